"""An 8-bit AdamW run's timeline derived from the AdamW run's, with no fake run of its own.

``what_fits`` tries "8-bit AdamW state" on the recipe it asked with AdamW: the same model, inputs,
forward and backward, only the optimizer changed. The optimizer's part of the timeline is the only part
that changes, and it changes in a way written in the two optimizers' source:

* ``torch.optim.AdamW`` (foreach, the default on CUDA tensors: ``torch/optim/adamw.py`` and
  ``torch/optim/adam.py``, ``Adam._init_group`` and ``_multi_tensor_adam``) makes, at its first step,
  each parameter's ``exp_avg`` then ``exp_avg_sq`` (``torch.zeros_like(p, memory_format=
  torch.preserve_format)``: the parameter's shape and dtype), its ``step`` a CPU scalar
  (``torch.tensor(0.0, ..., device="cpu")`` where neither ``capturable`` nor ``fused``) off the device's
  timeline; in every step it makes temporaries (``_foreach_sqrt``...), all freed in the step.
* ``gpulab.training.eight_bit.AdamW8bit`` (bitsandbytes' layout) makes, at its first step, for each
  parameter in the same order (``_init_state``): where it has at least ``MIN_8BIT_SIZE`` elements, a
  ``uint8`` ``state1`` and ``state2`` of its shape, then a ``float32`` ``absmax1`` and ``absmax2`` of
  ``ceil(n / BLOCK_SIZE)`` values; else a ``float32`` ``state1`` and ``state2`` of its shape; before its
  first large parameter, the two quantization maps (``quantization_map``: the signed one from a
  128-value ``logspace``, its ``flip`` and ``neg`` and a zero; the unsigned one from a zero and a
  255-value ``logspace``). On the fake CUDA target its update is one in-place op per tensor
  (``_fused_update``): nothing else is allocated, in any step.

``derive`` rewrites the AdamW timeline so: the AdamW step's temporaries dropped, each ``exp_avg`` /
``exp_avg_sq`` pair's allocations replaced by the 8-bit state's (the maps' events before the first large
one), their frees by the 8-bit state's frees, and the maps freed after the last parameter is (where the
run's end drops the optimizer). Stepped in backward (``LoopRecipe.optimizer_in_backward``: the loop's
``_InBackward``, one optimizer per parameter, each stepped by the parameter's post-accumulate-grad hook),
each large parameter's optimizer makes its own maps before its state and drops them after its
parameter is freed. It answers only a timeline it can read that way (the state made only where the
optimizer steps, nothing but the step's temporaries made in the optimizer phase, the state freed only
once nothing more is allocated), else None: then the candidate has a fake run of its own. A test
(tests/test_eight_bit_timeline.py) checks the derived timeline against the fake run's, event for event.
"""
from __future__ import annotations

import dataclasses
import math

from gpulab.categories import Category
from gpulab.measure.records import Event, StorageRecord, TrackingResult
from gpulab.training.eight_bit import BLOCK_SIZE, MIN_8BIT_SIZE
from gpulab.training.loop import LoopRecipe

__all__ = ["derivable", "derive"]

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
# quantization_map's allocations and frees, in the order the fake run makes them: ("alloc", name, op, float32
# values) or ("free", name)
# (signed: logspace(-7, 0, 128), mags[1:].flip(0), its neg, a zero, their cat; then the unsigned map from
# a zero and logspace(-7, 0, 255); each map a cat of 256 float32 values, kept by the optimizer)
_MAPS = (("alloc", "mags", "logspace", 128), ("alloc", "flipped", "flip", 127), ("alloc", "negated", "neg", 127),
         ("free", "flipped"), ("alloc", "zero", "zeros", 1), ("alloc", "qmap1", "cat", 256), ("free", "zero"),
         ("free", "negated"), ("free", "mags"),
         ("alloc", "zero2", "zeros", 1), ("alloc", "mags2", "logspace", 255), ("alloc", "qmap2", "cat", 256),
         ("free", "mags2"), ("free", "zero2"))


# the recipe fields ``derive`` has been checked under (tests/test_eight_bit_timeline.py): every other
# field keeps its default (one rank holding its parameters whole, no adapters, no scaler or clipping)
_CHECKED = frozenset({"optimizer", "optimizer_in_backward", "chunked_loss", "checkpointing"})


def derivable(recipe: LoopRecipe) -> bool:
    """Whether ``recipe``'s run is one ``derive`` reads: AdamW (PyTorch's default implementation), stepped
    once per step in the optimizer phase or parameter by parameter in backward, every field but
    ``_CHECKED``'s at its default."""
    plain = LoopRecipe()
    return recipe.optimizer == "adamw" and all(getattr(recipe, f.name) == getattr(plain, f.name)
                                               for f in dataclasses.fields(recipe) if f.name not in _CHECKED)


def derive(t: TrackingResult, in_backward: bool = False) -> TrackingResult | None:
    """The AdamW8bit run's timeline from the AdamW run's ``t`` (module docstring), or None where ``t`` is
    not a timeline this reads. ``in_backward``: the run steps one optimizer per parameter in backward
    (``LoopRecipe.optimizer_in_backward``)."""
    recs = t.records
    stepping = "backward" if in_backward else "optimizer"   # the phase the optimizer's tensors are made in
    dropped: set[int] = set()
    pairs: dict[int, tuple[int, int]] = {}    # exp_avg's sid -> (exp_avg_sq's sid, elements)
    second: set[int] = set()
    pending: int | None = None
    last_alloc = max((i for i, e in enumerate(t.events) if e.kind != "free"), default=-1)
    first_state_free = None
    for i, e in enumerate(t.events):
        r = recs[e.sid]
        if r.category is Category.OPTIMIZER_STATE:
            if r.phase != stepping or e.kind == "resize" or r.op != "zeros_like" or r.dtype not in _ITEMSIZE:
                return None
            if e.kind == "free":
                first_state_free = i if first_state_free is None else first_state_free
            elif r.state_key == "exp_avg" and pending is None:
                pending = e.sid
            elif r.state_key == "exp_avg_sq" and pending is not None and recs[pending].shape == r.shape \
                    and recs[pending].nbytes == r.nbytes and recs[pending].dtype == r.dtype:
                pairs[pending] = (e.sid, r.nbytes // _ITEMSIZE[r.dtype])
                second.add(e.sid)
                pending = None
            else:
                return None
        elif e.kind == "free" or r.phase not in ("backward", "optimizer"):
            continue
        elif _steps_temporary(r, in_backward):
            dropped.add(e.sid)
        elif r.phase == "optimizer":
            return None   # something else made in the optimizer phase
    if pending is not None or not pairs or first_state_free is not None and first_state_free < last_alloc:
        return None
    return _rewritten(t, dropped, pairs, second, in_backward)


def _steps_temporary(r: StorageRecord, in_backward: bool) -> bool:
    """Whether AdamW's step made ``r``, a tensor it frees within the step: in the optimizer phase, any
    temporary; stepped in backward, from a parameter's post-accumulate-grad hook (no module's: the
    tracker names none for an ``AccumulateGrad`` node), its ``_foreach_*`` results and the 0-d tensors
    ``torch.tensor`` lifts (``lift_fresh``: the step's scalars)."""
    if r.category is not Category.TEMPORARIES:
        return False
    if not in_backward:
        return r.phase == "optimizer"
    return r.phase == "backward" and r.module == "" and (r.op.startswith("_foreach_") or r.op == "lift_fresh"
                                                         and r.shape == ())


def _state_of(new, like: StorageRecord, n: int) -> list[int]:
    """The 8-bit state ``AdamW8bit._init_state`` makes for a parameter of ``n`` elements (``like``: its
    ``exp_avg``), each made by ``new(like, nbytes, dtype, shape, category, op, key)``."""
    if n >= MIN_8BIT_SIZE:
        blocks = math.ceil(n / BLOCK_SIZE)
        return [new(like, n, "uint8", like.shape, Category.OPTIMIZER_STATE, "zeros_like", "state1"),
                new(like, n, "uint8", like.shape, Category.OPTIMIZER_STATE, "zeros_like", "state2"),
                new(like, 4 * blocks, "float32", (blocks,), Category.OPTIMIZER_STATE, "zeros", "absmax1"),
                new(like, 4 * blocks, "float32", (blocks,), Category.OPTIMIZER_STATE, "zeros", "absmax2")]
    return [new(like, 4 * n, "float32", like.shape, Category.OPTIMIZER_STATE, "zeros_like", k)
            for k in ("state1", "state2")]


def _rewritten(t: TrackingResult, dropped: set[int], pairs: dict[int, tuple[int, int]], second: set[int],
               in_backward: bool) -> TrackingResult:
    recs = {sid: r.copied() for sid, r in t.records.items() if sid not in dropped and sid not in second
            and sid not in pairs}
    events: list[Event] = []
    next_sid = max(t.records, default=-1) + 1
    made: dict[int, list[int]] = {}     # exp_avg's sid -> the 8-bit state's sids
    maps: dict[int, list[int]] = {}     # exp_avg's sid -> the maps its optimizer made for it (its first large tensor)
    unfreed: list[int] = []             # maps whose optimizer is dropped once a parameter is freed
    last_param_free = max((i for i, e in enumerate(t.events) if e.kind == "free"
                           and t.records[e.sid].category is Category.PARAMETERS), default=len(t.events) - 1)

    def emit(kind: str, sid: int, like: Event) -> None:
        r = recs[sid]
        if kind == "alloc":
            r.created = len(events)
        else:
            r.freed = len(events)
        events.append(Event(like.index, kind, sid, r.nbytes, r.nbytes if kind == "alloc" else -r.nbytes,
                            like.device, like.phase, like.module, like.time))

    def new(like: StorageRecord, nbytes: int, dtype: str, shape: tuple, category: Category, op: str,
            key: str = "") -> int:
        nonlocal next_sid
        sid, next_sid = next_sid, next_sid + 1
        recs[sid] = StorageRecord(sid=sid, nbytes=nbytes, device=like.device, dtype=dtype, shape=shape,
                                  category=category, module=like.module, phase=like.phase, op=op, created=-1,
                                  state_key=key)
        return sid

    def made_maps(like: StorageRecord, e: Event) -> list[int]:
        names: dict[str, int] = {}
        for step in _MAPS:
            if step[0] == "alloc":
                _, name, op, values = step
                keep = name.startswith("qmap")
                names[name] = new(like, 4 * values, "float32", (values,),
                                  Category.OPTIMIZER_STATE if keep else Category.TEMPORARIES, op, name if keep else "")
                emit("alloc", names[name], e)
            else:
                emit("free", names[step[1]], e)
        return [names["qmap1"], names["qmap2"]]

    for i, e in enumerate(t.events):
        if e.sid in dropped or e.sid in second:
            continue
        if e.sid not in pairs:
            events.append(e)
            r = recs.get(e.sid)
            if r is not None and e.kind == "alloc":
                r.created = len(events) - 1
            elif r is not None and e.kind == "free":
                r.freed = len(events) - 1
            # the maps go with their optimizer: one per parameter, dropped once its parameter is (in backward);
            # else the run's one, dropped after the model
            if unfreed and e.kind == "free" and r is not None and r.category is Category.PARAMETERS \
                    and (in_backward or i == last_param_free):
                for sid in unfreed:
                    emit("free", sid, e)
                unfreed.clear()
            continue
        like = t.records[e.sid]
        n = pairs[e.sid][1]
        if e.kind == "free":
            for sid in made[e.sid]:
                emit("free", sid, e)
            if in_backward:
                unfreed.extend(maps.get(e.sid, ()))
            continue
        if n >= MIN_8BIT_SIZE:
            if in_backward or not maps:
                maps[e.sid] = made_maps(like, e)
                if not in_backward:
                    unfreed.extend(maps[e.sid])
        made[e.sid] = sids = _state_of(new, like, n)
        for sid in sids:
            emit("alloc", sid, e)
    for sid in unfreed:   # no parameter freed after them: at the end
        emit("free", sid, events[-1])
    return TrackingResult.build(recs, events, device=t.device, rounded=t.rounded)
