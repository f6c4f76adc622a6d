"""Largest-batch panel: pick a card, get the largest batch that fits, predicted on the fake
engine, verified by fake runs and the allocator simulator, and run for real on a GPU when
there is one."""
from __future__ import annotations

from typing import Any

import ipywidgets as W

from gpulab.training.optimizers import OPTIMIZERS
from gpulab.models.registry import MODELS
from gpulab.course.sweeps import CARDS_GIB, CONTEXT_OVERHEAD_ASSUMED, LargestBatch, largest_batch
from gpulab.units import MiB
from gpulab.widgets.base import Panel, dropdown, slider_layout, with_value

__all__ = ["compute_largest", "largest_batch_panel", "render_largest"]


def compute_largest(model: str, card_gib: int, optimizer: str, context_mib: int, progress=None) -> LargestBatch:
    return largest_batch(model, card_gib, optimizer=optimizer, context_overhead_bytes=int(context_mib) * MiB,
                         progress=progress)


def render_largest(result: LargestBatch) -> list[Any]:
    return [result, result.plot()]


def largest_batch_panel(model: str = "vgg16", card_gib: int = 16, optimizer: str = "sgd",
                        context_mib: int = CONTEXT_OVERHEAD_ASSUMED // MiB) -> Panel:
    if card_gib not in CARDS_GIB:
        raise ValueError(f"card must be one of {', '.join(f'{c} GiB' for c in CARDS_GIB)}, got {card_gib!r}")
    controls = {
        "model": dropdown("model", list(MODELS), model),
        "card_gib": dropdown("card", [(f"{c} GiB", c) for c in CARDS_GIB], card_gib),
        "optimizer": dropdown("optimizer", OPTIMIZERS, optimizer),
        "context_mib": with_value("context_mib", W.IntSlider(
            value=0, min=0, max=2048, step=64, description="assumed CUDA context (MiB)", continuous_update=False,
            style={"description_width": "initial"}, layout=slider_layout("assumed CUDA context (MiB)")),
            context_mib),   # refused out of range, never clamped
    }
    return Panel("The largest batch that fits a card", controls, compute_largest, render_largest,
                 description="Fake tensors (no compute) at four batch sizes, a fitted line solved for the card, "
                             "then fake runs at that batch and the next to verify it, replayed through the "
                             "caching-allocator simulator. The CUDA context is an assumption you can change.")
