"""The KV cache layer by layer: which layers slide and over what window, what each layer caches per
token (full keys and values, or DeepSeek's compressed latent), and what that comes to in bytes,
as transformers' cache holds it and as vLLM's paged cache does (formulas; ``predict.generation``
measures transformers' own cache objects on fake tensors, and the tests hold the two equal).

* **Which layers slide** is what transformers' cache decides: ``DynamicCache(config=...)`` asks
  ``cache_utils.get_layer_types_and_kwargs`` for each layer's type (the config's ``layer_types``
  where it has them, Gemma-2/3 and Qwen2; else every layer slides when ``sliding_window`` is set,
  Mistral and Mixtral) and makes a ``DynamicLayer`` (every position) or a
  ``DynamicSlidingWindowLayer`` (the window) of it; this module asks the same function.
* **A sliding layer's positions**: ``DynamicSlidingWindowLayer.update`` concatenates the new keys to
  the kept ones and keeps a *view* of the last ``sliding_window - 1``: the storage it keeps is the
  concatenation's, ``window`` positions once a decode step has run past the window (``window - 1``
  kept + 1 new), ``context`` below it: min(context, window). NB: right after a prefill of P > window
  tokens the view still holds the prefill's whole storage (P positions) until the first decode
  step; this module gives the decode steps' figure.
* **MLA** (DeepSeek-V2/V3): transformers 5 caches the compressed latent, not K and V
  (``modeling_deepseek_v2.py``, ``DeepseekV2Attention.forward``: ``cache.update(k_nope, k_pe)``
  with k_nope of shape (batch, 1, seq, kv_lora_rank) after ``kv_a_layernorm``, k_pe of shape
  (batch, 1, seq, qk_rope_head_dim); ``expand_kv`` up-projects the whole cache to every head's K
  and V in each layer's forward, a temporary). vLLM caches the same latent: ``MLAAttentionSpec``
  (vllm/v1/kv_cache_interface.py) has ``real_page_size_bytes = block_size · num_kv_heads ·
  head_size · dtype size`` with one KV head of ``head_size = kv_lora_rank + qk_rope_head_dim`` (576
  for DeepSeek-V3), one latent for keys and values, not two. ``full_kv_bytes`` gives what caching K
  and V after the up-projection would cost (heads · (qk_nope + qk_rope + v_head_dim)), for the
  comparison.
* **vLLM's paged cache** (formula, vllm/v1/kv_cache_interface.py): a full layer's page is
  ``block_size · num_kv_heads · (head_size + head_size_v) · dtype size`` and a sequence of ``c``
  tokens takes cdiv(c, block_size) pages (``FullAttentionSpec.max_memory_usage_bytes``); a sliding
  layer takes cdiv(min(window − 1 + scheduled, max_model_len), block_size) + 1 pages
  (``SlidingWindowSpec.max_memory_usage_bytes``: the window may start mid-block); here one
  scheduled token (a decode step), and never more than a full layer's. NB: with the hybrid KV-cache
  manager off, vLLM gives sliding layers full-attention pages (``FullAttentionSpec``'s docstring).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["KVLayer", "KVLayout", "kv_layout"]


@dataclass(frozen=True)
class KVLayer:
    """One layer's cache: ``kind`` "full", "sliding" or "none" (no KV cache: transformers'
    ``DummyLayer``), its window, and the elements one token of one sequence adds to it (keys and
    values together; MLA: the latent and the rope key)."""
    kind: str
    window: int | None
    elements_per_token: int

    def positions(self, context: int) -> int:
        """Positions this layer holds at ``context`` tokens in a decode step (module docstring)."""
        if self.kind == "none":
            return 0
        return min(context, self.window) if self.kind == "sliding" else context

    def vllm_blocks(self, context: int, block_size: int) -> int:
        """Pages of ``block_size`` tokens vLLM gives one sequence of ``context`` tokens in this layer."""
        if self.kind == "none":
            return 0
        full = math.ceil(context / block_size)
        if self.kind == "sliding":   # SlidingWindowSpec, one scheduled token: window - 1 + 1
            return min(full, math.ceil(min(self.window, context) / block_size) + 1)
        return full


@dataclass(frozen=True)
class KVLayout:
    """A model's KV cache layer by layer (``kv_layout``): bytes at a context, the all-global
    formula beside it, vLLM's paged bytes, and the assumption in words."""
    layers: tuple[KVLayer, ...]
    mla: bool = False
    full_kv_elements: int = 0     # MLA: heads · (qk_nope + qk_rope + v_head_dim) per layer per token

    @property
    def sliding_layers(self) -> int:
        return sum(1 for layer in self.layers if layer.kind == "sliding")

    @property
    def windows(self) -> tuple[int, ...]:
        return tuple(sorted({layer.window for layer in self.layers if layer.kind == "sliding"}))

    def per_token_bytes(self, nbytes: int) -> int:
        """One token of one sequence in every layer that caches it (the all-global rate)."""
        return sum(layer.elements_per_token for layer in self.layers) * nbytes

    def bytes(self, context: int, batch: int, nbytes: int) -> int:
        """The cache of ``batch`` sequences at ``context`` tokens, as transformers' cache keeps it
        in a decode step: a sliding layer holds min(context, window) positions."""
        return batch * nbytes * sum(layer.elements_per_token * layer.positions(context) for layer in self.layers)

    def all_global_bytes(self, context: int, batch: int, nbytes: int) -> int:
        """The same cache if no layer slid: every layer holds every position."""
        return self.per_token_bytes(nbytes) * context * batch

    def full_kv_bytes(self, context: int, batch: int, nbytes: int) -> int:
        """MLA only: every layer's K and V after the up-projection, at every position (what a cache
        of full keys and values would hold; neither transformers nor vLLM keeps it)."""
        if not self.mla:
            return self.bytes(context, batch, nbytes)
        caching = sum(1 for layer in self.layers if layer.kind != "none")
        return caching * self.full_kv_elements * context * batch * nbytes

    def vllm_bytes(self, context: int, batch: int, nbytes: int, block_size: int = 16) -> int:
        """vLLM's pages for ``batch`` sequences of ``context`` tokens (module docstring)."""
        return batch * block_size * nbytes * sum(layer.elements_per_token * layer.vllm_blocks(context, block_size)
                                                 for layer in self.layers)

    def assumption(self, kv_dtype: str = "") -> str:
        """Which layers slide and over what window, MLA latent or K and V, the KV dtype: in words."""
        n = len(self.layers)
        dtype = f", KV in {kv_dtype}" if kv_dtype else ""
        what = ("MLA: the latent (kv_lora_rank) and the rope key (qk_rope_head_dim) cached per token, "
                "not K and V" if self.mla else "keys and values of every KV head cached per token")
        if not self.sliding_layers:
            return f"all {n} layers global (every position kept); {what}{dtype}"
        windows = " / ".join(f"{w:,}" for w in self.windows)
        return (f"{self.sliding_layers} of {n} layers slide (window {windows} tokens: min(context, window) "
                f"positions kept, as transformers' DynamicSlidingWindowLayer keeps them), "
                f"{n - self.sliding_layers} global; {what}{dtype}")


def _text(config: Any) -> Any:
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


_SLIDING = ("sliding_attention", "chunked_attention", "hybrid_sliding")
# transformers 5.15 (Colab's) names, as later releases name them: its moe/mlp layers keep no cache
# (a LinearAttentionLayer left empty; later a DummyLayer), its DeepSeek sparse layers are indexed
_OLD_NAMES = {"moe": "dummy", "mlp": "dummy", "deepseek_sparse_attention": "indexed_attention"}


def _layer_types(text: Any) -> tuple[list[str], list[dict]]:
    """Each layer's type and arguments, as transformers' ``DynamicCache(config=...)`` reads them.
    transformers 5.15 returns one kwargs dict for every layer (its ``sliding_window`` read only by
    the sliding layers); later releases one dict per layer: both come back per layer."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
        kinds, kwargs = get_layer_types_and_kwargs(text)
    except (ImportError, AttributeError):   # an older transformers: every layer global
        return ["full_attention"] * text.num_hidden_layers, [{}] * text.num_hidden_layers
    if isinstance(kwargs, dict):
        window = {"sliding_window": kwargs.get("sliding_window")}
        kwargs = [window if kind in _SLIDING else {} for kind in kinds]
        kinds = [_OLD_NAMES.get(kind, kind) for kind in kinds]
    return list(kinds), list(kwargs)


def kv_layout(config: Any) -> KVLayout:
    """The KV cache of a transformers config layer by layer (module docstring): sliding layers and
    their windows as transformers' cache decides them; MLA's latent where the config has
    ``kv_lora_rank``; otherwise 2 · KV heads · head dim elements per token per layer."""
    text = _text(config)
    heads = text.num_attention_heads
    kv_lora = getattr(text, "kv_lora_rank", None)
    if kv_lora:
        elements = kv_lora + text.qk_rope_head_dim
        full = heads * (text.qk_nope_head_dim + text.qk_rope_head_dim + text.v_head_dim)
    else:
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        elements, full = 2 * kv_heads * head_dim, 0
    layers = []
    for kind, kwargs in zip(*_layer_types(text)):
        if kind in ("full_attention", "indexed_attention"):
            layers.append(KVLayer("full", None, elements))
        elif "sliding_window" in kwargs and kwargs["sliding_window"]:
            layers.append(KVLayer("sliding", int(kwargs["sliding_window"]), elements))
        elif kind == "dummy":
            layers.append(KVLayer("none", None, 0))
        else:
            raise ValueError(f"a {kind!r} layer's cache is not modelled here (full and sliding attention, MLA are)")
    return KVLayout(tuple(layers), mla=bool(kv_lora), full_kv_elements=full)
