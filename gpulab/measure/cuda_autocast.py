"""CUDA's autocast policy, applied to a run on fake CPU tensors.

``torch.autocast`` keeps one table of ops per device (``aten/src/ATen/autocast_mode.cpp`` and the
``AT_FORALL_*`` lists of ``autocast_mode.h``). The CPU's table and CUDA's differ: on CUDA,
softmax, log_softmax, layer_norm, rms_norm, the losses, sum, pow, exp, the norms and the rest of
the "fp32" lists run in float32, and ``binary_cross_entropy`` is refused; on the CPU those ops
run in whatever dtype arrives (bf16/fp16 after a matmul), and cat / stack promote. A fake
CUDA-target run executes on fake *CPU* tensors (``fake_cuda``), so the CPU's table would apply.

``cuda_autocast_policy()`` swaps it for CUDA's for the duration: every op of CUDA's table gets a
kernel at the ``AutocastCPU`` dispatch key that does what CUDA's ``WrapFunction_`` does for its
policy, with the CPU's autocast dtype as the lower precision, and every op only the CPU's table
names gets a kernel that passes it through, as CUDA's fallthrough does. The casts happen above
autograd, exactly where autocast makes them, so autograd saves the tensors CUDA's autocast
would hand it (a float32 copy of a float16 activation before ``layer_norm``, for one).

Policies (``CastPolicy`` in ``autocast_mode.h``):

The C++ wrappers cast each argument in a call ``F(cached_cast(args)...)``, whose evaluation order
C++ leaves to the compiler; GCC on x86-64 (PyTorch's Linux wheels) evaluates right to left, so
``linear(x, w)`` casts ``w`` before ``x``. The emulation casts in that order too: it is the order
of the allocations, which the allocator simulator replays.

* ``lower_precision_fp``: floating inputs cast to the autocast dtype; casts of float32 leaf
  tensors that require grad (the weights) are cached until autocast exits, as ``cached_cast``
  does, so a weight used twice is cast once;
* ``fp32``: floating inputs cast to float32;
* ``fp32_set_opt_dtype``: an op with an optional ``dtype`` argument (softmax, sum, ...) gets
  ``dtype=float32`` unless given one, when its first input is eligible;
* ``fp32_append_dtype``: ``norm`` without a dtype redispatches to its overload with
  ``dtype=float32``;
* ``promote``: inputs cast to the widest floating dtype among them (float32 if any is);
* ``banned``: ``binary_cross_entropy`` raises, as on CUDA.

"Eligible" is ``is_eligible``: a defined floating tensor on the autocast's device that is not
float64. ``CUDA_AUTOCAST`` is the table as data, written from ``autocast_mode.h`` of torch 2.15
(with torch 2.11's ops that 2.15 dropped), kept to the ops the installed torch registers;
``tests/test_cuda_autocast.py`` checks the written tables cover every ``AutocastCUDA`` kernel the
installed torch registers, and checks the policies by running the real CUDA kernels on fake cuda
tensors beside this emulation.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator

import torch

__all__ = ["CUDA_AUTOCAST", "POLICIES", "cuda_autocast_policy", "cuda_policy_of"]

POLICIES = ("lower_precision_fp", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote", "banned")

_LOWER = (  # AT_FORALL_LOWER_PRECISION_FP, cudnn_convolution(_transpose), and cuDNN's RNN
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr",
    "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
    "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
    "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
    "cudnn_convolution", "cudnn_convolution_transpose", "_cudnn_rnn",
)
_FP32 = (  # AT_FORALL_FP32
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "group_norm", "rms_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "linalg_matrix_sqrth", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d",
    "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
)
_FP32_SET_OPT_DTYPE = (  # AT_FORALL_FP32_SET_OPT_DTYPE (the Dimname overloads are not registered in 2.15)
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)
_FP32_APPEND_DTYPE = ("norm.Scalar", "norm.ScalarOpt_dim")  # AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE
_PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
            "tensordot", "scatter_add")  # AT_FORALL_PROMOTE

_TABLE_2_15: dict[str, str] = {
    **{op: "lower_precision_fp" for op in _LOWER}, **{op: "fp32" for op in _FP32},
    **{op: "fp32_set_opt_dtype" for op in _FP32_SET_OPT_DTYPE},
    **{op: "fp32_append_dtype" for op in _FP32_APPEND_DTYPE}, **{op: "promote" for op in _PROMOTE},
    "binary_cross_entropy": "banned",
}
# torch 2.11 (Colab's) still registers AutocastCUDA kernels for the Dimname overloads of the
# fp32_set_opt_dtype ops and for norm.names_ScalarOpt_dim, and none for rms_norm or
# linalg_matrix_sqrth (its CUDA autocast lets them through in the dtype that arrives)
_OLDER_ONLY = {**{op: "fp32_set_opt_dtype" for op in ("prod.dim_Dimname", "softmax.Dimname", "log_softmax.Dimname",
                                                       "cumprod.dimname", "cumsum.dimname", "sum.dim_DimnameList")},
               "norm.names_ScalarOpt_dim": "fp32_append_dtype"}


def _installed_table() -> dict[str, str]:
    """The written tables, kept to the ops the installed torch registers an ``AutocastCUDA`` kernel
    for (``_dispatch_get_registrations_for_dispatch_key``; CPU-only builds register them too):
    torch 2.15's table whole on torch 2.15, torch 2.11's ops on torch 2.11."""
    registered = {n.removeprefix("aten::") for n in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")
                  if n.startswith("aten::")}
    written = {**_TABLE_2_15, **_OLDER_ONLY}
    return {op: policy for op, policy in written.items() if op in registered} if registered else dict(_TABLE_2_15)


CUDA_AUTOCAST: dict[str, str] = _installed_table()
"""Op (``name`` or ``name.overload``, as the dispatcher lists ``aten::`` registrations) → the
policy CUDA's autocast applies to it in the installed torch."""

# aten/src/ATen/native/SoftMax.cpp: softmax / log_softmax of a CUDA float16 tensor with dtype=float32
# run the kernel that reads float16 and writes float32 (half_to_float), with no float32 copy of
# the input; anything else converts the input first.
_HALF_TO_FLOAT = {"softmax.int": torch.ops.aten._softmax.default,
                  "log_softmax.int": torch.ops.aten._log_softmax.default}

_APPEND_TARGET = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
                  "norm.names_ScalarOpt_dim": "norm.names_ScalarOpt_dim_dtype"}

_BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast. (CUDA's autocast refuses it; gpulab's fake CUDA target does too.)")


def cuda_policy_of(op: str) -> str | None:
    """CUDA's autocast policy for ``op`` ("softmax.int", "aten::linear", ...), or None when CUDA's
    autocast lets it through unchanged."""
    name = op.removeprefix("aten::")
    return CUDA_AUTOCAST.get(name, CUDA_AUTOCAST.get(name.removesuffix(".default")))


def _overload(name: str):
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


class _Casts:
    """What ``cached_cast`` does, for the CPU tensors of a fake CUDA-target run: eligible
    tensors cast, float32 weights' lower-precision casts cached until autocast exits."""

    def __init__(self) -> None:
        self.cache: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    @staticmethod
    def eligible(t: Any) -> bool:
        return (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_floating_point()
                and t.dtype != torch.float64)

    def cast(self, to: torch.dtype, value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return type(value)(self.cast(to, v) for v in value)
        if not self.eligible(value) or value.dtype == to:
            return value
        cacheable = (to == torch.get_autocast_dtype("cpu") and value.dtype == torch.float32
                     and value.requires_grad and value.is_leaf and not value._is_view())
        if not cacheable:
            return value.to(to)
        hit = self.cache.get(id(value))
        if hit is not None and hit[0]() is value:
            return hit[1]
        casted = value.to(to)
        self.cache[id(value)] = (weakref.ref(value), casted)
        return casted

    def promote_type(self, values) -> torch.dtype:
        """``promote_type``: the autocast dtype unless an eligible input is float32 (float64 ignored)."""
        low = torch.get_autocast_dtype("cpu")
        flat = [v for x in values for v in (x if isinstance(x, (list, tuple)) else (x,))]
        return torch.float32 if any(self.eligible(v) and v.dtype == torch.float32 for v in flat) else low


def _with_dtype(op, args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    """``set_opt_dtype``: the op's optional ``dtype`` argument set to ``dtype`` when not given."""
    schema = op._schema.arguments
    index = next(i for i, a in enumerate(schema) if a.name == "dtype")
    if schema[index].kwarg_only or index >= len(args) and "dtype" in kwargs:
        if kwargs.get("dtype") is None:
            kwargs = {**kwargs, "dtype": dtype}
        return args, kwargs
    args = list(args) + [a.default_value for a in schema[len(args):index + 1]]
    if args[index] is None:
        args[index] = dtype
    return tuple(args), kwargs


def _kernel(name: str, policy: str, casts: _Casts) -> Callable:
    """The ``AutocastCPU`` kernel for ``name`` that applies CUDA's ``policy``, then redispatches
    with autocast excluded (``ExcludeDispatchKeyGuard`` on the autocast keys, as the C++ wrappers)."""
    op = _overload(name)
    target = _overload(_APPEND_TARGET[name]) if policy == "fp32_append_dtype" else op
    excluded = (torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
                | torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA))

    def kernel(_keyset, *args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            first = args[0] if args else None
            if policy == "banned":
                raise RuntimeError(_BANNED_MESSAGE)
            if policy == "lower_precision_fp" or policy == "fp32" or policy == "promote":
                to = (torch.get_autocast_dtype("cpu") if policy == "lower_precision_fp" else
                      torch.float32 if policy == "fp32" else casts.promote_type([*args, *kwargs.values()]))
                kwargs = {k: casts.cast(to, v) for k, v in reversed(kwargs.items())}
                args = tuple(reversed([casts.cast(to, a) for a in reversed(args)]))
            elif policy == "fp32_set_opt_dtype" and casts.eligible(first):
                args, kwargs = _with_dtype(op, args, kwargs, torch.float32)
                if name in _HALF_TO_FLOAT and first.dtype == torch.float16 and args[2] == torch.float32:
                    return _HALF_TO_FLOAT[name](first, args[1], True)
            elif policy == "fp32_append_dtype":
                args, kwargs = _appended(op, args, kwargs, torch.float32 if casts.eligible(first) else first.dtype)
            return target(*args, **kwargs)
    return kernel


def _appended(op, args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    """``norm``'s arguments with their defaults filled in, and ``dtype`` appended."""
    schema = op._schema.arguments
    full = list(args) + [kwargs.get(a.name, a.default_value) for a in schema[len(args):]]
    return tuple(full), {"dtype": dtype}


def _passthrough(name: str) -> Callable:
    """The fallthrough CUDA's autocast has for an op only the CPU's table names: the op goes on to
    the next dispatch key, and the ops it is made of meet autocast again (no exclusion). Under the
    Python dispatcher (dynamo's and AOTAutograd's tracing), which picks each call's kernel from the
    tensors and the thread's keys again, a redispatch would come back here: there the op runs with
    ``AutocastCPU`` excluded instead."""
    op = _overload(name)
    autocast = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def kernel(keyset, *args, **kwargs):
        if torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher):
            with torch._C._ExcludeDispatchKeyGuard(autocast):
                return op(*args, **kwargs)
        return op.redispatch(keyset.remove(torch._C.DispatchKey.AutocastCPU), *args, **kwargs)
    return kernel


@contextlib.contextmanager
def cuda_autocast_policy() -> Iterator[None]:
    """For the duration, ``torch.autocast("cpu", dtype)`` applies CUDA's table (see the module
    docstring); the CPU's own kernels come back on exit. Code inside runs autocast on CPU
    tensors, as a fake CUDA-target run does."""
    import warnings
    casts = _Casts()
    cpu_ops = {n.removeprefix("aten::") for n in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")
               if n.startswith("aten::")}
    lib = torch.library.Library("aten", "IMPL")
    original_clear = torch.clear_autocast_cache

    def clear_autocast_cache() -> None:   # autocast's exit to nesting 0 empties both caches
        casts.cache.clear()
        original_clear()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
            for name, policy in CUDA_AUTOCAST.items():
                if _has_overload(name):
                    lib.impl(name, _kernel(name, policy, casts), "AutocastCPU", with_keyset=True)
            for name in sorted(cpu_ops - set(CUDA_AUTOCAST)):
                if _has_overload(name):
                    lib.impl(name, _passthrough(name), "AutocastCPU", with_keyset=True)
        torch.clear_autocast_cache = clear_autocast_cache
        yield
    finally:
        torch.clear_autocast_cache = original_clear
        casts.cache.clear()
        lib._destroy()


def _has_overload(name: str) -> bool:
    try:
        _overload(name)
    except (AttributeError, RuntimeError):
        return False
    return True
