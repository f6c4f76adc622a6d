"""Figures for lessons 06-08 (in place and inference, checkpointing, mixed precision).

Each function takes a result object from ``gpulab.inplace``, ``gpulab.inference``,
``gpulab.checkpointing`` or ``gpulab.precision`` and returns a ``Figure`` built without
pyplot's global state. Axes carry units (binary: MiB), titles and legends carry the source
label of every series (formula, measured on CPU, fake tensors, ...).
"""
from __future__ import annotations

import math

from matplotlib.figure import Figure

from gpulab.plots import CATEGORY_COLORS, LessonFigure
from gpulab.units import MiB

__all__ = [
    "checkpoint_figure", "inplace_figure", "lifetimes_figure", "modes_figure", "precision_figure"
]

_FALSE, _TRUE = "#C44E52", "#4C72B0"     # inplace=False / names kept, inplace=True / del
_FORMULA = "#555555"


def _fig(width: float, height: float) -> Figure:
    return LessonFigure(figsize=(width, height), dpi=100, layout="constrained")


def _totals(tracking) -> list[float]:
    return [sum(s.values()) / MiB for s in tracking.series]


def _short(label: str) -> str:
    return label.replace(" (live tensors)", "")


def _phase_ticks(ax, tracking, color: str = "#999999", y: float = 0.98) -> None:
    """Mark where backward starts (first backward event) in the run's colour."""
    for i, e in enumerate(tracking.events):
        if e.phase == "backward":
            ax.axvline(i, color=color, lw=0.8, ls=":")
            ax.text(i, y, " backward →", transform=ax.get_xaxis_transform(), fontsize=7,
                    va="top", color=color)
            return


def _saving(a: float, b: float) -> str:
    d = (a - b) / MiB
    return "same" if abs(d) < 0.005 else f"−{d:.2f}" if d > 0 else f"+{-d:.2f}"


# --- lesson 06 ---------------------------------------------------------------------------------------

def inplace_figure(result) -> Figure:
    """Left: live memory over the run, inplace False vs True. Right: peak, forward peak,
    allocation traffic and saved-for-backward bytes side by side, with the articles' claim."""
    fig = _fig(10.5, 3.8)
    left, right = fig.subplots(1, 2, width_ratios=[1.25, 1])
    for inplace, color in ((False, _FALSE), (True, _TRUE)):
        r = result.runs[inplace]
        ys = _totals(r.measurement.tracking)
        left.step(range(len(ys)), ys, where="post", color=color, lw=1.4, label=f"ReLU(inplace={inplace})")
        tr = r.measurement.tracking
        left.plot([tr.peak_index], [tr.peak_bytes / MiB], "o", color=color, ms=5)
        _phase_ticks(left, tr, color, 0.98 if inplace else 0.9)
    left.set_xlabel("allocation / free event")
    left.set_ylabel("live tensors (MiB)")
    left.legend(fontsize=8, loc="lower center")
    left.set_title(f"{result.block} ×{result.depth}, {result.mode}: {_short(result.label)}", fontsize=9)

    f, t = result.runs[False], result.runs[True]
    names = ["peak", "forward\npeak", "allocated\nin total"]
    a = [f.peak_bytes, f.forward_peak, f.allocated_bytes]
    b = [t.peak_bytes, t.forward_peak, t.allocated_bytes]
    if f.saved_bytes is not None:
        names.append("saved by\nautograd")
        a.append(f.saved_bytes)
        b.append(t.saved_bytes)
    xs = range(len(names))
    right.bar([x - 0.2 for x in xs], [v / MiB for v in a], 0.4, color=_FALSE, label="inplace=False")
    right.bar([x + 0.2 for x in xs], [v / MiB for v in b], 0.4, color=_TRUE, label="inplace=True")
    for x, va, vb in zip(xs, a, b):
        right.text(x, max(va, vb) / MiB, _saving(va, vb), ha="center", va="bottom", fontsize=8)
    if f.saved_bytes is not None:
        right.plot([len(names) - 1 - 0.4, len(names) - 1 + 0.4], [result.predicted_saved_bytes / MiB] * 2,
                   color=_FORMULA, lw=2, ls="--", label="formula: saved")
    right.set_xticks(list(xs), names, fontsize=8)
    right.set_ylabel("MiB")
    right.legend(fontsize=7, loc="upper left")
    right.set_title(f"inplace saves (MiB, above each pair); claim of refs 000/003: "
                    f"{result.articles_saving_bytes / MiB:.2f} MiB", fontsize=9)
    return fig


def modes_figure(result) -> Figure:
    """Per mode: the forward's peak and what stays alive while the output is held, with the
    formula for the saved tensors."""
    fig = _fig(9.0, 3.6)
    ax = fig.add_subplot()
    modes = list(result.runs)
    xs = range(len(modes))
    peaks = [result.runs[m].peak_bytes / MiB for m in modes]
    held = [result.runs[m].held_bytes / MiB for m in modes]
    ax.bar([x - 0.2 for x in xs], peaks, 0.4, color="#CCB974", label="peak during the forward")
    ax.bar([x + 0.2 for x in xs], held, 0.4, color=CATEGORY_COLORS["activations"],
           label="held while the output lives")
    for x, m in zip(xs, modes):
        p = result.predicted[m] / MiB
        ax.plot([x + 0.0, x + 0.4], [p, p], color=_FORMULA, lw=2, ls="--",
                label="formula: saved by autograd" if x == 0 else None)
        ax.text(x + 0.2, held[x], f"{held[x]:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [m.replace(" + ", "\n+ ") for m in modes], fontsize=8)
    ax.set_ylabel("MiB")
    ax.legend(fontsize=8)
    ax.set_title(f"one forward, batch {result.batch}: {_short(result.label)} (the peak includes parameters "
                 f"and the input; 'held' does not)", fontsize=9)
    return fig


def lifetimes_figure(result) -> Figure:
    """Live memory over the run for both ways of writing forward."""
    fig = _fig(8.0, 3.6)
    ax = fig.add_subplot()
    for (style, r), color in zip(result.runs.items(), (_FALSE, _TRUE)):
        ys = _totals(r.measurement.tracking)
        ax.step(range(len(ys)), ys, where="post", color=color, lw=1.4,
                label=f"{style}: peak {r.peak_bytes / MiB:.1f} MiB")
    if result.grad_mode == "no_grad forward":
        fixed = result.runs["names kept"].peak_bytes - result.runs["names kept"].forward_peak
        ax.axhline((result.predicted_names_peak + fixed) / MiB, color=_FORMULA, ls="--", lw=1,
                   label="formula: every intermediate alive (names kept)")
    for (style, r), color, y in zip(result.runs.items(), (_FALSE, _TRUE), (0.98, 0.9)):
        _phase_ticks(ax, r.measurement.tracking, color, y)
    ax.set_xlabel("allocation / free event")
    ax.set_ylabel("live tensors (MiB)")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(f"TinyUNet, {result.grad_mode}, batch {result.batch}: {_short(result.label)}", fontsize=9)
    return fig


# --- lesson 07 ---------------------------------------------------------------------------------------

def checkpoint_figure(result) -> Figure:
    """Left: activation-side peak against k, measured and both formulas, √N marked.
    Right: step time (median, IQR bars) against k with the recompute formula."""
    has_time = all(p.timing is not None for p in result.points)
    fig = _fig(10.5 if has_time else 6.5, 3.8)
    axes = fig.subplots(1, 2) if has_time else [fig.add_subplot()]
    ax = axes[0]
    ks = [p.segments for p in result.points]
    meas = [p.activation_side / MiB for p in result.points]
    seq = [p.sequential_bytes / MiB for p in result.points]
    fine = [1 + i * (max(ks) - 1) / 200 for i in range(201)]
    chen = [(result.n_blocks / k + k) * result.map_bytes / MiB for k in fine]
    ax.plot(fine, chen, "-", color="#999999", lw=1.2, label="formula: Chen et al. N/k + k")
    ax.plot(ks, seq, "s", mfc="none", color=_FORMULA, ms=6, label="formula: checkpoint_sequential segments")
    ax.plot(ks, meas, "o", color=CATEGORY_COLORS["activations"], ms=5, label=f"{_short(result.label)}")
    ax.axvline(math.sqrt(result.n_blocks), color="#C44E52", ls=":", lw=1)
    ax.text(math.sqrt(result.n_blocks), 0.02, f" √N = {math.sqrt(result.n_blocks):.1f}",
            transform=ax.get_xaxis_transform(), fontsize=8, color="#C44E52")
    best = result.best
    ax.annotate(f"lowest: k = {best.segments}", (best.segments, best.activation_side / MiB),
                xytext=(10, -18), textcoords="offset points", fontsize=8, arrowprops={"arrowstyle": "-"})
    ax.set_xlabel("segments k (k = 1: no checkpointing)")
    ax.set_ylabel("activations + temporaries at peak (MiB)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"N = {result.n_blocks} blocks: memory", fontsize=9)
    if has_time:
        ax2 = axes[1]
        med = [p.timing.median * 1e3 for p in result.points]
        lo = [m - p.timing.low * 1e3 for m, p in zip(med, result.points)]
        hi = [p.timing.high * 1e3 - m for m, p in zip(med, result.points)]
        ax2.errorbar(ks, med, yerr=[lo, hi], fmt="o", color="#4C72B0", ms=4, capsize=2,
                     label="measured: median, bars = IQR")
        ax2.plot(ks, [p.timing.min * 1e3 for p in result.points], "x", color="#4C72B0", ms=4,
                 label="measured: fastest")
        base_t = result.baseline.timing   # k = 1's spread, across the plot: a point inside it is not told apart
        ax2.axhspan(base_t.low * 1e3, base_t.high * 1e3, color="#4C72B0", alpha=0.12, lw=0,
                    label="k = 1's IQR")
        base = result.baseline.timing.median * 1e3
        ax2.plot(ks, [base * result.recompute_overhead(p) for p in result.points], "-", color=_FORMULA,
                 lw=1.2, label="formula: +1 forward of the checkpointed blocks")
        ax2.set_xlabel("segments k")
        ax2.set_ylabel("one training step (ms)")
        top = max(m + h for m, h in zip(med, hi))
        ax2.set_ylim(0, min(top, 3 * max(med)) * 1.1)
        ax2.legend(fontsize=7, loc="upper left")
        ax2.set_title("step time, " + result.timing_label.split(" (")[0] + " (no tracker)", fontsize=9)
        import textwrap
        fig.supxlabel(textwrap.fill(result.timing_verdict(), 150), fontsize=8)   # constrained layout makes room
    return fig


# --- lesson 08 ---------------------------------------------------------------------------------------

def precision_figure(result) -> Figure:
    """Left: memory at the peak by category for each mode (stacked). Right: bytes per
    parameter kept between steps, with the articles' 16 B/param."""
    fig = _fig(10.5, 3.8)
    left, right = fig.subplots(1, 2, width_ratios=[1.3, 1])
    modes = list(result.runs)
    cats = [c for c in CATEGORY_COLORS if any(result.runs[m].peak_by_category.get(c, 0) for m in modes)]
    bottoms = [0.0] * len(modes)
    for c in cats:
        vals = [result.runs[m].peak_by_category.get(c, 0) / MiB for m in modes]
        left.bar(range(len(modes)), vals, 0.6, bottom=bottoms, color=CATEGORY_COLORS[c], label=c)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    for x, m in enumerate(modes):
        pct = result.saving_percent(m)
        txt = "" if m == "fp32" else (f"saves {pct:.0f}%" if pct >= 0.5 else
                                      "same" if pct > -0.5 else f"{-pct:.0f}% more")
        left.text(x, bottoms[x], txt, ha="center", va="bottom", fontsize=9)
    left.set_xticks(range(len(modes)), modes, fontsize=8)
    left.set_ylabel("live tensors at the peak (MiB)")
    left.legend(fontsize=7, loc="upper right", ncols=2)
    left.set_title(f"{result.model}, batch {result.batch}, {result.optimizer}: {_short(result.label)}", fontsize=9)

    parts = ("parameters", "gradients", "optimizer_state")
    bottoms = [0.0] * len(modes)
    for c in parts:
        vals = [result.runs[m].persistent.get(c, 0) / result.runs[m].n_params for m in modes]
        right.bar(range(len(modes)), vals, 0.6, bottom=bottoms, color=CATEGORY_COLORS[c], label=c)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    for x, b in enumerate(bottoms):
        right.text(x, b, f"{b:.1f}", ha="center", va="bottom", fontsize=8)
    right.axhline(16, color="#C44E52", ls="--", lw=1, label="ref 002: 16 B/param (Adam, mixed precision)")
    right.set_xticks(range(len(modes)), modes, fontsize=8)
    right.set_ylabel("bytes per parameter between steps")
    right.set_ylim(0, max(max(bottoms), 16) * 1.45)
    right.legend(fontsize=7, loc="upper right")
    right.set_title("kept between steps: measured", fontsize=9)
    return fig
