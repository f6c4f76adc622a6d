"""Issue 46 item 7: the step's time read off the fake runs the memory search makes (``predict.run_ops``).

Checked: each op's FLOPs and bytes are affine in the batch (batches 2 and 3 laid out to 5 give batch 5's
run, op for op, with checkpointing and the loss in chunks too), where they are not (a mixture of experts
whose tokens do not split evenly) the layout is refused rather than used; ``fit``'s time, read off its
search's runs, equals the time of separate timed runs (the way it was made before) to the last bit; the
tracker's observer sees the ops a dispatch mode of its own sees; a laid-out time keeps the runs' order
(the same answer in every process).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import transformers

import gpulab
from gpulab.measure.engines import run
from gpulab.models import hf_configs
from gpulab.models.workload import resolve_workload
from gpulab.options import Layout, Recipe
from gpulab.predict import fake_runs
from gpulab.predict import run_cache
from gpulab.predict.card_speeds import CARD_SPEEDS
from gpulab.predict.layer_repeat import with_depth
from gpulab.predict.plan_time import Runs, _laid_out, plan_time, timed_rank
from gpulab.predict.run_ops import at_batch
from gpulab.predict.timing import OpTimer, timed_experiment
from gpulab.training.loop import loop_recipe, train_experiment

H100 = CARD_SPEEDS["H100"]


def _ops(w, recipe, dt, batches):
    return {b: fake_runs.timed_fake_run(w, b, dt, recipe)[1] for b in batches}


def _wrong_kinds(laid, ran) -> Counter:
    """The op kinds (names) whose FLOPs or bytes the layout got wrong, and how many calls."""
    return Counter(a.name for a, b in zip(laid.ops, ran.ops) if a != b)


def test_each_ops_flops_and_bytes_are_affine_in_the_batch():
    w = resolve_workload("hf:tiny-llama", seq_len=32)
    recipe = loop_recipe(Recipe(optimizer="adamw", dtype="bf16", checkpointing="full", chunked_loss=4), Layout())
    ops = _ops(w, recipe, torch.bfloat16, (2, 3, 5))
    laid = at_batch(ops[2], ops[3], 2, 5)
    assert laid is not None and len(laid.ops) == len(ops[5].ops) > 100
    assert not _wrong_kinds(laid, ops[5]), _wrong_kinds(laid, ops[5])
    assert laid == ops[5]                     # every op, the offloaded, parameter and gradient bytes
    kinds = {o.name for o in laid.ops}
    assert {"mm", "_log_softmax", "embedding_dense_backward"} <= kinds, kinds   # matmuls, the loss, the embedding
    assert any("attention" in k for k in kinds) and any(k.startswith("_foreach") for k in kinds), kinds
    assert sum(o.phase == "backward" and o.name == "mm" for o in laid.ops) > \
        sum(o.phase == "forward" and o.name == "mm" for o in laid.ops)   # the recompute is in the step
    assert at_batch(ops[2], ops[3], 2, 1) is None   # batch 1 is not laid out (its size-1 dimensions)


@pytest.mark.extended   # ~3 s: six fake runs of a mixture of experts
def test_experts_whose_tokens_do_not_split_evenly_are_not_laid_out():
    """Balanced routing gives E experts ``tokens·k // E`` rows, one more to the first ``tokens·k % E``
    (``training.routing.expert_rows``): 30 tokens a sequence over 8 experts is not affine in the batch,
    so ``timed_step`` times the batch it needs rather than lay it out."""
    cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=64,
                                     max_position_embeddings=64)
    w = resolve_workload(cfg, seq_len=30)
    recipe = loop_recipe(Recipe(optimizer="adamw", routing="balanced"), Layout())   # the eager loop over experts
    ops = _ops(w, recipe, torch.float32, (2, 3, 5))
    laid = at_batch(ops[2], ops[3], 2, 5)
    assert laid is None or laid != ops[5]
    run_cache.clear()
    key, target = run_cache.workload_key(cfg, w, own_parts=False), ("cuda", "H100")
    for b in (2, 3, 4):   # the search's timed runs: 4 confirmed its memory, and shows the ops are not affine
        fake_runs.tracked(w, key, b, torch.float32, recipe, target, timed=True)
    made = []
    real = fake_runs.fake_run
    try:
        fake_runs.fake_run = lambda *a: made.append(a[1]) or real(*a)
        assert fake_runs.timed_step(w, key, None, 5, torch.float32, recipe, target) == ops[5]
    finally:
        fake_runs.fake_run = real
        run_cache.clear()
    assert made == [5]


def test_fits_time_from_its_search_equals_separate_timed_runs():
    """12 layers: the search lays the depth out from runs of 1 and 2 layers, timed; the time made the way
    it was before (its own timed runs, nothing kept) is the same to the last bit."""
    run_cache.clear()
    cfg = with_depth(hf_configs.make_config("tiny-llama"), 12)
    r = gpulab.fit(cfg, "H100", seq_len=32, optimizer="adamw")
    assert r.largest_batch > 3 and r.time is not None and r.time.depth.startswith("timed at 1 and 2 layers")
    w = resolve_workload(cfg, seq_len=32)
    alone = plan_time(w, r.largest_batch, torch.float32, loop_recipe(Recipe(optimizer="adamw"), Layout()), Layout(),
                      H100, runs=Runs())
    assert r.time.as_dict() == alone.as_dict()
    run_cache.clear()


def test_the_trackers_observer_sees_what_a_dispatch_mode_of_its_own_sees():
    w = resolve_workload("hf:tiny-llama", seq_len=16)
    recipe = loop_recipe(Recipe(optimizer="adamw", checkpointing="full"), Layout())
    observed: list = []
    run(timed_experiment(train_experiment(w, [2, 2], torch.float32, recipe), observed), "fake", fake_target="cuda")
    moded: list = []
    experiment = train_experiment(w, [2, 2], torch.float32, recipe)

    def as_mode(ctx):
        moded.append(OpTimer(ctx.tracker.current_phase, 1))
        with moded[0]:
            return experiment(ctx)
    run(as_mode, "fake", fake_target="cuda")
    assert len(observed[0].ops) > 100 and observed[0].ops == moded[0].ops


def test_a_laid_out_time_keeps_the_order_its_runs_met_ops_and_collectives_in():
    w = with_depth(hf_configs.make_config("tiny-llama"), 12)
    rank = timed_rank(resolve_workload(w, seq_len=16), 2, torch.float32, loop_recipe(Recipe(), Layout()), H100)
    a = rank.step
    names = list(a.by_op)
    b = type(a)(**{**a.__dict__, "by_op": {n: a.by_op[n] for n in reversed(names[1:])}})
    assert list(_laid_out(b, a, 2.0).by_op) == names
    assert list(_laid_out(a, b, 2.0).by_op) == [*reversed(names[1:]), names[0]]
