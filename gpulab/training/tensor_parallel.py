"""Tensor (and sequence) parallelism measured per rank, in one process: PyTorch's own APIs on
PyTorch's fake process group.

A layout of N ranks is too large for N real processes on a laptop, and most of its ranks are alike.
``fake_world(N)`` starts ``torch.distributed`` with the fake backend
(``torch.testing._internal.distributed.fake_pg``: every collective returns at once, nothing is
sent), the one torchtitan's memory estimator runs FSDP2 on; ``tensor_parallel`` then splits the
model with ``torch.distributed.tensor.parallel.parallelize_module``. The step then runs on fake
tensors under the tracker, which counts a DTensor by its local shard: rank 0's memory, and every
rank of a tensor-parallel group is alike.

The layout (``LAYOUT``, stated in every answer) is torchtitan's, on a transformers model:

* the blocks by the model's own tensor-parallel plan (transformers' ``config.base_model_tp_plan``:
  ``colwise`` for q/k/v and the MLP's gate and up projections, ``rowwise`` for the output and down
  projections), which torchtitan's Llama plan splits alike;
* the embedding vocabulary-parallel (``VocabParallelEmbedding``): each rank holds rows
  ``V/tp`` of it, looks up the tokens that fall in its rows on its local shard, zeroes the others,
  and the ranks' partial outputs are all-reduced (reduce-scattered to a sequence shard with sequence
  parallelism). Its gradient is computed on the local shard, so it has the weight's local shape
  ``(V/tp, h)``: torchtitan 0.3's ``Embedding.forward`` (its ``tp_group`` path, under ``local_map``)
  and Megatron-LM's ``VocabParallelEmbedding`` do so. NB: the DTensor route to the same split,
  torch's ``RowwiseParallel`` on an ``nn.Embedding`` (torchtitan's ``apply_tp`` before 0.3) and
  transformers' ``embedding_rowwise`` (``EmbeddingParallel``, which ``init_parallel_plans`` adds to
  every model's ``tp_plan`` in 5.25), holds the weight split but its gradient whole and replicated
  ``(V, h)`` on every rank: DTensor's ``embedding_dense_backward_strategy``
  (``torch/distributed/tensor/_ops/_embedding_ops.py``) has no vocabulary-sharded (``Shard(0)``)
  strategy. ``tests/test_tp_embedding_real.py`` checks both on two real gloo ranks;
* the head column-parallel (``ColwiseParallel``: the weight ``Shard(0)``, its rows the vocabulary)
  with its logits all-gathered to the whole vocabulary on every rank (transformers'
  ``colwise_gather_output``, torchtitan without loss parallelism), or with ``loss_parallel`` left
  sharded on the vocabulary (``output_layouts=Shard(-1)``) and the cross-entropy computed on them
  under ``torch.distributed.tensor.parallel.loss_parallel()``, as torchtitan's ``apply_tp`` does
  unless ``disable_loss_parallel`` (0.3's ``lm_head`` always ends in ``Shard(-1)``);
* a tied embedding and head stay one parameter (both ``Shard(0)`` of the same ``(V, h)`` weight;
  torchtitan's ``Decoder`` re-points ``tok_embeddings.weight`` at ``lm_head.weight`` so too).

``sequence_parallel`` (Megatron-LM's sequence parallelism, Korthikanti et al. 2022 §4.2.2): every
norm of a block runs on a sequence shard (``SequenceParallel``), each block's attention and MLP
gather their input (``PrepareModuleInput``: ``Shard(1)`` to ``Replicate()``) and the row-wise
projections reduce-scatter their output back to a sequence shard (``RowwiseParallel(output_layouts=
Shard(1))``), as torchtitan parallelizes Llama. For decoder blocks made of ``self_attn``, ``mlp``
and norms (Llama's two, Gemma-2's four around each half); others say so.

The loop builds the model on the meta device, splits it there, then gives each tensor storage
(``materialize_shards``: a DTensor its local shard only), as torchtitan 0.3's ``trainer.py`` builds
under ``torch.device("meta")``, runs ``parallelize_fn``, then ``model.to_empty(device=init_device)``:
a rank's setup never holds the whole model.

NB: the fake group's collectives allocate their outputs as the real ones do (all-gather,
reduce-scatter, all-reduce results); NCCL's own buffers are not in it (GPU-only).
"""
from __future__ import annotations

import contextlib
import fnmatch
import types
import weakref
from typing import Any, Iterator

import torch
from torch import nn

from gpulab.options import check_tp_options   # torch-free: the CLI checks it before torch loads

__all__ = ["LAYOUT", "TP_STYLES", "check_tensor_parallel", "check_tp_options", "fake_world", "layout_text",
           "loss_parallel_context", "tensor_parallel", "tp_notes",
           "vocab_parallel_embedding"]

TP_STYLES = ("colwise", "rowwise", "embedding_rowwise")
LAYOUT = "torchtitan's TP layout (vocabulary-parallel embedding and head)"
_SP_PARTS = ("self_attn", "mlp")


def layout_text(sequence_parallel: bool = False, loss_parallel: bool = False) -> str:
    """The tensor-parallel layout an answer states (module docstring)."""
    logits = ("logits and loss sharded on the vocabulary (loss_parallel)" if loss_parallel
              else "logits gathered whole on every rank")
    return f"{LAYOUT}{', sequence parallel' if sequence_parallel else ''}, {logits}"


def tp_notes(r: Any) -> dict[str, dict[str, Any]]:
    """What a tensor-parallel rank's answer states about its layout (``r``: the loop's recipe): which
    layout, in the recipe shown and the label; nothing without tensor parallelism."""
    if r.tp == 1:
        return {}
    text = layout_text(r.sequence_parallel, r.loss_parallel)
    return {"tensor_parallel": {"layout": text, "text": f"tp={r.tp}: {text}"}}


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


def loss_parallel_context(on: bool) -> Any:
    """``torch.distributed.tensor.parallel.loss_parallel()`` when ``on`` (the cross-entropy on logits
    sharded on the vocabulary, forward and backward inside it), else nothing."""
    if not on:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel
    return loss_parallel()


def check_tensor_parallel(config: Any, tp: int, sequence_parallel: bool = False, loss_parallel: bool = False) -> None:
    """ValueError, in one line, when ``config`` cannot be split ``tp`` ways: no plan, or heads, KV
    heads or the MLP's width that ``tp`` does not divide (and ``check_tp_options``)."""
    check_tp_options(tp, sequence_parallel, loss_parallel)
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


def tensor_parallel(model: nn.Module, mesh: Any, sequence_parallel: bool = False,
                    loss_parallel: bool = False) -> nn.Module:
    """``model`` split over ``mesh`` in place in torchtitan's layout (module docstring); returns it.
    With ``loss_parallel`` the head's logits stay a DTensor sharded on the vocabulary: the loss and
    its backward must run inside ``loss_parallel_context(True)``."""
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
        if style == "embedding_rowwise":   # the vocabulary-parallel embedding below, whatever the plan says
            continue
        if style == "replicated_with_grad_allreduce":   # replicated by _replicate_the_rest (its gradient's
            continue                                      # all-reduce allocates nothing more)
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
            layout.update(_sequence_parallel_block(base.get_submodule(block), block, PrepareModuleInput,
                                                   SequenceParallel, Replicate, Shard))
        if list(base.norm.parameters()):   # (before a pipeline's last stage: an Identity)
            layout["norm"] = SequenceParallel()
    embedding = getattr(base, "embed_tokens", None)   # (a later pipeline stage has none)
    # module by module in the model's order (a layer's projections together, not each projection over all
    # layers): every layer's setup events then follow each other alike, as layer repeat lays them out
    order = {n: i for i, n in enumerate(names)}
    head = getattr(model, "lm_head", None)
    tied = (isinstance(embedding, nn.Embedding) and isinstance(head, nn.Linear)
            and head.weight is embedding.weight)
    if isinstance(embedding, nn.Embedding):   # first, in the model's order
        vocab_parallel_embedding(embedding, mesh, Shard(1) if sequence_parallel else Replicate())
    parallelize_module(base, mesh, dict(sorted(layout.items(), key=lambda kv: order[kv[0]])))
    if isinstance(head, nn.Linear):
        if tied:   # the embedding's Shard(0) weight is already the head's: no second copy is made
            head.weight = base.embed_tokens.weight
        parallelize_module(head, mesh, ColwiseParallel(input_layouts=Shard(1) if sequence_parallel else Replicate(),
                                                       output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                                       use_local_output=not loss_parallel))
        if tied:   # one (V, h) weight, Shard(0) in both: one parameter, as the model ties it
            head.weight = base.embed_tokens.weight
    _replicate_the_rest(model, mesh)
    return model


def _sequence_parallel_block(block: nn.Module, name: str, prepare: Any, sequence: Any, replicate: Any,
                             shard: Any) -> dict[str, Any]:
    """A decoder block's sequence-parallel styles: ``SequenceParallel`` for each norm the block applies
    to the residual stream (Llama's ``input_layernorm`` and ``post_attention_layernorm``; Gemma-2's
    four, ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm`` too), the attention's and
    the MLP's input gathered from the sequence shard."""
    parts = dict(block.named_children())
    norms = [n for n, m in parts.items() if n not in _SP_PARTS and "norm" in type(m).__name__.lower()]
    others = [n for n, m in parts.items() if n not in _SP_PARTS and n not in norms and list(m.parameters())]
    if not all(p in parts for p in _SP_PARTS) or others or not norms:
        raise ValueError(f"sequence parallelism is measured for decoder blocks made of {' and '.join(_SP_PARTS)} and "
                         f"norms; {name} ({type(block).__name__}) has {', '.join(others or sorted(parts))}: leave out "
                         f"--sequence-parallel")
    out: dict[str, Any] = {f"{name}.{n}": sequence() for n in norms}
    out[f"{name}.self_attn"] = prepare(input_kwarg_layouts={"hidden_states": shard(1)},
                                       desired_input_kwarg_layouts={"hidden_states": replicate()})
    out[f"{name}.mlp"] = prepare(input_layouts=(shard(1),), desired_input_layouts=(replicate(),))
    return out


def vocab_parallel_embedding(module: nn.Module, mesh: Any, output_layout: Any) -> nn.Module:
    """``module``, an ``nn.Embedding`` (or a subclass that scales its output, Gemma's), split over the
    vocabulary in place: the weight ``Shard(0)``; the forward looks the tokens up on the local shard
    (the module's own forward, its weight swapped for the local one for the call), zeroes the tokens
    outside the rank's rows, and the partial sums go to ``output_layout`` (``Replicate()``: an
    all-reduce, returned as a plain tensor; ``Shard(1)``: a reduce-scatter, kept a DTensor), as
    torchtitan's ``Embedding.forward`` and Megatron's ``VocabParallelEmbedding`` do: the weight's
    gradient has its local shape."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    weight = module.weight
    if not isinstance(weight, DTensor):
        module.register_parameter("weight", nn.Parameter(distribute_tensor(weight.detach(), mesh, [Shard(0)]),
                                                         requires_grad=weight.requires_grad))
    offset = mesh.get_local_rank() * -(-module.num_embeddings // mesh.size())   # torch.chunk's rows: ceil(V/tp) a rank
    # the module's forward as it is now (one set on the instance, else its class's), the module held weakly: the
    # forward set below lives in the module's __dict__, so holding the module would make a reference cycle, which
    # keeps the model's storages alive after the step until a full gc.collect (measure.engines._run_host then
    # pays one: about 0.25 s a fake run with torch loaded)
    own = module.__dict__.get("forward")
    this = weakref.ref(module)

    def vocab_parallel_forward(ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        module = this()
        ids = ids.to_local() if isinstance(ids, DTensor) else ids   # token ids: the same on every rank
        param = module._parameters["weight"]
        local = param.to_local()   # differentiable: the gradient reaches the parameter as Shard(0)
        rows = local.shape[0]
        inside = (ids >= offset) & (ids < offset + rows)
        module._parameters["weight"] = local   # transformers' _use_local_dtensor_params swaps alike
        try:
            ids = (ids - offset).clamp(0, max(rows - 1, 0))
            out = own(ids, *args, **kwargs) if own is not None else type(module).forward(module, ids, *args, **kwargs)
        finally:
            module._parameters["weight"] = param
        out = out * inside.unsqueeze(-1).to(out.dtype)
        out = DTensor.from_local(out, mesh, [Partial()], run_check=False).redistribute(mesh, [output_layout])
        return out.to_local() if output_layout == Replicate() else out

    module.forward = vocab_parallel_forward
    return module


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


def materialize_shards(module: nn.Module, device: torch.device | str) -> nn.Module:
    """``module``, built and split on the meta device, given empty storages on ``device`` (in place;
    under a ``FakeTensorMode`` fake tensors): a DTensor parameter or buffer only its local shard
    (``DTensor.from_local`` of the meta DTensor's local shape, its mesh, placements, global shape and
    stride), a plain one its whole shape. torchtitan 0.3 (trainer.py) builds on meta, parallelizes, then
    ``model.to_empty(device=...)``: a rank never holds the whole model. Not ``Module.to_empty``
    itself: its ``_apply`` of ``torch.empty_like`` gives a meta parameter held by two modules (a tied
    ``nn.Embedding`` and ``nn.Linear``) back as two parameters with two storages, and under a
    ``FakeTensorMode`` ``empty_like`` refuses a real meta tensor (``validate_and_convert_non_fake_tensors``);
    here each tensor is made once and put back in every slot that held it (a tied weight stays one
    parameter, a shared buffer one buffer). The values are uninitialised: for memory questions only."""
    from torch.distributed.tensor import DTensor
    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            if isinstance(t, DTensor):
                local = torch.empty(t.to_local().shape, dtype=t.dtype, device=device)
                out = DTensor.from_local(local, t.device_mesh, t.placements, run_check=False,
                                         shape=t.shape, stride=t.stride())
            else:
                out = torch.empty(t.shape, dtype=t.dtype, device=device)
            made[id(t)] = nn.Parameter(out, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else out
        return made[id(t)]
    with torch.no_grad():
        for m in module.modules():
            for slots in (m._parameters, m._buffers):
                for name, t in slots.items():
                    if t is not None:
                        slots[name] = empty(t)
    return module
