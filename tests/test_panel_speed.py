"""The slow panels made faster give the answers they gave (#47 item 9): lesson 04's largest batch
from the sweep's line against running every batch, lesson 11's fine-tune check and what-if through
``predict.fake_step`` (laid out from a few layers, kept) against ``gpulab.step``'s full-depth run,
lesson 12's strategies measured together against one at a time. Latencies are the benchmark's
(``benchmarks/panel_latency.py``), never asserted here."""
import dataclasses

import pytest
import torch

from gpulab.course import sweeps as S
from gpulab.predict.batch_line import BatchLine
from gpulab.course.finetune import custom_config, finetune_check, recipe_options
from gpulab.allocator.simulator import CachingAllocator
from gpulab.predict import run_cache
from gpulab.predict import layer_repeat as L
from gpulab.predict.fake_step import fake_step_timeline
from gpulab.predict.step import step
from gpulab.predict.cards import card_target
from gpulab.measure.cuda_card import kernel_target


def _bytes(t):
    return [(e.kind, e.nbytes) for e in t.events]


def test_the_sweeps_line_makes_the_run_it_did_not_make():
    sweep = S.batch_sweep("cnn", (8, 16, 32, 64), optimizer="adam", engine="fake")
    runs = {r.batch: r.measurement.tracking for r in sweep.steps_results}
    line = BatchLine.make({b: runs[b] for b in (8, 16, 32)})
    assert line is not None and BatchLine.same(line.at(64), runs[64])       # the fourth run, made exactly
    assert line.at(64).peak_bytes == runs[64].peak_bytes
    bent = dict(runs)
    e = bent[32].events[5]
    bent[32] = dataclasses.replace(bent[32], events=[*bent[32].events[:5], e.with_bytes(e.nbytes + 512, e.delta + 512),
                                                     *bent[32].events[6:]])
    assert BatchLine.make({b: bent[b] for b in (8, 16, 32)}) is None       # not affine: no line, runs instead


@pytest.mark.extended
@pytest.mark.parametrize("model,card_gib,optimizer", [("vgg16", 16, "sgd"), ("vgg16", 8, "adam"), ("cnn", 1, "sgd")])
def test_largest_batch_answers_unchanged(model, card_gib, optimizer):
    S._KEPT.clear()
    made = S.largest_batch(model, card_gib, optimizer=optimizer, context_overhead_bytes=512 * 2**20)
    ran = S.largest_batch(model, card_gib, optimizer=optimizer, context_overhead_bytes=512 * 2**20, extrapolate=False)
    assert made.answers == ran.answers and made.sweep.fit == ran.sweep.fit
    assert made.verification_runs < ran.verification_runs


@pytest.mark.extended
def test_fine_tune_check_answers_as_the_full_depth_step():
    """A custom 12-layer Llama-style model (laid out from runs of 1 and 2 layers) with LoRA: the kept,
    laid-out timeline gives gpulab.step's full-depth numbers, and asking again measures nothing."""
    config = custom_config(hidden=128, layers=12)
    options = recipe_options("lora", "none")
    full = step(config, batch=2, seq_len=64, optimizer="adamw", engine="fake", dtype=torch.bfloat16, gpu="H100",
                **options)   # the check follows the card's kernels, as gpulab.fit does
    answer = finetune_check("custom", "H100", 64, 2, "lora", "adamw", "bf16", "none", hidden=128, layers=12)
    t = full.measurement.tracking
    assert answer.peak_bytes == t.peak_bytes and answer.peak_by_category == dict(t.peak_by_category)
    assert answer.reserved_bytes == CachingAllocator().replay(t.events, strict=False).peak_reserved
    assert "laid out" in answer.label
    before = run_cache.info()
    again = finetune_check("custom", "H100", 64, 2, "lora", "adamw", "bf16", "none", hidden=128, layers=12,
                           context_bytes=2**30)   # only the verdict changes: no new run
    assert run_cache.info() == before and again.peak_bytes == answer.peak_bytes and again.context_bytes == 2**30
    with kernel_target(card_target("H100")):
        laid, how = fake_step_timeline(config, 2, seq_len=64, optimizer="adamw", dtype=torch.bfloat16, **options)
    assert _bytes(laid) == _bytes(t) and "laid out" in how


@pytest.mark.extended
def test_strategies_measured_together_as_alone():
    from gpulab.distributed.sharding import STRATEGIES, StrategySpec, measure_strategies, measure_strategy
    specs = [StrategySpec(strategy=s, model="cnn", width=32) for s in STRATEGIES]
    together = measure_strategies(specs, 2)
    alone = measure_strategy(specs[-1], 2)
    strip = [dataclasses.replace(r, losses=[]) for r in alone.ranks]
    assert [dataclasses.replace(r, losses=[]) for r in together[-1].ranks] == strip


def test_fine_tune_counts_kept_per_model_equal_a_fresh_build():
    """The fine-tune check keeps its parameter counts per model, method, optimizer and dtype (a
    sequence-length move builds no skeleton): what it keeps equals a fresh meta build at another
    sequence length, and a different method is counted afresh."""
    from gpulab.course import finetune as FT
    from gpulab.models.workload import resolve_workload
    from gpulab.training.loop import recipe_workload, user_recipe
    config = custom_config(hidden=256, layers=2)
    FT._COUNTS.clear()
    options = recipe_options("lora", "none")
    kept = FT._parameter_counts("custom", (256, 2), config, 64, "lora", "adamw", options, torch.bfloat16)
    fresh = recipe_workload(resolve_workload(config, seq_len=512), user_recipe(
        "adamw", **{**options, "quantize": None, "checkpointing": False})).parameter_counts(torch.bfloat16)
    assert kept == fresh and fresh[0] > fresh[1] > 0   # adapters trained, the base frozen
    assert FT._parameter_counts("custom", (256, 2), config, 512, "lora", "adamw", options, torch.bfloat16) == fresh
    assert list(FT._COUNTS) == [("custom", (256, 2), "lora", "adamw", "torch.bfloat16")]   # one build, one key


def test_a_slow_panel_says_what_it_runs_and_how_long_its_last_run_took():
    """A panel with ``real_run`` states it in its header, and while running shows the last run's
    measured seconds (its own ``last_seconds``), never a typed figure; other panels say only running."""
    from gpulab.widgets.base import Panel, slider
    seen = []

    def compute(n):
        seen.append(panel.status.value)
        return n

    panel = Panel("slow", {"n": slider("n", 1, 1, 4)}, compute, lambda r: [], auto_run=True,
                  real_run="a real run on this machine")
    panel.run()
    assert seen[-1] == "running…" and "a real run on this machine" in panel.widget.children[0].value
    first = panel.last_seconds
    panel.controls["n"].value = 2
    assert seen[-1] == f"running… (the last run here took {first:.1f} s)" and panel.result == 2
    plain = Panel("quick", {"n": slider("n", 1, 1, 4)}, lambda n: seen.append(plain.status.value), lambda r: [],
                  auto_run=True)
    plain.run()
    plain.run()
    assert seen[-1] == "running…" and "gpulab-realrun" not in plain.widget.children[0].value


def _layout_reused_against_learned(options, layers):
    """(the step at seq 32 with the layout learned at seq 64 kept, the same step with a fresh learn, fake
    runs made for each): a sequence-length move of lesson 11's panels takes the kept layout."""
    config = custom_config(hidden=128, layers=layers)
    run_cache.clear()
    fake_step_timeline(config, 1, seq_len=64, optimizer="adamw", dtype=torch.bfloat16, **options)
    before = run_cache.info()["runs"]
    reused, how = fake_step_timeline(config, 1, seq_len=32, optimizer="adamw", dtype=torch.bfloat16, **options)
    made_reused = run_cache.info()["runs"] - before
    run_cache.clear()   # forgets the layouts too: the slow path, learned from three small runs
    learned, _ = fake_step_timeline(config, 1, seq_len=32, optimizer="adamw", dtype=torch.bfloat16, **options)
    assert "laid out" in how
    return reused, learned, made_reused, run_cache.info()["runs"]


def test_a_layout_learned_at_one_sequence_length_serves_another_exactly():
    reused, learned, made_reused, made_learned = _layout_reused_against_learned(recipe_options("full", "none"), L.MIN_REPEAT_DEPTH)
    assert [(e.kind, e.nbytes, e.sid) for e in reused.events] == [(e.kind, e.nbytes, e.sid) for e in learned.events]
    assert reused.peak_bytes == learned.peak_bytes and reused.peak_by_category == learned.peak_by_category
    assert made_reused == made_learned - 1     # the deepest small run, which only teaches the layout, not made


@pytest.mark.extended
@pytest.mark.parametrize("method,policy", [("lora", "none"), ("qlora", "selective"), ("full", "full")])
def test_a_kept_layout_answers_as_a_learned_one_for_the_recipes(method, policy):
    reused, learned, made_reused, made_learned = _layout_reused_against_learned(recipe_options(method, policy), 12)
    assert [(e.kind, e.nbytes, e.sid) for e in reused.events] == [(e.kind, e.nbytes, e.sid) for e in learned.events]
    assert made_reused < made_learned


def _optimizer_runs_alike(a, b):
    """Two optimizer runs count the same bytes: every tracker event, the moments, optimizer.state."""
    assert a.optimizer == b.optimizer and a.engine == b.engine == "cpu"
    ta, tb = a.measurement.tracking, b.measurement.tracking
    assert [(e.kind, e.nbytes, e.phase, e.module) for e in ta.events] == \
           [(e.kind, e.nbytes, e.phase, e.module) for e in tb.events]
    assert ta.series == tb.series and ta.peak_by_category == tb.peak_by_category
    assert a.moments == b.moments and a.state_names == b.state_names
    assert a.measurement.peak_bytes == b.measurement.peak_bytes and a.state_after_bytes == b.state_after_bytes


def test_optimizer_panels_on_one_thread_count_what_two_threads_count():
    """Lesson 05's optimizer and implementation panels run on one CPU thread (``Panel(threads=1)``): the
    same bytes, event for event, as the comparisons on two threads."""
    from gpulab.course.optimizers import compare_implementations, compare_optimizers
    from gpulab.record.runs.checkpoint import cpu_threads
    from gpulab.widgets.optimizer_impl import compute_implementations
    from gpulab.widgets.optimizers import compute_optimizers
    with cpu_threads(2):
        two = compare_optimizers("mlp", batch=2, engine="cpu")
    with cpu_threads(1):   # as the panels run them (``Panel(threads=1)``)
        one = compute_optimizers("mlp", 2, "cpu")
    assert [r.optimizer for r in one.runs] == [r.optimizer for r in two.runs] and len(one.runs) >= 6
    for a, b in zip(one.runs, two.runs):
        _optimizer_runs_alike(a, b)
    assert any(r.state_after_bytes > 0 for r in one.runs)   # state was there to count
    with cpu_threads(2):
        two_impl = compare_implementations("mlp", "momentum", batch=2, engine="cpu")
    with cpu_threads(1):
        one_impl = compute_implementations("mlp", "momentum", 2, "cpu")
    assert [r.implementation for r in one_impl.rows] == [r.implementation for r in two_impl.rows]
    for a, b in zip(one_impl.rows, two_impl.rows):
        assert (a.run is None) == (b.run is None) and a.unsupported == b.unsupported
        if a.run is not None:
            _optimizer_runs_alike(a.run, b.run)
            assert a.run.step_peak() == b.run.step_peak()


def test_memory_panels_run_their_guard_and_measurement_on_one_thread():
    """The eight memory-only panels ask for one CPU thread (``Panel(threads=1)``), and a Panel runs its
    guard and its compute under the thread count it was given, then restores torch's."""
    from gpulab.widgets import base
    from gpulab.widgets.activations import modelsize_panel
    from gpulab.widgets.allocator import allocator_panel
    from gpulab.widgets.flops import depthwise_panel, flops_panel
    from gpulab.widgets.optimizer_impl import implementation_panel
    from gpulab.widgets.optimizers import optimizer_panel
    from gpulab.widgets.precision import precision_panel
    from gpulab.widgets.step import step_panel
    from gpulab.widgets.sweep import sweep_panel
    for make in (modelsize_panel, allocator_panel, depthwise_panel, implementation_panel, optimizer_panel,
                 precision_panel, step_panel, sweep_panel):
        assert make().threads == 1, make.__name__
    assert flops_panel().threads is None   # a formula panel: torch's threads left alone
    seen = []
    before = torch.get_num_threads()
    target = 1 if before > 1 else 2

    def guard(params):
        seen.append(("guard", torch.get_num_threads()))
        return base.GuardVerdict(True)

    def compute(x):
        seen.append(("compute", torch.get_num_threads()))
        return x

    panel = base.Panel("t", {"x": base.slider("x", 1, 1, 4)}, compute, lambda r: [], guard=guard, threads=target)
    assert panel.run() == 1 and panel.error is None
    assert seen == [("guard", target), ("compute", target)] and torch.get_num_threads() == before
    seen.clear()
    base.Panel("t", {"x": base.slider("x", 1, 1, 4)}, compute, lambda r: [], guard=guard).run()
    assert seen == [("guard", before), ("compute", before)]


def test_checkpoint_panel_shows_the_memory_then_the_sweep_timed_as_checkpoint_sweep_times_it():
    """Lesson 07's panel shows the memory of every k first, then times the steps on a worker thread
    (``time_sweep``): the answer equals ``checkpoint_sweep``'s in one go (every byte, the labels, one timing
    of ``repeats`` samples per k). While it times, ``timing`` is True and the status says so; a change
    stops the timing (the stale memory stays without timings)."""
    import threading

    from gpulab.course.checkpointing import checkpoint_sweep, time_sweep
    from gpulab.record.runs.checkpoint import TimingStopped
    from gpulab.widgets.checkpoint import checkpoint_panel
    whole = checkpoint_sweep(6, 16, 8, "every k from 1 to N", "cpu", repeats=2)
    memory = checkpoint_sweep(6, 16, 8, "every k from 1 to N", "cpu", repeats=2, time_steps=False)
    assert all(p.timing is None for p in memory.points) and memory.timing_label == "not timed"
    timed = time_sweep(memory, repeats=2)

    def fields(r):
        return (r.n_blocks, r.width, r.batch, r.map_bytes, r.label, r.engine, r.timing_label,
                [(p.segments, p.peak_bytes, p.activation_side, p.peak_by_category, p.chen_bytes, p.sequential_bytes)
                 for p in r.points])
    assert fields(timed) == fields(whole) and "1 thread" in timed.timing_label
    assert all(len(p.timing.samples) == 2 and p.timing.warmup == q.timing.warmup
               for p, q in zip(timed.points, whole.points))
    with pytest.raises(TimingStopped):
        time_sweep(memory, repeats=2, stop=lambda: True)
    fake = checkpoint_sweep(6, 16, 8, "divisors of N", "fake")
    assert time_sweep(fake) is fake

    panel = checkpoint_panel(n_blocks=6, width=16, batch=8, repeats=2, engine="cpu")
    gate = threading.Event()
    panel.progress.observe(lambda c: threading.current_thread().name == "gpulab-checkpoint-timing" and gate.wait(10),
                           names="value")   # holds the worker at its first round until the gate opens
    panel.run()
    assert panel.timing and "timing the steps" in panel.status.value and all(p.timing is None for p in panel.result.points)
    assert fields(panel.result)[:6] == fields(whole)[:6] and fields(panel.result)[7] == fields(whole)[7]
    gate.set()
    assert panel.wait() and not panel.timing and panel.error is None
    assert fields(panel.result) == fields(whole) and all(len(p.timing.samples) == 2 for p in panel.result.points)
    assert panel.status.value.startswith("done: memory in")
    shown = [o["data"].get("text/html", "") for o in panel.output.outputs]   # set from the worker thread
    assert any("timed on this CPU, 1 thread" in h for h in shown) and any("image/png" in o["data"] for o in panel.output.outputs)
    gate.clear()
    panel.set(n_blocks=4)                       # memory of N = 4 shown, its timing held at the gate
    assert panel.timing
    threading.Timer(0.2, gate.set).start()
    panel.controls["batch"].value = 16          # a change: the timing of N = 4 is stopped (it waits for it)
    assert panel.wait() and not panel.timing and panel.stale
    assert [p.segments for p in panel.result.points] == [1, 2, 3, 4] and all(p.timing is None for p in panel.result.points)


def test_checkpoint_panel_reuses_its_sweep_for_a_subset_of_k_and_measures_again_on_run():
    """Lesson 07's panel (``reusing_sweeps``, as checkpoint_panel wires it): the divisors of N after a sweep
    of every k are that sweep's points (memory as a fresh sweep of the divisors measures it, the timings
    kept), under the note; Run with nothing moved measures afresh; another N is measured."""
    from gpulab.course.checkpointing import SEGMENT_CHOICES, checkpoint_sweep
    from gpulab.widgets.checkpoint import REUSED_SWEEP_NOTE, checkpoint_panel, compute_checkpoint, reusing_sweeps
    assert checkpoint_panel()._compute.__name__ == "compute_or_reuse"
    compute, render = reusing_sweeps(compute_checkpoint, lambda r: ["shown"])
    every = compute(6, 8, 4, SEGMENT_CHOICES[0], 1, "cpu")
    assert render(every) == ["shown"]
    divisors = compute(6, 8, 4, "divisors of N", 1, "cpu")
    fresh = checkpoint_sweep(6, 8, 4, "divisors of N", "cpu", repeats=1)
    assert [p.segments for p in divisors.points] == [p.segments for p in fresh.points] == [1, 2, 3, 6]
    for p, q in zip(divisors.points, fresh.points):
        assert (p.peak_bytes, p.activation_side, p.peak_by_category, p.chen_bytes, p.sequential_bytes) == \
               (q.peak_bytes, q.activation_side, q.peak_by_category, q.chen_bytes, q.sequential_bytes)
        assert p.timing is every.point(p.segments).timing            # the sweep's own timing, not a new one
    assert (divisors.label, divisors.timing_label, divisors.map_bytes) == (fresh.label, fresh.timing_label, fresh.map_bytes)
    assert render(divisors)[0].data == REUSED_SWEEP_NOTE and render(divisors)[1:] == ["shown"]
    again = compute(6, 8, 4, "divisors of N", 1, "cpu")              # Run, nothing moved: measured again
    assert again.point(2).timing is not every.point(2).timing and render(again) == ["shown"]
    other = compute(5, 8, 4, "divisors of N", 1, "cpu")
    assert [p.segments for p in other.points] == [1, 5] and render(other) == ["shown"]
    assert compute(6, 8, 4, "divisors of N", 2, "cpu").point(2).timing is not again.point(2).timing   # other rounds


def test_activation_panel_measures_only_the_length_a_move_adds():
    """Lesson 11's activation panel keeps its runs (``activation_vs_seq(kept=)``): a sweep that shares a
    length with an earlier one reuses that length's runs, and its rows equal a fresh sweep's."""
    from collections import OrderedDict

    from gpulab.course.transformer_activations import activation_vs_seq
    kept = OrderedDict()
    first = activation_vs_seq("tiny-gpt2", (32, 64), kept=kept)
    second = activation_vs_seq("tiny-gpt2", (16, 32), kept=kept)
    fresh = activation_vs_seq("tiny-gpt2", (16, 32))
    assert second.rows == fresh.rows and second.model == fresh.model
    assert [(r.per_layer_bytes, r.contents) for r in second.runs] == [(r.per_layer_bytes, r.contents) for r in fresh.runs]
    assert second.runs[2] is first.runs[0] and second.runs[3] is first.runs[1]     # s = 32: kept, not measured again
    assert second.runs[0] is not fresh.runs[0] and len(kept) == 6


def _same_timeline(a, b):
    assert [(e.kind, e.nbytes, e.phase, e.module) for e in a.events] == [(e.kind, e.nbytes, e.phase, e.module) for e in b.events]
    assert a.series == b.series and a.peak_bytes == b.peak_bytes and a.peak_by_category == b.peak_by_category


@pytest.mark.extended
def test_step_sweep_and_precision_panels_on_one_thread_count_what_two_threads_count():
    """Lessons 04's step and sweep panels and 08's precision panel run on one CPU thread: the same
    timelines, event for event, as the library's calls on two threads."""
    from gpulab.course.precision import precision_step
    from gpulab.course.sweeps import batch_sweep
    from gpulab.predict.step import step as tracked_step
    from gpulab.record.runs.checkpoint import cpu_threads
    from gpulab.widgets.precision import compute_precision
    from gpulab.widgets.step import compute_step
    from gpulab.widgets.sweep import compute_sweep, sweep_batches
    size = 32   # the mlp's default image size
    with cpu_threads(2):
        step2 = tracked_step("mlp", batch=2, image_size=size, optimizer="adam", dtype="float32", engine="cpu",
                             steps=1, guard=False)
        sweep2 = batch_sweep("mlp", sweep_batches(4), optimizer="adam", engine="cpu", steps=2)
        prec2 = precision_step("mlp", 2, size, "adam", "bfloat16", "cpu")
    with cpu_threads(1):   # as the panels run them (``Panel(threads=1)``)
        step1 = compute_step("mlp", 2, size, "adam", "float32", "cpu")
        sweep1 = compute_sweep("mlp", "adam", 4, "cpu")
        prec1 = compute_precision("mlp", 2, size, "adam", "bfloat16", "cpu")
    _same_timeline(step1.measurement.tracking, step2.measurement.tracking)
    assert [p.batch for p in sweep1.points] == [p.batch for p in sweep2.points] == [1, 2, 4]
    for a, b in zip(sweep1.steps_results, sweep2.steps_results):
        _same_timeline(a.measurement.tracking, b.measurement.tracking)
    assert list(prec1.runs) == list(prec2.runs) and len(prec1.runs) >= 2
    for mode in prec1.runs:   # autocast's frees inside forward come in an order that varies run to run on
        a, b = prec1.runs[mode].measurement.tracking, prec2.runs[mode].measurement.tracking   # any thread count
        assert sorted((e.kind, e.nbytes, e.phase) for e in a.events) == sorted((e.kind, e.nbytes, e.phase) for e in b.events)
        assert (a.peak_bytes, a.peak_by_category, a.final_bytes) == (b.peak_bytes, b.peak_by_category, b.final_bytes)
    assert prec1._repr_html_() == prec2._repr_html_()


@pytest.mark.extended
def test_lesson_03_and_09_panels_on_one_thread_answer_as_on_two():
    """Lesson 03's modelsize and depthwise panels and 09's allocator panel run on one CPU thread: the
    same tables (their HTML, every number), and the same replayed allocator, as on two threads."""
    from gpulab.course.flops import depthwise_vs_standard
    from gpulab.course.modelsize import modelsize_vs_saved
    from gpulab.models.registry import MODELS
    from gpulab.predict.replay import workload
    from gpulab.record.runs.checkpoint import cpu_threads
    from gpulab.widgets.activations import compute_modelsize
    from gpulab.widgets.allocator import compute_allocator
    from gpulab.widgets.flops import compute_depthwise
    with cpu_threads(2):
        size2 = modelsize_vs_saved(tuple(MODELS), 1, "float32", "cpu")
        depth2 = depthwise_vs_standard(16, 32, 28, 2, True, "float32", "cpu")
        alloc2 = workload("training step", "cnn", 4, expandable_segments=False, empty_cache=False)
    with cpu_threads(1):   # as the panels run them (``Panel(threads=1)``)
        size1 = compute_modelsize(1, "float32", "cpu")
        depth1 = compute_depthwise(16, 32, 28, 2, True, "float32", "cpu")
        alloc1 = compute_allocator("cnn", 4, "training step", False, False)
    assert size1._repr_html_() == size2._repr_html_()
    assert depth1._repr_html_() == depth2._repr_html_()
    assert (alloc1.allocated, alloc1.reserved, alloc1.stats) == (alloc2.allocated, alloc2.reserved, alloc2.stats)
