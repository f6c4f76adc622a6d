"""``gpulab.predict.eight_bit_timeline``: the 8-bit AdamW run's timeline derived from the AdamW run's
equals the 8-bit run's own fake run, event for event, and so its peak, its replayed reserved bytes and
what ``what_fits`` answers with it (issue 46, item 7)."""
from __future__ import annotations

import pytest
import torch

from gpulab.models.workload import resolve_workload
from gpulab.predict import eight_bit_timeline, run_cache
from gpulab.predict.fake_runs import fake_run
from gpulab.predict.fit import verdict
from gpulab.training.loop import RECIPE_DEFAULTS, user_recipe


def _run(w, batch, dt, optimizer, **options):
    return fake_run(w, batch, dt, user_recipe(optimizer, None, **{**RECIPE_DEFAULTS, **options})).tracking


def _same_events(a, b) -> None:
    """Event for event the same kind and bytes, the storages matched one to one (ids differ)."""
    assert len(a.events) == len(b.events)
    ours, theirs = {}, {}
    for i, (x, y) in enumerate(zip(a.events, b.events)):
        assert (x.kind, x.nbytes) == (y.kind, y.nbytes), f"event {i}: {x} != {y}"
        assert ours.setdefault(x.sid, y.sid) == y.sid and theirs.setdefault(y.sid, x.sid) == x.sid, f"event {i}"


@pytest.mark.parametrize("model, dt, batch, options", [
    ("hf:tiny-llama", torch.bfloat16, 2, {}),                          # norms under MIN_8BIT_SIZE: float32 state
    pytest.param("hf:tiny-llama", torch.float32, 1, {"checkpointing": "full"}, marks=pytest.mark.extended),
    ("hf:tiny-gpt2", torch.bfloat16, 3, {"chunked_loss": 8}),
    ("hf:tiny-llama", torch.bfloat16, 2, {"optimizer_in_backward": True, "chunked_loss": 4}),   # maps per parameter
    pytest.param("hf:tiny-llama", torch.float32, 1, {"optimizer_in_backward": True, "checkpointing": "full"},
                 marks=pytest.mark.extended),
    ("mlp", torch.float32, 2, {"optimizer_in_backward": True}),   # an image model: what_fits tries it too
    pytest.param("resnet18", torch.float32, 2, {}, marks=pytest.mark.extended),   # batch norm's buffers
])
def test_the_derived_timeline_is_the_eight_bit_runs_event_for_event(model, dt, batch, options):
    w = resolve_workload(model, seq_len=32) if model.startswith("hf:") else resolve_workload(model)
    adamw, eight = _run(w, batch, dt, "adamw", **options), _run(w, batch, dt, "adamw8bit", **options)
    assert eight_bit_timeline.derivable(user_recipe("adamw", None, **{**RECIPE_DEFAULTS, **options}))
    derived = eight_bit_timeline.derive(adamw, in_backward=options.get("optimizer_in_backward", False))
    assert derived is not None and derived.peak_bytes < adamw.peak_bytes   # it changed something
    _same_events(derived, eight)
    assert (derived.peak_bytes, derived.peak_index, derived.peak_by_category) == \
        (eight.peak_bytes, eight.peak_index, eight.peak_by_category)
    for usable in (eight.peak_bytes, 2 * eight.peak_bytes, 10 ** 12):   # missing by a little, fitting, no limit
        assert verdict(derived, usable) == verdict(eight, usable)


def test_runs_it_cannot_read_are_left_to_a_fake_run():
    w = resolve_workload("hf:tiny-llama", seq_len=32)
    assert not eight_bit_timeline.derivable(user_recipe("adamw", None, **{**RECIPE_DEFAULTS, "lora": 16}))
    assert not eight_bit_timeline.derivable(user_recipe("adamw", None, **{**RECIPE_DEFAULTS, "clip_grad_norm": 1.0}))
    assert not eight_bit_timeline.derivable(user_recipe("sgd", None, **RECIPE_DEFAULTS))
    assert eight_bit_timeline.derive(_run(w, 1, torch.bfloat16, "sgd")) is None   # no Adam state to read
    stepped_in_backward = _run(w, 1, torch.bfloat16, "adamw", optimizer_in_backward=True)
    assert eight_bit_timeline.derive(stepped_in_backward) is None   # its state is not where a plain step makes it


@pytest.mark.extended
def test_what_fits_with_the_derived_candidate_answers_as_its_fake_run_memory_and_time():
    """On a card with speed figures, the 8-bit candidate (derived) fits, and its reserved bytes and predicted
    step time equal those of its own fake runs, made afresh."""
    import gpulab
    from gpulab.predict.card_speeds import speed_of
    from gpulab.predict.cards import parse_gpu
    from gpulab.predict.plan_time import _one_gpu_layout, plan_time
    from gpulab.predict.replay import replay_events, tracked_events
    from gpulab.predict.what_fits import what_fits
    model, batch, seq = "hf:tiny-gpt2", 8, 256

    def reserved(**kw) -> int:
        r = gpulab.step(model, batch=batch, seq_len=seq, engine="fake", **kw)
        return max(replay_events(tracked_events(r.measurement)).reserved)
    asked, eight = reserved(optimizer="adamw"), reserved(optimizer="adamw8bit")
    assert eight < asked
    card = parse_gpu("H100")
    usable = (asked + eight) // 2
    context = card.reported_total_bytes - usable - card.workspace_bytes()
    run_cache.clear()
    told: list[str] = []
    r = what_fits(model, "H100", batch=batch, seq_len=seq, optimizer="adamw", context_bytes=context,
                  progress=lambda fraction, text: told.append(text))
    assert any("8-bit AdamW state (bitsandbytes), derived from its AdamW run" in text for text in told)
    t = next(t for t in r.tried if t.name == "8-bit AdamW state (bitsandbytes)")
    assert not r.asked_fits and t.fits and t.reserved_bytes == eight and t.time is not None
    run_cache.clear()   # the reference: the 8-bit recipe's own timed runs, none reused
    w = resolve_workload(model, seq_len=seq)
    recipe = user_recipe("adamw8bit", None, **RECIPE_DEFAULTS)
    ref = plan_time(w, batch, torch.float32, recipe, _one_gpu_layout(recipe), speed_of(card)).as_dict()
    assert t.time == ref
