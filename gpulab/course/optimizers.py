"""Optimizer memory, measured: state per optimizer, when it appears, the temporaries of the
for-loop / foreach / fused implementations, and what ``zero_grad`` keeps alive.

Every experiment here is a short training run (``steps`` steps of a fresh lesson model) on an
engine (``gpulab.measure.engines.run``), under the live-tensor tracker. At named moments (before and
after each ``step()``, after ``zero_grad``) it records the live bytes of each category, so the
question "how much optimizer state exists *now*?" is answered by the tracker, not by reading
``optimizer.state``. The tests read ``optimizer.state`` independently and compare.

Results are dataclasses with ``_repr_html_`` and a ``figure()``; nothing here prints. Every
number carries its source label: the engine's (``Measurement.label``) or ``formula``.
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from matplotlib.figure import Figure

from gpulab import formulas as F
from gpulab.course.anatomy import legend_outside
from gpulab.plots import to_png as as_png
from gpulab.measure.engines import LABEL_FORMULA, Measured, Measurement, run
# The measuring core lives in the library (gpulab record runs it too); these names stay importable here.
from gpulab.training.optimizers import IMPL_FLAGS as _IMPL_FLAGS
from gpulab.training.optimizers import OPTIMIZER_SPECS as _OPTIMIZER_SPECS
from gpulab.record.runs.optimizer import Moment, run_optimizer, state_tensor_bytes, step_peak
from gpulab.training.optimizers import IMPLEMENTATIONS, UnsupportedImplementation, build_optimizer
from gpulab.training.optimizers import check_implementation as _check_implementation
from gpulab.training.optimizers import check_optimizer as _check_optimizer
from gpulab.training.optimizers import constructor as _constructor
from gpulab.record.runs.optimizer import event_count as _event_count
from gpulab.record.runs.optimizer import moments_at as _moments
from gpulab.record.runs.optimizer import optimizer_experiment as _run_experiment
from gpulab.training.optimizers import OPTIMIZERS
from gpulab.predict.breakdown import predict_step, validate_batch
from gpulab.models.registry import ModelSpec, build_model, check_image_size, resolve_model
from gpulab.plots import CATEGORY_COLORS, LessonFigure
from gpulab.categories import Category
from gpulab.units import MiB, dtype_name, format_bytes, parse_dtype
from gpulab.views import error_percent, fmt_error, html_table

__all__ = [
    "ImplementationComparison", "ImplementationRow", "MixedPrecisionStates", "OptimizerComparison",
    "OptimizerRun", "Progress", "ZeroGradComparison", "compare_implementations",
    "compare_optimizers", "exercise_sgd_state", "exercise_state_after_first_step",
    "exercise_state_before_first_step", "implementation_figure", "largest_param_bytes",
    "mixed_precision_states", "model_states_figure", "optimizer_claims", "optimizer_run",
    "zero_grad_comparison"
]

# --- building optimizers -----------------------------------------------------------------------

# --- one tracked run ----------------------------------------------------------------------------

@dataclass
class OptimizerRun(Measured):
    """A short training run of one optimizer, tracked; see ``optimizer_run``."""
    model: str
    optimizer: str
    implementation: str
    batch: int
    image_size: int
    dtype: str
    steps: int
    set_to_none: bool
    measurement: Measurement
    n_params: int
    n_param_tensors: int
    param_bytes: int                       # formula: numel x element size, summed
    moments: dict[str, Moment]
    state_names: dict[str, int]            # read from optimizer.state after the run, for display
    formula_state_bytes: int               # gpulab.formulas.optimizer_state_bytes
    multiplier: int                        # gpulab.formulas.optimizer_state_multiplier
    formula_label: str = LABEL_FORMULA

    # ---- derived numbers -----------------------------------------------------------------------
    def _cat(self, moment: str, cat: Category | str) -> int:
        return self.moments[moment].by_category.get(Category(cat).value, 0)

    @property
    def state_before_bytes(self) -> int:
        """Optimizer state alive just before the first ``step()`` (measured)."""
        return self._cat("before step 1", Category.OPTIMIZER_STATE)

    @property
    def state_after_bytes(self) -> int:
        """Optimizer state alive just after the first ``step()`` (measured)."""
        return self._cat("after step 1", Category.OPTIMIZER_STATE)

    @property
    def state_final_bytes(self) -> int:
        return self._cat(f"after step {self.steps}", Category.OPTIMIZER_STATE)

    @property
    def step_counter_bytes(self) -> int:
        """Bytes of the scalar ``step`` tensors (Adam, AdamW, RMSprop, Adagrad keep one per
        parameter tensor) on the measured device, read from ``optimizer.state``. On CUDA they
        live on the CPU unless the optimizer is fused or capturable, so they count 0 there."""
        return self.state_names.get("step", 0)

    @property
    def state_ratio(self) -> float:
        """Measured state after the first step, in units of the parameter bytes, without the
        step counters (what the multiplier describes)."""
        return (self.state_after_bytes - self.step_counter_bytes) / self.param_bytes

    @property
    def model_states_bytes(self) -> int:
        """Params + grads + optimizer state alive right after the first step (measured)."""
        m = self.moments["after step 1"].by_category
        return sum(m.get(c.value, 0) for c in (Category.PARAMETERS, Category.GRADIENTS,
                                               Category.OPTIMIZER_STATE))

    @property
    def training_ratio(self) -> float:
        """Measured params + grads + state, in units of the parameter bytes (the articles' x2,
        x3, x4)."""
        return self.model_states_bytes / self.param_bytes

    @property
    def state_error_percent(self) -> float | None:
        return error_percent(self.formula_state_bytes, self.state_after_bytes)

    def step_window(self, step: int) -> tuple[int, int]:
        """Event indices [start, end) of optimizer.step() number ``step`` (1-based), from the
        moment before it to the moment after it."""
        return self.moments[f"before step {step}"].event, self.moments[f"after step {step}"].event

    def step_peak(self, step: int | None = None) -> tuple[int, dict[str, int]]:
        """Highest live total reached during ``optimizer.step()`` number ``step`` (default: the
        last), and the categories at that moment."""
        step = self.steps if step is None else step
        return step_peak(self.measurement, self.moments[f"before step {step}"], self.moments[f"after step {step}"])

    @property
    def step_extra_bytes(self) -> int:
        """How far live memory rises inside the last ``step()`` above what was alive just
        before it: state created there plus the update's temporaries."""
        return self.step_peak()[0] - self.moments[f"before step {self.steps}"].total

    @property
    def step_temporaries_bytes(self) -> int:
        """Temporaries alive at the peak of the last ``step()`` (the update's intermediates)."""
        return self.step_peak()[1].get(Category.TEMPORARIES.value, 0)

    def step_peak_of_run(self, step: int) -> int:
        """Highest live total from the moment after ``step - 1`` (or the start) to the moment
        after ``step``: the peak of training step number ``step``."""
        tr = self.measurement.tracking
        start = self.moments[f"after step {step - 1}"].event if step > 1 else 0
        end = self.moments[f"after step {step}"].event
        return max((sum(s.values()) for s in tr.series[start:end]), default=0)

    # ---- views -------------------------------------------------------------------------------
    def title(self) -> str:
        return (f"{self.model}, batch {self.batch}, {self.dtype}, {self.optimizer} ({self.implementation}) "
                f"— {self.label}")

    def _repr_html_(self) -> str:
        rows = [[name, format_bytes(m.by_category.get("parameters", 0)),
                 format_bytes(m.by_category.get("gradients", 0)),
                 format_bytes(m.by_category.get("optimizer_state", 0)),
                 format_bytes(m.by_category.get("temporaries", 0)), format_bytes(m.total)]
                for name, m in self.moments.items()]
        table = html_table(["moment", "parameters", "gradients", "optimizer state", "temporaries", "all live"],
                           rows, f"{self.title()}; binary units")
        names = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.state_names.items()) or "none"
        return (table + f"<div class='gpulab-label'>in optimizer.state after the run: {html.escape(names)}; "
                f"{self.formula_label}: {self.multiplier} × {format_bytes(self.param_bytes)} of "
                f"parameters = {format_bytes(self.formula_state_bytes)} incl. step counters</div>")

    def figure(self, title: str | None = None) -> Figure:
        """The run's timeline by category (``gpulab.plots.timeline``)."""
        from gpulab.plots import timeline
        return legend_outside(timeline(self.measurement.tracking, title=title or self.title()))

    def plot(self):
        """``figure()`` as a PNG image (what a notebook cell shows)."""
        return as_png(self.figure())

    def __repr__(self) -> str:
        return (f"OptimizerRun({self.model}, {self.optimizer}/{self.implementation}, engine={self.engine}, "
                f"state after step 1={self.state_after_bytes:,} B)")


def _prepare(model: str | ModelSpec, batch: int | None, image_size: int | None):
    """Resolve the model once and check the settings: (spec, batch, image size)."""
    spec = resolve_model(model)
    batch = validate_batch(spec.default_batch if batch is None else batch)
    size = image_size or spec.default_image_size
    check_image_size(spec, size, batch)
    return spec, batch, size


def optimizer_run(model: str = "mlp", optimizer: str = "adam", implementation: str = "default",
                  batch: int | None = 8, image_size: int | None = None, dtype: str | torch.dtype = "float32",
                  engine: str = "auto", steps: int = 2, set_to_none: bool = True) -> OptimizerRun:
    """Track ``steps`` training steps of a fresh ``model`` with ``optimizer``.

    Moments recorded (live bytes per category): ``after setup``, ``before step i``,
    ``after step i``, ``after zero_grad i`` (between steps). ``implementation`` is
    ``default``, ``for-loop``, ``foreach`` or ``fused``; an unsupported one raises
    ``UnsupportedImplementation`` before anything runs."""
    spec, batch, size = _prepare(model, batch, image_size)
    opt_key = _check_optimizer(optimizer)
    impl = _check_implementation(implementation)
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    dt = parse_dtype(dtype)
    _constructor(opt_key, impl)  # refuse an implementation this torch lacks before running anything
    pred = predict_step(spec, batch, size, opt_key, dt)
    flops = 3 * _forward_flops(spec, batch, size, dt) * steps
    m, out = run_optimizer(spec, opt_key, impl, batch, size, dt, steps, engine, set_to_none,
                           predicted_bytes=sum(v for v in pred.values() if v), predicted_flops=flops)
    if m.oom:
        raise MemoryError(f"{spec.name} batch {batch} ran out of memory on the {m.engine} engine: {m.error}")
    return OptimizerRun(
        model=spec.name, optimizer=opt_key, implementation=impl, batch=batch, image_size=size,
        dtype=dtype_name(dt), steps=steps, set_to_none=set_to_none, measurement=m,
        n_params=out["n_params"], n_param_tensors=out["n_param_tensors"], param_bytes=out["param_bytes"],
        moments=_moments(out["marks"], m), state_names=out["state_names"],
        formula_state_bytes=F.optimizer_state_bytes(out["param_bytes"], out["n_param_tensors"], opt_key,
                                                    count_step_counters=m.engine != "cuda" or impl == "fused"),
        multiplier=F.optimizer_state_multiplier(opt_key))


def _forward_flops(model: str | ModelSpec, batch: int, size: int, dt: torch.dtype) -> int:
    from gpulab.predict.breakdown import breakdown
    return breakdown(model, batch, size, dt).forward_flops


# --- all optimizers side by side ------------------------------------------------------------------

Progress = Callable[[float, str], None] | None


@dataclass
class OptimizerComparison:
    """State after the first ``step()`` for several optimizers, measured next to the formula."""
    runs: list[OptimizerRun]

    @property
    def label(self) -> str:
        return self.runs[0].label if self.runs else ""

    def row(self, optimizer: str) -> OptimizerRun:
        for r in self.runs:
            if r.optimizer == optimizer:
                return r
        raise KeyError(optimizer)

    def rows(self) -> list[list[str]]:
        out = []
        for r in self.runs:
            out.append([r.optimizer, format_bytes(r.state_before_bytes), format_bytes(r.state_after_bytes),
                        format_bytes(r.formula_state_bytes), fmt_error(r.state_error_percent),
                        f"×{r.multiplier}", f"×{r.state_ratio:.3f}", f"×{F.training_multiplier(r.optimizer)}",
                        f"×{r.training_ratio:.3f}", format_bytes(r.step_counter_bytes)])
        return out

    def _repr_html_(self) -> str:
        if not self.runs:
            return "<i>no optimizers</i>"
        r0 = self.runs[0]
        head = (f"<b>{html.escape(r0.model)}</b>: {r0.n_params:,} parameters in {r0.n_param_tensors} tensors, "
                f"{format_bytes(r0.param_bytes)} ({LABEL_FORMULA}); batch {r0.batch}; engine <b>{r0.engine}</b> "
                f"({html.escape(r0.measurement.reason)})")
        return head + html_table(
            ["optimizer", "state before 1st step()", "state after 1st step()", "formula", "formula error",
             "state multiplier (formula)", "state / params (measured)", "params+grads+state (formula)",
             "params+grads+state (measured)", "step counters"],
            self.rows(),
            f"measured: {self.label}; formula: gpulab.formulas. The measured state/params "
            f"ratio leaves out the 4-byte step counters; binary units")

    def plot(self):
        """``figure()`` as a PNG image (what a notebook cell shows)."""
        return as_png(self.figure())

    def figure(self) -> Figure:
        return model_states_figure(self.runs, title=f"{self.runs[0].model}: params + grads + optimizer state "
                                                    f"after the first step()" if self.runs else "")


def compare_optimizers(model: str = "mlp", optimizers: Sequence[str] = OPTIMIZERS, batch: int | None = 8,
                       image_size: int | None = None, dtype: str | torch.dtype = "float32",
                       engine: str = "auto", progress: Progress = None) -> OptimizerComparison:
    """``optimizer_run`` for each optimizer (default implementation, 1 step)."""
    if not optimizers:
        raise ValueError("choose at least one optimizer")
    runs = []
    for i, name in enumerate(optimizers):
        if progress:
            progress(i / len(optimizers), f"{name} ({i + 1}/{len(optimizers)})")
        runs.append(optimizer_run(model, name, "default", batch, image_size, dtype, engine, steps=1))
    if progress:
        progress(1.0, "done")
    return OptimizerComparison(runs)


def model_states_figure(runs: Sequence[OptimizerRun], title: str = "") -> Figure:
    """Stacked bars per optimizer: parameters, gradients, optimizer state (measured, just after
    the first step), in units of the parameter bytes; a black tick marks the formula's
    multiplier (2 + states)."""
    fig = LessonFigure(figsize=(7.0, 3.6), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    xs = list(range(len(runs)))
    bottoms = [0.0] * len(runs)
    for cat in (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE):
        vals = [r.moments["after step 1"].by_category.get(cat.value, 0) / r.param_bytes for r in runs]
        ax.bar(xs, vals, 0.6, bottom=bottoms, color=CATEGORY_COLORS[cat.value], label=cat.value)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    for x, r in zip(xs, runs):
        f = F.training_multiplier(r.optimizer)
        ax.plot([x - 0.4, x + 0.4], [f, f], color="k", lw=2, label=f"{LABEL_FORMULA}: 2 + states" if x == 0 else None)
        ax.text(x, bottoms[x] + 0.05, f"×{bottoms[x]:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(xs, [r.optimizer for r in runs])
    ax.set_ylabel("bytes ÷ parameter bytes")
    ax.set_ylim(0, max(bottoms + [4]) * 1.12)
    ax.legend(fontsize=8)
    label = runs[0].label if runs else ""
    ax.set_title(f"{title}\nbars: {label}", fontsize=9)
    return legend_outside(fig)


# --- implementations: for-loop, foreach, fused -----------------------------------------------------

@dataclass
class ImplementationRow:
    implementation: str
    run: OptimizerRun | None
    unsupported: str | None = None   # why it could not run here


@dataclass
class ImplementationComparison:
    """The same optimizer with each implementation: how far memory rises inside ``step()``
    (steady state: the last of ``steps`` steps, so no state is created there)."""
    model: str
    optimizer: str
    rows: list[ImplementationRow]

    @property
    def label(self) -> str:
        for r in self.rows:
            if r.run is not None:
                return r.run.label
        return ""

    def row(self, implementation: str) -> ImplementationRow:
        for r in self.rows:
            if r.implementation == implementation:
                return r
        raise KeyError(implementation)

    def _repr_html_(self) -> str:
        rows = []
        for r in self.rows:
            if r.run is None:
                rows.append([r.implementation, "not supported", "", "", r.unsupported or ""])
                continue
            run_ = r.run
            rows.append([r.implementation, format_bytes(run_.step_temporaries_bytes),
                         f"{run_.step_temporaries_bytes / run_.param_bytes:.2f}",
                         format_bytes(run_.step_extra_bytes), format_bytes(run_.step_peak()[0])])
        first = next((r.run for r in self.rows if r.run is not None), None)
        head = ""
        if first is not None:
            head = (f"<b>{html.escape(self.model)}</b>, {html.escape(self.optimizer)}: parameters "
                    f"{format_bytes(first.param_bytes)} ({LABEL_FORMULA}), largest parameter tensor "
                    f"{format_bytes(largest_param_bytes(first.model, first.image_size, first.dtype))}; "
                    f"engine <b>{first.engine}</b>")
        return head + html_table(
            ["implementation", "temporaries at the step() peak", "÷ parameter bytes",
             "rise inside step()", "live at the step() peak"], rows,
            f"steady state (last of {first.steps if first else 2} steps): {self.label}; binary units")

    def figure(self) -> Figure:
        return implementation_figure(self)

    def plot(self):
        """``figure()`` as a PNG image (what a notebook cell shows)."""
        return as_png(self.figure())


def largest_param_bytes(model: str | ModelSpec, image_size: int | None = None, dtype: str | torch.dtype = "float32") -> int:
    """Bytes of the model's largest parameter tensor (meta device, shapes only)."""
    net = build_model(resolve_model(model), image_size, device="meta", dtype=parse_dtype(dtype))
    return max(p.numel() * p.element_size() for p in net.parameters())


def compare_implementations(model: str = "mlp", optimizer: str = "adam",
                            implementations: Sequence[str] = IMPLEMENTATIONS, batch: int | None = 8,
                            image_size: int | None = None, dtype: str | torch.dtype = "float32",
                            engine: str = "auto", progress: Progress = None) -> ImplementationComparison:
    """``optimizer_run`` (2 steps) with each implementation; one that torch does not support
    here becomes a row saying why, instead of an error."""
    spec = resolve_model(model)
    rows = []
    for i, impl in enumerate(implementations):
        if progress:
            progress(i / len(implementations), f"{impl} ({i + 1}/{len(implementations)})")
        try:
            rows.append(ImplementationRow(impl, optimizer_run(spec, optimizer, impl, batch, image_size, dtype,
                                                              engine, steps=2)))
        except UnsupportedImplementation as exc:
            rows.append(ImplementationRow(impl, None, str(exc)))
        except (RuntimeError, NotImplementedError) as exc:  # refused while stepping
            rows.append(ImplementationRow(impl, None, f"failed while stepping: {type(exc).__name__}: {exc}"))
    if progress:
        progress(1.0, "done")
    return ImplementationComparison(spec.name, _check_optimizer(optimizer), rows)


def implementation_figure(cmp: ImplementationComparison) -> Figure:
    """Bars per implementation: temporaries at the peak of ``step()``; dashed lines at the
    parameter bytes and at the largest parameter tensor."""
    fig = LessonFigure(figsize=(7.0, 3.6), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    names = [r.implementation for r in cmp.rows]
    vals = [(r.run.step_temporaries_bytes / MiB) if r.run else 0.0 for r in cmp.rows]
    ax.bar(range(len(names)), vals, 0.6, color=CATEGORY_COLORS["temporaries"], label="temporaries at the step() peak")
    for x, r in enumerate(cmp.rows):
        txt = "not supported\nhere" if r.run is None else format_bytes(r.run.step_temporaries_bytes)
        ax.text(x, vals[x], txt, ha="center", va="bottom", fontsize=8)
    first = next((r.run for r in cmp.rows if r.run is not None), None)
    if first is not None:
        ax.axhline(first.param_bytes / MiB, color=CATEGORY_COLORS["parameters"], ls="--", lw=1,
                   label=f"all parameters ({format_bytes(first.param_bytes)}, {LABEL_FORMULA})")
        big = largest_param_bytes(first.model, first.image_size, first.dtype)
        ax.axhline(big / MiB, color="k", ls=":", lw=1,
                   label=f"largest parameter tensor ({format_bytes(big)}, {LABEL_FORMULA})")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("MiB")
    top = max(vals + [first.param_bytes / MiB if first else 1.0])
    ax.set_ylim(0, top * 1.15)
    ax.legend(fontsize=8)
    ax.set_title(f"{cmp.model}, {cmp.optimizer}: temporaries inside step() (steady state)\n{cmp.label}", fontsize=9)
    return legend_outside(fig)


# --- zero_grad ----------------------------------------------------------------------------------------

@dataclass
class ZeroGradComparison:
    """``zero_grad(set_to_none=True)`` (the default since torch 2.0) vs ``set_to_none=False``."""
    runs: dict[bool, OptimizerRun]

    def between_steps(self, set_to_none: bool) -> dict[str, int]:
        return dict(self.runs[set_to_none].moments["after zero_grad 1"].by_category)

    def _repr_html_(self) -> str:
        rows = []
        for flag, r in self.runs.items():
            between = r.moments["after zero_grad 1"]
            rows.append([f"zero_grad(set_to_none={flag})", format_bytes(between.by_category.get("gradients", 0)),
                         format_bytes(between.total), format_bytes(r.step_peak_of_run(2))])
        r0 = next(iter(self.runs.values()))
        return html_table(["between steps", "gradients alive", "all live tensors", "peak of step 2"], rows,
                          f"{r0.model}, batch {r0.batch}, {r0.optimizer}: {r0.label}; binary units")


def zero_grad_comparison(model: str = "mlp", optimizer: str = "sgd", batch: int | None = 8,
                         image_size: int | None = None, engine: str = "auto") -> ZeroGradComparison:
    return ZeroGradComparison({flag: optimizer_run(model, optimizer, "default", batch, image_size,
                                                   engine=engine, steps=2, set_to_none=flag)
                               for flag in (True, False)})


# --- mixed precision: bytes per parameter ------------------------------------------------------------

@dataclass
class MixedPrecisionStates:
    """Adam under ``torch.autocast``: bytes per parameter of params, grads and state (measured)
    next to the mixed-precision layout of the ZeRO paper (fp16 weights and grads, fp32 master
    weights + two moments: 2 + 2 + 12 = 16 bytes per parameter)."""
    run: OptimizerRun
    autocast_dtype: str

    ZERO_LAYOUT = {"fp16 parameters": 2, "fp16 gradients": 2, "fp32 master parameters": 4,
                   "fp32 exp_avg": 4, "fp32 exp_avg_sq": 4}

    def bytes_per_param(self) -> dict[str, float]:
        m = self.run.moments["after step 1"].by_category
        n = self.run.n_params
        return {c: m.get(c, 0) / n for c in ("parameters", "gradients", "optimizer_state")}

    @property
    def total_bytes_per_param(self) -> float:
        return sum(self.bytes_per_param().values())

    def _repr_html_(self) -> str:
        bpp = self.bytes_per_param()
        rows = [[k.replace("_", " "), f"{v:.3f}"] for k, v in bpp.items()]
        rows.append(["total (measured)", f"{self.total_bytes_per_param:.3f}"])
        rows.append(["ZeRO mixed-precision layout (formula)", f"{sum(self.ZERO_LAYOUT.values())}"])
        return html_table(["bytes per parameter", "value"], rows,
                          f"{self.run.model}, Adam, autocast to {self.autocast_dtype}: {self.run.label}; "
                          f"ZeRO layout: {LABEL_FORMULA}")


def mixed_precision_states(model: str = "mlp", batch: int | None = 8, engine: str = "auto",
                           autocast_dtype: str | torch.dtype | None = None) -> MixedPrecisionStates:
    """One Adam step with the forward under ``torch.autocast`` (bfloat16 on the CPU, float16 on
    CUDA unless given): the weights, their gradients and Adam's state stay float32."""
    spec, batch, size = _prepare(model, batch, None)
    pred = predict_step(spec, batch, size, "adam", torch.float32)
    flops = 3 * _forward_flops(spec, batch, size, torch.float32)
    from gpulab.measure.engines import choose_engine
    eng = choose_engine(engine, sum(v for v in pred.values() if v), flops).name
    ac = parse_dtype(autocast_dtype) if autocast_dtype else (torch.float16 if eng == "cuda" else torch.bfloat16)
    out: dict[str, Any] = {}
    m = run(_run_experiment(spec, "adam", "default", batch, size, torch.float32, 1, True, ac, out), eng)
    if m.oom:
        raise MemoryError(f"out of memory on the {m.engine} engine: {m.error}")
    r = OptimizerRun(spec.name, "adam", "default", batch, size, "float32", 1, True, m, out["n_params"],
                     out["n_param_tensors"], out["param_bytes"], _moments(out["marks"], m), out["state_names"],
                     F.optimizer_state_bytes(out["param_bytes"], out["n_param_tensors"], "adam",
                                             count_step_counters=m.engine != "cuda"),
                     F.optimizer_state_multiplier("adam"))
    return MixedPrecisionStates(r, dtype_name(ac))


# --- exercises and claims (lesson 05) ----------------------------------------------------------------

def exercise_state_after_first_step(model: str = "mlp", optimizer: str = "adam"):
    """Predict-first: optimizer state bytes right after the first ``step()``."""
    from gpulab.course.exercises import Exercise
    from gpulab.predict.breakdown import breakdown
    from gpulab.course.exercises import CheckResult
    bd = breakdown(model)
    key = _check_optimizer(optimizer)
    ex = Exercise(
        question=f"{bd.model} has {bd.total_params:,} float32 parameters in {bd.param_tensors} tensors. How many "
                 f"bytes of optimizer state does {key} hold right after its first step()?",
        expected=lambda: F.optimizer_state_bytes(bd.param_bytes, bd.param_tensors, key),
        explain=f"{F.optimizer_state_multiplier(key)} × the parameter bytes ({format_bytes(bd.param_bytes)}), plus a "
                f"4-byte step counter per parameter tensor for the optimizers that keep one ({LABEL_FORMULA}).",
        unit="bytes", rel_tol=0.001,
        hint="Each state tensor has the shape and dtype of its parameter; count how many per parameter.",
        ratio_hint=f"count the state tensors {key} keeps per parameter, each the size of its parameter.")
    plain_check = ex.check
    no_counters = F.optimizer_state_multiplier(key) * bd.param_bytes

    def check(answer: Any) -> CheckResult:
        """The state without its step counters, typed exactly, is the GPU's answer, not this CPU's: the
        tolerance (for rounded answers) would accept it, so it is answered on its own."""
        res = plain_check(answer)
        try:
            said = float(answer)
        except (TypeError, ValueError, OverflowError):
            return res
        counters = res.expected - no_counters
        if counters and said == no_counters:
            return CheckResult(False, answer, res.expected,
                               f"You said {int(said):,} bytes: the state without its step counters. That is right "
                               f"on a GPU, where the counters live in host memory; this run is on the CPU, so add "
                               f"the {int(counters):,} bytes of counters (4 per parameter tensor). Try again.")
        return res

    ex.check = check
    return ex


def exercise_state_before_first_step(model: str = "mlp", optimizer: str = "adam"):
    """Predict-first: optimizer state bytes after construction, before any ``step()``."""
    from gpulab.course.exercises import Exercise
    key = _check_optimizer(optimizer)
    if key == "adagrad":
        raise ValueError("Adagrad fills its state in its constructor, so it holds state before the first step(); "
                         "this question is about an optimizer that creates it lazily (adam, adamw, sgd, ...)")
    return Exercise(
        question=f"And before the first step(): how many bytes of state does a freshly built {key} hold?",
        expected=lambda: 0,
        explain=f"None: {key} creates its state lazily, inside the first step() (its _init_group; Adagrad is the "
                "exception, filling its state in the constructor), so a model that fits before the first step can "
                "still run out of memory in it.",
        unit="bytes", rel_tol=0.0,
        hint=f"Does the constructor create {key}'s state tensors, or does the first step()?")


def exercise_sgd_state(model: str = "mlp", batch: int = 8):
    """Predict-first (qualitative): how much state does plain SGD (no momentum) hold after its first
    ``step()``? Measured by ``optimizer_run`` (live-tensor tracker) when the checker runs."""
    from gpulab.course.exercises import ChoiceExercise
    cache: dict[str, OptimizerRun] = {}

    def result() -> OptimizerRun:
        if "r" not in cache:
            cache["r"] = optimizer_run(model, "sgd", batch=batch, steps=1)
        return cache["r"]

    def expected() -> str:
        r = result()
        copies = r.state_after_bytes / r.param_bytes
        return "a" if copies < 0.5 else ("b" if copies < 1.5 else "c")

    def explain() -> str:
        r = result()
        return (f"Measured: {format_bytes(r.state_after_bytes)} of optimizer state after the first step(), for "
                f"{format_bytes(r.param_bytes)} of parameters ({r.label}). torch.optim.SGD with momentum=0 keeps "
                f"no buffer (its step() stores a momentum_buffer only when momentum ≠ 0): the update p -= lr × grad "
                f"needs only the gradient. "
                f"Momentum adds one copy of the parameters, Adam two.")

    return ChoiceExercise(
        question=(f"Plain SGD (torch.optim.SGD(model.parameters(), lr=0.01), no momentum) trains the {model.upper()} "
                  f"for one step. How much optimizer state does it hold right after that step()?"),
        options={"a": "none", "b": "one copy of the parameters", "c": "two copies of the parameters"},
        expected=expected, explain=explain)


def _close(measured: float, claimed: float, tol: float = 0.01) -> bool:
    return abs(measured - claimed) <= tol * abs(claimed)


def optimizer_claims(cmp: OptimizerComparison, impl: ImplementationComparison | None = None,
                     mixed: MixedPrecisionStates | None = None):
    """The articles' optimizer claims (x2, x3, x4, 16 bytes/param) with verdicts computed from
    measurements."""
    from gpulab.course.claims import BREAKS, HOLDS, ClaimCheck, ClaimReport, Evidence
    checks = []
    text = {"sgd": ("SGD: parameters + gradients, so the parameter memory doubles (×2).", "refs 001, 002, 003"),
            "momentum": ("SGD with momentum adds a momentum buffer: ×3.", "refs 001, 002"),
            "adam": ("Adam keeps two moments: ×4.", "refs 001, 002")}
    for name, (claim, src) in text.items():
        try:
            r = cmp.row(name)
        except KeyError:
            continue
        want = F.training_multiplier(name)
        ok = _close(r.training_ratio, want)
        ev = [Evidence("parameters", format_bytes(r.param_bytes), LABEL_FORMULA),
              Evidence("params + grads + state after the first step()", format_bytes(r.model_states_bytes), r.label),
              Evidence("ratio", f"×{r.training_ratio:.4f}", r.label)]
        verdict = HOLDS if ok else BREAKS
        why = (f"Measured ×{r.training_ratio:.4f}" + (f"; the excess over ×{want} is the {format_bytes(r.step_counter_bytes)}"
                                                        f" of 4-byte step counters." if r.step_counter_bytes else ".")
               if ok else f"Measured ×{r.training_ratio:.3f}, not ×{want}.")
        if name == "adam" and impl is not None and ok and impl.optimizer == "adam":
            runs = [(row.implementation, row.run) for row in impl.rows if row.run is not None]
            worst = max(runs, key=lambda t: t[1].step_temporaries_bytes, default=None)
            if worst is not None and worst[1].step_temporaries_bytes > 0.05 * worst[1].param_bytes:
                w = worst[1]
                split = w.step_peak()[1]
                at_peak = sum(split.get(c, 0) for c in ("parameters", "gradients", "optimizer_state",
                                                        "temporaries")) / w.param_bytes
                verdict = f"holds between steps, breaks inside a {worst[0]} step()"
                why += (f" Inside step() the {worst[0]} implementation adds {format_bytes(w.step_temporaries_bytes)} "
                        f"of temporaries on {w.model}: ×{at_peak:.2f} of its parameter bytes at that moment.")
                ev.append(Evidence(f"params + grads + state + temporaries at the {worst[0]} step() peak, "
                                   f"{w.model}", f"×{at_peak:.2f}", w.label))
        checks.append(ClaimCheck(claim, src, verdict, why, ev))
    if mixed is not None:
        per = mixed.bytes_per_param()
        total = mixed.total_bytes_per_param
        zero = sum(MixedPrecisionStates.ZERO_LAYOUT.values())
        checks.append(ClaimCheck(
            "Training with Adam in mixed precision takes 16 bytes per parameter (8.3 B parameters → 133 GB).",
            "ref 002", HOLDS if _close(total, 16) else BREAKS,
            (f"Measured {total:.3f} bytes per parameter with torch.autocast: the weights and their gradients stay "
             f"float32 ({per['parameters']:.0f} + {per['gradients']:.0f}) and Adam adds {per['optimizer_state']:.0f}. "
             f"The ZeRO paper's layout (fp16 weights and grads, fp32 master copy and moments) also gives {zero}, "
             f"split differently. Activations come on top.") if _close(total, 16) else
            f"Measured {total:.2f} bytes per parameter, not 16.",
            [Evidence("params + grads + Adam state per parameter", f"{total:.3f} B", mixed.run.label),
             Evidence("ZeRO mixed-precision layout", f"{zero} B", LABEL_FORMULA)]))
        opt_part = MixedPrecisionStates.ZERO_LAYOUT["fp32 master parameters"] + \
            MixedPrecisionStates.ZERO_LAYOUT["fp32 exp_avg"] + MixedPrecisionStates.ZERO_LAYOUT["fp32 exp_avg_sq"]
        meas_state = per["optimizer_state"]
        ok = _close(meas_state, 16) or _close(opt_part, 16)
        checks.append(ClaimCheck(
            "The optimizer state alone is 16 × the parameter count in bytes (1.37 B parameters → 21.9 GB).",
            "ref 002", HOLDS if ok else BREAKS,
            f"The 16 bytes are all the model states, not the optimizer's share: Adam's own state is "
            f"{meas_state:.0f} bytes per parameter under autocast (measured), {opt_part} in the ZeRO layout "
            f"(fp32 master weights + two moments). 1.37 B × 16 B = 21.9 GB is the total for weights, gradients "
            f"and optimizer together." if not ok else "Measured as claimed.",
            [Evidence("Adam state per parameter under autocast", f"{meas_state:.3f} B", mixed.run.label),
             Evidence("optimizer share in the ZeRO layout", f"{opt_part} B", LABEL_FORMULA)]))
    return ClaimReport(f"What refs 001, 002 and 003 (docs/references.md) claim about optimizers, tested ({cmp.label})", checks)
