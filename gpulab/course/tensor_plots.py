"""Figures for lessons 00 and 01, built without pyplot's global state (like gpulab.plots).

Axes carry units (binary: B, KiB, MiB, GiB, chosen from the data), legends name the label of
every series, and titles name where the measured numbers came from.
"""
from __future__ import annotations


from matplotlib.figure import Figure

from gpulab.plots import LessonFigure
from gpulab.plots import to_png  # noqa: F401  (re-exported for the lesson panels)
from gpulab.units import GiB, KiB, MiB

__all__ = [
    "CUDA_COLOR", "FORMULA_COLOR", "MEASURED_COLOR", "NAIVE_COLOR", "SIMULATED_COLOR",
    "dtype_figure", "engine_demo_figure", "pick_unit", "rounding_figure", "tensor_bytes_figure"
]

FORMULA_COLOR = "#999999"
MEASURED_COLOR = "#4C72B0"
SIMULATED_COLOR = "#DD8452"
CUDA_COLOR = "#55A868"
NAIVE_COLOR = "#C44E52"


def pick_unit(max_bytes: float) -> tuple[int, str]:
    """The binary unit that keeps the largest value between 1 and 1024."""
    for size, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if max_bytes >= size:
            return size, name
    return 1, "B"


def _fig(width: float = 7.0, height: float = 3.6) -> Figure:
    return LessonFigure(figsize=(width, height), dpi=100, layout="constrained")


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 or float(v).is_integer() else f"{v:,.3g}"


def tensor_bytes_figure(r) -> Figure:
    """Formula vs measured for each quantity of a ``TensorBytesResult``; the error in % above each
    pair; next to the last group, what y's shape alone suggests."""
    unit, uname = pick_unit(max(max(x.formula, x.measured) for x in r.rows) or 1)
    fig = _fig(7.4, 4.0)
    ax = fig.add_subplot()
    n = len(r.rows)
    xs = list(range(n))
    fv = [x.formula / unit for x in r.rows]
    mv = [x.measured / unit for x in r.rows]
    ax.bar([x - 0.2 for x in xs], fv, 0.38, label="formula", color=FORMULA_COLOR)
    ax.bar([x + 0.2 for x in xs], mv, 0.38, label=f"measured ({r.label})", color=MEASURED_COLOR)
    naive = r.y_shape_bytes / unit
    ax.bar([n - 1 + 0.52], [naive], 0.14, label="y's shape × itemsize (what y looks like)",
           color=NAIVE_COLOR, hatch="//", edgecolor="white")
    top = max(fv + mv + [naive]) or 1
    # left-aligned from the thin bar's left edge, so the label clears the measured bar beside it
    ax.annotate(f"y's shape:\n{_fmt(naive)} {uname}", (n - 1 + 0.45, naive), xytext=(0, 4),
                textcoords="offset points", ha="left", va="bottom", fontsize=7, color=NAIVE_COLOR)
    for x, row in zip(xs, r.rows):
        err = row.error
        txt = "0 B both" if row.formula == 0 and row.measured == 0 else (
            "—" if err is None else f"error {err:+.1f}%")
        ax.text(x, max(fv[x], mv[x]) + 0.02 * top, txt, ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, top * 1.15)
    ax.set_xlim(-0.6, n - 1 + 1.0)
    labels = [x.quantity.replace(" made by the operation", "\nmade by the op").replace(" after del x", "\nafter del x")
              .replace("peak live (x and y)", "peak live\n(x and y)") for x in r.rows]
    ax.set_xticks(xs, labels, fontsize=8)
    ax.set_ylabel(f"bytes ({uname})")
    fig.legend(fontsize=7, loc="outside lower center", ncols=3)
    ax.set_title(f"{r.shape} {r.dtype}, {r.code}: formula vs {r.label}", fontsize=9)
    return fig


def dtype_figure(t) -> Figure:
    """Bytes per element for every dtype: itemsize (formula) vs measured storage bytes / n."""
    rows = list(t.rows)
    fig = _fig(7.0, 0.22 * len(rows) + 1.2)
    ax = fig.add_subplot()
    ys = list(range(len(rows)))[::-1]
    ax.barh([y + 0.2 for y in ys], [r.itemsize for r in rows], 0.4, color=FORMULA_COLOR,
            label="formula: itemsize")
    meas = [(y, r.measured_bytes / t.n) for y, r in zip(ys, rows) if r.measured_bytes is not None]
    ax.barh([y - 0.2 for y, _ in meas], [v for _, v in meas], 0.4, color=MEASURED_COLOR,
            label=f"measured: storage bytes / {t.n:,} ({t.label})")
    for y, r in zip(ys, rows):
        if r.measured_bytes is None:
            ax.text(0.05, y - 0.2, "not measurable on this engine", va="center", fontsize=6, color="#b00")
        elif r.measured_bytes != r.formula_bytes:
            ax.text(r.itemsize + 0.1, y, f"packed: {r.measured_bytes / t.n:g} B", va="center", fontsize=7,
                    color="#b00")
    ax.set_yticks(ys, [r.name for r in rows], fontsize=7)
    ax.set_xlabel("bytes per element (B)")
    ax.set_xlim(0, max(r.itemsize for r in rows) * 1.25)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"bytes per element, dtype by dtype: formula vs {t.label}", fontsize=9)
    return fig


def rounding_figure(r) -> Figure:
    """Requested bytes vs what is counted: the formula's 512-byte steps, the simulated allocator,
    live storage bytes on the engine, and on a GPU the real allocator."""
    fig = _fig(7.0, 3.8)
    ax = fig.add_subplot()
    x = r.requested
    ax.plot(x, r.rounded, drawstyle="steps-post", color=FORMULA_COLOR, lw=2.5,
            label="formula: rounded up to 512 B (cuda_rounded_bytes)")
    ax.plot(x, r.live, color=MEASURED_COLOR, lw=1.2, label=f"storage bytes: {r.live_label}")
    if r.simulated is not None:
        ax.plot(x, r.simulated, "o", ms=2.5, color=SIMULATED_COLOR,
                label=f"memory_allocated: {r.simulated_label}")
    if r.cuda is not None:
        ax.plot(x, r.cuda, "x", ms=3, color=CUDA_COLOR, label=f"memory_allocated: {r.cuda_label}")
    ax.set_xlabel(f"requested bytes = numel × {r.requested[1] if len(r.requested) > 1 else 0} B ({r.dtype})")
    ax.set_ylabel("bytes counted (B)")
    ax.set_xlim(0, max(x) or 1)
    ax.set_ylim(0, max(r.rounded) * 1.08 or 1)
    ax.legend(fontsize=7, loc="upper left")
    src = r.cuda_label if r.cuda is not None else "formula and simulated allocator (no GPU here)"
    ax.set_title(f"{r.dtype} tensors of 0–{r.elements[-1]:,} elements on CUDA: 512-byte blocks\n{src}",
                 fontsize=9)
    return fig


def engine_demo_figure(d) -> Figure:
    """Each number about one tensor as a horizontal bar, named by its label."""
    bars = d.bars()
    unit, uname = pick_unit(max(b for _, b, _ in bars) or 1)
    colors = {d.formula_label: FORMULA_COLOR, d.simulated_label: SIMULATED_COLOR}
    fig = _fig(7.0, 0.45 * len(bars) + 1.3)
    ax = fig.add_subplot()
    ys = list(range(len(bars)))[::-1]
    vals = [b / unit for _, b, _ in bars]
    ax.barh(ys, vals, 0.6, color=[colors.get(lab, CUDA_COLOR if d.engine == "cuda" else MEASURED_COLOR)
                                  for _, _, lab in bars])
    for y, v in zip(ys, vals):
        ax.text(v, y, f" {_fmt(v)} {uname}", va="center", fontsize=8)
    ax.set_yticks(ys, [f"{what}\n[{lab}]" for what, _, lab in bars], fontsize=7)
    ax.set_xlabel(f"bytes ({uname})")
    ax.set_xlim(0, max(vals) * 1.3 or 1)
    ax.set_title(f"one float32 tensor of {_fmt(d.size_bytes / unit)} {uname}, answered by the {d.engine} engine\n"
                 f"measured numbers: {d.label}", fontsize=9)
    return fig
