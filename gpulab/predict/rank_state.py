"""Which parameters, gradients and optimizer state one rank holds under a layout: the tensors
``gpulab.fit`` counts for a rank, named, with their shapes.

``rank_state(model, layout)`` runs the rank's own training step as ``fit`` does (one fake-engine
run of ``training.loop.train_experiment``: the model cut to the pipeline stage, split by tensor
parallelism on the fake process group, E/ep experts a layer), and reads, after the optimizer step,
each parameter's local shape (a DTensor's ``to_local()``), its gradient's and its optimizer
state's. A data-parallel strategy is not a run of its own in ``fit``: it resizes the run's storages
by ``predict.sharding.held_bytes`` (FSDP2: each tensor split over ``n = dp_shard × cp`` ranks, rank 0's
shard padded to ``ceil(d0 / n)`` rows as ``fully_shard`` allocates it (``shard_rows``), the experts' over
torchtitan's ``efsdp``, ``n × tp / ep``: ``Sharding.expert_ranks``); each row's ``held`` bytes are that
same function's, tensor by tensor.

What the strategy adds beside the rank's own tensors (FSDP2's gathered unit, ZeRO-3's gathered
layer, DDP's buckets) is ``extra``: ``predict.sharding``'s terms, not tensors of the model.

Results as data: a ``RankState`` with a row per parameter, totals by category, and ``as_dict``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from gpulab.categories import Category
from gpulab.options import Layout, Recipe

__all__ = ["RankState", "TensorState", "rank_state"]


def _local(t: Any) -> tuple[int, ...] | None:
    """A tensor's shape on this rank (a DTensor's local shard's), None for no tensor."""
    if t is None:
        return None
    local = getattr(t, "to_local", None)
    return tuple((local() if callable(local) else t).shape)


@dataclass(frozen=True)
class TensorState:
    """One parameter as the rank holds it: shapes before the data-parallel strategy (the run's), and
    the bytes held after it (``held``: parameter, gradient, optimizer state)."""
    name: str
    shape: tuple[int, ...]
    grad: tuple[int, ...] | None
    state: dict[str, tuple[int, ...]]
    itemsize: int
    expert: bool                       # a routed expert's weight (split over the expert data-parallel group)
    held: dict[str, int] = field(default_factory=dict)   # category value -> bytes on the rank

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "grad": None if self.grad is None else list(self.grad),
                "state": {k: list(v) for k, v in self.state.items()}, "expert": self.expert, "held": dict(self.held)}


@dataclass(frozen=True)
class RankState:
    """One rank's parameters, gradients and optimizer state under ``layout`` (module docstring)."""
    model: str
    layout: Layout
    stage: int
    tensors: dict[str, TensorState]
    sharded_over: int                   # the ranks the strategy splits a tensor over (1: none)
    experts_over: int                   # the same for the routed experts' tensors
    extra: list[tuple[str, int, str]]   # (what the strategy adds, bytes, from when): predict.sharding's
    label: str

    def held_bytes(self, category: Category) -> int:
        """The bytes the rank holds of ``category`` (parameters, gradients or optimizer state), its own
        tensors only (``extra`` apart)."""
        return sum(t.held.get(category.value, 0) for t in self.tensors.values())

    def as_dict(self) -> dict[str, Any]:
        cats = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE)
        return {"model": self.model, "mesh": self.layout.mesh, "stage": self.stage,
                "sharded_over": self.sharded_over, "experts_over": self.experts_over,
                "held_bytes": {c.value: self.held_bytes(c) for c in cats},
                "extra": [{"what": w, "bytes": b, "from": at} for w, b, at in self.extra],
                "tensors": [t.as_dict() for t in self.tensors.values()], "label": self.label}


def rank_state(model: Any, layout: Layout | None = None, *, stage: int = 0, optimizer: str = "adamw",
               dtype: str | None = None, seq_len: int | None = None, batch: int = 1) -> RankState:
    """The tensors one rank of ``layout`` holds (rank 0 of pipeline stage ``stage``): see the module
    docstring. ``model``: what ``gpulab.fit`` takes (a transformers config, "hf:NAME" ...); ``optimizer``
    and ``dtype`` as ``gpulab.Recipe``'s; ``seq_len``, ``batch``: the step's input (the shapes held do
    not depend on them). Bad input raises ``ValueError`` as ``fit`` would."""
    from gpulab.measure.engines import run
    from gpulab.models.workload import resolve_workload
    from gpulab.predict import sharding as S
    from gpulab.predict.layer_pattern import workload_with_depth
    from gpulab.training.loop import check_recipe_for, loop_recipe, train_experiment
    from gpulab.training.routing import experts_modules
    from gpulab.units import parse_dtype

    layout = layout or Layout()
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage < layout.pp:
        raise ValueError(f"stage must be a pipeline stage from 0 to {layout.pp - 1} (pp {layout.pp}), got {stage!r}")
    recipe = Recipe(optimizer=optimizer, dtype=dtype)
    dt = parse_dtype(dtype) if dtype is not None else torch.float32
    loop = replace(loop_recipe(recipe, layout), pp_stage=stage)
    w = resolve_workload(model, seq_len=seq_len)
    check_recipe_for(loop, w, dt)
    if loop.pp > 1:   # a stage's share of the layers, as fit's pipeline stages are built (predict.pipeline_fit)
        w = workload_with_depth(w, w.config.num_hidden_layers // loop.pp)

    def report(ctx, net, opt, scaler) -> dict[str, Any]:
        # the routed experts' own parameters, by identity: under EP × TP they are DTensors whose
        # shape is the global one (E experts), their local shard E/ep (training.moe_parallel)
        experts = {id(p) for _, m in experts_modules(net) for p in m.parameters(recurse=False)}
        rows = []
        for name, p in net.named_parameters():
            if not p.requires_grad:
                continue
            state = {k: (_local(v), _nbytes(_local(v), v.element_size()))
                     for k, v in opt.state.get(p, {}).items() if isinstance(v, torch.Tensor)}
            local = _local(p)
            rows.append((name, local, _local(p.grad), state, p.element_size(), id(p) in experts))
        return {"rank_tensors": rows}

    m = run(train_experiment(w, [batch], dt, loop, report=report), "fake")
    if m.error:
        raise ValueError(f"{w.name}: the rank's step failed on the fake engine: {m.error}")
    spread = None if layout.gpus is None else layout.sharded_over
    sh = S.check_sharding(spread, layout.strategy, layout.offload_optimizer, optimizer, dt)
    if sh is not None:   # the experts' share over torchtitan's efsdp mesh (Sharding.expert_ranks), as fit's
        sh = replace(sh, ep=loop.ep, tp=loop.tp)
    n = 1 if sh is None else sh.gpus
    n_experts = 1 if sh is None else sh.expert_ranks
    tensors = {}
    for name, shape, grad, state, itemsize, expert in m.value["rank_tensors"]:
        own = {Category.PARAMETERS: _nbytes(shape, itemsize), Category.GRADIENTS: _nbytes(grad, itemsize),
               Category.OPTIMIZER_STATE: sum(b for _, b in state.values())}
        over = n_experts if expert else n
        held = {c.value: b for c, b in own.items()}
        if sh is not None:   # each storage as fit's per_rank resizes it (FSDP2: rank 0's padded shard, shard_rows)
            def one(cat, s, b):
                return S.held_bytes(sh, cat, b, over, rows=S.shard_rows(s or (), b, itemsize, over, expert))
            held = {Category.PARAMETERS.value: one(Category.PARAMETERS, shape, own[Category.PARAMETERS]),
                    Category.GRADIENTS.value: one(Category.GRADIENTS, grad, own[Category.GRADIENTS]),
                    Category.OPTIMIZER_STATE.value: sum(one(Category.OPTIMIZER_STATE, s, b) for s, b in state.values())}
        tensors[name] = TensorState(name, shape, grad, {k: s for k, (s, _) in state.items()}, itemsize, expert, held)
    extra = [] if sh is None else _strategy_extra(w, loop, dt, sh, m)
    label = (f"rank 0 of stage {stage} of {layout.mesh}: the fake-engine run's tensors (fake process group), "
             f"{'resized by the strategy' + chr(39) + 's formula (predict.sharding.held_bytes)' if sh else 'no strategy'}")
    return RankState(w.name, layout, stage, tensors, n, n_experts if loop.ep > 1 else n, extra, label)


def _nbytes(shape: tuple[int, ...] | None, itemsize: int) -> int:
    if shape is None:
        return 0
    out = itemsize
    for d in shape:
        out *= d
    return out


def _strategy_extra(w, loop, dt, sh, m) -> list[tuple[str, int, str]]:
    """What the strategy adds on the rank beside its tensors: ``predict.sharding``'s terms for the
    rank's model, as ``fit`` counts them (its ``_sharding``: E/ep experts a layer under ep)."""
    from gpulab.predict import sharding as S
    from gpulab.training.expert_parallel import expert_rank_model
    with torch.device("meta"):
        net = w.build(torch.device("meta"), dt) if loop.ep == 1 else expert_rank_model(w, loop, dt)
        layers = S.count_layers(net)
    elem = torch.empty((), dtype=dt).element_size()
    return S.strategy_extra(replace(sh, ep=loop.ep), layers, elem, m.tracking)
