"""A mixture of experts under tensor parallelism, with or without expert parallelism, as torchtitan
lays it out (``apply_moe_ep_tp`` in ``torchtitan/models/*/infra/parallelize.py``, v0.2.2; the
styles in ``torchtitan/distributed/expert_parallel.py``), on PyTorch's fake process group.

transformers' own tensor-parallel plans leave a mixture of experts' experts out (Mixtral's and
Qwen3-MoE's ``base_model_tp_plan`` name attention and dense MLPs only; the experts sit in a
separate ``base_model_ep_plan``), so gpulab follows torchtitan for them, per MoE layer:

* **tp without ep** (torchtitan's ``TensorParallel`` for ``GroupedExperts``): every expert's
  gate/up projection column-split (``Shard(1)`` of the ``(E, 2I, h)`` weight) and its down
  projection row-split (``Shard(2)`` of ``(E, h, I)``) over the tp ranks; each rank runs every
  token through its slice of every expert, the output a partial sum.
* **ep with tp** (torchtitan's default ``expert_tensor_parallel_degree = 1``, "[partial dp + all
  tp -> ep] etp = 1", and since #3167 its only layout): the experts are not tp-split: rank 0 holds
  E/ep whole experts (``ExpertParallel``: ``Shard(0)`` over the ep mesh, which borrows from
  ``dp_shard × cp × tp``), and each tp rank dispatches 1/tp of the tokens it shares with its tp
  group (``ReordererSequenceParallel``: the routed tokens split along the folded batch·sequence
  dimension), the output again a partial sum over tp.

The router is replicated on every rank (torchtitan's ``NoParallel`` on ``moe.router.gate``;
gpulab's ``tensor_parallel`` replicates every module its plan leaves out). Each MoE block takes its
input whole (with sequence parallelism: gathered from the sequence shard) and reduces its partial
output over tp: an all-reduce (without sequence parallelism) or, with it, a reduce-scatter back to
the sequence shard (torchtitan's ``PrepareModuleInputOutput(input_layouts=Shard(1),
desired_input_layouts=Replicate(), output_layouts=Partial(), desired_output_layouts=Shard(1))``).

The experts compute on their local tensors, as torchtitan's ``GroupedExperts.forward`` does
(``self.w1.to_local()``): the experts module's parameters are DTensors (what the optimizer steps,
their gradients and state the local shard's), and for its forward its weights are read as their
local tensors (``DTensor.to_local``, whose backward hands each gradient to its DTensor).

NB: torchtitan's expert tensor-parallel degree equal to tp (v0.2.2's ``ExpertTensorParallel``,
removed by #3167) is not measured; every answer says which layout it took (``moe_tp_text``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from gpulab.training.routing import experts_modules

__all__ = ["check_moe_tensor_parallel", "moe_blocks", "moe_tensor_parallel", "moe_tp_text", "tp_ep_meshes"]

_SHARED = ("n_shared_experts", "shared_expert_intermediate_size")   # DeepSeek's, Qwen2-MoE's shared experts


def check_moe_tensor_parallel(w: Any, tp: int, cp: int, ep: int) -> None:
    """ValueError, in one line, for a mixture of experts tp cannot lay out as the module docstring says:
    shared experts (torchtitan splits them with ColwiseParallel / RowwiseParallel(output_layouts=Partial()),
    their partial sum reduced with the routed experts': not measured yet), or, with ep, a rank's sequence
    shard that tp does not split evenly (torchtitan's ReordererSequenceParallel: "Uneven split of tokens
    is not supported yet")."""
    c = w.config
    shared = next((f for f in _SHARED if (getattr(c, f, None) or 0) > 0), None)
    if shared:
        raise ValueError(f"--tp {tp} on a mixture of experts with shared experts ({shared} = {getattr(c, shared)}): "
                         f"their tensor-parallel layout (torchtitan's Colwise/RowwiseParallel with a partial output "
                         f"summed with the routed experts') is not measured yet; leave out --tp (--ep alone answers)")
    shard = (w.seq_len or 0) // cp
    if ep > 1 and shard % tp:
        raise ValueError(f"--ep {ep} with --tp {tp}: each tp rank dispatches 1/tp of its tokens (torchtitan's "
                         f"ReordererSequenceParallel splits them evenly); the rank's {shard} positions do not split "
                         f"{tp} ways: use a sequence length that {tp * cp} divides")


def tp_ep_meshes(world: Any, tp: int, ep: int) -> tuple[Any, Any]:
    """(tp mesh, ep mesh) inside a fake world of ``lcm(tp, ep)`` ranks whose 1-D mesh is ``world``:
    each the world's mesh where it spans it, else the inner dimension of a 2-D mesh over the world
    (``init_device_mesh``), rank 0 in both (on the fake group only the groups' sizes shape what a
    rank allocates)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils._python_dispatch import _disable_current_modes
    n = world.size()

    def part(size: int, name: str) -> Any:
        if size == n:
            return world
        with _disable_current_modes():   # the mesh is a real tensor of rank numbers, not a fake one
            return init_device_mesh("cpu", (n // size, size), mesh_dim_names=(f"not_{name}", name))[name]
    return part(tp, "tp"), (part(ep, "ep") if ep > 1 else None)


def moe_blocks(net: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(MoE block, its experts module) for each MoE layer of ``net``: the module whose child is the
    experts (Mixtral's ``MixtralSparseMoeBlock``, Qwen3-MoE's, DeepSeek-V2's ``DeepseekV2Moe``)."""
    experts = {id(m) for _, m in experts_modules(net)}
    return [(block, child) for block in net.modules() for child in block.children() if id(child) in experts]


def moe_tensor_parallel(net: nn.Module, tp_mesh: Any, ep_mesh: Any, sequence_parallel: bool,
                        apply_tp: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """``net`` (rank 0's model: E/ep experts a layer under ep) with its MoE layers laid out over
    ``tp_mesh`` (and ``ep_mesh``, None without ep) as the module docstring says; ``apply_tp`` (the
    model's own tensor-parallel plan, ``training.tensor_parallel``) splits the rest in between: the
    experts become DTensors first (the plan's replication then leaves them be), the MoE blocks'
    input and output layouts are set after it (after the sequence-parallel gather the plan puts on
    each block's MLP input)."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor import DTensor
    blocks = moe_blocks(net)
    tp = tp_mesh.size()
    for _, experts in blocks:
        if experts.has_bias or experts.is_transposed or not experts.has_gate:
            raise ValueError(f"--tp: {type(experts).__name__} is not the gated, untransposed, bias-free experts layout "
                             f"gpulab splits (Mixtral's, Qwen3-MoE's): its tensor-parallel layout is not measured yet")
        for name, p in list(experts.named_parameters(recurse=False)):
            if ep_mesh is None:   # TensorParallel: gate/up (E, 2I, h) column-split, down (E, h, I) row-split
                local = distribute_tensor(p.detach(), tp_mesh, [Shard(2 if name == "down_proj" else 1)])
            else:   # ExpertParallel: the E/ep experts built are the rank's Shard(0) of all E
                local = DTensor.from_local(p.detach(), ep_mesh, [Shard(0)], run_check=False)
            experts.register_parameter(name, nn.Parameter(local, requires_grad=p.requires_grad))
        experts.register_forward_pre_hook(_local_weights_and_inputs)
        experts.register_forward_hook(_weights_back)
        if ep_mesh is not None:
            experts.gpulab_ep_group = ep_mesh.get_group()
            experts.gpulab_token_split = tp   # ReordererSequenceParallel: 1/tp of the tokens a tp rank
    net = apply_tp(net)
    for block, _ in blocks:
        block.gpulab_tp = (tp_mesh, sequence_parallel)
        block.register_forward_pre_hook(_block_input_local)
        block.register_forward_hook(_block_output_reduced)
    return net


def _local(x: Any) -> Any:
    from torch.distributed.tensor import DTensor
    return x.to_local() if isinstance(x, DTensor) else x


def _local_weights_and_inputs(module: nn.Module, args: tuple) -> tuple:
    """Before the experts run: their weights read as local tensors (an instance attribute shadows the
    registered DTensor parameter for the call), the router's outputs as local tensors."""
    for name, p in module.named_parameters(recurse=False):
        object.__setattr__(module, name, p.to_local())
    return tuple(_local(a) for a in args)


def _weights_back(module: nn.Module, args: tuple, output: Any) -> None:
    for name, _ in module.named_parameters(recurse=False):
        module.__dict__.pop(name, None)


def _block_input_local(module: nn.Module, args: tuple) -> tuple:
    """The MoE block's input whole and local (sequence parallelism's gather already made it a
    replicated DTensor: ``use_local_input=True``)."""
    return tuple(_local(a) for a in args)


def _block_output_reduced(module: nn.Module, args: tuple, output: Any) -> Any:
    """The block's partial sum over tp reduced: all-reduced to a whole local tensor, or with
    sequence parallelism reduce-scattered to a sequence-shard DTensor (the residual stream's)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    mesh, sequence_parallel = module.gpulab_tp
    partial = DTensor.from_local(_local(output), mesh, [Partial()], run_check=False)
    if sequence_parallel:
        return partial.redistribute(mesh, [Shard(1)])
    return partial.redistribute(mesh, [Replicate()]).to_local()


def moe_tp_text(tp: int, ep: int, experts: int) -> str:
    """How an answer names the MoE layers' layout under tp (module docstring)."""
    if ep == 1:
        return (f"experts tp-split over tp {tp} (torchtitan's TensorParallel for experts: gate/up column-, down "
                f"row-wise), every token through every rank's slice")
    return (f"experts not tp-split (expert tensor-parallel degree 1, torchtitan's default: ep borrows from "
            f"dp_shard × cp × tp), each tp rank dispatching 1/{tp} of its tp group's tokens "
            f"(ReordererSequenceParallel); {experts // ep} whole experts a layer")
