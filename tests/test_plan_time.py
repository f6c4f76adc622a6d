"""Issue 46 items 2-4: what a layout adds to a step's time (predict.comm_time, predict.plan_time), and the
answers that show it. Checked against NCCL's own formulas (nccl-tests doc/PERFORMANCE.md), Narayanan et al.'s
bubble, and the timed runs themselves (a laid-out depth against the full depth timed)."""
from __future__ import annotations

import pytest
import torch

import gpulab
from gpulab.models.workload import resolve_workload
from gpulab.options import Layout, Recipe
from gpulab.predict.card_speeds import CARD_SPEEDS
from gpulab.predict.comm_time import bus_factor, collective_seconds, link_for
from gpulab.predict.plan_time import plan_time, timed_rank
from gpulab.training.loop import loop_recipe

H100 = CARD_SPEEDS["H100"]


def test_nccl_bus_factors_and_links():
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("all_gather", 4) == bus_factor("reduce_scatter", 4) == pytest.approx(3 / 4)
    assert bus_factor("all_reduce", 1) == 0
    # 1 GB all-reduced over 8 GPUs on NVLink (450 GB/s a direction): 1e9 · 1.75 / 450e9
    assert collective_seconds("all_reduce", 10 ** 9, 8, 450e9) == pytest.approx(1.75 / 450)
    assert link_for(H100.links, 8) == (450e9, "NVLink") and link_for(H100.links, 16) == (50e9, "network")
    assert link_for(CARD_SPEEDS["RTX 4090"].links, 16)[0] is None
    with pytest.raises(ValueError, match="unknown collective"):
        bus_factor("gossip", 2)


@pytest.mark.extended   # ~15 s on the shared 2-core machine (the fake process group's first run)
def test_a_tensor_parallel_step_costs_the_collectives_its_run_issued():
    r = gpulab.step("hf:tiny-llama", batch=2, seq_len=32, gpu="H100", time=True, tp=2, sequence_parallel=True)
    kinds = {(c.kind, c.group, c.link) for c in r.time.collectives.values()}
    assert kinds == {("all_gather", 2, "NVLink"), ("reduce_scatter", 2, "NVLink")}
    assert r.time.comm_s == pytest.approx(sum(c.seconds for c in r.time.collectives.values()))
    assert r.time.seconds == pytest.approx(sum(r.time.by_phase.values()))
    assert "reduce-scatter over 2 ranks (NVLink)" in repr(r.time)
    # each DTensor op costed as the rank's own kernel: tiny-llama's every FLOP is in a linear, attention or
    # the head, each split over the 2 ranks (timing._local_share), so the rank runs half of one GPU's FLOPs
    one = gpulab.step("hf:tiny-llama", batch=2, seq_len=32, gpu="H100", time=True)
    assert r.time.flops == one.time.flops // 2 and r.time.model_flops == pytest.approx(one.time.model_flops / 2)


def test_a_depth_laid_out_from_two_small_runs_equals_the_full_depth_timed():
    from gpulab.predict.layer_repeat import workload_with_depth
    # 12 layers: the memory search lays that depth out (layer_repeat.MIN_REPEAT_DEPTH), and the time follows it
    w = workload_with_depth(resolve_workload("hf:tiny-llama", seq_len=32), 12)
    recipe = loop_recipe(Recipe(optimizer="adamw"), Layout())
    laid = timed_rank(w, 2, torch.float32, recipe, H100)
    assert laid.depth.startswith("timed at 1 and 2 layers")
    from gpulab.predict.plan_time import Runs, _timed_at
    full, params, grads = _timed_at(w, None, 2, torch.float32, recipe, H100, 64, "tokens", Runs())
    assert laid.step.flops == full.flops and laid.step.kernels == full.kernels
    assert laid.step.seconds == pytest.approx(full.seconds, rel=1e-9)
    assert laid.param_bytes == params and laid.grad_bytes == grads


def test_data_parallel_comm_and_the_pipeline_bubble():
    w = resolve_workload("hf:tiny-llama", seq_len=32)
    recipe = loop_recipe(Recipe(optimizer="adamw"), Layout())
    ddp = plan_time(w, 2, torch.float32, recipe, Layout(gpus=4, strategy="ddp"), H100)
    (ar,) = ddp.comm
    assert ar.ranks == 4 and ar.link == "NVLink" and ar.nbytes > 0
    assert ar.seconds == pytest.approx(collective_seconds("all_reduce", ar.nbytes, 4, 450e9))
    assert ddp.items == 4 * 64 and ddp.seconds >= ddp.rank.seconds
    fsdp = plan_time(w, 2, torch.float32, recipe, Layout(gpus=4, strategy="fsdp2"), H100)
    assert [c.name.split(",")[0] for c in fsdp.comm] == ["parameter all-gather", "parameter all-gather + gradient "
                                                                                  "reduce-scatter"]
    # each of FSDP's 4 ranks steps its quarter of every tensor; DDP's each the whole model (the timed run's)
    assert ddp.optimizer_s == ddp.rank.by_phase["optimizer"] > 0
    assert fsdp.optimizer_s == pytest.approx(ddp.optimizer_s / 4, rel=1e-12)
    assert fsdp.seconds - fsdp.exposed_comm_s == pytest.approx(ddp.rank.seconds - 3 * ddp.optimizer_s / 4, rel=1e-12)
    lay = Layout(pp=2, microbatches=4)
    pipe = plan_time(w, 1, torch.float32, loop_recipe(Recipe(optimizer="adamw"), lay), lay, H100)
    # GPipe/1F1B: bubble (p - 1)·t, a fraction (p - 1)/m of m·t
    assert pipe.bubble_s == pytest.approx(pipe.compute_s / 4)
    assert "(p - 1)/m = 0.250" in pipe.bubble_formula
    assert pipe.items == 4 * 32


@pytest.mark.extended   # ~10 s: a whole fit search twice
def test_fit_and_serve_answer_with_time_and_what_fits_ranks_by_it():
    r = gpulab.fit("hf:tiny-llama", "H100", seq_len=32)
    t = r.time
    assert t.label == "predicted (roofline, H100)" and t.items == r.largest_batch * 32 and 0 < t.mfu < 0.75
    assert r.as_dict()["time"]["seconds"] == t.seconds
    assert gpulab.fit("hf:tiny-llama", "24GiB", seq_len=32).time_note.startswith("gpulab has no speed figures")
