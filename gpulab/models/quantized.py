"""Weight-only quantized linear layers, stored and run as bitsandbytes (0.50.2) does on CUDA, in
plain torch so that every engine can run them (bitsandbytes' CUDA kernels need a GPU).

``quantize_linears(model, "nf4" | "fp4" | "int8", double_quant=True, compute_dtype=None)`` replaces
every ``nn.Linear`` except the output head (transformers keeps ``lm_head`` unquantized:
``modules_to_not_convert``) by a ``QuantizedLinear`` holding what bitsandbytes holds:

* **nf4** and **fp4** (``Linear4bit``: ``quant_type``, QLoRA's NF4 or the FP4 that is
  ``Linear4bit``'s and ``Params4bit``'s own default; ``nn/modules.py``): the weight packed two 4-bit
  values per byte, uint8 of shape ``((n + 1) // 2, 1)`` (``functional.quantize_4bit``, the same for
  both types), the type's 16 values as a float32 code table (``get_4bit_type``, one per layer), and
  one absmax per block of 64 values. With double quantization (``compress_statistics``: True in
  ``Linear4bit`` and ``Params4bit``, False in transformers' ``BitsAndBytesConfig``, whose
  ``bnb_4bit_use_double_quant`` defaults to False) those absmaxes are stored as uint8
  (``quantize_blockwise(absmax - offset, blocksize=256)``) with one float32 absmax per 256 blocks,
  a copy of the 256-value float32 dynamic map (``code.to(A.device, copy=True)``) and one float32
  offset (``absmax.mean()``); without it one float32 absmax per block;
* **int8** (``Linear8bitLt``, LLM.int8 without fp16 weights): the weight as int8 ``(out, in)`` and
  one float32 scale per output row (``SCB``).

``compute_dtype`` is 4-bit's ``Linear4bit(compute_dtype=...)``: None computes in the input's dtype
(``Linear4bit``'s default: ``set_compute_type`` adopts a float32 or bfloat16 input's dtype, and an
fp16 input is not cast), a dtype casts the input to it, multiplies in it and casts the output back
(transformers' ``BitsAndBytesConfig`` passes ``bnb_4bit_compute_dtype``, float32 when not given).

The forward allocates what bitsandbytes' CUDA path allocates. 4-bit (``MatMul4Bit``): for more
than 4 tokens the weight is dequantized into a (out, in) buffer of the compute dtype and multiplied
(``gemm_4bit``'s ``_dequant_linear_fallback``, past its custom kernel's range; with double
quantization the absmax is first dequantized to float32 and the offset added, a second float32
array, both held until the product exists; from 5 to 1536 tokens the choice depends on the GPU and
gpulab takes the dequantized path, the larger); backward saves nothing but the packed weight and
dequantizes it again (``functional.dequantize_4bit``: the float32 absmax, then the weight in the
dtype it was quantized from, then ``.to`` the gradient's dtype, a copy when the compute dtype
differs). int8 (``MatMul8bitLt``): the input quantized row-wise (int8 and a float32 scale per
row), an int32 product, the output; backward keeps the input (``ctx.tensors = (CAt, subA, A)``)
and multiplies by the weight dequantized into the input's dtype. LLM.int8's fp16 outlier columns
depend on the values (threshold 6.0) and are not counted. Values are not computed: the buffers are
the kernels' outputs, uninitialised (a memory tool, not a quantizer). NB: ``Linear4bit.forward``
also converts a bias whose dtype differs from the compute dtype in place (``bias.data =
bias.data.to(x.dtype)``, once); here the bias keeps its dtype and is cast for each product.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from gpulab.models.lora import linear_shape
from gpulab.options import FOUR_BIT, QUANTIZATIONS   # torch-free: the CLI's checks

__all__ = ["CODE_VALUES", "COMPUTE_DTYPES", "CUSTOM_KERNEL_TOKENS", "DYNAMIC_CODE_VALUES", "FOUR_BIT", "NF4_BLOCK",
           "QUANTIZATIONS", "QuantizedLinear", "quantization_text", "quantize_linears", "quantized_weight_bytes"]

NF4_BLOCK = 64             # functional.quantize_4bit's default blocksize (nf4 and fp4 alike)
ABSMAX_BLOCK = 256         # the second level of double quantization
CODE_VALUES = 16           # functional.get_4bit_type: the 4-bit type's values, float32, one table per layer
DYNAMIC_CODE_VALUES = 256  # functional.quantize_blockwise's dynamic map, copied into each layer's state2
CUSTOM_KERNEL_TOKENS = 4   # backends/cuda/ops.py _GEMM_4BIT_CUSTOM_FLOOR_M: no dequantized weight
COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def quantized_weight_bytes(n: int, kind: str, double_quant: bool = True) -> int:
    """Bytes bitsandbytes stores for an ``n``-value weight quantized to 4 bits (``kind`` "nf4" or
    "fp4", the same sizes), before the allocator's rounding: what ``functional.quantize_4bit`` keeps
    in the weight and its ``QuantState``: the packed weight ``(n + 1) // 2``, the 16-value float32
    code table, and per block of 64 a float32 absmax; with ``double_quant`` a uint8 absmax per
    block, a float32 absmax per 256 blocks, the 256-value float32 dynamic map and a float32 offset."""
    if kind == "int8":
        raise ValueError("int8 needs the weight's shape (a scale per row): use QuantizedLinear")
    if kind not in FOUR_BIT:
        raise ValueError(f"kind must be one of {', '.join(FOUR_BIT)}, got {kind!r}")
    blocks = math.ceil(n / NF4_BLOCK)
    absmax = (blocks + 4 * math.ceil(blocks / ABSMAX_BLOCK) + 4 * DYNAMIC_CODE_VALUES + 4 if double_quant
              else 4 * blocks)
    return (n + 1) // 2 + 4 * CODE_VALUES + absmax


def quantization_text(kind: str, double_quant: bool = True, compute_dtype: torch.dtype | None = None) -> str:
    """How a quantized base is stored and run, for an answer's description: "nf4 base (double
    quantization, computing in the input's dtype)"; int8 has neither choice."""
    if kind not in FOUR_BIT:
        return f"{kind} base"
    compute = ("the input's dtype" if compute_dtype is None
               else next(k for k, v in COMPUTE_DTYPES.items() if v == compute_dtype))
    return f"{kind} base ({'double' if double_quant else 'no double'} quantization, computing in {compute})"


class _Dequantized(torch.autograd.Function):
    """x @ dequantized(W).T for a frozen quantized W: the forward's and backward's temporaries."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        return layer.quantized_matmul(x)

    @staticmethod
    def backward(ctx, grad):
        layer = ctx.layer
        w = layer.backward_weight(grad.dtype)           # dequantized again, as both kernels do
        return grad @ w, None


class QuantizedLinear(nn.Linear):
    """An ``nn.Linear`` (peft adapts it as one) whose frozen weight is stored as bitsandbytes
    stores it (module docstring); ``bias`` stays as it was."""

    def __init__(self, linear: nn.Module, kind: str, double_quant: bool = True,
                 compute_dtype: torch.dtype | None = None):
        if kind not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {kind!r}")
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear_shape(linear)   # nn.Linear, or GPT-2's Conv1D (in, out)
        self.kind = kind
        self.weight_dtype = linear.weight.dtype     # QuantState.dtype: what backward dequantizes into
        self.compute_dtype = compute_dtype if kind in FOUR_BIT else None
        device, n = linear.weight.device, self.in_features * self.out_features
        if kind in FOUR_BIT:
            self._store_4bit(n, device, double_quant)
        else:
            self.weight = nn.Parameter(torch.zeros(self.out_features, self.in_features, dtype=torch.int8,
                                                   device=device), requires_grad=False)
            self.register_buffer("scb", torch.zeros(self.out_features, dtype=torch.float32, device=device))
        self.bias = linear.bias
        self.double_quant = double_quant and kind in FOUR_BIT

    def _store_4bit(self, n: int, device, double_quant: bool) -> None:
        """The packed weight and its QuantState's tensors (``functional.quantize_4bit``)."""
        f32 = dict(dtype=torch.float32, device=device)
        self.weight = nn.Parameter(torch.zeros((n + 1) // 2, 1, dtype=torch.uint8, device=device),
                                   requires_grad=False)
        self.register_buffer("code", torch.zeros(CODE_VALUES, **f32))
        blocks = math.ceil(n / NF4_BLOCK)
        if double_quant:
            self.register_buffer("absmax", torch.zeros(blocks, dtype=torch.uint8, device=device))
            self.register_buffer("absmax2", torch.zeros(math.ceil(blocks / ABSMAX_BLOCK), **f32))
            self.register_buffer("code2", torch.zeros(DYNAMIC_CODE_VALUES, **f32))
            self.register_buffer("offset", torch.zeros((), **f32))
        else:
            self.register_buffer("absmax", torch.zeros(blocks, **f32))

    def _absmax(self) -> torch.Tensor | None:
        """Double quantization's absmax as the kernels use it, float32 per block (None without)."""
        if not self.double_quant:
            return None
        return torch.empty(self.absmax.shape, dtype=torch.float32, device=self.absmax.device)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as the kernels write it out: (out, in) in ``dtype``."""
        return torch.empty(self.out_features, self.in_features, dtype=dtype, device=self.weight.device)

    def backward_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight backward multiplies by: 4-bit, ``dequantize_4bit`` (its float32 absmax first,
        freed on return) into the weight's own dtype, then ``.to(dtype)``; int8, in ``dtype``."""
        if self.kind not in FOUR_BIT:
            return self.dequantized(dtype)
        absmax = self._absmax()
        w = self.dequantized(self.weight_dtype)
        del absmax
        return w.to(dtype)

    def quantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.numel() // max(self.in_features, 1)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.kind in FOUR_BIT:
            if tokens <= CUSTOM_KERNEL_TOKENS:   # the custom kernel reads the packed weight directly
                out = x.new_empty(*x.shape[:-1], self.out_features)
                return out if bias is None else out + bias
            # _dequant_linear_fallback: absmax_dq and absmax_dq + offset, the weight, then F.linear
            held = [self._absmax(), self._absmax()]
            return nn.functional.linear(x, self.dequantized(x.dtype), bias)
        # row-wise int8 input and scales, an int32 product, the output in fp16 then x's dtype
        held = [torch.empty(tokens, self.in_features, dtype=torch.int8, device=x.device),
                torch.empty(tokens, dtype=torch.float32, device=x.device),
                torch.empty(tokens, self.out_features, dtype=torch.int32, device=x.device)]
        del held[:2]
        out = torch.empty(*x.shape[:-1], self.out_features, dtype=torch.float16, device=x.device)
        del held
        out = out.to(x.dtype)
        return out if bias is None else out + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inp = x.dtype
        if self.compute_dtype is not None:   # Linear4bit.forward: x.to(compute_dtype), the output .to(inp_dtype)
            x = x.to(self.compute_dtype)
        if torch.is_grad_enabled() and x.requires_grad:
            out = _Int8.apply(x, self) if self.kind == "int8" else _Dequantized.apply(x, self)
        else:
            out = self.quantized_matmul(x)
        return out.to(inp)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


class _Int8(_Dequantized):
    @staticmethod
    def forward(ctx, x, layer):
        ctx.save_for_backward(x)
        ctx.layer = layer
        return layer.quantized_matmul(x)


def quantize_linears(model: nn.Module, kind: str, double_quant: bool = True,
                     compute_dtype: torch.dtype | None = None) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (and transformers' ``Conv1D``, GPT-2's, which
    transformers' bitsandbytes integration quantizes too) except its output head
    (``get_output_embeddings``) by a ``QuantizedLinear`` of ``kind`` (4-bit: with or without
    ``double_quant``, computing in ``compute_dtype``), in place; returns ``model``."""
    if kind not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {kind!r}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            # exactly nn.Linear: a subclass such as MultiheadAttention's out_proj is read by weight
            if (type(child) is nn.Linear or type(child).__name__ == "Conv1D") and child is not head:
                setattr(module, child_name, QuantizedLinear(child, kind, double_quant, compute_dtype))
    return model
