"""Optimizer panel: SGD, momentum, Adam, AdamW, RMSprop, Adagrad side by side: optimizer state
before and after the first ``step()``, measured, next to the formulas' multipliers. When the live
engine is not cuda, a recorded GPU training step of the same model and batch with each optimizer
is shown beside it, or a one-line note says that none matches."""
from __future__ import annotations

from typing import Any

from IPython.display import HTML

from gpulab.training.optimizers import OPTIMIZERS
from gpulab.course.optimizers import OptimizerComparison, compare_optimizers, optimizer_run
from gpulab.record.lookup import RecordLookup, find_record_series
from gpulab.record.views import counter_text, recorded_html
from gpulab.units import format_bytes
from gpulab.widgets.base import Panel, model_controls
from gpulab.widgets.guard import memory_guard

__all__ = [
    "compute_optimizers", "optimizer_panel", "predict_optimizers_peak", "recorded_optimizers",
    "render_optimizers"
]


def compute_optimizers(model: str, batch: int, engine: str, progress=None) -> OptimizerComparison:
    """``compare_optimizers`` (the panel runs it on one CPU thread: ``Panel(threads=1)``)."""
    return compare_optimizers(model, OPTIMIZERS, int(batch), engine=engine, progress=progress)


def predict_optimizers_peak(params: dict[str, Any]) -> int:
    """Adam (the most state) on the fake engine: the largest peak of the comparison."""
    return optimizer_run(params["model"], "adam", batch=int(params["batch"]), engine="fake",
                         steps=1).measurement.peak_bytes


def recorded_optimizers(result: OptimizerComparison) -> RecordLookup:
    """One recorded GPU training step per optimizer of the comparison (same model, batch, image
    size, dtype, one step: what ``compare_optimizers`` runs)."""
    first = result.runs[0]
    return find_record_series("step", "optimizer", [r.optimizer for r in result.runs], model=first.model,
                              batch=first.batch, image_size=first.image_size, dtype=first.dtype, steps=1)


def _optimizer_rows(r: dict[str, Any]) -> list[list[str]]:
    rows = []
    for p in r["points"]:
        rows.append([p["optimizer"], format_bytes(p.get("after_step_by_category", {}).get("optimizer_state", 0)),
                     format_bytes(p["peak_bytes"]),
                     counter_text(p)])
    return rows


def render_optimizers(result: OptimizerComparison) -> list[Any]:
    recorded = [] if result.runs[0].engine == "cuda" else [
        HTML(recorded_html(recorded_optimizers(result), _optimizer_rows,
                           ["optimizer", "optimizer state after step() (tracker)", "peak (tracker)",
                            "max_memory_allocated − baseline"]))]
    return [result, result.plot(), *recorded]


def optimizer_panel(model: str = "mlp", batch: int = 8, engine: str = "auto") -> Panel:
    controls = model_controls(model, batch=batch, engine=engine)
    return Panel("Optimizer state, measured", controls, compute_optimizers, render_optimizers,
                 guard=memory_guard(predict_optimizers_peak), threads=1,
                 description="One training step per optimizer on a fresh model; the tracker's optimizer-state "
                             "bytes just before and just after <code>step()</code>, next to the formula.",
                 real_run="one training step per optimizer, real where the engine is cpu or cuda (after the fake "
                          "engine has checked that Adam's, the most state, fits)")
