"""One rank's memory when a training step is spread over N GPUs (``gpulab fit --gpus N --strategy S``).

The one-GPU fake run of the recipe is the measurement; each of its storages of parameters,
gradients and optimizer state is then resized as the strategy holds it on one rank, and what the
strategy adds is put in as storages of its own. The timeline so made goes through the same
simulated allocator as a one-GPU answer. The label says so: a formula over a measured timeline.

* ``ddp`` (``DistributedDataParallel``, its defaults): every rank holds everything, plus gradient
  buckets the size of the gradients (``gradient_as_bucket_view=False``), from the first gradient on.
* ``zero2`` (DeepSpeed ZeRO-2, as DeepSpeed's own estimator ``estimate_zero2_model_states_mem_needs``
  counts it, in ``deepspeed/runtime/zero/stage_1_and_2.py``, 0.19): 16-bit parameters whole on every
  rank (2 bytes a parameter); the 16-bit gradient partition, the fp32 master weights, Adam's two
  fp32 moments and an fp32 gradient partition (2 + 16 bytes a parameter) split N ways; offloaded,
  all but the 16-bit parameters live on the host.
* ``zero1``: the same with the 16-bit gradients whole on every rank (DeepSpeed's estimator has no
  stage-1 function of its own: this is the ZeRO paper's P_os with DeepSpeed's 16 bytes of state).
* ``zero3`` (``estimate_zero3_model_states_mem_needs``, ``stage3.py``): everything split N ways
  (18 bytes a parameter: the 16-bit weights and the 16 above; the 16-bit gradients go into the
  fp32 partition as they are reduced, so none are kept), plus the largest layer's 16-bit weights
  and gradients gathered (4 bytes a parameter of the module with the most parameters of its own).
* ``fsdp2`` (``torch.distributed.fsdp.fully_shard`` on every layer of the model's largest
  ``ModuleList`` and on the root, ``reshard_after_forward=True``): parameters, gradients and
  optimizer state split N ways in the run's own dtypes (rank 0's shard of each tensor padded to
  ``ceil(d0 / N)`` rows, as ``fully_shard`` allocates it: ``shard_rows``); the largest unit's parameters gathered
  while it computes and its gradients unsharded until they are reduce-scattered: two copies of
  its parameter bytes, counted as held for the whole step (an upper bound: FSDP2 frees them
  after each unit).

FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` (``Sharding.master_elem``,
``reduce_elem``; torch's ``torch/distributed/fsdp/_fully_shard``): the run computes in ``param_dtype``
(the unsharded parameters are cast to it before the all-gather, ``FSDPParam.all_gather_inputs``'
``_to_dtype_if_needed``, and so are the forward's inputs); the sharded parameters, their gradients
and the optimizer state stay in the model's own dtype (``FSDPParam.orig_dtype``; the reduced
gradients are accumulated "in each parameter's sharded dtype", ``foreach_reduce``), so each such
storage of the run (in the run's dtype) is resized by master bytes / run bytes before its split.
The largest unit is then held as its all-gathered parameters in ``param_dtype``, its unsharded
gradients in ``param_dtype`` and, where ``reduce_dtype`` differs from the gradients' dtype, the
reduce-scatter input it copies them into (``foreach_reduce``: ``reduce_scatter_comm.allocate(...,
dtype=reduce_dtype)``, then ``foreach_reduce_scatter_copy_in``). NB: that buffer exists in the
gradients' own dtype too when no cast is asked; gpulab's plain fsdp2 count leaves it out, as before.

float8 with FSDP2's float8 all-gather (``Sharding.float8_all_gather``: torchao's
``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``, tensorwise; torchtitan <= 0.2's
``float8.enable_fsdp_float8_all_gather`` with ``precompute_float8_dynamic_scale_for_fsdp``; 0.3.0's
``Float8LinearConverter`` keeps only the rowwise recipes, without it):
``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather`` casts each float8 layer's weight shard
to float8 before the all-gather, so the gathered weights of those layers are 1 byte an element
instead of ``param_dtype``'s (``Layers.units``: each unit's float8 weights); the gradients are
unchanged. NB: the one-GPU run's per-matmul weight casts are kept (an upper bound: with the
float8 all-gather the gathered weight is already float8), and the scales (one fp32 number a
weight) are not counted.

The optimizer step's temporaries (torch's foreach Adam/AdamW makes copies the size of the
parameters it steps: ``_foreach_sqrt`` of the second moments in ``_multi_tensor_adam``) are the
shard's on every strategy but ddp: FSDP2's optimizer steps each rank's DTensor shards, DeepSpeed's
its flat partition (DeepSpeed's fused Adam makes none: an upper bound there).

``offload_optimizer`` keeps the optimizer state (DeepSpeed: with the fp32 master weights and
gradient partition) in host memory: off the GPU.

With expert parallelism (``ep``: the run is rank 0's, holding E/ep experts a layer) the experts'
parameters, gradients and optimizer state are split over the expert data-parallel group, N/ep
ranks, or with tensor parallelism N·tp/ep (ep borrows the tp ranks too: torchtitan's ``efsdp``
mesh, ``dp_shard × cp × tp / ep``, for FSDP2; DeepSpeed-MoE's expert data-parallel group for ZeRO),
the rest over all N: ``per_rank``'s ``experts``, the experts' parameter shapes.

What only a GPU run adds is not here: NCCL's own buffers and communicator memory, the caching
allocator's per-stream pools for FSDP2's all-gather and reduce-scatter streams, and DeepSpeed's
bucket buffers (``reduce_bucket_size``, ``allgather_bucket_size``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn

from gpulab.categories import Category
from gpulab.measure.records import Event, TrackingResult

STRATEGIES: dict[str, str] = {
    "ddp": "DistributedDataParallel: everything on every rank, plus gradient buckets",
    "zero1": "ZeRO-1 with DeepSpeed's bytes: fp32 master weights, Adam state and fp32 gradients split N ways",
    "zero2": "DeepSpeed ZeRO-2: 16-bit and fp32 gradients, fp32 master weights and Adam state split N ways",
    "zero3": "DeepSpeed ZeRO-3: everything split N ways, the largest layer gathered",
    "fsdp2": "FSDP2 (fully_shard per layer): everything split N ways, the largest unit gathered",
}
DEEPSPEED = ("zero1", "zero2", "zero3")
ADAM_FAMILY = ("adam", "adamw")
DS_STATE_BYTES = 16     # fp32 master weight + two fp32 Adam moments + fp32 gradient partition, per parameter
LABEL = ("one rank: the one-GPU fake run's timeline with its parameters, gradients and optimizer state "
         "resized as the strategy holds them (formula over measured storages); not counted, only a GPU run "
         "has them: NCCL's buffers, the allocator's pools for communication streams, DeepSpeed's bucket buffers")


@dataclass(frozen=True)
class Sharding:
    """How the step is spread: ``gpus`` ranks, ``strategy``, the optimizer state on the host or not."""
    gpus: int
    strategy: str
    offload_optimizer: bool = False
    ep: int = 1   # expert-parallel ranks among the gpus (module docstring)
    tp: int = 1   # tensor-parallel ranks beside them, which ep borrows too (torchtitan's efsdp = dp_shard·cp·tp/ep)
    # FSDP2's MixedPrecisionPolicy and float8 all-gather (module docstring; ``precision_policy``)
    run_dtype: str = ""            # the dtype the run computes in, whose state storages are resized
    master_elem: int = 0           # bytes an element of the sharded parameters, gradients and state (0: the run's)
    reduce_elem: int = 0           # bytes an element of the reduce-scatter input in reduce_dtype (0: no cast)
    float8_all_gather: bool = False
    # the layout it comes from (``Layout.shard_group``, ``Layout.mesh``): what ``describe`` states; a
    # Sharding made without them (the formulas' tests, the lesson) says ``gpus`` alone
    world: int = 0                                  # all the GPUs of the mesh (0: gpus)
    group: tuple[tuple[str, int], ...] = ()         # the mesh dimensions whose product is ``gpus``
    mesh: str = ""

    @property
    def expert_ranks(self) -> int:
        """The ranks the experts' own storages are split over: torchtitan's ``efsdp`` mesh,
        ``dp_shard × cp × tp / ep`` (``gpus`` being ``dp_shard × cp``), at least 1; without ep the
        experts are split over tp like the rest (training.moe_parallel) and sharded over ``gpus``."""
        return self.gpus if self.ep == 1 else max(1, self.gpus * self.tp // self.ep)

    def describe(self) -> str:
        """"16 GPUs, fsdp2 (...); N = dp_shard × cp = 4 × 2 = 8 ranks; mesh ...": the GPUs, the strategy,
        the group it splits (or replicates) over as the mesh's dimensions, and the experts' group."""
        off = ", optimizer state offloaded to the host" if self.offload_optimizer else ""
        group = self.group or (("gpus", self.gpus),)
        names, sizes = " × ".join(k for k, _ in group), " × ".join(str(v) for _, v in group)
        product = f"{names} = {sizes} = {self.gpus}" if len(group) > 1 else f"{names} = {self.gpus}"
        split = (f"every rank holds everything, {product} replicas" if self.strategy == "ddp" else
                 f"N = {product} ranks")
        experts = ""
        if self.ep > 1 and self.strategy != "ddp":
            tp = f" × tp" if self.tp > 1 else ""
            tps = f" × {self.tp}" if self.tp > 1 else ""
            experts = (f"; the experts' own share over the expert data-parallel group (torchtitan's efsdp), "
                       f"{names}{tp} / ep = {sizes}{tps} / {self.ep} = {self.expert_ranks} ranks")
        mesh = f"; {self.mesh}" if self.mesh else ""
        return (f"{self.world or self.gpus} GPUs, {self.strategy} ({STRATEGIES[self.strategy]}){off}; {split}"
                f"{experts}{self.policy_text()}{mesh}")

    def policy_text(self) -> str:
        """FSDP2's precision settings in words ("" where none is set)."""
        parts = []
        if self.master_elem:
            parts.append(f"MixedPrecisionPolicy: {self.run_dtype} parameters computed, sharded master weights, "
                         f"gradients and optimizer state at {self.master_elem} bytes an element")
        if self.reduce_elem:
            parts.append(f"gradients reduce-scattered at {self.reduce_elem} bytes an element")
        if self.float8_all_gather:
            parts.append("float8 weights all-gathered (1 byte an element)")
        return "; " + ", ".join(parts) if parts else ""


def precision_policy(run: torch.dtype, master: torch.dtype, reduce: torch.dtype | None,
                     float8_all_gather: bool = False) -> dict:
    """The ``Sharding`` fields of FSDP2's MixedPrecisionPolicy and float8 all-gather, the run computing
    in ``run`` (``param_dtype``, else the model's) over sharded parameters in ``master`` (the model's
    dtype), gradients reduced in ``reduce`` (None: in their own): master bytes where they differ from
    the run's, and the reduce-scatter's element size where it casts the gradients (which are in ``run``)."""
    out: dict = {"run_dtype": str(run).removeprefix("torch."), "float8_all_gather": bool(float8_all_gather)}
    if master != run:
        out["master_elem"] = torch.empty((), dtype=master).element_size()
    if reduce is not None and reduce != run:
        out["reduce_elem"] = torch.empty((), dtype=reduce).element_size()
    return out


def check_sharding(gpus: int | None, strategy: str | None, offload_optimizer: bool, optimizer: str,
                   param_dtype: torch.dtype) -> Sharding | None:
    """The sharding asked for, or None for one GPU; a clear ValueError for what cannot be answered."""
    if gpus is None:
        if strategy is not None or offload_optimizer:
            raise ValueError("a strategy or an offloaded optimizer spreads the step over several GPUs: "
                             "say how many with gpus=N (command line: --gpus N)")
        return None
    if gpus == 1 and strategy is None and not offload_optimizer:
        return None
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise ValueError(f"gpus must be a whole number of GPUs, 1 or more, not {gpus!r}")
    if strategy is None:
        raise ValueError(f"{gpus} GPUs: name how the step is spread over them: strategy one of "
                         f"{', '.join(STRATEGIES)} (command line: --strategy)")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: one of {', '.join(STRATEGIES)}")
    if offload_optimizer and strategy in ("ddp",):
        raise ValueError("ddp keeps the optimizer on every GPU: offloading it needs zero1, zero2, zero3 or fsdp2")
    if strategy in DEEPSPEED and optimizer not in ADAM_FAMILY:
        raise ValueError(f"{strategy} follows DeepSpeed's layout for Adam (fp32 master weights and two moments); "
                         f"use optimizer adam or adamw, or fsdp2 for {optimizer!r}")
    if strategy in DEEPSPEED and param_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{strategy} follows DeepSpeed's mixed precision (16-bit weights, fp32 master copy): "
                         "use dtype bf16 or fp16 (command line: --dtype bf16), or fsdp2 for fp32 weights")
    return Sharding(gpus, strategy, offload_optimizer)


@dataclass(frozen=True)
class Layers:
    """Parameter counts that decide what ZeRO-3 and FSDP2 gather (counted on the meta device)."""
    total: int
    largest_layer: int       # DeepSpeed: the module with the most parameters of its own
    largest_unit: int        # FSDP2: the largest of the layers of the largest ModuleList, and the root's rest
    units: tuple[tuple[int, int], ...] = ()   # with float8: each FSDP2 unit's (parameters, float8 weights' elements)

    def gathered_bytes(self, elem: int, float8: bool = False) -> int:
        """The largest unit's all-gathered parameters: ``elem`` bytes an element, its float8 layers'
        weights 1 byte where ``float8`` (the largest by bytes, which may be another unit)."""
        if not float8 or not self.units:
            return self.largest_unit * elem
        return max((n - f) * elem + f for n, f in self.units)


def count_layers(model: nn.Module, float8: Callable[[nn.Module], int] | None = None) -> Layers:
    """DeepSpeed's ``model_to_params`` (shared parameters once) and FSDP2's units as gpulab wraps them;
    with ``float8`` (a module's float8 weights' elements: ``training.fp8.float8_numel``), each unit's
    (``Layers.units``)."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        seen.setdefault(id(p), p.numel())
    total = sum(seen.values())
    largest_layer = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    units = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)
    if units is None:
        return Layers(total, largest_layer, total, ((total, float8(model)),) if float8 else ())
    per_unit = [sum(p.numel() for p in u.parameters()) for u in units]
    shape = ()
    if float8:
        f8 = [float8(u) for u in units]
        shape = (*zip(per_unit, f8), (total - sum(per_unit), float8(model) - sum(f8)))
    return Layers(total, largest_layer, max(max(per_unit), total - sum(per_unit)), tuple(shape))


def _shard(nbytes: int, n: int, rows: int = 0) -> int:
    """One rank's share of ``nbytes`` split ``n`` ways; with ``rows`` (FSDP2's ``Shard(0)`` of a tensor
    with that dim 0), rank 0's padded shard, ``ceil(rows / n)`` rows (``shard_rows``)."""
    if rows and n > 1 and nbytes % rows == 0:
        return -(-rows // n) * (nbytes // rows)
    return -(-nbytes // n)


def shard_rows(shape: tuple[int, ...], nbytes: int, itemsize: int, n: int, expert: bool = False) -> int:
    """The dim 0 FSDP2 splits a storage's tensor on, for rank 0's padded shard (0: split as bytes).
    ``fully_shard`` chunks each parameter on dim 0 (``FSDPParam._init_sharded_param``:
    ``_chunk_with_empty``, ``torch.chunk``'s ``ceil(d0 / n)`` rows a chunk) and allocates every rank's
    shard at ``chunks[0]``'s size (``padded_sharded_param = param_data.new_zeros(padded_sharded_size)``,
    "0th always padded"); the gradient is reduce-scattered into the same padded size, and the optimizer
    state follows the local shard (``ceil(d0 / n)`` rows on rank 0). So rank 0 holds ``ceil(d0 / n)``
    rows, more than ``numel / n`` where ``n`` does not divide d0: a router's 8-row gate over 16 ranks
    holds one row a rank, not half. Not where the storage's first tensor shape does not account for
    its bytes (a DTensor filed under its global shape), nor for a routed expert's weights with fewer
    rows (experts) than ranks, which torchtitan shards on dim 1 instead (``apply_fsdp_to_decoder``:
    ``Shard(1)`` when ``efsdp × ep`` exceeds E), an even split."""
    if not shape or n <= 1 or math.prod(shape) * itemsize != nbytes or (expert and shape[0] < n):
        return 0
    return shape[0]


def held_bytes(sharding: Sharding, cat: Category, nbytes: int, n: int, ds_scale: float = 1.0, rows: int = 0) -> int:
    """The bytes one rank holds under ``sharding`` of a storage of ``nbytes`` in category ``cat`` that
    the strategy splits over ``n`` ranks (module docstring; ``ds_scale``: DeepSpeed's fp32 state per
    parameter over the run's own state bytes; ``rows``: the storage's dim 0 under FSDP2, rank 0's
    padded shard, ``shard_rows``). ``per_rank`` resizes every storage by it; other categories are
    held whole."""
    s = sharding.strategy
    pad = rows if s == "fsdp2" else 0   # DeepSpeed splits a flat partition: bytes
    if cat is Category.OPTIMIZER_STATE:
        if sharding.offload_optimizer:
            return 0
        return _shard(int(math.ceil(nbytes * ds_scale)), n, pad) if s != "ddp" else nbytes
    if cat is Category.PARAMETERS:
        return _shard(nbytes, n, pad) if s in ("zero3", "fsdp2") else nbytes
    if cat is Category.GRADIENTS:
        if s == "zero3":   # reduced into the fp32 partition (in the 16 bytes) as they come
            return 0
        if s == "zero2":   # the 16-bit gradient partition (with the optimizer state on the host when offloaded)
            return 0 if sharding.offload_optimizer else _shard(nbytes, n)
        return _shard(nbytes, n, pad) if s == "fsdp2" else nbytes
    return nbytes


def per_rank(t: TrackingResult, sharding: Sharding, layers: Layers, param_elem: int,
             experts: frozenset[tuple[int, ...]] = frozenset()) -> TrackingResult:
    """``t`` (one GPU's two-step run) as one rank holds it under ``sharding``; storages of the shapes in
    ``experts`` split over ``gpus / ep`` ranks (module docstring)."""
    s = sharding.strategy
    cats = {sid: r.category for sid, r in t.records.items()}
    stepped = {sid for sid, r in t.records.items()   # the optimizer step's temporaries: the shard's (docstring)
               if r.category is Category.TEMPORARIES and r.phase == "optimizer"} if s != "ddp" else set()
    ranks = {sid: sharding.expert_ranks for sid, r in t.records.items() if tuple(r.shape) in experts}
    state_bytes = sum(r.nbytes for r in t.records.values() if r.category is Category.OPTIMIZER_STATE)
    params = sum(r.nbytes for r in t.records.values() if r.category is Category.PARAMETERS)
    # DeepSpeed's fp32 state per parameter, in place of the run's own state storages (by their share)
    ds_scale = (DS_STATE_BYTES * params / param_elem) / state_bytes if s in DEEPSPEED and state_bytes else 1.0

    master = ({sid for sid, r in t.records.items() if r.dtype == sharding.run_dtype and (
        r.category in (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE) or sid in stepped)}
        if sharding.master_elem else set())

    def size(cat: Category, nbytes: int, n: int, rows: int) -> int:
        return held_bytes(sharding, cat, nbytes, n, ds_scale, rows)

    def rows_of(sid: int, n: int) -> int:   # FSDP2's padded dim 0 (shard_rows); DeepSpeed's partitions: bytes
        if s != "fsdp2":
            return 0
        r = t.records[sid]
        return shard_rows(tuple(r.shape), r.nbytes, _itemsize(r.dtype), n, sid in ranks)   # ranks: the experts'

    events, sizes = [], {}
    for e in t.events:
        if e.kind == "free":
            nbytes = sizes.get(e.sid, e.nbytes)
            events.append(e.with_bytes(nbytes, -nbytes))
        else:
            n = ranks.get(e.sid, sharding.gpus)
            full = e.nbytes * sharding.master_elem // param_elem if e.sid in master else e.nbytes
            rows = rows_of(e.sid, n)
            nbytes = _shard(full, n, rows) if e.sid in stepped else size(cats[e.sid], full, n, rows)
            events.append(e.with_bytes(nbytes, nbytes - sizes.get(e.sid, 0)))
            sizes[e.sid] = nbytes
    records = dict(t.records)
    extra = strategy_extra(sharding, layers, param_elem, t)
    if extra:
        first_grad = next((i for i, e in enumerate(events) if e.kind == "alloc"
                           and cats[e.sid] is Category.GRADIENTS), 0)
        template = next(iter(t.records.values()))
        sid = max(records, default=-1) + 1
        for name, nbytes, at, *cat in extra:
            where = first_grad if at == "first gradient" else 0
            category = cat[0] if cat else Category.GRADIENTS if at == "first gradient" else Category.PARAMETERS
            rec = replace(template, sid=sid, nbytes=nbytes, category=category, op=name, shape=(nbytes,),
                          dtype="uint8", created=where)
            records[sid] = rec
            ev = replace(events[where] if events else Event(0, "alloc", sid, nbytes, nbytes, t.device, "", "", 0.0),
                         kind="alloc", sid=sid, nbytes=nbytes, delta=nbytes)
            events.insert(where, ev)
            sid += 1
    return TrackingResult.build(records, events, t.device, t.rounded)


def _itemsize(dtype: str) -> int:
    """Bytes an element of a record's dtype ("bfloat16", "float32" ...; 1 where torch has no such name)."""
    dt = getattr(torch, dtype, None)
    return dt.itemsize if isinstance(dt, torch.dtype) else 1


def strategy_extra(sharding: Sharding, layers: Layers, param_elem: int, t: TrackingResult) -> list[tuple[str, int, str]]:
    """(what, bytes, from when) the strategy adds on each rank."""
    s = sharding.strategy
    if s == "ddp":
        return [("ddp gradient buckets", one_step_gradients(t), "first gradient")]
    if s == "zero3":
        return [("zero3 gathered largest layer (16-bit weights and gradients)", 2 * layers.largest_layer * param_elem,
                 "start")]
    if s == "fsdp2":
        return fsdp2_units(sharding, layers, param_elem)
    return []


def fsdp2_units(sharding: Sharding, layers: Layers, param_elem: int) -> list[tuple]:
    """(what, bytes, from when[, category]) FSDP2 holds of its largest unit, unsharded: its parameters
    and gradients in the run's dtype; under a MixedPrecisionPolicy or the float8 all-gather each
    apart (module docstring), with the reduce-scatter input where the reduction casts."""
    unit = layers.largest_unit * param_elem
    if not (sharding.master_elem or sharding.reduce_elem or sharding.float8_all_gather):
        return [("fsdp2 largest unit gathered (weights) and unsharded (gradients)", 2 * unit, "start")]
    gathered = layers.gathered_bytes(param_elem, sharding.float8_all_gather)
    out = [(f"fsdp2 largest unit all-gathered ({'float8 weights, ' if sharding.float8_all_gather else ''}"
            f"{sharding.run_dtype or 'run dtype'})", gathered, "start", Category.PARAMETERS),
           (f"fsdp2 largest unit's unsharded gradients ({sharding.run_dtype or 'run dtype'})", unit, "start",
            Category.GRADIENTS)]
    if sharding.reduce_elem:
        out.append(("fsdp2 reduce-scatter input (reduce_dtype)", layers.largest_unit * sharding.reduce_elem, "start",
                    Category.GRADIENTS))
    return out


def one_step_gradients(t: TrackingResult) -> int:
    """The gradients' bytes of one step: those made before the optimizer's first storage (the
    run's later steps make theirs again when ``zero_grad`` sets them to None)."""
    first_opt = min((r.created for r in t.records.values() if r.phase == "optimizer"), default=None)
    return sum(r.nbytes for r in t.records.values() if r.category is Category.GRADIENTS
               and (first_opt is None or r.created < first_opt))


def model_state_bytes(n_params: int, sharding: Sharding, layers: Layers, param_elem: int, state_per_param: int) -> int:
    """The per-rank model-state bytes ``per_rank`` arrives at, by the strategy's formula alone (for
    the tests and the lesson: the ZeRO paper's terms with DeepSpeed's and FSDP2's bytes)."""
    n, s = sharding.gpus, sharding.strategy
    p = g = n_params * (sharding.master_elem or param_elem)
    state = 0 if sharding.offload_optimizer else (
        DS_STATE_BYTES * n_params if s in DEEPSPEED else state_per_param * n_params)
    if s == "ddp":
        return p + 2 * g + state
    if s == "zero1":
        return p + g + _shard(state, n)
    if s == "zero2":
        return p + (0 if sharding.offload_optimizer else _shard(g, n)) + _shard(state, n)
    if s == "zero3":
        return _shard(p, n) + _shard(state, n) + 2 * layers.largest_layer * param_elem
    return _shard(p, n) + _shard(g, n) + _shard(state, n) + sum(u[1] for u in fsdp2_units(sharding, layers, param_elem))


def deepspeed_estimate(n_params: int, sharding: Sharding, layers: Layers) -> int:
    """DeepSpeed's own GPU figure for the same setting, as its estimator functions compute it
    (``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs``,
    deepspeed 0.19, one node, no offload): 2Ψ + 18Ψ/N, and 4·largest layer + 18Ψ/N."""
    n = sharding.gpus
    if sharding.strategy == "zero2":
        return 2 * n_params + int(18 * n_params / n)
    if sharding.strategy == "zero3":
        return 4 * layers.largest_layer + int(18 * n_params / n)
    raise ValueError(f"DeepSpeed has no estimator for {sharding.strategy}")


__all__ = ["DEEPSPEED", "LABEL", "Layers", "STRATEGIES", "Sharding", "check_sharding", "count_layers",
           "deepspeed_estimate", "fsdp2_units", "held_bytes", "model_state_bytes", "one_step_gradients", "per_rank",
           "precision_policy", "shard_rows", "strategy_extra"]
