"""no_grad / eval / inference_mode panel (lesson 06): one forward of a conv-BN-dropout net in
each mode -> peak, what stays alive while the output is held, what autograd saved (with the
formula), and what each switch changes."""
from __future__ import annotations

from typing import Any

from ..course.inference import ModesResult, inference_modes
from .base import Panel, dropdown, slider, ENGINES
from .guard import memory_guard



def compute_modes(batch: int, channels: int, image_size: int, engine: str) -> ModesResult:
    return inference_modes(int(batch), int(channels), int(image_size), engine)


def predict_modes_peak(params: dict[str, Any]) -> int:
    r = compute_modes(**dict(params, engine="fake"))
    return max(run.peak_bytes for run in r.runs.values())


def render_modes(result: ModesResult) -> list[Any]:
    return [result, result.figure()]


def grad_modes_panel(batch: int = 64, channels: int = 32, image_size: int = 32, engine: str = "auto") -> Panel:
    controls = {
        "batch": slider("batch", batch, 1, 512, log=True),
        "channels": slider("channels", channels, 1, 256, log=True),
        "image_size": slider("image size", image_size, 8, 256, step=8),
        "engine": dropdown("engine", ENGINES, engine),
    }
    return Panel("train() / eval() × grad / no_grad / inference_mode", controls, compute_modes, render_modes,
                 guard=memory_guard(predict_modes_peak),
                 description="The same forward pass five ways. <code>eval()</code> changes what dropout and batch "
                             "norm do; <code>no_grad()</code> and <code>inference_mode()</code> change what "
                             "autograd keeps.")
