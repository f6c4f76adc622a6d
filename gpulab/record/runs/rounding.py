"""Lesson 01's rounding measurement core: tensors of 0, 1, 2, … elements made one at a time, and
after each the live bytes the engine counts (on CUDA, ``memory_allocated`` above the run's
baseline: the caching allocator's 512-byte blocks). ``gpulab.course.tensor_bytes.rounding_curve``
adds the formulas and the simulator; ``gpulab record`` stores ``rounding_as_dict`` for a real GPU.
"""
from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch

from gpulab.measure.engines import Measurement, RunContext
from gpulab.record.kinds import record_kind
from gpulab.measure.engines import run
from gpulab.units import parse_dtype

__all__ = [
    "record_rounding", "rounding_as_dict", "rounding_experiment"
]


def rounding_experiment(elements: Sequence[int], dtype: torch.dtype):
    """An experiment for ``engines.run``: one ``torch.empty((e,))`` per e, freed before the next;
    its value is ``memory_allocated`` after each (None off CUDA)."""
    def experiment(ctx: RunContext) -> list[int | None]:
        allocated = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for e in elements:
                t = torch.empty((e,), dtype=dtype, device=ctx.device)
                allocated.append(ctx.snapshot(f"{e}").allocated_bytes)
                del t
        return allocated
    return experiment


def rounding_as_dict(m: Measurement, elements: Sequence[int], requested: Sequence[int]) -> dict[str, Any]:
    """Plain JSON-able data of one rounding run (what ``gpulab record`` stores)."""
    return {"engine": m.engine, "device": m.device, "label": m.label, "elements": list(elements),
            "requested": list(requested), "memory_allocated": list(m.value or []),
            "allocator": dict(m.allocator or {}), "oom": m.oom, "error": m.error}


@record_kind("rounding")
def record_rounding(p: dict[str, Any]) -> dict[str, Any]:
    """Lesson 01's 512-byte panel default on the GPU: ``memory_allocated`` after each tensor."""
    dt = parse_dtype(p["dtype"])
    elements = list(range(p["max_elements"] + 1))
    m = run(rounding_experiment(elements, dt), engine="cuda")
    return rounding_as_dict(m, elements, [e * dt.itemsize for e in elements])
