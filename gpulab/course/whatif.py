"""Lesson 11's what-if: one transformer training step's memory per GPU, by formula at once and
measured (a fake run and the allocator simulator) beside it.

``whatif_formula(...)`` is the formula side: a pure function of the settings, in microseconds
(the model's config is read once per process), returning a ``WhatIfFormula``:

* parameters P from the config (``transformer_params.param_formula``), bytes per element by the
  precision (fp32 and amp-bf16 keep fp32 weights, 4 B; pure bf16 2 B); gradients the same;
  optimizer state ``formulas.optimizer_state_multiplier`` × the parameter bytes;
* tensor parallelism over t GPUs divides all three by t (NB: Megatron splits the attention and MLP
  weights and the vocabulary; the norms stay whole on every rank: a few MiB);
* ZeRO stage z over d data-parallel GPUs as the ZeRO paper divides them (Rajbhandari et al. 2019,
  §5: P_os, P_os+g, P_os+g+p; ``formulas.zero_bytes_per_device``), with DeepSpeed's bytes for its
  mixed precision from stage 1 on: 16-bit weights and gradients and 16 B of fp32 state a parameter
  (master weights, two Adam moments, the fp32 gradient partition: ``predict.sharding.DS_STATE_BYTES``);
* activations by Korthikanti et al. 2022, Table 2, per layer and per tensor-parallel rank:
  s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes without recompute, s·b·h·(10 + 24/t) with selective
  recompute (the s×s attention scores recomputed), and 2·s·b·h per layer plus one layer's full set
  with full recompute (``formulas.checkpointed_activation_bytes``). The formula is for 16-bit
  activations: ×2 for fp32 (NB: its 1-byte dropout masks stay 1 byte). Dropout masks are dropped
  for a model whose config has no dropout (Llama, Mistral, Qwen2). The logits add s·b·V/t values
  in the activation dtype and their fp32 copy for the loss (transformers' ``ForCausalLMLoss``
  upcasts them: ``logits = logits.float()``).

``whatif_measured(...)`` is the measured side: the same model and recipe's two training steps on the
fake engine following the card's CUDA kernels, as ``gpulab.step`` runs them and made as ``gpulab.fit``
makes its runs (``predict.fake_step``: a tensor-parallel rank on the fake process group), a
ZeRO stage applied to that timeline as ``gpulab.fit`` applies it (``predict.sharding.per_rank``:
stages 1-3 are DeepSpeed's ZeRO-1/2/3), and the timeline replayed through the simulated caching
allocator. Fake runs are kept for the process (``predict.run_cache``): a setting met before
answers at once (the replay aside).
"""
from __future__ import annotations

import functools
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from gpulab import formulas as F
from gpulab.units import format_bytes

__all__ = [
    "RECOMPUTE", "WHATIF_MODELS", "WHATIF_OPTIMIZERS", "WHATIF_PRECISIONS", "WhatIfFormula", "WhatIfMeasured",
    "check_whatif", "compare_html", "explain", "model_shape", "whatif_formula", "whatif_measured"
]

WHATIF_MODELS = ("hf:gpt2", "hf:tiny-llama", "hf:qwen2.5-0.5b", "hf:llama-3-8b", "hf:mistral-7b")
RECOMPUTE = ("none", "selective", "full")
# the precision's (weights dtype, autocast), as lesson 11's fine-tune check names them
WHATIF_PRECISIONS = {"fp32": ("float32", None), "bf16": ("bfloat16", None), "amp-bf16": ("float32", "bf16")}
WHATIF_OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
ZERO_STAGES = (0, 1, 2, 3)
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations")
FORMULA_LABEL = "formula (parameters from the config, ZeRO paper §5, Korthikanti et al. 2022 Table 2)"


@functools.lru_cache(maxsize=None)
def model_shape(model: str) -> dict[str, Any]:
    """What the formula needs of a built-in config, read once: P, h, a, L, V, max positions, dropout."""
    from gpulab.course.transformer_activations import dropout_probabilities
    from gpulab.course.transformer_params import param_formula
    from gpulab.models import hf_configs
    cfg = hf_configs.make_config(model, use_cache=False)
    s = hf_configs.config_summary(cfg)
    p_attn, p_hidden = dropout_probabilities(cfg)
    return {"params": param_formula(cfg).total, "h": s["hidden_size"], "a": s["num_heads"], "layers": s["num_layers"],
            "vocab": s["vocab_size"], "max_positions": s["max_positions"], "p_attn": p_attn, "p_hidden": p_hidden}


def check_whatif(model: str, seq_len: int, batch: int, recompute: str, precision: str, optimizer: str,
                 zero: int, dp: int, tp: int) -> dict[str, Any]:
    """The model's shape, or a one-line ``ValueError`` saying what to change."""
    if model not in WHATIF_MODELS:
        raise ValueError(f"unknown model {model!r}; the what-if offers {', '.join(WHATIF_MODELS)}")
    for name, v in (("seq_len", seq_len), ("batch", batch), ("dp", dp), ("tp", tp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a whole number, 1 or more, got {v!r}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    if precision not in WHATIF_PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(WHATIF_PRECISIONS)}, got {precision!r}")
    F.check_optimizer(optimizer)
    if zero not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero!r}")
    m = model_shape(model)
    if m["max_positions"] and seq_len > m["max_positions"]:
        raise ValueError(f"{model} takes at most {m['max_positions']} positions: choose a sequence of "
                         f"{m['max_positions']} or fewer")
    if m["a"] % tp or m["h"] % tp:
        raise ValueError(f"tensor parallelism over {tp} GPUs must divide {model}'s {m['a']} heads and "
                         f"{m['h']} hidden size: choose a tp that does")
    return m


@dataclass(frozen=True)
class WhatIfFormula:
    """The formula side: bytes per GPU by category (module docstring), and its terms."""
    model: str
    seq_len: int
    batch: int
    recompute: str
    precision: str
    optimizer: str
    zero: int
    dp: int
    tp: int
    n_params: int
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    scores_bytes: int          # Korthikanti's s² term over all layers, within ``activations`` (0 when recomputed)
    logits_bytes: int          # within ``activations``
    label: str = FORMULA_LABEL

    @property
    def total(self) -> int:
        """Parameters + gradients + optimizer state + activations: the sum of the parts (NB: more than a
        step's peak, where gradients grow while activations are freed)."""
        return self.parameters + self.gradients + self.optimizer_state + self.activations

    def by_category(self) -> dict[str, int]:
        return {c: getattr(self, c) for c in CATEGORIES}

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}

    def _repr_html_(self) -> str:
        return compare_html(self, None)


def whatif_formula(model: str = "hf:gpt2", seq_len: int = 1024, batch: int = 1, recompute: str = "none",
                   precision: str = "bf16", optimizer: str = "adamw", zero: int = 0, dp: int = 1,
                   tp: int = 1) -> WhatIfFormula:
    """Bytes per GPU of one training step by formula (module docstring): pure, no torch run."""
    m = check_whatif(model, seq_len, batch, recompute, precision, optimizer, zero, dp, tp)
    n, s, b, h, a, layers, t = m["params"], seq_len, batch, m["h"], m["a"], m["layers"], tp
    weights = WHATIF_PRECISIONS[precision][0]
    pe = 4 if weights == "float32" else 2
    mult = F.optimizer_state_multiplier(optimizer)
    local = -(-n // t)                                   # a tensor-parallel rank's parameters
    if zero == 0 or dp == 1:
        params, grads, state = local * pe, local * pe, mult * local * pe
    else:   # DeepSpeed's mixed precision: 16-bit weights and gradients, 16 B of fp32 state a parameter
        from gpulab.predict.sharding import DS_STATE_BYTES
        shard = -(-local // dp)
        params = local * 2 if zero < 3 else shard * 2
        grads = local * 2 if zero < 2 else (shard * 2 if zero == 2 else 0)
        state = shard * DS_STATE_BYTES
    act_bytes = 4 if precision == "fp32" else 2
    sbh = s * b * h
    # Table 2's 10·sbh outside the tensor-parallel split: 8·sbh of 16-bit values and two 1-byte dropout masks
    linear = (8 * sbh + 24 * sbh // t) * act_bytes // 2 + (2 * sbh if m["p_hidden"] else 0)
    # 5·a·s²·b/t: the softmax output (16-bit), with attention dropout its 1-byte mask and the dropped copy
    as2b = a * s * s * b // t
    scores = 2 * as2b * act_bytes // 2 + ((as2b + 2 * as2b * act_bytes // 2) if m["p_attn"] else 0)
    per_layer_full = linear + scores
    if recompute == "none":
        acts, kept_scores = layers * per_layer_full, layers * scores
    elif recompute == "selective":
        acts, kept_scores = layers * linear, 0
    else:   # full: each layer's input kept, one layer recomputed at a time
        acts = int(F.checkpointed_activation_bytes(per_layer_full, layers, s * b * h * act_bytes))
        kept_scores = scores
    logits = s * b * (-(-m["vocab"] // t)) * (act_bytes + 4)
    return WhatIfFormula(model, s, b, recompute, precision, optimizer, zero, dp, tp, n, params, grads, state,
                         acts + logits, kept_scores, logits)


@dataclass
class WhatIfMeasured:
    """The measured side: the largest each category reached over the step's timeline, the peak of
    live tensors, the simulated allocator's reserved peak, how long it took, and its label."""
    settings: dict[str, Any]
    by_category: dict[str, int]
    peak_bytes: int
    reserved_bytes: int
    label: str
    seconds: float
    reused: bool = False
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_KERNELS: dict[tuple, str] = {}   # the attention kernels each setting's fake run chose, for its cached reruns


@functools.lru_cache(maxsize=8)
def _layers(model: str, dtype: str):
    import torch

    from gpulab.models import hf_configs
    from gpulab.predict.sharding import count_layers
    with torch.device("meta"):
        net = hf_configs.build_causal_lm(hf_configs.make_config(model, use_cache=False)).to(getattr(torch, dtype))
    return count_layers(net)


def whatif_measured(model: str = "hf:gpt2", seq_len: int = 1024, batch: int = 1, recompute: str = "none",
                    precision: str = "bf16", optimizer: str = "adamw", zero: int = 0, dp: int = 1, tp: int = 1,
                    card: str = "H100") -> WhatIfMeasured:
    """The same settings measured: a fake step (``predict.fake_step``), ZeRO applied to its timeline as
    ``gpulab.fit`` applies it, replayed through the simulated allocator (module docstring)."""
    check_whatif(model, seq_len, batch, recompute, precision, optimizer, zero, dp, tp)
    import torch

    from gpulab.allocator.simulator import CachingAllocator
    from gpulab.measure.engines import LABEL_FAKE_CUDA, LABEL_SIMULATED
    from gpulab.predict import run_cache
    from gpulab.predict import sharding as S
    from gpulab.measure.cuda_card import kernel_target
    from gpulab.predict.cards import card_target
    from gpulab.predict.fake_step import fake_step_timeline
    t0 = time.perf_counter()
    hits = run_cache.info()["hits"]
    dtype, amp = WHATIF_PRECISIONS[precision]
    with kernel_target(card_target(card)) as target:   # the card's kernels (its attention kernel, by capability)
        t, depth = fake_step_timeline(model, batch, seq_len=seq_len, optimizer=optimizer, dtype=dtype, amp=amp,
                                      checkpointing=False if recompute == "none" else recompute, tp=tp)
    key = (model, seq_len, batch, recompute, precision, optimizer, tp, card)
    if target.seen:   # a run made here: its attention kernels; a cached run's are those its first run saw
        _KERNELS[key] = target.note()
    label = f"{LABEL_FAKE_CUDA} ({card}{'; ' + depth if depth else ''}; {_KERNELS.get(key, target.note())})"
    notes = []
    if zero and dp > 1:
        sh = S.check_sharding(dp, f"zero{zero}", False, optimizer, getattr(torch, dtype))
        t = S.per_rank(t, sh, _layers(model, dtype), torch.empty((), dtype=getattr(torch, dtype)).element_size())
        label += f", ZeRO-{zero} over {dp} GPUs applied to its timeline as gpulab fit does"
        if zero == 3:
            notes.append("ZeRO-3 gathers the largest layer's 16-bit weights and gradients on every GPU: "
                         f"{format_bytes(2 * 2 * _layers(model, dtype).largest_layer)}, which the formula leaves out")
    reserved = CachingAllocator().replay(t.events, strict=False).peak_reserved
    cats = {c: max((row.get(c, 0) for row in t.series), default=0) for c in CATEGORIES}
    return WhatIfMeasured(dict(model=model, seq_len=seq_len, batch=batch, recompute=recompute, precision=precision,
                               optimizer=optimizer, zero=zero, dp=dp, tp=tp, card=card),
                          cats, t.peak_bytes, reserved, f"{label} + {LABEL_SIMULATED}",
                          time.perf_counter() - t0, run_cache.info()["hits"] > hits, notes)


def _error(formula: int, measured: int) -> str:
    if not measured:
        return "" if not formula else "—"
    return f"{100 * (formula - measured) / measured:+.0f}%"


_FUSED = re.compile(r"(flash|memory-efficient|cuDNN) attention")   # measure.cuda_card.BACKEND_TEXT's fused kernels


def explain(formula: WhatIfFormula, measured: WhatIfMeasured | None) -> list[str]:
    """Sentences for the gaps over 10% between the two sides, computed from both."""
    if measured is None:
        return []
    out = []
    acts = measured.by_category.get("activations", 0)
    if acts and abs(formula.activations - acts) > 0.1 * acts:
        if formula.scores_bytes and formula.activations > acts and _FUSED.search(measured.label):
            out.append(f"Activations: {format_bytes(formula.scores_bytes)} of the formula's are Korthikanti's "
                       "s×s attention tensors (the softmax's output, its dropout mask and the dropped probabilities), "
                       "which the fused attention kernel this card's run follows (named in its label) never stores: recompute <i>selective</i> shows the formula without them.")
        out.append(f"Activations: the formula holds the logits and their fp32 copy for the loss "
                   f"({format_bytes(formula.logits_bytes)}) with Korthikanti's tensors of a GPT-3 layer; what this "
                   "model's own layers save beyond or short of those is listed tensor by tensor by "
                   "<code>measured_layer_activations</code>.")
    state = measured.by_category.get("optimizer_state", 0)
    if state and abs(formula.optimizer_state - state) > 0.1 * state:
        out.append("Optimizer state: the formula counts the optimizer's states per parameter; the measured column "
                   "is the largest the category reached in the run.")
    if formula.tp > 1:
        out.append(f"Tensor parallel over {formula.tp}: the formula divides every parameter by {formula.tp}; "
                   "the run keeps the norms (and GPT-2's biases of row-split layers) whole on every GPU.")
    out.extend(measured.notes)
    return out


def compare_html(formula: WhatIfFormula, measured: WhatIfMeasured | None, pending: str = "") -> str:
    """The two sides as one table: formula, measured, error, per category and in all."""
    from gpulab.tables import html_table
    rows = []
    for c in CATEGORIES:
        f = getattr(formula, c)
        mv = measured.by_category.get(c, 0) if measured else None
        rows.append([c.replace("_", " "), format_bytes(f),
                     format_bytes(mv) if mv is not None else pending, _error(f, mv) if mv is not None else ""])
    mpeak = measured.peak_bytes if measured else None
    rows.append(["sum of the parts / peak of live tensors", format_bytes(formula.total),
                 format_bytes(mpeak) if measured else pending, _error(formula.total, mpeak) if measured else ""])
    if measured:
        rows.append(["reserved (simulated allocator)", "", format_bytes(measured.reserved_bytes), ""])
    n = formula.n_params
    count = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n:,}"
    head = (f"<b>{formula.model}</b>, {count} parameters; seq {formula.seq_len} × batch "
            f"{formula.batch}, {formula.precision}, {formula.optimizer}, recompute {formula.recompute}, "
            f"ZeRO-{formula.zero} over {formula.dp}, TP {formula.tp}: bytes per GPU")
    caption = formula.label + (f"; measured: {measured.label}" if measured else "")
    return head + html_table(["", "formula", "measured", "error"], rows, caption)
