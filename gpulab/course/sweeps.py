"""Batch-size sweeps: ``memory = fixed + batch x per-sample``, fitted and compared with the
formulas, and "the largest batch that fits" a card of a given size.

* ``formula_line``: the formulas' fixed part (params + buffers + grads + optimizer state) and
  per-sample part (every layer's output for one image, plus the image and its label).
* ``batch_sweep``: tracked training runs at several batch sizes on one engine, the peak of
  each, and a least-squares line through them (``gpulab.formulas.fit_memory_model``).
* ``largest_batch``: on the fake engine (shapes only, any size): sweep, fit, solve for the
  card, then verify with fake runs at that batch and the next, replay the verified run
  through the caching-allocator simulator, and subtract an *assumed* CUDA context. On a
  machine with a GPU the answer is also run for real, with the allocator limited to the
  card's size.

Fake tensors count live tensors only: no allocator rounding or caching, no fragmentation,
no CUDA context or library workspaces. The simulator adds the first three (labelled
*simulated allocator*); the context is an assumption (labelled so) until a GPU measures it.
"""
from __future__ import annotations

import html
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from gpulab.allocator.simulator import CachingAllocator
from gpulab.predict.cards import CUDA_CONTEXT_ASSUMED
from gpulab.predict.search import largest_fitting as _boundary
from gpulab.measure.engines import LABEL_FORMULA, LABEL_SIMULATED, choose_engine, label_cuda
from gpulab.training.optimizers import check_optimizer
from gpulab.predict.step import StepResult, step as tracked_step
from gpulab.predict.breakdown import breakdown, predict_step, validate_batch
from gpulab.formulas import MemoryFit, fit_memory_model, max_batch
from gpulab.models.registry import ModelSpec, check_image_size, resolve_model
from gpulab.categories import Category
from gpulab.measure.records import TrackingResult
from gpulab.predict.batch_line import BatchLine
from gpulab.units import GiB, MiB, dtype_name, format_bytes, parse_dtype
from gpulab.views import error_percent, fmt_error, html_table

__all__ = [
    "BatchCheck", "CARDS_GIB", "CONTEXT_OVERHEAD_ASSUMED", "CapacityAnswer", "FormulaLine",
    "GpuCheck", "LABEL_ASSUMPTION", "LargestBatch", "Progress", "SweepPoint", "SweepResult",
    "batch_sweep", "exercise_largest_batch", "exercise_steady_state_extra", "fit_label",
    "formula_line", "largest_batch", "search_run_bound", "sweep_claims", "sweep_figure"
]

# Card sizes a student can pick (GiB, as the vendors' "16 GB" cards hold 16 GiB).
CARDS_GIB = (8, 12, 16, 24, 40, 80)

# the assumed CUDA context (``gpulab.predict.cards.CUDA_CONTEXT_ASSUMED``, shared with ``gpulab fit``)
CONTEXT_OVERHEAD_ASSUMED = CUDA_CONTEXT_ASSUMED
LABEL_ASSUMPTION = "assumption"

Progress = Callable[[float, str], None] | None


def fit_label(label: str) -> str:
    return f"least-squares fit to {label}"


# --- the formulas' line ------------------------------------------------------------------------

@dataclass(frozen=True)
class FormulaLine:
    """``fixed + batch x per-sample`` from the formulas alone (no measurement)."""
    model: str
    image_size: int
    optimizer: str
    dtype: str
    parameters: int
    buffers: int
    gradients: int
    optimizer_state: int
    activations_per_sample: int   # every leaf layer's output for one image (the articles' view)
    inputs_per_sample: int        # the image and its int64 label
    label: str = LABEL_FORMULA

    @property
    def fixed_bytes(self) -> int:
        return self.parameters + self.buffers + self.gradients + self.optimizer_state

    @property
    def per_sample_bytes(self) -> int:
        return self.activations_per_sample + self.inputs_per_sample

    def predict(self, batch: int) -> int:
        return self.fixed_bytes + batch * self.per_sample_bytes

    def max_batch(self, capacity_bytes: float) -> int:
        return max_batch(capacity_bytes, self.fixed_bytes, self.per_sample_bytes)

    def _repr_html_(self) -> str:
        rows = [["parameters", format_bytes(self.parameters)], ["buffers", format_bytes(self.buffers)],
                ["gradients", format_bytes(self.gradients)],
                [f"optimizer state ({self.optimizer})", format_bytes(self.optimizer_state)],
                ["fixed", format_bytes(self.fixed_bytes)],
                ["layer outputs per image", format_bytes(self.activations_per_sample)],
                ["input image + label", format_bytes(self.inputs_per_sample)],
                ["per sample", format_bytes(self.per_sample_bytes)]]
        return html_table(["part", "bytes"], rows,
                          f"{self.model}, {self.image_size}×{self.image_size}, {self.dtype}: {self.label}")


def formula_line(model: str | ModelSpec, image_size: int | None = None, optimizer: str = "sgd",
                 dtype: str | torch.dtype = "float32", count_step_counters: bool = True) -> FormulaLine:
    """The formulas' fixed and per-sample bytes (``gpulab.predict.breakdown.predict_step`` at batch 1)."""
    spec = resolve_model(model)
    size = image_size or spec.default_image_size
    opt = check_optimizer(optimizer)
    dt = parse_dtype(dtype)
    p = predict_step(spec, 1, size, opt, dt, count_step_counters)
    return FormulaLine(spec.name, size, opt, dtype_name(dt), p["parameters"], p["buffers"], p["gradients"],
                       p["optimizer_state"], p["activations"], p["inputs"])


# --- a sweep ---------------------------------------------------------------------------------------

@dataclass
class SweepPoint:
    batch: int
    peak_bytes: int
    peak_phase: str
    peak_by_category: dict[str, int]
    seconds: float
    oom: bool = False
    error: str | None = None


@dataclass
class SweepResult:
    """Peaks at several batch sizes on one engine, a line through them, and the formulas' line."""
    model: str
    image_size: int
    optimizer: str
    dtype: str
    steps: int
    engine: str
    reason: str
    label: str
    points: list[SweepPoint]
    fit: MemoryFit
    formula: FormulaLine
    activations_fit: MemoryFit          # saved activations at the peak, against the batch
    steps_results: list[StepResult] = field(default_factory=list, repr=False)

    @property
    def fit_label(self) -> str:
        return fit_label(self.label)

    @property
    def fixed_error_percent(self) -> float | None:
        """Formula's fixed bytes vs the fit's intercept."""
        return error_percent(self.formula.fixed_bytes, self.fit.fixed_bytes)

    @property
    def per_sample_error_percent(self) -> float | None:
        """Formula's per-sample bytes vs the fit's slope."""
        return error_percent(self.formula.per_sample_bytes, self.fit.per_sample_bytes)

    def compare_rows(self) -> list[list[str]]:
        f, fit = self.formula, self.fit
        saved = self.activations_fit.per_sample_bytes
        return [
            ["fixed (intercept)", format_bytes(f.fixed_bytes), format_bytes(fit.fixed_bytes),
             fmt_error(self.fixed_error_percent)],
            ["per sample (slope)", format_bytes(f.per_sample_bytes), format_bytes(fit.per_sample_bytes),
             fmt_error(self.per_sample_error_percent)],
            ["  of which: saved activations per sample", format_bytes(f.activations_per_sample),
             format_bytes(saved), fmt_error(error_percent(f.activations_per_sample, saved))],
        ]

    def _repr_html_(self) -> str:
        head = (f"<b>{html.escape(self.model)}</b>, {self.image_size}×{self.image_size}, {html.escape(self.dtype)}, "
                f"{html.escape(self.optimizer)}, {self.steps} step(s) per run — engine <b>{self.engine}</b> "
                f"({html.escape(self.reason)})")
        pts = [[p.batch, "out of memory" if p.oom else format_bytes(p.peak_bytes), p.peak_phase,
                format_bytes(self.fit.predict(p.batch)), format_bytes(self.formula.predict(p.batch)),
                fmt_error(error_percent(self.formula.predict(p.batch), p.peak_bytes) if not p.oom else None)]
               for p in self.points]
        t1 = html_table(["batch", f"peak ({self.label})", "peak during", "fit", "formula", "formula error"], pts,
                        "binary units")
        t2 = html_table(["", LABEL_FORMULA, f"fit (R² = {self.fit.r2:.5f})", "formula error"],
                        self.compare_rows(),
                        f"fit: {self.fit_label}; saved activations: the tracker's activations at each peak, "
                        f"fitted against the batch")
        return head + t1 + t2

    def figure(self, max_batch_shown: int | None = None):
        return sweep_figure(self, max_batch_shown)

    def plot(self):
        """``figure()`` as a PNG image (what a notebook cell shows)."""
        from gpulab.plots import to_png as as_png
        return as_png(self.figure())


def _resolve_engine(engine: str, model: ModelSpec, batch: int, size: int, optimizer: str, dt: torch.dtype,
                    steps: int):
    pred = predict_step(model, batch, size, optimizer, dt)
    flops = 3 * breakdown(model, batch, size, dt).forward_flops * steps
    return choose_engine(engine, sum(v for v in pred.values() if v), flops)


def batch_sweep(model: str | ModelSpec = "cnn", batches: Sequence[int] = (4, 8, 16, 32), image_size: int | None = None,
                optimizer: str = "sgd", dtype: str | torch.dtype = "float32", engine: str = "auto",
                steps: int = 2, progress: Progress = None) -> SweepResult:
    """Track ``steps`` training steps at each batch size (one engine for all: the one ``auto``
    would pick for the largest batch) and fit ``peak = fixed + batch x per-sample``.

    ``steps=2`` (the default) measures the steady state: from the second step on, the
    optimizer state exists while activations are alive."""
    spec = resolve_model(model)
    bs = sorted({validate_batch(b) for b in batches})
    if len(bs) < 2:
        raise ValueError(f"a sweep needs at least two different batch sizes, got {list(batches)!r}")
    size = image_size or spec.default_image_size
    check_image_size(spec, size, bs[0])
    opt = check_optimizer(optimizer)
    dt = parse_dtype(dtype)
    choice = _resolve_engine(engine, spec, bs[-1], size, opt, dt, steps)
    points, results = [], []
    for i, b in enumerate(bs):
        if progress:
            progress(i / len(bs), f"batch {b} ({i + 1}/{len(bs)}) on {choice.name}")
        r = tracked_step(spec, batch=b, image_size=size, optimizer=opt, dtype=dt, engine=choice.name, steps=steps, guard=False)
        m = r.measurement
        points.append(SweepPoint(b, m.peak_bytes, m.tracking.peak_phase if m.tracking else "",
                                 m.peak_by_category, m.seconds, m.oom, m.error))
        results.append(r)
    if progress:
        progress(1.0, "fitting")
    good = [p for p in points if not p.oom]
    if len(good) < 2:
        raise MemoryError(f"only {len(good)} of the batch sizes ran without running out of memory on "
                          f"{choice.name}; choose smaller batches or the fake engine")
    fit = fit_memory_model([p.batch for p in good], [p.peak_bytes for p in good])
    act = fit_memory_model([p.batch for p in good],
                           [p.peak_by_category.get(Category.ACTIVATIONS.value, 0) for p in good])
    label = results[0].measurement.label
    return SweepResult(spec.name, size, opt, dtype_name(dt), steps, choice.name, choice.reason, label, points,
                       fit, formula_line(spec, size, opt, dt, count_step_counters=choice.name != "cuda"),
                       act, results)


def sweep_figure(sweep: SweepResult, max_batch_shown: int | None = None, capacity_lines: Sequence[tuple[float, str]] = (),
                 title: str | None = None):
    """Measured peaks, the fitted line and the formulas' line, in MiB or GiB."""
    from gpulab.plots import LessonFigure
    good = [p for p in sweep.points if not p.oom]
    top = max([sweep.fit.predict(max_batch_shown or 0), sweep.formula.predict(max_batch_shown or 0)]
              + [p.peak_bytes for p in good] + [c for c, _ in capacity_lines])
    unit, uname = (GiB, "GiB") if top >= 4 * GiB else (MiB, "MiB")
    xmax = max_batch_shown or max(p.batch for p in sweep.points)
    xs = [0, xmax]
    fig = LessonFigure(figsize=(7.0, 3.8), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.plot([p.batch for p in good], [p.peak_bytes / unit for p in good], "o", color="#4C72B0",
            label=f"peak, {sweep.label}", zorder=3)
    ax.plot(xs, [sweep.fit.predict(x) / unit for x in xs], "-", color="#4C72B0",
            label=f"fit: {format_bytes(sweep.fit.fixed_bytes)} + batch × {format_bytes(sweep.fit.per_sample_bytes)}")
    ax.plot(xs, [sweep.formula.predict(x) / unit for x in xs], "--", color="#999999",
            label=f"{LABEL_FORMULA}: {format_bytes(sweep.formula.fixed_bytes)} + batch × "
                  f"{format_bytes(sweep.formula.per_sample_bytes)}")
    for cap, lab in capacity_lines:
        ax.axhline(cap / unit, color="#C44E52", ls=":" if "assum" in lab else "-", lw=1, label=lab)
    ax.set_xlim(0, xmax * 1.03)
    ax.set_ylim(0, top / unit * 1.1)
    ax.set_xlabel("batch size")
    ax.set_ylabel(f"peak live tensors ({uname})")
    ax.legend(fontsize=7.5, loc="upper left")
    ax.set_title(title or f"{sweep.model}, {sweep.optimizer}: memory = fixed + batch × per-sample", fontsize=10)
    return fig


# --- the largest batch for a card ------------------------------------------------------------------

@dataclass
class BatchCheck:
    """One fake run used to verify a predicted batch: its live-tensor peak and, replayed through
    the allocator simulator with the capacity as the device size, what the allocator would do."""
    batch: int
    peak_bytes: int                 # fake tensors (no compute)
    simulated_reserved: int         # simulated allocator: peak reserved bytes
    simulated_oom: bool             # simulated allocator: an allocation failed


@dataclass
class CapacityAnswer:
    """The largest batch for one usable capacity, step by step."""
    name: str
    capacity_bytes: int
    formula_batch: int              # formula line solved for the capacity
    fit_batch: int                  # fitted line solved for the capacity
    live_batch: int                 # verified with fake runs: peak(B) <= capacity < peak(B+1)
    allocator_batch: int            # largest batch the simulated allocator serves without OOM
    checks: list[BatchCheck]
    capacity_label: str


@dataclass
class GpuCheck:
    """A real run on the GPU with the caching allocator limited to the card's size."""
    batch: int
    oom: bool
    max_allocated: int | None
    max_reserved: int | None
    outside_allocator: int | None   # NVML used - reserved: context, libraries (other processes too)
    label: str


@dataclass
class LargestBatch:
    model: str
    image_size: int
    optimizer: str
    dtype: str
    card_bytes: int
    context_overhead_bytes: int
    sweep: SweepResult
    answers: list[CapacityAnswer]
    gpu_checks: list[GpuCheck]
    gpu_note: str
    verification_runs: int = 0      # fake runs beyond the sweep that the search needed

    @property
    def recommended(self) -> CapacityAnswer:
        """The most careful answer: allocator simulated, assumed context subtracted."""
        return self.answers[-1]

    def answer(self, name_start: str) -> CapacityAnswer:
        for a in self.answers:
            if a.name.startswith(name_start):
                return a
        raise KeyError(name_start)

    def _repr_html_(self) -> str:
        card = format_bytes(self.card_bytes)
        head = (f"<b>{html.escape(self.model)}</b>, {self.image_size}×{self.image_size}, {html.escape(self.dtype)}, "
                f"{html.escape(self.optimizer)} (steady state) on a <b>{card}</b> card")
        rows = []
        for a in self.answers:
            rows.append([a.name, format_bytes(a.capacity_bytes), a.capacity_label, a.formula_batch, a.fit_batch,
                         a.live_batch, a.allocator_batch])
        fake = self.sweep.label  # the fake runs' own label: whose kernels they followed
        t = html_table(["usable memory", "bytes", "source", f"{LABEL_FORMULA}", f"fit to {fake}",
                        f"verified: {fake}", f"verified: {LABEL_SIMULATED}"], rows,
                       "largest batch; 'verified' = peak at that batch fits and at batch + 1 does not")
        checks = []
        for a in self.answers:
            for c in a.checks:
                checks.append([a.name, c.batch, format_bytes(c.peak_bytes, digits=3),
                               format_bytes(c.simulated_reserved, digits=3),
                               "OOM" if c.simulated_oom else "fits"])
        t2 = html_table(["usable memory", "batch", f"peak ({self.sweep.label})", f"reserved ({LABEL_SIMULATED})",
                         f"{LABEL_SIMULATED}"], checks, "the verification runs")
        if self.gpu_checks:
            g = [[c.batch, "OOM" if c.oom else "fits", format_bytes(c.max_allocated or 0),
                  format_bytes(c.max_reserved or 0),
                  format_bytes(c.outside_allocator) if c.outside_allocator is not None else "n/a"]
                 for c in self.gpu_checks]
            t3 = html_table(["batch", "result", "max allocated", "max reserved", "outside the allocator"], g,
                            self.gpu_checks[0].label)
        else:
            t3 = ""
        note = f"<div class='gpulab-label'><b>{html.escape(self.gpu_note)}</b></div>"
        return head + t + t2 + t3 + note

    def plot(self):
        """``figure()`` as a PNG image (what a notebook cell shows)."""
        from gpulab.plots import to_png as as_png
        return as_png(self.figure())

    def figure(self):
        rec = self.recommended
        xmax = int(max(a.formula_batch for a in self.answers + [rec]) * 1.15) + 1
        xmax = max(xmax, int(rec.live_batch * 1.3) + 1, max(p.batch for p in self.sweep.points))
        lines = [(self.card_bytes, f"card: {format_bytes(self.card_bytes)}"),
                 (self.card_bytes - self.context_overhead_bytes,
                  f"card − CUDA context ({format_bytes(self.context_overhead_bytes)}, {LABEL_ASSUMPTION})")]
        fig = sweep_figure(self.sweep, xmax, lines,
                           title=f"{self.model}, {self.optimizer}: largest batch on a "
                                 f"{format_bytes(self.card_bytes)} card")
        ax = fig.axes[0]
        unit = GiB if ax.get_ylabel().endswith("(GiB)") else MiB
        sweep_batches = {p.batch for p in self.sweep.points}
        ver = sorted({(c.batch, c.peak_bytes) for a in self.answers for c in a.checks if c.batch not in sweep_batches})
        if ver:
            ax.plot([b for b, _ in ver], [p / unit for _, p in ver], "x", color="#C44E52", ms=7, zorder=4,
                    label=f"verification runs, {self.sweep.label}")
            ax.legend(fontsize=7.5, loc="upper left")
        a0 = self.answers[0]
        ax.axvline(a0.live_batch, color="#55A868", lw=1)
        ax.annotate(f"{a0.live_batch} (live tensors)", (a0.live_batch, 0.05), xycoords=("data", "axes fraction"),
                    xytext=(3, 0), textcoords="offset points", fontsize=8, color="#55A868", rotation=90)
        ax.axvline(rec.allocator_batch, color="#C44E52", lw=1, ls=":")
        ax.annotate(f"{rec.allocator_batch} (recommended)", (rec.allocator_batch, 0.05),
                    xycoords=("data", "axes fraction"), xytext=(-10, 0), textcoords="offset points", fontsize=8,
                    color="#C44E52", rotation=90, ha="right")
        return fig


def _replay(t: TrackingResult, capacity: int | None) -> tuple[int, bool]:
    """Replay a fake run's timeline through the allocator simulator with ``capacity`` as the
    device size (None: unlimited): (peak reserved bytes, whether an allocation failed)."""
    res = CachingAllocator(capacity_bytes=None if capacity is None else int(capacity)).replay(t.events, strict=False)
    return res.peak_reserved, bool(res.oom_events)


KEPT_SWEEPS = 8   # sweeps (four fake runs each, and the runs that verified them) kept for the process
_KEPT: "OrderedDict[tuple, tuple[SweepResult, dict[int, StepResult]]]" = OrderedDict()


def largest_batch(model: str | ModelSpec = "vgg16", card_gib: float = 16, image_size: int | None = None,
                  optimizer: str = "sgd", dtype: str | torch.dtype = "float32",
                  context_overhead_bytes: int = CONTEXT_OVERHEAD_ASSUMED,
                  sweep_batches: Sequence[int] = (8, 16, 32, 64), check_on_gpu: bool = True,
                  progress: Progress = None, max_runs: int | None = None, extrapolate: bool = True) -> LargestBatch:
    """The largest batch whose steady-state training step fits a ``card_gib`` GiB card.

    Two usable capacities are answered: the whole card, and the card minus an *assumed*
    CUDA context (``context_overhead_bytes``). For each: the formula's and the fit's answer,
    the batch verified by fake runs (peak at B fits, at B + 1 does not), and the batch the
    simulated caching allocator can serve. Each search starts from a close guess (the sweep's
    line; for the allocator, the live answer scaled by the simulator's overhead) and then
    gallops and bisects, so it needs about 2·log2(distance from the guess) + 2 fake runs:
    logarithmic in the batch for any card size. ``max_runs`` (default: ``search_run_bound``
    of the sweep's answer) turns a runaway search into an error. ``extrapolate``: the examined batches made
    from the sweep's line (``predict.batch_line``), not run (False: run, the same answers). With a GPU and
    ``check_on_gpu``, the allocator-simulated answer for the whole card and the batch after it run for real, with
    ``torch.cuda.set_per_process_memory_fraction`` limiting the allocator to the card."""
    if not card_gib or card_gib <= 0:
        raise ValueError(f"card size must be a positive number of GiB, got {card_gib!r}")
    card = int(card_gib * GiB)
    if context_overhead_bytes < 0 or context_overhead_bytes >= card:
        raise ValueError(f"the context overhead must be between 0 and the card size, got "
                         f"{format_bytes(context_overhead_bytes)}")
    spec = resolve_model(model)
    size = image_size or spec.default_image_size
    opt = check_optimizer(optimizer)
    dt = parse_dtype(dtype)
    def note(frac: float, text: str) -> None:
        if progress:
            progress(frac, text)

    def sweep_progress(frac: float, text: str) -> None:
        note(0.5 * frac, text)

    key = (spec.name, size, opt, str(dt), tuple(sweep_batches)) if isinstance(model, str) else None
    sweep, runs = _kept_sweep(key, lambda: batch_sweep(spec, sweep_batches, size, opt, dt, "fake", steps=2,
                                                       progress=sweep_progress))
    ran_before = len(runs)
    if max_runs is None:
        max_runs = search_run_bound(max(sweep.fit.max_batch(card), sweep.formula.max_batch(card), 1))

    def fake(batch: int) -> TrackingResult:
        if batch not in runs:
            done = len(runs) - ran_before   # fake runs this verification has made so far
            if done >= max_runs:
                raise RuntimeError(f"the verification needed more than {max_runs} fake runs; the sweep's line "
                                   f"is too far from the measured peaks")
            note(0.5 + 0.4 * (done + 1) / max_runs, f"verifying batch {batch} (fake)")
            runs[batch] = tracked_step(spec, batch=batch, image_size=size, optimizer=opt, dtype=dt, engine="fake", steps=2, guard=False)
        return runs[batch].measurement.tracking

    capacities = (("whole card", card, "card size"),
                  ("card − CUDA context", card - context_overhead_bytes, f"card − {format_bytes(context_overhead_bytes)} "
                                                                         f"({LABEL_ASSUMPTION})"))
    answers = _answers(capacities, sweep, runs, fake, extrapolate)

    gpu_checks: list[GpuCheck] = []
    if torch.cuda.is_available() and check_on_gpu:
        note(0.92, "checking on the GPU")
        gpu_checks, gpu_note = _gpu_check(spec, size, opt, dt, card, answers[0].allocator_batch)
    elif torch.cuda.is_available():
        gpu_note = "A GPU is present, but the GPU check was switched off: prediction only."
    else:
        gpu_note = ("No GPU here: prediction only. The batch sizes above come from fake tensors and the "
                    "allocator simulator; the CUDA context is an assumption.")
    note(1.0, "done")
    return LargestBatch(spec.name, size, opt, dtype_name(dt), card, int(context_overhead_bytes), sweep, answers,
                        gpu_checks, gpu_note, verification_runs=len(runs) - ran_before)


def _kept_sweep(key: tuple | None, sweep: Callable[[], SweepResult]) -> tuple[SweepResult, dict[int, StepResult]]:
    """The sweep and its runs by batch, kept for the process under ``key`` (a registered model's
    settings; None: not kept): moving the card or the context re-answers from the same timelines (a
    fake run depends on nothing else), with the same answers."""
    if key is not None and key in _KEPT:
        _KEPT.move_to_end(key)
        return _KEPT[key]
    made = sweep()
    kept = (made, {r.batch: r for r in made.steps_results})
    if key is not None:
        _KEPT[key] = kept
        while len(_KEPT) > KEPT_SWEEPS:
            _KEPT.popitem(last=False)
    return kept


def _answers(capacities, sweep: SweepResult, runs: dict[int, StepResult], fake: Callable[[int], TrackingResult],
             extrapolate: bool) -> list[CapacityAnswer]:
    """Each capacity's answer, the examined batches made from the sweep's line where it holds (exact at
    every swept batch), confirmed by one run at the answer; else every examined batch is run."""
    line = BatchLine.make({b: r.measurement.tracking for b, r in runs.items()}) if extrapolate else None
    made: dict[int, TrackingResult] = {}

    def timeline(batch: int) -> TrackingResult:
        if line is None or batch in runs:
            return fake(batch)
        if batch not in made:
            made[batch] = line.at(batch)
        return made[batch]
    answers = [_capacity_answer(name, cap, cap_label, sweep, timeline) for name, cap, cap_label in capacities]
    if line is not None:
        confirm = answers[0].allocator_batch or answers[0].live_batch
        if confirm and confirm not in runs and not BatchLine.same(fake(confirm), line.at(confirm)):
            line = None   # the line did not hold there: every examined batch is run instead
            answers = [_capacity_answer(name, cap, cap_label, sweep, timeline) for name, cap, cap_label in capacities]
    return answers


def _capacity_answer(name: str, cap: int, cap_label: str, sweep, fake: Callable[[int], TrackingResult]) -> CapacityAnswer:
    """One usable capacity's answers: the formula's and the fit's batch, the batch fake runs verify
    (peak at B fits, at B + 1 does not), and the batch the simulated allocator can serve."""
    examined: dict[int, BatchCheck] = {}

    def examine(b: int) -> BatchCheck:
        if b not in examined:
            reserved, oom = _replay(fake(b), cap)
            examined[b] = BatchCheck(b, fake(b).peak_bytes, reserved, oom)
        return examined[b]

    fit_b = sweep.fit.max_batch(cap)
    live_b = _boundary(fit_b, lambda b: examine(b).peak_bytes <= cap)
    # the simulator reserves at least the live bytes, so it never serves more than live_b;
    # its rounding and caching cost some images: start from live_b scaled by the overhead
    # the simulator shows at live_b without a capacity limit (reserved / live), then search
    alloc_b = 0
    if live_b:
        reserved_unlimited, _ = _replay(fake(live_b), None)
        guess = min(live_b, int(live_b * cap / max(reserved_unlimited, 1)))
        alloc_b = _boundary(guess, lambda b: not examine(b).simulated_oom, upper=live_b + 1)
    return CapacityAnswer(name, cap, sweep.formula.max_batch(cap), fit_b, live_b, alloc_b,
                          [examined[b] for b in sorted(examined)], cap_label)


def search_run_bound(batch: int) -> int:
    """The most fake runs ``largest_batch`` may need when the answers are at most ``batch``:
    two capacities × two searches (live tensors, simulated allocator), each a gallop from its
    guess and a bisection, ``2·ceil(log2(2·batch + 2)) + 2`` runs at most."""
    return 4 * (2 * math.ceil(math.log2(2 * batch + 2)) + 2)


def _gpu_check(model: ModelSpec, size: int, optimizer: str, dt: torch.dtype, card: int,
               batch: int) -> tuple[list[GpuCheck], str]:
    """Run ``batch`` and ``batch + 1`` on the GPU with the allocator capped at ``card`` bytes."""
    from gpulab.measure.gpu import nvml_used_bytes
    dev = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(dev).total_memory
    name = torch.cuda.get_device_name(dev)
    if card > total:
        return [], (f"This GPU ({name}) has {format_bytes(total)}, less than the {format_bytes(card)} card: "
                    f"it cannot stand in for it, so this is a prediction only.")
    checks = []
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(card / total, dev)
    try:
        for b in (batch, batch + 1):
            if b < 1:
                continue
            r = tracked_step(model, batch=b, image_size=size, optimizer=optimizer, dtype=dt, engine="cuda", steps=2, guard=False)
            a = r.measurement.allocator or {}
            used = nvml_used_bytes(dev)
            outside = None if used is None else used - torch.cuda.memory_reserved(dev)
            checks.append(GpuCheck(b, r.measurement.oom, a.get("max_memory_allocated"), a.get("max_memory_reserved"),
                                   outside, label_cuda(name) + f", allocator capped at {format_bytes(card)}"))
            torch.cuda.empty_cache()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
    return checks, (f"Checked on {name}: the caching allocator was limited to {format_bytes(card)} "
                    f"(torch.cuda.set_per_process_memory_fraction); the CUDA context sits outside that limit.")


# --- exercises and claims (lesson 04) ----------------------------------------------------------------

def exercise_largest_batch(model: str = "vgg16", card_gib: float = 16, optimizer: str = "sgd"):
    """Predict-first: solve the formulas' line for a card."""
    from gpulab.course.exercises import Exercise
    line = formula_line(model, optimizer=optimizer)
    cap = card_gib * GiB
    return Exercise(
        question=f"Using the formulas' fixed and per-sample bytes for {line.model} with {line.optimizer}, "
                 f"what is the largest batch that fits {card_gib:g} GiB?",
        expected=lambda: line.max_batch(cap),
        explain=f"(capacity − fixed) ÷ per-sample, rounded down: ({format_bytes(cap)} − "
                f"{format_bytes(line.fixed_bytes)}) ÷ {format_bytes(line.per_sample_bytes)} ({LABEL_FORMULA}). "
                f"The experiment below shows how far the measured line is from this one.",
        unit="images", rel_tol=0.02,
        hint="1 GiB = 1024³ bytes; subtract the fixed part first, then divide by the per-sample part.")


def exercise_steady_state_extra(model: str = "cnn", optimizer: str = "adam"):
    """Predict-first: how much higher is the second step's peak than the first's?"""
    from gpulab.course.exercises import Exercise
    from gpulab.predict.breakdown import breakdown as _bd
    from gpulab.formulas import optimizer_state_bytes
    bd = _bd(model)
    return Exercise(
        question=f"{bd.model} with {optimizer}: the peak of the first training step happens in backward. By how "
                 f"many bytes is the second step's peak higher?",
        expected=lambda: optimizer_state_bytes(bd.param_bytes, bd.param_tensors, optimizer),
        explain="The optimizer state that the first step() created stays alive through the second forward and "
                "backward; everything else is the same. For Adam: 2 × the parameter bytes (exp_avg, exp_avg_sq) "
                f"plus a 4-byte step counter per parameter tensor ({LABEL_FORMULA}).",
        unit="bytes", rel_tol=0.01,
        hint="Which tensors exist in step 2 that did not exist in step 1?",
        ratio_hint="count the state tensors the first step() created per parameter, each its parameter's size.")


def _pct(fraction: float) -> str:
    return "0.01%" if fraction < 1e-4 else f"{100 * fraction:.2g}%"


def sweep_claims(sweep: SweepResult, largest: LargestBatch | None = None):
    """The reference articles' claims about batch size and memory, with verdicts computed from
    the sweep (and the largest-batch answer, if given)."""
    from gpulab.course.claims import BREAKS, HOLDS, ClaimCheck, ClaimReport, Evidence
    good = [p for p in sweep.points if not p.oom]
    resid = max(abs(p.peak_bytes - sweep.fit.predict(p.batch)) / p.peak_bytes for p in good)
    lin = ClaimCheck(
        "GPU memory = model memory + batch_size × memory per sample.", "refs 000, 001",
        HOLDS if sweep.fit.r2 >= 0.999 and resid <= 0.02 else BREAKS,
        (f"A straight line fits the measured peaks with R² = {sweep.fit.r2:.5f}; no point is more than "
         f"{_pct(resid)} off it.") if sweep.fit.r2 >= 0.999 and resid <= 0.02 else
        (f"The peaks bend away from a line (R² = {sweep.fit.r2:.4f}, worst point {100 * resid:.1f}% off): "
         f"something besides the batch changes (algorithm choice, allocator rounding)."),
        [Evidence("fixed (intercept)", format_bytes(sweep.fit.fixed_bytes), sweep.fit_label),
         Evidence("per sample (slope)", format_bytes(sweep.fit.per_sample_bytes), sweep.fit_label),
         Evidence("R²", f"{sweep.fit.r2:.5f}", sweep.fit_label)])
    small = good[0]
    share = sweep.fit.fixed_bytes / small.peak_bytes
    prop = ClaimCheck(
        "Memory is not simply proportional to batch size: the model's own part stays when the batch shrinks.",
        "ref 001",
        HOLDS if share > 0.01 else BREAKS,
        f"At batch {small.batch} the fixed part is {100 * share:.0f}% of the peak; halving the batch does not halve "
        f"the memory." if share > 0.01 else
        f"The fixed part is only {100 * share:.1f}% of the peak at batch {small.batch}: here memory is close to "
        f"proportional to the batch.",
        [Evidence(f"peak at batch {small.batch}", format_bytes(small.peak_bytes), sweep.label),
         Evidence("fixed (intercept)", format_bytes(sweep.fit.fixed_bytes), sweep.fit_label)])
    f = sweep.formula
    e_slope = error_percent(f.per_sample_bytes, sweep.fit.per_sample_bytes) or 0.0
    saved = sweep.activations_fit.per_sample_bytes
    e_saved = error_percent(f.activations_per_sample, saved) or 0.0
    ok_slope, ok_saved = abs(e_slope) <= 10, abs(e_saved) <= 10
    if ok_slope and ok_saved:
        verdict, why = HOLDS, "Both the slope and the saved activations are within 10% of the layer outputs."
    elif not ok_slope and not ok_saved:
        verdict = BREAKS
        why = (f"Autograd does not keep every layer's output: it saves {format_bytes(saved)} per sample where "
               f"the outputs add up to {format_bytes(f.activations_per_sample)} ({e_saved:+.0f}%), and the "
               f"measured slope is {format_bytes(sweep.fit.per_sample_bytes)} ({e_slope:+.0f}%).")
    else:
        verdict = (f"holds for the slope ({e_slope:+.0f}%), breaks for what is saved ({e_saved:+.0f}%)" if ok_slope
                   else f"holds for what is saved ({e_saved:+.0f}%), breaks for the slope ({e_slope:+.0f}%)")
        why = (f"Autograd saves {format_bytes(saved)} per sample, not every output "
               f"({format_bytes(f.activations_per_sample)}); the slope also counts everything else that grows "
               f"with the batch at the peak (backward's gradient buffers, the input), so the totals come closer "
               f"than the accounts do.")
    per = ClaimCheck(
        "The per-sample part is the feature maps: every layer's output is kept for the backward pass.",
        "refs 001, 003", verdict, why,
        [Evidence("layer outputs per sample", format_bytes(f.activations_per_sample), LABEL_FORMULA),
         Evidence("saved activations per sample", format_bytes(saved), fit_label(sweep.label)),
         Evidence("slope (all per-sample memory)", format_bytes(sweep.fit.per_sample_bytes), sweep.fit_label)])
    checks = [lin, prop, per]
    if largest is not None:
        a = largest.answers[0]
        c = next((c for c in a.checks if c.batch == a.allocator_batch), None) or a.checks[0]
        extra = c.simulated_reserved - c.peak_bytes
        ev = [Evidence(f"live tensors at batch {c.batch}", format_bytes(c.peak_bytes), largest.sweep.label),
              Evidence(f"reserved at batch {c.batch}", format_bytes(c.simulated_reserved), LABEL_SIMULATED),
              Evidence("CUDA context", format_bytes(largest.context_overhead_bytes), LABEL_ASSUMPTION)]
        if largest.gpu_checks and largest.gpu_checks[0].outside_allocator is not None:
            g = largest.gpu_checks[0]
            ev.append(Evidence("outside the allocator", format_bytes(g.outside_allocator), g.label))
            ctx_txt = f"and the GPU measured {format_bytes(g.outside_allocator)} outside the allocator."
        else:
            ctx_txt = ("and the CUDA context comes on top; without a GPU its size is an assumption "
                       f"({format_bytes(largest.context_overhead_bytes)}), not a measurement.")
        checks.append(ClaimCheck(
            "Real usage is somewhat larger than the computed tensors, because of framework overhead.",
            "refs 000, 003", HOLDS if extra >= 0 else BREAKS,
            f"The caching allocator (simulated) reserves {format_bytes(extra)} more than the live tensors at "
            f"batch {c.batch}, {ctx_txt}", ev))
    return ClaimReport(f"What refs 000, 001 and 003 (docs/references.md) claim about batch size, tested on {sweep.model} ({sweep.label})", checks)
