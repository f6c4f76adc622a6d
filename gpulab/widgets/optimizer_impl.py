"""Implementation panel: the same optimizer run as a for-loop, with foreach kernels, and fused;
the temporaries each leaves alive at the peak of ``step()``. When the live engine is not cuda, the
recorded GPU run with the same settings is shown beside it (where CUDA's foreach and fused kernels
really ran), or a one-line note says that none matches."""
from __future__ import annotations

from typing import Any

from IPython.display import HTML

from gpulab.course.optimizers import IMPLEMENTATIONS, ImplementationComparison, compare_implementations, optimizer_run
from gpulab.record.lookup import RecordLookup, find_record
from gpulab.record.views import recorded_html
from gpulab.units import format_bytes
from gpulab.widgets.base import Panel, model_controls
from gpulab.widgets.guard import memory_guard

__all__ = [
    "compute_implementations", "implementation_panel", "predict_implementations_peak",
    "recorded_implementations", "render_implementations"
]


def compute_implementations(model: str, optimizer: str, batch: int, engine: str,
                            progress=None) -> ImplementationComparison:
    """``compare_implementations`` (the panel runs it on one CPU thread: ``Panel(threads=1)``)."""
    return compare_implementations(model, optimizer, IMPLEMENTATIONS, int(batch), engine=engine,
                                   progress=progress)


def predict_implementations_peak(params: dict[str, Any]) -> int:
    return optimizer_run(params["model"], params["optimizer"], "foreach", int(params["batch"]),
                         engine="fake").measurement.peak_bytes


def recorded_implementations(result: ImplementationComparison) -> RecordLookup:
    """The recorded GPU run with this model, optimizer, batch and image size, or why there is none."""
    first = next(r.run for r in result.rows if r.run is not None)
    return find_record("implementations", model=result.model, optimizer=result.optimizer, batch=first.batch,
                       image_size=first.image_size, steps=first.steps)


def _implementation_rows(r: dict[str, Any]) -> list[list[str]]:
    rows = []
    for impl, row in r["implementations"].items():
        if "unsupported" in row:
            rows.append([impl, "not supported", "", "", row["unsupported"]])
            continue
        rows.append([impl, format_bytes(row["step_temporaries"]), format_bytes(row["step_rise"]),
                     format_bytes(row["step_peak"]), ""])
    return rows


def render_implementations(result: ImplementationComparison) -> list[Any]:
    live = next((r.run for r in result.rows if r.run is not None), None)
    recorded = [] if live is None or live.engine == "cuda" else [
        HTML(recorded_html(recorded_implementations(result), _implementation_rows,
                           ["implementation", "temporaries at the step() peak", "rise inside step()",
                            "live at the step() peak", ""]))]
    return [result, result.plot(), *recorded]


def implementation_panel(model: str = "mlp", optimizer: str = "adam", batch: int = 8, engine: str = "auto") -> Panel:
    controls = model_controls(model, batch=batch, optimizer=optimizer, engine=engine)
    return Panel("for-loop vs foreach vs fused", controls, compute_implementations, render_implementations,
                 guard=memory_guard(predict_implementations_peak), threads=1,
                 description="Two steps with each implementation of the optimizer; how many bytes of "
                             "temporaries are alive at the peak of the second <code>step()</code>.",
                 real_run="two training steps per implementation, real where the engine is cpu or cuda")
