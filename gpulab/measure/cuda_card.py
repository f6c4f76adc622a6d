"""What CUDA's libraries choose by the card: its compute capability decides the attention kernel
``F.scaled_dot_product_attention`` runs and the cuBLAS workspace PyTorch allocates.

The fake engine's CUDA target answers for one card at a time (``KernelTarget``, held in a context
variable for the duration of a run: ``kernel_target``); ``gpulab.predict.cards`` gives each card
its capability. Each rule below follows PyTorch's source, cited by file and function:

* **attention** (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, ``select_sdp_backend``):
  the backends are tried in ``priority_order``: flash, memory-efficient, math; cuDNN attention first
  when ``check_prefer_cudnn_attention`` holds (cuDNN newer than 9.15 on sm90 / sm100).

  - flash (``can_use_flash_attention``): ``check_flash_attention_hardware_support`` sm80..sm121;
    ``check_dtypes_low_precision`` fp16 / bf16; ``check_for_attn_mask`` no mask;
    ``check_head_dim_size_flash`` equal head dims <= 256;
    ``check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120`` (training on sm86-89 /
    sm120-121 only with head dim <= 192, or > 224 without dropout);
    ``check_flash_causal_non_square_seqlens`` (causal only with as many queries as keys);
  - memory-efficient (``can_use_mem_efficient_attention``): ``check_mem_efficient_hardware_support``
    sm50..sm121; dtypes fp16 / fp32, and bf16 from sm80 (``greater_than_or_equal_sm80_mem_efficient_dtypes``);
    ``check_head_dim_size_mem_efficient``: q and k head dims equal, q's and v's a multiple of
    ``minimum_gemm_alignment`` (sm80+: 8 for 16-bit, 4 for fp32; sm7x: 8 for fp16, 1 for fp32, no
    tensor cores for fp32 there; older: 1);
  - cuDNN (``can_use_cudnn_attention``): ``check_cudnn_hardware_support`` sm80..sm121, fp16 / bf16,
    ``check_cudnn_tensor_shapes``: head dims <= 128, or q / k 192 with v 128 on sm90 / sm10x (cuDNN
    9.11 and up; NB: 256 on sm90/sm10x with cuDNN newer than 9.22 and its frontend 1.24, not
    modelled), a multiple of 8, keys longer than 1; ``check_cudnn_dropout``: p a multiple of 1/16;
  - math (``_scaled_dot_product_attention_math``, aten/src/ATen/native/transformers/attention.cpp):
    anything else; it upcasts fp16 / bf16 q, k, v to float32 ("Keep query, key, value in high
    precision") and saves the s×s attention weights for backward.

* **cuBLAS workspace** (aten/src/ATen/cuda/CublasHandlePool.cpp, ``parseChosenWorkspaceSize``
  behind ``getChosenWorkspaceSize``): ``CUBLAS_WORKSPACE_CONFIG`` (":SIZE:COUNT" pairs, SIZE in
  KiB) when set; else ":4096:2:16:8" (4096 KiB × 2 + 16 KiB × 8 = 8,519,680 bytes), or 32 MiB
  (``4096 * 8 * 1024``) on Hopper: ``sm90`` only (major 9, minor 0) in older files, majors 9, 10,
  11 and 12 since pytorch#175344 ("32MiB for Hopper and Blackwell", 2026). Here: 32 MiB for
  majors 9 and up. ``setWorkspaceForHandle`` allocates one through the caching allocator per
  (cuBLAS handle, stream) and keeps it; handles are per thread (``getCurrentCUDABlasHandle``'s
  thread-local pool window), and autograd runs backward on its own device thread, so a training
  step holds two. ``parseCUDABlasLtWorkspaceSize`` adds cuBLASLt's own (``CUBLASLT_WORKSPACE_SIZE``,
  default 1024 KiB). On the H200 recorded here (torch 2.11.0+cu130) the first step kept 68,157,440
  bytes allocated after it: 2 × 32 MiB + 1 MiB, as these rules give. NB: from torch 2.15 on,
  PyTorch keeps workspaces only with ``TORCH_CUBLAS_WORKSPACE_CACHE=1``
  (``isCUDABlasWorkspaceCachingEnabled``, off by default on CUDA); otherwise a matmul allocates one for its own duration
  (``getCurrentCUDABlasHandleWithWorkspace``) or leaves cuBLAS its default workspace, so there these
  kept figures are an upper bound.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

__all__ = [
    "BACKEND_TEXT", "DEFAULT_TARGET", "KernelTarget", "current_target", "cublas_workspace_bytes",
    "cublaslt_workspace_bytes", "gemm_alignment", "kernel_target", "prefers_cudnn_attention", "sdpa_backend",
    "step_workspace_bytes"
]

# what each backend saves for backward, in words (the answer's "why")
BACKEND_TEXT = {
    "cudnn": "cuDNN attention (saves the output and a float32 softmax statistic per row)",
    "flash": "flash attention (saves the output and a float32 softmax statistic per row)",
    "efficient": "memory-efficient attention (saves the output and a float32 softmax statistic per row)",
    "math": "math attention (q, k, v upcast to float32 and the s×s attention weights saved)",
}
# dtypes by name (``str(torch.float16)`` is "torch.float16"): this module imports no torch, so
# that ``predict.cards`` (and the CLI's argument checks) stay torch-free
_HALF = ("float16", "bfloat16")
_MiB = 1 << 20


@dataclass(frozen=True)
class KernelTarget:
    """The card a fake CUDA-target run answers for: its name and compute capability (None: not
    known, an A100/H100-class GPU's sm80 rules assumed). ``seen`` counts the attention backends a run chose."""
    name: str = ""
    capability: tuple[int, int] | None = None
    seen: Counter = field(default_factory=Counter, compare=False, hash=False)

    @property
    def rules(self) -> tuple[int, int]:
        """The capability whose rules apply: the card's, else sm80 (today's default)."""
        return self.capability or (8, 0)

    @property
    def text(self) -> str:
        """``a T4 (sm75)``; without a card or a capability, what is assumed instead."""
        if self.capability is None:
            why = f"no compute capability known for {self.name}" if self.name else "no card named"
            return f"an A100/H100-class GPU (sm80 rules; {why})"
        sm = f"sm{self.capability[0]}{self.capability[1]}"
        article = "an" if self.name[:1].upper() in "AEFHILMNORSX8" else "a"
        return f"{article} {self.name} ({sm})"

    def note(self) -> str:
        """``CUDA kernels of a T4 (sm75): math attention (...)``: the card and the attention kernels chosen."""
        out = f"CUDA kernels of {self.text}"
        if self.seen:
            out += ": " + "; ".join(BACKEND_TEXT[b] for b in BACKEND_TEXT if b in self.seen)
        return out


DEFAULT_TARGET = KernelTarget()
_TARGET: contextvars.ContextVar[KernelTarget] = contextvars.ContextVar("gpulab_kernel_target", default=DEFAULT_TARGET)


def current_target() -> KernelTarget:
    return _TARGET.get()


@contextlib.contextmanager
def kernel_target(target: KernelTarget | None) -> Iterator[KernelTarget]:
    """Fake CUDA-target runs inside answer for ``target`` (None: the default, sm80 rules)."""
    token = _TARGET.set(target or DEFAULT_TARGET)
    try:
        yield _TARGET.get()
    finally:
        _TARGET.reset(token)


def _between(cc: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> bool:
    """``check_sm_version<low, high>``: low <= cc <= high, inclusive."""
    return low <= cc <= high


def _dtype(dtype: Any) -> str:
    """"float16" for torch.float16 (or the string "float16")."""
    return str(dtype).removeprefix("torch.")


def gemm_alignment(cc: tuple[int, int], dtype: Any) -> int:
    """``minimum_gemm_alignment``: the head-dim multiple memory-efficient attention needs."""
    half = _dtype(dtype) in _HALF
    tensor_cores = cc[0] >= 8 or (cc[0] >= 7 and half)        # use_tensor_cores
    mn = 4 if cc[0] >= 8 else 1
    return max(mn, 128 // (16 if half else 32)) if tensor_cores else mn


def prefers_cudnn_attention(cc: tuple[int, int]) -> bool:
    """``check_prefer_cudnn_attention``: cuDNN newer than 9.15 (assumed: the H200 run here had 9.19.0)
    on major 9 or 10 (minor 0 or 3 with CUDA before 13: H100, H200, B200 pass either way)."""
    return cc[0] in (9, 10) and cc[1] in (0, 3)


def _flash_ok(cc, dtype, dq, dk, dv, sq, sk, mask, is_causal, dropout_p, grad) -> bool:
    if not _between(cc, (8, 0), (12, 1)) or _dtype(dtype) not in _HALF or mask:
        return False
    if not (dq == dk == dv and dq <= 256) or (is_causal and sq != sk):
        return False
    if grad and (_between(cc, (8, 6), (8, 9)) or _between(cc, (12, 0), (12, 1))):
        return dq <= 192 or (dropout_p == 0 and dq > 224)
    return True


def _efficient_ok(cc, dtype, dq, dk, dv) -> bool:
    if not _between(cc, (5, 0), (12, 1)):
        return False
    if _dtype(dtype) not in (("float16", "float32", "bfloat16") if cc[0] >= 8 else ("float16", "float32")):
        return False
    align = gemm_alignment(cc, dtype)
    return dq == dk and dq % align == 0 and dv % align == 0 and dq > 0 and dv > 0


def _cudnn_ok(cc, dtype, dq, dv, sq, sk, dropout_p) -> bool:
    if not _between(cc, (8, 0), (12, 1)) or _dtype(dtype) not in _HALF:
        return False
    limit = 192 if (cc == (9, 0) or cc[0] == 10) and (dq, dv) == (192, 128) else 128   # cuDNN 9.11 and up
    if dq > limit or dv > limit or dq % 8 or dv % 8 or sk == 1 or (dropout_p and sq == 1):
        return False
    return dropout_p * 16 == int(dropout_p * 16)


def sdpa_backend(cc: tuple[int, int], dtype: Any, q_shape, k_shape, v_shape, *, mask: bool = False,
                 is_causal: bool = False, dropout_p: float = 0.0, requires_grad: bool = False) -> str:
    """The backend ``select_sdp_backend`` picks on a GPU of capability ``cc`` for these shapes
    ("cudnn", "flash", "efficient" or "math"); see the module docstring for each rule."""
    dq, dk, dv = q_shape[-1], k_shape[-1], v_shape[-1]
    sq, sk = q_shape[-2], k_shape[-2]
    if prefers_cudnn_attention(cc) and _cudnn_ok(cc, dtype, dq, dv, sq, sk, dropout_p):
        return "cudnn"
    if _flash_ok(cc, dtype, dq, dk, dv, sq, sk, mask, is_causal, dropout_p, requires_grad):
        return "flash"
    if _efficient_ok(cc, dtype, dq, dk, dv):
        return "efficient"
    return "math"


def cublas_workspace_bytes(cc: tuple[int, int] | None, env: Mapping[str, str] | None = None) -> int:
    """One cuBLAS workspace (``getChosenWorkspaceSize``): ``CUBLAS_WORKSPACE_CONFIG`` if set (an
    unreadable one falls back to the default, as PyTorch warns), else 32 MiB on major 9 and up,
    8,519,680 bytes (":4096:2:16:8") before. ``cc`` None: sm80 (today's default)."""
    env = os.environ if env is None else env
    major = (cc or (8, 0))[0]
    default = 4096 * 8 * 1024 if major >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    if config is None:
        return default
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    return sum(int(size) * 1024 * int(count) for size, count in pairs) if pairs else default


def cublaslt_workspace_bytes(env: Mapping[str, str] | None = None) -> int:
    """cuBLASLt's workspace (``parseCUDABlasLtWorkspaceSize``): ``CUBLASLT_WORKSPACE_SIZE`` KiB, default 1024."""
    env = os.environ if env is None else env
    try:
        return int(env.get("CUBLASLT_WORKSPACE_SIZE", "1024")) * 1024
    except ValueError:
        return 1024 * 1024


def step_workspace_bytes(cc: tuple[int, int] | None, training: bool = True,
                         env: Mapping[str, str] | None = None) -> int:
    """What a step's matmuls leave allocated for the process: a cuBLAS workspace for the calling
    thread's handle and, training, one for autograd's backward thread; cuBLASLt's once."""
    return cublas_workspace_bytes(cc, env) * (2 if training else 1) + cublaslt_workspace_bytes(env)
