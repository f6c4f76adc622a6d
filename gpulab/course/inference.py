"""Lesson 06, part 2: forward passes that do not train.

* ``inference_modes(...)``: one forward of a small conv-BN-dropout net in each of
  ``train() + grad``, ``eval() + grad``, ``train() + no_grad``, ``eval() + no_grad`` and
  ``eval() + inference_mode``: the peak, what stays alive while the output is held (what
  autograd saved), and what each switch changes (graph, dropout, batch-norm statistics,
  version counters).
* ``forward_lifetimes(...)``: a small U-Net written two ways, every intermediate under its own
  local name versus one reused name plus ``del`` of each skip tensor after its last use (the
  reference articles' advice), measured with and without autograd.
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

import torch

from gpulab import formulas as F
from gpulab.measure.engines import LABEL_FORMULA, Measured, Measurement
# The measuring core lives in the library (gpulab record runs it too); these names stay importable here.
from gpulab.record.runs.inference import GRAD_MODES, MODES, STYLES, TinyUNet, eval_demo_net, forward_peak, mode_context, run_lifetimes, run_modes
from gpulab.course.inplace import SavedTensor, saved_activation_bytes, validate_positive
from gpulab.units import format_bytes
from gpulab.views import error_percent, fmt_error, html_table

__all__ = [
    "LifetimeRun", "LifetimesResult", "ModeRun", "ModesResult", "forward_lifetimes",
    "inference_claims", "inference_modes", "mode_facts", "names_kept_peak", "predict_saved_bytes",
    "unet_intermediates"
]



# --- the model ----------------------------------------------------------------------------------

def predict_saved_bytes(batch: int, channels: int, image_size: int, training: bool) -> int:
    """What autograd saves in one forward of ``eval_demo_net`` with grad enabled (bytes of new
    storages; input, weights and BN running buffers are saved by reference).

    From tools/autograd/derivatives.yaml: BN saves its input (the conv output) and, in
    training, two per-channel statistics; ReLU saves its result, which max-pool saves as its
    input too (one storage); max-pool saves int64 indices; Linear saves its input. In
    training, dropout is ``input * mask`` and saves the scaled mask (float32, one per element),
    and Linear's input is dropout's new output; in eval dropout returns its input, so Linear
    saves the pooled map (through the flatten view).
    NB: assumes the CPU/CUDA dropout kernel that keeps a float mask; a fused kernel may keep a
    1-byte bool mask instead."""
    full = F.tensor_bytes((batch, channels, image_size, image_size))
    half = (batch, channels, image_size // 2, image_size // 2)
    total = full                              # BN input (conv output)
    total += full                             # ReLU result = max-pool input
    total += F.tensor_bytes(half, "int64")    # max-pool indices
    total += F.tensor_bytes(half)             # Linear input (dropout output, or the pooled map)
    if training:
        total += 2 * F.tensor_bytes([channels])  # save_mean, save_invstd
        total += F.tensor_bytes(half)            # dropout's scaled mask
    return total


@dataclass
class ModeRun:
    mode: str
    measurement: Measurement
    held_bytes: int               # live after the forward, output still held (minus params/input)
    saved: list[SavedTensor]
    requires_grad: bool
    grad_fn: str | None
    is_inference: bool
    bn_stats_updated: bool
    dropout_active: bool
    version_tracked: bool
    can_backward: bool

    @property
    def peak_bytes(self) -> int:
        return self.measurement.peak_bytes

    @property
    def saved_bytes(self) -> int:
        return saved_activation_bytes(self.saved)


@dataclass
class ModesResult(Measured):
    batch: int
    channels: int
    image_size: int
    runs: dict[str, ModeRun]
    predicted: dict[str, int]
    predicted_label: str = LABEL_FORMULA

    @property
    def measurement(self) -> Measurement:
        """The run whose engine and label speak for the comparison: the first mode's run."""
        return next(iter(self.runs.values())).measurement

    def figure(self):
        from gpulab.course.plots_tradeoffs import modes_figure
        return modes_figure(self)

    def as_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "channels": self.channels, "image_size": self.image_size,
                "engine": self.engine, "label": self.label, "predicted_saved_bytes": dict(self.predicted),
                "runs": {k: {"peak_bytes": r.peak_bytes, "held_bytes": r.held_bytes, "saved_bytes": r.saved_bytes,
                             "requires_grad": r.requires_grad, "grad_fn": r.grad_fn,
                             "is_inference": r.is_inference, "bn_stats_updated": r.bn_stats_updated,
                             "dropout_active": r.dropout_active, "version_tracked": r.version_tracked,
                             "can_backward": r.can_backward} for k, r in self.runs.items()}}

    def __repr__(self) -> str:
        peaks = ", ".join(f"{k}: {r.peak_bytes:,} B" for k, r in self.runs.items())
        return f"ModesResult(batch={self.batch}, {peaks})"

    def _repr_html_(self) -> str:
        yes = lambda b: "yes" if b else "no"
        rows = []
        for k, r in self.runs.items():
            p = self.predicted[k]
            rows.append([k, format_bytes(r.peak_bytes), format_bytes(r.held_bytes), format_bytes(r.saved_bytes),
                         format_bytes(p), fmt_error(error_percent(p, r.saved_bytes)),
                         r.grad_fn or "None", yes(r.dropout_active), yes(r.bn_stats_updated),
                         yes(r.version_tracked), yes(r.can_backward)])
        head = (f"one forward of <code>eval_demo_net</code>, batch {self.batch}, {self.channels} channels, "
                f"{self.image_size}×{self.image_size} — {html.escape(self.label)}")
        return head + html_table(
            ["mode", "peak", "held while the output lives", "saved by autograd", "formula: saved",
             "formula error", "out.grad_fn", "dropout active", "BN stats updated", "version counter",
             "backward possible"], rows,
            "memory columns: live tensors beyond parameters, buffers and the input batch where noted; "
            "binary units")


def mode_facts(mode: str, channels: int = 4, image_size: int = 8) -> dict[str, bool]:
    """What a mode changes, observed on a tiny net (no tracker): do BN's running statistics
    move, is dropout active (two forwards differ), does the output track a version counter,
    can ``backward()`` run through it?"""
    torch.manual_seed(0)
    net = eval_demo_net(channels, image_size)
    net.train(mode.startswith("train"))
    x = torch.randn(4, 3, image_size, image_size)
    before = net[1].running_mean.clone()
    with mode_context(mode):
        a = net(x)
        b = net(x)
    try:
        a._version
        version = True
    except RuntimeError:  # "Inference tensors do not track version counter."
        version = False
    try:
        a.sum().backward()
        can_backward = True
    except RuntimeError:
        can_backward = False
    return {"bn_stats_updated": not torch.equal(before, net[1].running_mean),
            "dropout_active": not torch.equal(a, b), "version_tracked": version,
            "can_backward": can_backward}


def inference_modes(batch: int = 64, channels: int = 32, image_size: int = 32,
                    engine: str = "auto", modes: tuple[str, ...] = MODES) -> ModesResult:
    """Track one forward of ``eval_demo_net`` in each mode."""
    validate_positive(batch=batch, channels=channels, image_size=image_size)
    eval_demo_net(1, image_size)  # validates the size
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; valid modes: {', '.join(MODES)}")
    fmap = F.tensor_bytes((batch, channels, image_size, image_size))
    flops = F.conv2d_flops(batch, 3, channels, (image_size, image_size), 3)
    runs: dict[str, ModeRun] = {}
    predicted: dict[str, int] = {}
    measured = run_modes(batch, channels, image_size, engine, modes, predicted_bytes=4 * fmap, predicted_flops=flops)
    for mode, m in measured.items():
        v = m.value
        facts = mode_facts(mode)
        runs[mode] = ModeRun(mode, m, v["held"] - v["fixed"], v["saved"], v["requires_grad"], v["grad_fn"],
                             v["is_inference"], facts["bn_stats_updated"], facts["dropout_active"],
                             facts["version_tracked"], facts["can_backward"])
        grad = mode.endswith("grad") and "no_grad" not in mode
        predicted[mode] = predict_saved_bytes(batch, channels, image_size, mode.startswith("train")) if grad else 0
    return ModesResult(batch, channels, image_size, runs, predicted)


# --- del and name reuse inside forward -------------------------------------------------------------



def unet_intermediates(batch: int, channels: int, image_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor ``TinyUNet``'s forward creates, with its shape (float32), in order:
    the formula side of the lifetimes experiment."""
    if image_size % 4:
        raise ValueError(f"image size must be a multiple of 4 (two 2x2 poolings), got {image_size}")
    b, c, s = batch, channels, image_size
    return [
        ("c1 = enc1(x)", (b, c, s, s)), ("e1 = relu(c1)", (b, c, s, s)),
        ("p1 = pool(e1)", (b, c, s // 2, s // 2)), ("c2 = enc2(p1)", (b, 2 * c, s // 2, s // 2)),
        ("e2 = relu(c2)", (b, 2 * c, s // 2, s // 2)), ("p2 = pool(e2)", (b, 2 * c, s // 4, s // 4)),
        ("c3 = enc3(p2)", (b, 4 * c, s // 4, s // 4)), ("e3 = relu(c3)", (b, 4 * c, s // 4, s // 4)),
        ("u3 = up(e3)", (b, 4 * c, s // 2, s // 2)), ("k2 = cat(u3, e2)", (b, 6 * c, s // 2, s // 2)),
        ("c4 = dec2(k2)", (b, 2 * c, s // 2, s // 2)), ("d2 = relu(c4)", (b, 2 * c, s // 2, s // 2)),
        ("u2 = up(d2)", (b, 2 * c, s, s)), ("k1 = cat(u2, e1)", (b, 3 * c, s, s)),
        ("c5 = dec1(k1)", (b, c, s, s)), ("d1 = relu(c5)", (b, c, s, s)), ("out = head(d1)", (b, 1, s, s)),
    ]


def names_kept_peak(batch: int, channels: int, image_size: int) -> int:
    """Formula: with every intermediate under its own name, all of them are alive when
    ``forward`` returns, so the forward's activation-side peak is their sum.
    NB: max-pool makes its int64 indices in every mode (``max_pool2d`` runs
    ``max_pool2d_with_indices``, as lesson 03's tracked runs show); without autograd nothing keeps
    them, so they are a moment's temporary, not part of this sum."""
    return sum(F.tensor_bytes(s) for _, s in unet_intermediates(batch, channels, image_size))


@dataclass
class LifetimeRun:
    style: str
    measurement: Measurement
    forward_peak: int      # activation side: live bytes beyond params/input at the forward's peak

    @property
    def peak_bytes(self) -> int:
        return self.measurement.peak_bytes


@dataclass
class LifetimesResult(Measured):
    grad_mode: str
    batch: int
    channels: int
    image_size: int
    runs: dict[str, LifetimeRun]
    predicted_names_peak: int
    predicted_label: str = LABEL_FORMULA

    @property
    def measurement(self) -> Measurement:
        """The run whose engine and label speak for the comparison: the first style's run."""
        return self.runs[STYLES[0]].measurement

    @property
    def forward_saving(self) -> int:
        return self.runs[STYLES[0]].forward_peak - self.runs[STYLES[1]].forward_peak

    @property
    def peak_saving(self) -> int:
        return self.runs[STYLES[0]].peak_bytes - self.runs[STYLES[1]].peak_bytes

    def figure(self):
        from gpulab.course.plots_tradeoffs import lifetimes_figure
        return lifetimes_figure(self)

    def as_dict(self) -> dict[str, Any]:
        return {"grad_mode": self.grad_mode, "batch": self.batch, "channels": self.channels,
                "image_size": self.image_size, "engine": self.engine, "label": self.label,
                "predicted_names_peak": self.predicted_names_peak,
                "runs": {k: {"peak_bytes": r.peak_bytes, "forward_peak": r.forward_peak,
                             "peak_by_category": r.measurement.peak_by_category} for k, r in self.runs.items()},
                "forward_saving": self.forward_saving, "peak_saving": self.peak_saving}

    def __repr__(self) -> str:
        return (f"LifetimesResult({self.grad_mode}, forward saving {self.forward_saving:,} B, "
                f"peak saving {self.peak_saving:,} B)")

    def _repr_html_(self) -> str:
        a, b = self.runs[STYLES[0]], self.runs[STYLES[1]]
        names_formula = self.predicted_names_peak if self.grad_mode == "no_grad forward" else None
        rows = [["forward peak (beyond params and input)", format_bytes(a.forward_peak), format_bytes(b.forward_peak),
                 format_bytes(a.forward_peak - b.forward_peak),
                 (format_bytes(names_formula) + f" ({fmt_error(error_percent(names_formula, a.forward_peak))})")
                 if names_formula is not None else "—"],
                ["peak of the whole run", format_bytes(a.peak_bytes), format_bytes(b.peak_bytes),
                 format_bytes(a.peak_bytes - b.peak_bytes), "—"]]
        head = (f"<code>TinyUNet</code>, {self.grad_mode}, batch {self.batch}, {self.channels} channels, "
                f"{self.image_size}×{self.image_size} — {html.escape(self.label)}")
        return head + html_table(["", "names kept", "del / reuse", "saved by del", "formula: names kept"],
                                 rows, "formula: every intermediate alive at once (sum of shapes); binary units")


def forward_lifetimes(grad_mode: str = "no_grad forward", batch: int = 8, channels: int = 16,
                      image_size: int = 64, engine: str = "auto") -> LifetimesResult:
    """``TinyUNet`` with both forward styles, tracked; forward peak and whole-run peak."""
    validate_positive(batch=batch, channels=channels, image_size=image_size)
    if grad_mode not in GRAD_MODES:
        raise ValueError(f"unknown mode {grad_mode!r}; valid modes: {', '.join(GRAD_MODES)}")
    predicted = names_kept_peak(batch, channels, image_size)  # also validates the size
    measured = run_lifetimes(grad_mode, batch, channels, image_size, engine, predicted_bytes=3 * predicted,
                             predicted_flops=3 * 2 * 27 * channels * batch * image_size ** 2 * 8)
    runs = {style: LifetimeRun(style, m, forward_peak(m)) for style, m in measured.items()}
    return LifetimesResult(grad_mode, batch, channels, image_size, runs, predicted)


# --- the articles' claims ------------------------------------------------------------------------

def inference_claims(modes_result: ModesResult, no_grad: LifetimesResult | None = None,
                     with_grad: LifetimesResult | None = None):
    """The articles' claims about eval()/no_grad and ``del`` in forward, with verdicts computed
    from the measurements passed in."""
    from gpulab.course.claims import BREAKS, HOLDS, ClaimCheck, ClaimReport, Evidence
    checks = []
    r = modes_result.runs
    lab = modes_result.label
    if {"eval() + grad", "eval() + no_grad", "train() + grad"} <= set(r):
        eg, en, tg = r["eval() + grad"], r["eval() + no_grad"], r["train() + grad"]
        ok = (eg.saved_bytes > 0 and en.saved_bytes == 0 and not eg.dropout_active and not eg.bn_stats_updated
              and tg.dropout_active)
        checks.append(ClaimCheck(
            "model.eval() is not torch.no_grad(): eval() switches dropout and batch norm to inference behaviour, "
            "no_grad() switches off autograd, which is what saves memory.", "ref 003",
            HOLDS if ok else BREAKS,
            (f"eval() alone still builds the graph and keeps {format_bytes(eg.saved_bytes)} for backward "
             f"(out.grad_fn = {eg.grad_fn}); eval() + no_grad keeps {format_bytes(en.saved_bytes)}. "
             f"Dropout and the BN statistics change with train()/eval() only.") if ok else
            "The measurement disagrees: see the evidence.",
            [Evidence("saved by autograd, eval() + grad", format_bytes(eg.saved_bytes), lab),
             Evidence("saved by autograd, eval() + no_grad", format_bytes(en.saved_bytes), lab),
             Evidence("peak, eval() + grad / eval() + no_grad",
                      f"{format_bytes(eg.peak_bytes)} / {format_bytes(en.peak_bytes)}", lab),
             Evidence("dropout active in eval() + grad", "yes" if eg.dropout_active else "no", "measured on CPU")]))
    if {"eval() + no_grad", "eval() + inference_mode"} <= set(r):
        en, im = r["eval() + no_grad"], r["eval() + inference_mode"]
        same = en.peak_bytes == im.peak_bytes
        checks.append(ClaimCheck(
            "no_grad() is the way to run inference with less memory (ref 003 predates inference_mode).",
            "ref 003", HOLDS if same else "holds; inference_mode differs",
            (f"inference_mode() has the same peak here ({format_bytes(im.peak_bytes)}): both save nothing. What it "
             f"adds is skipping the version counter and view tracking (its outputs cannot enter autograd later), "
             f"a CPU-time saving, not a memory one.") if same else
            f"inference_mode peak {format_bytes(im.peak_bytes)} vs no_grad {format_bytes(en.peak_bytes)}.",
            [Evidence("peak, eval() + no_grad", format_bytes(en.peak_bytes), lab),
             Evidence("peak, eval() + inference_mode", format_bytes(im.peak_bytes), lab),
             Evidence("output tracks a version counter (no_grad / inference_mode)",
                      f"{'yes' if en.version_tracked else 'no'} / {'yes' if im.version_tracked else 'no'}",
                      "measured on CPU")]))
    if no_grad is not None:
        pct = 100 * no_grad.forward_saving / max(1, no_grad.runs[STYLES[0]].forward_peak)
        ev = [Evidence("forward peak saved by del, no_grad", f"{format_bytes(no_grad.forward_saving)} ({pct:.0f}%)",
                       no_grad.label)]
        why = (f"Without autograd, a local name is the only thing keeping an intermediate alive: reusing one name "
               f"and deleting each skip tensor after its last use cuts the forward's peak by {pct:.0f}%.")
        verdict = HOLDS if no_grad.forward_saving > 0 else BREAKS
        if with_grad is not None:
            pg = 100 * with_grad.peak_saving / max(1, with_grad.runs[STYLES[0]].peak_bytes)
            ev.append(Evidence("whole-step peak saved by del, train step",
                               f"{format_bytes(with_grad.peak_saving)} ({pg:.0f}%)", with_grad.label))
            why += (f" In a training step autograd keeps most intermediates for backward anyway; del still frees "
                    f"what autograd does not keep (ReLU inputs, upsampled maps), {pg:.0f}% of the step's peak here.")
            if no_grad.forward_saving > 0:
                verdict = "holds, most without autograd"
        checks.append(ClaimCheck(
            "In forward, reuse one variable name and del intermediates (the U-Net example): it saves GPU memory.",
            "ref 003", verdict, why, ev))
    return ClaimReport("What ref 003 (docs/references.md) claims about eval(), no_grad() and del, tested", checks)
