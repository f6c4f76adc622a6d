"""Total and per-token (active) parameter counts of mixtures of experts: from the config's fields,
from a meta-device build (experts found by module name), and the model cards' figures."""
import pytest
import torch
import transformers

from gpulab.models.hf_configs import build_model, hf_entry, make_config
from gpulab.models.moe import MOE_TYPES, ParamCounts, counts_of_model, moe_counts, param_counts


def meta_model(config):
    with torch.device("meta"):
        return build_model(config)


# (name, the card's total, the card's active, digits the card gives after the point)
CARDS = [
    ("mixtral-8x7b", "46.7", "12.9", 1),    # mistral.ai/news/mixtral-of-experts: 46.7B total, 12.9B per token
    ("qwen3-30b-a3b", "30.5", "3.3", 1),    # Qwen/Qwen3-30B-A3B card: 30.5B total, 3.3B activated
    ("deepseek-v2-lite", "15.7", "2.4", 1),  # deepseek-ai/DeepSeek-V2-Lite card: 15.7B total, 2.4B activated
]


@pytest.mark.parametrize("name,total,active,digits", CARDS)
def test_moe_counts_match_the_cards_and_a_meta_build(name, total, active, digits):
    counts = moe_counts(name)
    assert counts.total == hf_entry(name).published_params   # the exact meta-device count in the table
    assert f"{counts.total / 1e9:.{digits}f}" == total
    # DeepSeek's card counts the active parameters without the input embedding (2.45B; 2.66B with it)
    shown = counts.active_without_embedding if name.startswith("deepseek") else counts.active
    # within one unit of the card's last digit: cards round (Mixtral's 12.88 -> 12.9) or cut (DeepSeek's 2.45 -> 2.4)
    assert abs(shown / 1e9 - float(active)) < 10 ** -digits
    if name.startswith("deepseek"):
        assert abs(counts.active / 1e9 - float(active)) > 10 ** -digits   # with the embedding: 2.66B, not the card's
    assert counts_of_model(meta_model(make_config(name))) == counts
    assert param_counts(name) == counts


def test_the_exact_counts():
    assert moe_counts("mixtral-8x7b") == ParamCounts(
        total=46_702_792_704, active=12_879_925_248, routed_experts=45_097_156_608, active_routed=11_274_289_152,
        shared_experts=0, embedding=131_072_000, moe_layers=32, experts=8, top_k=2)
    q = moe_counts("qwen3-30b-a3b")
    assert (q.total, q.active, q.moe_layers, q.experts, q.top_k) == (30_532_122_624, 3_353_032_704, 48, 128, 8)
    d = moe_counts("deepseek-v2-lite")
    assert (d.total, d.active, d.active_without_embedding) == (15_706_484_224, 2_661_150_208, 2_451_435_008)
    # layer 0 dense, then 26 MoE layers of 64 routed experts (1408 wide) + 2 shared
    assert (d.moe_layers, d.experts, d.top_k) == (26, 64, 6)
    assert d.shared_experts == 26 * 2 * 3 * 2048 * 1408
    assert d.active == d.total - d.routed_experts + 26 * 6 * 3 * 2048 * 1408


@pytest.mark.parametrize("name", ["llama-3.1-70b", "gemma-2-2b", "tiny-llama"])
def test_dense_models_use_every_parameter(name):
    counts = param_counts(name)
    assert counts.active == counts.total and counts.routed_experts == counts.moe_layers == 0
    published = hf_entry(name).published_params
    assert published is None or counts.total == published
    with pytest.raises(ValueError, match="moe_counts counts mixtral, qwen3_moe, deepseek_v2 configs"):
        moe_counts(name)


TINY = dict(vocab_size=100, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            tie_word_embeddings=False)


@pytest.mark.parametrize("config", [
    transformers.MixtralConfig(**TINY, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2),
    transformers.Qwen3MoeConfig(**TINY, intermediate_size=64, moe_intermediate_size=16, num_experts=8,
                                num_experts_per_tok=3, decoder_sparse_step=2, mlp_only_layers=[3], head_dim=12,
                                attention_bias=True),
    transformers.DeepseekV2Config(**{**TINY, "num_key_value_heads": 4, "tie_word_embeddings": True},
                                  intermediate_size=64, moe_intermediate_size=16,
                                  n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                                  first_k_dense_replace=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                                  qk_rope_head_dim=4, v_head_dim=8),
], ids=["mixtral", "qwen3_moe-sparse-step-2-bias", "deepseek_v2-q-lora-tied"])
def test_the_formula_follows_other_shapes(config):
    """Dense layers among MoE ones, query LoRA, attention biases, a tied head: formula = module count."""
    assert config.model_type in MOE_TYPES
    counts = moe_counts(config)
    assert counts == counts_of_model(meta_model(config))
    assert 0 < counts.moe_layers < 4 or config.model_type == "mixtral"
