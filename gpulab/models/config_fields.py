"""A transformer config's size fields checked as written: the counts and sizes no model's forward
can take (a head count of 0, a negative intermediate size, KV heads that do not divide the heads,
a mixture of experts routing to none ...), refused in one line naming the field, its value and what
to set. Pure functions of a dict of fields (a config.json's, or a config object's ``vars``): no
transformers. ``hf_configs`` runs them on a config.json before transformers builds it and on every
config a model is resolved from (``hf_configs.check_settings``)."""
from __future__ import annotations

from typing import Any

__all__ = ["EXPERT_FIELDS", "NON_NEGATIVE_FIELDS", "POSITIVE_FIELDS", "check_fields"]

EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")   # Mixtral, Qwen3-MoE, DeepSeek-V2

# size fields a model's forward divides or builds layers by: at least 1 where present (None: not used)
POSITIVE_FIELDS = ("vocab_size", "hidden_size", "n_embd", "d_model", "num_hidden_layers", "n_layer",
                   "num_attention_heads", "n_head", "num_key_value_heads", "head_dim", "max_position_embeddings",
                   "n_positions", "kv_lora_rank", "q_lora_rank", "moe_intermediate_size")
# sizes that may be 0 in some models but never negative
NON_NEGATIVE_FIELDS = ("intermediate_size", "n_inner", "n_shared_experts", "qk_rope_head_dim", "qk_nope_head_dim",
                       "v_head_dim", "first_k_dense_replace")
_LATENT = {"kv_lora_rank": "DeepSeek's latent attention always compresses keys and values to kv_lora_rank; "
                           "transformers' DeepseekV2Attention has no non-latent mode",
           "q_lora_rank": "null means queries are not compressed"}


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_fields(fields: dict[str, Any], shown: str, from_file: bool = False) -> None:
    """The size fields of a config (``fields``: a config.json's fields as written, or a config
    object's own ``vars``) that no model's forward can take, refused in one line naming the field,
    its value and what to set: a count or size below 1 (``POSITIVE_FIELDS``) or below 0
    (``NON_NEGATIVE_FIELDS``); attention heads that are not a multiple of the key/value heads
    (grouped-query attention repeats each KV head heads/kv times, ``repeat_kv``); a hidden size that
    is not a multiple of the heads where no ``head_dim`` says the heads' width; a mixture of experts
    with no experts, or tokens routed to none (``num_experts_per_tok``); a sliding window of under 1
    token. Values of the wrong type are left to transformers' own validation (``_refused``)."""
    def bad(name: str, value: Any, need: str) -> ValueError:
        return ValueError(f"{shown}: {name} {value!r} {need}")

    for name in POSITIVE_FIELDS:
        value = fields.get(name)
        if _whole(value) and value < 1:
            why = f" ({_LATENT[name]})" if name in _LATENT else ""
            fix = " or null" if name == "q_lora_rank" else ""
            raise bad(name, value, f"is not a size a model can have{why}: set {name} to 1 or more{fix}")
    for name in NON_NEGATIVE_FIELDS:
        value = fields.get(name)
        if _whole(value) and value < 0:
            raise bad(name, value, f"is negative: set {name} to 0 or more")
    heads = next((fields[n] for n in ("num_attention_heads", "n_head") if _whole(fields.get(n))), None)
    kv = fields.get("num_key_value_heads")
    if heads and _whole(kv) and heads % kv:
        divisors = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
        raise bad("num_key_value_heads", kv, f"does not divide num_attention_heads {heads}: each key/value head "
                  f"serves the same number of query heads (grouped-query attention, repeat_kv): set "
                  f"num_key_value_heads to one of {divisors}")
    hidden = next((fields[n] for n in ("hidden_size", "n_embd", "d_model") if _whole(fields.get(n))), None)
    if heads and hidden and hidden % heads and fields.get("head_dim") is None:
        raise bad("hidden_size", hidden, f"is not a multiple of num_attention_heads {heads}, and no head_dim says "
                  f"how wide a head is: set hidden_size to a multiple of {heads}, or head_dim"
                  + (" (this config.json gives none)" if from_file else ""))
    k = fields.get("num_experts_per_tok")
    field = next((f for f in EXPERT_FIELDS if _whole(fields.get(f))), None)
    if field is not None and fields[field] < 0:
        raise bad(field, fields[field], f"is negative: set {field} to the routed experts a layer has (1 or more)")
    if field is not None and _whole(k) and k >= 1 and fields[field] == 0:
        raise bad(field, 0, f"leaves no expert to route to while num_experts_per_tok is {k}: set {field} to "
                  f"{k} or more (the routed experts a layer has)")
    if field is not None and fields[field] > 0 and _whole(k) and k < 1:
        raise bad("num_experts_per_tok", k, f"routes each token to no expert: set num_experts_per_tok to 1 to "
                  f"{fields[field]} ({field})")
    window = fields.get("sliding_window")
    if _whole(window) and window < 1:
        raise bad("sliding_window", window, "is not a window (a token sees at least itself): set sliding_window "
                  "to 1 or more tokens, or null for no sliding window")
