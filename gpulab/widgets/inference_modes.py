"""no_grad / eval / inference_mode panel (lesson 06): one forward of a conv-BN-dropout net in
each mode -> peak, what stays alive while the output is held, what autograd saved (with the
formula), and what each switch changes. When the live engine is not cuda, the recorded GPU run with
the same settings is shown beside it, or a one-line note says that none matches."""
from __future__ import annotations

from typing import Any

from IPython.display import HTML

from gpulab.course.inference import ModesResult, inference_modes
from gpulab.record.lookup import RecordLookup, find_record
from gpulab.record.views import counter_text, recorded_html
from gpulab.units import format_bytes
from gpulab.widgets.base import Panel, dropdown, slider, ENGINES, engine_dropdown
from gpulab.widgets.guard import memory_guard

__all__ = [
    "compute_modes", "grad_modes_panel", "predict_modes_peak", "recorded_modes", "render_modes"
]



def compute_modes(batch: int, channels: int, image_size: int, engine: str) -> ModesResult:
    return inference_modes(int(batch), int(channels), int(image_size), engine)


def predict_modes_peak(params: dict[str, Any]) -> int:
    r = compute_modes(**dict(params, engine="fake"))
    return max(run.peak_bytes for run in r.runs.values())


def recorded_modes(result: ModesResult) -> RecordLookup:
    """The recorded GPU run with this result's settings, or why there is none."""
    return find_record("grad modes", batch=result.batch, channels=result.channels, image_size=result.image_size)


def _modes_rows(r: dict[str, Any]) -> list[list[str]]:
    rows = []
    for mode, run in r["runs"].items():
        rows.append([mode, format_bytes(run["peak_bytes"]), format_bytes(run["held_bytes"]),
                     format_bytes(run["saved_bytes"]),
                     counter_text(run)])
    return rows


def render_modes(result: ModesResult) -> list[Any]:
    recorded = [] if result.engine == "cuda" else [
        HTML(recorded_html(recorded_modes(result), _modes_rows,
                           ["mode", "peak (tracker)", "alive while the output is held", "saved for backward",
                            "max_memory_allocated − baseline"]))]
    return [result, result.figure(), *recorded]


def grad_modes_panel(batch: int = 64, channels: int = 32, image_size: int = 32, engine: str = "auto") -> Panel:
    controls = {
        "batch": slider("batch", batch, 1, 512, log=True),
        "channels": slider("channels", channels, 1, 256, log=True),
        "image_size": slider("image size", image_size, 8, 256, step=8),
        "engine": engine_dropdown(engine),
    }
    return Panel("train() / eval() × grad / no_grad / inference_mode", controls, compute_modes, render_modes,
                 guard=memory_guard(predict_modes_peak),
                 description="The same forward pass five ways. <code>eval()</code> changes what dropout and batch "
                             "norm do; <code>no_grad()</code> and <code>inference_mode()</code> change what "
                             "autograd keeps.")
