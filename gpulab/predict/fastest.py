"""``gpulab fit --fastest layout --gpus N``: the layouts of N GPUs for one recipe, each answered as
``gpulab fit`` answers it alone (its largest per-GPU batch, fake runs replayed through the simulated
allocator, and its predicted step time at that batch, ``predict.plan_time``), ranked by tokens (or
samples) a second, fastest first.

Which layouts are tried, and which are left out and why (before any fake run, some by a formula that
shows they are dominated or cannot fit), is ``predict.layout_choices``. Layouts of one rank shape
(the same tp, pp and ep: ddp, zero2, zero3 and fsdp2 differ only in what a rank keeps of the same
run) share their fake runs (``predict.run_cache``): a strategy costs allocator replays, and a run
only at a batch the others did not reach.

A plan's time is one rank's kernels (its tensor-parallel collectives on the critical path), the
data-parallel collectives' exposed part and the pipeline's bubble, each with its assumption named
(``plan_time.OVERLAP``, ``comm_time.COMM_ASSUMPTION``, ``plan_time.BUBBLE_SOURCE``, the card's
efficiencies); the answer carries them with every plan.

``predict.fastest_plans`` (plain ``--fastest --gpus N``) searches the recipes too, through the parts
here: ``setup``, ``choices`` (the layouts a recipe can take) and ``answer`` (one pair as ``fit`` answers it).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gpulab.predict.layout_choices import MAX_SHAPES, LayoutChoices, Skipped, layout_choices, memory_floor
from gpulab.predict.progress import Progress, report

__all__ = ["FastestLayouts", "LayoutPlan", "Setup", "answer", "choices", "fastest_layouts", "layouts_for",
           "setup"]


@dataclass
class LayoutPlan:
    """One layout answered: its mesh, the largest per-GPU (micro-)batch that fits, the memory there and
    the predicted step (``time``: ``plan_time.PlanTime``; None where nothing fits, ``note`` says why)."""
    layout: Any                     # gpulab.Layout
    largest_batch: int
    reserved_bytes: int
    needed_bytes: int
    capacity_bytes: int
    time: Any = None
    note: str = ""
    seconds: float = 0.0            # what answering it took here
    recipe: str = ""                # the recipe change answered (``predict.fastest_plans``): "" the asked recipe
    changes: dict[str, Any] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.largest_batch >= 1

    @property
    def timed(self) -> bool:
        """It fits and its step was predicted (``note`` says why not otherwise)."""
        return self.fits and self.time is not None

    @property
    def name(self) -> str:
        lay = self.layout
        parts = [f"tp {lay.tp}"] + (["sp"] if lay.sequence_parallel else []) + [f"pp {lay.pp}"]
        parts += [f"{lay.microbatches} micro-batches 1F1B"] if lay.pp > 1 else []
        parts += [f"ep {lay.ep}"] if lay.ep > 1 else []
        name = (f"{lay.strategy} dp {lay.dp}, " if lay.strategy else "dp 1, ") + ", ".join(parts)
        return name + (f" + {self.recipe}" if self.recipe else "")

    def as_dict(self) -> dict[str, Any]:
        t = self.time
        return {"name": self.name, "layout": self.layout.changed(), "mesh": self.layout.mesh,
                "mesh_dims": self.layout.mesh_dims, "largest_batch": self.largest_batch,
                "microbatches": self.layout.microbatches if self.layout.pp > 1 else None,
                "reserved_bytes": self.reserved_bytes, "needed_bytes": self.needed_bytes,
                "capacity_bytes": self.capacity_bytes, "fits": self.fits, "timed": self.timed, "note": self.note,
                "seconds": self.seconds, "recipe": self.recipe or "the asked recipe", "changes": self.changes,
                "time": None if t is None else t.as_dict()}


@dataclass
class FastestLayouts:
    """Every layout tried for one recipe on ``gpus`` GPUs (``plans``, in the order tried), those left
    out (``skipped``, each with why), and the ranking by predicted tokens (samples) a second."""
    model: str
    card: str
    gpus: int
    recipe: dict[str, Any]
    plans: list[LayoutPlan] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    seconds: float = 0.0
    fake_runs_note: str = ""
    assumptions: dict[str, str] = field(default_factory=dict)
    label: str = ""

    @property
    def ranked(self) -> list[LayoutPlan]:
        """The plans that fit and were timed, fastest first (most tokens or samples a second)."""
        return sorted((p for p in self.plans if p.timed), key=lambda p: -p.time.items_per_s)

    @property
    def fastest(self) -> LayoutPlan | None:
        r = self.ranked
        return r[0] if r else None

    @property
    def tried(self) -> int:
        return len(self.plans)

    def as_dict(self) -> dict[str, Any]:
        f = self.fastest
        return {"model": self.model, "card": self.card, "gpus": self.gpus, "recipe": self.recipe,
                "plans": [p.as_dict() for p in self.plans], "ranked": [p.name for p in self.ranked],
                "fastest": None if f is None else f.as_dict(), "tried": self.tried,
                "skipped": [s.as_dict() for s in self.skipped], "seconds": self.seconds,
                "assumptions": self.assumptions, "label": self.label}

    def __repr__(self) -> str:
        f = self.fastest
        return (f"FastestLayouts({self.model} on {self.gpus} × {self.card}: {self.tried} layouts tried, "
                f"{len(self.ranked)} fit; fastest: {f.name if f else 'none fits'})")

    def _repr_html_(self) -> str:
        from gpulab.views import html_table
        rows = [[p.name, p.largest_batch, f"{p.reserved_bytes / 2 ** 30:,.2f} GiB",
                 f"{p.time.seconds * 1e3:,.1f} ms" if p.time else "",
                 f"{p.time.items_per_s:,.0f}" if p.time else p.note] for p in self.ranked]
        return html_table(["layout", "batch per GPU", "reserved", "step", "tokens/s"], rows, repr(self))


def _params_and_shape(w: Any, dt: Any) -> tuple[int, int | None, int | None]:
    """(parameters, layers, routed experts) of the model, counted on the meta device."""
    import torch

    from gpulab.predict.sharding import count_layers
    from gpulab.training.expert_parallel import _EXPERT_FIELDS
    with torch.device("meta"):
        n = count_layers(w.build(torch.device("meta"), dt)).total
    layers = experts = None
    if w.kind == "tokens" and w.facts is not None and w.facts.depth_field:
        layers = int(getattr(w.config, w.facts.depth_field))
        experts = next((int(getattr(w.config, f)) for f in _EXPERT_FIELDS
                        if isinstance(getattr(w.config, f, None), int) and getattr(w.config, f) > 0), None)
    return n, layers, experts


@dataclass
class Setup:
    """What every layout of one question shares: the card (``place``, its ``speed`` row, the bytes
    ``usable``), the workload, its parameters, depth and routed experts (``_params_and_shape``)."""
    model: Any
    place: Any
    speed: Any
    usable: int
    w: Any
    seq_len: int | None
    image_size: int | None
    module_loading: str
    n_params: int
    layers: int | None
    experts: int | None
    gpus: int


def setup(model: Any, gpu: Any, gpus: int, recipe: Any, seq_len: int | None, image_size: int | None,
          context_bytes: int | None, module_loading: str) -> Setup:
    """The shared part of ``fastest_layouts`` (and ``predict.fastest_plans``), its input checked: one line
    for what cannot be answered."""
    from gpulab.options import Recipe
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 2:   # checked before torch and the model load
        raise ValueError(f"the fastest layout spreads the step over 2 or more GPUs, not gpus={gpus!r}: give --gpus N "
                         f"(N >= 2), or leave --gpus out for the fastest recipe on one GPU")
    if not isinstance(recipe, Recipe):
        raise ValueError(f"recipe must be a gpulab.Recipe, got {type(recipe).__name__}")
    from gpulab.models.workload import resolve_workload
    from gpulab.predict.fit import _place, usable_bytes
    from gpulab.predict.plan_time import speed_or_why
    from gpulab.units import model_dtype
    place = _place(gpu, context_bytes, module_loading, True)
    speed, why = speed_or_why(place.card)
    if speed is None:
        raise ValueError(f"the fastest layout ranks layouts by their predicted time: {why}")
    if speed.links is None:
        raise ValueError(f"{speed.name} has no link figures in gpulab's card table: its layouts' communication "
                         f"cannot be timed")
    w = resolve_workload(model, seq_len=seq_len, image_size=image_size)
    dt = model_dtype(recipe.dtype)
    n_params, layers, experts = _params_and_shape(w, dt)
    return Setup(model, place, speed, usable_bytes(place), w, seq_len, image_size, module_loading, n_params, layers,
                 experts, gpus)


def choices(s: Setup, recipe: Any, pinned: dict[str, Any], microbatches_per_stage: int,
            max_shapes: int | None) -> LayoutChoices:
    """The layouts ``s``'s GPUs can take for ``recipe`` (``predict.layout_choices``): each checked against
    the model and the recipe, those whose memory floor passes the card left out."""
    from gpulab import formulas as F
    from gpulab.options import settings_from
    from gpulab.predict.sharding import check_sharding
    from gpulab.training.loop import check_recipe_for, loop_recipe
    from gpulab.units import model_dtype
    dt = model_dtype(recipe.dtype)
    full = not (recipe.lora or recipe.quantize or recipe.param_dtype)
    # an optimizer without a whole multiple of the weights (8-bit state): none counted, still a floor
    k = F.optimizer_state_multiplier(recipe.optimizer) if recipe.optimizer in F.OPTIMIZER_STATES else 0

    def check(lay: Any) -> None:
        settings_from(recipe, lay, {})
        loop = loop_recipe(recipe, lay)
        check_recipe_for(loop, s.w, dt)
        if lay.strategy is not None:
            check_sharding(lay.sharded_over, lay.strategy, False, recipe.optimizer, dt)

    def floor(lay: Any) -> int:
        return memory_floor(s.n_params, dt.itemsize, k, lay, full, recipe.optimizer_in_backward)
    return layout_choices(s.gpus, s.speed.links.gpus_per_node, s.layers, s.experts, recipe, check, floor, s.usable,
                          pinned, microbatches_per_stage, max_shapes)


def answer(s: Setup, lay: Any, recipe: Any) -> LayoutPlan | Skipped:
    """``lay`` for ``recipe`` answered as ``gpulab.fit`` answers it alone (its largest batch and its step
    predicted there), or left out saying why (what only the fit sees: a shape a rank cannot take)."""
    from gpulab.predict.fit import fit
    t1 = time.perf_counter()
    try:
        r = fit(s.model, s.place.card, recipe=recipe, layout=lay, seq_len=s.seq_len, image_size=s.image_size,
                context_bytes=s.place.context_bytes, module_loading=s.module_loading, predict_time=True)
    except ValueError as why:
        return Skipped(lay.mesh + f", {lay.strategy or 'one replica'}", str(why))
    except RuntimeError as why:   # fit's batch search gave up (its fallback's run budget): said, not the whole answer
        if "the search needed more than" not in str(why):
            raise
        return Skipped(lay.mesh + f", {lay.strategy or 'one replica'}", f"gpulab fit could not answer it: {why}")
    return LayoutPlan(lay, r.largest_batch, r.reserved_bytes, r.needed_bytes, r.capacity_bytes, r.time, r.time_note,
                      time.perf_counter() - t1)


def fastest_layouts(model: Any, gpu: Any, gpus: int, *, recipe: Any = None, tp: int | None = None,
                    pp: int | None = None, ep: int | None = None, cp: int | None = None, strategy: str | None = None,
                    seq_len: int | None = None, image_size: int | None = None, context_bytes: int | None = None,
                    module_loading: str = "lazy", microbatches_per_stage: int = 4, max_shapes: int | None = MAX_SHAPES,
                    progress: Progress = None) -> FastestLayouts:
    """The layouts of ``gpus`` GPUs for ``recipe`` (a ``gpulab.Recipe``; None: ``gpulab.fit``'s default),
    each answered by ``gpulab.fit`` (module docstring), ranked by predicted tokens (samples) a second.
    ``tp``, ``pp``, ``ep``, ``strategy``: fixed where given, else tried over (``predict.layout_choices``);
    ``microbatches_per_stage``: a pipeline's micro-batches, that many per stage (1F1B). ``max_shapes``: the
    cost bound, rank shapes (tp, pp, ep) tried, fewest model-parallel GPUs first (None: every one).
    ``predict.fastest_plans`` searches the recipes too."""
    from gpulab.options import Recipe
    t0 = time.perf_counter()
    recipe = recipe if recipe is not None else Recipe()
    s = setup(model, gpu, gpus, recipe, seq_len, image_size, context_bytes, module_loading)
    pinned = {k2: v for k2, v in (("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp), ("strategy", strategy))
              if v is not None}
    return layouts_for(s, recipe, pinned, microbatches_per_stage, max_shapes, progress, t0)


def layouts_for(s: Setup, recipe: Any, pinned: dict[str, Any], microbatches_per_stage: int, max_shapes: int | None,
                progress: Progress, t0: float) -> FastestLayouts:
    """``fastest_layouts`` for ``s`` (``setup``'s), the degrees in ``pinned`` fixed; ``t0``: when the
    question began (``perf_counter``)."""
    chosen = choices(s, recipe, pinned, microbatches_per_stage, max_shapes)
    plans: list[LayoutPlan] = []
    for i, lay in enumerate(chosen.layouts):
        report(progress, i / max(1, len(chosen.layouts)), f"layout {i + 1} of {len(chosen.layouts)}: "
               f"{lay.mesh}, {lay.strategy or 'no data parallelism'}")
        got = answer(s, lay, recipe)
        (plans if isinstance(got, LayoutPlan) else chosen.skipped).append(got)
    return FastestLayouts(s.w.name, s.place.card.name, s.gpus,
                          {"optimizer": recipe.optimizer, "dtype": recipe.dtype, **recipe.changed()},
                          plans, chosen.skipped, time.perf_counter() - t0,
                          assumptions=_assumptions(s.speed, microbatches_per_stage),
                          label=f"each layout: gpulab fit's answer (fake runs, simulated allocator) and its step "
                                f"predicted (roofline, {s.speed.name})")


def _assumptions(speed: Any, microbatches_per_stage: int) -> dict[str, str]:
    """What every plan's time assumes, named: the card's efficiency, its links, NCCL's factors, the
    overlap per strategy, the pipeline's schedule and the batch each layout runs at."""
    from gpulab.predict.comm_time import COMM_ASSUMPTION
    from gpulab.predict.plan_time import BUBBLE_SOURCE, OVERLAP

    a = speed.assumptions
    return {
        "efficiency": f"{a.text} ({a.source})",
        "bandwidths": (f"NVLink {speed.links.nvlink_gbs} GB/s, network {speed.links.network_gbs} GB/s a direction, "
                       f"{speed.links.gpus_per_node} GPUs a node ({speed.links.source})"),
        "communication": COMM_ASSUMPTION,
        "overlap": "; ".join(f"{s}: {OVERLAP[s]}" for s in ("ddp", "zero2", "fsdp2")) + "; tensor parallelism's "
                   "collectives: on the critical path",
        "pipeline": f"1F1B with {microbatches_per_stage} micro-batches a stage; bubble {BUBBLE_SOURCE}",
        "batch": "each layout at the largest per-GPU (micro-)batch it fits, found as gpulab fit finds it",
    }
