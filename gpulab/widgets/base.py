"""The panel pattern every lesson shares.

A ``Panel`` has controls (sliders, dropdowns) that only change parameters, one ``run()``
that calls a pure ``compute(**params)`` and renders the result into an ``Output``, and
keeps the latest result as data (``panel.result``), so it is testable without a browser:
set a control's value, call ``run()`` (or let it run on change), assert on ``panel.result``.

* Cheap experiments (``auto_run=True``) rerun when a control changes; expensive ones wait
  for the Run button. Sliders use ``continuous_update=False``.
* While a run is in progress the Run button is disabled and a progress bar shows; clicks
  and control changes during a run are not lost: one more run follows with the newest
  values.
* Every error becomes a readable message in the output (``panel.error``); the kernel never
  sees an exception from a callback.
* A guard may veto a run before it starts (e.g. the fake engine predicts more memory than
  is free) and say why; the panel then shows that message instead of running.
* ``threads=1`` runs the guard and the experiment on one CPU thread (``cpu_threads``): the
  memory panels count the same bytes on any number of threads (tests/test_panel_speed.py), and
  on a shared 2-core machine a second OpenMP thread that gets descheduled makes each small op
  wait (lesson 05's Adam step: five times slower). None leaves torch's thread count alone.
"""
from __future__ import annotations

import functools
import inspect
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import ipywidgets as W
from IPython.display import HTML, display

from gpulab.widgets.gc_scope import old_objects_frozen

__all__ = [
    "ENGINES", "GuardVerdict", "MEASURE_LOCK", "NO_GPU_NOTE", "Panel", "REUSED_NOTE", "check_control_value", "displayable", "dropdown",
    "engine_choices", "engine_dropdown", "model_controls", "slider_layout",
    "reuse_first", "slider", "with_value"
]


# gpulab's tracker hooks every module of the process while it measures (global module hooks): a panel
# that measures on a worker thread (widgets.whatif) and a Panel's run in the kernel's thread take turns
MEASURE_LOCK = threading.RLock()


@dataclass
class GuardVerdict:
    ok: bool
    message: str = ""        # HTML shown when not ok
    suggestion: dict[str, Any] | None = None  # control values that would be safe, e.g. {"engine": "fake"}


class Panel:
    """controls -> compute(**params) -> render(result) into an Output."""

    def __init__(self, title: str, controls: dict[str, W.ValueWidget],
                 compute: Callable[..., Any], render: Callable[[Any], list[Any]], *,
                 auto_run: bool = False, guard: Callable[[dict[str, Any]], GuardVerdict] | None = None,
                 description: str = "", run_on_show: bool = True, real_run: str = "",
                 threads: int | None = None):
        self.title = title
        self.threads = threads
        self.controls = controls
        self._compute = compute
        self._wants_progress = "progress" in inspect.signature(compute).parameters
        self._render = render
        self._guard = guard
        self.auto_run = auto_run
        self.result: Any = None
        self.error: str | None = None
        self.blocked: GuardVerdict | None = None
        self.runs = 0
        self.last_seconds = 0.0
        self._running = False
        self._pending = False
        self.stale = False
        self.real_run = real_run

        self.output = W.Output()
        self.output.add_class("gpulab-output")
        self.run_button = W.Button(description="Run", button_style="primary", icon="play",
                                   tooltip="run the experiment with these settings")
        self.run_button.add_class("gpulab-run")
        self.run_button.on_click(self._on_click)
        self.progress = W.IntProgress(value=0, min=0, max=100, layout=W.Layout(width="160px", visibility="hidden"))
        self.status = W.HTML("")
        self.status.add_class("gpulab-status")
        self.safe_button = W.Button(description="Use the safe settings", button_style="warning",
                                    layout=W.Layout(display="none"))
        self.safe_button.on_click(self._apply_suggestion)
        for c in controls.values():
            if hasattr(c, "continuous_update"):
                c.continuous_update = False
            c.observe(self._on_change, names="value")
        if not auto_run:   # a run-only panel: its Run button says so, and its header carries a badge
            self.run_button.description = "Run (needed after a change)"
            self.run_button.layout = W.Layout(width="auto")
        badge = ("<span class='gpulab-live' style='background:#e6f4ea;border-radius:3px;padding:1px 5px;"
                 "font-size:0.8em'>live: reruns on every change</span>" if auto_run else
                 "<span class='gpulab-runonly' style='background:#fff4e0;border-radius:3px;padding:1px 5px;"
                 "font-size:0.8em'>run-only: press Run after a change</span>")
        no_gpu = ("<div class='gpulab-nogpu' style='font-size:0.85em;color:#555'>" + NO_GPU_NOTE + "</div>"
                  if "engine" in controls and "cuda" not in getattr(controls["engine"], "_options_values", ("cuda",))
                  else "")
        slow = (f"<div class='gpulab-realrun' style='font-size:0.85em;color:#555'>⏱ {real_run}; the status "
                "says how long each run took.</div>" if real_run else "")
        header = W.HTML(f"<h4 style='margin:4px 0'>{title} {badge}</h4>"
                        + (f"<div>{description}</div>" if description else "") + no_gpu + slow)
        row = W.HBox([self.run_button, self.progress, self.safe_button, self.status])
        self.widget = W.VBox([header, W.HBox(list(controls.values()), layout=W.Layout(flex_flow="row wrap")),
                              row, self.output])
        self.widget.add_class("gpulab-panel")
        self._shown = False
        self._run_on_show = run_on_show

    # ---- parameters ----------------------------------------------------------------------------
    @property
    def params(self) -> dict[str, Any]:
        return {k: c.value for k, c in self.controls.items()}

    def set(self, **values: Any) -> "Panel":
        """Set several controls at once and run once (tests and notebooks use this)."""
        auto, self.auto_run = self.auto_run, False
        try:
            for k, v in values.items():
                if k not in self.controls:
                    raise KeyError(f"no control {k!r}; controls: {', '.join(self.controls)}")
                check_control_value(k, self.controls[k], v)   # a slider would clamp it without a word
                self.controls[k].value = v
        finally:
            self.auto_run = auto
        self.run()
        return self

    # ---- running --------------------------------------------------------------------------------
    def _on_change(self, change) -> None:
        if self.auto_run:
            self.run()
        else:
            self.mark_stale()

    def mark_stale(self) -> None:
        """A run-only panel whose controls moved: the result shown is for other settings. The status
        says so in bold, the output is greyed, and the Run button is highlighted until the next run."""
        self.stale = True
        self.status.value = ("<b style='color:#b35900'>stale: the result below is for the previous settings; "
                             "press Run</b>")
        self.output.add_class("gpulab-stale")
        self.output.layout.opacity = "0.45"
        self.run_button.button_style = "warning"

    def _on_click(self, _button) -> None:
        self.run()

    def _apply_suggestion(self, _button) -> None:
        if self.blocked and self.blocked.suggestion:
            self.set(**self.blocked.suggestion)

    def _report_progress(self, fraction: float, text: str = "") -> None:
        self.progress.value = int(100 * max(0.0, min(1.0, fraction)))
        if text:
            self.status.value = text

    def run(self) -> Any:
        """Run the experiment with the current control values and render it. Returns the
        result (None if blocked or failed; then ``panel.blocked`` / ``panel.error`` say why)."""
        if self._running:  # a click or change while running: run again afterwards
            self._pending = True
            return None
        self._running = True
        try:
            while True:
                self._pending = False
                self._run_once()
                if not self._pending:
                    break
        finally:
            self._running = False
        return self.result if self.error is None and self.blocked is None else None

    def _run_once(self) -> None:
        params = self.params
        self.run_button.disabled = True
        self.safe_button.layout.display = "none"
        self.progress.layout.visibility = "visible"
        self.progress.value = 5
        self.status.value = self.running_text()
        t0 = time.perf_counter()
        self.error, self.blocked = None, None
        self._fresh()   # what is shown next is for these settings (a result, a refusal or an error)
        try:
            with MEASURE_LOCK, _cpu_threads(self.threads):   # a guard may measure (the fake engine)
                verdict = self._guard(params) if self._guard else GuardVerdict(True)
            if not verdict.ok:
                self.blocked = verdict
                self._show([HTML(f"<div class='gpulab-blocked'>{verdict.message}</div>")])
                if verdict.suggestion:
                    self.safe_button.layout.display = ""
                self.status.value = "not run (see below)"
                return
            with MEASURE_LOCK, _cpu_threads(self.threads), old_objects_frozen():   # gc walks only the run's objects
                if self._wants_progress:
                    result = self._compute(progress=self._report_progress, **params)
                else:
                    result = self._compute(**params)
            self.result = result
            self.runs += 1
            self._show(self._render(result))
            self.last_seconds = time.perf_counter() - t0
            self.status.value = f"done in {self.last_seconds:.2f} s"
        except Exception as exc:  # every error is shown, never raised into the kernel
            self.error = f"{type(exc).__name__}: {exc}"
            tb = traceback.format_exc(limit=3)
            self._show([HTML(f"<div class='gpulab-error' style='color:#b00'><b>Could not run:</b> "
                             f"{_escape(self.error)}</div><details><summary>details</summary>"
                             f"<pre>{_escape(tb)}</pre></details>")])
            self.status.value = "failed (see below)"
        finally:
            self.progress.value = 100
            self.progress.layout.visibility = "hidden"
            self.run_button.disabled = False

    def running_text(self) -> str:
        """The status while a run is in progress; for a panel whose run takes seconds (its header's
        ``real_run`` line says what it runs), how long its last run took here, so a room knows the wait."""
        if self.real_run and self.runs:
            return f"running… (the last run here took {self.last_seconds:.1f} s)"
        return "running…"

    def _fresh(self) -> None:
        self.stale = False
        self.output.remove_class("gpulab-stale")
        self.output.layout.opacity = None
        self.run_button.button_style = "primary"

    def _show(self, items: list[Any]) -> None:
        with self.output:
            self.output.clear_output(wait=True)
            for item in displayable(items):
                display(item)

    # ---- display -----------------------------------------------------------------------------------
    def _ipython_display_(self) -> None:
        display(self.widget)
        if self._run_on_show and not self._shown:
            self._shown = True
            self.run()


REUSED_NOTE = ("<i class='gpulab-reused'>Shown: what the lesson measured above with these same settings; "
               "press Run to measure again.</i>")


def reuse_first(compute: Callable[..., Any], render: Callable[[Any], list[Any]], measured: Iterable[Any],
                same: Callable[[Any, dict[str, Any]], bool]) -> tuple[Callable[..., Any], Callable[[Any], list[Any]]]:
    """``(compute, render)`` for a panel whose first run shows a result the lesson already
    computed with the panel's own settings instead of computing it again (``same(result,
    settings)`` decides, among ``measured``), under a line saying so. Every later run computes
    afresh. A lesson that shows a panel right after measuring the same thing pays once."""
    left = [m for m in measured if m is not None]
    reused: list[Any] = []

    @functools.wraps(compute)   # keeps the signature: Panel looks for a ``progress`` parameter
    def first_or_compute(**params: Any) -> Any:
        settings = {k: v for k, v in params.items() if k != "progress"}
        found = next((m for m in left if same(m, settings)), None)
        left.clear()   # the first run only
        if found is not None:
            reused.append(found)
            return found
        return compute(**params)

    def render_noted(result: Any) -> list[Any]:
        out = list(render(result))
        if any(result is r for r in reused):
            out.insert(0, HTML(REUSED_NOTE))
        return out

    return first_or_compute, render_noted


def displayable(items: list[Any]) -> list[Any]:
    """``items`` as a panel displays them: each matplotlib Figure as a PNG image (a bare Figure shows as
    text unless pyplot registered a formatter), its memory released once the image is made."""
    from matplotlib.figure import Figure

    from gpulab.plots import as_image
    shown = []
    for item in items:
        if isinstance(item, Figure):
            image = as_image(item)
            item.clf()
            item = image
        shown.append(item)
    return shown


def _cpu_threads(n: int | None):
    """``record.runs.checkpoint.cpu_threads(n)`` (imported here: it imports torch)."""
    from gpulab.record.runs.checkpoint import cpu_threads
    return cpu_threads(n)


def _escape(text: str) -> str:
    import html
    return html.escape(text)


def check_control_value(name: str, control: W.Widget, value: Any) -> None:
    """``ValueError`` in one line, naming ``name``, the value and what the control takes, for a value
    outside a control's range or choices: an ``IntSlider`` would clamp it without a word (99
    processes becoming 4), a dropdown or selection slider raise traitlets' ``TraitError``."""
    if isinstance(control, (W.IntSlider, W.BoundedIntText)):
        if not isinstance(value, int) or isinstance(value, bool) or not control.min <= value <= control.max:
            raise ValueError(f"{name} must be a whole number from {control.min} to {control.max} (the panel's "
                             f"range), got {value!r}")
    elif hasattr(control, "_options_values") and value not in control._options_values:
        choices = list(control._options_values)
        if value == "cuda" and value in ENGINES and set(choices) <= set(ENGINES):
            raise ValueError(f"{name} 'cuda' needs a GPU: torch.cuda.is_available() is False here; choose one of "
                             f"{', '.join(choices)} (each number's label says whose kernels answered)")
        shown = ", ".join(map(repr, choices)) if len(choices) <= 20 else f"{choices[0]!r} ... {choices[-1]!r}"
        raise ValueError(f"{name} must be one of {shown} (the panel's choices), got {value!r}")


def with_value(name: str, control: W.Widget, value: Any) -> W.Widget:
    """``control`` set to ``value`` once ``check_control_value`` took it (a control built at its first
    value, so that nothing is clamped or raised on the way)."""
    check_control_value(name, control, value)
    control.value = value
    return control


def slider_layout(description: str) -> W.Layout:
    """A slider wide enough for its track: ipywidgets gives every control 300 px in all
    (``--jp-widgets-inline-width``), and a description shown whole ("description_width": "initial")
    takes its width out of them: "assumed CUDA context (MiB)" left the track no room. About 7 px a
    character of description, plus 200 px for the track and 60 px for the value."""
    return W.Layout(width=f"{7 * len(description) + 260}px", min_width="300px")


def slider(description: str, value: int, min: int, max: int, step: int = 1, log: bool = False) -> W.Widget:
    """An integer slider (or a dropdown of powers of two when ``log``) that fires on release. A
    ``value`` outside the range is refused (``check_control_value``), never clamped."""
    if log:
        options = [v for v in (2**i for i in range(0, 16)) if min <= v <= max]
        control = W.SelectionSlider(options=options, value=options[0], description=description,
                                    continuous_update=False, style={"description_width": "initial"},
                                    layout=slider_layout(description))
    else:
        control = W.IntSlider(value=min, min=min, max=max, step=step, description=description,
                              continuous_update=False, style={"description_width": "initial"},
                              layout=slider_layout(description))
    return with_value(description, control, value)


def fit_lengths(control, most: int | None, shortest: int = 64, longest: int = 2048) -> None:
    """Offer on ``control`` (a selection slider of powers of two) only the lengths from ``shortest`` that a
    model with ``most`` positions takes (its config's: tiny-llama and tiny-gpt2 take 256; ``None``: no limit
    but ``longest``), keeping the chosen length when it still fits and the longest that fits otherwise, so
    that the slider never reads a length the model refuses (a model with fewer positions than ``shortest``
    is offered ``shortest`` alone, which its panel then refuses in one line)."""
    choices = [v for v in (2 ** i for i in range(16)) if shortest <= v <= min(most or longest, longest)] or [shortest]
    keep = control.value if control.value in choices else choices[-1]
    if list(control.options) != choices:
        control.options = choices
        control.value = keep


def dropdown(description: str, options, value=None) -> W.Dropdown:
    """A dropdown; a ``value`` not among ``options`` is refused in one line (``check_control_value``)."""
    options = list(options)
    control = W.Dropdown(options=options, description=description,   # the first option's value
                         style={"description_width": "initial"}, layout=W.Layout(width="auto"))
    if value is not None:
        check_control_value(description, control, value)
        control.value = value
    return control


ENGINES = ("auto", "cpu", "fake", "cuda")   # every engine; a panel offers ``engine_choices()``
NO_GPU_NOTE = ("The <code>cuda</code> engine is not offered: <code>torch.cuda.is_available()</code> is False on "
               "this machine (no GPU). <i>auto</i> picks <i>cpu</i> or <i>fake</i> instead, and each number's "
               "label says whose kernels answered.")


def engine_choices() -> tuple[str, ...]:
    """The engines a panel offers: ``cuda`` only where ``torch.cuda.is_available()``."""
    import torch
    return ENGINES if torch.cuda.is_available() else tuple(e for e in ENGINES if e != "cuda")


def engine_dropdown(value: str = "auto") -> W.Dropdown:
    """The engine control: the engines that can run here (``engine_choices``); asking for ``cuda``
    without a GPU is refused in one line saying why."""
    return dropdown("engine", engine_choices(), value)


def model_controls(model: str, *, batch: int | None = None, batch_max: int = 256, batch_min: int = 1,
                   batch_key: str = "batch", batch_label: str = "batch",
                   image_size: int | None | bool = False, image_min: int = 16,
                   optimizer: str | None = None, extra: dict[str, W.ValueWidget] | None = None,
                   engine: str | None = "auto") -> dict[str, W.ValueWidget]:
    """The controls the model panels share, always in this order: model, batch, image size,
    optimizer, the panel's own ``extra`` controls, engine. A control is left out when its
    argument is None (``image_size=False`` leaves the image size out; ``None`` starts it at
    the model's default size)."""
    from gpulab.training.optimizers import OPTIMIZERS
    from gpulab.models.registry import MODELS, resolve_model
    controls: dict[str, W.ValueWidget] = {"model": dropdown("model", list(MODELS), model)}
    if batch is not None:
        controls[batch_key] = slider(batch_label, batch, batch_min, batch_max, log=True)
    if image_size is not False:
        size = image_size or resolve_model(model).default_image_size
        controls["image_size"] = slider("image size", size, image_min, 512, step=16)
        _size_follows_model(controls["model"], controls["image_size"])
    if optimizer is not None:
        controls["optimizer"] = dropdown("optimizer", OPTIMIZERS, optimizer)
    controls.update(extra or {})
    if engine is not None:
        controls["engine"] = engine_dropdown(engine)
    return controls


def _size_follows_model(model: W.ValueWidget, size: W.ValueWidget) -> None:
    """When the student picks a model the image size slider is too small for (alexnet at 32), the slider
    moves to that model's default size, so the panel answers instead of refusing the pair."""
    from gpulab.models.registry import check_image_size, resolve_model

    def follow(change: dict) -> None:
        spec = resolve_model(change["new"])
        try:
            check_image_size(spec, int(size.value))
        except ValueError:
            size.value = max(int(size.min), min(int(size.max), int(spec.default_image_size)))

    model.observe(follow, names="value")
