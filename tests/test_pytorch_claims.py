"""Issue 47, item 5: a sentence about PyTorch names the symbol it rests on, and the symbol is in the
installed torch. Lesson 09 said PyTorch sets CUDA_MODULE_LOADING through
``maybe_set_cuda_module_loading``, removed in 2025; nothing checked it.

* every ``torch.…`` name in backticks in a lesson's markdown resolves (import + getattr);
* every C++ symbol the lessons name (``CPP_SYMBOLS``, and any backticked ``a::b``, ``camelCase()`` or
  ``kConstant``) is found in the installed torch: its .py files, its headers (torch/include), or,
  failing those, the strings of its libraries (torch/lib/*.so);
* a symbol known to be gone from PyTorch (``REMOVED``) is not named in backticks as if it existed;
* ``CLAIMS``, the registry of the core-day lessons' sentences about PyTorch's internals: each
  sentence (found by a phrase of it) is still in its lesson, its paragraph names the symbol it
  rests on, and the installed torch bears the sentence out: the symbol resolves, its Python source
  says what the sentence says, a header holds the constant, or a library holds the C++ name;
* every paragraph of a core-day lesson that cites a PyTorch source file is in the registry.

The lessons run on torch 2.11 (Google Colab's, gpulab's floor) through the newest release. A symbol
that only some of these have is listed in ``IN_RELEASES`` with its first and last release; a sentence
resting on it says which releases those are, and the test checks both sides of that bound on the
installed torch: present inside the range, absent outside it. ``make test-claims-oldest`` runs these
tests on torch 2.11 (docs/architecture.md, "Supported versions").

On a CPU-only build of torch (``TORCH=cpu``) the libraries hold no CUDA code, so a C++ name that lives
only in libtorch_cuda.so cannot be found there: those checks skip, saying so, rather than fail.
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
    "isCUDABlasWorkspaceCachingEnabled": "aten/src/ATen/cuda/CUDAContextLight.h (torch 2.15 on)",
    "TORCH_CUBLAS_WORKSPACE_CACHE": "aten/src/ATen/cuda/CublasHandlePool.cpp (torch 2.15 on)",
    "getNewWorkspace": "aten/src/ATen/cuda/CublasHandlePool.cpp (torch 2.11 to 2.14)",
    "CUBLAS_WORKSPACE_CONFIG": "aten/src/ATen/cuda/CublasHandlePool.cpp",
    "alloc_found_block": "c10/cuda/CUDACachingAllocator.cpp",
    "get_free_block": "c10/cuda/CUDACachingAllocator.cpp",
    "get_allocation_size": "c10/cuda/CUDACachingAllocator.cpp",
    "kMinBlockSize": "c10/core/AllocatorConfig.h (c10/cuda/CUDACachingAllocator.cpp before)",
    "alloc_block": "c10/cuda/CUDACachingAllocator.cpp",
    "release_cached_blocks": "c10/cuda/CUDACachingAllocator.cpp",
    "max_split_size": "c10/cuda/CUDAAllocatorConfig.h",
    "expandable_segments": "c10/cuda/CUDAAllocatorConfig.h",
    "num_alloc_retries": "c10/core/CachingDeviceAllocator.h",
    "num_device_alloc": "c10/core/CachingDeviceAllocator.h",
    "num_ooms": "c10/core/CachingDeviceAllocator.h",
    "aten::empty": "aten/src/ATen/native/native_functions.yaml",
}
# gone from every torch the lessons support (2.11 on): a lesson may mention it as history, never in
# backticks as a current symbol
REMOVED = {"maybe_set_cuda_module_loading": "pytorch/pytorch#158712 (July 2025); not in torch 2.11's libraries"}

# in only some of the releases the lessons support: name -> (first release with it, last release with
# it), None where the range is open. Read off the released wheels' libraries and headers (2.11.0,
# 2.12.1, 2.13.0, 2.14.1, 2.15.0): the cuBLAS workspace of a (handle, stream) was cached by
# getNewWorkspace through 2.14; 2.15 caches it only with TORCH_CUBLAS_WORKSPACE_CACHE=1.
IN_RELEASES = {
    "isCUDABlasWorkspaceCachingEnabled": ("2.15", None),
    "TORCH_CUBLAS_WORKSPACE_CACHE": ("2.15", None),
    "getNewWorkspace": (None, "2.14"),
}


def _release(version: str | None = None) -> tuple[int, int]:
    """``"2.11.0+cu130"`` -> ``(2, 11)``; the installed torch's when no version is given."""
    major, minor = re.match(r"(\d+)\.(\d+)", version or torch.__version__).groups()
    return int(major), int(minor)


def _in_range(since: str | None, until: str | None, version: str | None = None) -> bool:
    """Whether a release lies in [since, until] (major.minor; None leaves that side open)."""
    r = _release(version)
    return (since is None or r >= _release(since)) and (until is None or r <= _release(until))

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


def _has_cuda_libraries() -> bool:
    """A CUDA build of torch ships libtorch_cuda.so; a CPU-only build has no CUDA code to search."""
    return bool(glob.glob(os.path.join(TORCH_DIR, "lib", "libtorch_cuda*.so*")))


def _cuda_only_skip(names) -> None:
    pytest.skip(f"torch {torch.__version__} is a CPU-only build: its libraries hold no CUDA code, so "
                f"{sorted(names)} cannot be looked for here; run this test on a CUDA build")


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
    # a symbol of only some releases: present in those, absent from the others
    elsewhere = {s for s in cpp if s in IN_RELEASES and not _in_range(*IN_RELEASES[s])}
    there = sorted(s for s in elsewhere if _in_installed_torch(s))
    assert not there, f"torch {torch.__version__} has {there}, outside the releases IN_RELEASES gives"
    missing = sorted(s for s in cpp - elsewhere if not _in_installed_torch(s))
    if missing and not _has_cuda_libraries():
        _cuda_only_skip(missing)
    assert not missing, f"named in a lesson, absent from torch {torch.__version__}: {missing}"


def test_a_symbol_of_only_some_releases_is_named_with_its_releases():
    """A lesson naming a symbol of IN_RELEASES rests on a CLAIMS entry with the same releases, whose
    sentence names them (the registry test checks that)."""
    ranged = {(c[2], c[3][1], c[3][2]) for c in CLAIMS if c[3][0] == "releases"}
    named = {t.removesuffix("()") for _, t in _backticked()} & set(IN_RELEASES)
    assert named   # the lessons name some
    unranged = sorted(s for s in named if (s, *IN_RELEASES[s]) not in ranged)
    assert not unranged, f"named in a lesson without a CLAIMS entry giving its releases {IN_RELEASES}: {unranged}"


@pytest.mark.parametrize("version, since, until, inside", [
    ("2.11.0+cu130", None, "2.14", True), ("2.14.1", None, "2.14", True), ("2.15.0", None, "2.14", False),
    ("2.11.0", "2.15", None, False), ("2.15.0+cpu", "2.15", None, True), ("2.16.0a0+git1234", "2.15", None, True),
    ("2.12.1", "2.12", "2.13", True), ("2.9.1", "2.12", "2.13", False)])
def test_release_ranges(version, since, until, inside):
    assert _in_range(since, until, version) is inside


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


# --- the registry: each core-day sentence about PyTorch's internals, tied to the symbol it rests on ---
#
# (lesson, a phrase of the sentence, the symbol its paragraph names, the evidence in the installed torch):
#   ("releases", since, until, evidence)
#                               the evidence holds on releases since..until (major.minor, None: open) and
#                               fails on the others; the paragraph names the bounds (e.g. "2.15")
#   ("attr", dotted)            the name resolves
#   ("source", dotted, text)    the Python source of that object contains the text
#   ("doc", dotted, text)       its docstring contains the text
#   ("header", text)            a header of torch/include contains the text
#   ("lib", symbol)             the symbol is in the Python files, headers or library strings
#   ("run", check)              a check run on the installed torch (a function returning True)


def _maxpool_saves_int64_indices() -> bool:
    x = torch.randn(1, 1, 4, 4, requires_grad=True)
    _, idx = torch.nn.functional.max_pool2d_with_indices(x, 2)
    return idx.dtype == torch.int64


def _cpu_dropout_saves_a_float_mask() -> bool:
    y = torch.nn.functional.dropout(torch.randn(64, requires_grad=True), 0.5, True)
    saved = [getattr(y.grad_fn, n) for n in dir(y.grad_fn) if n.startswith("_saved_")]
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in saved) \
        and torch.ops.aten.native_dropout(torch.randn(4), 0.5, True)[1].dtype == torch.bool


def _each_optimizers_state_has_its_parameters_shape_and_dtype() -> bool:
    """The table of lesson 05: SGD none, momentum one, Adam/AdamW two, RMSprop one, Adagrad one."""
    expected = {(torch.optim.SGD, ()): set(), (torch.optim.SGD, (("momentum", 0.9),)): {"momentum_buffer"},
                (torch.optim.Adam, ()): {"exp_avg", "exp_avg_sq"}, (torch.optim.AdamW, ()): {"exp_avg", "exp_avg_sq"},
                (torch.optim.RMSprop, ()): {"square_avg"}, (torch.optim.Adagrad, ()): {"sum"}}
    for (cls, kw), keys in expected.items():
        p = torch.nn.Parameter(torch.randn(3, 2))
        opt = cls([p], lr=0.1, **dict(kw))
        p.grad = torch.ones_like(p)
        opt.step()
        tensors = {k: v for k, v in opt.state[p].items() if isinstance(v, torch.Tensor) and v.dim() > 0}
        if set(tensors) != keys or any(v.shape != p.shape or v.dtype != p.dtype for v in tensors.values()):
            return False
    return True


def _layer_norm_saves_its_input() -> bool:
    x = torch.randn(2, 3, 8, requires_grad=True)
    y = torch.nn.LayerNorm(8)(x)
    return type(y.grad_fn).__name__.startswith("NativeLayerNormBackward") and y.grad_fn._saved_input is x


def _sdpa_math_computes_bf16_in_float32() -> bool:
    """``_scaled_dot_product_attention_math`` on bf16 inputs: its matmuls run on float32 copies."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.bmm.default, torch.ops.aten.matmul.default):
                seen.append(out.dtype)
            return out

    q = torch.randn(1, 2, 8, 4, dtype=torch.bfloat16, requires_grad=True)
    with Log():
        out = torch.ops.aten._scaled_dot_product_attention_math(q, q, q)[0]
    return bool(seen) and set(seen) == {torch.float32} and out.dtype == torch.bfloat16


def _fused_exists_for_sgd_adam_adamw_adagrad_not_rmsprop() -> bool:
    """Lesson 05: ``fused=True`` is accepted (and steps) on the CPU for SGD, Adam, AdamW and Adagrad;
    RMSprop has no such argument."""
    for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad):
        p = torch.nn.Parameter(torch.randn(3, 2))
        opt = cls([p], lr=0.1, fused=True)
        p.grad = torch.ones_like(p)
        opt.step()
        if not opt.param_groups[0].get("fused"):
            return False
    try:
        torch.optim.RMSprop([torch.nn.Parameter(torch.randn(2))], fused=True)
    except TypeError:
        return True
    return False


def _scalar_mul_saves_nothing_and_softmax_saves_its_output() -> bool:
    """Lesson 07: ``x * 0.5`` saves nothing of ``x`` (only the number, as a 0-dim wrapped tensor);
    softmax saves its output (the same storage), not its input."""
    x = torch.randn(2, 3, requires_grad=True)
    scaled = x * 0.5
    saved = [getattr(scaled.grad_fn, n) for n in dir(scaled.grad_fn) if n.startswith("_saved_")]
    probs = torch.softmax(scaled, dim=-1)
    soft = [getattr(probs.grad_fn, n) for n in dir(probs.grad_fn) if n.startswith("_saved_")]
    soft_tensors = [t for t in soft if isinstance(t, torch.Tensor)]
    return (all(t.dim() == 0 for t in saved if isinstance(t, torch.Tensor)) and scaled.grad_fn._saved_self is None
            and len(soft_tensors) == 1 and soft_tensors[0].data_ptr() == probs.data_ptr())


def _cpu_autocast_keeps_softmax_and_norms_low_and_losses_fp32() -> bool:
    """Lesson 08: CPU autocast's float32 list has the losses but not softmax or the norms (CUDA's, in
    ``ATen/autocast_mode.h``, has all three): under bf16 autocast on the CPU softmax and layer_norm of
    a bf16 tensor stay bf16, mse_loss runs in float32."""
    h = torch.randn(4, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return (torch.softmax(h, -1).dtype == torch.bfloat16
                and torch.nn.functional.layer_norm(h, (8,)).dtype == torch.bfloat16
                and torch.nn.functional.mse_loss(h, torch.zeros_like(h)).dtype == torch.float32)


def _frozen_linear_saves_no_input() -> bool:
    """Lesson 11: a linear layer whose weight is frozen saves no input for a weight gradient (addmm
    saves ``mat1`` only when ``mat2`` needs a gradient)."""
    x = torch.randn(2, 4, requires_grad=True)
    frozen, trained = torch.nn.Linear(4, 4).requires_grad_(False), torch.nn.Linear(4, 4)
    a, b = frozen(x).grad_fn, trained(x).grad_fn
    return (type(a).__name__ == "AddmmBackward0" and a._saved_mat1 is None
            and b._saved_mat1 is not None and b._saved_mat1.shape == x.shape)


CLAIMS = [
    ("01", "hands out blocks in multiples of 512 bytes", "kMinBlockSize",
     ("header", "constexpr size_t kMinBlockSize = 512;")),
    ("03", "max-pool its **input and an int64 index tensor**", "max_pool2d_with_indices",
     ("run", _maxpool_saves_int64_indices)),
    ("03", "which the composite `dropout` multiplies by", "native_dropout", ("run", _cpu_dropout_saves_a_float_mask)),
    ("04", "sets the **peak** of every `memory_stats()` statistic", "torch.cuda.reset_peak_memory_stats()",
     ("attr", "torch.cuda.reset_peak_memory_stats")),
    ("04", "(that is `reset_accumulated_memory_stats()`)", "reset_accumulated_memory_stats",
     ("attr", "torch.cuda.reset_accumulated_memory_stats")),
    ("04", 'is `memory_stats()["allocated_bytes.all.current"]`', "torch.cuda.memory_allocated()",
     ("source", "torch.cuda.memory_allocated", "allocated_bytes.all.current")),
    ("04", 'is `"allocated_bytes.all.peak"`', "torch.cuda.max_memory_allocated()",
     ("source", "torch.cuda.max_memory_allocated", "allocated_bytes.all.peak")),
    ("04", '(`"reserved_bytes.all.current"`)', "torch.cuda.memory_reserved()",
     ("source", "torch.cuda.memory_reserved", "reserved_bytes.all.current")),
    ("04", "calls `cudaMemGetInfo`", "torch.cuda.mem_get_info()",
     ("source", "torch.cuda.mem_get_info", "cudaMemGetInfo")),
    ("04", 'torch.cuda.memory_stats()["requested_bytes.all.peak"]', "requested_bytes", ("lib", "requested_bytes")),
    ("05", "otherwise it is created **on the CPU**", "_init_group",
     ("releases", "2.13", None, ("source", "torch.optim.adam.Adam._init_group",
                                 'torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu")'))),
    ("05", "torch 2.11 and 2.12 leave the device out", "torch.set_default_device",
     ("releases", None, "2.12", ("source", "torch.optim.adam.Adam._init_group",
                                 "else torch.tensor(0.0, dtype=_get_scalar_dtype())\n"))),
    ("05", "create their state lazily inside the first `step()`", "_init_group",
     ("source", "torch.optim.adam.Adam._init_group", "Lazy state initialization")),
    ("07", "still runs `use_reentrant=True`", "torch/utils/checkpoint.py",
     ("source", "torch.utils.checkpoint", "without use_reentrant will raise an exception")),
    ("07", "still runs `use_reentrant=True`", "checkpoint",
     ("source", "torch.utils.checkpoint", "use_reentrant = True")),
    ("07", "still runs `use_reentrant=True`", "checkpoint_sequential",
     ("source", "torch.utils.checkpoint.checkpoint_sequential", "use_reentrant = True")),
    ("07", "**last segment runs without checkpointing**", "checkpoint_sequential",
     ("source", "torch.utils.checkpoint.checkpoint_sequential",
      "run_function(end + 1, len(functions) - 1, functions)(input)")),
    ("04", "As PyTorch's source has it", "torch/cuda/memory.py",
     ("source", "torch.cuda.memory", "def reset_peak_memory_stats")),
    ("05", "a tensor of the same shape and dtype as the parameter", "torch/optim/*.py",
     ("run", _each_optimizers_state_has_its_parameters_shape_and_dtype)),
    ("05", "backward ops run in the dtype autocast chose for the matching forward op", "autocast",
     ("doc", "torch.autocast", "Backward ops run in the same type that autocast used for corresponding forward ops")),
    ("05", "Its constructor fills `state[\"sum\"]` for every parameter", "torch/optim/adagrad.py",
     ("source", "torch.optim.Adagrad.__init__", 'state["sum"]')),
    ("05", "almost nothing for fused (read off `torch/optim/adam.py`", "torch/optim/adam.py",
     ("source", "torch.optim.adam", "def _multi_tensor_adam")),
    ("09", "(simulator; the same rules as `CUDACachingAllocator.cpp`)", "CUDACachingAllocator.cpp",
     ("header", "constexpr size_t kSmallBuffer = 2097152;")),
    ("08", "backward ops run in the dtype autocast chose for the matching forward op", "torch.autocast",
     ("doc", "torch.autocast", "Backward ops run in the same type that autocast used for corresponding forward ops")),
    ("09", "*best-fit from the cached free blocks*", "get_free_block", ("lib", "get_free_block")),
    ("09", "*best-fit from the cached free blocks*", "alloc_block", ("lib", "alloc_block")),
    ("09", "returns *whole free segments* to CUDA", "release_cached_blocks", ("lib", "release_cached_blocks")),
    ("09", "frees cached segments and retries on its own", "num_alloc_retries", ("lib", "num_alloc_retries")),
    ("09", "sized by `getChosenWorkspaceSize()`", "getChosenWorkspaceSize", ("lib", "getChosenWorkspaceSize")),
    ("09", "only when `TORCH_CUBLAS_WORKSPACE_CACHE=1` is set", "isCUDABlasWorkspaceCachingEnabled",
     ("releases", "2.15", None, ("lib", "isCUDABlasWorkspaceCachingEnabled"))),
    ("09", "the workspace stays with its handle", "getNewWorkspace",
     ("releases", None, "2.14", ("lib", "getNewWorkspace"))),
    ("11", "Adam keeps two moments per parameter in the parameter's dtype", "_init_group",
     ("source", "torch.optim.adam.Adam._init_group", 'state["exp_avg_sq"] = torch.zeros_like(')),
    ("11", "gets the memory-efficient kernel only in fp16 or fp32", "can_use_mem_efficient_attention",
     ("lib", "can_use_mem_efficient_attention")),
    ("11", "op-level selective activation checkpointing", "create_selective_checkpoint_contexts",
     ("attr", "torch.utils.checkpoint.create_selective_checkpoint_contexts")),
    # lesson 04's data loading (an optional section): what pin_memory and non_blocking change, and where
    ("04", "`pin_memory=True` is ignored with a warning", "_BaseDataLoaderIter",
     ("source", "torch.utils.data.dataloader._BaseDataLoaderIter.__init__",
      "loader.pin_memory and torch.accelerator.is_available()")),
    ("04", "each batch is copied into pinned memory", "torch.utils.data._utils.pin_memory.pin_memory",
     ("source", "torch.utils.data._utils.pin_memory.pin_memory", "return data.pin_memory()")),
    ("04", "has an effect only on a copy between CPU and GPU", "torch.Tensor.copy_",
     ("doc", "torch.Tensor.copy_", "if ``True`` and this copy is between CPU and GPU")),
    ("04", "from pinned and pageable memory alike", "torch.Tensor.to",
     ("doc", "torch.Tensor.to", "applies to both pinned and pageable memory")),
    # the review of 2026-12-07: sentences corrected against torch 2.15
    ("01", "would leave 1 MiB or less over", "kSmallSize", ("header", "constexpr size_t kSmallSize = 1048576;")),
    ("01", "cuts small blocks from segments of", "kSmallBuffer", ("header", "constexpr size_t kSmallBuffer = 2097152;")),
    ("04", "20 MiB for requests of 1 to 10 MiB, a larger request's own size", "get_allocation_size",
     ("header", "constexpr size_t kMinLargeAlloc = 10485760;")),
    ("04", "20 MiB for requests of 1 to 10 MiB, a larger request's own size", "get_allocation_size",
     ("header", "constexpr size_t kRoundLarge = 2097152;")),
    ("05", "SGD's `_init_group` only reads `momentum_buffer`", "_init_group",
     ("source", "torch.optim.sgd.SGD._init_group", 'momentum_buffer_list.append(state.get("momentum_buffer"))')),
    ("05", "its `step()` stores the buffer the first update made", "_init_group",
     ("source", "torch.optim.sgd.SGD.step", 'state["momentum_buffer"] = momentum_buffer')),
    ("07", "LayerNorm 1 (`native_layer_norm`) also saves the block's input", "native_layer_norm",
     ("run", _layer_norm_saves_its_input)),
    ("09", "otherwise torch 2.15 and later give it back after each call", "TORCH_CUBLAS_WORKSPACE_CACHE",
     ("releases", "2.15", None, ("header", "workspace = at::cuda::allocateCUDABlasWorkspace(size);"))),
    ("09", "otherwise torch 2.15 and later give it back after each call", "TORCH_CUBLAS_WORKSPACE_CACHE",
     ("releases", "2.15", None, ("lib", "TORCH_CUBLAS_WORKSPACE_CACHE"))),
    ("07", "yes, once the last needed tensor is recomputed", "use_reentrant=False",
     ("doc", "torch.utils.checkpoint.checkpoint", "Non-reentrant checkpoint stops recomputation as soon as")),
    ("08", "and caches it for the rest of the region", "cache_enabled",
     ("doc", "torch.autocast", "Whether the weight cache inside autocast should be enabled.")),
    ("11", "which computes in float32 and saves", "_scaled_dot_product_attention_math",
     ("run", _sdpa_math_computes_bf16_in_float32)),
    ("14", "`param.copy_(input_param)` in `Module._load_from_state_dict`", "_load_from_state_dict",
     ("source", "torch.nn.Module._load_from_state_dict", "param.copy_(input_param)")),
    ("14", "PyTorch warns so and suggests `assign=True`", "assign=True",
     ("source", "torch.nn.Module._load_from_state_dict", "which is a no-op")),
    ("14", "keeping the module's `requires_grad`", "assign=True",
     ("source", "torch.nn.Module._load_from_state_dict", "requires_grad=param.requires_grad")),
    ("14", "is `mmap.MAP_PRIVATE`", "get_default_mmap_options",
     ("doc", "torch.serialization.get_default_mmap_options", "Defaults to ``mmap.MAP_PRIVATE``")),
    ("07", "the segment's parameters get **no gradient** (a warning, not an error)", "use_reentrant=True",
     ("source", "torch.utils.checkpoint", "None of the inputs have requires_grad=True. Gradients will be None")),
    ("07", "keyword arguments, `torch.autograd.grad`, `backward(inputs=...)`", "use_reentrant=True",
     ("source", "torch.utils.checkpoint", "with .grad() or passing an `inputs` parameter to .backward()")),
    ("07", "keyword arguments, `torch.autograd.grad`, `backward(inputs=...)`", "use_reentrant=True",
     ("source", "torch.utils.checkpoint", "if kwargs and use_reentrant:")),
    # review-h of 2026-12-07: the core path of lessons 00-03
    ("03", "plus cuDNN/cuBLAS workspaces and block rounding", "torch.cuda.max_memory_allocated()",
     ("source", "torch.cuda.max_memory_allocated", "allocated_bytes.all.peak")),
    # review3 of 2026-12-07: the core path of lessons 05, 07, 08, 11
    ("05", "(the default since torch 2.0)", "zero_grad(set_to_none=True)",
     ("source", "torch.optim.Optimizer.zero_grad", "def zero_grad(self, set_to_none: bool = True)")),
    ("05", "On CUDA, foreach", "_default_to_fused_or_foreach",
     ("source", "torch.optim.optimizer._default_to_fused_or_foreach", "foreach = not fused and all(")),
    ("05", "RMSprop has none, and the panel says so", "fused",
     ("run", _fused_exists_for_sgd_adam_adamw_adagrad_not_rmsprop)),
    ("07", "a multiply by a Python number saves nothing", "softmax",
     ("run", _scalar_mul_saves_nothing_and_softmax_saves_its_output)),
    ("08", "multiplies the loss by a large scale (2¹⁶ to start)", "GradScaler",
     ("source", "torch.amp.GradScaler.__init__", "init_scale: float = 2.0**16")),
    ("11", "a frozen linear layer's `addmm` does not save its input", "addmm", ("run", _frozen_linear_saves_no_input)),
    # review-b of 2026-12-07: the core path of lessons 07, 08, 09, 11, 14
    ("08", "softmax and norms on CUDA, by `ATen/autocast_mode.h`, but not on the CPU", "ATen/autocast_mode.h",
     ("header", "_(softmax, int)")),
    ("08", "softmax and norms on CUDA, by `ATen/autocast_mode.h`, but not on the CPU", "ATen/autocast_mode.h",
     ("header", "_(native_layer_norm)")),
    ("08", "softmax and norms on CUDA, by `ATen/autocast_mode.h`, but not on the CPU", "ATen/autocast_mode.h",
     ("run", _cpu_autocast_keeps_softmax_and_norms_low_and_losses_fp32)),
    # review-e of 2026-12-07: lessons 07, 08, 09, 11, 14 read again
    ("14", "through `ModuleTracker`", "ModuleTracker",
     ("source", "torch.utils.flop_counter.FlopCounterMode.__init__", "ModuleTracker()")),
    ("14", "through `ModuleTracker`", "register_multi_grad_hook",
     ("source", "torch.utils.module_tracker.ModuleTracker._fw_pre_hook", "register_multi_grad_hook")),
]

_CITES_SOURCE = re.compile(r"(?:torch|c10|aten)/[\w/.*]+\.(?:py|cpp|h|yaml)|\b[A-Z]\w+\.(?:cpp|h)\b")


def _normal(text: str) -> str:
    return " ".join(text.split())


@functools.lru_cache(maxsize=None)
def _paragraphs(number: str) -> tuple[str, ...]:
    (path,) = glob.glob(os.path.join(ROOT, "lessons", f"{number}_*.ipynb"))
    out = []
    for cell in nbformat.read(path, 4).cells:
        if cell.cell_type == "markdown":
            out += [_normal(p) for p in re.split(r"\n\s*\n", cell.source)]
    return tuple(out)


def _core_day() -> list[str]:
    import sys
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import core_day_lessons
    return sorted(core_day_lessons())


def _object(dotted: str):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def _borne_out(evidence) -> bool | None:
    """Whether the installed torch bears the evidence out; None where it cannot tell (a C++ name
    absent from a CPU-only build, whose libraries hold no CUDA code)."""
    import inspect
    kind, *args = evidence
    if kind == "releases":
        since, until, inner = args
        held = _borne_out(inner)
        return None if held is None else held == _in_range(since, until)
    if kind == "attr":
        return _resolves(args[0])
    if kind == "source":
        return args[1] in inspect.getsource(_object(args[0]))
    if kind == "doc":
        return args[1] in (_object(args[0]).__doc__ or "")
    if kind == "header":
        return args[0] in _source_text()
    if kind == "lib":
        return True if _in_installed_torch(args[0]) else (False if _has_cuda_libraries() else None)
    if kind == "run":
        return bool(args[0]())
    raise ValueError(f"unknown evidence kind {kind!r}")


@pytest.mark.parametrize("claim", CLAIMS, ids=lambda c: f"{c[0]}-{c[2]}")
def test_each_registered_sentence_names_its_symbol_and_the_installed_torch_bears_it_out(claim):
    number, phrase, symbol, evidence = claim
    paragraphs = [p for p in _paragraphs(number) if _normal(phrase) in p]
    assert paragraphs, f"lesson {number} no longer says {phrase!r}: update CLAIMS with the sentence that replaced it"
    assert any(symbol in p for p in paragraphs), f"lesson {number}: the sentence with {phrase!r} does not name {symbol}"
    if evidence[0] == "releases":
        bounds = [v for v in evidence[1:3] if v]
        assert any(all(v in p for v in bounds) for p in paragraphs if symbol in p), \
            f"lesson {number}: the sentence with {phrase!r} does not say which releases ({bounds}) have {symbol}"
    held = _borne_out(evidence)
    if held is None:
        _cuda_only_skip([symbol])
    assert held, f"lesson {number}: torch {torch.__version__} does not bear out {phrase!r} ({evidence})"


def test_every_core_lesson_paragraph_citing_pytorchs_source_is_registered():
    registered = {(n, _normal(phrase)) for n, phrase, _, _ in CLAIMS}
    unregistered = []
    for number in _core_day():
        for p in _paragraphs(number):
            if _CITES_SOURCE.search(p) and not any(n == number and phrase in p for n, phrase in registered):
                unregistered.append((number, p[:120]))
    assert not unregistered, f"sentences citing PyTorch's source with no CLAIMS entry: {unregistered}"


def test_a_claim_the_installed_torch_does_not_bear_out_fails():
    assert not _borne_out(("source", "torch.cuda.memory_allocated", "requested_bytes.all.current"))
    assert not _borne_out(("lib", "maybe_set_cuda_module_loading"))
    assert not _borne_out(("header", "constexpr size_t kMinBlockSize = 1024;"))
    # a symbol every supported release has, claimed to stop at 2.10 or to start at 9.0
    assert not _borne_out(("releases", None, "2.10", ("attr", "torch.cuda.memory_stats")))
    assert not _borne_out(("releases", "9.0", None, ("attr", "torch.cuda.memory_stats")))
    assert _borne_out(("releases", "2.11", None, ("attr", "torch.cuda.memory_stats")))
