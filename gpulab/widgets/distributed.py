"""Lesson 12's panel: a data-parallel strategy, the world size (1-4 local processes), the model
and its width → each rank's memory by category, measured in real torch.distributed processes,
next to ZeRO's formula.

Starting the processes (each imports torch) costs far more than these small steps, and a strategy
is what a student changes most. So a setting not measured yet is measured for every strategy at once,
in one set of processes (``measure_strategies``, as the lesson's comparison does), and kept for the
session; moving to another strategy, or back to a setting, shows what was measured with those same
settings, under a line saying so (the tracker counts bytes, which repeat exactly from run to run:
``tests/test_panel_speed.py`` checks it). Pressing Run again without changing anything measures afresh."""
from __future__ import annotations

from typing import Any, Iterable

from IPython.display import HTML

from gpulab.course.distributed import strategy_bars
from gpulab.distributed.sharding import (MODELS, STRATEGIES, StrategyRun, StrategySpec, measure_strategies,
                                         measure_strategy)
from gpulab.widgets.base import REUSED_NOTE, Panel, dropdown, slider

__all__ = ["KEPT_NOTE", "compute_sharding", "render_sharding", "sharding_panel"]

KEPT_NOTE = ("<i class='gpulab-reused'>Shown: measured earlier in this session with these same settings (the "
             "lesson's comparison above, or this panel measuring every strategy at once); press Run again to "
             "measure afresh.</i>")


def compute_sharding(strategy: str, world_size: int, model: str, width: int) -> StrategyRun:
    return measure_strategy(world_size=world_size, strategy=strategy, model=model, width=width)


def render_sharding(result: StrategyRun) -> list[Any]:
    return [strategy_bars([result]), result]


def _key(run: StrategyRun) -> tuple:
    return (run.spec, run.world_size)


class _Kept:
    """The panel's measurements by settings, the lesson's first; which result was shown last."""

    def __init__(self, measured: Iterable[StrategyRun]):
        self.runs: dict[tuple, StrategyRun] = {_key(r): r for r in measured if r is not None}
        self.lessons = {id(r) for r in self.runs.values()}
        self.reused: set[int] = set()
        self.last: tuple | None = None

    def compute(self, strategy: str, world_size: int, model: str, width: int) -> StrategyRun:
        key = (StrategySpec(strategy=strategy, model=model, width=width), world_size)
        if key == self.last:
            run = compute_sharding(strategy, world_size, model, width)     # Run again: measured afresh
        elif key in self.runs:
            run = self.runs[key]
            self.reused.add(id(run))
        else:   # every strategy of these settings at once, in one set of processes
            specs = [StrategySpec(strategy=s, model=model, width=width) for s in STRATEGIES]
            for r in measure_strategies(specs, world_size):
                self.runs[_key(r)] = r
            run = self.runs[key]
        self.runs[key], self.last = run, key
        return run

    def render(self, run: StrategyRun) -> list[Any]:
        out = render_sharding(run)
        if id(run) in self.reused:
            out.insert(0, HTML(REUSED_NOTE if id(run) in self.lessons else KEPT_NOTE))
        return out


def sharding_panel(strategy: str = "fsdp2", world_size: int = 2, model: str = "transformer",
                   width: int = 128, measured: Iterable[StrategyRun] = ()) -> Panel:
    """The panel. ``measured``: runs the lesson already made (a comparison's ``runs``), shown for their
    settings instead of starting the worker processes again for the same measurement (module docstring)."""
    controls = {
        "strategy": dropdown("strategy", list(STRATEGIES), strategy),
        "world_size": slider("processes", world_size, 1, 4),
        "model": dropdown("model", list(MODELS), model),
        "width": slider("width", width, 32, 512, step=32),
    }
    kept = _Kept(measured)
    return Panel("Data parallel, ZeRO and FSDP, measured per rank", controls, kept.compute, kept.render,
                 description="Each new setting starts that many worker processes joined by torch.distributed (gloo "
                             "on this CPU, loopback only), wraps the model with every strategy in turn and trains "
                             "two steps under gpulab's tracker in every rank; start-up takes a few seconds, and "
                             "switching strategy afterwards shows what was measured.")
