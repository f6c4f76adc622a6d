"""Caching-allocator panel (lesson 09): model / batch / workload / expandable segments /
empty_cache after each step -> allocated vs reserved over the events (simulated allocator),
the segment map at the allocated peak, and a table of ``memory_stats()`` keys (next to the
real allocator's when the tracked run was on CUDA). When the tracked run was not on CUDA, the
recorded GPU run of the same workload is shown beside it (its real peaks, and for the training
step its real ``memory_reserved`` timeline next to the simulator's), or a one-line note says that
none matches."""
from __future__ import annotations

from typing import Any

import ipywidgets as W
from IPython.display import HTML

from gpulab.allocator.plots import allocated_vs_reserved, segment_map
from gpulab.record.lookup import find_allocator_record
from gpulab.record.views import allocator_rows, recorded_html, reserved_timelines
from gpulab.predict.replay import WORKLOADS, AllocatorRun, workload
from gpulab.units import format_bytes
from gpulab.widgets.base import Panel, dropdown, slider

__all__ = ["allocator_panel", "compute_allocator", "render_allocator"]


def compute_allocator(model: str, batch: int, workload_name: str, expandable_segments: bool,
                      empty_cache: bool) -> AllocatorRun:
    """The tracked workload (the panel runs it on one CPU thread: ``Panel(threads=1)``)."""
    return workload(workload_name, model, batch, expandable_segments=expandable_segments,
                    empty_cache=empty_cache)


def _allocator_record_rows(r: dict[str, Any]) -> list[list[str]]:
    rows = allocator_rows(r)
    for key, name in (("simulated_peak_allocated", "allocated peak of the simulator, same run"),
                      ("simulated_peak_reserved", "reserved peak of the simulator, same run")):
        if r.get(key) is not None:
            rows.append([name, format_bytes(r[key])])
    return rows


def render_allocator(run: AllocatorRun) -> list[Any]:
    items: list[Any] = [allocated_vs_reserved(run),
                        segment_map(run.segments, title=f"segment map at the allocated peak ({run.label})"),
                        run]
    if run.real is None:   # the tracked run was not on a GPU: what a real one recorded
        lookup = find_allocator_record(run)
        items.append(HTML(recorded_html(lookup, _allocator_record_rows)))
        if lookup and "timeline" in lookup.result:
            items.append(reserved_timelines(run, lookup))
    return items


def allocator_panel(model: str = "cnn", batch: int = 32, workload_name: str = "training step",
                    expandable_segments: bool = False, empty_cache: bool = False) -> Panel:
    controls = {
        "model": dropdown("model", ["cnn", "mlp"], model),
        "batch": slider("batch", batch, 1, 128, log=True),
        "workload_name": dropdown("workload", WORKLOADS, workload_name),
        "expandable_segments": W.Checkbox(value=expandable_segments, description="expandable segments"),
        "empty_cache": W.Checkbox(value=empty_cache, description="empty_cache() after each step"),
    }
    return Panel("The caching allocator", controls, compute_allocator, render_allocator, threads=1,
                 description="A tracked timeline replayed through the <b>simulated allocator</b>: "
                             "allocated (tensors, 512-byte rounded) vs reserved (segments).")
