"""One fake CUDA-target training step's timeline (two steps, as ``gpulab.step`` runs them on the fake
engine), made the way ``gpulab.fit`` makes its runs: laid out from fake runs of a few layers where
the model's layers are alike (``predict.layer_repeat``: equal to the full-depth run event for event,
which its tests show), else run at full depth; and kept for the process under a key naming all of it
(``predict.run_cache``), so a question met before answers at once. Panels that ask one step's memory
of a transformer at full size (lesson 11's fine-tune check and what-if) use it: a 32-layer model's
step costs a few layers' runs, and moving back to a setting costs nothing.
"""
from __future__ import annotations

from typing import Any

from gpulab.measure.cuda_card import current_target
from gpulab.measure.tracking import TrackingResult
from gpulab.options import Layout, Recipe, settings_from
from gpulab.predict import run_cache
from gpulab.predict.fit import tracked_at_depth
from gpulab.training.loop import check_recipe_for, loop_recipe
from gpulab.units import model_dtype
from gpulab.models.workload import resolve_workload

__all__ = ["fake_step_timeline"]


def fake_step_timeline(model: Any, batch: int, *, seq_len: int | None = None, recipe: Recipe | None = None,
                       layout: Layout | None = None, **flat: Any) -> tuple[TrackingResult, str]:
    """(the timeline of two fake training steps of ``model`` at ``batch``, how its depth was run).
    ``recipe``/``layout`` or their fields as keywords (``optimizer``, ``dtype``, ``amp``,
    ``checkpointing``, ``lora``, ``quantize``, ``tp``, ...), as ``gpulab.step`` takes them; one GPU's
    step (one rank of tp). The runs follow the kernels of the card in effect
    (``measure.cuda_card.current_target``: ``predict.cards.follows_card`` sets it)."""
    recipe, layout = settings_from(recipe, layout, flat)
    if layout.gpus is not None or layout.strategy is not None:
        raise ValueError("fake_step_timeline is one GPU's step (one rank of tp): spread it with gpulab.fit")
    dt = model_dtype(recipe.dtype)
    loop = loop_recipe(recipe, layout)
    w = resolve_workload(model, None, seq_len=seq_len)
    check_recipe_for(loop, w, dt)
    key = run_cache.workload_key(model, w, own_parts=False)
    target = current_target()
    target = ("cuda", target.name, target.capability)
    whole = run_cache.run_key(key, loop, dt, int(batch), (*target, "full depth"))   # the laid-out timeline too

    def make() -> TrackingResult:
        t, _HOW[whole] = tracked_at_depth(w, key, int(batch), dt, loop, target)
        return t
    t, _ = run_cache.measured(whole, make)
    return t, _HOW.get(whole, "")


_HOW: dict[tuple | None, str] = {}   # how each kept full-depth timeline was made (a line of text per key)
