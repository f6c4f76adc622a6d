"""Lesson 11, section 9 (optional): the models of 2026 — experts, windows and latents.

* ``moe_params``: total and per-token (active) parameters of the built-in mixtures of experts
  (``models.moe``), beside the figures their model cards publish (quoted, with the card), and
  what training holds for them: every expert's weights, gradients and optimizer state.
* ``moe_routing_steps``: one training step of a small Mixtral on the fake engine under named
  routing assumptions (``training.routing``): the state is the same, each expert's saved
  activations follow the token rows routed to it. ``exercise_moe_routing`` asks what changes.
* ``kv_caches``: the KV cache of dense, sliding-window and MLA models at a few contexts, measured
  in transformers' own ``DynamicCache`` on the meta device (storage bytes, no memory), beside the
  dense all-global formula and the sliding layers' share; ``plot_kv_caches``; ``exercise_gemma_cache``.
* ``context_bounds``: the longest context that weights + KV cache alone leave room for on a card
  (formula, ``predict.kv_layout``), and ``measured_longest_context``: ``predict.serve.longest_context``
  (fake runs of prefill and decode) on a small config beside its bound, so the gap — the prefill's
  working set — is seen.

Results are dataclasses with ``_repr_html_`` views; nothing here prints.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpulab.course.exercises import ChoiceExercise, Exercise
from gpulab.tables import html_table
from gpulab.units import format_bytes

__all__ = ["CARD_FIGURES", "ContextBound", "ContextBounds", "KVRow", "KVTable", "MeasuredContext", "MoEParams",
           "MoERouting", "RoutedStep", "context_bounds", "dense_formula_bytes", "exercise_gemma_cache",
           "exercise_moe_routing", "kv_caches", "measured_longest_context", "meta_cache_bytes", "moe_params",
           "moe_routing_steps", "plot_kv_caches", "small_mixtral", "small_llama"]

MOE_MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v2-lite")

# The model cards' own figures, quoted (label: "published by <card>"); tests/test_moe.py holds the
# counts to them. DeepSeek's card counts the active parameters without the input embedding.
CARD_FIGURES = {
    "mixtral-8x7b": ("46.7B", "12.9B", "https://mistral.ai/news/mixtral-of-experts"),
    "qwen3-30b-a3b": ("30.5B", "3.3B", "https://huggingface.co/Qwen/Qwen3-30B-A3B"),
    "deepseek-v2-lite": ("15.7B", "2.4B", "https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite"),
}

# Mixed-precision Adam per parameter (section 2; the ZeRO paper): bf16 weights 2 + bf16 gradients 2
# + fp32 master weights 4 + Adam's two fp32 moments 8.
MIXED_ADAM_BYTES = 2 + 2 + 4 + 8


# --- 1. total vs active parameters ----------------------------------------------------------------

@dataclass(frozen=True)
class MoEParams:
    """``moe_params``: one row per model (``models.moe.ParamCounts`` and the card's figures)."""
    rows: tuple[dict[str, Any], ...]
    bytes_per_param: int

    def row(self, model: str) -> dict[str, Any]:
        return next(r for r in self.rows if r["model"] == model)

    def __repr__(self) -> str:
        return "MoEParams(" + ", ".join(f"{r['model']}: {r['total'] / 1e9:.1f}B total, "
                                        f"{r['active_as_card'] / 1e9:.2f}B active" for r in self.rows) + ")"

    def _repr_html_(self) -> str:
        body = [[r["model"], f"{r['experts']} × top-{r['top_k']} in {r['moe_layers']} layers",
                 f"{r['total']:,}", f"{r['active']:,}", f"{r['active_as_card']:,}", f"{r['card_total']} / {r['card_active']}",
                 format_bytes(r["training_state_bytes"]), format_bytes(r["active_state_bytes"])] for r in self.rows]
        head = ["model", "routed experts", "total (formula)", "active per token", "active as the card counts",
                "card: total / active", f"training state held ({self.bytes_per_param} B × total)",
                f"{self.bytes_per_param} B × active (an undercount)"]
        return html_table(head, body, caption=(
            "counts: formula from the config (gpulab.models.moe, equal to a meta-device build); card: published by "
            "each model card (" + ", ".join(r["card_url"] for r in self.rows) + "); training state: formula, "
            "mixed-precision Adam. DeepSeek's card counts the active parameters without the input embedding."))


def moe_params(models: tuple[str, ...] = MOE_MODELS, bytes_per_param: int = MIXED_ADAM_BYTES) -> MoEParams:
    """Total and active parameters of each mixture of experts, the card's figures beside them, and
    the training state that every expert's weights, gradients and optimizer state take."""
    from gpulab.models.moe import moe_counts
    rows = []
    for name in models:
        c = moe_counts(name)
        card_total, card_active, url = CARD_FIGURES[name]
        as_card = c.active_without_embedding if name.startswith("deepseek") else c.active
        rows.append({"model": name, "total": c.total, "active": c.active, "active_as_card": as_card,
                     "experts": c.experts, "top_k": c.top_k, "moe_layers": c.moe_layers,
                     "routed_share": c.routed_experts / c.total, "card_total": card_total,
                     "card_active": card_active, "card_url": url,
                     "training_state_bytes": c.total * bytes_per_param,
                     "active_state_bytes": c.active * bytes_per_param})
    return MoEParams(tuple(rows), bytes_per_param)


# --- 1b. a measured MoE step under two routings ---------------------------------------------------

def small_mixtral(layers: int = 1, experts: int = 4, top_k: int = 2):
    """A small Mixtral config (hidden 32, experts 64 wide) whose step runs in a second on fake tensors."""
    import transformers
    return transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
                                      num_experts_per_tok=top_k, vocab_size=128, max_position_embeddings=64)


@dataclass(frozen=True)
class RoutedStep:
    """One routing's step: the state held at the step's peak, the saved activations of layer 0's experts
    (bytes per expert, filed under each expert's module), the step's peak, its label."""
    routing: str
    parameters: int
    gradients: int
    optimizer_state: int
    expert_activations: tuple[int, ...]
    peak: int
    peak_phase: str
    label: str

    @property
    def state(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state


@dataclass(frozen=True)
class MoERouting:
    """``moe_routing_steps``: the same small MoE stepped under each routing assumption."""
    steps: tuple[RoutedStep, ...]
    tokens: int
    experts: int
    top_k: int
    total_params: int

    def step(self, routing: str) -> RoutedStep:
        return next(s for s in self.steps if s.routing == routing)

    def __repr__(self) -> str:
        return "MoERouting(" + "; ".join(f"{s.routing}: state {s.state:,} B, experts {list(s.expert_activations)}"
                                         for s in self.steps) + ")"

    def _repr_html_(self) -> str:
        body = [[s.routing, format_bytes(s.parameters), format_bytes(s.gradients), format_bytes(s.optimizer_state),
                 " · ".join(format_bytes(n) for n in s.expert_activations), f"{format_bytes(s.peak)} ({s.peak_phase})"]
                for s in self.steps]
        head = ["routing", "parameters", "gradients", "Adam state", "saved activations, expert 0 · 1 · …",
                "peak (phase)"]
        labels = "; ".join(dict.fromkeys(s.label for s in self.steps))
        return html_table(head, body, caption=(
            f"one training step of a small Mixtral ({self.experts} experts, top-{self.top_k}, {self.tokens} tokens "
            f"per layer, {self.total_params:,} parameters). Parameters, gradients and Adam state: tensor bytes at the "
            f"step's peak; saved activations: layer 0's experts, each filed under its own module; {labels}"))


def moe_routing_steps(routings: tuple[str, ...] = ("balanced", "worst"), batch: int = 2, seq_len: int = 16,
                      layers: int = 1) -> MoERouting:
    """One fp32 Adam step of ``small_mixtral`` on the fake engine per routing assumption."""
    import gpulab
    from gpulab.models.moe import param_counts
    from gpulab.training.routing import activations_by_expert
    config = small_mixtral(layers)
    steps = []
    for routing in routings:
        r = gpulab.step(config, batch=batch, seq_len=seq_len, engine="fake", steps=1, routing=routing)
        t = r.measurement.tracking
        at_peak = r.tensor_bytes_by_category   # at the peak (unrounded): in the optimizer step, where all three live
        by_expert = {e: n for (owner, e), n in activations_by_expert(t).items() if owner.endswith("layers.0.mlp.experts")}
        steps.append(RoutedStep(routing, at_peak.get("parameters", 0), at_peak.get("gradients", 0),
                                at_peak.get("optimizer_state", 0),
                                tuple(by_expert.get(e, 0) for e in range(config.num_local_experts)),
                                r.peak_bytes, t.peak_phase, r.measurement.label))
    return MoERouting(tuple(steps), batch * seq_len, config.num_local_experts, config.num_experts_per_tok,
                      param_counts(config).total)


def exercise_moe_routing(result: MoERouting) -> ChoiceExercise:
    """Predict-first: from balanced to worst-case routing, what changes? Read off ``result``."""
    bal, worst = result.step("balanced"), result.step("worst")

    def expected() -> str:
        if bal.state != worst.state:
            return "c"
        return "b" if max(worst.expert_activations) > max(bal.expert_activations) else "a"

    def explain() -> str:
        return (f"Predicted on fake tensors: weights, gradients and Adam state are {format_bytes(bal.state)} under "
                f"both routings — every expert is held, used or not. The busiest expert of layer 0 saves "
                f"{format_bytes(max(bal.expert_activations))} balanced ({result.tokens}·{result.top_k}/"
                f"{result.experts} rows) and {format_bytes(max(worst.expert_activations))} worst ({result.tokens} "
                f"rows); under worst, {result.experts - result.top_k} experts save nothing.")

    return ChoiceExercise(
        question=(f"A small Mixtral ({result.experts} experts, top-{result.top_k}) trains one step, first with "
                  f"balanced routing, then with every token sent to the same {result.top_k} experts. What changes?"),
        options={"a": "nothing: memory is the same under both routings",
                 "b": "weights, gradients and optimizer state stay the same; the busiest expert's saved activations grow",
                 "c": f"weights, gradients and optimizer state shrink to the {result.top_k} experts used"},
        expected=expected, explain=explain)


# --- 2. KV caches: dense, sliding window, MLA -----------------------------------------------------

def _text_config(name_or_config: Any) -> tuple[Any, str]:
    from gpulab.models import hf_configs
    if isinstance(name_or_config, str):
        config, shown = hf_configs.config_and_name(name_or_config)
    else:
        config, shown = name_or_config, type(name_or_config).__name__
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return text, shown


def _cache_shapes(text: Any) -> tuple[int, int, int, int]:
    """(key heads, key dim, value heads, value dim) one layer's ``cache.update`` gets: MLA's
    (1, kv_lora_rank) latent and (1, qk_rope_head_dim) rope key (``DeepseekV2Attention.forward``),
    else the KV heads' keys and values."""
    if getattr(text, "kv_lora_rank", None):
        return 1, text.kv_lora_rank, 1, text.qk_rope_head_dim
    kv = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    d = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return kv, d, kv, d


def meta_cache_bytes(model: Any, context: int, batch: int = 1, dtype: str = "bfloat16") -> tuple[int, int]:
    """(bytes, sliding layers) of transformers' ``DynamicCache(config=...)`` on the meta device after
    a prompt of ``context - 1`` tokens and one decode step: the storage its layers keep (a sliding
    layer's view keeps its last concatenation's storage), and how many of its layers slide."""
    import torch
    import transformers
    text, _ = _text_config(model)
    kh, kd, vh, vd = _cache_shapes(text)
    dt = getattr(torch, dtype)
    cache = transformers.DynamicCache(config=text)
    with torch.device("meta"):
        for n in (context - 1, 1):
            for i in range(len(cache.layers)):
                cache.update(torch.empty(batch, kh, n, kd, dtype=dt), torch.empty(batch, vh, n, vd, dtype=dt), i)
    held = sum(t.untyped_storage().nbytes() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)
    return held, sum(bool(getattr(layer, "is_sliding", False)) for layer in cache.layers)


def dense_formula_bytes(model: Any, context: int, batch: int = 1, nbytes: int = 2) -> int:
    """The dense all-global formula 2 · L · a_kv · d · s · b · bytes; for MLA, full keys and values
    after the up-projection: L · a · (qk_nope + qk_rope + v_head_dim) · s · b · bytes."""
    text, _ = _text_config(model)
    layers = text.num_hidden_layers
    if getattr(text, "kv_lora_rank", None):
        per = text.num_attention_heads * (text.qk_nope_head_dim + text.qk_rope_head_dim + text.v_head_dim)
        return layers * per * context * batch * nbytes
    kv, d, _, _ = _cache_shapes(text)
    return 2 * layers * kv * d * context * batch * nbytes


@dataclass(frozen=True)
class KVRow:
    model: str
    kind: str               # "dense", "sliding" or "MLA"
    context: int
    measured: int           # transformers' DynamicCache on the meta device
    dense_formula: int      # 2·L·a_kv·d·s·b·bytes (MLA: full K and V)
    sliding_share: int      # the sliding layers' positions beyond the window (0 without sliding layers)
    assumption: str

    @property
    def below_dense(self) -> int:
        return self.dense_formula - self.measured


@dataclass(frozen=True)
class KVTable:
    """``kv_caches``: each model at each context (within its positions), measured beside the formula."""
    rows: tuple[KVRow, ...]
    batch: int
    dtype: str
    skipped: tuple[str, ...]   # "model at N tokens": beyond the model's positions

    def row(self, model: str, context: int) -> KVRow:
        return next(r for r in self.rows if r.model == model and r.context == context)

    def __repr__(self) -> str:
        return "KVTable(" + "; ".join(f"{r.model} @ {r.context:,}: {r.measured:,} B" for r in self.rows) + ")"

    def _repr_html_(self) -> str:
        body = [[r.model, r.kind, f"{r.context:,}", format_bytes(r.measured), format_bytes(r.dense_formula),
                 format_bytes(r.below_dense), format_bytes(r.sliding_share) if r.kind == "sliding" else "—"]
                for r in self.rows]
        head = ["model", "attention", "context", "cache (DynamicCache, meta)", "dense formula", "below the formula",
                "sliding layers' share"]
        notes = "; ".join(dict.fromkeys(f"{r.model}: {r.assumption}" for r in self.rows))
        skipped = f" Not shown (beyond the model's positions): {', '.join(self.skipped)}." if self.skipped else ""
        return html_table(head, body, caption=(
            f"batch {self.batch}, {self.dtype}. Cache: read off transformers' DynamicCache(config=...) built on the meta "
            f"device (its storage bytes after a prompt and one decode step; no memory used); dense formula: 2·L·a_kv·d·s·b·bytes "
            f"(MLA: full K and V). {notes}.{skipped}"))


def kv_caches(models: tuple[str, ...] = ("llama-3-8b", "gemma-2-9b", "gemma-3-1b", "deepseek-v2-lite"),
              contexts: tuple[int, ...] = (4096, 8192, 32768), batch: int = 1, dtype: str = "bfloat16") -> KVTable:
    """Each model's KV cache at each context its positions allow, measured in transformers' cache
    objects (``meta_cache_bytes``), beside the dense formula and the sliding layers' share."""
    from gpulab.models import hf_configs
    from gpulab.predict.kv_layout import kv_layout
    from gpulab.units import dtype_bytes
    nbytes = dtype_bytes(dtype)
    rows, skipped = [], []
    for name in models:
        text, _ = _text_config(name)
        layout = kv_layout(text)
        kv, d, _, _ = _cache_shapes(text)
        longest = hf_configs.max_positions(text)
        for s in contexts:
            if longest and s > longest:
                skipped.append(f"{name} at {s:,} tokens ({longest:,} positions)")
                continue
            held, sliding = meta_cache_bytes(text, s, batch, dtype)
            window = layout.windows[0] if layout.windows else 0
            share = sliding * 2 * kv * d * max(0, s - window) * batch * nbytes if sliding else 0
            kind = "MLA" if layout.mla else ("sliding" if sliding else "dense")
            rows.append(KVRow(name, kind, s, held, dense_formula_bytes(text, s, batch, nbytes), share,
                              layout.assumption(dtype)))
    return KVTable(tuple(rows), batch, dtype, tuple(skipped))


def plot_kv_caches(table: KVTable, max_context: int = 8192, ax: Any = None):
    """KV cache against context up to ``max_context``, per model: kv_layout's bytes as a line, the
    measured points as markers, the dense formula dashed where the model slides or caches a latent."""
    import matplotlib.pyplot as plt
    from gpulab.predict.kv_layout import kv_layout
    from gpulab.units import dtype_bytes
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7, 4))
    nbytes, gib = dtype_bytes(table.dtype), 1024 ** 3
    for name in dict.fromkeys(r.model for r in table.rows):
        rows = [r for r in table.rows if r.model == name and r.context <= max_context]
        if not rows:
            continue
        layout = kv_layout(_text_config(name)[0])
        xs = list(range(0, max(r.context for r in rows) + 1, 256))
        line, = ax.plot(xs, [layout.bytes(x, table.batch, nbytes) / gib for x in xs], label=f"{name} ({rows[0].kind})")
        ax.plot([r.context for r in rows], [r.measured / gib for r in rows], "o", color=line.get_color())
        if rows[0].kind != "dense":
            ax.plot(xs, [dense_formula_bytes(name, x, table.batch, nbytes) / gib for x in xs], "--",
                    color=line.get_color(), alpha=0.5,
                    label=f"{name}: " + ("full K and V" if rows[0].kind == "MLA" else "dense formula"))
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(f"KV cache, batch {table.batch} (GiB)")
    ax.set_title("KV cache: lines kv_layout, dots transformers' DynamicCache (meta device)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def exercise_gemma_cache(model: str = "gemma-2-9b", context: int = 8192, dtype: str = "bfloat16") -> Exercise:
    """Predict-first: a sliding-window model's cache at ``context`` tokens, checked against
    transformers' DynamicCache measured on the meta device."""
    from gpulab.predict.kv_layout import kv_layout
    text, _ = _text_config(model)
    layout = kv_layout(text)
    kv, d, _, _ = _cache_shapes(text)
    window = layout.windows[0]

    def explain() -> str:
        held, sliding = meta_cache_bytes(text, context, 1, dtype)
        return (f"Read off transformers' DynamicCache built on the meta device: {held:,} bytes. The dense formula "
                f"gives {dense_formula_bytes(text, context):,}; the {sliding} sliding layers keep {window:,} "
                f"positions, not {context:,}, so the cache is below it by {sliding}·2·{kv}·{d}·"
                f"({context:,} − {window:,})·2 bytes.")

    n = len(layout.layers)
    return Exercise(
        question=(f"{model} in {dtype}, one sequence at {context:,} tokens: {n} layers, {kv} KV heads of {d}; "
                  f"{layout.sliding_layers} of the layers slide over a {window:,}-token window. How many bytes "
                  f"does its KV cache hold?"),
        expected=lambda: meta_cache_bytes(text, context, 1, dtype)[0],
        explain=explain(), unit="bytes", rel_tol=0.01,
        hint=f"a sliding layer holds min(context, window) positions; the other {n - layout.sliding_layers} hold all")


# --- 3. the longest context that fits ------------------------------------------------------------

@dataclass(frozen=True)
class ContextBound:
    model: str
    batch: int
    weights: int
    usable: int
    context: int            # the longest context weights + KV cache leave room for (0: weights do not fit)
    limit: str              # "memory", "the model's positions (N)" or "the weights alone"
    kv_at_context: int
    assumption: str


@dataclass(frozen=True)
class ContextBounds:
    """``context_bounds``: weights + KV cache against a card, per model and batch (formula)."""
    rows: tuple[ContextBound, ...]
    card: str
    dtype: str

    def row(self, model: str, batch: int) -> ContextBound:
        return next(r for r in self.rows if r.model == model and r.batch == batch)

    def __repr__(self) -> str:
        return "ContextBounds(" + "; ".join(f"{r.model} × {r.batch}: {r.context:,} ({r.limit})" for r in self.rows) + ")"

    def _repr_html_(self) -> str:
        body = [[r.model, str(r.batch), format_bytes(r.weights), f"{r.context:,}" if r.context else "—", r.limit,
                 format_bytes(r.kv_at_context), format_bytes(r.usable)] for r in self.rows]
        head = ["model", "batch", "weights", "longest context (tokens)", "limited by", "KV cache there", "usable"]
        notes = "; ".join(dict.fromkeys(f"{r.model}: {r.assumption}" for r in self.rows))
        return html_table(head, body, caption=(
            f"{self.card}, {self.dtype}. Formula: weights (parameters × bytes) + KV cache (predict.kv_layout) ≤ usable "
            f"(the card less the assumed CUDA context and the cuBLAS workspace, as gpulab.serve counts it). The "
            f"prefill's working set is left out: longest_context's answer (fake runs) is at most this. {notes}."))


def _usable(card: Any, context_bytes: int | None) -> int:
    from gpulab.predict.context import context_assumption
    context_bytes = context_assumption("lazy").nbytes if context_bytes is None else context_bytes
    return card.reported_total_bytes - context_bytes - card.workspace_bytes(training=False)


def _bound(model: Any, card: Any, batch: int, nbytes: int, context_bytes: int | None) -> ContextBound:
    from gpulab.course.transformer_params import counted_params
    from gpulab.models import hf_configs
    from gpulab.predict.kv_layout import kv_layout
    text, shown = _text_config(model)
    layout = kv_layout(text)
    weights = counted_params(model if isinstance(model, str) else text)[0] * nbytes   # a name: counted once a session
    usable = _usable(card, context_bytes)
    longest = hf_configs.max_positions(text) or 1 << 24
    assumption = layout.assumption()

    def fits(c: int) -> bool:
        return weights + layout.bytes(c, batch, nbytes) <= usable

    if not fits(1):
        return ContextBound(shown, batch, weights, usable, 0, "the weights alone", 0, assumption)
    lo, hi = 1, longest + 1   # fits(lo), and hi is past the model's positions or does not fit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    limit = f"the model's positions ({longest:,})" if lo == longest else "memory"
    return ContextBound(shown, batch, weights, usable, lo, limit, layout.bytes(lo, batch, nbytes), assumption)


def context_bounds(models: tuple[str, ...] = ("llama-3-8b", "mistral-7b", "gemma-2-9b"), card: str = "24GiB",
                   batches: tuple[int, ...] = (1, 8), dtype: str = "bfloat16") -> ContextBounds:
    """The longest context weights + KV cache leave room for, per model and batch (formula)."""
    from gpulab.predict.cards import parse_gpu
    from gpulab.units import dtype_bytes
    c = parse_gpu(card)
    nbytes = dtype_bytes(dtype)
    return ContextBounds(tuple(_bound(m, c, b, nbytes, None) for m in models for b in batches), c.name, dtype)


def small_llama():
    """A two-layer Llama-style config with a small vocabulary and unbounded positions."""
    import transformers
    return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                                    num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
                                    max_position_embeddings=1 << 20)


@dataclass(frozen=True)
class MeasuredContext:
    """``measured_longest_context``: longest_context's answer beside the weights + KV bound."""
    bound: ContextBound
    measured: Any            # predict.serve.LongestContext

    @property
    def prefill_gap(self) -> int:
        """What the measured answer needs beyond weights + KV cache at its context (the larger of the
        prefill's and the decode step's working sets)."""
        at = self.measured.at
        return at.needed_one_at_a_time_bytes - at.weights_bytes - at.kv_cache_bytes

    def __repr__(self) -> str:
        return (f"MeasuredContext(bound {self.bound.context:,} tokens, longest_context {self.measured.context_len:,} "
                f"tokens on {self.measured.card})")

    def _repr_html_(self) -> str:
        at = self.measured.at
        body = [["weights + KV cache (formula)", f"{self.bound.context:,}", format_bytes(self.bound.weights),
                 format_bytes(self.bound.kv_at_context), "—", format_bytes(self.bound.usable)],
                ["longest_context (fake tensors)", f"{self.measured.context_len:,}", format_bytes(at.weights_bytes),
                 format_bytes(at.kv_cache_bytes), format_bytes(self.prefill_gap), format_bytes(at.usable_bytes)]]
        head = ["answer", "longest context", "weights", "KV cache", "prefill / decode working set", "usable"]
        return html_table(head, body, caption=(
            f"{self.bound.model} on {self.measured.card}, batch {self.measured.batch}; longest_context: {at.label}; "
            f"{self.measured.runs} contexts tried, each a fake prefill and decode run. {self.bound.assumption}."))


def measured_longest_context(card: str = "48MiB", batch: int = 1) -> MeasuredContext:
    """``longest_context`` for ``small_llama`` in fp32 on a small card (no CUDA context assumed),
    started at the formula's bound, beside that bound."""
    from gpulab.predict.cards import parse_gpu
    from gpulab.predict.serve import longest_context
    config = small_llama()
    bound = _bound(config, parse_gpu(card), batch, 4, 0)
    measured = longest_context(config, card, batch=batch, context_bytes=0, dtype="float32",
                               start=max(2, bound.context))
    return MeasuredContext(bound, measured)
