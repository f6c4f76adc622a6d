"""Tensor-bytes panels (lesson 01).

* ``tensor_bytes_panel``: shape x dtype x operation x engine -> x's storage, what the operation
  allocated, the peak, what y keeps alive after ``del x``: formula vs measured, and the figure;
  without a GPU, the recorded GPU run with the same settings (or a one-line note that none matches).
* ``rounding_panel``: small tensors on CUDA: the 512-byte blocks, by formula, by the simulated
  allocator, and measured when there is a GPU; without one, the recorded GPU run with the same
  settings (or a one-line note that none matches).
"""
from __future__ import annotations

from typing import Any

import ipywidgets as W
from IPython.display import HTML

from gpulab.course.tensor_bytes import (DEFAULT_SHAPE, OPERATIONS, TENSOR_CPU_LIMIT, RoundingResult, TensorBytesResult,
                            is_quantized, dtype_names, measure, predict, rounding_curve)
from gpulab.course.tensor_plots import rounding_figure, tensor_bytes_figure, to_png
from gpulab.record.lookup import RecordLookup, find_record
from gpulab.record.views import recorded_html
from gpulab.units import DTYPES, parse_dtype
from gpulab.widgets.base import ENGINES, GuardVerdict, Panel, dropdown, engine_dropdown, with_value
from gpulab.widgets.env import engine_guard

__all__ = [
    "ENGINE_OPTIONS", "compute_rounding", "compute_tensor_bytes", "predict_tensor_bytes_peak",
    "recorded_rounding", "recorded_tensor_bytes", "render_rounding", "render_tensor_bytes",
    "rounding_panel", "tensor_bytes_panel"
]

ENGINE_OPTIONS = list(ENGINES)   # every engine; a panel offers engine_choices()


def compute_tensor_bytes(shape: str, dtype: str, operation: str, engine: str) -> TensorBytesResult:
    return measure(shape, dtype, operation, engine)


def predict_tensor_bytes_peak(params: dict[str, Any]) -> int:
    """The guard's prediction: the same experiment on fake tensors (no memory used)."""
    return compute_tensor_bytes(**dict(params, engine="fake")).peak_bytes


def _guard(params: dict[str, Any]):
    if is_quantized(parse_dtype(params["dtype"])):
        return GuardVerdict(True)  # quantized dtypes run on cpu only, and fake tensors cannot hold them
    return engine_guard(predict_tensor_bytes_peak, lambda p: TENSOR_CPU_LIMIT,
                        lambda p: predict(p["shape"], p["dtype"], p["operation"]).peak_bytes)(params)


def recorded_tensor_bytes(result: TensorBytesResult) -> RecordLookup:
    """The recorded GPU run with this shape, dtype and operation, or why there is none."""
    return find_record("tensor bytes", shape=",".join(map(str, result.shape)), dtype=result.dtype,
                       operation=result.operation)


def _tensor_rows(r: dict[str, Any]) -> list[list[str]]:
    a = r.get("allocator") or {}
    rows = [["x's block: memory_allocated right after x", "—" if r.get("x_allocated") is None
             else f"{r['x_allocated']:,} B"],
            ["peak (tracker)", f"{r['peak_bytes']:,} B"],
            ["kept alive by y after del x (tracker)", f"{r['kept']:,} B"]]
    if a.get("peak_reserved_delta") is not None:
        rows.append(["max_memory_reserved − baseline", f"{a['peak_reserved_delta']:,} B"])
    return rows


def render_tensor_bytes(result: TensorBytesResult) -> list[Any]:
    recorded = [] if result.engine == "cuda" else [
        HTML(recorded_html(recorded_tensor_bytes(result), _tensor_rows, ["recorded figure", "bytes"]))]
    return [result, to_png(tensor_bytes_figure(result)), *recorded]


def tensor_bytes_panel(shape: str = DEFAULT_SHAPE, dtype: str = "float32", operation: str = "slice",
                       engine: str = "auto") -> Panel:
    controls = {
        "shape": W.Text(value=shape, description="shape", placeholder="e.g. 256,3,100,100",
                        continuous_update=False, style={"description_width": "initial"},
                        layout=W.Layout(width="220px")),
        "dtype": dropdown("dtype", dtype_names(), dtype),
        "operation": dropdown("operation", list(OPERATIONS), operation),
        "engine": engine_dropdown(engine),
    }
    return Panel("Tensor bytes: views, slices and copies", controls, compute_tensor_bytes,
                 render_tensor_bytes, auto_run=True, guard=_guard,
                 description="<code>x = torch.empty(shape, dtype)</code>, then the operation makes "
                             "<code>y</code>, then <code>del x</code>. Which bytes were allocated, "
                             "and which stay alive?")


def compute_rounding(dtype: str, max_elements: int, engine: str) -> RoundingResult:
    return rounding_curve(dtype, max_elements, engine)


def recorded_rounding(result: RoundingResult) -> RecordLookup:
    """The recorded GPU run with this dtype, covering this many elements, or why there is none."""
    return find_record("rounding", dtype=result.dtype, max_elements=result.elements[-1])


def _rounding_rows(r: dict[str, Any]) -> list[list[str]]:
    """One row per run of element counts that got the same ``memory_allocated``."""
    rows, start = [], 0
    els, alloc = r["elements"], r["memory_allocated"]
    for i in range(1, len(els) + 1):
        if i == len(els) or alloc[i] != alloc[start]:
            span = str(els[start]) if i - 1 == start else f"{els[start]}–{els[i - 1]}"
            rows.append([span, f"{r['requested'][start]:,}–{r['requested'][i - 1]:,} B", f"{alloc[start]:,} B"])
            start = i
    return rows


def render_rounding(result: RoundingResult) -> list[Any]:
    recorded = [] if result.engine == "cuda" else [
        HTML(recorded_html(recorded_rounding(result), _rounding_rows,
                           ["elements", "requested", "memory_allocated (measured)"]))]
    return [result, to_png(rounding_figure(result)), *recorded]


def rounding_panel(dtype: str = "float32", max_elements: int = 300, engine: str = "auto") -> Panel:
    plain = [d for d in dtype_names() if DTYPES[d].kind != "quantized"]
    controls = {
        "dtype": dropdown("dtype", plain, dtype),
        "max_elements": with_value("max_elements", W.IntSlider(value=16, min=16, max=2048, step=16,
                                                               description="up to elements", continuous_update=False,
                                                               style={"description_width": "initial"}), max_elements),
        "engine": engine_dropdown(engine),
    }
    return Panel("512-byte blocks on CUDA", controls, compute_rounding, render_rounding, auto_run=True,
                 description="Tensors of 0, 1, 2, … elements: the bytes they request, and what the CUDA "
                             "caching allocator counts for them.")
