"""Lesson 09's reference-article claims about the caching allocator, put to the test (the appendix,
lessons/15_appendix_reference_claims.ipynb, section 09): "nvidia-smi shows more than your
tensors", "empty_cache slows training down" and "PyTorch uses an extra ~400 MB beyond the
tensors". Each verdict is computed from the replayed training step, the cudaMalloc/cudaFree
counts and the device-level reading that ``gpulab.predict.replay`` returns."""
from __future__ import annotations

from typing import Any

from gpulab.course.claims import BREAKS, HOLDS, ClaimCheck, ClaimReport, Evidence
from gpulab.measure.engines import LABEL_SIMULATED
from gpulab.units import MB, format_bytes

__all__ = ["allocator_claims"]

# ref 003's "about 400 MB" beyond the tensors; a device reading within this share of it "holds"
CLAIMED_EXTRA = 400 * MB
EXTRA_TOLERANCE = 0.5


def allocator_claims(step: Any, cost: dict[str, dict[str, int]], beyond: dict[str, Any]) -> ClaimReport:
    """``step``: ``replay.workload("training step", ...)`` (tracked peak, simulated allocated and
    reserved peaks); ``cost``: ``replay.empty_cache_cost(...)``; ``beyond``:
    ``replay.beyond_allocator_bytes()`` (``bytes`` is None where no GPU can be read)."""
    tensors, allocated, reserved = step.tracked_peak, step.peak_allocated, step.peak_reserved
    ordered = tensors <= allocated <= reserved
    more = ordered and reserved > tensors
    smi = ClaimCheck(
        "nvidia-smi shows more than your tensors", "ref 003",
        HOLDS if more else BREAKS,
        (f"Each layer adds to the one below: the cache adds {format_bytes(reserved - allocated)} over the "
         f"allocated peak, and nvidia-smi adds the CUDA context on top, which only a GPU can measure. "
         f"Workspaces are inside allocated and reserved, not in that last line.") if more else
        "The replay's layers are not in the order tensors ≤ allocated ≤ reserved, or reserved adds nothing here.",
        [Evidence("live tensors, peak (512-rounded)", format_bytes(tensors), step.source_label),
         Evidence("allocated_bytes.all.peak", format_bytes(allocated), LABEL_SIMULATED),
         Evidence("reserved_bytes.all.peak", format_bytes(reserved), LABEL_SIMULATED)])

    off, on = cost["without"], cost["with empty_cache"]
    slower = (on["cudaMalloc calls"] > off["cudaMalloc calls"]
              and on["peak reserved"] >= off["peak reserved"])
    empty = ClaimCheck(
        "empty_cache() slows training down", "ref 003",
        "holds as a direction (counts, not times)" if slower else BREAKS,
        (f"With empty_cache() after every step the allocator calls cudaMalloc {on['cudaMalloc calls']} times "
         f"instead of {off['cudaMalloc calls']}, and the peak reserved memory is no lower. How much time that "
         "costs depends on the GPU and the step's length: time it on a GPU.") if slower else
        "empty_cache() after every step did not add cudaMalloc calls, or it lowered the peak reserved memory.",
        [Evidence(f"{k}: cudaMalloc / cudaFree calls", f"{v['cudaMalloc calls']} / {v['cudaFree calls']}",
                  LABEL_SIMULATED) for k, v in cost.items()]
        + [Evidence(f"{k}: peak reserved", format_bytes(v["peak reserved"]), LABEL_SIMULATED)
           for k, v in cost.items()])

    extra = beyond.get("bytes")
    if extra is None:
        verdict = "cannot be tested here"
        why = ("Memory outside the allocator (the CUDA context, other processes) needs a GPU and NVML; the "
               "articles' figure was nvidia-smi's count on the author's GPU and CUDA version, not a constant.")
        value = "not measurable here"
    else:
        close = abs(extra - CLAIMED_EXTRA) <= EXTRA_TOLERANCE * CLAIMED_EXTRA
        verdict = HOLDS if close else BREAKS
        why = (f"On this GPU nvidia-smi counts {format_bytes(extra)} beyond what the allocator reserved "
               f"({'within' if close else 'not within'} {EXTRA_TOLERANCE:.0%} of 400 MB): it depends on the GPU, "
               "the driver, the CUDA version and lazy loading.")
        value = format_bytes(extra)
    context = ClaimCheck(
        "PyTorch uses an extra ~400 MB beyond the tensors", "ref 003", verdict, why,
        [Evidence("claimed extra", "400 MB", "published by ref 003"),
         Evidence("nvidia-smi extra, outside the allocator", value, beyond["label"])])
    return ClaimReport("Lesson 09: the caching allocator, the articles' claims", [smi, empty, context])


def recorded_gap(real_step: Any) -> str:
    """Lesson 09: why the recorded GPU's reserved line ends above the simulator's, from the record
    itself (Markdown; "" when no record matched). The record carries the run's tracked tensor peak,
    the simulator's replay of those tensors, and the GPU allocator's own peaks above the run's start:
    the tensors agree, and what the allocator held beyond them no tensor owns (a kernel's workspace:
    cuDNN's convolutions and cuBLAS take theirs from the same caching allocator)."""
    if not real_step:
        return ""
    r = real_step.result
    a, tl = r["allocator"], r.get("timeline", {})
    tensors, sim_alloc, sim_res = r["peak_bytes"], r["simulated_peak_allocated"], r["simulated_peak_reserved"]
    gpu_alloc, gpu_res = a["peak_allocated_delta"], a["peak_reserved_delta"]
    res = tl.get("reserved") or [0]
    steps = [(res[i] - res[i - 1], i) for i in range(1, len(res))]
    jump, at = max(steps) if steps else (0, 0)
    same = "equals" if sim_alloc == tensors else "differs from"
    return (f"Why the lines end apart ({real_step.label}): the simulator's reserved peak is {format_bytes(sim_res)}, "
            f"the GPU's {format_bytes(gpu_res)} above the run's start. The tensors are the same: the run's tracked "
            f"peak, {format_bytes(tensors)}, {same} the simulator's allocated peak. But the GPU's allocator held more "
            f"than tensors: its allocated peak above the start was {format_bytes(gpu_alloc)}, "
            f"{format_bytes(gpu_alloc - tensors)} that no tensor owns; its reserved memory's largest single rise "
            f"was {format_bytes(jump)} (op {at} of {len(res)}, read after each op). Allocations no tensor owns are "
            f"kernels' workspaces (cuDNN's convolutions and cuBLAS take theirs from the same allocator, next "
            f"section); the simulator replays tensors only ({LABEL_SIMULATED}), so a segment opened for one is not "
            f"in its line.")
