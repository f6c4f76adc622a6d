"""What a recipe changes in the model before it trains: the model's own activation checkpointing
(transformers' ``activation_checkpointing_enable``) under one of four policies, and LoRA adapters
(``peft``) on a frozen base.

Checkpointing policies (``CHECKPOINTING_POLICIES``; ``check_checkpointing`` reads them):

* ``"full"``: every transformer block recomputed in backward from its saved input (what
  ``TrainingArguments(gradient_checkpointing=True)`` does);
* ``"every-K"``: every K-th block only (transformers' ``every_n_layers``; the blocks between keep
  their activations): less recompute, more memory (torchtitan's selective mode with a layer
  frequency, ``selective_ac_option=K``);
* ``"selective"``: every block under PyTorch's op-level selective activation checkpointing (SAC,
  ``torch.utils.checkpoint.create_selective_checkpoint_contexts``): inside a block the outputs of
  the matrix multiplies and fused attention are saved, everything else (norms, activation
  functions, rotary embeddings, elementwise products) is recomputed in backward. torchtitan's
  op-level policy (``selective_ac_option="op"``, ``torchtitan/distributed/activation_checkpoint.py``)
  is the same idea, but recomputes every second ``mm``; this one keeps them all. It is not
  Megatron-LM's selective recomputation (lesson 07, ``course.selective_checkpointing.selective_checkpoint``),
  which checkpoints only the attention core and keeps everything else.
* ``"torchtitan-op"``: torchtitan's own op-level policy, as its source writes it (torchtitan 0.3.0,
  ``torchtitan/distributed/activation_checkpoint.py``: ``SelectiveAC._wrap_block`` and
  ``_get_default_save_ops``), on every block: the ops saved are torch's compute-intensive list
  (``torch._functorch.partitioners.get_default_op_list().compute_intensive_ops``: mm, bmm, addmm,
  the flash and efficient attention kernels, ``_scaled_mm``, convolutions ...) with the cuDNN, math
  and overrideable attention kernels, ``max`` (the float8 scales' amax), ``linear``, ``topk`` (an
  MoE's routing) and the ``reduce_scatter_tensor`` / ``all_to_all_single`` collectives; of the
  ``mm`` and ``linear`` calls in a block only the odd ones (the 1st, 3rd ...: ``mm_count % 2``) are
  saved, the even ones recomputed; an ``mm`` whose weight has the router's shape is always
  recomputed (torchtitan's ``force_recompute_mm_shapes_by_fqns=["moe.router.gate"]``; here the
  modules transformers names ``gate`` whose weight is (experts, hidden)); a CUDA-to-CPU copy is
  always saved. Each block's call counts from 0 again (a fresh policy per ``context_fn`` call, as
  torchtitan's ``lambda: create_selective_checkpoint_contexts(_get_custom_policy())``).

``"every-K"`` and torchtitan's per-layer SAC (``selective_ac_option="K"`` up to torchtitan 0.2.2,
``_apply_layer_sac``; torchtitan 0.3.0 removed it) differ in which blocks they pick: transformers'
``every_n_layers`` checkpoints blocks 0, K, 2K ... (``layer_index % every_n_layers == 0``,
ceil(L/K) of L blocks); torchtitan counted from 1 (``_layer_sac_count += 1`` then ``% ac_freq == 0``:
blocks K-1, 2K-1 ..., floor(L/K) of them, the last block checkpointed when K divides L). gpulab's is
transformers'.

``adapted(w, lora=R, lora_targets=..., checkpointing="full")`` is the workload ``w`` built that way:
the same inputs and loss, a model that is built, checkpointed and wrapped on the run's device
(under fake tensors through a meta skeleton: ``registry.build_in_place``, since peft moves each
adapter with ``Module.to``, which fake parameters refuse).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from typing import Callable, Sequence

import torch
from torch import nn

from gpulab.models.lora import LORA_DTYPES, check_lora_dtype, check_rank, check_targets, default_targets, wrap_lora
from gpulab.models.quantized import quantization_text, quantize_linears
from gpulab.models.registry import active_fake_mode, build_in_place, build_skeleton, materialize
from gpulab.models.workload import Workload
from gpulab.options import CHECKPOINTING_POLICIES, POLICY_TEXT, check_checkpointing   # torch-free: the CLI checks first

__all__ = ["CHECKPOINTING_KWARGS", "CHECKPOINTING_POLICIES", "POLICY_TEXT", "SELECTIVE_SAVED_OPS", "adapted", "check_checkpointing", "check_lora",
           "enable_checkpointing", "quantized_build", "torchtitan_policy", "torchtitan_save_ops"]

# what transformers 5.x passes to torch.utils.checkpoint when none are given (modeling_utils.py,
# ``_activation_checkpointing_enable``): the non-reentrant implementation
CHECKPOINTING_KWARGS = {"use_reentrant": False}
_PEFT_TASKS = {"causal-lm": "CAUSAL_LM", "seq2seq-lm": "SEQ_2_SEQ_LM"}
# the ops whose outputs selective checkpointing keeps: matrix multiplies (a linear layer runs
# ``mm``, or ``addmm`` with a bias) and the fused attention kernels; everything else in a block is
# recomputed in backward
SELECTIVE_SAVED_OPS = frozenset(op for op in (
    getattr(getattr(torch.ops.aten, name, None), "default", None)
    for name in ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"))
    if op is not None)


def _selective_policy(ctx, func, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy
    return CheckpointPolicy.MUST_SAVE if func in SELECTIVE_SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def torchtitan_save_ops() -> set:
    """The ops torchtitan's op-level SAC saves (torchtitan 0.3.0's ``_get_default_save_ops``, read
    there): torch's compute-intensive ops, the attention kernels, ``max``, ``linear``, ``topk``, and
    the collectives; ops this torch lacks are left out, as torchtitan's ``_resolve_ops`` leaves them."""
    from torch._functorch.partitioners import get_default_op_list
    save = {op.default for op in get_default_op_list().compute_intensive_ops}
    for path in ("aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_attention_math",
                 "aten._scaled_dot_product_fused_attention_overrideable", "aten.max", "aten.linear", "aten.topk",
                 "_c10d_functional.reduce_scatter_tensor", "_c10d_functional.all_to_all_single",
                 "torch_attn._varlen_attn", "deepep.dispatch", "deepep.combine", "hybridep.dispatch",
                 "hybridep.combine"):
        ns, name = path.split(".")
        op = getattr(getattr(getattr(torch.ops, ns, None), name, None), "default", None)
        if op is not None:
            save.add(op)
    for name in ("flex_attention", "inductor_compiled_code"):   # higher-order ops
        op = getattr(torch._higher_order_ops, name, None)
        if op is not None:
            save.add(op)
    return save


def _router_shapes(model: nn.Module) -> set:
    """The (in, out) shapes of an MoE router's weight: torchtitan recomputes every ``mm`` of that shape
    (``force_recompute_mm_shapes_by_fqns``, "moe.router.gate" in its models; transformers names the
    router ``gate``, a weight of (experts, hidden))."""
    shapes = set()
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        if name.rsplit(".", 1)[-1] == "gate" and isinstance(w, torch.Tensor) and w.dim() == 2:
            shapes.add(torch.Size((w.shape[1], w.shape[0])))
    return shapes


def torchtitan_policy(save_ops: set, mm_recompute_shapes: set):
    """A fresh torchtitan op-level policy (its counters at 0) for one checkpointed call: torchtitan's
    ``SelectiveAC._get_custom_policy().wrapped_policy``, line for line."""
    from torch.utils.checkpoint import CheckpointPolicy
    mm_ops = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)
    meta = {"forward_mm_count": 0, "recompute_mm_count": 0}

    def policy(ctx, func, *args, **kwargs):
        if (func == torch.ops.aten._to_copy.default and "cuda" in str(args[0].device) and "device" in kwargs
                and str(kwargs["device"]) == "cpu"):
            return CheckpointPolicy.MUST_SAVE
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func in mm_ops:
            shape = args[1].shape
            if func == torch.ops.aten.linear.default:
                shape = torch.Size((shape[1], shape[0]))
            if shape in mm_recompute_shapes:
                return CheckpointPolicy.PREFER_RECOMPUTE
            meta[key] += 1
        if func in save_ops:
            if func in mm_ops and meta[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def _torchtitan_context(save_ops: set, shapes: set):
    from torch.utils import checkpoint as ck
    return ck.create_selective_checkpoint_contexts(torchtitan_policy(save_ops, shapes))


def _policy_arguments(policy: str, enable, model: nn.Module | None = None) -> tuple[dict, dict]:
    """(the kwargs for torch.utils.checkpoint, the enable method's own kwargs) for ``policy``."""
    from torch.utils import checkpoint as ck
    kwargs, own = dict(CHECKPOINTING_KWARGS), {}
    if policy in ("selective", "torchtitan-op"):
        kwargs["context_fn"] = (functools.partial(ck.create_selective_checkpoint_contexts, _selective_policy)
                                if policy == "selective" else
                                functools.partial(_torchtitan_context, torchtitan_save_ops(),
                                                  _router_shapes(model) if model is not None else set()))
        if "respect_saved_tensors_hooks" in inspect.signature(ck.checkpoint).parameters:
            # what SAC keeps goes through the surrounding saved-tensor hooks, as any saved tensor does
            # (the tracker's, save_on_cpu's); releases before this argument existed bypass them
            kwargs["respect_saved_tensors_hooks"] = True
    elif policy.startswith("every-"):
        if "every_n_layers" not in inspect.signature(enable).parameters:
            raise ValueError(f"checkpointing={policy!r} needs transformers' every_n_layers (transformers 5.x's "
                             f"activation_checkpointing_enable); this transformers lacks it: use full or selective, "
                             f"or update transformers")
        own["every_n_layers"] = int(policy[6:])
    return kwargs, own


def enable_checkpointing(model: nn.Module, policy: str = "full") -> nn.Module:
    """Turn on ``model``'s own activation checkpointing under ``policy`` (see the module
    docstring); ``ValueError`` for a model that has none. Returns ``model``."""
    policy = check_checkpointing(policy) or "full"
    for name, key in (("activation_checkpointing_enable", "activation_checkpointing_kwargs"),
                      ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs")):
        enable = getattr(model, name, None)
        if callable(enable):   # transformers 5.x renamed it; the old name warns that it will go
            kwargs, own = _policy_arguments(policy, enable, model)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(**{key: kwargs}, **own)
            return model
    raise ValueError(f"checkpointing turns on a transformers model's own gradient checkpointing; "
                     f"{type(model).__name__} has none: wrap its blocks in torch.utils.checkpoint.checkpoint "
                     f"yourself and pass the function that builds it, or leave checkpointing out")


def quantized_build(build: Callable[[], nn.Module], kind: str, double_quant: bool = True,
                    compute_dtype: torch.dtype | None = None) -> nn.Module:
    """``build()`` with its linear layers but the head quantized (``models.quantized``). Shapes only
    (a fake mode, or the meta device): built on meta and quantized there, then given storages, so
    the full-precision weights never exist at once (transformers quantizes layer by layer while it
    loads); real tensors (the cpu engine's small models) are built, then quantized, so a cpu run's
    setup briefly holds the full-precision weights too (its training steps are the fake run's).
    ``double_quant`` and ``compute_dtype``: 4-bit's (``models.quantized``)."""
    quantize = functools.partial(quantize_linears, kind=kind, double_quant=double_quant, compute_dtype=compute_dtype)
    if active_fake_mode() is None and torch.get_default_device().type != "meta":
        return quantize(build())
    device = torch.get_default_device()
    return materialize(build_skeleton(lambda: quantize(build())), device)


def _check_rank_fits(config, rank: int, targets: Sequence[str]) -> None:
    """A rank above a targeted layer's smaller side gives adapters larger than a full-rank update
    of that layer: refused, with the largest rank that makes sense."""
    from gpulab.models.lora import rank_refusal, targeted_linears
    try:
        found = targeted_linears(config, targets)
    except ValueError:   # no layer of that name: peft's wrapping says so, with the names there are
        return
    name, i, o = min(found, key=lambda t: min(t[1], t[2]))
    if rank > min(i, o):
        raise rank_refusal(rank, name, i, o)


def check_lora(w: Workload, rank: int, targets: Sequence[str] | None) -> None:
    """LoRA's targets (None: peft's defaults for the model type) and rank checked against ``w``'s model
    built on the meta device (free: names and shapes only), before anything runs
    (``models.lora.check_adapters``)."""
    from gpulab.models.lora import check_adapters
    targets = check_targets(targets) if targets is not None else default_targets(w.config)
    with torch.device("meta"):
        model = w.build(torch.device("meta"), None)
    check_adapters(model, w.name, check_rank(rank), targets)


def adapted(w: Workload, *, lora: int = 0, lora_targets: Sequence[str] | None = None, lora_dropout: float = 0.0,
            checkpointing: bool | str = False, quantize: str | None = None, lora_dtype: str = "fp32",
            double_quant: bool = True, quant_compute_dtype: torch.dtype | None = None) -> Workload:
    """``w`` with its model checkpointed (``checkpointing``: a policy, True for "full") and/or
    wrapped with rank-``lora`` adapters on ``lora_targets`` (None: the layers peft adapts by
    default for the config's model type) with ``lora_dropout`` on their inputs, in ``lora_dtype``
    ("fp32", peft's default, or "base": the model's dtype, torchtune's), its linear layers but the
    head stored as bitsandbytes stores them when ``quantize`` is "nf4", "fp4" or "int8"
    (``models.quantized``, 4-bit with or without ``double_quant``, computing in
    ``quant_compute_dtype``, None for the input's dtype: with LoRA, QLoRA); ``w`` itself when none
    is asked. The description names each choice. ``ValueError`` for a workload that cannot take them."""
    checkpointing = check_checkpointing(checkpointing)
    if not lora and not checkpointing and not quantize:
        return w
    if w.make is None:
        raise ValueError(f"{w.name} is a module instance, which gpulab copies as it is: to add "
                         + ("LoRA" if lora else "checkpointing") + ", pass the function that builds it")
    check_lora_dtype(lora_dtype)
    if lora:
        check_rank(lora)
        targets = check_targets(lora_targets) if lora_targets is not None else default_targets(w.config)
        if w.config is not None:
            _check_rank_fits(w.config, lora, targets)
    task = _PEFT_TASKS.get(w.facts.task) if w.facts is not None else None   # read when resolved
    inner = w.make

    def make(dtype):
        model = (quantized_build(lambda: inner(dtype), quantize, double_quant, quant_compute_dtype) if quantize
                 else inner(dtype))
        if checkpointing:
            enable_checkpointing(model, checkpointing)
            if getattr(getattr(model, "config", None), "use_cache", False):
                model.config.use_cache = False   # what transformers' forward does itself then, with a log line
        if lora:
            adapter_dtype = None if lora_dtype == "fp32" else (dtype or torch.float32)
            model = wrap_lora(model, lora, targets, task_type=task, dropout=lora_dropout, adapter_dtype=adapter_dtype)
        return model

    def build(device, dtype):
        if lora and (active_fake_mode() is not None or (device is not None and torch.device(device).type == "meta")):
            # peft cannot wrap fake parameters (it moves adapters with Module.to, which swaps tensors):
            # straight to a meta skeleton, then storages, without a first attempt that would fail
            return materialize(build_skeleton(lambda: make(dtype), dtype), device or "cpu")
        return build_in_place(lambda: make(dtype), device, dtype)

    parts = (([quantization_text(quantize, double_quant, quant_compute_dtype)] if quantize else [])
             + ([f"LoRA rank {lora} on {', '.join(targets)}, {LORA_DTYPES[lora_dtype]}"] if lora else [])
             + ([f"checkpointed ({checkpointing})"] if checkpointing else []))
    return dataclasses.replace(w, build=build, make=make, description=f"{w.description} ({'; '.join(parts)})")
