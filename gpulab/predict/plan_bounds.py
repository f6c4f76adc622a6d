"""An upper bound on a plan's tokens (samples) a second at **any** batch, from fake runs already made:
what lets ``predict.fastest_plans`` leave a layout × recipe pair unrun when it cannot win.

gpulab's time model (``predict.timing``) costs each op ``max(F / C, Y / W) + launch`` (``C``: the card's
peak in the op's dtype × the compute efficiency; ``W``: its bandwidth × the memory efficiency), and each
op's FLOPs ``F`` and bytes ``Y`` are ``a + b·c`` in the batch ``b`` (``predict.run_ops``: the runs at
batches 2 and 3 pair up op for op). So one op's time a sample, ``t(b)/b``, is at least
``max(c_F / C, c_Y / W)`` at every batch, with ``c`` its per-sample slope (its intercept ``a`` at
least 0; where a figure's intercept is below 0, its value at batch 1 is taken instead: the lower of
the two). A collective is its bytes over the link (``comm_time.collective_seconds``, linear): its
slope likewise. Summed over the step's ops, that is a floor on the rank's time a sample that no batch
beats; the layout adds only time that does not shrink per sample (data-parallel collectives,
the optimizer step: at least 0) or, for a pipeline of ``p`` stages and ``m`` micro-batches, the
bubble: the step is at least ``(m + p − 1)`` stage times (``plan_time``). Hence

    items/s  ≤  dp · items a sample / floor          (× m / (m + p − 1) for a pipeline),

laid out to the full depth from the two small depths exactly as ``plan_time.timed_rank`` lays out
the time (the floor is a sum over ops, and the deeper run holds the shallower's ops and one more
period).

Reading only the runs ``run_cache`` kept with their ops (``kept_ops``: those ``gpulab fit``'s search
made at batches 2 and 3), it makes no fake run: where they are not kept, there is no bound (None).

The bound is the asked recipe's; ``predict.fastest_plans`` states, candidate by candidate, why it
bounds the candidate too (``SAME_OR_MORE``).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

__all__ = ["RECOMPUTE", "rate_bound", "slope_floor"]

RECOMPUTE = ("full activation checkpointing reruns each decoder layer's forward in the backward (transformers' "
             "activation_checkpointing_enable wraps each layer in torch.utils.checkpoint.checkpoint, use_reentrant="
             "False: models.adapt.enable_checkpointing): its forward ops once more")


def _slope(lo: int, hi: int) -> int:
    """A figure's per-sample slope from batches 2 (``lo``) and 3 (``hi``), or its value at batch 1 where
    its intercept is below 0: the lower of the two, a floor on figure / batch at every batch >= 1."""
    c = hi - lo
    a = lo - 2 * c
    return max(0, c + min(0, a))


def slope_floor(lo: Any, hi: Any, speed: Any, phase: str | None = None) -> float | None:
    """The floor on one rank's step seconds a sample (module docstring) from the ``RunOps`` of its runs at
    batches 2 (``lo``) and 3 (``hi``) on ``speed`` (a ``card_speeds.CardSpeed``); ``phase``: that phase's
    ops only ("forward"). None where their ops do not pair up one to one."""
    from gpulab.predict.comm_time import collective_seconds, link_for
    from gpulab.predict.run_ops import _same_op
    from gpulab.predict.timing import roofline_seconds
    if len(lo.ops) != len(hi.ops) or not all(map(_same_op, lo.ops, hi.ops)):
        return None
    a = speed.assumptions
    total = 0.0
    for o, p in zip(lo.ops, hi.ops):
        if phase is not None and o.phase != phase:
            continue
        f, y = _slope(o.flops, p.flops), _slope(o.nbytes, p.nbytes)
        if o.kind != "kernel":
            if speed.links is not None:
                bw, _ = link_for(speed.links, o.group)
                total += collective_seconds(o.kind, y, o.group, bw) if bw else 0.0
            continue
        c, m = roofline_seconds(f, y, speed.peak_flops(o.dtype) if f else 1.0, speed.bandwidth_bytes_s, a)
        total += max(c, m)
    return total


def _kept(w: Any, key: tuple | None, depth: int | None, batch: int, dt: Any, recipe: Any, target: tuple):
    from gpulab.predict import layer_pattern, run_cache
    if key is None:
        return None
    if depth is not None:
        w = layer_pattern.workload_with_depth(w, depth)
        key = run_cache.workload_key(w.config, w, own_parts=False)
    return run_cache.kept_ops(run_cache.run_key(key, recipe, dt, batch, target))


def _rank_floor(w: Any, key: tuple | None, dt: Any, recipe: Any, speed: Any, target: tuple,
                recompute: bool = False) -> float | None:
    """The rank's floor a sample at ``w``'s full depth, laid out from its two small depths as
    ``plan_time.timed_rank`` lays the time out (or at the full depth where that is what was run).
    ``recompute``: plus every repeated layer's forward once more (full activation checkpointing reruns
    each decoder layer's forward in the backward: ``RECOMPUTE``), that layer's forward floor being the
    two depths' difference (none where the full depth was run: still a floor)."""
    from gpulab.predict import layer_pattern
    from gpulab.predict.fake_runs import not_laid_out
    pattern = None if not_laid_out(w, recipe) is not None else layer_pattern.block_pattern(w.config, min_depth=0,
                                                                                          facts=w.facts)
    if isinstance(pattern, str):
        pattern = None
    if pattern is None:
        depths: list[int | None] = [None]
    else:
        full = getattr(w.config, w.facts.depth_field)
        d1, d2, _ = pattern.depths(full)
        depths = [d1, d2]
    floors, forwards = [], []
    for d in depths:
        lo, hi = _kept(w, key, d, 2, dt, recipe, target), _kept(w, key, d, 3, dt, recipe, target)
        s = None if lo is None or hi is None else slope_floor(lo, hi, speed)
        if s is None:
            return None
        floors.append(s)
        forwards.append(slope_floor(lo, hi, speed, "forward") if recompute else 0.0)
    if len(floors) == 1:
        return floors[0]
    f = (full - d1) / (d2 - d1)
    again = max(0.0, (forwards[1] - forwards[0]) / (d2 - d1)) * (full - pattern.prefix)
    return max(0.0, floors[0] + f * (floors[1] - floors[0])) + again


def rate_bound(w: Any, key: tuple | None, dt: Any, recipe: Any, layout: Any, speed: Any,
               target: tuple, recompute: bool = False) -> float | None:
    """An upper bound on the tokens (samples) a second of ``recipe`` (a ``training.loop.LoopRecipe``) under
    ``layout`` (a ``gpulab.Layout``) at any per-GPU batch, from the runs ``gpulab fit``'s search kept at
    batches 2 and 3 (module docstring); None where they are not kept (no bound: the pair is run).
    ``recompute``: the bound for the same recipe with full activation checkpointing (``_rank_floor``)."""
    per = w.seq_len if w.kind == "tokens" and w.seq_len else 1
    items = per * recipe.accumulate * layout.dp
    if recipe.pp == 1:
        floor = _rank_floor(w, key, dt, recipe, speed, target, recompute)
        return None if floor is None else (float("inf") if floor <= 0 else items / floor)
    from gpulab.predict import layer_pattern
    stage_w = layer_pattern.workload_with_depth(w, w.config.num_hidden_layers // recipe.pp)
    floors = [_rank_floor(stage_w, key, dt, replace(recipe, pp_stage=s, microbatches=1), speed, target, recompute)
              for s in (0, recipe.pp - 1)]
    floors = [f for f in floors if f is not None]
    if not floors or max(floors) <= 0:   # the slowest stage sets the pace: any stage's floor bounds it
        return None
    m, p = recipe.microbatches, recipe.pp
    return items * m / ((m + p - 1) * max(floors))
