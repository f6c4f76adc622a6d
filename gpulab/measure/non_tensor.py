"""Allocations no tensor owns, told apart in the CUDA caching allocator's own trace.

The tracker sees every storage an op returns; the allocator also hands out memory that no tensor
owns: cuDNN's convolution workspace (allocated in ``at::native::run_conv_plan``), cuBLAS
workspaces, buffers inside one kernel.
On an NVIDIA H200 (torch 2.11, cuDNN 9.19) every such allocation in a training step of VGG16,
AlexNet, ResNet-18 and the lessons' CNN came from ``run_conv_plan`` (the C++ frames of the
snapshots in ``tests/data/h200/``), and they made the whole gap between the tensors' blocks and
``max_memory_allocated``.

``classify`` walks a trace (``torch.cuda.memory._snapshot()["device_traces"][i]``) next to the
tensor storages the tracker saw on that device, in the order it saw them (address, bytes): an
``alloc`` entry at a tracked storage's address, of its bytes, is that tensor's; any other
``alloc`` is not a tensor's. The trace records requested bytes: sums here round each one up to
512 B, as the allocator's blocks are (a large block left unsplit holds up to 1 MiB more). Pure: plain data in,
plain data out.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from gpulab.formulas import cuda_rounded_bytes as _rounded   # each request up to 512 B, as the allocator's blocks

__all__ = ["LABEL", "NonTensorAllocations", "classify", "trace_events"]

LABEL = ("allocations no tensor owns (cuDNN convolution workspaces, cuBLAS workspaces, buffers inside "
         "one kernel), from the allocator's own trace")


@dataclass
class NonTensorAllocations:
    """What the trace held beyond the tracked tensors. Bytes are requests rounded up to 512 B,
    counted from the trace's first entry."""
    count: int = 0                    # alloc entries no tracked tensor owns
    total_bytes: int = 0              # their bytes, summed over the run
    largest_bytes: int = 0
    trace_peak: int = 0               # the highest allocated bytes the trace reached
    at_peak: int = 0                  # non-tensor bytes live at that moment
    tensors_at_peak: int = 0          # tracked tensors' blocks live at that moment
    tensor_peak: int = 0              # the highest tracked tensors' blocks alone reached
    unmatched_tensors: int = 0        # tracked storages with no alloc entry (made before the trace)
    sites: dict[str, int] = field(default_factory=dict)   # C++ function -> count, when frames exist
    site_bytes: dict[str, int] = field(default_factory=dict)   # C++ function -> bytes, summed
    label: str = LABEL

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _site(entry: dict[str, Any]) -> str | None:
    """The first frame below the allocator (where the trace has C++ frames)."""
    for fr in entry.get("frames") or ():
        name = fr.get("name", "")
        if "c10::" in name or "CachingAllocator" in name or "DeviceCachingAllocator" in name:
            continue
        if name.startswith("at::") or "cudnn" in name.lower() or "cublas" in name.lower():
            return name.split("(")[0]
    return None


def classify(trace: Iterable[dict[str, Any]], tensors: Sequence[tuple[int, int]]) -> NonTensorAllocations:
    """``trace``: the allocator's entries for one device; ``tensors``: (address, bytes) of each
    storage the tracker saw on that device, in the order it saw them."""
    pending: dict[int, deque[int]] = defaultdict(deque)
    for addr, nbytes in tensors:
        pending[addr].append(_rounded(nbytes))
    out = NonTensorAllocations()
    live_other: dict[int, int] = {}
    live_tensor: dict[int, int] = {}
    allocated = tensors_now = other_now = 0
    sites: dict[str, int] = defaultdict(int)
    site_bytes: dict[str, int] = defaultdict(int)
    for e in trace:
        # the trace holds requested sizes (``orig_size``): the allocator's counters count blocks,
        # at least the request rounded up to 512 B (a large block left unsplit can hold more)
        action, addr, size = e.get("action"), e.get("addr"), _rounded(int(e.get("size", 0)))
        if action == "alloc":
            queue = pending.get(addr)
            if queue and queue[0] == size:
                queue.popleft()
                live_tensor[addr] = size
                tensors_now += size
            else:
                live_other[addr] = size
                other_now += size
                out.count += 1
                out.total_bytes += size
                out.largest_bytes = max(out.largest_bytes, size)
                site = _site(e)
                if site:
                    sites[site] += 1
                    site_bytes[site] += size
            allocated += size
            out.tensor_peak = max(out.tensor_peak, tensors_now)
            if allocated > out.trace_peak:
                out.trace_peak, out.at_peak, out.tensors_at_peak = allocated, other_now, tensors_now
        elif action == "free_requested":
            if addr in live_tensor:
                tensors_now -= live_tensor.pop(addr)
                allocated -= size
            elif addr in live_other:
                other_now -= live_other.pop(addr)
                allocated -= size
            else:                      # a block allocated before the trace began
                allocated -= size
    out.unmatched_tensors = sum(len(q) for q in pending.values())
    out.sites, out.site_bytes = dict(sites), dict(site_bytes)
    return out


def trace_events(trace: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trace's allocations and frees as storage events (``kind``, ``sid``, ``nbytes``, with the
    requested bytes) for ``CachingAllocator.replay``: what the simulator needs to replay the run
    as the GPU's allocator saw it, workspaces included. Frees of blocks from before the trace
    began have no allocation here and are left out."""
    live: dict[int, int] = {}
    out: list[dict[str, Any]] = []
    for e in trace:
        action, addr = e.get("action"), e.get("addr")
        if action == "alloc":
            sid = len(out)
            live[addr] = sid
            out.append({"kind": "alloc", "sid": sid, "nbytes": int(e.get("size", 0)), "device": "cuda"})
        elif action == "free_requested" and addr in live:
            out.append({"kind": "free", "sid": live.pop(addr), "nbytes": int(e.get("size", 0)), "device": "cuda"})
    return out
