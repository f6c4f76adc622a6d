"""The memory of generating text with a causal language model: ``generation_peak``.

What ``model.generate()`` holds at its two high points, measured on fake tensors (CUDA target) with
the model's real forward at full size:

* the **prefill**: one forward of the whole prompt with an empty ``DynamicCache``, only the last
  position's logits kept (``logits_to_keep=1``, as generate asks), and generate's float32 copy of
  them (``generation/utils.py``, ``_sample``: ``outputs.logits[:, -1, :].to(copy=True,
  dtype=torch.float32)``);
* the **last decode step**: one token per sequence against a cache of ``prompt_len + new_tokens -
  2`` tokens, where the cache is largest. A ``DynamicCache`` layer grows by ``torch.cat``: the new
  storage is made while the old one still lives, so that step also holds one layer's old keys
  and values.

No attention mask is passed: generate's all-ones mask lets transformers' SDPA path skip building the
causal mask on a GPU (``masking_utils._ignore_causal_mask_sdpa`` reads the mask's values), which it
cannot see on fake tensors, where it would build a (prompt × prompt) mask the GPU run never holds.

The decode steps in between are not run one by one (a 2,048-token generation would be 2,047
forwards): the cache is filled to its last length between the two measured windows, and that fill
is not part of either window; it leaves each layer as the decode steps would (a sliding-window layer
keeps its window, ``predict.kv_layout``). ``peak_bytes`` is the larger of the two windows' peaks: what
``torch.cuda.max_memory_allocated`` reports for the whole generation, up to the allocator's rounding
and the attention kernel's workspace (``measure.fake_cuda.STILL_DIFFERS``).

The cache is transformers' own: ``DynamicCache(config=...)`` (its sliding-window layers where the
config marks them; DeepSeek's MLA layers cache the latent) or, with ``kv_cache="fp8"``, its
``QuantizedCache("fp8")``. NB: a sliding layer saves nothing at the prefill: after a prompt longer
than its window it keeps a view of the prefill's whole concatenation (``prefill_cache_bytes``) until
its first decode step replaces it with the window.
"""
from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from gpulab.measure.engines import Measured, Measurement, RunContext, run
from gpulab.models import hf_configs
from gpulab.models.adapt import quantized_build
from gpulab.training.routing import install_routing
from gpulab.models.quantized import QUANTIZATIONS
from gpulab.predict.kv_layout import kv_layout
from gpulab.units import dtype_name, parse_dtype

__all__ = ["GenerationPeak", "KV_CACHES", "cache_keyword", "fp8_cache_exists", "generation_peak"]

KV_CACHES = ("dynamic", "fp8")   # transformers' DynamicCache, its QuantizedCache("fp8")


@dataclass
class GenerationPeak(Measured):
    """``generation_peak``'s answer: bytes at the prefill's and the last decode step's peaks."""
    model: str
    prompt_len: int
    new_tokens: int
    batch: int
    dtype: str
    weights_bytes: int
    cache_bytes: int          # the KV cache at the last decode step (after it grew)
    prefill_peak_bytes: int
    decode_peak_bytes: int
    measurement: Measurement
    kv_cache: str = "dynamic"   # transformers' cache class measured: "dynamic" or "fp8" (KV_CACHES)
    # the cache right after the prefill: a sliding layer still holds the whole prompt's storage there
    # (DynamicSlidingWindowLayer keeps a view of the prefill's concatenation until its next update)
    prefill_cache_bytes: int = 0

    @property
    def peak_bytes(self) -> int:   # the whole generation's (the tracker's own peak includes the fill)
        return max(self.prefill_peak_bytes, self.decode_peak_bytes)

    @property
    def peak_at(self) -> str:
        return "prefill" if self.prefill_peak_bytes >= self.decode_peak_bytes else "last decode step"

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "prompt_len": self.prompt_len, "new_tokens": self.new_tokens,
                "batch": self.batch, "dtype": self.dtype, "weights_bytes": self.weights_bytes,
                "cache_bytes": self.cache_bytes, "prefill_peak_bytes": self.prefill_peak_bytes,
                "decode_peak_bytes": self.decode_peak_bytes, "peak_bytes": self.peak_bytes,
                "peak_at": self.peak_at, "kv_cache": self.kv_cache,
                "prefill_cache_bytes": self.prefill_cache_bytes, "label": self.label}

    def __repr__(self) -> str:
        return (f"GenerationPeak({self.model}, prompt {self.prompt_len:,} + {self.new_tokens:,} new tokens × "
                f"{self.batch}: peak {self.peak_bytes:,} B at the {self.peak_at})")


def cache_keyword(fn) -> str:
    """The keyword a transformers call takes the KV cache by: ``cache`` where transformers has
    renamed it (5.x: the old ``past_key_values`` still works there, with a FutureWarning, until
    it is removed), ``past_key_values`` before. ``generate`` forwards its keyword arguments to
    ``prepare_inputs_for_generation``: ask that one for generate."""
    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"


def _layer_tensors(layer) -> list[torch.Tensor]:
    """Every tensor a transformers cache layer holds: its keys and values, and a quantized layer's
    stored states and scales (``Fp8QuantizedLayer._quantized_keys``: (float8 states, scale))."""
    out = [t for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor)]
    for q in (getattr(layer, "_quantized_keys", None), getattr(layer, "_quantized_values", None)):
        out += [t for t in (q if isinstance(q, tuple) else (q,)) if isinstance(t, torch.Tensor)]
    return out


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storages under ``tensors``, each storage once (a sliding layer's keys are a
    view of a longer storage: the storage is what the allocator holds)."""
    seen: dict[int, int] = {}
    for t in tensors:
        seen[id(t.untyped_storage())] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _fill(cache, batch: int, fill: int) -> None:
    """Add ``fill`` positions to every layer as the decode steps between the two measured windows
    would: in one update, then the last position alone, so that a sliding layer is left as a decode
    step leaves it (``window - 1`` kept positions, a view of a ``window``-position storage) rather
    than as a view of one long concatenation. Shapes follow the layer's own states (MLA's keys and
    values differ in their last dimension; an FP8 layer keeps them in ``_quantized_keys``)."""
    if fill <= 0:
        return
    for i, layer in enumerate(cache.layers):
        states = [getattr(layer, "_quantized_keys", None), getattr(layer, "_quantized_values", None)]
        keys, values = (s[0] for s in states) if states[0] is not None else (layer.keys, layer.values)
        if keys is None or keys.dim() != 4:
            continue
        dtype = layer.keys.dtype
        for n in ((fill - 1, 1) if fill > 1 else (1,)):
            cache.update(torch.empty((batch, keys.shape[1], n, keys.shape[-1]), dtype=dtype),
                         torch.empty((batch, values.shape[1], n, values.shape[-1]), dtype=dtype), i)


def _experiment(config, prompt_len: int, new_tokens: int, batch: int, dtype: torch.dtype, weights: str | None,
                kv_cache: str = "dynamic", timer: list | None = None):
    def experiment(ctx: RunContext) -> dict[str, Any]:
        import transformers
        with ctx.phase("setup"), torch.device(ctx.device):
            model = (quantized_build(lambda: hf_configs.build_causal_lm(config, dtype), weights) if weights
                     else hf_configs.build_causal_lm(config, dtype))
            model.eval()
            install_routing(model, None)   # a mixture of experts: transformers' grouped_mm as is, eager experts balanced
            ctx.tracker.register(model)
            vocab = hf_configs.vocab_size(config)
            cache = (transformers.QuantizedCache("fp8", config) if kv_cache == "fp8"
                     else transformers.DynamicCache(config=config))
        kwargs: dict[str, Any] = {cache_keyword(model.forward): cache, "use_cache": True}
        if "logits_to_keep" in inspect.signature(model.forward).parameters:
            kwargs["logits_to_keep"] = 1
        with torch.no_grad():
            start = ctx.mark()
            with ctx.phase("forward"), torch.device(ctx.device):
                ids = ctx.label(torch.randint(0, vocab, (batch, prompt_len)))
                out = model(input_ids=ids, **kwargs)
                scores = out.logits[:, -1, :].to(copy=True, dtype=torch.float32)
                del out, scores
            prefill_end = ctx.mark()
            if timer:   # the decode step is the timer's next step (predict.timing.OpTimer.new_step)
                timer[0].new_step()
            after_prefill = sum(_storage_bytes(_layer_tensors(layer)) for layer in cache.layers)
            last = prompt_len + new_tokens - 1           # tokens the cache holds after the last step
            fill = last - 1 - prompt_len                  # what the decode steps before it added
            with ctx.phase("setup"), torch.device(ctx.device):
                _fill(cache, batch, fill)
            decode_start = ctx.mark()
            with ctx.phase("forward"), torch.device(ctx.device):
                step = ctx.label(torch.randint(0, vocab, (batch, 1)))
                out = model(input_ids=step, **kwargs)
                scores = out.logits[:, -1, :].to(copy=True, dtype=torch.float32)
                del out, scores
        weights_bytes = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()])
        cache_bytes = sum(_storage_bytes(_layer_tensors(layer)) for layer in cache.layers)
        return {"marks": (start, prefill_end, decode_start), "weights": weights_bytes, "cache": cache_bytes,
                "after_prefill": after_prefill}
    return experiment


def fp8_cache_exists() -> bool:
    """Whether this transformers has ``QuantizedCache("fp8")`` (``cache_utils.Fp8QuantizedLayer``;
    5.15, Colab's, has the quanto and hqq backends only)."""
    import transformers.cache_utils
    return hasattr(transformers.cache_utils, "Fp8QuantizedLayer")


def generation_peak(model: Any, *, prompt_len: int, new_tokens: int, batch: int = 1,
                    dtype: str | torch.dtype = "bf16", attn_implementation: str | None = None,
                    weights: str | None = None, kv_cache: str = "dynamic",
                    beyond_positions: bool = False, timer: list | None = None) -> GenerationPeak:
    """The peak of generating ``new_tokens`` tokens (at least 2) after a prompt of ``prompt_len``
    for ``batch`` sequences: a built-in config name (``"hf:qwen2.5-7b"``) or a transformers config,
    its weights in ``dtype``, measured on fake tensors following CUDA's kernels (module docstring).
    ``attn_implementation``: the config's (None) or e.g. ``"eager"``, ``"sdpa"``. ``weights``: "nf4"
    or "int8" stores the linear layers but the head as bitsandbytes does (weight-only quantization,
    ``models.quantized``), computing in ``dtype``. ``kv_cache``: "dynamic" (transformers'
    ``DynamicCache(config=...)``: sliding layers as the config marks them) or "fp8" (transformers'
    ``QuantizedCache("fp8", config)``: float8_e4m3fn states with a per-tensor float32 scale, every
    layer dequantized whole to ``dtype`` in its forward; transformers takes it for models with full
    attention only). ``beyond_positions``: measure past the config's ``max_position_embeddings``
    where the model's positions are rotary (``hf_configs.rotary_positions``), as ``serve`` does with
    that assumption named; a learned position table is always refused there. ``timer``: a list the run's
    ``predict.timing.OpTimer`` is appended to (the prefill is its step 1, the decode step its step 2)."""
    if kv_cache not in KV_CACHES:
        raise ValueError(f"kv_cache must be one of {', '.join(KV_CACHES)}, got {kv_cache!r}")
    if weights is not None and weights not in QUANTIZATIONS:
        raise ValueError(f"weights must be one of {', '.join(QUANTIZATIONS)} or None (the dtype's own), got {weights!r}")
    for name, value, low in (("prompt_len", prompt_len, 1), ("new_tokens", new_tokens, 2), ("batch", batch, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be a whole number of at least {low}, got {value!r}")
    config, shown = hf_configs.config_and_name(model)
    config = copy.deepcopy(config)   # a fresh one for a name; the caller's stays untouched
    config.use_cache = True
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    longest = hf_configs.max_positions(config)
    beyond = beyond_positions and hf_configs.rotary_positions(config)
    if longest and prompt_len + new_tokens - 1 > longest and not beyond:   # the last token is never fed back
        raise ValueError(f"{shown} takes {longest:,} positions; prompt_len + new_tokens - 1 is "
                         f"{prompt_len + new_tokens - 1:,}: ask for fewer tokens")
    if kv_cache == "fp8" and kv_layout(config).sliding_layers:
        raise ValueError(f"{shown} has sliding-window layers: transformers' fp8 QuantizedCache takes models with "
                         f"full attention only; ask for kv_cache='dynamic'")
    if kv_cache == "fp8" and not fp8_cache_exists():
        import transformers
        raise ValueError(f"transformers {transformers.__version__} has no fp8 QuantizedCache (its backends: quanto, "
                         f"hqq): ask for kv_cache='dynamic', or install a newer transformers")
    dt = parse_dtype(dtype)
    experiment = _experiment(config, prompt_len, new_tokens, batch, dt, weights, kv_cache, timer)
    if timer is not None:
        from gpulab.predict.timing import timed_experiment
        experiment = timed_experiment(experiment, timer)
    m = run(experiment, "fake", fake_target="cuda")
    if m.oom or m.tracking is None:
        raise MemoryError(m.error or "the generation did not run")
    start, prefill_end, decode_start = m.value["marks"]
    prefill_peak, _, _ = m.tracking.peak_between(start, prefill_end)
    decode_peak, _, _ = m.tracking.peak_between(decode_start)
    return GenerationPeak(shown, prompt_len, new_tokens, batch, dtype_name(dt), m.value["weights"], m.value["cache"],
                          prefill_peak, decode_peak, m, kv_cache, m.value["after_prefill"])
