"""Batch-sweep panel: training steps at four batch sizes on one engine, the fitted line
``fixed + batch x per-sample`` next to the formulas' line. When the live engine is not cuda, the
recorded GPU steps at the same batch sizes are shown beside it, or a one-line note says that none
match."""
from __future__ import annotations

from typing import Any

from IPython.display import HTML

from gpulab.predict.step import step as tracked_step
from gpulab.course.sweeps import SweepResult, batch_sweep
from gpulab.record.lookup import RecordLookup, find_record_series
from gpulab.record.views import counter_text, recorded_html
from gpulab.units import format_bytes
from gpulab.widgets.base import Panel, model_controls
from gpulab.widgets.guard import memory_guard

__all__ = [
    "compute_sweep", "predict_sweep_peak", "recorded_sweep", "render_sweep", "sweep_batches",
    "sweep_panel"
]


def sweep_batches(largest: int) -> tuple[int, ...]:
    """Four batch sizes ending at ``largest``: largest/8, /4, /2, largest (at least 1 each)."""
    return tuple(sorted({max(1, largest // d) for d in (8, 4, 2, 1)}))


def compute_sweep(model: str, optimizer: str, largest: int, engine: str, progress=None) -> SweepResult:
    """The sweep (the panel runs it on one CPU thread: ``Panel(threads=1)``)."""
    return batch_sweep(model, sweep_batches(int(largest)), optimizer=optimizer, engine=engine, steps=2,
                       progress=progress)


def predict_sweep_peak(params: dict[str, Any]) -> int:
    """The fake engine's peak at the largest batch of the sweep (for the memory guard)."""
    return tracked_step(params["model"], batch=int(params["largest"]), optimizer=params["optimizer"], engine="fake", steps=2, guard=False).peak_bytes


def recorded_sweep(result: SweepResult) -> RecordLookup:
    """The recorded GPU steps at every batch size of the sweep (same model, optimizer, steps)."""
    return find_record_series("step", "batch", [p.batch for p in result.points], model=result.model,
                              image_size=result.image_size, optimizer=result.optimizer, dtype=result.dtype,
                              steps=result.steps)


def _sweep_rows(r: dict[str, Any]) -> list[list[str]]:
    rows = []
    for p in r["points"]:
        rows.append([str(p["batch"]), format_bytes(p["peak_bytes"]),
                     counter_text(p),
                     counter_text(p, "peak_reserved_delta")])
    return rows


def render_sweep(result: SweepResult) -> list[Any]:
    recorded = [] if result.engine == "cuda" else [
        HTML(recorded_html(recorded_sweep(result), _sweep_rows,
                           ["batch", "peak (tracker)", "max_memory_allocated − baseline",
                            "max_memory_reserved − baseline"]))]
    return [result, result.plot(), *recorded]


def sweep_panel(model: str = "cnn", optimizer: str = "sgd", largest: int = 32, engine: str = "auto") -> Panel:
    controls = model_controls(model, batch=largest, batch_min=4, batch_key="largest", batch_label="largest batch",
                              optimizer=optimizer, engine=engine)
    return Panel("Batch-size sweep: memory = fixed + batch × per-sample", controls, compute_sweep, render_sweep,
                 guard=memory_guard(predict_sweep_peak), threads=1,
                 description="Two training steps at each of four batch sizes (the second step is the steady "
                             "state, with the optimizer state alive); the peak of each, a least-squares line "
                             "through them, and the formulas' line.",
                 real_run="training steps at four batch sizes, real where the engine is cpu or cuda")
