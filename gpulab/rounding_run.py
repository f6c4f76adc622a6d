"""Lesson 01's rounding measurement core: tensors of 0, 1, 2, … elements made one at a time, and
after each the live bytes the engine counts (on CUDA, ``memory_allocated`` above the run's
baseline: the caching allocator's 512-byte blocks). ``gpulab.course.tensor_bytes.rounding_curve``
adds the formulas and the simulator; ``gpulab record`` stores ``rounding_as_dict`` for a real GPU.
"""
from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch

from .engines import Measurement, RunContext


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
