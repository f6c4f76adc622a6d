"""Training-step panel: model, batch, image size, optimizer, dtype, engine -> per-category
peak (measured) next to the formulas, and the memory timeline. When the live engine is not cuda,
the recorded GPU run with the same settings is shown beside it, labelled with its provenance
(``gpulab.record.find_record``), or a one-line note says that no recorded run matches."""
from __future__ import annotations

import html
from typing import Any

from IPython.display import HTML

from ..experiments import StepResult, training_step
from ..plots import comparison_bars, timeline
from ..record import RecordLookup, find_record
from ..tables import html_table
from ..units import format_bytes
from .base import Panel, dropdown, model_controls
from .guard import memory_guard


def compute_step(model: str, batch: int, image_size: int, optimizer: str, dtype: str, engine: str) -> StepResult:
    return training_step(model, batch, image_size, optimizer, dtype, engine)


def predict_step_peak(params: dict[str, Any]) -> int:
    p = dict(params, engine="fake")
    return compute_step(**p).peak_bytes


def recorded_step(result: StepResult) -> RecordLookup:
    """The recorded GPU run with this result's settings (``gpulab/recorded/``, or the folder
    $GPULAB_RECORDED_DIR names), or why there is none."""
    return find_record("step", model=result.model, batch=result.batch, image_size=result.image_size,
                       optimizer=result.optimizer, dtype=result.dtype)


def recorded_step_html(lookup: RecordLookup) -> str:
    """The recorded figures with their provenance label, or a one-line note saying why none."""
    if not lookup:
        why = lookup.mismatch or lookup.reason
        return (f"<div class='gpulab-recorded gpulab-label'>On a real GPU: no recorded GPU run matches these "
                f"settings {'' if why.startswith('(') else '— '}{html.escape(why)}.</div>")
    r = lookup.result
    a = r.get("allocator", {})
    rows = [["peak live tensors (tracker, 512 B blocks)", format_bytes(r["peak_bytes"])]]
    for key, name in (("peak_allocated_delta", "max_memory_allocated − baseline"),
                      ("peak_reserved_delta", "max_memory_reserved − baseline"),
                      ("baseline_allocated", "memory_allocated before the run (baseline)"),
                      ("nvml_used", "NVML used (whole device)")):
        if a.get(key) is not None:
            rows.append([name, format_bytes(a[key])])
    rows += [[f"peak: {k}", format_bytes(v)] for k, v in r.get("peak_by_category", {}).items() if v]
    return ("<div class='gpulab-recorded'><b>The same settings on a real GPU</b>"
            + html_table(["recorded figure", "bytes"], rows, lookup.label) + "</div>")


def render_step(result: StepResult) -> list[Any]:
    m = result.measurement
    recorded = [] if m.engine == "cuda" else [HTML(recorded_step_html(recorded_step(result)))]
    if m.oom:
        return [result, *recorded]
    return [result, *recorded,
            comparison_bars(result.predicted, result.tensor_bytes_by_category, f"peak tensor bytes: {m.label}",
                            title=f"{result.model}, batch {result.batch}: formula vs {m.label}"),
            timeline(m.tracking, title=f"one training step, {m.label}")]


def step_panel(model: str = "cnn", batch: int = 32, image_size: int | None = None, optimizer: str = "sgd",
               dtype: str = "float32", engine: str = "auto") -> Panel:
    controls = model_controls(model, batch=batch, image_size=image_size, optimizer=optimizer, engine=engine,
                              extra={"dtype": dropdown("dtype", ["float32", "bfloat16", "float16"], dtype)})
    return Panel("One training step", controls, compute_step, render_step,
                 guard=memory_guard(predict_step_peak),
                 description="Forward, backward and <code>optimizer.step()</code> on a fresh model; "
                             "peak live memory by category next to the formulas.")
