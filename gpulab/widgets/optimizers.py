"""Optimizer panel: SGD, momentum, Adam, AdamW, RMSprop, Adagrad side by side: optimizer state
before and after the first ``step()``, measured, next to the formulas' multipliers."""
from __future__ import annotations

from typing import Any

from ..experiments import OPTIMIZERS
from ..course.optimizers import OptimizerComparison, compare_optimizers, optimizer_run
from .base import Panel, model_controls
from .guard import memory_guard


def compute_optimizers(model: str, batch: int, engine: str, progress=None) -> OptimizerComparison:
    return compare_optimizers(model, OPTIMIZERS, int(batch), engine=engine, progress=progress)


def predict_optimizers_peak(params: dict[str, Any]) -> int:
    """Adam (the most state) on the fake engine: the largest peak of the comparison."""
    return optimizer_run(params["model"], "adam", batch=int(params["batch"]), engine="fake",
                         steps=1).measurement.peak_bytes


def render_optimizers(result: OptimizerComparison) -> list[Any]:
    return [result, result.plot()]


def optimizer_panel(model: str = "mlp", batch: int = 8, engine: str = "auto") -> Panel:
    controls = model_controls(model, batch=batch, engine=engine)
    return Panel("Optimizer state, measured", controls, compute_optimizers, render_optimizers,
                 guard=memory_guard(predict_optimizers_peak),
                 description="One training step per optimizer on a fresh model; the tracker's optimizer-state "
                             "bytes just before and just after <code>step()</code>, next to the formula.")
