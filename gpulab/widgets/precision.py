"""Mixed-precision panel (lesson 08): fp32, autocast (bf16, or fp16 with GradScaler) and pure
16-bit training steps -> memory at the peak by category, measured ratios to fp32 against the
formula, bytes per parameter kept between steps. When the live engine is not cuda, the recorded GPU run with
the same settings is shown beside it, or a one-line note says that none matches."""
from __future__ import annotations

from typing import Any

from IPython.display import HTML

from gpulab.course.precision import LOW_DTYPES, PrecisionResult, precision_engine, precision_step, saving_text
from gpulab.record.lookup import RecordLookup, find_record
from gpulab.record.views import counter_text, recorded_html
from gpulab.units import format_bytes
from gpulab.widgets.base import Panel, dropdown, model_controls
from gpulab.widgets.guard import memory_guard

__all__ = [
    "compute_precision", "precision_engine_name", "precision_panel", "predict_precision_peak", "recorded_precision",
    "render_precision"
]



def compute_precision(model: str, batch: int, image_size: int, optimizer: str, low: str,
                      engine: str) -> PrecisionResult:
    """The runs (the panel runs them on one CPU thread: ``Panel(threads=1)``)."""
    return precision_step(model, int(batch), int(image_size), optimizer, low, engine)


def predict_precision_peak(params: dict[str, Any]) -> int:
    r = compute_precision(**dict(params, engine="fake"))
    return max(run.peak_bytes for run in r.runs.values())


def precision_engine_name(params: dict[str, Any]) -> str:
    """The engine ``compute_precision`` will run on (``precision_engine``): the guard predicts nothing for
    a run that ``auto`` sends to the fake engine."""
    return precision_engine(params["model"], int(params["batch"]), int(params["image_size"]), params["low"],
                            params["engine"]).name


def recorded_precision(result: PrecisionResult) -> RecordLookup:
    """The recorded GPU run with this result's settings, or why there is none."""
    return find_record("precision", model=result.model, batch=result.batch, image_size=result.image_size,
                       optimizer=result.optimizer, low=result.low, steps=result.steps)


def _precision_rows(r: dict[str, Any]) -> list[list[str]]:
    rows = []
    for mode, run in r["runs"].items():
        pct = run.get("saving_percent")
        rows.append([mode, format_bytes(run["peak_bytes"]),
                     counter_text(run),
                     "—" if pct is None or mode == "fp32" else saving_text(pct),
                     f"{run['bytes_per_param']:.2f}"])
    return rows


def render_precision(result: PrecisionResult) -> list[Any]:
    recorded = [] if result.engine == "cuda" else [
        HTML(recorded_html(recorded_precision(result), _precision_rows,
                           ["mode", "peak (tracker)", "max_memory_allocated − baseline", "peak vs fp32",
                            "bytes/param kept between steps"]))]
    return [result, result.figure(), *recorded]


def precision_panel(model: str = "cnn", batch: int = 32, image_size: int | None = None, optimizer: str = "adam",
                    low: str = "bfloat16", engine: str = "auto") -> Panel:
    controls = model_controls(model, batch=batch, image_size=image_size, optimizer=optimizer, engine=engine,
                              extra={"low": dropdown("16-bit dtype", LOW_DTYPES, low)})
    return Panel("Mixed precision: which tensors shrink", controls, compute_precision, render_precision,
                 guard=memory_guard(predict_precision_peak, resolve=precision_engine_name), threads=1,
                 description="Two training steps each in float32, under <code>torch.autocast</code> (fp16 adds "
                             "<code>GradScaler</code>), and with the whole model in 16 bits; the peak of each by "
                             "category.",
                 real_run="three training runs of two steps each (fp32, autocast, the whole model in 16 bits), real "
                          "where the engine is cpu or cuda (after the fake engine has checked that they fit)")
