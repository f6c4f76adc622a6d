"""Lesson 11, part 1: where a transformer's training memory goes.

Three questions, each answered by a formula from the config alone and by a measurement:

* **Parameters** (``param_formula``): the parameter count of a causal language model from its
  config (GPT-2, Llama, Mistral, Qwen2), term by term, checked against ``numel()`` of the model
  ``transformers`` builds from the same config.
* **Bytes per parameter** (``TRAINING_RECIPES``, ``bytes_per_param_table``,
  ``measured_bytes_per_param``): weights, gradients, optimizer state and master weights under
  the usual training recipes (fp32 + Adam, the ZeRO paper's mixed precision, autocast, pure
  bf16, bf16 weights with fp32 or 8-bit Adam state), and for the recipes ``gpulab.step`` can
  run, the same bytes measured after a training step.
* **Activations per layer** (``korthikanti_bytes``, ``measured_layer_activations``,
  ``activation_vs_seq``): Korthikanti et al. 2022's count of what one transformer layer saves
  for backward, next to what autograd really saved in each layer of the model, and a computed
  list of where and why the two differ.

Results are dataclasses; nothing here prints. Every number is computed (from a config, a
formula or a run) and carries its label: ``formula`` (``gpulab.measure.engines.LABEL_FORMULA``) or the
label of the engine that measured it.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from gpulab import formulas as F
from gpulab.models import hf_configs
from gpulab.measure.engines import LABEL_FORMULA, Measured, Measurement, RunContext, run
from gpulab.measure.fake_cuda import cuda_sdpa_backend, unpacked_sequences
from gpulab.tables import html_table
from gpulab.categories import Category
from gpulab.units import dtype_bytes, dtype_name, format_bytes, parse_dtype
from gpulab.views import error_percent, fmt_error
from gpulab.course.exercises import Exercise

__all__ = [
    "ADAM_SOURCE", "ATTN_IMPLEMENTATIONS", "AUTOCAST_SOURCE", "ActivationDifference",
    "ActivationSweep", "BLOCKS", "BYTES_HEADER", "BytesPerParamRow", "EIGHT_BIT_SOURCE", "FAMILIES",
    "FormulaTerm", "KORTHIKANTI_SOURCE", "LayerActivations", "ParamBreakdown", "RECIPES",
    "SavedEntry", "SeqRow", "TRAINING_RECIPES", "TrainingRecipe", "ZERO_SOURCE",
    "activation_vs_seq", "bytes_per_param_table", "counted_params", "cuda_sdpa",
    "dropout_probabilities", "exercise_layer_params", "korthikanti_bytes", "korthikanti_terms",
    "live_after_last_step", "measured_bytes_per_param", "measured_layer_activations",
    "param_formula", "recipe", "recipe_bytes_per_param"
]

# --- 1. parameters from the config ----------------------------------------------------------------

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
             "matrices (three for SwiGLU); norms are tiny.")


# --- 2. bytes per parameter under training recipes -----------------------------------------------

ZERO_SOURCE = ("Rajbhandari et al., ZeRO (2019, arXiv 1910.02054), §3.1: fp16 weights and gradients, fp32 "
               "master weights, momentum and variance: 2 + 2 + 12 = 16 bytes per parameter")
ADAM_SOURCE = "torch.optim.Adam/AdamW: exp_avg and exp_avg_sq, each in the parameter's dtype (torch/optim/adam.py)"
AUTOCAST_SOURCE = ("torch.autocast (torch.amp docs): parameters, gradients and optimizer state stay fp32; matmuls "
                   "run on 16-bit copies of the weights made in forward")
EIGHT_BIT_SOURCE = ("Dettmers et al., 8-bit Optimizers via Block-wise Quantization (2021, arXiv 2110.02861); "
                    "bitsandbytes Optimizer2State: gpulab.formulas.eight_bit_optimizer_state_bytes")


@dataclass(frozen=True)
class TrainingRecipe:
    """Which dtype each kind of model state has. ``state`` is the dtype of each optimizer
    moment (None: 8-bit blockwise state); ``master`` the dtype of a separate master copy of
    the weights (None: the optimizer updates the weights themselves). ``step_dtype`` /
    ``step_amp``: how ``gpulab.step`` runs the recipe (``dtype=``, ``amp=``), None when it
    cannot (``why_not`` says why)."""
    key: str
    name: str
    weights: str
    gradients: str
    state: str | None
    master: str | None
    source: str
    optimizer: str = "adam"
    step_dtype: str | None = None
    step_amp: str | None = None
    note: str = ""
    why_not: str = ""

    @property
    def measurable(self) -> bool:
        return self.step_dtype is not None


TRAINING_RECIPES: tuple[TrainingRecipe, ...] = (
    TrainingRecipe("fp32", "fp32 + Adam", "float32", "float32", "float32", None, ADAM_SOURCE,
                   step_dtype="float32"),
    TrainingRecipe("zero-mixed", "mixed precision, fp32 master weights (ZeRO)", "float16", "float16", "float32",
                   "float32", ZERO_SOURCE,
                   why_not="gpulab.step keeps no separate master copy of the weights (apex O2, DeepSpeed and "
                           "Megatron-LM do)"),
    TrainingRecipe("autocast", "autocast bf16, fp32 weights", "float32", "float32", "float32", None,
                   AUTOCAST_SOURCE, step_dtype="float32", step_amp="bf16",
                   note="plus the 16-bit copies of the weights autocast makes in forward (saved for backward, "
                        "so they count as activations, not as model state)"),
    TrainingRecipe("pure-bf16", "pure bf16 + Adam", "bfloat16", "bfloat16", "bfloat16", None, ADAM_SOURCE,
                   step_dtype="bfloat16"),
    TrainingRecipe("bf16-fp32-adam", "bf16 weights, fp32 Adam state", "bfloat16", "bfloat16", "float32", None,
                   ADAM_SOURCE + "; the moments kept in fp32 (e.g. a custom or fused optimizer)",
                   why_not="torch.optim keeps Adam's moments in the parameters' dtype; gpulab.step has no "
                           "optimizer with fp32 state for bf16 weights"),
    TrainingRecipe("adam-8bit", "bf16 weights, 8-bit Adam state", "bfloat16", "bfloat16", None, None,
                   EIGHT_BIT_SOURCE,
                   why_not="gpulab.step runs torch.optim optimizers only, not bitsandbytes"),
)
RECIPES = {r.key: r for r in TRAINING_RECIPES}


def recipe(key: str | TrainingRecipe) -> TrainingRecipe:
    """A recipe by key (``"fp32"``, ``"pure-bf16"``, ...) or name; ``ValueError`` lists the keys."""
    if isinstance(key, TrainingRecipe):
        return key
    k = str(key).strip().lower()
    for r in TRAINING_RECIPES:
        if k in (r.key, r.name.lower()):
            return r
    raise ValueError(f"unknown training recipe {key!r}; valid: {', '.join(RECIPES)}")


@dataclass
class BytesPerParamRow:
    """One recipe's model-state bytes per parameter. The per-parameter fields are the byte
    counts divided by ``n_params``; ``step_counter_bytes`` is the part of the optimizer state
    that is Adam's scalar ``step`` tensors (one float32 per parameter tensor, where they live on
    the measured device). A measured row carries the ``formula`` row for the same model."""
    recipe: str
    name: str
    n_params: int
    weight_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    master_bytes: int
    source: str
    label: str
    n_param_tensors: int = 0
    step_counter_bytes: int = 0
    note: str = ""
    model: str = ""
    formula: BytesPerParamRow | None = None
    moment: str = ""   # a measured row: when the live bytes were read

    @property
    def weights(self) -> float:
        return self.weight_bytes / self.n_params

    @property
    def gradients(self) -> float:
        return self.gradient_bytes / self.n_params

    @property
    def optimizer_state(self) -> float:
        return self.optimizer_state_bytes / self.n_params

    @property
    def master_weights(self) -> float:
        return self.master_bytes / self.n_params

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.gradient_bytes + self.optimizer_state_bytes + self.master_bytes

    @property
    def total(self) -> float:
        return self.total_bytes / self.n_params

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "formula"}
        d.update(weights=self.weights, gradients=self.gradients, optimizer_state=self.optimizer_state,
                 master_weights=self.master_weights, total=self.total, total_bytes=self.total_bytes)
        if self.formula is not None:
            d["formula"] = self.formula.as_dict()
        return d

    def cells(self) -> list[str]:
        return [self.name, f"{self.weights:g}", f"{self.gradients:g}", f"{self.optimizer_state:.6g}",
                f"{self.master_weights:g}", f"{self.total:.6g}", self.label]

    def _repr_html_(self) -> str:
        rows = [self.cells()] + ([self.formula.cells()] if self.formula is not None else [])
        return html_table(BYTES_HEADER, rows, f"{self.model or 'model'}: {self.n_params:,} parameters")


BYTES_HEADER = ["recipe", "weights B/param", "gradients", "optimizer state", "master weights", "total", "source"]


def recipe_bytes_per_param(r: str | TrainingRecipe, n_params: int, n_param_tensors: int = 0,
                           count_step_counters: bool = False, optimizer: str | None = None) -> BytesPerParamRow:
    """The formula row of recipe ``r`` for ``n_params`` parameters in ``n_param_tensors``
    tensors: element sizes from ``gpulab.units.dtype_bytes``; the optimizer state from
    ``gpulab.formulas.optimizer_state_bytes`` (state count x the moments' dtype, plus one 4-byte
    ``step`` scalar per parameter tensor when ``count_step_counters``: the CPU keeps them with
    the state, a GPU in host memory) or, for 8-bit state,
    ``gpulab.formulas.eight_bit_optimizer_state_bytes``.

    NB: the 8-bit state is computed as if all parameters were one tensor (blocks do not span
    tensors, which adds at most 8 bytes per tensor; tensors under 4096 elements keep 32-bit
    state)."""
    r = recipe(r)
    opt = optimizer or r.optimizer
    if n_params <= 0:
        raise ValueError(f"n_params must be positive, got {n_params!r}")
    if r.state is None:
        state = F.eight_bit_optimizer_state_bytes(n_params, F.optimizer_state_multiplier(opt))
        counters = 0
    else:
        state = F.optimizer_state_bytes(n_params * dtype_bytes(r.state), n_param_tensors, opt, count_step_counters)
        counters = F.optimizer_state_bytes(0, n_param_tensors, opt, count_step_counters)
    return BytesPerParamRow(r.key, r.name, n_params, n_params * dtype_bytes(r.weights),
                            n_params * dtype_bytes(r.gradients), state,
                            n_params * dtype_bytes(r.master) if r.master else 0, r.source, LABEL_FORMULA,
                            n_param_tensors, counters, r.note)


def bytes_per_param_table(n_params: int) -> list[BytesPerParamRow]:
    """Every recipe of ``TRAINING_RECIPES`` for a model of ``n_params`` parameters (formula; no
    step counters: a GPU keeps them in host memory)."""
    return [recipe_bytes_per_param(r, n_params) for r in TRAINING_RECIPES]


def _step_model(config_or_name: Any) -> Any:
    """What ``gpulab.step`` takes: ``hf:NAME`` for a built-in config, a config object as is."""
    if hf_configs.is_config(config_or_name):
        return config_or_name
    return hf_configs.HF_PREFIX + hf_configs.hf_entry(config_or_name).name


def live_after_last_step(m: Measurement) -> dict[str, int]:
    """Live tensor bytes per category (unrounded: numel x element size, as the formulas count)
    on the measured device just after the last ``optimizer.step()`` of a ``gpulab.step`` run,
    when the weights, their gradients and the optimizer state all exist. (At the run's peak a
    gradient may not exist yet: the peak can fall in the backward pass.)"""
    marks = (m.value or {}).get("step_marks") if isinstance(m.value, dict) else None
    if not marks or m.tracking is None:
        raise ValueError("the run has no step marks: it did not finish a training step")
    end = marks[-1]
    out = {c.value: 0 for c in Category}
    for r in m.tracking.records.values():
        if r.created < end and (r.freed is None or r.freed >= end):
            out[r.category.value] += r.nbytes
    return out


def measured_bytes_per_param(config_or_name: Any, r: str | TrainingRecipe = "fp32", engine: str = "cpu",
                             batch: int = 1, seq_len: int | None = None, optimizer: str | None = None,
                             steps: int = 1) -> BytesPerParamRow:
    """Run recipe ``r`` with ``gpulab.step`` (``steps`` training steps, its dtype, autocast and
    optimizer; ``optimizer`` overrides the recipe's, e.g. "adamw", whose state is Adam's) and
    divide the live parameter, gradient and optimizer-state bytes after the last step by the
    parameter count (``counted_params``). One step is enough: the optimizer creates its state in
    its first ``step()``, so right after it the weights, their gradients and the whole state are
    live, as after any later step (a second step frees and remakes the same tensors). Returns the measured row, labelled with the run's
    label, with the formula row for the same model attached (``.formula``), counting Adam's
    ``step`` scalars where the run keeps them on the measured device: the cpu engine does (one
    float32 per parameter tensor, in optimizer state); a GPU, and the fake engine's CUDA target,
    keep them in host memory. A recipe ``gpulab.step`` cannot run raises ``ValueError``."""
    from gpulab.predict.step import step
    r = recipe(r)
    if not r.measurable:
        raise ValueError(f"cannot measure {r.name!r}: {r.why_not}; its bytes per parameter are a formula only "
                         f"(recipe_bytes_per_param)")
    opt = optimizer or r.optimizer
    result = step(_step_model(config_or_name), batch=batch, seq_len=seq_len, engine=engine, dtype=r.step_dtype,
                  amp=r.step_amp, optimizer=opt, steps=steps)
    m = result.measurement
    if m.oom:
        raise MemoryError(f"{r.name} ran out of memory on the {m.engine} engine: {m.error}")
    n, tensors = counted_params(config_or_name)
    live = live_after_last_step(m)
    counters_here = m.kernels != "cuda"
    formula = recipe_bytes_per_param(r, n, tensors, counters_here, opt)
    counters = sum(rec.nbytes for rec in m.tracking.records.values()
                   if rec.state_key == "step" and rec.category == Category.OPTIMIZER_STATE)
    return BytesPerParamRow(r.key, r.name, n, live[Category.PARAMETERS.value], live[Category.GRADIENTS.value],
                            live[Category.OPTIMIZER_STATE.value], 0, r.source, m.label, tensors,
                            counters if counters_here else 0, r.note, model=result.model, formula=formula,
                            moment="live after the last optimizer step")


# --- 3. activations per layer ----------------------------------------------------------------------

KORTHIKANTI_SOURCE = ("Korthikanti et al., Reducing Activation Recomputation in Large Transformer Models (2022, "
                      "arXiv 2205.05198), §4.1, eq. 1: s·b·h·(34 + 5·a·s/h) bytes per layer, 16-bit values, "
                      "1-byte dropout masks")


def korthikanti_bytes(s: int, b: int, h: int, a: int, quadratic: bool = True) -> int:
    """Activation bytes one transformer layer saves for backward, Korthikanti et al. 2022,
    eq. 1: s·b·h·(34 + 5·a·s/h) = 34·s·b·h + 5·a·s²·b, for sequence length s, micro-batch b,
    hidden size h and a attention heads, with 16-bit activations, 1-byte dropout masks and a
    4h MLP. ``quadratic=False`` leaves out the 5·a·s²·b of the s×s attention scores (softmax
    output 2, its dropout mask 1, the dropped probabilities 2 bytes per element): what remains,
    34·s·b·h, is what a fused attention (flash / memory-efficient SDPA) layer saves, since it
    never stores the scores (it saves a logsumexp per row and recomputes them in backward)."""
    for name, v in (("s", s), ("b", b), ("h", h), ("a", a)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return 34 * s * b * h + (5 * a * s * s * b if quadratic else 0)


@dataclass(frozen=True)
class FormulaTerm:
    """One term of Korthikanti et al.'s count (§4.1). ``block`` is the paper's (attention, MLP,
    LayerNorm); ``creator`` the part of a pre-norm HF layer whose forward creates that tensor
    (``norm``: a LayerNorm's output, ``layer``: the residual stream), which is where the
    tracker records it; ``kind`` is "value", "mask" (a dropout mask) or "scores"."""
    name: str
    bytes: int
    block: str
    creator: str
    kind: str
    dropout: str = ""   # "attention" / "hidden": the term exists only with that dropout


def korthikanti_terms(s: int, b: int, h: int, a: int) -> list[FormulaTerm]:
    """The terms of ``korthikanti_bytes`` one by one (they sum to it): attention 11·s·b·h +
    5·a·s²·b, MLP 19·s·b·h, LayerNorm 4·s·b·h, as §4.1 lists them."""
    korthikanti_bytes(s, b, h, a)   # validates
    sbh, as2b = s * b * h, a * s * s * b
    return [
        FormulaTerm("QKV input (LayerNorm 1 output)", 2 * sbh, "attention", "norm", "value"),
        FormulaTerm("Q and K (inputs of QKᵀ)", 4 * sbh, "attention", "attention", "value"),
        FormulaTerm("softmax output", 2 * as2b, "attention", "attention", "scores"),
        FormulaTerm("softmax dropout mask", as2b, "attention", "attention", "scores", "attention"),
        FormulaTerm("dropped probabilities (input of ·V)", 2 * as2b, "attention", "attention", "scores", "attention"),
        FormulaTerm("V (input of ·V)", 2 * sbh, "attention", "attention", "value"),
        FormulaTerm("output projection input", 2 * sbh, "attention", "attention", "value"),
        FormulaTerm("attention dropout mask", sbh, "attention", "attention", "mask", "hidden"),
        FormulaTerm("MLP first linear input (LayerNorm 2 output)", 2 * sbh, "mlp", "norm", "value"),
        FormulaTerm("GELU input", 8 * sbh, "mlp", "mlp", "value"),
        FormulaTerm("MLP second linear input (GELU output)", 8 * sbh, "mlp", "mlp", "value"),
        FormulaTerm("MLP dropout mask", sbh, "mlp", "mlp", "mask", "hidden"),
        FormulaTerm("LayerNorm inputs (2)", 4 * sbh, "layernorm", "layer", "value"),
    ]


def dropout_probabilities(config: Any) -> tuple[float, float]:
    """(attention dropout, hidden dropout) of a config: GPT-2's ``attn_pdrop`` and
    ``resid_pdrop``; the Llama layout's ``attention_dropout`` and no hidden dropout at all."""
    cfg = _as_config(config)

    def first(*names: str) -> float:
        for n in names:
            v = getattr(cfg, n, None)
            if v is not None:
                return float(v)
        return 0.0
    return first("attn_pdrop", "attention_dropout"), first("resid_pdrop", "hidden_dropout")


# --- what CUDA's scaled_dot_product_attention runs, on fake tensors ------------------------------

def cuda_sdpa() -> contextlib.AbstractContextManager:
    """CUDA's attention kernel on fake tensors: part of every fake CUDA-target run
    (``gpulab.measure.fake_cuda.cuda_kernels``); kept as a name for this lesson's own runs."""
    from gpulab.measure.fake_cuda import _cuda_attention
    return _cuda_attention()


# --- measuring one layer's saved tensors --------------------------------------------------------------

_LAYER = re.compile(r"\.(?:h|layers)\.(\d+)(?:\.|$)")
_FUSED_OPS = {"_scaled_dot_product_flash_attention": "flash", "_scaled_dot_product_efficient_attention": "efficient",
              "_scaled_dot_product_cudnn_attention": "cudnn", "_scaled_dot_product_flash_attention_for_cpu":
              "flash (CPU)"}
ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
BLOCKS = ("layer", "norm", "attention", "mlp", "other")


def _layer_of(module: str) -> tuple[int, str] | None:
    """(layer index, module path inside the layer) of a tracker module name such as
    ``GPT2LMHeadModel.transformer.h.3.attn.c_attn`` or ``LlamaForCausalLM.model.layers.3.mlp``."""
    m = _LAYER.search(module)
    if m is None:
        return None
    return int(m.group(1)), module[m.end():]


def _block_of(inner: str) -> str:
    """Which part of a layer a module path inside it is: the layer itself (the residual stream),
    a norm, the attention or the MLP."""
    head = inner.split(".", 1)[0]
    if not head:
        return "layer"
    if "attn" in head or "attention" in head:
        return "attention"
    if "mlp" in head or "feed_forward" in head:
        return "mlp"
    if "norm" in head or head.startswith("ln"):
        return "norm"
    return "other"


@dataclass(frozen=True)
class SavedEntry:
    """What one kind of saved tensor costs per layer: the module inside the layer that created
    it, the op, dtype and shape, and the bytes (summed over the layers, divided by their count)."""
    block: str
    module: str
    op: str
    dtype: str
    shape: tuple[int, ...]
    bytes: float

    def text(self) -> str:
        shape = "×".join(map(str, self.shape)) or "scalar"
        return f"{self.module or '(layer)'} {self.op} {self.dtype} {shape}: {self.bytes:,.0f} B"


@dataclass(frozen=True)
class ActivationDifference:
    """One reason why measured and formula differ, per layer, in bytes (measured − formula:
    negative for a formula term the model does not have). ``label`` says whether the bytes come
    from the formula (an absent term) or the measurement (what a part of the layer saves beyond
    the formula's terms that exist)."""
    what: str
    bytes: float
    where: str
    why: str
    label: str


@dataclass
class LayerActivations(Measured):
    """What autograd saved per transformer layer in one forward pass, next to Korthikanti et
    al.'s formula (``measured_layer_activations``)."""
    model: str
    family: str
    seq_len: int
    batch: int
    hidden: int
    heads: int
    n_layers: int
    dtype: str
    attn_implementation: str
    attention_kernel: str           # what ran: eager, flash, efficient, flash (CPU), cudnn, math
    measurement: Measurement
    per_layer_bytes: list[int]      # each layer's saved bytes (measured)
    outside_layers_bytes: int       # saved tensors created outside the layers (embeddings, final norm, LM head)
    host_bytes_per_layer: float     # what a GPU keeps in host memory (flash/efficient RNG seed and offset)
    by_block: dict[str, float]      # measured bytes per layer by the part that created them
    contents: list[SavedEntry]
    formula_bytes: int              # the formula compared: with the score term for eager, without for fused
    formula_full_bytes: int
    formula_no_scores_bytes: int
    terms: list[FormulaTerm]
    differences: list[ActivationDifference]
    formula_label: str = LABEL_FORMULA

    @property
    def bytes_per_layer(self) -> float:
        return sum(self.per_layer_bytes) / len(self.per_layer_bytes)

    @property
    def error_percent(self) -> float | None:
        """(formula − measured) / measured in %."""
        return error_percent(self.formula_bytes, self.bytes_per_layer)

    @property
    def difference_bytes(self) -> float:
        return self.bytes_per_layer - self.formula_bytes

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "family": self.family, "seq_len": self.seq_len, "batch": self.batch,
                "hidden": self.hidden, "heads": self.heads, "n_layers": self.n_layers, "dtype": self.dtype,
                "attn_implementation": self.attn_implementation, "attention_kernel": self.attention_kernel,
                "engine": self.engine, "label": self.label, "bytes_per_layer": self.bytes_per_layer,
                "per_layer_bytes": list(self.per_layer_bytes), "outside_layers_bytes": self.outside_layers_bytes,
                "host_bytes_per_layer": self.host_bytes_per_layer, "by_block": dict(self.by_block),
                "formula_bytes": self.formula_bytes, "formula_full_bytes": self.formula_full_bytes,
                "formula_no_scores_bytes": self.formula_no_scores_bytes, "formula_label": self.formula_label,
                "error_percent": self.error_percent, "difference_bytes": self.difference_bytes,
                "differences": [asdict(d) for d in self.differences],
                "contents": [asdict(c) for c in self.contents]}

    def _repr_html_(self) -> str:
        head = html_table(
            ["per layer", "bytes", "source"],
            [["measured", format_bytes(self.bytes_per_layer), self.label],
             ["formula" + (" (34·s·b·h + 5·a·s²·b)" if self.formula_bytes == self.formula_full_bytes
                           else " (34·s·b·h, no scores)"), format_bytes(self.formula_bytes), self.formula_label],
             ["formula error", fmt_error(self.error_percent), ""]],
            f"{self.model}, {self.attn_implementation} ({self.attention_kernel}), s={self.seq_len}, b={self.batch}, "
            f"{self.dtype}")
        diffs = html_table(["difference", "bytes per layer", "where", "why", "source"],
                           [[d.what, f"{d.bytes:+,.0f}", d.where, d.why, d.label] for d in self.differences],
                           "measured − formula, one reason per row")
        return head + diffs


def _layer_experiment(cfg, seq_len: int, batch: int, dtype: torch.dtype):
    """One forward and backward of a fresh model (dropout on: training mode), with CUDA's
    attention kernels when the run follows CUDA's (the fake engine's CUDA target)."""
    from gpulab.models.workload import forward, resolve_workload
    w = resolve_workload(cfg, seq_len=seq_len)

    def experiment(ctx: RunContext) -> dict[str, Any]:
        sdpa = cuda_sdpa() if ctx.kernels == "cuda" and ctx.engine == "fake" else contextlib.nullcontext()
        unpacked = unpacked_sequences() if ctx.engine == "fake" else contextlib.nullcontext()
        with ctx.phase("setup"):
            net = w.build(ctx.device, dtype)
            net.train()
            with torch.device(ctx.device):
                data = w.inputs(batch, dtype)
            for t in [*data[0], *data[1].values()]:
                if isinstance(t, torch.Tensor):
                    ctx.label(t)
        with ctx.phase("forward"), sdpa, unpacked:
            loss = w.loss(forward(net, data), data)
        with ctx.phase("backward"):
            loss.backward()
        return {"n_layers": hf_configs.config_summary(cfg)["num_layers"]}
    return experiment


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


def _absent_terms(terms: list[FormulaTerm], p_attn: float, p_hidden: float) -> list[tuple[FormulaTerm, str]]:
    """The formula's terms the model does not have, and why (from the config's dropout)."""
    out = []
    for t in terms:
        if t.dropout == "attention" and p_attn == 0:
            out.append((t, "attention dropout p = 0: no mask, and ·V saves the softmax output itself"
                           if "dropped" in t.name else "attention dropout p = 0: no mask"))
        elif t.dropout == "hidden" and p_hidden == 0:
            out.append((t, "no dropout after the projection (the model has none, or p = 0)"))
    return out


def _differences(terms: list[FormulaTerm], absent: list[tuple[FormulaTerm, str]], by_block: dict[str, float],
                 contents: list[SavedEntry], label: str) -> list[ActivationDifference]:
    """Absent formula terms (negative), then, per part of the layer, what it saved beyond the
    formula's remaining terms created there (measured, with what it saved)."""
    out = [ActivationDifference(t.name, -t.bytes, t.creator, why, LABEL_FORMULA) for t, why in absent]
    gone = {id(t) for t, _ in absent}
    for block in BLOCKS:
        present = sum(t.bytes for t in terms if t.creator == block and id(t) not in gone)
        extra = by_block.get(block, 0) - present
        if extra:
            saved = "; ".join(c.text() for c in contents if c.block == block) or "nothing"
            names = ", ".join(t.name for t in terms if t.creator == block and id(t) not in gone) or "none"
            out.append(ActivationDifference(
                f"{block}: saved {'beyond' if extra > 0 else 'short of'} the formula's terms", extra, block,
                f"formula terms created here: {names} ({present:,} B); measured: {saved}", label))
    return out


def _saved_by_layer(m: Measurement, n_layers: int) -> tuple[list[int], int, int, dict[tuple, int], str]:
    """What the forward saved, read off the tracker's records: bytes per layer, host bytes (the
    fused kernels' random-number state), bytes outside the layers, bytes per (block, module,
    op, dtype, shape), and the attention kernel that ran."""
    per_layer = [0] * n_layers
    host, outside = 0, 0
    groups: dict[tuple, int] = {}
    kernel = "eager"
    for r in m.tracking.records.values():
        place = _layer_of(r.module)
        if place is not None and r.op in _FUSED_OPS:
            kernel = _FUSED_OPS[r.op]
        elif place is not None and r.op == "_safe_softmax" and kernel == "eager":
            kernel = "math"
        if r.category != Category.ACTIVATIONS or r.phase != "forward":
            continue
        if place is None:
            outside += r.nbytes
            continue
        layer, inner = place
        if m.kernels == "cuda" and r.op in _FUSED_OPS and not r.dtype.startswith(("float", "bfloat")):
            host += r.nbytes   # philox seed / offset: CPU tensors on a GPU (not under CUDA graphs)
            continue
        per_layer[layer] += r.nbytes
        key = (_block_of(inner), inner, r.op, r.dtype, tuple(r.shape))
        groups[key] = groups.get(key, 0) + r.nbytes
    return per_layer, host, outside, groups, kernel


def measured_layer_activations(name_or_config: Any, seq_len: int = 128, batch: int = 1,
                               attn_implementation: str = "eager", dtype: str | torch.dtype = torch.bfloat16,
                               engine: str = "fake") -> LayerActivations:
    """Build the whole model (``attn_implementation`` "eager" or "sdpa", written into a copy of
    the config as ``_attn_implementation``), run one forward and backward of token ids (s =
    ``seq_len``, b = ``batch``) in training mode under gpulab's tracker, and report the bytes
    autograd saved per transformer layer: the activation-category storages created in forward,
    grouped by the layer index in the creating module's name (``transformer.h.3.`` /
    ``model.layers.3.``), averaged over the layers. Each layer is charged for what its own
    modules create (its output, which the next layer's norm saves, included; its input, the
    previous layer's output or the embedding, not), so every layer counts the same.

    ``engine`` "fake" runs on the fake engine's CUDA target (a GPU's allocations: bool dropout
    masks, and here also CUDA's attention kernel, ``cuda_sdpa_backend``, and transformers' mask
    choice for real positions, ``unpacked_sequences``; without these two a fake GPT-2 layer with
    SDPA took the CPU's math fallback and saved 2.75x what flash saves at s = 512); "cpu" computes for
    real on this CPU (small configs), with its kernels (float dropout masks; SDPA with dropout
    falls back to the math composite). The random-number state of the fused kernels (a seed and
    an offset, host tensors on a GPU) is reported apart (``host_bytes_per_layer``).

    Compared with ``korthikanti_bytes`` (with the score term for eager attention, without it
    when a fused kernel ran), term by term (``korthikanti_terms``), in ``differences``:

    * formula terms the model does not have, from its config: dropout masks where p = 0 (Llama,
      Mistral and Qwen2 have no dropout at all), the scores under a fused kernel;
    * per part of the layer, what it saved beyond the formula's terms created there, listed
      storage by storage (the measurement).

    What GPT-2 (hf:gpt2, eager, bf16, fake CUDA target) saves, found this way and exact to the
    byte: every one of the formula's 13 terms, plus (1) GPT-2's ``gelu_new``, a Python composite
    (transformers' ``NewGELUActivation``: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))), whose
    element-wise ops save three more tensors of the MLP's width, tanh(·), 0.5·x and 1 + tanh(·):
    3·2·s·b·4h = 24·s·b·h bytes (+35 % at s = 128); and (2) each LayerNorm's per-token mean and
    1/std: 2 norms × 2 × s·b values (in the activation dtype on fake CPU tensors; float32 on a
    GPU, whose ``layer_norm`` kernel keeps them in the accumulate type). With the one-kernel
    tanh GELU (``activation_function="gelu_pytorch_tanh"``, the same function) only (2) remains:
    at most 2·2·4 = 16 bytes per s·b against 34·h of the formula, 16 / (34 · 768) = 0.061 % for
    GPT-2, so such a layer is within 0.1 % of the formula. The tests check both."""
    impl = str(attn_implementation).lower()
    if impl not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {attn_implementation!r}; valid: "
                         f"{', '.join(ATTN_IMPLEMENTATIONS)}")
    _check_positive(seq_len=seq_len, batch=batch)
    dt = parse_dtype(dtype)
    cfg = copy.deepcopy(_as_config(name_or_config))
    cfg._attn_implementation = impl
    family = _family(cfg)
    s = hf_configs.config_summary(cfg)
    if s["max_positions"] and seq_len > s["max_positions"]:
        raise ValueError(f"seq_len {seq_len} is longer than the model takes ({s['max_positions']} positions)")
    m = run(_layer_experiment(cfg, seq_len, batch, dt), engine, fake_target="cuda")
    if m.oom:
        raise MemoryError(f"the forward/backward ran out of memory on the {m.engine} engine: {m.error}")
    n_layers = s["num_layers"]
    per_layer, host, outside, groups, kernel = _saved_by_layer(m, n_layers)
    if impl == "eager":
        kernel = "eager"
    contents = [SavedEntry(b, mod, op, d, shape, n / n_layers) for (b, mod, op, d, shape), n in groups.items()]
    by_block = {b: sum(c.bytes for c in contents if c.block == b) for b in BLOCKS}
    h, a = s["hidden_size"], s["num_heads"]
    terms = korthikanti_terms(seq_len, batch, h, a)
    fused = kernel in ("flash", "efficient", "cudnn", "flash (CPU)")
    full = korthikanti_bytes(seq_len, batch, h, a)
    no_scores = korthikanti_bytes(seq_len, batch, h, a, quadratic=False)
    # the formula compared: the score terms belong to it unless a fused kernel ran, which never
    # stores the s×s scores (it saves a float32 logsumexp per row and recomputes them in backward)
    formula = no_scores if fused else full
    compared_terms = [t for t in terms if not (fused and t.kind == "scores")]
    p_attn, p_hidden = dropout_probabilities(cfg)
    differences = _differences(compared_terms, _absent_terms(compared_terms, p_attn, p_hidden), by_block, contents,
                               m.label)
    return LayerActivations(
        model=_model_name(name_or_config, cfg), family=family, seq_len=seq_len, batch=batch, hidden=h, heads=a,
        n_layers=n_layers, dtype=dtype_name(dt), attn_implementation=impl, attention_kernel=kernel, measurement=m,
        per_layer_bytes=per_layer, outside_layers_bytes=outside, host_bytes_per_layer=host / n_layers,
        by_block=by_block, contents=contents, formula_bytes=formula, formula_full_bytes=full,
        formula_no_scores_bytes=no_scores, terms=terms, differences=differences)


# --- a sequence-length sweep ------------------------------------------------------------------------

@dataclass(frozen=True)
class SeqRow:
    """One sequence length: the formula with and without the score term, and the measured bytes
    per layer with eager attention and with SDPA."""
    seq_len: int
    batch: int
    formula: int
    formula_no_scores: int
    measured_eager: float
    measured_sdpa: float
    sdpa_kernel: str
    label: str
    formula_label: str = LABEL_FORMULA

    @property
    def eager_error_percent(self) -> float | None:
        return error_percent(self.formula, self.measured_eager)

    @property
    def sdpa_error_percent(self) -> float | None:
        """Against the formula without scores when a fused kernel ran, else the full formula."""
        return error_percent(self.formula if self.sdpa_kernel == "math" else self.formula_no_scores,
                             self.measured_sdpa)

    @property
    def scores_formula(self) -> int:
        """The formula's s² part, 5·a·s²·b."""
        return self.formula - self.formula_no_scores

    @property
    def scores_measured(self) -> float:
        """Measured eager − measured SDPA: what storing the scores costs in this model."""
        return self.measured_eager - self.measured_sdpa

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "eager_error_percent": self.eager_error_percent,
                "sdpa_error_percent": self.sdpa_error_percent, "scores_formula": self.scores_formula,
                "scores_measured": self.scores_measured}


@dataclass
class ActivationSweep:
    """``activation_vs_seq``: rows, and the runs behind them (eager and SDPA per length)."""
    model: str
    rows: list[SeqRow]
    runs: list[LayerActivations] = field(default_factory=list, repr=False)

    @property
    def label(self) -> str:
        return self.rows[0].label if self.rows else ""

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "label": self.label, "rows": [r.as_dict() for r in self.rows]}

    def plot(self):
        """Bytes per layer over the sequence length: the formula with and without the s² term as
        curves (from 0 to the longest length), the measured eager and SDPA layers as points."""
        from gpulab.plots import _fig
        from gpulab.units import MiB
        fig = _fig(7.0, 3.4)
        ax = fig.add_subplot()
        r0 = self.rows[0]
        top = max(r.seq_len for r in self.rows)
        xs = [top * i / 50 for i in range(1, 51)]
        lin = r0.formula_no_scores / r0.seq_len                 # 34·b·h per token
        quad = r0.scores_formula / r0.seq_len ** 2              # 5·a·b per token²
        ax.plot(xs, [(lin * x + quad * x * x) / MiB for x in xs], color="#C44E52",
                label="formula s·b·h·(34 + 5as/h)")
        ax.plot(xs, [lin * x / MiB for x in xs], color="#4C72B0", ls="--", label="formula without scores, 34·s·b·h")
        ax.scatter([r.seq_len for r in self.rows], [r.measured_eager / MiB for r in self.rows], color="#C44E52",
                   zorder=3, label="measured, eager attention")
        ax.scatter([r.seq_len for r in self.rows], [r.measured_sdpa / MiB for r in self.rows], color="#4C72B0",
                   marker="s", zorder=3, label="measured, SDPA")
        ax.set_xlabel("sequence length s (tokens)")
        ax.set_ylabel("MiB per layer")
        ax.set_title(f"{self.model}: activations per layer — {self.label}", fontsize=9)
        ax.legend(fontsize=8)
        return fig

    def _repr_html_(self) -> str:
        rows = [[r.seq_len, format_bytes(r.formula), format_bytes(r.formula_no_scores),
                 format_bytes(r.measured_eager), fmt_error(r.eager_error_percent),
                 format_bytes(r.measured_sdpa) + f" ({r.sdpa_kernel})", fmt_error(r.sdpa_error_percent),
                 format_bytes(r.scores_formula), format_bytes(r.scores_measured)] for r in self.rows]
        return html_table(["s", "formula", "formula, no scores", "eager", "error", "sdpa", "error",
                           "5·a·s²·b", "eager − sdpa"], rows,
                          f"{self.model}: activation bytes per layer — {LABEL_FORMULA} vs {self.label}")


def activation_vs_seq(name_or_config: Any, seq_lens: Sequence[int] = (128, 256, 512), batch: int = 1,
                      dtype: str | torch.dtype = torch.bfloat16, engine: str = "fake") -> ActivationSweep:
    """Per-layer activation bytes over a sweep of sequence lengths: the formula with the score
    term (34·s·b·h + 5·a·s²·b) and without (34·s·b·h), measured with eager attention and with
    SDPA (``measured_layer_activations`` for each). Eager minus SDPA is what storing the s×s
    scores costs: it grows with s², as the formula's 5·a·s²·b does."""
    if not seq_lens:
        raise ValueError("seq_lens must name at least one sequence length")
    rows, runs = [], []
    for s in seq_lens:
        eager = measured_layer_activations(name_or_config, s, batch, "eager", dtype, engine)
        sdpa = measured_layer_activations(name_or_config, s, batch, "sdpa", dtype, engine)
        runs += [eager, sdpa]
        rows.append(SeqRow(s, batch, eager.formula_full_bytes, eager.formula_no_scores_bytes, eager.bytes_per_layer,
                           sdpa.bytes_per_layer, sdpa.attention_kernel, eager.label))
    return ActivationSweep(runs[0].model, rows, runs)
