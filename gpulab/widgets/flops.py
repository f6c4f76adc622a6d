"""Lesson 03 panels on compute: where the parameters and the FLOPs are (AlexNet), and a
depthwise-separable block against a standard convolution (when the live engine is not cuda, with
the recorded GPU run of the same settings beside it, or a one-line note that none matches)."""
from __future__ import annotations

from typing import Any

import ipywidgets as W
from IPython.display import HTML

from gpulab.course.activations import ACT_DTYPES
from gpulab.course.flops import (DepthwiseResult, ParamsFlops, depthwise_figure, depthwise_vs_standard,
                                 params_flops_figure, params_vs_flops)
from gpulab.record.lookup import RecordLookup, find_record
from gpulab.record.views import recorded_html
from gpulab.units import format_bytes
from gpulab.widgets.base import Panel, dropdown, slider, ENGINES, engine_dropdown, model_controls
from gpulab.widgets.guard import memory_guard

__all__ = [
    "compute_depthwise", "compute_flops", "depthwise_panel", "flops_panel", "recorded_depthwise",
    "render_depthwise", "render_flops"
]



# --- params vs FLOPs ------------------------------------------------------------------------------

def compute_flops(model: str, batch: int, image_size: int) -> ParamsFlops:
    return params_vs_flops(model, batch, image_size)


def render_flops(result: ParamsFlops) -> list[Any]:
    return [result, params_flops_figure(result)]


def flops_panel(model: str = "alexnet", batch: int = 1, image_size: int | None = None) -> Panel:
    controls = model_controls(model, batch=batch, image_size=image_size, image_min=32, engine=None)
    return Panel("Where the parameters are, where the FLOPs are", controls, compute_flops, render_flops,
                 auto_run=True,
                 description="Per layer with weights: its share of the parameters (numel) and of the "
                             "forward FLOPs (formula, checked against <code>FlopCounterMode</code>).")


# --- depthwise-separable vs standard ------------------------------------------------------------------

def compute_depthwise(in_channels: int, out_channels: int, image_size: int, batch: int, bn_relu: bool,
                      dtype: str, engine: str) -> DepthwiseResult:
    """Both convolutions (the panel runs them on one CPU thread: ``Panel(threads=1)``)."""
    return depthwise_vs_standard(in_channels, out_channels, image_size, batch, bn_relu, dtype, engine)


def recorded_depthwise(result: DepthwiseResult) -> RecordLookup:
    """The recorded GPU run with this result's settings, or why there is none."""
    return find_record("depthwise", in_channels=result.in_channels, out_channels=result.out_channels,
                       image_size=result.image_size, batch=result.batch, bn_relu=result.bn_relu, dtype=result.dtype)


def _depthwise_rows(r: dict[str, Any]) -> list[list[str]]:
    return [[k, format_bytes(b["saved"]), format_bytes(b["grad_peak"]), format_bytes(b["no_grad_peak"]),
             format_bytes(b["param_bytes"])] for k, b in r["blocks"].items()]


def render_depthwise(result: DepthwiseResult) -> list[Any]:
    recorded = [] if result.engine == "cuda" else [
        HTML(recorded_html(recorded_depthwise(result), _depthwise_rows,
                           ["block", "saved for backward", "forward peak with grad", "no_grad forward peak",
                            "parameters"]))]
    return [result, depthwise_figure(result), *recorded]


def _depthwise_bytes(params: dict[str, Any]) -> int:
    from gpulab.units import dtype_bytes
    plane = params["batch"] * params["image_size"] ** 2 * dtype_bytes(params["dtype"])
    return 8 * (params["in_channels"] + params["out_channels"]) * plane  # formula, generous


def depthwise_panel(in_channels: int = 64, out_channels: int = 128, image_size: int = 56, batch: int = 8,
                    bn_relu: bool = True, dtype: str = "float32", engine: str = "auto") -> Panel:
    controls = {
        "in_channels": slider("in channels", in_channels, 8, 1024, step=8),
        "out_channels": slider("out channels", out_channels, 8, 1024, step=8),
        "image_size": slider("feature map", image_size, 4, 224, step=4),
        "batch": slider("batch", batch, 1, 256, log=True),
        "bn_relu": W.Checkbox(value=bn_relu, description="BatchNorm + ReLU after each conv", indent=False),
        "dtype": dropdown("dtype", ACT_DTYPES, dtype),
        "engine": engine_dropdown(engine),
    }
    return Panel("Depthwise-separable vs standard convolution", controls, compute_depthwise, render_depthwise,
                 auto_run=True, guard=memory_guard(_depthwise_bytes), threads=1,
                 description="A standard 3×3 conv and a MobileNet block (3×3 depthwise, then 1×1 pointwise) "
                             "with the same channels, on the same input: parameters, FLOPs, and the "
                             "bytes autograd saves for backward.")
