"""Lesson 12's panel: a data-parallel strategy, the world size (1-4 local processes), the model
and its width → each rank's memory by category, measured in real torch.distributed processes,
next to ZeRO's formula."""
from __future__ import annotations

from typing import Any, Iterable

from gpulab.course.distributed import strategy_bars
from gpulab.distributed.sharding import MODELS, STRATEGIES, StrategyRun, StrategySpec, measure_strategy
from gpulab.widgets.base import Panel, dropdown, reuse_first, slider

__all__ = ["compute_sharding", "render_sharding", "sharding_panel"]


def compute_sharding(strategy: str, world_size: int, model: str, width: int) -> StrategyRun:
    return measure_strategy(world_size=world_size, strategy=strategy, model=model, width=width)


def render_sharding(result: StrategyRun) -> list[Any]:
    return [strategy_bars([result]), result]


def _same_settings(run: StrategyRun, p: dict[str, Any]) -> bool:
    return (run.world_size == p["world_size"]
            and run.spec == StrategySpec(strategy=p["strategy"], model=p["model"], width=p["width"]))


def sharding_panel(strategy: str = "fsdp2", world_size: int = 2, model: str = "transformer",
                   width: int = 128, measured: Iterable[StrategyRun] = ()) -> Panel:
    """The panel. ``measured``: runs the lesson already made (a comparison's ``runs``); the first
    showing uses the one made with the panel's settings rather than starting the worker processes
    again for the same measurement, and says so. Every Run measures afresh."""
    controls = {
        "strategy": dropdown("strategy", list(STRATEGIES), strategy),
        "world_size": slider("processes", world_size, 1, 4),
        "model": dropdown("model", list(MODELS), model),
        "width": slider("width", width, 32, 512, step=32),
    }
    compute, render = reuse_first(compute_sharding, render_sharding, measured, _same_settings)
    return Panel("Data parallel, ZeRO and FSDP, measured per rank", controls, compute, render,
                 description="Each run starts that many worker processes joined by torch.distributed (gloo on this "
                             "CPU, loopback only), wraps the model with the strategy and trains two steps under "
                             "gpulab's tracker in every rank; start-up takes a few seconds per run.")
