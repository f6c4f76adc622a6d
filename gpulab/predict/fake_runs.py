"""``gpulab fit``'s fake runs, each made once a process (``predict.run_cache``): a training step of two
steps at a batch on the fake engine (CUDA's kernels), laid out from a few layers where the layers are
alike (``predict.layer_repeat``), timed where the step's time is asked (``predict.run_ops``: an
``OpTimer`` told every op by the tracker, its ops kept beside the timeline), and read back by
``predict.plan_time`` (``timed_step``) without a run of its own.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch

from gpulab.measure.engines import Measurement, run
from gpulab.measure.tracking import TrackingResult
from gpulab.models.workload import Workload, step_failed
from gpulab.predict import layer_repeat, run_cache
from gpulab.training.loop import LoopRecipe, train_experiment

if TYPE_CHECKING:
    from gpulab.predict.cards import Card
    from gpulab.predict.run_ops import RunOps

__all__ = ["deep_runs", "depth_text", "fake_run", "not_laid_out", "target_of", "timed_fake_run", "timed_step", "tracked",
           "tracked_at_depth"]


def target_of(card: Card) -> tuple:
    """The cache's name for the card whose kernels a fake run followed (``run_cache.run_key``)."""
    return ("cuda", repr(card))


def deep_runs(w: Workload, key: tuple | None, dt: torch.dtype, recipe: LoopRecipe, target: tuple,
              timed: bool = False) -> "layer_repeat.Deep | None":
    """The full depth laid out from runs of a few layers (``predict.layer_repeat``), where the
    model's layers are alike; None where they are not (then every run has the full depth). ``timed``:
    the runs of the two depths the layout reads its bytes from are timed, as ``timed_step`` reads them
    (the deepest run, which only teaches the layout, is not)."""
    if not_laid_out(w, recipe) is not None:
        return None
    deep: list = []

    def small(wk: Workload, b: int, fresh: bool) -> TrackingResult:
        wkey = run_cache.workload_key(wk.config, wk, own_parts=False) if key is not None else None
        at = timed and getattr(wk.config, wk.facts.depth_field) in deep[0].depths[:2]
        return tracked(wk, wkey, b, dt, recipe, target, fresh, at)
    deep.append(layer_repeat.Deep(w, small))
    lkey = _layouts_key(key, w, recipe, dt, target)
    if lkey is not None:   # the layouts learned for this kind of model and recipe at any size, sequence length or batch
        deep[0].layouts = run_cache.layouts(lkey)
        if recipe.pp > 1:   # and for its other pipeline stages, each tried on this stage's runs (layer_repeat.transfer)
            deep[0].peers = run_cache.layouts(_stages_key(lkey))
    return deep[0]


def _stages_key(lkey: tuple) -> tuple:
    """``_layouts_key`` without the pipeline stage: where the layouts learned for every stage of a pipeline
    are kept (``layer_repeat.transfer`` moves one onto another stage's runs where it rebuilds them)."""
    workload, kind, fields, *rest = lkey
    return (workload, kind, tuple(f for f in fields if f[0] != "pp_stage"), *rest, "every pipeline stage")


# a config's sizes: the fields a kept layout may differ in. Every other field (the model's type, its
# layer pattern: sliding windows, layer types, dense/MoE layers, dropout, biases...) is part of the key
_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
          "num_hidden_layers", "vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id",
          "pad_token_id", "rms_norm_eps", "layer_norm_eps", "rope_theta")


def _layouts_key(key: tuple | None, w: Workload, recipe: LoopRecipe, dt: torch.dtype, target: tuple) -> tuple | None:
    """``run_cache.run_key`` with the model's config less its sizes (``_SIZES``, and the rope's theta), and
    without the sequence length or the batch (None: not kept): where ``run_cache.layouts`` keeps the layouts
    learned for a kind of model and a recipe. ``Deep.at`` takes a kept layout only where it rebuilds the
    asked setting's (k+1)-layer run exactly, as it does for another batch, and learns one (its third,
    deepest small run) where none does: a panel's sequence-length move costs two small runs, not three and a
    learn, and so does a move to another size of the same model (lesson 11's custom Llama after
    Llama-3-8B, whose layouts learned apart are equal: a test shows it). Any other field differing (Mistral's
    sliding window beside Llama's, a layer pattern) keeps the layouts apart: a 2-layer run cannot tell a
    pattern that shows only deeper."""
    if key is None:
        return None
    name, kind, _inputs, image_size, _seq_len, source, config = key
    if config is None:   # no config to read sizes from: the model itself, as run_cache.workload_key names it
        return run_cache.run_key((name, kind, image_size, source), recipe, dt, 0, target)
    fields = json.loads(config)
    rope = fields.get("rope_parameters")
    if isinstance(rope, dict):
        fields["rope_parameters"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    config = json.dumps({k: v for k, v in fields.items() if k not in _SIZES}, sort_keys=True)
    return run_cache.run_key((kind, image_size, config), recipe, dt, 0, target)


def tracked_at_depth(w: Workload, key: tuple | None, batch: int, dt: torch.dtype, recipe: LoopRecipe,
                     target: tuple, timed: bool = False) -> tuple[TrackingResult, str]:
    """One fake run's full-depth timeline at ``batch``, laid out from a few layers where the layers
    are alike (``deep_runs``), else run at full depth; and how (``layer_repeat.Deep.describe``). ``timed``:
    the runs it reads are timed (``timed_step`` then finds them)."""
    deep = deep_runs(w, key, dt, recipe, target, timed)
    t = deep.at(batch) if deep is not None else None
    if t is None:
        t = tracked(w, key, batch, dt, recipe, target, timed=timed)
    return t, depth_text(deep, w, recipe)


def depth_text(deep: "layer_repeat.Deep | None", w: Workload, recipe: LoopRecipe) -> str:
    """How a timeline's depth was run: laid out from a few layers (``Deep.describe``), or why not."""
    if deep is not None:
        return deep.describe()
    return not_laid_out(w, recipe) or ""


def not_laid_out(w: Workload, recipe: LoopRecipe) -> str | None:
    """Why every run has the full depth (None: it is laid out from a few layers)."""
    if recipe.virtual_stages > 1:
        return ("interleaved pipeline: a rank's chunks take turns in its schedule, so every run has the rank's "
                "full depth")
    return layer_repeat.not_repeatable(w.config, recipe.checkpointing, w.facts)


def tracked(w: Workload, key: tuple | None, batch: int, dt: torch.dtype, recipe: LoopRecipe, target: tuple,
            fresh: bool = False, timed: bool = False) -> TrackingResult:
    """The fake run's timeline at ``batch``, reused when this process made it already for the same
    workload ``key`` (``run_cache.workload_key``), recipe, dtype and ``target`` (the card). ``timed``:
    the run is made under an ``OpTimer`` and its step's ops kept beside its timeline (``timed_step``
    reads them); a timeline kept without them is made again. Nothing is timed where nothing is kept."""
    rkey = run_cache.run_key(key, recipe, dt, batch, target)
    timed = timed and rkey is not None
    if timed and run_cache.kept_ops(rkey) is None:
        fresh = True

    def made() -> TrackingResult:
        if not timed:
            return fake_run(w, batch, dt, recipe).tracking
        m, ops = timed_fake_run(w, batch, dt, recipe)
        run_cache.keep_ops(rkey, ops)
        return m.tracking
    return run_cache.measured(rkey, made, fresh=fresh)[0]


def timed_step(w: Workload, key: tuple | None, depth: int | None, batch: int, dt: torch.dtype, recipe: LoopRecipe,
               target: tuple) -> "RunOps":
    """The steady step's ops (``predict.run_ops.RunOps``) of the fake run of ``w`` at ``depth`` layers (None:
    as it is) at ``batch``, keyed as the search keys its runs (``deep_runs``, ``tracked``): the ops kept
    where the search timed that run; where it made no run at ``batch`` (a pipeline stage read off its
    extrapolation), laid out from its timed runs at batches 2 and 3 (``run_ops.at_batch``) where that
    layout gives, op for op, the ops of a third batch it timed (the one that confirmed its extrapolation);
    else a timed fake run made now (and kept)."""
    from gpulab.predict import run_ops
    if depth is not None:
        w = layer_repeat.workload_with_depth(w, depth)
        key = run_cache.workload_key(w.config, w, own_parts=False) if key is not None else None
    rkey = run_cache.run_key(key, recipe, dt, batch, target)
    if rkey is None:
        return timed_fake_run(w, batch, dt, recipe)[1]
    ops = run_cache.kept_ops(rkey)
    kept = run_cache.kept_ops_by_batch(rkey)
    checks = [b for b in kept if b > 3]
    if ops is None and batch > 3 and 2 in kept and 3 in kept and checks and all(
            run_ops.at_batch(kept[2], kept[3], 2, b) == kept[b] for b in checks):
        ops = run_ops.at_batch(kept[2], kept[3], 2, batch)
    if ops is None:
        tracked(w, key, batch, dt, recipe, target, timed=True)
        ops = run_cache.kept_ops(rkey)
    return ops


def fake_run(w: Workload, batch: int, dt: torch.dtype, recipe: LoopRecipe, timers: list | None = None,
             from_step: int = 0) -> Measurement:
    """The two-step fake run at ``batch``; ``timers``: under an ``OpTimer``, appended there, that the
    tracker tells every op (``predict.timing.timed_experiment``), recording from step ``from_step`` on."""
    experiment = train_experiment(w, [batch, batch], dt, recipe)
    if timers is not None:
        from gpulab.predict.run_ops import per_step
        from gpulab.predict.timing import timed_experiment
        experiment = timed_experiment(experiment, timers, per_step(recipe), from_step)
    try:
        m = run(experiment, "fake", fake_target="cuda")
    except ValueError:
        raise
    except Exception as exc:   # the model's own error: say which input was tried and how to pass one
        raise ValueError(step_failed(w, batch, "on the fake engine", exc)) from exc
    if m.oom or m.tracking is None:
        raise RuntimeError(f"the fake run at batch {batch} failed: {m.error}")
    return m


def timed_fake_run(w: Workload, batch: int, dt: torch.dtype, recipe: LoopRecipe) -> tuple[Measurement, "RunOps"]:
    """``fake_run`` timed: the measurement and its steady step's ops (``run_ops.of_run``)."""
    from gpulab.predict import run_ops
    first = run_ops.from_step(recipe)
    timers: list = []
    m = fake_run(w, batch, dt, recipe, timers, first)
    if timers[-1].step < first:   # the timer told fewer steps than the run made: again, every step recorded
        m = fake_run(w, batch, dt, recipe, timers)
    return m, run_ops.of_run(m, timers[-1])
