"""Lesson 09's panel and replay against independent references, and the lessons' checkers."""
import pytest

from gpulab.predict import replay as R
from gpulab.allocator.simulator import MiB, simulate
from gpulab.measure.engines import LABEL_SIMULATED
from gpulab.course.exercises import Exercise
from gpulab.formulas import tensor_bytes
from gpulab.measure.tracking import TrackingResult
from gpulab.widgets import allocator_panel


def rounded_peak(m):
    t = m.tracking
    return TrackingResult.build(t.records, t.events, t.device, True).peak_bytes


def test_replay_of_tracked_step_matches_tracker_peak_exactly():
    m = R.tracked_steps("cnn", [8, 8], engine="cpu")
    run = R.replay_events(R.tracked_events(m))
    tracked = m.tracking.events
    assert run.peak_allocated == rounded_peak(m)
    assert run.peak_allocated == simulate(tracked).stats["allocated_bytes.all.peak"]
    assert all(r >= a for a, r in zip(run.allocated, run.reserved))
    assert run.peak_reserved >= run.peak_allocated
    assert len(run.allocated) == len(tracked)


def test_step_boundaries_are_after_each_optimizer_phase():
    m = R.tracked_steps("mlp", [4, 4, 4], engine="cpu")
    ends = R.step_boundaries(R.tracked_events(m))
    assert len(ends) == 3


def test_panel_default_and_controls():
    p = allocator_panel(model="mlp", batch=8)
    p.run()
    assert p.error is None and p.result.workload == "training step"
    assert p.result.label == LABEL_SIMULATED
    assert p.result.peak_reserved >= p.result.peak_allocated > 0
    assert p.result.tracked_peak == p.result.peak_allocated

    p.set(workload_name="fragmentation")
    frag = p.result
    # 8 x 6 MiB, every other freed, then 4 x 12 MiB: allocated peak = 4*6 + 4*12 MiB
    assert frag.peak_allocated == (4 * 6 + 4 * 12) * MiB
    # 6 MiB requests share 20 MiB segments (3 per segment, 8 -> 3 segments); 12 MiB ones get their own
    assert frag.peak_reserved == 3 * 20 * MiB + 4 * 12 * MiB
    assert frag.num_device_alloc == 7

    p.set(expandable_segments=True)
    assert p.result.expandable_segments and p.result.peak_reserved < frag.peak_reserved

    p.set(workload_name="growing batches", batch=16, expandable_segments=False)
    assert p.error is None and p.result.workload == "growing batches"
    assert p.result.peak_reserved >= p.result.peak_allocated


def test_empty_cache_every_step_costs_cuda_mallocs_not_peak():
    cost = R.empty_cache_cost("cnn", 16, steps=3, engine="cpu")
    without, with_ = cost["without"], cost["with empty_cache"]
    assert with_["cudaMalloc calls"] > without["cudaMalloc calls"]
    assert with_["peak reserved"] <= without["peak reserved"]
    assert without["cudaFree calls"] == 0
    # the small MLP's activations share segments with its parameters: nothing is ever wholly free
    small = R.empty_cache_cost("mlp", 8, steps=3, engine="cpu")
    assert small["with empty_cache"]["cudaMalloc calls"] == small["without"]["cudaMalloc calls"]


def test_empty_cache_releases_only_whole_free_segments():
    run = R.replay_events([{"kind": "alloc", "sid": 0, "nbytes": 6 * MiB},
                           {"kind": "alloc", "sid": 1, "nbytes": 6 * MiB},
                           {"kind": "free", "sid": 0, "nbytes": 6 * MiB}], empty_cache_at=[2])
    assert run.reserved[-1] == 20 * MiB
    run = R.replay_events([{"kind": "alloc", "sid": 0, "nbytes": 6 * MiB},
                           {"kind": "free", "sid": 0, "nbytes": 6 * MiB}], empty_cache_at=[1])
    assert run.reserved[-1] == 0


def test_beyond_allocator_is_labelled_not_measurable_without_cuda():
    import torch
    b = R.beyond_allocator_bytes()
    if not torch.cuda.is_available():
        assert b["bytes"] is None and "not measurable" in b["label"]


def test_unknown_workload_is_refused():
    with pytest.raises(ValueError):
        R.workload("nope")


# ---- the lessons' checkers --------------------------------------------------------------------

def test_checker_09_reserved_after_3mib_tensor():
    ex = Exercise("q", expected=lambda: simulate([{"kind": "alloc", "sid": 0, "nbytes": 786_432 * 4}]).peak_reserved,
                  explain="", unit="bytes")
    assert ex.check(20 * MiB).ok
    assert not ex.check(3 * MiB).ok
    assert not ex.check(...).ok


def test_checker_10_leak_per_iteration():
    ex = Exercise("q", expected=lambda: tensor_bytes((64, 256)) + tensor_bytes((64, 512)) + tensor_bytes((64, 10))
                  + tensor_bytes(()), explain="", unit="bytes")
    assert ex.check(4 * 64 * (256 + 512 + 10) + 4).ok
    assert not ex.check(4 * 64 * 256).ok


# ---- GPU: the simulator next to the real allocator (skipped without CUDA) ------------------------
from conftest import cuda  # noqa: E402


@cuda
def test_cuda_simulated_next_to_real_allocator():
    run = R.workload("training step", "cnn", 8, engine="cuda")
    assert run.real is not None and run.real_label.startswith("measured on")
    assert run.peak_allocated == run.tracked_peak          # simulated vs tracked, 512-rounded
    assert run.real["allocated_bytes.all.peak"] >= run.tracked_peak  # real adds workspaces, baseline
    assert run.real["reserved_bytes.all.peak"] >= run.real["allocated_bytes.all.peak"]
    assert R.beyond_allocator_bytes()["bytes"] is not None
