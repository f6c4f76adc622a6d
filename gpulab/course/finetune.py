"""Lesson 11: "will it fine-tune on my card?" — one answer from a fake run of the real model.

A transformer preset (GPT-2, Llama-3-8B, Mistral-7B from ``gpulab.models.hf_configs``, or a custom
Llama-style size), a card, a sequence length and batch, a method (full fine-tuning, LoRA,
QLoRA), an optimizer, a precision and activation checkpointing: the model is built from its
config under fake tensors (no memory at any size), two training steps run on the fake engine
following CUDA's kernels, the timeline is replayed through the simulated caching allocator, and
an assumed CUDA context is added. The verdict is ``reserved + context <= card``, with the margin.

QLoRA's 4-bit base weights need bitsandbytes' CUDA kernels, so they are not run here: a LoRA run
with bf16 base weights is measured and the bytes of the weights 4-bit loading quantizes (the
Linear layers' weights, not the embeddings, norms or lm_head: ``course.lora.nf4_quantized``)
are replaced by the NF4 formula, labelled as such.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from gpulab.allocator.simulator import CachingAllocator
from gpulab.predict.cards import CUDA_CONTEXT_ASSUMED, CardBudget, parse_gpu
from gpulab.measure.engines import LABEL_FAKE_CUDA, LABEL_SIMULATED
from gpulab.models.hf_configs import build_causal_lm, hf_entry, make_config
from gpulab.models.registry import build_skeleton
from gpulab.predict.step import step
from gpulab.units import format_bytes
from gpulab.course.lora import nf4_quantized
from gpulab.models.lora import wrap_lora

__all__ = [
    "FinetuneAnswer", "LABEL_QLORA", "LORA_TARGETS", "METHODS", "PRECISIONS", "PRESETS", "Progress",
    "custom_config", "finetune_check", "model_builder", "preset_config"
]

PRESETS = ("gpt2", "llama-3-8b", "mistral-7b", "custom")
METHODS = ("full", "lora", "qlora")
PRECISIONS = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None), "amp-bf16": (torch.float32, "bf16")}
LORA_TARGETS = ("q_proj", "v_proj", "c_attn")   # Llama/Mistral's projections; GPT-2's fused q/k/v
LABEL_QLORA = ("fake run (LoRA on bf16 base weights) with the quantized Linear weights' bytes replaced by the "
               "NF4 formula: bitsandbytes' 4-bit kernels need CUDA")

Progress = Callable[[float, str], None] | None


def custom_config(hidden: int = 2048, layers: int = 16):
    """A Llama-style config of a chosen size: 128-wide heads, 4 query heads per KV head, a SwiGLU
    width of about 3.5 × hidden (rounded up to 256), a 32,000-token vocabulary."""
    import transformers
    if hidden % 128 or hidden < 128 or layers < 1:
        raise ValueError(f"a custom size needs a hidden size that is a multiple of 128 and at least 1 layer, "
                         f"got hidden {hidden}, layers {layers}")
    heads = hidden // 128
    return transformers.LlamaConfig(vocab_size=32000, hidden_size=hidden, num_hidden_layers=layers,
                                    num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                                    intermediate_size=-(-int(3.5 * hidden) // 256) * 256,
                                    max_position_embeddings=8192, use_cache=False)


def preset_config(preset: str, hidden: int = 2048, layers: int = 16):
    if preset == "custom":
        return custom_config(hidden, layers)
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid: {', '.join(PRESETS)}")
    return make_config(hf_entry(preset), use_cache=False)   # training without the KV cache, as the recipes run


def model_builder(config, method: str, dtype: torch.dtype, checkpointing: bool, rank: int = 16):
    """A zero-argument function that builds the model to fine-tune (called under fake tensors)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; valid: {', '.join(METHODS)}")

    def build():
        model = build_causal_lm(config, dtype)
        if checkpointing:   # transformers 5.x renamed it; the old name warns that it will go
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if method in ("lora", "qlora"):
            names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
            model = wrap_lora(model, rank, [t for t in LORA_TARGETS if t in names], task_type="CAUSAL_LM")
        return model
    build.__name__ = f"{getattr(config, 'model_type', 'model')}-{method}"
    return build


@dataclass
class FinetuneAnswer(CardBudget):
    preset: str
    card: str
    capacity_bytes: int
    seq_len: int
    batch: int
    method: str
    optimizer: str
    precision: str
    checkpointing: bool
    n_params: int
    trainable_params: int
    peak_by_category: dict[str, int]
    peak_bytes: int
    reserved_bytes: int
    context_bytes: int
    label: str
    seconds: float

    @property
    def fits(self) -> bool:
        return self.margin_bytes >= 0

    def as_dict(self) -> dict[str, Any]:
        from dataclasses import asdict
        d = asdict(self)
        d.update(needed_bytes=self.needed_bytes, margin_bytes=self.margin_bytes, fits=self.fits)
        return d

    def _repr_html_(self) -> str:
        from gpulab.views import html_table
        verdict = (f"<b style='color:#2a7'>fits</b>, {format_bytes(self.margin_bytes)} to spare" if self.fits else
                   f"<b style='color:#c33'>does not fit</b>: short by {format_bytes(-self.margin_bytes)}")
        rows = [[k, format_bytes(v)] for k, v in self.peak_by_category.items() if v]
        rows += [["live tensors (peak)", format_bytes(self.peak_bytes)],
                 [f"reserved ({LABEL_SIMULATED})", format_bytes(self.reserved_bytes)],
                 ["CUDA context (assumption)", format_bytes(self.context_bytes)],
                 ["needed", format_bytes(self.needed_bytes)], ["card", format_bytes(self.capacity_bytes)]]
        head = (f"<b>{self.preset}</b> ({self.n_params / 1e9:.2f} B parameters, {self.trainable_params:,} trained), "
                f"{self.method}, {self.precision}, {self.optimizer}, seq {self.seq_len} × batch {self.batch}"
                f"{', checkpointing' if self.checkpointing else ''} on <b>{self.card}</b>: {verdict}")
        return head + html_table(["", "bytes"], rows, self.label)


def finetune_check(preset: str = "llama-3-8b", card: str = "H100", seq_len: int = 2048, batch: int = 1,
                   method: str = "lora", optimizer: str = "adamw", precision: str = "bf16",
                   checkpointing: bool = False, hidden: int = 2048, layers: int = 16,
                   context_bytes: int = CUDA_CONTEXT_ASSUMED, progress: Progress = None) -> FinetuneAnswer:
    """Will this fine-tuning run fit the card? (module docstring)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}")
    c = parse_gpu(card)
    dtype, amp = PRECISIONS[precision]
    config = preset_config(preset, hidden, layers)
    if progress:
        progress(0.1, "building the model under fake tensors and running two steps")
    run_dtype = torch.bfloat16 if method == "qlora" and dtype == torch.float32 else dtype
    builder = model_builder(config, method, run_dtype, checkpointing)
    result = step(builder, batch=batch, seq_len=seq_len, optimizer=optimizer, engine="fake", dtype=run_dtype, amp=amp)
    if progress:
        progress(0.8, "replaying the timeline through the simulated allocator")
    tracking = result.measurement.tracking
    by_cat = dict(result.peak_by_category)
    peak = result.peak_bytes
    skeleton = build_skeleton(builder)   # the counts, on the meta device
    n_params = sum(p.numel() for p in skeleton.parameters())
    trainable = sum(p.numel() for p in skeleton.parameters() if p.requires_grad)
    label = LABEL_FAKE_CUDA + " + " + LABEL_SIMULATED
    reserved = CachingAllocator().replay(tracking.events, strict=False).peak_reserved
    if method == "qlora":   # the Linear weights 4-bit loading quantizes (not embeddings, norms, lm_head)
        quantized, nf4_bytes, _ = nf4_quantized(build_skeleton(model_builder(config, "full", run_dtype, False)))
        saved = quantized * run_dtype.itemsize - int(nf4_bytes)
        by_cat["parameters"] -= saved
        peak -= saved
        reserved -= saved
        label = LABEL_QLORA
    if progress:
        progress(1.0, "done")
    return FinetuneAnswer(preset, c.name, c.memory_bytes, seq_len, batch, method, optimizer, precision,
                          checkpointing, n_params, trainable, by_cat, peak, reserved, context_bytes, label,
                          result.measurement.seconds)
