"""``gpulab fit``: the largest batch whose steady-state training step fits a GPU card.

Answered on the fake engine (CUDA's kernels, fake tensors: no compute, no memory) and the
caching-allocator simulator, so an 8 B model takes seconds on a laptop:

1. Two-step runs at batch 2 and batch 3. Their timelines are the same operations in the same
   order; every storage's size is ``a + b·c`` in the batch ``b``, so the two runs give each
   event's bytes at *any* batch without running it (checked: the events must pair up one to
   one, else the search falls back to runs). Batch 1 runs only when batch 2 does not fit.
2. The timeline at batch ``b``, so made, is replayed through the simulated caching allocator
   with the card's capacity less an assumed CUDA context: the largest ``b`` whose replay does
   not run out is found by galloping and bisection over these replays.
3. A third fake run at that batch confirms it: its bytes must equal the extrapolated ones,
   event for event (otherwise the answer comes from galloping and bisection over fake runs).

The allocator's verdict is not always monotone in the batch: a larger batch can pack into
segments better than a smaller one. The answer is the first boundary met counting up from
batch 3 (that batch fits, the next does not); ``largest_batch_live`` is the bound from the
live tensors alone, which is monotone.

When batch 1 does not fit, the answer says by how much, and what each lever would give, as
formulas from the measured categories at batch 1 (labelled so): bf16, 8-bit optimizer state,
activation checkpointing, LoRA, and sharding over N GPUs (ZeRO-3 / FSDP).

``fit(..., progress=callback)`` is told what runs (``predict.progress``: the CLI writes it on
stderr). A fake run this process already made for the same question (workload, recipe, dtype,
batch, card) is reused, not run again (``predict.run_cache``).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from dataclasses import replace as _dc_replace
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch

from gpulab.allocator.simulator import CachingAllocator
from gpulab.measure.cuda_card import current_target
from gpulab.predict.cards import Card, CardBudget, card_with_room, follows_card
from gpulab.predict.context import context_assumption, context_label
from gpulab.predict.levers import LABEL_LEVER, Lever, levers_at_batch_one
from gpulab.measure.engines import LABEL_SIMULATED
from gpulab.options import Layout, Recipe, settings_from
from gpulab.training.loop import AMP_DTYPES, LoopRecipe, changed_options, check_recipe_for, loop_recipe
from gpulab.predict import run_cache
from gpulab.predict.fake_runs import deep_runs as _deep, depth_text as _depth_text, not_laid_out
from gpulab.predict.fake_runs import target_of as _target, tracked as _tracked, tracked_at_depth
from gpulab.predict.progress import Progress, report
from gpulab.predict.search import largest_fitting
from gpulab.training.context_parallel import layout_notes
from gpulab.training.tensor_parallel import tp_notes
from gpulab.training.routing import is_moe, stated_routing
from gpulab.measure.tracking import TrackingResult
from gpulab.units import dtype_name, format_bytes, model_dtype, parse_dtype
from gpulab.models.workload import Workload, resolve_workload


__all__ = [
    "BatchCheck", "FitResult", "LABEL_FIT", "LABEL_LEVER", "Lever", "MAX_BATCH",
    "MAX_FALLBACK_RUNS", "Progress", "WORKSPACE_LABEL", "fit", "not_laid_out", "tracked_at_depth"
]

LABEL_FIT = "fake tensors, CUDA kernels' allocations (no compute) + simulated allocator + assumed CUDA context"
WORKSPACE_LABEL = ("formula: cuBLAS's workspace for the card's compute capability (CublasHandlePool.cpp, "
                   "getChosenWorkspaceSize; CUBLAS_WORKSPACE_CONFIG honoured) for the forward's thread and "
                   "autograd's, and cuBLASLt's, kept as torch 2.11-2.14 keep them (from 2.15 only with "
                   "TORCH_CUBLAS_WORKSPACE_CACHE=1, isCUDABlasWorkspaceCachingEnabled; else an upper bound); "
                   "cuDNN workspaces: not predicted")
MAX_BATCH = 1 << 20
MAX_FALLBACK_RUNS = 12


@dataclass(frozen=True)
class BatchCheck:
    """One batch examined: live-tensor peak, simulated reserved peak, whether it fits, and
    whether it came from a fake run ("run") or from the batch-1/batch-2 extrapolation."""
    batch: int
    peak_bytes: int
    reserved_bytes: int
    fits: bool
    source: str


@dataclass
class FitResult(CardBudget):
    model: str
    card: str
    capacity_bytes: int
    context_bytes: int
    optimizer: str
    dtype: str
    amp: str | None
    input_text: str
    largest_batch: int
    peak_bytes: int                   # live tensors at the answer (batch 1 when nothing fits)
    peak_by_category: dict[str, int]
    reserved_bytes: int               # simulated allocator's reserved peak at that batch
    checks: list[BatchCheck]
    runs: int
    largest_batch_live: int | None    # live tensors alone (no allocator): an upper bound, monotone in the batch
    seconds: float
    engine: str = "fake"
    label: str = LABEL_FIT
    levers: list[Lever] = field(default_factory=list)
    method: str = ""
    recipe: dict[str, Any] = field(default_factory=dict)   # options set away from the plain loop
    module_loading: str = "lazy"      # CUDA's module loading the context size assumes
    sharding: str = ""                # several GPUs: "8 GPUs, fsdp2 (...)"; the figures are one rank's
    sharding_label: str = ""
    capacity_note: str = ""           # where capacity_bytes comes from (Card.total_text)
    # the cuBLAS (and cuBLASLt) workspaces the step's matmuls keep allocated on this card
    # (Card.workspace_bytes: two cuBLAS workspaces, the forward's thread and autograd's, and cuBLASLt's)
    workspace_bytes: int = 0
    kernels: str = ""                 # the card whose CUDA kernels the fake runs followed, the attention kernels chosen
    layers: str = ""                  # how the depth was run: laid out from a few layers (predict.layer_repeat), or why not
    mesh: str = ""                    # a layout's mesh (Layout.mesh): dp_replicate × dp_shard × cp × tp × pp, ep
    pipeline: str = ""                # pipeline parallelism: the layout, schedule and micro-batches (predict.pipeline_fit)
    ranks: list = field(default_factory=list)   # with pipeline stages: one pipeline_fit.StageFit per stage shape
    answered_recipe: Recipe | None = None   # the Recipe and Layout this answer is for (gpulab.options)
    answered_layout: Layout | None = None
    time: Any = None                  # the step's predicted time at the answer (predict.plan_time.PlanTime)
    time_note: str = ""               # why there is none

    @property
    def allocator_overhead_bytes(self) -> int:
        """Reserved beyond the live tensors (rounding, caching, fragmentation): simulated."""
        return self.reserved_bytes - self.peak_bytes

    @property
    def at_search_limit(self) -> bool:
        """The search stopped at its limit (``MAX_BATCH``) with that batch still fitting: the answer is
        a lower bound, not the largest batch."""
        return self.largest_batch >= MAX_BATCH

    @property
    def largest_batch_text(self) -> str:
        """The answer in words: "1048576 (...)" is never shown as the largest batch when it is the limit."""
        return f"at least {self.largest_batch} (the search's limit)" if self.at_search_limit else str(self.largest_batch)

    def as_dict(self) -> dict[str, Any]:
        t, self.time = self.time, None   # a view of its own, not asdict's copy
        try:
            d = asdict(self)
        finally:
            self.time = t
        d["time"] = None if t is None else t.as_dict()
        if not d["recipe"]:
            del d["recipe"]
        d.update(largest_batch_at_limit=self.at_search_limit, largest_batch_text=self.largest_batch_text)
        d.update(allocator_overhead_bytes=self.allocator_overhead_bytes, needed_bytes=self.needed_bytes,
                 margin_bytes=self.margin_bytes, allocator_label=LABEL_SIMULATED,
                 context_label=context_label(self.context_bytes, self.module_loading),
                 context_warning=context_assumption(self.module_loading).warning, workspace_label=WORKSPACE_LABEL)
        return d

    def __repr__(self) -> str:
        return (f"FitResult({self.model} on {self.card}: largest batch {self.largest_batch_text}, "
                f"needs {format_bytes(self.needed_bytes)} of {format_bytes(self.capacity_bytes)})")

    def _repr_html_(self) -> str:
        from gpulab.views import fit_html
        return fit_html(self)


@follows_card   # the fake runs follow the card's kernels (compute capability: attention kernel)
def fit(model: Any, gpu: str | Card | int, *, recipe: Recipe | None = None, layout: Layout | None = None,
        optimizer: str = "adam", dtype: str | torch.dtype | None = None,
        amp: str | None = None, seq_len: int | None = None, image_size: int | None = None, inputs: Any = None,
        input_shape: tuple[int, ...] | None = None, loss: Callable | None = None,
        context_bytes: int | None = None, progress: Progress = None, accumulate: int = 1,
        clip_grad_norm: float | None = None, grad_scaler: bool = False, set_to_none: bool = True,
        optimizer_in_backward: bool = False, offload_activations: bool = False, chunked_loss: int = 0,
        use_cache: bool | None = None, compile: bool = False, implementation: str = "default",
        checkpointing: bool | str = False, lora: int = 0, lora_targets: Sequence[str] | None = None,
        lora_dropout: float = 0.0, quantize: str | None = None, lora_dtype: str = "fp32", double_quant: bool = True,
        quant_compute_dtype: str = "input", routing: Any = None, tp: int = 1, sequence_parallel: bool = False, loss_parallel: bool = False,
        pp: int = 1, microbatches: int | None = None, schedule: str = "1f1b", virtual_stages: int = 1,
        fp8: str | None = None, cp: int = 1, ep: int = 1, module_loading: str = "lazy",
        gpus: int | None = None, strategy: str | None = None, offload_optimizer: bool = False,
        param_dtype: str | None = None, reduce_dtype: str | None = None, fp8_all_gather: bool = False,
        predict_time: bool = True) -> FitResult:
    """The largest batch of ``model`` whose two-step training run fits ``gpu`` (a card name,
    a size such as "24GiB", a ``Card`` or a number of bytes). See the module docstring.

    ``recipe`` (``gpulab.Recipe``: optimizer, dtype, autocast, checkpointing, LoRA ...) and ``layout``
    (``gpulab.Layout``: GPUs, strategy, tp, cp, ep, pp ...) say what is trained and how it is spread;
    the flat keyword arguments of the same names build them when they are not given (a keyword that
    contradicts an object passed is refused). ``context_bytes``: the CUDA context, by default the
    assumption for ``module_loading`` (``predict.context``). A layout over ``gpus`` with a ``strategy``
    (``predict.sharding.STRATEGIES``): the answer is one rank's, its batch the per-GPU batch, with
    ``offload_optimizer`` keeping the optimizer state on the host. ``pp`` pipeline stages
    (``microbatches``, ``schedule``: ``training.pipeline``): the batch is the micro-batch, the answer
    the stage that binds, every stage that differs in ``ranks`` (``predict.pipeline_fit``). ``cp``,
    ``ep``: rank 0 of a context- / expert-parallel group (``training.context_parallel``). With fsdp2,
    ``param_dtype`` / ``reduce_dtype`` (FSDP2's ``MixedPrecisionPolicy``) run the step in ``param_dtype``
    over sharded master weights in ``dtype``, and ``fp8_all_gather`` gathers float8 weights
    (``predict.sharding``). The result carries the ``Recipe`` and ``Layout`` it answered
    (``answered_recipe``, ``answered_layout``). ``predict_time``: the step's predicted time at the answer,
    ``result.time`` (``predict.plan_time``), where the card has speed figures (else ``result.time_note``
    says why not)."""
    t0, place = time.perf_counter(), _place(gpu, context_bytes, module_loading, predict_time)
    recipe, layout = settings_from(recipe, layout, locals())   # each checked once, then passed whole
    if layout.pp_stage:
        raise ValueError("pp_stage picks the stage gpulab.step measures; gpulab.fit answers every stage: leave it out")
    dt = model_dtype(recipe.dtype)
    loop = loop_recipe(recipe, layout)
    w = resolve_workload(model, inputs, input_shape=input_shape, seq_len=seq_len, image_size=image_size, loss=loss)
    check_recipe_for(loop, w, dt)
    key = run_cache.workload_key(model, w, own_parts=inputs is not None or input_shape is not None or loss is not None)
    # FSDP2's MixedPrecisionPolicy: the step computes in param_dtype, the sharded master weights stay in dt
    run_dt = parse_dtype(loop.param_dtype) if loop.param_dtype else dt
    if loop.pp > 1:   # one search per pipeline stage that differs (predict.pipeline_fit)
        from gpulab.predict.pipeline_fit import StageSearch, fit_stages
        result = fit_stages(w, key, run_dt, loop, place, layout, progress, t0,
                            StageSearch(_search, _sharding, _check, usable_bytes), master=dt)
    else:
        spread = None if layout.gpus is None else layout.sharded_over   # dp_shard × cp under fsdp2/zero*
        sharding, shard = _sharding(w, loop, run_dt, spread, layout.strategy, layout.offload_optimizer, master=dt,
                                    layout=layout)
        result = _search(w, key, run_dt, loop, place._replace(sharding=sharding), shard, progress, t0)[0]
    result.answered_recipe, result.answered_layout = recipe, layout
    if predict_time:   # from the runs the search made at the answer's batch, timed (predict.run_ops)
        from gpulab.predict.plan_time import Runs, time_of_fit
        time_of_fit(result, w, run_dt, loop, layout, place.card, progress, Runs(key, _target(place.card)))
    return _layout_stated(result, w, loop, run_dt, layout)


def _layout_stated(result: FitResult, w: Workload, recipe: LoopRecipe, dt: torch.dtype, layout: Layout) -> FitResult:
    """A layout's answer states its mesh (torchtitan's ``ParallelDims`` names, ``Layout.mesh``); a
    context- or expert-parallel one its layout and buffers at the batch it found."""
    if layout.parallel:
        result.mesh = layout.mesh
        result.label = f"{result.label}; {layout.mesh}"
    itemsize = torch.empty((), dtype=recipe.amp or dt).element_size()
    for name, note in {**tp_notes(recipe), **layout_notes(w, recipe, max(1, result.largest_batch), itemsize)}.items():
        result.label = f"{result.label}; {note['text']}"
        result.recipe = {**result.recipe, name: note}
    return result


def _search(w: Workload, key: tuple | None, dt: torch.dtype, recipe: LoopRecipe, place: "_Place", shard,
            progress: Progress, t0: float) -> tuple[FitResult, "_FakeRuns"]:
    """``fit``'s search for one workload and recipe (module docstring): the answer, and the fake runs
    it made (a pipeline's other stages are read at the answer's batch from theirs)."""
    usable = usable_bytes(place)
    fake_run = _FakeRuns(w, key, dt, recipe, _target(place.card), shard, progress, place.timed)
    runs, count = fake_run.runs, fake_run.count

    def done(result: FitResult) -> tuple[FitResult, _FakeRuns]:
        result.layers = fake_run.layers()
        if w.config is not None and is_moe(w.config):   # the routing every MoE answer took (or grouped_mm's none)
            routing = stated_routing(recipe.routing, w.config, recipe.ep)
            result.label = f"{result.label}; {routing.label}"
            result.recipe = {**result.recipe, "routing": routing.text}
        return result, fake_run

    replayed = fake_run.checked   # each candidate replayed once

    def run_check(b: int) -> BatchCheck:
        if (b, "run") not in replayed:
            t = fake_run(b)
            replayed[b, "run"], fake_run.checked_on[b] = _check(t, usable, b, "run"), t
        return replayed[b, "run"]

    two, checks = fake_run(2), [run_check(2)]
    if not checks[0].fits:
        one = fake_run(1)
        checks.append(run_check(1))
        if checks[-1].fits:
            return done(_result(w, place, recipe, dt, 1, one, checks, count(), t0, [],
                           "fake runs at batches 2 (does not fit) and 1 (fits)"))
        levers = levers_at_batch_one(w, one, recipe.optimizer, dt, usable, sharded=place.sharding is not None)
        return done(_result(w, place, recipe, dt, 0, one, checks, count(), t0, levers,
                            "batch 1 does not fit (fake run): levers below, as formulas"))
    three = fake_run(3)
    checks.append(run_check(3))
    if not checks[-1].fits:
        return done(_result(w, place, recipe, dt, 2, two, checks, count(), t0, [],
                       "fake runs at batches 2 (fits) and 3 (does not fit)"))
    two, line = _line(runs, fake_run, two, three)
    if line is not None:
        def line_check(b: int) -> BatchCheck:
            if (b, "extrapolated") not in replayed:
                ran = fake_run.checked_on.get(b)   # at batches 2 and 3 the line's events are the runs' own
                replayed[b, "extrapolated"] = (_dc_replace(replayed[b, "run"], source="extrapolated")
                                               if ran is not None and line.same_events(ran, b) else line.check(b, usable))
            return replayed[b, "extrapolated"]

        def line_fits(b: int) -> bool:   # live tensors past the card: no replay can make it fit (``_check``)
            return line.peak_at(b) <= usable and line_check(b).fits
        report(progress, 0.8, "searching: batches 2 and 3 extrapolated, replayed through the simulated allocator")
        best = largest_fitting(3, line_fits, limit=MAX_BATCH)
        live = largest_fitting(best, lambda b: line.peak_at(b) <= usable, limit=MAX_BATCH)
        checks += [line_check(b) for b in (best, best + 1)]
        real = fake_run(best)
        if [e.nbytes for e in real.events] == line.nbytes_at(best):
            fake_run.line = line   # confirmed: a pipeline's other batches are read off it (predict.pipeline_fit)
            if (best, "run") not in replayed and line.same_events(real, best):   # the replay it had, event for event
                replayed[best, "run"] = _dc_replace(replayed[best, "extrapolated"], source="run")
                fake_run.checked_on[best] = real
            checks.append(run_check(best))
            return done(_result(w, place, recipe, dt, best, real, checks, count(), t0, [],
                           f"extrapolated from fake runs at batches 2 and 3 (every storage a + b·c), replayed "
                           f"through the simulated allocator; confirmed by a fake run at batch {best} (the same "
                           f"bytes, event for event)", live))
    best = _bisect(runs, run_check, checks)   # fall back: bracketed bisection over fake runs
    return done(_result(w, place, recipe, dt, best, fake_run(best), checks, count(), t0, [],
                   "bisection over fake runs (the batch-2 and batch-3 timelines did not extrapolate)"))


def usable_bytes(place: "_Place") -> int:
    """What the step's tensors may take on the card: its memory less the CUDA context and the workspaces."""
    return max(0, place.card.reported_total_bytes - place.context_bytes - place.card.workspace_bytes())


def _line(runs: dict[int, TrackingResult], fake_run, two: TrackingResult, three: TrackingResult):
    """(batch 2's run, the a + b·c extrapolation or None). A process's first build can make a few
    storages once (seen with peft's adapters: constants lifted on the first build only): then
    batch 2 again, now built like batch 3."""
    line = _Extrapolation.make(two, three, 2)
    if line is None:
        del runs[2]
        two = fake_run(2, True)   # made again, not reused: the kept one is the first build's
        line = _Extrapolation.make(two, three, 2)
    return two, line


def _bisect(runs: dict[int, TrackingResult], run_check: Callable[[int], BatchCheck], checks: list[BatchCheck]) -> int:
    """The largest fitting batch by bracketed bisection over fake runs, at most ``MAX_FALLBACK_RUNS`` more."""
    budget = [MAX_FALLBACK_RUNS]

    def fits(b: int) -> bool:
        if b not in runs:
            budget[0] -= 1
            if budget[0] < 0:
                raise RuntimeError(f"the search needed more than {MAX_FALLBACK_RUNS} fake runs")
        c = run_check(b)
        checks.append(c)
        return c.fits
    return largest_fitting(3 if checks[1].fits else 2, fits, limit=MAX_BATCH)


def _sharding(w: Workload, recipe: LoopRecipe, dt: torch.dtype, gpus, strategy, offload_optimizer,
              master: torch.dtype | None = None, layout: Any = None):
    """(None, None) for one GPU; else the ``predict.sharding.Sharding`` and the function that turns
    a one-GPU run into one rank's. ``gpus``: the ranks the strategy spreads a rank's state over
    (``Layout.sharded_over``: dp_shard × cp under fsdp2/zero*, torchtitan's fsdp mesh), None for one GPU.
    ``dt``: the dtype the run computes in; ``master``: the sharded parameters' (FSDP2's
    ``MixedPrecisionPolicy``: the model's dtype, where the run's is ``param_dtype``). ``layout``: the
    ``gpulab.Layout`` answered, whose GPUs, mesh and sharding group (``Layout.shard_group``) the answer states."""
    from gpulab.predict import sharding as S
    sh = S.check_sharding(gpus, strategy, offload_optimizer, recipe.optimizer, dt)
    if sh is None:
        return None, None
    if sh.strategy in S.DEEPSPEED and (recipe.lora or recipe.quantize):
        raise ValueError(f"{sh.strategy} follows DeepSpeed's full fine-tuning layout; with LoRA or QLoRA use fsdp2 or ddp")
    from dataclasses import replace

    from gpulab.training.expert_parallel import expert_parameter_shapes, expert_rank_model
    from gpulab.training.fp8 import float8_numel
    policy = recipe.param_dtype or recipe.reduce_dtype or recipe.fp8_all_gather   # fsdp2's (options.check_fsdp_policy)
    reduce = parse_dtype(recipe.reduce_dtype) if recipe.reduce_dtype else None
    sh = replace(sh, ep=recipe.ep, tp=recipe.tp, **(S.precision_policy(dt, master or dt, reduce, recipe.fp8_all_gather)
                                                    if policy else {}))
    if layout is not None and layout.gpus is not None:   # stated as the mesh lays it out
        sh = replace(sh, world=layout.gpus, group=layout.shard_group, mesh=layout.mesh)
    with torch.device("meta"):   # the rank's own model: E/ep experts a layer under ep
        net = w.build(torch.device("meta"), dt) if recipe.ep == 1 else expert_rank_model(w, recipe, dt)
        layers = S.count_layers(net, float8=float8_numel if recipe.fp8_all_gather else None)
        experts = expert_parameter_shapes(net)
    if recipe.ep > 1 and recipe.tp > 1:   # the experts are DTensors (training.moe_parallel): the tracker files a
        # storage a DTensor op makes (the optimizer's zeros_like of a parameter) under the DTensor's global shape
        experts = experts | {(s[0] * recipe.ep, *s[1:]) for s in experts}
    elem = torch.empty((), dtype=dt).element_size()

    def one_rank(t: TrackingResult) -> TrackingResult:
        return S.per_rank(t, sh, layers, elem, experts)
    return sh, one_rank


def _place(gpu: str | Card | int, context_bytes: int | None, module_loading: str, timed: bool = False) -> "_Place":
    """The card asked for and the CUDA context on it (given, or assumed for ``module_loading``); ``timed``:
    the step's time is asked, so the fake runs are timed where the card has speed figures."""
    assumed = context_bytes is None
    if assumed:
        context_bytes = context_assumption(module_loading).nbytes
    # the card (a name, a size, a Card or bytes) with room for the context: a card smaller than an
    # assumed context is said to be so, with the option that replaces the assumption (predict.cards)
    card = card_with_room(gpu, context_bytes, assumed)
    if timed:
        from gpulab.predict.plan_time import speed_or_why
        timed = speed_or_why(card)[0] is not None
    return _Place(card, context_bytes, module_loading, timed=timed)


class _FakeRuns:
    """``fit``'s fake runs by batch (``self(b)``), each made once: laid out from a few layers where
    the layers are alike (``_deep``), else at full depth; one rank's when ``shard`` is given. ``timed``:
    every run the step's time reads is timed (``_deep``; ``predict.run_ops``)."""

    def __init__(self, w: Workload, key: tuple | None, dt: torch.dtype, recipe: LoopRecipe, target: tuple, shard,
                 progress: Progress, timed: bool = False):
        self.w, self.key, self.dt, self.recipe, self.target = w, key, dt, recipe, target
        self.shard, self.progress, self.timed = shard, progress, timed
        self.runs: dict[int, TrackingResult] = {}
        self.made: list[int] = []     # every full-depth fake run, in order (a batch run again counts again)
        self.deep = _deep(w, key, dt, recipe, target, timed)
        self.line: _Extrapolation | None = None   # the search's extrapolation, once a fake run confirmed it
        # each batch the search replayed: (batch, "run" or "extrapolated") -> its check (a pipeline's rows reuse them)
        self.checked: dict[tuple[int, str], BatchCheck] = {}
        self.checked_on: dict[int, TrackingResult] = {}   # the run each (batch, "run") check replayed

    def __call__(self, b: int, fresh: bool = False) -> TrackingResult:
        if b not in self.runs:
            deep = self.deep
            report(self.progress, 0.2 * min(4, len(self.runs)), f"fake run at batch {b} (a training step on fake "
                   f"tensors{f', {deep.depths[0]} and {deep.depths[1]} of its {deep.depth} layers' if deep and not deep.why else ''})"
                   f", then replaying it through the simulated allocator")
            t = deep.at(b, fresh) if deep is not None else None
            if t is None:
                t = _tracked(self.w, self.key, b, self.dt, self.recipe, self.target, fresh, self.timed)
                self.made.append(b)
            self.runs[b] = t if self.shard is None else self.shard(t)
        return self.runs[b]

    def count(self) -> int:
        """Fake runs made: full-depth ones and the few-layer ones the layouts came from."""
        return len(self.made) + (self.deep.runs if self.deep is not None else 0)

    def layers(self) -> str:
        """How the depth was run (``FitResult.layers``)."""
        return _depth_text(self.deep, self.w, self.recipe)


def _replay(t: TrackingResult, capacity: int | None) -> tuple[int, bool]:
    """(simulated peak reserved, whether an allocation failed) with ``capacity`` (None: no limit)."""
    peak, ooms = CachingAllocator(capacity_bytes=capacity).replay_peak(t.events)   # replay's peak and OOMs
    return peak, bool(ooms)


def verdict(t: TrackingResult, usable: int) -> tuple[int, bool]:
    """(reserved, fits) of ``t`` where the step's tensors may take ``usable`` bytes: where it fits, the
    reserved peak of its replay with that capacity (``_check``); where not, that of a replay without a
    limit (what it would need). One replay without a limit answers both where the live tensors alone
    pass ``usable`` (``_check``: no fit) or where that replay never reserves more than ``usable``: the
    simulator reads its capacity only when a new segment would pass it (``CachingAllocator._alloc_block``),
    so that replay is the one with the capacity, event for event. The replay with the capacity is made
    only where the one without a limit reserves more than ``usable``."""
    free, _ = _replay(t, None)
    if t.peak_bytes > usable or free <= usable:
        return free, t.peak_bytes <= usable
    reserved, oom = _replay(t, usable)
    return (free, False) if oom else (reserved, True)


def _check(t: TrackingResult, usable: int, batch: int, source: str) -> BatchCheck:
    reserved, oom = _replay(t, usable)
    return BatchCheck(batch, t.peak_bytes, reserved, not oom and t.peak_bytes <= usable, source)


@dataclass
class _Extrapolation:
    """Each event's bytes as ``a + (b - base)·c`` from two aligned timelines (batches ``base``
    and ``base + 1``). Batch 1 is not a base: a size-1 dimension makes some slices contiguous
    (transformers' shifted labels), so its timeline has fewer copies than any larger batch."""
    base: TrackingResult
    base_batch: int
    slopes: list[int]
    _arrays: tuple | None = field(default=None, repr=False, compare=False)   # peak_at's, made once

    @classmethod
    def make(cls, lo: TrackingResult, hi: TrackingResult, base_batch: int) -> "_Extrapolation | None":
        if len(lo.events) != len(hi.events):
            return None
        if any(a.kind != b.kind or a.sid != b.sid for a, b in zip(lo.events, hi.events)):
            return None
        slopes = [b.nbytes - a.nbytes for a, b in zip(lo.events, hi.events)]
        if any(s < 0 for s in slopes):
            return None
        return cls(lo, base_batch, slopes)

    def at(self, batch: int) -> TrackingResult:
        k = batch - self.base_batch
        events = [e.with_bytes(e.nbytes + k * s, e.delta) for e, s in zip(self.base.events, self.slopes)]
        return TrackingResult.build(self.base.records, events, self.base.device, self.base.rounded)

    def nbytes_at(self, batch: int) -> list[int]:
        """Each event's bytes at ``batch`` (those of ``at(batch)``'s events), without building its timeline."""
        k = batch - self.base_batch
        return [e.nbytes + k * s for e, s in zip(self.base.events, self.slopes)]

    def peak_at(self, batch: int) -> int:
        """``at(batch).peak_bytes`` without building the timeline: the live bytes after each event
        (each storage rounded as ``TrackingResult.build`` rounds it, a free taking back what the storage's
        previous event left) summed in one pass of numpy."""
        if self._arrays is None:
            events = self.base.events
            last: dict[int, int] = {}
            prev = np.empty(len(events), dtype=np.int64)   # the storage's previous event (-1: none)
            for i, e in enumerate(events):
                prev[i] = last.get(e.sid, -1)
                last[e.sid] = i
            self._arrays = (np.array([e.nbytes for e in events], dtype=np.int64), np.array(self.slopes, dtype=np.int64),
                            np.array([e.kind == "free" for e in events], dtype=bool), prev)
        nbytes, slopes, free, prev = self._arrays
        if not len(nbytes):
            return 0
        now = nbytes + (batch - self.base_batch) * slopes
        if self.base.rounded:   # formulas.cuda_rounded_bytes
            now = np.where(now <= 0, 0, (now + 511) // 512 * 512)
        now[free] = 0
        before = np.where(prev >= 0, now[prev], 0)
        return max(0, int(np.cumsum(now - before).max()))

    def same_events(self, t: TrackingResult, batch: int) -> bool:
        """``t``'s events are ``at(batch)``'s in kind, storage and bytes (all an allocator replay reads),
        and rounded alike: its replay is theirs."""
        return t.rounded == self.base.rounded and len(t.events) == len(self.base.events) and all(
            a.kind == b.kind and a.sid == b.sid for a, b in zip(t.events, self.base.events)) and \
            [e.nbytes for e in t.events] == self.nbytes_at(batch)

    def check(self, batch: int, usable: int) -> BatchCheck:
        return _check(self.at(batch), usable, batch, "extrapolated")


class _Place(NamedTuple):
    card: Card
    context_bytes: int
    module_loading: str
    sharding: Any = None     # predict.sharding.Sharding when the answer is one rank's
    timed: bool = False      # the fake runs are timed (predict.run_ops): the step's time is asked, the card has speeds


def _result(w, place: _Place, recipe: LoopRecipe, dt, batch, t: TrackingResult, checks, runs, t0, levers,
            method, live: int | None = None) -> FitResult:
    card, context_bytes = place.card, place.context_bytes
    if batch:   # every answer was checked by a fake run on this card: what its replay reserved there
        reserved = next(c.reserved_bytes for c in checks if c.batch == batch and c.source == "run")
    else:       # nothing fits: what batch 1 would reserve on a card without a limit, what it needs
        reserved, _ = _replay(t, None)
    amp = next((k for k, v in AMP_DTYPES.items() if v == recipe.amp), None)
    return FitResult(w.name, card.name, card.reported_total_bytes, context_bytes, recipe.optimizer, dtype_name(dt), amp,
                     w.describe_input(max(batch, 1)), batch, t.peak_bytes, dict(t.peak_by_category), reserved,
                     sorted(checks, key=lambda c: (c.batch, c.source)), runs, live,
                     time.perf_counter() - t0, levers=levers, method=method, recipe=changed_options(recipe),
                     module_loading=place.module_loading,
                     sharding=place.sharding.describe() if place.sharding else "",
                     sharding_label=_sharding_label() if place.sharding else "", capacity_note=card.total_text,
                     workspace_bytes=card.workspace_bytes(), kernels=current_target().note(),
                     label=f"{LABEL_FIT}; {current_target().note()}")


def _sharding_label() -> str:
    from gpulab.predict.sharding import LABEL
    return LABEL
