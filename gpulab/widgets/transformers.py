"""Lesson 11's panels on transformer memory: activations per layer against the sequence length
(the quadratic score term appears and SDPA removes it), and "will serving fit?" (weights, KV
cache, a decode step) for a card, context length and batch."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterable

from gpulab.predict.cards import card_names
from gpulab.course.serving import InferenceFit, inference_fit, max_context
from gpulab.course.transformer_activations import ActivationSweep, activation_vs_seq, kept_key
from gpulab.plots import to_png
from gpulab.widgets.base import Panel, check_control_value, dropdown, fit_lengths, reuse_first, slider

__all__ = [
    "ACTIVATION_MODELS", "SERVING_DTYPES", "SERVING_MODELS", "activation_seq_panel",
    "compute_activations", "compute_serving", "model_positions", "render_activations", "render_serving",
    "serving_panel", "sweep_lengths"
]

ACTIVATION_MODELS = ("gpt2", "tiny-llama", "tiny-gpt2")
SERVING_MODELS = ("llama-3-8b", "llama-2-7b", "mistral-7b", "qwen2.5-0.5b", "gpt2")
SERVING_DTYPES = ("bfloat16", "float16", "float32")


def sweep_lengths(seq_len: int) -> tuple[int, ...]:
    """The lengths the panel measures for a chosen one: a quarter, half and all of it."""
    return tuple(sorted({max(16, seq_len // 4), max(32, seq_len // 2), seq_len}))


def compute_activations(model: str, seq_len: int, progress=None, kept: OrderedDict | None = None) -> ActivationSweep:
    """The sweep of ``sweep_lengths(seq_len)``; ``kept``: the panel's runs (``activation_vs_seq``), so a
    move of the slider measures only the length it adds (a half of 512 is 256, measured already). Each
    run made is a forward alone: what a layer saves is the forward's, and the rows are those of a run
    with its backward (``measured_layer_activations(backward=False)``)."""
    lens = sweep_lengths(seq_len)
    if progress:
        progress(0.1, f"fake forwards at {', '.join(map(str, lens))} tokens, eager and SDPA")
    return activation_vs_seq(model, seq_lens=tuple(lens), kept=kept, backward=False)


def render_activations(sweep: ActivationSweep) -> list[Any]:
    return [sweep, to_png(sweep.plot())]


def _same_sweep(sweep: ActivationSweep, p: dict[str, Any]) -> bool:
    """Made as the panel makes it: this model, its lengths, batch 1, bf16, the fake engine."""
    return (sweep.model == p["model"] and tuple(r.seq_len for r in sweep.rows) == sweep_lengths(p["seq_len"])
            and all(r.batch == 1 for r in sweep.rows)
            and all(run.dtype == "bfloat16" and run.measurement.engine == "fake" for run in sweep.runs))


def model_positions(model: str) -> int | None:
    """The positions a transformers model's config takes (``max_position_embeddings`` or ``n_positions``)."""
    from gpulab.models import hf_configs
    return hf_configs.config_summary(hf_configs.make_config(model, use_cache=False))["max_positions"]


def activation_seq_panel(model: str = "gpt2", seq_len: int = 512, measured: Iterable[ActivationSweep] = ()) -> Panel:
    """The panel. ``measured``: sweeps the lesson already made (``activation_vs_seq``); the
    first showing uses one made with the panel's settings instead of measuring it again."""
    controls = {"model": dropdown("model", ACTIVATION_MODELS, model),
                "seq_len": slider("sequence length", 64, 64, 2048, log=True)}
    fit_lengths(controls["seq_len"], model_positions(model))
    check_control_value("seq_len", controls["seq_len"], seq_len)   # a length the model refuses: one line
    controls["seq_len"].value = seq_len
    # before the panel's own observer: the slider offers only what the newly chosen model takes
    controls["model"].observe(lambda change: fit_lengths(controls["seq_len"], model_positions(change["new"])),
                              names="value")
    measured = [m for m in measured if m is not None]
    kept: OrderedDict = OrderedDict()   # the panel's runs, the lesson's sweeps first
    for sweep in measured:
        if all(r.measurement.engine == "fake" and r.batch == 1 for r in sweep.runs):
            for r in sweep.runs:
                kept[kept_key(r.model, r.seq_len, r.batch, r.attn_implementation, r.dtype, "fake")] = r

    def compute_kept(model: str, seq_len: int, progress=None) -> ActivationSweep:
        return compute_activations(model, seq_len, progress, kept=kept)

    compute, render = reuse_first(compute_kept, render_activations, measured, _same_sweep)
    return Panel("Activations per layer against the sequence length", controls, compute, render,
                 description="One layer's saved tensors measured on the fake engine (bf16, CUDA's kernels) at a "
                             "quarter, half and all of the chosen length, with eager attention and with SDPA, next "
                             "to Korthikanti et al.'s formula with and without its s² term.")


def compute_serving(model: str, card: str, context_len: int, batch: int, dtype: str) -> tuple[InferenceFit, Any]:
    return inference_fit(model, card, context_len, batch, dtype), max_context(model, card, batch, dtype)


def render_serving(result: tuple[InferenceFit, Any]) -> list[Any]:
    return list(result)


def serving_panel(model: str = "llama-3-8b", card: str = "RTX 4090", context_len: int = 8192, batch: int = 1,
                  dtype: str = "bfloat16") -> Panel:
    controls = {"model": dropdown("model", SERVING_MODELS, model),
                "card": dropdown("card", card_names(), card),
                "context_len": slider("context (tokens)", context_len, 256, 131072, log=True),
                "batch": slider("batch", batch, 1, 256, log=True),
                "dtype": dropdown("dtype", SERVING_DTYPES, dtype)}
    return Panel("Will serving fit? Weights + KV cache + a decode step", controls, compute_serving, render_serving,
                 description="Weights and the KV cache by formula, one decode step's working set as a labelled "
                             "estimate, against the card less an assumed CUDA context; and the longest context "
                             "that fits at this batch.", auto_run=True)
