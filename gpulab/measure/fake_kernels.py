"""The fake engine's direct answers: the most frequent plain ops on fake tensors (batch norm,
elementwise arithmetic and activations and their backward on one layout, views, new tensors like
another, the optimizers' foreach arithmetic, ``torch.tensor(x)``) answered as torch would, without
FakeTensorMode's Python path. ``FakeMode`` (``fake_mode``) looks each op up in ``FAKE_KERNELS``;
``tests/test_fake_mode.py`` compares every answer with torch's own over grids of cases."""
from __future__ import annotations


import torch
from torch._prims_common import (make_channels_last_2d_strides_for, make_channels_last_3d_strides_for,
                                 make_contiguous_strides_for)
from torch._subclasses.fake_tensor import FakeTensor

from gpulab.measure.fake_internals import (compute_elementwise_output_logical_to_physical_perm, in_kernel_invocation_manager, no_dispatch, reshape_view_helper)

__all__ = ["FAKE_KERNELS"]

# ---- fake tensors: the fake engine's mode -------------------------------------------------------
# torch's FakeTensorMode answers every op in Python. It caches an answer by the op and its
# arguments' metadata, but the first time it meets a shape it works the answer out, which
# costs about a millisecond, and far more for an op it runs as its Python decomposition: batch
# norm is about 30 ops, each through the fake mode (~15-25 ms per new shape, forward and
# backward alike). A model whose layers all differ in width (DenseNet) pays that for every
# layer, and ``slice`` (its decomposition into ``as_strided``) for every concatenation's
# gradient. Even a cached answer costs ~100-200 us, mostly building the cache key, which
# matters for ops asked thousands of times a step: ``detach`` (autograd detaches every saved
# tensor it unpacks), views, elementwise ops, and the optimizer's ``_foreach_*`` ops (one call
# per step, but run tensor by tensor through the fake mode).
# ``FakeMode`` is FakeTensorMode answering the most frequent of these directly where the answer
# is plain (batch norm, elementwise arithmetic and activations and their backward on one layout,
# views, new tensors like another, the optimizers' foreach arithmetic, ``torch.tensor(x)``):
# a new tensor or a view with the same shape, strides, offset, dtype, device and storage as
# torch's own answer (tests/test_fake_mode.py compares the two over grids of shapes, layouts,
# dtypes and flags), and taking a shorter way to everything else it has cached. Anything else,
# and anything that would raise, goes to FakeTensorMode as before.

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_aten = torch.ops.aten


def _plain_fake(mode, t) -> bool:
    """A strided fake CPU tensor of this mode, with no constant, conjugate or negative bit."""
    return (isinstance(t, FakeTensor) and t.fake_mode is mode and t.constant is None
            and t.layout == torch.strided and t.fake_device.type == "cpu" and not t.is_conj()
            and not t.is_neg() and not t.is_inference())


def _one_layout(t: torch.Tensor) -> bool:
    """Contiguous or channels-last (2-d / 3-d images) with exactly the strides a new tensor of
    that layout gets (a size-1 dimension's stride can be anything in a view, and then torch's
    kernels may answer with other strides): the layouts batch norm keeps as they are."""
    stride = t.stride()
    if stride == make_contiguous_strides_for(t.shape):
        return True
    if t.dim() == 4:
        return stride == make_channels_last_2d_strides_for(t.shape)
    return t.dim() == 5 and stride == make_channels_last_3d_strides_for(t.shape)


def _unambiguous_layout(operands, shape):
    """The strides ``compute_elementwise_output_logical_to_physical_perm`` gives an output of
    ``shape`` without looking further, or None. It first asks whether every operand is
    contiguous, or every one channels-last (4-d); when exactly one of the two holds it answers
    that layout. Here only for operands that all have one stride (the function itself is ~40 us
    of Python, for every elementwise op)."""
    first = operands[0]
    if first.dim() < 2 or any(o.stride() != first.stride() for o in operands[1:]):
        return None
    contiguous = first.is_contiguous()
    channels_last = first.dim() == 4 and first.is_contiguous(memory_format=torch.channels_last)
    if contiguous == channels_last:
        return None
    return (make_contiguous_strides_for if contiguous else make_channels_last_2d_strides_for)(shape)


def _elementwise_fake(mode, like: FakeTensor, *operands) -> FakeTensor:
    """A new tensor of ``like``'s shape and dtype, laid out as an elementwise op of ``operands``
    lays out its output (``compute_elementwise_output_logical_to_physical_perm``, run, as the
    op's meta kernel runs it, inside the fake mode's kernel invocation)."""
    stride = _unambiguous_layout(operands, like.shape)
    if stride is not None:
        return _new_fake(mode, like.fake_device, like.shape, stride, like.dtype)
    with in_kernel_invocation_manager(mode):
        perm, _ = compute_elementwise_output_logical_to_physical_perm(*operands)
        elem = torch.empty_permuted(like.shape, perm, dtype=like.dtype, device="meta")
    return FakeTensor(mode, elem, like.fake_device)


def _new_fake(mode, device: torch.device, shape, stride, dtype: torch.dtype) -> FakeTensor:
    """A fresh fake tensor (its own storage), made as FakeTensorMode makes one from its cache
    (``_get_output_tensor_from_cache_entry``): an empty meta tensor, wrapped."""
    with in_kernel_invocation_manager(mode):
        elem = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return FakeTensor(mode, elem, device)


def _fake_view(mode, base: FakeTensor, shape, stride, offset: int) -> FakeTensor:
    """A view of ``base``'s storage, made as FakeTensorMode makes a cached view (``set_`` of an
    empty meta tensor onto the storage)."""
    with in_kernel_invocation_manager(mode):
        elem = torch.empty_strided((), (), dtype=base.dtype, device="meta")
        elem.set_(base.untyped_storage(), offset, shape, stride)
    return FakeTensor(mode, elem, base.fake_device)


def _per_channel(mode, t, channels: int) -> bool:
    return t is None or (_plain_fake(mode, t) and t.dim() == 1 and t.shape[0] == channels and t.dtype in _FLOATS)


def _batch_norm_input(mode, input) -> bool:
    return _plain_fake(mode, input) and _batch_norm_layout(input)


def _batch_norm_layout(input) -> bool:
    """A floating input, at least 2-d and not empty, of one layout (kept by batch norm)."""
    return input.dtype in _FLOATS and input.dim() >= 2 and input.numel() > 0 and _one_layout(input)


def _batch_norm_statistics_ok(input, running_mean, running_var, training: bool) -> bool:
    """Statistics the decomposition computes without raising: in training a channel needs
    values (and two or more to update a running variance: it divides by n - 1); in eval the
    running statistics are what it uses."""
    if training:
        n = input.numel() // input.shape[1]
        return n > 0 and (running_var is None or n > 1)
    return running_mean is not None and running_var is not None


def _fake_native_batch_norm(mode, input, weight, bias, running_mean, running_var, training, momentum, eps):
    """``native_batch_norm`` as its decomposition computes it on fake CPU tensors
    (torch/_decomp/decompositions.py ``native_batch_norm_helper``): the output in the input's
    dtype and layout; the saved mean and inverse std per channel in the input's dtype (its
    ``input.device.type == "cpu"`` branch), or empty (0,) in eval; the running statistics
    updated in place (no new storage, so nothing to make)."""
    if not _batch_norm_input(mode, input):
        return NotImplemented
    c = input.shape[1]
    if not (all(_per_channel(mode, t, c) for t in (weight, bias, running_mean, running_var))
            and _batch_norm_statistics_ok(input, running_mean, running_var, training)):
        return NotImplemented
    device, stat = input.fake_device, ((c,) if training else (0,))
    return (_new_fake(mode, device, input.shape, input.stride(), input.dtype),
            _new_fake(mode, device, stat, (1,), input.dtype), _new_fake(mode, device, stat, (1,), input.dtype))


def _fake_native_batch_norm_backward(mode, grad_out, input, weight, running_mean, running_var, save_mean,
                                     save_invstd, train, eps, output_mask):
    """``native_batch_norm_backward`` as its decomposition computes it: the input's gradient in
    the input's dtype and layout (answered only when the incoming gradient has the very same
    strides), the weight's and bias's (as the mask asks) per channel in the weight's dtype."""
    if not (_batch_norm_input(mode, input) and _plain_fake(mode, grad_out) and grad_out.dtype in _FLOATS
            and grad_out.shape == input.shape and grad_out.stride() == input.stride() and len(output_mask) == 3):
        return NotImplemented
    c = input.shape[1]
    if not all(_per_channel(mode, t, c) for t in (weight, running_mean, running_var, save_mean, save_invstd)):
        return NotImplemented
    if (train and (save_mean is None or save_invstd is None)) or \
            (not train and (running_mean is None or running_var is None)):
        return NotImplemented
    device, wdt = input.fake_device, (weight.dtype if weight is not None else input.dtype)
    return (_new_fake(mode, device, input.shape, input.stride(), input.dtype),
            _new_fake(mode, device, (c,), (1,), wdt) if output_mask[1] else None,
            _new_fake(mode, device, (c,), (1,), wdt) if output_mask[2] else None)


def _fake_slice(mode, self, dim=0, start=None, end=None, step=1):
    """``slice.Tensor``: the view its decomposition makes (``slice_forward``: start and end
    wrapped and clamped to the dimension, then ``as_strided``)."""
    if not (_plain_fake(mode, self) and self.dim() > 0 and type(dim) is int and type(step) is int and step > 0
            and (start is None or type(start) is int) and (end is None or type(end) is int)
            and -self.dim() <= dim < self.dim()):
        return NotImplemented
    dim %= self.dim()
    sizes, strides = list(self.shape), list(self.stride())
    lo = 0 if start is None else start
    hi = sizes[dim] if end is None else end
    lo += sizes[dim] if lo < 0 else 0
    hi += sizes[dim] if hi < 0 else 0
    lo = min(max(lo, 0), sizes[dim])
    hi = min(max(hi, lo), sizes[dim])
    offset = self.storage_offset() + lo * strides[dim]
    sizes[dim] = (hi - lo + step - 1) // step
    strides[dim] *= step
    return _fake_view(mode, self, sizes, strides, offset)


def _fake_detach(mode, self):
    """``detach``: a view of the whole tensor (same sizes, strides and offset)."""
    if not _plain_fake(mode, self):
        return NotImplemented
    return _fake_view(mode, self, self.shape, self.stride(), self.storage_offset())


def _foreach_lists_ok(mode, lists, numbers) -> bool:
    """Tensor lists of one length whose tensors at each position are plain fakes of one shape and
    one floating dtype (the first list's dense, so that no two of its elements share memory), and
    numbers that are Python numbers (or lists of them, one per tensor): where the optimizers'
    in-place ``_foreach_*`` arithmetic cannot fail."""
    if not isinstance(lists[0], (list, tuple)) or not lists[0]:   # an empty list raises
        return False
    n = len(lists[0])
    for lst in lists:
        if not isinstance(lst, (list, tuple)) or len(lst) != n:
            return False
    for i, t in enumerate(lists[0]):
        if not (_plain_fake(mode, t) and t.dtype in _FLOATS and _one_layout(t)):   # written to: no overlap
            return False
        for other in lists[1:]:
            o = other[i]
            if not (_plain_fake(mode, o) and o.dtype == t.dtype and o.shape == t.shape):
                return False
    for x in numbers:
        if isinstance(x, (list, tuple)):
            if len(x) != n or not all(type(v) in (int, float, bool) for v in x):
                return False
        elif type(x) not in (int, float, bool):
            return False
    return True


def _foreach_inplace(n_lists: int):
    """An in-place ``_foreach_*_`` op (returns nothing, allocates nothing: every tensor keeps its
    storage) taking ``n_lists`` tensor lists, then numbers."""
    def kernel(mode, *args, **kwargs):
        lists, numbers = args[:n_lists], [*args[n_lists:], *kwargs.values()]
        if len(args) < n_lists or not _foreach_lists_ok(mode, lists, numbers):
            return NotImplemented
        return None
    return kernel


def _fake_foreach_sqrt(mode, tensors):
    """``_foreach_sqrt``: a new tensor like each one (a float unary op keeps a dense layout)."""
    if not (isinstance(tensors, (list, tuple)) and _foreach_lists_ok(mode, [tensors], [])
            and all(t.numel() > 0 for t in tensors)):
        return NotImplemented
    return [_elementwise_fake(mode, t, t) for t in tensors]


def _same_float_operands(mode, a, b) -> bool:
    """Two plain fakes of one shape (at least 1-d, not empty) and one floating dtype."""
    return (_plain_fake(mode, a) and _plain_fake(mode, b) and a.dtype in _FLOATS and a.dtype == b.dtype
            and a.dim() > 0 and a.shape == b.shape and a.numel() > 0)


def _fake_binary(mode, a, b, **alpha):
    """``add`` / ``sub`` (without ``alpha``), ``mul``, ``div`` of two tensors of one shape and one
    floating dtype: what their meta kernel (torch/_refs ``add`` and the elementwise binary
    references, ``prims`` ``_prim_elementwise_meta``) makes: a tensor of that shape and dtype
    laid out by ``compute_elementwise_output_logical_to_physical_perm`` of the two (torch's own
    function, run as the kernel runs it)."""
    if alpha or not _same_float_operands(mode, a, b):   # with alpha, add computes b * alpha first
        return NotImplemented
    return _elementwise_fake(mode, a, a, b)


def _fake_binary_inplace(mode, self, other, alpha=1):
    """``add_`` / ``sub_`` / ``mul_`` / ``div_`` of a dense tensor by another of its shape and dtype
    (not sharing its storage) or by a number: the op returns ``self``."""
    if isinstance(other, torch.Tensor):
        if not (_same_float_operands(mode, self, other) and _one_layout(self)
                and other.untyped_storage()._cdata != self.untyped_storage()._cdata):
            return NotImplemented
    elif not (type(other) in (int, float) and _plain_fake(mode, self) and self.dtype in _FLOATS
              and self.numel() > 0 and _one_layout(self)):
        return NotImplemented
    return self if type(alpha) in (int, float) else NotImplemented


def _fake_unary_inplace(mode, self):
    """An activation in place (``relu_``, ``silu_`` ...) on a dense floating tensor: returns ``self``."""
    if not (_plain_fake(mode, self) and self.dtype in _FLOATS and self.numel() > 0 and _one_layout(self)):
        return NotImplemented
    return self


def _fake_threshold_backward(mode, grad_output, self, threshold):
    """``threshold_backward`` (ReLU's backward), as its decomposition computes it
    (``torch.where(self <= threshold, 0, grad_output)``): for a gradient and an input of one
    shape and floating dtypes, a tensor like the gradient laid out as ``where`` lays out the mask
    (laid out like ``self``) and the gradient."""
    if not (_same_float_operands(mode, grad_output, self) and type(threshold) in (int, float)):
        return NotImplemented
    stride = _unambiguous_layout((self, grad_output), grad_output.shape)
    if stride is not None:     # the mask is then laid out as both
        return _new_fake(mode, grad_output.fake_device, grad_output.shape, stride, grad_output.dtype)
    with in_kernel_invocation_manager(mode):
        perm, _ = compute_elementwise_output_logical_to_physical_perm(self)
        mask = torch.empty_permuted(self.shape, perm, dtype=torch.bool, device="meta")
    return _elementwise_fake(mode, grad_output, mask, grad_output)


def _fake_activation_backward(mode, grad_output, x, approximate=None):
    """The backward of an activation (``gelu``, ``silu``, ``sigmoid``, ``tanh``, ``hardswish`` ...):
    elementwise in the gradient and the activation's input (or output), decomposed by torch into
    a chain of elementwise ops whose result has the gradient's dtype; answered when both have one
    stride and an unambiguous layout (``_unambiguous_layout``), the layout of every op in the chain."""
    if not (_same_float_operands(mode, grad_output, x) and approximate in (None, "none", "tanh")):
        return NotImplemented
    stride = _unambiguous_layout((grad_output, x), grad_output.shape)
    if stride is None:
        return NotImplemented
    return _new_fake(mode, grad_output.fake_device, grad_output.shape, stride, grad_output.dtype)


def _fake_like(mode, self, *fill, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """``empty_like`` / ``zeros_like`` / ``ones_like`` / ``full_like`` keeping the tensor's
    dtype, device and layout (``preserve_format``): a new tensor laid out as torch's
    reference lays it out (``empty_like``: ``compute_elementwise_output_logical_to_physical_perm``
    of the tensor), answered where that layout is unambiguous (``_unambiguous_layout``)."""
    if not (_plain_fake(mode, self) and len(fill) <= 1 and all(type(v) in (int, float, bool) for v in fill)
            and dtype in (None, self.dtype) and layout in (None, torch.strided) and not pin_memory
            and memory_format in (None, torch.preserve_format) and self.numel() > 0
            and (device is None or torch.device(device) == self.fake_device)):
        return NotImplemented
    stride = _unambiguous_layout((self,), self.shape)
    if stride is None:
        return NotImplemented
    return _new_fake(mode, self.fake_device, self.shape, stride, self.dtype)


def _fake_clone(mode, self, memory_format=None):
    """``clone`` keeping the layout: a dense tensor's copy gets its very strides (``empty_like``
    in aten/src/ATen/native/TensorFactories.cpp); answered for the layouts of ``_one_layout``."""
    if not (_plain_fake(mode, self) and memory_format in (None, torch.preserve_format) and self.numel() > 0
            and _one_layout(self)):
        return NotImplemented
    return _new_fake(mode, self.fake_device, self.shape, self.stride(), self.dtype)


def _fake_reshape_view(mode, self, size):
    """``view`` / ``_unsafe_view``: FakeTensorMode answers them with torch's reference algorithm
    (fake_impls ``_view_meta``: ``torch._refs._reshape_view_helper``, which can give a size-1
    dimension another stride than the C++ kernel does); so does this, run on a plain meta tensor
    aliasing the fake one's storage instead of through the fake mode op by op."""
    if not (_plain_fake(mode, self) and isinstance(size, (list, tuple)) and all(type(n) is int for n in size)):
        return NotImplemented
    with in_kernel_invocation_manager(mode):
        alias = torch.empty_strided((), (), dtype=self.dtype, device="meta")
        alias.set_(self.untyped_storage(), self.storage_offset(), self.shape, self.stride())
        try:
            out = reshape_view_helper(alias, *size, allow_copy=False)
        except Exception:   # not a view of this shape: FakeTensorMode raises its own error
            return NotImplemented
    if not (isinstance(out, torch.Tensor) and out.untyped_storage()._cdata == alias.untyped_storage()._cdata):
        return NotImplemented
    return FakeTensor(mode, out, self.fake_device)


def _cpp_view(func):
    """A view op (``view``, ``permute``, ``t``, ``expand`` ...) run by its C++ kernel on a plain meta
    tensor aliasing the fake one's storage, and the result wrapped: what FakeTensorMode computes
    for it, where its kernel runs on the fake tensor itself and, when that is a miss, through
    Python on the way (~1-2 ms for ``view``), or a cached answer (~45 us). Arguments other than
    the tensor must be plain (sizes, dims); an error (a shape that cannot be a view) is left
    for FakeTensorMode to raise."""
    def kernel(mode, self, *args, **kwargs):
        if not _plain_fake(mode, self) or any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values())):
            return NotImplemented
        with in_kernel_invocation_manager(mode):
            alias = torch.empty_strided((), (), dtype=self.dtype, device="meta")
            alias.set_(self.untyped_storage(), self.storage_offset(), self.shape, self.stride())
            try:
                out = func(alias, *args, **kwargs)
            except Exception:   # not a view of these sizes: FakeTensorMode raises its own error
                return NotImplemented
        if isinstance(out, torch.Tensor):
            return FakeTensor(mode, out, self.fake_device)
        if isinstance(out, (list, tuple)) and all(isinstance(o, torch.Tensor) for o in out):
            return type(out)(FakeTensor(mode, o, self.fake_device) for o in out)
        return NotImplemented
    return kernel


_CPU = torch.device("cpu")


def _fake_empty(mode, size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """``torch.empty(size)`` (and ``zeros`` / ``ones``) on the CPU: contiguous, or channels-last
    for a 4-d size when asked, in the dtype asked for or the default one (FakeTensorMode's
    ``constructors`` run the meta kernel and put the tensor on the device asked for, the CPU
    when none is)."""
    if not (isinstance(size, (list, tuple)) and all(type(n) is int and n >= 0 for n in size)
            and (dtype is None or isinstance(dtype, torch.dtype)) and layout in (None, torch.strided) and not pin_memory
            and (device is None or torch.device(device) == _CPU)):
        return NotImplemented
    if memory_format in (None, torch.contiguous_format):
        stride = make_contiguous_strides_for(size)
    elif memory_format is torch.channels_last and len(size) == 4:
        stride = make_channels_last_2d_strides_for(size)
    else:
        return NotImplemented
    return _new_fake(mode, _CPU, size, stride, dtype or torch.get_default_dtype())


FAKE_KERNELS = {
    _aten.empty.memory_format: _fake_empty,
    _aten.zeros.default: _fake_empty,      # the same tensor: a fake one has no values to set
    _aten.ones.default: _fake_empty,
    _aten.empty_like.default: _fake_like,
    _aten.zeros_like.default: _fake_like,
    _aten.ones_like.default: _fake_like,
    _aten.full_like.default: _fake_like,
    _aten.clone.default: _fake_clone,
    _aten.add.Tensor: _fake_binary,
    _aten.sub.Tensor: _fake_binary,
    _aten.mul.Tensor: _fake_binary,
    _aten.div.Tensor: _fake_binary,
    _aten.add_.Tensor: _fake_binary_inplace,
    _aten.sub_.Tensor: _fake_binary_inplace,
    _aten.mul_.Tensor: _fake_binary_inplace,
    _aten.div_.Tensor: _fake_binary_inplace,
    _aten.add_.Scalar: _fake_binary_inplace,
    _aten.mul_.Scalar: _fake_binary_inplace,
    _aten.relu_.default: _fake_unary_inplace,
    _aten.silu_.default: _fake_unary_inplace,
    _aten.sigmoid_.default: _fake_unary_inplace,
    _aten.tanh_.default: _fake_unary_inplace,
    _aten.hardswish_.default: _fake_unary_inplace,
    _aten.hardsigmoid_.default: _fake_unary_inplace,
    _aten.threshold_backward.default: _fake_threshold_backward,
    _aten.gelu_backward.default: _fake_activation_backward,
    _aten.silu_backward.default: _fake_activation_backward,
    _aten.sigmoid_backward.default: _fake_activation_backward,
    _aten.tanh_backward.default: _fake_activation_backward,
    _aten.hardswish_backward.default: _fake_activation_backward,
    _aten.hardsigmoid_backward.default: _fake_activation_backward,
    _aten.native_batch_norm.default: _fake_native_batch_norm,
    _aten.native_batch_norm_backward.default: _fake_native_batch_norm_backward,
    _aten.slice.Tensor: _fake_slice,
    _aten.detach.default: _fake_detach,
    _aten._foreach_sqrt.default: _fake_foreach_sqrt,
}
FAKE_KERNELS[_aten.view.default] = FAKE_KERNELS[_aten._unsafe_view.default] = _fake_reshape_view
FAKE_KERNELS.update({op: _cpp_view(op) for op in (
    _aten.t.default, _aten.transpose.int, _aten.permute.default,
    _aten.expand.default, _aten.unsqueeze.default, _aten.squeeze.dim, _aten.squeeze.dims, _aten.select.int,
    _aten.alias.default, _aten.unbind.int, _aten.split.Tensor, _aten.split_with_sizes.default)})
# the in-place foreach arithmetic of torch.optim's foreach implementations (adam, adamw, sgd,
# rmsprop, adagrad ...), by how many tensor lists each overload takes before its numbers
for _name, _overloads in {
        "_foreach_add_": {"Scalar": 1, "ScalarList": 1, "List": 2},
        "_foreach_sub_": {"Scalar": 1, "ScalarList": 1, "List": 2},
        "_foreach_mul_": {"Scalar": 1, "ScalarList": 1, "List": 2},
        "_foreach_div_": {"Scalar": 1, "ScalarList": 1, "List": 2},
        "_foreach_lerp_": {"Scalar": 2, "List": 3},
        "_foreach_addcmul_": {"Scalar": 3, "ScalarList": 3},
        "_foreach_addcdiv_": {"Scalar": 3, "ScalarList": 3},
        "_foreach_maximum_": {"List": 2},
        "_foreach_sqrt_": {"default": 1},
        "_foreach_neg_": {"default": 1},
        "_foreach_zero_": {"default": 1}}.items():
    for _overload, _n in _overloads.items():
        _op = getattr(getattr(_aten, _name, None), _overload, None)
        if _op is not None:   # an overload this torch does not have is left to FakeTensorMode
            FAKE_KERNELS[_op] = _foreach_inplace(_n)


def _fake_local_scalar_dense(mode, self):
    """``.item()`` of a fake tensor made by ``torch.tensor(number)`` (an optimizer's step counter):
    FakeTensorMode reads its constant (the real tensor behind it); so does this, directly."""
    if not (isinstance(self, FakeTensor) and self.fake_mode is mode and type(self.constant) is torch.Tensor):
        return NotImplemented
    with no_dispatch():
        return _aten._local_scalar_dense.default(self.constant)


def _fake_lift_fresh(mode, t):
    """``torch.tensor(number)`` under the mode (BatchNorm's ``num_batches_tracked``, an
    optimizer's step counter): FakeTensorMode's own steps for it (``_dispatch_impl``'s lift
    branch: the real op, then a fake tensor keeping a copy of the one value as its constant),
    without the general machinery around them."""
    if not (type(t) is torch.Tensor and t.device.type == "cpu" and t.layout == torch.strided
            and not t.requires_grad and not t.is_quantized):
        return NotImplemented
    out = _aten.lift_fresh.default(t)
    if type(out) is not torch.Tensor or not mode.may_turn_const(out):
        return NotImplemented     # larger than a constant: FakeTensorMode converts it without one
    with no_dispatch():
        out = out.clone()
    return mode.fake_tensor_converter.from_real_tensor(mode, out, make_constant=True)


FAKE_KERNELS[_aten._local_scalar_dense.default] = _fake_local_scalar_dense
FAKE_KERNELS[_aten.lift_fresh.default] = _fake_lift_fresh

