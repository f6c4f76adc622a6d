"""Lesson 11's fine-tuning check: full, LoRA, QLoRA at full size on the fake engine, and its panel."""
from __future__ import annotations

import pytest
import torch

from gpulab.predict.cards import CUDA_CONTEXT_ASSUMED, parse_gpu
from gpulab.course.finetune import custom_config, finetune_check
from gpulab.course.lora import qlora_formula
from gpulab.formulas import lora_params
from gpulab.models.hf_configs import make_config
from gpulab.models.hf_configs import build_causal_lm


def test_lora_freezes_the_base_and_trains_the_adapters_only():
    full = finetune_check("gpt2", "T4", seq_len=128, batch=2, method="full", precision="fp32", optimizer="adam")
    lora = finetune_check("gpt2", "T4", seq_len=128, batch=2, method="lora", precision="fp32", optimizer="adam")
    # GPT-2's fused q/k/v projection (768 -> 2304) in each of its 12 layers, rank 16
    assert lora.trainable_params == 12 * lora_params(768, 3 * 768, 16)
    assert full.trainable_params == full.n_params == 124_439_808
    assert lora.peak_by_category["optimizer_state"] < full.peak_by_category["optimizer_state"] / 100
    assert lora.peak_by_category["parameters"] >= full.n_params * 4       # the frozen base is still there
    assert lora.fits and full.fits and lora.margin_bytes > full.margin_bytes


def test_qlora_stores_the_base_weights_as_nf4_within_bytes_of_the_formula():
    """QLoRA is a fake run of the model with bitsandbytes' NF4 storage (models.quantized), checked
    against the NF4 formula of lesson 11 (course.lora.qlora_formula) applied to the LoRA run."""
    lora = finetune_check("llama-3-8b", "RTX4090", seq_len=2048, batch=1, method="lora", precision="bf16")
    q = finetune_check("llama-3-8b", "RTX4090", seq_len=2048, batch=1, method="qlora", precision="bf16")
    f = qlora_formula("llama-3-8b")
    # every Linear weight is quantized, but not the embedding, lm_head or the 65 RMSNorm weights
    assert f.quantized_params == 8_030_261_248 - 2 * 128256 * 4096 - (2 * 32 + 1) * 4096
    assert f.quantized_bytes < 0.52 * f.quantized_params
    # the packed weights are parameters, their quantization constants buffers
    measured = q.peak_by_category["parameters"] + q.peak_by_category["buffers"] - lora.peak_by_category["buffers"]
    predicted = lora.peak_by_category["parameters"] - (2 * f.quantized_params - int(f.quantized_bytes))
    # per quantized layer, what the formula leaves out: bitsandbytes' float32 code tables (the 16 NF4
    # values, the 256-value dynamic map) and offset, and the rounding of its six storages to 512-byte blocks
    assert abs(measured - predicted) <= (4 * (16 + 256 + 1) + 6 * 512) * 32 * 7
    # rank 16 on q_proj (4096 -> 4096) and v_proj (4096 -> 1024) in 32 layers
    assert q.trainable_params == lora.trainable_params == 32 * (16 * (4096 + 4096) + 16 * (4096 + 1024))
    assert q.label == lora.label and "fake" in q.label
    assert q.fits and not lora.fits          # 8B at 2,048 tokens: 16 GB of bf16 weights and the activations do not fit 24 GiB
    assert q.capacity_bytes == parse_gpu("RTX4090").reported_total_bytes and q.context_bytes == CUDA_CONTEXT_ASSUMED


def test_checkpointing_lowers_the_activations():
    plain = finetune_check("gpt2", "T4", seq_len=256, batch=4, method="full", precision="bf16")
    ckpt = finetune_check("gpt2", "T4", seq_len=256, batch=4, method="full", precision="bf16", checkpointing=True)
    selective = finetune_check("gpt2", "T4", seq_len=256, batch=4, method="full", precision="bf16",
                               checkpointing="selective")
    assert ckpt.peak_by_category["activations"] < plain.peak_by_category["activations"] / 2
    assert ckpt.peak_bytes < selective.peak_bytes < plain.peak_bytes
    assert (ckpt.checkpointing, selective.checkpointing, plain.checkpointing) == ("full", "selective", False)


def test_the_step_follows_the_cards_kernels():
    """A T4 (sm75) has no bf16 flash or memory-efficient attention: SDPA runs the math kernel, which
    saves float32 attention weights; an A100 (sm80) runs a fused kernel. The check, like gpulab.fit,
    follows the card it is asked about (it used to answer every card with the same sm80 step)."""
    t4 = finetune_check("gpt2", "T4", seq_len=256, batch=4, method="full", precision="bf16")
    a100 = finetune_check("gpt2", "A100-40GB", seq_len=256, batch=4, method="full", precision="bf16")
    assert "T4 (sm75)" in t4.label and "A100" in a100.label
    assert t4.peak_by_category["activations"] > a100.peak_by_category["activations"]
    assert t4.peak_by_category["parameters"] == a100.peak_by_category["parameters"]


def test_custom_size_and_the_builder_is_shapes_only():
    cfg = custom_config(1024, 4)
    with torch.device("meta"):
        model = build_causal_lm(cfg, torch.bfloat16)
    a = finetune_check("custom", "8GiB", seq_len=128, batch=1, method="full", precision="bf16", hidden=1024, layers=4)
    assert a.n_params == sum(p.numel() for p in model.parameters())
    assert "custom" in a._repr_html_() and ("fits" in a._repr_html_())


@pytest.mark.parametrize("kw, words", [
    (dict(preset="gpt5"), ["unknown preset", "llama-3-8b"]),
    (dict(method="prefix"), ["unknown method", "lora"]),
    (dict(precision="fp8"), ["unknown precision", "bf16"]),
    (dict(preset="custom", hidden=1000), ["multiple of 128"]),
    (dict(card="H1000"), ["cannot read", "H100"]),
    (dict(checkpointing="some"), ["checkpointing", "selective", "every-K"]),
])
def test_bad_settings_say_what_is_valid(kw, words):
    with pytest.raises(ValueError) as e:
        finetune_check(**{"preset": "gpt2", "seq_len": 64, **kw})
    assert all(w in str(e.value) for w in words)


def test_panel_runs_and_shows_the_verdict():
    from gpulab.widgets import finetune_panel
    p = finetune_panel(preset="gpt2", card="T4", seq_len=128, batch=2)
    p.run()
    assert p.error is None and p.result.fits and p.result.preset == "gpt2"
    p.controls["method"].value = "full"
    p.run()
    assert p.result.method == "full" and p.result.trainable_params == p.result.n_params


def test_the_sequence_slider_offers_only_what_the_preset_takes():
    """GPT-2 has 1,024 positions (its config's ``n_positions``): picking it moves a 2,048-token slider to
    1,024 instead of leaving a length the model refuses; a preset with more positions offers them again."""
    from gpulab.widgets import finetune_panel
    p = finetune_panel(preset="llama-3-8b", seq_len=2048)
    seq = p.controls["seq_len"]
    assert max(seq.options) == 8192 and seq.value == 2048
    p.controls["preset"].value = "gpt2"
    assert max(seq.options) == make_config("gpt2").n_positions == 1024 and seq.value == 1024
    p.controls["preset"].value = "mistral-7b"
    assert max(seq.options) == 8192 and seq.value == 1024
    with pytest.raises(ValueError, match="sequence length must be one of 128, 256, 512, 1024"):
        finetune_panel(preset="gpt2", seq_len=2048)


def test_preset_configs_are_the_built_in_ones():
    assert make_config("llama-3-8b").num_key_value_heads == 8


def test_activation_panel_shows_the_square_term():
    from gpulab.widgets import activation_seq_panel
    p = activation_seq_panel(model="tiny-gpt2", seq_len=128)
    p.run()
    assert p.error is None and [r.seq_len for r in p.result.rows] == [32, 64, 128]
    rows = p.result.rows
    # eager − SDPA (what storing the scores costs) grows with s²: ×4 from 64 to 128 tokens, within 5%
    assert abs(rows[2].scores_measured / rows[1].scores_measured - 4) < 0.2


def test_activation_panel_opens_with_the_lessons_sweep_when_the_settings_match(monkeypatch):
    """Lesson 11 measures the sweep, then shows the panel at the same settings: measured once."""
    from gpulab.course.transformer_activations import activation_vs_seq
    from gpulab.widgets import activation_seq_panel
    from gpulab.widgets import transformers as T
    sweep = activation_vs_seq("tiny-gpt2", seq_lens=(32, 64, 128))
    calls = []
    real = T.activation_vs_seq
    monkeypatch.setattr(T, "activation_vs_seq", lambda *a, **k: calls.append((a, k)) or real(*a, **k))
    p = activation_seq_panel(model="tiny-gpt2", seq_len=128, measured=[sweep])
    assert p.run() is sweep and calls == []
    assert "measured above" in p._render(sweep)[0].data
    p.run()                                   # Run: measured again, the same numbers
    assert len(calls) == 1 and p.result is not sweep and p.result.rows == sweep.rows
    assert "measured above" not in str(p._render(p.result)[0])
    other = activation_seq_panel(model="tiny-gpt2", seq_len=256, measured=[sweep])
    other.run()                               # other lengths (64, 128, 256): not the sweep
    assert len(calls) == 2 and [r.seq_len for r in other.result.rows] == [64, 128, 256]


def test_serving_panel_finds_the_cache_taking_the_card():
    from gpulab.widgets import serving_panel
    p = serving_panel(model="llama-3-8b", card="RTX 4090", context_len=8192, batch=1)
    p.run()
    fit, longest = p.result
    assert fit.fits and longest.batch == 1
    p.controls["batch"].value = 16
    p.run()
    fit16, _ = p.result
    assert not fit16.fits and fit16.kv_cache_bytes == 16 * fit.kv_cache_bytes
