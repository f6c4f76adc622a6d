"""Lesson 01's tensor-bytes measuring core: ``x = torch.empty(shape, dtype)`` on an engine's
device, an operation that makes ``y`` (a view, a slice, a copy: ``OPERATIONS``), then ``del x``;
which storages were allocated and which stay alive. It returns data (the ``Measurement``, its
value holding y's layout and the bytes kept); ``gpulab.course.tensor_bytes`` adds the formulas and
the views, and ``gpulab record`` stores ``tensor_as_dict`` for a real GPU.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from gpulab.measure.engines import Measurement, RunContext
from gpulab.units import DTYPES, dtype_name
from gpulab.record.kinds import record_kind
from gpulab.measure.engines import run
from gpulab.units import parse_dtype

__all__ = [
    "OPERATIONS", "Operation", "contiguous_strides", "empty_tensor", "is_contiguous",
    "is_quantized", "operation", "record_tensor_bytes", "tensor_as_dict", "tensor_experiment"
]


def is_quantized(dtype: torch.dtype) -> bool:
    return DTYPES[dtype_name(dtype)].kind == "quantized"


def empty_tensor(shape: Sequence[int], dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty``; quantized dtypes need a quantizer, so they get a per-tensor one."""
    if is_quantized(dtype):
        return torch._empty_affine_quantized(tuple(shape), scale=1.0, zero_point=0, dtype=dtype,
                                             device=device)
    return torch.empty(tuple(shape), dtype=dtype, device=device)


# --- operations ---------------------------------------------------------------------------------

def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of a dense tensor (what ``torch.empty(shape).stride()`` gives)."""
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(1, s)
    return tuple(reversed(strides))


def is_contiguous(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """torch's rule (``TensorImpl::compute_contiguous``): walking from the last dimension, every
    dimension of size > 1 must have stride = product of the sizes after it; a tensor with no
    elements is contiguous."""
    if math.prod(shape) == 0:
        return True
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


def _swap_first_last(seq: Sequence[int]) -> tuple[int, ...]:
    s = list(seq)
    if len(s) >= 2:
        s[0], s[-1] = s[-1], s[0]
    return tuple(s)


@dataclass(frozen=True)
class Operation:
    """What happens to ``x``: the code, the result's shape, and whether it copies."""

    key: str
    code: str                                         # shown to the student
    fn: Callable[[torch.Tensor], torch.Tensor]
    result_shape: Callable[[tuple[int, ...]], tuple[int, ...]]
    copies: Callable[[tuple[int, ...]], bool]         # allocates a new storage?
    needs_dims: bool = False                          # cannot apply to a 0-d tensor


def _slice_shape(shape):
    return (min(1, shape[0]),) + tuple(shape[1:])


def _strided_shape(shape):
    return ((shape[0] + 1) // 2,) + tuple(shape[1:])


OPERATIONS: dict[str, Operation] = {op.key: op for op in (
    Operation("tensor", "y = x", lambda x: x, lambda s: s, lambda s: False),
    Operation("view", "y = x.view(-1)", lambda x: x.view(-1),
              lambda s: (math.prod(s),), lambda s: False),
    Operation("transpose", "y = x.transpose(0, -1)", lambda x: x.transpose(0, -1),
              _swap_first_last, lambda s: False),
    Operation("slice", "y = x[:1]", lambda x: x[:1], _slice_shape, lambda s: False, needs_dims=True),
    Operation("strided slice", "y = x[::2]", lambda x: x[::2], _strided_shape, lambda s: False,
              needs_dims=True),
    Operation("slice + clone", "y = x[:1].clone()", lambda x: x[:1].clone(), _slice_shape,
              lambda s: True, needs_dims=True),
    Operation("transpose + contiguous", "y = x.transpose(0, -1).contiguous()",
              lambda x: x.transpose(0, -1).contiguous(), _swap_first_last,
              # .contiguous() returns the tensor itself when the transposed view already is one
              lambda s: not is_contiguous(_swap_first_last(s), _swap_first_last(contiguous_strides(s)))),
)}


def operation(key: str) -> Operation:
    if key not in OPERATIONS:
        raise ValueError(f"unknown operation {key!r}; valid operations: {', '.join(OPERATIONS)}")
    return OPERATIONS[key]


def tensor_experiment(shp: tuple[int, ...], dt: torch.dtype, op: Operation):
    """x, then y = op(x), then del x (an experiment for ``engines.run``); its value: whether y
    shares x's storage, y's layout, ``memory_allocated`` right after x (CUDA), the bytes kept."""
    def experiment(ctx: RunContext) -> dict[str, Any]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # complex32/bcomplex32 "experimental", quantized deprecation
            x = empty_tensor(shp, dt, ctx.device)
            sx = ctx.snapshot("x")
            try:
                y = op.fn(x)
            except (RuntimeError, NotImplementedError) as exc:
                raise ValueError(f"{op.code} is not supported for {dtype_name(dt)} on the "
                                 f"{ctx.engine} engine ({str(exc).splitlines()[0]})") from None
            facts = {"shares": y.untyped_storage() is x.untyped_storage(), "y_shape": tuple(y.shape),
                     "y_stride": tuple(y.stride()), "y_offset": int(y.storage_offset()),
                     "y_contiguous": bool(y.is_contiguous()), "x_allocated": sx.allocated_bytes}
            del x
            live = ctx.tracker.result(device=str(ctx.device), round_to_cuda_blocks=False).alive()
            facts["kept"] = sum(r.nbytes for r in live)
            del y
        return facts

    return experiment


def tensor_as_dict(m: Measurement) -> dict[str, Any]:
    """Plain JSON-able data of one run (what ``gpulab record`` stores)."""
    v = m.value or {}
    return {"engine": m.engine, "device": m.device, "label": m.label, "peak_bytes": m.peak_bytes,
            "x_allocated": v.get("x_allocated"), "kept": v.get("kept"), "shares": v.get("shares"),
            "y_shape": list(v.get("y_shape", ())), "allocator": dict(m.allocator or {}), "oom": m.oom,
            "error": m.error}


@record_kind("tensor bytes")
def record_tensor_bytes(p: dict[str, Any]) -> dict[str, Any]:
    """Lesson 01's tensor-bytes panel default on the GPU."""
    shape = tuple(int(v) for v in p["shape"].split(","))
    m = run(tensor_experiment(shape, parse_dtype(p["dtype"]), operation(p["operation"])), engine="cuda")
    return {**p, **tensor_as_dict(m)}
