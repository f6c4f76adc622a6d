"""Lesson 11, part 2: the memory of generating text, the KV cache.

* ``kv_cache_bytes`` / ``kv_cache_for``: the KV cache formula, 2 · layers · KV heads · head dim ·
  tokens · batch · bytes, for any built-in config or a ``transformers`` config;
  ``attention_variants``: the same cache under multi-head, grouped-query and multi-query attention.
* ``measured_kv_cache``: a real ``generate()`` of a small model with random weights on the cpu
  engine, the cache's bytes read after every forward pass next to the formula (equal, byte for
  byte), and the tracker's peak of the whole generation; ``fake_kv_cache``: one prefill forward
  of a full-size model on fake tensors, its cache against the formula.

Whether serving fits a card, and the longest context: ``gpulab.course.serving``. LoRA and QLoRA,
the lesson's third part, are in ``gpulab.course.lora``.

Results are dataclasses with ``as_dict`` and ``_repr_html_``; nothing here prints. Every number
carries its source label: an engine's (``gpulab.measure.engines.LABEL_*``) or ``formula``.
"""
from __future__ import annotations

import copy
import html
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from gpulab.formulas import kv_cache_bytes  # noqa: F401  (the formula lives in the library)
from gpulab.models import hf_configs
from gpulab.predict.generation import cache_keyword as _cache_keyword
from gpulab.measure.engines import LABEL_FORMULA, Measured, Measurement, RunContext, run
from gpulab.units import dtype_bytes, dtype_name, format_bytes, parse_dtype
from gpulab.views import html_table
from gpulab.course.inplace import validate_positive

__all__ = [
    "AttentionVariants", "CacheRow", "FakeKVCache", "KVCacheSize", "MeasuredKVCache", "VariantRow",
    "attention_shape", "attention_variants", "cache_storage_bytes", "fake_kv_cache", "kv_cache_bytes",
    "kv_cache_for", "measured_kv_cache"
]


# --- configs ---------------------------------------------------------------------------------------

_config = hf_configs.config_and_name   # (a config, a name to show) for a name or a config


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def attention_shape(config_or_name: Any) -> dict[str, Any]:
    """What the KV cache depends on, read off a config: layers, heads, KV heads, head dim, and
    the sliding window when the model has one (None otherwise).

    Names and defaults via ``gpulab.models.hf_configs.config_summary``; the head dim is the config's own
    ``head_dim`` when it has one (LlamaConfig and MistralConfig do), else hidden size / heads,
    as ``LlamaAttention.__init__`` computes it (transformers/models/llama/modeling_llama.py:
    ``getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)``). A sliding
    window counts when the cache would use it: transformers/cache_utils.py
    ``get_layer_types_and_kwargs`` makes a sliding layer for a config with ``sliding_window``
    set, unless its ``layer_types`` say otherwise."""
    config, name = _config(config_or_name)
    s = hf_configs.config_summary(config)
    text = _text_config(config)
    hidden, heads = s["hidden_size"], s["num_heads"]
    head_dim = getattr(text, "head_dim", None)
    if head_dim is None:
        if not hidden or not heads or hidden % heads:
            raise ValueError(f"cannot read a head dimension off {name}: hidden size {hidden}, {heads} heads")
        head_dim = hidden // heads
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if window is not None and layer_types is not None and "sliding_attention" not in set(layer_types):
        window = None
    return {"model": name, "layers": int(s["num_layers"]), "heads": int(heads), "kv_heads": int(s["num_kv_heads"]),
            "head_dim": int(head_dim), "hidden_size": int(hidden), "intermediate_size": int(s["intermediate_size"]),
            "vocab_size": int(s["vocab_size"]), "max_positions": s["max_positions"],
            "sliding_window": int(window) if window else None}


# --- the KV cache formula -------------------------------------------------------------------------

@dataclass(frozen=True)
class KVCacheSize:
    """The KV cache of one model at one length and batch (``kv_cache_for``)."""
    model: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    seq_len: int
    batch: int
    dtype: str
    dtype_bytes: int
    bytes: int
    sliding_window: int | None = None
    label: str = LABEL_FORMULA

    @property
    def per_token_bytes(self) -> int:
        """One more token of one sequence: 2 · layers · kv_heads · head_dim · bytes."""
        return kv_cache_bytes(self.layers, self.kv_heads, self.head_dim, 1, 1, self.dtype_bytes)

    @property
    def windowed_bytes(self) -> int:
        """The formula at min(seq_len, sliding window) tokens: what a sliding-window model keeps.
        NB: transformers' ``DynamicSlidingWindowLayer.update`` keeps a *view* of the last
        ``sliding_window - 1`` tokens of the concatenated states, so the storage behind it holds
        up to one window (more right after a prefill longer than the window)."""
        n = self.seq_len if self.sliding_window is None else min(self.seq_len, self.sliding_window)
        return kv_cache_bytes(self.layers, self.kv_heads, self.head_dim, n, self.batch, self.dtype_bytes)

    @property
    def formula(self) -> str:
        return (f"2 × {self.layers} layers × {self.kv_heads} KV heads × {self.head_dim} head dim × "
                f"{self.seq_len:,} tokens × batch {self.batch} × {self.dtype_bytes} B")

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "layers": self.layers, "heads": self.heads, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "seq_len": self.seq_len, "batch": self.batch, "dtype": self.dtype,
                "dtype_bytes": self.dtype_bytes, "bytes": self.bytes, "per_token_bytes": self.per_token_bytes,
                "sliding_window": self.sliding_window, "windowed_bytes": self.windowed_bytes,
                "formula": self.formula, "label": self.label}

    def __repr__(self) -> str:
        return f"KVCacheSize({self.model}, {self.seq_len:,} tokens × {self.batch}, {self.dtype}: {self.bytes:,} B)"

    def _repr_html_(self) -> str:
        rows = [["KV cache", format_bytes(self.bytes), self.formula],
                ["per token of one sequence", format_bytes(self.per_token_bytes), ""]]
        if self.sliding_window is not None:
            rows.append([f"within the {self.sliding_window:,}-token sliding window", format_bytes(self.windowed_bytes),
                         f"min({self.seq_len:,}, {self.sliding_window:,}) tokens"])
        return html_table(["", "bytes", "how"], rows, f"{self.model} — {self.label}; binary units")


def kv_cache_for(config_or_name: Any, seq_len: int, batch: int = 1,
                 dtype: str | torch.dtype = "float16") -> KVCacheSize:
    """``kv_cache_bytes`` with the shapes read off a config (``attention_shape``)."""
    validate_positive(seq_len=seq_len, batch=batch)
    a = attention_shape(config_or_name)
    nbytes = dtype_bytes(dtype)
    return KVCacheSize(a["model"], a["layers"], a["heads"], a["kv_heads"], a["head_dim"], seq_len, batch,
                       dtype_name(parse_dtype(dtype)), nbytes,
                       kv_cache_bytes(a["layers"], a["kv_heads"], a["head_dim"], seq_len, batch, nbytes),
                       a["sliding_window"])


# --- MHA, GQA, MQA --------------------------------------------------------------------------------

@dataclass(frozen=True)
class VariantRow:
    variant: str
    kv_heads: int
    bytes: int
    fraction_of_mha: float

    def as_dict(self) -> dict[str, Any]:
        return {"variant": self.variant, "kv_heads": self.kv_heads, "bytes": self.bytes,
                "fraction_of_mha": self.fraction_of_mha}


@dataclass(frozen=True)
class AttentionVariants:
    model: str
    seq_len: int
    batch: int
    dtype: str
    heads: int
    config_kv_heads: int
    rows: list[VariantRow]
    label: str = LABEL_FORMULA

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "seq_len": self.seq_len, "batch": self.batch, "dtype": self.dtype,
                "heads": self.heads, "config_kv_heads": self.config_kv_heads,
                "rows": [r.as_dict() for r in self.rows], "label": self.label}

    def __repr__(self) -> str:
        return "AttentionVariants(" + ", ".join(f"{r.variant}: {r.bytes:,} B" for r in self.rows) + ")"

    def _repr_html_(self) -> str:
        rows = [[r.variant, r.kv_heads, format_bytes(r.bytes), f"{r.fraction_of_mha:.3g}"] for r in self.rows]
        return html_table(["attention", "KV heads", "KV cache", "× multi-head"], rows,
                          f"{self.model}, {self.seq_len:,} tokens × batch {self.batch}, {self.dtype} — {self.label}")


def attention_variants(config_or_name: Any, seq_len: int, batch: int = 1,
                       dtype: str | torch.dtype = "float16") -> AttentionVariants:
    """The cache of the same model under three attention designs, as rows:

    * multi-head (every query head has its own keys and values: kv_heads = heads);
    * grouped-query, the config's own kv_heads (Ainslie et al., "GQA: Training Generalized
      Multi-Query Transformer Models from Multi-Head Checkpoints", 2023, arXiv 2305.13245);
    * multi-query (one key/value head shared by all: Shazeer, "Fast Transformer Decoding: One
      Write-Head is All You Need", 2019, arXiv 1911.02150).

    Only the cache changes here; the projections' weights shrink too (k_proj and v_proj output
    kv_heads · head_dim), which this table does not count."""
    validate_positive(seq_len=seq_len, batch=batch)
    a = attention_shape(config_or_name)
    nbytes = dtype_bytes(dtype)
    mha = kv_cache_bytes(a["layers"], a["heads"], a["head_dim"], seq_len, batch, nbytes)
    own = "grouped-query (this config)" if a["kv_heads"] not in (1, a["heads"]) else \
        f"this config ({'multi-head' if a['kv_heads'] == a['heads'] else 'multi-query'})"
    rows = []
    for variant, kv in (("multi-head", a["heads"]), (own, a["kv_heads"]), ("multi-query", 1)):
        b = kv_cache_bytes(a["layers"], kv, a["head_dim"], seq_len, batch, nbytes)
        rows.append(VariantRow(variant, kv, b, b / mha))
    return AttentionVariants(a["model"], seq_len, batch, dtype_name(parse_dtype(dtype)), a["heads"], a["kv_heads"],
                             rows)


# --- the cache, measured ---------------------------------------------------------------------------

def cache_storage_bytes(cache: Any) -> int:
    """Bytes of the storages behind a ``transformers`` cache's keys and values, each storage
    once (read from the live tensors: ``untyped_storage().nbytes()``). Works on real and fake
    tensors. Reads ``cache.layers[i].keys`` / ``.values`` (transformers/cache_utils.py,
    ``CacheLayerMixin``); a layer that stores nothing has ``None`` there."""
    seen: set[int] = set()
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st._cdata not in seen:
                    seen.add(st._cdata)
                    total += st.nbytes()
    return total


def _with_cache(config_or_name: Any) -> tuple[Any, str]:
    """A copy of the config with ``use_cache=True`` (a config may have it switched off)."""
    config, name = _config(config_or_name)
    config = copy.deepcopy(config)
    config.use_cache = True
    return config, name


def _check_length(a: dict[str, Any], tokens: int) -> None:
    if a["max_positions"] and tokens > a["max_positions"]:
        raise ValueError(f"{tokens:,} tokens is longer than {a['model']} takes ({a['max_positions']:,} positions)")


def _eos_id(config) -> int:
    eos = getattr(_text_config(config), "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return 0 if eos is None else int(eos)


@dataclass(frozen=True)
class CacheRow:
    """The cache after one forward pass of ``generate``: step 0 is the prefill (the prompt),
    each later step one decode forward (one new token)."""
    step: int
    tokens: int               # tokens the cache should hold: prompt + step
    cache_seq_length: int     # what the cache says it holds (``get_seq_length()``)
    measured_bytes: int       # storages behind its keys and values, read from the live tensors
    formula_bytes: int        # kv_cache_bytes at ``tokens``

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens": self.tokens, "cache_seq_length": self.cache_seq_length,
                "measured_bytes": self.measured_bytes, "formula_bytes": self.formula_bytes}


@dataclass
class MeasuredKVCache(Measured):
    """``measured_kv_cache``: the cache per generated token, and the tracker's whole-run view."""
    model: str
    prompt_len: int
    new_tokens: int
    batch: int
    dtype: str
    rows: list[CacheRow]
    output_len: int           # the sequence generate returned: prompt + new tokens
    weights_bytes: int        # parameters + buffers of the model (read from the live tensors)
    measurement: Measurement
    formula_label: str = LABEL_FORMULA

    @property
    def all_equal(self) -> bool:
        return bool(self.rows) and all(r.measured_bytes == r.formula_bytes and r.cache_seq_length == r.tokens
                                       for r in self.rows)

    @property
    def final_cache_bytes(self) -> int:
        return self.rows[-1].measured_bytes if self.rows else 0

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "prompt_len": self.prompt_len, "new_tokens": self.new_tokens,
                "batch": self.batch, "dtype": self.dtype, "output_len": self.output_len,
                "rows": [r.as_dict() for r in self.rows], "all_equal": self.all_equal,
                "final_cache_bytes": self.final_cache_bytes, "weights_bytes": self.weights_bytes,
                "peak_bytes": self.peak_bytes, "peak_by_category": self.peak_by_category,
                "label": self.label, "formula_label": self.formula_label, "engine": self.engine,
                "seconds": round(self.measurement.seconds, 4)}

    def __repr__(self) -> str:
        return (f"MeasuredKVCache({self.model}, {len(self.rows)} forwards, cache {self.final_cache_bytes:,} B, "
                f"peak {self.peak_bytes:,} B, equal={self.all_equal})")

    def _repr_html_(self) -> str:
        rows = [[r.step, r.tokens, f"{r.measured_bytes:,}", f"{r.formula_bytes:,}",
                 "yes" if r.measured_bytes == r.formula_bytes else "no"] for r in self.rows]
        head = (f"generate() of {html.escape(self.model)}: prompt {self.prompt_len}, {self.new_tokens} new tokens, "
                f"batch {self.batch}, {self.dtype}; whole-run peak {format_bytes(self.peak_bytes)} "
                f"({html.escape(self.label)}), weights {format_bytes(self.weights_bytes)}")
        return head + html_table(["forward", "tokens in cache", "cache bytes (measured)", "formula", "equal"], rows,
                                 f"measured: {self.label}; formula: {self.formula_label}")


def _generate_experiment(config, prompt_len: int, new_tokens: int, batch: int, dtype: torch.dtype, seed: int):
    def experiment(ctx: RunContext) -> dict[str, Any]:
        import transformers
        with ctx.phase("setup"), torch.device(ctx.device):
            torch.manual_seed(seed)
            model = hf_configs.build_causal_lm(config, dtype)
            model.eval()
            ctx.tracker.register(model)
            ids = ctx.label(torch.randint(0, hf_configs.vocab_size(config), (batch, prompt_len)))
            mask = ctx.label(torch.ones_like(ids))
            cache = transformers.DynamicCache(config=config)
        seen: list[tuple[int, int]] = []

        def after_forward(module, args, output):   # the cache has been updated by this forward
            seen.append((cache.get_seq_length(), cache_storage_bytes(cache)))

        handle = model.register_forward_hook(after_forward)
        eos = _eos_id(config)
        try:
            with ctx.phase("forward"), torch.no_grad():
                out = model.generate(ids, attention_mask=mask, do_sample=False,
                                     max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                     pad_token_id=eos, eos_token_id=eos,
                                     **{_cache_keyword(model.prepare_inputs_for_generation): cache})
        finally:
            handle.remove()
        weights = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()])
        return {"seen": seen, "output_len": int(out.shape[-1]), "weights": weights}
    return experiment


def measured_kv_cache(name_or_config: Any = "tiny-llama", prompt_len: int = 8, new_tokens: int = 16,
                      batch: int = 1, dtype: str | torch.dtype = torch.float32, seed: int = 0) -> MeasuredKVCache:
    """A real ``model.generate()`` (greedy, exactly ``new_tokens`` new tokens) of a model with
    random weights on the cpu engine, with our own ``transformers.DynamicCache`` passed as its
    cache (``cache``, or ``past_key_values`` in older transformers); a forward hook on the model reads the cache's storages after every
    forward pass (generate uses a cache it is given: ``_prepare_cache_for_generation`` in
    transformers/generation/utils.py). Each row: tokens in the cache, measured bytes, the formula.

    generate runs one prefill forward (the prompt) and then one forward per new token except the
    last (the last token chosen is never fed back), so there are ``new_tokens`` rows and the
    cache ends at prompt_len + new_tokens - 1 tokens. ``DynamicLayer.update`` concatenates
    (``torch.cat``) a new storage each step and drops the old one, so the cache's storages are
    exactly the formula's bytes. ``min_new_tokens`` stops an early end of sequence; pad and eos
    ids are given so that generate does not warn. The whole run is tracked
    (``MemoryTracker``): ``peak_bytes`` and its ``label``. NB: cpu engine only: generate picks
    tokens by value (argmax), which fake tensors do not have."""
    validate_positive(prompt_len=prompt_len, new_tokens=new_tokens, batch=batch)
    config, name = _with_cache(name_or_config)
    a = attention_shape(config)
    a["model"] = name
    _check_length(a, prompt_len + new_tokens)
    dt = parse_dtype(dtype)
    m = run(_generate_experiment(config, prompt_len, new_tokens, batch, dt, seed), "cpu")
    if m.oom:
        raise MemoryError(m.error)
    nbytes = dt.itemsize
    rows = [CacheRow(i, prompt_len + i, seq, measured,
                     kv_cache_bytes(a["layers"], a["kv_heads"], a["head_dim"], prompt_len + i, batch, nbytes))
            for i, (seq, measured) in enumerate(m.value["seen"])]
    return MeasuredKVCache(name, prompt_len, new_tokens, batch, dtype_name(dt), rows, m.value["output_len"],
                           m.value["weights"], m)


@dataclass
class FakeKVCache(Measured):
    """``fake_kv_cache``: one prefill forward of a full-size model on fake tensors."""
    model: str
    seq_len: int
    batch: int
    dtype: str
    measured_bytes: int       # storages behind the returned cache's keys and values
    formula_bytes: int
    layer_shapes: list[tuple[int, ...]]   # keys of each layer
    weights_bytes: int
    measurement: Measurement
    formula_label: str = LABEL_FORMULA

    @property
    def equal(self) -> bool:
        return self.measured_bytes == self.formula_bytes

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "seq_len": self.seq_len, "batch": self.batch, "dtype": self.dtype,
                "measured_bytes": self.measured_bytes, "formula_bytes": self.formula_bytes, "equal": self.equal,
                "layers": len(self.layer_shapes), "key_shape": list(self.layer_shapes[0]) if self.layer_shapes else [],
                "weights_bytes": self.weights_bytes, "peak_bytes": self.peak_bytes,
                "peak_by_category": self.peak_by_category, "label": self.label,
                "formula_label": self.formula_label, "seconds": round(self.measurement.seconds, 4)}

    def __repr__(self) -> str:
        return f"FakeKVCache({self.model}, {self.seq_len:,} tokens: {self.measured_bytes:,} B, equal={self.equal})"

    def _repr_html_(self) -> str:
        rows = [["KV cache after the prefill", format_bytes(self.measured_bytes), format_bytes(self.formula_bytes)],
                ["weights", format_bytes(self.weights_bytes), "—"],
                ["peak of the forward (live tensors)", format_bytes(self.peak_bytes), "—"]]
        return html_table(["", self.label, "formula"], rows,
                          f"{self.model}, prefill of {self.seq_len:,} tokens × batch {self.batch}, {self.dtype}")


def _prefill_experiment(config, seq_len: int, batch: int, dtype: torch.dtype):
    def experiment(ctx: RunContext) -> dict[str, Any]:
        import transformers
        with ctx.phase("setup"), torch.device(ctx.device):
            model = hf_configs.build_causal_lm(config, dtype)
            model.eval()
            ctx.tracker.register(model)
            ids = ctx.label(torch.randint(0, hf_configs.vocab_size(config), (batch, seq_len)))
            cache = transformers.DynamicCache(config=config)
        name = _cache_keyword(model.forward)
        kwargs: dict[str, Any] = {"input_ids": ids, name: cache, "use_cache": True}
        if "logits_to_keep" in inspect.signature(model.forward).parameters:
            kwargs["logits_to_keep"] = 1      # as generate does (generation/utils.py)
        with ctx.phase("forward"), torch.no_grad():
            out = model(**kwargs)
        returned = getattr(out, name)         # the output names it as the input did
        weights = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()])
        return {"bytes": cache_storage_bytes(returned), "seq": returned.get_seq_length(),
                "shapes": [tuple(layer.keys.shape) for layer in returned.layers if layer.keys is not None],
                "weights": weights}
    return experiment


def fake_kv_cache(name: Any = "hf:llama-3-8b", seq_len: int = 512, batch: int = 1,
                  dtype: str | torch.dtype = torch.bfloat16) -> FakeKVCache:
    """One prefill forward (``use_cache=True``, no grad, only the last position's logits as
    generate asks with ``logits_to_keep=1``) of a full-size model under gpulab's fake engine with
    CUDA's kernels (``engines.run(..., "fake", fake_target="cuda")``): no weights in RAM, no
    compute. The cache the model returns is summed storage by storage and set next to the
    formula. About a second and a half for Llama-3-8B at 512 tokens on a laptop CPU."""
    validate_positive(seq_len=seq_len, batch=batch)
    config, shown = _with_cache(name)
    a = attention_shape(config)
    a["model"] = shown
    _check_length(a, seq_len)
    dt = parse_dtype(dtype)
    m = run(_prefill_experiment(config, seq_len, batch, dt), "fake", fake_target="cuda")
    if m.oom:
        raise MemoryError(m.error)
    formula = kv_cache_bytes(a["layers"], a["kv_heads"], a["head_dim"], seq_len, batch, dt.itemsize)
    return FakeKVCache(shown, seq_len, batch, dtype_name(dt), m.value["bytes"], formula, m.value["shapes"],
                       m.value["weights"], m)
