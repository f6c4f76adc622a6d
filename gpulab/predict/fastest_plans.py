"""``gpulab fit --fastest --gpus N``: the fastest plan that fits, across recipes × layouts.

The recipes are the asked one and each single change ``--what-fits`` knows (``what_fits.CANDIDATES``,
where it applies to the asked recipe: the loss in chunks, the optimizer step in backward, bf16,
8-bit AdamW state, selective then full activation checkpointing); LoRA and QLoRA are left out, said
so: they change what is trained, not how. The layouts are ``predict.layout_choices``'s for each
recipe. Every pair run is answered as ``gpulab fit`` answers it alone (its largest per-GPU batch, its
step predicted there: ``predict.fastest.answer``), and those that fit are ranked by tokens (samples)
a second.

The cost is bounded, every pair not run said with why:

1. **The asked recipe first**, over its layouts (``predict.fastest.fastest_layouts``): the incumbent.
2. **Memory**: a pair whose weights, gradients and optimizer state alone pass the card (the formula
   floor of ``layout_choices.memory_floor`` for that recipe: 8-bit state and the step in backward
   lower it) is not run.
3. **Time**: a pair whose tokens a second at *any* batch are bounded (``predict.plan_bounds``, from
   the asked recipe's runs on the same rank shape, kept by ``run_cache``) at or below the fastest
   plan found so far is not run. The asked recipe's bound holds for a change because of what the
   change does to the step's ops a sample (``SAME_OR_MORE``); full checkpointing's bound adds its
   recompute (``plan_bounds.RECOMPUTE``). bf16 changes every op's rate: never pruned by time.
   The pairs are run highest bound first, so the incumbent rises early.

A change's pairs on one rank shape (its strategies) share their fake runs (``run_cache``), as the
asked recipe's do.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace
from typing import Any

from gpulab.predict.fastest import FastestLayouts, LayoutPlan, answer, choices, layouts_for, setup
from gpulab.predict.layout_choices import MAX_SHAPES
from gpulab.predict.progress import Progress, report

__all__ = ["FastestPlans", "Pruned", "SAME_OR_MORE", "fastest_plans", "recipe_changes"]

# why the asked recipe's time bound (plan_bounds.rate_bound) bounds each change's too: what the change
# does to the ops a sample of the forward and backward (the optimizer's ops do not grow with the batch)
SAME_OR_MORE = {
    "chunked_loss": "the loss in chunks: the same matmuls a sample, in more kernels",
    "optimizer_in_backward": "the step in backward: the same forward and backward ops",
    "optimizer": "8-bit state: the same forward and backward ops",
    "selective": "selective checkpointing: the same ops and the recomputed pointwise ones",
    "full": "full checkpointing: the same ops and every layer's forward again",
}


@dataclass(frozen=True)
class Pruned:
    """A layout × recipe pair not run, and why: ``bound`` "memory" (its floor passes the card), "time"
    (its bound cannot beat the fastest found), "refused" (the layout cannot take the change) or "cost"
    (a rank shape the asked recipe did not run: the cost bound)."""
    layout: str
    recipe: str
    bound: str
    why: str
    rate: float | None = None   # "time": the bound on its tokens (samples) a second

    def as_dict(self) -> dict[str, Any]:
        return {"layout": self.layout, "recipe": self.recipe, "bound": self.bound, "why": self.why, "rate": self.rate}


@dataclass
class FastestPlans(FastestLayouts):
    """``FastestLayouts`` across recipes: ``plans`` holds every pair run (``LayoutPlan.recipe`` names the
    change, "" the asked recipe), ``pruned`` every pair not run and why, ``recipes`` those searched and
    ``recipes_left_out`` those not, with why."""
    recipes: list[str] = field(default_factory=list)
    recipes_left_out: list[str] = field(default_factory=list)
    pruned: list[Pruned] = field(default_factory=list)

    def count(self, bound: str) -> int:
        return sum(p.bound == bound for p in self.pruned)

    @property
    def pairs(self) -> int:
        """Layout × recipe pairs considered: run, or pruned (layouts left out for every recipe not counted)."""
        return self.tried + len(self.pruned)

    def as_dict(self) -> dict[str, Any]:
        return {**super().as_dict(), "recipes": self.recipes, "recipes_left_out": self.recipes_left_out,
                "pruned": [p.as_dict() for p in self.pruned], "pairs": self.pairs,
                "pruned_memory": self.count("memory"), "pruned_time": self.count("time"),
                "refused": self.count("refused"), "cost_bound": self.count("cost")}

    def __repr__(self) -> str:
        f = self.fastest
        return (f"FastestPlans({self.model} on {self.gpus} × {self.card}: {self.pairs} layout × recipe pairs, "
                f"{self.tried} run, {self.count('memory')} pruned by memory, {self.count('time')} by time; "
                f"fastest: {f.name if f else 'none fits'})")


def recipe_changes(recipe: Any, w: Any) -> tuple[list[tuple[Any, Any]], list[str]]:
    """The single changes of ``recipe`` searched, as (``what_fits.Candidate``, the changed ``gpulab.Recipe``),
    and those left out, each with why (module docstring)."""
    from gpulab.predict.what_fits import CANDIDATES, _applies
    from gpulab.units import parse_dtype
    asked = {f.name: getattr(recipe, f.name) for f in fields(recipe)}
    asked["dtype"] = parse_dtype(recipe.dtype) if recipe.dtype is not None else None
    causal = w.facts is not None and w.facts.task == "causal-lm"
    out, left = [], []
    for c in CANDIDATES:
        if "lora" in c.changes:
            left.append(f"{c.name}: it changes what is trained (adapters only), not how the same training runs")
            continue
        if not _applies(c, asked, w.kind, causal):
            continue   # already in the asked recipe, or not for this model or optimizer
        try:
            out.append((c, replace(recipe, **c.changes)))
        except ValueError as why:
            left.append(f"{c.name}: {why}")
    return out, left


def _premise(changes: dict[str, Any]) -> str | None:
    """Why the asked recipe's bound bounds this change (None: it does not, e.g. another dtype)."""
    if "dtype" in changes:
        return None
    k = changes.get("checkpointing") or next(iter(changes))
    return SAME_OR_MORE.get(k)


def fastest_plans(model: Any, gpu: Any, gpus: int, *, recipe: Any = None, tp: int | None = None,
                  pp: int | None = None, ep: int | None = None, cp: int | None = None, strategy: str | None = None,
                  seq_len: int | None = None, image_size: int | None = None, context_bytes: int | None = None,
                  module_loading: str = "lazy", microbatches_per_stage: int = 4, max_shapes: int | None = MAX_SHAPES,
                  progress: Progress = None) -> FastestPlans:
    """The fastest plan that fits ``gpus`` GPUs across the recipes and layouts of the module docstring,
    ``recipe`` (a ``gpulab.Recipe``; None: ``gpulab.fit``'s default) the asked one. The layout keywords
    are ``predict.fastest.fastest_layouts``'s (it answers the asked recipe alone, layouts only)."""
    from gpulab.options import Recipe
    t0 = time.perf_counter()
    recipe = recipe if recipe is not None else Recipe()
    s = setup(model, gpu, gpus, recipe, seq_len, image_size, context_bytes, module_loading)
    pinned = {k: v for k, v in (("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp), ("strategy", strategy)) if v is not None}
    base = layouts_for(s, recipe, pinned, microbatches_per_stage, max_shapes, progress, t0)   # the asked recipe
    changes, left = recipe_changes(recipe, s.w)
    pruned: list[Pruned] = []
    pairs = _pairs(s, recipe, changes, pinned, microbatches_per_stage, max_shapes, base, pruned)
    plans, best = list(base.plans), base.fastest
    for i, (bound, lay, c, r) in enumerate(pairs):
        name = LayoutPlan(lay, 0, 0, 0, 0).name
        if bound is not None and best is not None and bound <= best.time.items_per_s:
            unit = best.time.unit
            pruned.append(Pruned(name, c.name, "time", f"at most {bound:,.0f} {unit}/s at any batch (the asked "
                                 f"recipe's runs on this rank shape, plan_bounds; {_premise(c.changes)}), not more "
                                 f"than {best.name}'s {best.time.items_per_s:,.0f}", bound))
            continue
        report(progress, i / max(1, len(pairs)), f"pair {i + 1} of {len(pairs)}: {name} + {c.name}")
        got = answer(s, lay, r)
        if not isinstance(got, LayoutPlan):
            pruned.append(Pruned(name, c.name, "refused", got.why))
            continue
        got.recipe, got.changes = c.name, dict(c.changes)
        plans.append(got)
        if got.timed and (best is None or got.time.items_per_s > best.time.items_per_s):
            best = got
    assumptions = {**base.assumptions, "recipes": "each recipe at its own largest batch; a pair is left unrun where "
                   "its memory floor passes the card or its time bound cannot beat the fastest found (plan_bounds)",
                   "time bound": "tokens/s at any batch <= dp x tokens a sample / the sum over the step's ops of "
                   "max(FLOPs a sample / compute, bytes a sample / bandwidth) (each op affine in the batch: the asked "
                   "recipe's runs at batches 2 and 3), x m/(m + p - 1) for a pipeline; a change's is the asked "
                   "recipe's because of what it does to the ops a sample: " + "; ".join(SAME_OR_MORE.values())}
    return FastestPlans(base.model, base.card, gpus, base.recipe, plans, base.skipped, time.perf_counter() - t0,
                        assumptions=assumptions,
                        label=base.label, recipes=["the asked recipe"] + [c.name for c, _ in changes],
                        recipes_left_out=left, pruned=pruned)


def _pairs(s: Any, recipe: Any, changes: list, pinned: dict, microbatches_per_stage: int, max_shapes: int | None,
           base: FastestLayouts, pruned: list[Pruned]) -> list[tuple[float | None, Any, Any, Any]]:
    """Each change's layouts as (its time bound or None, layout, candidate, recipe), highest bound first
    (unbounded ones first of all); those its memory floor or checks leave out go to ``pruned``. Every
    bound is read before any change runs: the asked recipe's kept runs are still in ``run_cache``."""
    from gpulab.predict import run_cache
    from gpulab.predict.fit import _target
    from gpulab.predict.plan_bounds import rate_bound
    from gpulab.training.loop import loop_recipe
    from gpulab.units import model_dtype
    key, target = run_cache.workload_key(s.model, s.w, own_parts=False), _target(s.place.card)
    dt = model_dtype(recipe.dtype)
    asked_left = {(k.what, k.why) for k in base.skipped}
    shapes = {(p.layout.tp, p.layout.pp, p.layout.ep) for p in base.plans}
    bounds: dict[tuple, float | None] = {}
    out = []
    for c, r in changes:
        # the asked recipe's rank shapes (its bounds read from their runs); its own first ones where it had none
        chosen = choices(s, r, pinned, microbatches_per_stage, None if shapes else max_shapes)
        for k in chosen.skipped:   # a refusal only on the shapes tried (a shape not tried is named once, below)
            if (k.what, k.why) not in asked_left and (k.memory or not shapes or k.shape is None or k.shape in shapes):
                kind = "memory" if k.memory else "cost" if "the cost bound" in k.why else "refused"
                pruned.append(Pruned(k.what, c.name, kind, k.why))
        other = {}
        for lay in chosen.layouts:
            at = (lay.tp, lay.pp, lay.ep)
            if shapes and at not in shapes:
                other[at] = other.get(at, 0) + 1
                continue
            full = c.changes.get("checkpointing") == "full"
            if _premise(c.changes) is not None and (at, lay.dp, lay.microbatches, full) not in bounds:
                bounds[at, lay.dp, lay.microbatches, full] = rate_bound(s.w, key, dt, loop_recipe(recipe, lay), lay,
                                                                        s.speed, target, full)
            bound = bounds[at, lay.dp, lay.microbatches, full] if _premise(c.changes) is not None else None
            out.append((bound, lay, c, r))
        pruned += [Pruned(f"tp {t}, pp {p}" + (f", ep {e}" if e > 1 else "") + f" ({n} layout{'s' if n > 1 else ''})",
                          c.name, "cost", f"not tried, the cost bound: a change is tried on the asked recipe's rank "
                          f"shapes (their runs bound its time); fix --tp {t} --pp {p} to try it") for (t, p, e), n in
                   other.items()]
    return sorted(out, key=lambda p: -(float("inf") if p[0] is None else p[0]))
