"""Lesson 05's measuring core: a short training run of a fresh model with one optimizer and one
implementation (for-loop, foreach, fused), tracked on an engine, with the live bytes by category
at named moments (before and after each ``step()``, after ``zero_grad``). It returns data (the
``Measurement`` and the moments); ``gpulab.course.optimizers`` adds the formulas, the comparisons
and the views, and ``gpulab record`` stores ``implementations_as_dict`` for a real GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from gpulab.measure.engines import Measurement, RunContext, run
from gpulab.training.optimizers import (IMPLEMENTATIONS, UnsupportedImplementation)
from gpulab.models.registry import ModelSpec
from gpulab.models.workload import image_workload
from gpulab.training.loop import LoopRecipe, train_experiment
from gpulab.categories import CATEGORIES, Category
from gpulab.record.kinds import record_kind
from gpulab.models.registry import resolve_model

__all__ = [
    "Moment", "event_count", "implementations_as_dict", "moments_at", "optimizer_experiment",
    "record_implementations", "run_optimizer", "state_tensor_bytes", "step_peak"
]

def state_tensor_bytes(optimizer: torch.optim.Optimizer, device: str | None = None) -> dict[str, int]:
    """Bytes of the tensors in ``optimizer.state``, summed per state name (``exp_avg``, ``step``,
    ...), each storage counted once. ``device``: count only tensors on this device type."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for state in optimizer.state.values():
        for key, v in state.items():
            if not isinstance(v, torch.Tensor):
                continue
            if device is not None and v.device.type != torch.device(device).type:
                continue
            st = v.untyped_storage()
            if id(st) in seen:
                continue
            seen.add(id(st))
            out[key] = out.get(key, 0) + st.nbytes()
    return out


@dataclass
class Moment:
    """Live bytes by category at a named moment of the run (the tracker's count)."""
    name: str
    event: int                  # number of tracker events on the device so far
    by_category: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.by_category.values())


def event_count(ctx: RunContext, device: str) -> int:
    """How many tracker events on ``device`` so far (the index the next event will get)."""
    return len(ctx.tracker.result(device=device).events)


def moments_at(marks: dict[str, int], m: Measurement) -> dict[str, Moment]:
    """Live bytes by category at each mark, read from the final timeline, so every storage
    carries the label it ended up with (a parameter is labelled when its module first runs)."""
    tr = m.tracking
    zero = {c.value: 0 for c in CATEGORIES}
    return {name: Moment(name, n, dict(tr.series[n - 1]) if n > 0 else dict(zero))
            for name, n in marks.items()}


def optimizer_experiment(spec: ModelSpec, optimizer: str, implementation: str, batch: int, image_size: int,
                         dtype: torch.dtype, steps: int, set_to_none: bool, autocast: torch.dtype | None,
                         out: dict[str, Any]) -> Callable[[RunContext], dict[str, Any]]:
    """The experiment ``run`` calls: ``training.loop`` with this implementation, ``zero_grad`` in
    the optimizer phase and named moments. Fills ``out`` with the moments and what optimizer.state
    held at the end (plain Python data, so it survives the fake-tensor mode); everything is freed
    in a teardown phase of its own."""
    recipe = LoopRecipe(optimizer, implementation=implementation, amp=autocast, zero_grad="top, optimizer phase",
                    set_to_none=set_to_none, teardown=True)
    marks: dict[str, int] = {}

    def moment(ctx: RunContext, name: str) -> None:
        marks[name] = event_count(ctx, str(ctx.device) if ctx.engine == "cuda" else "cpu")

    def report(ctx: RunContext, net: nn.Module, opt: torch.optim.Optimizer, scaler) -> dict[str, Any]:
        out["marks"] = marks
        out["state_names"] = state_tensor_bytes(opt, device=ctx.device.type)
        out["n_params"] = sum(p.numel() for p in net.parameters())
        out["n_param_tensors"] = sum(1 for _ in net.parameters())
        out["param_bytes"] = sum(p.numel() * p.element_size() for p in net.parameters())
        return {}

    return train_experiment(image_workload(spec, image_size), [batch] * steps, dtype, recipe,
                            moment=moment, report=report)


def step_peak(m: Measurement, before: Moment, after: Moment) -> tuple[int, dict[str, int]]:
    """Highest live total reached between two moments (e.g. inside one ``optimizer.step()``),
    and the categories at that moment."""
    tr = m.tracking
    best, split = before.total, dict(before.by_category)
    for i in range(before.event, min(after.event, len(tr.series))):
        tot = sum(tr.series[i].values())
        if tot > best:
            best, split = tot, dict(tr.series[i])
    return best, split


def run_optimizer(spec: ModelSpec, optimizer: str, implementation: str, batch: int, image_size: int,
                  dtype: torch.dtype, steps: int, engine: str, set_to_none: bool = True,
                  **run_kwargs: Any) -> tuple[Measurement, dict[str, Any]]:
    """``steps`` tracked training steps on ``engine``; the measurement and what the experiment
    recorded (marks, optimizer.state by name, parameter counts)."""
    out: dict[str, Any] = {}
    m = run(optimizer_experiment(spec, optimizer, implementation, batch, image_size, dtype, steps, set_to_none, None,
                            out), engine, **run_kwargs)
    return m, out


def implementations_as_dict(spec: ModelSpec, optimizer: str, batch: int, image_size: int, engine: str,
                            implementations: tuple[str, ...] = IMPLEMENTATIONS, steps: int = 2) -> dict[str, Any]:
    """Each implementation run for ``steps`` steps (what the implementation panel runs), as plain
    JSON-able data (what ``gpulab record`` stores): the temporaries alive at the peak of the last
    ``step()``, how far memory rises inside it, the live total there, the run's peak and allocator
    counters; an implementation this torch refuses is a row saying why."""
    rows: dict[str, Any] = {}
    label = device = None
    for impl in implementations:
        try:
            m, out = run_optimizer(spec, optimizer, impl, batch, image_size, torch.float32, steps, engine)
        except (UnsupportedImplementation, RuntimeError, NotImplementedError) as exc:
            rows[impl] = {"unsupported": f"{type(exc).__name__}: {exc}"}
            continue
        if m.oom:
            rows[impl] = {"unsupported": f"out of memory: {m.error}"}
            continue
        moments = moments_at(out["marks"], m)
        before, after = moments[f"before step {steps}"], moments[f"after step {steps}"]
        peak, split = step_peak(m, before, after)
        rows[impl] = {"step_temporaries": split.get(Category.TEMPORARIES.value, 0), "step_rise": peak - before.total,
                      "step_peak": peak, "param_bytes": out["param_bytes"], "peak_bytes": m.peak_bytes,
                      "allocator": dict(m.allocator or {})}
        label, device = label or m.label, device or m.device
    return {"engine": engine, "device": device, "label": label, "implementations": rows}


@record_kind("implementations")
def record_implementations(p: dict[str, Any]) -> dict[str, Any]:
    """Lesson 05's implementation panel default on the GPU."""
    return {**p, **implementations_as_dict(resolve_model(p["model"]), p["optimizer"], p["batch"],
                                           p["image_size"], "cuda", steps=p["steps"])}
