"""Lesson 11's "will it fine-tune on my card?" panel: a transformer preset, a card, the sequence
length and batch, the method, optimizer, precision and checkpointing policy; the fake engine runs the
real model at full size in seconds (progress shown), the simulator adds the allocator."""
from __future__ import annotations

from typing import Any

from gpulab.predict.cards import card_names
from gpulab.course.finetune import (CHECKPOINTING_CHOICES, METHODS, PRECISIONS, PRESETS, FinetuneAnswer, finetune_check,
                                    preset_positions)
from gpulab.training.optimizers import OPTIMIZERS
from gpulab.widgets.base import Panel, dropdown, fit_lengths, slider, with_value

__all__ = ["compute_finetune", "finetune_panel", "render_finetune"]

SEQ_SHORTEST, SEQ_LONGEST = 128, 8192   # the sequence slider's range, where the preset's positions allow


def compute_finetune(preset: str, card: str, seq_len: int, batch: int, method: str, optimizer: str,
                     precision: str, checkpointing: str, hidden: int, layers: int,
                     progress=None) -> FinetuneAnswer:
    return finetune_check(preset, card, seq_len, batch, method, optimizer, precision, checkpointing,
                          hidden=hidden, layers=layers, progress=progress)


def render_finetune(answer: FinetuneAnswer) -> list[Any]:
    return [answer]


def finetune_panel(preset: str = "llama-3-8b", card: str = "RTX 4090", seq_len: int = 2048, batch: int = 1,
                   method: str = "lora", optimizer: str = "adamw", precision: str = "bf16",
                   checkpointing: str = "none", hidden: int = 2048, layers: int = 16) -> Panel:
    controls = {
        "preset": dropdown("model", PRESETS, preset),
        "card": dropdown("card", card_names(), card),
        "seq_len": slider("sequence length", SEQ_SHORTEST, SEQ_SHORTEST, SEQ_LONGEST, log=True),
        "batch": slider("batch", batch, 1, 64, log=True),
        "method": dropdown("method", METHODS, method),
        "optimizer": dropdown("optimizer", OPTIMIZERS, optimizer),
        "precision": dropdown("precision", list(PRECISIONS), precision),
        "checkpointing": dropdown("checkpointing", CHECKPOINTING_CHOICES, checkpointing),
        "hidden": slider("custom: hidden size", hidden, 256, 8192, step=256),
        "layers": slider("custom: layers", layers, 1, 80),
    }
    # the sequence slider offers only what the preset's positions take (GPT-2: 1,024), before the panel's
    # own observer, so that a preset change never asks for a length the model refuses
    fit_lengths(controls["seq_len"], preset_positions(preset), shortest=SEQ_SHORTEST, longest=SEQ_LONGEST)
    with_value("sequence length", controls["seq_len"], seq_len)
    controls["preset"].observe(lambda change: fit_lengths(controls["seq_len"], preset_positions(change["new"]),
                                                          shortest=SEQ_SHORTEST, longest=SEQ_LONGEST), names="value")
    return Panel("Will it fine-tune on my card?", controls, compute_finetune, render_finetune,
                 description="The model is built from its config under fake tensors (no memory at any size); two "
                             "training steps of a few of its layers run following CUDA's kernels and are laid out "
                             "to the model's depth (where its layers are alike); the simulated caching allocator "
                             "and an assumed CUDA context are added. The custom sliders apply to the <i>custom</i> model.",
                 real_run="fake-tensor runs (of a few layers, laid out to the model's depth, where its layers are "
                          "alike), then the allocator replayed over the whole step: seconds for a setting not met "
                          "before, at once for one met before")
