"""The FLOPs of one aten op: ``torch.utils.flop_counter.flop_registry``'s formula for it, or, for the
scaled-dot-product-attention variants an older torch's registry lacks, torch's own SDPA formula
(``sdpa_flop_count``, ``sdpa_backward_flop_count``) applied to the op's shapes.

NB: torch 2.15's registry has ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (the
kernels ``F.scaled_dot_product_attention`` runs on a CPU, so on the fake engine following this CPU);
torch 2.11's (Colab's, gpulab's floor) has no entry for them, so a count there scores that attention 0.
Where the installed registry lacks them, they are counted as 2.15's registry counts them (``sdpa_flop``
and ``sdpa_backward_flop`` in torch/utils/flop_counter.py): grouped-query k/v (``enable_gqa``: fewer k/v
heads than the query's) counted at the query's heads, as 2.15's ``sdpa_flop_count`` does and the kernel
broadcasts them; 2.11's ``sdpa_flop_count`` asserts equal heads, so the k/v shapes it is given carry the
query's heads. The CUDA ops (flash, memory-efficient, cuDNN and their backwards), which the fake CUDA
target gives grouped-query k/v as they are (``fake_cuda._cuda_sdpa``), are in both registries; where the
installed ``sdpa_flop_count`` refuses fewer k/v heads (``_counts_grouped_query``), they are counted the
same way instead. Causal masking is not modelled, as in torch's formulas (an upper bound).

NB: no torch release read (2.11, 2.15) has a formula for ``aten._grouped_mm`` (the grouped GEMM that
transformers' default MoE experts implementation runs, ``grouped_mm_experts_forward`` in
transformers/integrations/moe.py), so torch's count scores MoE expert layers 0. gpulab's own formula
(``grouped_mm_flops``) counts it from the shapes as ``_create_grouped_mm_output_tensor`` (torch/
_meta_registrations.py) reads them: 2·m·k·n summed over the groups, whichever operand ``offs`` splits.
Its backward is ``_grouped_mm`` again (derivatives.yaml: ``_grouped_mm_mat1_backward``,
``_grouped_mm_mat2_backward``), so this one formula covers it. Rows past ``offs[-1]`` (expert
parallelism's sentinel tokens, which the kernel skips) are counted: an upper bound there, exact where
the groups fill the operand, as transformers' offsets do without expert parallelism.

gpulab's own ops (``training.bnb_kernels``: bitsandbytes' fused AdamW kernels, which no torch registry
knows) are counted from bitsandbytes' csrc/kernels.cu, per element of the parameter tensor, each float
add, multiply, divide and square root one FLOP, the per-launch constants (1 − β, ε·correction2, the step
size, 1 − lr·wd) none, comparisons none (the NaN checks, the block's absmax, the quantization search):
``kOptimizer32bit2State`` (ADAM) 14 (the gradient scaled 1, m = β1·m + (1−β1)·g 3, v = β2·v + (1−β2)·g·g
4, p += step·m/(√v + ε·c2) 5, weight decay 1); ``kOptimizerStatic8bit2StateBlockwise`` (ADAM) those 14
plus the two moments dequantized (map[code]·absmax, 2) and divided by their new absmax to quantize (2):
18. The kernels compute in float32 whatever the parameter's dtype (``COMPUTE_DTYPES``).

Where the installed torch's registry has a formula, it is used unchanged; ``ADDED_SOURCES`` names the
source of each one added.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

__all__ = ["ADAMW32BIT_FLOPS", "ADAMW8BIT_FLOPS", "ADDED_FORMULAS", "ADDED_SOURCES", "COMPUTE_DTYPES", "flop_formula", "grouped_mm_flops", "sdpa_backward_flops",
           "sdpa_forward_flops"]

_aten = torch.ops.aten


def _at_query_heads(query_shape, kv_shape) -> tuple[int, ...]:
    """A (batch, heads, seq, dim) key or value shape with the query's heads (``enable_gqa``'s broadcast)."""
    b, _, s, d = kv_shape
    return (b, query_shape[1], s, d)


def sdpa_forward_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """An SDPA forward's FLOPs from its shapes (``sdpa_flop_count``: 2·b·h·s_q·s_k·d for q·kᵀ plus
    2·b·h·s_q·s_k·d_v for the weights times v)."""
    return sdpa_flop_count(tuple(query_shape), _at_query_heads(query_shape, key_shape),
                           _at_query_heads(query_shape, value_shape))


def sdpa_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """An SDPA backward's FLOPs from its shapes (``sdpa_backward_flop_count``: the scores recomputed and
    four matmuls for the gradients, 2.5× the forward's where d_v = d)."""
    return sdpa_backward_flop_count(tuple(grad_out_shape), tuple(query_shape), _at_query_heads(query_shape, key_shape),
                                    _at_query_heads(query_shape, value_shape))


def grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """``_grouped_mm(mat_a, mat_b, offs, bias, out_dtype)``'s FLOPs from its shapes: 2·m·k·n over the
    groups, for each pairing the op takes (``_create_grouped_mm_output_tensor``):
    2-D (m, k) × 3-D (g, k, n), ``offs`` splitting a's rows (the MoE forward, and the backward's grad of
    the input): 2·m·k·n; 3-D (g, m, k) × 2-D (k, n), ``offs`` splitting b's columns: 2·m·k·n;
    2-D (m, k) × 2-D (k, n) → (g, m, n), ``offs`` splitting k (the backward's grad of the weights,
    aᵀ (k, tokens) × grad (tokens, n)): 2·m·k·n; 3-D × 3-D, a batched matmul: 2·g·m·k·n. The bias's
    adds are not counted, as the registry's ``addmm_flop`` leaves them out."""
    if len(a_shape) == 3 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]
    return 2 * a_shape[-2] * a_shape[-1] * b_shape[-1]


ADAMW32BIT_FLOPS = 14   # FLOPs an element of bitsandbytes' kOptimizer32bit2State (ADAM), as the docstring counts them
ADAMW8BIT_FLOPS = ADAMW32BIT_FLOPS + 4   # kOptimizerStatic8bit2StateBlockwise: + 2 dequantize, + 2 quantize


def _per_element(flops: int) -> Callable:
    """A formula, called as the registry's are: ``flops`` per element of the op's first argument (the parameter)."""
    def formula(p, *args, out_val=None, **kwargs) -> int:
        return flops * p.numel()
    return formula


_BNB_SOURCE = "bitsandbytes' csrc/kernels.cu {}, counted per element (predict.op_flops' docstring)"
# gpulab's own ops (``training.bnb_kernels``): qualified name -> (formula, source)
_GPULAB_OPS = {
    "gpulab::adamw8bit_blockwise_update": (_per_element(ADAMW8BIT_FLOPS),
                                           _BNB_SOURCE.format("kOptimizerStatic8bit2StateBlockwise (ADAM): 18")),
    "gpulab::adamw32bit_update": (_per_element(ADAMW32BIT_FLOPS), _BNB_SOURCE.format("kOptimizer32bit2State (ADAM): 14")),
}
# the dtype an op's FLOPs run at where it is not its lowest-precision input's: op name -> card table key
COMPUTE_DTYPES: dict[str, str] = {name.split("::")[1]: "fp32" for name in _GPULAB_OPS}

# the formulas gpulab adds where the installed torch's registry lacks them: op name -> (formula, source)
_FORMULAS = {
    "_scaled_dot_product_flash_attention_for_cpu": (
        sdpa_forward_flops, "torch 2.15's sdpa_flop (torch/utils/flop_counter.py), on this torch's sdpa_flop_count"),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (
        sdpa_backward_flops, "torch 2.15's sdpa_backward_flop (torch/utils/flop_counter.py), on this torch's "
                             "sdpa_backward_flop_count"),
    "_grouped_mm": (
        grouped_mm_flops, "gpulab's own formula (predict.op_flops.grouped_mm_flops: 2·m·k·n over the groups, "
                          "from the shapes; torch 2.11 and 2.15 have none)"),
}
_MISSING = [name for name in _FORMULAS if hasattr(_aten, name) and getattr(_aten, name) not in flop_registry]


def _counts_grouped_query() -> bool:
    """Whether this torch's ``sdpa_flop_count`` takes k/v with fewer heads than q (2.15's does; 2.11's
    asserts equal heads)."""
    try:
        sdpa_flop_count((1, 2, 1, 8), (1, 1, 1, 8), (1, 1, 1, 8))
    except AssertionError:
        return False
    return True


if not _counts_grouped_query():   # the CUDA ops' registry formulas would refuse grouped-query shapes
    for _op in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_cudnn_attention"):
        _FORMULAS[_op] = (sdpa_forward_flops, "torch 2.15's sdpa_flop, grouped-query k/v at the query's heads "
                                              "(this torch's asserts equal heads)")
        _FORMULAS[_op + "_backward"] = (sdpa_backward_flops, "torch 2.15's sdpa_backward_flop, grouped-query k/v at "
                                                             "the query's heads (this torch's asserts equal heads)")
        _MISSING += [_op, _op + "_backward"]
# the formulas (on shapes, as ``FlopCounterMode(custom_mapping=...)`` takes them) this torch's registry lacks
ADDED_FORMULAS: dict = {getattr(_aten, name): _FORMULAS[name][0] for name in _MISSING}
ADDED_SOURCES: dict[str, str] = {name: _FORMULAS[name][1] for name in _MISSING}   # op name -> whose formula
ADDED_SOURCES.update({name.split("::")[1]: source for name, (_, source) in _GPULAB_OPS.items()})
_ADDED_RAW = {op: shape_wrapper(f) for op, f in ADDED_FORMULAS.items()}


def flop_formula(packet) -> Callable | None:
    """The formula for an op (its ``OpOverloadPacket``), called as the registry's are:
    ``f(*args, **kwargs, out_val=out)``; None where neither the registry nor ``ADDED_FORMULAS`` has one."""
    if packet in _ADDED_RAW:   # gpulab's formula where the registry's lacks the op or its grouped-query shapes
        return _ADDED_RAW[packet]
    f = flop_registry.get(packet)
    if f is None and packet._qualified_op_name.startswith("gpulab::"):
        return _GPULAB_OPS[packet._qualified_op_name][0]
    return f
