"""``gpulab.serve``: will this model serve on this card, at this context length, this many
sequences at once?

Measured on fake tensors at full size (``predict.generation``: the model's real forward, CUDA's
kernels): the weights (in the dtype, or weight-only int8 / NF4 as bitsandbytes stores them), the
prefill's peak of one sequence at a time and of the whole batch at once, and the last decode step's
peak with every sequence's KV cache at the full context. The KV cache's bytes per token come from
the config (2 · layers · KV heads · head dim · bytes); a KV dtype other than the model's (an fp8
cache) is applied to the measured decode step as that formula, labelled so.

Beside it, paged serving as vLLM sizes it (formula, labelled): vLLM asks for
``gpu_memory_utilization`` of the card's memory, keeps the weights, the peak of a profiling
forward and what lives outside PyTorch (the CUDA context), and cuts the rest into blocks of
``block_size`` tokens of every layer's keys and values; a sequence of the context length takes
ceil(context / block_size) blocks. Here the profiling forward is the prefill of one sequence, and
what lives outside PyTorch is the CUDA context alone: vLLM's budget (vllm/v1/worker/gpu_worker.py
``determine_available_memory``: ``self.requested_memory - profile_result.non_kv_cache_memory``,
less ``cudagraph_memory_estimate_applied`` where VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS is on)
also subtracts the other non-torch memory it sees grow (NCCL buffers, ...) and the CUDA graphs'
estimate, so the block count here is an upper bound. vLLM's chunked prefill packs a token budget
(``max_num_batched_tokens``) across requests each step rather than one prompt at a time.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from gpulab import formulas as F
from gpulab.measure.engines import LABEL_FORMULA, LABEL_FAKE_CUDA
from gpulab.models import hf_configs
from gpulab.measure.cuda_card import current_target
from gpulab.predict.cards import Card, follows_card, parse_gpu
from gpulab.predict.context import context_assumption, context_label
from gpulab.predict.generation import generation_peak
from gpulab.predict.progress import Progress, report
from gpulab.units import dtype_name, format_bytes, parse_dtype

__all__ = ["KV_DTYPES", "ServeResult", "kv_bytes_per_token", "serve"]

KV_DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
WEIGHTS = {"int8": "int8", "int4": "nf4", "nf4": "nf4"}   # int4: bitsandbytes' 4-bit (NF4) layout


def kv_bytes_per_token(config: Any, nbytes: int) -> int:
    """One token of one sequence in every layer's keys and values: 2 · layers · KV heads · head dim · bytes."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return F.kv_cache_bytes(text.num_hidden_layers, kv_heads, head_dim, 1, 1, nbytes)


@dataclass
class ServeResult:
    """``serve``'s answer: measured bytes (fake tensors, CUDA's kernels) and vLLM's block arithmetic."""
    model: str
    card: str
    capacity_bytes: int
    context_bytes: int            # the CUDA context, outside PyTorch's allocator (assumed)
    context_len: int
    batch: int
    dtype: str
    weights: str                  # "bf16" / "fp16" / ... or "int8", "nf4"
    kv_dtype: str
    weights_bytes: int
    kv_per_token_bytes: int
    kv_cache_bytes: int           # every sequence's cache at the full context, in the KV dtype
    prefill_one_bytes: int        # peak of one sequence's prefill (live tensors)
    prefill_all_bytes: int        # peak of the whole batch's prefill at once
    decode_bytes: int             # peak of the last decode step, the whole batch, in the KV dtype
    utilization: float
    block_size: int
    seconds: float
    label: str = LABEL_FAKE_CUDA
    paged_label: str = LABEL_FORMULA + " (vLLM's block arithmetic)"
    kv_label: str = LABEL_FAKE_CUDA
    module_loading: str = "lazy"
    capacity_note: str = ""       # where capacity_bytes comes from (Card.total_text)
    # the cuBLAS workspace the forward's matmuls keep allocated (one thread: Card.workspace_bytes(training=False))
    workspace_bytes: int = 0
    kernels: str = ""             # the card whose CUDA kernels the fake runs followed, the attention kernels chosen

    @property
    def usable_bytes(self) -> int:
        return self.capacity_bytes - self.context_bytes - self.workspace_bytes

    @property
    def needed_one_at_a_time_bytes(self) -> int:   # prefill each sequence alone, then decode them all
        return max(self.prefill_one_bytes + self.kv_cache_bytes * (self.batch - 1) // self.batch, self.decode_bytes)

    @property
    def needed_all_at_once_bytes(self) -> int:
        return max(self.prefill_all_bytes, self.decode_bytes)

    @property
    def fits(self) -> bool:
        return self.needed_one_at_a_time_bytes <= self.usable_bytes

    @property
    def paged_blocks(self) -> int:
        """KV blocks vLLM would make: utilization × capacity − weights − the profiling forward's
        working set − the CUDA context, in blocks of ``block_size`` tokens."""
        working = max(0, self.prefill_one_bytes - self.weights_bytes)
        budget = int(self.utilization * self.capacity_bytes) - self.weights_bytes - working - self.context_bytes
        return max(0, budget // (self.block_size * self.kv_per_token_bytes))

    @property
    def max_sequences(self) -> int:
        """Sequences of the full context that fit in those blocks at once."""
        return self.paged_blocks // math.ceil(self.context_len / self.block_size)

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out.update(context_label=context_label(self.context_bytes, self.module_loading),
                   context_warning=context_assumption(self.module_loading).warning, usable_bytes=self.usable_bytes, needed_one_at_a_time_bytes=self.needed_one_at_a_time_bytes,
                   needed_all_at_once_bytes=self.needed_all_at_once_bytes, fits=self.fits,
                   paged_blocks=self.paged_blocks, max_sequences=self.max_sequences)
        return out

    def __repr__(self) -> str:
        return (f"ServeResult({self.model} on {self.card}: {self.batch} × {self.context_len:,} tokens "
                f"{'fits' if self.fits else 'does not fit'}; vLLM-style: {self.max_sequences} sequences)")

    def _repr_html_(self) -> str:
        from gpulab.views import html_table
        rows = [["weights (" + self.weights + ")", format_bytes(self.weights_bytes), self.label],
                [f"KV cache, {self.batch} × {self.context_len:,} tokens ({self.kv_dtype})",
                 format_bytes(self.kv_cache_bytes), self.kv_label],
                ["prefill, one sequence at a time (peak)", format_bytes(self.prefill_one_bytes), self.label],
                ["prefill, all at once (peak)", format_bytes(self.prefill_all_bytes), self.label],
                ["last decode step (peak)", format_bytes(self.decode_bytes), self.kv_label],
                ["usable (card − CUDA context − cuBLAS workspace)", format_bytes(self.usable_bytes),
                 context_label(self.context_bytes, self.module_loading)
                 + f"; cuBLAS workspace {format_bytes(self.workspace_bytes)} by formula"],
                [f"vLLM-style: blocks of {self.block_size} tokens at {self.utilization:.0%}",
                 f"{self.paged_blocks:,} blocks: {self.max_sequences} sequences", self.paged_label]]
        return html_table(["", "bytes", "source"], rows, repr(self))


def _check(context_len: int, batch: int, block_size: int, utilization: float) -> None:
    for name, value in (("context_len", context_len), ("batch", batch), ("block_size", block_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive whole number, got {value!r}")
    if context_len < 2:
        raise ValueError("context_len must be at least 2 tokens (a prompt and one generated token)")
    if not (isinstance(utilization, (int, float)) and 0 < utilization <= 1):
        raise ValueError(f"utilization must be a fraction of the card's memory in (0, 1], got {utilization!r}")


def _config(model: Any) -> tuple[Any, str]:
    """(config, name) for a built-in name with or without ``hf:``, ``hf:path/config.json`` or an
    id in the local Hugging Face cache, or a config object."""
    if isinstance(model, str):
        key = model.strip().removeprefix(hf_configs.HF_PREFIX)
        if hf_configs.names_local_config(key):
            return hf_configs.local_config(key), key
        return hf_configs.config_and_name(key)
    return hf_configs.config_and_name(model)


@follows_card   # the fake runs follow the card's kernels (compute capability: attention kernel)
def serve(model: Any, gpu: str | Card | int, *, context_len: int, batch: int = 1, dtype: str | torch.dtype = "bf16",
          weights: str | None = None, kv_dtype: str | None = None, block_size: int = 16, utilization: float = 0.9,
          context_bytes: int | None = None, module_loading: str = "lazy", progress: Progress = None) -> ServeResult:
    """Serving ``model`` (a built-in config name or a transformers config) on ``gpu`` at
    ``context_len`` tokens per sequence (prompt and output together), ``batch`` sequences at
    once: see the module docstring. ``weights``: None (``dtype``), "int8" or "int4" / "nf4";
    ``kv_dtype``: None (``dtype``), "bf16", "fp16", "fp32" or "fp8". ``context_bytes``: the CUDA
    context's size, by default the assumption for ``module_loading`` (``predict.context``).
    ``progress(fraction, text)``: told before each fake run (``predict.progress``)."""
    t0 = time.perf_counter()
    assumed = context_assumption(module_loading)
    context_bytes = assumed.nbytes if context_bytes is None else context_bytes
    _check(context_len, batch, block_size, utilization)
    if weights is not None and weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)} or left out (the dtype's own), got {weights!r}")
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    card = gpu if isinstance(gpu, Card) else parse_gpu(gpu)
    config, shown = _config(model)
    if hf_configs.task_of(config) != "causal-lm":
        raise ValueError(f"{shown} is trained as a {hf_configs.task_of(config)}: serving here is generating text "
                         f"with a causal language model (hf:llama-3-8b, hf:qwen2.5-7b ...)")
    longest = hf_configs.max_positions(config)
    if longest and context_len > longest:
        raise ValueError(f"{shown} takes {longest:,} positions; a context of {context_len:,} tokens is longer: "
                         f"ask for {longest:,} or fewer")
    dt = parse_dtype(dtype)
    kind = WEIGHTS.get(weights) if weights else None
    report(progress, 0.1, f"fake run of one sequence: prefill of {context_len - 1:,} tokens and decode steps on "
           f"fake tensors (CUDA's kernels)")
    one = generation_peak(config, prompt_len=context_len - 1, new_tokens=2, batch=1, dtype=dt, weights=kind)
    if batch > 1:
        report(progress, 0.5, f"fake run of all {batch} sequences at once: prefill and decode steps")
    everyone = one if batch == 1 else generation_peak(config, prompt_len=context_len - 1, new_tokens=2, batch=batch,
                                                      dtype=dt, weights=kind)
    per_token_model = kv_bytes_per_token(config, dt.itemsize)
    per_token = kv_bytes_per_token(config, KV_DTYPES[kv_dtype]) if kv_dtype else per_token_model
    kv = per_token * context_len * batch
    # the measured cache holds context_len tokens in the model's dtype: a KV dtype of its own, by formula
    decode = everyone.decode_peak_bytes - everyone.cache_bytes + kv
    return ServeResult(shown, card.name, card.reported_total_bytes, context_bytes, context_len, batch, dtype_name(dt),
                       kind or dtype_name(dt), kv_dtype or dtype_name(dt), one.weights_bytes, per_token, kv,
                       one.prefill_peak_bytes, everyone.prefill_peak_bytes, decode, float(utilization), block_size,
                       time.perf_counter() - t0,
                       kv_label=LABEL_FAKE_CUDA if per_token == per_token_model
                       else f"{LABEL_FAKE_CUDA}, the cache at {kv_dtype} by formula", module_loading=module_loading,
                       capacity_note=card.total_text, workspace_bytes=card.workspace_bytes(training=False),
                       kernels=current_target().note(), label=f"{LABEL_FAKE_CUDA}; {current_target().note()}")
