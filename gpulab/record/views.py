"""Views of recorded GPU runs (``gpulab.record``): what every panel shows beside its live run
when the live engine is not cuda, and lesson 09's real ``reserved`` timeline next to the
simulator's.

* ``recorded_html(lookup, rows)``: the recorded figures for the same settings, titled "The same
  settings on a real GPU" and labelled with the record's provenance (``RecordLookup.label``);
  when nothing matches, ``recorded_note(lookup)``: one line saying so and what was recorded
  instead (``RecordLookup.mismatch``), or that no recordings ship.
* ``allocator_rows(result)``: the allocator's counters of one recorded run, the rows most panels
  show; ``counter_text(run, key)``: one of those counters as a table cell
  (``max_memory_allocated − baseline`` by default).
* ``reserved_timelines(run, lookup)``: one axis, the simulator's reserved series and (when a
  record matched) the recorded one, each over the fraction of the run it covers.
"""
from __future__ import annotations

import html
from typing import Any, Callable, Sequence

from matplotlib.figure import Figure

from gpulab.allocator.plots import RESERVED_COLOR
from gpulab.plots import LessonFigure
from gpulab.tables import html_table
from gpulab.units import MiB, format_bytes

__all__ = [
    "ALLOCATOR_ROWS", "NOTE_PREFIX", "RECORDED_COLOR", "TITLE", "allocator_rows", "counter_text",
    "recorded_html", "recorded_note", "reserved_timelines"
]

TITLE = "The same settings on a real GPU"
NOTE_PREFIX = "On a real GPU: no recorded GPU run matches these settings"
RECORDED_COLOR = "#DD8452"

# The allocator counters of a recorded run (``engines.cuda_run_counters``), in display order.
ALLOCATOR_ROWS = (("peak_allocated_delta", "max_memory_allocated − baseline"),
                  ("peak_reserved_delta", "max_memory_reserved − baseline"),
                  ("baseline_allocated", "memory_allocated before the run (baseline)"),
                  ("nvml_used", "NVML used (whole device)"))


def recorded_note(lookup) -> str:
    """One line: no recorded run matches, and what was recorded instead (or why none)."""
    why = lookup.mismatch or lookup.reason
    sep = "" if why.startswith("(") else "— "
    return f"<div class='gpulab-recorded gpulab-label'>{NOTE_PREFIX} {sep}{html.escape(why)}.</div>"


def allocator_rows(result: dict[str, Any], prefix: str = "") -> list[list[str]]:
    """Rows [figure, bytes] of the allocator's counters a recorded run carries (those present)."""
    a = result.get("allocator") or {}
    return [[prefix + name, format_bytes(a[key])] for key, name in ALLOCATOR_ROWS if a.get(key) is not None]


def counter_text(run: dict[str, Any], key: str = "peak_allocated_delta") -> str:
    """One allocator counter of a recorded run (``max_memory_allocated − baseline`` by default;
    ``ALLOCATOR_ROWS`` names the keys), formatted, or "—" when the run has none."""
    a = run.get("allocator") or {}
    return format_bytes(a[key]) if a.get(key) is not None else "—"


def recorded_html(lookup, rows: Callable[[dict[str, Any]], Sequence[Sequence[Any]]],
                  headers: Sequence[str] = ("recorded figure", "bytes"), title: str = TITLE) -> str:
    """The recorded figures (``rows(lookup.result)``) as a table labelled with the record's
    provenance, or ``recorded_note`` when the lookup found none."""
    if not lookup:
        return recorded_note(lookup)
    body = [list(r) for r in rows(lookup.result)]
    return (f"<div class='gpulab-recorded'><b>{html.escape(title)}</b>"
            + html_table(list(headers), body, lookup.label) + "</div>")


def reserved_timelines(run, lookup, title: str | None = None, unit: int = MiB, unit_name: str = "MiB") -> Figure:
    """The simulator's ``reserved`` after each event of ``run`` (an ``AllocatorRun``) and, when
    ``lookup`` found a recorded ``allocator timeline``, the real ``memory_reserved`` read after
    every op of the same workload on that GPU (above the run's start). The two are sampled at
    different points (tensor events vs ops), so both run over the fraction of the run, 0 to 1."""
    fig = LessonFigure(figsize=(7.0, 3.6), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    n = max(1, len(run.reserved) - 1)
    ax.step([i / n for i in range(len(run.reserved))], [v / unit for v in run.reserved], where="post",
            color=RESERVED_COLOR, label=f"reserved, {run.label} (peak {run.peak_reserved / unit:,.1f} {unit_name})")
    if lookup:
        tl = lookup.result["timeline"]
        last = max(1, tl["samples"] - 1)
        real = tl["reserved"]
        ax.step([i / last for i in tl["index"]], [v / unit for v in real], where="post", color=RECORDED_COLOR,
                label=f"memory_reserved, {lookup.label} (peak {max(real, default=0) / unit:,.1f} {unit_name})")
    ax.set_xlabel("fraction of the run (simulator: per tensor event; recorded: per op)")
    ax.set_ylabel(f"{unit_name} above the run's start")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.1 * max([1.0, *ax.get_ylim()[1:]]))
    fig.legend(loc="outside lower center", fontsize=7, ncols=1, frameon=False)
    what = (run.description or run.workload).rstrip(".")
    ax.set_title(title or f"reserved over {what}: simulated"
                 + (" vs recorded on a real GPU" if lookup else " (no recorded GPU run matches)"), fontsize=10)
    return fig
