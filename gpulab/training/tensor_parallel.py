"""Tensor (and sequence) parallelism measured per rank, in one process: PyTorch's own APIs on
PyTorch's fake process group.

A layout of N ranks is too large for N real processes on a laptop, and most of its ranks are alike.
``fake_world(N)`` starts ``torch.distributed`` with the fake backend
(``torch.testing._internal.distributed.fake_pg``: every collective returns at once, nothing is
sent), the one torchtitan's memory estimator runs FSDP2 on; ``tensor_parallel`` then splits the
model with ``torch.distributed.tensor.parallel.parallelize_module`` by the model's own
tensor-parallel plan (transformers' ``config.base_model_tp_plan``: ``colwise`` for q/k/v and the
MLP's gate and up projections, ``rowwise`` for the output and down projections; the head's
``colwise_gather_output`` from the model class's ``_tp_plan``). The step then runs on fake tensors
under the tracker, which counts a DTensor by its local shard: rank 0's memory, and every rank of
a tensor-parallel group is alike.

``sequence_parallel`` (Megatron-LM's sequence parallelism, Korthikanti et al. 2022 §4.2.2): the
norms run on a sequence shard (``SequenceParallel``), each block's attention and MLP gather their
input (``PrepareModuleInput``: ``Shard(1)`` to ``Replicate()``) and the row-wise projections
reduce-scatter their output back to a sequence shard (``RowwiseParallel(output_layouts=Shard(1))``),
as torchtitan parallelizes Llama. Only for decoders whose blocks name ``input_layernorm``,
``self_attn``, ``post_attention_layernorm`` and ``mlp`` (Llama, Mistral, Qwen2 and kin); others say so.

NB: the embedding is not split. transformers 5.15 (Colab's) adds ``embed_tokens: embedding_rowwise``
(a vocabulary-parallel embedding) to every tied-embedding config's plan; 5.24 does not, and neither
is measured here: that entry is skipped, so the answer is the same on both (every rank holds the
whole embedding, as in the model's own plan).

NB: the fake group's collectives allocate their outputs as the real ones do (all-gather,
reduce-scatter, all-reduce results); NCCL's own buffers are not in it (GPU-only).
"""
from __future__ import annotations

import contextlib
import fnmatch
from typing import Any, Iterator

import torch
from torch import nn

from gpulab.options import check_tp_options   # torch-free: the CLI checks it before torch loads

__all__ = ["TP_STYLES", "check_tensor_parallel", "check_tp_options", "fake_world", "tensor_parallel"]

TP_STYLES = ("colwise", "rowwise", "colwise_gather_output")
_SP_BLOCK = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


@contextlib.contextmanager
def fake_world(size: int) -> Iterator[Any]:
    """``torch.distributed`` with the fake backend, ``size`` ranks, this process rank 0, for the code
    inside; yields a one-dimensional ``DeviceMesh`` of the ranks (on "cpu": fake CPU tensors stand in
    for the GPUs' in the fake engine's CUDA target)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group is already running in this process: gpulab measures "
                           "tensor parallelism in a fake process group of its own; run it in a fresh process")
    from torch.utils._python_dispatch import _disable_current_modes
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        with _disable_current_modes():   # the mesh is a real tensor of rank numbers (read back), not a fake one
            mesh = init_device_mesh("cpu", (size,))
        yield mesh
    finally:
        dist.destroy_process_group()


def check_tensor_parallel(config: Any, tp: int, sequence_parallel: bool = False) -> None:
    """ValueError, in one line, when ``config`` cannot be split ``tp`` ways: no plan, or heads, KV
    heads or the MLP's width that ``tp`` does not divide (and ``check_tp_options``)."""
    check_tp_options(tp, sequence_parallel)
    if tp == 1:
        return
    plan = getattr(config, "base_model_tp_plan", None) if config is not None else None
    if not plan:
        what = type(config).__name__ if config is not None else "this model"
        raise ValueError(f"{what} has no tensor-parallel plan (transformers' base_model_tp_plan): tensor "
                         f"parallelism is measured for decoders that have one (Llama, Mistral, Qwen2 ...)")
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, field, None)
        if isinstance(value, int) and value % tp:
            raise ValueError(f"--tp {tp} does not divide {field} = {value}: tensor parallelism splits it evenly; "
                             f"use a tp that divides {value}")


def _tied_embedding_entry(config: Any, pattern: str, style: str) -> bool:
    """transformers 5.15's own addition to a tied-embedding config's plan (``PretrainedConfig.__init__``:
    ``"embed_tokens": "embedding_rowwise"`` when ``tie_word_embeddings``), which its later releases (5.24)
    no longer make: not applied, so the embedding stays whole on every rank on both (module docstring)."""
    return pattern == "embed_tokens" and style == "embedding_rowwise" and bool(getattr(config, "tie_word_embeddings", False))


def tensor_parallel(model: nn.Module, mesh: Any, sequence_parallel: bool = False) -> nn.Module:
    """``model`` split over ``mesh`` in place by its transformers tensor-parallel plan (module
    docstring); returns it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    base = getattr(model, "base_model", model)
    base = getattr(base, "model", base) if not hasattr(base, "layers") else base
    plan = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    names = [n for n, _ in base.named_modules()]
    layout: dict[str, Any] = {}
    for pattern, style in plan.items():
        if _tied_embedding_entry(model.config, pattern, style) or style == "replicated_with_grad_allreduce":
            continue   # (replicated: by _replicate_the_rest; the gradient's all-reduce allocates nothing more)
        if style not in styles:
            raise ValueError(f"tensor-parallel style {style!r} of {pattern} is not one gpulab measures ({', '.join(TP_STYLES)})")
        for name in fnmatch.filter(names, pattern):
            if sequence_parallel and style == "rowwise":   # back to a sequence shard, kept a DTensor for the residual add
                layout[name] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
            else:
                layout[name] = styles[style]()
    if sequence_parallel:
        blocks = [n for n in names if fnmatch.fnmatch(n, "layers.*") and n.count(".") == 1]
        for block in blocks:
            if not all(f"{block}.{part}" in names for part in _SP_BLOCK):
                raise ValueError(f"sequence parallelism is measured for decoder blocks with {', '.join(_SP_BLOCK)}; "
                                 f"{block} has other parts")
            for part in ("input_layernorm", "post_attention_layernorm"):
                layout[f"{block}.{part}"] = SequenceParallel()
            for part in ("self_attn", "mlp"):
                layout[f"{block}.{part}"] = PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)} if part == "self_attn" else None,
                    desired_input_kwarg_layouts={"hidden_states": Replicate()} if part == "self_attn" else None,
                    input_layouts=None if part == "self_attn" else (Shard(1),),
                    desired_input_layouts=None if part == "self_attn" else (Replicate(),))
        # a DTensor of the whole sequence's shape: the rotary positions are the whole sequence's
        if getattr(base, "embed_tokens", None) is not None:   # (a later pipeline stage has none)
            layout["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                     use_local_output=False)
        if list(base.norm.parameters()):   # (before a pipeline's last stage: an Identity)
            layout["norm"] = SequenceParallel()
    # module by module in the model's order (a layer's projections together, not each projection over all
    # layers): every layer's setup events then follow each other alike, as layer repeat lays them out
    order = {n: i for i, n in enumerate(names)}
    parallelize_module(base, mesh, dict(sorted(layout.items(), key=lambda kv: order[kv[0]])))
    head = getattr(model, "lm_head", None)
    if head is not None and isinstance(head, nn.Linear):
        parallelize_module(head, mesh, ColwiseParallel(input_layouts=Shard(1) if sequence_parallel else Replicate(),
                                                       output_layouts=Replicate()))
    _replicate_the_rest(model, mesh)
    return model


def _replicate_the_rest(model: nn.Module, mesh: Any) -> None:
    """Every module the plan did not split that holds parameters (the embedding, the norms) gets them
    as replicated DTensors, its inputs made DTensors on the way in and its outputs plain on the way
    out (``distribute_module``; no copies): torch.optim's foreach kernels refuse a list that mixes
    DTensors and plain tensors, so one optimizer can step them all only so (torchtitan leaves no
    parameter plain either)."""
    from torch.distributed.tensor import DTensor, distribute_module
    for module in list(model.modules()):
        own = list(module.parameters(recurse=False))
        if own and not any(isinstance(p, DTensor) for p in own):
            distribute_module(module, mesh, partition_fn=_replicate_own, input_fn=_inputs_replicated,
                              output_fn=_outputs_local)


def _replicate_own(name: str, module: nn.Module, mesh: Any) -> None:
    from torch.distributed.tensor import Replicate, distribute_tensor
    for pname, p in list(module.named_parameters(recurse=False)):
        module.register_parameter(pname, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()]),
                                                      requires_grad=p.requires_grad))


def _inputs_replicated(module: nn.Module, inputs: tuple, mesh: Any) -> tuple:
    from torch.distributed.tensor import DTensor, Replicate
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                 if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)


def _outputs_local(module: nn.Module, outputs: Any, mesh: Any) -> Any:
    from torch.distributed.tensor import DTensor
    return outputs.to_local() if isinstance(outputs, DTensor) else outputs
