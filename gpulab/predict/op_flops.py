"""The FLOPs of one aten op: ``torch.utils.flop_counter.flop_registry``'s formula for it, or, for the
scaled-dot-product-attention variants an older torch's registry lacks, torch's own SDPA formula
(``sdpa_flop_count``, ``sdpa_backward_flop_count``) applied to the op's shapes.

NB: torch 2.15's registry has ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (the
kernels ``F.scaled_dot_product_attention`` runs on a CPU, so on the fake engine following this CPU, and
for grouped-query attention on the fake CUDA target too: ``fake_cuda._cuda_sdpa``); torch 2.11's
(Colab's, gpulab's floor) has no entry for them, so a count there scores that attention 0. Where the
installed registry lacks them, they are counted as 2.15's registry counts them (``sdpa_flop`` and
``sdpa_backward_flop`` in torch/utils/flop_counter.py): grouped-query k/v (``enable_gqa``: fewer k/v
heads than the query's) counted at the query's heads, as 2.15's ``sdpa_flop_count`` does and the kernel
broadcasts them; 2.11's ``sdpa_flop_count`` asserts equal heads, so the k/v shapes it is given carry the
query's heads. Causal masking is not modelled, as in torch's formulas (an upper bound). Where the
installed torch's registry has a formula, it is used unchanged.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

__all__ = ["ADDED_FORMULAS", "flop_formula", "sdpa_backward_flops", "sdpa_forward_flops"]

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


_SDPA = {"_scaled_dot_product_flash_attention_for_cpu": sdpa_forward_flops,
         "_scaled_dot_product_flash_attention_for_cpu_backward": sdpa_backward_flops}
# the formulas (on shapes, as ``FlopCounterMode(custom_mapping=...)`` takes them) this torch's registry lacks
ADDED_FORMULAS: dict = {getattr(_aten, name): f for name, f in _SDPA.items()
                        if hasattr(_aten, name) and getattr(_aten, name) not in flop_registry}
_ADDED_RAW = {op: shape_wrapper(f) for op, f in ADDED_FORMULAS.items()}


def flop_formula(packet) -> Callable | None:
    """The formula for an op (its ``OpOverloadPacket``), called as the registry's are:
    ``f(*args, **kwargs, out_val=out)``; None where neither the registry nor ``ADDED_FORMULAS`` has one."""
    f = flop_registry.get(packet)
    return f if f is not None else _ADDED_RAW.get(packet)
