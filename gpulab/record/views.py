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
* ``gap_notes(result)``: for every gap above ``GAP`` (10%) between what the tracker counted and what
  the allocator's counters show in the same recorded run, or between its allocated and reserved
  peaks, one sentence naming the part the bytes are (the allocations no tensor owns: kernels'
  workspaces, from the record's own allocator trace; the allocator's segments), with the bytes.
  ``recorded_html`` shows them under the table, so no gap is shown unexplained.
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
    "ALLOCATOR_ROWS", "GAP", "NOTE_PREFIX", "RECORDED_COLOR", "TITLE", "allocator_rows", "counter_text",
    "gap_notes", "recorded_html", "recorded_note", "reserved_timelines"
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


GAP = 0.10   # a difference above this share of the smaller figure is explained where it is shown
_DETAIL = "lesson 09 shows the allocator's segments and the workspaces in detail"


def _over(a: int, b: int) -> bool:
    return abs(a - b) > GAP * max(min(a, b), 1)


def _run_gaps(name: str, run: dict[str, Any], tracked_key: str | None, reserved_shown: bool = True) -> list[str]:
    """The notes for one recorded run: tracker against allocated, allocated against reserved (when
    the table shows reserved)."""
    a = run.get("allocator") or {}
    alloc, reserved = a.get("peak_allocated_delta"), a.get("peak_reserved_delta")
    if alloc is None:
        return []
    where = f"{name}: " if name else ""
    out = []
    tracked = run.get(tracked_key) if tracked_key else None
    if tracked is not None and _over(alloc, tracked):
        beyond = (run.get("beyond_tensors") or {}).get("not_tensors") or {}
        part = (f"the allocator's own trace holds {beyond['count']} allocations no tensor owns (cuDNN's and "
                f"cuBLAS's workspaces, buffers inside a kernel), {format_bytes(beyond['at_peak'])} of them live at "
                f"its peak" if beyond.get("count") else
                "allocations no tensor owns: the workspaces cuDNN's convolutions and cuBLAS take from the same "
                "caching allocator, and buffers inside a kernel")
        kept = a.get("allocated_delta") or 0
        if not beyond.get("count") and kept > 0:
            part += (f"; {format_bytes(kept)} of it is still allocated after the run, when none of the run's "
                     f"tensors is")
        held = beyond.get("tensors_at_peak") if beyond.get("count") else None
        if held is not None and _over(tracked, held):
            # the two peaks fall at different moments: what the tensors hold at the allocator's peak is why the
            # gap is smaller (or larger) than the allocations no tensor owns
            part += (f", where the tensors hold {format_bytes(held)}, not the tracker's peak: the allocator's "
                     f"peak and the tracker's fall at different moments")
        if alloc > tracked:
            out.append(f"{where}max_memory_allocated − baseline is {format_bytes(alloc - tracked)} above the "
                       f"tracker's {format_bytes(tracked)} ({(alloc - tracked) / tracked:+.1%}): {part}.")
        else:
            out.append(f"{where}max_memory_allocated − baseline is {format_bytes(tracked - alloc)} under the "
                       f"tracker's {format_bytes(tracked)}: the tracker counts storages alive together that the "
                       f"allocator had already reused.")
    if reserved_shown and reserved is not None and alloc and _over(reserved, alloc):
        if reserved > alloc:
            replay = ((run.get("beyond_tensors") or {}).get("not_tensors") or {}).get("replayed_peak_reserved")
            again = (f"; gpulab's allocator simulator, replaying this run's own trace, reserves "
                     f"{format_bytes(replay)}" if replay else "")
            out.append(f"{where}max_memory_reserved − baseline is {format_bytes(reserved - alloc)} above "
                       f"max_memory_allocated − baseline: the caching allocator reserves whole segments and cuts "
                       f"blocks from them, and keeps a freed block cached for the next request{again}.")
        else:
            out.append(f"{where}max_memory_reserved − baseline is {format_bytes(alloc - reserved)} under "
                       f"max_memory_allocated − baseline: blocks were cut from segments reserved before the run "
                       f"({format_bytes(a.get('baseline_reserved', 0))} reserved, "
                       f"{format_bytes(a.get('baseline_allocated', 0))} of it allocated, at its start), so the "
                       f"run reserved less than it allocated.")
    return out


def gap_notes(result: dict[str, Any], points_reserved_shown: bool = False) -> list[str]:
    """Each gap above ``GAP`` a recorded run's table shows, with the part it is (module docstring):
    the run itself (its tracked ``peak_bytes``, or a model build's live parameters and buffers), and
    each run of a panel that records several (``runs``, ``models``), where the allocator's counter
    also holds what the columns beside it leave out, where they do (the parameters, when a run's column
    is its ``peak_non_param``; a model build's, and with backward their gradients), and each point of a
    recorded sweep (``points``: named by its k or its batch; its reserved peak only when
    ``points_reserved_shown``, the table showing it)."""
    notes = []
    if "live_by_category" in result:
        live = dict(result, live_total=sum(result["live_by_category"].values()))
        notes += _run_gaps("", live, "live_total")
    else:
        notes += _run_gaps("", result, "peak_bytes")
    # a panel recording several runs shows one allocator counter per run (no reserved) beside its tracker
    # columns; where they leave the parameters out (the run's ``peak_non_param``: lesson 03's pair), the
    # note says the counter holds them; where the tracker's peak is shown whole (``peak_bytes``, the
    # parameters in it), there is nothing to add but a gap above GAP
    runs = {n: r for n, r in (result.get("runs") or {}).items() if (r.get("allocator") or {}).get("peak_allocated_delta") is not None}
    for name, run in runs.items():
        if run.get("peak_non_param") is not None:
            over = run["allocator"]["peak_allocated_delta"] - run["peak_bytes"]
            rest = (f"; the other {format_bytes(over)} is allocations no tensor owns (cuDNN's and cuBLAS's "
                    f"workspaces, buffers inside a kernel) and blocks rounded up" if over > 0 else "")
            notes.append(f"{name}: max_memory_allocated − baseline counts the parameters too, built in the run: the "
                         f"tracker's peak with them is {format_bytes(run['peak_bytes'])}{rest}.")
        notes += _run_gaps(name, run, "peak_bytes", reserved_shown=False)
    # a sweep recording one run per point, shown a row each (lesson 07's checkpoint sweep: one per segment count
    # k; lesson 04's batch sweep: one step per batch, with its reserved peak when the table shows it)
    for p in result.get("points") or []:
        if (p.get("allocator") or {}).get("peak_allocated_delta") is not None:
            name = (f"k = {p['segments']}" if "segments" in p else f"batch {p['batch']}" if "batch" in p else "")
            notes += _run_gaps(name, p, "peak_bytes", reserved_shown=points_reserved_shown)
    if any((r.get("allocator") or {}).get("peak_allocated_delta") is not None for r in (result.get("models") or {}).values()):
        notes.append("max_memory_allocated − baseline counts each whole run: the parameters built in it and the "
                     "gradients backward made, which the columns beside it leave out.")
    return notes


def recorded_html(lookup, rows: Callable[[dict[str, Any]], Sequence[Sequence[Any]]],
                  headers: Sequence[str] = ("recorded figure", "bytes"), title: str = TITLE) -> str:
    """The recorded figures (``rows(lookup.result)``) as a table labelled with the record's
    provenance, or ``recorded_note`` when the lookup found none."""
    if not lookup:
        return recorded_note(lookup)
    body = [list(r) for r in rows(lookup.result)]
    notes = gap_notes(lookup.result, points_reserved_shown=any("reserved" in h for h in headers))
    why = ("" if not notes else "<div class='gpulab-label gpulab-gaps'>Where the figures differ: "
           + " ".join(html.escape(n) for n in notes) + f" ({html.escape(_DETAIL)}.)</div>")
    return (f"<div class='gpulab-recorded'><b>{html.escape(title)}</b>"
            + html_table(list(headers), body, lookup.label) + why + "</div>")


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
