"""``gpulab.serve``: will this model serve on this card, at this context length, this many
sequences at once?

Measured on fake tensors at full size (``predict.generation``: the model's real forward, CUDA's
kernels): the weights (in the dtype, or weight-only int8 / NF4 as bitsandbytes stores them), the
prefill's peak of one sequence at a time and of the whole batch at once, and the last decode step's
peak with every sequence's KV cache at the full context. The KV cache is what transformers' own cache
objects hold on those fake tensors (``predict.kv_layout`` says it layer by layer, and names the
assumption in every answer): a sliding-window layer min(context, window) positions (Gemma-2/3,
Mistral: transformers' ``DynamicSlidingWindowLayer``), an MLA layer (DeepSeek-V2/V3) the compressed
latent and the rope key, every other layer every position. An fp8 cache is measured too, where
transformers has one (``QuantizedCache("fp8")``: float8_e4m3fn states, a float32 scale per tensor,
full-attention models only); a KV dtype it cannot measure is applied to the measured decode step
by formula, labelled so. NB: transformers' sliding layer keeps a view of its last concatenation, so
right after a prompt longer than the window it still holds the whole prompt until its first decode
step (the prefill's and first decode step's peaks include it; ``kv_cache_bytes`` is after that step).

Beside it, paged serving as vLLM sizes it (formula, labelled): vLLM asks for
``gpu_memory_utilization`` of the card's memory, keeps the weights, the peak of a profiling
forward and what lives outside PyTorch (the CUDA context), and cuts the rest into blocks of
``block_size`` tokens of every layer's keys and values; a sequence of the context length takes
ceil(context / block_size) blocks in each full layer and no more than its window's in a sliding
one (``kv_layout.KVLayout.vllm_bytes``, vllm/v1/kv_cache_interface.py); an MLA layer's page is one
latent of kv_lora_rank + qk_rope_head_dim per token (``MLAAttentionSpec``). Here the profiling
forward is the prefill of one sequence, and what lives outside PyTorch is the CUDA context alone:
vLLM's budget (vllm/v1/worker/gpu_worker.py ``determine_available_memory``:
``self.requested_memory - profile_result.non_kv_cache_memory``, less ``cudagraph_memory_estimate_applied`` where VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS is on)
also subtracts the other non-torch memory it sees grow (NCCL buffers, ...) and the CUDA graphs'
estimate, so the block count here is an upper bound. vLLM's chunked prefill packs a token budget
(``max_num_batched_tokens``) across requests each step rather than one prompt at a time.

``longest_context``: the longest context that fits a card and a batch, each context it tries a
``serve`` answer (measured), the assumption named in its answer.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from gpulab.measure.engines import LABEL_FORMULA, LABEL_FAKE_CUDA
from gpulab.models import hf_configs
from gpulab.measure.cuda_card import current_target
from gpulab.predict.cards import Card, as_card, follows_card
from gpulab.predict.context import context_assumption, context_label
from gpulab.predict.generation import generation_peak
from gpulab.predict.kv_layout import KVLayout, kv_layout
from gpulab.training.routing import is_moe, stated_routing
from gpulab.predict.search import largest_fitting
from gpulab.predict.progress import Progress, report
from gpulab.units import dtype_name, format_bytes, parse_dtype

__all__ = ["KV_DTYPES", "LongestContext", "ServeResult", "kv_bytes_per_token", "longest_context", "serve"]

KV_DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
WEIGHTS = {"int8": "int8", "int4": "nf4", "nf4": "nf4"}   # int4: bitsandbytes' 4-bit (NF4) layout


def kv_bytes_per_token(config: Any, nbytes: int) -> int:
    """One token of one sequence in every layer that caches it, while every layer still grows (below
    any window): 2 · layers · KV heads · head dim · bytes (``formulas.kv_cache_bytes``), MLA's latent
    and rope key per layer instead of K and V (``predict.kv_layout``)."""
    return kv_layout(config).per_token_bytes(nbytes)


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
    kv_assumption: str = ""       # which layers slide, the window, MLA latent or K and V, the KV dtype (kv_layout)
    kv_all_global_bytes: int = 0  # the same cache if every layer kept every position (formula)
    vllm_sequence_bytes: int = 0  # one sequence's pages at the context in vLLM (formula; 0: kv_per_token_bytes's)
    positions_note: str = ""      # the assumption when the context is past the config's positions (rotary only)
    experts_note: str = ""        # a mixture of experts: how its experts ran (training.routing.stated_routing's label)
    time: Any = None              # predicted prefill and decode times (predict.serve_time.ServeTime)
    time_note: str = ""           # why there is none

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
        """Sequences of the full context that fit in those blocks at once (a sliding layer takes no
        more pages than its window's: ``vllm_sequence_bytes``)."""
        pages = self.vllm_sequence_bytes or (math.ceil(self.context_len / self.block_size) * self.block_size
                                             * self.kv_per_token_bytes)
        return self.paged_blocks * self.block_size * self.kv_per_token_bytes // pages

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["time"] = None if self.time is None else self.time.as_dict()
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
                 format_bytes(self.kv_cache_bytes), f"{self.kv_label}; {self.kv_assumption}"],
                ["KV cache if no layer slid", format_bytes(self.kv_all_global_bytes), LABEL_FORMULA],
                *([["past the config's positions", "", self.positions_note]] if self.positions_note else []),
                *([["experts", "", self.experts_note]] if self.experts_note else []),
                ["prefill, one sequence at a time (peak)", format_bytes(self.prefill_one_bytes), self.label],
                ["prefill, all at once (peak)", format_bytes(self.prefill_all_bytes), self.label],
                ["last decode step (peak)", format_bytes(self.decode_bytes), self.kv_label],
                ["usable (card − CUDA context − cuBLAS workspace)", format_bytes(self.usable_bytes),
                 context_label(self.context_bytes, self.module_loading)
                 + f"; cuBLAS workspace {format_bytes(self.workspace_bytes)} by formula"],
                [f"vLLM-style: blocks of {self.block_size} tokens at {self.utilization:.0%}",
                 f"{self.paged_blocks:,} blocks: {self.max_sequences} sequences", self.paged_label]]
        return html_table(["", "bytes", "source"], rows, repr(self))


def _beyond_positions(config: Any, shown: str, context_len: int) -> str:
    """"" when the context is within the config's ``max_position_embeddings``; past it, the assumption
    the answer then names (rotary positions are computed for any position, so the memory is that
    context's) or, for a learned position table, a one-line error."""
    longest = hf_configs.max_positions(config)
    if not longest or context_len <= longest:
        return ""
    if not hf_configs.rotary_positions(config):
        raise ValueError(f"{shown} takes {longest:,} positions (a learned position table); a context of "
                         f"{context_len:,} tokens is longer: ask for {longest:,} or fewer")
    return (f"{context_len:,} tokens is past the {longest:,} positions {shown}'s config gives: its rotary positions "
            f"extend, so this is that context's memory; whether the model's output holds there (without RoPE "
            f"scaling or long-context training) is not a memory question")


def _check(context_len: int, batch: int, block_size: int, utilization: float) -> None:
    for name, value in (("context_len", context_len), ("batch", batch), ("block_size", block_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive whole number, got {value!r}")
    if context_len < 2:
        raise ValueError("context_len must be at least 2 tokens (a prompt and one generated token)")
    if not (isinstance(utilization, (int, float)) and 0 < utilization <= 1):
        raise ValueError(f"utilization must be a fraction of the card's memory in (0, 1], got {utilization!r}")


def _kv_plan(layout: KVLayout, dt: torch.dtype, kv_dtype: str | None) -> tuple[str, int, str]:
    """(the transformers cache the fake runs measure, bytes per KV element, the KV cache's label):
    the model's dtype and fp8 are measured in transformers' own cache objects; fp8 on a model with
    sliding layers (transformers' fp8 cache refuses them) and any other KV dtype are by formula."""
    what = ("transformers' MLA latent cache" if layout.mla else "transformers' DynamicCache"
            + (" with its sliding-window layers" if layout.sliding_layers else ""))
    if kv_dtype is None or (kv_dtype != "fp8" and KV_DTYPES[kv_dtype] == dt.itemsize):
        return "dynamic", dt.itemsize, f"{LABEL_FAKE_CUDA}: {what}"
    if kv_dtype == "fp8" and not layout.sliding_layers:
        return "fp8", 1, (f"{LABEL_FAKE_CUDA}: transformers' QuantizedCache('fp8'), float8_e4m3fn states and a "
                          f"float32 scale per layer's keys and per layer's values")
    why = " (transformers' fp8 cache takes full-attention models only)" if kv_dtype == "fp8" else ""
    return "dynamic", KV_DTYPES[kv_dtype], f"{LABEL_FAKE_CUDA}, the cache at {kv_dtype} by formula{why}"


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
          context_bytes: int | None = None, module_loading: str = "lazy", progress: Progress = None,
          predict_time: bool = True) -> ServeResult:
    """Serving ``model`` (a built-in config name or a transformers config) on ``gpu`` at
    ``context_len`` tokens per sequence (prompt and output together), ``batch`` sequences at
    once: see the module docstring. ``weights``: None (``dtype``), "int8" or "int4" / "nf4";
    ``kv_dtype``: None (``dtype``), "bf16", "fp16", "fp32" or "fp8". ``context_bytes``: the CUDA
    context's size, by default the assumption for ``module_loading`` (``predict.context``).
    ``progress(fraction, text)``: told before each fake run (``predict.progress``). ``predict_time``: the
    prefill's and a decode step's predicted times from the whole batch's run (``predict.serve_time``), where
    the card has speed figures."""
    t0 = time.perf_counter()
    assumed = context_assumption(module_loading)
    context_bytes = assumed.nbytes if context_bytes is None else context_bytes
    _check(context_len, batch, block_size, utilization)
    if weights is not None and weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)} or left out (the dtype's own), got {weights!r}")
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    card = as_card(gpu)   # a name, a size, a Card or a positive number of bytes, as fit takes it
    if not isinstance(context_bytes, int) or isinstance(context_bytes, bool) or context_bytes < 0:
        raise ValueError(f"context_bytes (--cuda-context) must be a whole number of bytes, 0 or more, got "
                         f"{context_bytes!r}")
    config, shown = _config(model)
    hf_configs.check_settings(config, shown)
    if hf_configs.task_of(config) != "causal-lm":
        raise ValueError(f"{shown} is trained as a {hf_configs.task_of(config)}: serving here is generating text "
                         f"with a causal language model (hf:llama-3-8b, hf:qwen2.5-7b ...)")
    positions_note = _beyond_positions(config, shown, context_len)
    dt = parse_dtype(dtype)
    kind = WEIGHTS.get(weights) if weights else None
    layout = kv_layout(config)
    cache, nbytes, kv_label = _kv_plan(layout, dt, kv_dtype)
    report(progress, 0.1, f"fake run of one sequence: prefill of {context_len - 1:,} tokens and decode steps on "
           f"fake tensors (CUDA's kernels)")
    from gpulab.predict.plan_time import speed_or_why
    speed, time_note = speed_or_why(card) if predict_time else (None, "")
    timer: list | None = [] if speed is not None else None
    one = generation_peak(config, prompt_len=context_len - 1, new_tokens=2, batch=1, dtype=dt, weights=kind,
                          kv_cache=cache, beyond_positions=bool(positions_note), timer=timer if batch == 1 else None)
    if batch > 1:
        report(progress, 0.5, f"fake run of all {batch} sequences at once: prefill and decode steps")
    everyone = one if batch == 1 else generation_peak(config, prompt_len=context_len - 1, new_tokens=2, batch=batch,
                                                      dtype=dt, weights=kind, kv_cache=cache,
                                                      beyond_positions=bool(positions_note), timer=timer)
    measured = kv_label.startswith(LABEL_FAKE_CUDA + ":")
    kv = everyone.cache_bytes if measured else layout.bytes(context_len, batch, nbytes)
    # a KV dtype transformers' cache could not be measured in: the measured decode step with the formula's cache
    decode = everyone.decode_peak_bytes - everyone.cache_bytes + kv
    timed = None
    if timer:
        from gpulab.predict.serve_time import serve_time
        try:
            timed = serve_time(timer[0].ops, speed, batch, context_len - 1, one.weights_bytes, kv)
        except ValueError as why:   # a dtype the card has no peak for (a T4 in bf16)
            time_note = str(why)
    return ServeResult(shown, card.name, card.reported_total_bytes, context_bytes, context_len, batch, dtype_name(dt),
                       kind or dtype_name(dt), kv_dtype or dtype_name(dt), one.weights_bytes,
                       layout.per_token_bytes(nbytes), kv, one.prefill_peak_bytes, everyone.prefill_peak_bytes, decode,
                       float(utilization), block_size, time.perf_counter() - t0, kv_label=kv_label,
                       module_loading=module_loading, capacity_note=card.total_text,
                       workspace_bytes=card.workspace_bytes(training=False),
                       kv_assumption=layout.assumption(kv_dtype or dtype_name(dt)), positions_note=positions_note,
                       experts_note=stated_routing(None, config).label if is_moe(config) else "",
                       kv_all_global_bytes=layout.all_global_bytes(context_len, batch, nbytes),
                       vllm_sequence_bytes=layout.vllm_bytes(context_len, 1, nbytes, block_size),
                       kernels=current_target().note(), label=f"{LABEL_FAKE_CUDA}; {current_target().note()}",
                       time=timed, time_note=time_note)


@dataclass
class LongestContext:
    """``longest_context``'s answer: the longest context (prompt and output together) that fits
    ``batch`` sequences on the card, the serving answer there and, where it is not the model's own
    limit, the one a token longer that does not fit."""
    model: str
    card: str
    batch: int
    context_len: int               # 0: not even 2 tokens fit
    limit: str                     # "memory" or "the model's positions (N)"
    at: ServeResult | None         # the answer at context_len
    beyond: ServeResult | None     # the answer at context_len + 1 (None at the model's limit)
    runs: int                      # serving answers computed (each one or two fake runs)

    @property
    def assumption(self) -> str:
        return self.at.kv_assumption if self.at else ""

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "card": self.card, "batch": self.batch, "context_len": self.context_len,
                "limit": self.limit, "runs": self.runs, "assumption": self.assumption,
                "at": self.at.as_dict() if self.at else None,
                "beyond": self.beyond.as_dict() if self.beyond else None}

    def __repr__(self) -> str:
        return (f"LongestContext({self.model} on {self.card}: {self.batch} × {self.context_len:,} tokens, "
                f"limited by {self.limit}; {self.assumption})")

    def _repr_html_(self) -> str:
        from gpulab.views import html_table
        rows = [[f"{r.context_len:,} tokens", "fits" if r.fits else "does not fit",
                 format_bytes(r.needed_one_at_a_time_bytes), format_bytes(r.usable_bytes), r.label]
                for r in (self.at, self.beyond) if r is not None]
        return html_table(["context", "", "needed", "usable", "source"], rows, repr(self))


def _secant_bracket(at, first: int, longest: int | None, steps: int = 5) -> tuple[int | None, int | None]:
    """(the longest context seen to fit, the shortest seen not to) after a few secant steps on
    needed − usable bytes over the context, from ``first`` and twice it (the model's limit bounds
    every try): what the bisection then narrows."""
    lo = hi = None
    points: list[tuple[int, int]] = []
    context = first
    for _ in range(steps):
        r = at(context)
        points.append((context, r.needed_one_at_a_time_bytes - r.usable_bytes))
        if r.fits:
            lo = context if lo is None else max(lo, context)
        else:
            hi = context if hi is None else min(hi, context)
        if (lo is not None and hi is not None and hi - lo <= 1) or (longest and lo == longest):
            break
        if len(points) == 1:
            guess = 2 * context if r.fits else max(2, context // 2)
        else:
            (c0, e0), (c1, e1) = points[-2], points[-1]
            guess = c1 - e1 * (c1 - c0) / (e1 - e0) if e1 != e0 else 2 * c1
        low, high = (lo or 1) + 1, (hi or (longest + 1 if longest else 1 << 24)) - 1
        if low > high:
            break
        context = min(max(int(guess), low), high)
        if context in (c for c, _ in points):
            break
    return lo, hi


def longest_context(model: Any, gpu: str | Card | int, *, batch: int = 1, start: int = 1024,
                    progress: Progress = None, **kwargs: Any) -> LongestContext:
    """The longest context (prompt and output together, tokens per sequence) at which ``batch``
    sequences of ``model`` serve on ``gpu``: the largest ``context_len`` whose ``serve`` answer
    fits (one sequence's prefill at a time, then every sequence's decode step, in the usable
    memory), every answer measured on fake tensors at full size. ``kwargs``: ``serve``'s (dtype,
    weights, kv_dtype, ...). The search: ``serve`` at ``start`` tokens and at twice it, a few
    secant steps on the measured bytes over the context (``_secant_bracket``), then gallop and
    bisect (``predict.search.largest_fitting``), each context tried once; the model's position
    limit bounds it. NB: assumes the answer grows with the context (the cache, the prefill's
    activations)."""
    config, shown = _config(model)
    card = as_card(gpu)
    longest = hf_configs.max_positions(config)
    answers: dict[int, ServeResult] = {}

    def at(context: int) -> ServeResult:
        if context not in answers:
            report(progress, min(0.95, 0.05 * (len(answers) + 1)), f"serving {batch} × {context:,} tokens")
            answers[context] = serve(model, card, context_len=context, batch=batch, **kwargs)
        return answers[context]

    lo, hi = _secant_bracket(at, max(2, min(start, longest or start)), longest)
    if hi is not None and lo is not None and hi - lo <= 1:
        found = lo
    else:
        upper = hi if hi is not None else (longest + 1 if longest else None)
        found = largest_fitting(max(2, lo or 2), lambda c: c >= 2 and at(c).fits, upper=upper, limit=1 << 24)
    if found < 2:
        return LongestContext(shown, card.name, batch, 0, "memory", None, at(2), len(answers))
    at_model_limit = longest is not None and found == longest
    limit = f"the model's positions ({longest:,})" if at_model_limit else "memory"
    return LongestContext(shown, card.name, batch, found, limit, at(found), None if at_model_limit else at(found + 1),
                          len(answers))
