"""A plan's step time: one rank's kernels from a timed fake run, then what its layout adds (the
data-parallel collectives, the pipeline's bubble and its sends), each with its overlap named.

**One rank's kernels.** The ops of the recipe's fake run at the plan's batch, on the card's kernels
(``predict.timing.OpTimer``): the very runs ``gpulab fit``'s search (or ``what_fits``) made for the
memory answer, timed as they ran and kept with their ops (``predict.fake_runs.timed_step``,
``predict.run_ops``), so the time adds no fake run of its own; a run none kept is made here. A
tensor-parallel rank's run issues its own collectives on the fake process group, costed where they sit
(``timing.TP_OVERLAP``). Where the search lays a deep stack out from a few layers, the time reads the
same two small depths ``d1 < d2`` that differ by one period of alike layers (``layer_pattern.Pattern``),
and every figure is laid out linearly to the full depth: t(L) = t(d1) + (L − d1)/(d2 − d1) ·
(t(d2) − t(d1)), exact for a sum of per-op costs when the layers repeat op for op (the premise
``layer_repeat`` checks for memory). Where the search runs the full depth, so does the time.

**Data parallelism** (``dp`` ranks; their bytes are the rank's own parameters P and gradients G,
read from the timed run's "after step" snapshot, so a tensor-parallel shard moves its shard):

* ``ddp``: all-reduce of G; DDP's bucketed all-reduce overlaps the backward
  (``torch.nn.parallel.DistributedDataParallel``, ``bucket_cap_mb`` 25): exposed is what exceeds the
  backward, plus the last bucket's all-reduce, which starts when the backward ends.
* ``zero1``/``zero2``: reduce-scatter of G (overlapping the backward, DeepSpeed's ``overlap_comm``)
  and all-gather of the updated P after the optimizer step (exposed).
* ``zero3``/``fsdp2``: all-gather of P in the forward and again in the backward, reduce-scatter of G
  in the backward; FSDP's prefetch overlaps each with the phase's compute (``fully_shard``'s implicit
  prefetching): exposed is what exceeds the forward, and the backward.

A data-parallel group's link: the ranks sit ``tp × cp`` apart in the mesh (torchtitan's
``ParallelDims`` order, tp innermost), so the group spans ``dp × tp × cp`` GPUs, NVLink when that is
inside one node.

**Pipeline** (``pp`` stages, ``m`` micro-batches, ``v`` chunks a rank): the first and the last
stage are timed (a middle stage holds the first's layers without its embedding: no slower), one
micro-batch through each; the slowest stage's forward + backward ``t`` sets the pace. The step is
m·t plus the bubble, (p − 1)·t for GPipe and 1F1B, (p − 1)·t / v interleaved: a bubble fraction
(p − 1)/m, and (p − 1)/(v·m) (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", §2.2.1 and §2.2.2), then the stage's optimizer step. Each
micro-batch's activation and its gradient cross each stage boundary (send/recv of the micro-batch's
hidden state, b·s·h in the run's dtype, a tp-th of it with sequence parallelism), counted on the
critical path: 2·(m + p − 1) transfers, an upper bound (Megatron's 1F1B waits on its batched
send/recv). The stages sit ``dp × cp × tp`` GPUs apart (pp outermost).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from gpulab.models.workload import Workload
from gpulab.options import SHARDED_STRATEGIES
from gpulab.predict import layer_pattern
from gpulab.predict.card_speeds import CardSpeed
from gpulab.predict.comm_time import COMM_ASSUMPTION, collective_seconds, link_for
from gpulab.predict.timing import StepTime, cost_ops, with_host_copies
from gpulab.training.loop import LoopRecipe

__all__ = ["BUBBLE_SOURCE", "CommPart", "PlanTime", "RankTime", "Runs", "bubble_seconds", "plan_time", "time_of_fit",
           "timed_rank"]

BUBBLE_SOURCE = ("Narayanan et al. 2021 (Megatron-LM, SC'21) §2.2: bubble fraction (p-1)/m for GPipe and 1F1B, "
                 "(p-1)/(v·m) interleaved")
OVERLAP = {
    "ddp": "DDP's bucketed all-reduce overlaps the backward (bucket_cap_mb 25): exposed is what exceeds the "
           "backward, plus the last bucket",
    "zero1": "the gradients' reduce-scatter overlaps the backward (DeepSpeed overlap_comm); the parameters' "
             "all-gather after the optimizer step is exposed",
    "zero3": "FSDP/ZeRO-3 prefetch overlaps each all-gather and reduce-scatter with its phase's compute: exposed "
             "is what exceeds the forward, and the backward",
}
OVERLAP["zero2"], OVERLAP["fsdp2"] = OVERLAP["zero1"], OVERLAP["zero3"]
SHARDED_STEP = ("optimizer step on the rank's shard: the timed run's (every parameter's) over the sharding ranks n, "
                "its launch overheads divided too, though each rank launches as many kernels (short by the optimizer "
                "kernels' launch overhead × (1 - 1/n))")
_BUCKET = 25 * 2 ** 20   # torch.nn.parallel.DistributedDataParallel's bucket_cap_mb default


@dataclass
class RankTime:
    """One rank's timed step at full depth, and the bytes its data parallelism moves."""
    step: StepTime
    param_bytes: int
    grad_bytes: int
    depth: str   # how the depth was timed


@dataclass(frozen=True)
class CommPart:
    """One communication a layout adds: what, its bytes (S as nccl-tests counts it), over how many
    ranks and which link, its seconds, the seconds left exposed and why."""
    name: str
    nbytes: int
    ranks: int
    link: str
    seconds: float
    exposed_s: float
    overlap: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class PlanTime:
    """A plan's predicted step (one rank's view; every rank of the plan steps together)."""
    card: str
    speed: CardSpeed
    rank: StepTime                 # the (slowest) rank's kernels and its own collectives, one micro-batch
    seconds: float                 # the step: compute + exposed communication + bubble
    compute_s: float               # the rank's kernels and own collectives over the step (all micro-batches)
    optimizer_s: float
    comm: list[CommPart] = field(default_factory=list)
    bubble_s: float = 0.0
    bubble_formula: str = ""
    items: int = 0                 # tokens (or samples) the whole plan consumes a step
    unit: str = "tokens"
    gpus: int = 1
    model_flops: float = 0.0       # the step's model FLOPs over every GPU (3 × forward, recompute not counted)
    depth: str = ""
    notes: list[str] = field(default_factory=list)
    # what predicting it took in this process (costing the kept runs' ops, and any timed run made for it): not
    # part of the answer's data (``as_dict``), which identical questions answer identically
    wall_s: float = 0.0

    @property
    def label(self) -> str:
        return f"predicted (roofline, {self.card})"

    @property
    def items_per_s(self) -> float:
        return self.items / self.seconds if self.seconds else 0.0

    @property
    def mfu(self) -> float:
        """Model FLOPs / (step × GPUs × the card's peak in the dtype carrying most FLOPs)."""
        if not self.seconds or not self.rank.mfu_dtype:
            return 0.0
        return self.model_flops / (self.seconds * self.gpus * self.speed.peak_flops(self.rank.mfu_dtype))

    @property
    def exposed_comm_s(self) -> float:
        return sum(c.exposed_s for c in self.comm)

    def lines(self) -> list[str]:
        per_gpu = self.items_per_s / self.gpus
        out = [f"step time: {self.seconds * 1e3:,.1f} ms, {self.label}",
               f"  {self.unit}/s: {self.items_per_s:,.0f}" + (f" ({per_gpu:,.0f} a GPU over {self.gpus})" if self.gpus > 1
                                                               else "")
               + f", {self.items:,} {self.unit} a step; MFU {self.mfu:.1%} of {self.rank.mfu_dtype} peak",
               f"  compute {self.compute_s * 1e3:,.1f} ms (one rank's kernels"
               + (f", its tensor-parallel collectives {self.rank.comm_s * 1e3:,.1f} ms a micro-batch on the critical "
                  f"path" if self.rank.comm_s else "") + f"), optimizer {self.optimizer_s * 1e3:,.1f} ms"]
        if self.rank.host_s:
            out.append(f"  host copies (offloading) {self.rank.host_s * 1e3:,.1f} ms, inside compute")
        for c in self.comm:
            out.append(f"  {c.name}: {c.nbytes:,} B over {c.ranks} ranks ({c.link}) {c.seconds * 1e3:,.1f} ms, exposed "
                       f"{c.exposed_s * 1e3:,.1f} ms ({c.overlap})")
        if self.bubble_formula:
            out.append(f"  pipeline bubble: {self.bubble_s * 1e3:,.1f} ms ({self.bubble_formula}; {BUBBLE_SOURCE})")
        a = self.speed.assumptions
        out.append(f"  assumptions: {a.text} ({a.source}); "
                   f"{COMM_ASSUMPTION if self.comm or self.rank.comm_s else 'no communication'}")
        out += [f"  {n}" for n in self.notes]
        out += self.rank.uncounted_lines()
        out.append(f"  how: {self.depth}")
        out.append(f"  card: {self.speed.source}" + (f"; links: {self.speed.links.source}" if self.speed.links else ""))
        return out

    def __repr__(self) -> str:
        return "\n".join(self.lines())

    def as_dict(self) -> dict[str, Any]:
        a = self.assumptions
        return {"label": self.label, "seconds": self.seconds, "compute_seconds": self.compute_s,
                "optimizer_seconds": self.optimizer_s, "comm": [c.as_dict() for c in self.comm],
                "exposed_comm_seconds": self.exposed_comm_s, "bubble_seconds": self.bubble_s,
                "bubble_formula": self.bubble_formula, "items": self.items, "unit": self.unit,
                "items_per_s": self.items_per_s, "gpus": self.gpus, "mfu": self.mfu, "mfu_dtype": self.rank.mfu_dtype,
                "model_flops": self.model_flops, "depth": self.depth, "notes": list(self.notes),
                "rank": self.rank.as_dict(), "lines": self.lines(),
                "assumptions": {"compute_efficiency": a.compute_efficiency, "memory_efficiency": a.memory_efficiency,
                                "launch_overhead_s": a.launch_overhead_s, "source": a.source,
                                "communication": COMM_ASSUMPTION}}

    @property
    def assumptions(self):
        return self.speed.assumptions


def _lerp(a: float, b: float, f: float) -> float:
    return a + f * (b - a)


def _in_order(a: dict, b: dict) -> list:
    """The keys of ``b`` then those only ``a`` has, each in its dict's order (the order the run met
    them): the same answer in every process, where a set's order is not."""
    return [*b, *(k for k in a if k not in b)]


def _laid_out(a: StepTime, b: StepTime, f: float) -> StepTime:
    """Every additive figure of ``a`` (depth d1) and ``b`` (d2) laid out to d1 + f·(d2 − d1)."""
    ops = {}
    for name in _in_order(a.by_op, b.by_op):
        oa, ob = a.by_op.get(name), b.by_op.get(name)
        base = ob or oa
        zero = replace(base, count=0, seconds=0.0, flops=0, nbytes=0, compute_bound=0)
        oa, ob = oa or zero, ob or zero
        ops[name] = replace(base, count=round(_lerp(oa.count, ob.count, f)), seconds=_lerp(oa.seconds, ob.seconds, f),
                            flops=round(_lerp(oa.flops, ob.flops, f)), nbytes=round(_lerp(oa.nbytes, ob.nbytes, f)),
                            compute_bound=round(_lerp(oa.compute_bound, ob.compute_bound, f)))
    colls = {}
    for key in _in_order(a.collectives, b.collectives):
        ca, cb = a.collectives.get(key), b.collectives.get(key)
        base = cb or ca
        zero = replace(base, count=0, nbytes=0, seconds=0.0)
        ca, cb = ca or zero, cb or zero
        colls[key] = replace(base, count=round(_lerp(ca.count, cb.count, f)), nbytes=round(_lerp(ca.nbytes, cb.nbytes, f)),
                             seconds=_lerp(ca.seconds, cb.seconds, f))
    phases = {p: _lerp(a.by_phase.get(p, 0.0), b.by_phase.get(p, 0.0), f) for p in b.by_phase}
    return replace(b, seconds=sum(phases.values()), by_phase=phases,
                   compute_bound_s=_lerp(a.compute_bound_s, b.compute_bound_s, f),
                   memory_bound_s=_lerp(a.memory_bound_s, b.memory_bound_s, f), launch_s=_lerp(a.launch_s, b.launch_s, f),
                   kernels=round(_lerp(a.kernels, b.kernels, f)), flops=round(_lerp(a.flops, b.flops, f)),
                   forward_flops=round(_lerp(a.forward_flops, b.forward_flops, f)), by_op=ops,
                   comm_s=_lerp(a.comm_s, b.comm_s, f), host_s=_lerp(a.host_s, b.host_s, f), collectives=colls,
                   host_bytes=round(_lerp(a.host_bytes, b.host_bytes, f)))


@dataclass(frozen=True)
class Runs:
    """Where a plan's timed fake runs come from: those ``gpulab fit``'s search or ``what_fits`` made and
    ``run_cache`` kept with their ops, under the workload's ``key`` and the card's ``target`` as
    ``predict.fit`` keys them; a run none kept is made now, timed (``predict.fit.timed_step``). The
    default keeps nothing: every run made here."""
    key: tuple | None = None
    target: tuple = ("cuda", "")


def _timed_at(w: Workload, depth: int | None, batch: int, dt: torch.dtype, recipe: LoopRecipe, speed: CardSpeed,
              items: int, unit: str, runs: Runs) -> tuple[StepTime, int, int]:
    """The steady step of the two-step fake run at ``depth`` layers (None: as ``w`` is) and ``batch``
    (``predict.fit.timed_step``): its step time and its parameters' and gradients' bytes after the step."""
    from gpulab.predict.fake_runs import timed_step
    ops = timed_step(w, runs.key, depth, batch, dt, recipe, runs.target)
    t = cost_ops(list(ops.ops), speed, items, unit)
    if ops.offloaded_bytes:   # the run's two steps' host copies: one step's
        t = with_host_copies(t, ops.offloaded_bytes // 2)
    return t, ops.param_bytes, ops.grad_bytes


def timed_rank(w: Workload, batch: int, dt: torch.dtype, recipe: LoopRecipe, speed: CardSpeed,
               runs: Runs = Runs()) -> RankTime:
    """One rank's step at ``w``'s full depth (module docstring): two small timed depths laid out where
    the memory search lays the depth out (``predict.fit``: the same runs), else the full depth timed."""
    from gpulab.predict.fake_runs import not_laid_out
    per = w.seq_len if w.kind == "tokens" and w.seq_len else 1
    items, unit = batch * per * recipe.accumulate, ("tokens" if per > 1 else "samples")
    why = not_laid_out(w, recipe)
    pattern = None if why is not None else layer_pattern.block_pattern(w.config, min_depth=0, facts=w.facts)
    if isinstance(pattern, str):
        why, pattern = pattern, None
    if pattern is None:
        t, p, g = _timed_at(w, None, batch, dt, recipe, speed, items, unit, runs)
        return RankTime(t, p, g, f"timed at full depth ({why})")
    depth = getattr(w.config, w.facts.depth_field)
    d1, d2, _ = pattern.depths(depth)
    a, pa, ga = _timed_at(w, d1, batch, dt, recipe, speed, items, unit, runs)
    b, pb, gb = _timed_at(w, d2, batch, dt, recipe, speed, items, unit, runs)
    f = (depth - d1) / (d2 - d1)
    return RankTime(_laid_out(a, b, f), round(_lerp(pa, pb, f)), round(_lerp(ga, gb, f)),
                    f"timed at {d1} and {d2} layers, laid out to {depth} (t(L) = t({d1}) + (L - {d1})/{d2 - d1}"
                    f"·(t({d2}) - t({d1})))")


def _rank_optimizer(seconds: float, strategy: str, n: int, notes: list[str]) -> float:
    """The optimizer step of one rank: the timed run's (every parameter's) where each rank steps them all
    (ddp), a ``n``-th of it where each steps its shard of each tensor (ZeRO-1/2/3, FSDP2: ``SHARDED_STEP``)."""
    if strategy not in SHARDED_STRATEGIES or n <= 1 or not seconds:
        return seconds
    notes.append(SHARDED_STEP)
    return seconds / n


def _dp_comm(strategy: str, n: int, span: int, rank: RankTime, speed: CardSpeed, fwd: float, bwd: float) -> list[CommPart]:
    """The data-parallel collectives of ``strategy`` over ``n`` ranks spanning ``span`` GPUs (module docstring)."""
    if n <= 1:
        return []
    bw, link = link_for(speed.links, span)
    if bw is None:
        raise ValueError(f"{speed.name} has no network figure in gpulab's card table: {n} data-parallel ranks "
                         f"spanning {span} GPUs leave a node of {speed.links.gpus_per_node}")
    P, G = rank.param_bytes, rank.grad_bytes

    def sec(kind: str, nbytes: int) -> float:
        return collective_seconds(kind, nbytes, n, bw)
    why = OVERLAP[strategy]
    if strategy == "ddp":
        t = sec("all_reduce", G)
        return [CommPart("gradient all-reduce", G, n, link, t, max(0.0, t - bwd) + sec("all_reduce", min(G, _BUCKET)),
                         why)]
    if strategy in ("zero1", "zero2"):
        rs, ag = sec("reduce_scatter", G), sec("all_gather", P)
        return [CommPart("gradient reduce-scatter", G, n, link, rs, max(0.0, rs - bwd), why),
                CommPart("parameter all-gather after the step", P, n, link, ag, ag, why)]
    ag, rs = sec("all_gather", P), sec("reduce_scatter", G)
    return [CommPart("parameter all-gather, forward", P, n, link, ag, max(0.0, ag - fwd), why),
            CommPart("parameter all-gather + gradient reduce-scatter, backward", P + G, n, link, ag + rs,
                     max(0.0, ag + rs - bwd), why)]


def bubble_seconds(pp: int, t: float, virtual_stages: int = 1) -> float:
    """The pipeline's bubble: (p - 1)·t for GPipe and 1F1B, (p - 1)·t/v interleaved, where ``t`` is the
    slowest stage's forward + backward of one micro-batch (``BUBBLE_SOURCE``)."""
    return (pp - 1) * t / virtual_stages


def plan_time(w: Workload, batch: int, dt: torch.dtype, recipe: LoopRecipe, layout: Any, speed: CardSpeed,
              strategy: str | None = None, rank: RankTime | None = None, runs: Runs = Runs()) -> PlanTime:
    """The step time of ``recipe`` at per-GPU (micro-)batch ``batch`` under ``layout`` (a
    ``gpulab.Layout``) on ``speed``'s card (module docstring). ``strategy``: the data parallelism
    (None: ``layout.strategy``, else replicas: ddp). ``rank``: the rank's timed step when already made
    for the same workload, batch, dtype, recipe and card (``timed_rank``), so that several data-parallel
    strategies share one timed run (not for a pipeline: its stages are timed apart). ``runs``: where the
    timed runs are kept (``Runs``: those of ``gpulab fit``'s search)."""
    if batch < 1:
        raise ValueError("nothing fits: no step to time")
    gpus = layout.gpus or 1
    dp, tp, cp, pp = layout.dp, recipe.tp, recipe.cp, recipe.pp
    strategy = strategy or layout.strategy or "ddp"
    notes = []
    if pp > 1:
        return _pipeline_time(w, batch, dt, recipe, layout, speed, strategy, notes, runs)
    rank = rank if rank is not None else timed_rank(w, batch, dt, recipe, speed, runs)
    s = rank.step
    fwd, bwd, opt = s.by_phase.get("forward", 0.0), s.by_phase.get("backward", 0.0), s.by_phase.get("optimizer", 0.0)
    opt_rank = _rank_optimizer(opt, strategy, dp * cp, notes)
    comm = _dp_comm(strategy, dp * (cp if strategy in SHARDED_STRATEGIES else 1), dp * tp * cp,
                    rank, speed, fwd, bwd) if dp * cp > 1 and speed.links is not None else []
    if layout.offload_optimizer:
        notes.append("optimizer offloaded: its state's host traffic and a CPU optimizer step are not timed (the "
                     "GPU's optimizer step stands in)")
    seconds = s.seconds - opt + opt_rank + sum(c.exposed_s for c in comm)
    return PlanTime(speed.name, speed, s, seconds, fwd + bwd, opt_rank, comm, items=s.items * dp, unit=s.unit, gpus=gpus,
                    model_flops=s.model_flops * gpus, depth=rank.depth, notes=notes)


def _pipeline_time(w: Workload, batch: int, dt: torch.dtype, recipe: LoopRecipe, layout: Any, speed: CardSpeed,
                   strategy: str, notes: list[str], runs: Runs) -> PlanTime:
    """GPipe, 1F1B or interleaved 1F1B over ``recipe.pp`` stages (module docstring)."""
    pp, m, v, tp = recipe.pp, recipe.microbatches, recipe.virtual_stages, recipe.tp
    layers = w.config.num_hidden_layers
    stage_w = layer_pattern.workload_with_depth(w, layers // pp)
    ranks = {}
    for stage in (0, pp - 1):
        r = replace(recipe, pp_stage=stage) if v > 1 else replace(recipe, pp_stage=stage, microbatches=1)
        ranks[stage] = timed_rank(stage_w, batch, dt, r, speed, runs)
    share = m if v > 1 else 1   # an interleaved run is the rank's whole schedule: its m micro-batches
    per_mb = {s: (r.step.by_phase.get("forward", 0.0) + r.step.by_phase.get("backward", 0.0)) / share
              for s, r in ranks.items()}
    slow = max(per_mb, key=per_mb.get)
    t = per_mb[slow]
    rank = ranks[slow]
    s = rank.step
    opt = _rank_optimizer(s.by_phase.get("optimizer", 0.0), strategy, layout.dp * recipe.cp, notes)
    bubble = bubble_seconds(pp, t, v)
    formula = (f"(p - 1)·t{'/v' if v > 1 else ''} = {pp - 1}·{t * 1e3:,.1f} ms{f'/{v}' if v > 1 else ''}, "
               f"a fraction (p - 1)/{'(v·m)' if v > 1 else 'm'} = {(pp - 1) / (v * m):.3f} of m·t; {recipe.schedule}, "
               f"{m} micro-batches, t the {'first' if slow == 0 else 'last'} stage's forward + backward of one")
    comm: list = []
    if speed.links is not None:
        dp, cp = layout.dp, recipe.cp
        hidden = w.config.hidden_size
        itemsize = torch.empty((), dtype=recipe.amp or dt).element_size()
        act = batch * (w.seq_len or 1) * hidden * itemsize // (tp if recipe.sequence_parallel else 1) // cp
        bw, link = link_for(speed.links, 2 * dp * cp * tp)
        if bw is None:
            raise ValueError(f"{speed.name} has no network figure in gpulab's card table: pipeline stages leave a node")
        p2p = 2 * (m + pp - 1) * collective_seconds("send_recv", act, 2, bw)
        comm.append(CommPart("pipeline send/recv (activations forward, their gradients backward)",
                             2 * (m + pp - 1) * act, 2, link, p2p, p2p,
                             "on the critical path: 2·(m + p - 1) transfers of one micro-batch's hidden state"))
        fwd, bwd = (s.by_phase.get("forward", 0.0) / share * m, s.by_phase.get("backward", 0.0) / share * m)
        sharded = strategy in SHARDED_STRATEGIES
        comm += _dp_comm(strategy, dp * (cp if sharded else 1), dp * tp * cp, rank, speed, fwd, bwd) \
            if dp * cp > 1 else []
        if layout.strategy is None and dp > 1:
            notes.append("data parallelism assumed ddp (Megatron-LM's default, as the memory answer says)")
    seconds = m * t + bubble + opt + sum(c.exposed_s for c in comm)
    # model FLOPs: every stage's forward, a middle stage as the first without its embedding (no FLOPs)
    first, last = ranks[0].step.forward_flops / share, ranks[pp - 1].step.forward_flops / share
    stage_fwd = first + last + (pp - 2) * first
    gpus = layout.gpus or pp * tp
    model_flops = 3 * stage_fwd * m * tp * layout.dp * recipe.cp
    notes.append(f"stages timed: first and last ({ranks[0].depth}); a middle stage holds the first's layers without "
                 f"the embedding, so it is no slower")
    return PlanTime(speed.name, speed, s, seconds, m * t, opt, comm, bubble, formula,
                    items=s.items * m * layout.dp, unit=s.unit, gpus=gpus, model_flops=model_flops,
                    depth=rank.depth, notes=notes)


def speed_or_why(card: Any) -> tuple[CardSpeed | None, str]:
    """The card's speed row, or None and why there is none (a size such as 24GiB has no speeds)."""
    from gpulab.predict.card_speeds import speed_of
    try:
        return speed_of(card), ""
    except ValueError as why:
        return None, str(why)


def time_of_fit(result: Any, w: Workload, dt: torch.dtype, recipe: LoopRecipe, layout: Any, card: Any,
                progress: Any = None, runs: Runs = Runs()) -> None:
    """``gpulab.fit``'s answer (a ``FitResult``) given its step time at the batch it found: ``result.time``,
    or ``result.time_note`` saying why there is none. ``runs``: where the search's timed runs are kept."""
    from gpulab.predict.progress import report
    speed, why = speed_or_why(card)
    if speed is None:
        result.time_note = why
        return
    if result.largest_batch < 1:
        result.time_note = "nothing fits: no step to time"
        return
    report(progress, 1.0, f"timing the step at batch {result.largest_batch} on {speed.name} (the search's fake runs)")
    strategy = layout.strategy or (result.sharding.split(", ")[1].split(" ")[0] if result.sharding else None)
    t0 = time.perf_counter()
    try:
        result.time = plan_time(w, result.largest_batch, dt, recipe, layout, speed, strategy, runs=runs)
    except ValueError as why:
        result.time_note = str(why)
        return
    result.time.wall_s = time.perf_counter() - t0


def _one_gpu_layout(recipe: LoopRecipe):
    """The one-GPU layout of a recipe's own tp, cp, ep and pp (what ``what_fits`` answers)."""
    from gpulab.options import Layout
    pipe = dict(microbatches=recipe.microbatches, schedule=recipe.schedule,
                virtual_stages=recipe.virtual_stages) if recipe.pp > 1 else {}
    return Layout(tp=recipe.tp, sequence_parallel=recipe.sequence_parallel, cp=recipe.cp, ep=recipe.ep, pp=recipe.pp,
                  **pipe)


def time_candidates(w: Workload, batch: int, base_dt: torch.dtype, recipe_of: Any, asked_fits: bool, tried: list,
                    card: Any, progress: Any = None, runs: Runs = Runs()) -> tuple[dict | None, list, str]:
    """``what_fits``'s asked recipe (where it fits) and each fitting candidate timed at ``batch``: (the
    asked one's time, the candidates with theirs, why none where the card has no speeds). ``runs``: where
    ``what_fits``'s own timed runs are kept."""
    from gpulab.predict.progress import report
    from gpulab.units import parse_dtype
    speed, why = speed_or_why(card)
    if speed is None:
        return None, tried, why

    def timed(changes: dict, name: str) -> dict | None:
        report(progress, 1.0, f"timing {name} at batch {batch} on {speed.name}")
        recipe = recipe_of(changes)
        dt = parse_dtype(changes["dtype"]) if "dtype" in changes else base_dt
        return plan_time(w, batch, dt, recipe, _one_gpu_layout(recipe), speed, runs=runs).as_dict()
    try:
        asked = timed({}, "the asked recipe") if asked_fits else None
        out = [replace(t, time=timed(t.changes, t.name)) if t.fits else t for t in tried]
    except ValueError as why:   # a dtype the card has no peak for (a T4 in bf16)
        return None, tried, str(why)
    return asked, out, ""
