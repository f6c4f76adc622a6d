"""Pure formulas: parameter counts, tensor bytes, FLOPs, optimizer state, the batch model.

Every function takes shapes, dtypes and counts and returns numbers; none touches a tensor.
Each cites where its rule comes from and marks approximations with ``NB:``. The tests check
each one against an independent reference (``numel()`` of a real layer, FlopCounterMode,
``optimizer.state`` after a real step).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpulab.units import dtype_bytes

__all__ = [
    "MemoryFit", "OPTIMIZER_STATES", "RECIPE_OPTIMIZERS", "backward_flops", "batchnorm_buffer_bytes", "batchnorm_params", "check_optimizer",
    "checkpointed_activation_bytes", "conv2d_flops", "conv2d_output_hw", "conv2d_params",
    "cuda_rounded_bytes", "eight_bit_optimizer_state_bytes", "embedding_params", "fit_memory_model", "kv_cache_bytes",
    "layernorm_params", "linear_flops", "linear_memory", "linear_params", "lora_params",
    "lora_trainable_params", "max_batch", "modelsize_activation_bytes", "nf4_weight_bytes", "numel",
    "optimizer_state_bytes", "optimizer_state_multiplier", "output_bytes", "shaped_optimizer_state_bytes",
    "tensor_bytes",
    "training_multiplier", "zero_bytes_per_device"
]


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

# Optimizers of the training recipes (gpulab.step, gpulab.fit, the CLI), beyond the lessons' six:
# their state is not a multiple of the parameter bytes but depends on each tensor's shape
# (``shaped_optimizer_state_bytes``).
RECIPE_OPTIMIZERS = ("adafactor", "adamw8bit", "paged_adamw8bit")


def check_optimizer(name: str, recipes: bool = False) -> str:
    """The optimizer's key ("adam" for "Adam"), or ValueError naming the valid ones: the one
    check every caller of the library makes. ``recipes``: also accept ``RECIPE_OPTIMIZERS``
    (where the caller measures any optimizer: gpulab.step, gpulab.fit)."""
    key = str(name).lower()
    valid = (*OPTIMIZER_STATES, *RECIPE_OPTIMIZERS) if recipes else tuple(OPTIMIZER_STATES)
    if key not in valid:
        raise ValueError(f"unknown optimizer {name!r}; valid optimizers: {', '.join(valid)}")
    return key


def shaped_optimizer_state_bytes(shapes: Sequence[Sequence[int]], name: str, element_size: int = 4,
                                 count_step_counters: bool = True) -> int:
    """Optimizer state after the first ``step()`` from each trainable tensor's shape, for the
    optimizers whose state is not a multiple of the parameters (and for the others too):

    * ``adafactor`` (``torch.optim.Adafactor``): a tensor of 2+ dims keeps ``row_var`` (its shape
      with the last dim 1) and ``col_var`` (the second-to-last dim 1), a smaller one ``variance``
      (its shape), in the gradient's dtype; and a float32 ``step`` scalar each;
    * ``adamw8bit`` / ``paged_adamw8bit`` (bitsandbytes' layout, ``eight_bit_optimizer_state_bytes``):
      8-bit states and float32 block absmax for tensors of at least 4096 elements, two float32
      states below that, two 256-entry float32 quantization maps per optimizer; no step tensor
      (paged buffers are counted here too: they are state, in unified memory);
    * the lessons' six: ``optimizer_state_bytes`` of the total."""
    key = check_optimizer(name, recipes=True)
    sizes = [math.prod(int(d) for d in s) for s in shapes]
    if key == "adafactor":
        total = 0
        for shape, n in zip(shapes, sizes):
            if len(shape) >= 2:
                total += (n // max(1, int(shape[-1])) + n // max(1, int(shape[-2]))) * element_size
            else:
                total += n * element_size
        return total + (4 * len(sizes) if count_step_counters else 0)
    if key in ("adamw8bit", "paged_adamw8bit"):
        small = sum(2 * 4 * n for n in sizes if n < 4096)
        large = [n for n in sizes if n >= 4096]
        return small + sum(eight_bit_optimizer_state_bytes(n) for n in large) + (2 * 256 * 4 if large else 0)
    return optimizer_state_bytes(sum(sizes) * element_size, len(sizes), key, count_step_counters)


def optimizer_state_multiplier(name: str) -> int:
    """Optimizer state as a multiple of the parameter bytes: 0, 1 or 2."""
    return OPTIMIZER_STATES[check_optimizer(name)]


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
    key = check_optimizer(name)
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


# --- levers that make training fit -------------------------------------------------------
# Each lever trades something (communication, recompute, precision) for memory. These are
# counts on paper; the byte sizes are parameters so a lesson can vary them.

def zero_bytes_per_device(n_params: int, world_size: int, stage: int, param_bytes: int = 2,
                          grad_bytes: int = 2, optimizer_bytes_per_param: int = 12) -> int:
    """Model-state bytes on each of ``world_size`` data-parallel devices under ZeRO stage 0-3.

    Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
    Models" (2019, arXiv 1910.02054), section 5 and figure 1, with Psi parameters, N devices
    and K bytes of optimizer state per parameter (K = 12 for mixed-precision Adam: an fp32
    copy of the weights, momentum and variance, 4 B each):

    * stage 0 (plain data parallelism): (2 + 2 + K) * Psi
    * stage 1 (P_os, optimizer state sharded): 2Psi + 2Psi + K*Psi/N
    * stage 2 (P_os+g, gradients sharded too): 2Psi + (2 + K)*Psi/N
    * stage 3 (P_os+g+p, parameters sharded too): (2 + 2 + K)*Psi/N

    with the 2s replaced by ``param_bytes`` and ``grad_bytes``. Figure 1 (Psi = 7.5B,
    N = 64, K = 12) gives 120 GB, 31.4 GB, 16.6 GB and 1.9 GB (GB = 10**9 B).

    NB: a sharded tensor is counted as ceil(Psi / N) elements per device (the last shard is
    padded), so the result is a whole number of bytes. Activations, temporary buffers and
    fragmentation (the paper's "residual states") are not included.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, not {stage!r}")
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    if n_params < 0:
        raise ValueError("n_params must not be negative")
    shard = -(-n_params // world_size)  # ceil
    p, g, k = param_bytes, grad_bytes, optimizer_bytes_per_param
    if stage == 0:
        return (p + g + k) * n_params
    if stage == 1:
        return (p + g) * n_params + k * shard
    if stage == 2:
        return p * n_params + (g + k) * shard
    return (p + g + k) * shard


def eight_bit_optimizer_state_bytes(n_params: int, states: int = 2, block_size: int = 256) -> int:
    """Optimizer state of a bitsandbytes 8-bit blockwise optimizer for one parameter tensor:
    per state, one byte per element plus one fp32 absmax per block of ``block_size`` elements
    (``states`` = 2 for Adam/AdamW, 1 for momentum SGD, RMSprop, Adagrad, Lion).

    Source: bitsandbytes/optim/optimizer.py, ``Optimizer2State.init_state`` and
    ``Optimizer1State.init_state``: each state is a uint8 tensor of the parameter's shape,
    and ``absmax1`` / ``absmax2`` are float32 tensors of ceil(n / blocksize) elements with
    ``blocksize = 256``. The 256 dates from bitsandbytes 0.44.0 (PR #1365, "Change 8bit
    optimizer blocksize 2048->256"); earlier releases, and the paper (Dettmers et al.,
    "8-bit Optimizers via Block-wise Quantization", 2021, arXiv 2110.02861), used 2048.

    NB: blocks do not span tensors, so call this per parameter tensor and sum. A tensor with
    fewer than ``min_8bit_size`` elements (4096 by default) keeps 32-bit state (4 B per
    element per state) instead; the shared 256-entry quantization maps are not counted.
    """
    if n_params < 0 or states < 0 or block_size < 1:
        raise ValueError("n_params and states must be >= 0 and block_size >= 1")
    blocks = -(-n_params // block_size)  # ceil
    return states * (n_params + 4 * blocks)


def lora_params(in_features: int, out_features: int, rank: int) -> int:
    """Trainable parameters LoRA adds to one linear layer: A (rank x in) and B (out x rank),
    so rank * (in + out). Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models"
    (2021, arXiv 2106.09685), section 4.1: W0 + BA with B in R^{d x r}, A in R^{r x k}.
    E.g. rank 8 on a 4096 x 4096 q_proj: 8 * 8192 = 65,536."""
    if min(in_features, out_features, rank) < 0:
        raise ValueError("features and rank must not be negative")
    return rank * (in_features + out_features)


def lora_trainable_params(linear_shapes: Iterable[Sequence[int]], rank: int) -> int:
    """``lora_params`` summed over the adapted layers, given as (in_features, out_features)."""
    return sum(lora_params(int(i), int(o), rank) for i, o in linear_shapes)


def nf4_weight_bytes(n_params: int, block_size: int = 64, double_quant: bool = True) -> float:
    """Bytes of weights stored as QLoRA's 4-bit NormalFloat (NF4), with their quantization
    constants: 0.5 B per weight plus

    * without double quantization: one fp32 absmax per ``block_size`` weights,
      32/64 = 0.5 bits per parameter at block size 64;
    * with double quantization: those absmaxes quantized to 8 bits, with one fp32 constant
      per 256 of them, 8/64 + 32/(64*256) = 0.127 bits per parameter.

    Source: Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs" (2023,
    arXiv 2305.14314), section 3, "Double Quantization" (0.5 -> 0.127 bits per parameter).
    bitsandbytes implements it in ``functional.quantize_4bit``: default ``blocksize=64``,
    and with ``compress_statistics`` the absmaxes go through ``quantize_blockwise`` with
    ``blocksize=256``.

    NB: an average over whole blocks (a float); the extra fp32 offset and the 256-entry code
    table bitsandbytes keeps per tensor are left out.
    """
    if n_params < 0 or block_size < 1:
        raise ValueError("n_params must be >= 0 and block_size >= 1")
    constant_bits = 8 / block_size + 32 / (block_size * 256) if double_quant else 32 / block_size
    return n_params * (4 + constant_bits) / 8


def checkpointed_activation_bytes(per_layer_bytes: float, n_layers: int,
                                  boundary_bytes: float) -> float:
    """Activation memory with every layer checkpointed: each layer's input is kept
    (``boundary_bytes`` per layer) and, during the backward pass, one layer's activations
    are recomputed at a time: n_layers * boundary_bytes + per_layer_bytes.

    Without checkpointing it is n_layers * per_layer_bytes. Chen et al., "Training Deep Nets
    with Sublinear Memory Cost" (2016, arXiv 1604.06174) analyse this trade; checkpointing
    every sqrt(n) layers instead of every layer is their O(sqrt(n)) variant.

    NB: ignores the gradient buffers of the layer being recomputed and allocator effects.
    """
    if n_layers < 0:
        raise ValueError("n_layers must not be negative")
    return n_layers * boundary_bytes + (per_layer_bytes if n_layers else 0)


# --- inference ---------------------------------------------------------------------------

def kv_cache_bytes(layers: int, kv_heads: int, head_dim: int, seq_len: int, batch: int, dtype_bytes: int) -> int:
    """Bytes of a KV cache: 2 (keys and values) · layers · kv_heads · head_dim · seq_len · batch ·
    bytes per element.

    Each attention layer keeps one key and one value tensor of shape (batch, kv_heads, seq_len,
    head_dim): transformers/cache_utils.py, ``DynamicLayer`` ("tensors of shape `[batch_size,
    num_heads, seq_len, head_dim]`"), grown by ``torch.cat`` along the sequence in ``update``.
    E.g. Llama-2-7B in fp16 at 4096 tokens: 2 · 32 · 32 · 128 · 4096 · 1 · 2 = 2 GiB per sequence.
    NB: every layer global, full K and V: a sliding-window layer (Gemma-2/3, Mistral) holds
    min(seq_len, window) positions and an MLA layer (DeepSeek-V2/V3) one latent of kv_lora_rank +
    qk_rope_head_dim per token instead of 2 · kv_heads · head_dim (``predict.kv_layout``)."""
    for what, v in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim), ("seq_len", seq_len),
                    ("batch", batch), ("dtype_bytes", dtype_bytes)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{what} must be a non-negative integer, got {v!r}")
    return 2 * layers * kv_heads * head_dim * seq_len * batch * dtype_bytes
