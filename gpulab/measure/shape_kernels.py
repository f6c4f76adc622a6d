"""Forwards on meta tensors, faster (``shape_kernels()``): the size checks' and ``breakdown``'s
forward passes, with batch norm answered directly and ops that only make new tensors answered
again from the same op on the same shapes."""
from __future__ import annotations


import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpulab.measure.fake_kernels import _FLOATS, _batch_norm_layout, _batch_norm_statistics_ok
from gpulab.measure.fake_mode import _KEY_SCALARS
from gpulab.measure.grouped_mm_shapes import OLD_META, grouped_mm_output

__all__ = ["shape_kernels"]

# ---- meta tensors: the size checks' and breakdown's forwards ----------------------------------
def _plain_meta(t) -> bool:
    """A meta tensor, or parameter, of no other subclass (a subclass may answer ops itself)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_meta


def _meta_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """``native_batch_norm`` on meta tensors, as its meta kernel answers (the decomposition,
    torch/_decomp/decompositions.py ``native_batch_norm_helper``, on a device that is not the
    CPU): the output in the input's dtype and layout, the mean and inverse std per channel in the
    computation dtype (float32 for 16-bit inputs), in training and in eval alike. The kernel runs
    ~30 ops through Python meta kernels (~2 ms; most of a CNN's meta forward); this makes three
    empty tensors. NotImplemented where the kernel must answer (or raise) itself."""
    if not (_plain_meta(input) and _batch_norm_layout(input)):
        return NotImplemented
    c = input.shape[1]
    for t in (weight, bias, running_mean, running_var):
        if t is not None and not (_plain_meta(t) and t.dim() == 1 and t.shape[0] == c and t.dtype in _FLOATS):
            return NotImplemented
    if not _batch_norm_statistics_ok(input, running_mean, running_var, training):
        return NotImplemented
    comp = torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype
    return (torch.empty_strided(input.shape, input.stride(), dtype=input.dtype, device="meta"),
            torch.empty((c,), dtype=comp, device="meta"), torch.empty((c,), dtype=comp, device="meta"))


def shape_kernels() -> "TorchDispatchMode":
    """For a forward on meta tensors (the size checks, ``breakdown``): batch norm answered
    directly (``_meta_batch_norm``), an op that makes new tensors answered from what the same op
    on the same shapes made before (``_META_ANSWERS``), every other op run as it would be."""
    return _ShapeKernels()


# On meta tensors every op runs a Python meta kernel (~0.1-2 ms) and nothing is cached, so the
# size checks and the breakdown (three forwards of the model) pay for every layer each time,
# though a transformer's or a CNN stage's blocks repeat the very same shapes. An op that
# only makes new tensors (no view, nothing written in place, no data-dependent or random
# output, a built-in aten / prims op) gives outputs that depend only on its arguments' shapes,
# strides, dtypes and values: ``_META_ANSWERS`` keeps, per op and arguments, the outputs'
# shapes, strides and dtypes, and answers again with new empty tensors of exactly those.
_META_ANSWERS: dict[tuple, tuple] = {}
_META_ANSWERS_MAX = 100_000
_META_KEY_SCALARS = (*_KEY_SCALARS, torch.device)
_NOT_CACHED_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape,
                    torch.Tag.nondeterministic_seeded, torch.Tag.inplace_view)


def _answerable(func) -> bool:
    return (isinstance(func, torch._ops.OpOverload) and func.namespace in ("aten", "prims") and not func.is_view
            and not func._schema.is_mutable and func is not torch.ops.aten._unsafe_view.default
            and not any(tag in func.tags for tag in _NOT_CACHED_TAGS))


def _meta_key(func, args, kwargs):
    """The op and everything about its arguments an answer can depend on, or None (an argument
    that is not a plain meta tensor, a number, a list of them ...)."""
    key = [func, torch.get_default_dtype(), torch.is_inference_mode_enabled()]

    def add(items) -> bool:
        key.append(len(items))
        for a in items:
            if isinstance(a, torch.Tensor):
                if not (_plain_meta(a) and a.layout == torch.strided):
                    return False
                key.append((a.dtype, tuple(a.shape), a.stride(), a.storage_offset(), a.untyped_storage().nbytes(),
                            a.requires_grad, a.is_conj(), a.is_neg()))
            elif isinstance(a, (list, tuple)):
                key.append(type(a))
                if not add(a):
                    return False
            elif type(a) in _META_KEY_SCALARS:
                key.append((type(a), a))
            else:
                return False
        return True
    if not add(args) or not add(tuple(kwargs.items())):
        return None
    return tuple(key)


def _fresh_storage_bytes(t: torch.Tensor) -> int:
    """The bytes of the storage ``torch.empty_strided`` gives a tensor of ``t``'s shape and strides."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def _meta_answer(out, args):
    """What to keep of ``out``: (shape, stride, dtype) per output, if every output is a fresh
    meta tensor (its own storage, of the size ``empty_strided`` makes, at offset 0, nothing an
    input holds); else None."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    seen = {a.untyped_storage()._cdata for a in args if isinstance(a, torch.Tensor)}
    answer = []
    for o in outs:
        if not (type(o) is torch.Tensor and o.is_meta and o.layout == torch.strided and o.storage_offset() == 0
                and not o.requires_grad and not o.is_conj() and not o.is_neg()
                and o.untyped_storage().nbytes() == _fresh_storage_bytes(o)):
            return None
        cdata = o.untyped_storage()._cdata
        if cdata in seen:
            return None
        seen.add(cdata)
        answer.append((tuple(o.shape), o.stride(), o.dtype))
    return type(out) if isinstance(out, (tuple, list)) else None, tuple(answer)


class _ShapeKernels(TorchDispatchMode):

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.native_batch_norm.default and not kwargs:
            out = _meta_batch_norm(*args)
            if out is not NotImplemented:
                return out
        if OLD_META and all(_plain_meta(a) for a in args[:2]):   # torch 2.11: fp32 _grouped_mm (grouped_mm_shapes)
            out = grouped_mm_output(func, args, kwargs)
            if out is not NotImplemented:
                return out
        key = _meta_key(func, args, kwargs) if _answerable(func) else None
        if key is not None:
            known = _META_ANSWERS.get(key)
            if known is not None:
                container, outs = known
                made = [torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in outs]
                return made[0] if container is None else container(made)
        out = func(*args, **kwargs)
        if key is not None:
            answer = _meta_answer(out, [*args, *kwargs.values()])
            if answer is not None:
                if len(_META_ANSWERS) >= _META_ANSWERS_MAX:
                    _META_ANSWERS.clear()
                _META_ANSWERS[key] = answer
        return out
