"""The CUDA context: what a process holds on the GPU outside PyTorch's caching allocator, and the
size ``gpulab fit`` and ``gpulab serve`` assume for it, with where that comes from.

The context holds the driver's state and the kernels loaded into it. Before CUDA 11.7 every
kernel of every loaded library (PyTorch's own, cuBLAS, cuDNN ...) was loaded when the context was
made; CUDA 11.7 added lazy module loading, each kernel loaded when first used, and CUDA makes it
its own default from 12.2 on Linux and 12.3 on Windows. PyTorch set ``CUDA_MODULE_LOADING=LAZY``
itself from 1.13 (pytorch#86509) until pytorch#158712 (July 2025) removed that. So
the size depends mostly on the module loading, then on the GPU, the driver and the libraries. The
measurements below are what the assumptions rest on, each with its GPU, software and setting;
gpulab's own come first: on an NVIDIA H200 (torch 2.11.0+cu130, CUDA runtime 13.0, driver
580.159.04, lazy loading) NVML used − memory_reserved was 1,141.88 MiB right after start and
1,383.88 MiB after the validation's training steps had loaded their kernels (docs/gpu-validation-h200.md,
"CUDA context", 2026-11-26); on an NVIDIA H100 80GB HBM3 (the same software) 1,006.81 MiB right after
start and 1,284.81 MiB after the practitioner validation's twelve cases, inductor's included
(docs/gpu-validation.md and its practitioner section, 2026-11-27). The lazy assumption is the larger
"after" figure, the H200's: what a training process holds outside the allocator once its kernels are
loaded, on the cards measured so far. A GPU run replaces the assumption with a measurement
(``gpulab record``: NVML used − memory_reserved).
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


_OURS = "gpulab's GPU validation (docs/gpu-validation-h200.md, CUDA context), 2026-11-26"
_OURS_H100 = ("gpulab's GPU validation (docs/gpu-validation.md, CUDA context, and its practitioner section's "
              "gpt2-compile case), 2026-11-27")
_SOFTWARE = "torch 2.11.0+cu130, CUDA runtime 13.0, driver 580.159.04"   # both GPU runs
_AFTER, _START = ("NVML used - memory_reserved after the validation's training steps",
                  "NVML used - memory_reserved right after start, before any kernel ran")
CONTEXT_MEASUREMENTS = (   # gpulab's own first, the assumed one (the largest "after") at the head
    ContextMeasurement("NVIDIA H200", _SOFTWARE, "lazy", 1_451_098_112, _AFTER, _OURS),
    ContextMeasurement("NVIDIA H200", _SOFTWARE, "lazy", 1_197_342_720, _START, _OURS),
    ContextMeasurement("NVIDIA H100 80GB HBM3", _SOFTWARE, "lazy", 1_347_223_552, _AFTER, _OURS_H100),
    ContextMeasurement("NVIDIA H100 80GB HBM3", _SOFTWARE, "lazy", 1_055_719_424, _START, _OURS_H100),
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


def _mib(nbytes: int) -> str:
    """1,383.88 MiB: the figure as the GPU validation printed it."""
    return f"{nbytes / MiB:,.2f} MiB"


def _range(loading: str) -> str:
    found = [m for m in CONTEXT_MEASUREMENTS if m.loading == loading]
    return "; ".join(f"{_mib(m.nbytes)} on {m.gpu} ({m.software}: {m.source})" for m in found)


def context_assumption(module_loading: str = "lazy") -> ContextAssumption:
    """The context size assumed for ``module_loading`` ("lazy": CUDA's own default from 12.2 on
    Linux and 12.3 on Windows; "eager": older CUDA, or ``CUDA_MODULE_LOADING=EAGER``), its label and any warning."""
    if module_loading not in MODULE_LOADING:
        raise ValueError(f"module_loading must be one of {', '.join(MODULE_LOADING)} (lazy: CUDA's own default "
                         f"from CUDA 12.2 on Linux), got {module_loading!r}")
    if module_loading == "lazy":
        ours = [m for m in CONTEXT_MEASUREMENTS if m.source.startswith("gpulab's")]
        after, start = ours[0], ours[1]
        others = "; ".join(f"{_mib(a.nbytes)} on an {a.gpu} after training steps, {_mib(b.nbytes)} right after "
                           f"start ({a.software}: {a.source})" for a, b in zip(ours[2::2], ours[3::2]))
        published = "; ".join(f"{_mib(m.nbytes)} on {m.gpu} ({m.software}: {m.source})"
                              for m in CONTEXT_MEASUREMENTS if m.loading == "lazy" and m not in ours)
        return ContextAssumption(CUDA_CONTEXT_ASSUMED, f"measured: {_mib(after.nbytes)} on an {after.gpu} after "
                                 f"training steps ({after.software}; lazy module loading; NVML used − "
                                 f"memory_reserved: {after.source}), {_mib(start.nbytes)} right after start; "
                                 f"also measured: {others}; published: {published}")
    eager = [m.nbytes for m in CONTEXT_MEASUREMENTS if m.loading == "eager"]
    # eager loading loads every kernel lazy loading would, and more: never below the lazy figure
    largest = max(*eager, CUDA_CONTEXT_ASSUMED)
    return ContextAssumption(largest, f"assumed {_mib(largest)} with eager module loading: the largest "
                             f"measurement, eager ({_range('eager')}) or lazy (the NVIDIA H200's above, which "
                             "eager loading can only add to)",
                             "eager module loading (CUDA before 11.7, or CUDA_MODULE_LOADING=EAGER) loads every "
                             "library's kernels into the context: it varies from GPU to GPU and library to library; "
                             "measure yours (nvidia-smi after the first tensor) and pass it as the context size")


def context_label(nbytes: int, module_loading: str = "lazy") -> str:
    """How a result names its context size: the assumption's label, or that the user gave it."""
    assumed = context_assumption(module_loading)
    return assumed.label if nbytes == assumed.nbytes else f"given: {format_bytes(nbytes)}"
