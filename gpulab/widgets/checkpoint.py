"""Checkpointing panel (lesson 07): N blocks, a sweep over the segment count k of
checkpoint_sequential -> activation memory at the peak (measured, Chen et al.'s N/k + k,
checkpoint_sequential's own segments) and step time (median, IQR). When the live engine is not
cuda, the recorded GPU sweep with the same N, width and batch is shown beside it (its points for
the live run's k), or a one-line note says that none matches.

A panel keeps its own sweeps (``reusing_sweeps``): a run whose k were all measured by an earlier sweep with
the same N, width, batch, timed rounds and engine (the segments choice moved from every k to the divisors
of N, or back to an N met before) shows those points under a line saying so, and Run pressed with
nothing moved measures afresh.

The memory comes first (``CheckpointPanel``): a run measures every k under the tracker and shows it; the
steps are then timed on a worker thread (``course.checkpointing.time_sweep``, the same round robin and
label as ``checkpoint_sweep``'s) while the status says so, and the answer is shown again with its timings.
A change of a control or another run stops timings in flight (they are for settings the student has left)."""
from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections import OrderedDict
from typing import Any, Callable

from IPython.display import HTML

from gpulab.course.checkpointing import SEGMENT_CHOICES, CheckpointResult, checkpoint_sweep, segment_counts, time_sweep
from gpulab.measure.tracking import TRACKER_LOCK
from gpulab.record.lookup import RecordLookup, find_record
from gpulab.record.runs.checkpoint import TimingStopped
from gpulab.record.views import counter_text, recorded_html
from gpulab.units import format_bytes
from gpulab.widgets.base import ENGINES, MEASURE_LOCK, Panel, displayable, dropdown, engine_dropdown, slider
from gpulab.widgets.guard import memory_guard

__all__ = [
    "CheckpointPanel", "KEPT_SWEEPS", "REUSED_SWEEP_NOTE", "checkpoint_panel", "compute_checkpoint",
    "compute_checkpoint_memory", "predict_checkpoint_peak",
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


def compute_checkpoint_memory(n_blocks: int, width: int, batch: int, segments: str, repeats: int, engine: str,
                              progress=None) -> CheckpointResult:
    """``compute_checkpoint`` without its timings (``time_steps=False``): the memory of every k, which
    ``CheckpointPanel`` shows before it times the steps (``time_sweep``)."""
    return checkpoint_sweep(int(n_blocks), int(width), int(batch), segments, engine, repeats=int(repeats),
                            progress=progress, time_steps=False)


def predict_checkpoint_peak(params: dict[str, Any]) -> int:
    """The fake engine's peak without checkpointing (k = 1), the largest of the sweep: the guard's
    prediction before every run, worked out once per N, width and batch (a fake run's bytes depend on
    nothing else; the segments, timed rounds and engine controls move without it)."""
    return _fake_baseline_peak(int(params["n_blocks"]), int(params["width"]), int(params["batch"]))


@functools.lru_cache(maxsize=64)
def _fake_baseline_peak(n_blocks: int, width: int, batch: int) -> int:
    return checkpoint_sweep(n_blocks, width, batch, [1], "fake").baseline.peak_bytes


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
        keep(result, repeats, engine)
        return result

    def keep(result: CheckpointResult, repeats: int, engine: str) -> None:
        """Keep ``result`` (measured with the panel's ``repeats`` and ``engine`` controls), replacing a
        sweep with the same key: ``CheckpointPanel`` keeps a sweep again once its timings are in."""
        key = (result.n_blocks, result.width, result.batch, int(repeats), engine)
        kept[key] = result
        kept.move_to_end(key)
        while len(kept) > KEPT_SWEEPS:
            kept.popitem(last=False)

    def render_noted(result: CheckpointResult) -> list[Any]:
        out = list(render(result))
        return [HTML(REUSED_SWEEP_NOTE), *out] if any(result is r for r in reused) else out

    compute_or_reuse.keep = keep   # CheckpointPanel keeps the timed sweep (one of the kept results)
    return compute_or_reuse, render_noted


class CheckpointPanel(Panel):
    """A ``Panel`` whose answer comes in two updates: the memory of every k (the compute), then the same
    sweep with its steps timed (``time_sweep``) on a worker thread that holds ``MEASURE_LOCK`` and
    ``measure.tracking.TRACKER_LOCK`` (a tracker's hooks see every thread's modules). While it
    times, the progress bar shows and the status says so; ``timing`` is True. A run, or a change of a
    control, stops the timing in flight (``TimingStopped`` before its next step) and waits for it."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.timing = False
        self.timing_seconds = 0.0
        self._timing_gen = 0
        self._timer: threading.Thread | None = None

    def _run_once(self) -> None:
        self._stop_timing()
        super()._run_once()
        r = self.result
        if self.error is None and self.blocked is None and r is not None and r.engine != "fake" \
                and any(p.timing is None for p in r.points):
            self._start_timing(r, dict(self.params))

    def mark_stale(self) -> None:
        self._stop_timing()
        super().mark_stale()

    def _stop_timing(self) -> None:
        self._timing_gen += 1
        t = self._timer
        if t is not None and t is not threading.current_thread():
            t.join()
        self._end_timing()

    def _end_timing(self) -> None:
        if self.timing:
            self.timing = False
            self.progress.layout.visibility = "hidden"
            self.run_button.disabled = False

    def _start_timing(self, memory: CheckpointResult, params: dict[str, Any]) -> None:
        gen = self._timing_gen
        self.timing = True
        repeats = int(params["repeats"])
        self.progress.layout.visibility = "visible"
        self.progress.value = 0
        memory_s = self.last_seconds
        self.status.value = (f"memory measured in {memory_s:.2f} s; timing the steps of every k "
                             f"({repeats} rounds)…")
        self._timer = threading.Thread(target=self._time, args=(gen, memory, params, memory_s),
                                       name="gpulab-checkpoint-timing", daemon=True)
        self._timer.start()

    def _time(self, gen: int, memory: CheckpointResult, params: dict[str, Any], memory_s: float) -> None:
        def stop() -> bool:
            return gen != self._timing_gen

        def progress(j: int) -> None:
            if not stop():
                self.progress.value = int(100 * j / repeats)
                self.status.value = (f"memory measured in {memory_s:.2f} s; timing the steps of every k: "
                                     f"round {j + 1}/{repeats}…")
        repeats = int(params["repeats"])
        t0 = time.perf_counter()
        try:
            with MEASURE_LOCK, TRACKER_LOCK:   # no tracker, here or in a notebook cell, sees these modules
                if stop():
                    return
                timed = time_sweep(memory, repeats, progress=progress, stop=stop)
        except TimingStopped:
            return
        except Exception as exc:   # shown in the status, never raised into the kernel
            if not stop():
                self.timing = False
                self.progress.layout.visibility = "hidden"
                self.status.value = f"memory shown; timing failed: {type(exc).__name__}: {exc}"
            return
        if stop():
            return
        self.timing_seconds = time.perf_counter() - t0
        keep = getattr(self._compute, "keep", None)
        if keep is not None:
            keep(timed, params["repeats"], params["engine"])
        self.result = timed
        self._show_from_worker(self._render(timed))
        self.timing = False
        self.progress.layout.visibility = "hidden"
        self.status.value = f"done: memory in {memory_s:.2f} s, then timings in {self.timing_seconds:.2f} s"

    def _show_from_worker(self, items: list[Any]) -> None:
        """``Panel._show`` for the worker thread: the Output's ``outputs`` set to the items' display data
        (ipywidgets' way from another thread), not ``with output: display(...)``, which takes the kernel's
        current parent message and would send the items to whatever cell is running now."""
        from IPython.core.formatters import format_display_data
        shown = []
        for item in displayable(items):
            data, metadata = format_display_data(item)
            shown.append({"output_type": "display_data", "data": data, "metadata": metadata})
        self.output.outputs = tuple(shown)

    def wait(self, timeout: float = 300.0) -> bool:
        """Block until the timings in flight are shown (or stopped); False on timeout."""
        t = self._timer
        if t is not None:
            t.join(timeout)
            return not t.is_alive()
        return True


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
    compute, render = reusing_sweeps(compute_checkpoint_memory, render_checkpoint)
    return CheckpointPanel("Checkpointing: memory against recompute time", controls, compute, render,
                 guard=memory_guard(predict_checkpoint_peak),
                 description="<code>checkpoint_sequential(blocks, k, x, use_reentrant=False)</code> for each k: "
                             "the peak under the tracker, then the step timed without it.",
                 real_run="a real run where the engine is cpu or cuda: each k is measured under the tracker and shown, "
                          "then its step is timed <i>timed rounds</i> times and the answer is shown again with the "
                          "timings, which take seconds; the status says while they run")
