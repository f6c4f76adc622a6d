"""Pipeline parallelism measured per stage, in one process: each stage's own modules, its micro-batches
in flight as the schedule holds them.

A pipeline of ``pp`` stages splits a decoder's layers evenly: the first stage holds the embedding and
its layers, the last its layers, the final norm, the output head and the loss, the middle ones only
layers (torchtitan's and Megatron-LM's split). ``pipeline_stage`` cuts a built model down to one
stage's modules (the caller builds it at the stage's depth: ``layers / pp`` blocks); ``StageStep``
runs one micro-batch through them as a stage does: the first from the token ids, the others from
a received activation (a fresh tensor of the hidden state's shape: the receive buffer), and every
stage but the last backward from a received gradient of its output's shape.

The schedule decides how many micro-batches' activations a stage holds at once. ``in_flight``
gives that count from the schedule's definition (labelled so in every answer: it is the schedule's
count, not measured): GPipe runs all ``M`` forwards before any backward, so every stage holds
``M``; 1F1B (PipeDream-Flush, Narayanan et al. 2021; ``torch.distributed.pipelining.Schedule1F1B``,
Megatron-LM's ``forward_backward_pipelining_without_interleaving``) runs ``pp - 1 - i`` warm-up
forwards on stage ``i``, then one forward and one backward at a time, so stage ``i`` holds
``min(pp - i, M)`` at its first backward and never more. ``run_in_flight`` then measures it: that
many forwards of the real stage, each kept with its graph, then their backwards, then the
optimizer step: the stage's peak (weights, gradients, optimizer state, the held activations and one
backward's transient) is the run's, on whichever engine runs it. The remaining micro-batches of
the step repeat the same shapes and are not run.

NB: ``torch.distributed.pipelining``'s stages and schedules are not used: their send and receive
go through the process group (the fake one returns nothing to receive into) and their shape
inference exchanges objects between ranks, and one process plays one rank. The stage's modules
and its order of forwards and backwards are the same; the communication buffers are the receive
buffers above.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from gpulab.options import SCHEDULES   # torch-free: the CLI offers the same names

__all__ = ["SCHEDULES", "StageShape", "StageStep", "check_pipeline", "check_pp_options", "distinct_stages",
           "in_flight", "pipeline_stage", "rank_range", "run_in_flight", "stage_layers", "stage_role"]

SCHEDULE_LABEL = ("micro-batches in flight: the schedule's count (GPipe: all M; 1F1B: min(pp - stage, M)), not "
                  "measured; one micro-batch measured through each stage's own modules, the others held as copies "
                  "of what its forward kept for backward")


def check_pp_options(pp: int, microbatches: int | None = None, schedule: str = "1f1b", stage: int = 0) -> None:
    """ValueError, in one line, for a pipeline degree, micro-batch count, schedule or stage that is not one."""
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        raise ValueError(f"pipeline parallelism must be a whole number of stages >= 1, got {pp!r}")
    if microbatches is not None and (not isinstance(microbatches, int) or isinstance(microbatches, bool)
                                     or not 1 <= microbatches <= 1024):
        raise ValueError(f"microbatches must be a whole number from 1 to 1024, got {microbatches!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage < pp:
        raise ValueError(f"pp_stage must be a stage from 0 to {pp - 1}, got {stage!r}")
    if pp == 1 and (microbatches is not None or schedule != "1f1b" or stage):
        raise ValueError("microbatches, schedule and pp_stage are a pipeline's: give --pp 2 or more")


def check_pipeline(config: Any, pp: int) -> None:
    """ValueError, in one line, when ``config``'s layers cannot be split into ``pp`` equal stages or the
    model is not a decoder whose parts a stage can hold."""
    if pp == 1:
        return
    layers = getattr(config, "num_hidden_layers", None) if config is not None else None
    if not isinstance(layers, int) or getattr(config, "is_encoder_decoder", False):
        raise ValueError("pipeline stages are measured for decoder language models (a transformers config with "
                         "num_hidden_layers: Llama, Mistral, Qwen2 ...)")
    if layers % pp:
        fits = [str(d) for d in range(1, layers + 1) if layers % d == 0]
        shown = ", ".join(fits[:8]) + (" ..." if len(fits) > 8 else "")
        raise ValueError(f"--pp {pp} does not divide num_hidden_layers = {layers}: each stage holds the same "
                         f"number of layers; use a pp that divides {layers} ({shown})")


def stage_role(stage: int, pp: int) -> str:
    """"first" (the embedding), "last" (the norm, head and loss) or "middle"."""
    return "first" if stage == 0 else "last" if stage == pp - 1 else "middle"


def stage_layers(stage: int, pp: int, layers: int) -> str:
    """What a stage holds, in words: "embedding + layers 0-19"."""
    n = layers // pp
    text = f"layer {stage}" if n == 1 else f"layers {stage * n}-{(stage + 1) * n - 1}"
    role = stage_role(stage, pp)
    return f"embedding + {text}" if role == "first" else f"{text} + norm + head + loss" if role == "last" else text


def in_flight(schedule: str, stage: int, pp: int, microbatches: int) -> int:
    """Micro-batches whose activations stage ``stage`` of ``pp`` holds at its peak, by the schedule's
    definition (module docstring): GPipe all ``microbatches``, 1F1B ``min(pp - stage, microbatches)``."""
    check_pp_options(pp, microbatches, schedule, stage)
    return microbatches if schedule == "gpipe" else min(pp - stage, microbatches)


def rank_range(stage: int, pp: int, per_stage: int) -> str:
    """The global ranks of a stage when the tensor- and data-parallel ranks vary fastest (Megatron-LM's
    order: tp, dp, then pp): "ranks 16-31"."""
    lo = stage * per_stage
    return f"rank {lo}" if per_stage == 1 else f"ranks {lo}-{lo + per_stage - 1}"


@dataclass(frozen=True)
class StageShape:
    """Stages alike in memory: the same role and micro-batches in flight. ``run`` is the stage measured;
    ``bounded_by`` (middle stages of 1F1B holding fewer micro-batches than the busiest middle one):
    the stage whose answer bounds theirs (the same modules, fewer activations held), not run."""
    stages: tuple[int, ...]
    role: str
    in_flight: int
    bounded_by: int | None = None

    @property
    def run(self) -> int:
        return self.stages[0]


def distinct_stages(pp: int, microbatches: int, schedule: str) -> list[StageShape]:
    """The stages that differ, each once: the first, the middle ones by micro-batches in flight, the
    last. Middle stages of 1F1B hold fewer the later they are; only the busiest is run."""
    groups: dict[tuple[str, int], list[int]] = {}
    for s in range(pp):
        groups.setdefault((stage_role(s, pp), in_flight(schedule, s, pp, microbatches)), []).append(s)
    shapes = [StageShape(tuple(v), role, k) for (role, k), v in groups.items()]
    middles = [s for s in shapes if s.role == "middle"]
    if len(middles) > 1:
        busiest = max(middles, key=lambda s: s.in_flight)
        shapes = [s if s.role != "middle" or s is busiest else StageShape(s.stages, s.role, s.in_flight, busiest.run)
                  for s in shapes]
    return shapes


def pipeline_stage(model: nn.Module, pp: int, stage: int) -> nn.Module:
    """``model`` (a transformers causal LM built at one stage's depth) cut to stage ``stage``'s modules:
    no embedding past the first stage; before the last, the decoder alone (no head) with its final
    norm an ``nn.Identity`` (the norm belongs to the last stage). A tied head keeps its weight on the
    last stage, as Megatron-LM's last stage keeps a copy of the embedding."""
    if pp == 1:   # no pipeline: the whole model
        return model
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "embed_tokens"):
        raise ValueError(f"{type(model).__name__} is not a decoder with embed_tokens and layers: pipeline stages "
                         f"are measured for Llama-like transformers models")
    if stage > 0:
        base.embed_tokens = None
    if stage == pp - 1:
        return model
    base.norm = nn.Identity()
    return base


class StageStep:
    """One micro-batch through a stage (module docstring): ``forward(data)`` returns what its backward
    needs, ``backward(held)`` runs it."""

    def __init__(self, net: nn.Module, hidden: int, recipe: Any):
        self.net, self.first, self.last = net, recipe.pp_stage == 0, recipe.pp_stage == recipe.pp - 1
        self.hidden, self.sequence_parallel = hidden, recipe.sequence_parallel

    def forward(self, data) -> tuple:
        _, kwargs = data
        ids = kwargs["input_ids"]
        if self.first:
            out = self.net(input_ids=ids, use_cache=False)
            return (out.last_hidden_state, None)
        x, local = self._received(ids)
        if self.last:
            return (self.net(inputs_embeds=x, labels=kwargs["labels"], use_cache=False).loss, local)
        return (self.net(inputs_embeds=x, use_cache=False).last_hidden_state, local)

    def backward(self, held: tuple) -> None:
        out, _ = held
        if self.last:
            out.backward()
        else:   # the gradient the next stage sends back, in a receive buffer of the output's shape
            out.backward(torch.zeros_like(out))

    def _received(self, ids: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """The activation the previous stage sends (a receive buffer, a leaf whose gradient is sent
        back): with sequence parallelism its sequence shard, as a DTensor of the whole sequence."""
        dtype = next(p for p in self.net.parameters()).dtype
        b, s = ids.shape
        mesh = _mesh_of(self.net) if self.sequence_parallel else None
        rows = s // mesh.size() if mesh is not None else s
        local = torch.empty(b, rows, self.hidden, dtype=dtype, device=ids.device, requires_grad=True)
        if mesh is None:
            return local, local
        from torch.distributed.tensor import DTensor, Shard
        return DTensor.from_local(local, mesh, [Shard(1)], run_check=False), local


def _autocast(device: torch.device, amp: torch.dtype | None):
    return contextlib.nullcontext() if amp is None else torch.autocast(device.type, dtype=amp)


def _mesh_of(net: nn.Module):
    from torch.distributed.tensor import DTensor
    return next(p.device_mesh for p in net.parameters() if isinstance(p, DTensor))


def run_in_flight(ctx, stage: StageStep | Callable, data, recipe: Any) -> None:
    """A pipeline stage's step (nothing without one: ``recipe.pp`` 1): its micro-batches in flight
    (``in_flight``) forward, each kept with its graph, then each backward in the order they went forward
    (the schedule's peak); the received tensors go with their backward."""
    if recipe.pp == 1:
        return
    held = []
    for _ in range(in_flight(recipe.schedule, recipe.pp_stage, recipe.pp, recipe.microbatches)):
        with ctx.phase("forward"), _autocast(ctx.device, recipe.amp):
            held.append(stage.forward(data))
    while held:
        with ctx.phase("backward"):
            stage.backward(held.pop(0))
