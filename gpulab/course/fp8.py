"""Lesson 08 (optional section): FP8 training as torchao does it, measured beside bf16.

``fp8_comparison(model, ...)`` runs the same bf16 training step three times on the fake engine
(CUDA's kernels): plain bf16, then torchao's float8 training with "tensorwise" and with "rowwise"
scaling (``gpulab.step(fp8=...)``, ``training.fp8``). Each run's peak by category sits beside what
the float8 layers made (``training.fp8.fp8_added``: the float8 casts, their scales, and the fp32
work that computes them), so the lesson can show where FP8's bytes go and why its peak can be
*higher* than bf16's: torchao (0.18, eager) saves the high-precision input and weight for backward,
not their float8 copies, so the activations are bf16's; each matmul adds casts and the fp32
temporaries that make them.

The lesson's model (``LESSON_CONFIG``) is a small Llama whose linear layers all have dims divisible
by 16 (the FP8 tensor cores' rule; smaller ones would stay in bf16) and a small vocabulary, so the
peak falls in the blocks and not in the loss. ``exercise_fp8_peak`` is its predict-first question:
the checker reads the measured comparison.
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

import torch

from gpulab.categories import CATEGORIES
from gpulab.training.fp8 import KINDS, Fp8Added, fp8_added, fp8_layers
from gpulab.units import format_bytes

__all__ = ["LESSON_CONFIG", "Fp8Comparison", "Fp8Run", "exercise_fp8_peak", "fp8_comparison", "lesson_config"]

# hidden 256, MLP 1024, 2 layers, 4 heads, vocabulary 512: every projection converts to float8
LESSON_CONFIG = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=512, max_position_embeddings=1024)


def lesson_config():
    """The lesson's small Llama (a transformers ``LlamaConfig`` of ``LESSON_CONFIG``)."""
    from transformers import LlamaConfig
    return LlamaConfig(**LESSON_CONFIG)


@dataclass
class Fp8Run:
    """One measured step: ``recipe`` is "bf16" (no FP8) or a float8 recipe."""
    recipe: str
    peak_bytes: int
    tensor_bytes_by_category: dict[str, int]   # at the peak, unrounded
    peak_where: str                            # the phase and module of the peak's event
    added: Fp8Added | None
    label: str


@dataclass
class Fp8Comparison:
    """bf16 against torchao's float8 recipes, one fake CUDA-target step each (``fp8_comparison``)."""
    model: str
    batch: int
    seq_len: int | None
    runs: dict[str, Fp8Run]
    converted: list[str]
    kept: list[str]
    notes: list[str] = field(default_factory=list)

    def extra_bytes(self, recipe: str) -> int:
        """The recipe's peak minus bf16's (positive: FP8 costs more)."""
        return self.runs[recipe].peak_bytes - self.runs["bf16"].peak_bytes

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "batch": self.batch, "seq_len": self.seq_len, "converted": list(self.converted),
                "kept": list(self.kept), "notes": list(self.notes),
                "runs": {k: {"peak_bytes": r.peak_bytes, "tensor_bytes_by_category": dict(r.tensor_bytes_by_category),
                             "peak_where": r.peak_where, "label": r.label,
                             "added": r.added.as_dict() if r.added else None} for k, r in self.runs.items()}}

    def _repr_html_(self) -> str:
        from gpulab.tables import html_table
        names = list(self.runs)
        cats = [c.value for c in CATEGORIES if any(r.tensor_bytes_by_category.get(c.value) for r in self.runs.values())]
        rows = [["peak (live tensors)", *[format_bytes(self.runs[n].peak_bytes) for n in names]],
                ["peak vs bf16", "", *[f"{self.extra_bytes(n):+,} B" for n in names[1:]]],
                ["where the peak is", *[self.runs[n].peak_where for n in names]]]
        rows += [[f"  {c} at the peak", *[format_bytes(self.runs[n].tensor_bytes_by_category.get(c, 0)) for n in names]]
                 for c in cats]
        for kind in KINDS:
            rows.append([f"FP8 made: {kind} (fwd / bwd)", "",
                         *[" / ".join(format_bytes(self.runs[n].added.made[kind].get(ph, 0))
                                      for ph in ("forward", "backward")) for n in names[1:]]])
            rows.append([f"  {kind} alive at the peak", "",
                         *[format_bytes(self.runs[n].added.at_peak[kind]) for n in names[1:]]])
        table = html_table(["", *names], rows)
        notes = "".join(f"<li>{html.escape(n)}</li>" for n in self.notes)
        label = html.escape(self.runs["bf16"].label)
        return (f"<div><b>{html.escape(self.model)}</b>, batch {self.batch}: bf16 vs torchao float8 "
                f"<i>({label})</i>{table}<ul>{notes}</ul></div>")


def _run(model, recipe: str | None, batch: int, seq_len: int | None, optimizer: str, gpu: Any,
         converted: list[str]) -> Fp8Run:
    import gpulab
    r = gpulab.step(model, batch=batch, seq_len=seq_len, engine="fake", dtype="bf16", optimizer=optimizer,
                    fp8=recipe, gpu=gpu)
    t = r.measurement.tracking
    ev = t.events[t.peak_index] if t.peak_index >= 0 else None
    where = f"{ev.phase}, {ev.module.split('.', 1)[-1] or 'model'}" if ev else ""
    return Fp8Run(recipe or "bf16", r.peak_bytes, r.tensor_bytes_by_category, where,
                  fp8_added(t, converted) if recipe else None, r.measurement.label)


def fp8_comparison(model: Any = None, *, batch: int = 2, seq_len: int | None = 256, optimizer: str = "adamw",
                   gpu: Any = None, recipes: tuple[str, ...] = ("tensorwise", "rowwise")) -> Fp8Comparison:
    """bf16 and each float8 recipe, one bf16 training step each on the fake engine (``model``:
    anything ``gpulab.step`` takes; None: the lesson's small Llama)."""
    from gpulab.models.workload import resolve_workload
    model = lesson_config() if model is None else model
    w = resolve_workload(model, None, seq_len=seq_len)
    if w.make is None:
        raise ValueError("fp8_comparison needs a model gpulab can build unplaced (a name or a transformers config)")
    with torch.device("meta"):
        converted, kept = fp8_layers(w.make(torch.bfloat16))
    runs = {"bf16": _run(model, None, batch, seq_len, optimizer, gpu, converted)}
    for recipe in recipes:
        runs[recipe] = _run(model, recipe, batch, seq_len, optimizer, gpu, converted)
    notes = [f"{len(converted)} linear layers converted to torchao's Float8Linear; kept in bf16: "
             f"{', '.join(kept) or 'none'} (the output head, and any layer whose dims do not divide by 16, "
             f"as torchtitan filters them)",
             "torchao 0.18 saves the bf16 input and weight for backward, not their float8 copies: the casts are "
             "temporaries, made again in backward"]
    return Fp8Comparison(w.name, batch, w.seq_len, runs, converted, kept, notes)


def exercise_fp8_peak(comparison: Fp8Comparison, recipe: str = "rowwise"):
    """Predict-first: does eager FP8 training (torchao, ``recipe``) lower, keep or raise the peak of
    the same bf16 step? The checker reads the measured comparison."""
    from gpulab.course.exercises import ChoiceExercise

    def expected() -> str:
        extra = comparison.extra_bytes(recipe)
        return "a" if extra < 0 else "b" if extra == 0 else "c"

    def explain() -> str:
        r, bf = comparison.runs[recipe], comparison.runs["bf16"]
        work = r.added.total("cast work")
        return (f"Measured on fake tensors: bf16's peak {format_bytes(bf.peak_bytes)}, {recipe} FP8's "
                f"{format_bytes(r.peak_bytes)} ({comparison.extra_bytes(recipe):+,} B). torchao saves the bf16 input "
                f"and weight for backward, not the float8 copies, so activations do not shrink; every matmul adds "
                f"its float8 casts ({format_bytes(r.added.total('float8 casts'))} over the step) and the fp32 "
                f"copies that compute them ({format_bytes(work)}), and the peak moves to where those sit "
                f"({r.peak_where}). FP8 buys speed (float8 tensor cores), not memory, unless torch.compile fuses "
                f"the casts.")
    return ChoiceExercise(
        question=(f"The same bf16 training step of {comparison.model} (batch {comparison.batch}) runs with torchao's "
                  f"{recipe} float8 training: every linear layer but the head multiplies in float8 (1 byte per "
                  f"element instead of 2). What happens to the step's peak memory, eagerly (no torch.compile)?"),
        options={"a": "it falls (float8 activations are half the size)", "b": "it stays the same",
                 "c": "it rises"},
        expected=expected, explain=explain)
