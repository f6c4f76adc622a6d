"""Weight-only quantized linear layers, stored and run as bitsandbytes (0.50.2) does on CUDA, in
plain torch so that every engine can run them (bitsandbytes' CUDA kernels need a GPU).

``quantize_linears(model, "nf4" | "int8")`` replaces every ``nn.Linear`` except the output head
(transformers keeps ``lm_head`` unquantized: ``modules_to_not_convert``) by a ``QuantizedLinear``
holding what bitsandbytes holds:

* **nf4** (``Linear4bit``, QLoRA's NF4 with double quantization, bitsandbytes' defaults for
  ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True)``): the weight packed two
  4-bit values per byte, uint8 of shape ``((n + 1) // 2, 1)`` (``functional.quantize_4bit``); one
  absmax per block of 64 values, itself quantized to uint8 with one float32 absmax per 256 blocks
  and one float32 offset (``compress_statistics``: ``quantize_blockwise(absmax - offset,
  blocksize=256)``); without double quantization one float32 absmax per block;
* **int8** (``Linear8bitLt``, LLM.int8 without fp16 weights): the weight as int8 ``(out, in)`` and
  one float32 scale per output row (``SCB``).

The forward allocates what bitsandbytes' CUDA path allocates. NF4 (``MatMul4Bit``): for more than
4 tokens the weight is dequantized into a (out, in) buffer of the input's dtype and multiplied
(``gemm_4bit``: dequantize + ``F.linear`` past its custom kernel's range; from 5 to 1536 tokens the
choice depends on the GPU and gpulab takes the dequantized path, the larger); backward
dequantizes it again for the input's gradient and saves nothing but the packed weight. int8
(``MatMul8bitLt``): the input quantized row-wise (int8 and a float32 scale per row), an int32
product, the output; backward keeps the input (``ctx.tensors = (CAt, subA, A)``) and multiplies by
the weight dequantized into the input's dtype. LLM.int8's fp16 outlier columns depend on the
values (threshold 6.0) and are not counted. Values are not computed: the buffers are the kernels'
outputs, uninitialised (a memory tool, not a quantizer).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from gpulab.models.lora import linear_shape

__all__ = ["CUSTOM_KERNEL_TOKENS", "NF4_BLOCK", "QUANTIZATIONS", "QuantizedLinear", "quantize_linears",
           "quantized_weight_bytes"]

QUANTIZATIONS = ("nf4", "int8")
NF4_BLOCK = 64             # functional.quantize_4bit's default blocksize
ABSMAX_BLOCK = 256         # the second level of double quantization
CUSTOM_KERNEL_TOKENS = 4   # backends/cuda/ops.py _GEMM_4BIT_CUSTOM_FLOOR_M: no dequantized weight


def quantized_weight_bytes(n: int, kind: str, double_quant: bool = True) -> int:
    """Bytes bitsandbytes stores for an ``n``-value weight (the storages ``QuantizedLinear`` makes,
    before the allocator's rounding)."""
    if kind == "int8":
        raise ValueError("int8 needs the weight's shape (a scale per row): use QuantizedLinear")
    blocks = math.ceil(n / NF4_BLOCK)
    absmax = blocks + 4 * math.ceil(blocks / ABSMAX_BLOCK) + 4 if double_quant else 4 * blocks
    return (n + 1) // 2 + absmax


class _Dequantized(torch.autograd.Function):
    """x @ dequantized(W).T for a frozen quantized W: the forward's and backward's temporaries."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        return layer.quantized_matmul(x)

    @staticmethod
    def backward(ctx, grad):
        layer = ctx.layer
        w = layer.dequantized(grad.dtype)               # dequantized again, as both kernels do
        return grad @ w, None


class QuantizedLinear(nn.Linear):
    """An ``nn.Linear`` (peft adapts it as one) whose frozen weight is stored as bitsandbytes
    stores it (module docstring); ``bias`` stays as it was."""

    def __init__(self, linear: nn.Module, kind: str, double_quant: bool = True):
        if kind not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {kind!r}")
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear_shape(linear)   # nn.Linear, or GPT-2's Conv1D (in, out)
        self.kind = kind
        self.compute_dtype = linear.weight.dtype
        device, n = linear.weight.device, self.in_features * self.out_features
        if kind == "nf4":
            self.weight = nn.Parameter(torch.zeros((n + 1) // 2, 1, dtype=torch.uint8, device=device),
                                       requires_grad=False)
            blocks = math.ceil(n / NF4_BLOCK)
            if double_quant:
                self.register_buffer("absmax", torch.zeros(blocks, dtype=torch.uint8, device=device))
                self.register_buffer("absmax2", torch.zeros(math.ceil(blocks / ABSMAX_BLOCK), device=device,
                                                           dtype=torch.float32))
                self.register_buffer("offset", torch.zeros((), dtype=torch.float32, device=device))
            else:
                self.register_buffer("absmax", torch.zeros(blocks, dtype=torch.float32, device=device))
        else:
            self.weight = nn.Parameter(torch.zeros(self.out_features, self.in_features, dtype=torch.int8,
                                                   device=device), requires_grad=False)
            self.register_buffer("scb", torch.zeros(self.out_features, dtype=torch.float32, device=device))
        self.bias = linear.bias
        self.double_quant = double_quant

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as the kernels write it out: (out, in) in ``dtype`` (NF4 with double
        quantization also dequantizes its absmax first, one float32 per block)."""
        absmax = (torch.empty(self.absmax.shape, dtype=torch.float32, device=self.absmax.device)
                  if self.kind == "nf4" and self.double_quant else None)
        weight = torch.empty(self.out_features, self.in_features, dtype=dtype, device=self.weight.device)
        del absmax
        return weight

    def quantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.numel() // max(self.in_features, 1)
        if self.kind == "nf4":
            if tokens <= CUSTOM_KERNEL_TOKENS:   # the custom kernel reads the packed weight directly
                out = x.new_empty(*x.shape[:-1], self.out_features)
            else:
                out = nn.functional.linear(x, self.dequantized(x.dtype))
        else:   # row-wise int8 input and scales, an int32 product, the output in fp16 then x's dtype
            held = [torch.empty(tokens, self.in_features, dtype=torch.int8, device=x.device),
                    torch.empty(tokens, dtype=torch.float32, device=x.device),
                    torch.empty(tokens, self.out_features, dtype=torch.int32, device=x.device)]
            del held[:2]
            out = torch.empty(*x.shape[:-1], self.out_features, dtype=torch.float16, device=x.device)
            del held
            out = out.to(x.dtype)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            if self.kind == "int8":   # MatMul8bitLt keeps its input for backward
                return _Int8.apply(x, self)
            return _Dequantized.apply(x, self)
        return self.quantized_matmul(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


class _Int8(_Dequantized):
    @staticmethod
    def forward(ctx, x, layer):
        ctx.save_for_backward(x)
        ctx.layer = layer
        return layer.quantized_matmul(x)


def quantize_linears(model: nn.Module, kind: str, double_quant: bool = True) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (and transformers' ``Conv1D``, GPT-2's, which
    transformers' bitsandbytes integration quantizes too) except its output head
    (``get_output_embeddings``) by a ``QuantizedLinear`` of ``kind``, in place; returns ``model``."""
    if kind not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {kind!r}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            # exactly nn.Linear: a subclass such as MultiheadAttention's out_proj is read by weight
            if (type(child) is nn.Linear or type(child).__name__ == "Conv1D") and child is not head:
                setattr(module, child_name, QuantizedLinear(child, kind, double_quant))
    return model
