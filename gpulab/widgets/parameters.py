"""Lesson 02 panels: one layer's parameters and buffers (``layer_panel``) and a whole
model layer by layer (``parameters_panel``), formula next to what the engine built. When the live
engine is not cuda, each panel shows the recorded GPU build of the same layer or model and dtype
beside it, or a one-line note says that none matches."""
from __future__ import annotations

from typing import Any

import ipywidgets as W
from IPython.display import HTML

from gpulab.models.registry import MODELS, build_model, resolve_model
from gpulab.course.parameters import (LAYER_KINDS, MODEL_DTYPES, LayerParams, ModelParams, buffer_bytes_by_formula,
                          dtype_figure, layer_figure, layer_params, make_layer, model_layers_figure,
                          model_params)
from gpulab.record.lookup import RecordLookup, find_record
from gpulab.record.views import allocator_rows, recorded_html
from gpulab.units import format_bytes, parse_dtype
from gpulab.widgets.base import Panel, dropdown, ENGINES, engine_dropdown, with_value
from gpulab.widgets.guard import memory_guard

__all__ = [
    "compute_layer", "compute_model", "layer_panel", "parameters_panel", "recorded_layer",
    "recorded_model", "render_layer", "render_model"
]



def _int_box(description: str, value: int, max_value: int) -> W.BoundedIntText:
    return with_value(description, W.BoundedIntText(value=1, min=1, max=max_value, description=description,
                                                    style={"description_width": "initial"},
                                                    layout=W.Layout(width="150px")), value)


# --- one layer ----------------------------------------------------------------------------------

def compute_layer(kind: str, in_size: int, out_size: int, kernel: int, groups: int, bias: bool,
                  dtype: str, engine: str) -> LayerParams:
    return layer_params(kind, in_size, out_size, kernel, groups, bias, dtype, engine)


def _layer_bytes(params: dict[str, Any]) -> int:
    """Formula bytes of the layer (built on the meta device: no memory)."""
    dt = parse_dtype(params["dtype"])
    layer = make_layer(params["kind"], params["in_size"], params["out_size"], params["kernel"],
                       params["groups"], params["bias"], device="meta", dtype=dt)
    return sum(p.numel() for p in layer.parameters()) * dt.itemsize + buffer_bytes_by_formula(layer)


def recorded_layer(result: LayerParams) -> RecordLookup:
    """The recorded GPU build of this very layer (its ``repr``) in this dtype, or why there is none."""
    return find_record("layer build", layer=result.module_repr, dtype=result.dtype)


def render_layer(result: LayerParams) -> list[Any]:
    recorded = [] if result.engine == "cuda" else [HTML(recorded_html(recorded_layer(result), _model_rows))]
    return [result, layer_figure(result), *recorded]


def layer_panel(kind: str = "Conv2d", in_size: int = 64, out_size: int = 128, kernel: int = 3,
                groups: int = 1, bias: bool = True, dtype: str = "float32", engine: str = "auto") -> Panel:
    controls = {
        "kind": dropdown("layer", LAYER_KINDS, kind),
        "in_size": _int_box("in", in_size, 1_000_000),
        "out_size": _int_box("out", out_size, 100_000),
        "kernel": with_value("kernel", W.IntSlider(value=1, min=1, max=11, description="kernel",
                                                   continuous_update=False, style={"description_width": "initial"}),
                             kernel),
        "groups": _int_box("groups", groups, 100_000),
        "bias": W.Checkbox(value=bias, description="bias", indent=False, layout=W.Layout(width="80px")),
        "dtype": dropdown("dtype", MODEL_DTYPES, dtype),
        "engine": engine_dropdown(engine),
    }
    return Panel("One layer: formula vs the real module", controls, compute_layer, render_layer,
                 auto_run=True, guard=memory_guard(_layer_bytes),
                 description="Conv2d uses in, out, kernel, groups, bias; Linear uses in, out, bias; "
                             "BatchNorm2d and LayerNorm use <i>out</i> as the number of features; "
                             "Embedding uses <i>in</i> as the vocabulary size and <i>out</i> as the "
                             "embedding dimension.")


# --- a whole model ------------------------------------------------------------------------------

def compute_model(model: str, dtype: str, engine: str) -> ModelParams:
    return model_params(model, dtype, engine)


def _model_bytes(params: dict[str, Any]) -> int:
    dt = parse_dtype(params["dtype"])
    net = build_model(resolve_model(params["model"]), device="meta", dtype=dt)
    return sum(p.numel() for p in net.parameters()) * dt.itemsize


def recorded_model(result: ModelParams) -> RecordLookup:
    """The recorded GPU build of this model in this dtype, or why there is none."""
    return find_record("model build", model=result.model, dtype=result.dtype)


def _model_rows(r: dict[str, Any]) -> list[list[str]]:
    live = r.get("live_by_category", {})
    return [["parameters, live once built (tracker, numel × itemsize)", format_bytes(live.get("parameters", 0))],
            ["buffers, live once built (tracker)", format_bytes(live.get("buffers", 0))], *allocator_rows(r)]


def render_model(result: ModelParams) -> list[Any]:
    recorded = [] if result.engine == "cuda" else [HTML(recorded_html(recorded_model(result), _model_rows))]
    return [result, model_layers_figure(result), dtype_figure(result), *recorded]


def parameters_panel(model: str = "vgg16", dtype: str = "float32", engine: str = "auto") -> Panel:
    controls = {
        "model": dropdown("model", list(MODELS), model),
        "dtype": dropdown("dtype", MODEL_DTYPES, dtype),
        "engine": engine_dropdown(engine),
    }
    return Panel("A model layer by layer: formula vs numel()", controls, compute_model, render_model,
                 auto_run=True, guard=memory_guard(_model_bytes),
                 description="Every leaf layer's parameter formula next to <code>numel()</code> of the "
                             "built layer; parameter and buffer memory measured by the tracker; "
                             "the weight memory in every dtype.")
