"""Lesson 11, section 9 (``gpulab.course.modern_models``): every figure against an independent
computation from the configs' published shapes, written out here by hand."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest

from gpulab.course.modern_models import (context_bounds, dense_formula_bytes, exercise_gemma_cache,
                                         exercise_moe_routing, kv_caches, measured_longest_context, moe_params,
                                         moe_routing_steps, plot_kv_caches)
from gpulab.predict.cards import parse_gpu
from gpulab.predict.context import context_assumption
from gpulab.training.routing import eager_expert_bytes


def test_total_and_active_parameters_beside_the_cards():
    table = moe_params()
    m = table.row("mixtral-8x7b")
    # Mixtral-8x7B by hand: untied 32,000 × 4,096 embedding and head; per layer q, o (4096²), k, v
    # (4096 × 1024), 8 experts of 3 · 4096 · 14336, the router (8 × 4096), two norms; a final norm
    h, layers, expert = 4096, 32, 3 * 4096 * 14336
    per_layer = 2 * h * h + 2 * h * 1024 + 8 * expert + 8 * h + 2 * h
    total = 2 * 32000 * h + layers * per_layer + h
    assert m["total"] == total and m["active"] == total - layers * 6 * expert   # 2 of 8 experts per token
    for r in table.rows:   # the cards' figures, quoted beside: the count rounds to them
        assert f"{r['total'] / 1e9:.1f}B" == r["card_total"]
        assert abs(r["active_as_card"] / 1e9 - float(r["card_active"][:-1])) < 0.1
        assert r["training_state_bytes"] == 16 * r["total"] > r["active_state_bytes"] == 16 * r["active"]
    d = table.row("deepseek-v2-lite")
    assert d["active"] - d["active_as_card"] == 102400 * 2048   # the card leaves the input embedding out
    assert "12.88B active" in repr(table) and "mistral.ai" in table._repr_html_()


@pytest.fixture(scope="module")
def routing():
    return moe_routing_steps()


def test_every_expert_is_held_and_activations_follow_the_routed_rows(routing):
    # the small Mixtral by hand: untied 128 × 32 embedding and head; q, o 32 × 32; k, v 32 × 16
    # (2 KV heads of 8); 4 experts of gate_up 128 × 32 and down 32 × 64; router 4 × 32; 3 norms of 32
    params = 2 * 128 * 32 + 2 * 32 * 32 + 2 * 32 * 16 + 4 * (128 * 32 + 32 * 64) + 4 * 32 + 3 * 32
    assert routing.total_params == params
    bal, worst = routing.step("balanced"), routing.step("worst")
    for s in (bal, worst):
        assert s.parameters == s.gradients == 4 * params
        assert s.optimizer_state == 2 * 4 * params   # Adam's exp_avg and exp_avg_sq, fp32
        assert s.peak_phase == "optimizer" and s.routing in s.label
    assert bal.state == worst.state
    per_row = eager_expert_bytes(1, 32, 64, 4) - 64 * 4   # SiLU's output is filed under act_fn, not the expert
    tokens, k, e = 2 * 16, 2, 4
    assert bal.expert_activations == (tokens * k // e * per_row,) * e
    assert worst.expert_activations == (tokens * per_row,) * k + (0,) * (e - k)
    assert sum(bal.expert_activations) == sum(worst.expert_activations)
    ex = exercise_moe_routing(routing)
    assert ex.check("b").ok and not ex.check("a").ok and not ex.check("c").ok
    assert "worst" in routing._repr_html_() and "balanced" in repr(routing)


def test_kv_caches_measured_beside_the_dense_formula():
    table = kv_caches()
    # Gemma-2-9B: 42 layers, 8 KV heads of 256, bf16; 21 layers slide over 4,096 positions
    g = table.row("gemma-2-9b", 8192)
    assert g.dense_formula == 2 * 42 * 8 * 256 * 8192 * 2
    assert g.measured == 2 * 21 * 8 * 256 * 8192 * 2 + 2 * 21 * 8 * 256 * 4096 * 2
    assert g.below_dense == g.sliding_share == 21 * 2 * 8 * 256 * (8192 - 4096) * 2
    assert table.row("gemma-2-9b", 4096).below_dense == 0   # nothing slid out yet
    assert any(s.startswith("gemma-2-9b at 32,768") for s in table.skipped)   # 8,192 positions
    # Gemma-3-1B: 26 layers, 1 KV head of 256; every 6th layer global (4), 22 slide over 512
    g3 = table.row("gemma-3-1b", 32768)
    assert g3.measured == 2 * 256 * 2 * (4 * 32768 + 22 * 512)
    assert g3.below_dense == g3.sliding_share == 22 * 2 * 256 * (32768 - 512) * 2
    # DeepSeek-V2-Lite (MLA): 27 layers of a 512 latent + 64 rope key; K and V: 16 heads of 192 + 128
    d = table.row("deepseek-v2-lite", 32768)
    assert d.kind == "MLA" and d.measured == 27 * (512 + 64) * 32768 * 2
    assert d.dense_formula == dense_formula_bytes("deepseek-v2-lite", 32768) == 27 * 16 * (192 + 128) * 32768 * 2
    llama = table.row("llama-3-8b", 4096)
    assert llama.kind == "dense" and llama.measured == llama.dense_formula == 2 * 32 * 8 * 128 * 4096 * 2
    fig = plot_kv_caches(table)
    assert len(fig.axes[0].lines) == 4 * 2 + 3   # a line and its dots per model, a dashed formula per non-dense
    import matplotlib.pyplot as plt
    plt.close(fig)
    assert "DynamicCache" in table._repr_html_()


def test_the_gemma_exercise_checks_the_measured_cache():
    ex = exercise_gemma_cache()
    right = 2 * 21 * 8 * 256 * 8192 * 2 + 2 * 21 * 8 * 256 * 4096 * 2
    assert ex.check(right).ok and not ex.check(2 * 42 * 8 * 256 * 8192 * 2).ok
    assert "21 of the layers slide over a 4,096-token window" in ex.question


def test_context_bounds_against_the_arithmetic():
    table = context_bounds()
    card = parse_gpu("24GiB")
    usable = card.reported_total_bytes - context_assumption("lazy").nbytes - card.workspace_bytes(training=False)
    llama = table.row("llama-3-8b", 8)   # 8,030,261,248 parameters in bf16; 2·32·8·128·2 bytes per token
    assert llama.limit == "memory"
    assert llama.context == (usable - 8_030_261_248 * 2) // (8 * 2 * 32 * 8 * 128 * 2)
    gemma = table.row("gemma-2-9b", 8)   # below the window every one of its 42 layers grows
    assert gemma.context == (usable - 9_241_705_984 * 2) // (8 * 2 * 42 * 8 * 256 * 2) < 4096
    assert table.row("gemma-2-9b", 1).limit == "the model's positions (8,192)"
    assert table.row("mistral-7b", 8).context == 32768   # every layer slides: the cache stops at the window
    for r in table.rows:
        assert r.weights + r.kv_at_context <= r.usable


def test_the_measured_longest_context_is_below_the_formulas_bound():
    m = measured_longest_context()
    assert m.measured.at.fits and not m.measured.beyond.fits
    assert 2 <= m.measured.context_len < m.bound.context and m.prefill_gap > 0
    assert m.measured.runs <= 8 and "longest_context" in m._repr_html_()
