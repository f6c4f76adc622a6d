"""Mixed-precision panel (lesson 08): fp32, autocast (bf16, or fp16 with GradScaler) and pure
16-bit training steps -> memory at the peak by category, measured ratios to fp32 against the
formula, bytes per parameter kept between steps."""
from __future__ import annotations

from typing import Any

from ..course.precision import LOW_DTYPES, PrecisionResult, precision_step
from .base import Panel, dropdown, model_controls
from .guard import memory_guard



def compute_precision(model: str, batch: int, image_size: int, optimizer: str, low: str,
                      engine: str) -> PrecisionResult:
    return precision_step(model, int(batch), int(image_size), optimizer, low, engine)


def predict_precision_peak(params: dict[str, Any]) -> int:
    r = compute_precision(**dict(params, engine="fake"))
    return max(run.peak_bytes for run in r.runs.values())


def render_precision(result: PrecisionResult) -> list[Any]:
    return [result, result.figure()]


def precision_panel(model: str = "cnn", batch: int = 32, image_size: int | None = None, optimizer: str = "adam",
                    low: str = "bfloat16", engine: str = "auto") -> Panel:
    controls = model_controls(model, batch=batch, image_size=image_size, optimizer=optimizer, engine=engine,
                              extra={"low": dropdown("16-bit dtype", LOW_DTYPES, low)})
    return Panel("Mixed precision: which tensors shrink", controls, compute_precision, render_precision,
                 guard=memory_guard(predict_precision_peak),
                 description="Two training steps each in float32, under <code>torch.autocast</code> (fp16 adds "
                             "<code>GradScaler</code>), and with the whole model in 16 bits; the peak of each by "
                             "category.")
