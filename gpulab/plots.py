"""Matplotlib figures from result objects. Each function returns a ``Figure`` built
without pyplot's global state (so widgets can redraw safely); the caller displays it.
Axis labels carry units and the figure title carries the source label."""
from __future__ import annotations

import io
from typing import Sequence

from matplotlib.figure import Figure

from gpulab.categories import CATEGORIES
from gpulab.units import MiB

__all__ = [
    "CATEGORY_COLORS", "LessonFigure", "as_image", "comparison_bars", "figure_png_bytes",
    "layer_bars", "line_fit", "timeline", "to_png"
]

# One colour per category, the same in every figure.
CATEGORY_COLORS = {
    "parameters": "#4C72B0", "buffers": "#8172B3", "inputs": "#937860",
    "optimizer_state": "#DD8452", "gradients": "#C44E52", "activations": "#55A868",
    "temporaries": "#CCB974",
}


class LessonFigure(Figure):
    """A Figure that shows itself as a PNG in any notebook front end (``_repr_png_``),
    without pyplot or ``%matplotlib inline`` having registered a formatter."""

    def _repr_png_(self) -> bytes:
        return figure_png_bytes(self)


def figure_png_bytes(fig: Figure, dpi: int = 100) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def as_image(fig: Figure):
    """The figure as an ``IPython.display.Image`` (PNG), which displays everywhere:
    JupyterLab, Output widgets, nbclient, nbconvert."""
    from IPython.display import Image
    return Image(data=figure_png_bytes(fig), format="png")


def to_png(fig: Figure):
    """``as_image(fig)``, then the figure is cleared to release its memory."""
    image = as_image(fig)
    fig.clf()
    return image


def _fig(width: float = 7.0, height: float = 3.6) -> Figure:
    return LessonFigure(figsize=(width, height), dpi=100, layout="constrained")


def timeline(result, title: str | None = None, unit: int = MiB, unit_name: str = "MiB") -> Figure:
    """Live bytes by category after each allocation/free event, stacked; the peak marked,
    and the phases (setup / forward / backward / optimizer) shaded."""
    fig = _fig()
    ax = fig.add_subplot()
    xs = list(range(len(result.series)))
    stacks = [[s[c.value] / unit for s in result.series] for c in CATEGORIES]
    ax.stackplot(xs, stacks, labels=[c.value for c in CATEGORIES],
                 colors=[CATEGORY_COLORS[c.value] for c in CATEGORIES], step="post", alpha=0.9)
    # phases as light background bands, named along the top edge
    start = 0
    for i in range(1, len(result.events) + 1):
        if i == len(result.events) or result.events[i].phase != result.events[start].phase:
            phase = result.events[start].phase
            ax.axvspan(start, i, color=_PHASE_COLORS.get(phase, "#999999"), alpha=0.08, lw=0)
            ax.text((start + i) / 2, 1.01, phase, fontsize=7, ha="center", va="bottom",
                    transform=ax.get_xaxis_transform())
            start = i
    if result.peak_index >= 0:
        ax.axvline(result.peak_index, color="k", lw=0.8, ls="--")
        ax.annotate(f"peak {result.peak_bytes / unit:,.1f} {unit_name}", (result.peak_index, result.peak_bytes / unit),
                    xytext=(5, -12), textcoords="offset points", fontsize=8)
    ax.set_xlabel("allocation / free event")
    ax.set_ylabel(f"live tensors ({unit_name})")
    ax.set_xlim(0, max(1, len(xs)))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    ax.set_title(title or f"memory over time on {result.device}", fontsize=10, pad=14)
    return fig


_PHASE_COLORS = {"setup": "#bbbbbb", "forward": "#55A868", "backward": "#C44E52", "optimizer": "#DD8452"}


def comparison_bars(predicted: dict[str, float | None], measured: dict[str, float], measured_label: str,
                    predicted_label: str = "formula", title: str = "", unit: int = MiB,
                    unit_name: str = "MiB") -> Figure:
    """Grouped bars: formula vs measurement per key, with the error in % above each pair."""
    keys = [k for k in measured if (measured.get(k) or 0) > 0 or (predicted.get(k) or 0) > 0]
    fig = _fig()
    ax = fig.add_subplot()
    xs = range(len(keys))
    pv = [(predicted.get(k) or 0) / unit for k in keys]
    mv = [measured.get(k, 0) / unit for k in keys]
    ax.bar([x - 0.2 for x in xs], pv, 0.4, label=predicted_label, color="#999999")
    ax.bar([x + 0.2 for x in xs], mv, 0.4, label=measured_label,
           color=[CATEGORY_COLORS.get(k, "#4C72B0") for k in keys])
    for x, k in zip(xs, keys):
        p, m = predicted.get(k), measured.get(k, 0)
        txt = "no formula" if p is None else ("—" if not m else f"{100 * (p - m) / m:+.0f}%")
        ax.text(x, max(pv[x], mv[x]), txt, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [k.replace("_", "\n") for k in keys], fontsize=8)
    ax.set_ylabel(unit_name)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    return fig


def layer_bars(names: Sequence[str], values: Sequence[Sequence[float]], series_labels: Sequence[str],
               ylabel: str, title: str = "", log: bool = False) -> Figure:
    """Per-layer bars for one or more series (e.g. formula vs measured output bytes)."""
    fig = _fig(max(7.0, 0.25 * len(names) + 2), 3.8)
    ax = fig.add_subplot()
    n = len(values)
    w = 0.8 / max(1, n)
    for i, (vals, lab) in enumerate(zip(values, series_labels)):
        ax.bar([x + (i - (n - 1) / 2) * w for x in range(len(names))], vals, w, label=lab)
    ax.set_xticks(range(len(names)), names, rotation=90, fontsize=7)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    if n > 1:
        ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    return fig


def line_fit(xs: Sequence[float], ys: Sequence[float], fit_xs: Sequence[float], fit_ys: Sequence[float],
             xlabel: str, ylabel: str, measured_label: str, fit_label: str, title: str = "",
             hline: float | None = None, hline_label: str = "") -> Figure:
    """Measured points and a fitted or predicted line (batch sweeps, checkpoint curves)."""
    fig = _fig()
    ax = fig.add_subplot()
    ax.plot(xs, ys, "o", label=measured_label)
    ax.plot(fit_xs, fit_ys, "-", label=fit_label)
    if hline is not None:
        ax.axhline(hline, color="r", ls="--", lw=1, label=hline_label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    return fig
