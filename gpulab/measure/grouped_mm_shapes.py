"""``torch._grouped_mm``'s output on meta and fake tensors where this torch's meta kernel lags its kernels.

transformers (5.15 and later) runs a mixture of experts' projections with ``torch._grouped_mm``
(``integrations/moe.py``, ``_grouped_mm``: one kernel per projection over the sorted token rows).
torch 2.11 (Colab's) runs it in float32 and float16 on the CPU (checked) and CUDA, but its meta
kernel still checks ``mat_a.dtype == torch.bfloat16`` (``torch/_meta_registrations.py``,
``_meta_grouped_mm_common``: "Expected inputs of BF16 type"), so a shapes-only run of an fp32
MoE model fails there. torch 2.15's meta kernel takes float32, bfloat16 and float16 and makes the
same output as before (``_create_grouped_mm_output_tensor``, present in both).

``OLD_META`` says whether this torch's meta kernel refuses float32 (probed once, on meta tensors);
where it does, ``grouped_mm_output(a, b, offs, bias, out_dtype)`` answers a float32 or float16 call
with the output torch's own helper makes from meta stand-ins of the arguments: the shape, strides
and dtype torch 2.15 gives, so a fake or meta step of an fp32 MoE model gives the same bytes on both
torches. Everywhere else it answers ``NotImplemented`` and torch's kernel runs as it is.

NB: the output only. Autograd's formula for ``_grouped_mm`` (above the dispatch modes) saves
the inputs and calls ``_grouped_mm`` again in backward, answered here the same way.
"""
from __future__ import annotations

import torch

__all__ = ["OLD_META", "grouped_mm_output"]

_OP = getattr(getattr(torch.ops.aten, "_grouped_mm", None), "default", None)
_LAGGING = (torch.float32, torch.float16)


def _meta_refuses_float32() -> bool:
    if _OP is None:
        return False
    a = torch.empty((16, 16), device="meta")
    b = torch.empty((2, 16, 16), device="meta")
    offs = torch.empty((2,), dtype=torch.int32, device="meta")
    try:
        _OP(a, b, offs)
    except RuntimeError:
        return True
    return False


OLD_META = _meta_refuses_float32()


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="meta")


def grouped_mm_output(func, args, kwargs) -> torch.Tensor:
    """A meta tensor: ``_grouped_mm``'s output for these arguments as torch 2.15's meta kernel
    makes it, where this torch's meta kernel refuses their float32/float16 dtype; else
    ``NotImplemented`` (torch's kernel answers)."""
    if not OLD_META or func is not _OP:
        return NotImplemented
    names = ("self", "mat2", "offs", "bias", "out_dtype")
    bound = dict(zip(names, args), **kwargs)
    a, b, offs, bias = bound.get("self"), bound.get("mat2"), bound.get("offs"), bound.get("bias")
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype in _LAGGING
            and b.dtype == a.dtype and bias is None and set(bound) <= set(names)):
        return NotImplemented
    from torch._meta_registrations import _create_grouped_mm_output_tensor
    return _create_grouped_mm_output_tensor(_meta_like(a), _meta_like(b),
                                            None if offs is None else _meta_like(offs), bound.get("out_dtype"))
