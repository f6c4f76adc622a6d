"""Lesson 03: where the parameters are, where the FLOPs are.

* ``params_vs_flops``: which layers hold the parameters and which do the work (AlexNet), and
  ref 001's claims checked (``flops_claims``).
* ``depthwise_vs_standard``: a MobileNet-style depthwise-separable block against a standard
  convolution with the same in/out channels: params, FLOPs, what autograd saves.

Every result is a dataclass with ``_repr_html_``; figures are built without pyplot.
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Sequence

import torch
from matplotlib.figure import Figure

from gpulab import formulas as F
from gpulab.course.claims import ClaimCheck, ClaimReport, Evidence
from gpulab.measure.engines import LABEL_FORMULA, Measured, Measurement, run
from gpulab.record.runs.activations import depthwise_experiment, separable_block, standard_block
from gpulab.predict.breakdown import breakdown, validate_batch
from gpulab.models.registry import build_model
from gpulab.course.parameters import NUMEL_LABEL, lesson_engine_limits
from gpulab.plots import CATEGORY_COLORS, LessonFigure
from gpulab.units import MiB, dtype_name, format_bytes, parse_dtype
from gpulab.views import error_percent, fmt_error, html_table
from gpulab.course.activations import _check_dtype, _setup, _verdict

__all__ = [
    "BlockMeasure", "DepthwiseResult", "FlopRow", "LABEL_FLOP_COUNTER", "ParamsFlops", "depthwise_figure",
    "depthwise_saved_formula", "depthwise_vs_standard", "flops_claims", "params_flops_figure",
    "params_vs_flops"
]

LABEL_FLOP_COUNTER = "counted by torch.utils.flop_counter (meta tensors, no compute)"


# --- where the parameters are, where the FLOPs are ------------------------------------------------

@dataclass
class FlopRow:
    name: str
    type: str
    params: int
    flops: int            # formula
    flops_counted: int    # torch.utils.flop_counter


@dataclass
class ParamsFlops:
    model: str
    batch: int
    image_size: int
    rows: list[FlopRow]
    counted_total: int

    @property
    def total_params(self) -> int:
        return sum(r.params for r in self.rows)

    @property
    def total_flops(self) -> int:
        return sum(r.flops for r in self.rows)

    def share(self, types: Sequence[str] = ("Conv2d",)) -> tuple[float, float]:
        """(% of params, % of FLOPs) in layers of these types."""
        p = sum(r.params for r in self.rows if r.type in types)
        f = sum(r.flops for r in self.rows if r.type in types)
        return 100 * p / max(1, self.total_params), 100 * f / max(1, self.total_flops)

    def _repr_html_(self) -> str:
        rows = [[r.name, r.type, f"{r.params:,}", f"{100 * r.params / max(1, self.total_params):.1f}%",
                 f"{r.flops / 1e6:,.1f}", f"{100 * r.flops / max(1, self.total_flops):.1f}%",
                 f"{r.flops_counted / 1e6:,.1f}", fmt_error(error_percent(r.flops, r.flops_counted))]
                for r in self.rows]
        rows.append(["total", "", f"{self.total_params:,}", "100%", f"{self.total_flops / 1e6:,.1f}", "100%",
                     f"{self.counted_total / 1e6:,.1f}",
                     fmt_error(error_percent(self.total_flops, self.counted_total))])
        t = html_table(["layer", "type", "params", "% params", "MFLOP (formula)", "% FLOPs", "MFLOP (counted)",
                        "formula error"], rows,
                       f"{self.model}, batch {self.batch}, {self.image_size}×{self.image_size}; forward FLOPs, "
                       f"2 per multiply-add; params: numel(); counted: {LABEL_FLOP_COUNTER}")
        cp, cf = self.share(("Conv2d",))
        lp, lf = self.share(("Linear",))
        s = html_table(["layer type", "% of params", "% of FLOPs"],
                       [["Conv2d", f"{cp:.1f}%", f"{cf:.1f}%"], ["Linear (FC)", f"{lp:.1f}%", f"{lf:.1f}%"]],
                       LABEL_FORMULA)
        return t + s

    def __repr__(self) -> str:
        cp, cf = self.share(("Conv2d",))
        return f"ParamsFlops({self.model}, conv: {cp:.1f}% params / {cf:.1f}% FLOPs)"


def params_vs_flops(model: str = "alexnet", batch: int = 1, image_size: int | None = None) -> ParamsFlops:
    """Per layer with parameters: params (numel) and forward FLOPs (formula, and counted by
    FlopCounterMode on the meta device)."""
    from torch.utils.flop_counter import FlopCounterMode
    spec, batch, size, dt = _setup(model, batch, image_size, "float32")
    bd = breakdown(spec, batch, size)
    net = build_model(spec, size, device="meta").eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        net(torch.empty(batch, 3, size, size, device="meta"))
    per_module = counter.get_flop_counts()
    root = type(net).__name__
    rows = []
    for r in bd.layers:
        if not r.params and not r.flops:
            continue
        counted = sum(per_module.get(f"{root}.{r.name}", {}).values())
        rows.append(FlopRow(r.name, r.type, r.params, r.flops, counted))
    return ParamsFlops(spec.name, batch, size, rows, counter.get_total_flops())


def params_flops_figure(r: ParamsFlops) -> Figure:
    """Share of parameters and of FLOPs per layer, side by side."""
    fig = LessonFigure(figsize=(max(6.4, 0.35 * len(r.rows) + 2.5), 3.6), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    xs = range(len(r.rows))
    tp, tf = max(1, r.total_params), max(1, r.total_flops)
    ax.bar([x - 0.2 for x in xs], [100 * row.params / tp for row in r.rows], 0.4, label="% of parameters",
           color=CATEGORY_COLORS["parameters"])
    ax.bar([x + 0.2 for x in xs], [100 * row.flops / tf for row in r.rows], 0.4, label="% of forward FLOPs",
           color="#DD8452")
    ax.set_xticks(list(xs), [f"{row.name}\n{row.type}" for row in r.rows], rotation=90, fontsize=7)
    ax.set_ylabel("% of the model total")
    cp, cf = r.share(("Conv2d",))
    lp, lf = r.share(("Linear",))
    ax.legend(fontsize=8)
    ax.set_title(f"{r.model} {r.image_size}×{r.image_size}: conv {cp:.0f}% params / {cf:.0f}% FLOPs; "
                 f"FC {lp:.0f}% params / {lf:.0f}% FLOPs ({LABEL_FORMULA})", fontsize=9)
    return fig


# --- depthwise-separable vs standard convolution --------------------------------------------------

@dataclass
class BlockMeasure:
    name: str
    params: int
    flops_formula: int
    flops_counted: int
    saved_bytes: int          # tracker: saved for backward at the end of the forward (input included)
    output_bytes: int
    no_grad_peak: int         # tracker: peak of a no_grad forward, not parameters
    train_peak: int           # tracker: peak of a forward with grad, not parameters
    param_bytes: int


@dataclass
class DepthwiseResult(Measured):
    in_channels: int
    out_channels: int
    image_size: int
    batch: int
    bn_relu: bool
    dtype: str
    standard: BlockMeasure
    separable: BlockMeasure
    measurement: Measurement
    saved_formula: dict[str, int]

    @property
    def flops_ratio(self) -> float:
        return self.separable.flops_counted / max(1, self.standard.flops_counted)

    @property
    def saved_ratio(self) -> float:
        return self.separable.saved_bytes / max(1, self.standard.saved_bytes)

    def training_total(self, b: BlockMeasure) -> int:
        """Saved activations + weights + their gradients (what one training step of the
        block adds up to, without optimizer state)."""
        return b.saved_bytes + 2 * b.param_bytes

    def claims(self) -> ClaimReport:
        s, d = self.standard, self.separable
        tot_s, tot_d = self.training_total(s), self.training_total(d)
        more_saved = d.saved_bytes > s.saved_bytes
        more_total = tot_d > tot_s
        if more_total == more_saved:
            total_verdict = _verdict(more_total)
        else:
            total_verdict = "holds for saved activations, breaks for the whole step at this size"
        return ClaimReport(f"Depthwise-separable vs standard ({self.in_channels}→{self.out_channels} channels, "
                           f"{self.image_size}×{self.image_size}, batch {self.batch})", [
            ClaimCheck("a depthwise-separable convolution needs much less computation", "ref 001 (MobileNet)",
                       _verdict(self.flops_ratio < 1), f"formula ratio 1/C_out + 1/9 = "
                       f"{1 / self.out_channels + 1 / 9:.3f}",
                       [Evidence("separable / standard FLOPs", f"×{self.flops_ratio:.3f}", LABEL_FLOP_COUNTER)]),
            ClaimCheck("…but it uses more memory, because every step's output must be saved", "ref 001",
                       _verdict(more_saved),
                       "the separable block also saves its C_in×H×W intermediate"
                       + (" (twice: the depthwise output for BatchNorm and the ReLU output for the 1×1 conv)"
                          if self.bn_relu else "") + "; this holds at every size",
                       [Evidence("saved for backward, standard", format_bytes(s.saved_bytes), self.label),
                        Evidence("saved for backward, separable", format_bytes(d.saved_bytes), self.label),
                        Evidence("the same by formula", f"{format_bytes(self.saved_formula['standard'])} vs "
                                 f"{format_bytes(self.saved_formula['separable'])}", LABEL_FORMULA)]),
            ClaimCheck("…so a separable block costs more memory in training", "ref 001 (implied)", total_verdict,
                       "with the weights and their gradients counted, the answer depends on the shape: a large "
                       "feature map makes the saved activations dominate (separable costs more); many channels "
                       "on a small map make the weights dominate (separable costs much less)",
                       [Evidence("saved + weights + grads, standard", format_bytes(tot_s), self.label),
                        Evidence("saved + weights + grads, separable", format_bytes(tot_d), self.label)]),
        ])

    def _repr_html_(self) -> str:
        s, d = self.standard, self.separable
        m = self.measurement
        head = (f"in {self.in_channels} → out {self.out_channels} channels, {self.image_size}×{self.image_size}, "
                f"batch {self.batch}, {self.dtype}"
                + (", each conv followed by BatchNorm + ReLU" if self.bn_relu else "")
                + f" — engine <b>{m.engine}</b> ({html.escape(m.reason)})")

        def row(label, a, b, fmt):
            return [label, fmt(a), fmt(b), f"×{b / a:.3f}" if a else "—"]
        mb = lambda v: format_bytes(v, digits=2)  # noqa: E731
        rows = [row("parameters (numel)", s.params, d.params, lambda v: f"{v:,}"),
                row(f"forward MFLOP ({LABEL_FORMULA})", s.flops_formula, d.flops_formula, lambda v: f"{v / 1e6:,.2f}"),
                row("forward MFLOP (counted)", s.flops_counted, d.flops_counted, lambda v: f"{v / 1e6:,.2f}"),
                row(f"saved for backward ({m.label})", s.saved_bytes, d.saved_bytes, mb),
                row(f"saved for backward ({LABEL_FORMULA})", self.saved_formula["standard"],
                    self.saved_formula["separable"], mb),
                row("output", s.output_bytes, d.output_bytes, mb),
                row("peak of a no_grad forward (not parameters)", s.no_grad_peak, d.no_grad_peak, mb),
                row("peak of a forward with grad (not parameters)", s.train_peak, d.train_peak, mb),
                row("saved + weights + gradients", self.training_total(s), self.training_total(d), mb)]
        t = html_table(["quantity", "standard 3×3 conv", "depthwise-separable", "separable / standard"], rows,
                       "the block input counts as saved (inside a network it is the previous layer's output)")
        return head + t

    def __repr__(self) -> str:
        return (f"DepthwiseResult({self.in_channels}->{self.out_channels}, {self.image_size}px: FLOPs ×"
                f"{self.flops_ratio:.3f}, saved ×{self.saved_ratio:.2f})")


def depthwise_saved_formula(cin: int, cout: int, hw: int, batch: int, bn_relu: bool, dtype) -> dict[str, int]:
    """What autograd saves, by formula (bytes), input included.

    A conv saves its input (for the weight gradient); BatchNorm saves its input and two
    per-channel statistics (mean and inverse std); an in-place ReLU saves its output, which is
    also the next conv's input, so it is counted once. BatchNorm's running statistics are saved
    too, but they are buffers, not activations.
    NB: the statistics are taken in the input dtype, as this torch's CPU and meta kernels keep
    them; CUDA kernels may keep them in float32 for 16-bit inputs (2·C·2 bytes more per layer)."""
    b = parse_dtype(dtype).itemsize
    plane = batch * hw * hw * b
    if not bn_relu:
        return {"standard": cin * plane, "separable": 2 * cin * plane}
    stats = lambda c: 2 * c * b  # noqa: E731
    std = cin * plane + cout * plane + cout * plane + stats(cout)
    sep = cin * plane + 2 * cin * plane + 2 * cout * plane + stats(cin) + stats(cout)
    return {"standard": std, "separable": sep}


def depthwise_vs_standard(in_channels: int = 64, out_channels: int = 128, image_size: int = 56, batch: int = 8,
                          bn_relu: bool = True, dtype: str | torch.dtype = "float32",
                          engine: str = "auto") -> DepthwiseResult:
    """Both blocks on the same input, measured on an engine: saved-for-backward bytes at the end
    of a forward with grad, the peak of a no_grad forward, params and FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode
    for k, v in (("in channels", in_channels), ("out channels", out_channels), ("image size", image_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{k} must be a positive integer, got {v!r}")
    validate_batch(batch)
    dt = _check_dtype(dtype)
    shape = (batch, in_channels, image_size, image_size)
    builders = {"standard": standard_block, "separable": separable_block}

    flops_formula = {
        "standard": F.conv2d_flops(batch, in_channels, out_channels, (image_size, image_size), 3),
        "separable": F.conv2d_flops(batch, in_channels, in_channels, (image_size, image_size), 3, groups=in_channels)
        + F.conv2d_flops(batch, in_channels, out_channels, (image_size, image_size), 1)}
    counted = {}
    for k, build in builders.items():
        with torch.device("meta"):
            blk = build(in_channels, out_channels, bn_relu)
        with FlopCounterMode(display=False) as fc, torch.no_grad():
            blk(torch.empty(shape, device="meta"))
        counted[k] = fc.get_total_flops()
    plane = batch * image_size * image_size * dt.itemsize
    predicted_bytes = 8 * (in_channels + out_channels) * plane
    predicted_flops = 2 * sum(counted.values())  # each block runs forward twice (grad, no_grad)

    m = run(depthwise_experiment(in_channels, out_channels, image_size, batch, bn_relu, dt), engine,
            predicted_bytes=predicted_bytes, predicted_flops=predicted_flops,
            **lesson_engine_limits())
    blocks = {k: BlockMeasure(k, v["params"], flops_formula[k], counted[k], v["saved"], v["output"],
                              v["no_grad_peak"], v["grad_peak"], v["param_bytes"]) for k, v in m.value.items()}
    return DepthwiseResult(in_channels, out_channels, image_size, batch, bn_relu, dtype_name(dt),
                           blocks["standard"], blocks["separable"], m,
                           depthwise_saved_formula(in_channels, out_channels, image_size, batch, bn_relu, dt))


def depthwise_figure(r: DepthwiseResult) -> Figure:
    """Three panels: parameters, forward FLOPs, saved-for-backward memory."""
    fig = LessonFigure(figsize=(8.0, 3.2), dpi=100, layout="constrained")
    axes = fig.subplots(1, 3)
    s, d = r.standard, r.separable
    items = [("parameters (K)", s.params / 1e3, d.params / 1e3),
             ("forward FLOPs (MFLOP)", s.flops_counted / 1e6, d.flops_counted / 1e6),
             ("saved for backward (MiB)", s.saved_bytes / MiB, d.saved_bytes / MiB)]
    for ax, (title, a, b) in zip(axes, items):
        bars = ax.bar(["standard", "separable"], [a, b], color=["#4C72B0", "#55A868"])
        for bar, v in zip(bars, [a, b]):
            ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:,.2f}", ha="center", va="bottom", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.margins(y=0.18)
        ax.tick_params(labelsize=8)
    fig.suptitle(f"{r.in_channels}→{r.out_channels} ch, {r.image_size}×{r.image_size}, batch {r.batch}, {r.dtype}"
                 f"{' +BN+ReLU' if r.bn_relu else ''}; memory: {r.label}; FLOPs: counted", fontsize=9)
    return fig


def flops_claims(r: "ParamsFlops") -> ClaimReport:
    """Ref 001 (docs/references.md) on AlexNet: the FC layers hold most parameters, the conv layers do most FLOPs."""
    cp, cf = r.share(("Conv2d",))
    lp, lf = r.share(("Linear",))
    return ClaimReport(f"Parameters and FLOPs ({r.model}, {r.image_size}×{r.image_size})", [
        ClaimCheck("the fully connected layers hold most of the parameters", "ref 001 (AlexNet)",
                   _verdict(lp > 50), "the first FC layer alone multiplies the flattened feature map by 4096",
                   [Evidence("FC share of parameters", f"{lp:.1f}%", NUMEL_LABEL),
                    Evidence("conv share of parameters", f"{cp:.1f}%", NUMEL_LABEL)]),
        ClaimCheck("the convolution layers do most of the computation", "ref 001 (AlexNet)",
                   _verdict(cf > 50), "each conv weight is reused at every output position; an FC weight once "
                   "per image",
                   [Evidence("conv share of forward FLOPs", f"{cf:.1f}%", LABEL_FORMULA),
                    Evidence("total forward FLOPs", f"{r.total_flops / 1e9:,.3f} GFLOP", LABEL_FORMULA),
                    Evidence("the same, counted", f"{r.counted_total / 1e9:,.3f} GFLOP", LABEL_FLOP_COUNTER)]),
    ])
