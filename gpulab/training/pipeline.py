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

Interleaved 1F1B (Narayanan et al. 2021 §2.2; ``torch.distributed.pipelining.ScheduleInterleaved1F1B``,
Megatron-LM's ``forward_backward_pipelining_with_interleaving`` with a virtual pipeline size ``V``):
each rank holds ``V`` chunks of ``layers / (pp·V)`` layers, chunk ``c`` of rank ``r`` being virtual
stage ``c·pp + r`` of ``pp·V`` (the embedding on virtual stage 0, the norm, head and loss on the
last). ``interleaved_actions`` is the rank's order of forwards and backwards as torch's schedule
computes it (its own ``_calculate_single_rank_operations``: ``(V - 1)·rounds + 2·(pp - 1 - r)``
warm-up forwards, then one forward and one backward at a time), and ``run_in_flight`` runs that
whole order for real, chunk by chunk: the rank's peak is measured, not scaled. Its most chunk
micro-batches in flight (``in_flight``) on rank 0, divided by ``V``, is Megatron-LM's
``interleaved_schedule_memory_penalty`` times ``pp``: ``pp·(1 + (pp - 1)/(pp·V))`` stages' worth.

NB: ``torch.distributed.pipelining``'s stages and schedules are not used: their send and receive
go through the process group (the fake one returns nothing to receive into) and their shape
inference exchanges objects between ranks, and one process plays one rank. The stage's modules
and its order of forwards and backwards are the same; the communication buffers are the receive
buffers above.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from gpulab.models.hf_configs import MOE_EVERY_K, per_layer_lists
from gpulab.options import SCHEDULES, check_pp_options   # torch-free: the CLI checks them before torch loads

__all__ = ["SCHEDULES", "InterleavedStep", "StageShape", "StageStep", "check_pipeline", "check_pp_options",
           "distinct_stages", "in_flight", "interleaved_actions", "pipeline_stage", "rank_range", "run_in_flight",
           "stage_layers", "stage_role", "stage_step"]

SCHEDULE_LABEL = ("micro-batches in flight: the schedule's count (GPipe: all M; 1F1B: min(pp - stage, M)), not "
                  "measured; one micro-batch measured through each stage's own modules, the others held as copies "
                  "of what its forward kept for backward")
INTERLEAVED_LABEL = ("interleaved 1F1B: each rank's V chunks run in the order torch.distributed.pipelining's "
                     "ScheduleInterleaved1F1B gives that rank (every forward and backward of the step, measured); "
                     "in flight: chunk micro-batches, each 1/V of a stage's layers")


def check_pipeline(config: Any, pp: int, virtual: int = 1) -> None:
    """ValueError, in one line, when ``config``'s layers cannot be split into ``pp`` equal stages (``pp``
    ranks of ``virtual`` equal chunks each) or the model is not a decoder whose parts a stage can hold."""
    if pp == 1:
        return
    layers = getattr(config, "num_hidden_layers", None) if config is not None else None
    if not isinstance(layers, int) or getattr(config, "is_encoder_decoder", False):
        raise ValueError("pipeline stages are measured for decoder language models (a transformers config with "
                         "num_hidden_layers: Llama, Mistral, Qwen2 ...)")
    if layers < pp:
        raise ValueError(f"--pp {pp} splits the layers into {pp} stages of at least one layer each; this config has "
                         f"num_hidden_layers = {layers}: give a pp from 2 to {layers}" if layers >= 2 else
                         f"--pp {pp} splits the layers into {pp} stages; this config has num_hidden_layers = {layers}, "
                         f"too few to split: leave --pp out")
    fits = [str(d) for d in range(1, layers + 1) if layers % d == 0]
    shown = ", ".join(fits[:8]) + (" ..." if len(fits) > 8 else "")
    if layers % pp:
        raise ValueError(f"--pp {pp} does not divide num_hidden_layers = {layers}: each stage holds the same "
                         f"number of layers; use a pp that divides {layers} ({shown})")
    if layers % (pp * virtual):
        raise ValueError(f"pp × virtual_stages = {pp} × {virtual} = {pp * virtual} does not divide num_hidden_layers "
                         f"= {layers}: every chunk holds the same number of layers; use pp × virtual_stages dividing "
                         f"{layers} ({shown})")
    _check_alike_chunks(config, layers, pp * virtual)


def layer_kinds(config: Any) -> tuple[list[tuple], list[str]]:
    """Each layer's kind as the config lays it out (its entries in the per-layer lists such as
    ``layer_types``; dense or not where the first layers are dense; its place in a every-K mixture of
    experts), and the fields that make layers differ, in words."""
    depth = config.num_hidden_layers
    lists = per_layer_lists(config, depth)
    dense = getattr(config, "first_k_dense_replace", None)
    dense = dense if isinstance(dense, int) and dense > 0 else 0
    only = set(getattr(config, "mlp_only_layers", None) or ())
    steps = {n: getattr(config, n) for n in MOE_EVERY_K if isinstance(getattr(config, n, None), int) and getattr(config, n) > 1}
    why = (list(lists) + ([f"first_k_dense_replace {dense}"] if dense else []) + (["mlp_only_layers"] if only else [])
           + [f"{n} {k}" for n, k in steps.items()])
    kinds = [tuple(repr(v[i]) for v in lists.values()) + (i < dense or i in only,) + tuple(i % k for k in steps.values())
             for i in range(depth)]
    return kinds, why


def _check_alike_chunks(config: Any, layers: int, chunks: int) -> None:
    """ValueError when a stage's (or an interleaved chunk's) layers are not the first's: each stage is
    measured from a model built with the first ``layers / chunks`` layers (``with_depth``)."""
    kinds, why = layer_kinds(config)
    size = layers // chunks
    odd = next((j for j in range(1, chunks) if kinds[j * size:(j + 1) * size] != kinds[:size]), None)
    if odd is None:
        return
    good = [d for d in range(2, layers + 1) if layers % d == 0
            and all(kinds[j * (layers // d):(j + 1) * (layers // d)] == kinds[:layers // d] for j in range(1, d))]
    hint = (f"use a pp (× virtual stages) of {', '.join(map(str, good[:8]))}" if good
            else "no even split gives every stage the same layers: measure it without --pp")
    raise ValueError(f"pipeline stages: its layers are not all alike ({'; '.join(why)}): split into {chunks} chunks of {size} layers, "
                     f"chunk {odd} holds other layers than the first, and each stage is measured as one built from the "
                     f"first {size}; {hint}")


def stage_role(stage: int, pp: int) -> str:
    """"first" (the embedding), "last" (the norm, head and loss) or "middle"."""
    return "first" if stage == 0 else "last" if stage == pp - 1 else "middle"


def stage_layers(stage: int, pp: int, layers: int, virtual: int = 1) -> str:
    """What a stage holds, in words: "embedding + layers 0-19"; a rank of ``virtual`` chunks lists each
    chunk's: "embedding + layers 0-4, 20-24"."""
    n = layers // (pp * virtual)
    spans = [(c * pp + stage) * n for c in range(virtual)]
    text = ("layer " if n == 1 and virtual == 1 else "layers ") + ", ".join(
        str(lo) if n == 1 else f"{lo}-{lo + n - 1}" for lo in spans)
    role = stage_role(stage, pp)
    return f"embedding + {text}" if role == "first" else f"{text} + norm + head + loss" if role == "last" else text


def in_flight(schedule: str, stage: int, pp: int, microbatches: int, virtual: int = 1) -> int:
    """Micro-batches whose activations stage ``stage`` of ``pp`` holds at its peak, by the schedule's
    definition (module docstring): GPipe all ``microbatches``, 1F1B ``min(pp - stage, microbatches)``;
    interleaved: chunk micro-batches, the most its action list (``interleaved_actions``) holds at once."""
    check_pp_options(pp, microbatches, schedule, stage, virtual)
    if schedule == "interleaved":
        held = most = 0
        for kind, _, _ in interleaved_actions(pp, virtual, microbatches, stage):
            held += 1 if kind == "F" else -1
            most = max(most, held)
        return most
    return microbatches if schedule == "gpipe" else min(pp - stage, microbatches)


def interleaved_actions(pp: int, virtual: int, microbatches: int, rank: int) -> list[tuple[str, int, int]]:
    """Rank ``rank``'s forwards and backwards under interleaved 1F1B, in order, as ("F" or "B", virtual
    stage, micro-batch): computed by torch's own ``ScheduleInterleaved1F1B._calculate_single_rank_operations``
    (torch/distributed/pipelining/schedules.py) on the attributes its constructor sets from the stages
    (pp_group_size, n_local_stages, number_of_rounds, microbatches_per_round), its idle steps dropped."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType
    check_pp_options(pp, microbatches, "interleaved", rank, virtual)
    rounds = max(1, microbatches // pp)
    state = SimpleNamespace(pp_group_size=pp, n_local_stages=virtual, number_of_rounds=rounds,
                            microbatches_per_round=microbatches // rounds, _n_microbatches=microbatches)
    ops = ScheduleInterleaved1F1B._calculate_single_rank_operations(state, rank)
    kinds = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B"}
    return [(kinds[a.computation_type], a.stage_index, a.microbatch_index) for a in ops if a is not None]


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


def distinct_stages(pp: int, microbatches: int, schedule: str, virtual: int = 1) -> list[StageShape]:
    """The stages that differ, each once: the first, the middle ones by micro-batches in flight, the
    last. Middle stages of 1F1B (and interleaved) hold fewer the later they are; only the busiest is run."""
    groups: dict[tuple[str, int], list[int]] = {}
    for s in range(pp):
        groups.setdefault((stage_role(s, pp), in_flight(schedule, s, pp, microbatches, virtual)), []).append(s)
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
    last stage, as Megatron-LM's last stage keeps a copy of the embedding. Under the interleaved
    schedule the same cut gives a rank's modules (its chunks are ``InterleavedStep``'s views of them)."""
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


def stage_step(net: nn.Module, hidden: int, recipe: Any) -> "StageStep | InterleavedStep":
    """What runs a stage's micro-batches: its ``StageStep``, or under the interleaved schedule the
    rank's ``InterleavedStep`` (one ``StageStep`` per chunk)."""
    return InterleavedStep(net, hidden, recipe) if recipe.schedule == "interleaved" else StageStep(net, hidden, recipe)


class StageStep:
    """One micro-batch through a stage (module docstring): ``forward(data)`` returns what its backward
    needs, ``backward(held)`` runs it. ``place``: (virtual stage, virtual stages) for one chunk of an
    interleaved rank; the recipe's (pp_stage, pp) otherwise."""

    def __init__(self, net: nn.Module, hidden: int, recipe: Any, place: tuple[int, int] | None = None):
        stage, stages = place or (recipe.pp_stage, recipe.pp)
        self.net, self.first, self.last = net, stage == 0, stage == stages - 1
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


class InterleavedStep:
    """An interleaved rank's chunks (module docstring): ``chunks[v]`` runs virtual stage ``v``'s layers
    as a ``StageStep``. Each chunk is a shallow copy of the rank's decoder (``net``, cut by
    ``pipeline_stage``) holding its own slice of the layers, sharing the rank's parameters: the
    embedding on virtual stage 0 only, the final norm, head and loss on the last only."""

    def __init__(self, net: nn.Module, hidden: int, recipe: Any):
        self.net, pp, v_count = net, recipe.pp, recipe.virtual_stages
        top = net if hasattr(net, "model") else None
        base = net.model if top is not None else net
        n = len(base.layers) // v_count
        self.chunks: dict[int, StageStep] = {}
        for c in range(v_count):
            v = c * pp + recipe.pp_stage
            part = _shallow(base)
            part.layers = nn.ModuleList(list(base.layers)[c * n:(c + 1) * n])
            if v != 0:
                part.embed_tokens = None
            if v != pp * v_count - 1:
                part.norm = nn.Identity()
            else:   # the last virtual stage: the causal LM's head and loss around its layers
                head = _shallow(top)
                head.model = part
                part = head
            self.chunks[v] = StageStep(part, hidden, recipe, (v, pp * v_count))


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of ``module`` sharing its parameters and submodules, whose submodules can be replaced."""
    out = copy.copy(module)
    out._modules = dict(module._modules)
    return out


def _autocast(device: torch.device, amp: torch.dtype | None):
    return contextlib.nullcontext() if amp is None else torch.autocast(device.type, dtype=amp)


def _mesh_of(net: nn.Module):
    from torch.distributed.tensor import DTensor
    return next(p.device_mesh for p in net.parameters() if isinstance(p, DTensor))


def run_in_flight(ctx, stage: StageStep | InterleavedStep | Callable, data, recipe: Any) -> None:
    """A pipeline stage's step (nothing without one: ``recipe.pp`` 1): its micro-batches in flight
    (``in_flight``) forward, each kept with its graph, then each backward in the order they went forward
    (the schedule's peak); the received tensors go with their backward. Interleaved: the rank's whole
    action list (``interleaved_actions``), chunk by chunk."""
    if recipe.pp == 1:
        return
    if recipe.schedule == "interleaved":
        _run_interleaved(ctx, stage, data, recipe)
        return
    held = []
    for _ in range(in_flight(recipe.schedule, recipe.pp_stage, recipe.pp, recipe.microbatches)):
        with ctx.phase("forward"), _autocast(ctx.device, recipe.amp):
            held.append(stage.forward(data))
    while held:
        with ctx.phase("backward"):
            stage.backward(held.pop(0))


def _run_interleaved(ctx, rank: InterleavedStep, data, recipe: Any) -> None:
    """Every forward and backward of an interleaved rank's step, in its schedule's order."""
    held: dict[tuple[int, int], tuple] = {}
    for kind, v, mb in interleaved_actions(recipe.pp, recipe.virtual_stages, recipe.microbatches, recipe.pp_stage):
        if kind == "F":
            with ctx.phase("forward"), _autocast(ctx.device, recipe.amp):
                held[v, mb] = rank.chunks[v].forward(data)
        else:
            with ctx.phase("backward"):
                rank.chunks[v].backward(held.pop((v, mb)))
