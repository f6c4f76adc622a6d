"""Training-step panel: model, batch, image size, optimizer, dtype, engine -> per-category
peak (measured) next to the formulas, and the memory timeline. When the live engine is not cuda,
the recorded GPU run with the same settings is shown beside it, labelled with its provenance
(``gpulab.record.lookup.find_record``), or a one-line note says that no recorded run matches."""
from __future__ import annotations

from typing import Any

from IPython.display import HTML

from gpulab.predict.step import StepResult, step as tracked_step
from gpulab.plots import comparison_bars, timeline
from gpulab.record.lookup import RecordLookup, find_record
from gpulab.record.views import allocator_rows, recorded_html
from gpulab.units import format_bytes
from gpulab.widgets.base import Panel, dropdown, model_controls
from gpulab.widgets.guard import memory_guard

__all__ = [
    "compute_step", "predict_step_peak", "recorded_step", "recorded_step_html", "render_step",
    "step_panel"
]


def compute_step(model: str, batch: int, image_size: int, optimizer: str, dtype: str, engine: str) -> StepResult:
    """One tracked step (the panel runs it on one CPU thread: ``Panel(threads=1)``)."""
    return tracked_step(model, batch=batch, image_size=image_size, optimizer=optimizer, dtype=dtype,
                        engine=engine, steps=1, guard=False)


def predict_step_peak(params: dict[str, Any]) -> int:
    p = dict(params, engine="fake")
    return compute_step(**p).peak_bytes


def recorded_step(result: StepResult) -> RecordLookup:
    """The recorded GPU run with this result's settings (``gpulab/recorded/``, or the folder
    $GPULAB_RECORDED_DIR names), or why there is none."""
    return find_record("step", model=result.model, batch=result.batch, image_size=result.image_size,
                       optimizer=result.optimizer, dtype=result.dtype, steps=result.steps)


def _step_rows(r: dict[str, Any]) -> list[list[str]]:
    rows = [["peak live tensors (tracker, 512 B blocks)", format_bytes(r["peak_bytes"])]]
    rows += allocator_rows(r)
    rows += [[f"peak: {k}", format_bytes(v)] for k, v in r.get("peak_by_category", {}).items() if v]
    return rows


def recorded_step_html(lookup: RecordLookup) -> str:
    """The recorded figures with their provenance label, or a one-line note saying why none."""
    return recorded_html(lookup, _step_rows)


def render_step(result: StepResult) -> list[Any]:
    m = result.measurement
    recorded = [] if m.engine == "cuda" else [HTML(recorded_step_html(recorded_step(result)))]
    if m.oom:
        return [result, *recorded]
    return [result, *recorded,
            comparison_bars(result.predicted, result.tensor_bytes_by_category, f"peak tensor bytes: {m.label}",
                            title=f"{result.model}, batch {result.batch}: formula vs {m.label}"),
            timeline(m.tracking, title=f"one training step, {m.label}")]


def step_panel(model: str = "cnn", batch: int = 32, image_size: int | None = None, optimizer: str = "sgd",
               dtype: str = "float32", engine: str = "auto") -> Panel:
    controls = model_controls(model, batch=batch, image_size=image_size, optimizer=optimizer, engine=engine,
                              extra={"dtype": dropdown("dtype", ["float32", "bfloat16", "float16"], dtype)})
    return Panel("One training step", controls, compute_step, render_step,
                 guard=memory_guard(predict_step_peak), threads=1,
                 description="Forward, backward and <code>optimizer.step()</code> on a fresh model; "
                             "peak live memory by category next to the formulas.")
