"""A small built-in table of well-known transformer configurations, written out in the code.

Each entry holds the fields of a published model's ``config.json`` (hidden size, layers, heads,
vocabulary ...) copied into a Python dict, the URL of that file on huggingface.co (``source``)
and the model's published parameter count. Nothing is downloaded: ``make_config`` builds the
``transformers`` config object from the dict, and ``build_causal_lm`` builds a model with random
weights from it, which, under ``with torch.device("meta"):`` or a ``FakeTensorMode``, costs no
memory at all, so an 8 B model can be measured on a laptop.

The ``tiny-*`` entries are gpulab's own small configs for CPU runs, not published models.

The dicts leave out ``torch_dtype`` (the dtype the published weights are stored in): the dtype
of a built model is the caller's choice (``build_causal_lm(config, dtype=...)``, float32 when
not given). ``transformers`` is imported only inside the functions, so importing this module
stays cheap.
"""
from __future__ import annotations

import copy
import difflib
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpulab.models.config_fields import EXPERT_FIELDS, check_fields

__all__ = [
    "ConfigFacts", "HFConfigEntry", "HF_CONFIGS", "HF_PREFIX", "MOE_EVERY_K", "TASKS", "TINY_SOURCE", "build_causal_lm",
    "build_model", "check_fields", "check_settings", "close_names", "config_and_name", "config_summary", "depth_field",
    "facts_of", "hf_entry", "hf_names", "is_config", "local_config", "make_config", "max_positions",
    "names_local_config", "per_layer_lists", "resolve", "rotary_positions", "task_of", "vocab_size"
]

if TYPE_CHECKING:
    import torch
    import transformers
    from torch import nn

HF_PREFIX = "hf:"
TINY_SOURCE = "gpulab (a small config for CPU runs)"


@dataclass(frozen=True)
class HFConfigEntry:
    """One built-in configuration.

    ``config_class`` is the name of the ``transformers`` config class (``"LlamaConfig"``),
    ``kwargs`` the fields passed to it (as in the official ``config.json``), ``source`` the URL
    of that ``config.json`` (or ``TINY_SOURCE``), ``published_params`` the published parameter
    count (a tied embedding counted once; ``None`` for the tiny configs), ``tiny`` whether this
    is one of gpulab's own small configs rather than a published model. ``published_class``: the
    transformers Auto class the published count is of, when not the trained model's (BERT's
    110 M / 335 M are ``BertModel``'s: the encoder and its pooler, without the masked-LM head).
    ``rounded``: the figure as the model card rounds it (``"46.7B"``) where no exact count is
    published; ``published_params`` is then the exact count of a meta-device build."""
    name: str
    config_class: str
    kwargs: dict[str, Any] = field(hash=False)
    source: str
    published_params: int | None
    description: str
    tiny: bool = False
    published_class: str | None = None
    rounded: str | None = None


# What a config is trained as (``task_of``): the transformers Auto class that builds it.
TASKS = {"causal-lm": "AutoModelForCausalLM", "masked-lm": "AutoModelForMaskedLM",
         "seq2seq-lm": "AutoModelForSeq2SeqLM"}
_MASKED_LM_TYPES = ("bert", "roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2", "xlm-roberta",
                    "camembert", "modernbert")


def _bert_kwargs(hidden: int, layers: int, heads: int) -> dict[str, Any]:
    # google-bert/bert-*-uncased/config.json
    return {"vocab_size": 30522, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "intermediate_size": 4 * hidden, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
            "attention_probs_dropout_prob": 0.1, "max_position_embeddings": 512, "type_vocab_size": 2,
            "initializer_range": 0.02, "layer_norm_eps": 1e-12, "pad_token_id": 0}


def _gpt2_kwargs(n_embd: int, n_layer: int, n_head: int) -> dict[str, Any]:
    # openai-community/gpt2*/config.json. Their ``n_ctx`` (1024) is left out: a legacy alias
    # of ``n_positions`` that GPT2Config no longer reads.
    return {
        "vocab_size": 50257, "n_positions": 1024, "n_embd": n_embd, "n_layer": n_layer, "n_head": n_head,
        "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
        "layer_norm_epsilon": 1e-05, "initializer_range": 0.02,
        "bos_token_id": 50256, "eos_token_id": 50256, "tie_word_embeddings": True,
    }


def _gemma2_kwargs(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int) -> dict[str, Any]:
    # google/gemma-2-{2b,9b}/config.json: every other layer (the even ones) attends within a
    # 4096-token window; attention logits soft-capped at 50, final logits at 30.
    return {"vocab_size": 256000, "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 256,
            "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0, "max_position_embeddings": 8192, "rope_theta": 10000.0,
            "rms_norm_eps": 1e-06, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
            "initializer_range": 0.02, "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}


def _llama31_kwargs(hidden: int, intermediate: int, layers: int, heads: int) -> dict[str, Any]:
    # meta-llama/Llama-3.1-{70B,405B}/config.json: 8 KV heads, RoPE stretched from 8 K to 128 K
    # positions by the "llama3" scaling.
    return {"vocab_size": 128256, "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": 8, "max_position_embeddings": 131072,
            "rope_theta": 500000.0,
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "rms_norm_eps": 1e-05, "hidden_act": "silu", "initializer_range": 0.02, "attention_bias": False,
            "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1,
            "bos_token_id": 128000, "eos_token_id": 128001, "tie_word_embeddings": False}


_ENTRIES = [
    HFConfigEntry(
        "gpt2", "GPT2Config", _gpt2_kwargs(768, 12, 12),
        "https://huggingface.co/openai-community/gpt2/blob/main/config.json", 124_439_808,
        "GPT-2 small (OpenAI, 2019): 12 layers, 768 wide, 1024 positions, tied embeddings"),
    HFConfigEntry(
        "gpt2-medium", "GPT2Config", _gpt2_kwargs(1024, 24, 16),
        "https://huggingface.co/openai-community/gpt2-medium/blob/main/config.json", 354_823_168,
        "GPT-2 medium (OpenAI, 2019): 24 layers, 1024 wide, 1024 positions, tied embeddings"),
    HFConfigEntry(
        "llama-3-8b", "LlamaConfig",
        {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192,
         "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "hidden_act": "silu", "initializer_range": 0.02,
         "attention_bias": False, "attention_dropout": 0.0, "pretraining_tp": 1,
         "bos_token_id": 128000, "eos_token_id": 128001, "tie_word_embeddings": False},
        "https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json", 8_030_261_248,
        "Meta Llama 3 8B (2024): 32 layers, 4096 wide, grouped-query attention (8 KV heads), "
        "128 K vocabulary, untied embeddings"),
    HFConfigEntry(
        # Its config.json has no rope_theta: LlamaConfig's default, 10000, applies.
        "llama-2-7b", "LlamaConfig",
        {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
         "rms_norm_eps": 1e-05, "hidden_act": "silu", "initializer_range": 0.02, "pretraining_tp": 1,
         "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False},
        "https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json", 6_738_415_616,
        "Meta Llama 2 7B (2023): 32 layers, 4096 wide, full multi-head attention (32 KV heads), "
        "32 K vocabulary, untied embeddings"),
    HFConfigEntry(
        "llama-2-13b", "LlamaConfig",
        {"vocab_size": 32000, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
         "num_attention_heads": 40, "num_key_value_heads": 40, "max_position_embeddings": 4096,
         "rms_norm_eps": 1e-05, "hidden_act": "silu", "initializer_range": 0.02, "pretraining_tp": 1,
         "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False},
        "https://huggingface.co/meta-llama/Llama-2-13b-hf/blob/main/config.json", 13_015_864_320,
        "Meta Llama 2 13B (2023): 40 layers, 5120 wide, full multi-head attention (40 KV heads), "
        "32 K vocabulary, untied embeddings"),
    HFConfigEntry(
        "mistral-7b", "MistralConfig",
        {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768,
         "sliding_window": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-05, "hidden_act": "silu",
         "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False},
        "https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json", 7_241_732_096,
        "Mistral 7B v0.1 (2023): 32 layers, 4096 wide, grouped-query attention (8 KV heads), "
        "4096-token sliding window, untied embeddings"),
    HFConfigEntry(
        # Its config.json also has "use_mrope": false, which is not a Qwen2Config field.
        "qwen2.5-0.5b", "Qwen2Config",
        {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
         "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
         "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "hidden_act": "silu", "initializer_range": 0.02,
         "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": 32768,
         "max_window_layers": 24, "bos_token_id": 151643, "eos_token_id": 151643, "tie_word_embeddings": True},
        "https://huggingface.co/Qwen/Qwen2.5-0.5B/blob/main/config.json", 494_032_768,
        "Qwen2.5 0.5B (Alibaba, 2024): 24 layers, 896 wide, grouped-query attention (2 KV heads), "
        "152 K vocabulary, tied embeddings: the embedding is over a quarter of the parameters"),
    HFConfigEntry(
        "qwen2.5-7b", "Qwen2Config",
        {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
         "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 131072,
         "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "hidden_act": "silu", "initializer_range": 0.02,
         "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": 131072,
         "max_window_layers": 28, "bos_token_id": 151643, "eos_token_id": 151643, "tie_word_embeddings": False},
        "https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json", 7_615_616_512,
        "Qwen2.5 7B (Alibaba, 2024): 28 layers, 3584 wide, grouped-query attention (4 KV heads), "
        "152 K vocabulary, untied embeddings"),
    HFConfigEntry(
        "bert-base-uncased", "BertConfig", _bert_kwargs(768, 12, 12),
        "https://huggingface.co/google-bert/bert-base-uncased/blob/main/config.json", 109_482_240,
        "BERT base (Google, 2018): an encoder, 12 layers, 768 wide, 512 positions; trained here as a masked "
        "language model (every position predicted)", published_class="AutoModel"),
    HFConfigEntry(
        "bert-large-uncased", "BertConfig", _bert_kwargs(1024, 24, 16),
        "https://huggingface.co/google-bert/bert-large-uncased/blob/main/config.json", 335_141_888,
        "BERT large (Google, 2018): an encoder, 24 layers, 1024 wide, 512 positions; trained here as a masked "
        "language model (every position predicted)", published_class="AutoModel"),
    HFConfigEntry(
        # google-t5/t5-base/config.json; its n_positions (512) is not a T5Config field: T5 has
        # relative position buckets, no position table.
        "t5-base", "T5Config",
        {"vocab_size": 32128, "d_model": 768, "d_kv": 64, "d_ff": 3072, "num_layers": 12, "num_heads": 12,
         "relative_attention_num_buckets": 32, "dropout_rate": 0.1, "layer_norm_epsilon": 1e-06,
         "initializer_factor": 1.0, "feed_forward_proj": "relu", "is_encoder_decoder": True,
         "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": True},
        "https://huggingface.co/google-t5/t5-base/blob/main/config.json", 222_903_552,
        "T5 base (Google, 2019): an encoder-decoder, 12 + 12 layers, 768 wide, tied embeddings; trained here "
        "on the same tokens as input and target"),
    HFConfigEntry(
        # Its config.json also has "sliding_window": null (Mixtral has no sliding window) and
        # "output_router_logits": false. The model card's 46.7 B total / 12.9 B active are
        # 46,702,792,704 / 12,879,925,248 exactly (a meta-device build; gpulab.models.moe).
        "mixtral-8x7b", "MixtralConfig",
        {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
         "max_position_embeddings": 32768, "sliding_window": None, "rope_theta": 1000000.0, "rms_norm_eps": 1e-05,
         "hidden_act": "silu", "initializer_range": 0.02, "attention_dropout": 0.0, "router_aux_loss_coef": 0.02,
         "output_router_logits": False, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False},
        "https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json", 46_702_792_704,
        "Mixtral 8x7B v0.1 (Mistral AI, 2023): a mixture of experts, 32 layers, 4096 wide, 8 experts per layer of "
        "which each token uses 2 (46.7 B parameters, 12.9 B per token), grouped-query attention (8 KV heads)",
        rounded="46.7B"),
    HFConfigEntry(
        # Its config.json also has "rope_scaling": null and "sliding_window": null. The model
        # card's 30.5 B total / 3.3 B activated are 30,532,122,624 / 3,353,032,704 exactly.
        "qwen3-30b-a3b", "Qwen3MoeConfig",
        {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
         "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
         "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
         "norm_topk_prob": True, "router_aux_loss_coef": 0.001, "output_router_logits": False,
         "max_position_embeddings": 40960, "max_window_layers": 48, "use_sliding_window": False,
         "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "hidden_act": "silu", "initializer_range": 0.02,
         "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
         "tie_word_embeddings": False},
        "https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json", 30_532_122_624,
        "Qwen3 30B-A3B (Alibaba, 2025): a mixture of experts, 48 layers, 2048 wide, 128 small experts per layer "
        "of which each token uses 8 (30.5 B parameters, 3.3 B per token), 4 KV heads of 128", rounded="30.5B"),
    HFConfigEntry(
        # Multi-head latent attention (keys and values through a 512-wide latent, 64 rotary dims)
        # and DeepSeekMoE (layer 0 dense, then 64 routed experts, 6 per token, + 2 shared).
        # Its config.json also names its remote code (auto_map) and has "moe_layer_freq": 1,
        # "seq_aux": true, "aux_loss_alpha": 0.001, "pretraining_tp": 1, which DeepseekV2Config
        # keeps and its model does not read. 15.7 B total (the card) is 15,706,484,224 exactly;
        # the card's 2.4 B activated is the active count without the input embedding (2.45 B;
        # 2.66 B with it): see gpulab.models.moe.
        "deepseek-v2-lite", "DeepseekV2Config",
        {"vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
         "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None,
         "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
         "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
         "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1, "scoring_func": "softmax",
         "norm_topk_prob": False, "routed_scaling_factor": 1.0, "aux_loss_alpha": 0.001, "seq_aux": True,
         "max_position_embeddings": 163840, "rope_theta": 10000,
         "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                          "original_max_position_embeddings": 4096, "type": "yarn"},
         "rms_norm_eps": 1e-06, "hidden_act": "silu", "initializer_range": 0.02, "attention_bias": False,
         "attention_dropout": 0.0, "pretraining_tp": 1, "bos_token_id": 100000, "eos_token_id": 100001,
         "tie_word_embeddings": False},
        "https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json", 15_706_484_224,
        "DeepSeek-V2-Lite (DeepSeek, 2024): multi-head latent attention and a mixture of experts, 27 layers, 2048 "
        "wide, 64 routed experts of which each token uses 6, plus 2 shared (15.7 B parameters, 2.4 B per token)",
        rounded="15.7B"),
    HFConfigEntry(
        # Its config.json also has "cache_implementation": "hybrid" (a generation setting).
        "gemma-2-2b", "Gemma2Config", _gemma2_kwargs(2304, 9216, 26, 8, 4),
        "https://huggingface.co/google/gemma-2-2b/blob/main/config.json", 2_614_341_888,
        "Gemma 2 2B (Google, 2024): 26 layers, 2304 wide, sliding-window (4096) and global attention layers "
        "alternating, attention and final logits soft-capped, 256 K vocabulary, tied embeddings"),
    HFConfigEntry(
        # Its config.json also has "cache_implementation": "hybrid" and "sliding_window_size": 4096
        # (an old alias of sliding_window).
        "gemma-2-9b", "Gemma2Config", _gemma2_kwargs(3584, 14336, 42, 16, 8),
        "https://huggingface.co/google/gemma-2-9b/blob/main/config.json", 9_241_705_984,
        "Gemma 2 9B (Google, 2024): 42 layers, 3584 wide, sliding-window (4096) and global attention layers "
        "alternating, attention and final logits soft-capped, 256 K vocabulary, tied embeddings"),
    HFConfigEntry(
        # Gemma 3 1B is text only: its config.json is a whole Gemma3TextConfig (the 4B, 12B and
        # 27B configs are multimodal, their text_config mostly left to the class defaults). It
        # also has "rope_scaling": null, "attn_logit_softcapping": null, "final_logit_softcapping":
        # null, "cache_implementation": "hybrid". The Gemma 3 report (arXiv 2503.19786, table 1)
        # gives 302 M embedding + 698 M non-embedding parameters: 301,989,888 + 697,896,064.
        "gemma-3-1b", "Gemma3TextConfig",
        {"vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
         "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256,
         "sliding_window": 512, "sliding_window_pattern": 6, "rope_local_base_freq": 10000, "rope_theta": 1000000,
         "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "hidden_activation": "gelu_pytorch_tanh",
         "initializer_range": 0.02, "attention_bias": False, "attention_dropout": 0.0,
         "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0},
        "https://huggingface.co/google/gemma-3-1b-pt/blob/main/config.json", 999_885_952,
        "Gemma 3 1B (Google, 2025): 26 layers, 1152 wide, five sliding-window (512) layers to one global, "
        "1 KV head of 256, 262 K vocabulary: the embedding is 30 % of the parameters, tied"),
    HFConfigEntry(
        "llama-3.1-70b", "LlamaConfig", _llama31_kwargs(8192, 28672, 80, 64),
        "https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json", 70_553_706_496,
        "Meta Llama 3.1 70B (2024): 80 layers, 8192 wide, grouped-query attention (8 KV heads), 128 K context "
        "(llama3 RoPE scaling), untied embeddings"),
    HFConfigEntry(
        "llama-3.1-405b", "LlamaConfig", _llama31_kwargs(16384, 53248, 126, 128),
        "https://huggingface.co/meta-llama/Llama-3.1-405B/blob/main/config.json", 405_853_388_800,
        "Meta Llama 3.1 405B (2024): 126 layers, 16384 wide, grouped-query attention (8 KV heads), 128 K context "
        "(llama3 RoPE scaling), untied embeddings"),
    HFConfigEntry(
        # The instruct model's config.json (the base model has the same shapes). Its card's
        # 72.7 B is 72,706,203,648 exactly (a meta-device build).
        "qwen2.5-72b-instruct", "Qwen2Config",
        {"vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
         "num_attention_heads": 64, "num_key_value_heads": 8, "max_position_embeddings": 32768,
         "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "hidden_act": "silu", "initializer_range": 0.02,
         "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": 131072,
         "max_window_layers": 70, "bos_token_id": 151643, "eos_token_id": 151645, "tie_word_embeddings": False},
        "https://huggingface.co/Qwen/Qwen2.5-72B-Instruct/blob/main/config.json", 72_706_203_648,
        "Qwen2.5 72B Instruct (Alibaba, 2024): 80 layers, 8192 wide, grouped-query attention (8 KV heads), "
        "152 K vocabulary, untied embeddings", rounded="72.7B"),
    HFConfigEntry(
        "tiny-gpt2", "GPT2Config",
        # GPT-2's <|endoftext|> is its last token; GPT2Config's default (50256) is outside 1000.
        {"vocab_size": 1000, "n_positions": 256, "n_embd": 64, "n_layer": 2, "n_head": 4,
         "bos_token_id": 999, "eos_token_id": 999, "tie_word_embeddings": True},
        TINY_SOURCE, None,
        "gpulab's own tiny GPT-2-style config for CPU runs (not a published model): 2 layers, 64 wide",
        tiny=True),
    HFConfigEntry(
        "tiny-llama", "LlamaConfig",
        {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
         "tie_word_embeddings": False},
        TINY_SOURCE, None,
        "gpulab's own tiny Llama-style config for CPU runs (not a published model): 2 layers, 64 wide, "
        "2 KV heads",
        tiny=True),
]

HF_CONFIGS: dict[str, HFConfigEntry] = {e.name: e for e in _ENTRIES}


def hf_names() -> list[str]:
    """The names of the built-in configs, published models first, then the tiny ones."""
    return list(HF_CONFIGS)


def hf_entry(name: str) -> HFConfigEntry:
    """The entry called ``name`` (case-insensitive, with or without the ``hf:`` prefix). An
    unknown name raises a ``ValueError`` that lists the close matches and every valid name."""
    key = str(name).strip().lower().removeprefix(HF_PREFIX)
    if key in HF_CONFIGS:
        return HF_CONFIGS[key]
    close = difflib.get_close_matches(key, HF_CONFIGS, n=3, cutoff=0.5)
    hint = f"  (did you mean {', '.join(close)}?)" if close else ""
    raise ValueError(f"unknown transformer config {name!r}{hint}; built-in configs: {', '.join(HF_CONFIGS)}; "
                     f"or pass a transformers.PretrainedConfig object")


def make_config(entry: HFConfigEntry | str, use_cache: bool | None = None) -> transformers.PretrainedConfig:
    """A fresh ``transformers`` config for ``entry`` (an entry or its name). ``use_cache``: None
    keeps the config class's default, as a config loaded from the Hub has it (True for GPT-2 and
    Llama: transformers then builds a ``DynamicCache`` in a plain training forward too, and GPT-2's
    attention keeps copies of its keys and values for it); False or True sets it. The attention
    implementation is left at the transformers default."""
    import transformers

    if not isinstance(entry, HFConfigEntry):
        entry = hf_entry(entry)
    # a deep copy: transformers 5 writes into a nested rope_scaling dict (rope_theta, rope_type)
    config = getattr(transformers, entry.config_class)(**copy.deepcopy(dict(entry.kwargs)))
    if use_cache is not None and hasattr(config, "use_cache"):
        config.use_cache = use_cache
    return config


def is_config(obj: object) -> bool:
    """Whether ``obj`` is a ``transformers.PretrainedConfig``. Does not import transformers: if
    it has not been imported, no object can be one of its configs."""
    module = sys.modules.get("transformers")
    if module is None:
        return False
    return isinstance(obj, module.PretrainedConfig)


def _as_config(config: transformers.PretrainedConfig | HFConfigEntry | str) -> transformers.PretrainedConfig:
    return config if is_config(config) else make_config(config)  # type: ignore[arg-type]


def build_causal_lm(config: transformers.PretrainedConfig | HFConfigEntry | str,
                    dtype: torch.dtype | None = None) -> nn.Module:
    """A causal language model with random weights for ``config`` (a config, an entry or a
    name), via ``AutoModelForCausalLM.from_config``. Parameters are created on the current
    default device, so this works under ``with torch.device("meta"):`` and under a
    ``FakeTensorMode``. ``dtype`` (transformers 5.x's name for the old ``torch_dtype``) sets the
    parameters' dtype and, as transformers does, ``config.dtype``; when ``None`` the config's own
    ``dtype`` applies (float32 for the built-in configs)."""
    model = _from_config("AutoModelForCausalLM", _as_config(config), dtype)
    if getattr(model, "loss_type", "") is None:
        # transformers picks the loss from the class name, and GPT2LMHeadModel's has no
        # "ForCausalLM" in it: the first loss would warn "loss_type=None ... unrecognized" and
        # then use ForCausalLMLoss anyway. Name that loss here, which the model is built as.
        model.loss_type = "ForCausalLM"
    return model


def _from_config(auto_class: str, config: transformers.PretrainedConfig, dtype: torch.dtype | None) -> nn.Module:
    """``transformers.<auto_class>.from_config(config)`` in ``dtype`` (None: the config's own)."""
    import transformers

    kwargs = {} if dtype is None else {"dtype": dtype}
    if dtype is not None:   # from_config writes the dtype into the config: keep the caller's untouched
        config = copy.deepcopy(config)
    return getattr(transformers, auto_class).from_config(config, **kwargs)


def task_of(config: transformers.PretrainedConfig) -> str:
    """What the config is trained as (a key of ``TASKS``): an encoder-decoder as a sequence-to-sequence
    LM, an encoder (BERT and its kin, or an ``architectures`` entry saying ``ForMaskedLM``) as a masked
    LM, anything else as a causal LM."""
    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq-lm"
    archs = getattr(config, "architectures", None) or ()
    if getattr(config, "model_type", "") in _MASKED_LM_TYPES or any("MaskedLM" in a for a in archs):
        return "masked-lm"
    return "causal-lm"


def build_model(config: transformers.PretrainedConfig | HFConfigEntry | str,
                dtype: torch.dtype | None = None, auto_class: str | None = None) -> nn.Module:
    """The model ``config`` is trained as (``task_of``), with random weights, on the current default
    device (see ``build_causal_lm``); ``auto_class`` names another transformers Auto class."""
    config = _as_config(config)
    if task_of(config) == "causal-lm" and auto_class is None:
        return build_causal_lm(config, dtype)
    return _from_config(auto_class or TASKS[task_of(config)], config, dtype)


def names_local_config(key: str) -> bool:
    """Whether ``key`` (after ``hf:``) names a config of the user's own: not a built-in name, and a
    path (``config.json`` or a folder) or an ``org/name`` id of the local Hugging Face cache."""
    return key.lower() not in HF_CONFIGS and ("/" in key or key.endswith(".json"))


def local_config(key: str) -> transformers.PretrainedConfig:
    """A config from this machine, never downloaded: ``key`` a ``config.json`` (or a folder holding
    one), or a model id (``org/name``) found in the local Hugging Face cache. ValueError otherwise,
    saying what to do."""
    import os

    import transformers

    try:
        from huggingface_hub.errors import StrictDataclassError   # transformers 5's config validation
    except ImportError:   # an older huggingface_hub: its configs raise ValueError
        StrictDataclassError = ValueError  # noqa: N806

    path = os.path.expanduser(key)
    if os.path.lexists(path) and not os.path.exists(path):   # a link to nothing, or a loop of links
        raise ValueError(f"{key!r} is a symbolic link that leads nowhere (a broken link, or a loop of links): "
                         f"point it at a config.json or a model folder, or give the real path")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"the folder {key!r} holds no config.json: give the folder a model was saved to "
                         f"(save_pretrained writes its config.json), or the path of a config.json")
    raw = _raw_fields(path)
    if raw is not None:   # before transformers builds it: a field no model can take, named (ZeroDivisionError else)
        check_fields(raw, key, from_file=True)
    try:
        if os.path.exists(path):
            return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        if "/" in key and not key.endswith(".json"):
            return transformers.AutoConfig.from_pretrained(key, local_files_only=True)
    except StrictDataclassError as exc:
        raise _refused(key, path, exc) from None
    except (OSError, ValueError, KeyError) as exc:
        where = "that file" if os.path.exists(path) else "the local Hugging Face cache"
        raise ValueError(f"could not read a transformers config for {key!r} from {where}: {exc} "
                         f"(gpulab never downloads: download it once with huggingface-cli, or pass a config.json "
                         f"path or a transformers config object)") from None
    raise ValueError(f"{key!r} is neither a file nor a folder here; for a model from the Hugging Face cache name it "
                     f"as org/name (gpulab never downloads), or use a built-in config: {', '.join(HF_CONFIGS)}")


def _refused(key: str, path: str, exc: Exception) -> ValueError:
    """transformers refusing the user's config (a field of the wrong type, fields that do not fit
    together), said in one line: which field of ``key`` is wrong, and why."""
    import json
    import os
    import re

    why = " ".join(str(exc.__cause__ or exc).split()).rstrip(".")
    field = re.search(r"field '([^']+)'", str(exc))
    if field:   # huggingface_hub's "Field 'vocab_size' expected int, got str (value: '500')"
        why = why.removeprefix(f"Field '{field.group(1)}' ")
        return ValueError(f"{key}: field {field.group(1)!r} {why}; transformers refuses the config: correct that field")
    try:   # a check across fields: name those whose values the message quotes
        with open(os.path.join(path, "config.json") if os.path.isdir(path) else path) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        raw = {}
    quoted = set(re.findall(r"\(([^()]+)\)", why))
    fields = [f"{k} = {v!r}" for k, v in (raw.items() if isinstance(raw, dict) else ())
              if isinstance(v, (int, float, str)) and not isinstance(v, bool) and str(v) in quoted]
    which = f" (fields {', '.join(fields)})" if fields else ""
    fix = "correct them" if len(fields) > 1 else "correct it"
    return ValueError(f"{key}: {why[:1].lower()}{why[1:]}{which}; transformers refuses the config: {fix}")


def config_summary(config: transformers.PretrainedConfig | HFConfigEntry | str) -> dict[str, Any]:
    """The shape of a model at a glance, under one set of names whatever the model family
    (GPT-2 calls them ``n_embd``, ``n_layer``, ``n_head``): model_type, hidden_size, num_layers,
    num_heads, num_kv_heads (= num_heads without grouped-query attention), intermediate_size,
    vocab_size, max_positions, tie_word_embeddings."""
    config = _as_config(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config

    def first(*names: str) -> Any:
        for n in names:
            value = getattr(text, n, None)
            if value is not None:
                return value
        return None

    hidden = first("hidden_size", "n_embd", "d_model")
    heads = first("num_attention_heads", "n_head")
    return {
        "model_type": getattr(config, "model_type", None),
        "hidden_size": hidden,
        "num_layers": first("num_hidden_layers", "n_layer"),
        "num_heads": heads,
        "num_kv_heads": first("num_key_value_heads") or heads,
        "intermediate_size": first("intermediate_size", "n_inner") or (4 * hidden if hidden else None),
        "vocab_size": first("vocab_size"),
        "max_positions": first("max_position_embeddings", "n_positions"),
        "tie_word_embeddings": bool(getattr(text, "tie_word_embeddings", False)),
    }


def close_names(name: str, n: int = 3) -> list[str]:
    """Built-in config names close to ``name``, with the ``hf:`` prefix (for "did you mean")."""
    key = str(name).strip().lower().removeprefix(HF_PREFIX)
    return [HF_PREFIX + c for c in difflib.get_close_matches(key, HF_CONFIGS, n=n, cutoff=0.6)]


def vocab_size(config: transformers.PretrainedConfig) -> int:
    """The vocabulary size: token ids are drawn below it."""
    return int(config_summary(config)["vocab_size"])


# the fields that put a mixture-of-experts layer every K layers (DeepSeek, Qwen-MoE, Llama 4)
MOE_EVERY_K = ("moe_layer_freq", "decoder_sparse_step", "interleave_moe_layer_step")


def per_layer_lists(config: Any, depth: int) -> dict[str, Any]:
    """The config's per-layer lists (``depth`` entries, such as ``layer_types``) whose entries are
    not all the same: what makes its layers differ, by field name."""
    return {name: value for name, value in vars(config).items()
            if isinstance(value, (list, tuple)) and len(value) == depth and len({repr(v) for v in value}) > 1}


def max_positions(config: transformers.PretrainedConfig) -> int | None:
    """The longest sequence the model's position table takes (None when it does not say)."""
    value = config_summary(config)["max_positions"]
    return int(value) if value else None


def rotary_positions(config: transformers.PretrainedConfig) -> bool:
    """Whether the model places tokens by rotary embeddings (RoPE: ``rope_parameters``, or the older
    ``rope_theta``), computed for any position, rather than by a learned table of
    ``max_position_embeddings`` rows (GPT-2, BERT) that a longer sequence would index past."""
    text = getattr(config, "text_config", None) or config
    return bool(getattr(text, "rope_parameters", None) or getattr(text, "rope_theta", None))


_SLIDING = ("sliding_attention", "chunked_attention", "hybrid_sliding")


def check_settings(config: transformers.PretrainedConfig, shown: str) -> None:
    """Settings transformers builds but no model can mean, refused in one line saying what to set:
    the size fields no forward can take (``check_fields``); more experts per token (``num_experts_per_tok``) than a layer routes to; a sliding window wider
    than the positions (``max_position_embeddings``) where layers slide (as transformers' cache
    decides them, ``cache_utils.get_layer_types_and_kwargs``: Qwen2.5's ``use_sliding_window: false``
    has no sliding layer, whatever its ``sliding_window``)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    check_fields(vars(text), shown)
    k = getattr(text, "num_experts_per_tok", None)
    field = next((f for f in EXPERT_FIELDS if vars(text).get(f)), None)   # its own field, not an attribute_map alias
    if k and field and k > getattr(text, field):
        raise ValueError(f"{shown}: num_experts_per_tok {k} is larger than the {getattr(text, field)} routed experts "
                         f"a layer has ({field}): each token goes to k of them: set num_experts_per_tok to "
                         f"{getattr(text, field)} or fewer")
    window, positions = getattr(text, "sliding_window", None), max_positions(text)
    if not (window and positions and window > positions):
        return
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
        slides = any(kind in _SLIDING for kind in get_layer_types_and_kwargs(text)[0])
    except (ImportError, AttributeError):   # an older transformers: no sliding layers in its cache
        slides = False
    if slides:
        raise ValueError(f"{shown}: sliding_window {window:,} is larger than its {positions:,} positions "
                         f"(max_position_embeddings): its sliding layers would never slide; set sliding_window to "
                         f"{positions:,} or less, or max_position_embeddings to {window:,} or more")


def _raw_fields(path: str) -> dict[str, Any] | None:
    """The fields of the config.json at ``path`` (a file, or a folder holding one) as written, and its
    ``text_config``'s beside them where it has one; None when it cannot be read as a JSON object
    (transformers then says why)."""
    import json
    import os

    try:
        with open(os.path.join(path, "config.json") if os.path.isdir(path) else path) as f:
            raw = json.load(f)
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(raw, dict):
        return None
    text = raw.get("text_config")
    return {**raw, **text} if isinstance(text, dict) else raw


@dataclass(frozen=True)
class ConfigFacts:
    """What gpulab reads off a transformer config, read once when a model is resolved (``resolve``)
    and carried on its workload (``Workload.facts``): who it is (``name`` as messages show it, its
    ``description`` and ``source``), what it is trained as (``task``, ``task_of``), its shape at a
    glance (``config_summary``'s items), the longest sequence it takes (``max_positions``), its
    vocabulary (``config_summary``'s, as given: ``int`` is taken where token ids are drawn), the field
    that holds its depth (``depth_field``) and its per-layer lists that differ (``per_layer_lists``)."""
    name: str
    description: str
    source: str
    task: str
    shape: tuple[tuple[str, Any], ...]
    max_positions: int | None
    vocab_size: Any
    depth_field: str | None
    layer_lists: tuple[tuple[str, tuple], ...]

    def summary(self) -> dict[str, Any]:
        """``config_summary``'s dict (a fresh one: the record stays as read)."""
        return dict(self.shape)


def depth_field(config: Any) -> str | None:
    """The field that holds the config's number of layers (None: it names none)."""
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(getattr(config, name, None), int):
            return name
    return None


def facts_of(config: transformers.PretrainedConfig, name: str, description: str, source: str) -> ConfigFacts:
    """The ``ConfigFacts`` of ``config`` as it is (unchecked: ``resolve`` checks first)."""
    summary = config_summary(config)
    depth = depth_field(config)
    lists = per_layer_lists(config, getattr(config, depth)) if depth else {}
    return ConfigFacts(name, description, source, task_of(config), tuple(summary.items()),
                       int(summary["max_positions"]) if summary["max_positions"] else None, summary["vocab_size"],
                       depth, tuple((k, tuple(v)) for k, v in lists.items()))


def resolve(model: Any) -> tuple[transformers.PretrainedConfig, ConfigFacts] | None:
    """One trip from what the user named to a checked config and its facts: ``model`` an ``hf:`` name
    (a built-in config, a ``config.json`` or a folder here, an id in the local Hugging Face cache) or
    a transformers config (used as given, never changed); None when it is neither. Refuses in one
    line what no model can be (``check_settings``), an unknown name (``hf_entry``), a config that
    cannot be read (``local_config``)."""
    if isinstance(model, str) and model.lower().startswith(HF_PREFIX):
        rest = model[len(HF_PREFIX):]
        if names_local_config(rest):
            config = local_config(rest)   # a config.json here, or an id in the local HF cache
            name, description, source = model, f"{type(config).__name__} from {rest}", rest
        else:
            entry = hf_entry(model)
            config = make_config(entry)
            name, description, source = f"{HF_PREFIX}{entry.name}", entry.description, entry.source
    elif is_config(model):
        config = model
        name = f"{HF_PREFIX}{getattr(model, 'model_type', 'config')}"
        description, source = f"{type(model).__name__} (your config)", "your config object"
    else:
        return None
    check_settings(config, name)
    return config, facts_of(config, name, description, source)


def config_and_name(config_or_name: Any) -> tuple[Any, str]:
    """(a transformers config, a name to show) for a built-in name (``"llama-3-8b"`` or
    ``"hf:llama-3-8b"``), an ``HFConfigEntry`` or a config object (used as given, never changed)."""
    if is_config(config_or_name):
        return config_or_name, f"{type(config_or_name).__name__} (your config)"
    entry = config_or_name if isinstance(config_or_name, HFConfigEntry) \
        else hf_entry(config_or_name)
    return make_config(entry), entry.name

