"""``gpulab fit --pp N``: the largest micro-batch every pipeline stage fits, answered per stage.

A pipeline's ranks are not alike: the first stage holds the embedding, the last the final norm, the
output head and the loss, and under 1F1B the earlier stages hold more micro-batches in flight
(``training.pipeline``). ``fit_stages`` searches each stage that differs the way ``fit`` searches one
GPU's step (fake runs of that stage's own modules at ``layers / pp`` blocks, laid out from a few
blocks by ``predict.layer_repeat``; the data-parallel strategy applied per rank as ``fit`` applies it),
then reads every stage at the smallest answer, the micro-batch the whole pipeline runs (off the stage
search's own extrapolation where a fake run confirmed it: no new run). Ranks of the
same shape run once: 64 GPUs of ``tp 8 × pp 4 × dp 2`` are at most four stage searches, not 64 runs.
The stages hold the same layers with other ends, so only the first stage's search learns how a layer
repeats (a run of 3 layers); the others take that layout moved onto their own runs of 1 and 2 layers
where it rebuilds them exactly (``layer_repeat.transfer``; ``fake_runs.deep_runs`` hands them it).

The micro-batches in flight: each search's fake runs push one micro-batch through the stage (so
layer repeat lays a deep stage out from a few blocks, as for any step), and ``hold_in_flight`` adds
the schedule's other ``k - 1`` micro-batches to the timeline: a copy of every storage the measured
forward left for its backward (its saved activations, its output, the received input), made when the
forward ends and freed when the backward ends. The stage's peak, the first backward with ``k - 1``
micro-batches held, is then replayed through the simulated allocator; ``gpulab.step(pp=...)`` runs
all ``k`` forwards for real, and the test checks the two peaks agree. The interleaved schedule's
runs are the rank's whole schedule instead (``training.pipeline``: its chunks take turns, so there is
no one forward to copy), each at the rank's full depth.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, NamedTuple

import torch

from gpulab.measure.records import Event, TrackingResult
from gpulab.predict import layer_repeat
from gpulab.predict.progress import Progress, report
from gpulab.training.loop import LoopRecipe, changed_options
from gpulab.training.pipeline import (INTERLEAVED_LABEL, SCHEDULE_LABEL, StageShape, distinct_stages, in_flight,
                                      rank_range, stage_layers)
from gpulab.models.workload import Workload

__all__ = ["DEFAULT_STRATEGY", "StageFit", "StageSearch", "fit_stages", "hold_in_flight"]

# Megatron-LM's default for the data-parallel replicas of a pipeline (use_distributed_optimizer off)
DEFAULT_STRATEGY = "ddp"


class StageSearch(NamedTuple):
    """``fit``'s own parts a stage search uses, handed in by ``fit`` (which imports this module): its
    search, its data-parallel sharding, its replay check and the card's usable bytes."""
    search: Callable
    sharding: Callable
    check: Callable
    usable: Callable


@dataclass(frozen=True)
class StageFit:
    """One stage shape of the answer: which stages and ranks, what they hold, the micro-batches in flight
    (the schedule's count), and their memory at the pipeline's micro-batch (None where not run)."""
    stages: tuple[int, ...]
    ranks: str
    role: str
    holds: str
    in_flight: int
    largest_batch: int | None        # this stage alone (None: not run)
    peak_bytes: int | None           # live tensors at the pipeline's micro-batch
    reserved_bytes: int | None       # simulated allocator's reserved peak there
    peak_by_category: dict[str, int] = field(default_factory=dict)
    binds: bool = False
    note: str = ""


def fit_stages(w: Workload, key: tuple | None, dt: torch.dtype, recipe: LoopRecipe, place, layout: Any,
               progress: Progress, t0: float, fit_parts: StageSearch, master: torch.dtype | None = None):
    """``fit``'s answer (a ``FitResult``) for ``recipe.pp`` stages (module docstring); ``layout``: the
    ``gpulab.Layout`` ``fit`` got (its mesh checked: gpus = dp_replicate × dp_shard × cp × tp × pp, ep
    dividing dp_shard × cp × tp). ``dt``: the dtype the stages compute in; ``master``: the sharded
    parameters' where FSDP2's MixedPrecisionPolicy differs (``param_dtype``): each stage is its own
    ``fully_shard`` with the policy, as torchtitan's ``parallelize`` applies ``apply_fsdp_to_decoder``
    to each model part (``pipeline_llm``), so each stage's storages are resized as one GPU's are."""
    pp, layers = recipe.pp, w.config.num_hidden_layers
    stage_w = layer_repeat.workload_with_depth(w, layers // pp)
    gpus, strategy, offload = layout.gpus, layout.strategy, layout.offload_optimizer
    group = recipe.tp * pp
    assumed = gpus is not None and gpus > group and strategy is None
    spread = None if gpus is None else layout.sharded_over   # with ddp assumed: the dp replicas
    sharding, shard = fit_parts.sharding(stage_w, recipe, dt, spread, DEFAULT_STRATEGY if assumed else strategy,
                                         offload, master=master, layout=layout)
    place = place._replace(sharding=sharding)
    per_stage = gpus // pp if gpus else recipe.tp   # (the Layout checked that tp × pp divides gpus)
    v = recipe.virtual_stages
    shapes = distinct_stages(pp, recipe.microbatches, recipe.schedule, v)
    searched: dict[int, tuple[Any, Any]] = {}
    for n, shape in enumerate(s for s in shapes if s.bounded_by is None):
        report(progress, 0.0, f"pipeline stage {shape.run} ({shape.role}: {stage_layers(shape.run, pp, layers, v)}, "
                              f"{shape.in_flight} in flight)")
        run, holding = _stage_run(recipe, shape, shard)
        searched[shape.run] = fit_parts.search(stage_w, key, dt, run, place, holding,
                                               _within(progress, n, len(shapes)), time.perf_counter())
    batch = min(res.largest_batch for res, _ in searched.values())
    check = functools.partial(fit_parts.check, usable=fit_parts.usable(place), source="run")
    rows = [_row(shape, searched, batch, check, (pp, v), layers, per_stage) for shape in shapes]
    binding = max((r for r in rows if r.largest_batch is not None and r.largest_batch == batch),
                  key=lambda r: r.reserved_bytes or 0)
    rows = [replace(r, binds=r is binding) for r in rows]
    answer, _ = searched[binding.stages[0]]
    answer.ranks = rows
    answer.recipe = {**answer.recipe, **changed_options(recipe)}   # the pipeline's options, not its stage run's
    answer.recipe.pop("pp_stage", None)
    answer.runs = sum(res.runs for res, _ in searched.values())
    answer.seconds = time.perf_counter() - t0
    answer.pipeline = (f"pp {pp} × tp {recipe.tp} × dp {layout.dp if gpus else 1}: {layers} layers, "
                       f"{layers // pp} a stage{f' in {v} chunks' if v > 1 else ''}; {recipe.schedule}, "
                       f"{recipe.microbatches} micro-batches of the "
                       f"batch below a step; the answer is the {binding.role} stage's (it binds)"
                       + (f"; data parallel assumed {DEFAULT_STRATEGY} (Megatron-LM's default: no distributed "
                          f"optimizer; --strategy changes it)" if assumed else "")
                       + (f"; fsdp2 counted resharding after forward (the largest unit gathered at a time), "
                          f"where torchtitan's default under pp keeps each stage's parameters gathered from "
                          f"forward to backward (its get_fsdp_reshard_after_forward_policy: not pp_enabled), "
                          f"which holds more" if strategy == "fsdp2" else "")
                       + every_k_note(recipe.checkpointing, layers, pp * v))
    answer.method = f"each pipeline stage that differs searched as one GPU's step; {answer.method}"
    answer.label = f"{answer.label}; {INTERLEAVED_LABEL if v > 1 else SCHEDULE_LABEL}"
    return answer


def every_k_note(checkpointing: Any, layers: int, chunks: int) -> str:
    """What a stage's every-K checkpointing does against the whole model's, in words ("" where the
    same): each stage (chunk) is its own model of ``layers / chunks`` layers, so transformers'
    ``every_n_layers`` counts K from the stage's first layer, where the whole model's counts from layer 0.
    Where a stage's layers are not a multiple of K, the stages checkpoint ceil(n/K) layers each, at least
    as many as the whole-model policy puts in them: the answer is then optimistic by the difference."""
    if not (isinstance(checkpointing, str) and checkpointing.startswith("every-")):
        return ""
    k, n = int(checkpointing[6:]), layers // chunks
    whole = [sum(1 for i in range(c * n, (c + 1) * n) if i % k == 0) for c in range(chunks)]
    staged = -(-n // k)
    if all(w == staged for w in whole):
        return ""
    return (f"; checkpointing {checkpointing} counted from each stage's first layer ({staged} of its {n} layers "
            f"checkpointed in every stage), where the whole model's every-{k} puts {', '.join(map(str, whole))} in "
            f"the stages in turn: stages with fewer under the whole-model policy are answered optimistically")


def _stage_run(recipe: LoopRecipe, shape: StageShape, shard) -> tuple[LoopRecipe, Callable]:
    """The recipe a stage's search runs and what it makes of each run's timeline: one micro-batch, the
    schedule's others held as copies (``hold_in_flight``); interleaved, the rank's whole schedule run."""
    if recipe.schedule == "interleaved":
        return replace(recipe, pp_stage=shape.run), _holding(1, shard)
    return replace(recipe, pp_stage=shape.run, microbatches=1), _holding(shape.in_flight, shard)


def _holding(count: int, shard):
    """A stage's timeline with ``count`` micro-batches in flight, then one data-parallel rank's."""
    def one_rank(t: TrackingResult) -> TrackingResult:
        held = hold_in_flight(t, count)
        return held if shard is None else shard(held)
    return one_rank


def hold_in_flight(t: TrackingResult, count: int) -> TrackingResult:
    """``t`` (one micro-batch through a stage, each step a forward then a backward) with ``count - 1``
    more micro-batches held (module docstring): after each forward, a copy of every storage it made
    that its backward frees; each copy freed at the backward's end."""
    if count <= 1:
        return t
    events, records = t.events, dict(t.records)
    freed = {e.sid: i for i, e in enumerate(events) if e.kind == "free"}
    out: list[Event] = []
    sid = max(records, default=0) + 1
    i = 0
    while i < len(events):
        if events[i].phase != "forward":
            out.append(events[i])
            i += 1
            continue
        j = i
        while j < len(events) and events[j].phase == "forward":
            j += 1
        k = j
        while k < len(events) and events[k].phase == "backward":
            k += 1
        held = [e for e in events[i:j] if e.kind == "alloc" and j <= freed.get(e.sid, -1) < k]
        out += events[i:j]
        copies = []
        for _ in range(count - 1):
            for e in held:
                records[sid] = replace(t.records[e.sid], sid=sid, created=events[j - 1].index, freed=None)
                copies.append(replace(e, sid=sid, index=events[j - 1].index))
                sid += 1
        out += copies + events[j:k]
        end = events[k - 1]
        out += [replace(c, kind="free", delta=-c.nbytes, phase=end.phase, index=end.index, time=end.time)
                for c in copies]
        i = k
    return TrackingResult.build(records, out, t.device, t.rounded)


def _within(progress: Progress, n: int, of: int) -> Progress:
    """The progress of the n-th of ``of`` stage searches, as a share of the whole."""
    if progress is None:
        return None
    return lambda frac, text: progress((n + frac) / of, text)


def stage_at(runs, batch: int, largest: int) -> tuple[TrackingResult, bool]:
    """A searched stage's timeline at the pipeline's ``batch``, and whether it was read off the search's
    extrapolation (confirmed by a fake run at ``largest``, so no new run) rather than run."""
    if runs.line is not None and 2 <= batch != largest:
        return runs.line.at(batch), True
    return runs(batch), False


def _reserved(runs, t: TrackingResult, read: bool, batch: int, check: Callable) -> int:
    """The simulated reserved peak of ``t``, a searched stage's timeline at ``batch`` (``stage_at``): the
    replay its search made of that same timeline where it made one (of the run at ``batch``; of the
    extrapolation there, whose base batch is the run itself), else a replay now."""
    if read:
        done = runs.checked.get((batch, "extrapolated"))
        if done is None and batch == runs.line.base_batch and runs.checked_on.get(batch) is runs.line.base:
            done = runs.checked.get((batch, "run"))   # the extrapolation at its base: the base run's events
    else:
        done = runs.checked.get((batch, "run")) if runs.checked_on.get(batch) is t else None
    return (done if done is not None else check(t, batch=batch)).reserved_bytes


def _row(shape: StageShape, searched: dict, batch: int, check: Callable, layout: tuple[int, int], layers: int,
         per_stage: int) -> StageFit:
    """One stage shape at the pipeline's micro-batch ``batch``: its own search's run there, or the
    stage that bounds it. ``layout``: (pp, chunks per rank)."""
    pp, v = layout
    ranks = ", ".join(rank_range(s, pp, per_stage) for s in shape.stages)
    holds = stage_layers(shape.run, pp, layers, v) if len(shape.stages) == 1 else \
        f"{layers // pp} layers each"
    if shape.bounded_by is not None:
        return StageFit(shape.stages, ranks, shape.role, holds, shape.in_flight, None, None, None,
                        note=f"not run: the same modules as stage {shape.bounded_by} with fewer micro-batches in "
                             f"flight, so at most its memory")
    res, runs = searched[shape.run]
    if batch == 0:   # nothing fits: each stage's batch-1 answer as its search left it
        return StageFit(shape.stages, ranks, shape.role, holds, shape.in_flight, 0, res.peak_bytes,
                        res.reserved_bytes, dict(res.peak_by_category), note="batch 1 does not fit this stage"
                        if res.largest_batch == 0 else "")
    t, read = stage_at(runs, batch, res.largest_batch)
    return StageFit(shape.stages, ranks, shape.role, holds, shape.in_flight, res.largest_batch, t.peak_bytes,
                    _reserved(runs, t, read, batch, check), dict(t.peak_by_category),
                    note=f"alone it fits micro-batch {res.largest_batch}" + (
                        f"; read off its search's extrapolation from batches 2 and 3 (confirmed by a fake run at "
                        f"{res.largest_batch}, event for event)" if read else "") if res.largest_batch != batch else "")

