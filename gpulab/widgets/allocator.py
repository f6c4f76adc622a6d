"""Caching-allocator panel (lesson 09): model / batch / workload / expandable segments /
empty_cache after each step -> allocated vs reserved over the events (simulated allocator),
the segment map at the allocated peak, and a table of ``memory_stats()`` keys (next to the
real allocator's when the tracked run was on CUDA)."""
from __future__ import annotations

from typing import Any

import ipywidgets as W

from ..allocator_plots import allocated_vs_reserved, segment_map
from ..replay import WORKLOADS, AllocatorRun, workload
from .base import Panel, dropdown, slider


def compute_allocator(model: str, batch: int, workload_name: str, expandable_segments: bool,
                      empty_cache: bool) -> AllocatorRun:
    return workload(workload_name, model, batch, expandable_segments=expandable_segments,
                    empty_cache=empty_cache)


def render_allocator(run: AllocatorRun) -> list[Any]:
    return [allocated_vs_reserved(run),
            segment_map(run.segments, title=f"segment map at the allocated peak ({run.label})"),
            run]


def allocator_panel(model: str = "cnn", batch: int = 32, workload_name: str = "training step",
                    expandable_segments: bool = False, empty_cache: bool = False) -> Panel:
    controls = {
        "model": dropdown("model", ["cnn", "mlp"], model),
        "batch": slider("batch", batch, 1, 128, log=True),
        "workload_name": dropdown("workload", WORKLOADS, workload_name),
        "expandable_segments": W.Checkbox(value=expandable_segments, description="expandable segments"),
        "empty_cache": W.Checkbox(value=empty_cache, description="empty_cache() after each step"),
    }
    return Panel("The caching allocator", controls, compute_allocator, render_allocator,
                 description="A tracked timeline replayed through the <b>simulated allocator</b>: "
                             "allocated (tensors, 512-byte rounded) vs reserved (segments).")
