"""Lesson 12's panel: a data-parallel strategy, the world size (1-4 local processes), the model
and its width → each rank's memory by category, measured in real torch.distributed processes,
next to ZeRO's formula."""
from __future__ import annotations

from typing import Any

from ..course.distributed import strategy_bars
from ..sharding import MODELS, STRATEGIES, StrategyRun, measure_strategy
from .base import Panel, dropdown, slider


def compute_sharding(strategy: str, world_size: int, model: str, width: int) -> StrategyRun:
    return measure_strategy(world_size=world_size, strategy=strategy, model=model, width=width)


def render_sharding(result: StrategyRun) -> list[Any]:
    return [strategy_bars([result]), result]


def sharding_panel(strategy: str = "fsdp2", world_size: int = 2, model: str = "transformer",
                   width: int = 128) -> Panel:
    controls = {
        "strategy": dropdown("strategy", list(STRATEGIES), strategy),
        "world_size": slider("processes", world_size, 1, 4),
        "model": dropdown("model", list(MODELS), model),
        "width": slider("width", width, 32, 512, step=32),
    }
    return Panel("Data parallel, ZeRO and FSDP, measured per rank", controls, compute_sharding, render_sharding,
                 description="Each run starts that many worker processes joined by torch.distributed (gloo on this "
                             "CPU, loopback only), wraps the model with the strategy and trains two steps under "
                             "gpulab's tracker in every rank; start-up takes a few seconds per run.")
