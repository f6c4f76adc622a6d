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
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from gpulab.allocator.simulator import CachingAllocator, rebuilt_allocator
from gpulab.measure.cuda_card import KernelTarget
from gpulab.measure.fake_mode import FakeMode
from gpulab.formulas import cuda_rounded_bytes
from gpulab.categories import Category
from gpulab.measure.tracking import HOST_DEVICE, UNIFIED_DEVICE, MemoryTracker, TrackingResult

__all__ = [
    "AllocatorBlocks", "DEFAULT_MAX_CPU_BYTES", "DEFAULT_MAX_CPU_FLOPS", "ENGINES", "EngineChoice",
    "EngineUnavailable", "FAKE_CUDA_DEVICE", "FAKE_TARGETS", "LABEL_BLOCKS", "LABEL_CPU",
    "LABEL_FAKE", "LABEL_FAKE_CPU", "LABEL_FAKE_CUDA", "LABEL_FORMULA", "LABEL_SIMULATED",
    "LABEL_TENSOR_BYTES", "Measured", "Measurement", "RunContext", "Snapshot", "allocator_blocks", "label_fake_cuda",
    "beyond_tensors", "choose_engine", "cuda_run_counters", "engine_status", "label_cuda",
    "label_recorded", "release_cuda_memory", "run", "validate_fake_target"
]

ENGINES = ("cuda", "cpu", "fake")

# Where the automatic choice stops running real CPU compute and switches to fake tensors.
DEFAULT_MAX_CPU_BYTES = 2 * 1024**3        # predicted peak of live tensors
DEFAULT_MAX_CPU_FLOPS = 40 * 10**9         # ~ a second or two of fp32 work on a 2-core CPU
# Most CPUs have no float16 arithmetic units: torch computes float16 matmuls and convolutions on them far
# slower than float32 (on the 2-core EPYC this was written on, torch 2.15: a 256x256 matmul about 29x and a
# 3x3 convolution about 12x slower; an earlier measurement of a whole step there, about 65x). ``auto`` counts
# each float16 FLOP this many times against the cpu engine's FLOP limit, so a big float16 run goes to the
# fake engine (bfloat16 is counted once: CPUs with bfloat16 units run it at float32's speed or faster).
CPU_FP16_SLOWDOWN = 50

LABEL_FORMULA = "formula"
LABEL_CPU = "measured on CPU (live tensors)"
LABEL_FAKE = "fake tensors (no compute)"  # the family; a measurement says whose kernels it followed
LABEL_FAKE_CPU = "fake tensors, CPU kernels (no compute)"
LABEL_FAKE_CUDA = "fake tensors, CUDA kernels' allocations (no compute)"

# Whose kernels a fake run follows: "cuda" answers for a GPU (foreach optimizers, bool dropout
# masks, 512-byte blocks, step counters in host memory: gpulab.measure.fake_cuda), "cpu" mimics this
# CPU's kernels, so that a fake run equals a cpu-engine run storage for storage.
FAKE_TARGETS = ("cuda", "cpu")
LABEL_SIMULATED = "simulated allocator"
# The two ways the cuda engine counts its live tensors (see ``allocator_blocks``).
LABEL_TENSOR_BYTES = "tensor bytes (live tensors, each storage rounded up to 512 B)"
LABEL_BLOCKS = ("allocator blocks (live tensors replayed through the simulated allocator: a large "
                "block is not split when 1 MiB or less would remain)")


def label_cuda(gpu_name: str) -> str:
    return f"measured on {gpu_name} (cuda)"


def label_recorded(gpu_name: str, date: str, torch_version: str) -> str:
    return f"recorded on {gpu_name}, {date}, torch {torch_version}"


# the device the fake engine's CUDA target records its CPU fake tensors on (MemoryTracker's
# device_alias), so its storages are counted as the GPU's
FAKE_CUDA_DEVICE = "cuda:0"


def validate_fake_target(target: str) -> str:
    key = str(target).lower()
    if key not in FAKE_TARGETS:
        raise ValueError(f"unknown fake target {target!r}; valid targets: {', '.join(FAKE_TARGETS)}")
    return key


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
                  max_cpu_flops: int = DEFAULT_MAX_CPU_FLOPS, dtype: torch.dtype | None = None) -> EngineChoice:
    """``auto``: cuda when a GPU is visible; else cpu, unless the predicted size or work is
    over the caller's limits, then fake (``dtype``: the experiment's compute dtype; a float16 FLOP
    counts ``CPU_FP16_SLOWDOWN`` times). An explicit engine is used as asked, or refused
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
    weight = CPU_FP16_SLOWDOWN if dtype == torch.float16 else 1
    if predicted_flops is not None and predicted_flops * weight > max_cpu_flops:
        counted = (f" in float16, counted {weight}x (CPU_FP16_SLOWDOWN: most CPUs have no float16 units),"
                   if weight > 1 else "")
        return EngineChoice("fake", f"no GPU, and {predicted_flops / 1e9:,.1f} GFLOP{counted} is too slow to "
                                    f"compute on this CPU (limit {max_cpu_flops / 1e9:,.0f} GFLOP)")
    return EngineChoice("cpu", "no GPU; small enough to compute for real on the CPU")


@dataclass
class Snapshot:
    """Live bytes at a named moment: the tracker's count, and on CUDA the allocator's."""
    name: str
    tracked_bytes: int
    allocated_bytes: int | None = None
    by_category: dict[str, int] = field(default_factory=dict)  # tracked bytes per category
    blocks_bytes: int | None = None   # cuda: the live tensors' blocks (``allocator_blocks``), to
                                      # compare with ``allocated_bytes`` like with like


@dataclass(frozen=True)
class AllocatorBlocks:
    """What ``torch.cuda.memory_allocated`` counts for a run's live tensors: its blocks.

    The caching allocator rounds each request up to 512 B, and it does not split a free large
    block when 1 MiB or less would remain (``should_split``: ``remaining > kSmallSize`` in the
    large pool), so a block can be bigger than its rounded tensor; ``allocated_bytes`` grows by
    the whole ``block->size`` (``alloc_found_block``), c10/cuda/CUDACachingAllocator.cpp."""
    peak_bytes: int
    final_bytes: int
    label: str = LABEL_BLOCKS
    tensor_label: str = LABEL_TENSOR_BYTES   # the line it stands next to: the tracker's own peak


def allocator_blocks(events, segments=None) -> AllocatorBlocks:
    """Replay tracker events (one CUDA device's) through gpulab's simulated caching allocator,
    starting from ``segments`` (the allocator's segments when the run began, as
    ``gpu.allocator_segments`` reads them: the blocks allocated before the run and the free room
    beside them, which the run's tensors may take), or from an empty cache when they are not
    known. The peaks and the final bytes are those of the run's own blocks (above the start)."""
    sim = rebuilt_allocator(segments) if segments else None
    sim = sim or CachingAllocator()
    start = sim.memory_allocated()
    r = sim.replay(events, strict=False)
    return AllocatorBlocks(r.peak_allocated - start, sim.memory_allocated() - start)


class RunContext:
    """What an experiment receives: where to put tensors, and how to label them."""

    def __init__(self, engine: str, device: torch.device, tracker: MemoryTracker, baseline: int = 0,
                 kernels: str | None = None, on_host=None, segments=None):
        self.engine = engine
        self._segments = segments   # cuda: the allocator's segments when the run began (allocator_blocks)
        self.device = device
        self._on_host = on_host  # records a CUDA run keeps in host memory (fake CUDA target)
        # whose kernels the run follows: "cuda" on the cuda engine and for the fake engine's
        # CUDA target (tensors still on ``device``), else "cpu"
        self.kernels = kernels or ("cuda" if engine == "cuda" else "cpu")
        self.tracker = tracker
        self.snapshots: list[Snapshot] = []
        self._baseline = baseline

    def label(self, tensor: torch.Tensor, category: Category | str = Category.INPUTS) -> torch.Tensor:
        return self.tracker.label(tensor, category)

    def phase(self, name: str):
        return self.tracker.phase(name)

    def offloading(self):
        """Activation offloading for the code inside (``MemoryTracker.offloading``): saved tensors
        go to host memory, reported apart (``Measurement.offloaded``)."""
        return self.tracker.offloading(copy_back=self.kernels == "cuda" and self.engine != "cuda")

    def mark(self) -> int:
        """The number of events recorded so far: a position on the run's timeline (the events
        after it have ``index >= mark``), e.g. where a training step starts."""
        return len(self.tracker._events)

    def snapshot(self, name: str) -> Snapshot:
        """Record live bytes now (tracker, and the allocator on CUDA)."""
        # the fake CUDA target records its CPU fake tensors as cuda:0 (MemoryTracker device_alias)
        dev = FAKE_CUDA_DEVICE if self.kernels == "cuda" and self.engine != "cuda" else str(self.device)
        rounded = self.kernels == "cuda"
        by_category = {c.value: 0 for c in Category}
        for r in self.tracker._records.values():
            if (r.alive and r.device.startswith(dev) and not r.apart
                    and not (self._on_host and self._on_host(r))):
                by_category[r.category.value] += cuda_rounded_bytes(r.nbytes) if rounded else r.nbytes
        tracked = sum(by_category.values())
        alloc = blocks = None
        if self.engine == "cuda":
            torch.cuda.synchronize(self.device)
            alloc = torch.cuda.memory_allocated(self.device) - self._baseline
            blocks = allocator_blocks([e for e in self.tracker._events if e.device.startswith(dev)],
                                      self._segments).final_bytes
        snap = Snapshot(name, tracked, alloc, by_category, blocks)
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
    allocator: dict[str, int] | None = None    # cuda only: the caching allocator's counters, this run
    beyond_tensors: dict[str, Any] | None = None  # cuda only: allocator peak - the tensors' blocks' peak
    blocks: AllocatorBlocks | None = None      # cuda only: the live tensors' allocator blocks
    oom: bool = False
    error: str | None = None
    kernels: str = ""  # whose kernels the numbers follow: "cuda" or "cpu" (filled in if not given)
    offloaded: TrackingResult | None = None   # activation offloading: the host copies, apart
    paged: TrackingResult | None = None       # a paged optimizer's state in unified memory, apart
    kernels_note: str = ""   # fake CUDA target: the card whose kernels were followed, the attention kernels chosen

    def __post_init__(self) -> None:
        if not self.kernels:
            self.kernels = "cuda" if self.engine == "cuda" else "cpu"

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
        from gpulab.views import measurement_html
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


def run(experiment: Callable[[RunContext], Any], engine: str | EngineChoice = "auto", *,
        predicted_bytes: int | None = None, predicted_flops: int | None = None,
        max_cpu_bytes: int = DEFAULT_MAX_CPU_BYTES, max_cpu_flops: int = DEFAULT_MAX_CPU_FLOPS,
        cuda_device: int = 0, fake_target: str = "cpu", dtype: torch.dtype | None = None) -> Measurement:
    """Run ``experiment`` on the chosen engine under a tracker. ``engine``: a name ("auto" chooses
    with ``choose_engine`` from the predicted bytes and FLOPs, their ``dtype`` and the limits), or the
    ``EngineChoice`` a caller has already made, used as it is.

    ``fake_target`` (fake engine only): "cpu" follows this CPU's kernels, so a fake run equals
    a cpu-engine run storage for storage; "cuda" answers for a GPU with CUDA's kernel choices
    (``gpulab.measure.fake_cuda``) and 512-byte blocks. Questions about a GPU's capacity pass "cuda".

    An out-of-memory error is caught and returned as ``Measurement(oom=True, error=...)``,
    after freeing what the experiment allocated (gc, and ``empty_cache`` on CUDA)."""
    target = validate_fake_target(fake_target)
    choice = engine if isinstance(engine, EngineChoice) else choose_engine(
        engine, predicted_bytes, predicted_flops, max_cpu_bytes, max_cpu_flops, dtype)
    if choice.name == "cuda":
        return _run_cuda(experiment, choice, torch.device("cuda", cuda_device))
    if choice.name == "fake":
        if target == "cuda":
            return _run_fake_cuda(experiment, choice, FakeMode)
        return _run_host(experiment, choice, LABEL_FAKE_CPU, FakeMode())
    return _run_host(experiment, choice, LABEL_CPU, contextlib.nullcontext())


def _run_fake_cuda(experiment, choice: EngineChoice, fake_mode) -> Measurement:
    """The fake engine's CUDA target: fake CPU tensors (fake cuda tensors cannot run backward
    without a GPU), CUDA's kernel choices made explicitly, storages recorded as ``cuda:0``
    with 512-byte blocks, and what CUDA keeps in host memory counted on the CPU."""
    from gpulab.measure.fake_cuda import cuda_kernels
    kernels = cuda_kernels()
    m = _run_host(experiment, choice, label_fake_cuda(kernels.target), _stacked(fake_mode(), kernels),
                  tracker=MemoryTracker(device_alias={"cpu": FAKE_CUDA_DEVICE}), kernels="cuda")
    m.kernels_note = kernels.target.note()
    return m


def label_fake_cuda(target: KernelTarget) -> str:
    """A fake CUDA-target run's label: ``LABEL_FAKE_CUDA`` when no card was named (sm80 rules,
    which ``Measurement.kernels_note`` says), else the card's: "fake tensors, CUDA kernels of a T4
    (sm75) (no compute)"."""
    return LABEL_FAKE_CUDA if not target.name else f"fake tensors, CUDA kernels of {target.text} (no compute)"


@contextlib.contextmanager
def _stacked(*modes):
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        yield


def _run_host(experiment, choice: EngineChoice, label: str, mode, tracker: MemoryTracker | None = None,
              kernels: str = "cpu") -> Measurement:
    device = torch.device("cpu")
    tracker = tracker or MemoryTracker()
    value, err, oom = None, None, False
    t0 = time.perf_counter()
    on_host = None
    if kernels == "cuda":
        from gpulab.measure.fake_cuda import on_host_under_cuda as on_host
    with mode:
        ctx = RunContext(choice.name, device, tracker, kernels=kernels, on_host=on_host)
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
    if kernels == "cuda":
        dev_name = f"{FAKE_CUDA_DEVICE} (fake tensors, CUDA kernels emulated on the CPU)"
        tracking = tracker.result(device=FAKE_CUDA_DEVICE, round_to_cuda_blocks=True, on_host=on_host)
    else:
        dev_name = "cpu" if choice.name == "cpu" else "cpu (fake tensors)"
        tracking = tracker.result(device="cpu")
    return Measurement(choice.name, choice.reason, dev_name, label, tracking,
                       value, seconds, ctx.snapshots, oom=oom, error=err, kernels=kernels,
                       offloaded=_apart(tracker, HOST_DEVICE), paged=_apart(tracker, UNIFIED_DEVICE))


def release_cuda_memory(device: torch.device | int | None = None) -> None:
    """Give back what earlier code left: collect garbage (reference cycles holding tensors), wait
    for the GPU, and return the allocator's free cached segments to the driver (``empty_cache``)."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def _cuda_counters(device: torch.device) -> dict[str, int]:
    """The allocator's current counters; ``num_*`` count since the process started."""
    stats = torch.cuda.memory_stats(device)
    return {"allocated": int(torch.cuda.memory_allocated(device)),
            "reserved": int(torch.cuda.memory_reserved(device)),
            "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
            "num_ooms": int(stats.get("num_ooms", 0))}


def cuda_run_counters(before: dict[str, int], after: dict[str, int], max_allocated: int,
                      max_reserved: int, nvml_used: int | None) -> dict[str, Any]:
    """One run's allocator numbers: peaks and deltas from the run's own baseline. Counters the
    allocator keeps for the whole process are given as this run's difference, and separately
    under names that say ``since_process_start``."""
    return {
        "baseline_allocated": before["allocated"], "baseline_reserved": before["reserved"],
        "memory_allocated": after["allocated"], "memory_reserved": after["reserved"],
        "max_memory_allocated": int(max_allocated), "max_memory_reserved": int(max_reserved),
        "peak_allocated_delta": int(max_allocated) - before["allocated"],
        "peak_reserved_delta": int(max_reserved) - before["reserved"],
        "allocated_delta": after["allocated"] - before["allocated"],
        "num_alloc_retries_this_run": after["num_alloc_retries"] - before["num_alloc_retries"],
        "num_ooms_this_run": after["num_ooms"] - before["num_ooms"],
        "num_alloc_retries_since_process_start": after["num_alloc_retries"],
        "num_ooms_since_process_start": after["num_ooms"],
        "nvml_used": nvml_used,   # device-wide, all processes: not a per-run number
    }


def beyond_tensors(allocator: dict[str, Any], blocks: AllocatorBlocks) -> dict[str, Any]:
    """What the allocator held during the run beyond the live tensors' own blocks (cuBLAS/cuDNN
    workspaces, internal buffers of ops), and how much of it is still held after the run: that
    part lives on with the process (cuBLAS keeps the workspace its first matmul of the process
    allocated), so it is not a cost of every run."""
    peak = allocator["peak_allocated_delta"]
    gap = peak - blocks.peak_bytes
    kept = allocator["allocated_delta"] - blocks.final_bytes
    return {"bytes": int(gap),
            "label": "allocator peak of this run beyond the live tensors' blocks (workspaces, internal buffers)",
            "fraction_of_peak": gap / max(1, peak),
            "kept_after_run": int(kept),
            "kept_label": "still allocated after the run beyond live tensors: workspaces this run created, "
                          "kept until the process ends (cuBLAS's first matmul of the process)"}


def _trace_figures(trace, addresses, segments) -> dict[str, Any]:
    """The allocations no tensor owns in the run's trace (``non_tensor.classify``), and the
    simulator's replay of the whole trace, workspaces included, from the run's starting segments."""
    from gpulab.measure.non_tensor import classify, trace_events
    out = classify(trace, addresses).as_dict()
    sim = (rebuilt_allocator(segments) if segments else None) or CachingAllocator()
    a0, r0 = sim.memory_allocated(), sim.memory_reserved()
    r = sim.replay(trace_events(trace), strict=False)
    out.update(replayed_peak_allocated=int(r.peak_allocated - a0), replayed_peak_reserved=int(r.peak_reserved - r0),
               replay_label="gpulab's allocator simulator replaying this run's own allocator trace (tensors and "
                            "the allocations no tensor owns), from the segments the run began with")
    return out


class _TraceRun:
    """The caching allocator's trace of one run (``torch.cuda.memory._record_memory_history``,
    without stack frames, so it costs little), to tell the allocations no tensor owns from the
    tensors'. When the user's own recording is on, it is left alone and no trace is taken."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.trace: list[dict[str, Any]] | None = None
        self._mine = False

    def __enter__(self) -> "_TraceRun":
        try:
            if not torch._C._cuda_isHistoryEnabled():
                torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                         max_entries=1_000_000, clear_history=True)
                self._mine = True
        except (AttributeError, RuntimeError, TypeError):   # a torch without it: no trace
            self._mine = False
        return self

    def __exit__(self, *exc) -> None:
        if not self._mine:
            return
        try:
            snap = torch.cuda.memory._snapshot(self.device)
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            traces = snap.get("device_traces") or []
            self.trace = list(traces[index]) if index < len(traces) else []
        except Exception:  # noqa: BLE001 - the trace is an extra: the run's figures stand without it
            self.trace = None
        finally:
            try:
                torch.cuda.memory._record_memory_history(enabled=None)
            except Exception:  # noqa: BLE001
                pass


def _run_cuda(experiment, choice: EngineChoice, device: torch.device) -> Measurement:
    """Measure one run, not the process's history: free what earlier code left (gc, synchronize,
    ``empty_cache``), reset the peaks, record the baseline; report peaks and deltas from it.
    Memory is released again after any error; an error that is not an out-of-memory is re-raised."""
    from gpulab.measure.gpu import allocator_segments, nvml_used_bytes
    release_cuda_memory(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = _cuda_counters(device)
    segments = allocator_segments(device)   # what was left (a cuBLAS workspace) and the room beside it
    tracker = MemoryTracker()
    # The allocator's counters are this tracked run's: the tracker counts what it allocates, the
    # accumulations its dispatch mode makes out of place included, so that the two agree
    # (MemoryTracker._accumulation_candidate; the fake and cpu engines count them in place).
    tracker.emulate_untracked = False
    tracker.cuda_addresses = []
    ctx = RunContext("cuda", device, tracker, baseline=before["allocated"], segments=segments)
    value, err, oom = None, None, False
    history = _TraceRun(device)
    t0 = time.perf_counter()
    try:
        with history, tracker:
            value = experiment(ctx)
        torch.cuda.synchronize(device)
    except Exception as exc:
        # the traceback's frames hold the experiment's tensors: drop their locals, then free
        traceback.clear_frames(exc.__traceback__)
        if not _is_oom(exc):
            release_cuda_memory(device)
            raise
        oom, err = True, f"{type(exc).__name__}: {exc}"
    seconds = time.perf_counter() - t0
    max_alloc = torch.cuda.max_memory_allocated(device)
    max_res = torch.cuda.max_memory_reserved(device)
    result = tracker.result(device=str(device))
    blocks = allocator_blocks(result.events, segments)
    allocator = cuda_run_counters(before, _cuda_counters(device), max_alloc, max_res,
                                  nvml_used_bytes(device.index or 0))
    beyond = beyond_tensors(allocator, blocks)
    if history.trace is not None:
        try:
            beyond["not_tensors"] = _trace_figures(history.trace, tracker.cuda_addresses, segments)
        except Exception:  # noqa: BLE001 - an extra: the run's own figures stand without it
            pass
    if oom:
        release_cuda_memory(device)
    name = torch.cuda.get_device_name(device)
    return Measurement("cuda", choice.reason, str(device), label_cuda(name), result, value, seconds,
                       ctx.snapshots, allocator=allocator, beyond_tensors=beyond, oom=oom, error=err,
                       blocks=blocks, offloaded=_apart(tracker, HOST_DEVICE), paged=_apart(tracker, UNIFIED_DEVICE))


def _apart(tracker: MemoryTracker, where: str) -> TrackingResult | None:
    """What the run kept outside the device's allocator (``where``: offloaded activations' host
    copies, a paged optimizer's unified memory), when it kept any."""
    if not any(r.apart == where for r in tracker._records.values()):
        return None
    return tracker.result(device=where, round_to_cuda_blocks=False)
