"""The new attention served honestly (``predict.kv_layout``, ``generation_peak``, ``serve``,
``longest_context``): sliding-window layers, DeepSeek's MLA latent and an fp8 cache, each checked
against the bytes transformers' own cache objects hold (on fake tensors, or the meta device) and
against vLLM's per-token formulas (vllm/v1/kv_cache_interface.py)."""
from __future__ import annotations

import math

import pytest
import torch
import transformers

from gpulab.models import hf_configs
from gpulab.predict.generation import fp8_cache_exists, generation_peak
from gpulab.predict.kv_layout import kv_layout
from gpulab.predict.serve import longest_context, serve

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
             max_position_embeddings=1024)


def gemma2(layers: int = 4, window: int = 16):
    return transformers.Gemma2Config(num_hidden_layers=layers, head_dim=16, sliding_window=window, **SMALL)


def gemma3(window: int = 16):   # 6 layers: 5 sliding, then 1 global (its sliding_window_pattern)
    return transformers.Gemma3TextConfig(num_hidden_layers=6, head_dim=16, sliding_window=window, **SMALL)


def mistral(window: int | None = 16):
    return transformers.MistralConfig(num_hidden_layers=3, sliding_window=window, **SMALL)


def deepseek_v2():
    return transformers.DeepseekV2Config(
        num_hidden_layers=3, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=128, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, max_position_embeddings=1024)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


@pytest.mark.parametrize("make, sliding", [(gemma2, 2), (gemma3, 5), (mistral, 3)])
def test_which_layers_slide_is_what_transformers_cache_builds(make, sliding):
    config = make()
    layout = kv_layout(config)
    cache = transformers.DynamicCache(config=config)
    assert [layer.kind == "sliding" for layer in layout.layers] == [layer.is_sliding for layer in cache.layers]
    assert layout.sliding_layers == sliding and layout.windows == (16,)
    assert f"{sliding} of {len(layout.layers)} layers slide (window 16" in layout.assumption("bf16")
    assert kv_layout(mistral(None)).sliding_layers == 0


def test_a_sliding_layer_keeps_min_context_window_positions_in_transformers_cache_objects():
    # transformers' DynamicCache on the meta device: a prompt, then decode steps one token at a time
    config, (batch, heads, dim) = gemma2(), (2, 2, 16)
    layout = kv_layout(config)
    for prompt, steps in ((5, 3), (15, 1), (40, 1), (40, 30)):
        cache = transformers.DynamicCache(config=config)
        with torch.device("meta"):
            for n in (prompt, *[1] * steps):
                for i in range(len(cache.layers)):
                    cache.update(torch.empty(batch, heads, n, dim), torch.empty(batch, heads, n, dim), i)
        held = sum(_storage(layer.keys) + _storage(layer.values) for layer in cache.layers)
        assert held == layout.bytes(prompt + steps, batch, 4), (prompt, steps)


@pytest.mark.parametrize("prompt, new", [(8, 2), (100, 2), (50, 40)])
def test_generate_on_fake_tensors_holds_the_layouts_bytes(prompt, new):
    config = gemma2()
    layout = kv_layout(config)
    g = generation_peak(config, prompt_len=prompt, new_tokens=new, dtype="float32", batch=2)
    context = prompt + new - 1
    assert g.cache_bytes == layout.bytes(context, 2, 4)
    if context > 16:   # below the all-global cache by the sliding layers' share
        share = 2 * (2 * 2 * 16) * (context - 16) * 2 * 4   # 2 sliding layers · 2·KV heads·head dim · tokens past
        assert layout.all_global_bytes(context, 2, 4) - g.cache_bytes == share


def test_mla_caches_the_latent_and_the_rope_key_in_transformers_and_vllm():
    config = deepseek_v2()
    layout = kv_layout(config)
    g = generation_peak(config, prompt_len=50, new_tokens=10, dtype="float32")
    latent = 3 * (32 + 8) * 59 * 4            # layers · (kv_lora_rank + qk_rope_head_dim) · tokens · bytes
    assert layout.mla and g.cache_bytes == layout.bytes(59, 1, 4) == latent
    # K and V after the up-projection would be heads · (qk_nope + qk_rope + v_head_dim) per layer
    assert layout.full_kv_bytes(59, 1, 4) == 3 * 4 * (16 + 8 + 16) * 59 * 4
    # vLLM's MLAAttentionSpec: a page is block_size · 1 KV head · (kv_lora_rank + qk_rope_head_dim) · dtype size
    assert layout.vllm_bytes(59, 1, 2, block_size=16) == 3 * math.ceil(59 / 16) * 16 * 1 * (32 + 8) * 2
    assert "MLA: the latent" in layout.assumption()


def test_vllms_pages_for_full_and_sliding_layers():
    layout = kv_layout(gemma2(window=40))
    per_layer = 2 * 2 * 16 * 2                            # FullAttentionSpec: 2 · KV heads · head size · bf16
    full = math.ceil(1000 / 16) * 16 * per_layer          # cdiv(context, block_size) pages
    sliding = (math.ceil(40 / 16) + 1) * 16 * per_layer   # SlidingWindowSpec: cdiv(window - 1 + 1, block) + 1
    assert layout.vllm_bytes(1000, 1, 2, 16) == 2 * full + 2 * sliding
    assert layout.vllm_bytes(10, 1, 2, 16) == 4 * 16 * per_layer   # short: one page each


@pytest.mark.skipif(not fp8_cache_exists(), reason=f"transformers {transformers.__version__} has no fp8 QuantizedCache")
def test_an_fp8_cache_is_measured_in_transformers_quantized_cache():
    config = mistral(None)
    with torch.device("meta"):   # transformers' own fp8 cache keeps float8_e4m3fn states
        cache = transformers.QuantizedCache("fp8", config)
        cache.update(torch.empty(1, 2, 5, 16, dtype=torch.bfloat16), torch.empty(1, 2, 5, 16, dtype=torch.bfloat16), 0)
    assert cache.layers[0]._quantized_keys[0].dtype == torch.float8_e4m3fn
    bf16 = generation_peak(config, prompt_len=50, new_tokens=10)
    fp8 = generation_peak(config, prompt_len=50, new_tokens=10, kv_cache="fp8")
    assert fp8.kv_cache == "fp8" and fp8.cache_bytes == bf16.cache_bytes // 2 + 3 * 2 * 4   # + a float32 scale each
    assert fp8.cache_bytes == kv_layout(config).bytes(59, 1, 1) + 3 * 2 * 4
    with pytest.raises(ValueError, match="full attention only"):
        generation_peak(gemma2(), prompt_len=8, new_tokens=2, kv_cache="fp8")
    with pytest.raises(ValueError, match="kv_cache"):
        generation_peak(config, prompt_len=8, new_tokens=2, kv_cache="int2")


@pytest.mark.skipif(fp8_cache_exists(), reason=f"transformers {transformers.__version__} has an fp8 QuantizedCache")
def test_without_transformers_fp8_cache_an_fp8_kv_cache_is_refused_in_one_line():
    with pytest.raises(ValueError, match=f"transformers {transformers.__version__} has no fp8 QuantizedCache"):
        generation_peak(mistral(None), prompt_len=8, new_tokens=2, kv_cache="fp8")


def test_serve_names_its_assumption_and_keeps_the_sliding_saving():
    r = serve(gemma2(), "24GiB", context_len=100, batch=2, dtype="float32")
    assert r.kv_cache_bytes == kv_layout(gemma2()).bytes(100, 2, 4) < r.kv_all_global_bytes
    assert "2 of 4 layers slide (window 16" in r.kv_assumption and "KV in float32" in r.kv_assumption
    assert "sliding-window layers" in r.kv_label
    fp8 = serve(gemma2(), "24GiB", context_len=100, batch=2, dtype="float32", kv_dtype="fp8")
    assert fp8.kv_cache_bytes == kv_layout(gemma2()).bytes(100, 2, 1) and "full-attention models only" in fp8.kv_label
    assert r.as_dict()["kv_assumption"] == r.kv_assumption


def test_the_longest_context_fits_and_one_more_token_does_not():
    config = transformers.MistralConfig(num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                                        num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
                                        sliding_window=None, max_position_embeddings=1 << 20)
    r = longest_context(config, "48MiB", context_bytes=0, dtype="float32", start=256)
    assert r.limit == "memory" and r.context_len > 256 and r.runs <= 12
    assert r.at.fits and r.at.context_len == r.context_len
    assert not r.beyond.fits and r.beyond.context_len == r.context_len + 1
    assert "all 2 layers global" in r.assumption and r.as_dict()["context_len"] == r.context_len
    capped = longest_context("tiny-llama", "24GiB")   # the card holds more than its 256 positions
    assert capped.context_len == 256 and "positions (256)" in capped.limit and capped.beyond is None


def _meta_cache_bytes(config, context: int, elements: tuple[int, int, int, int]) -> int:
    """transformers' DynamicCache(config=...) on the meta device after a prompt of context - 1 tokens
    and one decode step: (KV heads, key dim, value heads, value dim) per layer, bf16."""
    kh, kd, vh, vd = elements
    cache = transformers.DynamicCache(config=config)
    with torch.device("meta"):
        for n in (context - 1, 1):
            for i in range(len(cache.layers)):
                cache.update(torch.empty(1, kh, n, kd, dtype=torch.bfloat16),
                             torch.empty(1, vh, n, vd, dtype=torch.bfloat16), i)
    return sum(_storage(layer.keys) + _storage(layer.values) for layer in cache.layers)


@pytest.mark.skipif("gemma-2-9b" not in hf_configs.HF_CONFIGS or "deepseek-v2-lite" not in hf_configs.HF_CONFIGS,
                    reason="the built-in Gemma-2 / DeepSeek-V2-Lite configs are not in this checkout")
def test_the_built_in_configs_against_transformers_cache_objects():
    gemma, _ = hf_configs.config_and_name("gemma-2-9b")   # 42 layers, every other one sliding over 4,096
    layout = kv_layout(gemma)
    held = _meta_cache_bytes(gemma, 8192, (8, 256, 8, 256))
    assert held == layout.bytes(8192, 1, 2) == 2_113_929_216   # 1.97 GiB
    # below the all-global formula (2 · 42 · 8 · 256 · 8192 · 2 = 2.63 GiB) by the sliding layers' share
    assert layout.all_global_bytes(8192, 1, 2) - held == 21 * 2 * 8 * 256 * (8192 - 4096) * 2
    deepseek, _ = hf_configs.config_and_name("deepseek-v2-lite")   # MLA: kv_lora_rank 512, qk_rope_head_dim 64
    layout = kv_layout(deepseek)
    held = _meta_cache_bytes(deepseek, 4096, (1, 512, 1, 64))
    assert held == layout.bytes(4096, 1, 2) == 27 * (512 + 64) * 4096 * 2 == layout.vllm_bytes(4096, 1, 2, 16)
    assert layout.full_kv_bytes(4096, 1, 2) == 27 * 16 * (128 + 64 + 128) * 4096 * 2   # 8.9 × the latent


def test_a_sliding_layer_saves_nothing_at_the_prefill_in_transformers():
    # DynamicSlidingWindowLayer keeps a view of the prefill's concatenation: the whole prompt's storage
    config = gemma2()
    layout = kv_layout(config)
    g = generation_peak(config, prompt_len=100, new_tokens=2, dtype="float32")
    assert g.prefill_cache_bytes == layout.all_global_bytes(100, 1, 4) > layout.bytes(100, 1, 4)
    assert g.cache_bytes == layout.bytes(101, 1, 4) and g.as_dict()["prefill_cache_bytes"] == g.prefill_cache_bytes


def test_the_longest_context_renders_in_a_notebook():
    r = longest_context("tiny-llama", "24GiB")
    assert "256 tokens" in r._repr_html_() and "fits" in r._repr_html_()
