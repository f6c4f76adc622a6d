"""The time model (issue 46, item 1): a roofline per op of the fake step, on a card's datasheet speeds.

Checked against what no one here wrote: FlopCounterMode's own count of the same step (exact),
Transformer Math's C ≈ 6·N·D (Kaplan et al. 2020, eq. 2.1's 2N per token forward, ×3 for training)
within 2% for GPT-2 at 128 tokens, where attention's 2·n_layer·n_ctx·d_model per token is ~1% of 2N;
and a real CPU run's ratio of step times between two recipes, with a wide tolerance (the machine is
shared; benchmarks/time_ratios.py prints the figures)."""
from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import gpulab
from conftest import ROOT
from gpulab.measure.cpu_speed import measure_cpu_speed
from gpulab.measure.engines import run
from gpulab.models.workload import resolve_workload
from gpulab.options import Layout, Recipe
from gpulab.predict.card_speeds import CARD_SPEEDS, CardSpeed, TimeAssumptions, cpu_card_speed, speed_of
from gpulab.predict.timing import roofline_seconds
from gpulab.training.loop import loop_recipe, train_experiment


@pytest.fixture(scope="module")
def gpt2_h100():
    return gpulab.step("hf:gpt2", batch=1, seq_len=128, optimizer="adamw", gpu="H100", time=True, steps=1)


def test_the_steps_flops_equal_flop_counter_modes_count_of_the_same_step(gpt2_h100):
    w = resolve_workload("hf:gpt2", seq_len=128)
    experiment = train_experiment(w, [1], torch.float32, loop_recipe(Recipe(optimizer="adamw"), Layout()))
    counter = FlopCounterMode(display=False)

    def counted(ctx):
        with counter:
            return experiment(ctx)
    run(counted, "fake", fake_target="cuda")
    assert gpt2_h100.time.flops == counter.get_total_flops()   # exact: 96,986,529,792 here


def test_model_flops_are_six_n_d_for_a_dense_transformer(gpt2_h100):
    n = sum(p.numel() for p in resolve_workload("hf:gpt2", seq_len=128).build("meta", torch.float32).parameters())
    t = gpt2_h100.time
    assert t.items == 128 and t.unit == "tokens"
    assert 1.0 <= t.model_flops / (6 * n * t.items) <= 1.02   # 1.012: attention's share, as Kaplan's C_forward says


def test_matmuls_are_compute_bound_and_elementwise_ops_memory_bound_on_an_h100(gpt2_h100):
    ops = gpt2_h100.time.by_op
    assert ops["mm"].bound == "compute" and ops["addmm"].bound == "compute"
    assert ops["add"].bound == "memory" and ops["mul"].bound == "memory"
    # the roofline itself: a 4096³ bf16 matmul vs a 2^24-element fp32 add
    h100, a = CARD_SPEEDS["H100"], TimeAssumptions()
    c, m = roofline_seconds(2 * 4096 ** 3, 3 * 4096 ** 2 * 2, h100.peak_flops("bf16"), h100.bandwidth_bytes_s, a)
    assert c > m
    c, m = roofline_seconds(0, 3 * 2 ** 24 * 4, h100.peak_flops("fp32"), h100.bandwidth_bytes_s, a)
    assert m > c == 0


def test_the_answer_names_its_card_its_assumptions_and_splits_the_step(gpt2_h100):
    t = gpt2_h100.time
    assert t.label == "predicted (roofline, H100)"
    assert set(t.by_phase) == {"forward", "backward", "optimizer"}
    assert t.seconds == pytest.approx(sum(t.by_phase.values()))
    assert t.launch_s == pytest.approx(t.kernels * 1e-6)
    assert 0 < t.compute_bound_share < 1 and 0 < t.mfu < 0.75 and t.mfu_dtype == "fp32"
    text = repr(t)
    for part in ("predicted (roofline, H100)", "compute efficiency 0.75", "launch overhead 1 µs", "RuntimeEstimator",
                 "MFU", "tokens/s", "nvidia.com"):
        assert part in text
    assert "<table" in t._repr_html_() and gpt2_h100.as_dict()["time"]["mfu"] == t.mfu


def test_a_bigger_efficiency_is_a_shorter_step_and_the_steady_state_is_the_last_step():
    faster = dataclasses.replace(speed_of("H100"), assumptions=TimeAssumptions(compute_efficiency=1.0))
    a = gpulab.step("hf:tiny-llama", batch=2, seq_len=32, gpu="H100", time=True)
    b = gpulab.step("hf:tiny-llama", batch=2, seq_len=32, gpu="H100", time=faster)
    assert b.time.seconds < a.time.seconds and b.time.flops == a.time.flops
    # step 2 creates no optimizer state: no zeros_like for Adam's moments in the steady state
    one = gpulab.step("hf:tiny-llama", batch=2, seq_len=32, gpu="H100", time=True, steps=1)
    steady = a.time.by_op["zeros_like"].count if "zeros_like" in a.time.by_op else 0
    assert one.time.by_op["zeros_like"].count > steady


def test_card_table_rows_name_their_source_and_say_where_a_figure_is_missing():
    for name in ("H100", "H200", "A100-40GB", "A100-80GB", "T4", "RTX 4090", "L4"):
        row = speed_of(name)
        assert row.source and row.bandwidth_gbs > 0 and row.peak_tflops["fp32"] > 0
    assert speed_of("H100-SXM").peak_tflops["bf16"] == pytest.approx(989.5)   # 1,979* halved
    with pytest.raises(ValueError, match="T4 has no bf16 peak"):
        speed_of("T4").peak_flops("bf16")
    with pytest.raises(ValueError, match="no speed figures for V100-16GB"):
        speed_of("V100-16GB")
    with pytest.raises(ValueError, match="name it with gpu="):
        gpulab.step("hf:tiny-llama", batch=1, seq_len=8, time=True)
    with pytest.raises(ValueError, match="engine='fake'"):
        gpulab.step("hf:tiny-llama", batch=1, seq_len=8, gpu="H100", time=True, engine="cpu")
    with pytest.raises(ValueError, match="compute_efficiency"):
        TimeAssumptions(compute_efficiency=0)


def _time_ratios():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import time_ratios
    return time_ratios


def test_predicted_ratio_of_two_recipes_against_a_real_cpu_run():
    """Batch 8 over batch 2 of a small GPT-2 on this CPU, measured as a card on the spot, one thread,
    timed by the thread's CPU time (benchmarks/time_ratios.py). At the commit, on a 2-core machine at
    load 11: predicted 3.64, measured 3.46. The bound is wide: the default run's cheap check."""
    time_ratios = _time_ratios()
    card = time_ratios.cpu_card()
    assert isinstance(card, CardSpeed) and card.assumptions.compute_efficiency == 1.0
    (row,) = time_ratios.ratios(card, pairs=time_ratios.PAIRS[:1], steps=3)
    assert 0.5 < row["quotient"] < 2.0, row


@pytest.mark.extended
def test_the_cpu_model_predicts_each_recipes_ratio_of_step_times():
    """Issue 46 item 5 on the CPU: checkpointing on/off, batch 8 vs 2 and 8 vs 1, for-loop vs foreach Adam,
    each predicted ratio against real timed CPU steps (one torch thread, each the fastest of 5 steps by
    ``time.thread_time``: another process's work delays a step without counting in it). At the commit (2-core
    AMD EPYC, load 11): predicted/measured 1.05, 0.95, 1.14, 1.22. Tolerance: predicted/measured in
    [0.75, 1.4]. Why so wide: the roofline charges one launch cost for every op and none of the CPU's
    caches (a small batch's weights stay in cache; the for-loop's per-tensor ops cost less than eager's
    measured per-op overhead inside foreach's C++ loop), so 20-25% off is the model's own error; wider than
    that is a wrong model (e.g. recompute not counted would predict 1.0 for checkpointing: 0.75 of 1.34)."""
    time_ratios = _time_ratios()
    rows = time_ratios.ratios(time_ratios.cpu_card(), steps=5)
    assert len(rows) == 4
    for row in rows:
        assert 0.75 < row["quotient"] < 1.4, row
