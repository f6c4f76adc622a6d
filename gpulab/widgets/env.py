"""Engine panel (lesson 00): one float32 tensor of a chosen size; which engine answers, why,
and the label it puts on its number, next to the formula and the simulated allocator.

Also ``engine_guard``: a memory guard that resolves ``auto`` the way the experiment will (with
the predicted size and the cpu limit), so a large ``auto`` run goes to the fake engine instead
of being refused."""
from __future__ import annotations

from typing import Any, Callable

import ipywidgets as W

from gpulab.measure.engines import DEFAULT_MAX_CPU_BYTES, choose_engine
from gpulab.course.start import SIZE_OPTIONS_MIB, EngineDemo, engine_demo
from gpulab.course.tensor_plots import engine_demo_figure, to_png
from gpulab.units import MiB, format_bytes
from gpulab.widgets.base import GuardVerdict, Panel, dropdown, ENGINES, engine_dropdown, with_value
from gpulab.widgets.guard import free_memory

__all__ = [
    "CPU_LIMIT_OPTIONS_MIB", "SAFE_FRACTION", "compute_engine_demo", "engine_guard", "engine_panel",
    "predict_engine_demo_peak", "render_engine_demo"
]

CPU_LIMIT_OPTIONS_MIB = (64, 256, 1024, DEFAULT_MAX_CPU_BYTES // MiB, 8192)


SAFE_FRACTION = 0.25   # a formula peak under this share of free memory needs no fake-engine check


def engine_guard(predict_fake_peak: Callable[[dict[str, Any]], int],
                 max_cpu_bytes: Callable[[dict[str, Any]], int],
                 formula_peak: Callable[[dict[str, Any]], int], engine_key: str = "engine") -> Callable:
    """Refuse a cpu or cuda run whose peak (predicted on the fake engine) exceeds free memory.

    Unlike ``guard.memory_guard`` it passes the predicted size and the cpu limit to
    ``choose_engine``, so ``auto`` resolves exactly as the experiment will resolve it. The cheap
    ``formula_peak`` decides the engine and waves through runs far below free memory; only runs
    that come close are predicted on the fake engine first."""
    def guard(params: dict[str, Any]) -> GuardVerdict:
        guess = formula_peak(params)
        choice = choose_engine(params.get(engine_key, "auto"), predicted_bytes=guess,
                               max_cpu_bytes=max_cpu_bytes(params))
        if choice.name == "fake":
            return GuardVerdict(True)
        free, what = free_memory(choice.name)
        if guess <= SAFE_FRACTION * free:
            return GuardVerdict(True)
        peak = predict_fake_peak(params)
        if peak <= free:
            return GuardVerdict(True)
        return GuardVerdict(
            False,
            f"<b>Not run:</b> the fake engine predicts a peak of <b>{format_bytes(peak)}</b> (fake tensors, "
            f"no compute), more than the {format_bytes(free)} a run may use on the <b>{choice.name}</b> engine "
            f"({what}). "
            f"Switch to the <b>fake</b> engine, which answers the same question without allocating anything.",
            suggestion={engine_key: "fake"})
    return guard


def compute_engine_demo(size_mib: int, engine: str, cpu_limit_mib: int) -> EngineDemo:
    return engine_demo(size_mib, engine, cpu_limit_mib)


def predict_engine_demo_peak(params: dict[str, Any]) -> int:
    """The guard's prediction: the same tensor on the fake engine (no memory used)."""
    return compute_engine_demo(**dict(params, engine="fake")).measured_bytes


def render_engine_demo(result: EngineDemo) -> list[Any]:
    return [result, to_png(engine_demo_figure(result))]


def _mib_slider(description: str, options, value) -> W.SelectionSlider:
    opts = [(f"{v:,} MiB" if v < 1024 else f"{v // 1024:,} GiB", v) for v in options]
    return with_value(description, W.SelectionSlider(options=opts, description=description, continuous_update=False,
                                                     style={"description_width": "initial"},
                                                     layout=W.Layout(width="340px")), value)


def engine_panel(size_mib: int = 4, engine: str = "auto",
                 cpu_limit_mib: int = DEFAULT_MAX_CPU_BYTES // MiB) -> Panel:
    controls = {
        "size_mib": _mib_slider("tensor size", SIZE_OPTIONS_MIB, size_mib),
        "engine": engine_dropdown(engine),
        "cpu_limit_mib": _mib_slider("auto: cpu engine up to", CPU_LIMIT_OPTIONS_MIB, cpu_limit_mib),
    }
    return Panel("Which engine answers?", controls, compute_engine_demo, render_engine_demo,
                 auto_run=True,
                 guard=engine_guard(predict_engine_demo_peak, lambda p: p["cpu_limit_mib"] * MiB,
                                    lambda p: p["size_mib"] * MiB),
                 description="Allocate one float32 tensor. <b>auto</b> picks cuda when there is a GPU, "
                             "else cpu while the tensor is under the limit, else fake; every number "
                             "says which engine produced it.")
