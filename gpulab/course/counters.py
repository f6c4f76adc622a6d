"""Lesson 04's PyTorch counters: the lines a student pastes into their own training code, and
what gpulab shows for each of them where there is no GPU.

On a GPU the lesson runs plain PyTorch (``cuda_counters`` is the same lines as a function):
``torch.cuda.reset_peak_memory_stats()``, a training step, then ``memory_allocated()``,
``max_memory_allocated()``, ``memory_reserved()``, ``max_memory_reserved()``,
``mem_get_info()``, and a snapshot (``torch.cuda.memory._record_memory_history`` /
``_dump_snapshot``). Without one, ``read_counters`` runs the same training function under
gpulab's tracker (fake tensors following CUDA's kernels by default, or the cpu engine), replays
its timeline through the simulated caching allocator, and maps each counter to its stand-in:

* ``memory_allocated()``: ``allocated_bytes.all.current``, every live tensor's block (sizes
  rounded up to 512 B) -> the simulator's allocated bytes at the end;
* ``max_memory_allocated()``: ``allocated_bytes.all.peak`` since the last reset -> the
  tracker's peak after the allocator's rounding (the simulator's allocated peak);
* ``memory_reserved()`` / ``max_memory_reserved()``: ``reserved_bytes.all.current`` / ``.peak``,
  the segments the allocator got with cudaMalloc, cached free blocks included -> the simulator's
  reserved bytes;
* ``mem_get_info()``: ``cudaMemGetInfo`` for the whole device: (free, total), every process and
  the CUDA context included -> total = the card's total as CUDA reports it, free = total -
  simulated reserved - an assumed CUDA context (and no other process, which is an assumption too).

What is checked against PyTorch's source (torch/cuda/memory.py, c10/cuda/CUDACachingAllocator.cpp):
``reset_peak_memory_stats`` sets the *peak* of every ``memory_stats()`` statistic to its current
value (allocated, reserved, active, requested bytes, segment and block counts); it does not free
anything, and the counters ``num_alloc_retries``, ``num_ooms``, ``num_device_alloc`` are reset only
by ``reset_accumulated_memory_stats``. ``memory_allocated`` / ``max_memory_allocated`` /
``memory_reserved`` read ``memory_stats()`` keys; ``mem_get_info`` calls ``cudaMemGetInfo``.
The tracker's unrounded peak has a PyTorch counter too: ``memory_stats()["requested_bytes.all.peak"]``
(the ``requested_bytes`` statistic: bytes asked for before rounding).
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from gpulab.measure.engines import LABEL_SIMULATED, label_cuda, release_cuda_memory, run
from gpulab.predict.cards import parse_gpu
from gpulab.predict.context import context_assumption
from gpulab.predict.replay import replay_events
from gpulab.units import format_bytes
from gpulab.views import html_table

__all__ = ["COUNTERS", "REQUESTED_PEAK", "CounterReading", "CounterRow", "cuda_counters", "read_counters", "simulated_counters",
           "snapshot_segments"]

# (counter as a student calls it, what PyTorch returns, gpulab's stand-in without a GPU)
COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("torch.cuda.memory_allocated()",
     "bytes in blocks of live tensors now (allocated_bytes.all.current; each block rounded up to 512 B)",
     "the simulator's allocated bytes at the end of the run"),
    ("torch.cuda.max_memory_allocated()",
     "the highest memory_allocated() since the last reset_peak_memory_stats() (allocated_bytes.all.peak)",
     "the tracker's peak after the allocator's rounding (the simulator's allocated peak)"),
    ("torch.cuda.memory_reserved()",
     "bytes in segments the caching allocator holds from cudaMalloc now, free cached blocks included "
     "(reserved_bytes.all.current)",
     "the simulator's reserved bytes at the end of the run"),
    ("torch.cuda.max_memory_reserved()",
     "the highest memory_reserved() since the last reset (reserved_bytes.all.peak)",
     "the simulator's reserved peak"),
    ("torch.cuda.mem_get_info()[0]  (free)",
     "cudaMemGetInfo's free bytes on the whole device: other processes and the CUDA context are not free",
     "card total - simulated reserved - assumed CUDA context (no other process)"),
    ("torch.cuda.mem_get_info()[1]  (total)",
     "cudaMemGetInfo's total bytes of the device (a little under the advertised size)",
     "the card's total as CUDA reports it, where known; else its advertised size"),
)
# The unrounded peak: PyTorch counts the bytes client code asked for, before the 512-byte rounding,
# as the ``requested_bytes`` statistic (``DeviceStats::requested_bytes`` in c10/core/CachingDeviceAllocator.h).
REQUESTED_PEAK = ('torch.cuda.memory_stats()["requested_bytes.all.peak"]',
                  "the peak of the bytes client code asked for, before the allocator rounds each block up "
                  "(requested_bytes; workspaces included)")
_KEYS = ("allocated", "max_allocated", "reserved", "max_reserved", "free", "total")


@dataclass(frozen=True)
class CounterRow:
    counter: str
    meaning: str
    stand_in: str
    simulated: int
    measured: int | None = None


@dataclass
class CounterReading:
    """One training function's counters: gpulab's stand-ins (always) and PyTorch's own (when a
    GPU measured them). ``simulated_label`` says what the stand-ins rest on."""
    rows: list[CounterRow]
    simulated_label: str
    tracked_label: str
    tracker_peak_unrounded: int
    card: str
    context_bytes: int
    context_label: str
    measured_label: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def simulated(self, key: str) -> int:
        return self.rows[_KEYS.index(key)].simulated

    def measured(self, key: str) -> int | None:
        return self.rows[_KEYS.index(key)].measured

    def _header(self) -> list[str]:
        head = ["PyTorch counter", "what it returns", f"gpulab without a GPU: {self.simulated_label}", "from"]
        return head + ([self.measured_label] if self.measured_label else [])

    def table_rows(self) -> list[list[str]]:
        out = []
        for r in self.rows:
            row = [r.counter, r.meaning, format_bytes(r.simulated), r.stand_in]
            if self.measured_label:
                row.append("—" if r.measured is None else format_bytes(r.measured))
            out.append(row)
        requested = None if self.measured_label is None else self.extra.get("measured_max_requested")
        out.append([REQUESTED_PEAK[0], REQUESTED_PEAK[1],
                     format_bytes(self.tracker_peak_unrounded), f"the tracker's peak, unrounded ({self.tracked_label})"]
                    + (["—" if requested is None else format_bytes(requested)] if self.measured_label else []))
        return out

    def caption(self) -> str:
        return (f"the same training function: stand-ins replay the tracker's timeline ({self.tracked_label}) "
                f"through the {LABEL_SIMULATED} on {self.card}; CUDA context: {self.context_label}")

    def _repr_html_(self) -> str:
        return html_table(self._header(), self.table_rows(), self.caption())

    def __repr__(self) -> str:
        lines = [self.caption()]
        for row in self.table_rows():
            lines.append(f"{row[0]:<40} {row[2]:>10}" + (f"   measured {row[4]:>10}" if self.measured_label else ""))
        return "\n".join(lines)


def simulated_counters(events, card: str = "T4", context_bytes: int | None = None) -> dict[str, int]:
    """The counters' stand-ins from a tracker timeline (``events``: kind/sid/nbytes) replayed
    through the simulated allocator; ``context_bytes``: the CUDA context (default: the assumption
    for lazy module loading)."""
    sim = replay_events(list(events))
    gpu = parse_gpu(card)
    ctx = context_assumption("lazy").nbytes if context_bytes is None else int(context_bytes)
    total = gpu.reported_total_bytes
    reserved = sim.stats["reserved_bytes.all.current"]
    return {"allocated": sim.stats["allocated_bytes.all.current"], "max_allocated": sim.stats["allocated_bytes.all.peak"],
            "reserved": reserved, "max_reserved": sim.stats["reserved_bytes.all.peak"],
            "free": total - reserved - ctx, "total": total}


def read_counters(train: Callable[[torch.device], Any], *, engine: str = "fake", fake_target: str = "cuda",
                  card: str = "T4", context_bytes: int | None = None,
                  measured: dict[str, int] | None = None, measured_on: str | None = None) -> CounterReading:
    """Run ``train(device)`` under gpulab's tracker (``engine``: "fake" or "cpu"), keep what it
    returns alive to the end (as a student's code keeps its model and optimizer), and give each
    PyTorch counter's stand-in. ``measured``: PyTorch's own counters of the same function on a GPU
    (keys as ``cuda_counters`` returns them), shown beside the stand-ins, labelled with the GPU."""
    if engine not in ("fake", "cpu"):
        raise ValueError(f"read_counters runs the tracker on the 'fake' or 'cpu' engine, not {engine!r}; "
                         "on a GPU, cuda_counters() reads PyTorch's own counters")
    m = run(lambda ctx: train(ctx.device), engine, fake_target=fake_target)
    assumed = context_assumption("lazy")
    ctx = assumed.nbytes if context_bytes is None else int(context_bytes)
    figures = simulated_counters(m.tracking.events, card, ctx)
    unrounded = m.tracking.peak_bytes
    if m.tracking.rounded:
        unrounded = type(m.tracking).build(m.tracking.records, m.tracking.events, m.tracking.device, False).peak_bytes
    rows = [CounterRow(name, meaning, stand_in, figures[k], None if measured is None else measured.get(k))
            for (name, meaning, stand_in), k in zip(COUNTERS, _KEYS)]
    return CounterReading(rows, f"{LABEL_SIMULATED} + assumed context", m.label, unrounded, parse_gpu(card).name,
                          ctx, assumed.label if context_bytes is None else f"given: {format_bytes(ctx)}",
                          label_cuda(measured_on) if measured is not None and measured_on else
                          ("measured (cuda)" if measured is not None else None),
                          {"final_by_category": dict(m.tracking.final_by_category),
                           "peak_by_category": dict(m.tracking.peak_by_category),
                           "measured_max_requested": None if measured is None else measured.get("max_requested")})


def cuda_counters(train: Callable[[torch.device], Any], snapshot_path: str | None = None,
                  device: int = 0) -> dict[str, Any]:
    """The lesson's plain-PyTorch lines as a function (needs a CUDA GPU): free what earlier code
    left, reset the peaks, record the allocator's history, run ``train``, read the counters while
    what ``train`` returned is still alive, dump the snapshot to ``snapshot_path`` if given."""
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_counters needs a CUDA GPU; read_counters gives the stand-ins without one")
    dev = torch.device("cuda", device)
    release_cuda_memory(dev)
    torch.cuda.reset_peak_memory_stats(dev)            # every memory_stats() peak := its current value
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        kept = train(dev)
        torch.cuda.synchronize(dev)
        free, total = torch.cuda.mem_get_info(dev)      # cudaMemGetInfo: the whole device
        out = {"allocated": torch.cuda.memory_allocated(dev), "max_allocated": torch.cuda.max_memory_allocated(dev),
               "reserved": torch.cuda.memory_reserved(dev), "max_reserved": torch.cuda.max_memory_reserved(dev),
               "max_requested": torch.cuda.memory_stats(dev).get("requested_bytes.all.peak"),
               "free": int(free), "total": int(total), "allocated_before": before,
               "gpu": torch.cuda.get_device_name(dev)}
        if snapshot_path is not None:
            torch.cuda.memory._dump_snapshot(snapshot_path)   # open it at https://pytorch.org/memory_viz
        del kept
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return out


def snapshot_segments(path: str) -> list[dict[str, Any]]:
    """The segments of a snapshot file written by ``_dump_snapshot`` (a pickled dict)."""
    with open(path, "rb") as f:
        return list(pickle.load(f)["segments"])

