"""Lesson 11: "will it fine-tune on my card?" — one answer from a fake run of the real model.

A transformer preset (GPT-2, Llama-3-8B, Mistral-7B from ``gpulab.models.hf_configs``, or a custom
Llama-style size), a card, a sequence length and batch, a method (full fine-tuning, LoRA,
QLoRA), an optimizer, a precision and an activation checkpointing policy: gpulab's one training loop
builds the model from its config under fake tensors (no memory at any size) as the recipe says
(``models.adapt``: peft's LoRA adapters; QLoRA's base Linear weights stored as bitsandbytes stores
NF4, ``models.quantized``; transformers' own checkpointing) and runs two training steps on the fake
engine following the card's CUDA kernels, made as ``gpulab.fit`` makes its runs
(``predict.fake_step``: laid out from a few layers where the layers are alike, the same timeline to the
byte, and kept for the process); the timeline is replayed through the simulated caching
allocator, and an assumed CUDA context is added. The verdict is ``reserved + context <= card``
(the total CUDA reports for the card where it is known), with the margin.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch

from gpulab.allocator.simulator import CachingAllocator
from gpulab.predict.cards import CUDA_CONTEXT_ASSUMED, CardBudget, card_target, parse_gpu
from gpulab.measure.cuda_card import kernel_target
from gpulab.measure.engines import LABEL_SIMULATED, label_fake_cuda
from gpulab.models.adapt import check_checkpointing
from gpulab.models.hf_configs import hf_entry, make_config
from gpulab.models.workload import resolve_workload
from gpulab.predict.breakdown import validate_batch
from gpulab.predict.fake_step import fake_step_timeline
from gpulab.training.loop import recipe_workload, user_recipe
from gpulab.units import format_bytes

__all__ = [
    "CHECKPOINTING_CHOICES", "FinetuneAnswer", "LORA_RANK", "METHODS", "PRECISIONS", "PRESETS",
    "Progress", "custom_config", "finetune_check", "preset_config", "preset_positions", "recipe_options"
]

PRESETS = ("gpt2", "llama-3-8b", "mistral-7b", "custom")
METHODS = ("full", "lora", "qlora")
PRECISIONS = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None), "amp-bf16": (torch.float32, "bf16")}
LORA_RANK = 16
CHECKPOINTING_CHOICES = ("none", "full", "selective", "every-2")

Progress = Callable[[float, str], None] | None
KEPT_ANSWERS = 32   # measured steps kept for the process: the card decides only the verdict
_MEASURED: "OrderedDict[tuple, tuple]" = OrderedDict()


def _parameter_counts(preset: str, size: tuple[int, int] | None, config: Any, seq_len: int, method: str,
                      optimizer: str, options: dict[str, Any], dtype: torch.dtype) -> tuple[int, int]:
    """(parameters, trainable) of the adapted model, from the same model without its quantization (which
    packs two NF4 values a byte), built on the meta device. Kept per model, method, optimizer and dtype:
    the sequence length, batch, checkpointing and card change the inputs and the step, never the
    parameters, so a move of those sliders does not build the model's skeleton again."""
    key = (preset, size, method, optimizer, str(dtype))
    if key not in _COUNTS:
        plain = recipe_workload(resolve_workload(config, seq_len=seq_len),
                                user_recipe(optimizer, **{**options, "quantize": None, "checkpointing": False}))
        _COUNTS[key] = plain.parameter_counts(dtype)
    return _COUNTS[key]


_COUNTS: dict[tuple, tuple[int, int]] = {}


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


def preset_positions(preset: str) -> int | None:
    """The positions ``preset``'s config takes (``max_position_embeddings`` or ``n_positions``; the custom
    model's are its config's), for a control that offers only lengths the model takes."""
    from gpulab.models.hf_configs import config_summary
    return config_summary(preset_config(preset))["max_positions"]


def preset_config(preset: str, hidden: int = 2048, layers: int = 16):
    if preset == "custom":
        return custom_config(hidden, layers)
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid: {', '.join(PRESETS)}")
    return make_config(hf_entry(preset), use_cache=False)   # training without the KV cache, as the recipes run


def recipe_options(method: str, checkpointing: bool | str) -> dict[str, Any]:
    """The recipe options of ``gpulab.step`` for ``method``: LoRA of rank ``LORA_RANK`` on the layers
    peft adapts by default for the model type (``models.lora.default_targets``: Llama's and
    Mistral's q_proj and v_proj, GPT-2's fused c_attn), QLoRA as that on an NF4 base."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; valid: {', '.join(METHODS)}")
    policy = check_checkpointing(False if checkpointing == "none" else checkpointing)
    if method == "full":
        return {"checkpointing": policy}
    return {"checkpointing": policy, "lora": LORA_RANK, "quantize": "nf4" if method == "qlora" else None}


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
    checkpointing: bool | str         # False or the policy
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
                f"{f', {self.checkpointing} checkpointing' if self.checkpointing else ''} on <b>{self.card}</b>: "
                f"{verdict}")
        return head + html_table(["", "bytes"], rows, self.label)


def finetune_check(preset: str = "llama-3-8b", card: str = "H100", seq_len: int = 2048, batch: int = 1,
                   method: str = "lora", optimizer: str = "adamw", precision: str = "bf16",
                   checkpointing: bool | str = False, hidden: int = 2048, layers: int = 16,
                   context_bytes: int = CUDA_CONTEXT_ASSUMED, progress: Progress = None) -> FinetuneAnswer:
    """Will this fine-tuning run fit the card? (module docstring). ``checkpointing``: False or
    "none", True or "full", "selective", "every-K" (``models.adapt``)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}")
    c = parse_gpu(card)
    dtype, amp = PRECISIONS[precision]
    config = preset_config(preset, hidden, layers)
    options = recipe_options(method, checkpointing)
    if progress:
        progress(0.1, "building the model under fake tensors and running two steps")
    # QLoRA computes in bf16 on its 4-bit base (bnb_4bit_compute_dtype): an fp32 request runs the adapters in bf16
    run_dtype = torch.bfloat16 if method == "qlora" and dtype == torch.float32 else dtype
    validate_batch(batch)
    size = (hidden, layers) if preset == "custom" else None   # the custom sliders shape only the custom model
    # the card's kernels decide the tensors too (bf16 attention on a T4, sm75, is the math kernel's
    # float32 weights, not a fused kernel's): the runs follow them, as gpulab.fit's do
    target = card_target(c)
    key = (preset, size, seq_len, batch, method, optimizer, precision, options["checkpointing"],
           (target.name, target.capability) if target else None)
    if key in _MEASURED:
        _MEASURED.move_to_end(key)
        measured = _MEASURED[key]
    else:
        t0 = time.perf_counter()
        with kernel_target(target) as followed:
            tracking, depth = fake_step_timeline(config, batch, seq_len=seq_len, optimizer=optimizer,
                                                 dtype=run_dtype, amp=amp, **options)
        if progress:
            progress(0.8, "replaying the timeline through the simulated allocator")
        n_params, trainable = _parameter_counts(preset, size, config, seq_len, method, optimizer, options, run_dtype)
        reserved = CachingAllocator().replay_peak(tracking.events)[0]   # replay(strict=False)'s peak, no series
        fake = label_fake_cuda(followed)
        label = f"{fake} ({depth}) + {LABEL_SIMULATED}" if depth else f"{fake} + {LABEL_SIMULATED}"
        measured = (n_params, trainable, dict(tracking.peak_by_category), tracking.peak_bytes, reserved, label,
                    time.perf_counter() - t0)
        _MEASURED[key] = measured
        while len(_MEASURED) > KEPT_ANSWERS:
            _MEASURED.popitem(last=False)
    n_params, trainable, by_category, peak, reserved, label, seconds = measured
    if progress:
        progress(1.0, "done")
    return FinetuneAnswer(preset, c.name, c.reported_total_bytes, seq_len, batch, method, optimizer, precision,
                          options["checkpointing"], n_params, trainable, dict(by_category), peak, reserved,
                          context_bytes, label, seconds)
