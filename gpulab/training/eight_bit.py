"""8-bit AdamW with bitsandbytes' state layout, and its paged variant, without bitsandbytes.

bitsandbytes' kernels need CUDA, and the lessons must run anywhere, so the layout is rebuilt in
plain torch from bitsandbytes' source (``bitsandbytes/optim/optimizer.py``, release 0.50.2:
``Optimizer2State.init_state`` and ``Optimizer8bit.get_state_buffer``):

* a parameter tensor with at least ``min_8bit_size`` = 4096 elements keeps two ``uint8`` states of
  its shape (``state1``, ``state2``) and two ``float32`` ``absmax`` vectors, one value per block of
  256 elements (``blocks = ceil(n / 256)``); the two 256-entry ``float32`` quantization maps
  (``qmap1`` signed, ``qmap2`` unsigned) are made once per optimizer and shared by every tensor;
* a smaller tensor keeps two ``float32`` states of its shape;
* ``state["step"]`` is a Python int (no tensor);
* paged (``PagedAdamW8bit``): a state buffer of at least 10⁵ elements is allocated in CUDA unified
  memory (``F.get_paged``, ``cudaMallocManaged``), outside PyTorch's caching allocator: the
  tracker reports those apart (``paged_tensors``); smaller ones are ordinary device tensors. On a
  CPU bitsandbytes falls back to plain buffers, and so does this class.

The update: on real tensors, each block's moments are dequantized (value = map[code] × absmax),
updated as AdamW, and quantized again to the nearest code of the block's new absmax. The map
(``quantization_map``) spaces its codes in log scale, the idea of bitsandbytes' dynamic map, whose
exact codes differ: the bytes are bitsandbytes', the rounding is close, not the same. The float32
temporaries the update takes are this CPU implementation's. On the fake engine's
CUDA target the update allocates nothing, as bitsandbytes' fused blockwise kernel
(``optimizer_update_8bit_blockwise``) updates parameters, states and absmax in place: each tensor's step
is one op mirroring that kernel (``training.bnb_kernels``; a small tensor's, ``optimizer_update_32bit``'s),
which writes in place and which the time model costs by the bytes it reads and writes.
"""
from __future__ import annotations

import math

import torch

from gpulab.measure.fake_cuda import emulating_cuda

__all__ = ["AdamW8bit", "BLOCK_SIZE", "MIN_8BIT_SIZE", "PAGED_MIN_NUMEL", "PagedAdamW8bit", "quantization_map"]

BLOCK_SIZE = 256          # bitsandbytes >= 0.44 (2048 before)
MIN_8BIT_SIZE = 4096      # Optimizer2State's min_8bit_size default
PAGED_MIN_NUMEL = 100_000  # get_state_buffer pages a buffer of at least 1e5 elements


class AdamW8bit(torch.optim.Optimizer):
    """AdamW whose moments are stored block-wise in 8 bits, laid out as bitsandbytes does."""

    paged = False

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, min_8bit_size: int = MIN_8BIT_SIZE):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.min_8bit_size = min_8bit_size
        self.qmaps: dict[str, torch.Tensor] = {}
        self.paged_tensors: list[torch.Tensor] = []   # what lives in unified memory (paged only)

    def _buffer(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        buf = torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)
        # paged on a GPU (or the fake engine's CUDA target); on a CPU bitsandbytes falls back to plain buffers
        if self.paged and (p.device.type == "cuda" or emulating_cuda()) and p.numel() >= PAGED_MIN_NUMEL:
            self.paged_tensors.append(buf)
        return buf

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        state["step"] = 0
        if p.numel() < self.min_8bit_size:
            state["state1"] = self._buffer(p, torch.float32)
            state["state2"] = self._buffer(p, torch.float32)
            return state
        if not self.qmaps:
            self.qmaps = {"signed": quantization_map(True, p.device), "unsigned": quantization_map(False, p.device)}
        blocks = math.ceil(p.numel() / BLOCK_SIZE)
        state["state1"] = self._buffer(p, torch.uint8)
        state["qmap1"] = self.qmaps["signed"]
        state["state2"] = self._buffer(p, torch.uint8)
        state["qmap2"] = self.qmaps["unsigned"]
        state["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        fused = emulating_cuda()   # bitsandbytes' CUDA kernel: in place, nothing allocated
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p] if self.state[p] else self._init_state(p)
                state["step"] += 1
                if fused:
                    _fused_update(p, state, group)
                else:
                    _update(p, p.grad, state, group)
        return loss


class PagedAdamW8bit(AdamW8bit):
    """``AdamW8bit`` whose large state buffers live in CUDA unified memory (bitsandbytes' paged
    optimizer): reported apart from device memory."""

    paged = True


def _fused_update(p: torch.Tensor, state: dict, group: dict) -> None:
    """The step as bitsandbytes runs it on a GPU: one in-place kernel per tensor (``training.bnb_kernels``)."""
    from gpulab.training import bnb_kernels
    (beta1, beta2), lr, eps, wd = group["betas"], group["lr"], group["eps"], group["weight_decay"]
    if state["state1"].dtype == torch.uint8:
        bnb_kernels.adamw8bit_blockwise_update(p, p.grad, state["state1"], state["state2"], state["qmap1"],
                                               state["qmap2"], state["absmax1"], state["absmax2"], lr, beta1, beta2,
                                               eps, wd, state["step"])
    else:
        bnb_kernels.adamw32bit_update(p, p.grad, state["state1"], state["state2"], lr, beta1, beta2, eps, wd,
                                      state["step"])


def _update(p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
    beta1, beta2 = group["betas"]
    lr, eps, wd, t = group["lr"], group["eps"], group["weight_decay"], state["step"]
    grad = grad.float()
    quantized = state["state1"].dtype == torch.uint8
    if quantized:
        m = _dequantize(state["state1"], state["qmap1"], state["absmax1"])
        v = _dequantize(state["state2"], state["qmap2"], state["absmax2"])
    else:
        m, v = state["state1"], state["state2"]
    m.mul_(beta1).add_(grad, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    p.mul_(1 - lr * wd)
    denom = (v / (1 - beta2 ** t)).sqrt_().add_(eps)
    p.addcdiv_((m / (1 - beta1 ** t)).to(p.dtype), denom.to(p.dtype), value=-lr)
    if quantized:
        _quantize(m, state["state1"], state["qmap1"], state["absmax1"])
        _quantize(v, state["state2"], state["qmap2"], state["absmax2"])


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` flattened and padded to whole blocks, as a (blocks, 256) view."""
    flat = x.reshape(-1)
    pad = (-flat.numel()) % BLOCK_SIZE
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, BLOCK_SIZE)


def quantization_map(signed: bool, device=None) -> torch.Tensor:
    """256 increasing codes in [-1, 1] (signed) or [0, 1]: zero and magnitudes spaced evenly in
    log scale from 1e-7 to 1, so that a block's small values keep their relative precision, the
    idea of bitsandbytes' dynamic map (whose exact codes differ)."""
    if signed:
        mags = torch.logspace(-7, 0, 128, device=device)
        return torch.cat([-mags[1:].flip(0), torch.zeros(1, device=device), mags])
    return torch.cat([torch.zeros(1, device=device), torch.logspace(-7, 0, 255, device=device)])


def _dequantize(codes: torch.Tensor, qmap: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    values = qmap[_blocks(codes).long()] * absmax[:, None]
    return values.reshape(-1)[:codes.numel()].view(codes.shape)


def _quantize(values: torch.Tensor, codes: torch.Tensor, qmap: torch.Tensor, absmax: torch.Tensor) -> None:
    blocks = _blocks(values)
    absmax.copy_(blocks.abs().amax(dim=1).clamp_min_(1e-30))
    unit = (blocks / absmax[:, None]).clamp_(qmap[0], qmap[-1])
    upper = torch.searchsorted(qmap, unit).clamp_(1, qmap.numel() - 1)
    nearer_lower = (unit - qmap[upper - 1]) < (qmap[upper] - unit)
    index = upper - nearer_lower.long()
    codes.copy_(index.to(torch.uint8).reshape(-1)[:codes.numel()].view(codes.shape))
