"""Checkpointing panel (lesson 07): N blocks, a sweep over the segment count k of
checkpoint_sequential -> activation memory at the peak (measured, Chen et al.'s N/k + k,
checkpoint_sequential's own segments) and step time (median, IQR). When the live engine is not
cuda, the recorded GPU sweep with the same N, width and batch is shown beside it (its points for
the live run's k), or a one-line note says that none matches.

A panel keeps its own sweeps (``reusing_sweeps``): a run whose k were all measured by an earlier sweep with
the same N, width, batch, timed rounds and engine (the segments choice moved from every k to the divisors
of N, or back to an N met before) shows those points under a line saying so, and Run pressed with
nothing moved measures afresh."""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, Callable

from IPython.display import HTML

from gpulab.course.checkpointing import SEGMENT_CHOICES, CheckpointResult, checkpoint_sweep, segment_counts
from gpulab.record.lookup import RecordLookup, find_record
from gpulab.record.views import counter_text, recorded_html
from gpulab.units import format_bytes
from gpulab.widgets.base import Panel, dropdown, slider, ENGINES, engine_dropdown
from gpulab.widgets.guard import memory_guard

__all__ = [
    "KEPT_SWEEPS", "REUSED_SWEEP_NOTE", "checkpoint_panel", "compute_checkpoint", "predict_checkpoint_peak",
    "recorded_checkpoint", "recorded_checkpoint_html", "render_checkpoint", "reusing_sweeps"
]

KEPT_SWEEPS = 8   # sweeps a panel keeps (each a few kB of numbers)
REUSED_SWEEP_NOTE = ("<i class='gpulab-reused'>Shown: the points this panel measured for these k with the same N, "
                     "width, batch, timed rounds and engine (an earlier sweep of more k); press Run again to "
                     "measure afresh.</i>")



def compute_checkpoint(n_blocks: int, width: int, batch: int, segments: str, repeats: int, engine: str,
                       progress=None) -> CheckpointResult:
    return checkpoint_sweep(int(n_blocks), int(width), int(batch), segments, engine, repeats=int(repeats),
                            progress=progress)


def predict_checkpoint_peak(params: dict[str, Any]) -> int:
    """The fake engine's peak without checkpointing (k = 1), the largest of the sweep."""
    r = checkpoint_sweep(int(params["n_blocks"]), int(params["width"]), int(params["batch"]), [1], "fake")
    return r.baseline.peak_bytes


def recorded_checkpoint(result: CheckpointResult) -> RecordLookup:
    """The recorded GPU sweep with this result's N, width and batch, or why there is none."""
    return find_record("checkpoint", n_blocks=result.n_blocks, width=result.width, batch=result.batch)


def recorded_checkpoint_html(result: CheckpointResult, lookup: RecordLookup) -> str:
    ks = {p.segments for p in result.points}

    def rows(r: dict[str, Any]) -> list[list[str]]:
        out = []
        for p in r["points"]:
            if p["segments"] not in ks:
                continue
            out.append([str(p["segments"]), format_bytes(p["peak_bytes"]), format_bytes(p["activation_side"]),
                        counter_text(p),
                        f"{p['median_s'] * 1e3:.2f}" if p.get("median_s") is not None else "—"])
        return out
    return recorded_html(lookup, rows, ["k", "peak (tracker)", "activations + temporaries at peak",
                                        "max_memory_allocated − baseline", "step ms (median)"])


def render_checkpoint(result: CheckpointResult) -> list[Any]:
    recorded = [] if result.engine == "cuda" else [HTML(recorded_checkpoint_html(result, recorded_checkpoint(result)))]
    return [result, result.figure(), *recorded]


def reusing_sweeps(compute: Callable[..., CheckpointResult], render: Callable[[CheckpointResult], list[Any]]
                   ) -> tuple[Callable[..., CheckpointResult], Callable[[CheckpointResult], list[Any]]]:
    """``(compute, render)`` for one panel that keeps its last ``KEPT_SWEEPS`` sweeps: a run whose k (and
    k = 1, always measured) were all measured by a kept sweep with the same N, width, batch, timed rounds
    and engine control is that sweep's points for those k (the memory, its timings, its labels), rendered
    under ``REUSED_SWEEP_NOTE``; a run with the settings of the run before it (Run pressed with nothing
    moved) measures afresh, and so does any other."""
    kept: OrderedDict[tuple, CheckpointResult] = OrderedDict()
    last: list[tuple] = []
    reused: list[CheckpointResult] = []

    def compute_or_reuse(n_blocks: int, width: int, batch: int, segments: str, repeats: int, engine: str,
                         progress=None) -> CheckpointResult:
        key = (int(n_blocks), int(width), int(batch), int(repeats), engine)
        again = last == [(key, segments)]
        last[:] = [(key, segments)]
        reused.clear()
        ks = {1, *segment_counts(int(n_blocks), segments)}
        old = kept.get(key)
        if old is not None and not again and ks <= {p.segments for p in old.points}:
            kept.move_to_end(key)
            result = dataclasses.replace(old, points=[p for p in old.points if p.segments in ks])
            reused.append(result)
            return result
        result = compute(n_blocks, width, batch, segments, repeats, engine, progress=progress)
        kept[key] = result
        kept.move_to_end(key)
        while len(kept) > KEPT_SWEEPS:
            kept.popitem(last=False)
        return result

    def render_noted(result: CheckpointResult) -> list[Any]:
        out = list(render(result))
        return [HTML(REUSED_SWEEP_NOTE), *out] if any(result is r for r in reused) else out

    return compute_or_reuse, render_noted


def checkpoint_panel(n_blocks: int = 16, width: int = 128, batch: int = 512,
                     segments: str = SEGMENT_CHOICES[0], repeats: int = 7, engine: str = "auto") -> Panel:
    controls = {
        "n_blocks": slider("blocks N", n_blocks, 2, 64),
        "width": slider("width", width, 8, 2048, log=True),
        "batch": slider("batch", batch, 1, 4096, log=True),
        "segments": dropdown("segments k", SEGMENT_CHOICES, segments),
        "repeats": slider("timed rounds", repeats, 1, 21),
        "engine": engine_dropdown(engine),
    }
    compute, render = reusing_sweeps(compute_checkpoint, render_checkpoint)
    return Panel("Checkpointing: memory against recompute time", controls, compute, render,
                 guard=memory_guard(predict_checkpoint_peak),
                 description="<code>checkpoint_sequential(blocks, k, x, use_reentrant=False)</code> for each k: "
                             "the peak under the tracker, then the step timed without it.",
                 real_run="a real run where the engine is cpu or cuda: each k is measured under the tracker, then its step is "
                          "timed <i>timed rounds</i> times, so an answer takes seconds; press Run once and talk "
                          "while it sweeps")
