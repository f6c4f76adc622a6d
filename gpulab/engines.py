"""Three ways to answer "how much memory does this take?": cuda, cpu and fake.

An *experiment* is a callable ``fn(ctx) -> value`` that builds what it needs on
``ctx.device`` and labels its inputs with ``ctx.label``. ``run(fn, engine=...)`` runs it
under a ``MemoryTracker`` and returns a ``Measurement``: the tracker's result, the engine
that answered and why, the honest label for the numbers, and on CUDA the caching
allocator's own counters and NVML's device-wide figure, with the gap between the
allocator and the live tensors reported as its own line.
"""
from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .formulas import cuda_rounded_bytes
from .tracking import Category, MemoryTracker, TrackingResult

ENGINES = ("cuda", "cpu", "fake")

# Where the automatic choice stops running real CPU compute and switches to fake tensors.
DEFAULT_MAX_CPU_BYTES = 2 * 1024**3        # predicted peak of live tensors
DEFAULT_MAX_CPU_FLOPS = 40 * 10**9         # ~ a second or two of fp32 work on a 2-core CPU

LABEL_FORMULA = "formula"
LABEL_CPU = "measured on CPU (live tensors)"
LABEL_FAKE = "fake tensors (no compute)"
LABEL_SIMULATED = "simulated allocator"


def label_cuda(gpu_name: str) -> str:
    return f"measured on {gpu_name} (cuda)"


def label_recorded(gpu_name: str, date: str, torch_version: str) -> str:
    return f"recorded on {gpu_name}, {date}, torch {torch_version}"


class EngineUnavailable(ValueError):
    """The engine asked for cannot run here; the message says which ones can."""


@dataclass(frozen=True)
class EngineChoice:
    name: str
    reason: str


def engine_status() -> dict[str, tuple[bool, str]]:
    """Each engine: (available, why)."""
    cuda = torch.cuda.is_available()
    return {
        "cuda": (cuda, "a CUDA GPU is visible" if cuda else "no CUDA GPU is visible to torch"),
        "cpu": (True, "always available: real compute on the CPU, live-tensor accounting"),
        "fake": (True, "always available: shapes and dtypes only, no data, no compute"),
    }


def choose_engine(requested: str = "auto", predicted_bytes: int | None = None,
                  predicted_flops: int | None = None,
                  max_cpu_bytes: int = DEFAULT_MAX_CPU_BYTES,
                  max_cpu_flops: int = DEFAULT_MAX_CPU_FLOPS) -> EngineChoice:
    """``auto``: cuda when a GPU is visible; else cpu, unless the predicted size or work is
    over the caller's limits, then fake. An explicit engine is used as asked, or refused
    with an ``EngineUnavailable`` that names the engines this machine has."""
    status = engine_status()
    req = str(requested).lower()
    if req != "auto":
        if req not in status:
            raise EngineUnavailable(f"unknown engine {requested!r}; valid engines: auto, {', '.join(ENGINES)}")
        ok, why = status[req]
        if not ok:
            have = ", ".join(n for n, (a, _) in status.items() if a)
            raise EngineUnavailable(f"engine {req!r} is not available here ({why}); available: auto, {have}")
        return EngineChoice(req, "asked for explicitly")
    if status["cuda"][0]:
        return EngineChoice("cuda", "a CUDA GPU is available, so the real allocator is measured")
    if predicted_bytes is not None and predicted_bytes > max_cpu_bytes:
        return EngineChoice("fake", f"no GPU, and the predicted {predicted_bytes / 2**20:,.0f} MiB is over "
                                    f"the cpu engine's limit of {max_cpu_bytes / 2**20:,.0f} MiB")
    if predicted_flops is not None and predicted_flops > max_cpu_flops:
        return EngineChoice("fake", f"no GPU, and {predicted_flops / 1e9:,.1f} GFLOP is too slow to compute on "
                                    f"this CPU (limit {max_cpu_flops / 1e9:,.0f} GFLOP)")
    return EngineChoice("cpu", "no GPU; small enough to compute for real on the CPU")


@dataclass
class Snapshot:
    """Live bytes at a named moment: the tracker's count, and on CUDA the allocator's."""
    name: str
    tracked_bytes: int
    allocated_bytes: int | None = None
    by_category: dict[str, int] = field(default_factory=dict)  # tracked bytes per category


class RunContext:
    """What an experiment receives: where to put tensors, and how to label them."""

    def __init__(self, engine: str, device: torch.device, tracker: MemoryTracker, baseline: int = 0):
        self.engine = engine
        self.device = device
        self.tracker = tracker
        self.snapshots: list[Snapshot] = []
        self._baseline = baseline

    def label(self, tensor: torch.Tensor, category: Category | str = Category.INPUTS) -> torch.Tensor:
        return self.tracker.label(tensor, category)

    def phase(self, name: str):
        return self.tracker.phase(name)

    def snapshot(self, name: str) -> Snapshot:
        """Record live bytes now (tracker, and the allocator on CUDA)."""
        dev = str(self.device)
        rounded = self.engine == "cuda"
        by_category = {c.value: 0 for c in Category}
        for r in self.tracker._records.values():
            if r.alive and r.device.startswith(dev):
                by_category[r.category.value] += cuda_rounded_bytes(r.nbytes) if rounded else r.nbytes
        tracked = sum(by_category.values())
        alloc = None
        if self.engine == "cuda":
            torch.cuda.synchronize(self.device)
            alloc = torch.cuda.memory_allocated(self.device) - self._baseline
        snap = Snapshot(name, tracked, alloc, by_category)
        self.snapshots.append(snap)
        return snap


@dataclass
class Measurement:
    """One experiment's answer, with where it came from."""
    engine: str
    reason: str
    device: str
    label: str
    tracking: TrackingResult | None
    value: Any = None
    seconds: float = 0.0
    snapshots: list[Snapshot] = field(default_factory=list)
    allocator: dict[str, int] | None = None    # cuda only: the caching allocator's counters
    beyond_tensors: dict[str, Any] | None = None  # cuda only: allocator peak - tracked peak
    oom: bool = False
    error: str | None = None

    @property
    def peak_bytes(self) -> int:
        return self.tracking.peak_bytes if self.tracking else 0

    @property
    def peak_by_category(self) -> dict[str, int]:
        return dict(self.tracking.peak_by_category) if self.tracking else {}

    def __repr__(self) -> str:
        state = f"OOM: {self.error}" if self.oom else f"peak={self.peak_bytes:,} B"
        return f"Measurement(engine={self.engine!r}, {state}, label={self.label!r})"

    def _repr_html_(self) -> str:
        from .views import measurement_html
        return measurement_html(self)


class Measured:
    """The shared shape of every result that holds one ``measurement`` (a field, or a property
    naming the run that speaks for a comparison): where its numbers came from, and its peak.

    A mixin of properties only; a dataclass using it must not declare fields of these names."""
    measurement: Measurement

    @property
    def label(self) -> str:
        return self.measurement.label

    @property
    def engine(self) -> str:
        return self.measurement.engine

    @property
    def peak_bytes(self) -> int:
        return self.measurement.peak_bytes

    @property
    def peak_by_category(self) -> dict[str, int]:
        return self.measurement.peak_by_category


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and ("out of memory" in str(exc).lower()
                                              or "can't allocate memory" in str(exc).lower())


def run(experiment: Callable[[RunContext], Any], engine: str = "auto", *,
        predicted_bytes: int | None = None, predicted_flops: int | None = None,
        max_cpu_bytes: int = DEFAULT_MAX_CPU_BYTES, max_cpu_flops: int = DEFAULT_MAX_CPU_FLOPS,
        cuda_device: int = 0) -> Measurement:
    """Run ``experiment`` on the chosen engine under a tracker.

    An out-of-memory error is caught and returned as ``Measurement(oom=True, error=...)``,
    after freeing what the experiment allocated (gc, and ``empty_cache`` on CUDA)."""
    choice = choose_engine(engine, predicted_bytes, predicted_flops, max_cpu_bytes, max_cpu_flops)
    if choice.name == "cuda":
        return _run_cuda(experiment, choice, torch.device("cuda", cuda_device))
    if choice.name == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode
        return _run_host(experiment, choice, LABEL_FAKE, FakeTensorMode())
    return _run_host(experiment, choice, LABEL_CPU, contextlib.nullcontext())


def _run_host(experiment, choice: EngineChoice, label: str, mode) -> Measurement:
    device = torch.device("cpu")
    tracker = MemoryTracker()
    value, err, oom = None, None, False
    t0 = time.perf_counter()
    with mode:
        ctx = RunContext(choice.name, device, tracker)
        try:
            with tracker:
                value = experiment(ctx)
        except Exception as exc:
            if not _is_oom(exc):
                raise
            oom, err = True, f"{type(exc).__name__}: {exc}"
    seconds = time.perf_counter() - t0
    # Free reference cycles the experiment left, so their frees are recorded. A full
    # collection costs 0.2-0.3 s with torch loaded (more than a small step itself), so
    # only pay it when a tracked storage is still alive: otherwise it changes nothing.
    if any(r.alive for r in tracker._records.values()):
        gc.collect()
    dev_name = "cpu" if choice.name == "cpu" else "cpu (fake tensors)"
    return Measurement(choice.name, choice.reason, dev_name, label, tracker.result(device="cpu"),
                       value, seconds, ctx.snapshots, oom=oom, error=err)


def _run_cuda(experiment, choice: EngineChoice, device: torch.device) -> Measurement:
    from .gpu import nvml_used_bytes
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base_alloc = torch.cuda.memory_allocated(device)
    tracker = MemoryTracker()
    ctx = RunContext("cuda", device, tracker, baseline=base_alloc)
    value, err, oom = None, None, False
    t0 = time.perf_counter()
    try:
        with tracker:
            value = experiment(ctx)
        torch.cuda.synchronize(device)
    except Exception as exc:
        if not _is_oom(exc):
            raise
        oom, err = True, f"{type(exc).__name__}: {exc}"
    seconds = time.perf_counter() - t0
    stats = torch.cuda.memory_stats(device)
    allocator = {
        "baseline_allocated": int(base_alloc),
        "memory_allocated": int(torch.cuda.memory_allocated(device)),
        "max_memory_allocated": int(torch.cuda.max_memory_allocated(device)),
        "memory_reserved": int(torch.cuda.memory_reserved(device)),
        "max_memory_reserved": int(torch.cuda.max_memory_reserved(device)),
        "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "num_ooms": int(stats.get("num_ooms", 0)),
        "nvml_used": nvml_used_bytes(device.index or 0),
    }
    result = tracker.result(device=str(device))
    gap = allocator["max_memory_allocated"] - base_alloc - result.peak_bytes
    beyond = {"bytes": int(gap),
              "label": "allocator peak beyond live tensors (workspaces, internal buffers)",
              "fraction_of_peak": gap / max(1, allocator["max_memory_allocated"] - base_alloc)}
    if oom:
        gc.collect()
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(device)
    return Measurement("cuda", choice.reason, str(device), label_cuda(name), result, value, seconds,
                       ctx.snapshots, allocator=allocator, beyond_tensors=beyond, oom=oom, error=err)
