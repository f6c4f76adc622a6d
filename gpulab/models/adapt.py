"""What a recipe changes in the model before it trains: the model's own activation checkpointing
(transformers' ``gradient_checkpointing_enable``), and LoRA adapters (``peft``) on a frozen base.

``adapted(w, lora=R, lora_targets=..., checkpointing=True)`` is the workload ``w`` built that way:
the same inputs and loss, a model that is built, checkpointed and wrapped on the run's device
(under fake tensors through a meta skeleton: ``registry.build_in_place``, since peft moves each
adapter with ``Module.to``, which fake parameters refuse).
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Sequence

import torch
from torch import nn

from gpulab.models import hf_configs
from gpulab.models.lora import check_rank, check_targets, default_targets, wrap_lora
from gpulab.models.quantized import quantize_linears
from gpulab.models.registry import active_fake_mode, build_in_place, build_skeleton, materialize
from gpulab.models.workload import Workload

__all__ = ["CHECKPOINTING_KWARGS", "adapted", "enable_checkpointing", "quantized_build"]

# what transformers 5.x passes to torch.utils.checkpoint when none are given (modeling_utils.py,
# ``_activation_checkpointing_enable``): the non-reentrant implementation
CHECKPOINTING_KWARGS = {"use_reentrant": False}
_PEFT_TASKS = {"causal-lm": "CAUSAL_LM", "seq2seq-lm": "SEQ_2_SEQ_LM"}


def enable_checkpointing(model: nn.Module) -> nn.Module:
    """Turn on ``model``'s own activation checkpointing (each transformer block recomputed in
    backward from its saved input), as ``TrainingArguments(gradient_checkpointing=True)`` does;
    ``ValueError`` for a model that has none. Returns ``model``."""
    for name, key in (("activation_checkpointing_enable", "activation_checkpointing_kwargs"),
                      ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs")):
        enable = getattr(model, name, None)
        if callable(enable):   # transformers 5.x renamed it; the old name warns that it will go
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(**{key: dict(CHECKPOINTING_KWARGS)})
            return model
    raise ValueError(f"checkpointing turns on a transformers model's own gradient checkpointing; "
                     f"{type(model).__name__} has none: wrap its blocks in torch.utils.checkpoint.checkpoint "
                     f"yourself and pass the function that builds it, or leave checkpointing out")


def quantized_build(build: Callable[[], nn.Module], kind: str) -> nn.Module:
    """``build()`` with its linear layers but the head quantized (``models.quantized``). Shapes only
    (a fake mode, or the meta device): built on meta and quantized there, then given storages, so
    the full-precision weights never exist at once (transformers quantizes layer by layer while it
    loads); real tensors (the cpu engine's small models) are built, then quantized, so a cpu run's
    setup briefly holds the full-precision weights too (its training steps are the fake run's)."""
    if active_fake_mode() is None and torch.get_default_device().type != "meta":
        return quantize_linears(build(), kind)
    device = torch.get_default_device()
    return materialize(build_skeleton(lambda: quantize_linears(build(), kind)), device)


def _check_rank_fits(config, rank: int, targets: Sequence[str]) -> None:
    """A rank above a targeted layer's smaller side gives adapters larger than a full-rank update
    of that layer: refused, with the largest rank that makes sense."""
    from gpulab.models.lora import targeted_linears
    try:
        found = targeted_linears(config, targets)
    except ValueError:   # no layer of that name: peft's wrapping says so, with the names there are
        return
    name, i, o = min(found, key=lambda t: min(t[1], t[2]))
    if rank > min(i, o):
        raise ValueError(f"LoRA rank {rank} is more than the smaller side of the adapted layer {name} "
                         f"({i} in, {o} out): its adapters would hold more than the layer's own full-rank update; "
                         f"use a rank of at most {min(i, o)} (ranks of 4 to 64 are usual)")


def adapted(w: Workload, *, lora: int = 0, lora_targets: Sequence[str] | None = None, lora_dropout: float = 0.0,
            checkpointing: bool = False, quantize: str | None = None) -> Workload:
    """``w`` with its model checkpointed (``checkpointing``) and/or wrapped with rank-``lora``
    adapters on ``lora_targets`` (None: the layers peft adapts by default for the config's model
    type) with ``lora_dropout`` on their inputs, its linear layers but the head stored as
    bitsandbytes stores them when ``quantize`` is "nf4" or "int8" (``models.quantized``: with LoRA,
    QLoRA); ``w`` itself when none is asked. ``ValueError`` for a workload that cannot take them."""
    if not lora and not checkpointing and not quantize:
        return w
    if w.make is None:
        raise ValueError(f"{w.name} is a module instance, which gpulab copies as it is: to add "
                         + ("LoRA" if lora else "checkpointing") + ", pass the function that builds it")
    if lora:
        check_rank(lora)
        targets = check_targets(lora_targets) if lora_targets is not None else default_targets(w.config)
        if w.config is not None:
            _check_rank_fits(w.config, lora, targets)
    task = _PEFT_TASKS.get(hf_configs.task_of(w.config)) if w.config is not None else None
    inner = w.make

    def make(dtype):
        model = quantized_build(lambda: inner(dtype), quantize) if quantize else inner(dtype)
        if checkpointing:
            enable_checkpointing(model)
            if getattr(getattr(model, "config", None), "use_cache", False):
                model.config.use_cache = False   # what transformers' forward does itself then, with a log line
        if lora:
            model = wrap_lora(model, lora, targets, task_type=task, dropout=lora_dropout)
        return model

    def build(device, dtype):
        if lora and (active_fake_mode() is not None or (device is not None and torch.device(device).type == "meta")):
            # peft cannot wrap fake parameters (it moves adapters with Module.to, which swaps tensors):
            # straight to a meta skeleton, then storages, without a first attempt that would fail
            return materialize(build_skeleton(lambda: make(dtype), dtype), device or "cpu")
        return build_in_place(lambda: make(dtype), device, dtype)

    parts = (([f"{quantize} base"] if quantize else []) + ([f"LoRA rank {lora} on {', '.join(targets)}"] if lora else [])
             + (["checkpointed"] if checkpointing else []))
    return dataclasses.replace(w, build=build, make=make, description=f"{w.description} ({'; '.join(parts)})")
