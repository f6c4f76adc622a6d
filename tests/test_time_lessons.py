"""Issue 46, item 6: the lessons' time side (gpulab/course/step_time.py, data_loading.py, layout_time.py,
fastest_plan.py), each checked against a reference computed here by hand: the roofline's ridge from the
card's datasheet figures, the pipeline bubble's fraction from Narayanan et al. 2021, the FLOPs that
checkpoint_sequential recomputes from the Linear layer's 2·b·in·out, tensor parallelism's all-reduce
time from NCCL's bus factor, DDP's exposed all-reduce from its bucket. Measured times are never asserted
(the machine is shared): only that they are there, and the conclusion rule on planted samples."""
from __future__ import annotations

import pytest
import torch

from gpulab.course.step_time import RecomputeTime, cpu_as_card, recompute_time, ridge
from gpulab.predict.card_speeds import speed_of
from gpulab.predict.plan_time import bubble_seconds
from gpulab.record.runs.checkpoint import Timing


def test_the_ridge_point_is_the_datasheets_peak_over_its_bandwidth():
    h100 = speed_of("H100")
    # H100 SXM datasheet: FP32 67 TFLOP/s, 3.35 TB/s; RuntimeEstimator's 75% of the peak, the full bandwidth
    assert ridge(h100) == pytest.approx(67e12 * 0.75 / 3.35e12)
    assert ridge(h100, "bf16") == pytest.approx(1979e12 / 2 * 0.75 / 3.35e12)
    assert ridge(h100, "bf16") > 10 * ridge(h100)


@pytest.mark.parametrize("pp, m, v", [(4, 8, 1), (4, 8, 2), (8, 32, 1), (2, 1, 1)])
def test_the_bubble_is_narayanans_fraction_of_the_micro_batches(pp, m, v):
    t = 0.0123
    assert bubble_seconds(pp, t, v) / (m * t) == pytest.approx((pp - 1) / (v * m))


def test_the_time_model_counts_exactly_the_forward_that_checkpoint_sequential_recomputes():
    """16 blocks of Linear(128, 128) + ReLU at batch 64 in 16 segments: every segment but the last is
    recomputed in the backward (checkpoint_sequential runs the last one plainly), so the step gains 15
    Linear forwards, 2·b·128·128 FLOPs each (ReLU has none)."""
    r = recompute_time(n_blocks=16, width=128, batch=64, segments=(1, 16), repeats=1)
    assert r.recomputed_flops(16) == 15 * 2 * 64 * 128 * 128
    assert r.predicted_ratio(16, "card") > 1 and r.predicted_ratio(16) > 1
    assert all(len(p.measured.samples) == 1 and p.measured.min > 0 for p in r.points)
    assert r.points[0].on_card.label == "predicted (roofline, H100)"


def _planted(a: list[float], b: list[float]) -> RecomputeTime:
    """Two measured intervals planted, with predicted steps of 10 and 13 ms."""
    from types import SimpleNamespace

    from gpulab.course.step_time import RecomputePoint
    t0, t1 = SimpleNamespace(seconds=0.010), SimpleNamespace(seconds=0.013)
    return RecomputeTime(4, 8, 2, None, "H100", [RecomputePoint(1, t0, t0, 0, Timing(a, 1, "x")),
                                                 RecomputePoint(4, t1, t1, 0, Timing(b, 1, "x"))])


def test_a_conclusion_is_drawn_only_when_the_measured_intervals_do_not_overlap():
    apart = _planted([0.010, 0.011], [0.012, 0.013])
    assert apart.separated(4) and "do not overlap" in apart.conclusion(4) and "slower" in apart.conclusion(4)
    assert "×1.20 as long" in apart.conclusion(4) and "×1.30 predicted" in apart.conclusion(4)
    close = _planted([0.010, 0.013], [0.012, 0.014])
    assert not close.separated(4) and "no conclusion" in close.conclusion(4)


def test_this_cpu_as_a_card_is_measured_with_no_efficiency_factor():
    cpu = cpu_as_card()
    assert cpu.assumptions.compute_efficiency == 1.0 and cpu.assumptions.memory_efficiency == 1.0
    assert cpu.peak_flops("fp32") > 1e8 and cpu.bandwidth_bytes_s > 1e8 and "measured here" in cpu.source


def test_data_loading_times_each_setting_and_says_pin_memory_is_a_gpus():
    from gpulab.course.data_loading import SETTINGS, SlowItems, exercise_workers, loader_times
    assert len(SlowItems(5)) == 5 and SlowItems(5)[3][0].shape == (3, 32, 32)
    r = loader_times(items=4, batch=2, wait_s=0.0, repeats=2, settings=SETTINGS[:2])
    assert set(r.times) == {s.name for s in SETTINGS[:2]} and all(len(t.samples) == 2 for t in r.times.values())
    if not torch.accelerator.is_available():
        assert "pin_memory=True was ignored" in r._repr_html_()
    with pytest.raises(ValueError):
        loader_times(repeats=0)
    assert exercise_workers  # the exercise needs a num_workers=2 row: the lesson's default settings have one


@pytest.mark.extended
def test_layout_times_follow_nccls_factors_and_each_strategys_overlap():
    from gpulab.course.layout_time import exercise_exposed, layout_times
    r = layout_times("hf:llama-3-8b", "H100", seq_len=256, batch=1, gpus=(8,), tp=8, pp=4, microbatches=8)
    links = speed_of("H100").links
    degree, nbytes, seconds, link = r.tp
    act = 1 * 256 * 4096 * 2                   # b·s·h in bf16
    assert nbytes == 4 * 32 * act and link == "NVLink"
    assert seconds == pytest.approx(4 * 32 * act * 2 * 7 / 8 / (links.nvlink_gbs * 1e9))
    ddp = r.plans[("ddp", 8)]
    (allreduce,) = ddp.comm
    assert allreduce.seconds == pytest.approx(allreduce.nbytes * 2 * 7 / 8 / (links.nvlink_gbs * 1e9))
    zero1 = r.plans[("zero1", 8)]
    assert zero1.comm[1].exposed_s == zero1.comm[1].seconds   # the gather after the step is never hidden
    assert [b.fraction for b in r.bubbles] == pytest.approx([3 / 8, 3 / 8, 3 / 16])
    assert exercise_exposed(r).expected() in "abc"
