"""What CUDA would run, on fake tensors, on a machine without a GPU.

The fake engine answers "would it fit on a GPU?" without one. Fake tensors *on a cuda
device* get surprisingly far: ``FakeTensorMode`` builds them, and a forward pass dispatches
the CUDA paths (``dropout`` becomes ``native_dropout`` with a bool mask, batch norm becomes
``cudnn_batch_norm``). But backward does not run: autograd's engine asks the CUDA runtime
for the device's primary context, and with no GPU it fails (``RuntimeError: hasPrimaryContext
expects a valid device index``). Autocast on a fake cuda tensor is switched off with a
warning ("CUDA is not available"). So a training step cannot run on fake cuda tensors here.

Instead the fake engine runs the experiment on fake *CPU* tensors and makes CUDA's
choices explicitly (``cuda_kernels()``), each one checked against PyTorch's source:

* **optimizers**: ``torch/optim/optimizer.py`` ``_default_to_fused_or_foreach`` picks the
  foreach implementation when every parameter is a CUDA tensor (and never fused unless
  asked). On the CPU, and for ``FakeTensor`` parameters anywhere (their type is not in
  ``_foreach_supported_types``), it picks the for-loop. Inside ``cuda_kernels()`` it answers
  as it would for CUDA tensors. An explicit ``foreach=`` / ``fused=`` is left alone.
* **step counters**: ``torch/optim/adam.py`` ``_init_group`` (and adamw, rmsprop,
  adagrad) keeps ``state["step"]`` as a CPU tensor unless the group is fused or capturable,
  so on a GPU it is host memory. ``on_host_under_cuda`` picks those storages so the engine
  counts them on the CPU, not on the GPU. NB: a fused or capturable optimizer keeps its step
  on the GPU (one 512-byte block per parameter tensor); the emulation counts it as host.
* **dropout**: ``aten/src/ATen/native/Dropout.cpp`` ``dropout`` uses the fused kernel
  (``native_dropout``: the output and a **bool** mask, saved for backward) when the input
  is on CUDA, in training, with 0 < p < 1; the CPU path multiplies by a float noise
  tensor it keeps. Inside ``cuda_kernels()``, ``F.dropout`` / ``torch.dropout`` (patched for
  the duration) call ``torch.native_dropout``, which allocates exactly what the fused CUDA
  kernel does.
  ``dropout_`` (``inplace=True``), ``Dropout1d/2d/3d`` and alpha dropout take the same
  non-fused path on both devices and are left alone. ``at::dropout`` called from C++ (the math
  attention composite ``_scaled_dot_product_attention_math`` in
  aten/src/ATen/native/transformers/attention.cpp calls it on the float32 weights) never meets the
  Python patch: for a fake CPU input it would run
  ``_dropout_impl`` and save a float32 noise tensor, 3 bytes an element more than CUDA's bool mask.
  ``_cuda_dropout_op`` registers CUDA's choice on the op itself (``aten::dropout`` at the
  ``AutogradCPU`` key, fake inputs only) for the duration.
* **512-byte blocks**: the engine reports the run on ``cuda:0`` with every storage rounded
  up to the caching allocator's 512-byte block (``c10/cuda/CUDACachingAllocator.cpp``
  ``kMinBlockSize``), as the tracker does for a real CUDA run.
* **attention**: ``F.scaled_dot_product_attention`` (patched for the duration) runs the CUDA
  kernel ``select_sdp_backend`` picks on the card the run answers for (``measure.cuda_card``: its
  compute capability and the input dtype decide between cuDNN, flash, memory-efficient and math;
  no card named: an A100/H100-class GPU's sm80 rules). cuDNN, flash and memory-efficient save the
  output and a float32 softmax statistic per row; math saves the s×s attention weights, in float32
  (``cuda_sdpa_backend``), and with dropout the bool mask of CUDA's ``native_dropout`` (see dropout).
  Transformers' mask builder is told the sequences are not packed, as it finds on real positions
  (``unpacked_sequences``).
* **RMSNorm**: ``aten::rms_norm`` on a CUDA tensor runs the fused kernel ``_fused_rms_norm``
  (one output and a float32 ``rstd`` per row, saved with the input and weight), while on the CPU
  it decomposes into pow / mean / rsqrt / mul, which save three input-sized tensors. Inside
  ``cuda_kernels()`` fake CPU tensors take the fused kernel's allocations (``_cuda_rms_norm``).
* **autocast**: CUDA's op table (``cuda_autocast.cuda_autocast_policy``): softmax, layer norm,
  the losses, sums and the other "fp32" ops run in float32 as on a GPU.
* **batch norm**: nothing to change: ``cudnn_batch_norm`` saves the same input, weight,
  running stats and per-channel mean / inverse std as the CPU kernel; its extra ``reserve``
  tensor is empty on fake tensors (its real size comes from cuDNN at run time).

``STILL_DIFFERS`` lists, as data, what a fake CUDA-target run still cannot match on a real
GPU; the README and lesson 04 show it.
"""
from __future__ import annotations

import contextlib
import contextvars
import sys
from typing import Iterator

import torch
from torch._subclasses.fake_tensor import is_fake

from gpulab.measure.cuda_autocast import cuda_autocast_policy
from gpulab.measure.cuda_card import DEFAULT_TARGET, KernelTarget, current_target, kernel_target, sdpa_backend

__all__ = [
    "STILL_DIFFERS", "cuda_kernels", "emulating_cuda", "cuda_sdpa_backend", "on_host_under_cuda", "unpacked_sequences"
]

STILL_DIFFERS: tuple[tuple[str, str], ...] = (
    ("CUDA context", "the driver's and PyTorch's own memory on the card: not a tensor, so never counted; fit, "
                     "serve and lesson 04 add the measured figure (predict.context)"),
    ("cuBLAS / cuDNN workspaces", "matmul and convolution workspaces the libraries allocate through the "
                                  "caching allocator: fit and serve add cuBLAS's by the card's compute capability "
                                  "(measure.cuda_card); cuDNN's depend on the algorithm it picks at run time, and "
                                  "are added only from a step recorded on the card asked for (record.workspaces)"),
    ("cuDNN batch norm reserve", "cudnn_batch_norm's reserve tensor is empty on fake tensors; its real size "
                                 "comes from cuDNN"),
    ("caching allocator", "live tensors only: reserved memory, fragmentation and cached blocks come from "
                          "the allocator simulator, not from the fake run"),
    ("kernel-internal buffers", "memory a CUDA kernel allocates inside itself (cuDNN conv algorithms, "
                                "NCCL, flash attention's scratch) is invisible to fake tensors"),
    ("attention kernels", "F.scaled_dot_product_attention is sent to the kernel the card's compute capability "
                          "picks (cuDNN, flash, memory-efficient or math, by sdp_utils.cpp's rules; no card named: "
                          "an A100/H100's); cuDNN attention is assumed newer than 9.15 on sm90/sm100, and its "
                          "allocations are the flash kernel's kind (output and a float32 statistic per row)"),
    ("fused / capturable optimizers", "their step counters live on the GPU, one 512-byte block per parameter "
                                      "tensor there, but the fake run counts them as host memory"),
)


def _optimizer_modules() -> list:
    return [m for name, m in list(sys.modules.items())
            if m is not None and (name == "torch.optim" or name.startswith("torch.optim."))]


def _cuda_default_to_fused_or_foreach(params, differentiable: bool, use_fused: bool = False):
    """CUDA's answer of ``torch/optim/optimizer.py`` ``_default_to_fused_or_foreach``: every
    parameter counts as a CUDA tensor (``cuda`` is in both supported-device lists)."""
    if torch.jit.is_scripting() or differentiable:
        return False, False
    fused = use_fused and all(p is None or torch.is_floating_point(p) for p in params)
    return fused, not fused


@contextlib.contextmanager
def _cuda_optimizer_defaults() -> Iterator[None]:
    """Swap torch.optim's default-implementation choice for CUDA's, in every torch.optim
    module that imported it, for the duration (restored on exit)."""
    original = sys.modules["torch.optim.optimizer"]._default_to_fused_or_foreach
    patched = [m for m in _optimizer_modules() if getattr(m, "_default_to_fused_or_foreach", None) is original]
    for m in patched:
        m._default_to_fused_or_foreach = _cuda_default_to_fused_or_foreach
    try:
        yield
    finally:
        for m in patched:
            m._default_to_fused_or_foreach = original


def _cuda_dropout(original, inplace_name: str = "inplace"):
    """``original`` (``F.dropout`` or ``torch.dropout``) as ``aten/src/ATen/native/Dropout.cpp``
    runs it on CUDA: the fused ``native_dropout`` (output + bool mask) when training with
    0 < p < 1 on a non-empty input and not in place; anything else goes through unchanged."""
    if original is torch.nn.functional.dropout:
        def dropout(input, p=0.5, training=True, inplace=False):
            if training and not inplace and 0.0 < float(p) < 1.0 and input.numel() > 0:
                return torch.native_dropout(input, float(p), True)[0]
            return original(input, p, training, inplace)
    else:  # torch.dropout(input, p, train)
        def dropout(input, p, train):
            if train and 0.0 < float(p) < 1.0 and input.numel() > 0:
                return torch.native_dropout(input, float(p), True)[0]
            return original(input, p, train)
    dropout.__wrapped__ = original
    return dropout


@contextlib.contextmanager
def _cuda_dropout_functions() -> Iterator[None]:
    """Swap ``torch.nn.functional.dropout`` and ``torch.dropout`` for CUDA's choice for the
    duration. A patch rather than a ``TorchFunctionMode``: it costs nothing on every other call,
    and it also holds while ``torch.utils.checkpoint`` recomputes a forward inside backward."""
    f_orig, t_orig = torch.nn.functional.dropout, torch.dropout
    torch.nn.functional.dropout, torch.dropout = _cuda_dropout(f_orig), _cuda_dropout(t_orig)
    try:
        yield
    finally:
        torch.nn.functional.dropout, torch.dropout = f_orig, t_orig


@contextlib.contextmanager
def _cuda_dropout_op() -> Iterator[None]:
    """``aten::dropout`` as ``Dropout.cpp``'s ``dropout`` runs it on a CUDA input, for fake CPU inputs,
    registered at the ``AutogradCPU`` key for the duration: training with 0 < p < 1 on a non-empty
    input (``is_fused_kernel_acceptable``) it is ``native_dropout`` (its output, and a bool mask that
    autograd saves); anything else, and every real tensor, runs the op's own composite (``_dropout_impl``).
    It reaches the calls C++ makes (the math attention's ``at::dropout``), which ``_cuda_dropout_functions``
    cannot."""
    lib = torch.library.Library("aten", "IMPL")
    op = torch.ops.aten.dropout.default

    def dropout(keyset, input, p, train):
        if is_fake(input) and train and 0.0 < p < 1.0 and input.numel() > 0:
            return torch.native_dropout(input, p, True)[0]
        # the C++ composite, under autograd (``op.decompose`` would take torch/_decomp's Python one,
        # which is native_dropout on any device)
        return op._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, input, p, train)
    try:
        lib.impl("dropout", dropout, "AutogradCPU", with_keyset=True)
        yield
    finally:
        lib._destroy()


def cuda_sdpa_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attn_mask: torch.Tensor | None = None, is_causal: bool = False, dropout_p: float = 0.0,
                      capability: tuple[int, int] | None = None) -> str:
    """The kernel ``F.scaled_dot_product_attention`` picks on a GPU of ``capability`` (default: the
    card the run answers for, ``cuda_card.current_target``; no card: sm80, an A100), per
    ``select_sdp_backend`` in aten/src/ATen/native/transformers/cuda/sdp_utils.cpp: "cudnn",
    "flash", "efficient" or "math" (``cuda_card.sdpa_backend`` gives each rule)."""
    cc = capability or current_target().rules
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return sdpa_backend(cc, query.dtype, tuple(query.shape), tuple(key.shape), tuple(value.shape),
                        mask=attn_mask is not None, is_causal=is_causal, dropout_p=float(dropout_p), requires_grad=grad)


@torch.compiler.assume_constant_result
def _count_traced(backend: str) -> bool:
    """``KernelTarget.seen`` counted once per trace: dynamo calls this while it traces and keeps its
    result as a constant, so its graphs hold no guard on the count (which would recompile them at
    every new count: ``len(...seen) != 0``)."""
    current_target().seen[backend] += 1
    return True


def _cuda_sdpa(original):
    """``F.scaled_dot_product_attention`` as CUDA runs it on the target card (``cuda_sdpa_backend``):
    the CUDA cuDNN / flash / memory-efficient ATen ops, whose fake kernels give the outputs (and so
    the saved tensors) the CUDA kernels allocate, or the math composite (``_scaled_dot_product_attention_math``,
    the s×s weights saved). Grouped-query k/v (``enable_gqa``, fewer k/v heads than q heads) go to the
    chosen CUDA op as they are, as CUDA does: ``sdp_utils.cpp`` lets all three fused kernels take them
    (``check_batch_size_and_num_heads_dense`` with GQA supported in ``can_use_flash_attention``,
    ``can_use_mem_efficient_attention`` and ``can_use_cudnn_attention``), and ``attention.cpp``'s
    ``scaled_dot_product_attention`` passes key and value unrepeated to each op. Flash's backward
    (``flash_api.cpp`` ``mha_bwd``) adds q-heads-wide ``dk_expanded`` / ``dv_expanded`` temporaries for
    GQA that no fake kernel shows. Each choice is counted on the target (``KernelTarget.seen``) for the
    answer's label."""
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        backend = cuda_sdpa_backend(query, key, value, attn_mask, bool(is_causal), dropout_p)
        if torch.compiler.is_compiling():   # counted as dynamo traces it, no guard on the count
            _count_traced(backend)
        else:
            current_target().seen[backend] += 1
        if backend == "math":
            return torch.ops.aten._scaled_dot_product_attention_math(
                query, key, value, attn_mask, float(dropout_p), bool(is_causal), None, scale=scale,
                enable_gqa=bool(enable_gqa))[0]
        if backend == "flash":
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, float(dropout_p), bool(is_causal), False, scale=scale)[0]
        mask = attn_mask
        if mask is not None and mask.dtype == torch.bool:   # convert_boolean_attn_mask (attention.cpp)
            mask = torch.zeros((), dtype=query.dtype).masked_fill(~mask, float("-inf"))
        lse = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
        if backend == "cudnn":
            return torch.ops.aten._scaled_dot_product_cudnn_attention(
                query, key, value, mask, lse, float(dropout_p), bool(is_causal), False, scale=scale)[0]
        return torch.ops.aten._scaled_dot_product_efficient_attention(   # "efficient"
            query, key, value, mask, lse, float(dropout_p), bool(is_causal), scale=scale)[0]
    sdpa.__wrapped__ = original
    return sdpa


@contextlib.contextmanager
def _cuda_attention() -> Iterator[None]:
    """CUDA's attention kernel for the duration (a patch: it holds during checkpoint recompute),
    and transformers' mask choice for one sequence per row (``unpacked_sequences``)."""
    original = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _cuda_sdpa(original)
    try:
        with unpacked_sequences():
            yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


@contextlib.contextmanager
def unpacked_sequences() -> Iterator[None]:
    """transformers' answer for one sequence per row, on fake tensors. Without an attention
    mask, ``create_causal_mask`` reads ``position_ids`` to rule out packed sequences
    (``masking_utils.find_packed_sequence_indices``: ``(packed[:, -1] == 0).all()``); it treats a
    fake tensor as tracing, cannot read it, and materializes a (b, 1, s, s) mask, which keeps
    SDPA off the flash kernel. On real tensors, with positions 0..s-1, it finds no packing and
    passes no mask (``is_causal=True``). Inside, the check answers as for those real positions
    (NB: packed sequences passed as explicit ``position_ids`` are taken as unpacked). Nothing is
    done when transformers has not been imported."""
    masking_utils = None
    if "transformers" in sys.modules:   # loaded now, not by the model's first forward (then too late)
        try:
            import transformers.masking_utils as masking_utils
        except ImportError:   # a transformers without it: nothing to answer
            masking_utils = None
    if masking_utils is None or not hasattr(masking_utils, "find_packed_sequence_indices"):
        yield
        return
    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


class _FusedRMSNorm(torch.autograd.Function):
    """What ``_fused_rms_norm`` and its backward allocate on CUDA, for fake tensors (no values):
    the output (input's dtype and shape) and ``rstd`` (float32, 1 in each normalized dim); saved:
    input, weight, rstd. Backward: the input's gradient and the weight's."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, eps):
        rstd_shape = tuple(x.shape[:x.dim() - len(normalized_shape)]) + (1,) * len(normalized_shape)
        rstd = x.new_empty(rstd_shape, dtype=torch.float32)
        ctx.save_for_backward(x, weight, rstd)
        ctx.mark_non_differentiable(rstd)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        x, weight, _ = ctx.saved_tensors
        grad_weight = torch.empty_like(weight) if weight is not None and ctx.needs_input_grad[2] else None
        return torch.empty_like(x), None, grad_weight, None


@contextlib.contextmanager
def _cuda_rms_norm() -> Iterator[None]:
    """``aten::rms_norm`` as CUDA runs it (the fused kernel) for fake tensors, registered at the
    autograd key for the duration (below autocast, which has cast the inputs by then); real
    tensors take the CPU's path unchanged, and an input whose dtype differs from the weight's
    its decomposition (``CompositeImplicitAutograd``), as CUDA does (``layer_norm.cpp``: "Mismatch
    dtype between input and weight ... Cannot dispatch to fused implementation"): torch 2.11's
    autocast (Colab's) leaves rms_norm's float16 input beside a float32 weight."""
    lib = torch.library.Library("aten", "IMPL")
    op = torch.ops.aten.rms_norm.default

    def rms_norm(keyset, input, normalized_shape, weight=None, eps=None):
        if is_fake(input):
            if weight is None or weight.dtype == input.dtype:
                return _FusedRMSNorm.apply(input, list(normalized_shape), weight, eps)
            return op.decompose(input, normalized_shape, weight, eps)   # the composite, under autograd
        return op.redispatch(keyset.remove(torch._C.DispatchKey.AutogradCPU), input, normalized_shape, weight, eps)
    try:
        lib.impl("rms_norm", rms_norm, "AutogradCPU", with_keyset=True)
        yield
    finally:
        lib._destroy()


_EMULATING = contextvars.ContextVar("gpulab_emulating_cuda", default=False)


def emulating_cuda() -> bool:
    """True inside ``cuda_kernels()``: code that has a fused CUDA kernel of its own (gpulab's 8-bit
    optimizer: bitsandbytes' in-place update) allocates as that kernel does."""
    return _EMULATING.get()


class cuda_kernels(contextlib.AbstractContextManager):
    """Run the code inside with CUDA's kernel choices (see the module docstring) for the card the
    caller named (``cuda_card.kernel_target``; none: sm80 rules). ``target`` is that card with a
    fresh count of the attention kernels chosen inside; after the run, ``target.note()`` says them."""

    def __init__(self) -> None:
        self._outer = current_target()
        self.target = KernelTarget(self._outer.name, self._outer.capability)
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> "cuda_kernels":
        stack = contextlib.ExitStack()
        token = _EMULATING.set(True)
        stack.callback(_EMULATING.reset, token)
        try:
            stack.enter_context(kernel_target(self.target))
            for cm in (_cuda_optimizer_defaults(), _cuda_dropout_functions(), _cuda_dropout_op(), _cuda_attention(),
                       _cuda_rms_norm(), cuda_autocast_policy()):
                stack.enter_context(cm)
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.__exit__(*exc)
        if self._outer is not DEFAULT_TARGET:   # a named card's question adds up its runs' kernels
            self._outer.seen.update(self.target.seen)


def on_host_under_cuda(record) -> bool:
    """A tracked storage that CUDA would keep in host memory: an optimizer's 0-dim
    ``state["step"]`` counter (``torch/optim/adam.py`` ``_init_group``)."""
    return record.state_key == "step" and tuple(record.shape) == ()
