"""Issue 47, item 5: a sentence about PyTorch names the symbol it rests on, and the symbol is in the
installed torch. Lesson 09 said PyTorch sets CUDA_MODULE_LOADING through
``maybe_set_cuda_module_loading``, removed in 2025; nothing checked it.

* every ``torch.…`` name in backticks in a lesson's markdown resolves (import + getattr);
* every C++ symbol the lessons name (``CPP_SYMBOLS``, and any backticked ``a::b``, ``camelCase()`` or
  ``kConstant``) is found in the installed torch: its .py files, its headers (torch/include), or,
  failing those, the strings of its libraries (torch/lib/*.so);
* a symbol known to be gone from PyTorch (``REMOVED``) is not named in backticks as if it existed.
"""
from __future__ import annotations

import functools
import glob
import importlib
import mmap
import os
import re

import nbformat
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_DIR = os.path.dirname(torch.__file__)

# C++ (or C++-side) names the lessons' sentences rest on -> where PyTorch's source has them
CPP_SYMBOLS = {
    "requested_bytes": "c10/core/CachingDeviceAllocator.h (DeviceStats)",
    "can_use_mem_efficient_attention": "aten/src/ATen/native/transformers/cuda/sdp_utils.cpp",
    "_scaled_dot_product_attention_math": "aten/src/ATen/native/transformers/attention.cpp",
    "getChosenWorkspaceSize": "aten/src/ATen/cuda/CublasHandlePool.cpp",
    "isCUDABlasWorkspaceCachingEnabled": "aten/src/ATen/cuda/CUDAContextLight.h (newer than torch 2.11's validation)",
    "TORCH_CUBLAS_WORKSPACE_CACHE": "aten/src/ATen/cuda/CublasHandlePool.cpp",
    "CUBLAS_WORKSPACE_CONFIG": "aten/src/ATen/cuda/CublasHandlePool.cpp",
    "alloc_found_block": "c10/cuda/CUDACachingAllocator.cpp",
    "get_free_block": "c10/cuda/CUDACachingAllocator.cpp",
    "get_allocation_size": "c10/cuda/CUDACachingAllocator.cpp",
    "kMinBlockSize": "c10/cuda/CUDACachingAllocator.cpp",
    "max_split_size": "c10/cuda/CUDAAllocatorConfig.h",
    "expandable_segments": "c10/cuda/CUDAAllocatorConfig.h",
    "num_alloc_retries": "c10/core/CachingDeviceAllocator.h",
    "num_device_alloc": "c10/core/CachingDeviceAllocator.h",
    "num_ooms": "c10/core/CachingDeviceAllocator.h",
    "aten::empty": "aten/src/ATen/native/native_functions.yaml",
}
# gone from PyTorch: a lesson may mention it as history, never in backticks as a current symbol
REMOVED = {"maybe_set_cuda_module_loading": "pytorch/pytorch#158712 (July 2025)",
           "getNewWorkspace": "CublasHandlePool.cpp, not in torch 2.15's libraries or headers"}

_CPP_LOOKING = re.compile(r"[A-Za-z_]\w*::\w+|[a-z]+[A-Z]\w*\(\)|k[A-Z]\w+")


@functools.lru_cache(maxsize=None)
def _backticked() -> tuple[tuple[str, str], ...]:
    """(lesson, text in backticks) over every markdown cell, fenced code left out."""
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "lessons", "*.ipynb"))):
        for cell in nbformat.read(path, 4).cells:
            if cell.cell_type == "markdown":
                src = re.sub(r"```.*?```", "", cell.source, flags=re.S)
                out += [(os.path.basename(path), t) for t in re.findall(r"`([^`\n]+)`", src)]
    return tuple(out)


def _python_name(text: str) -> str:
    """``torch.cuda.memory_stats()["requested_bytes.all.peak"]`` -> ``torch.cuda.memory_stats``."""
    return re.split(r"[(\[:\s=]", text, maxsplit=1)[0].rstrip(".")


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for i, attr in enumerate(parts[cut:]):
            if attr.endswith("*"):   # torch._foreach_*: some attribute with that prefix
                return i == len(parts[cut:]) - 1 and any(a.startswith(attr[:-1]) for a in dir(obj))
            if not hasattr(obj, attr):
                try:
                    obj = importlib.import_module(f"{obj.__name__}.{attr}")
                    continue
                except (ImportError, AttributeError):
                    return False
            obj = getattr(obj, attr)
        return True
    return False


@functools.lru_cache(maxsize=None)
def _source_text() -> str:
    """The installed torch's Python files and headers, as one string (read once)."""
    chunks = []
    for pattern in ("**/*.py", "include/**/*.h", "include/**/*.cuh"):
        for path in glob.glob(os.path.join(TORCH_DIR, pattern), recursive=True):
            try:
                with open(path, encoding="utf-8", errors="ignore") as f:
                    chunks.append(f.read())
            except OSError:
                pass
    return "\n".join(chunks)


def _in_libraries(symbol: str) -> bool:
    needle = symbol.encode()
    for path in glob.glob(os.path.join(TORCH_DIR, "lib", "*.so*")):
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m.find(needle) != -1:
                return True
    return False


def _in_installed_torch(symbol: str) -> bool:
    return symbol in _source_text() or _in_libraries(symbol)


def test_every_torch_name_in_the_lessons_markdown_exists_in_the_installed_torch():
    names = sorted({(lesson, _python_name(t)) for lesson, t in _backticked() if t.startswith("torch.")})
    assert len(names) > 20   # the scan sees the lessons' names
    missing = [(lesson, n) for lesson, n in names if not _resolves(n)]
    assert not missing, f"not in torch {torch.__version__}: {missing}"


def test_every_cpp_symbol_the_lessons_name_is_in_the_installed_torch():
    named = {t.removesuffix("()") for _, t in _backticked()}
    cpp = {s for s in CPP_SYMBOLS if s in named}
    assert {"requested_bytes", "can_use_mem_efficient_attention", "getChosenWorkspaceSize"} <= cpp
    # any other backticked name that looks like C++ is checked too, registry or not
    cpp |= {m.removesuffix("()") for _, t in _backticked() for m in _CPP_LOOKING.findall(t)
            if not t.startswith("torch.")}
    missing = sorted(s for s in cpp if not _in_installed_torch(s))
    assert not missing, f"named in a lesson, absent from torch {torch.__version__}: {missing}"


def test_no_lesson_names_a_removed_symbol_as_current():
    hits = [(lesson, t) for lesson, t in _backticked() for gone in REMOVED if gone in t]
    assert not hits, f"removed from PyTorch ({REMOVED}): {hits}"
    assert not any(_in_libraries(gone) for gone in REMOVED)   # and still gone from the installed torch


@pytest.mark.parametrize("text, name", [('torch.cuda.memory_stats()["requested_bytes.all.peak"]', "torch.cuda.memory_stats"),
                                        ("torch.OutOfMemoryError: CUDA out of memory", "torch.OutOfMemoryError"),
                                        ("torch.load(path, mmap=True)", "torch.load")])
def test_names_are_read_off_the_backticks(text, name):
    assert _python_name(text) == name and _resolves(name)
    assert not _resolves("torch.cuda.maybe_set_cuda_module_loading")
