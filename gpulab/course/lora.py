"""Lesson 11, part 3: fine-tuning a few weights (LoRA, QLoRA).

* ``lora_step``: a training step of a model wrapped by ``peft``'s LoRA next to a full fine-tune
  of the same model, by category; the adapter size from ``gpulab.models.lora.adapter_params``;
* ``qlora_formula``: the same on paper with the base in NF4 (bitsandbytes' kernels need CUDA).

Results are dataclasses with ``as_dict`` and ``_repr_html_``; nothing here prints.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from gpulab import formulas as F
from gpulab.models import hf_configs
from gpulab.measure.engines import LABEL_FORMULA, Measured, Measurement
from gpulab.predict.step import StepResult
from gpulab.predict.breakdown import validate_batch
from gpulab.categories import CATEGORIES, Category
from gpulab.predict.step import step as gpulab_step
from gpulab.units import dtype_name, format_bytes, parse_dtype
from gpulab.views import html_table
from gpulab.course.inplace import validate_positive

from gpulab.models.lora import (DEFAULT_TARGETS, adapter_params, check_targets, linear_shape, targeted_linears,
                                 wrap_lora)
from gpulab.course.serving import _param_counts
from gpulab.models.hf_configs import config_and_name

__all__ = [
    "CategoryRow", "LABEL_QLORA", "LoRAComparison", "QLoRAFormula", "adapter_params_formula", "category_highs",
    "lora_model_builder", "lora_step", "nf4_quantized", "peft_on_fake", "qlora_formula", "trainable_params",
    "wrap_lora",
]

LABEL_QLORA = "formula (bitsandbytes' 4-bit kernels need CUDA)"
adapter_params_formula = adapter_params   # the name lesson 11 uses


def lora_model_builder(name: Any = "tiny-llama", rank: int = 8, targets: Sequence[str] = DEFAULT_TARGETS,
                       dtype: torch.dtype | None = None) -> Callable[[], nn.Module]:
    """A zero-argument function that builds the base model (``hf_configs.build_causal_lm``) and
    wraps it with ``peft.get_peft_model(model, LoraConfig(r=rank, lora_alpha=2*rank,
    target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM"))`` (with ``fan_in_fan_out``
    for GPT-2's ``Conv1D``): what ``gpulab.step`` calls on the run's device.

    On the fake engine it does *not* build under a plain ``FakeTensorMode`` (``peft_on_fake``):
    peft moves each new adapter to its base layer's device and dtype with ``Module.to``
    (peft/tuners/tuners_utils.py ``_move_adapter_to_device_of_base_layer``); ``Module._apply``
    replaces a ``FakeTensor`` parameter with ``torch.utils.swap_tensors`` (torch/nn/modules/module.py),
    which refuses a tensor that has weak references, and fake tensors have them. gpulab's
    ``models.build_in_place`` then builds it as a skeleton on the meta device (peft skips moving
    adapters that are on meta) and materializes that as fake tensors: same shapes, dtypes and
    ``requires_grad``.

    peft reads ``model.is_gradient_checkpointing`` (peft/peft_model.py, ``PeftModel.__init__``),
    which transformers 5.x deprecates with a FutureWarning; that one warning is silenced here."""
    validate_positive(rank=rank)
    targets = check_targets(targets)
    config, shown = config_and_name(name)

    def build() -> nn.Module:
        return wrap_lora(hf_configs.build_causal_lm(config, dtype), rank, targets, task_type="CAUSAL_LM")
    build.__name__ = f"lora_r{rank}_{_slug(shown)}"
    return build


def peft_on_fake(name: Any = "tiny-llama", rank: int = 8, targets: Sequence[str] = DEFAULT_TARGETS) -> dict[str, Any]:
    """Does peft's ``get_peft_model`` build under fake tensors? ``native``: called directly inside
    a ``FakeTensorMode`` with its dispatch cache off (the error it raised, if any); ``via_skeleton``: through
    ``gpulab.models.registry.build_in_place`` as the fake engine calls it (meta skeleton, then fake
    tensors), with whether every parameter came out a ``FakeTensor``. See ``lora_model_builder``."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from gpulab.models.registry import build_in_place

    build = lora_model_builder(name, rank, targets)
    error = None
    try:
        mode = FakeTensorMode()
        # torch's dispatch cache is shared by every FakeTensorMode: an op answered from it makes its
        # fake output without the converter's memo (no weak reference, so swap_tensors succeeds),
        # and whether it is there depends on what ran before in the process. Off, the answer is
        # the one a fresh process gives on every torch (torch 2.11 and 2.15 alike).
        mode.cache_enabled = False
        with mode:
            build()
    except Exception as exc:   # noqa: BLE001 - reported, not hidden
        cause = f" ({exc.__cause__})" if exc.__cause__ else ""
        error = f"{type(exc).__name__}: {exc}{cause}"
    with FakeTensorMode():
        model = build_in_place(build, "cpu")
        all_fake = all(isinstance(p, FakeTensor) for p in model.parameters())
        trainable = trainable_params(model)
    return {"native": error is None, "native_error": error, "via_skeleton": all_fake,
            "trainable_params": trainable}


def _slug(text: str) -> str:
    return re.sub(r"\W+", "_", text).strip("_")


def trainable_params(model: nn.Module) -> int:
    """``sum(p.numel() for p in model.parameters() if p.requires_grad)``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def category_highs(result: StepResult) -> dict[str, int]:
    """Each category's highest live bytes over the whole run, unrounded (numel × element size,
    what formulas count; a fake CUDA-target run's 512-byte rounding undone). The categories peak
    at different moments (gradients and optimizer state after ``step()``, activations at the end
    of the forward), which one overall-peak split would hide."""
    t = result.measurement.tracking
    if t is None:
        return {}
    if t.rounded:
        t = type(t).build(t.records, t.events, t.device, rounded=False)
    return {c.value: max((s[c.value] for s in t.series), default=0) for c in CATEGORIES}


@dataclass(frozen=True)
class CategoryRow:
    category: str
    lora: int
    full: int
    lora_formula: int | None
    full_formula: int | None

    def as_dict(self) -> dict[str, Any]:
        return {"category": self.category, "lora": self.lora, "full": self.full,
                "lora_formula": self.lora_formula, "full_formula": self.full_formula}


@dataclass
class LoRAComparison(Measured):
    """``lora_step``: LoRA and a full fine-tune of the same model, by category."""
    model: str
    rank: int
    targets: tuple[str, ...]
    batch: int
    seq_len: int
    optimizer: str
    base_params: int
    base_param_tensors: int
    adapter_params: int            # formula: sum of lora_params over the targeted layers
    adapter_tensors: int           # lora_A and lora_B per targeted layer
    trainable_params_peft: int     # measured: requires_grad parameters of the peft model
    lora: StepResult
    full: StepResult
    rows: list[CategoryRow]
    formula_label: str = LABEL_FORMULA

    @property
    def measurement(self) -> Measurement:
        """The run that speaks for the labels: the LoRA run."""
        return self.lora.measurement

    def row(self, category: str) -> CategoryRow:
        return next(r for r in self.rows if r.category == category)

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "rank": self.rank, "targets": list(self.targets), "batch": self.batch,
                "seq_len": self.seq_len, "optimizer": self.optimizer, "engine": self.engine, "label": self.label,
                "formula_label": self.formula_label, "base_params": self.base_params,
                "adapter_params": self.adapter_params, "adapter_tensors": self.adapter_tensors,
                "trainable_params_peft": self.trainable_params_peft,
                "rows": [r.as_dict() for r in self.rows],
                "lora_peak_bytes": self.lora.peak_bytes, "full_peak_bytes": self.full.peak_bytes}

    def __repr__(self) -> str:
        return (f"LoRAComparison({self.model}, rank {self.rank}, {self.adapter_params:,} adapter params; "
                f"peak {self.lora.peak_bytes:,} B vs full {self.full.peak_bytes:,} B)")

    def _repr_html_(self) -> str:
        f = lambda v: "—" if v is None else format_bytes(v)
        rows = [[r.category, format_bytes(r.lora), f(r.lora_formula), format_bytes(r.full), f(r.full_formula)]
                for r in self.rows]
        rows.append(["peak of the run", format_bytes(self.lora.peak_bytes), "—", format_bytes(self.full.peak_bytes),
                     "—"])
        return html_table(["category (highest over the run)", "LoRA", "formula", "full fine-tune", "formula"], rows,
                          f"{self.model}, LoRA rank {self.rank} on {', '.join(self.targets)} "
                          f"({self.adapter_params:,} trainable of {self.base_params + self.adapter_params:,}), "
                          f"batch {self.batch} × {self.seq_len} tokens, {self.optimizer} — measured: {self.label}; "
                          f"formula: {self.formula_label}")


def lora_step(name: Any = "tiny-llama", rank: int = 8, targets: Sequence[str] = DEFAULT_TARGETS, batch: int = 2,
              seq_len: int = 32, engine: str = "cpu", optimizer: str = "adam") -> LoRAComparison:
    """A training step (``gpulab.step``, the steady state: two steps) of the model wrapped by
    LoRA (``lora_model_builder``) next to a full fine-tune of the same model, float32, by
    category (``category_highs``), with the formulas:

    * parameters: LoRA keeps every frozen base weight *and* adds the adapters: (base + adapter
      params) × 4 B; full: base × 4 B;
    * gradients: only trainable parameters get one: adapter params × 4 B (full: base × 4 B);
    * optimizer state: ``formulas.optimizer_state_bytes`` of the trainable bytes (Adam: 8 B per
      parameter, plus a 4-byte step counter per tensor on the cpu engine; on the fake CUDA target
      those live in host memory and are not counted);
    * activations: measured only. They remain, smaller: a frozen Linear does not save its input,
      since autograd saves ``mm``'s ``self`` only to compute the weight's gradient
      (tools/autograd/derivatives.yaml, ``mm``: ``mat2: mm_mat2_backward(grad, self, ...)``; the
      generated ``MmBackward0`` has ``_saved_self`` None when the weight needs no grad).

    Works on the cpu and fake engines (on the fake engine through gpulab's meta-skeleton
    fallback: ``lora_model_builder``, ``peft_on_fake``)."""
    validate_positive(rank=rank)
    targets = check_targets(targets)
    validate_batch(batch)
    config, shown = config_and_name(name)
    base_params, base_tensors = _param_counts(name)
    layers = targeted_linears(config, targets)
    adapter = F.lora_trainable_params([(i, o) for _, i, o in layers], rank)
    adapter_tensors = 2 * len(layers)
    builder = lora_model_builder(name, rank, targets)
    with torch.device("meta"):
        peft_count = trainable_params(builder())

    def full_model() -> nn.Module:
        return hf_configs.build_causal_lm(config)
    full_model.__name__ = f"full_{_slug(shown)}"

    lora = gpulab_step(builder, batch=batch, seq_len=seq_len, engine=engine, optimizer=optimizer)
    full = gpulab_step(full_model, batch=batch, seq_len=seq_len, engine=engine, optimizer=optimizer)
    counters = lora.measurement.kernels == "cpu"
    elem = 4   # float32: gpulab.step's default dtype
    formulas = {
        Category.PARAMETERS.value: ((base_params + adapter) * elem, base_params * elem),
        Category.GRADIENTS.value: (adapter * elem, base_params * elem),
        Category.OPTIMIZER_STATE.value: (
            F.optimizer_state_bytes(adapter * elem, adapter_tensors, optimizer, counters),
            F.optimizer_state_bytes(base_params * elem, base_tensors, optimizer, counters)),
        # token ids, the same tensor passed as the labels
        Category.INPUTS.value: (F.tensor_bytes((batch, seq_len), "int64"),) * 2,
    }
    lh, fh = category_highs(lora), category_highs(full)
    rows = [CategoryRow(c.value, lh.get(c.value, 0), fh.get(c.value, 0), *formulas.get(c.value, (None, None)))
            for c in CATEGORIES]
    return LoRAComparison(shown, rank, targets, batch, seq_len, str(optimizer).lower(), base_params, base_tensors,
                          adapter, adapter_tensors, peft_count, lora, full, rows)


# --- QLoRA, on paper -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class QLoRAFormula:
    """Model state of QLoRA fine-tuning (``qlora_formula``): no activations."""
    model: str
    rank: int
    targets: tuple[str, ...]
    base_params: int
    quantized_params: int       # in the Linear layers bitsandbytes converts to 4 bits
    kept_params: int            # embeddings, norms, lm_head: kept in ``base_dtype``
    adapter_params: int
    base_dtype: str
    adapter_dtype: str
    optimizer: str
    quantized_bytes: float      # NF4 with double quantization (formulas.nf4_weight_bytes, per tensor)
    kept_bytes: int
    adapter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    plain_lora_base_bytes: int  # the same base unquantized, every weight in ``base_dtype``
    label: str = LABEL_QLORA

    @property
    def total_bytes(self) -> float:
        return self.quantized_bytes + self.kept_bytes + self.adapter_bytes + self.gradient_bytes + self.optimizer_bytes

    @property
    def plain_lora_total_bytes(self) -> int:
        return self.plain_lora_base_bytes + self.adapter_bytes + self.gradient_bytes + self.optimizer_bytes

    def rows(self) -> list[tuple[str, float]]:
        return [(f"base Linear weights in NF4 ({self.quantized_params:,} params)", self.quantized_bytes),
                (f"other base weights in {self.base_dtype} ({self.kept_params:,} params)", self.kept_bytes),
                (f"adapters in {self.adapter_dtype} ({self.adapter_params:,} params)", self.adapter_bytes),
                ("adapter gradients", self.gradient_bytes),
                (f"{self.optimizer} state (adapters only)", self.optimizer_bytes),
                ("total (model state, no activations)", self.total_bytes),
                (f"the same LoRA on a {self.base_dtype} base", self.plain_lora_total_bytes)]

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "rank": self.rank, "targets": list(self.targets),
                "base_params": self.base_params, "quantized_params": self.quantized_params,
                "kept_params": self.kept_params, "adapter_params": self.adapter_params,
                "base_dtype": self.base_dtype, "adapter_dtype": self.adapter_dtype, "optimizer": self.optimizer,
                "quantized_bytes": self.quantized_bytes, "kept_bytes": self.kept_bytes,
                "adapter_bytes": self.adapter_bytes, "gradient_bytes": self.gradient_bytes,
                "optimizer_bytes": self.optimizer_bytes, "total_bytes": self.total_bytes,
                "plain_lora_base_bytes": self.plain_lora_base_bytes,
                "plain_lora_total_bytes": self.plain_lora_total_bytes, "label": self.label}

    def __repr__(self) -> str:
        return f"QLoRAFormula({self.model}, rank {self.rank}: {self.total_bytes:,.0f} B)"

    def _repr_html_(self) -> str:
        return html_table(["", "bytes"], [[w, format_bytes(b)] for w, b in self.rows()],
                          f"{self.model}, QLoRA rank {self.rank} on {', '.join(self.targets)} — {self.label}")


def nf4_quantized(model: nn.Module) -> tuple[int, float, set[int]]:
    """What loading ``model`` in 4 bits quantizes: (weights quantized, their NF4 bytes, the ids of
    those weight tensors). Every ``nn.Linear`` / ``Conv1D`` weight except the output embedding
    (lm_head) and tied weights (transformers/quantizers/base.py ``get_keys_to_not_convert``), tensor
    by tensor (``formulas.nf4_weight_bytes``: blocks do not span tensors)."""
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = getattr(model, "all_tied_weights_keys", {}) or {}
    skip = {k.removesuffix(".weight") for k in [*tied.keys(), *tied.values()]}
    quantized, quantized_bytes, ids = 0, 0.0, set()
    for n, m in model.named_modules():
        if linear_shape(m) is not None and m is not out_emb and n not in skip:
            quantized += m.weight.numel()
            quantized_bytes += F.nf4_weight_bytes(m.weight.numel())
            ids.add(id(m.weight))
    return quantized, quantized_bytes, ids


def qlora_formula(name: Any = "llama-3-8b", rank: int = 8, targets: Sequence[str] = DEFAULT_TARGETS,
                  base_dtype: str | torch.dtype = "bfloat16", adapter_dtype: str | torch.dtype = "float32",
                  optimizer: str = "adam") -> QLoRAFormula:
    """QLoRA's model state on paper (Dettmers et al., "QLoRA: Efficient Finetuning of Quantized
    LLMs", 2023, arXiv 2305.14314); bitsandbytes' 4-bit kernels need CUDA, so nothing here runs.

    * Which weights become 4-bit: every linear layer (``linear_shape``: ``nn.Linear`` and
      ``Conv1D``) except the output embedding (lm_head) and
      tied weights (transformers/quantizers/base.py ``get_keys_to_not_convert``; the conversion
      in transformers/integrations/bitsandbytes.py makes ``bnb.nn.Linear4bit`` of the others).
      Each is ``formulas.nf4_weight_bytes`` (NF4, block 64, double quantization), tensor by
      tensor since blocks do not span tensors; biases, embeddings, norms and lm_head stay in
      ``base_dtype``.
    * Adapters: float32 by default, as peft makes them (peft/tuners/tuners_utils.py
      ``cast_adapter_dtype``: with ``autocast_adapter_dtype=True``, the default of
      ``get_peft_model``, float16 and bfloat16 adapter weights are upcast to float32).
    * Gradients: one per adapter parameter, in the adapters' dtype. Optimizer state:
      ``formulas.optimizer_state_bytes`` of the adapter bytes, without step counters (on a GPU
      they are host memory).

    NB: the NF4 figure is an average over whole blocks (a float); activations, the CUDA context
    and bitsandbytes' dequantization buffers are not counted."""
    validate_positive(rank=rank)
    targets = check_targets(targets)
    config, shown = config_and_name(name)
    bd, ad = parse_dtype(base_dtype), parse_dtype(adapter_dtype)
    with torch.device("meta"):
        model = hf_configs.build_causal_lm(config)
    quantized, quantized_bytes, linear_weights = nf4_quantized(model)
    base = sum(p.numel() for p in model.parameters())
    kept = sum(p.numel() for p in model.parameters() if id(p) not in linear_weights)
    layers = targeted_linears(config, targets)
    adapter = F.lora_trainable_params([(i, o) for _, i, o in layers], rank)
    adapter_bytes = adapter * ad.itemsize
    opt = F.optimizer_state_bytes(adapter_bytes, 2 * len(layers), optimizer, count_step_counters=False)
    return QLoRAFormula(shown, rank, targets, base, quantized, kept, adapter, dtype_name(bd), dtype_name(ad),
                        str(optimizer).lower(), quantized_bytes, kept * bd.itemsize, adapter_bytes, adapter_bytes,
                        opt, base * bd.itemsize)


