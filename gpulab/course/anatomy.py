"""The anatomy of a training step: when the peak happens and what it is made of.

``step_anatomy`` tracks ``steps`` training steps (``gpulab.predict.step.training_step``) and
cuts the timeline into segments, one per phase of each step (setup, forward 1, backward 1,
optimizer 1, forward 2, ...). For each segment: its highest live total and the categories at
that moment, so "the first step" and "the steady state" can be compared, and one can see
that the optimizer state created by the first ``step()`` is alive during the second forward.
The storages alive at the overall peak are listed, largest first.
"""
from __future__ import annotations

import html
from dataclasses import dataclass

import torch

from gpulab.measure.engines import LABEL_FAKE_CUDA
from gpulab.predict.step import StepResult, step as tracked_step
from gpulab.measure.fake_cuda import STILL_DIFFERS
from gpulab.categories import CATEGORIES
from gpulab.measure.tracking import TrackingResult
from gpulab.units import format_bytes
from gpulab.plots import to_png as as_png
from gpulab.views import html_table

__all__ = [
    "FakeCudaDifferences", "Segment", "StepAnatomy", "StorageRow", "exercise_peak_category",
    "fake_cuda_differences", "legend_outside", "segments", "step_anatomy"
]


@dataclass(frozen=True)
class FakeCudaDifferences:
    """What a fake-engine step answering for a GPU (*fake tensors, CUDA kernels' allocations*)
    still cannot match on a real one: ``gpulab.measure.fake_cuda.STILL_DIFFERS``, for lesson 04."""
    rows: tuple[tuple[str, str], ...] = STILL_DIFFERS
    label: str = LABEL_FAKE_CUDA

    def shown_rows(self) -> list[tuple[str, str]]:
        """The rows, the CUDA context's with the size fit and serve assume and its source (rendered
        from ``gpulab.predict.context``: the measurement it rests on, never a typed figure)."""
        from gpulab.predict.cards import CUDA_CONTEXT_ASSUMED
        from gpulab.predict.context import CONTEXT_MEASUREMENTS
        m = next(m for m in CONTEXT_MEASUREMENTS if m.nbytes == CUDA_CONTEXT_ASSUMED)
        said = f": {m.nbytes / 2**20:,.2f} MiB assumed, measured on {m.gpu} ({m.what}; {m.software}; {m.source})"
        return [(name, why + said if name == "CUDA context" else why) for name, why in self.rows]

    def __repr__(self) -> str:
        return "\n".join([f"not in '{self.label}':"] + [f"- {name}: {why}" for name, why in self.shown_rows()])

    def _repr_html_(self) -> str:
        return html_table(["not predicted", "why"], self.shown_rows(),
                          f"what '{self.label}' still cannot match on a real GPU")


def fake_cuda_differences() -> FakeCudaDifferences:
    return FakeCudaDifferences()


_OPT_NAMES = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "momentum": "SGD with momentum"}
_PEAK_OPTIONS = {"a": "parameters", "b": "gradients", "c": "optimizer_state", "d": "activations"}


def exercise_peak_category(model: str = "cnn", batch: int = 32, optimizer: str = "adam", engine: str = "fake"):
    """Predict-first (qualitative): at the peak of the steady-state (second) training step, which
    category is largest? Read from ``step_anatomy`` (fake engine by default: fast) when checked."""
    from gpulab.course.exercises import ChoiceExercise
    cache: dict[str, StepAnatomy] = {}

    def anatomy() -> StepAnatomy:
        if "a" not in cache:
            cache["a"] = step_anatomy(model, batch=batch, optimizer=optimizer, engine=engine)
        return cache["a"]

    def expected() -> str:
        cats = anatomy().step_peak(2).by_category
        return max(_PEAK_OPTIONS, key=lambda k: cats.get(_PEAK_OPTIONS[k], 0))

    def explain() -> str:
        a = anatomy()
        seg = a.step_peak(2)
        sizes = ", ".join(f"{cat.replace('_', ' ')} {format_bytes(seg.by_category.get(cat, 0))}"
                          for cat in _PEAK_OPTIONS.values())
        return (f"The second step peaks in {seg.name}: {sizes} ({a.label}). Parameters, gradients and "
                f"{_OPT_NAMES.get(optimizer, optimizer)}'s state depend only on the model; the tensors autograd saved for backward grow with "
                f"the batch, and for a CNN with {batch} images they outweigh the rest. Lower the batch or use an "
                f"MLP and the answer can change.")

    return ChoiceExercise(
        question=(f"The small {model.upper()} trained with {_OPT_NAMES.get(optimizer, optimizer)}, batch {batch}. At the peak of the second "
                  f"training step (the steady state), which category holds the most memory?"),
        options={"a": "the parameters", "b": "the gradients", "c": "the optimizer state",
                 "d": "the activations autograd saved for backward"},
        expected=expected, explain=explain,
        hint="Look again at what is alive at the peak, and which of it grows with the batch")


@dataclass
class Segment:
    """One phase of one step on the timeline: events [start, end)."""
    phase: str
    step: int            # 0 for setup, then 1, 2, ...
    start: int
    end: int
    peak_bytes: int      # highest live total inside the segment
    peak_index: int
    by_category: dict[str, int]  # live bytes per category at that moment

    @property
    def name(self) -> str:
        return self.phase if self.step == 0 else f"{self.phase} {self.step}"


def segments(tracking: TrackingResult) -> list[Segment]:
    """Cut a tracked timeline into consecutive phase segments. A new step starts at each
    forward that follows an optimizer phase (or the setup)."""
    out: list[Segment] = []
    step = 0
    events, series = tracking.events, tracking.series
    i = 0
    while i < len(events):
        phase = events[i].phase
        if phase == "forward" and (not out or out[-1].phase != "forward"):
            step += 1
        j = i
        best, best_i = -1, i
        while j < len(events) and events[j].phase == phase:
            tot = sum(series[j].values())
            if tot > best:
                best, best_i = tot, j
            j += 1
        out.append(Segment(phase, 0 if phase == "setup" else max(step, 1), i, j, best, best_i,
                           dict(series[best_i])))
        i = j
    return out


@dataclass
class StorageRow:
    category: str
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    module: str
    op: str
    created_in: str


@dataclass
class StepAnatomy:
    step: StepResult
    segments: list[Segment]
    top: list[StorageRow]            # alive at the overall peak, largest first
    top_total: int                   # how many storages were alive then

    @property
    def label(self) -> str:
        return self.step.measurement.label

    @property
    def tracking(self) -> TrackingResult:
        return self.step.measurement.tracking

    @property
    def peak_segment(self) -> Segment:
        return max(self.segments, key=lambda s: s.peak_bytes)

    def step_peak(self, step: int) -> Segment:
        """The segment holding the highest live total of training step ``step``."""
        cands = [s for s in self.segments if s.step == step]
        if not cands:
            raise KeyError(f"no step {step}; this run has {self.step.steps}")
        return max(cands, key=lambda s: s.peak_bytes)

    def segment(self, name: str) -> Segment:
        for s in self.segments:
            if s.name == name:
                return s
        raise KeyError(f"no segment {name!r}; segments: {', '.join(s.name for s in self.segments)}")

    def _repr_html_(self) -> str:
        r = self.step
        peak = self.peak_segment
        where = f" in <code>{html.escape(self.tracking.peak_module)}</code>" if self.tracking.peak_module else ""
        head = (f"<b>{html.escape(r.model)}</b>, batch {r.batch}, {html.escape(r.optimizer)}, {r.steps} step(s) — "
                f"engine <b>{r.engine}</b> ({html.escape(r.measurement.reason)})<br>"
                f"Peak <b>{format_bytes(r.peak_bytes)}</b> during <b>{peak.name}</b>{where}.")
        cats = [c.value for c in CATEGORIES]
        rows = [[s.name, format_bytes(s.peak_bytes)] + [format_bytes(s.by_category.get(c, 0)) for c in cats]
                for s in self.segments]
        t1 = html_table(["segment", "highest live"] + [c.replace("_", " ") for c in cats], rows,
                        f"each segment at its own highest moment: {self.label}; binary units")
        rows2 = [[s.category, format_bytes(s.nbytes), "×".join(map(str, s.shape)) or "scalar", s.dtype,
                  s.module or "—", s.op, s.created_in] for s in self.top]
        t2 = html_table(["category", "bytes", "shape", "dtype", "created in module", "op", "created during"],
                        rows2, f"the {len(self.top)} largest of the {self.top_total} storages alive at the peak "
                               f"({self.label})")
        return head + t1 + t2

    def figure(self, title: str | None = None):
        from gpulab.plots import timeline
        r = self.step
        fig = timeline(self.tracking, title=title or f"{r.model}, batch {r.batch}, {r.optimizer}, "
                                                     f"{r.steps} step(s): {self.label}")
        return legend_outside(fig)

    def plot(self):
        """``figure()`` as a PNG image (what a notebook cell shows)."""
        return as_png(self.figure())


def legend_outside(fig, width: float = 8.8):
    """Move a figure's legend to the right of the plot, where it hides no data (the figure
    widens so the plot keeps its size)."""
    fig.set_size_inches(width, fig.get_size_inches()[1])
    for ax in fig.axes:
        if ax.get_legend() is not None:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7.5, ncols=1, frameon=False)
    return fig


def step_anatomy(model: str = "cnn", batch: int | None = 32, optimizer: str = "adam", engine: str = "auto",
                 steps: int = 2, image_size: int | None = None, dtype: str | torch.dtype = "float32",
                 top: int = 8) -> StepAnatomy:
    """Track ``steps`` training steps and take the timeline apart (see the module docstring)."""
    r = tracked_step(model, batch=batch, image_size=image_size, optimizer=optimizer, dtype=dtype, engine=engine, steps=steps, guard=False)
    if r.measurement.oom:
        raise MemoryError(f"{r.model} batch {r.batch} ran out of memory on {r.engine}: {r.measurement.error}")
    tr = r.measurement.tracking
    alive = tr.live_at(tr.peak_index) if tr.peak_index >= 0 else []
    alive.sort(key=lambda rec: tr.storage_bytes(rec), reverse=True)
    rows = [StorageRow(rec.category.value, tr.storage_bytes(rec), rec.shape, rec.dtype, rec.module, rec.op, rec.phase)
            for rec in alive[:top]]
    return StepAnatomy(r, segments(tr), rows, len(alive))
