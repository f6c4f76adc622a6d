"""Lesson 06's in-place measuring core: what autograd saves (``saved_tensors``, read from
``grad_fn._saved_*``), and a conv-ReLU (or conv-BN-ReLU) stack run with ``ReLU(inplace=False)``
and ``ReLU(inplace=True)`` on an engine, tracked. It returns data (``InplaceRun`` per setting);
``gpulab.course.inplace`` adds the formulas, the claims and the views, and ``gpulab record``
stores ``inplace_as_dict`` for a real GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpulab.measure.engines import Measurement, RunContext, run
from gpulab.record.kinds import head, record_kind

__all__ = [
    "BLOCKS", "InplaceRun", "MODES", "SavedTensor", "conv_stack", "inplace_as_dict",
    "record_inplace", "run_inplace_pair", "saved_activation_bytes", "saved_tensors", "storage_key"
]

BLOCKS = ("conv-relu", "conv-bn-relu")
MODES = ("train step", "no_grad forward")


# --- what autograd saves ------------------------------------------------------------------------

@dataclass(frozen=True)
class SavedTensor:
    """One storage that one or more backward nodes keep for backward."""
    saved_by: tuple[str, ...]  # "ReluBackward0._saved_result", ... every node that keeps it
    shape: tuple[int, ...]     # shape of the first tensor seen on it
    dtype: str
    nbytes: int                # bytes of the whole storage
    by_reference: bool         # a parameter, buffer or input that exists anyway: no new memory
    key: int                   # storage identity (two views of one storage share it)

    @property
    def node(self) -> str:
        return self.saved_by[0].split(".")[0]


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def saved_tensors(output: torch.Tensor, params: Any = ()) -> list[SavedTensor]:
    """Every tensor the autograd graph behind ``output`` keeps for backward, one row per
    storage, naming every node that keeps it. ``params``: parameters, buffers and inputs,
    marked ``by_reference`` (they exist anyway; saving them costs nothing extra).

    Reads ``grad_fn._saved_<name>`` for each node (the attributes autograd generates from
    tools/autograd/derivatives.yaml). Call it after the forward and before ``backward()``:
    backward frees what was saved."""
    if output.grad_fn is None:
        return []
    param_keys = {storage_key(p) for p in params}
    rows: dict[int, SavedTensor] = {}
    seen, stack = set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for attr in sorted(a for a in dir(node) if a.startswith("_saved_")):
            try:
                value = getattr(node, attr)
            except RuntimeError:  # freed already, or modified in place
                continue
            for t in (value if isinstance(value, (tuple, list)) else (value,)):
                if not isinstance(t, torch.Tensor):
                    continue
                key = storage_key(t)
                who = f"{node.name()}.{attr}"
                if key in rows:
                    old = rows[key]
                    rows[key] = SavedTensor(old.saved_by + (who,), old.shape, old.dtype, old.nbytes,
                                            old.by_reference, key)
                else:
                    rows[key] = SavedTensor((who,), tuple(t.shape), str(t.dtype).removeprefix("torch."),
                                            t.untyped_storage().nbytes(), key in param_keys, key)
        stack.extend(fn for fn, _ in node.next_functions)
    return list(rows.values())


def saved_activation_bytes(rows: list[SavedTensor]) -> int:
    """Bytes of the saved storages that are not parameters, buffers or inputs."""
    return sum(r.nbytes for r in rows if not r.by_reference)


def conv_stack(depth: int = 4, channels: int = 16, inplace: bool = False, block: str = "conv-relu",
               in_channels: int = 3) -> nn.Sequential:
    """``depth`` blocks of 3x3 conv (padding 1, same size) [+ BatchNorm] + ReLU."""
    if block not in BLOCKS:
        raise ValueError(f"unknown block {block!r}; valid blocks: {', '.join(BLOCKS)}")
    layers: list[nn.Module] = []
    c = in_channels
    for _ in range(depth):
        layers.append(nn.Conv2d(c, channels, 3, padding=1))
        if block == "conv-bn-relu":
            layers.append(nn.BatchNorm2d(channels))
        layers.append(nn.ReLU(inplace=inplace))
        c = channels
    return nn.Sequential(*layers)



def _stack_experiment(block: str, depth: int, channels: int, batch: int, image_size: int,
                      mode: str, inplace: bool):
    def experiment(ctx: RunContext) -> dict[str, Any]:
        with ctx.phase("setup"):
            torch.manual_seed(0)
            with torch.device(ctx.device):
                net = conv_stack(depth, channels, inplace, block)
            ctx.tracker.register(net)
            x = ctx.label(torch.randn(batch, 3, image_size, image_size, device=ctx.device))
        if mode == "no_grad forward":
            with torch.no_grad(), ctx.phase("forward"):
                out = net(x)
            del out
            return {"saved": None}
        with ctx.phase("forward"):
            out = net(x)
            loss = out.sum()
        saved = saved_tensors(loss, list(net.parameters()) + list(net.buffers()) + [x])
        with ctx.phase("backward"):
            loss.backward()
        del loss, out
        grads = None
        if ctx.engine != "fake":
            grads = [p.grad.detach().to("cpu", copy=True) for p in net.parameters()]
        return {"saved": saved, "grads": grads}
    return experiment


def _phase_peak(m: Measurement, phase: str) -> int:
    return m.tracking.by_phase_peak().get(phase, 0) if m.tracking else 0


def _allocated(m: Measurement) -> tuple[int, int]:
    recs = [r for r in m.tracking.records.values() if not r.preexisting and r.phase in ("forward", "backward")]
    return sum(r.nbytes for r in recs), len(recs)


@dataclass
class InplaceRun:
    inplace: bool
    measurement: Measurement
    forward_peak: int          # highest live total while the forward ran
    allocated_bytes: int       # every storage created during forward and backward, summed
    allocations: int           # how many storages that was
    saved: list[SavedTensor] | None  # None for no_grad runs
    grads: list[torch.Tensor] | None = None  # parameter gradients (real engines, train step)

    @property
    def peak_bytes(self) -> int:
        return self.measurement.peak_bytes

    @property
    def saved_bytes(self) -> int | None:
        return None if self.saved is None else saved_activation_bytes(self.saved)


def run_inplace_pair(block: str, depth: int, channels: int, batch: int, image_size: int, mode: str,
                     engine: str, **run_kwargs: Any) -> dict[bool, InplaceRun]:
    """The stack with ``ReLU(inplace=False)`` and with ``ReLU(inplace=True)`` on ``engine``
    (``run_kwargs`` go to ``engines.run``). Raises ``MemoryError`` when a run goes out of memory."""
    runs = {}
    for inplace in (False, True):
        m = run(_stack_experiment(block, depth, channels, batch, image_size, mode, inplace), engine, **run_kwargs)
        if m.oom:
            raise MemoryError(m.error)
        total, count = _allocated(m)
        v = m.value or {}
        runs[inplace] = InplaceRun(inplace, m, _phase_peak(m, "forward"), total, count, v.get("saved"),
                                   v.get("grads"))
    return runs


def inplace_as_dict(runs: dict[bool, InplaceRun]) -> dict[str, Any]:
    """Plain JSON-able data of both runs (what ``gpulab record`` stores), keyed "inplace=False" /
    "inplace=True": peaks, the forward peak, the allocation traffic, saved bytes, the allocator's
    counters on CUDA."""
    return {f"inplace={k}": {"peak_bytes": r.peak_bytes, "forward_peak": r.forward_peak,
                             "allocated_bytes": r.allocated_bytes, "allocations": r.allocations,
                             "saved_bytes": r.saved_bytes, "peak_by_category": dict(r.measurement.peak_by_category),
                             "allocator": dict(r.measurement.allocator or {})}
            for k, r in runs.items()}


@record_kind("inplace")
def record_inplace(p: dict[str, Any]) -> dict[str, Any]:
    """Lesson 06's in-place panel default on the GPU."""
    runs = run_inplace_pair(engine="cuda", **p)
    return {**head(runs[False].measurement), **p, "runs": inplace_as_dict(runs)}
