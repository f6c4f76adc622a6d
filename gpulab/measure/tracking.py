"""Live-tensor accounting: every storage created while an experiment runs.

``MemoryTracker`` is a ``TorchDispatchMode``: it sees the output of every ATen op, takes
each output's *storage* (two views of one storage count once) and keeps a weak reference
to it, whose callback records the moment the storage is freed. Hooks add meaning:

* global module forward hooks give the module an allocation belongs to, and label a
  model's parameters and buffers;
* ``saved_tensors_hooks`` see what autograd saves for backward (activations);
* post-accumulate-grad hooks label gradients;
* global optimizer step hooks label optimizer state and mark the optimizer phase;
* ``label()`` marks inputs (or anything else) explicitly.

A storage can gain labels as it lives (a temporary that a later layer saves becomes an
activation); it keeps the strongest one it received (``Category`` order), and that label
is used for its whole life. The same code runs on real CPU tensors, CUDA tensors and
fake tensors (FakeTensorMode), since all three have storages with ``nbytes()``.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
import weakref
from dataclasses import dataclass, replace
from typing import Any, Iterable, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.autograd.function import BackwardCFunction
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from gpulab.categories import CATEGORIES, Category
from gpulab.measure.records import (HOST_DEVICE, PHASES, UNIFIED_DEVICE, Event, StorageRecord, TrackingResult,
                                    apart_devices, live_by_category)

__all__ = ["Event", "HOST_DEVICE", "MemoryTracker", "PHASES", "StorageRecord", "TRACKER_LOCK", "TrackingResult", "UNIFIED_DEVICE"]


_RANK = {c: i for i, c in enumerate(CATEGORIES)}



def _device_str(device: torch.device) -> str:
    return str(device)


# A tracker's module and optimizer hooks are global (``register_module_forward_pre_hook``): they see the
# modules that every thread runs. A tracker holds this lock from ``__enter__`` to ``__exit__``, and code
# that runs modules on another thread while a tracker may be measuring (a panel's timing worker,
# ``widgets.checkpoint``) holds it too, so the two take turns.
TRACKER_LOCK = threading.RLock()


class MemoryTracker(TorchDispatchMode):
    """Context manager that records storage lifetimes; ``result()`` gives the data.

    >>> with MemoryTracker() as tracker:
    ...     model = torch.nn.Linear(4, 2)
    ...     x = tracker.label(torch.randn(8, 4), Category.INPUTS)
    ...     model(x).sum().backward()
    >>> tracker.result().peak_bytes  # doctest: +SKIP
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """True: a model under ``torch.compile`` runs its compiled graphs with the tracker on (it sees
        the ops they run); without it dynamo would see a user dispatch mode and run the model eagerly
        (torch/_dynamo/convert_frame.py, ``any_torch_dispatch_mode_on_stack``). Compile with the
        tracker ``paused()``."""
        return True

    def __init__(self, device_alias: dict[str, str] | None = None) -> None:
        """``device_alias``: record storages of one device under another name, e.g.
        ``{"cpu": "cuda:0"}`` when CPU fake tensors stand in for a GPU's (the fake engine's
        CUDA target)."""
        super().__init__()
        self._device_alias = dict(device_alias or {})
        self._device_names: dict[torch.device, str] = {}   # a storage's device -> the name it is recorded under
        self._self_ref = weakref.ref(self)   # what free callbacks hold: they must not keep the tracker alive
        self._records: dict[int, StorageRecord] = {}
        self._live: dict[int, int] = {}          # id(storage object) -> sid
        self._refs: dict[int, weakref.ref] = {}  # sid -> weakref (kept so callbacks fire)
        self._events: list[Event] = []
        self._next_sid = 0
        self._t0 = time.perf_counter()
        self._module_names: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
        self._module_stack: list[str] = []
        self._node_modules: dict[int, str] = {}  # autograd node sequence nr -> module that made it
        self._phase_override: list[str] = []
        self._auto_phase = "setup"
        self._in_optimizer = 0
        self._hooked_params = WeakIdKeyDictionary()  # param -> hook handle
        self._handles: list[Any] = []
        self._exit_stack: contextlib.ExitStack | None = None
        self._closed = False
        self._offload: str | None = None   # saved tensors go to host memory: "copy back" or "alias back"
        self._paused = False
        # Untracked autograd adds a gradient's contributions in place (``old.add_(new)``), but any
        # dispatch mode, this tracker included, makes it add them out of place: see
        # ``_accumulation_candidate``. ``emulate_untracked`` counts them as the untracked run does.
        self.emulate_untracked = True
        self._candidate: tuple[int, int, int] | None = None   # (key, sid) of an add's result, sid of its first input
        self.inplace_accumulations = 0   # out-of-place accumulations counted in place
        # CUDA storages' addresses in the order they were seen (the cuda engine sets a list, to
        # tell the allocator's trace entries that are tensors from those that are not)
        self.cuda_addresses: list[tuple[int, int]] | None = None
        # told every op after the tracker has seen it: ``observer(func, args, kwargs, out)`` (``predict.timing``'s
        # ``OpTimer``): the ops a second dispatch mode inside the tracker would see, without that mode's cost
        self.op_observer: Any = None

    # ---- context management -------------------------------------------------------
    def __enter__(self) -> "MemoryTracker":
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim_module

        TRACKER_LOCK.acquire()   # released in __exit__
        try:
            self._handles = [
                nn_module.register_module_forward_pre_hook(self._on_forward_pre),
                nn_module.register_module_forward_hook(self._on_forward_post, always_call=True),
                optim_module.register_optimizer_step_pre_hook(self._on_step_pre),
                optim_module.register_optimizer_step_post_hook(self._on_step_post),
            ]
            stack = contextlib.ExitStack()
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack))
            stack.enter_context(_storage_resizes_seen_by(self))
            self._exit_stack = stack
            super().__enter__()
        except BaseException:
            TRACKER_LOCK.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self._exit_stack is None:   # never entered, or left already: TorchDispatchMode's own stack is empty
            raise RuntimeError("MemoryTracker.__exit__ without a matching __enter__: use it as `with MemoryTracker() "
                               "as t:` (or call __enter__ first), and leave it once")
        try:
            super().__exit__(*exc)
        finally:
            for h in self._handles:
                h.remove()
            self._handles = []
            for h in list(self._hooked_params.values()):
                h.remove()
            self._hooked_params = WeakIdKeyDictionary()
            if self._exit_stack is not None:
                self._exit_stack.close()
                self._exit_stack = None
            self._closed = True
            TRACKER_LOCK.release()

    # ---- the dispatch hook ------------------------------------------------------------
    # Every ATen op of the run passes through here (tens of thousands for a large model's
    # training step), so the common outputs, one tensor or a flat tuple of tensors, are read
    # without building a pytree; anything nested goes through ``tree_flatten``, in the same order.
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._candidate = None
        if func is _PRIM_DEVICE and type(args[0]) is FakeTensor:
            # C++ asking a fake tensor its device (the autograd engine does, for every tensor it
            # meets: most of a fake step's dispatches). FakeTensor's own ``device`` answers it as
            # FakeTensorMode's handler would (the fake device, or meta inside its kernels), with
            # no storage made and no second dispatch.
            return args[0].device
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            rec = self._see(out, op=_op_name(func))
            if func is _ADD and rec is not None and self.emulate_untracked:
                self._candidate = self._accumulation_candidate(args, kwargs, out, rec)
        elif isinstance(out, (tuple, list)):
            flat = out if not any(isinstance(o, (tuple, list, dict)) for o in out) else tree_flatten(out)[0]
            for t in flat:
                if isinstance(t, torch.Tensor):
                    self._see(t, op=_op_name(func))
        elif isinstance(out, dict):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._see(t, op=_op_name(func))
        if self.op_observer is not None:
            self.op_observer(func, args, kwargs or {}, out)
        return out

    # ---- bookkeeping ---------------------------------------------------------------------
    def _phase(self) -> str:
        if self._phase_override:
            return self._phase_override[-1]
        if self._in_optimizer:
            return "optimizer"
        if torch._C._current_autograd_node() is not None:
            self._auto_phase = "backward"
        return self._auto_phase

    def _module(self) -> str:
        if self._module_stack:
            return self._module_stack[-1]
        # in backward: the module whose forward created the autograd node now running
        node = torch._C._current_autograd_node()
        if node is not None:
            return self._node_modules.get(node._sequence_nr(), "")
        return ""

    def _map_backward_nodes(self, output, name: str) -> None:
        """Remember which module's forward created each new autograd node behind
        ``output``, so that allocations in backward can name their module. Walks back from
        the output's grad_fn and stops at nodes already mapped (an inner module's, mapped
        first because inner forward hooks fire first)."""
        todo = [t.grad_fn for t in tree_flatten(output)[0]
                if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while todo:
            node = todo.pop()
            seq = node._sequence_nr()
            if seq in self._node_modules or "AccumulateGrad" in node.name():
                continue
            self._node_modules[seq] = name
            todo.extend(nxt for nxt, _ in node.next_functions if nxt is not None)

    def _storage(self, t: torch.Tensor):
        if is_traceable_wrapper_subclass(t):
            # A wrapper such as DTensor reports its global size; its memory is the one inner
            # tensor it wraps (a DTensor's local shard, what FSDP2 and ZeRO leave per rank).
            inner = [v for v in (getattr(t, a) for a in t.__tensor_flatten__()[0])
                     if isinstance(v, torch.Tensor)]
            if len(inner) != 1:
                return None
            t = inner[0]
        try:
            return t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return None  # sparse, nested or other storage-less tensors: not tracked

    def _see(self, t: torch.Tensor, op: str, category: Category = Category.TEMPORARIES,
             preexisting: bool = False) -> StorageRecord | None:
        if self._paused:
            return None
        st = self._storage(t)
        if st is None:
            return None
        key = id(st)
        sid = self._live.get(key)
        if sid is not None:
            rec = self._records[sid]
            n = st.nbytes()
            if n != rec.nbytes:  # resize_ / out= that grew the storage
                self._emit("resize", rec, n, n - rec.nbytes)
                rec.nbytes = n
            self._upgrade(rec, category)
            return rec
        sid = self._next_sid
        self._next_sid += 1
        device = t.device
        name = self._device_names.get(device)
        if name is None:
            name = self._device_names[device] = self._device_alias.get(_device_str(device), _device_str(device))
        rec = StorageRecord(
            sid=sid, nbytes=st.nbytes(), device=name, dtype=_dtype_name(t.dtype), shape=tuple(t.shape),
            category=category, module=self._module(), phase=self._phase(), op=op,
            created=len(self._events), preexisting=preexisting, node=_node_seq(),
        )
        self._records[sid] = rec
        self._live[key] = sid
        self._refs[sid] = weakref.ref(st, functools.partial(_storage_freed, self._self_ref, key, sid))
        self._candidate = None
        self._emit("alloc", rec, rec.nbytes, rec.nbytes)
        if self.cuda_addresses is not None and device.type == "cuda":
            self.cuda_addresses.append((st.data_ptr(), rec.nbytes))
        return rec

    def _accumulation_candidate(self, args, kwargs, out: torch.Tensor, rec: StorageRecord):
        """An ``add`` that may be autograd adding two contributions to one gradient, which it does
        out of place only because a dispatch mode is on.

        torch/csrc/autograd/input_buffer.cpp, ``accumulate``: with grad mode off, ``old_var.add_(var)``
        when ``can_accumulate_inplace(old_var)`` (dense, the buffer holds its last reference and its
        storage's) and ``var`` is not subclass-like, else ``old_var + var``; and
        aten/src/ATen/TensorSubclassLikeUtils.h, ``isTensorSubclassLike``: true whenever
        ``c10::impl::dispatch_mode_enabled()``. So under the tracker the buffer's add allocates a
        new gradient and then drops the old one, where untracked code reuses it.

        Candidate: in backward with grad mode off, ``add.Tensor(old, new)`` with alpha 1, the result
        of ``old``'s shape, dtype and strides, ``old`` dense and made by an earlier autograd node
        than the one running (the buffer's entries come from nodes that already ran: an add inside a
        backward formula works on the node's own temporaries). ``_free`` completes it when ``old``'s
        storage is freed right after, before any other op (the buffer held its last reference)."""
        node = torch._C._current_autograd_node()
        if node is None or torch.is_grad_enabled() or len(args) != 2 or (kwargs or {}).get("alpha", 1) != 1:
            return None
        old, new = args
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)) \
                or is_traceable_wrapper_subclass(old) or is_traceable_wrapper_subclass(new) \
                or old.is_sparse or new.is_sparse or old.shape != out.shape or old.dtype != out.dtype \
                or old.stride() != out.stride() or not (old.is_contiguous() or _dense(old)):
            return None
        old_sid = self._live.get(id(self._storage(old)))
        if old_sid is None or self._records[old_sid].node == node._sequence_nr():
            return None
        return (id(self._storage(out)), rec.sid, old_sid)

    def _accumulated_in_place(self, old_sid: int) -> bool:
        """``old``'s storage was freed right after the candidate add: count the add's result as
        ``old``'s storage, as ``old.add_(new)`` keeps it (the result's alloc event is dropped, and
        ``old``'s record lives on with the result's storage)."""
        key, sid, cand_old = self._candidate
        self._candidate = None
        if cand_old != old_sid or not self._events or self._events[-1].sid != sid \
                or self._events[-1].kind != "alloc" or sid != self._next_sid - 1:
            return False
        ref = self._refs.pop(sid)
        storage = ref()
        if storage is None:
            return False
        self._events.pop()
        del self._records[sid]
        self._next_sid -= 1
        self._live[key] = old_sid
        self._refs[old_sid] = weakref.ref(storage, functools.partial(_storage_freed, self._self_ref, key, old_sid))
        self.inplace_accumulations += 1
        return True

    def _free(self, key: int, sid: int) -> None:
        if self._candidate is not None:
            if self._candidate[2] == sid and self._accumulated_in_place(sid):
                if self._live.get(key) == sid:   # the old storage's key, unless the result took it
                    del self._live[key]
                return
            self._candidate = None
        if self._live.get(key) == sid:
            del self._live[key]
        rec = self._records.get(sid)
        if rec is None or rec.freed is not None:
            return
        rec.freed = len(self._events)
        self._emit("free", rec, rec.nbytes, -rec.nbytes)
        self._refs.pop(sid, None)

    def _emit(self, kind: str, rec: StorageRecord, nbytes: int, delta: int) -> None:
        phase = rec.phase if kind == "alloc" else self._phase_safe()
        module = rec.module if kind == "alloc" else self._module()
        self._events.append(Event(len(self._events), kind, rec.sid, nbytes, delta, rec.device,
                                  phase, module, time.perf_counter() - self._t0))

    def current_phase(self) -> str:
        """The phase the op now running belongs to (setup, forward, backward, optimizer, ...): what a
        second dispatch mode over the same run reads (``predict.timing.OpTimer``)."""
        return self._phase_safe()

    def _phase_safe(self) -> str:
        # Free callbacks can run on autograd's worker threads; reading the phase is cheap
        # and side-effect free apart from noticing that backward has started.
        try:
            return self._phase()
        except Exception:  # pragma: no cover - defensive: never break a free callback
            return self._auto_phase

    def _resized(self, storage) -> None:
        """A storage we track changed size in place (``UntypedStorage.resize_``: FSDP frees
        and re-allocates its gathered parameters this way)."""
        sid = self._live.get(id(storage))
        if sid is None:
            return
        rec = self._records[sid]
        n = storage.nbytes()
        if n != rec.nbytes:
            self._emit("resize", rec, n, n - rec.nbytes)
            rec.nbytes = n

    @staticmethod
    def _upgrade(rec: StorageRecord, category: Category) -> None:
        if _RANK[category] < _RANK[rec.category]:
            rec.category = category

    # ---- labels --------------------------------------------------------------------------
    def label(self, tensor: torch.Tensor, category: Category | str) -> torch.Tensor:
        """Give ``tensor``'s storage a category (``Category.INPUTS`` for a batch). Returns
        the tensor, so ``x = tracker.label(torch.randn(...), "inputs")`` reads naturally."""
        cat = Category(category)
        self._see(tensor, op="existing", category=cat, preexisting=True)
        return tensor

    def register(self, model: torch.nn.Module | None = None, optimizer=None,
                 inputs: Iterable[torch.Tensor] = ()) -> None:
        """Label what already exists: a model's parameters and buffers, an optimizer's
        state, input tensors. Storages created before the tracker started appear as
        allocations at this moment, marked ``preexisting``."""
        if model is not None:
            self._register_module(model)
        if optimizer is not None:
            self._label_optimizer(optimizer)
        for t in inputs:
            self.label(t, Category.INPUTS)

    def _register_module(self, root: torch.nn.Module, parent: str | None = None) -> None:
        """Name ``root`` and its submodules, and label its tensors. A module first seen while
        ``parent`` runs is named under it: a module that is no registered child of its caller (
        transformers 5.25 wraps ``apply_rotary_pos_emb`` in one, ``hub_kernels.use_kernelized_func``)
        keeps what it makes inside the layer that called it."""
        prefix = f"{parent}.{type(root).__name__}" if parent else type(root).__name__
        for name, m in root.named_modules():
            if m not in self._module_names:
                self._module_names[m] = f"{prefix}.{name}" if name else prefix
        for p in root.parameters():
            self._see(p, op="existing", category=Category.PARAMETERS, preexisting=True)
            self._hook_grad(p)
            if p.grad is not None:
                self._see(p.grad, op="existing", category=Category.GRADIENTS, preexisting=True)
        for b in root.buffers():
            self._see(b, op="existing", category=Category.BUFFERS, preexisting=True)

    def _hook_grad(self, p: torch.Tensor) -> None:
        if not p.requires_grad or p in self._hooked_params:
            return
        tracker_ref = weakref.ref(self)

        def on_grad(param: torch.Tensor) -> None:
            tracker = tracker_ref()
            if tracker is not None and param.grad is not None:
                tracker._see(param.grad, op="accumulate_grad", category=Category.GRADIENTS)

        self._hooked_params[p] = p.register_post_accumulate_grad_hook(on_grad)

    def _label_optimizer(self, optimizer) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                self._see(p, op="existing", category=Category.PARAMETERS, preexisting=True)
                self._hook_grad(p)
                if p.grad is not None:
                    self._see(p.grad, op="existing", category=Category.GRADIENTS, preexisting=True)
        for state in optimizer.state.values():
            for key, v in state.items():
                if isinstance(v, torch.Tensor):
                    rec = self._see(v, op="existing", category=Category.OPTIMIZER_STATE, preexisting=True)
                    if rec is not None and not rec.state_key:
                        rec.state_key = str(key)
        for v in getattr(optimizer, "paged_tensors", ()):   # a paged optimizer's unified-memory buffers
            rec = self._see(v, op="existing", category=Category.OPTIMIZER_STATE, preexisting=True)
            if rec is not None:
                rec.apart = UNIFIED_DEVICE

    # ---- hooks ------------------------------------------------------------------------------
    def _on_forward_pre(self, module, args):
        if module not in self._module_names:   # a module we have not seen: label its tensors
            self._register_module(module, self._module_stack[-1] if self._module_stack else None)
        if not self._phase_override and not self._in_optimizer:
            self._auto_phase = "forward"
        self._module_stack.append(self._module_names.get(module, type(module).__name__))

    def _on_forward_post(self, module, args, output):
        if self._module_stack:
            name = self._module_stack.pop()
            if torch.is_grad_enabled():
                self._map_backward_nodes(output, name)

    def _on_step_pre(self, optimizer, args, kwargs):
        self._in_optimizer += 1
        self._label_optimizer(optimizer)

    def _on_step_post(self, optimizer, args, kwargs):
        self._label_optimizer(optimizer)
        self._in_optimizer = max(0, self._in_optimizer - 1)
        if not self._in_optimizer:
            self._auto_phase = "optimizer"  # frees right after step() (zero_grad) belong here

    def _pack(self, t: torch.Tensor):
        self._see(t, op="saved", category=Category.ACTIVATIONS)
        if self._offload is not None:
            return self._offloaded(t)
        # Keep a detached alias (same storage, so no extra memory), not ``t`` itself, where ``t``
        # could lead back to the node saving it: when an op saves its own output (ReLU, softmax),
        # ``t.grad_fn`` is that node, and holding ``t`` would make a reference cycle that keeps a
        # graph which never runs backward alive until the garbage collector finds it. Elsewhere
        # ``t`` is kept as it is, since ``detach`` is an op, through every dispatch mode (on fake
        # tensors a fake op: thousands a training step). Kept: a tensor without a grad_fn (a
        # weight, running statistics, an input), and one whose node is older than the newest
        # node made on this thread (autograd makes the saving node before it saves anything, so
        # the newest node is that one or newer; an op's inputs are saved so, and an older node
        # cannot lead back to a newer one). A custom autograd Function's node is made before its
        # forward runs, which may make nodes of its own, so tensors with such a node as grad_fn
        # (its outputs) always get the alias.
        grad_fn = t.grad_fn
        if grad_fn is None or (grad_fn._sequence_nr() < torch._C._autograd._get_sequence_nr() - 1
                               and not isinstance(grad_fn, BackwardCFunction)):
            return t, t._version
        # Autograd skips its in-place version check for tensors that go through
        # saved_tensors_hooks, so we record the version here and check it in _unpack: code
        # that breaks autograd outside the tracker breaks it inside the tracker too.
        return t.detach(), t._version

    def _offloaded(self, t: torch.Tensor):
        """``torch.autograd.graph.save_on_cpu(pin_memory=True)``'s pack: a contiguous host copy
        of the saved tensor (its elements, not its whole storage; pinned when a GPU is there),
        which autograd keeps instead of the tensor. Recorded as an offloaded activation."""
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, device="cpu",
                           pin_memory=t.device.type == "cuda")
        host.copy_(t, non_blocking=t.device.type == "cuda")
        rec = self._see(host, op="offload", category=Category.ACTIVATIONS)
        if rec is not None:
            rec.apart = HOST_DEVICE
        return _Offloaded(t.device, host, self._offload == "copy back")

    @staticmethod
    def _unpack(packed) -> torch.Tensor:
        if isinstance(packed, _Offloaded):   # save_on_cpu's unpack: back to the device for backward
            if packed.device.type == "cpu" and packed.copy_back:   # CPU fake tensors standing in for a GPU's
                return packed.host.clone()
            return packed.host.to(packed.device, non_blocking=packed.device.type == "cuda")
        alias, version = packed
        if alias._version != version:  # the alias shares the original's version counter
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{alias.dtype} {list(alias.shape)}] is at version {alias._version}; "
                f"expected version {version} instead. (Reported by gpulab's tracker, which checks "
                "saved tensors exactly as autograd does.)")
        return alias

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing inside is recorded, and nothing of the tracker is there to be traced: its dispatch
        mode, its saved-tensor hooks and its global module hooks are off (a compiler's warm-up:
        dynamo would trace the hooks). The tracker must be the innermost dispatch mode and its hooks
        the innermost saved-tensor hooks."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily
        if _get_current_dispatch_mode() is not self:
            raise RuntimeError("MemoryTracker.paused() needs the tracker to be the innermost dispatch mode")
        with self.without_module_hooks():
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self._paused = True
            try:
                with _pop_mode_temporarily():
                    yield
            finally:
                self._paused = False
                torch._C._autograd._push_saved_tensors_default_hooks(self._pack, self._unpack)

    @contextlib.contextmanager
    def without_module_hooks(self) -> Iterator[None]:
        """The tracker's global module hooks off for the code inside (a compiled model: dynamo would
        trace them into its graphs); storages made inside are attributed to no module."""
        from torch.nn.modules import module as nn_module
        module_hooks, self._handles = self._handles[:2], self._handles[2:]
        for h in module_hooks:
            h.remove()
        try:
            yield
        finally:
            self._handles = [nn_module.register_module_forward_pre_hook(self._on_forward_pre),
                             nn_module.register_module_forward_hook(self._on_forward_post, always_call=True),
                             *self._handles]

    @contextlib.contextmanager
    def offloading(self, copy_back: bool) -> Iterator[None]:
        """Activation offloading for the code inside, as ``save_on_cpu(pin_memory=True)`` does it:
        every tensor autograd saves is copied to host memory (records ``apart=HOST_DEVICE``) and
        copied back for backward. ``copy_back``: make that copy even though the "device" is the
        CPU (the fake engine's CUDA target, whose CPU tensors stand in for the GPU's)."""
        before = self._offload
        self._offload = "copy back" if copy_back else "alias back"
        try:
            yield
        finally:
            self._offload = before

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Name the phase explicitly for the code inside (overrides auto-detection)."""
        self._phase_override.append(name)
        try:
            yield
        finally:
            self._phase_override.pop()
            if name in PHASES:
                self._auto_phase = name

    # ---- results ----------------------------------------------------------------------------
    def live_by_category(self, device: str) -> dict[str, int]:
        """``result(device=device).final_by_category`` without building the result: the bytes alive now on
        ``device`` per category (512-byte blocks on a CUDA device), in one pass over the events and no copy
        of the records. A forward's per-layer hooks ask it after every layer (``record.runs.activations``)."""
        return live_by_category(self._records, self._events, device)

    def result(self, device: str | None = None, round_to_cuda_blocks: bool | None = None,
               on_host=None) -> "TrackingResult":
        """A snapshot of what has been recorded so far (the tracker may still be running).

        ``device``: keep only storages on this device ("cpu", "cuda:0", "meta" for fake
        tensors created on meta). By default the device holding the most bytes at its peak.
        ``round_to_cuda_blocks``: count each storage as the 512-byte multiple the CUDA
        caching allocator gives it (default: True for CUDA devices).
        ``on_host``: a predicate on records; those it picks are counted on "cpu" (what a GPU
        run keeps in host memory, when CPU fake tensors stand in for the GPU's)."""
        records = {sid: _copy_record(r) for sid, r in self._records.items()}
        events = list(self._events)
        host = apart_devices(records)
        if on_host is not None:  # ``on_host(record)``: count this storage on the "cpu" instead
            host.update({sid: "cpu" for sid, r in records.items() if on_host(r) and sid not in host})
        if host:   # offloaded activations, paged state: on devices of their own, apart from the GPU's
            for sid, name in host.items():
                records[sid].device = name
            events = [replace(e, device=host[e.sid]) if e.sid in host else e for e in events]
        return TrackingResult.build(records, events, device=device, rounded=round_to_cuda_blocks)


@contextlib.contextmanager
def _storage_resizes_seen_by(tracker: MemoryTracker) -> Iterator[None]:
    """``UntypedStorage.resize_`` does not pass through the dispatcher, so no dispatch mode sees
    it (PyTorch's own MemTracker patches it for the same reason, torch/distributed/_tools/
    mem_tracker.py). Wrap it while ``tracker`` runs; nested trackers wrap and unwrap in turn."""
    original = torch.UntypedStorage.resize_
    tracker_ref = weakref.ref(tracker)

    def resize_(storage, size):
        out = original(storage, size)
        t = tracker_ref()
        if t is not None:
            t._resized(storage)
        return out

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original


def _storage_freed(tracker_ref: "weakref.ref[MemoryTracker]", key: int, sid: int, _ref) -> None:
    """A tracked storage's weak reference died: record the free (if the tracker still exists)."""
    tracker = tracker_ref()
    if tracker is not None:
        tracker._free(key, sid)


_ADD = torch.ops.aten.add.Tensor
_PRIM_DEVICE = torch.ops.prim.device.default


def _node_seq() -> int:
    """The sequence number of the autograd node running now (-1 outside backward)."""
    node = torch._C._current_autograd_node()
    return -1 if node is None else node._sequence_nr()


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense, as ``can_accumulate_inplace`` asks: some order of the dims is
    contiguous (c10's ``compute_non_overlapping_and_dense``)."""
    expected = 1
    for size, stride in sorted(((n, s) for n, s in zip(t.shape, t.stride()) if n != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


_OP_NAMES: dict[Any, str] = {}


def _op_name(func) -> str:
    """The name a storage's record gives the op that created it (``func.overloadpacket``'s)."""
    name = _OP_NAMES.get(func)
    if name is None:
        name = _OP_NAMES[func] = str(func.overloadpacket.__name__)
    return name


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


@dataclass(frozen=True)
class _Offloaded:
    """What autograd keeps for a saved tensor under activation offloading."""
    device: torch.device
    host: torch.Tensor
    copy_back: bool


def _copy_record(r: StorageRecord) -> StorageRecord:
    return StorageRecord(**{f: getattr(r, f) for f in r.__dataclass_fields__})
