"""Training-step panel: model, batch, image size, optimizer, dtype, engine -> per-category
peak (measured) next to the formulas, and the memory timeline."""
from __future__ import annotations

from typing import Any

from ..experiments import StepResult, training_step
from ..plots import comparison_bars, timeline
from .base import Panel, dropdown, model_controls
from .guard import memory_guard


def compute_step(model: str, batch: int, image_size: int, optimizer: str, dtype: str, engine: str) -> StepResult:
    return training_step(model, batch, image_size, optimizer, dtype, engine)


def predict_step_peak(params: dict[str, Any]) -> int:
    p = dict(params, engine="fake")
    return compute_step(**p).peak_bytes


def render_step(result: StepResult) -> list[Any]:
    m = result.measurement
    if m.oom:
        return [result]
    return [result,
            comparison_bars(result.predicted, result.tensor_bytes_by_category, f"peak tensor bytes: {m.label}",
                            title=f"{result.model}, batch {result.batch}: formula vs {m.label}"),
            timeline(m.tracking, title=f"one training step, {m.label}")]


def step_panel(model: str = "cnn", batch: int = 32, image_size: int | None = None, optimizer: str = "sgd",
               dtype: str = "float32", engine: str = "auto") -> Panel:
    controls = model_controls(model, batch=batch, image_size=image_size, optimizer=optimizer, engine=engine,
                              extra={"dtype": dropdown("dtype", ["float32", "bfloat16", "float16"], dtype)})
    return Panel("One training step", controls, compute_step, render_step,
                 guard=memory_guard(predict_step_peak),
                 description="Forward, backward and <code>optimizer.step()</code> on a fresh model; "
                             "peak live memory by category next to the formulas.")
