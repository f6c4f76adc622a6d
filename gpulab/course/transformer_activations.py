"""Lesson 11: a transformer's activations per layer, formula against autograd.

``korthikanti_bytes``, ``measured_layer_activations``, ``activation_vs_seq``: Korthikanti et al.
2022's count of what one transformer layer saves for backward, next to what autograd really saved
in each layer of the model (eager vs SDPA, CUDA's attention kernel on the fake engine), and a
computed list of where and why the two differ; the same over a sweep of sequence lengths.

Results are dataclasses; nothing here prints. Every number is computed (from a config, a
formula or a run) and carries its label: ``formula`` (``gpulab.measure.engines.LABEL_FORMULA``) or the
label of the engine that measured it.
"""
from __future__ import annotations

import contextlib
import copy
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from gpulab.models import hf_configs
from gpulab.measure.engines import LABEL_FORMULA, Measured, Measurement, RunContext, run
from gpulab.measure.fake_cuda import unpacked_sequences
from gpulab.tables import html_table
from gpulab.categories import Category
from gpulab.units import dtype_name, format_bytes, parse_dtype
from gpulab.views import error_percent, fmt_error
from gpulab.course.transformer_params import _as_config, _family, _model_name

__all__ = [
    "ATTN_IMPLEMENTATIONS", "ActivationDifference", "ActivationSweep", "BLOCKS", "FormulaTerm",
    "KEPT_RUNS", "KORTHIKANTI_SOURCE", "LayerActivations", "SavedEntry", "SeqRow", "activation_vs_seq", "cuda_sdpa",
    "dropout_probabilities", "kept_key", "korthikanti_bytes", "korthikanti_terms", "measured_layer_activations"
]

# --- activations per layer ----------------------------------------------------------------------

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
    rng_bytes_per_layer: float      # the fused kernel's random-number state (seed, offset): not per token
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
                "rng_bytes_per_layer": self.rng_bytes_per_layer, "by_block": dict(self.by_block),
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


def _layer_experiment(cfg, seq_len: int, batch: int, dtype: torch.dtype, backward: bool = True):
    """One forward and backward (``backward=False``: the forward alone) of a fresh model (dropout on:
    training mode), with CUDA's attention kernels when the run follows CUDA's (the fake engine's CUDA
    target)."""
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
        if backward:
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
    """What the forward saved, read off the tracker's records: bytes per layer, the fused kernels'
    random-number state (bytes), bytes outside the layers, bytes per (block, module,
    op, dtype, shape), and the attention kernel that ran."""
    per_layer = [0] * n_layers
    rng, outside = 0, 0
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
            rng += r.nbytes   # the kernel's philox seed / offset: a few bytes, not per token
            continue
        per_layer[layer] += r.nbytes
        key = (_block_of(inner), inner, r.op, r.dtype, tuple(r.shape))
        groups[key] = groups.get(key, 0) + r.nbytes
    return per_layer, rng, outside, groups, kernel


def measured_layer_activations(name_or_config: Any, seq_len: int = 128, batch: int = 1,
                               attn_implementation: str = "eager", dtype: str | torch.dtype = torch.bfloat16,
                               engine: str = "fake", backward: bool = True) -> LayerActivations:
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
    an offset, which do not grow with s·b; flash's ``rng_state`` and ``unused`` are GPU tensors:
    ``flash_api.cpp`` ``mha_fwd``) is reported apart (``rng_bytes_per_layer``).

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
    GPT-2, so such a layer is within 0.1 % of the formula. The tests check both. ``backward=False``: the
    forward alone (lesson 11's panel); all reported is read off the forward's saved tensors and ops, which
    the backward only frees: the same bytes, contents, kernel and differences (tested)."""
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
    m = run(_layer_experiment(cfg, seq_len, batch, dt, backward), engine, fake_target="cuda")
    if m.oom:
        raise MemoryError(f"the forward/backward ran out of memory on the {m.engine} engine: {m.error}")
    n_layers = s["num_layers"]
    per_layer, rng, outside, groups, kernel = _saved_by_layer(m, n_layers)
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
        per_layer_bytes=per_layer, outside_layers_bytes=outside, rng_bytes_per_layer=rng / n_layers,
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
                      dtype: str | torch.dtype = torch.bfloat16, engine: str = "fake",
                      kept: "OrderedDict[tuple, LayerActivations] | None" = None,
                      backward: bool = True) -> ActivationSweep:
    """Per-layer activation bytes over a sweep of sequence lengths: the formula with the score
    term (34·s·b·h + 5·a·s²·b) and without (34·s·b·h), measured with eager attention and with
    SDPA (``measured_layer_activations`` for each). Eager minus SDPA is what storing the s×s
    scores costs: it grows with s², as the formula's 5·a·s²·b does.

    ``kept``: runs measured before (a panel keeps them), by model name, sequence length, batch, attention,
    dtype and engine, which are all a run's bytes depend on: a run found there is reused, and each run made
    is added (at most ``KEPT_RUNS``, the least recently used first out). A model given as a config is
    always measured. ``backward=False``: the runs made are forwards alone (``measured_layer_activations``:
    the same rows), kept apart from full runs, and a full run kept serves too."""
    if not seq_lens:
        raise ValueError("seq_lens must name at least one sequence length")
    rows, runs = [], []
    for s in seq_lens:
        eager = _kept_run(kept, name_or_config, s, batch, "eager", dtype, engine, backward)
        sdpa = _kept_run(kept, name_or_config, s, batch, "sdpa", dtype, engine, backward)
        runs += [eager, sdpa]
        rows.append(SeqRow(s, batch, eager.formula_full_bytes, eager.formula_no_scores_bytes, eager.bytes_per_layer,
                           sdpa.bytes_per_layer, sdpa.attention_kernel, eager.label))
    return ActivationSweep(runs[0].model, rows, runs)


KEPT_RUNS = 24   # ``activation_vs_seq``'s kept runs: a panel's last eight sweeps of three lengths


def kept_key(model: str, seq_len: int, batch: int, attn_implementation: str, dtype: str | torch.dtype,
             engine: str, backward: bool = True) -> tuple:
    """The key ``activation_vs_seq`` keeps a run under (a forward alone: ``backward=False``, apart)."""
    return (model, int(seq_len), int(batch), str(attn_implementation).lower(), dtype_name(parse_dtype(dtype)), engine,
            *(() if backward else ("forward only",)))


def _kept_run(kept: "OrderedDict[tuple, LayerActivations] | None", name_or_config: Any, seq_len: int, batch: int,
              impl: str, dtype: str | torch.dtype, engine: str, backward: bool = True) -> LayerActivations:
    if kept is None or not isinstance(name_or_config, str):
        return measured_layer_activations(name_or_config, seq_len, batch, impl, dtype, engine, backward)
    full = kept_key(name_or_config, seq_len, batch, impl, dtype, engine)
    key = full if backward or full in kept else kept_key(name_or_config, seq_len, batch, impl, dtype, engine, False)
    if key not in kept:
        kept[key] = measured_layer_activations(name_or_config, seq_len, batch, impl, dtype, engine, backward)
    kept.move_to_end(key)
    while len(kept) > KEPT_RUNS:
        kept.popitem(last=False)
    return kept[key]
