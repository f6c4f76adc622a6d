"""Lesson 11's what-if panel: model, sequence, batch, recompute, precision, optimizer, ZeRO stage
over data-parallel GPUs, tensor parallelism and card. The formula side (``course.whatif.whatif_formula``)
answers on every slider move, in the callback; the measured side (``whatif_measured``: a fake step
and the allocator simulator) follows on a worker thread once the controls rest for ``DEBOUNCE_S``.

A measurement the student has moved past is dropped: the worker measures the newest settings when it
starts, and when it finishes, a result for settings that are no longer the panel's is thrown away
(``panel.dropped`` counts them) and the newest settings are measured next. There is never more than
one measurement running and one waiting, whatever the number of moves. Until the newest result is
in, the measured column reads "measuring…" and the earlier result is not shown beside the new formula.

NB: gpulab's tracker hooks every module of the process while it measures (global module hooks), so
the worker holds ``base.MEASURE_LOCK``, which every ``Panel`` run takes too; a notebook cell that
calls ``gpulab.step`` itself while this panel measures is not covered by the lock. The first
measurement, when the panel is shown, runs in the cell itself (a Run All gets a deterministic
answer, and nothing measures behind later cells)."""
from __future__ import annotations

import html
import threading
import time
from typing import Any

import ipywidgets as W

from gpulab.course.whatif import (RECOMPUTE, WHATIF_MODELS, WHATIF_OPTIMIZERS, WHATIF_PRECISIONS, WhatIfFormula,
                                  WhatIfMeasured, compare_html, explain, whatif_formula, whatif_measured, model_shape)
from gpulab.predict.cards import card_names
from gpulab.widgets.base import MEASURE_LOCK, check_control_value, dropdown, fit_lengths
from gpulab.widgets.gc_scope import old_objects_frozen

__all__ = ["DEBOUNCE_S", "WhatIfPanel", "whatif_panel"]

DEBOUNCE_S = 0.4
SEQ_CHOICES = tuple(2 ** i for i in range(6, 14))     # 64 ... 8192
FORMULA_KEYS = ("model", "seq_len", "batch", "recompute", "precision", "optimizer", "zero", "dp", "tp")


def _log_slider(description: str, options: tuple[int, ...], value: int) -> W.SelectionSlider:
    return W.SelectionSlider(options=list(options), value=value, description=description, continuous_update=True,
                             style={"description_width": "initial"}, layout=W.Layout(width="300px"))


class WhatIfPanel:
    """The panel (module docstring). ``formula`` and ``measured`` hold the latest results as data;
    ``wait()`` blocks until the measured side has caught up (tests)."""

    def __init__(self, model: str = "hf:gpt2", seq_len: int = 1024, batch: int = 1, recompute: str = "none",
                 precision: str = "bf16", optimizer: str = "adamw", zero: int = 0, dp: int = 1, tp: int = 1,
                 card: str = "H100", debounce_s: float = DEBOUNCE_S, auto_measure: bool = True):
        for name in WHATIF_MODELS:   # every model's config read now: a move to any of them is a lookup
            model_shape(name)
        self.controls: dict[str, W.ValueWidget] = {
            "model": dropdown("model", WHATIF_MODELS, model),
            "seq_len": _log_slider("sequence", SEQ_CHOICES, SEQ_CHOICES[0]),
            "batch": _log_slider("batch", (1, 2, 4, 8, 16, 32, 64), 1),
            "recompute": dropdown("recompute", RECOMPUTE, recompute),
            "precision": dropdown("precision", list(WHATIF_PRECISIONS), precision),
            "optimizer": dropdown("optimizer", WHATIF_OPTIMIZERS, optimizer),
            "zero": dropdown("ZeRO stage", (0, 1, 2, 3), zero),
            "dp": _log_slider("data-parallel GPUs", (1, 2, 4, 8, 16, 32, 64), 1),
            "tp": _log_slider("tensor-parallel GPUs", (1, 2, 4, 8), 1),
            "card": dropdown("card", card_names(), card),
        }
        self._fit_sequence(model)
        for name, value in (("seq_len", seq_len), ("batch", batch), ("dp", dp), ("tp", tp)):
            check_control_value(name, self.controls[name], value)
            self.controls[name].value = value
        self.debounce_s = debounce_s
        self.auto_measure = auto_measure   # False: the formula side only, until ``measure_now()`` (tests, benchmarks)
        self.formula: WhatIfFormula | None = None
        self.measured: WhatIfMeasured | None = None
        self.formula_error: str | None = None
        self.error: str | None = None
        self.formula_seconds = 0.0
        self.runs = 0          # measurements finished
        self.dropped = 0       # measurements finished for settings the student had left
        self._generation = 0
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._shown = False

        self.formula_html = W.HTML()
        self.measured_note = W.HTML()
        self.status = W.HTML("")
        self.status.add_class("gpulab-status")
        self.progress = W.IntProgress(value=0, min=0, max=1, bar_style="info",
                                      layout=W.Layout(width="160px", visibility="hidden"))
        body = W.VBox([self.formula_html, self.measured_note])
        body.add_class("gpulab-output")
        header = W.HTML("<h4 style='margin:4px 0'>What if? One training step's memory per GPU</h4>"
                        "<div><span class='gpulab-live' style='background:#e6f4ea;border-radius:3px;padding:1px 5px'>"
                        "live</span> The formula column follows every move; the measured column (a fake step on "
                        "the card's CUDA kernels, then the simulated allocator) follows once the controls rest.</div>")
        self.widget = W.VBox([header, W.HBox(list(self.controls.values()), layout=W.Layout(flex_flow="row wrap")),
                              W.HBox([self.progress, self.status]), body])
        self.widget.add_class("gpulab-panel")
        for c in self.controls.values():
            c.observe(self._on_change, names="value")
        self.update_formula()

    # ---- settings ---------------------------------------------------------------------------------
    @property
    def params(self) -> dict[str, Any]:
        return {k: c.value for k, c in self.controls.items()}

    def set(self, **values: Any) -> "WhatIfPanel":
        """Set controls as a student would, one change after another (each updates the formula and
        asks for a measurement)."""
        for k, v in values.items():
            if k not in self.controls:
                raise KeyError(f"no control {k!r}; controls: {', '.join(self.controls)}")
            check_control_value(k, self.controls[k], v)
            self.controls[k].value = v
        return self

    def _fit_sequence(self, model: str) -> None:
        """The sequence slider offers what the model takes (tiny-llama: 256 positions): ``fit_lengths``."""
        fit_lengths(self.controls["seq_len"], model_shape(model)["max_positions"], SEQ_CHOICES[0], SEQ_CHOICES[-1])

    # ---- the formula side ---------------------------------------------------------------------------
    def update_formula(self) -> WhatIfFormula | None:
        t0 = time.perf_counter()
        p = self.params
        try:
            self.formula = whatif_formula(**{k: p[k] for k in FORMULA_KEYS})
            self.formula_error = None
        except ValueError as exc:
            self.formula, self.formula_error = None, str(exc)
        self.formula_seconds = time.perf_counter() - t0
        self._render()
        return self.formula

    def _render(self) -> None:
        if self.formula is None:
            self.formula_html.value = f"<div class='gpulab-blocked'>{html.escape(self.formula_error or '')}</div>"
            self.measured_note.value = ""
            return
        current = self.measured if self.measured and self.measured.settings == self._measure_args() else None
        self.formula_html.value = compare_html(self.formula, current, pending="measuring…")
        notes = "".join(f"<li>{n}</li>" for n in explain(self.formula, current))
        err = f"<div class='gpulab-blocked'>Measured side: {html.escape(self.error)}</div>" if self.error else ""
        self.measured_note.value = err + (f"<ul style='margin:2px 0'>{notes}</ul>" if notes else "")

    def _measure_args(self) -> dict[str, Any]:
        p = self.params
        return {k: p[k] for k in (*FORMULA_KEYS, "card")}

    # ---- the measured side --------------------------------------------------------------------------
    def _on_change(self, change) -> None:
        if change["owner"] is self.controls["model"]:
            self._fit_sequence(change["new"])
        self.update_formula()
        self._request()

    def _request(self) -> None:
        with self._lock:
            self._generation += 1
            self.error = None
            if self.formula is None:
                self._busy(False, "not measured: " + (self.formula_error or ""))
                return
            if not self.auto_measure:
                return
            self._busy(True, "measuring…")
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._work, name="gpulab-whatif", daemon=True)
                self._worker.start()

    def _busy(self, on: bool, text: str) -> None:
        self.progress.layout.visibility = "visible" if on else "hidden"
        self.progress.bar_style = "info"
        self.progress.value = 0 if on else 1
        self.status.value = text

    def _work(self) -> None:
        while True:
            time.sleep(self.debounce_s)
            with self._lock:
                gen, args = self._generation, self._measure_args()
                if self.formula is None:
                    self._worker = None
                    return
            result, error = self._measure(args)
            with self._lock:
                if gen != self._generation:      # the student moved on: drop it, measure the newest
                    self.dropped += 1
                    continue
                self.runs += 1
                self.measured, self.error = result, error
                self._render()
                self._busy(False, f"measured in {result.seconds:.2f} s" + (" (reused)" if result.reused else "")
                           if result else "measured side failed (see below)")
                self._worker = None
                return

    def _measure(self, args: dict[str, Any]) -> tuple[WhatIfMeasured | None, str | None]:
        try:
            with MEASURE_LOCK, old_objects_frozen():   # the collector walks only what the run makes
                return whatif_measured(**args), None
        except Exception as exc:   # shown in one line under the table, never raised into the kernel
            return None, f"{type(exc).__name__}: {exc}"

    def measure_now(self) -> WhatIfMeasured | None:
        """Measure the current settings in this thread (the first showing, and tests)."""
        with self._lock:
            self._generation += 1
        if self.formula is None:
            return None
        self._busy(True, "measuring…")
        result, self.error = self._measure(self._measure_args())
        self.runs += 1 if result else 0
        self.measured = result
        self._render()
        self._busy(False, f"measured in {result.seconds:.2f} s" if result else "measured side failed (see below)")
        return result

    def wait(self, timeout: float = 120.0) -> bool:
        """Block until no measurement is running or waiting; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            w = self._worker
            if w is None or not w.is_alive():
                return True
            w.join(timeout=0.05)
        return False

    def _ipython_display_(self) -> None:
        from IPython.display import display
        display(self.widget)
        if not self._shown:
            self._shown = True
            self.measure_now()


def whatif_panel(**settings: Any) -> WhatIfPanel:
    """The what-if panel with these starting settings (``WhatIfPanel``'s keywords)."""
    return WhatIfPanel(**settings)
