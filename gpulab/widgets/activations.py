"""Lesson 03 panels on activations: the per-layer forward table (cs231n), inference vs
training, and the articles' ``modelsize()`` estimate against what autograd saves. When the live
engine is not cuda, each panel shows the recorded GPU run with the same settings beside the live
one, or a one-line note says that none matches."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

from IPython.display import HTML

from gpulab.course.activations import (ACT_DTYPES, ForwardTable, InferenceVsTraining, forward_table,
                                       forward_table_figure, inference_training_figure, inference_vs_training,
                                       predicted_forward_bytes)
from gpulab.course.modelsize import ModelsizeComparison, modelsize_figure, modelsize_vs_saved
from gpulab.models.registry import MODELS
from gpulab.record.lookup import RecordLookup, find_record
from gpulab.record.views import counter_text, allocator_rows, recorded_html
from gpulab.units import format_bytes
from gpulab.widgets.base import Panel, dropdown, slider, ENGINES, engine_dropdown, model_controls
from gpulab.widgets.guard import memory_guard

__all__ = [
    "compute_inference", "compute_modelsize", "compute_table", "forward_table_panel",
    "inference_panel", "modelsize_panel", "render_inference", "render_modelsize", "render_table"
]



def _guard_bytes(params: dict[str, Any]) -> int:
    """Formula (weights + every layer output), cheap; enough to refuse a run that cannot fit."""
    return predicted_forward_bytes(params["model"], params["batch"], params["image_size"], params["dtype"])


def _controls(model: str, batch: int, image_size: int | None, dtype: str, engine: str) -> dict[str, Any]:
    return model_controls(model, batch=batch, image_size=image_size, image_min=32, engine=engine,
                          extra={"dtype": dropdown("dtype", ACT_DTYPES, dtype)})


# --- the forward table ----------------------------------------------------------------------------

def compute_table(model: str, batch: int, image_size: int, dtype: str, engine: str) -> ForwardTable:
    return forward_table(model, batch, image_size, dtype, engine)


def _recorded(kind: str, result) -> RecordLookup:
    return find_record(kind, model=result.model, batch=result.batch, image_size=result.image_size, dtype=result.dtype)


def _table_rows(r: dict[str, Any]) -> list[list[str]]:
    return [["peak live tensors (tracker)", format_bytes(r["peak_bytes"])],
            ["peak, not parameters (tracker)", format_bytes(r["peak_non_param"])],
            ["allocated by this forward (tracker)", format_bytes(r["forward_allocated"])], *allocator_rows(r)]


def render_table(result: ForwardTable) -> list[Any]:
    recorded = [] if result.engine == "cuda" else [HTML(recorded_html(_recorded("forward table", result), _table_rows))]
    return [result, forward_table_figure(result), *recorded]


def forward_table_panel(model: str = "vgg16", batch: int = 1, image_size: int | None = None,
                        dtype: str = "float32", engine: str = "auto") -> Panel:
    return Panel("Layer by layer: the tensors a forward pass creates",
                 _controls(model, batch, image_size, dtype, engine),
                 compute_table, render_table, auto_run=True, guard=memory_guard(_guard_bytes),
                 description="One eval-mode forward under <code>torch.no_grad()</code>; one row per tensor "
                             "it allocates (a ReLU with <code>inplace=True</code> writes into its input and "
                             "shares the row), with the parameters of the layers in that row.")


# --- inference vs training ------------------------------------------------------------------------

def compute_inference(model: str, batch: int, image_size: int, dtype: str, engine: str) -> InferenceVsTraining:
    return inference_vs_training(model, batch, image_size, dtype, engine)


def _pair_rows(r: dict[str, Any]) -> list[list[str]]:
    rows = []
    for mode, run in r["runs"].items():
        rows.append([mode, format_bytes(run["peak_non_param"]), format_bytes(run["saved_bytes"]),
                     counter_text(run)])
    return rows


def render_inference(result: InferenceVsTraining) -> list[Any]:
    recorded = [] if result.training.measurement.engine == "cuda" else [
        HTML(recorded_html(_recorded("inference vs training", result), _pair_rows,
                           ["forward", "peak, not parameters (tracker)", "saved for backward at the end",
                            "max_memory_allocated − baseline"]))]
    return [result, inference_training_figure(result), *recorded]


def inference_panel(model: str = "vgg16", batch: int = 1, image_size: int | None = None,
                    dtype: str = "float32", engine: str = "auto") -> Panel:
    return Panel("Inference vs training: what stays alive", _controls(model, batch, image_size, dtype, engine),
                 compute_inference, render_inference, auto_run=True, guard=memory_guard(_guard_bytes),
                 description="The same forward twice: eval under <code>torch.no_grad()</code>, then train "
                             "with grad. Live memory (not parameters) after every layer, tracked.")


# --- modelsize() vs saved ----------------------------------------------------------------------------

def compute_modelsize(batch: int, dtype: str, engine: str, kept: OrderedDict | None = None) -> ModelsizeComparison:
    """Every model's forward (the panel runs it on one CPU thread: ``Panel(threads=1)``); ``kept``: the
    panel's rows measured before (``modelsize_vs_saved``), a setting met again is not measured again."""
    return modelsize_vs_saved(tuple(MODELS), batch, dtype, engine, kept=kept)


def _modelsize_rows(r: dict[str, Any]) -> list[list[str]]:
    rows = []
    for model, row in r["models"].items():
        rows.append([model, format_bytes(row["saved_with_input"]), format_bytes(row["backward_peak"]),
                     format_bytes(row["no_grad_peak"]),
                     counter_text(row)])
    return rows


def render_modelsize(result: ModelsizeComparison) -> list[Any]:
    recorded = [] if not result.rows or result.rows[0].engine == "cuda" else [
        HTML(recorded_html(find_record("modelsize", batch=result.batch, dtype=result.dtype,
                                       models=[r.model for r in result.rows]), _modelsize_rows,
                           ["model", "saved for backward (input included)", "backward peak", "no_grad peak",
                            "max_memory_allocated − baseline (with grad)"]))]
    return [result, modelsize_figure(result), *recorded]


def _modelsize_guard_bytes(params: dict[str, Any]) -> int:
    return max(predicted_forward_bytes(m, params["batch"], None, params["dtype"]) for m in MODELS)


def modelsize_panel(batch: int = 1, dtype: str = "float32", engine: str = "auto") -> Panel:
    controls = {
        "batch": slider("batch", batch, 1, 256, log=True),
        "dtype": dropdown("dtype", ACT_DTYPES, dtype),
        "engine": engine_dropdown(engine),
    }
    kept: OrderedDict = OrderedDict()

    def compute(batch: int, dtype: str, engine: str) -> ModelsizeComparison:
        return compute_modelsize(batch, dtype, engine, kept=kept)
    return Panel("The articles' modelsize() vs what autograd saves", controls, compute,
                 render_modelsize, auto_run=True, guard=memory_guard(_modelsize_guard_bytes), threads=1,
                 description="Every lesson model at its default image size: the estimate (every layer's "
                             "output, in-place ReLUs skipped, ×2) next to a tracked forward with grad.",
                 real_run="a forward and backward, and a forward under no_grad, of every lesson model, real where "
                          "the engine is cpu or cuda")
