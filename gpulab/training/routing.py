"""A mixture of experts' routing as a named assumption, so a fake run has static shapes.

Which expert a token goes to depends on the router's values, so a run on fake tensors (shapes
only) cannot know how many tokens each expert gets. transformers' eager experts loop
(``MixtralExperts.forward``, ``Qwen3MoeExperts.forward``, ``DeepseekV2Experts.forward``) finds
them with ``one_hot`` / ``nonzero`` / ``torch.where``: shapes that depend on data. gpulab names
the counts instead, an explicit assumption every MoE answer carries (``Routing.label``):

* ``"balanced"`` (the default): each expert gets ``tokens·k/E`` token rows, the remainder spread
  one row each over the first experts (a perfectly load-balanced router);
* ``"capacity:F"``: a capacity limit as Switch, GShard and Megatron-LM set it: each expert
  processes ``C = ceil(F·tokens·k/E)`` rows (at most the ``tokens`` it can get), tokens beyond
  it dropped and experts below it padded to it (GShard's dispatch tensor ``[E, C, d]``,
  Megatron's ``--moe-pad-expert-input-to-capacity``): the most a capacity limit lets an expert hold;
* ``"worst"``: every token to the same ``k`` experts (``tokens`` rows each, the others none);
* exact counts (``Routing.exact(counts)``, a list of per-expert row counts per call of an MoE
  layer, in the order the run calls them, repeated if the run calls more): what a real run's router
  chose, read off it (``counts_of_run``) to check the fake engine against it (NB: checkpointing
  runs a layer's forward again in backward, a call of its own);
* ``"router"``: no assumption: the model's own experts implementation and router run (on a real
  engine, what the router chose; on the fake engine only where that implementation has static
  shapes, transformers' default ``grouped_mm``).

**No routing stated** (``None``): where the built model's experts run transformers' ``grouped_mm``
(``experts_implementation``), they run it ("router", ``default_routing``): its bytes do not depend
on the routing (below; tests/test_moe_routing.py shows two real steps whose routers chose
differently holding the same bytes), so the answer needs no routing assumption and says so; it is
also the fast path (one grouped kernel per projection instead of a module per expert: Qwen3-30B-A3B's
8-GPU fit answers in under a minute, where the mirror of its 128 experts did not finish in 25). Elsewhere (an ``"eager"`` config, a model without transformers'
decorator, expert parallelism's dispatch) balanced is assumed, as before.

``routed_experts_forward`` is an experts implementation registered in transformers'
``ExpertsInterface`` (``ALL_EXPERTS_FUNCTIONS``) under ``ROUTED``; ``install_routing(model, r)``
selects it for a run (in the built model's config) and gives each experts module its counts.

**Which implementation it mirrors.** transformers 5 runs ``grouped_mm`` by default
(``PreTrainedModel.get_correct_experts_implementation``: ``"grouped_mm"`` when the config asks
for none, on every class decorated by ``use_experts_implementation``; on CUDA it needs sm80+ and
falls back to a custom op below). grouped_mm's shapes do not depend on the routing: it sorts the
``tokens·k`` (token, expert) pairs and runs every expert in one kernel over them, so its memory is
the same whatever the router chooses (a fake run of it needs no assumption): ``grouped_mm_experts_forward``
(transformers/integrations/moe.py) makes every tensor on the ``S = tokens·k`` sorted rows (the
gather ``hidden_states[perm // k]``, the gate/up and down outputs, the weighting, the un-permute)
and reads the per-expert counts only as ``offs`` (``histc``, ``cumsum``: E values), which size no
tensor; ``torch._grouped_mm`` saves its input and weight for backward. On CUDA the kernel's own
scratch (``GroupMM.cu``: per-group argument arrays and CUTLASS's workspace) is sized on the host
from the group count and SM count, the per-group sizes living on the device, so it cannot follow
the routing either (NB: that scratch is the allocator's, not a tracked tensor). The routing shows in
memory in the eager loop (``experts_implementation="eager"``, what models without the decorator,
remote code and older transformers run, and what the decorator falls back to): one expert at a
time, each holding its own rows' gathered input, gate/up output, activation, down output and
weighting until backward, and each expert's temporaries as large as its rows. So the routed
implementation mirrors the **eager loop**, op for op, with each expert's rows fixed by the
assumption: ``zeros_like`` output; under no_grad ``one_hot`` (E+1 classes), its permute, sum and
``greater`` and ``nonzero``'s index of hit experts; per hit expert ``torch.where``'s (rows, 2)
int64 index, the gather ``hidden_states[token_idx]``, ``linear`` with ``gate_up_proj[e]``,
``chunk``, ``act_fn(gate) * up``, ``linear`` with ``down_proj[e]``, the weighting by
``top_k_weights[token_idx, top_k_pos, None]`` and ``index_add_``. Each expert runs inside a
weightless module ``<experts>.routed.<e>``, so the tracker files that expert's saved activations
under it. NB: the rows' values are placeholders (token 0, slot 0): which tokens an expert gets
changes no shape; on a real engine the numbers computed are not the model's.

**Megatron-LM's formula.** ``megatron/training/theoretical_memory_usage.py``
(``compute_activation_memory``, Korthikanti et al. 2022, Table 2, selective recompute with
sequence parallelism), per transformer layer, in bytes::

    activation_memory = (args.seq_length * args.micro_batch_size * args.hidden_size) * (
        18 + (4 * (args.ffn_hidden_size / args.hidden_size))
    )

It reads neither ``num_experts`` nor ``moe_router_topk`` nor ``moe_ffn_hidden_size``: an MoE layer
is counted as a dense MLP of ``ffn_hidden_size``. ``megatron_layer_bytes`` is that formula, with
``ffn`` given (``k·moe_ffn`` for the routed rows read as one wide MLP); ``eager_expert_bytes`` is
what the eager loop saves per expert, and the tests hold the two apart term by term.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from gpulab.options import check_routing_text   # torch-free: the CLI checks a routing before torch loads

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["GROUPED_MM", "KINDS", "ROUTED", "Routing", "activations_by_expert", "counts_of_run", "ran_routed",
           "default_routing", "eager_expert_bytes", "expert_rows", "experts_implementation", "experts_modules",
           "install_routing", "is_moe", "megatron_layer_bytes", "parse_routing", "register_routed_experts",
           "routed_experts_forward", "stated_routing"]

ROUTED = "gpulab_routed"   # the name the implementation is registered under in transformers' ExpertsInterface
GROUPED_MM = "grouped_mm"  # transformers' default experts implementation (integrations/moe.py)
KINDS = ("balanced", "capacity", "worst", "exact", "router")


@dataclass(frozen=True)
class Routing:
    """How many token rows each expert gets (see the module docstring). ``capacity_factor`` for
    "capacity"; ``counts`` (per MoE layer, per expert) for "exact"; ``implementation`` for "router":
    the experts implementation that ran, where known (its label says what that means for memory)."""
    kind: str = "balanced"
    capacity_factor: float = 0.0
    counts: tuple[tuple[int, ...], ...] = ()
    implementation: str = ""

    @classmethod
    def exact(cls, counts: Sequence[Sequence[int]]) -> "Routing":
        rows = tuple(tuple(int(n) for n in layer) for layer in counts)
        if not rows or any(not layer or min(layer) < 0 for layer in rows):
            raise ValueError("exact routing counts are one list of per-expert token rows (whole numbers, >= 0) "
                             "per MoE layer")
        return cls("exact", counts=rows)

    @property
    def label(self) -> str:
        """The assumption, in words, as every MoE answer states it."""
        if self.kind == "balanced":
            return "MoE routing assumed balanced: tokens·k/E rows per expert"
        if self.kind == "capacity":
            return (f"MoE routing assumed at capacity {self.capacity_factor:g}: every expert processes "
                    f"ceil({self.capacity_factor:g}·tokens·k/E) rows (dropped above, padded below)")
        if self.kind == "worst":
            return "MoE routing assumed worst: every token to the same k experts"
        if self.kind == "router" and self.implementation == GROUPED_MM:
            return ("MoE experts: transformers' grouped_mm, the router's own choice: its tensors hold the tokens·k "
                    "routed rows however they are routed, so memory needs no routing assumption "
                    "(balanced, capacity:F or worst run the eager experts loop under one)")
        if self.kind == "router":
            return "MoE routing: the router's own choice (the model's experts implementation, no assumption)"
        return f"MoE routing: exact counts per expert given for {len(self.counts)} MoE-layer calls"

    @property
    def text(self) -> str:
        """The option's value as written (``routing="capacity:1.25"``)."""
        return f"capacity:{self.capacity_factor:g}" if self.kind == "capacity" else self.kind


def parse_routing(value: Any) -> Routing | None:
    """``None`` (the default: balanced where the model has experts), "balanced",
    "capacity:F" (F > 0), "worst", a ``Routing``, or exact counts (a list per MoE layer).
    Anything else: ``ValueError`` in one line."""
    if value is None or isinstance(value, Routing):
        return value
    if isinstance(value, (list, tuple)):
        return Routing.exact(value)
    kind, factor = check_routing_text(value)
    return Routing(kind, capacity_factor=factor)


def expert_rows(r: Routing, tokens: int, top_k: int, experts: int, layer: int = 0) -> list[int]:
    """The token rows each expert processes in one MoE layer under ``r`` (``layer``: the call's
    number in the run, for exact counts)."""
    if r.kind == "balanced":
        base, extra = divmod(tokens * top_k, experts)
        return [base + (e < extra) for e in range(experts)]
    if r.kind == "capacity":
        return [min(tokens, math.ceil(r.capacity_factor * tokens * top_k / experts))] * experts
    if r.kind == "worst":
        return [tokens if e < top_k else 0 for e in range(experts)]
    counts = list(r.counts[layer % len(r.counts)])
    if len(counts) != experts or max(counts) > tokens:
        raise ValueError(f"exact routing counts of MoE-layer call {layer}: {experts} experts of at most {tokens} "
                         f"rows each expected, got {counts}")
    return counts


def experts_modules(model: "nn.Module") -> list[tuple[str, "nn.Module"]]:
    """The model's routed-experts modules (classes under transformers' ``use_experts_implementation``),
    in order: one per MoE layer. The decorator's ``__init__`` marks them: ``has_gate`` and
    ``is_transposed`` in every transformers 5 release gpulab runs (5.15, Colab's, has no
    ``_is_expert_parallel`` or ``has_post_expert_norm`` yet; 5.24 has both)."""
    return [(name, m) for name, m in model.named_modules()
            if hasattr(m, "has_gate") and hasattr(m, "is_transposed") and hasattr(m, "num_experts")
            and hasattr(m, "down_proj")]


def experts_implementation(model_or_config: Any) -> str:
    """The experts implementation transformers runs: a built model's, as its experts modules' config
    names it ("" where it has none); for a config, the one it asks for, else transformers' default
    (``PreTrainedModel.get_correct_experts_implementation``: "grouped_mm" where the model class can
    set one, i.e. its modeling module uses ``@use_experts_implementation``, the heuristic of
    ``_can_set_experts_implementation``; else "eager")."""
    if hasattr(model_or_config, "named_modules"):
        found = experts_modules(model_or_config)
        return (getattr(found[0][1].config, "_experts_implementation", None) or "") if found else ""
    asked = getattr(model_or_config, "_experts_implementation", None)
    if asked:
        return asked
    import importlib
    import inspect
    try:
        module = importlib.import_module(type(model_or_config).__module__.replace(".configuration_", ".modeling_"))
        source = inspect.getsource(module)
    except (ImportError, OSError, TypeError):
        return "eager"
    return GROUPED_MM if "@use_experts_implementation" in source else "eager"


def default_routing(implementation: str, ep: int = 1) -> Routing:
    """The routing a run takes when none is stated (module docstring): transformers' own
    ``grouped_mm`` where the experts run it ("router": its bytes do not depend on the routing),
    else balanced (the eager loop, and expert parallelism's dispatch, need counts)."""
    return Routing("router", implementation=GROUPED_MM) if implementation == GROUPED_MM and ep == 1 else Routing()


def stated_routing(routing: Routing | None, config: Any, ep: int = 1) -> Routing:
    """The routing an MoE answer states: the one asked for, else ``default_routing`` for the
    config's experts implementation; "router" on grouped_mm says so."""
    impl = experts_implementation(config)
    if routing is None:
        return default_routing(impl, ep)
    if routing.kind == "router" and not routing.implementation and impl == GROUPED_MM:
        return Routing("router", implementation=GROUPED_MM)
    return routing


def is_moe(model_or_config: Any) -> bool:
    """Whether a model (or a config) routes tokens to experts."""
    if hasattr(model_or_config, "named_modules"):
        return bool(experts_modules(model_or_config))
    return any(getattr(model_or_config, f, None) for f in ("num_local_experts", "num_experts", "n_routed_experts"))


class _ExpertRows:
    """Made lazily (torch is imported on first use): the weightless module one expert runs in."""
    cls = None

    @classmethod
    def make(cls, index: int) -> "nn.Module":
        if cls.cls is None:
            from torch import nn

            class ExpertRows(nn.Module):
                """One routed expert's computation, for its rows (no weights of its own: the tracker
                files what it saves under this module's name)."""

                def __init__(self, index: int):
                    super().__init__()
                    self.index = index

                def forward(self, experts, hidden_states, top_k_weights, rows, final):
                    return _one_expert(experts, self.index, hidden_states, top_k_weights, rows, final)
            cls.cls = ExpertRows
        return cls.cls(index)


def register_routed_experts() -> None:
    """Register ``routed_experts_forward`` in transformers' ``ExpertsInterface`` (once)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    if ROUTED not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(ROUTED, routed_experts_forward)


def install_routing(model: "nn.Module", r: Routing | None) -> Routing | None:
    """Make ``model``'s experts run ``routed_experts_forward`` under ``r`` (None: ``default_routing``
    for the model's experts implementation), one weightless module per expert; returns the routing
    installed (or "router": the model's own implementation left to run), or None for a model
    without routed experts (nothing changed)."""
    found = experts_modules(model)
    if not found:
        return None
    from torch import nn
    r = r or default_routing(experts_implementation(model))
    if r.kind == "router":
        return r
    calls = {"n": 0}   # MoE-layer calls so far in this model's run (exact counts are per call)
    for _, m in found:
        if m.has_bias or m.is_transposed or not m.has_gate or getattr(m, "has_post_expert_norm", False):
            raise ValueError(f"routing: {type(m).__name__} is not the gated, untransposed, bias-free layout the "
                             f"eager loop gpulab mirrors (Mixtral, Qwen3-MoE, DeepSeek-V2 are)")
        m.gpulab_routing, m.gpulab_calls = r, calls
        if not hasattr(m, "routed"):
            m.routed = nn.ModuleList(_ExpertRows.make(e) for e in range(m.num_experts))
    register_routed_experts()
    for _, m in found:   # the experts read the model's config (a copy per build): the implementation named there
        m.config._experts_implementation_internal = ROUTED
    return r


def routed_experts_forward(self: "nn.Module", hidden_states: "torch.Tensor", top_k_index: "torch.Tensor",
                           top_k_weights: "torch.Tensor") -> "torch.Tensor":
    """transformers' eager experts loop with each expert's rows fixed by ``self.gpulab_routing``
    (see the module docstring): the same ops on the same shapes, none data-dependent."""
    import torch
    tokens, top_k = hidden_states.size(0), top_k_index.size(-1)
    call = self.gpulab_calls["n"]
    self.gpulab_calls["n"] = call + 1
    rows = expert_rows(self.gpulab_routing, tokens, top_k, self.num_experts, call)
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
        expert_mask = expert_mask.permute(2, 1, 0)
        hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0)
        # nonzero's answer, at the size the assumption gives
        expert_hit = torch.zeros((sum(1 for n in rows if n), 1), dtype=torch.long, device=hidden_states.device)
        del hit
    for e, n in enumerate(rows):
        if n:
            is_sentinel = torch.zeros((), dtype=torch.bool, device=hidden_states.device)   # expert_idx == E
            del is_sentinel
            self.routed[e](self, hidden_states, top_k_weights, n, final_hidden_states)
    del expert_mask, expert_hit
    return final_hidden_states


def _one_expert(self, e: int, hidden_states, top_k_weights, n: int, final_hidden_states):
    """One expert of the eager loop on ``n`` rows (``torch.where``'s index: an (n, 2) int64)."""
    import torch
    from torch import nn
    where = torch.zeros((n, 2), dtype=torch.long, device=hidden_states.device)
    top_k_pos, token_idx = where.unbind(1)
    del where
    current_state = hidden_states[token_idx]
    gate, up = nn.functional.linear(current_state, self.gate_up_proj[e]).chunk(2, dim=-1)
    current_hidden_states = self.act_fn(gate) * up
    current_hidden_states = nn.functional.linear(current_hidden_states, self.down_proj[e])
    current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
    final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
    return final_hidden_states


def counts_of_run(model: "nn.Module") -> tuple[list[list[int]], list]:
    """Hooks that record how many rows each expert got at every call of an MoE layer in the model's
    real forwards (from ``top_k_index``), in call order: ``Routing.exact``'s counts. Returns (the
    list, filled in as forwards run; the hooks' handles)."""
    import torch
    counts: list[list[int]] = []

    def hook(mod, args):
        counts.append(torch.bincount(args[1].reshape(-1), minlength=mod.num_experts).tolist())
    return counts, [m.register_forward_pre_hook(hook) for _, m in experts_modules(model)]


def activations_by_expert(tracking: Any, start: int = 0, end: int | None = None) -> dict[tuple[str, int], int]:
    """Saved activations (bytes) each expert's module created between events ``start`` and ``end``
    of a tracked run (``TrackingResult``; e.g. one step's marks), by (experts module, expert)."""
    out: dict[tuple[str, int], int] = {}
    for rec in tracking.records.values():
        owner, sep, rest = rec.module.rpartition(".routed.")
        if (sep and rest.isdigit() and rec.category.value == "activations" and rec.created >= start
                and (end is None or rec.created < end)):
            out[(owner, int(rest))] = out.get((owner, int(rest)), 0) + rec.nbytes
    return out


def ran_routed(tracking: Any) -> bool:
    """Whether a tracked run ran experts under a routing assumption (their modules made tensors)."""
    return tracking is not None and any(".routed." in rec.module for rec in tracking.records.values())


def eager_expert_bytes(rows: int, hidden: int, moe_ffn: int, itemsize: int, weight_itemsize: int = 4) -> int:
    """What the eager loop saves for backward for one expert on ``rows`` token rows (bytes):
    the gathered input (h) for the gate/up linear, the gate/up output (2·I: the activation's input
    and ``up`` for the product), the activation's output (I) for the product, the product (I) for
    the down linear, the down output (h) for the weighting, the weighted output (h: ``index_add_``'s
    derivative, ``grad.index_select(dim, index).expand_as(source)`` in PyTorch's derivatives.yaml,
    keeps its source), the routing weights gathered per row (``weight_itemsize``: the router's
    fp32), and ``torch.where``'s (rows, 2) int64 index (the gather's and ``index_add_``'s). NB: SiLU
    saves its input, the gate half of the gate/up output already counted; the tracker files the
    activation's output under the ``act_fn`` module, the rest under the expert's."""
    return rows * ((hidden + 2 * moe_ffn + moe_ffn + moe_ffn + hidden + hidden) * itemsize + weight_itemsize + 2 * 8)


def megatron_layer_bytes(seq: int, micro_batch: int, hidden: int, ffn: int) -> float:
    """Megatron-LM's activation bytes of one transformer layer (``compute_activation_memory``:
    ``s·b·h·(18 + 4·ffn/h)``, 16-bit activations, selective recompute, no tensor parallelism).
    NB: its MLP term ``4·ffn/h`` is a dense GeLU MLP's (the first linear's 2-byte input counted in
    the 18, the GeLU input and the second linear's input 2·ffn bytes each per token)."""
    return seq * micro_batch * hidden * (18 + 4 * (ffn / hidden))
