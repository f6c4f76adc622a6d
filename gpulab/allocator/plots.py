"""Figures for lesson 09: allocated vs reserved over events, and the segment map.

Built like ``gpulab.plots`` (a ``Figure`` without pyplot's global state, units on the axes,
the source label in the title)."""
from __future__ import annotations

from typing import Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from gpulab.allocator.simulator import Segment
from gpulab.plots import LessonFigure
from gpulab.units import MiB

__all__ = [
    "ALLOCATED_COLOR", "FREE_COLOR", "RESERVED_COLOR", "allocated_vs_reserved", "segment_map"
]

ALLOCATED_COLOR = "#C44E52"
FREE_COLOR = "#DDDDDD"
RESERVED_COLOR = "#4C72B0"


def _fig(width: float = 7.0, height: float = 3.4) -> Figure:
    return LessonFigure(figsize=(width, height), dpi=100, layout="constrained")


def allocated_vs_reserved(run, title: str | None = None, unit: int = MiB, unit_name: str = "MiB",
                          extra_lines: Sequence[tuple[str, float]] = ()) -> Figure:
    """Lines of allocated and reserved bytes after each event of an ``AllocatorRun``; dotted
    verticals where ``empty_cache`` ran; ``extra_lines``: (label, bytes) horizontal lines (e.g.
    an NVML figure measured on a GPU)."""
    fig = _fig()
    ax = fig.add_subplot()
    xs = range(len(run.allocated))
    ax.step(xs, [v / unit for v in run.reserved], where="post", color=RESERVED_COLOR,
            label=f"reserved (peak {run.peak_reserved / unit:,.1f} {unit_name})")
    ax.step(xs, [v / unit for v in run.allocated], where="post", color=ALLOCATED_COLOR,
            label=f"allocated (peak {run.peak_allocated / unit:,.1f} {unit_name})")
    ax.fill_between(xs, [v / unit for v in run.allocated], [v / unit for v in run.reserved],
                    step="post", color=RESERVED_COLOR, alpha=0.15, label="cached, free")
    if run.empty_cache_every_step:
        for i, x in enumerate(run.step_ends):
            ax.axvline(x, color="k", ls=":", lw=0.8, label="empty_cache()" if i == 0 else None)
    for label, value in extra_lines:
        ax.axhline(value / unit, ls="--", lw=1, color="#555", label=label)
    ax.set_xlabel("allocation / free event")
    ax.set_ylabel(unit_name)
    ax.set_xlim(0, max(1, len(run.allocated)))
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title(title or f"{run.workload}: allocated vs reserved ({run.label})", fontsize=10)
    return fig


def segment_map(segments: Sequence[Segment], title: str = "segment map (simulated allocator)",
                unit: int = MiB, unit_name: str = "MiB", max_segments: int = 40) -> Figure:
    """One horizontal bar per segment (length = its size), its blocks coloured allocated / free
    and outlined, the pool and expandable flag in the tick label."""
    segs = list(segments)[:max_segments]
    fig = _fig(7.0, max(1.6, 0.32 * len(segs) + 1.0))
    ax = fig.add_subplot()
    for row, seg in enumerate(segs):
        for b in seg.blocks:
            ax.barh(row, b.size / unit, left=b.offset / unit, height=0.7,
                    color=ALLOCATED_COLOR if b.allocated else FREE_COLOR, edgecolor="k", linewidth=0.4)
    ax.set_yticks(range(len(segs)),
                  [f"#{s.id} {s.pool}{' exp' if s.expandable else ''} {s.size / unit:,.0f}" for s in segs],
                  fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"offset in segment ({unit_name})")
    ax.set_xlim(left=0)
    alloc = sum(s.allocated_bytes for s in segs)
    total = sum(s.size for s in segs)
    more = f" (first {max_segments} of {len(segments)})" if len(segments) > max_segments else ""
    ax.legend(handles=[Patch(color=ALLOCATED_COLOR, label=f"allocated {alloc / unit:,.1f} {unit_name}"),
                       Patch(color=FREE_COLOR, label=f"free (cached) {(total - alloc) / unit:,.1f} {unit_name}")],
              fontsize=7, loc="lower right")
    ax.set_title(title + more, fontsize=10)
    return fig
