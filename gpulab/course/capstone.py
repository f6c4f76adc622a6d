"""Lesson 14, the capstone: your model on your card.

A student brings a model (a registered name, an ``hf:`` config name or a ``config.json``, a
``transformers`` config, an ``nn.Module`` class or a function that builds one) and a card, and
this module answers, for that model and nothing typed in advance:

* ``your_model``: what gpulab will train (the workload, its parameters, one sample's input), the
  card read once (``predict.cards.parse_gpu``); bad input is a ``ValueError`` saying what to do
  (a ``LessonInputError``: in a notebook it shows as that one line, "did you mean T4?" included,
  not as a traceback, and the cells after it do not run);
* ``largest_batch``: ``gpulab.fit``'s largest batch on the card (fake engine, simulated allocator);
* ``decision_table``: the baseline and each technique (and the two together), each one
  ``gpulab.fit`` for its largest batch and one two-step fake run at a fixed batch (the training
  loop of ``training.loop``, under ``torch.utils.flop_counter.FlopCounterMode``) for its peak and
  its FLOPs per step; from those, per technique: bytes saved at the fixed batch, batch gained,
  FLOPs paid, and the micro-batches (accumulation steps, or DDP ranks) to a global batch;
* two predict-first checkers whose answers come from that table.

The techniques are ``gpulab.fit`` / ``gpulab.step`` options (``TECHNIQUES``), their costs in words
taken from ``predict.what_fits.CANDIDATES`` where the change is one of its candidates. Nothing
here prints; results are dataclasses with ``as_dict`` and ``_repr_html_``.
"""
from __future__ import annotations

import dataclasses
import html
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from gpulab.categories import CATEGORIES
from gpulab.course.exercises import ChoiceExercise, Exercise
from gpulab.measure.engines import run
from gpulab.models.hf_configs import is_config, task_of
from gpulab.models.workload import Workload, resolve_workload, step_failed
from gpulab.predict.cards import Card, card_names, parse_gpu
from gpulab.predict.fit import LABEL_FIT, FitResult, fit
from gpulab.predict.op_flops import ADDED_FORMULAS
from gpulab.predict.step import step as gpulab_step
from gpulab.predict.what_fits import CANDIDATES
from gpulab.tables import html_table
from gpulab.training.loop import RECIPE_DEFAULTS, check_recipe_for, recipe_workload, train_experiment, user_recipe
from gpulab.units import dtype_name, format_bytes, parse_dtype

__all__ = [
    "DecisionTable", "LABEL_ACCUMULATION", "LessonInputError", "LABEL_FLOPS", "Row", "TECHNIQUES", "Technique", "YourModel",
    "available_techniques", "decision_table", "exercise_batch_gain", "exercise_flops_ratio", "largest_batch", "measure_recipe",
    "step_flops", "technique", "your_model",
]

LABEL_FLOPS = ("FlopCounterMode (torch.utils.flop_counter) over one training step on fake tensors (a run of its "
               "own): matmuls, convolutions and attention, forward and backward, recomputation included; "
               "elementwise ops and the optimizer count 0")
LABEL_ACCUMULATION = "arithmetic: ⌈global batch ÷ largest batch⌉"
_STEPS = 2   # the steady state: the optimizer state exists from the first step() on


class LessonInputError(ValueError):
    """A mistake in what the student typed at the top of the lesson (the model, the card, an option):
    a ``ValueError`` whose one-line message says what to pass instead. IPython shows an exception's
    ``_render_traceback_`` in place of its traceback, so the notebook shows that one line; Python
    code catching ``ValueError`` sees no difference."""

    def _render_traceback_(self) -> list[str]:
        return [f"ValueError: {self}"]


@dataclass(frozen=True)
class Technique:
    """One change to the training recipe: ``options`` are keyword arguments of ``gpulab.fit`` and
    ``gpulab.step`` (``amp``, ``dtype``, ``optimizer``, ``checkpointing``, ``lora``, ...); ``cost`` is
    what it costs besides memory, in words (the table measures the FLOPs)."""
    name: str
    options: dict[str, Any]
    cost: str


def _candidate(name: str, short: str) -> Technique:
    c = next(c for c in CANDIDATES if c.name == name)
    return Technique(short, dict(c.changes), c.cost)


TECHNIQUES: dict[str, Technique] = {t.name: t for t in (
    Technique("bf16 autocast", {"amp": "bf16"},
              "precision: matmuls and their saved inputs in bf16, float32 weights, gradients and optimizer state "
              "stay; on a GPU with bf16 tensor cores the matmuls also run faster (not measured here)"),
    _candidate("activation checkpointing", "checkpointing"),
    _candidate("LoRA rank 16", "LoRA"),
    _candidate("QLoRA (NF4 base, LoRA rank 16)", "QLoRA"),
    _candidate("8-bit AdamW state (bitsandbytes)", "8-bit AdamW"),
    _candidate("bf16 weights, gradients and optimizer state", "bf16 weights"),
    _candidate("loss in 8 chunks", "chunked loss"),
    _candidate("optimizer step in backward", "optimizer in backward"),
    Technique("offload activations", {"offload_activations": True},
              "every saved activation copied to host memory in forward and back in backward (PCIe traffic)"),
)}
_FIT_KEYS = {"optimizer", "dtype", "amp", *RECIPE_DEFAULTS}


def technique(choice: "str | Technique | tuple[str, dict[str, Any]]") -> Technique:
    """A ``Technique`` from a name of ``TECHNIQUES`` (any case), a ``Technique``, or a pair
    ``(name, options)`` of your own, e.g. ``("LoRA on my layers", {"lora": 8, "lora_targets": ["fc1"]})``."""
    if isinstance(choice, Technique):
        t = choice
    elif isinstance(choice, tuple) and len(choice) == 2 and isinstance(choice[1], dict):
        t = Technique(str(choice[0]), dict(choice[1]), "your own recipe")
    else:
        key = {k.lower(): k for k in TECHNIQUES}.get(str(choice).strip().lower())
        if key is None:
            raise ValueError(f"unknown technique {choice!r}: pick one of {', '.join(TECHNIQUES)}, or give your own as "
                             f"(name, {{options of gpulab.fit}}), e.g. ('LoRA on fc1', {{'lora': 8, 'lora_targets': ['fc1']}})")
        return TECHNIQUES[key]
    unknown = sorted(set(t.options) - _FIT_KEYS)
    if unknown or not t.options:
        raise ValueError(f"technique {t.name!r}: {', '.join(unknown) or 'no options'}; its options are keyword "
                         f"arguments of gpulab.fit: {', '.join(sorted(_FIT_KEYS))}")
    return t


def available_techniques(you: "YourModel | None" = None) -> "_Html":
    """``TECHNIQUES`` as a table: each one's options and cost, and (given your model) whether it
    applies to it, or why not (the checks ``decision_table`` makes before running anything)."""
    rows = []
    for t in TECHNIQUES.values():
        row = [t.name, ", ".join(f"{k}={v!r}" for k, v in t.options.items()), t.cost]
        if you is not None:
            try:
                _check_applies(you, t)
                row.append("yes")
            except ValueError as exc:
                row.append(f"no: {exc}")
        rows.append(row)
    header = ["technique", "options of gpulab.fit / gpulab.step", "what it costs besides memory"]
    caption = "the techniques by name; your own: (name, {options})"
    if you is not None:
        header.append(f"applies to {you.name}?")
    return _Html(html_table(header, rows, caption))


# --- the model and the card ---------------------------------------------------------------------

@dataclass
class YourModel:
    """What gpulab trains for you: the workload, the card and the base recipe."""
    workload: Workload
    card: Card
    optimizer: str
    dtype: str
    n_params: int
    base_options: dict[str, Any] = field(default_factory=dict)   # recipe options every row shares

    @property
    def name(self) -> str:
        return self.workload.name

    def fit_options(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Keyword arguments of ``gpulab.fit`` for the base recipe with ``extra`` on top."""
        return {"optimizer": self.optimizer, "dtype": self.dtype, **self.base_options, **(extra or {})}

    def as_dict(self) -> dict[str, Any]:
        w = self.workload
        return {"model": w.name, "kind": w.kind, "description": w.description, "parameters": self.n_params,
                "input": w.describe_input(1), "card": self.card.name, "card_bytes": self.card.reported_total_bytes,
                "card_note": self.card.total_text, "optimizer": self.optimizer, "dtype": self.dtype,
                "base_options": dict(self.base_options)}

    def __repr__(self) -> str:
        return f"YourModel({self.name}, {self.n_params:,} parameters, on {self.card.name})"

    def _repr_html_(self) -> str:
        d = self.as_dict()
        rows = [["model", d["model"], d["description"]], ["kind", d["kind"], "what one batch is made of"],
                ["parameters", f"{d['parameters']:,}", "counted on the meta device (numel of every parameter)"],
                ["one sample", d["input"], "what gpulab feeds it (batch 1)"],
                ["card", f"{d['card']} ({format_bytes(d['card_bytes'])})",
                 d["card_note"] + "; gpulab.fit plans with this total less the CUDA context"],
                ["optimizer, dtype", f"{d['optimizer']}, {d['dtype']}", "the baseline recipe"]]
        if self.base_options:
            rows.append(["every row also", ", ".join(f"{k}={v}" for k, v in self.base_options.items()),
                         "a training step needs no KV cache (transformers builds one when config.use_cache is true)"])
        return html_table(["", "yours", "where it comes from"], rows, "your model on your card")


def your_model(model: Any, card: Any, *, optimizer: str = "adamw", dtype: Any = None, seq_len: int | None = None,
               input_shape: tuple[int, ...] | None = None, inputs: Any = None, image_size: int | None = None,
               loss: Callable | None = None, name: str | None = None) -> YourModel:
    """Read the model and the card once (``ValueError`` saying what to pass instead, before anything
    runs). ``model``: what ``gpulab.fit`` takes; ``card``: a name of ``predict.cards`` or a size
    ("24GiB"); the input options as ``gpulab.fit`` has them; ``name``: what the tables call it
    (default: the registered name, "your GPT2Config" for a config object, the class's name)."""
    try:
        return _your_model(model, card, optimizer, dtype, seq_len, input_shape, inputs, image_size, loss, name)
    except LessonInputError:
        raise
    except ValueError as exc:   # one line in the notebook (LessonInputError), not a traceback
        raise LessonInputError(str(exc)) from None


def _your_model(model, card, optimizer, dtype, seq_len, input_shape, inputs, image_size, loss, name) -> YourModel:
    if isinstance(card, Card):
        c = card
    elif isinstance(card, str):
        c = parse_gpu(card, "card")   # a Python call: no command-line flag in the message
    else:
        raise ValueError(f"card must be a card name or a size, got {type(card).__name__} {card!r}: e.g. 'T4', "
                         f"'24GiB'; cards: {', '.join(card_names())}")
    if model is None or isinstance(model, (int, float, bool, bytes, list, dict, set)):
        raise ValueError(f"cannot use {type(model).__name__} {model!r} as your model: give an nn.Module class (or a "
                         f"function that builds your module), a transformers config, an 'hf:' name such as "
                         f"'hf:tiny-gpt2', or a registered model such as 'resnet18'")
    w = resolve_workload(model, inputs, input_shape=input_shape, seq_len=seq_len, image_size=image_size, loss=loss)
    if name is None and is_config(model):   # not "hf:gpt2" for a config of your own
        name = f"your {type(model).__name__}"
    if name is not None:
        w = dataclasses.replace(w, name=str(name))
    dt = parse_dtype(dtype) if dtype is not None else torch.float32
    user_recipe(optimizer)   # the optimizer's name checked here, with the list of valid ones
    base: dict[str, Any] = {}
    if w.config is not None and task_of(w.config) == "causal-lm" and getattr(w.config, "use_cache", False):
        base["use_cache"] = False
    try:
        n, _ = w.parameter_counts(dt)
    except Exception as exc:
        raise ValueError(step_failed(w, 1, "to build on the meta device (shapes only)", exc)) from exc
    return YourModel(w, c, optimizer, dtype_name(dt), n, base)


def largest_batch(you: YourModel, **options: Any) -> FitResult:
    """``gpulab.fit`` of your model on your card with the base recipe (and ``options`` on top)."""
    return fit(you.workload, you.card, **you.fit_options(options))


# --- one recipe measured: its peak (gpulab.step) and its FLOPs (FlopCounterMode) -------------------

@dataclass
class _Run:
    peak_bytes: int
    peak_by_category: dict[str, int]
    flops_per_step: int
    label: str


def step_flops(you: YourModel, batch: int, options: dict[str, Any] | None = None) -> int:
    """The FLOPs of one training step of your model at ``batch`` with the base recipe and ``options``:
    ``FlopCounterMode`` around the loop ``gpulab.step`` runs (``training.loop.train_experiment``), on
    the fake engine following CUDA's kernels (CUDA's attention kernels, grouped-query k/v included, counted by
    their shapes as ``predict.op_flops`` says).

    A run of its own: FlopCounterMode's module hooks keep tensors that checkpointing recomputes
    alive longer (measured: a GPT-2-style model's checkpointed peak rose by half under it), so the
    memory comes from ``gpulab.step`` without it."""
    from torch.utils.flop_counter import FlopCounterMode
    opts = you.fit_options(options)
    dt = parse_dtype(opts.pop("dtype"))
    recipe = user_recipe(opts.pop("optimizer"), opts.pop("amp", None), **opts)
    check_recipe_for(recipe, you.workload)
    experiment = train_experiment(you.workload, [batch], dt, recipe)

    def counted(ctx):
        # grouped-query attention runs CUDA's kernel with k/v as they are (``fake_cuda._cuda_sdpa``), which
        # torch 2.11's registry formulas refuse; ``ADDED_FORMULAS`` counts them (``predict.op_flops``)
        with FlopCounterMode(display=False, custom_mapping=ADDED_FORMULAS) as counter:
            experiment(ctx)
        return counter.get_total_flops()
    try:
        m = run(counted, "fake", fake_target="cuda")
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(step_failed(you.workload, batch, "on the fake engine", exc)) from exc
    if m.oom:
        raise RuntimeError(f"the fake run at batch {batch} failed: {m.error}")
    return int(m.value)


def measure_recipe(you: YourModel, batch: int, options: dict[str, Any] | None = None) -> _Run:
    """Your model at ``batch`` with the base recipe and ``options``: the peak of two training steps
    (``gpulab.step`` on the fake engine, your card's CUDA kernels, the ones ``gpulab.fit`` follows:
    bf16 attention on a T4 is the math kernel's float32, not a fused kernel's) and the FLOPs of one
    (``step_flops``)."""
    s = gpulab_step(you.workload, batch=batch, engine="fake", gpu=you.card, **you.fit_options(options))
    return _Run(s.peak_bytes, {k: int(v) for k, v in s.measurement.peak_by_category.items()},
                step_flops(you, batch, options), s.label)


# --- the decision table ------------------------------------------------------------------------

@dataclass
class Row:
    """One recipe: its largest batch (``gpulab.fit``) and, at the table's fixed batch, its peak and FLOPs."""
    technique: Technique
    fit: FitResult
    peak_bytes: int
    peak_by_category: dict[str, int]
    flops_per_step: int
    trainable_params: int
    label: str

    @property
    def name(self) -> str:
        return self.technique.name

    @property
    def largest_batch(self) -> int:
        return self.fit.largest_batch


@dataclass
class DecisionTable:
    """The baseline first, then each technique, then (``combined``) the techniques together."""
    you: YourModel
    batch: int                  # the fixed batch every row's peak and FLOPs are measured at
    target_batch: int           # the global batch the micro-batch column aims at
    rows: list[Row]
    seconds: float = 0.0

    @property
    def baseline(self) -> Row:
        return self.rows[0]

    def row(self, name: str) -> Row:
        for r in self.rows:
            if r.name.lower() == str(name).strip().lower():
                return r
        raise ValueError(f"no row {name!r} in this table; rows: {', '.join(r.name for r in self.rows)}")

    def saved_bytes(self, name: str) -> int:
        """Peak bytes at the fixed batch: the baseline's minus this row's."""
        return self.baseline.peak_bytes - self.row(name).peak_bytes

    def batch_gained(self, name: str) -> int:
        return self.row(name).largest_batch - self.baseline.largest_batch

    def flops_ratio(self, name: str) -> float:
        """FLOPs per step at the fixed batch, this row's over the baseline's."""
        return self.row(name).flops_per_step / self.baseline.flops_per_step if self.baseline.flops_per_step else math.nan

    def micro_batches(self, name: str) -> int | None:
        """Micro-batches of the largest batch that make the target global batch (None: batch 1 does not fit)."""
        b = self.row(name).largest_batch
        return math.ceil(self.target_batch / b) if b else None

    def as_dict(self) -> dict[str, Any]:
        rows = []
        for r in self.rows:
            rows.append({"technique": r.name, "options": dict(r.technique.options), "cost": r.technique.cost,
                         "peak_bytes": r.peak_bytes, "saved_bytes": self.saved_bytes(r.name),
                         "largest_batch": r.largest_batch, "batch_gained": self.batch_gained(r.name),
                         "largest_batch_live": r.fit.largest_batch_live,
                         "flops_per_step": r.flops_per_step, "flops_ratio": self.flops_ratio(r.name),
                         "micro_batches": self.micro_batches(r.name), "trainable_params": r.trainable_params,
                         "peak_by_category": dict(r.peak_by_category)})
        return {"model": self.you.name, "card": self.you.card.name, "batch": self.batch,
                "target_batch": self.target_batch, "rows": rows,
                "labels": {"largest_batch": LABEL_FIT, "peak_bytes": self.baseline.label, "flops": LABEL_FLOPS,
                           "micro_batches": LABEL_ACCUMULATION}}

    def __repr__(self) -> str:
        return (f"DecisionTable({self.you.name} on {self.you.card.name}: "
                + "; ".join(f"{r.name} batch {r.largest_batch}" for r in self.rows) + ")")

    def _repr_html_(self) -> str:
        b, n = self.batch, self.target_batch
        header = ["technique", f"peak at batch {b}", "saved", "largest batch", "gained", "live-tensor bound",
                  f"GFLOP per step at batch {b}",
                  "FLOPs paid", f"micro-batches to {n}", "also costs"]
        rows = []
        for r in self.rows:
            saved, ratio, k = self.saved_bytes(r.name), self.flops_ratio(r.name), self.micro_batches(r.name)
            rows.append([r.name, format_bytes(r.peak_bytes), "—" if r is self.baseline else _signed_bytes(saved),
                         r.largest_batch or "none fits", "—" if r is self.baseline else f"{self.batch_gained(r.name):+,}",
                         "—" if r.fit.largest_batch_live is None else f"{r.fit.largest_batch_live:,}",
                         f"{r.flops_per_step / 1e9:,.1f}", "—" if r is self.baseline else f"×{ratio:.3f}",
                         "—" if k is None else f"{k:,}", r.technique.cost])
        sources = html_table(["columns", "where the figures come from"], [
            [f"peak at batch {b}, saved", f"{self.baseline.label}: the live-tensor peak of two training steps"],
            ["largest batch, gained", f"gpulab.fit: {LABEL_FIT}"],
            ["live-tensor bound", "gpulab.fit's largest_batch_live: the live tensors alone against the same memory, "
                                  "no allocator (an upper bound; the gap to the largest batch is the simulated "
                                  "allocator's rounding, caching and fragmentation)"],
            ["GFLOP per step, FLOPs paid", LABEL_FLOPS],
            [f"micro-batches to {n}", f"{LABEL_ACCUMULATION}: gradient accumulation steps on one card, or GPUs with DDP"],
            ["also costs", "in words (predict.what_fits.CANDIDATES where the change is one of its candidates)"]])
        caption = (f"{self.you.name} on {self.you.card.name} ({format_bytes(self.baseline.fit.capacity_bytes)}), "
                   f"{self.you.optimizer}, {self.you.dtype}: computed for this model, a gpulab.fit and two fake runs "
                   f"(a two-step peak, a one-step FLOP count) per row")
        return html_table(header, rows, caption) + sources

    def by_category(self) -> "_Html":
        """At the fixed batch: each category at the peak, per row, and the change from the baseline."""
        cats = [c.value for c in CATEGORIES if any(r.peak_by_category.get(c.value) for r in self.rows)]
        base = self.baseline.peak_by_category
        rows = []
        for c in cats:
            cells = [c, format_bytes(base.get(c, 0))]
            cells += [_signed_bytes(r.peak_by_category.get(c, 0) - base.get(c, 0)) for r in self.rows[1:]]
            rows.append(cells)
        rows.append(["trainable parameters", f"{self.baseline.trainable_params:,}"]
                    + [f"{r.trainable_params:,}" for r in self.rows[1:]])
        header = ["at the peak, batch " + str(self.batch), "baseline"] + [f"{r.name} (change)" for r in self.rows[1:]]
        return _Html(html_table(header, rows, f"where each saving comes from: {self.baseline.label}"))

    def decision(self) -> "_Html":
        """The table read out in sentences, every figure from it."""
        return _Html("<ul>" + "".join(f"<li>{html.escape(s)}</li>" for s in self.sentences()) + "</ul>")

    def sentences(self) -> list[str]:
        b0 = self.baseline
        out = [f"Baseline: largest batch {b0.largest_batch or 'none'} on {self.you.card.name}; "
               f"{_k(self.micro_batches(b0.name))} to a global batch of {self.target_batch}."]
        for r in self.rows[1:]:
            saved = self.saved_bytes(r.name)
            out.append(f"{r.name}: {'saves' if saved >= 0 else 'adds'} {format_bytes(abs(saved))} at batch {self.batch} "
                       f"({abs(saved) / b0.peak_bytes:.0%} of the baseline's peak); largest batch "
                       f"{b0.largest_batch} → {r.largest_batch} ({self.batch_gained(r.name):+,}); FLOPs per step "
                       f"×{self.flops_ratio(r.name):.3f}; {_k(self.micro_batches(r.name))} to {self.target_batch}. "
                       f"Also: {r.technique.cost}." + _kernel_change(r, b0))
        tech = self.rows[1:]
        best = max(tech, key=lambda r: r.largest_batch)
        out.append(f"Largest batch: {best.name} ({best.largest_batch}).")
        gaining = [r for r in tech if self.batch_gained(r.name) > 0]
        if gaining:
            cheap = min(gaining, key=lambda r: (self.flops_ratio(r.name), -r.largest_batch))
            out.append(f"Fewest FLOPs per step among those that gain a batch: {cheap.name} (×{self.flops_ratio(cheap.name):.3f}).")
        else:
            out.append("No technique here gains a batch on this card: look at what_fits' other recipes, or more GPUs.")
        return out

    def figure(self):
        """Largest batch against FLOPs per step (relative to the baseline), one point per row."""
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7.2, 3.8))
        for r in self.rows:
            x, y = self.flops_ratio(r.name), r.largest_batch
            ax.scatter([x], [y], s=40)
            ax.annotate(r.name, (x, y), textcoords="offset points", xytext=(6, 4), fontsize=9)
        ax.set_xlabel("FLOPs per step ÷ the baseline's (FlopCounterMode)")
        ax.set_ylabel(f"largest batch on {self.you.card.name} (gpulab.fit)")
        ax.set_title(f"{self.you.name}: batch bought, compute paid (FLOPs at batch {self.batch})", fontsize=10)
        ax.margins(x=0.35, y=0.15)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        plt.close(fig)
        return fig


class _Html:
    def __init__(self, text: str):
        self.text = text

    def _repr_html_(self) -> str:
        return self.text


def _signed_bytes(n: int) -> str:
    return ("−" if n < 0 else "+") + format_bytes(abs(n)) if n else "0 B"


def _attention_kernels(r: Row) -> str:
    """The attention kernels a row's fake runs followed, read off ``gpulab.fit``'s kernels line
    ("CUDA kernels of a T4 (sm75): math attention (...)" -> "math attention (...)"); "" when none."""
    kernels = getattr(r.fit, "kernels", "") or ""
    return kernels.split(": ", 1)[1] if ": " in kernels else ""


def _kernel_change(r: Row, base: Row) -> str:
    """" Its attention kernel is ..., not the baseline's ..." when the technique changed the kernel the card's
    SDPA chooses (a T4 in bf16: the math kernel, which saves the s×s attention weights), else ""."""
    mine, theirs = _attention_kernels(r), _attention_kernels(base)
    if not mine or not theirs or mine == theirs:
        return ""
    return f" Its attention kernel on this card is {mine}, not the baseline's {theirs}: see lesson 11, section 3."


def _k(k: int | None) -> str:
    return "batch 1 does not fit" if k is None else f"{k:,} micro-batch{'es' if k != 1 else ''}"


def _trainable(you: YourModel, options: dict[str, Any]) -> int:
    """Parameters that train with ``options`` (LoRA: the adapters only), counted on the meta device."""
    opts = you.fit_options(options)
    recipe = user_recipe(opts.pop("optimizer"), opts.pop("amp", None), **{k: v for k, v in opts.items()
                                                                          if k in RECIPE_DEFAULTS})
    return recipe_workload(you.workload, recipe).parameter_counts(parse_dtype(you.dtype))[1]


def _combined(techniques: list[Technique]) -> Technique | None:
    """The techniques together, or None when two of them set the same option differently."""
    merged: dict[str, Any] = {}
    for t in techniques:
        for k, v in t.options.items():
            if k in merged and merged[k] != v:
                return None
            merged[k] = v
    return Technique(" + ".join(t.name for t in techniques), merged, "all of the above")


def decision_table(you: YourModel, techniques: Sequence[Any] = ("bf16 autocast", "checkpointing"), *,
                   baseline: FitResult | None = None, batch: int | None = None, target_batch: int | None = None,
                   combined: bool = True) -> DecisionTable:
    """The decision table for your model (module docstring). ``baseline``: ``largest_batch(you)``
    if already made; ``batch``: the fixed batch of the peaks and FLOPs (default: the baseline's largest
    batch, or 1 when none fits); ``target_batch``: the global batch to reach (default: 4 × that batch)."""
    import time
    t0 = time.perf_counter()
    chosen = [technique(t) for t in techniques]
    if not chosen:
        raise ValueError(f"give at least one technique: {', '.join(TECHNIQUES)}")
    if len({t.name for t in chosen}) < len(chosen):
        raise ValueError(f"each technique once, got {', '.join(t.name for t in chosen)}")
    for t in chosen:
        _check_applies(you, t)
    base_fit = baseline if baseline is not None else largest_batch(you)
    b = batch if batch is not None else max(1, base_fit.largest_batch)
    if not isinstance(b, int) or isinstance(b, bool) or b < 1:
        raise ValueError(f"batch must be a positive whole number, got {b!r}")
    target = target_batch if target_batch is not None else 4 * b
    if not isinstance(target, int) or isinstance(target, bool) or target < 1:
        raise ValueError(f"target_batch must be a positive whole number, got {target!r}")
    recipes = [Technique("baseline", {}, "—")] + chosen
    if combined and len(chosen) > 1 and (both := _combined(chosen)) is not None:
        recipes.append(both)
    rows = []
    for t in recipes:
        f = base_fit if not t.options else largest_batch(you, **t.options)
        m = measure_recipe(you, b, t.options)
        rows.append(Row(t, f, m.peak_bytes, m.peak_by_category, m.flops_per_step, _trainable(you, t.options), m.label))
    return DecisionTable(you, b, target, rows, time.perf_counter() - t0)


def _check_applies(you: YourModel, t: Technique) -> None:
    """Refuse, before anything runs, a technique this model cannot take, saying which it can."""
    w = you.workload
    if (t.options.get("lora") or t.options.get("checkpointing")) and w.kind == "image":
        raise ValueError(f"{t.name} is for transformers (lesson 07 checkpoints a CNN by hand); {w.name} is an image "
                         f"model: pick bf16 autocast, bf16 weights, 8-bit AdamW or offload activations")
    if t.options.get("checkpointing") and w.config is None:
        raise ValueError(f"{t.name} turns on a transformers model's own gradient checkpointing; {w.name} has none: "
                         f"pick another technique (bf16 autocast, LoRA with lora_targets, 8-bit AdamW, offload "
                         f"activations), or wrap your blocks in torch.utils.checkpoint.checkpoint yourself")
    if t.options.get("lora") and w.config is None and not t.options.get("lora_targets"):
        raise ValueError(f"{t.name} on your own module needs the names of its Linear layers to adapt: give "
                         f"('LoRA', {{'lora': 8, 'lora_targets': ['fc1', 'fc2']}}) with your layers' names")
    opts = you.fit_options(t.options)
    opts.pop("dtype")
    check_recipe_for(user_recipe(opts.pop("optimizer"), opts.pop("amp", None), **opts), w)


# --- predict first ---------------------------------------------------------------------------------

_GAIN_OPTIONS = {"a": "no larger than the baseline's", "b": "larger, but less than 1.5 times the baseline's",
                 "c": "1.5 to 2.5 times the baseline's", "d": "more than 2.5 times the baseline's"}


def _gain_key(ratio: float) -> str:
    return "a" if ratio <= 1 else "b" if ratio < 1.5 else "c" if ratio <= 2.5 else "d"


def exercise_batch_gain(table: DecisionTable, name: str) -> ChoiceExercise:
    """With technique ``name``, how much larger is the largest batch? The answer from the two fits."""
    row, base = table.row(name), table.baseline

    def expected() -> str:
        return _gain_key(row.largest_batch / base.largest_batch if base.largest_batch else math.inf)

    def explain() -> str:
        cats = {c: row.peak_by_category.get(c, 0) - base.peak_by_category.get(c, 0)
                for c in set(row.peak_by_category) | set(base.peak_by_category)}
        moved = ", ".join(f"{c} {_signed_bytes(v)}" for c, v in sorted(cats.items(), key=lambda kv: kv[1]) if v)
        return (f"gpulab.fit: {base.largest_batch} → {row.largest_batch} on {table.you.card.name}. At batch "
                f"{table.batch} the peak moved by {_signed_bytes(row.peak_bytes - base.peak_bytes)} ({moved or 'nothing'}): "
                f"only what grows with the batch buys a larger batch; what does not (weights, gradients, optimizer "
                f"state) only leaves more room once." + _kernel_change(row, base))
    q = (f"With {row.name}, the largest batch of {table.you.name} on {table.you.card.name} "
         f"(the baseline's is {base.largest_batch}) is:")
    return ChoiceExercise(q, dict(_GAIN_OPTIONS), expected, explain,
                          hint="Look at which categories grow with the batch, and which of them the technique shrinks or adds to")


def exercise_flops_ratio(table: DecisionTable, name: str) -> Exercise:
    """FLOPs of one step with technique ``name`` over the baseline's, at the table's batch (FlopCounterMode)."""
    row = table.row(name)
    base = table.baseline
    explain = (f"FlopCounterMode on the fake runs at batch {table.batch}: {base.flops_per_step / 1e9:,.1f} GFLOP per "
               f"step without, {row.flops_per_step / 1e9:,.1f} GFLOP with {row.name}. One more forward of the whole "
               f"model would be ×4/3 (backward costs about two forwards); recomputing only the blocks, not the "
               f"head and the loss, is less; LoRA skips the frozen weights' gradients; autocast changes precision, "
               f"not the count.")
    return Exercise(f"At batch {table.batch}, the FLOPs of one training step of {table.you.name} with {row.name}, "
                    f"divided by the FLOPs without it, are: (a ratio, e.g. 1.5)",
                    expected=lambda: round(table.flops_ratio(name), 3), explain=explain, unit="", rel_tol=0.03,
                    close=1.1, hint="Count what runs again in backward, and what no longer runs at all.")
