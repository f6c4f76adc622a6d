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
