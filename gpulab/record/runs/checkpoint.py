"""Lesson 07's measuring core: one training step of a deep Linear+ReLU stack with
``checkpoint_sequential`` over segment counts k, tracked for memory and timed without the tracker.

It runs on an engine and returns data (``CheckpointRuns``: one ``Measurement`` and one ``Timing``
per k); ``gpulab.course.checkpointing`` adds the formulas and the views, and ``gpulab record``
stores ``CheckpointRuns.as_dict()`` for a real GPU. ``time_fn`` is the timing helper: warm-up,
synchronize on CUDA, repeat, keep every sample (nanoGPT ``bench.py``).
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from gpulab.measure.engines import Measurement, RunContext, run
from gpulab.record.kinds import record_kind

__all__ = [
    "CHECKPOINT_SEGMENTS", "CheckpointRuns", "Timing", "block_stack", "checkpoint_step",
    "TimingStopped", "cpu_threads", "memory_experiment", "record_checkpoint", "run_checkpoint_sweep", "time_fn",
    "time_round_robin", "timing_label"
]

# --- timing -----------------------------------------------------------------------------------------

@dataclass
class Timing:
    """Wall-clock samples of one callable (seconds), after ``warmup`` untimed calls."""
    samples: list[float]
    warmup: int
    device: str

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        """The fastest sample: the run least disturbed by other work on a shared machine."""
        return min(self.samples)

    @property
    def low(self) -> float:
        """25th percentile (the minimum when there are fewer than 4 samples)."""
        return _quantile(self.samples, 0.25)

    @property
    def high(self) -> float:
        """75th percentile (the maximum when there are fewer than 4 samples)."""
        return _quantile(self.samples, 0.75)

    def __repr__(self) -> str:
        return (f"Timing(median={self.median * 1e3:.1f} ms, IQR {self.low * 1e3:.1f}–{self.high * 1e3:.1f} ms, "
                f"n={len(self.samples)}, on {self.device})")


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if len(s) < 4:
        return s[0] if q < 0.5 else s[-1]
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)


def time_fn(fn: Callable[[], Any], warmup: int = 1, repeats: int = 5,
            device: torch.device | str = "cpu") -> Timing:
    """Call ``fn`` ``warmup`` times untimed, then ``repeats`` times timed; on CUDA each call
    is bracketed by ``torch.cuda.synchronize`` so the kernels' time is counted (as nanoGPT's
    bench.py does)."""
    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be >= 1 and warmup >= 0")
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return Timing(samples, warmup, str(dev) if dev.type != "cpu" else "this CPU")


@contextlib.contextmanager
def cpu_threads(n: int | None):
    """Run the body with ``torch.set_num_threads(n)`` (None: leave it), then restore.

    One thread is the default for the checkpoint sweep on the CPU: its steps are a few
    milliseconds of small matmuls, and on a shared machine (CI, Binder, a classroom server) a
    second OpenMP thread that gets descheduled makes every op wait, turning 6 ms steps into
    100 ms ones. One thread measures the ratio that matters (recompute vs no recompute)
    steadily; the label says so."""
    old = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


# --- the model and one step ---------------------------------------------------------------------------

def block_stack(n_blocks: int = 16, width: int = 128) -> nn.Sequential:
    """N identical blocks, each ``Sequential(Linear(width, width), ReLU())``. Each block
    saves one (batch, width) map for backward: ReLU's result, which is also the next Linear's
    saved input."""
    for name, v in (("n_blocks", n_blocks), ("width", width)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(n_blocks)])


def checkpoint_step(net: nn.Sequential, x: torch.Tensor, segments: int) -> torch.Tensor:
    """Forward (``checkpoint_sequential`` when k > 1), sum, backward; the loss."""
    if segments <= 1:
        out = net(x)
    else:
        out = checkpoint_sequential(net, segments, x, use_reentrant=False)
    loss = out.sum()
    loss.backward()
    return loss


def memory_experiment(n_blocks: int, width: int, batch: int, segments: int):
    """The tracked step for one k (an experiment for ``engines.run``)."""
    def experiment(ctx: RunContext) -> None:
        with ctx.phase("setup"), torch.device(ctx.device):
            torch.manual_seed(0)
            net = block_stack(n_blocks, width)
            ctx.tracker.register(net)
            x = ctx.label(torch.randn(batch, width))
        with ctx.phase("forward"):
            out = net(x) if segments <= 1 else checkpoint_sequential(net, segments, x, use_reentrant=False)
            loss = out.sum()
        del out
        with ctx.phase("backward"):
            loss.backward()
    return experiment


class TimingStopped(Exception):
    """``time_round_robin``'s ``stop()`` said to stop (a panel whose student moved on)."""


def time_round_robin(n_blocks: int, width: int, batch: int, ks: list[int], device: torch.device,
                     warmup: int, repeats: int, progress: Callable[[int], None] | None,
                     stop: Callable[[], bool] | None = None) -> dict[int, Timing]:
    """One model, one batch; ``warmup`` untimed steps per k, then ``repeats`` rounds that time
    one step of every k in turn, so slow spells of a shared machine fall on all k alike.
    ``stop``: asked before every step; True raises ``TimingStopped``."""
    torch.manual_seed(0)
    with torch.device(device):
        net = block_stack(n_blocks, width)
        x = torch.randn(batch, width)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def step(k: int) -> float:
        if stop is not None and stop():
            raise TimingStopped(f"timing stopped before a step of k = {k}")
        net.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        checkpoint_step(net, x, k)
        sync()
        return time.perf_counter() - t0

    for k in ks:
        for _ in range(warmup):
            step(k)
    samples: dict[int, list[float]] = {k: [] for k in ks}
    for j in range(repeats):
        if progress:
            progress(j)
        for k in ks:
            samples[k].append(step(k))
    where = str(device) if device.type != "cpu" else "this CPU"
    return {k: Timing(v, warmup, where) for k, v in samples.items()}


# --- the sweep ------------------------------------------------------------------------------------------

@dataclass
class CheckpointRuns:
    """Per k: the tracked step's ``Measurement`` and (cpu/cuda, when timed) its ``Timing``."""
    n_blocks: int
    width: int
    batch: int
    engine: str
    measurements: dict[int, Measurement]
    timings: dict[int, Timing | None]
    label: str
    timing_label: str

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (what ``gpulab record`` stores): per k the peak, the activation
        side (activations + temporaries at the peak), the peak by category, the allocator's
        counters on CUDA, the step time's median and IQR."""
        points = []
        for k, m in self.measurements.items():
            pc = dict(m.peak_by_category)
            t = self.timings.get(k)
            points.append({"segments": k, "peak_bytes": m.peak_bytes,
                           "activation_side": pc.get("activations", 0) + pc.get("temporaries", 0),
                           "peak_by_category": pc, "allocator": dict(m.allocator or {}),
                           "median_s": t.median if t else None, "iqr_s": [t.low, t.high] if t else None})
        return {"n_blocks": self.n_blocks, "width": self.width, "batch": self.batch, "engine": self.engine,
                "label": self.label, "timing_label": self.timing_label, "points": points}


def run_checkpoint_sweep(n_blocks: int, width: int, batch: int, ks: list[int], engine: str, *,
                         repeats: int = 7, warmup: int = 1, time_steps: bool = True,
                         progress: Callable[[float, str], None] | None = None,
                         threads: int | None = 1) -> CheckpointRuns:
    """Track one step per k on ``engine`` (a resolved name: cuda, cpu or fake), then time every k
    round robin without the tracker (not on fake). ``threads``: CPU threads (``cpu_threads``;
    ignored elsewhere). Raises ``MemoryError`` when a run goes out of memory."""
    device = torch.device("cuda") if engine == "cuda" else torch.device("cpu")
    threads = threads if engine == "cpu" else None
    timed = engine != "fake" and time_steps
    n_tasks = len(ks) + (repeats + 1 if timed else 0)
    with cpu_threads(threads):
        measurements: dict[int, Measurement] = {}
        for i, k in enumerate(ks):
            if progress:
                progress(i / n_tasks, f"memory, k = {k} ({i + 1}/{len(ks)})")
            m = run(memory_experiment(n_blocks, width, batch, k), engine)
            if m.oom:
                raise MemoryError(m.error)
            measurements[k] = m
        timings: dict[int, Timing | None] = {k: None for k in ks}
        if timed:
            timings = time_round_robin(n_blocks, width, batch, ks, device, warmup, repeats,
                                       lambda j: progress((len(ks) + j) / n_tasks, f"timing, round {j}/{repeats}")
                                       if progress else None)
        label = timing_label(engine, time_steps, device, warmup, repeats, threads)
    if progress:
        progress(1.0, "done")
    return CheckpointRuns(n_blocks, width, batch, engine, measurements, timings, measurements[ks[0]].label,
                          label)


def timing_label(engine: str, time_steps: bool, device: torch.device, warmup: int, repeats: int,
                 threads: int | None) -> str:
    """What a sweep's timings are (``run_checkpoint_sweep``'s, and a panel's timing after the memory):
    ``threads`` as ``run_checkpoint_sweep`` passes it (None: torch's count now, in the calling thread)."""
    if engine == "fake":
        return "not timed: fake tensors do no compute"
    if not time_steps:
        return "not timed"
    if engine == "cuda":
        return (f"timed on {torch.cuda.get_device_name(device)} (untracked; {warmup} warm-up step "
                f"per k, then {repeats} rounds over every k in turn, synchronized)")
    nt = f"{threads} thread{'s' if threads != 1 else ''}" if threads else f"{torch.get_num_threads()} threads"
    return (f"timed on this CPU, {nt} (untracked; {warmup} warm-up step per k, then {repeats} "
            f"rounds over every k in turn; shared CPUs are noisy, and a GPU's balance of compute "
            f"and overhead differs)")


CHECKPOINT_SEGMENTS = "every k from 1 to N"   # the checkpoint panel's default choice of k


@record_kind("checkpoint")
def record_checkpoint(p: dict[str, Any]) -> dict[str, Any]:
    """Lesson 07's checkpoint panel default on the GPU: every k from 1 to N."""
    if p["segments"] != CHECKPOINT_SEGMENTS:
        raise ValueError(f"the checkpoint record runs {CHECKPOINT_SEGMENTS!r}, got {p['segments']!r}")
    return run_checkpoint_sweep(p["n_blocks"], p["width"], p["batch"], list(range(1, p["n_blocks"] + 1)),
                                "cuda", repeats=p["repeats"]).as_dict()
