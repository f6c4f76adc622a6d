"""bitsandbytes' fused AdamW update kernels as gpulab ops, one call per parameter tensor, so that the
fake engine's CUDA target issues what a GPU runs and the time model (``predict.timing``) costs it.

bitsandbytes (csrc/kernels.cu, main as fetched, 2026-08) updates each tensor in one kernel launch, in
place, allocating nothing (``Optimizer2State.update_step`` in bitsandbytes/optim/optimizer.py):

* ``kOptimizerStatic8bit2StateBlockwise`` (``F.optimizer_update_8bit_blockwise``) for a tensor with
  8-bit state: it reads ``g``, ``state1``, ``state2``, ``absmax1``, ``absmax2``, ``p`` and the two
  256-entry maps ``quantiles1``, ``quantiles2`` (into shared memory), and writes ``p``, ``state1``,
  ``state2``, ``absmax1``, ``absmax2``;
* ``kOptimizer32bit2State`` (``F.optimizer_update_32bit``) for a tensor below ``min_8bit_size``: it reads
  ``g``, ``state1``, ``state2``, ``p`` and writes ``p``, ``state1``, ``state2``.

Each op's schema marks what the kernel writes as mutated (``mutates_args``) and returns nothing, so the
timer counts each written tensor once as read and once as written (``OpTimer``: an op without a tensor
result writes its mutated arguments). The fake implementation returns None: nothing is allocated. They
run on fake tensors only: on real tensors ``training.eight_bit`` updates in plain torch and issues none.
"""
from __future__ import annotations

import torch

__all__ = ["adamw32bit_update", "adamw8bit_blockwise_update"]

_FAKE_ONLY = ("gpulab's mirror of a bitsandbytes kernel runs on fake tensors only (the fake engine's CUDA target): "
              "on real tensors use training.eight_bit.AdamW8bit, which updates in plain torch")


@torch.library.custom_op("gpulab::adamw8bit_blockwise_update",
                         mutates_args=("p", "state1", "state2", "absmax1", "absmax2"))
def adamw8bit_blockwise_update(p: torch.Tensor, g: torch.Tensor, state1: torch.Tensor, state2: torch.Tensor,
                               qmap1: torch.Tensor, qmap2: torch.Tensor, absmax1: torch.Tensor,
                               absmax2: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float,
                               weight_decay: float, step: int) -> None:
    """bitsandbytes' ``kOptimizerStatic8bit2StateBlockwise`` (ADAM): one tensor's AdamW step, its
    moments dequantized, updated and quantized again block by block, in place."""
    raise RuntimeError(_FAKE_ONLY)


@adamw8bit_blockwise_update.register_fake
def _(p, g, state1, state2, qmap1, qmap2, absmax1, absmax2, lr, beta1, beta2, eps, weight_decay, step) -> None:
    return None


@torch.library.custom_op("gpulab::adamw32bit_update", mutates_args=("p", "state1", "state2"))
def adamw32bit_update(p: torch.Tensor, g: torch.Tensor, state1: torch.Tensor, state2: torch.Tensor, lr: float,
                      beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> None:
    """bitsandbytes' ``kOptimizer32bit2State`` (ADAM): a small tensor's AdamW step on float32 moments, in place."""
    raise RuntimeError(_FAKE_ONLY)


@adamw32bit_update.register_fake
def _(p, g, state1, state2, lr, beta1, beta2, eps, weight_decay, step) -> None:
    return None
