"""Lesson 02's measuring core: build one layer (``make_layer``) or a model on an engine's device and count, with the tracker,
the bytes its parameters and buffers hold once built (unrounded: numel × element size, what the
formulas predict; on CUDA the allocator's counters come with the run). It returns data;
``gpulab.course.parameters`` adds the per-layer rows and formulas, and ``gpulab record`` stores
``build_as_dict`` for a real GPU.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from gpulab.measure.engines import Measurement, RunContext
from gpulab.models.registry import ModelSpec, build_model
from gpulab.record.kinds import record_kind
from gpulab.measure.engines import run
from gpulab.units import parse_dtype
from gpulab.models.registry import resolve_model

__all__ = [
    "LAYER_KINDS", "build_as_dict", "build_experiment", "layer_experiment", "layer_repr",
    "live_by_category", "make_layer", "positive_int", "record_layer_build", "record_model_build"
]

LAYER_KINDS = ("Conv2d", "Linear", "BatchNorm2d", "LayerNorm", "Embedding")


def live_by_category(ctx: RunContext) -> dict[str, int]:
    """Live tensor bytes per category right now on the run's device, unrounded (numel × element
    size), on every engine: what ``count × 4 B`` predicts. On CUDA each storage also takes a
    512-byte multiple of the allocator; comparing the formula with that would flip the verdict
    for small tensors, so the comparison is of like with like."""
    return dict(ctx.tracker.result(device=str(ctx.device), round_to_cuda_blocks=False).final_by_category)


def build_experiment(spec: ModelSpec, dtype: torch.dtype, rows: Callable[[nn.Module], Any] | None = None):
    """Build ``spec`` on the run's device (an experiment for ``engines.run``); its value is
    ``(rows(net) or None, live bytes by category once built)``."""
    def experiment(ctx: RunContext):
        net = build_model(spec, device=ctx.device, dtype=dtype)
        ctx.tracker.register(model=net)
        return (rows(net) if rows else None), live_by_category(ctx)
    return experiment


def build_as_dict(m: Measurement) -> dict[str, Any]:
    """Plain JSON-able data of one build (what ``gpulab record`` stores): live bytes by category
    once built, the parameter count, the allocator's counters on CUDA."""
    _, live = m.value
    return {"engine": m.engine, "device": m.device, "label": m.label, "live_by_category": dict(live),
            "peak_bytes": m.peak_bytes, "allocator": dict(m.allocator or {})}


def positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def make_layer(kind: str, in_size: int = 64, out_size: int = 128, kernel: int = 3, groups: int = 1,
               bias: bool = True, device=None, dtype: torch.dtype | None = None) -> nn.Module:
    """Build one layer directly on ``device`` in ``dtype`` (PyTorch's factory kwargs).

    ``in_size`` / ``out_size``: Conv2d channels, Linear features; BatchNorm2d and LayerNorm
    use ``out_size`` as the feature count; Embedding uses ``in_size`` as the vocabulary
    (num_embeddings) and ``out_size`` as the embedding dimension. ``kernel`` and ``groups``
    apply to Conv2d only; ``bias`` to Conv2d, Linear and LayerNorm."""
    key = {k.lower(): k for k in LAYER_KINDS}.get(str(kind).lower())
    if key is None:
        raise ValueError(f"unknown layer {kind!r}; valid layers: {', '.join(LAYER_KINDS)}")
    positive_int("in", in_size)
    positive_int("out", out_size)
    fk = {"device": device, "dtype": dtype}
    if key == "Conv2d":
        positive_int("kernel", kernel)
        positive_int("groups", groups)
        if in_size % groups or out_size % groups:
            raise ValueError(f"groups={groups} must divide both in ({in_size}) and out ({out_size}) "
                             f"channels; e.g. groups=1, or groups=in=out for a depthwise conv")
        return nn.Conv2d(in_size, out_size, kernel, groups=groups, bias=bias, **fk)
    if key == "Linear":
        return nn.Linear(in_size, out_size, bias=bias, **fk)
    if key == "BatchNorm2d":
        return nn.BatchNorm2d(out_size, **fk)
    if key == "LayerNorm":
        return nn.LayerNorm(out_size, bias=bias, **fk)
    return nn.Embedding(in_size, out_size, **fk)


def layer_experiment(dtype: torch.dtype, kind: str, in_size: int, out_size: int, kernel: int, groups: int,
                     bias: bool, rows: Callable[[nn.Module], Any] | None = None):
    """Build one layer on the run's device (an experiment for ``engines.run``); its value is
    ``(rows(layer) or None, live bytes by category once built)``."""
    def experiment(ctx: RunContext):
        layer = make_layer(kind, in_size, out_size, kernel, groups, bias, device=ctx.device, dtype=dtype)
        ctx.tracker.register(model=layer)
        return (rows(layer) if rows else None), live_by_category(ctx)
    return experiment


def layer_repr(kind: str, in_size: int, out_size: int, kernel: int, groups: int, bias: bool) -> str:
    """``repr`` of the layer (built on the meta device): what identifies its settings."""
    return repr(make_layer(kind, in_size, out_size, kernel, groups, bias, device="meta"))


@record_kind("layer build")
def record_layer_build(p: dict[str, Any]) -> dict[str, Any]:
    """Lesson 02's one-layer panel default built on the GPU (the entry names the layer it builds)."""
    shape = (p["kind"], p["in_size"], p["out_size"], p["kernel"], p["groups"], p["bias"])
    if layer_repr(*shape) != p["layer"]:
        raise ValueError(f"the layer entry names {p['layer']!r} but builds {layer_repr(*shape)!r}")
    return {**p, **build_as_dict(run(layer_experiment(parse_dtype(p["dtype"]), *shape), engine="cuda"))}


@record_kind("model build")
def record_model_build(p: dict[str, Any]) -> dict[str, Any]:
    """Lesson 02's parameters panel: a model built on the GPU."""
    m = run(build_experiment(resolve_model(p["model"]), parse_dtype(p["dtype"])), engine="cuda")
    return {**p, **build_as_dict(m)}
