"""del-in-forward panel (lesson 06): TinyUNet written with a name per intermediate vs one
reused name and del -> forward peak and whole-run peak, with and without autograd. When the live
engine is not cuda, the recorded GPU run with the same settings is shown beside it, or a one-line
note says that none matches."""
from __future__ import annotations

from typing import Any

from IPython.display import HTML

from gpulab.course.inference import GRAD_MODES, LifetimesResult, forward_lifetimes
from gpulab.record.lookup import RecordLookup, find_record
from gpulab.record.views import counter_text, recorded_html
from gpulab.units import format_bytes
from gpulab.widgets.base import Panel, dropdown, slider, ENGINES, engine_dropdown
from gpulab.widgets.guard import memory_guard

__all__ = [
    "compute_lifetimes", "lifetimes_panel", "predict_lifetimes_peak", "recorded_lifetimes",
    "render_lifetimes"
]



def compute_lifetimes(grad_mode: str, batch: int, channels: int, image_size: int, engine: str) -> LifetimesResult:
    return forward_lifetimes(grad_mode, int(batch), int(channels), int(image_size), engine)


def predict_lifetimes_peak(params: dict[str, Any]) -> int:
    r = compute_lifetimes(**dict(params, engine="fake"))
    return max(run.peak_bytes for run in r.runs.values())


def recorded_lifetimes(result: LifetimesResult) -> RecordLookup:
    """The recorded GPU run with this result's settings, or why there is none."""
    return find_record("lifetimes", grad_mode=result.grad_mode, batch=result.batch, channels=result.channels,
                       image_size=result.image_size)


def _lifetimes_rows(r: dict[str, Any]) -> list[list[str]]:
    rows = []
    for style, run in r["runs"].items():
        rows.append([style, format_bytes(run["forward_peak"]), format_bytes(run["peak_bytes"]),
                     counter_text(run)])
    return rows


def render_lifetimes(result: LifetimesResult) -> list[Any]:
    recorded = [] if result.engine == "cuda" else [
        HTML(recorded_html(recorded_lifetimes(result), _lifetimes_rows,
                           ["forward written with", "forward peak beyond params and input (tracker)",
                            "peak (tracker)", "max_memory_allocated − baseline"]))]
    return [result, result.figure(), *recorded]


def lifetimes_panel(grad_mode: str = "no_grad forward", batch: int = 8, channels: int = 16, image_size: int = 64,
                    engine: str = "auto") -> Panel:
    controls = {
        "grad_mode": dropdown("mode", GRAD_MODES, grad_mode),
        "batch": slider("batch", batch, 1, 128, log=True),
        "channels": slider("channels", channels, 1, 128, log=True),
        "image_size": slider("image size", image_size, 16, 256, step=16),
        "engine": engine_dropdown(engine),
    }
    return Panel("del and name reuse inside forward", controls, compute_lifetimes, render_lifetimes,
                 guard=memory_guard(predict_lifetimes_peak),
                 description="A small U-Net whose <code>forward</code> is written two ways: every intermediate "
                             "under its own name, or one reused name with <code>del</code> after each skip "
                             "tensor's last use.")
