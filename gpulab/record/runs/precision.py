"""Lesson 08's measuring core: ``steps`` training steps of a lesson model in fp32, under
``torch.autocast`` (fp16 adds ``GradScaler``) and in pure 16 bits, each tracked on an engine.

It returns data (one ``PrecisionRun`` per mode: the ``Measurement``, the bytes kept between steps,
the activations at the peak by dtype, GradScaler facts); ``gpulab.course.precision`` adds the
formulas and the views, and ``gpulab record`` stores ``runs_as_dict`` for a real GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpulab.measure.engines import Measured, Measurement, run
from gpulab.models.registry import ModelSpec
from gpulab.models.workload import image_workload
from gpulab.training.loop import LoopRecipe, train_experiment
from gpulab.categories import Category
from gpulab.units import dtype_name, parse_dtype
from gpulab.record.kinds import head, record_kind
from gpulab.models.registry import resolve_model

__all__ = [
    "LOW_DTYPES", "PrecisionRun", "modes", "precision_experiment", "record_precision",
    "run_precision_modes", "runs_as_dict", "saved_by_dtype"
]

LOW_DTYPES = ("bfloat16", "float16")


def modes(low: str = "bfloat16") -> tuple[str, str, str]:
    """The three modes compared: ``("fp32", "autocast <low>", "pure <low>")``."""
    low = dtype_name(parse_dtype(low))
    if low not in LOW_DTYPES:
        raise ValueError(f"low-precision dtype must be one of {', '.join(LOW_DTYPES)}, got {low!r}")
    return ("fp32", f"autocast {low}", f"pure {low}")


@dataclass
class PrecisionRun(Measured):
    mode: str
    measurement: Measurement
    n_params: int
    persistent: dict[str, int]               # after the step: parameters, gradients, optimizer_state
    saved_by_dtype: dict[str, int]            # activations alive at the peak, by dtype
    scaler: dict[str, Any] | None = None      # GradScaler facts (fp16 autocast only)

    @property
    def bytes_per_param(self) -> float:
        return sum(self.persistent.values()) / self.n_params


def _persistent(net: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    params = list(net.parameters())
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    nb = lambda t: t.untyped_storage().nbytes()
    return {"parameters": sum(nb(p) for p in params),
            "gradients": sum(nb(p.grad) for p in params if p.grad is not None),
            "optimizer_state": sum(nb(t) for t in state)}


def precision_experiment(spec: ModelSpec, batch: int, image_size: int, optimizer: str, mode: str, steps: int = 2):
    """``steps`` training steps in ``mode`` (an experiment for ``engines.run``): ``training.loop``
    with the model (and its inputs) in fp32 or in the low dtype, autocast for the forward, and a
    GradScaler for fp16 autocast; seeded, the model labelled before the optimizer exists."""
    low = parse_dtype(mode.split()[-1]) if mode != "fp32" else torch.float32
    pure = mode.startswith("pure")
    amp = mode.startswith("autocast")
    recipe = LoopRecipe(optimizer, amp=low if amp else None, grad_scaler=amp and low == torch.float16, seed=0,
                    register_model=True)

    def report(ctx, net: nn.Module, opt: torch.optim.Optimizer, scaler) -> dict[str, Any]:
        facts = None
        if scaler is not None:
            facts = {"scale": None if ctx.engine == "fake" else float(scaler.get_scale()),
                     "state_bytes": sum(t.untyped_storage().nbytes() for t in (scaler._scale, scaler._growth_tracker)
                                        if t is not None)}
        return {"persistent": _persistent(net, opt), "n_params": sum(p.numel() for p in net.parameters()),
                "scaler": facts}

    return train_experiment(image_workload(spec, image_size), [batch] * steps, low if pure else torch.float32,
                            recipe, report=report)


def saved_by_dtype(m: Measurement) -> dict[str, int]:
    """Activations alive at the tracked peak, bytes by dtype."""
    tr = m.tracking
    out: dict[str, int] = {}
    if tr is None or tr.peak_index < 0:
        return out
    for r in tr.live_at(tr.peak_index):
        if r.category == Category.ACTIVATIONS:
            out[r.dtype] = out.get(r.dtype, 0) + tr.storage_bytes(r)
    return out


def run_precision_modes(spec: ModelSpec, batch: int, image_size: int, optimizer: str, chosen: tuple[str, ...],
                        engine: str, steps: int = 2) -> dict[str, PrecisionRun]:
    """One tracked run per mode in ``chosen`` on ``engine`` (a resolved name). Raises
    ``MemoryError`` when a run goes out of memory."""
    runs = {}
    for mode in chosen:
        m = run(precision_experiment(spec, batch, image_size, optimizer, mode, steps), engine)
        if m.oom:
            raise MemoryError(m.error)
        v = m.value
        runs[mode] = PrecisionRun(mode, m, v["n_params"], v["persistent"], saved_by_dtype(m), v["scaler"])
    return runs


def runs_as_dict(runs: dict[str, PrecisionRun]) -> dict[str, Any]:
    """Plain JSON-able data per mode (what ``gpulab record`` stores): the peak and its categories,
    activations at the peak by dtype, bytes kept between steps, the allocator's counters on CUDA,
    the saving against fp32 in % of its peak."""
    base = runs["fp32"].peak_bytes if "fp32" in runs else None
    return {k: {"peak_bytes": r.peak_bytes, "peak_by_category": dict(r.peak_by_category),
                "saved_by_dtype": r.saved_by_dtype, "persistent": r.persistent,
                "bytes_per_param": r.bytes_per_param, "scaler": r.scaler,
                "allocator": dict(r.measurement.allocator or {}),
                "saving_percent": 100.0 * (base - r.peak_bytes) / base if base else None}
            for k, r in runs.items()}


@record_kind("precision")
def record_precision(p: dict[str, Any]) -> dict[str, Any]:
    """Lesson 08's mixed-precision panel default on the GPU."""
    runs = run_precision_modes(resolve_model(p["model"]), p["batch"], p["image_size"], p["optimizer"],
                               modes(p["low"]), "cuda", p["steps"])
    return {**head(runs["fp32"].measurement), **p, "runs": runs_as_dict(runs)}
