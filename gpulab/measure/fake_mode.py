"""Shape-only ops answered faster than torch's Python paths, with torch's own answers.

The fake engine and the size checks run whole training steps on tensors without data: fake
tensors (``FakeTensorMode``) and meta tensors. torch answers each op there in Python, which for
a large model's step costs seconds. This module holds the two shortcuts gpulab uses, each
checked against torch's own answer over grids of cases in ``tests/test_fake_mode.py``:

* ``FakeMode``: FakeTensorMode answering the most frequent plain ops directly and reading its
  own cache by a cheaper key (the fake engine's mode);
* ``shape_kernels()`` (``gpulab.measure.shape_kernels``): for forwards on meta tensors, batch norm answered directly and ops that
  only make new tensors answered again from the same op on the same shapes.

They use private parts of ``torch._subclasses.fake_tensor`` (written against torch 2.15). Where
this torch lacks them or they have another shape (``SHORTCUTS`` is False), ``FakeMode`` is
FakeTensorMode with none of them: the same numbers, at torch's speed (its fresh outputs are kept
out of the converter's memo, as the shortcuts' are, so ``Module.to`` works: ``_PlainFakeMode``).
"""
from __future__ import annotations

import logging
import types

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConverter, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from gpulab.measure.fake_internals import (SingletonConstant, _BypassDispatchCache, _DISPATCH_HANDLE_DIRECTLY, _DISPATCH_META_HANDLERS, _DispatchCacheKey, _DispatchCacheValidEntry, _pin_device_index, get_proxy_mode, in_kernel_invocation_manager)
from gpulab.measure.fake_internals import SHORTCUTS
from gpulab.measure.fake_kernels import FAKE_KERNELS
from gpulab.measure.grouped_mm_shapes import OLD_META, grouped_mm_output

__all__ = ["FakeMode", "SHORTCUTS", "quiet_fake_log", "scalars_read_as_one"]

_FAKE_LOG = logging.getLogger("torch._subclasses.fake_tensor")


class quiet_fake_log:
    """Silence FakeTensorMode's own log of an op that raises while this is entered: torch logs the
    whole traceback (``log.exception(\"failed while attempting to run meta ...\")``) and then
    raises the error, which gpulab reports in one line; under a notebook cell the log is noise."""

    def __enter__(self):
        self._was = _FAKE_LOG.disabled
        _FAKE_LOG.disabled = True
        return self

    def __exit__(self, *exc):
        _FAKE_LOG.disabled = self._was
        return False




class _NotPlain(Exception):
    """An argument the fast cache key leaves to FakeTensorMode's own (symbolic, sparse, ...)."""


_KEY_TAG = object()   # marks FakeMode's cache keys: they never equal FakeTensorMode's own
_KEY_SCALARS = (int, float, bool, str, complex, type(None), torch.dtype, torch.layout, torch.memory_format)


class _QuietMode:
    """A fake mode whose FakeTensorMode log of an op that raises is silenced while it is entered
    (``quiet_fake_log``): mixed in before FakeTensorMode."""

    def __enter__(self):
        self._quiet = quiet_fake_log().__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._quiet.__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._quiet.__exit__(None, None, None)


class FakeMode(_QuietMode, FakeTensorMode):
    """The fake engine's mode: FakeTensorMode, answering a few ops directly (see above), with a
    cheaper cache key and a shorter way to a cached answer. Static shapes only: with a ShapeEnv
    (symbolic shapes) it is FakeTensorMode unchanged. While it is entered, FakeTensorMode's log
    of an op that raises is silenced (``quiet_fake_log``)."""

    def dispatch(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if OLD_META and (out := _lagging_meta(self, func, args, kwargs)) is not NotImplemented:
            return out
        if self.shape_env is None:
            kernel = FAKE_KERNELS.get(func)
            if kernel is not None:
                out = kernel(self, *args, **kwargs)
                if out is not NotImplemented:
                    return out
            handler = _DISPATCH_META_HANDLERS.get(func)   # .device, .size() ...: FakeTensorMode's first step
            if handler is not None:
                return handler(args)
            if self.cache_enabled and not self.cache_crosscheck_enabled and func not in _DISPATCH_HANDLE_DIRECTLY:
                out = self._cached(func, args, kwargs)
                if out is not NotImplemented:
                    return out
        return super().dispatch(func, types, args, kwargs)

    # FakeTensorMode's cache key (``_cache_key``) describes each fake tensor argument by a
    # ``TensorMetadata`` dataclass flattened field by field, ~30-60 us a tensor and the larger
    # part of a cache hit. For static shapes the same facts fit in one tuple read straight off
    # the tensor: dtype, shape, stride, device, storage offset and size, requires_grad and the
    # conj / neg / inference bits (its memory format follows from shape and stride; sparse and
    # mkldnn tensors, and symbolic sizes, get FakeTensorMode's key). Everything else follows
    # ``_prep_args_for_hash``: the same arguments are refused with the same reasons (a tensor
    # that is not this mode's fake, a fake holding a constant, a function), so the same calls
    # are cached. The keys are tagged, so they never meet FakeTensorMode's own in its cache.
    def _cache_key(self, state, func, args, kwargs):
        if self.shape_env is not None:
            return super()._cache_key(state, func, args, kwargs)
        try:
            return self._fast_key(func, args, kwargs)
        except _NotPlain:
            return super()._cache_key(state, func, args, kwargs)

    def _fast_key(self, func, args, kwargs) -> _DispatchCacheKey:
        key = [_KEY_TAG, func, torch.get_default_dtype(), torch._C._get_default_device(),
               torch.is_inference_mode_enabled(), get_proxy_mode() is not None]
        if args:
            self._key_of(key, args)
        if kwargs:
            self._key_of(key, kwargs)
        return _DispatchCacheKey(tuple(key))

    def _key_of(self, key: list, args) -> None:
        key.append(type(args))
        key.append(len(args))
        if isinstance(args, dict):
            self._key_of(key, tuple(args.keys()))
            self._key_of(key, tuple(args.values()))
            return
        for a in args:
            if isinstance(a, FakeTensor):
                if a.fake_mode is not self:
                    raise _BypassDispatchCache("not our fake")
                if a.constant is not None:
                    raise _BypassDispatchCache("constant attribute")
                if a._has_symbolic_sizes_strides or a.layout != torch.strided:
                    raise _NotPlain
                key.append((a.dtype, tuple(a.shape), a.stride(), a.fake_device, a.storage_offset(),
                            a.untyped_storage().nbytes(), a.requires_grad, a.is_conj(), a.is_neg(),
                            a.is_inference(), a.is_quantized))
            elif isinstance(a, torch.Tensor):
                raise _BypassDispatchCache("non-fake tensor")
            elif isinstance(a, (list, tuple, dict)):
                self._key_of(key, a)
            elif type(a) in _KEY_SCALARS:
                key.append(type(a))
                key.append(a)
            elif isinstance(a, torch.device):
                key.append(torch.device)
                key.append(_pin_device_index(a))
            elif isinstance(a, types.FunctionType):
                raise _BypassDispatchCache("function argument")
            else:   # SymInt, graph modules, script objects, ...: FakeTensorMode's key knows them
                raise _NotPlain

    # A cache hit through FakeTensorMode passes ``dispatch``'s checks, ``_cached_dispatch_impl``,
    # ``_output_from_cache_entry`` and ``_get_output_tensor_from_cache_entry``, with a few context
    # managers on the way: ~80-110 us, of which making the output (an empty meta tensor, wrapped)
    # is ~25. ``_cached`` looks the key up and makes the outputs from the entry as those functions
    # do (the argument an in-place op returns, a new tensor of the recorded metadata, or a view of
    # the recorded argument's storage); a miss, a refused call or an entry it does not know how
    # to read goes the long way (which then finds, counts and stores it as FakeTensorMode would).
    def _cached(self, func, args, kwargs):
        try:
            key = self._fast_key(func, args, kwargs)
        except (_BypassDispatchCache, _NotPlain):
            return NotImplemented
        entry = FakeTensorMode.cache.get(key)
        if type(entry) is not _DispatchCacheValidEntry:
            return NotImplemented
        outs = []
        for info in entry.output_infos:
            out = self._output_of(info, args)
            if out is NotImplemented:
                return NotImplemented
            outs.append(out)
        FakeTensorMode.cache_hits += 1
        return tuple(outs) if entry.is_output_tuple else outs[0]

    def _output_of(self, info, args):
        if info.inplace_idx is None and info.metadata is None and info.view_idx is None:
            return NotImplemented if info.constant_value is SingletonConstant else info.constant_value
        if info.inplace_idx is not None:
            arg = args[info.inplace_idx]
            return arg if isinstance(arg, FakeTensor) else NotImplemented
        m = info.metadata
        if m.layout != torch.strided or not all(type(v) is int for v in (*m.shape, *m.stride, m.storage_offset)):
            return NotImplemented
        view = info.view_idx is not None
        if view and not isinstance(args[info.view_idx], FakeTensor):
            return NotImplemented
        with in_kernel_invocation_manager(self):
            empty = torch.empty_strided(() if view else m.shape, () if view else m.stride, dtype=m.dtype,
                                        layout=m.layout, device="meta", requires_grad=m.requires_grad)
            if m.is_conj:
                torch._C._set_conj(empty, True)
            if m.is_neg:
                torch._C._set_neg(empty, True)
            if view:
                empty.set_(args[info.view_idx].untyped_storage(), m.storage_offset, m.shape, m.stride)
        return FakeTensor(self, empty, m.device)


def _lagging_meta(mode, func, args, kwargs):
    """An op whose meta kernel in this torch refuses what its kernels run (``grouped_mm_shapes``:
    ``_grouped_mm`` in float32 on torch 2.11), answered as a newer torch's meta kernel does, as a
    fake tensor on the first argument's device; else NotImplemented."""
    first = args[0] if args else None
    if not (isinstance(first, FakeTensor) and first.fake_mode is mode):
        return NotImplemented
    out = grouped_mm_output(func, args, kwargs)
    return out if out is NotImplemented else FakeTensor(mode, out, first.fake_device)


class _FreshOutputs(FakeTensorConverter):
    """FakeTensorConverter whose fake tensors made around a kernel's fresh meta outputs are not
    kept in its memo. torch keeps each one there (``from_meta_and_device``: ``set_tensor_memo``, a
    weak reference), and ``Module._apply`` always swaps a fake parameter (``swap_tensors``, which
    refuses a tensor with a weak reference): so under FakeTensorMode itself a module built in the
    mode cannot be moved with ``.to(device)`` ("Couldn't swap Conv2d.weight"). A fresh meta output
    is never looked up again, so the memo held nothing the run reads."""

    def from_meta_and_device(self, fake_mode, t, device, pytype=None, dispatch_keys=None):
        memo = self._get_memo(t)
        if memo is not None:
            return memo
        return FakeTensor(fake_mode, t, device, pytype=pytype, dispatch_keys=dispatch_keys)


class _PlainFakeMode(_QuietMode, FakeTensorMode):
    """The fake engine's mode on a torch whose FakeTensorMode has other insides than the shortcuts
    read: FakeTensorMode's own answers (no shortcut), its log of a raising op silenced while
    entered, and fresh outputs kept out of the converter's memo (``_FreshOutputs``) so that
    ``Module.to`` works on a model built in the mode."""

    def dispatch(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if OLD_META and (out := _lagging_meta(self, func, args, kwargs)) is not NotImplemented:
            return out
        return super().dispatch(func, types, args, kwargs)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        converter = self.fake_tensor_converter
        if type(converter) is FakeTensorConverter and callable(getattr(converter, "_get_memo", None)):
            converter.__class__ = _FreshOutputs


if not SHORTCUTS:   # this torch's FakeTensorMode has another inside: use its answers as they are
    FakeMode = _PlainFakeMode  # noqa: F811




class scalars_read_as_one(TorchDispatchMode):
    """Inside: a fake tensor's value read on the host (``.item()``, ``float(t)``:
    ``aten._local_scalar_dense``) answers 1 instead of failing. Only for code whose reads steer
    arithmetic, never allocation: an optimizer's step (Adafactor reads the step count and
    parameter norms to scale its update). Anything else that reads values still fails on fake
    tensors, as it must: its allocations may depend on them."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            return True if t.dtype == torch.bool else 1 if not (t.is_floating_point() or t.is_complex()) else 1.0
        return func(*args, **(kwargs or {}))
