"""Implementation panel: the same optimizer run as a for-loop, with foreach kernels, and fused;
the temporaries each leaves alive at the peak of ``step()``."""
from __future__ import annotations

from typing import Any

from ..course.optimizers import IMPLEMENTATIONS, ImplementationComparison, compare_implementations, optimizer_run
from .base import Panel, model_controls
from .guard import memory_guard


def compute_implementations(model: str, optimizer: str, batch: int, engine: str,
                            progress=None) -> ImplementationComparison:
    return compare_implementations(model, optimizer, IMPLEMENTATIONS, int(batch), engine=engine, progress=progress)


def predict_implementations_peak(params: dict[str, Any]) -> int:
    return optimizer_run(params["model"], params["optimizer"], "foreach", int(params["batch"]),
                         engine="fake").measurement.peak_bytes


def render_implementations(result: ImplementationComparison) -> list[Any]:
    return [result, result.plot()]


def implementation_panel(model: str = "mlp", optimizer: str = "adam", batch: int = 8, engine: str = "auto") -> Panel:
    controls = model_controls(model, batch=batch, optimizer=optimizer, engine=engine)
    return Panel("for-loop vs foreach vs fused", controls, compute_implementations, render_implementations,
                 guard=memory_guard(predict_implementations_peak),
                 description="Two steps with each implementation of the optimizer; how many bytes of "
                             "temporaries are alive at the peak of the second <code>step()</code>.")
