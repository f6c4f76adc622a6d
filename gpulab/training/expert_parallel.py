"""Expert parallelism measured per rank, in one process: a mixture of experts' experts split over
``ep`` ranks, tokens dispatched to them and combined back by all-to-all on PyTorch's fake process
group.

**The rank's model.** Rank 0 of an expert-parallel group holds ``E/ep`` of the ``E`` experts of
every MoE layer: ``expert_shard(w, ep)`` builds the model with ``E/ep`` experts per layer (their
weights, hence their gradients and optimizer state, are the rank's share) and the router whole
(``E`` outputs: every rank routes its own tokens over all experts). Attention, norms and
embeddings stay whole (replicated, as in torchtitan's EP without TP).

**The step.** ``install_expert_parallel(net, ep)`` makes each experts module run
``ep_experts_forward`` (registered in transformers' ``ExpertsInterface`` as ``EP_ROUTED``), the
dispatch torchtitan's and Megatron-LM's all-to-all token dispatchers run:

1. *dispatch send buffer*: this rank's ``tokens·k`` (token, expert) rows, permuted by expert (a
   gather: ``tokens·k × h``);
2. *dispatch receive buffer*: ``all_to_all_single`` (``torch.distributed._functional_collectives
   .all_to_all_single_autograd``: its backward is the reverse all-to-all) brings the rows the
   rank's experts get from every rank of the group (``Σ rows × h``);
3. each local expert's gate/up, activation and down on its slice of the received rows;
4. *combine send buffer* (the experts' outputs, ``Σ rows × h``) and *combine receive buffer*
   (``tokens·k × h``), the all-to-all back;
5. the rows weighted by the router's top-k weights and summed into each token (``index_add_``).

How many rows the rank's experts receive is the routing assumption's (``training.routing``,
never the router's values on fake tensors): the group's ``ep·tokens`` tokens routed over all
``E`` experts, rank 0 holding experts ``0 … E/ep − 1``. Balanced: ``ep·tokens·k/E`` rows per
expert, ``tokens·k`` in all (the receive buffer equals the send buffer); worst: every token of the
group to experts ``0 … k−1``, all on rank 0 when ``k ≤ E/ep``: ``k·ep·tokens`` rows, ``ep`` times the
send buffer (the rank that binds). ``ep_buffers`` states the four buffers' sizes from the same rows.

NB: the fake group's all-to-all allocates its output and moves no data; NCCL's own buffers are
not counted. With a real router the split sizes are exchanged first (a small all-to-all of
counts); not counted either.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpulab.options import check_ep_options   # torch-free: the CLI checks it before torch loads
from gpulab.training.routing import Routing, expert_rows, experts_modules, is_moe

__all__ = ["EP_ROUTED", "EpBuffers", "check_ep_options", "check_expert_parallel", "ep_buffers", "ep_experts_forward",
           "expert_parameter_shapes", "expert_rank_model", "expert_shard", "expert_shard_workload",
           "install_expert_parallel", "total_experts", "widen_routers"]

EP_ROUTED = "gpulab_ep_routed"
_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")


def total_experts(config: Any) -> int | None:
    """The routed experts per MoE layer a config names (None for a dense model)."""
    for field in _EXPERT_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_expert_parallel(config: Any, ep: int, routing: Routing | None) -> None:
    """ValueError, in one line: ep on a dense model, experts that ep does not divide, or the
    router's own choice (a fake run needs a routing assumption to size the dispatch)."""
    check_ep_options(ep)
    if ep == 1:
        return
    experts = total_experts(config) if config is not None else None
    if not experts or not is_moe(config):
        raise ValueError(f"--ep {ep}: expert parallelism splits a mixture of experts' experts over ranks; this is a "
                         f"dense model (no routed experts): leave --ep out")
    if experts % ep:
        divisors = [d for d in range(2, experts + 1) if experts % d == 0]
        raise ValueError(f"--ep {ep} does not divide the {experts} experts per layer: each rank holds experts/ep of "
                         f"them; use --ep {' or '.join(map(str, divisors[:6]))}")
    if routing is not None and routing.kind in ("router", "exact"):
        raise ValueError(f"--ep {ep} sizes the all-to-all by a routing assumption: use routing balanced, "
                         f"capacity:F or worst with it (not {routing.kind})")


def expert_shard(config: Any, ep: int) -> Any:
    """A copy of ``config`` whose MoE layers build ``E/ep`` experts (the rank's share); the routers
    are widened back to ``E`` outputs by ``install_expert_parallel``."""
    local = copy.deepcopy(config)
    for field in _EXPERT_FIELDS:   # the first one named (Mixtral's num_experts is an alias of num_local_experts)
        value = getattr(local, field, None)
        if isinstance(value, int) and value > 0:
            setattr(local, field, value // ep)
            return local
    return local


def _routers(net: nn.Module, local: int) -> list[nn.Module]:
    """The MoE layers' routers: modules with a top-k and a (local experts × h) weight."""
    return [m for m in net.modules() if hasattr(m, "top_k") and isinstance(getattr(m, "weight", None), torch.Tensor)
            and m.weight.dim() == 2 and m.weight.shape[0] == local and not hasattr(m, "down_proj")]


def widen_routers(net: nn.Module, ep: int, experts: int) -> None:
    """The rank's routers scoring all ``experts`` (``net`` built from ``expert_shard``'s config, whose
    routers have E/ep outputs): routing stays global, as in torchtitan's EP (its
    ``TokenChoiceTopKRouter`` keeps ``num_experts`` = E and only ``GroupedExperts``' weights are
    ``Shard(0)`` over the EP mesh): top-k over all E whatever E/ep is, so a rank with fewer local
    experts than top-k (Mixtral at ep 8: 1 expert, top-2) routes as the whole model does. Routers
    already widened are left alone."""
    local = experts // ep
    for router in _routers(net, local):
        w = router.weight
        router.weight = nn.Parameter(w.new_empty((experts, w.shape[1])), requires_grad=w.requires_grad)
        if hasattr(router, "num_experts"):
            router.num_experts = experts
        if isinstance(getattr(router, "e_score_correction_bias", None), torch.Tensor):
            router.register_buffer("e_score_correction_bias", router.e_score_correction_bias.new_zeros(experts))


def install_expert_parallel(net: nn.Module, ep: int, experts: int, routing: Routing | None) -> Routing:
    """``net`` (built from ``expert_shard``'s config) as rank 0 of ``ep`` expert-parallel ranks:
    each router scoring all ``experts`` (``widen_routers``), each experts module running
    ``ep_experts_forward`` under ``routing`` (None: balanced). Returns the routing."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    found = experts_modules(net)
    r = routing or Routing()
    widen_routers(net, ep, experts)
    calls = {"n": 0}
    for _, m in found:
        if m.has_bias or m.is_transposed or not m.has_gate:
            raise ValueError(f"expert parallelism: {type(m).__name__} is not the gated, untransposed, bias-free "
                             f"layout gpulab dispatches (Mixtral, Qwen3-MoE, DeepSeek-V2 are)")
        m.gpulab_routing, m.gpulab_calls, m.gpulab_ep = r, calls, (ep, experts)
        m.config._experts_implementation_internal = EP_ROUTED
    if EP_ROUTED not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(EP_ROUTED, ep_experts_forward)
    return r


def expert_rank_model(w: Any, recipe: Any, dtype: torch.dtype) -> nn.Module:
    """Rank 0's model of ``recipe.ep`` expert-parallel ranks on the meta device, as the run builds it
    (E/ep experts a layer, the routers whole): what a sharding strategy counts."""
    net = expert_shard_workload(w, recipe.ep).build(torch.device("meta"), dtype)
    install_expert_parallel(net, recipe.ep, total_experts(w.config), recipe.routing)
    return net


def expert_parameter_shapes(net: nn.Module) -> frozenset[tuple[int, ...]]:
    """The shapes of the routed experts' own parameters in ``net`` (rank 0's model: E/ep experts a
    layer, stacked in 3-D tensors), which a data-parallel strategy splits over the expert data-parallel
    group; their gradients and optimizer state have the same shapes."""
    return frozenset(tuple(p.shape) for _, m in experts_modules(net) for p in m.parameters(recurse=False))


def _even(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def ep_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """One MoE layer on rank 0 of the expert-parallel group (module docstring: dispatch, local
    experts, combine), the rows fixed by the routing assumption."""
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    ep, experts = self.gpulab_ep
    split = getattr(self, "gpulab_token_split", 1)   # with tp: each TP rank dispatches 1/tp of the tokens
    tokens, k = hidden_states.size(0) // split, top_k_index.size(-1)
    call = self.gpulab_calls["n"]
    self.gpulab_calls["n"] = call + 1
    rows = expert_rows(self.gpulab_routing, ep * tokens, k, experts, call)[:experts // ep]
    group = getattr(self, "gpulab_ep_group", None) or dist.group.WORLD
    pairs = torch.zeros(tokens * k, dtype=torch.long, device=hidden_states.device)   # (token, expert) rows, by expert
    send = hidden_states[pairs]
    received = all_to_all_single_autograd(send, _even(sum(rows), ep), _even(tokens * k, ep), group)
    del send
    outputs, start = [], 0
    for e, n in enumerate(rows):
        if n:
            gate, up = nn.functional.linear(received[start:start + n], self.gate_up_proj[e]).chunk(2, dim=-1)
            outputs.append(nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e]))
            start += n
    combined = torch.cat(outputs) if outputs else received.new_zeros((0, received.size(-1)))
    del received, outputs
    back = all_to_all_single_autograd(combined, _even(tokens * k, ep), _even(sum(rows), ep), group)
    del combined
    weighted = back * top_k_weights[:tokens].reshape(-1, 1).to(back.dtype)
    final = torch.zeros_like(hidden_states)
    final.index_add_(0, pairs // k, weighted)
    return final


@dataclass(frozen=True)
class EpBuffers:
    """The all-to-all buffers of one MoE layer on rank 0 (bytes), from the rows the routing gives."""
    dispatch_send: int
    dispatch_receive: int
    combine_send: int
    combine_receive: int
    rows_received: int
    local_experts: int

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @property
    def text(self) -> str:
        from gpulab.units import format_bytes as f
        return (f"all-to-all per MoE layer: dispatch send {f(self.dispatch_send)}, receive "
                f"{f(self.dispatch_receive)} ({self.rows_received} rows for {self.local_experts} local experts), "
                f"combine send {f(self.combine_send)}, receive {f(self.combine_receive)}")


def ep_buffers(routing: Routing | None, tokens: int, top_k: int, experts: int, ep: int, hidden: int,
               itemsize: int) -> EpBuffers:
    """The four all-to-all buffers' sizes of one MoE layer on rank 0 of ``ep`` ranks (``tokens``:
    the rank's tokens, batch × sequence), as ``ep_experts_forward`` makes them."""
    rows = sum(expert_rows(routing or Routing(), ep * tokens, top_k, experts)[:experts // ep])
    mine = tokens * top_k
    return EpBuffers(mine * hidden * itemsize, rows * hidden * itemsize, rows * hidden * itemsize,
                     mine * hidden * itemsize, rows, experts // ep)


def expert_shard_workload(w: Any, ep: int) -> Any:
    """``w`` building rank 0's model of ``ep`` expert-parallel ranks (``expert_shard``'s config; the
    workload keeps the whole config, which checks and answers read)."""
    if ep == 1:
        return w
    from gpulab.models import hf_configs
    from gpulab.models.registry import build_in_place
    local, experts = expert_shard(w.config, ep), total_experts(w.config)

    def rank_model(net: nn.Module) -> nn.Module:
        widen_routers(net, ep, experts)   # E/ep experts, routing over all E
        return net

    def build(device, dtype):
        return rank_model(build_in_place(lambda: hf_configs.build_model(local, dtype), device, dtype))
    return dataclasses.replace(w, build=build, make=lambda dtype: rank_model(hf_configs.build_model(local, dtype)))
