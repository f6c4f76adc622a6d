"""Lesson 12's course module: ZeRO's figure 1 reproduced, any model and card, gradient
accumulation measured, the exercises and the panel."""
from __future__ import annotations

import dataclasses

import pytest

from gpulab.course import distributed as D
from gpulab.formulas import zero_bytes_per_device
from gpulab.units import format_bytes


def test_zero_figure1_exactly():
    t = D.zero_figure1()
    assert [round(t.gb(s, 64), 1) for s in range(4)] == [120.0, 31.4, 16.6, 1.9]
    assert "120.0 GB" in t._repr_html_()
    assert D.exercise_zero2().check(16.6).ok and not D.exercise_zero2().check(31.4).ok


def test_cards_needed_for_llama_full_adam():
    """On H100s (80 GiB): the paper's formula says two cards for ZeRO-1, -2 and -3; DeepSpeed's own
    layout (its fp32 gradient partition) needs three for ZeRO-1 and ZeRO-2: 88 GB a card at N = 2."""
    c = D.cards_needed("llama-3-8b", "H100")
    assert c.n_params == 8_030_261_248 and c.card == "H100" and c.usable_bytes > 80 * 10**9
    assert c.needed == {0: None, 1: 2, 2: 2, 3: 2}
    assert c.framework_needed == {0: None, 1: 3, 2: 3, 3: 2}
    for stage, n in c.needed.items():
        if n:  # the smallest N: it fits, one fewer does not
            assert zero_bytes_per_device(c.n_params, n, stage) <= c.usable_bytes
            assert n == 1 or zero_bytes_per_device(c.n_params, n - 1, stage) > c.usable_bytes
    from gpulab.predict.sharding import Sharding, deepspeed_estimate
    from gpulab.predict.sharding import Layers
    layers = Layers(c.n_params, c.largest_layer, 0)
    assert deepspeed_estimate(c.n_params, Sharding(2, "zero2"), layers) > c.usable_bytes
    assert abs(c.framework_per_device[2] - deepspeed_estimate(c.n_params, Sharding(3, "zero2"), layers)) <= 18
    html = c._repr_html_()
    assert "never" in html and "DeepSpeed" in html
    # "80GB" is 80·10⁹ bytes (lesson 00's units): less than an H100, and ZeRO-1 then needs three by the paper too
    assert D.cards_needed("llama-3-8b", "80GB").needed[1] == 3
    # issue 47: the lesson typed "84.5 GB usable" beside a table printing 83.6 GB; it renders reading()
    text = c.reading()
    assert format_bytes(c.usable_bytes, "decimal") in text and "84.5" not in text
    assert all(format_bytes(c.per_device[s], "decimal") in text for s in (1, 2, 3))
    assert "never fits" in text and "on 3 cards" in text


def test_gradient_accumulation_same_gradients_fewer_activations():
    acc = D.grad_accumulation("transformer", batch_size=8, micro_batches=4, width=64, seq_len=16)
    assert acc.max_grad_difference <= 1e-5 * acc.grad_scale
    assert acc.activations[4] < 0.4 * acc.activations[1]
    ex = D.exercise_accumulation_activations(acc)
    assert ex.check(acc.activations[4] / acc.activations[1]).ok
    bn = D.grad_accumulation("cnn", batch_size=8, micro_batches=4, width=8)
    assert bn.max_grad_difference > 1e-5 * bn.grad_scale  # BatchNorm: not the same gradients
    assert "BatchNorm" in bn._repr_html_()
    with pytest.raises(ValueError, match="equal micro-batches"):
        D.grad_accumulation(batch_size=10, micro_batches=4)


@pytest.mark.slow
def test_compare_strategies_and_figures(tmp_path, monkeypatch):
    import gpulab.distributed.sharding as S
    spawns = []
    real = S.run_distributed
    monkeypatch.setattr(S, "run_distributed", lambda *a, **k: spawns.append(a[1]) or real(*a, **k))
    comp = D.compare_strategies("cnn", world_size=2, width=32, strategies=("ddp", "fsdp2"), bucket_view=True)
    assert spawns == [2], "every strategy and the bucket-view DDP run in one set of worker processes"
    html = comp._repr_html_()
    assert "DDP (replicated)" in html and "FSDP2" in html
    assert [r.spec.strategy for r in comp.runs] == ["ddp", "fsdp2"] and comp.run("fsdp2") is comp.runs[1]
    ddp = comp.run("ddp")
    assert ddp.measured(0)["total"] - ddp.formula()["total"] == 4 * len(ddp.shapes)  # step counters
    # gradient_as_bucket_view: the buckets are the gradients, the separate copy is gone
    view = comp.bucket_view
    assert view.spec.bucket_view and view.spec.strategy == "ddp" and view.spec.width == 32
    grads = ddp.ranks[0].at_end["gradients"]
    assert ddp.ranks[0].at_end["communication buffers"] == grads > 0
    assert view.ranks[0].at_end["gradients"] == grads and view.ranks[0].at_end["communication buffers"] == 0
    with pytest.raises(KeyError, match="zero1"):
        comp.run("zero1")
    D.strategy_bars(comp.runs).savefig(tmp_path / "bars.png")
    D.gathered_timeline(comp.runs[1]).savefig(tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 10_000

    # the panel opens with the run already measured at its settings, then measures afresh
    from gpulab.widgets import distributed as W
    measured_again = []
    monkeypatch.setattr(W, "measure_strategy", lambda **k: measured_again.append(k) or comp.runs[0])
    panel = W.sharding_panel(strategy="fsdp2", world_size=2, model="cnn", width=32, measured=comp.runs)
    first = panel.run()
    assert first is comp.run("fsdp2") and measured_again == [] and len(spawns) == 1
    assert "measured above" in panel._render(first)[0].data
    panel.run()
    assert "measured above" not in str(panel._render(panel.result)[0])
    assert measured_again == [dict(world_size=2, strategy="fsdp2", model="cnn", width=32)], \
        "a Run after the first showing measures again"
    # a setting not measured yet: every strategy at once, in one set of processes; then switching strategy
    # shows what was measured, and Run again measures afresh
    from gpulab.distributed.sharding import STRATEGIES
    asked = []
    monkeypatch.setattr(W, "measure_strategies", lambda specs, ws: asked.append((specs, ws)) or [
        dataclasses.replace(comp.runs[i % len(comp.runs)], spec=s,
                            run=dataclasses.replace(comp.runs[i % len(comp.runs)].run, world_size=ws))
        for i, s in enumerate(specs)])
    other = W.sharding_panel(strategy="ddp", world_size=1, model="cnn", width=32, measured=comp.runs)
    ddp1 = other.run()
    assert [(s.strategy, s.model, s.width) for s in asked[0][0]] == [(s, "cnn", 32) for s in STRATEGIES]
    assert asked[0][1] == 1 and ddp1.spec.strategy == "ddp" and ddp1.world_size == 1
    other.set(strategy="fsdp2")
    assert len(asked) == 1 and other.result.spec.strategy == "fsdp2" and other.result.world_size == 1
    assert "measured earlier" in other._render(other.result)[0].data
    n = len(measured_again)
    other.run()
    assert len(measured_again) == n + 1 and measured_again[-1] == dict(world_size=1, strategy="fsdp2", model="cnn",
                                                                       width=32)


@pytest.mark.slow
def test_sharding_panel_runs_one_process():
    from gpulab.widgets import sharding_panel
    panel = sharding_panel(strategy="fsdp2", world_size=1, model="cnn", width=32)
    result = panel.run()
    assert panel.error is None, panel.error
    assert result.world_size == 1 and result.ranks[0].at_end["parameters"] == 4 * result.n_params


def test_the_torchtitan_layout_counts_one_ranks_share_and_draws_its_mesh():
    import torch

    from gpulab.course.titan_layout import titan_layout
    from gpulab.models import hf_configs
    t = titan_layout("hf:llama-3.1-70b", dp_shard=32, tp=8)
    with torch.device("meta"):
        whole = sum(p.numel() for p in hf_configs.build_causal_lm(hf_configs.make_config("llama-3.1-70b")).parameters())
    # every matrix split 8 ways, then 32 ways by FSDP; the norms (whole on each TP rank) are under 0.01%
    assert t.parameters_per_rank == pytest.approx(whole / 256, rel=1e-3)
    assert t.states_bytes == 16 * t.parameters_per_rank
    assert t.error_percent == pytest.approx(100 * (t.states_bytes - 71.9 * 2 ** 30) / (71.9 * 2 ** 30))
    fig = t.figure()
    cells = [p for p in fig.axes[0].patches if p.get_fill()]
    assert len(cells) == 256 and "dp_shard 32 x tp 8" in fig._suptitle.get_text()
    with pytest.raises(ValueError, match="pp must divide the model's 80 layers"):
        titan_layout("hf:llama-3.1-70b", pp=3)
