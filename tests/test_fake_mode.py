"""The fake engine's shortcuts give torch's own answers, faster.

``fake_mode.FakeMode`` answers some ops directly instead of through FakeTensorMode's Python
decompositions and cache, ``shape_kernels.shape_kernels`` does the same for batch norm on meta,
``models._initialisers_skipped`` skips writing values into tensors that have none, and the
tracker keeps a saved tensor itself where a detached alias is not needed. Each is checked here
against what torch (or the tracker) did without it: the same shapes, strides, offsets, dtypes,
devices and storages over grids of cases, the same errors, and the same cache behaviour.
"""
import gc
import itertools
import weakref

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from gpulab.measure import fake_kernels, fake_mode, shape_kernels
from gpulab.models import registry as models
from gpulab.measure.fake_mode import FakeMode
from gpulab.measure.tracking import MemoryTracker

aten = torch.ops.aten
FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def meta_of(t):
    """Everything about an op's output the fake engine can see."""
    if t is None or not isinstance(t, torch.Tensor):
        return t
    return (type(t).__name__, tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, str(t.device),
            t.untyped_storage().nbytes(), t.requires_grad, t.is_conj(), t.is_neg())


def answer(mode_cls, build, op):
    """``op`` applied to what ``build`` makes, under a fresh ``mode_cls``: the outputs' metadata
    and which input storages they share, or the exception's type."""
    with mode_cls():
        inputs = build()
        try:
            out = op(*inputs)
        except Exception as exc:   # the shortcut must raise where torch raises
            return type(exc).__name__
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        flat = [t for x in inputs for t in (x if isinstance(x, (list, tuple)) else [x]) if isinstance(t, torch.Tensor)]
        shared = [[i for i, t in enumerate(flat) if isinstance(o, torch.Tensor)
                   and o.untyped_storage()._cdata == t.untyped_storage()._cdata] for o in outs]
        return [meta_of(o) for o in outs], shared


@pytest.fixture
def answered(monkeypatch):
    """How many calls of each op FakeMode answered itself (so an equality test is not vacuous).
    On a torch whose FakeTensorMode lacks the insides the shortcuts read (``SHORTCUTS`` False,
    e.g. torch 2.11, Colab's), FakeMode is FakeTensorMode itself and answers nothing: the
    shortcut tests skip, and test_without_torchs_insides_... checks that fallback."""
    if not fake_mode.SHORTCUTS:
        pytest.skip(f"torch {torch.__version__}: FakeMode's shortcuts are off (SHORTCUTS False); FakeMode is FakeTensorMode")
    counts = {}

    def counting(op, kernel):
        def count(*args, **kwargs):
            out = kernel(*args, **kwargs)
            if out is not NotImplemented:
                counts[op] = counts.get(op, 0) + 1
            return out
        return count
    for op, kernel in list(fake_kernels.FAKE_KERNELS.items()):
        monkeypatch.setitem(fake_kernels.FAKE_KERNELS, op, counting(op, kernel))
    return counts


def in_format(t, channels_last):
    if channels_last and t.dim() == 4:
        return t.contiguous(memory_format=torch.channels_last)
    if channels_last and t.dim() == 5:
        return t.contiguous(memory_format=torch.channels_last_3d)
    return t


BN_SHAPES = [(4, 3, 5, 5), (4, 3, 1, 1), (1, 3, 1, 1), (4, 1, 5, 5), (4, 3), (1, 3), (4, 3, 7), (2, 3, 2, 4, 4),
             (4, 3, 5, 1), (4, 0, 2, 2)]


def bn_cases():
    for shape, dt, cl, training, affine, stats, same_dtype in itertools.product(
            BN_SHAPES, FLOATS[:3], (False, True), (True, False), (True, False), (True, False), (True, False)):
        if (cl and len(shape) < 4) or (dt in (torch.float32, torch.float64) and not same_dtype):
            continue
        yield shape, dt, cl, training, affine, stats, same_dtype


def bn_inputs(shape, dt, cl, affine, stats, same_dtype, device="cpu"):
    c = shape[1]
    pdt = dt if same_dtype else torch.float32
    x = in_format(torch.empty(shape, dtype=dt, device=device), cl)
    per_channel = lambda: torch.empty(c, dtype=pdt, device=device)
    w, b = (per_channel(), per_channel()) if affine else (None, None)
    rm, rv = (per_channel(), per_channel()) if stats else (None, None)
    return x, w, b, rm, rv


def test_batch_norm_forward_and_backward_equal_torchs(answered):
    n = 0
    for shape, dt, cl, training, affine, stats, same in bn_cases():
        # every case forward, and backward with the incoming gradient in either layout; the
        # masks that drop the weight's and bias's gradients (or the input's) on a few cases
        masks = [[True, True, True]]
        if shape in BN_SHAPES[:3] and dt in (torch.float32, torch.bfloat16):
            masks += [[True, False, False], [False, True, True]]
        for grad_cl, mask in itertools.product((False, True), masks):
            if grad_cl and len(shape) < 4:
                continue

            def build():
                x, w, b, rm, rv = bn_inputs(shape, dt, cl, affine, stats, same)
                return x, w, b, rm, rv, in_format(torch.empty(shape, dtype=dt), grad_cl)

            def fwd(x, w, b, rm, rv, g):
                return aten.native_batch_norm(x, w, b, rm, rv, training, 0.1, 1e-5)

            def bwd(x, w, b, rm, rv, g):
                out = aten.native_batch_norm(x, w, b, rm, rv, training, 0.1, 1e-5)
                return aten.native_batch_norm_backward(g, x, w, rm, rv, out[1], out[2], training, 1e-5, mask)

            ops = (fwd,) if not grad_cl and mask == masks[0] else ()
            if dt in (torch.float32, torch.bfloat16):   # backward: the two dtypes models train in
                ops += (bwd,)
            for op in ops:
                assert answer(FakeMode, build, op) == answer(FakeTensorMode, build, op), \
                    (op.__name__, shape, dt, cl, training, affine, stats, same, grad_cl, mask)
                n += 1
    assert n > 800
    assert answered[aten.native_batch_norm.default] > 400 and answered[aten.native_batch_norm_backward.default] > 200


def test_batch_norm_on_meta_equals_the_meta_kernel():
    for shape, dt, cl, training, affine, stats, same in bn_cases():
        def run(direct):
            x, w, b, rm, rv = bn_inputs(shape, dt, cl, affine, stats, same, device="meta")
            try:
                if direct:
                    with shape_kernels.shape_kernels():
                        out = aten.native_batch_norm(x, w, b, rm, rv, training, 0.1, 1e-5)
                else:
                    out = aten.native_batch_norm(x, w, b, rm, rv, training, 0.1, 1e-5)
            except Exception as exc:
                return type(exc).__name__
            return [meta_of(o) for o in out]
        assert run(True) == run(False), (shape, dt, cl, training, affine, stats, same)


ODD_BN_INPUTS = {   # views whose strides are not those of a new tensor
    "size-1 dims of a transposed tensor": lambda device: torch.empty(3, 4, device=device).t()[..., None, None],
    "a channel slice": lambda device: torch.empty(4, 6, 5, 5, device=device)[:, :3],
    "an expanded batch": lambda device: torch.empty(1, 3, 5, 5, device=device).expand(4, 3, 5, 5),
    "1-d stride 1 of 2": lambda device: torch.empty(4, 6, device=device)[:, ::2],
}


@pytest.mark.parametrize("make", list(ODD_BN_INPUTS.values()), ids=list(ODD_BN_INPUTS))
def test_batch_norm_of_odd_layouts_equals_torchs(make):
    for training in (True, False):
        def build(device="cpu"):
            x = make(device)
            return (x, *(torch.empty(x.shape[1], device=device) for _ in range(4)), torch.empty(x.shape, device=device))

        def fwd(x, w, b, rm, rv, g):
            return aten.native_batch_norm(x, w, b, rm, rv, training, 0.1, 1e-5)

        def bwd(x, w, b, rm, rv, g):
            out = aten.native_batch_norm(x, w, b, rm, rv, training, 0.1, 1e-5)
            return aten.native_batch_norm_backward(g, x, w, rm, rv, out[1], out[2], training, 1e-5, [True] * 3)
        for op in (fwd, bwd):
            assert answer(FakeMode, build, op) == answer(FakeTensorMode, build, op), (op.__name__, training)
        meta = build("meta")
        with shape_kernels.shape_kernels():
            fast = [meta_of(o) for o in fwd(*meta)]
        assert fast == [meta_of(o) for o in fwd(*meta)]


@pytest.mark.parametrize("base", [(6, 10, 4), (6, 10, 4, "t"), (1, 7), (5,), (3, 0, 4), (2, 9, 4, "slice")])
def test_slice_views_equal_torchs(base, answered):
    *shape, how = base if isinstance(base[-1], str) else (*base, None)

    def build():
        x = torch.empty(shape)
        if how == "t":
            x = x.transpose(0, -1)
        elif how == "slice":
            x = x[1:, 2:7]
        return (x,)
    for dim, start, end, step in itertools.product(range(-len(shape) - 1, len(shape) + 1),
                                                   (None, 0, 1, 3, -2, -20, 20), (None, 0, 2, -1, -20, 5, 20),
                                                   (1, 2, 3, 0)):
        op = lambda x: aten.slice.Tensor(x, dim, start, end, step)
        assert answer(FakeMode, build, op) == answer(FakeTensorMode, build, op), (shape, how, dim, start, end, step)
    assert answered[aten.slice.Tensor] > 100


def test_tensors_made_from_numbers_equal_torchs(answered):
    """``torch.tensor(...)`` under the mode: a constant behind a one-value tensor, none behind a larger one."""
    for make in (lambda: torch.tensor(0.0), lambda: torch.tensor(3, dtype=torch.int64), lambda: torch.tensor([1.0]),
                 lambda: torch.tensor([1.0, 2.0]), lambda: torch.tensor(True), lambda: torch.tensor([[1, 2], [3, 4]])):
        results = []
        for mode_cls in (FakeMode, FakeTensorMode):
            with mode_cls():
                t = make()
                constant = None if t.constant is None else (t.constant.tolist(), t.constant.dtype)
                results.append((meta_of(t), constant, type(t).__name__))
        assert results[0] == results[1]
    assert answered[aten.lift_fresh.default] == 4


VIEW_CALLS = {
    "view": [lambda x: aten.view.default(x, [-1]), lambda x: aten.view.default(x, [2, -1]),
             lambda x: aten.view.default(x, [1, *x.shape, 1]), lambda x: aten.view.default(x, [x.shape[0], 1, -1]),
             lambda x: aten.view.default(x, [7, -1])],
    "_unsafe_view": [lambda x: aten._unsafe_view.default(x, [-1]), lambda x: aten._unsafe_view.default(x, [2, -1, 1])],
    "t": [lambda x: aten.t.default(x)],
    "transpose": [lambda x: aten.transpose.int(x, 0, -1), lambda x: aten.transpose.int(x, 1, 1),
                  lambda x: aten.transpose.int(x, 0, 5)],
    "permute": [lambda x: aten.permute.default(x, list(range(x.dim()))[::-1]), lambda x: aten.permute.default(x, [0])],
    "expand": [lambda x: aten.expand.default(x, [3, *x.shape]), lambda x: aten.expand.default(x, [-1] * x.dim()),
               lambda x: aten.expand.default(x, [5] * x.dim())],
    "unsqueeze": [lambda x: aten.unsqueeze.default(x, 0), lambda x: aten.unsqueeze.default(x, -1),
                  lambda x: aten.unsqueeze.default(x, 9)],
    "squeeze": [lambda x: aten.squeeze.dim(x, 0), lambda x: aten.squeeze.dims(x, [0, -1])],
    "select": [lambda x: aten.select.int(x, 0, -1), lambda x: aten.select.int(x, -1, 1), lambda x: aten.select.int(x, 0, 99)],
    "alias": [lambda x: aten.alias.default(x)],
    "unbind": [lambda x: aten.unbind.int(x, 0)],
    "split": [lambda x: aten.split.Tensor(x, 2, -1), lambda x: aten.split_with_sizes.default(x, [1, x.shape[0] - 1])],
}


@pytest.mark.parametrize("op", list(VIEW_CALLS))
def test_view_ops_equal_torchs(op, answered):
    n = 0
    for shape in [(4, 6, 5), (4, 1, 6), (1, 6), (6, 1, 1), (2, 3, 4, 5)]:
        for lay, make in layouts(shape).items():
            for call in VIEW_CALLS[op]:
                build = lambda: (make(),)
                assert answer(FakeMode, build, call) == answer(FakeTensorMode, build, call), (op, shape, lay)
                n += 1
    assert sum(answered.values()) > n // 3


def test_detach_and_item_equal_torchs():
    def build():
        return torch.empty(4, 6)[:, 1:4], torch.tensor(2.5), torch.tensor(7)
    for op in (lambda x, s, i: aten.detach.default(x), lambda x, s, i: aten.detach.default(s),
               lambda x, s, i: aten._local_scalar_dense.default(s), lambda x, s, i: aten._local_scalar_dense.default(i)):
        assert answer(FakeMode, build, op) == answer(FakeTensorMode, build, op)
    with FakeMode():   # the value and its Python type, as torch reads the constant
        assert torch.tensor(2.5).item() == 2.5 and type(torch.tensor(7).item()) is int
        with pytest.raises(Exception, match="_local_scalar_dense"):
            torch.empty(()).item()   # no constant behind it: data-dependent, as before


def foreach_lists(shapes, dtypes):
    return [torch.empty(s, dtype=d) for s, d in zip(shapes, dtypes)]


FOREACH_CALLS = [
    ("add_ scalar", 1, lambda a, b, c: torch._foreach_add_(a, 1.5)),
    ("add_ list alpha", 2, lambda a, b, c: torch._foreach_add_(a, b, alpha=-0.1)),
    ("mul_ scalarlist", 1, lambda a, b, c: torch._foreach_mul_(a, [0.5] * len(a))),
    ("div_ scalarlist", 1, lambda a, b, c: torch._foreach_div_(a, [2.0] * len(a))),
    ("lerp_", 2, lambda a, b, c: torch._foreach_lerp_(a, b, 0.1)),
    ("addcmul_", 3, lambda a, b, c: torch._foreach_addcmul_(a, b, c, value=0.01)),
    ("addcdiv_ scalarlist", 3, lambda a, b, c: torch._foreach_addcdiv_(a, b, c, [-0.1] * len(a))),
    ("sqrt", 1, lambda a, b, c: torch._foreach_sqrt(a)),
    ("sqrt_", 1, lambda a, b, c: torch._foreach_sqrt_(a)),
    ("maximum_", 2, lambda a, b, c: torch._foreach_maximum_(a, b)),
    ("zero_", 1, lambda a, b, c: torch._foreach_zero_(a)),
]


@pytest.mark.parametrize("name,n_lists,call", FOREACH_CALLS, ids=[c[0] for c in FOREACH_CALLS])
def test_optimizer_foreach_ops_equal_torchs(name, n_lists, call, answered):
    shapes = [(3, 4), (7,), (2, 3, 5), ()]
    cases = {
        "same": (shapes, shapes, shapes, [torch.float32] * 4),
        "mixed dtypes": (shapes, shapes, shapes, [torch.float32, torch.bfloat16, torch.float16, torch.float64]),
        "shape mismatch": (shapes, [(4, 3), (7,), (2, 3, 5), ()], shapes, [torch.float32] * 4),
        "broadcast": (shapes, [(1, 4), (1,), (2, 3, 5), ()], shapes, [torch.float32] * 4),
        "length mismatch": (shapes, shapes[:3], shapes, [torch.float32] * 4),
        "empty": ([], [], [], []),
        "integers": (shapes, shapes, shapes, [torch.int64] * 4),
        "transposed": ([(4, 3)] * 4, [(4, 3)] * 4, [(4, 3)] * 4, [torch.float32] * 4),
    }
    for case, (sa, sb, sc, dts) in cases.items():
        def build():
            a, b, c = (foreach_lists(s, dts[:len(s)] + [torch.float32] * (len(s) - len(dts))) for s in (sa, sb, sc))
            if case == "transposed":
                a = [t.t() for t in a]
            return a, b, c
        assert answer(FakeMode, build, call) == answer(FakeTensorMode, build, call), (name, case)
    assert sum(answered.values()) >= 2   # "same" and "mixed dtypes" at least


class KeyOnly(FakeTensorMode):
    """FakeTensorMode with FakeMode's cache key and nothing else."""
    _cache_key = FakeMode._cache_key
    # (a torch whose FakeTensorMode gpulab uses as it is has no shortcuts: then nothing to add)
    _fast_key = getattr(FakeMode, "_fast_key", None)
    _key_of = getattr(FakeMode, "_key_of", None)


def cache_counts(mode_cls):
    FakeTensorMode.cache.clear()
    hits, misses, bypasses = FakeTensorMode.cache_hits, FakeTensorMode.cache_misses, dict(FakeTensorMode.cache_bypasses)
    torch.manual_seed(0)
    with mode_cls():
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Flatten(),
                                  torch.nn.Dropout(), torch.nn.Linear(8 * 5 * 6, 10))
        opt = torch.optim.Adam(net.parameters(), foreach=True)
        x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
        for _ in range(2):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x[:, :, 1:]), y).backward()
            opt.step()
    return (FakeTensorMode.cache_hits - hits, FakeTensorMode.cache_misses - misses,
            {k: v - bypasses.get(k, 0) for k, v in FakeTensorMode.cache_bypasses.items() if v != bypasses.get(k, 0)},
            len(FakeTensorMode.cache))


def test_fast_cache_key_caches_exactly_what_fake_tensor_mode_caches():
    """The same calls hit, miss and bypass (with the same reasons), and the cache holds as many
    entries: FakeMode's key tells apart exactly the calls FakeTensorMode's tells apart."""
    assert cache_counts(KeyOnly) == cache_counts(FakeTensorMode)


def test_fake_mode_tensors_are_fake_tensors_of_it():
    with FakeMode() as mode:
        x = torch.empty(4, 3, 5, 5, requires_grad=True)
        bn = torch.nn.BatchNorm2d(3)
        y = bn(x)
        assert isinstance(y, FakeTensor) and y.fake_mode is mode and y.device == torch.device("cpu")
        y.sum().backward()
        assert isinstance(x.grad, FakeTensor) and x.grad.shape == x.shape


def layouts(shape):
    """Tensors of ``shape`` (or views with it) in the layouts the elementwise shortcuts must get
    right: contiguous, channels-last, transposed, a slice with gaps, an expanded (stride 0) one."""
    out = {"contiguous": lambda: torch.empty(shape)}
    if len(shape) == 4:
        out["channels_last"] = lambda: torch.empty(shape).contiguous(memory_format=torch.channels_last)
    if len(shape) >= 2:
        out["transposed"] = lambda: torch.empty(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)
    out["slice"] = lambda: torch.empty(shape[0] + 3, *shape[1:])[2:2 + shape[0]]
    out["gaps"] = lambda: torch.empty(*shape[:-1], shape[-1] * 2)[..., ::2]
    out["expanded"] = lambda: torch.empty(1, *shape[1:]).expand(shape)
    return out


ELEMENTWISE_SHAPES = [(4, 3, 5, 5), (4, 1, 5, 5), (1, 3, 1, 1), (4, 3, 1, 1), (6, 5), (1, 5), (7,), (2, 3, 4)]


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "add_alpha", "add_", "mul_", "sub_alpha_", "add_scalar_",
                                "relu_", "silu_", "threshold_backward", "gelu_backward", "gelu_backward_tanh",
                                "silu_backward", "sigmoid_backward", "tanh_backward", "hardswish_backward"])
def test_elementwise_ops_equal_torchs(op, answered):
    calls = {
        "add": lambda a, b: aten.add.Tensor(a, b), "sub": lambda a, b: aten.sub.Tensor(a, b),
        "mul": lambda a, b: aten.mul.Tensor(a, b), "div": lambda a, b: aten.div.Tensor(a, b),
        "add_alpha": lambda a, b: aten.add.Tensor(a, b, alpha=2),
        "add_": lambda a, b: aten.add_.Tensor(a, b), "mul_": lambda a, b: aten.mul_.Tensor(a, b),
        "sub_alpha_": lambda a, b: aten.sub_.Tensor(a, b, alpha=0.5),
        "add_scalar_": lambda a, b: aten.add_.Scalar(a, 1.5), "relu_": lambda a, b: aten.relu_.default(a),
        "silu_": lambda a, b: aten.silu_.default(a),
        "threshold_backward": lambda a, b: aten.threshold_backward.default(a, b, 0),
        "gelu_backward": lambda a, b: aten.gelu_backward.default(a, b),
        "gelu_backward_tanh": lambda a, b: aten.gelu_backward.default(a, b, approximate="tanh"),
        "silu_backward": lambda a, b: aten.silu_backward.default(a, b),
        "sigmoid_backward": lambda a, b: aten.sigmoid_backward.default(a, b),
        "tanh_backward": lambda a, b: aten.tanh_backward.default(a, b),
        "hardswish_backward": lambda a, b: aten.hardswish_backward.default(a, b),
    }
    call = calls[op]
    n = 0
    for shape in ELEMENTWISE_SHAPES:
        lay = layouts(shape)
        for (la, ma), (lb, mb), da, db in itertools.product(lay.items(), lay.items(), FLOATS[:2], (FLOATS[0], torch.int64)):
            def build():
                a, b = ma(), mb()
                return (a.to(da), b.to(db)) if (da, db) != (torch.float32, torch.float32) else (a, b)
            assert answer(FakeMode, build, call) == answer(FakeTensorMode, build, call), (op, shape, la, lb, da, db)
            n += 1
        # the same storage on both sides; broadcasting; a 0-dim tensor and an empty one
        for build in (lambda: (lambda t: (t, t[:]))(torch.empty(shape)),
                      lambda: (torch.empty(shape), torch.empty(shape[-1:])), lambda: (torch.empty(()), torch.empty(())),
                      lambda: (torch.empty(0, *shape[1:]), torch.empty(0, *shape[1:]))):
            assert answer(FakeMode, build, call) == answer(FakeTensorMode, build, call), (op, shape)
    assert n > 100
    assert op == "add_alpha" or sum(answered.values()) > 20


LIKE_CALLS = {
    "empty_like": lambda t: aten.empty_like.default(t), "zeros_like": lambda t: aten.zeros_like.default(t),
    "zeros_like preserve": lambda t: aten.zeros_like.default(t, memory_format=torch.preserve_format),
    "ones_like": lambda t: aten.ones_like.default(t), "full_like": lambda t: aten.full_like.default(t, 0.5),
    "clone": lambda t: aten.clone.default(t), "clone preserve": lambda t: aten.clone.default(t, memory_format=torch.preserve_format),
    "zeros_like contiguous": lambda t: aten.zeros_like.default(t, memory_format=torch.contiguous_format),
    "zeros_like bf16": lambda t: aten.zeros_like.default(t, dtype=torch.bfloat16),
    "empty_like cpu": lambda t: aten.empty_like.default(t, device="cpu"),
}


@pytest.mark.parametrize("name", list(LIKE_CALLS))
def test_like_constructors_and_clone_equal_torchs(name, answered):
    call = LIKE_CALLS[name]
    for shape in [*ELEMENTWISE_SHAPES, (0, 3), (2, 3, 4, 5, 6)]:
        for lay, make in layouts(shape).items():
            for dt in (torch.float32, torch.int64):
                build = lambda: (make().to(dt),)
                assert answer(FakeMode, build, call) == answer(FakeTensorMode, build, call), (name, shape, lay, dt)
    if name in ("empty_like", "zeros_like", "clone", "full_like", "empty_like cpu"):
        assert sum(answered.values()) > 20


def test_empty_equals_torchs(answered):
    for size, kw in itertools.product([(4, 3, 5, 5), (4, 3, 1, 1), (0, 3), (7,), (), (2, 0, 4, 4), (3, 1, 1, 1)],
                                      [{}, {"dtype": torch.float16}, {"dtype": torch.int64}, {"device": "cpu"},
                                       {"memory_format": torch.channels_last}, {"memory_format": torch.contiguous_format},
                                       {"memory_format": torch.preserve_format}, {"pin_memory": False}]):
        for op in (aten.empty.memory_format, aten.zeros.default, aten.ones.default):
            if op is not aten.empty.memory_format and "memory_format" in kw:
                continue
            call = lambda: op(list(size), **kw)
            assert answer(FakeMode, tuple, call) == answer(FakeTensorMode, tuple, call), (op, size, kw)
            with torch.device("cpu"):
                assert answer(FakeMode, tuple, call) == answer(FakeTensorMode, tuple, call), (op, size, kw)
    assert answered[aten.empty.memory_format] > 50 and answered[aten.zeros.default] > 30


# ---- skipping initialisers on fake and meta tensors --------------------------------------------

def records_of(build):
    with FakeMode(), MemoryTracker() as tracker:
        keep = build()
    return keep, [(r.sid, r.nbytes, r.dtype, r.shape, r.op, r.category) for r in tracker.result(device="cpu").records.values()]


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small", "vgg11_bn", "cnn", "mlp"])
def test_skipping_initialisers_changes_no_storage(name):
    spec = models.resolve_model(name)
    with_init = records_of(lambda: spec.build(num_classes=10))[1]
    skipped = records_of(lambda: models.build_in_place(lambda: spec.build(num_classes=10), "cpu"))[1]
    assert skipped == with_init


def test_initialisers_still_write_real_tensors_and_check_their_arguments():
    with models._initialisers_skipped():
        w = torch.nn.Linear(4, 3).weight
        assert w.abs().sum() > 0                         # a real tensor still gets its random values
        with torch.device("meta"):
            with pytest.raises(ValueError, match="fewer than 2 dimensions"):
                torch.nn.init.kaiming_uniform_(torch.empty(3))
            p = torch.nn.Parameter(torch.empty(3))
            with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
                p.uniform_()                             # a write torch refuses is still refused
        with FakeTensorMode():
            c = torch.tensor(2.0)                        # a fake holding a constant keeps its value written
            c.fill_(5.0)
            assert c.item() == 5.0
    assert "uniform_" not in torch.Tensor.__dict__      # the methods are put back


# ---- the tracker keeps saved inputs themselves ---------------------------------------------------

def test_a_graph_that_never_runs_backward_is_freed_without_the_garbage_collector():
    """The tracker keeps a saved tensor without a grad_fn itself (no detach); that must never
    make a reference cycle: dropping the output frees everything, with no collector. A custom
    autograd Function that saves its output, and an in-place op on a view, included."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4), torch.nn.Softmax(dim=-1))
    gc.disable()
    try:
        with MemoryTracker() as tracker:
            class Exp(torch.autograd.Function):
                @staticmethod
                def forward(ctx, a):
                    out = a.exp()
                    ctx.save_for_backward(out, a)
                    return out

                @staticmethod
                def backward(ctx, g):
                    return g * ctx.saved_tensors[0]
            x = torch.randn(8, 16, requires_grad=True)
            h = model(x).clone()
            h[:, :2].sigmoid_()                      # in place on a view: the base's grad_fn is rebased
            out = Exp.apply(h) * x[:, :4]
            saved = [r for r in tracker._records.values() if r.category.value == "activations"]
            assert len(saved) >= 4
            ref = weakref.ref(out.untyped_storage())
            del out, x, h
            assert ref() is None
            alive = [r for r in tracker._records.values() if r.freed is None and r.category.value != "parameters"]
            assert not alive, f"outlived their graph: {alive}"
    finally:
        gc.enable()


def test_in_place_change_of_a_saved_input_is_still_reported():
    with MemoryTracker():
        w = torch.randn(5, requires_grad=True)
        x = torch.randn(5)
        c = (w * x).sum()  # saves x and w, neither with a grad_fn: kept as they are, not detached
        x.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            c.backward()


# ---- meta forwards: batch norm answered directly, repeated ops answered from before -------------

@pytest.mark.parametrize("name", ["resnet18", "densenet121", "mobilenet_v3_small", "swin_t", "vit_b_32", "maxvit_t",
                                  "efficientnet_b0", "regnet_y_400mf", "cnn"])
def test_meta_forwards_give_the_same_shapes_with_shape_kernels(name):
    """Every module's output (shape, strides, dtype, storage size) in a training and an eval
    forward on meta, with and without ``shape_kernels`` (its answers cache cleared first)."""
    spec = models.resolve_model(name)
    size = 224 if name != "cnn" else 32

    def outputs(fast, train):
        net = models.build_in_place(lambda: spec.build(num_classes=spec.num_classes, image_size=size), "meta")
        seen = []
        hooks = [m.register_forward_hook(lambda m, a, o: seen.append(meta_of(o) if isinstance(o, torch.Tensor) else None))
                 for m in net.modules()]
        x = torch.empty(2, 3, size, size, device="meta")
        with torch.no_grad(), (shape_kernels.shape_kernels() if fast else torch.autograd.graph.saved_tensors_hooks(
                lambda t: t, lambda t: t)):
            net.train(train)(x)
        for h in hooks:
            h.remove()
        return seen
    for train in (True, False):
        shape_kernels._META_ANSWERS.clear()
        assert outputs(True, train) == outputs(False, train)
        assert outputs(True, train) == outputs(False, train)     # the second time from the answers kept
    assert shape_kernels._META_ANSWERS


def test_without_torchs_insides_the_fake_engine_is_fake_tensor_mode_with_the_same_numbers():
    """On a torch whose FakeTensorMode has other insides (here: one private name removed before
    gpulab is imported), ``FakeMode`` answers with FakeTensorMode's own cache key and kernels and the
    prediction is unchanged; a model built in the mode moves with ``.to(device)`` (plain FakeTensorMode keeps
    each fresh output in its converter's memo, whose weak reference stops ``Module._apply``'s
    ``swap_tensors``: lesson 04's ``train`` failed so on torch 2.11)."""
    import json
    import subprocess
    import sys
    code = ("import json, sys, types, torch._subclasses.fake_tensor as ft\n"
            "if sys.argv[1] == 'without':   # gpulab's import sees a module without the name; torch keeps its own\n"
            "    class Without(types.ModuleType):\n"
            "        def __getattr__(self, name):\n"
            "            if name == '_DispatchCacheValidEntry':\n"
            "                raise AttributeError(name)\n"
            "            return getattr(ft, name)\n"
            "    sys.modules['torch._subclasses.fake_tensor'] = Without(ft.__name__)\n"
            "import gpulab\n"
            "from gpulab.measure import fake_mode\n"
            "from gpulab.measure.engines import run\n"
            "from gpulab.models.registry import resolve_model\n"
            "r = gpulab.step('cnn', batch=8, engine='fake')\n"
            "moved = run(lambda ctx: resolve_model('cnn').build().to(ctx.device), 'fake', fake_target='cuda')\n"
            "print(json.dumps([fake_mode.SHORTCUTS, fake_mode.FakeMode._cache_key is ft.FakeTensorMode._cache_key,\n"
            "                  r.peak_bytes, {k: v for k, v in r.as_dict()['peak_by_category'].items()},\n"
            "                  moved.peak_bytes]))\n")
    out = {}
    for how in ("with", "without"):
        p = subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        out[how] = json.loads(p.stdout.strip().splitlines()[-1])
    # on a torch with the insides the shortcuts read (2.15) they are on; on one without (2.11) off
    assert out["with"][:2] == ([True, False] if fake_mode.SHORTCUTS else [False, True])
    assert out["without"][:2] == [False, True]
    assert out["with"][2:] == out["without"][2:]
