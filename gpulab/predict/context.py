"""The CUDA context: what a process holds on the GPU outside PyTorch's caching allocator, and the
size ``gpulab fit`` and ``gpulab serve`` assume for it, with where that comes from.

The context holds the driver's state and the kernels loaded into it. Before CUDA 11.7 every
kernel of every loaded library (PyTorch's own, cuBLAS, cuDNN ...) was loaded when the context was
made; CUDA 11.7 added lazy module loading, each kernel loaded when first used, and PyTorch turns
it on (``CUDA_MODULE_LOADING=LAZY`` unless the user set it: pytorch#86509, in PyTorch 1.13). So
the size depends mostly on the module loading, then on the GPU, the driver and the libraries: the
published measurements below are what the assumptions rest on, each with its setting. A GPU run
replaces the assumption with a measurement (``gpulab record``: NVML used − memory_reserved).
"""
from __future__ import annotations

from dataclasses import dataclass

from gpulab.predict.cards import CUDA_CONTEXT_ASSUMED
from gpulab.units import MiB, format_bytes

__all__ = ["CONTEXT_MEASUREMENTS", "ContextAssumption", "MODULE_LOADING", "context_assumption", "context_label"]


@dataclass(frozen=True)
class ContextMeasurement:
    gpu: str
    software: str
    loading: str          # "lazy" or "eager"
    nbytes: int
    what: str             # what was measured
    source: str


CONTEXT_MEASUREMENTS = (
    ContextMeasurement("an unnamed GPU", "PyTorch 1.13 (its PR), CUDA >= 11.7", "lazy", 287_047_680,
                       "cudaMemGetInfo total - free after one 6.4 MB tensor", "pytorch/pytorch#86509"),
    ContextMeasurement("an unnamed GPU", "PyTorch 1.13 (its PR), CUDA_MODULE_LOADING=DEFAULT", "eager", 666_632_192,
                       "cudaMemGetInfo total - free after one 6.4 MB tensor", "pytorch/pytorch#86509"),
    ContextMeasurement("RTX 6000 Ada", "PyTorch 2.10.0+cu130", "lazy", 426 * MiB,
                       "nvidia-smi after torch.cuda.mem_get_info(0)", "unslothai/unsloth-zoo#1053"),
    ContextMeasurement("Tesla V100-SXM2 16 GB", "CUDA 11.2, driver 460.91.03", "eager", 1343 * MiB,
                       "NVML used after torch.ones((1, 1)).to('cuda')",
                       "Hugging Face transformers docs, perf_train_gpu_one (2022)"),
)
MODULE_LOADING = ("lazy", "eager")


@dataclass(frozen=True)
class ContextAssumption:
    nbytes: int
    label: str
    warning: str | None = None


def _range(loading: str) -> str:
    found = [m for m in CONTEXT_MEASUREMENTS if m.loading == loading]
    return "; ".join(f"{format_bytes(m.nbytes)} on {m.gpu} ({m.software}: {m.source})" for m in found)


def context_assumption(module_loading: str = "lazy") -> ContextAssumption:
    """The context size assumed for ``module_loading`` ("lazy": PyTorch's default on CUDA 11.7 and
    later; "eager": older CUDA, or ``CUDA_MODULE_LOADING=EAGER``), its label and any warning."""
    if module_loading not in MODULE_LOADING:
        raise ValueError(f"module_loading must be one of {', '.join(MODULE_LOADING)} (lazy: PyTorch's default "
                         f"with CUDA 11.7 or later), got {module_loading!r}")
    if module_loading == "lazy":
        return ContextAssumption(CUDA_CONTEXT_ASSUMED, f"assumed {format_bytes(CUDA_CONTEXT_ASSUMED)} with lazy module "
                                 "loading, above the published "
                                 f"measurements ({_range('lazy')}): kernels loaded on first use add to them")
    largest = max(m.nbytes for m in CONTEXT_MEASUREMENTS if m.loading == "eager")
    return ContextAssumption(largest, f"assumed {format_bytes(largest)} with eager module loading, the largest "
                             f"published measurement ({_range('eager')})",
                             "eager module loading (CUDA before 11.7, or CUDA_MODULE_LOADING=EAGER) loads every "
                             "library's kernels into the context: it varies from GPU to GPU and library to library; "
                             "measure yours (nvidia-smi after the first tensor) and pass it as the context size")


def context_label(nbytes: int, module_loading: str = "lazy") -> str:
    """How a result names its context size: the assumption's label, or that the user gave it."""
    assumed = context_assumption(module_loading)
    return assumed.label if nbytes == assumed.nbytes else f"given: {format_bytes(nbytes)}"
