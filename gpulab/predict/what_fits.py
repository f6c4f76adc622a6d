"""``what_fits``: when a training recipe does not fit a card, the recipes that do, each confirmed
by a fake run (or derived, event for event, from one).

Each candidate changes the asked recipe in one way people reach for (a smaller loss working set,
the optimizer stepped in backward, bf16, 8-bit optimizer state, selective then full activation
checkpointing, LoRA, QLoRA), and is run at the asked batch on the fake engine (CUDA's kernels) and
replayed through the simulated caching allocator against the card less the CUDA context, as ``gpulab fit``
checks a batch. 8-bit AdamW state changes only the optimizer's tensors: where the same recipe with AdamW
was run here, its timeline is derived from that run's (``predict.eight_bit_timeline``: the 8-bit run's,
event for event) and replayed, with no fake run of its own. If no single change fits, the changes are
stacked in order of what they cost until the stack fits. Candidates are ranked by that cost: first what changes nothing of the result (the loss in
chunks, the step in backward), then precision (bf16, 8-bit state), then compute (recomputing
activations), then what is trained (LoRA, then QLoRA's 4-bit base).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from gpulab.measure.cuda_card import current_target
from gpulab.measure.engines import LABEL_FAKE_CUDA, LABEL_SIMULATED
from gpulab.models.workload import resolve_workload
from gpulab.predict import eight_bit_timeline, run_cache
from gpulab.predict.cards import follows_card
from gpulab.predict.fit import _place, _target, tracked_at_depth, verdict
from gpulab.predict.progress import Progress, report
from gpulab.training.loop import RECIPE_DEFAULTS, check_recipe_for, user_recipe
from gpulab.units import dtype_name, format_bytes, parse_dtype

__all__ = ["CANDIDATES", "Candidate", "WhatFits", "what_fits"]

_ADAM = ("adam", "adamw")


@dataclass(frozen=True)
class Candidate:
    name: str
    cost: str          # what it costs, in words
    rank: int          # order of cost: lower is cheaper
    changes: dict[str, Any]


CANDIDATES = (
    Candidate("loss in 8 chunks", "a little time (the head runs as smaller matmuls): the same loss, its float32 logits a chunk at a time", 0,
              {"chunked_loss": 8}),
    Candidate("optimizer step in backward", "no gradient accumulation or clipping with it", 1,
              {"optimizer_in_backward": True}),
    Candidate("bf16 weights, gradients and optimizer state", "precision: no float32 master weights", 2,
              {"dtype": "bf16"}),
    Candidate("8-bit AdamW state (bitsandbytes)", "precision of the optimizer state", 3, {"optimizer": "adamw8bit"}),
    Candidate("selective activation checkpointing", "the pointwise ops (norms, activation functions) run again "
              "in backward; the matmuls and attention are kept", 4, {"checkpointing": "selective"}),
    Candidate("activation checkpointing", "up to a third more compute (each block's forward again)", 5,
              {"checkpointing": "full"}),
    Candidate("LoRA rank 16", "only adapters train (peft's default layers)", 6, {"lora": 16}),
    Candidate("QLoRA (NF4 base, LoRA rank 16)", "only adapters train, on a 4-bit base", 7,
              {"lora": 16, "quantize": "nf4"}),
)


@dataclass(frozen=True)
class Tried:
    name: str
    cost: str
    changes: dict[str, Any]
    reserved_bytes: int        # simulated peak reserved at the batch
    fits: bool
    saved_bytes: int           # against the asked recipe's reserved peak
    time: dict[str, Any] | None = None   # a fitting one's predicted step (predict.plan_time.PlanTime.as_dict)


@dataclass
class WhatFits:
    model: str
    card: str
    capacity_bytes: int
    context_bytes: int
    batch: int
    asked: dict[str, Any]
    asked_reserved_bytes: int
    asked_fits: bool
    tried: list[Tried] = field(default_factory=list)
    seconds: float = 0.0
    label: str = f"{LABEL_FAKE_CUDA}, replayed through the {LABEL_SIMULATED}"
    left_out: list[str] = field(default_factory=list)   # candidates the asked layout cannot take, and why
    asked_time: dict[str, Any] | None = None   # the asked recipe's predicted step, where it fits
    time_note: str = ""                        # why there are no times (a card without speed figures)

    @property
    def fitting(self) -> list[Tried]:
        """The candidates that fit, cheapest first (the order they were tried in)."""
        return [t for t in self.tried if t.fits]

    @property
    def ranked(self) -> list[Tried]:
        """The candidates that fit, fastest first by predicted step time (untimed ones last)."""
        return sorted(self.fitting, key=lambda t: t.time["seconds"] if t.time else float("inf"))

    @property
    def fastest(self) -> dict[str, Any] | None:
        """The fastest plan that fits, the asked recipe among them: name, changes and time (None: none timed)."""
        plans = [{"name": t.name, "changes": t.changes, "time": t.time} for t in self.tried if t.fits and t.time]
        if self.asked_time is not None:
            plans.append({"name": "the asked recipe", "changes": {}, "time": self.asked_time})
        return min(plans, key=lambda p: p["time"]["seconds"], default=None)

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "card": self.card, "capacity_bytes": self.capacity_bytes,
                "context_bytes": self.context_bytes, "batch": self.batch, "asked": self.asked,
                "asked_reserved_bytes": self.asked_reserved_bytes, "asked_fits": self.asked_fits,
                "tried": [t.__dict__ for t in self.tried], "fitting": [t.name for t in self.fitting],
                "ranked_by_time": [t.name for t in self.ranked],
                "seconds": self.seconds, "label": self.label, "left_out": self.left_out,
                "asked_time": self.asked_time, "time_note": self.time_note, "fastest": self.fastest}

    def __repr__(self) -> str:
        return (f"WhatFits({self.model} on {self.card} at batch {self.batch}: "
                + (", ".join(t.name for t in self.fitting) or "nothing tried fits") + ")")

    def _repr_html_(self) -> str:
        from gpulab.views import html_table
        rows = [[t.name, format_bytes(t.reserved_bytes), format_bytes(t.saved_bytes), "fits" if t.fits else "no",
                 t.cost] for t in self.tried]
        return html_table(["recipe", "reserved (simulated)", "saved", "", "what it costs"], rows, repr(self))


def _frozen(changes: dict[str, Any]) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in changes.items()))


def _applies(c: Candidate, asked: dict[str, Any], kind: str, causal: bool) -> bool:
    if c.changes.get("chunked_loss") and not causal:
        return False
    if (c.changes.get("lora") or c.changes.get("checkpointing")) and kind != "tokens":
        return False
    if c.changes.get("checkpointing") and asked.get("checkpointing"):   # already checkpointed: no other policy
        return False
    if c.changes.get("optimizer") and asked["optimizer"] not in _ADAM:
        return False
    if c.changes.get("dtype") and asked.get("dtype") not in (None, torch.float32):
        return False
    if c.changes.get("optimizer_in_backward") and (asked["accumulate"] > 1 or asked["clip_grad_norm"]):
        return False
    return all(asked.get(k) != v for k, v in c.changes.items())


def _stacks(candidates: list[Candidate], attempt, asked_reserved: int) -> list[Tried]:
    """The candidates stacked, cheapest first, each stack tried (``attempt(changes, name)``) until one fits;
    a candidate that sets what an earlier one set replaces it (full checkpointing the selective kind,
    QLoRA plain LoRA)."""
    chosen: list[Candidate] = []
    tried: list[Tried] = []
    for c in candidates:
        chosen = [c2 for c2 in chosen if not set(c2.changes) <= set(c.changes)] + [c]
        if len(chosen) < 2:
            continue
        stacked = {k: v for c2 in chosen for k, v in c2.changes.items()}
        reserved, fits = attempt(stacked, " + ".join(c2.name for c2 in chosen))
        tried.append(Tried(" + ".join(c2.name for c2 in chosen), "all of: " + "; ".join(c2.cost for c2 in chosen),
                           stacked, reserved, fits, asked_reserved - reserved))
        if fits:
            break
    return tried


@follows_card   # the candidates' fake runs follow the card's kernels, as fit's do
def what_fits(model: Any, gpu: Any, *, batch: int = 1, optimizer: str = "adamw", dtype: Any = None,
              amp: str | None = None, seq_len: int | None = None, image_size: int | None = None,
              context_bytes: int | None = None, module_loading: str = "lazy", progress: Progress = None,
              predict_time: bool = True, **options: Any) -> WhatFits:
    """The asked recipe (``optimizer``, ``dtype``, ``amp`` and the recipe ``options`` of
    ``gpulab.fit``) at ``batch`` on ``gpu``, then each candidate change, then stacked changes (see the
    module docstring). Every figure is a fake run replayed through the simulated allocator; a run this
    process made already (``gpulab.fit`` at the same batch) is reused. ``progress(fraction, text)``: told
    before each candidate (``predict.progress``). ``predict_time``: each recipe that fits gets its predicted
    step time (``predict.plan_time``), and ``ranked`` orders them by it."""
    t0 = time.perf_counter()
    place = _place(gpu, context_bytes, module_loading, predict_time)
    usable = max(0, place.card.reported_total_bytes - place.context_bytes - place.card.workspace_bytes())
    w = resolve_workload(model, seq_len=seq_len, image_size=image_size)
    key, target = run_cache.workload_key(model, w, own_parts=False), _target(place.card)
    base_dt = parse_dtype(dtype) if dtype is not None else torch.float32
    unknown = sorted(set(options) - set(RECIPE_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown recipe option(s) {', '.join(unknown)}; valid: {', '.join(RECIPE_DEFAULTS)}")
    defaults = {**RECIPE_DEFAULTS, **options}

    def recipe_of(changes: dict[str, Any]):
        opts = {**defaults, **{k: v for k, v in changes.items() if k not in ("optimizer", "dtype")}}
        return user_recipe(changes.get("optimizer", optimizer), amp, **opts)

    bases: dict[tuple, Any] = {}   # the AdamW runs an 8-bit AdamW candidate's timeline is derived from

    def attempt(changes: dict[str, Any], name: str = "the asked recipe") -> tuple[int, bool]:
        recipe = recipe_of(changes)
        check_recipe_for(recipe, w)
        dt = parse_dtype(changes["dtype"]) if "dtype" in changes else base_dt
        base = {k: v for k, v in changes.items() if k != "optimizer"}
        t = eight_bit_timeline.derive(bases[_frozen(base)], recipe.optimizer_in_backward) \
            if changes.get("optimizer") == "adamw8bit" and _frozen(base) in bases else None
        report(progress, len(tried) / (len(CANDIDATES) + 2), f"what fits at batch {batch}: {name}, "
               + ("derived from its AdamW run's timeline (predict.eight_bit_timeline)" if t is not None else
                  "a fake run") + " replayed through the simulated caching allocator")
        if t is None:
            t, _ = tracked_at_depth(w, key, batch, dt, recipe, target, place.timed)   # timed: read by the time below
            if eight_bit_timeline.derivable(recipe):
                bases[_frozen(changes)] = t
        return verdict(t, usable)   # what it needs on a card without a limit, when it fails

    tried: list[Tried] = []
    asked_reserved, asked_fits = attempt({})
    asked = {"optimizer": optimizer, "dtype": base_dt, **defaults}
    causal = w.facts is not None and w.facts.task == "causal-lm"
    usable_candidates, left_out = [], []
    for c in (c for c in CANDIDATES if _applies(c, asked, w.kind, causal)):
        try:   # what the asked layout (tp, pp, ...) cannot take is left out, saying why, not the whole answer
            recipe_of(c.changes)
        except ValueError as why:
            left_out.append(f"{c.name} ({why})")
            continue
        usable_candidates.append(c)
    for c in usable_candidates:
        reserved, fits = attempt(c.changes, c.name)
        tried.append(Tried(c.name, c.cost, c.changes, reserved, fits, asked_reserved - reserved))
    if not any(t.fits for t in tried):   # stack them, cheapest first, until the stack fits
        tried += _stacks(usable_candidates, attempt, asked_reserved)
    asked_time, time_note = None, ""
    if predict_time:
        from gpulab.predict.plan_time import Runs, time_candidates
        asked_time, tried, time_note = time_candidates(w, batch, base_dt, recipe_of, asked_fits, tried, place.card,
                                                       progress, Runs(key, target))
    return WhatFits(w.name, place.card.name, place.card.reported_total_bytes, place.context_bytes, batch,
                    {k: (dtype_name(v) if isinstance(v, torch.dtype) else v) for k, v in asked.items()
                     if k in ("optimizer", "dtype") or v != RECIPE_DEFAULTS.get(k)},
                    asked_reserved, asked_fits, tried, time.perf_counter() - t0,
                    label=f"{LABEL_FAKE_CUDA}, replayed through the {LABEL_SIMULATED}; {current_target().note()}",
                    left_out=left_out, asked_time=asked_time, time_note=time_note)
