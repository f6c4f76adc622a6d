"""Lesson 11, part 2: does inference fit a card, and what is the longest context?

* ``inference_fit`` / ``max_context``: weights + KV cache (``gpulab.course.kv_cache``) + one
  decode step's working set against a card, and the longest context that fits;
  ``fake_decode_step``: one decode step of a full-size model on fake tensors.
* ``exercise_serving_limit``: the lesson's predict-first question on it.

Results are dataclasses with ``as_dict`` and ``_repr_html_``; nothing here prints. Every number
carries its source label: an engine's (``gpulab.measure.engines.LABEL_*``), ``formula``, or
``LABEL_ESTIMATE`` for the one rough estimate (a decode step's working set).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from gpulab.models import hf_configs
from gpulab.predict.generation import cache_keyword as _cache_keyword
from gpulab.predict.cards import CUDA_CONTEXT_ASSUMED, Card, parse_gpu
from gpulab.measure.engines import LABEL_FORMULA, Measured, Measurement, RunContext, run
from gpulab.units import dtype_bytes, dtype_name, format_bytes, parse_dtype
from gpulab.views import html_table
from gpulab.course.inplace import validate_positive
from gpulab.course.transformer_params import counted_params
from gpulab.course.kv_cache import (_check_length, _config, _with_cache, attention_shape, cache_storage_bytes,
                                    kv_cache_for)

__all__ = [
    "DecodeStep", "InferenceFit", "LABEL_ESTIMATE", "MaxContext", "decode_step_estimate",
    "exercise_serving_limit", "fake_decode_step", "inference_fit", "max_context", "model_params"
]

LABEL_ESTIMATE = "estimate (rough, not measured)"


# --- does inference fit? ----------------------------------------------------------------------------

def model_params(config_or_name: Any) -> int:
    """Parameters of the causal LM a config builds (a tied embedding once), counted on a model
    built on the meta device (no memory). Built-in names are counted once per process."""
    return _param_counts(config_or_name)[0]


def _param_counts(config_or_name: Any) -> tuple[int, int]:
    """(parameters, parameter tensors): ``transformer_params.counted_params``, whose count of a
    built-in config is shared with lessons 11 and 12."""
    if isinstance(config_or_name, hf_configs.HFConfigEntry):
        config_or_name = config_or_name.name
    return counted_params(config_or_name)


def decode_step_estimate(config_or_name: Any, context_len: int, batch: int = 1,
                         dtype: str | torch.dtype = "bfloat16") -> dict[str, int]:
    """A rough estimate (``LABEL_ESTIMATE``) of the working set of one decode step (one new
    token per sequence), beyond the weights and the cache: the largest of four groups of tensors
    that live at different moments of the step, for ``batch`` sequences:

    * cache append: ``DynamicLayer.update`` (transformers/cache_utils.py) makes the grown keys
      with ``torch.cat`` while the old ones are still referenced, so one layer's keys exist twice
      for a moment: batch · kv_heads · head_dim · context · bytes. At long contexts this is the
      largest (``fake_decode_step`` measures it);
    * logits: vocab · (bytes + 4): the lm_head output of the last position and generate's
      float32 copy of it (transformers/generation/utils.py ``_sample``:
      ``outputs.logits[:, -1].to(copy=True, dtype=torch.float32)``);
    * MLP: 3 · intermediate · bytes: gate and up projections and their product
      (``LlamaMLP.forward``: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``);
    * attention scores: heads · context · (bytes + 4): eager attention's scores and their
      float32 softmax (``eager_attention_forward``: ``softmax(..., dtype=torch.float32)``);
      SDPA and flash kernels need not hold them.

    Returns the four terms and ``estimate`` (their maximum). NB: allocator rounding, kernel
    workspaces and the hidden states (batch · hidden, small) are left out; when SDPA gets a mask
    on CUDA, transformers repeats the KV heads for it (``repeat_kv``, as
    transformers/integrations/sdpa_attention.py ``use_gqa_in_sdpa`` decides), heads / kv_heads
    times one layer's keys and values, which this leaves out too."""
    validate_positive(context_len=context_len, batch=batch)
    a = attention_shape(config_or_name)
    b = dtype_bytes(dtype)
    terms = {"cache_append": batch * a["kv_heads"] * a["head_dim"] * context_len * b,
             "logits": batch * a["vocab_size"] * (b + 4),
             "mlp": batch * 3 * a["intermediate_size"] * b,
             "attention_scores": batch * a["heads"] * context_len * (b + 4)}
    return {**terms, "estimate": max(terms.values())}


@dataclass
class DecodeStep(Measured):
    """``fake_decode_step``: one decode step after a prefill, on fake tensors, beside the estimate."""
    model: str
    context_len: int
    batch: int
    dtype: str
    before_bytes: int          # live before the step: weights, cache of context_len - 1 tokens, ids
    step_peak_bytes: int       # the highest live total during the step
    cache_growth_bytes: int    # the cache after the step minus before (one token per sequence)
    estimate: dict[str, int]
    peak_module: str           # the module running at the step's peak
    measurement: Measurement
    estimate_label: str = LABEL_ESTIMATE

    @property
    def working_set_bytes(self) -> int:
        """What the step needed beyond what lived before it and the cache's own growth."""
        return self.step_peak_bytes - self.before_bytes - self.cache_growth_bytes

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "context_len": self.context_len, "batch": self.batch, "dtype": self.dtype,
                "before_bytes": self.before_bytes, "step_peak_bytes": self.step_peak_bytes,
                "cache_growth_bytes": self.cache_growth_bytes, "working_set_bytes": self.working_set_bytes,
                "estimate": dict(self.estimate), "peak_module": self.peak_module, "label": self.label,
                "estimate_label": self.estimate_label}

    def __repr__(self) -> str:
        return (f"DecodeStep({self.model}, {self.context_len:,} tokens × {self.batch}: working set "
                f"{self.working_set_bytes:,} B, estimate {self.estimate['estimate']:,} B)")

    def _repr_html_(self) -> str:
        rows = [["working set of the step", format_bytes(self.working_set_bytes), self.label]]
        rows += [[f"estimate: {k.replace('_', ' ')}", format_bytes(v), self.estimate_label]
                 for k, v in self.estimate.items()]
        return html_table(["", "bytes", "source"], rows,
                          f"{self.model}, one decode step at {self.context_len:,} tokens × batch {self.batch}, "
                          f"{self.dtype}")


def _decode_experiment(config, context_len: int, batch: int, dtype: torch.dtype):
    def experiment(ctx: RunContext) -> dict[str, Any]:
        import transformers
        with ctx.phase("setup"), torch.device(ctx.device):
            model = hf_configs.build_causal_lm(config, dtype)
            model.eval()
            ctx.tracker.register(model)
            vocab = hf_configs.vocab_size(config)
            ids = ctx.label(torch.randint(0, vocab, (batch, context_len - 1)))
            cache = transformers.DynamicCache(config=config)
        keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        keep[_cache_keyword(model.forward)] = cache
        with ctx.phase("forward"), torch.no_grad():
            # no attention mask, as in predict.generation: generate's all-ones mask lets a GPU's SDPA
            # path skip the mask (masking_utils._ignore_causal_mask_sdpa reads its values), which
            # fake tensors cannot show, so it would build one; with a mask, transformers before
            # pack_gqa (5.15) repeats one decode step's keys and values to every head (8 x 16 MiB
            # on llama-3-8b at 8k) where the GPU runs SDPA's enable_gqa on the cache itself
            out = model(input_ids=ids, use_cache=True, **keep)
            del out
            cache_before = cache_storage_bytes(cache)
            mark = ctx.mark()
            before = ctx.snapshot("before the decode step").tracked_bytes
            step_ids = ctx.label(torch.randint(0, vocab, (batch, 1)))
            out = model(input_ids=step_ids, use_cache=True, **keep)
            scores = out.logits[:, -1].to(copy=True, dtype=torch.float32)   # as generate's _sample does
            del out, scores
        return {"mark": mark, "before": before, "growth": cache_storage_bytes(cache) - cache_before}
    return experiment


def fake_decode_step(name: Any = "hf:llama-3-8b", context_len: int = 8192, batch: int = 1,
                     dtype: str | torch.dtype = torch.bfloat16) -> DecodeStep:
    """One decode step measured on the fake engine (CUDA target): a prefill of context_len - 1
    tokens, then one forward of one token per sequence (no attention mask: generate's all-ones
    mask, which a GPU's SDPA path skips) and ``logits_to_keep=1``, and generate's float32 copy
    of the logits. The working set is the
    step's peak minus what lived before it minus the cache's growth; ``decode_step_estimate``
    stands beside it. NB: fake tensors follow the CPU's attention path; a GPU's SDPA kernel may
    hold other buffers (``gpulab.measure.fake_cuda.STILL_DIFFERS``)."""
    validate_positive(context_len=context_len, batch=batch)
    if context_len < 2:
        raise ValueError("context_len must be at least 2 (a prefill of one token, then one decode step)")
    config, shown = _with_cache(name)
    a = attention_shape(config)
    a["model"] = shown
    _check_length(a, context_len)
    dt = parse_dtype(dtype)
    m = run(_decode_experiment(config, context_len, batch, dt), "fake", fake_target="cuda")
    if m.oom:
        raise MemoryError(m.error)
    peak, _, index = m.tracking.peak_between(m.value["mark"])
    module = m.tracking.events[index].module if index >= 0 else ""
    return DecodeStep(shown, context_len, batch, dtype_name(dt), m.value["before"], peak, m.value["growth"],
                      decode_step_estimate(config, context_len, batch, dt), module, m)


@dataclass(frozen=True)
class InferenceFit:
    """Weights + KV cache + one decode step against a card (``inference_fit``)."""
    model: str
    card: str
    card_bytes: int
    context_assumed_bytes: int
    context_len: int
    batch: int
    dtype: str
    params: int
    weights_bytes: int
    kv_cache_bytes: int
    activation_bytes: int
    activation_terms: dict[str, int] = field(default_factory=dict)
    weights_label: str = LABEL_FORMULA
    kv_label: str = LABEL_FORMULA
    activation_label: str = LABEL_ESTIMATE

    @property
    def usable_bytes(self) -> int:
        """The card's memory less the assumed CUDA context (``gpulab.predict.cards.CUDA_CONTEXT_ASSUMED``)."""
        return self.card_bytes - self.context_assumed_bytes

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.activation_bytes

    @property
    def margin_bytes(self) -> int:
        """Usable memory left (negative: over by that much)."""
        return self.usable_bytes - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.margin_bytes >= 0

    @property
    def verdict(self) -> str:
        m = format_bytes(abs(self.margin_bytes))
        return f"fits, {m} to spare" if self.fits else f"does not fit: {m} over"

    def rows(self) -> list[tuple[str, int, str]]:
        """(what, bytes, label) for each line of the budget."""
        return [("weights", self.weights_bytes, self.weights_label),
                ("KV cache", self.kv_cache_bytes, self.kv_label),
                ("one decode step's working set", self.activation_bytes, self.activation_label),
                ("total", self.total_bytes, "sum of the above"),
                (f"usable on {self.card}", self.usable_bytes,
                 f"card memory − assumed CUDA context ({format_bytes(self.context_assumed_bytes)})"),
                ("margin", self.margin_bytes, "usable − total")]

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "card": self.card, "card_bytes": self.card_bytes,
                "context_assumed_bytes": self.context_assumed_bytes, "usable_bytes": self.usable_bytes,
                "context_len": self.context_len, "batch": self.batch, "dtype": self.dtype, "params": self.params,
                "weights_bytes": self.weights_bytes, "kv_cache_bytes": self.kv_cache_bytes,
                "activation_bytes": self.activation_bytes, "activation_terms": dict(self.activation_terms),
                "total_bytes": self.total_bytes, "margin_bytes": self.margin_bytes, "fits": self.fits,
                "verdict": self.verdict, "labels": {"weights": self.weights_label, "kv_cache": self.kv_label,
                                                    "activations": self.activation_label}}

    def __repr__(self) -> str:
        return (f"InferenceFit({self.model} on {self.card}, {self.context_len:,} tokens × {self.batch}, "
                f"{self.dtype}: {self.verdict})")

    def _repr_html_(self) -> str:
        return html_table(["", "bytes", "source"], [[w, format_bytes(b), lab] for w, b, lab in self.rows()],
                          f"{self.model} on {self.card}, {self.context_len:,} tokens × batch {self.batch}, "
                          f"{self.dtype}: {self.verdict}")


def _card(card: str | Card) -> Card:
    return card if isinstance(card, Card) else parse_gpu(card)


def inference_fit(config_or_name: Any, card: str | Card, context_len: int, batch: int = 1,
                  dtype: str | torch.dtype = "bfloat16") -> InferenceFit:
    """Does serving this model fit on this card? Weights (parameters × bytes of ``dtype``:
    formula, the count from a meta-device model), the KV cache at ``context_len`` tokens per
    sequence (formula), and one decode step's working set (``decode_step_estimate``: an
    estimate), against the card's memory (``gpulab.predict.cards.parse_gpu``) less the assumed CUDA
    context. NB: buffers (the rotary tables, a few KiB) and the tokens' ids are left out."""
    validate_positive(context_len=context_len, batch=batch)
    config, name = _config(config_or_name)
    c = _card(card)
    dt = parse_dtype(dtype)
    params = model_params(config_or_name)
    kv = kv_cache_for(config, context_len, batch, dt).bytes
    act = decode_step_estimate(config, context_len, batch, dt)
    terms = {k: v for k, v in act.items() if k != "estimate"}
    return InferenceFit(name, c.name, c.reported_total_bytes, CUDA_CONTEXT_ASSUMED, context_len, batch, dtype_name(dt),
                        params, params * dt.itemsize, kv, act["estimate"], terms)


@dataclass(frozen=True)
class MaxContext:
    """The longest context that fits at a batch size (``max_context``)."""
    model: str
    card: str
    batch: int
    dtype: str
    tokens: int                       # longest context that fits in memory (0: not even one token)
    model_max_positions: int | None   # the longest the model itself takes
    fit: InferenceFit | None          # the budget at ``tokens`` (None when 0)
    label: str = "formula (weights, KV cache) + estimate (decode step), solved for the context"

    @property
    def usable_tokens(self) -> int:
        """The answer once the model's own limit is applied."""
        return self.tokens if not self.model_max_positions else min(self.tokens, self.model_max_positions)

    @property
    def limited_by(self) -> str:
        if self.tokens == 0:
            return "memory: the weights alone do not fit"
        if self.model_max_positions and self.model_max_positions < self.tokens:
            return "the model's position limit"
        return "memory"

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "card": self.card, "batch": self.batch, "dtype": self.dtype,
                "tokens": self.tokens, "model_max_positions": self.model_max_positions,
                "usable_tokens": self.usable_tokens, "limited_by": self.limited_by, "label": self.label,
                "fit": self.fit.as_dict() if self.fit else None}

    def __repr__(self) -> str:
        return (f"MaxContext({self.model} on {self.card}, batch {self.batch}: {self.tokens:,} tokens fit; "
                f"model takes {self.model_max_positions})")

    def _repr_html_(self) -> str:
        rows = [["longest context that fits in memory", f"{self.tokens:,} tokens"],
                ["the model's own limit",
                 f"{self.model_max_positions:,} tokens" if self.model_max_positions else "—"],
                ["limited by", self.limited_by]]
        return html_table(["", ""], rows, f"{self.model} on {self.card}, batch {self.batch}, {self.dtype} — "
                                          f"{self.label}")


def max_context(config_or_name: Any, card: str | Card, batch: int = 1, dtype: str | torch.dtype = "bfloat16",
                limit: int = 1 << 32) -> MaxContext:
    """The longest context (tokens per sequence) for which ``inference_fit`` fits at this batch:
    the budget grows with the context (cache and attention scores), so the answer is found by
    doubling, then bisection on whole tokens. ``limit`` caps the search."""
    validate_positive(batch=batch, limit=limit)
    config, name = _config(config_or_name)
    c = _card(card)
    def fit_at(n: int) -> InferenceFit:
        return inference_fit(config_or_name, c, n, batch, dtype)

    a = attention_shape(config)
    if not fit_at(1).fits:
        return MaxContext(name, c.name, batch, dtype_name(parse_dtype(dtype)), 0, a["max_positions"], None)
    lo, hi = 1, 2
    while hi <= limit and fit_at(hi).fits:
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:           # fit_at(lo) fits, fit_at(hi) does not (or hi is past the limit)
        mid = (lo + hi) // 2
        if fit_at(mid).fits:
            lo = mid
        else:
            hi = mid
    return MaxContext(name, c.name, batch, dtype_name(parse_dtype(dtype)), lo, a["max_positions"], fit_at(lo))


def exercise_serving_limit(name: str = "llama-3-8b", card: str = "H100", context_len: int = 8192,
                           dtype: str = "bfloat16"):
    """Predict-first (qualitative): serving ``name`` at ``context_len`` tokens, raising the batch,
    what runs out first? Worked out with ``inference_fit`` when the checker runs: the first batch
    that does not fit, and which part grew the most from batch 1."""
    from gpulab.course.exercises import ChoiceExercise
    options = {"a": "the weights: they do not fit the card even at batch 1",
               "b": "the KV cache: it grows with every sequence in the batch until the card is full",
               "c": "the activations of a decode step"}

    def first_over() -> tuple[InferenceFit, InferenceFit]:
        one = inference_fit(name, card, context_len, 1, dtype)
        b = 1
        while inference_fit(name, card, context_len, b, dtype).fits and b < 1 << 16:
            b *= 2
        return one, inference_fit(name, card, context_len, b, dtype)

    def expected() -> str:
        one, over = first_over()
        if not one.fits:
            return "a"
        grew_kv = over.kv_cache_bytes - one.kv_cache_bytes
        grew_act = over.activation_bytes - one.activation_bytes
        return "b" if grew_kv >= grew_act else "c"

    def explain() -> str:
        one, over = first_over()
        return (f"At batch 1 the weights take {format_bytes(one.weights_bytes)} and the cache "
                f"{format_bytes(one.kv_cache_bytes)}; by batch {over.batch} the cache is "
                f"{format_bytes(over.kv_cache_bytes)} and the total no longer fits {over.card} ({over.verdict}; "
                f"weights and cache: {LABEL_FORMULA}, the decode step: {LABEL_ESTIMATE}).")

    return ChoiceExercise(f"You serve {name} in {dtype} on {card} with {context_len:,}-token contexts. As you raise "
                          f"the batch, which runs out of room first?", options, expected, explain)
