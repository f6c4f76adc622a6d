"""A stand-in for one CUDA GPU, so that CI runs the cuda engine's code on every run without one.

What it replaces, and only that:

* **device memory**: tensors asked for on ``cuda`` live on the ``meta`` device (shapes, dtypes and
  storage sizes, no data, no compute). A ``TorchFunctionMode`` rewrites ``device="cuda"`` (also
  under ``with torch.device("cuda")``, ``.to("cuda")`` and ``.cuda()``) to ``meta``, and marks what
  it creates as GPU storages; a ``TorchDispatchMode`` marks every storage an op makes from GPU
  storages (forward, backward, optimizer) the same way.
* **the caching allocator**: each GPU storage gets a block from gpulab's own simulator
  (``gpulab.allocator.simulator.CachingAllocator``, rules from ``c10/cuda/CUDACachingAllocator.cpp``) when it
  is created, and gives it back when it dies, so ``torch.cuda.memory_allocated``/``_reserved``,
  their peaks, ``memory_stats``, ``empty_cache`` and ``reset_peak_memory_stats`` are one consistent
  set of counters. An allocation the simulated device cannot hold raises ``torch.OutOfMemoryError``
  as the real allocator does. The first matrix product of the "process" (the stand-in's lifetime)
  takes a cuBLAS-like workspace that stays allocated, as cuBLAS's does.
* **device facts**: ``torch.cuda.is_available`` and friends, ``mem_get_info`` (total minus a CUDA
  context, other processes and the reserved pool), NVML's used memory. The device's name is
  ``STANDIN_NAME``, so no number from it can be mistaken for a measurement.
* **CUDA events**: ``torch.cuda.Event(enable_timing=True)`` records the host's clock (no GPU ran
  anything: ``elapsed_time`` is the stand-in's own wall time, never a GPU's).
* **the allocator's history**: ``torch.cuda.memory._record_memory_history`` and ``_snapshot`` give
  the simulated allocator's segments and a ``device_traces`` list of ``alloc`` / ``free_completed``
  events (address, size, the Python frames that made it) in the shape PyTorch's snapshot has.

The tracker sees meta tensors; in the stand-in it names their device ``cuda:0`` (every meta tensor
a tracker sees during a stand-in test counts as the GPU's). Values are not computed: ``.item()``,
``bool()``, ``.tolist()`` and ``.cpu()`` of a GPU tensor give zeros.
NB: meta tensors are not CUDA tensors to PyTorch's own choices: optimizers take their for-loop
implementation, and CUDA autocast does not cast them. The counters follow what did run.
"""
from __future__ import annotations

import contextlib
import time
import traceback
import types
import weakref
from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from gpulab.allocator.simulator import MiB, CachingAllocator, SimulatedOutOfMemoryError

STANDIN_NAME = "stand-in GPU (no CUDA)"
GiB = 1024 * MiB

# cuBLAS's default workspace config ":4096:2:16:8" (2 x 4096 KiB + 8 x 16 KiB), allocated through
# the caching allocator by the first matmul on a handle/stream and kept for the process's lifetime
# (aten/src/ATen/cuda/CublasHandlePool.cpp, getChosenWorkspaceSize / getNewWorkspace: torch 2.11 to
# 2.14; from 2.15 on, kept so only with TORCH_CUBLAS_WORKSPACE_CACHE=1).
CUBLAS_WORKSPACE = 2 * 4096 * 1024 + 8 * 16 * 1024
MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addmv", "mv"}


def _is_cuda(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.split(":")[0] == "cuda"
    return False


def _zeros_like_host(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros(t.shape, dtype=t.dtype)


class StandInGPU:
    """The stand-in's state: the simulated allocator, the GPU storages, and a log of the
    ``torch.cuda`` calls made (``calls``: name -> count, ``order``: names in call order)."""

    def __init__(self, total_bytes: int = 16 * GiB, context_bytes: int = 500 * MiB,
                 other_process_bytes: int = 0, workspace_bytes: int = CUBLAS_WORKSPACE) -> None:
        self.total_bytes = total_bytes
        self.context_bytes = context_bytes
        self.other_process_bytes = other_process_bytes
        self.workspace_bytes = workspace_bytes
        self.sim = CachingAllocator(capacity_bytes=total_bytes - context_bytes - other_process_bytes)
        self.calls: Counter[str] = Counter()
        self.order: list[str] = []
        self._blocks: dict[int, Any] = {}       # id(storage) -> simulated block
        self._refs: dict[int, weakref.ref] = {}
        self._workspace = None
        self._creating = 0                       # > 0 while a cuda-device call runs
        self.trace: list[dict[str, Any]] | None = None   # _record_memory_history: on while a list
        self.trace_max = 0

    # ---- storages ------------------------------------------------------------------------------
    def is_gpu(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor) or t.device.type != "meta":
            return False
        try:
            return id(t.untyped_storage()) in self._blocks
        except (RuntimeError, NotImplementedError, TypeError):
            return False

    def _see(self, t: torch.Tensor) -> None:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return
        key = id(st)
        old = self._blocks.get(key)
        if old is not None:
            if old.size and st.nbytes() != old.requested:     # resized: a new buffer
                self._record("free_completed", old)
                self.sim.free(old)
                self._blocks[key] = self._malloc(st.nbytes())
            return
        self._blocks[key] = self._malloc(st.nbytes())
        self._refs[key] = weakref.ref(st, self._make_free(key))

    def _record(self, action: str, blk) -> None:
        if self.trace is None or blk is None or not blk.size:
            return
        frames = [{"filename": f.filename, "line": f.lineno, "name": f.name}
                  for f in reversed(traceback.extract_stack(limit=24)[:-3])]
        self.trace.append({"action": action, "addr": blk.addr, "size": blk.size, "stream": 0,
                           "time_us": int(time.time() * 1e6), "frames": frames})
        if self.trace_max and len(self.trace) > self.trace_max:
            del self.trace[0]

    def record_memory_history(self, enabled: Any = "all", context: Any = "all", stacks: str = "all",
                              max_entries: int = 0, **_kwargs: Any) -> None:
        """``torch.cuda.memory._record_memory_history``: ``enabled=None`` stops recording."""
        if enabled is None or enabled is False:
            self.trace = None
        else:
            self.trace, self.trace_max = ([] if self.trace is None else self.trace), int(max_entries or 0)

    def snapshot_with_trace(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """``torch.cuda.memory._snapshot()``: segments and the recorded trace (empty when off)."""
        return {"segments": self.memory_snapshot(), "device_traces": [list(self.trace or [])],
                "allocator_settings": {}, "stand_in": STANDIN_NAME}

    def _malloc(self, nbytes: int):
        try:
            blk = self.sim.malloc(nbytes)
            self._record("alloc", blk)
            return blk
        except SimulatedOutOfMemoryError as exc:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory ({STANDIN_NAME}). Tried to allocate {nbytes / MiB:.2f} MiB. "
                f"{self.sim.memory_allocated() / MiB:.2f} MiB is allocated by PyTorch, and "
                f"{(self.sim.memory_reserved() - self.sim.memory_allocated()) / MiB:.2f} MiB is reserved "
                f"by PyTorch but unallocated. ({exc})") from None

    def _make_free(self, key: int):
        me = weakref.ref(self)

        def on_free(_ref) -> None:
            gpu = me()
            if gpu is None:
                return
            blk = gpu._blocks.pop(key, None)
            gpu._refs.pop(key, None)
            if blk is not None:
                gpu._record("free_completed", blk)
                gpu.sim.free(blk)
        return on_free

    def _matmul(self) -> None:
        if self._workspace is None and self.workspace_bytes:
            self._workspace = self._malloc(self.workspace_bytes)

    # ---- torch.cuda ----------------------------------------------------------------------------
    def _log(self, name: str) -> None:
        self.calls[name] += 1
        self.order.append(name)

    def free_bytes(self) -> int:
        """What cudaMemGetInfo would say is free: total - context - other processes - reserved."""
        return self.total_bytes - self.context_bytes - self.other_process_bytes - self.sim.memory_reserved()

    def nvml_used(self) -> int:
        return self.total_bytes - self.free_bytes()

    def functions(self) -> dict[str, Any]:
        """The ``torch.cuda`` functions the stand-in answers, by name."""
        props = types.SimpleNamespace(name=STANDIN_NAME, total_memory=self.total_bytes, major=0, minor=0,
                                      multi_processor_count=1)

        def logged(name, fn):
            def wrapper(*args, **kwargs):
                self._log(name)
                return fn(*args, **kwargs)
            wrapper.__name__ = name
            return wrapper

        sim = self.sim
        return {
            "is_available": lambda: True,
            "device_count": lambda: 1,
            "current_device": lambda: 0,
            "set_device": lambda device=None: None,
            "is_initialized": lambda: True,
            "init": lambda: None,
            "get_device_name": lambda device=None: STANDIN_NAME,
            "get_device_capability": lambda device=None: (0, 0),
            "get_device_properties": lambda device=None: props,
            "is_bf16_supported": lambda *a, **k: True,
            "synchronize": logged("synchronize", lambda device=None: None),
            "empty_cache": logged("empty_cache", lambda: sim.empty_cache()),
            "reset_peak_memory_stats": logged("reset_peak_memory_stats", lambda device=None: sim.reset_peak_stats()),
            "reset_max_memory_allocated": logged("reset_peak_memory_stats", lambda device=None: sim.reset_peak_stats()),
            "memory_allocated": logged("memory_allocated", lambda device=None: sim.memory_allocated()),
            "max_memory_allocated": logged("max_memory_allocated", lambda device=None: sim.max_memory_allocated()),
            "memory_reserved": logged("memory_reserved", lambda device=None: sim.memory_reserved()),
            "max_memory_reserved": logged("max_memory_reserved", lambda device=None: sim.max_memory_reserved()),
            "memory_stats": logged("memory_stats", lambda device=None: sim.stats()),
            "mem_get_info": logged("mem_get_info", lambda device=None: (self.free_bytes(), self.total_bytes)),
            "memory_snapshot": logged("memory_snapshot", self.memory_snapshot),
            "Event": StandInEvent,
        }

    def memory_snapshot(self, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        """``torch.cuda.memory_snapshot()``'s segments (the fields gpulab reads), from the simulator."""
        return [{"device": 0, "address": seg.address, "total_size": seg.size, "segment_type": seg.pool,
                 "allocated_size": seg.allocated_bytes,
                 "blocks": [{"size": b.size, "requested_size": b.requested,
                             "state": "active_allocated" if b.allocated else "inactive"} for b in seg.blocks]}
                for seg in self.sim.segment_map()]


class StandInEvent:
    """``torch.cuda.Event``: the host's clock at ``record`` (the stand-in runs no GPU: an elapsed
    time from it is the stand-in's wall time, never a GPU's)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self.t: float | None = None

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream: Any = None) -> None:
        pass

    def elapsed_time(self, end: "StandInEvent") -> float:
        if not (self.enable_timing and end.enable_timing) or self.t is None or end.t is None:
            raise RuntimeError("Both events must be recorded with enable_timing=True before elapsed_time")
        return (end.t - self.t) * 1e3


class _Redirect(TorchFunctionMode):
    """``device="cuda"`` -> ``meta``; a GPU tensor's value -> zeros on the host."""

    def __init__(self, gpu: StandInGPU) -> None:
        super().__init__()
        self.gpu = gpu

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        gpu = self.gpu
        name = getattr(func, "__name__", "")
        first = args[0] if args else None
        # a value read from the GPU: zeros (every meta tensor here is the GPU's, also one made on
        # "meta" from a GPU tensor's device, such as GradScaler's found_inf); but the truth of such an
        # unmarked one is True, so that a loop it guards ends (generate()'s "all sequences finished")
        if (isinstance(first, torch.Tensor) and first.device.type == "meta" and not gpu.is_gpu(first)
                and name == "__bool__"):
            return True
        if isinstance(first, torch.Tensor) and first.device.type == "meta":
            if name in ("item", "__bool__", "__float__", "__int__", "__index__"):
                return func(_zeros_like_host(first), *args[1:], **kwargs)
            if name in ("tolist", "cpu", "numpy"):
                return func(_zeros_like_host(first), *args[1:], **kwargs)
            if name == "to" and any(isinstance(a, (str, torch.device)) and not _is_cuda(a)
                                    and torch.device(a).type == "cpu" for a in (*args[1:], kwargs.get("device"))
                                    if a is not None):
                return func(_zeros_like_host(first), *args[1:], **kwargs)
        redirect = False
        if _is_cuda(kwargs.get("device")):
            kwargs["device"], redirect = torch.device("meta"), True
        if name == "cuda":                      # t.cuda(...) -> t.to("meta")
            func, args, kwargs, redirect = torch.Tensor.to, (args[0], torch.device("meta")), {}, True
        elif name == "to" or name.startswith("new_"):
            new_args = []
            for a in args:
                if _is_cuda(a):
                    a, redirect = torch.device("meta"), True
                new_args.append(a)
            args = tuple(new_args)
        if not redirect:
            return func(*args, **kwargs)
        gpu._creating += 1
        try:
            out = func(*args, **kwargs)
        finally:
            gpu._creating -= 1
        # what a redirected call returns is on the GPU even where no op of its making reached the
        # dispatch mode: torch 2.11's torch.tensor(..., device="meta") dispatches nothing (2.15
        # dispatches lift_fresh), so BatchNorm's num_batches_tracked got no block there
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                gpu._see(t)
        return out


class _Observer(TorchDispatchMode):
    """Gives every storage an op makes on the GPU (from GPU inputs, or inside a redirected
    call) a block of the simulated allocator."""

    def __init__(self, gpu: StandInGPU) -> None:
        super().__init__()
        self.gpu = gpu

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        gpu = self.gpu
        flat_in = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
        on_gpu = gpu._creating > 0 or any(gpu.is_gpu(t) for t in flat_in)
        if (func is torch.ops.aten.copy_.default and isinstance(args[0], torch.Tensor)
                and args[0].device.type == "cpu" and gpu.is_gpu(args[1])):
            return args[0]      # a GPU tensor copied to the host (save_on_cpu): no values to copy
        if (func is torch.ops.aten._to_copy.default and gpu.is_gpu(args[0])
                and str((kwargs or {}).get("device", "")) == "cpu"):
            return _zeros_like_host(args[0])   # .cpu() where the function mode is off (a saved-tensor hook)
        if on_gpu and func.overloadpacket.__name__ in MATMUL_OPS:
            gpu._matmul()
        out = func(*args, **(kwargs or {}))
        if on_gpu:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.device.type == "meta":
                    gpu._see(t)
        return out


@contextlib.contextmanager
def standin_gpu(monkeypatch, **kwargs: Any):
    """Install the stand-in for the duration of the block; yields the ``StandInGPU``."""
    import gpulab.measure.gpu
    import gpulab.measure.tracking

    gpu = StandInGPU(**kwargs)
    for name, fn in gpu.functions().items():
        monkeypatch.setattr(torch.cuda, name, fn, raising=False)
        if hasattr(torch.cuda.memory, name):
            monkeypatch.setattr(torch.cuda.memory, name, fn)
    stream = types.SimpleNamespace(is_capturing=lambda: False, synchronize=lambda: None, device_index=0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: stream)
    # torch 2.11's optimizers ask the driver directly (torch.cuda.graphs), which a machine
    # without CUDA answers with an error; 2.15 asks the stream above
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", gpu.record_memory_history)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", gpu.snapshot_with_trace)
    monkeypatch.setattr(torch.cuda.graphs, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(gpulab.measure.gpu, "_nvml", lambda: (None, f"{STANDIN_NAME}: no NVML"), raising=False)
    monkeypatch.setattr(gpulab.measure.gpu, "nvml_used_bytes", lambda index=0: gpu.nvml_used(), raising=False)
    real_device_str = gpulab.measure.tracking._device_str
    monkeypatch.setattr(gpulab.measure.tracking, "_device_str",
                        lambda d: "cuda:0" if d.type == "meta" else real_device_str(d))
    with _Redirect(gpu), _Observer(gpu):
        yield gpu
