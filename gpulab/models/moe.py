"""How many parameters a model has, and how many of them one token goes through.

A token goes through every parameter of a dense model: active = total. In a mixture of experts
(MoE) each MoE layer's router sends a token to ``top_k`` of the layer's routed experts; the shared
experts (DeepSeek's), the attention, the norms, the router, the embedding and the head see every
token. So, per token::

    active = total - routed experts + top_k routed experts per MoE layer

Two ways to count, held equal by the tests:

* ``moe_counts(config)``: from the config's fields alone, for Mixtral (``mixtral``), Qwen3-MoE
  (``qwen3_moe``) and DeepSeek-V2 (``deepseek_v2``: multi-head latent attention, dense first layers,
  shared experts), as transformers 5 builds them;
* ``counts_of_model(model, config)``: from a built model (on the meta device: free), the routed
  experts found by module name (a path segment ``experts``; ``shared_experts`` are not routed).

``param_counts(config)`` takes either: the formula where it knows the family, otherwise a
meta-device build (a dense model: active = total).

Model cards differ in what their "active" figure counts. Mixtral's 12.9 B and Qwen3-30B-A3B's
3.3 B are the whole active count, embedding and head included; DeepSeek-V2-Lite's 2.4 B matches
the active count without the input embedding (2.45 B; 2.66 B with it), a lookup rather than a
matrix product: ``ParamCounts.active_without_embedding``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpulab.models.hf_configs import build_model, is_config, make_config

if TYPE_CHECKING:
    from torch import nn

__all__ = ["MOE_TYPES", "ParamCounts", "counts_of_model", "moe_counts", "param_counts"]

# The model types ``moe_counts`` counts from the config alone.
MOE_TYPES = ("mixtral", "qwen3_moe", "deepseek_v2")
# The config field holding the number of routed experts per MoE layer, by family.
_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of a model (a tied embedding counted once). ``active``: those one token goes
    through; ``routed_experts``: every routed expert's (0 for a dense model), of which one token
    uses ``active_routed``; ``shared_experts``: the shared experts' (always active);
    ``embedding``: the input embedding table's; ``moe_layers`` layers of ``experts`` routed
    experts, ``top_k`` per token."""
    total: int
    active: int
    routed_experts: int = 0
    active_routed: int = 0
    shared_experts: int = 0
    embedding: int = 0
    moe_layers: int = 0
    experts: int = 0
    top_k: int = 0

    @property
    def active_without_embedding(self) -> int:
        """The active count less the input embedding table (DeepSeek's cards count this way)."""
        return self.active - self.embedding


def _config(config: Any) -> Any:
    """A transformers config (its text config for a multimodal one) for a config, entry or name."""
    config = config if is_config(config) else make_config(config)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _experts_and_top_k(config: Any) -> tuple[int, int]:
    experts = next((getattr(config, f) for f in _EXPERT_FIELDS if getattr(config, f, None)), 0)
    return int(experts or 0), int(getattr(config, "num_experts_per_tok", 0) or 0)


def _is_moe_layer(config: Any, i: int) -> bool:
    """Whether layer ``i`` is a MoE layer, as transformers 5's modeling code decides."""
    kind = config.model_type
    if kind == "mixtral":
        return True
    if kind == "qwen3_moe":   # Qwen3MoeDecoderLayer
        return (i not in (config.mlp_only_layers or ()) and config.num_experts > 0
                and (i + 1) % config.decoder_sparse_step == 0)
    # DeepseekV2DecoderLayer: MoE from first_k_dense_replace on (it does not read moe_layer_freq)
    return i >= config.first_k_dense_replace


def _attention(config: Any) -> int:
    """One layer's attention parameters."""
    h, heads = config.hidden_size, config.num_attention_heads
    bias = bool(getattr(config, "attention_bias", False))
    if config.model_type == "deepseek_v2":   # multi-head latent attention
        qk_head = config.qk_nope_head_dim + config.qk_rope_head_dim
        if config.q_lora_rank is None:
            q = h * heads * qk_head
        else:   # q_a_proj (with bias), q_a_layernorm, q_b_proj
            rank = config.q_lora_rank
            q = (h + bias) * rank + rank + rank * heads * qk_head
        kv_a = (h + bias) * (config.kv_lora_rank + config.qk_rope_head_dim)
        kv_b = config.kv_lora_rank * heads * (config.qk_nope_head_dim + config.v_head_dim)
        out = heads * config.v_head_dim * h + bias * h
        return q + kv_a + config.kv_lora_rank + kv_b + out
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = config.num_key_value_heads
    q_o = 2 * h * heads * head_dim + bias * (heads * head_dim + h)
    k_v = 2 * (h * kv * head_dim + bias * kv * head_dim)
    qk_norm = 2 * head_dim if config.model_type == "qwen3_moe" else 0
    return q_o + k_v + qk_norm


def moe_counts(config: Any) -> ParamCounts:
    """Total and per-token parameters of a Mixtral, Qwen3-MoE or DeepSeek-V2 config (a config, a
    built-in entry or its name), from its fields alone. ValueError for another model type."""
    c = _config(config)
    kind = getattr(c, "model_type", None)
    if kind not in MOE_TYPES:
        raise ValueError(f"moe_counts counts {', '.join(MOE_TYPES)} configs, not {kind!r}: use param_counts, "
                         f"which builds the model on the meta device and finds its experts by name")
    h, layers = c.hidden_size, c.num_hidden_layers
    experts, top_k = _experts_and_top_k(c)
    moe_width = c.intermediate_size if kind == "mixtral" else c.moe_intermediate_size
    expert = 3 * h * moe_width   # gate, up and down projections, no biases
    shared_per_layer = 3 * h * moe_width * c.n_shared_experts if kind == "deepseek_v2" else 0
    moe_layers = sum(_is_moe_layer(c, i) for i in range(layers))
    dense_layers = layers - moe_layers
    embedding = c.vocab_size * h
    head = 0 if c.tie_word_embeddings else c.vocab_size * h
    routed = moe_layers * experts * expert
    mlp = routed + moe_layers * (experts * h + shared_per_layer) + dense_layers * 3 * h * c.intermediate_size
    total = embedding + head + layers * (_attention(c) + 2 * h) + mlp + h   # 2 norms a layer, a final norm
    active_routed = moe_layers * top_k * expert
    return ParamCounts(total, total - routed + active_routed, routed, active_routed, moe_layers * shared_per_layer,
                       embedding, moe_layers, experts, top_k)


def counts_of_model(model: nn.Module, config: Any = None) -> ParamCounts:
    """Total and per-token parameters of a built model (meta-device parameters count too): the
    routed experts are the parameters under a module path segment ``experts``, one group per MoE
    layer, of which a token uses ``top_k / experts`` (``config``'s, else ``model.config``'s)."""
    config = _config(config if config is not None else model.config)
    experts, top_k = _experts_and_top_k(config)
    total = shared = 0
    groups: dict[str, int] = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        total += p.numel()
        if "experts" in parts:
            prefix = ".".join(parts[:parts.index("experts") + 1])
            groups[prefix] = groups.get(prefix, 0) + p.numel()
        elif any(part.startswith("shared_expert") for part in parts):
            shared += p.numel()
    routed = sum(groups.values())
    if routed and not (experts and top_k):
        raise ValueError(f"{type(model).__name__} has routed experts but its config names no expert count "
                         f"({', '.join(_EXPERT_FIELDS)}) and top-k (num_experts_per_tok)")
    active_routed = 0
    for prefix, n in groups.items():
        if n % experts:
            raise ValueError(f"{prefix}: {n} parameters do not split into {experts} equal experts")
        active_routed += n // experts * top_k
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    embedding = embeddings.weight.numel() if embeddings is not None else 0
    return ParamCounts(total, total - routed + active_routed, routed, active_routed, shared, embedding,
                       len(groups), experts if groups else 0, top_k if groups else 0)


def param_counts(config: Any) -> ParamCounts:
    """Total and per-token parameters of any transformer config (a config, a built-in entry or its
    name): ``moe_counts`` for the families it knows, otherwise counted on a meta-device build
    (``counts_of_model``; a dense model: active = total)."""
    c = _config(config)
    if getattr(c, "model_type", None) in MOE_TYPES:
        return moe_counts(c)
    import torch

    with torch.device("meta"):
        model = build_model(config if is_config(config) else make_config(config))
    return counts_of_model(model, c)
