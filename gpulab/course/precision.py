"""Lesson 08: mixed precision, measured per category.

``precision_step(...)`` tracks one training step of a lesson model three ways:

* ``fp32``: the baseline;
* ``autocast <dtype>``: ``torch.autocast`` (bf16 or fp16) around the forward and the loss;
  fp16 adds ``torch.amp.GradScaler`` (scale the loss, unscale the gradients, skip the step on
  inf/NaN);
* ``pure <dtype>``: the model, the batch and therefore the gradients and optimizer state all in
  the low-precision dtype, for contrast.

and reports the peak by category, what autograd saved by dtype, and the bytes per parameter
that stay between steps (parameters + gradients + optimizer state), next to the formulas:
the ratio each category *should* have to fp32 if only what autocast casts shrinks.
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpulab import formulas as F
from gpulab.measure.engines import LABEL_FORMULA, EngineChoice, choose_engine
# The measuring core lives in the library (gpulab record runs it too); these names stay importable here.
from gpulab.record.runs.precision import LOW_DTYPES, PrecisionRun, modes, run_precision_modes
from gpulab.training.optimizers import check_optimizer
from gpulab.predict.breakdown import validate_batch
from gpulab.models.registry import ModelSpec, check_image_size, resolve_model
from gpulab.categories import CATEGORIES, Category
from gpulab.units import dtype_bytes, dtype_name, format_bytes, parse_dtype
from gpulab.views import error_percent, fmt_error, html_table

__all__ = [
    "AutocastSupport", "KEPT_BY_AUTOCAST", "PrecisionResult",
    "apex_bytes_per_param", "autocast_grad_dtypes", "autocast_saved", "autocast_support",
    "autocast_support_report", "exercise_autocast_bytes_per_param", "exercise_autocast_grad_dtypes",
    "expected_ratio", "persistent_bytes_per_param", "precision_claims", "precision_engine", "precision_step",
    "saving_text"
]



# Categories whose dtype autocast leaves alone: the model's parameters stay fp32 (autocast
# casts a *copy* for each matmul/conv), their gradients take the parameters' dtype, and the
# optimizer state follows the parameters.
KEPT_BY_AUTOCAST = ("parameters", "gradients", "optimizer_state", "buffers", "inputs")


def autocast_support(device_type: str = "cpu") -> dict[str, bool]:
    """Does this torch accept ``torch.autocast(device_type, dtype=...)`` for bf16 and fp16,
    and is ``torch.amp.GradScaler(device_type)`` enabled? Checked by trying, not assumed."""
    out = {}
    for name in LOW_DTYPES:
        try:
            with torch.autocast(device_type, dtype=parse_dtype(name)):
                y = nn.functional.linear(torch.ones(2, 2, device=device_type), torch.ones(2, 2, device=device_type))
            out[name] = y.dtype == parse_dtype(name)
        except (RuntimeError, AssertionError):
            out[name] = False
    try:
        out["grad_scaler"] = torch.amp.GradScaler(device_type).is_enabled()
    except (RuntimeError, AssertionError, TypeError):
        out["grad_scaler"] = False
    return out


@dataclass
class AutocastSupport:
    """What this torch accepts on one device type, found by trying (``autocast_support``)."""
    device_type: str
    torch_version: str
    support: dict[str, bool]

    def _repr_html_(self) -> str:
        yes = lambda b: "yes" if b else "no"
        rows = [[f"torch.autocast('{self.device_type}', dtype=torch.{d})", yes(self.support[d])] for d in LOW_DTYPES]
        rows.append([f"torch.amp.GradScaler('{self.device_type}') enabled", yes(self.support["grad_scaler"])])
        return html_table(["", "works here"], rows, f"checked by trying, torch {self.torch_version}")

    def __repr__(self) -> str:
        return f"AutocastSupport({self.device_type}, {self.support})"


def autocast_support_report(device_type: str = "cpu") -> AutocastSupport:
    return AutocastSupport(device_type, torch.__version__, autocast_support(device_type))


def autocast_saved(low: str = "bfloat16", batch: int = 64, features: int = 256):
    """What autograd keeps for ``Linear -> ReLU -> Linear`` on a batch that requires grad,
    in float32 and under ``torch.autocast(dtype=low)`` (CPU, real tensors): two ``SavedReport``.
    Under autocast the matmuls save 16-bit copies of their inputs *and of the weights*."""
    from gpulab.measure.engines import LABEL_CPU
    from gpulab.course.inplace import SavedReport, saved_tensors
    low = dtype_name(parse_dtype(low))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(features, features), nn.ReLU(), nn.Linear(features, 10))
    x = torch.randn(batch, features, requires_grad=True)
    out = []
    for enabled in (False, True):
        with torch.autocast("cpu", dtype=parse_dtype(low), enabled=enabled):
            y = net(x)
        rows = saved_tensors(y, list(net.parameters()) + [x])
        title = f"autocast {low}" if enabled else "float32"
        out.append(SavedReport(f"{title}: Linear({features}, {features}) → ReLU → Linear({features}, 10), "
                               f"batch {batch}", rows, LABEL_CPU))
    return out


def expected_ratio(category: str, mode: str) -> float | None:
    """Formula: bytes of ``category`` in ``mode`` relative to fp32, if each tensor simply took
    the dtype its mode gives it (2/4 for a 16-bit float, 1 where the dtype does not change).
    Temporaries have no formula (None).
    NB: autocast activations are *not* all 16-bit: ops on autocast's fp32 list (losses;
    softmax and norms on CUDA, not on the CPU), int64 indices (max-pool) and masks keep their dtype, and
    autocast adds 16-bit copies of the weights it saves; the measurement shows how far off."""
    if mode == "fp32" or category == "temporaries":
        return 1.0 if mode == "fp32" else None
    low = mode.split()[-1]
    half = dtype_bytes(low) / 4
    if mode.startswith("autocast"):
        return 1.0 if category in KEPT_BY_AUTOCAST else half
    # pure low precision: everything floating is low precision (inputs included)
    return half


@dataclass
class PrecisionResult:
    model: str
    batch: int
    image_size: int
    optimizer: str
    low: str
    steps: int
    runs: dict[str, PrecisionRun]
    engine: str
    engine_reason: str
    support: dict[str, bool]
    predicted_label: str = LABEL_FORMULA

    @property
    def label(self) -> str:
        return self.runs["fp32"].measurement.label

    @property
    def modes(self) -> tuple[str, ...]:
        return tuple(self.runs)

    def ratio(self, mode: str, category: str) -> float | None:
        base = self.runs["fp32"].peak_by_category.get(category, 0)
        if not base:
            return None
        return self.runs[mode].peak_by_category.get(category, 0) / base

    def saving_percent(self, mode: str) -> float:
        """Peak saving against fp32, in % of the fp32 peak (negative: more memory)."""
        base = self.runs["fp32"].peak_bytes
        return 100.0 * (base - self.runs[mode].peak_bytes) / base

    def figure(self):
        from gpulab.course.plots_tradeoffs import precision_figure
        return precision_figure(self)

    def param_dtypes(self, mode: str) -> str:
        """The dtype the parameters had during ``mode`` (from the tracker's records)."""
        recs = [r for r in self.runs[mode].measurement.tracking.records.values()
                if r.category == Category.PARAMETERS]
        return ", ".join(sorted({r.dtype for r in recs})) or "—"

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "batch": self.batch, "image_size": self.image_size,
                "optimizer": self.optimizer, "low": self.low, "steps": self.steps, "engine": self.engine,
                "label": self.label,
                "support": dict(self.support),
                "runs": {k: {"peak_bytes": r.peak_bytes, "peak_by_category": r.peak_by_category,
                             "saved_by_dtype": r.saved_by_dtype, "persistent": r.persistent,
                             "bytes_per_param": r.bytes_per_param, "saving_percent": self.saving_percent(k),
                             "scaler": r.scaler} for k, r in self.runs.items()}}

    def __repr__(self) -> str:
        s = ", ".join(f"{k}: {saving_text(self.saving_percent(k))}" for k in self.runs if k != "fp32")
        return f"PrecisionResult({self.model}, batch {self.batch}, peak vs fp32: {s})"

    def _repr_html_(self) -> str:
        ms = list(self.runs)
        rows = []
        for c in [c.value for c in CATEGORIES] + ["total"]:
            vals = [r.peak_bytes if c == "total" else r.peak_by_category.get(c, 0) for r in self.runs.values()]
            if not any(vals):
                continue
            row = [c] + [format_bytes(v) for v in vals]
            for m in ms[1:]:
                meas = (self.runs[m].peak_bytes / self.runs["fp32"].peak_bytes if c == "total"
                        else self.ratio(m, c))
                exp = None if c == "total" else expected_ratio(c, m)
                row.append(("—" if meas is None else f"{meas:.2f}") + " / " + ("—" if exp is None else f"{exp:.2f}")
                           + (f" ({fmt_error(error_percent(exp, meas))})" if exp is not None and meas else ""))
            rows.append(row)
        rows.append(["bytes/param kept between steps"] + [f"{r.bytes_per_param:.2f}" for r in self.runs.values()]
                     + ["" for _ in ms[1:]])
        head = (f"<b>{html.escape(self.model)}</b>, batch {self.batch}, {self.image_size}×{self.image_size}, "
                f"{html.escape(self.optimizer)}, peak over {self.steps} training step(s) — engine "
                f"<b>{self.engine}</b> ({html.escape(self.engine_reason)}); {html.escape(self.label)}")
        table = html_table(["category (at the peak)"] + ms + [f"{m}: measured / formula ratio to fp32" for m in ms[1:]],
                           rows, "measured columns: " + self.label + " — each category at the moment of the peak "
                           "(gradients may be partly accumulated then); formula: each tensor in its mode's dtype; "
                           "binary units")
        saved = "; ".join(f"{m}: " + ", ".join(f"{d} {format_bytes(b)}" for d, b in
                                               sorted(r.saved_by_dtype.items(), key=lambda kv: -kv[1]))
                          for m, r in self.runs.items())
        claims = " ".join(f"{m}: the peak {saving_text(self.saving_percent(m))} against fp32." for m in ms[1:])
        scaler = "".join(f" GradScaler ({m}): scale {r.scaler['scale']}, its own state "
                         f"{format_bytes(r.scaler['state_bytes'])}." for m, r in self.runs.items() if r.scaler)
        return (head + table + f"<div>Activations at the peak by dtype — {html.escape(saved)}.</div>"
                f"<div>{claims}{html.escape(scaler)}</div>")


def saving_text(pct: float) -> str:
    """"saves 37.1%", "no change", "costs 5.0% more" (pct: saving in % of the fp32 peak)."""
    if abs(pct) < 0.05:
        return "no change"
    return f"saves {pct:.1f}%" if pct > 0 else f"costs {-pct:.1f}% more"


def precision_engine(model: str | ModelSpec, batch: int, image_size: int | None, low: str,
                     engine: str = "auto") -> EngineChoice:
    """The engine ``precision_step`` runs on (``choose_engine`` with the formula's bytes and FLOPs: weights
    four times, every output twice, a step's three forwards' FLOPs in ``low``, where a float16 FLOP counts
    ``CPU_FP16_SLOWDOWN`` times on the CPU). A panel's memory guard asks it: a run on the fake engine needs no guard."""
    from gpulab.predict.breakdown import breakdown
    spec = resolve_model(model)
    validate_batch(batch)
    size = image_size or spec.default_image_size
    check_image_size(spec, size, batch)   # the messages precision_step gives, before the formula
    bd = breakdown(spec, batch, size)
    known = 4 * bd.param_bytes + 2 * bd.total_output_bytes
    return choose_engine(engine, predicted_bytes=known, predicted_flops=3 * bd.forward_flops, dtype=parse_dtype(low))


def precision_step(model: str | ModelSpec = "cnn", batch: int = 32, image_size: int | None = None, optimizer: str = "adam",
                   low: str = "bfloat16", engine: str = "auto",
                   include: tuple[str, ...] | None = None, steps: int = 2) -> PrecisionResult:
    """Track ``steps`` training steps in fp32, with autocast, and in pure low precision.

    Two steps by default: optimizers such as Adam create their state in the first
    ``step()``, so only from the second step on does a forward/backward run next to it (the
    steady state of a training loop); the peak over both steps is the steady-state peak."""
    spec = resolve_model(model)
    validate_batch(batch)
    size = image_size or spec.default_image_size
    check_image_size(spec, size, batch)
    opt = check_optimizer(optimizer)
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    all_modes = modes(low)
    chosen = all_modes if include is None else tuple(m for m in all_modes if m in include or m == "fp32")
    low = dtype_name(parse_dtype(low))
    choice = precision_engine(spec, batch, size, low, engine)
    device_type = "cuda" if choice.name == "cuda" else "cpu"
    support = autocast_support(device_type)
    if not support.get(low, False):
        raise ValueError(f"this torch cannot autocast to {low} on {device_type}")
    runs = run_precision_modes(spec, batch, size, opt, chosen, choice.name, steps)
    return PrecisionResult(spec.name, batch, size, opt, low, steps, runs, choice.name,
                           choice.reason, support)


def persistent_bytes_per_param(optimizer: str, mode: str) -> float:
    """Formula: bytes per parameter kept between steps (parameters + gradients + optimizer
    state), without the 4-byte step counters. fp32 and autocast: 4 + 4 + 4 x states (autocast
    keeps fp32 weights, so gradients and state are fp32 too); pure 16-bit: 2 + 2 + 2 x states.
    Compare the reference articles' "16 bytes per parameter with Adam in mixed precision",
    which counts the apex/ZeRO layout: fp16 weights and gradients (2 + 2) plus fp32 master
    weights, momentum and variance (4 + 4 + 4)."""
    states = F.optimizer_state_multiplier(optimizer)
    size = 4 if mode == "fp32" or mode.startswith("autocast") else dtype_bytes(mode.split()[-1])
    return float(size * (2 + states))


def apex_bytes_per_param(optimizer: str = "adam") -> int:
    """The layout behind the articles' 16 B/param (ZeRO paper, section 3.1): fp16 weights and
    gradients, fp32 master weights and fp32 optimizer states."""
    return 2 + 2 + 4 + 4 * F.optimizer_state_multiplier(optimizer)


# --- the exercise and the articles' claims ---------------------------------------------------------

def exercise_autocast_bytes_per_param(optimizer: str = "adam", low: str = "bfloat16"):
    """Predict-first: bytes per parameter kept between steps with autocast."""
    from gpulab.course.exercises import Exercise
    mode = f"autocast {dtype_name(parse_dtype(low))}"
    states = F.optimizer_state_multiplier(optimizer)
    return Exercise(
        question=(f"A float32 model trains with torch.autocast(dtype=torch.{dtype_name(parse_dtype(low))}) and "
                  f"{optimizer}, zero_grad() at the top of the loop. Right after optimizer.step() (gradients still "
                  f"alive), how many bytes per parameter do the parameters, their gradients and the optimizer state "
                  f"take together (ignore the 4-byte step counters)?"),
        expected=lambda: persistent_bytes_per_param(optimizer, mode),
        explain=(f"autocast casts copies for each matmul/conv; the parameters themselves stay float32 (4 B), so their "
                 f"gradients are float32 (4 B) and {optimizer} keeps {states} float32 state tensor(s) per parameter "
                 f"({4 * states} B): {persistent_bytes_per_param(optimizer, mode):g} B, exactly as in float32 "
                 f"training. Only activations and temporaries shrink ({LABEL_FORMULA})."),
        unit="bytes/param", rel_tol=0.0,
        hint="Which does autocast cast to 16 bits, the parameters or copies of them, and is any copy still alive "
             "after step()?",
        ratio_hint="that would be 16-bit parameters. Which does autocast cast to 16 bits: the parameters, or copies "
                   "of them?")


def precision_claims(results: list[PrecisionResult], claimed_saving: float = 20.0):
    """The articles' mixed-precision claims, with verdicts computed from ``precision_step``
    results (one per model)."""
    from gpulab.course.claims import BREAKS, HOLDS, ClaimCheck, ClaimReport, Evidence
    checks = []
    if not results:
        raise ValueError("need at least one precision_step result")
    amp = lambda r: next(m for m in r.runs if m.startswith("autocast"))
    savings = [(r, r.saving_percent(amp(r))) for r in results]
    near = [r.model for r, pct in savings if abs(pct - claimed_saving) <= 10]
    far = [r.model for r, pct in savings if abs(pct - claimed_saving) > 10]
    verdict = HOLDS if not far else BREAKS if not near else f"holds for {', '.join(near)}; breaks for {', '.join(far)}"
    why_peak = []
    for r, pct in savings:
        phase = r.runs[amp(r)].measurement.tracking.peak_phase
        why_peak.append(f"{r.model} {saving_text(pct)} (peak in {phase})")
    checks.append(ClaimCheck(
        f"Mixed precision saves about {claimed_saving:.0f}% of memory.", "ref 003", verdict,
        ("Peak against float32 with autocast, by model: " + "; ".join(why_peak) + f" (\"about "
         f"{claimed_saving:.0f}%\" counted as within ±10 points). Autocast shrinks the activations it "
         "computes in 16 bits, so the saving depends on how much of the peak is activations: nothing when the peak "
         "is in the optimizer step (weights, gradients and Adam state stay float32), most when activations "
         "dominate."),
        [Evidence(f"{r.model}, batch {r.batch}: peak fp32 → {amp(r)}",
                  f"{format_bytes(r.runs['fp32'].peak_bytes)} → {format_bytes(r.runs[amp(r)].peak_bytes)} "
                  f"({saving_text(pct)})", r.label) for r, pct in savings]))
    adam = [r for r in results if r.optimizer in ("adam", "adamw")]
    if adam:
        r = adam[0]
        bpp = r.runs[amp(r)].bytes_per_param
        pure = next((m for m in r.runs if m.startswith("pure")), None)
        ok = abs(bpp - 16) <= 0.1
        ev = [Evidence(f"{r.model}: params + grads + Adam state per parameter, {amp(r)}", f"{bpp:.3f} B", r.label),
              Evidence("apex / ZeRO layout: fp16 weights + grads, fp32 master + 2 moments",
                       f"{apex_bytes_per_param('adam')} B", LABEL_FORMULA)]
        if pure:
            ev.append(Evidence(f"{r.model}, {pure}", f"{r.runs[pure].bytes_per_param:.3f} B", r.label))
        checks.append(ClaimCheck(
            "Training with Adam in mixed precision takes 16 bytes per parameter.", "ref 002",
            HOLDS if ok else BREAKS,
            (f"Measured {bpp:.2f} B/param with torch.autocast, but not for ref 002's reason: autocast keeps "
             f"float32 weights (4) and gradients (4) and Adam's two float32 moments (8); ref 002's layout "
             f"(apex, ZeRO) keeps fp16 weights and gradients (2 + 2) plus an fp32 master copy and moments "
             f"(4 + 4 + 4). Same total, different tensors; activations and autocast's 16-bit weight copies come "
             f"on top.") if ok else f"Measured {bpp:.2f} B/param, not 16.", ev))
    r = results[0]
    dts = r.param_dtypes(amp(r))
    checks.append(ClaimCheck(
        "Mixed precision computes in half precision but keeps the parameters in float32 (to keep accuracy).",
        "ref 002", HOLDS if dts == "float32" else BREAKS,
        (f"Under {amp(r)} the parameters stay {dts}; what autograd saves is mostly "
         f"{max(r.runs[amp(r)].saved_by_dtype, key=r.runs[amp(r)].saved_by_dtype.get, default='—')}. (Accuracy "
         f"itself is not measured here.)"),
        [Evidence(f"parameter dtype under {amp(r)}", dts, r.label),
         Evidence("activations at the peak by dtype",
                  ", ".join(f"{d}: {format_bytes(b)}" for d, b in r.runs[amp(r)].saved_by_dtype.items()) or "—",
                  r.label)]))
    return ClaimReport("What refs 002 and 003 (docs/references.md) claim about mixed precision, tested", checks)


def autocast_grad_dtypes(low: str = "bfloat16", batch: int = 8, features: int = 32) -> dict[str, str]:
    """Run ``Linear -> ReLU -> Linear`` under CPU autocast and read the dtypes backward produces:
    the gradient flowing into the first Linear's output (an activation gradient) and the
    weight's ``.grad``. Backward ops run in the dtype autocast chose for the matching forward op
    (torch/amp/autocast_mode.py, the ``autocast`` docstring), so activation gradients are 16-bit,
    while a parameter's gradient is accumulated in the parameter's own dtype (float32)."""
    dt = parse_dtype(low)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(features, features), nn.ReLU(), nn.Linear(features, 4))
    x = torch.randn(batch, features, requires_grad=True)
    seen: dict[str, torch.dtype] = {}
    with torch.autocast("cpu", dtype=dt):
        h = net[0](x)
        h.register_hook(lambda g: seen.update(activation=g.dtype))  # returns None: g is left as it is
        out = net[2](net[1](h))
    out.float().sum().backward()
    return {"activation gradient (into the first Linear's output)": dtype_name(seen["activation"]),
            "first Linear's weight.grad": dtype_name(net[0].weight.grad.dtype),
            "input x.grad": dtype_name(x.grad.dtype),
            "label": "measured on CPU: dtypes read from the gradients, torch.autocast('cpu')"}


def exercise_autocast_grad_dtypes(low: str = "bfloat16"):
    """Predict-first (qualitative): the dtypes of gradients under autocast, measured by
    ``autocast_grad_dtypes`` when the checker runs."""
    from gpulab.course.exercises import ChoiceExercise
    name = dtype_name(parse_dtype(low))

    def expected() -> str:
        d = autocast_grad_dtypes(low)
        act, w = d["activation gradient (into the first Linear's output)"], d["first Linear's weight.grad"]
        if act == name and w == name:
            return "a"
        if act == "float32" and w == "float32":
            return "b"
        return "c" if act == name and w == "float32" else "d"

    def explain() -> str:
        d = autocast_grad_dtypes(low)
        facts = "; ".join(f"{k}: {v}" for k, v in d.items() if k != "label")
        return (f"{facts} ({d['label']}). Backward ops run in the dtype autocast picked for the matching forward "
                f"op, so the gradients flowing between layers are {name}; a parameter's .grad takes the "
                f"parameter's dtype, float32, because the gradient of the cast copy is cast back.")

    return ChoiceExercise(
        question=(f"A float32 model runs its forward under torch.autocast(dtype=torch.{name}); backward runs "
                  f"outside the autocast region. In which dtype are (1) the gradients flowing backward between "
                  f"layers and (2) the parameters' .grad?"),
        options={"a": f"both {name}", "b": "both float32",
                 "c": f"(1) {name}, (2) float32", "d": f"(1) float32, (2) {name}"},
        expected=expected, explain=explain,
        hint="Ask in which dtype a matmul's backward runs, and whose dtype a parameter's .grad takes")
