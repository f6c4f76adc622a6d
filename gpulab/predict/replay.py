"""Lesson 09's experiments: tracked tensor timelines replayed through the caching-allocator
simulator (``gpulab.allocator.simulator``), and on a GPU the real allocator next to it.

* ``replay_events(events, ...)``: replay tracker events (kind/sid/nbytes) through a
  ``CachingAllocator``, optionally calling ``empty_cache()`` after each training step, and keep
  allocated/reserved after every event, the final segment map and the stats.
* ``workload(name, ...)``: the lesson's three workloads as one ``AllocatorRun``: a tracked
  training step, a fragmentation scenario, growing batches.
* ``real_allocator_stats()``: the real ``torch.cuda.memory_stats()`` keys we compare with, and
  ``beyond_allocator_bytes()``: NVML used - ``memory_reserved`` (the CUDA context, other
  processes, memory not allocated through PyTorch), only on CUDA. The cuBLAS and cuDNN workspaces
  are *not* in it: PyTorch allocates them through the caching allocator (``getNewWorkspace()`` in
  ``aten/src/ATen/cuda/CublasHandlePool.cpp``, torch 2.11 to 2.14), so they count in
  ``memory_allocated`` and ``memory_reserved``, and ``empty_cache()`` does not free them. From torch
  2.15 on, a cuBLAS workspace is kept so only with ``TORCH_CUBLAS_WORKSPACE_CACHE=1``.

Every number from the simulator is labelled ``LABEL_SIMULATED`` ("simulated allocator"); the
tracked timelines it replays carry their own engine label (cpu/fake/cuda).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

from gpulab.allocator.simulator import MiB, CachingAllocator, Segment
from gpulab.measure.engines import LABEL_SIMULATED, run
from gpulab.models.workload import image_workload
from gpulab.training.loop import LoopRecipe, train_experiment
from gpulab.models.registry import ModelSpec, resolve_model

__all__ = [
    "AllocatorRun", "REAL_STATS_LABEL", "STATS_KEYS", "WORKLOADS", "beyond_allocator_bytes",
    "empty_cache_cost", "fragmentation_events", "growing_batches", "real_allocator_stats",
    "replay_events", "step_boundaries", "tracked_events", "tracked_steps", "workload"
]

WORKLOADS = ("training step", "fragmentation", "growing batches")

# The stats keys a lesson compares with torch.cuda.memory_stats() (same names there).
STATS_KEYS = (
    "allocated_bytes.all.current", "allocated_bytes.all.peak",
    "reserved_bytes.all.current", "reserved_bytes.all.peak",
    "active_bytes.all.peak", "requested_bytes.all.peak",
    "inactive_split_bytes.all.current",
    "segment.all.current", "segment.all.peak",
    "num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms",
)


@dataclass
class AllocatorRun:
    """A timeline replayed through the simulated allocator (label: simulated allocator).

    ``allocated``/``reserved``: bytes after each event; ``step_ends``: event indices after which
    a training step ended (where ``empty_cache`` ran when asked); ``segments``: the segment map
    at the moment the allocated memory peaked (``final_segments``: at the end)."""

    workload: str
    allocated: list[int]
    reserved: list[int]
    stats: dict[str, int]
    segments: list[Segment]
    final_segments: list[Segment]
    expandable_segments: bool
    empty_cache_every_step: bool
    step_ends: list[int] = field(default_factory=list)
    source_label: str = ""          # where the replayed timeline came from
    label: str = LABEL_SIMULATED
    description: str = ""
    tracked_peak: int | None = None  # the tracker's 512-rounded peak, when replaying a tracked run
    real: dict[str, int] | None = None  # the real allocator's stats (cuda engine only)
    settings: dict[str, Any] = field(default_factory=dict)  # workload()'s: model, batch, steps (to find records)

    @property
    def peak_allocated(self) -> int:
        return self.stats["allocated_bytes.all.peak"]

    @property
    def peak_reserved(self) -> int:
        return self.stats["reserved_bytes.all.peak"]

    @property
    def num_device_alloc(self) -> int:
        """``num_device_alloc``: segment allocations (one ``cudaMalloc`` each) with the default
        allocator; with ``expandable_segments``, page mappings (``cuMemCreate`` + ``cuMemMap``)."""
        return self.stats["num_device_alloc"]

    def stats_rows(self) -> list[list[str]]:
        from gpulab.units import format_bytes
        rows = []
        for k in STATS_KEYS:
            v = self.stats.get(k, 0)
            sim = format_bytes(v) if "bytes" in k else f"{v:,}"
            row = [k, sim]
            if self.real is not None:
                rv = self.real.get(k, 0)
                row.append(format_bytes(rv) if "bytes" in k else f"{rv:,}")
            rows.append(row)
        return rows

    def _repr_html_(self) -> str:
        from gpulab.views import html_table
        header = ["memory_stats() key", LABEL_SIMULATED] + ([self.real_label] if self.real else [])
        cap = (f"{self.workload}: {self.description} Replayed timeline: {self.source_label}. "
               f"expandable_segments={self.expandable_segments}, "
               f"empty_cache after each step={self.empty_cache_every_step}")
        return html_table(header, self.stats_rows(), cap)

    real_label: str = "real allocator"

    def __repr__(self) -> str:
        return (f"AllocatorRun({self.workload!r}, peak_allocated={self.peak_allocated:,} B, "
                f"peak_reserved={self.peak_reserved:,} B, num_device_alloc={self.num_device_alloc}; "
                f"{self.label})")


def step_boundaries(events: Sequence[Any]) -> list[int]:
    """Indices of events after which one training step ended: the last event of each run of
    'optimizer' phase events (the tracker's phase labels)."""
    ends = []
    for i, e in enumerate(events):
        if getattr(e, "phase", None) == "optimizer":
            nxt = events[i + 1] if i + 1 < len(events) else None
            if nxt is None or getattr(nxt, "phase", None) != "optimizer":
                ends.append(i)
    return ends


def replay_events(events: Sequence[Any], *, expandable_segments: bool = False,
                  empty_cache_at: Iterable[int] = (), workload: str = "events",
                  source_label: str = "", description: str = "",
                  **allocator_kwargs: Any) -> AllocatorRun:
    """Replay ``events`` (objects or dicts with kind/sid/nbytes) through a fresh simulated
    allocator, calling ``empty_cache()`` right after each event index in ``empty_cache_at``.
    NB: a 'resize' frees the old block before allocating the new one (as ``replay`` does)."""
    alloc = CachingAllocator(expandable_segments=expandable_segments, **allocator_kwargs)
    live: dict[Any, Any] = {}
    flush = set(empty_cache_at)
    a_series: list[int] = []
    r_series: list[int] = []
    peak_alloc, at_peak = -1, alloc.segment_map()
    for i, ev in enumerate(events):
        get = ev.get if isinstance(ev, dict) else (lambda k, e=ev: getattr(e, k))
        kind, sid, nbytes = get("kind"), get("sid"), int(get("nbytes") or 0)
        if kind == "alloc":
            if sid in live:
                alloc.free(live.pop(sid))
            live[sid] = alloc.malloc(nbytes)
        elif kind == "free":
            if sid in live:
                alloc.free(live.pop(sid))
        elif kind == "resize":
            if sid in live:
                alloc.free(live.pop(sid))
            live[sid] = alloc.malloc(nbytes)
        else:
            raise ValueError(f"event {i}: unknown kind {kind!r}")
        if alloc.memory_allocated() > peak_alloc:
            peak_alloc, at_peak = alloc.memory_allocated(), alloc.segment_map()
        if i in flush:
            alloc.empty_cache()
        a_series.append(alloc.memory_allocated())
        r_series.append(alloc.memory_reserved())
    return AllocatorRun(workload, a_series, r_series, alloc.stats(), at_peak, alloc.segment_map(),
                        expandable_segments, bool(flush), sorted(flush), source_label,
                        description=description)


# ---- workloads ------------------------------------------------------------------------------------

def steps_experiment(spec: ModelSpec, batches: Sequence[int], optimizer: str = "sgd"):
    """One model, one training step per batch size in ``batches`` (all under one tracker): each
    batch made fresh and dropped right after backward, ``zero_grad`` right after ``step()``."""
    return train_experiment(image_workload(spec), list(batches), None,
                            LoopRecipe(optimizer, zero_grad="after step", fresh_batch=True))


def tracked_steps(model: str = "cnn", batches: Sequence[int] = (32,), engine: str = "auto"):
    """Run training steps under the tracker; returns the ``Measurement``."""
    return run(steps_experiment(resolve_model(model), list(batches)), engine)


def tracked_events(measurement) -> list:
    """The tracker's events on the measurement's device (``TrackingResult.events`` is already
    filtered to one device: tensors on other devices never reach the simulated GPU)."""
    return list(measurement.tracking.events)


def fragmentation_events(n: int = 8, block_mib: int = 6, big_mib: int = 12) -> list[dict]:
    """``n`` tensors of ``block_mib`` MiB each, every other one freed, then ``n // 2`` tensors of
    ``big_mib`` MiB that fit in none of the holes: half the reserved memory is free but unusable
    for them, so new segments are needed. Synthetic: sizes only, no tensors are made."""
    ev: list[dict] = []
    for i in range(n):
        ev.append({"kind": "alloc", "sid": i, "nbytes": block_mib * MiB, "phase": "forward"})
    for i in range(0, n, 2):
        ev.append({"kind": "free", "sid": i, "nbytes": block_mib * MiB, "phase": "forward"})
    for j in range(n // 2):
        ev.append({"kind": "alloc", "sid": n + j, "nbytes": big_mib * MiB, "phase": "forward"})
    return ev


def growing_batches(batch: int, n: int = 4) -> list[int]:
    """``n`` batch sizes growing linearly up to ``batch`` (e.g. 8, 16, 24, 32)."""
    return sorted({max(1, round(batch * (i + 1) / n)) for i in range(n)})


def workload(name: str = "training step", model: str = "cnn", batch: int = 32, *,
             expandable_segments: bool = False, empty_cache: bool = False, steps: int = 2,
             engine: str = "auto") -> AllocatorRun:
    """One of ``WORKLOADS`` replayed through the simulated allocator.

    * "training step": ``steps`` tracked training steps of ``model`` at ``batch``;
    * "fragmentation": the synthetic scenario of ``fragmentation_events`` (model, batch unused);
    * "growing batches": one tracked step per batch size in ``growing_batches(batch)``.
    ``empty_cache``: call ``empty_cache()`` after every training step (after the last
    optimizer event of each step; in the fragmentation scenario, after the frees)."""
    key = str(name).lower()
    if key not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; valid: {', '.join(WORKLOADS)}")
    if key == "fragmentation":
        ev = fragmentation_events()
        n = 8
        flush = [n + n // 2 - 1] if empty_cache else []
        out = replay_events(ev, expandable_segments=expandable_segments, empty_cache_at=flush,
                            workload=key, source_label="synthetic sizes (no tensors)",
                            description="8 x 6 MiB, every other freed, then 4 x 12 MiB.")
        out.settings = {"n": n, "block_mib": 6, "big_mib": 12}
        return out
    batches = [batch] * steps if key == "training step" else growing_batches(batch)
    m = tracked_steps(model, batches, engine)
    ev = tracked_events(m)
    flush = step_boundaries(ev) if empty_cache else []
    desc = (f"{model}, batch {batch}, {steps} step(s)." if key == "training step"
            else f"{model}, batches {', '.join(map(str, batches))}.")
    out = replay_events(ev, expandable_segments=expandable_segments, empty_cache_at=flush,
                        workload=key, source_label=m.label, description=desc)
    out.settings = {"model": model, "batch": batch, "steps": steps} if key == "training step" \
        else {"model": model, "batch": batch}
    out.tracked_peak = m.tracking.peak_bytes if m.tracking.rounded else \
        type(m.tracking).build(m.tracking.records, m.tracking.events, m.tracking.device, True).peak_bytes
    if m.engine == "cuda" and m.allocator is not None:
        out.real = real_allocator_stats()
        out.real_label = REAL_STATS_LABEL.format(label=m.label)
    return out


def empty_cache_cost(model: str = "cnn", batch: int = 32, steps: int = 4,
                     engine: str = "auto") -> dict[str, dict[str, int]]:
    """The claim "empty_cache slows training", as a count: simulated cudaMalloc/cudaFree calls
    (segment allocations and frees; the default allocator, so ``num_device_alloc`` counts
    exactly those) over ``steps`` steps without and with ``empty_cache()`` after every step. NB:
    a proxy for time, not a time: each cudaMalloc/cudaFree costs microseconds to milliseconds
    and may synchronize the device; the simulator counts them, it does not time them."""
    m = tracked_steps(model, [batch] * steps, engine)
    ev = tracked_events(m)
    out = {}
    for flag in (False, True):
        r = replay_events(ev, empty_cache_at=step_boundaries(ev) if flag else [])
        out["with empty_cache" if flag else "without"] = {
            "cudaMalloc calls": r.stats["num_device_alloc"],
            "cudaFree calls": r.stats["num_device_free"],
            "peak reserved": r.peak_reserved,
            "steps": steps,
        }
    return out


# ---- the real allocator (CUDA only) ----------------------------------------------------------------

# memory_stats() is the process's: its counters (num_*, segment allocs) count since the process
# started, its current values include what the process held before the run; only the peaks were
# reset when the cuda engine started the run. Its column says so.
REAL_STATS_LABEL = ("{label}: counters and current values since the process started, "
                    "peaks since this run began")


def real_allocator_stats(device: int = 0) -> dict[str, int] | None:
    """``torch.cuda.memory_stats()`` restricted to ``STATS_KEYS``; None without CUDA. These are
    the process's numbers (label them with ``REAL_STATS_LABEL``), not one run's."""
    if not torch.cuda.is_available():
        return None
    s = torch.cuda.memory_stats(device)
    return {k: int(s.get(k, 0)) for k in STATS_KEYS}


def beyond_allocator_bytes(device: int = 0) -> dict[str, Any]:
    """NVML's used memory minus the allocator's reserved memory: the CUDA context, other
    processes and memory not allocated through PyTorch (the cuBLAS/cuDNN workspaces are inside
    reserved: see the module docstring). On CPU: not measurable, and said so."""
    if not torch.cuda.is_available():
        return {"bytes": None, "label": "not measurable here (no CUDA GPU): needs NVML and a CUDA "
                "context; it depends on the GPU, the driver and CUDA lazy loading"}
    from gpulab.measure.gpu import gpu_name, nvml_used_bytes
    used = nvml_used_bytes(device)
    reserved = torch.cuda.memory_reserved(device)
    if used is None:
        return {"bytes": None, "label": "NVML not available: cannot read device-wide used memory"}
    return {"bytes": int(used - reserved), "nvml_used": int(used), "reserved": int(reserved),
            "label": f"measured on {gpu_name(device)} (cuda): NVML used - memory_reserved "
                     "(includes other processes on this GPU)"}
