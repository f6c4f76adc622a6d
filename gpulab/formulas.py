"""Pure formulas: parameter counts, tensor bytes, FLOPs, optimizer state, the batch model.

Every function takes shapes, dtypes and counts and returns numbers; none touches a tensor.
Each cites where its rule comes from and marks approximations with ``NB:``. The tests check
each one against an independent reference (``numel()`` of a real layer, FlopCounterMode,
``optimizer.state`` after a real step).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from .units import dtype_bytes


def _pair(v: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    a, b = v
    return (int(a), int(b))


def numel(shape: Iterable[int]) -> int:
    return math.prod(int(s) for s in shape)


def tensor_bytes(shape: Iterable[int], dtype="float32") -> int:
    """Bytes of a dense contiguous tensor: numel x element size.

    E.g. a 500x500 RGB fp32 image: 500*500*3*4 = 3,000,000 B (2.86 MiB).
    NB: on CUDA the caching allocator rounds every request up to 512 B
    (``kMinBlockSize`` in c10/cuda/CUDACachingAllocator.cpp); see ``cuda_rounded_bytes``.
    """
    return numel(shape) * dtype_bytes(dtype)


def cuda_rounded_bytes(nbytes: int) -> int:
    """One storage of ``nbytes`` bytes rounded as the CUDA caching allocator rounds a request:
    up to a multiple of 512 bytes (``kMinBlockSize = 512``, ``round_size()`` in
    c10/cuda/CUDACachingAllocator.cpp). A zero-byte storage takes no block.

    NB: a lower bound of what ``torch.cuda.memory_allocated`` counts for it, not always equal:
    the allocator does not split a free large block when 1 MiB or less would remain
    (``should_split``), and counts the whole block (``alloc_found_block``), so a tensor can take
    up to 1 MiB more. ``engines.allocator_blocks`` replays a run through the simulator for that.
    """
    return 0 if nbytes <= 0 else ((nbytes + 511) // 512) * 512


# --- parameters -----------------------------------------------------------------------
# Source for the layer formulas: the parameter shapes documented for torch.nn.Conv2d,
# Linear, BatchNorm2d, LayerNorm and Embedding (weight and bias attributes).

def conv2d_params(in_channels: int, out_channels: int, kernel_size, groups: int = 1,
                  bias: bool = True) -> int:
    """weight (out, in/groups, kh, kw) + bias (out)."""
    kh, kw = _pair(kernel_size)
    if in_channels % groups or out_channels % groups:
        raise ValueError("in_channels and out_channels must be divisible by groups")
    return out_channels * (in_channels // groups) * kh * kw + (out_channels if bias else 0)


def linear_params(in_features: int, out_features: int, bias: bool = True) -> int:
    """weight (out, in) + bias (out)."""
    return in_features * out_features + (out_features if bias else 0)


def batchnorm_params(num_features: int, affine: bool = True) -> int:
    """weight (gamma) and bias (beta), one each per channel: 2N. Buffers are separate."""
    return 2 * num_features if affine else 0


def batchnorm_buffer_bytes(num_features: int, dtype="float32",
                           track_running_stats: bool = True) -> int:
    """running_mean and running_var (N each, in the layer's dtype) plus
    num_batches_tracked (one int64 scalar, 8 B). Buffers get no gradient and no
    optimizer state, but they do occupy memory."""
    if not track_running_stats:
        return 0
    return 2 * num_features * dtype_bytes(dtype) + dtype_bytes("int64")


def layernorm_params(normalized_shape, elementwise_affine: bool = True, bias: bool = True) -> int:
    """weight and (optionally) bias, each of the normalized shape."""
    n = numel(normalized_shape) if not isinstance(normalized_shape, int) else normalized_shape
    if not elementwise_affine:
        return 0
    return n * (2 if bias else 1)


def embedding_params(num_embeddings: int, embedding_dim: int) -> int:
    """One row per token: num_embeddings x embedding_dim."""
    return num_embeddings * embedding_dim


# --- shapes and activations ---------------------------------------------------------

def conv2d_output_hw(h: int, w: int, kernel_size, stride=1, padding=0, dilation=1) -> tuple[int, int]:
    """Output height and width, the formula in torch.nn.Conv2d's documentation:
    floor((H + 2p - d(k-1) - 1) / s) + 1 (MaxPool2d uses the same with ceil_mode=False)."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = map(_pair, (kernel_size, stride, padding, dilation))
    ho = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    wo = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    return ho, wo


def output_bytes(shape: Iterable[int], dtype="float32") -> int:
    """Bytes of a layer's output activation (same rule as ``tensor_bytes``)."""
    return tensor_bytes(shape, dtype)


def modelsize_activation_bytes(output_shapes: Iterable[Sequence[int]], dtype="float32",
                               backward_factor: int = 2) -> int:
    """The reference articles' ``modelsize()`` estimate: sum of every layer's output
    bytes, times 2 "because backward doubles the intermediates".

    NB: this ignores what autograd really saves (a conv saves its *input*, ReLU its
    output, max-pool an int64 index tensor, dropout a mask) and counts outputs that
    are freed immediately; lesson 03 measures how far off it is.
    """
    return backward_factor * sum(tensor_bytes(s, dtype) for s in output_shapes)


# --- FLOPs --------------------------------------------------------------------------
# Convention: one multiply-add = 2 FLOPs, biases and activations not counted. This is
# the convention of torch/utils/flop_counter.py (mm_flop = 2*m*n*k; conv_flop =
# 2 * prod(out_shape) * prod(w_shape[1:])), so FlopCounterMode agrees exactly.

def linear_flops(batch: int, in_features: int, out_features: int) -> int:
    """Forward FLOPs of y = x W^T (+ b): 2 * batch * in * out.

    NB: batch is every leading dimension multiplied together (tokens for a sequence)."""
    return 2 * batch * in_features * out_features


def conv2d_flops(batch: int, in_channels: int, out_channels: int, out_hw: tuple[int, int],
                 kernel_size, groups: int = 1) -> int:
    """Forward FLOPs: 2 * (N * C_out * H_out * W_out) * (C_in/groups * kh * kw)."""
    kh, kw = _pair(kernel_size)
    ho, wo = out_hw
    return 2 * batch * out_channels * ho * wo * (in_channels // groups) * kh * kw


def backward_flops(forward_flops: int, needs_input_grad: bool = True) -> int:
    """Backward of a linear or conv layer: one product for the weight gradient and one
    for the input gradient, each as costly as the forward (flop_counter's
    conv_backward_flop / mm rules). The first layer needs no input gradient."""
    return forward_flops * (2 if needs_input_grad else 1)


# --- optimizers ----------------------------------------------------------------------
# States per parameter element, read off torch/optim/*.py (the tensors each optimizer
# puts in ``optimizer.state[p]`` on its first step):
#   SGD (momentum=0): nothing.  SGD with momentum: momentum_buffer.
#   Adam / AdamW: exp_avg, exp_avg_sq (+ max_exp_avg_sq with amsgrad).
#   RMSprop: square_avg (+ momentum_buffer with momentum>0, + grad_avg when centered).
#   Adagrad: sum.
# Adam, AdamW, RMSprop and Adagrad also keep a scalar ``step`` tensor per parameter
# (float32, 4 B; on the CPU unless capturable/fused).

OPTIMIZER_STATES = {
    "sgd": 0,
    "momentum": 1,
    "adam": 2,
    "adamw": 2,
    "rmsprop": 1,
    "adagrad": 1,
}

_STEP_COUNTER = {"sgd": False, "momentum": False, "adam": True, "adamw": True,
                 "rmsprop": True, "adagrad": True}


def _check_optimizer(name: str) -> str:
    key = name.lower()
    if key not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(OPTIMIZER_STATES)}")
    return key


def optimizer_state_multiplier(name: str) -> int:
    """Optimizer state as a multiple of the parameter bytes: 0, 1 or 2."""
    return OPTIMIZER_STATES[_check_optimizer(name)]


def training_multiplier(name: str) -> int:
    """Params + grads + optimizer state, in units of the parameter bytes: the reference
    articles' SGD x2, momentum x3, Adam x4."""
    return 2 + optimizer_state_multiplier(name)


def optimizer_state_bytes(param_bytes: int, n_param_tensors: int, name: str,
                          count_step_counters: bool = True) -> int:
    """State bytes after the first ``step()``: multiplier x param bytes, plus one 4-byte
    ``step`` scalar per parameter tensor for the optimizers that keep one.

    NB: a CUDA run keeps those step scalars on the CPU (non-capturable, non-fused), so
    pass ``count_step_counters=False`` when comparing with ``torch.cuda.memory_allocated``.
    """
    key = _check_optimizer(name)
    steps = 4 * n_param_tensors if (count_step_counters and _STEP_COUNTER[key]) else 0
    return OPTIMIZER_STATES[key] * param_bytes + steps


# --- the batch-size model ----------------------------------------------------------------

def linear_memory(batch: int, fixed_bytes: float, per_sample_bytes: float) -> float:
    """memory = fixed + batch x per-sample (the reference articles' model).

    NB: a straight line is an approximation: allocator rounding, algorithm choice and
    workspaces make the real curve slightly jagged."""
    return fixed_bytes + batch * per_sample_bytes


@dataclass(frozen=True)
class MemoryFit:
    fixed_bytes: float
    per_sample_bytes: float
    r2: float

    def predict(self, batch: int) -> float:
        return linear_memory(batch, self.fixed_bytes, self.per_sample_bytes)

    def max_batch(self, capacity_bytes: float) -> int:
        return max_batch(capacity_bytes, self.fixed_bytes, self.per_sample_bytes)


def fit_memory_model(batches: Sequence[int], peak_bytes: Sequence[float]) -> MemoryFit:
    """Least-squares line through (batch, peak) points: intercept = fixed, slope = per sample."""
    if len(batches) != len(peak_bytes) or len(batches) < 2:
        raise ValueError("need at least two (batch, bytes) points of equal length")
    n = len(batches)
    mx = sum(batches) / n
    my = sum(peak_bytes) / n
    sxx = sum((x - mx) ** 2 for x in batches)
    if sxx == 0:
        raise ValueError("the batch sizes must not all be equal")
    sxy = sum((x - mx) * (y - my) for x, y in zip(batches, peak_bytes))
    slope = sxy / sxx
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in peak_bytes)
    ss_res = sum((y - (intercept + slope * x)) ** 2 for x, y in zip(batches, peak_bytes))
    r2 = 1.0 - ss_res / ss_tot if ss_tot else 1.0
    return MemoryFit(intercept, slope, r2)


def max_batch(capacity_bytes: float, fixed_bytes: float, per_sample_bytes: float) -> int:
    """Largest batch with fixed + batch x per-sample <= capacity (0 if even batch 1 fails)."""
    if per_sample_bytes <= 0:
        raise ValueError("per-sample bytes must be positive")
    return max(0, int((capacity_bytes - fixed_bytes) // per_sample_bytes))
