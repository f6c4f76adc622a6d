"""Lesson 11's panels made faster give the answers they gave (#47 item 9): the activation panel measures
forwards alone (what a layer saves is the forward's), and every panel's measurement runs with the objects
that existed before it out of the cycle collector's walks (``widgets.gc_scope``). Latencies are the
benchmark's (``benchmarks/panel_latency.py``), never asserted here."""
import gc
from collections import OrderedDict

import pytest

from gpulab.course import transformer_activations as ta
from gpulab.widgets.gc_scope import old_objects_frozen


def _facts(run):
    """Everything a run's answer reads (the sweep's rows and the run's own table)."""
    return (run.per_layer_bytes, run.outside_layers_bytes, run.rng_bytes_per_layer, run.by_block, run.contents,
            run.attention_kernel, run.formula_bytes, run.differences, run.label, run.n_layers)


@pytest.mark.parametrize("model,lengths", [("tiny-gpt2", (16, 32)), ("tiny-llama", (32,))])
def test_a_forward_alone_saves_what_forward_and_backward_save(model, lengths):
    """GPT-2's layout (dropout masks, eager scores, CUDA's flash kernel) and Llama's (no dropout, RoPE,
    SwiGLU): the rows and every run's bytes, contents and differences are the full runs', while the
    forward-only run's timeline has no backward (so it did measure less)."""
    full = ta.activation_vs_seq(model, lengths)
    alone = ta.activation_vs_seq(model, lengths, kept=OrderedDict(), backward=False)
    assert alone.rows == full.rows and alone.model == full.model
    assert [_facts(r) for r in alone.runs] == [_facts(r) for r in full.runs]
    phases = lambda run: {e.phase for e in run.measurement.tracking.events}
    assert all("backward" in phases(r) for r in full.runs)
    assert not any("backward" in phases(r) for r in alone.runs)


def test_the_panel_keeps_forward_runs_apart_and_reuses_full_ones():
    """A full run the lesson made serves the panel's forward-only sweep; a forward-only run is kept
    under its own key, so a caller asking for full runs never gets one."""
    kept = OrderedDict()
    first = ta.activation_vs_seq("tiny-gpt2", (16,), kept=kept)                       # full runs, kept
    assert set(kept) == {ta.kept_key("tiny-gpt2", 16, 1, i, "bfloat16", "fake") for i in ("eager", "sdpa")}
    forward = ta.activation_vs_seq("tiny-gpt2", (16, 32), kept=kept, backward=False)
    assert forward.runs[0] is first.runs[0] and forward.runs[1] is first.runs[1]       # s = 16: the full runs
    assert ta.kept_key("tiny-gpt2", 32, 1, "eager", "bfloat16", "fake", backward=False) in kept
    again = ta.activation_vs_seq("tiny-gpt2", (32,), kept=kept)                       # full asked: measured
    assert again.runs[0] is not forward.runs[2]
    assert "backward" in {e.phase for e in again.runs[0].measurement.tracking.events}
    assert _facts(again.runs[0]) == _facts(forward.runs[2])


def test_old_objects_frozen_leaves_a_freeze_alone_and_collects_new_cycles(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # a CPU student's machine
    assert gc.get_freeze_count() == 0
    with old_objects_frozen():
        frozen = gc.get_freeze_count()
        a, b = [], []
        a.append(b)
        b.append(a)
        del a, b
        assert gc.collect() >= 2                    # a cycle made inside is found inside
    assert frozen > 0 and gc.get_freeze_count() == 0   # every object handed back
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        with old_objects_frozen():
            pass
        assert gc.get_freeze_count() == before      # someone else's freeze: theirs to undo
    finally:
        gc.unfreeze()


def test_old_objects_stay_collectable_where_a_gpu_is(monkeypatch):
    """The cuda engine collects what earlier code left before it measures: with a GPU nothing is frozen."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with old_objects_frozen():
        assert gc.get_freeze_count() == 0


def test_a_run_with_old_objects_frozen_records_what_its_cycles_held(monkeypatch):
    """The fake engine collects after a run that left a tracked storage alive (``engines._run_host``): with
    the old objects frozen, a tensor that only a reference cycle made in the run holds is still freed there
    and its free recorded, as without; and a real run gives the same timeline both ways."""
    import torch

    from gpulab.measure.engines import run

    def cycle(ctx):
        with ctx.phase("forward"):
            holder = [torch.empty(4096, device=ctx.device)]
            holder.append(holder)   # only the collector frees it
        return {}

    def freed():
        t = run(cycle, "fake", fake_target="cuda").tracking
        return [(e.kind, e.nbytes) for e in t.events], [r.freed is not None for r in t.records.values()]

    def timeline():
        t = ta.measured_layer_activations("tiny-gpt2", 16, 1, "eager").measurement.tracking
        return ([(e.kind, e.sid, e.nbytes, e.phase, e.module) for e in t.events], t.peak_bytes,
                dict(t.peak_by_category), [(r.category, r.op, r.shape, r.freed) for r in t.records.values()])
    plain = freed(), timeline()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # frozen, as on a CPU student's machine
    with old_objects_frozen():
        assert gc.get_freeze_count() > 0
        frozen = freed(), timeline()
    assert frozen == plain
    assert plain[0][1] == [True] and [k for k, _ in plain[0][0]] == ["alloc", "free"]


def _step(method, hidden, layers):
    import torch

    from gpulab.course.finetune import custom_config, recipe_options
    from gpulab.predict.fake_step import fake_step_timeline
    return fake_step_timeline(custom_config(hidden=hidden, layers=layers), 1, seq_len=32, optimizer="adamw",
                              dtype=torch.bfloat16, **recipe_options(method, "none"))


@pytest.mark.parametrize("method", ["full", pytest.param("lora", marks=pytest.mark.extended)])
def test_a_layout_learned_for_one_size_serves_another_size_of_the_model_exactly(method):
    """Lesson 11's fine-tune panel moving from one Llama size to another (its presets and custom model are
    Llama-type): the layout kept from the first size (``run_cache.layouts``, per config less its sizes, and recipe) lays
    the second out event for event as a layout learned for it alone, which is the same layout, and spares
    the third small run and the learn."""
    from gpulab.predict import run_cache
    run_cache.clear()
    _step(method, 512, 12)
    first = [lay for kept in run_cache._layouts.values() for lay in kept]
    before = run_cache.info()["runs"]
    reused, how = _step(method, 256, 14)
    made_reused = run_cache.info()["runs"] - before
    run_cache.clear()   # forgets the layouts too: learned from three small runs
    learned, _ = _step(method, 256, 14)
    alone = [lay for kept in run_cache._layouts.values() for lay in kept]
    made_learned = run_cache.info()["runs"]
    assert "laid out" in how and len(first) == 1 and alone == first      # learned apart: the same layout
    assert [(e.kind, e.nbytes, e.sid, e.phase, e.module) for e in reused.events] == \
           [(e.kind, e.nbytes, e.sid, e.phase, e.module) for e in learned.events]
    assert reused.peak_bytes == learned.peak_bytes and reused.peak_by_category == learned.peak_by_category
    assert made_reused == made_learned - 1     # the deepest small run, which only teaches the layout, not made


def test_layouts_are_shared_between_sizes_of_a_model_and_kept_apart_by_any_other_field():
    """The layouts' key (``fake_runs._layouts_key``) is the config less its sizes: lesson 11's custom Llama
    shares Llama-3-8B's (they differ in sizes, token ids, norm epsilon and rope theta only), Mistral-7B
    (a sliding window, another model type) and a Llama with a different layer pattern do not."""
    import torch

    from gpulab.course.finetune import preset_config
    from gpulab.models.workload import resolve_workload
    from gpulab.predict import run_cache
    from gpulab.predict.fake_runs import _layouts_key
    from gpulab.training.loop import LoopRecipe

    def key(config):
        w = resolve_workload(config, seq_len=32)
        return _layouts_key(run_cache.workload_key(config, w, own_parts=False), w, LoopRecipe(),
                            torch.bfloat16, ("cuda", "H100"))
    llama, custom = key(preset_config("llama-3-8b")), key(preset_config("custom", 1024, 20))
    assert llama is not None and llama == custom
    assert key(preset_config("mistral-7b")) != llama
    windowed = preset_config("llama-3-8b")
    windowed.attention_dropout = 0.1      # dropout masks in every layer: other events
    assert key(windowed) != llama
