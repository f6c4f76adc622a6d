"""Lesson 11: a causal language model's parameters, counted from its config.

``param_formula``: the parameter count of a causal language model from its config (GPT-2, Llama,
Mistral, Qwen2), term by term, checked against ``numel()`` of the model ``transformers`` builds
from the same config (``counted_params``); ``exercise_layer_params``, the lesson's predict-first
question on one layer.

The lesson's next questions: bytes per parameter under training recipes
(``gpulab.course.transformer_memory``), activations per layer (``gpulab.course.transformer_activations``).

Results are dataclasses; nothing here prints. Every number is computed (from a config, a
formula or a run) and carries its label: ``formula`` (``gpulab.measure.engines.LABEL_FORMULA``) or the
label of the engine that measured it.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any

import torch

from gpulab import formulas as F
from gpulab.models import hf_configs
from gpulab.measure.engines import LABEL_FORMULA
from gpulab.tables import html_table
from gpulab.course.exercises import Exercise

__all__ = [
    "FAMILIES", "ParamBreakdown", "counted_params", "exercise_layer_params", "param_formula"
]

# --- parameters from the config ----------------------------------------------------------------

# model_type -> layout. "gpt2": learned positions, fused c_attn with bias, GELU MLP with biases,
# LayerNorm (weight + bias). "llama": RoPE (no position table), q/k/v/o without bias (unless the
# config says attention_bias), grouped-query k/v, SwiGLU MLP (gate, up, down), RMSNorm (weight
# only). Mistral is Llama's layout; Qwen2 is Llama's with biases on q, k and v.
FAMILIES = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "qwen2": "llama"}


@dataclass(frozen=True)
class ParamBreakdown:
    """A causal LM's parameters from its config, term by term (``param_formula``).

    ``layers`` is the number of transformer layers; ``per_layer`` (attention + MLP + norms) is
    one layer's count, ``all_layers`` all of them. ``lm_head`` is 0 when the output projection
    is tied to the token embedding (one tensor, counted once, as ``parameters()`` counts it)."""
    model: str
    family: str
    embedding: int
    position: int
    per_layer_attention: int
    per_layer_mlp: int
    per_layer_norms: int
    layers: int
    final_norm: int
    lm_head: int
    total: int
    label: str = LABEL_FORMULA

    @property
    def per_layer(self) -> int:
        return self.per_layer_attention + self.per_layer_mlp + self.per_layer_norms

    @property
    def all_layers(self) -> int:
        return self.layers * self.per_layer

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "per_layer": self.per_layer, "all_layers": self.all_layers}

    def _repr_html_(self) -> str:
        rows = [["token embedding", f"{self.embedding:,}"], ["position embedding", f"{self.position:,}"],
                ["one layer: attention", f"{self.per_layer_attention:,}"],
                ["one layer: MLP", f"{self.per_layer_mlp:,}"], ["one layer: norms", f"{self.per_layer_norms:,}"],
                [f"{self.layers} layers", f"{self.all_layers:,}"], ["final norm", f"{self.final_norm:,}"],
                ["LM head" + (" (tied to the embedding)" if not self.lm_head else ""), f"{self.lm_head:,}"],
                ["total", f"{self.total:,}"]]
        return html_table(["part", "parameters"], rows, f"{self.model} ({self.family} layout) — {self.label}")


def _as_config(config_or_name: Any):
    """A transformers config from a config, a built-in name (``"llama-3-8b"`` or ``"hf:..."``)."""
    if hf_configs.is_config(config_or_name):
        return config_or_name
    return hf_configs.make_config(config_or_name, use_cache=False)   # the formulas model no KV cache


def _model_name(config_or_name: Any, config) -> str:
    if isinstance(config_or_name, str):
        return hf_configs.hf_entry(config_or_name).name
    return f"{type(config).__name__} ({getattr(config, 'model_type', '?')})"


def _family(config) -> str:
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"no parameter formula for model_type {model_type!r}: supported model types are "
                         f"{', '.join(FAMILIES)} (GPT-2 and the Llama layout: Llama, Mistral, Qwen2)")
    return model_type


def _head_dim(config, hidden: int, heads: int) -> int:
    """Llama-style configs may set ``head_dim`` apart from hidden / heads; GPT-2 never does."""
    return int(getattr(config, "head_dim", None) or hidden // heads)


def param_formula(config: Any) -> ParamBreakdown:
    """The parameter count of a causal LM from its config alone (a ``transformers`` config or a
    built-in name, ``gpulab.models.hf_configs``), with h = hidden size, a = heads, kv = key/value heads,
    d = head dim, i = MLP width, V = vocabulary:

    * token embedding V·h; GPT-2 also learns a position table n_positions·h (Llama, Mistral and
      Qwen2 rotate q and k instead, RoPE: no parameters);
    * attention per layer: q h×(a·d), k and v h×(kv·d) each (grouped-query attention: kv < a
      shrinks them), output (a·d)×h. GPT-2 fuses q, k, v into ``c_attn`` with a 3h bias and
      gives ``c_proj`` an h bias; Qwen2 has biases on q, k and v; Llama and Mistral none (unless
      ``attention_bias``);
    * MLP per layer: GPT-2's GELU MLP h×i + i×h with biases (i = n_inner or 4h); the Llama
      layout's SwiGLU gate and up h×i, down i×h, no biases (unless ``mlp_bias``);
    * norms: two per layer and one final; LayerNorm has weight and bias (2h), RMSNorm weight only;
    * LM head h×V, or nothing when tied to the embedding (``tie_word_embeddings``).

    Sources: the modules each family's ``modeling_*.py`` in transformers builds (GPT2Attention,
    GPT2MLP, LlamaAttention, LlamaMLP, Qwen2Attention, LlamaRMSNorm), and the layer rules of
    ``gpulab.formulas`` (``linear_params``, ``layernorm_params``, ``embedding_params``). Other
    model types raise ``ValueError``."""
    cfg = _as_config(config)
    family = _family(cfg)
    s = hf_configs.config_summary(cfg)
    h, n_layers, a, kv = s["hidden_size"], s["num_layers"], s["num_heads"], s["num_kv_heads"]
    inner, vocab = s["intermediate_size"], s["vocab_size"]
    embedding = F.embedding_params(vocab, h)
    if FAMILIES[family] == "gpt2":
        position = F.embedding_params(s["max_positions"], h)
        attention = F.linear_params(h, 3 * h) + F.linear_params(h, h)   # c_attn (q, k, v fused), c_proj
        mlp = F.linear_params(h, inner) + F.linear_params(inner, h)     # c_fc, c_proj
        norm = F.layernorm_params(h)                                    # LayerNorm: weight and bias
    else:
        d = _head_dim(cfg, h, a)
        bias = bool(getattr(cfg, "attention_bias", False))
        qkv_bias = bias or family == "qwen2"                            # Qwen2Attention: q, k, v with bias
        attention = (F.linear_params(h, a * d, qkv_bias) + 2 * F.linear_params(h, kv * d, qkv_bias)
                     + F.linear_params(a * d, h, bias))
        mlp_bias = bool(getattr(cfg, "mlp_bias", False))
        mlp = 2 * F.linear_params(h, inner, mlp_bias) + F.linear_params(inner, h, mlp_bias)
        position = 0
        norm = F.layernorm_params(h, bias=False)                        # RMSNorm: weight only
    lm_head = 0 if s["tie_word_embeddings"] else F.linear_params(h, vocab, bias=False)
    norms = 2 * norm
    total = embedding + position + n_layers * (attention + mlp + norms) + norm + lm_head
    return ParamBreakdown(_model_name(config, cfg), family, embedding, position, attention, mlp, norms, n_layers,
                          norm, lm_head, total)


def counted_params(config: Any) -> tuple[int, int]:
    """(parameters, parameter tensors) of the model ``transformers`` builds from ``config``,
    built on the meta device (no memory): the independent count ``param_formula`` is checked
    against, and the divisor of ``measured_bytes_per_param``. A built-in config (a name) is
    built once per process: its count cannot change, and lessons ask for it several times."""
    if isinstance(config, str):
        return _counted_builtin(hf_configs.hf_entry(config).name)
    return _count_built(_as_config(config))


@functools.lru_cache(maxsize=None)
def _counted_builtin(name: str) -> tuple[int, int]:
    return _count_built(hf_configs.make_config(name, use_cache=False))


def _count_built(cfg) -> tuple[int, int]:
    with torch.device("meta"):
        model = hf_configs.build_causal_lm(cfg)
    params = list(model.parameters())
    return sum(p.numel() for p in params), len(params)


def exercise_layer_params(name: str = "llama-3-8b") -> Exercise:
    """Predict-first: how many parameters does one layer of ``name`` have? The expected value is
    ``param_formula(name).per_layer``, worked out when the checker runs."""
    cfg = _as_config(name)
    s = hf_configs.config_summary(cfg)
    model = _model_name(name, cfg)
    b = param_formula(cfg)
    h, a, kv, i = s["hidden_size"], s["num_heads"], s["num_kv_heads"], s["intermediate_size"]
    if FAMILIES[b.family] == "gpt2":
        shape = f"hidden size {h}, {a} heads, GELU MLP of width {i} with biases, LayerNorm"
        how = (f"attention {b.per_layer_attention:,} (c_attn {h}×{3 * h} + bias, c_proj {h}×{h} + bias), "
               f"MLP {b.per_layer_mlp:,} ({h}×{i} and {i}×{h}, with biases), two LayerNorms {b.per_layer_norms:,}")
    else:
        d = _head_dim(cfg, h, a)
        shape = (f"hidden size {h}, {a} query heads and {kv} key/value heads of dimension {d}, SwiGLU MLP of "
                 f"width {i}, RMSNorm")
        how = (f"attention {b.per_layer_attention:,} (q {h}×{a * d}, k and v {h}×{kv * d} each: only {kv} KV "
               f"heads, o {a * d}×{h}), MLP {b.per_layer_mlp:,} (gate, up {h}×{i} and down {i}×{h}), two "
               f"RMSNorms {b.per_layer_norms:,}")
    return Exercise(
        question=f"How many parameters does one {model} layer have? ({shape}.)",
        expected=lambda: param_formula(name).per_layer,
        explain=(f"{how}. The {b.layers} layers hold {b.all_layers:,} of the model's {b.total:,} parameters "
                 f"({LABEL_FORMULA}, checked against numel() of the model transformers builds)."),
        unit="parameters",
        hint="Count the four attention matrices (k and v are smaller with grouped-query attention) and the MLP's "
             "matrices (three for SwiGLU), then the norms: small, but counted (a weight of h values per RMSNorm).")
