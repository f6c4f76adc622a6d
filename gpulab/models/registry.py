"""Image-classification models by name: the lesson models (torchvision's VGG16, AlexNet and
ResNet-18 with random weights, and two small models that run in well under a second on a
CPU) and every other torchvision classification model (``resnet50`` or
``torchvision:resnet50``), never with downloaded weights.

Every model takes an image batch (N, 3, S, S) and returns class logits, so one training
step, one breakdown and one widget serve them all.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from gpulab.measure.shape_kernels import shape_kernels

__all__ = [
    "MODELS", "ModelSpec", "TORCHVISION_PREFIX", "active_fake_mode", "build_in_place",
    "build_model", "build_model_from", "build_skeleton", "check_image_size", "close_model_names", "is_model_name",
    "materialize", "resolve_model", "small_cnn", "small_mlp", "torchvision_names"
]


def small_mlp(num_classes: int = 10, image_size: int = 32) -> nn.Module:
    """Flatten -> 512 -> 256 -> classes: a fully connected net where parameters dominate."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(3 * image_size * image_size, 512), nn.ReLU(),
        nn.Linear(512, 256), nn.ReLU(),
        nn.Linear(256, num_classes),
    )


def small_cnn(num_classes: int = 10, image_size: int = 32) -> nn.Module:
    """Two conv-BN-ReLU-pool blocks and a classifier: a CNN where activations dominate."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(4), nn.Flatten(),
        nn.Linear(64 * 4 * 4, 128), nn.ReLU(),
        nn.Linear(128, num_classes),
    )


# GoogLeNet and Inception v3 warn that their default initialisation will change unless it is
# chosen; gpulab chooses torchvision's current one (truncated normal), so nothing is printed
_CHOOSE_INIT = {"googlenet": {"init_weights": True}, "inception_v3": {"init_weights": True}}


def _torchvision(name: str) -> Callable[..., nn.Module]:
    def build(num_classes: int = 1000, image_size: int = 224) -> nn.Module:
        import torchvision.models as tvm
        return tvm.get_model(name, weights=None, num_classes=num_classes, **_CHOOSE_INIT.get(name, {}))
    build.__name__ = name
    return build


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[..., nn.Module]
    default_image_size: int
    default_batch: int
    num_classes: int
    description: str


# The lesson models: the names the lessons' panels offer.
MODELS: dict[str, ModelSpec] = {
    "vgg16": ModelSpec("vgg16", _torchvision("vgg16"), 224, 1, 1000,
                       "torchvision VGG16 (138.4 M parameters), random weights"),
    "alexnet": ModelSpec("alexnet", _torchvision("alexnet"), 224, 1, 1000,
                         "torchvision AlexNet (61.1 M parameters), random weights"),
    "resnet18": ModelSpec("resnet18", _torchvision("resnet18"), 224, 1, 1000,
                          "torchvision ResNet-18 (11.7 M parameters), random weights"),
    "mlp": ModelSpec("mlp", small_mlp, 32, 32, 10, "small MLP on 32x32 RGB images"),
    "cnn": ModelSpec("cnn", small_cnn, 32, 32, 10, "small CNN on 32x32 RGB images"),
}


TORCHVISION_PREFIX = "torchvision:"


@functools.lru_cache(maxsize=1)
def torchvision_names() -> tuple[str, ...]:
    """Every torchvision classification model (``list_models(module=torchvision.models)``)."""
    import torchvision.models as tvm
    return tuple(tvm.list_models(module=tvm))


def is_model_name(name: str) -> bool:
    """Whether ``name`` is a lesson model or a torchvision classification model."""
    key = str(name).lower().removeprefix(TORCHVISION_PREFIX)
    return key in MODELS or key in torchvision_names()


def close_model_names(name: str, n: int = 3) -> list[str]:
    """The registered names closest to ``name`` (for "did you mean ...?")."""
    import difflib
    key = str(name).lower().removeprefix(TORCHVISION_PREFIX)
    names = list(dict.fromkeys([*MODELS, *torchvision_names()]))   # vgg16 etc. are both: once
    return difflib.get_close_matches(key, names, n=n, cutoff=0.6)


def resolve_model(model: "str | ModelSpec") -> ModelSpec:
    """Look a model up in the registry, once, at the edge (API, CLI, panel); pass the spec
    down from there. A ``ModelSpec`` is returned as it is. Names are the lesson models and
    every torchvision classification model, with or without the ``torchvision:`` prefix. An
    unknown name raises a ``ValueError`` that lists the close matches."""
    if isinstance(model, ModelSpec):
        return model
    key = str(model).lower().removeprefix(TORCHVISION_PREFIX)
    if key in MODELS:
        return MODELS[key]
    if key in torchvision_names():
        return _torchvision_spec(key)
    close = close_model_names(key)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise ValueError(f"unknown model {model!r}{hint}; valid models: {', '.join(MODELS)} (the lesson models) and "
                     f"every torchvision classification model (gpulab.models.registry.torchvision_names())")


@functools.lru_cache(maxsize=None)
def _torchvision_spec(name: str) -> ModelSpec:
    """A torchvision classification model with random weights, at the image size its first
    published weights were evaluated at (``weights.transforms`` crop size: 299 for Inception
    v3, 384 for EfficientNet-V2-S ...), or 224 where the model built without weights is fixed
    to 224 (ViT-H/14's published weights use 518, its constructor's default is 224)."""
    import torchvision.models as tvm
    weights = list(tvm.get_model_weights(name))
    crop = getattr(weights[0].transforms, "keywords", {}).get("crop_size", 224) if weights else 224
    build = _torchvision(name)
    # counted on the model the size checks then use (torchvision's builders take no image size)
    n = sum(p.numel() for p in _meta_model(build, 1000, int(crop)).parameters())
    # the spec returned is the one the size check ran with, so check_image_size finds it cached
    spec = ModelSpec(name, build, int(crop), 1, 1000, f"torchvision {name} ({n / 1e6:.1f} M parameters), random weights")
    if crop != 224 and not _meta_forward_ok(spec, int(crop)):
        spec = ModelSpec(name, build, 224, 1, 1000, spec.description)
    return spec


def build_model(spec: ModelSpec, image_size: int | None = None, device: torch.device | str | None = None,
                dtype: torch.dtype | None = None) -> nn.Module:
    """A fresh model with random weights, created directly on ``device`` in ``dtype``.

    Creating in place (rather than building in fp32 on the CPU and calling ``.to()``)
    never holds two copies, is faster on CUDA, and works under FakeTensorMode, where
    ``.to()`` would have to swap tensors."""
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"build_model takes a ModelSpec (resolve_model({spec!r}) first), not {type(spec).__name__}")
    size = image_size or spec.default_image_size
    return build_in_place(lambda: spec.build(num_classes=spec.num_classes, image_size=size), device, dtype)


def build_model_from(template: nn.Module, spec: ModelSpec, image_size: int | None = None,
                     device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> nn.Module:
    """``build_model(spec, image_size, device, dtype)`` with the values of ``template`` (a model that
    call made before) instead of new random ones: the model is built the same way, its tensors
    allocated in the same order and sizes, with the initialisers' random draws skipped
    (``_initialisers_skipped(every=True)``), and every parameter and buffer then copied from
    ``template`` in place. On a CPU the draws are most of a small model's build: AlexNet's 61 M
    weights take about as long to draw in fp16 as its forward takes to run. Raises ValueError if
    ``template``'s parameters and buffers are not the new model's (names, shapes, dtypes)."""
    with _initialisers_skipped(every=True):
        net = build_model(spec, image_size, device, dtype)
    mine = [*net.named_parameters(remove_duplicate=False), *net.named_buffers(remove_duplicate=False)]
    theirs = [*template.named_parameters(remove_duplicate=False), *template.named_buffers(remove_duplicate=False)]
    if [(n, t.shape, t.dtype) for n, t in mine] != [(n, t.shape, t.dtype) for n, t in theirs]:
        raise ValueError(f"the template is not a {spec.name} built with these settings: build it with build_model")
    with torch.no_grad():
        for (_, t), (_, s) in zip(mine, theirs):
            t.copy_(s)
    return net


def build_in_place(build: Callable[[], nn.Module], device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> nn.Module:
    """``build()`` with ``device`` as the default device and ``dtype`` as the default dtype.

    Shapes only (``device="meta"``, or inside a ``FakeTensorMode``): a builder that computes
    with tensors while it builds (torchvision's RegNet turns a tensor of widths into a list
    with ``.tolist()``) cannot run there; it is built again as a *skeleton*, its small
    computations on the CPU and every parameter and buffer moved to the meta device as it is
    registered, and then given empty storages on the target (fake tensors under a fake mode)."""
    shapes_only = active_fake_mode() is not None or (device is not None and torch.device(device).type == "meta")
    try:
        with _defaults(device, dtype), (_initialisers_skipped() if shapes_only else contextlib.nullcontext()), \
                (_FakeDeepcopy() if active_fake_mode() is not None else contextlib.nullcontext()):
            return build()
    except Exception:
        fake = active_fake_mode()
        if not (fake is not None or (device is not None and torch.device(device).type == "meta")):
            raise
    skeleton = build_skeleton(build, dtype)
    if fake is None:
        return skeleton
    return materialize(skeleton, device or "cpu")


@contextlib.contextmanager
def _defaults(device, dtype):
    with contextlib.ExitStack() as stack:
        if device is not None:
            stack.enter_context(torch.device(device))
        if dtype is not None and dtype != torch.get_default_dtype():
            stack.enter_context(_default_dtype(dtype))
        yield


def active_fake_mode():
    """The ``FakeTensorMode`` in force, or None."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


# The tensor methods that only write values: what torch.nn.init's initialisers end in
# (uniform_ / normal_ for kaiming, xavier and the rest, fill_ / zero_ for constant_, ones_,
# zeros_; torch/nn/init.py), and what builders call directly (ViT's ``.normal_()``).
_VALUE_WRITERS = ("uniform_", "normal_", "fill_", "zero_")


def _without_values(t) -> bool:
    """A tensor with no values to write: on meta, or fake with no constant behind it (a fake
    tensor made by ``torch.tensor(...)`` keeps its real value, which ``.item()`` reads)."""
    from torch._subclasses.fake_tensor import FakeTensor
    if isinstance(t, FakeTensor):
        return t.constant is None
    return isinstance(t, torch.Tensor) and t.is_meta


def _skipping(name: str, write, every: bool = False):
    def skip_or_write(self, *args, **kwargs):
        if ((every or _without_values(self)) and not (self.requires_grad and torch.is_grad_enabled())
                and not any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values()))):
            return self
        return write(self, *args, **kwargs)
    skip_or_write.__name__ = name
    skip_or_write.__wrapped__ = write
    return skip_or_write


class _FakeDeepcopy(torch.overrides.TorchFunctionMode):
    """``copy.deepcopy`` of a fake tensor while a model is built under a fake mode
    (``nn.TransformerEncoder`` deep-copies its layer ``num_layers`` times). torch's
    ``Tensor.__deepcopy__`` copies a fake tensor through its storage, which gives a fake tensor of
    a fake mode of its own, and the first forward then stops with "Mixing fake modes NYI". Here
    the copy is a new empty tensor of the same shape, strides, dtype and device under the fake
    mode in force (a parameter stays a parameter, with its ``requires_grad``); the memo keeps a
    tensor shared inside the copied module shared in the copy."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor
        if func is torch.Tensor.__deepcopy__ and isinstance(args[0], FakeTensor):
            t, memo = args
            if id(t) not in memo:
                with torch.no_grad():
                    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
                if isinstance(t, nn.Parameter) or getattr(t, "_is_param", False):
                    out = nn.Parameter(out, requires_grad=t.requires_grad)
                memo[id(t)] = out
            return memo[id(t)]
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _initialisers_skipped(every: bool = False) -> Iterator[None]:
    """While a model is built on fake tensors or meta, writing random or constant values into
    a tensor that has none does nothing but cost time: on fake tensors each ``uniform_`` of a
    new shape is a FakeTensorMode cache miss that decomposes into several ops (about 5 ms per
    conv layer), on meta a Python meta kernel; torch itself returns early for meta tensors in
    ``_no_grad_trunc_normal_`` (torch/nn/init.py). For the duration, ``Tensor.uniform_``,
    ``normal_``, ``fill_`` and ``zero_`` with numbers as arguments return such a tensor as the
    op would (in place: the same tensor, the same storage, nothing allocated, so the tracker
    sees exactly what it saw before); the initialisers' own checks (fan-in of a 1-d tensor,
    zero-element warnings) still run. A write the op would refuse (in place on a tensor that
    requires grad, outside ``no_grad``), a real tensor, or a fake tensor holding a constant
    goes through. A patch of the methods, not a ``TorchFunctionMode``: a mode is switched off
    while it handles a call, so the ``uniform_`` inside ``nn.init.kaiming_uniform_`` (itself
    dispatched to the mode) would escape it. ``every``: real tensors too, whose values are then
    whatever their new storage held (``build_model_from`` writes them afterwards)."""
    saved = {name: torch.Tensor.__dict__.get(name) for name in _VALUE_WRITERS}
    for name in _VALUE_WRITERS:
        setattr(torch.Tensor, name, _skipping(name, getattr(torch.Tensor, name), every))
    try:
        yield
    finally:
        for name, own in saved.items():
            if own is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, own)


def build_skeleton(build: Callable[[], nn.Module], dtype: torch.dtype | None = None) -> nn.Module:
    """The module ``build()`` makes, with every parameter and buffer on the meta device: built
    outside any fake mode with the CPU as default device, each tensor moved to meta when it is
    registered (before initialisers touch it, which then write nothing: ``_initialisers_skipped``),
    so it costs no memory at any size."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily(), _registered_on_meta(), _defaults(None, dtype), _initialisers_skipped():
        return build()


@contextlib.contextmanager
def _registered_on_meta():
    register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def on_meta_parameter(self, name, param):
        register_parameter(self, name, param)
        p = self._parameters.get(name)
        if p is not None and p.device.type != "meta":
            self._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    def on_meta_buffer(self, name, tensor, persistent=True):
        register_buffer(self, name, tensor, persistent)
        b = self._buffers.get(name)
        if b is not None and b.device.type != "meta":
            self._buffers[name] = b.to("meta")

    nn.Module.register_parameter, nn.Module.register_buffer = on_meta_parameter, on_meta_buffer
    try:
        yield
    finally:
        nn.Module.register_parameter, nn.Module.register_buffer = register_parameter, register_buffer


def materialize(module: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """Give every parameter and buffer of ``module`` an empty storage on ``device`` (in place,
    same shapes, dtypes and ``requires_grad``): under a ``FakeTensorMode`` these are fake
    tensors. The values are uninitialised: for memory questions, not for training quality."""
    # A parameter shared by two modules (tied weights: an LM head and its embedding) must stay one
    # parameter: ``_apply`` gives each module its own new ``nn.Parameter`` around the new storage,
    # which would make two gradients and two sets of optimizer state. Note where each is held,
    # then put the first new object back in every place the old one was.
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((m, name))
    made: dict[int, torch.Tensor] = {}   # and a storage shared by two tensors stays shared

    def storage_for(t: torch.Tensor) -> torch.Tensor:   # made once: a tied weight is not allocated twice
        if id(t) not in made:
            made[id(t)] = torch.empty(t.shape, dtype=t.dtype, device=device)
        return made[id(t)]
    module._apply(storage_for)
    for places in slots.values():
        if len(places) > 1:
            first = places[0][0]._parameters[places[0][1]]
            for m, name in places[1:]:
                m._parameters[name] = first
    return module


_MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    # torch.set_default_dtype takes only these; float8 passes is_floating_point but raises
    # TypeError there ("couldn't find storage object Float8_e4m3fnStorage").
    if dtype not in _MODEL_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in _MODEL_DTYPES)
        raise ValueError(f"models are built in a floating-point dtype ({names}), not {dtype}")
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def check_image_size(spec: ModelSpec, image_size: int, batch: int | None = None) -> None:
    """Raise ``ValueError`` if the model cannot take images of this size, naming the
    smallest size that works. With ``batch``, also check a *training* forward at that batch:
    batch norm in training needs more than one value per channel, so a small image at
    batch 1 can pass inference and fail training. Runs on the meta device: shapes only."""
    if image_size < 1:
        raise ValueError(f"image size must be a positive integer, got {image_size}")
    if not _meta_forward_ok(spec, image_size):
        hi = _smallest_size(spec, image_size, 1, False)
        raise ValueError(f"image size {image_size} is too small for {spec.name}: use {hi} or more (--image-size {hi})")
    if batch is not None and not _meta_forward_ok(spec, image_size, batch, True):
        hi = _smallest_size(spec, image_size, batch, True)
        raise ValueError(
            f"image size {image_size} is too small for training {spec.name} at batch {batch}: its last "
            f"feature maps shrink to one value per channel, and batch norm needs more than one in "
            f"training; use an image size of {hi} or more (--image-size {hi}), or a larger batch")


def _smallest_size(spec: ModelSpec, too_small: int, batch: int, train: bool) -> int:
    """The smallest image size above ``too_small`` that works (these models accept every
    size above it), by doubling then bisection."""
    lo, hi = too_small, max(2 * too_small, 8)
    while not _meta_forward_ok(spec, hi, batch, train):
        hi *= 2
        if hi > 4096:
            raise ValueError(f"model {spec.name} rejects image size {too_small}")
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _meta_forward_ok(spec, mid, batch, train) else (mid, hi)
    return hi


@functools.lru_cache(maxsize=512)
def _meta_forward_ok(spec: ModelSpec, image_size: int, batch: int = 1, train: bool = False) -> bool:
    # cached: a model's shape rules never change, and every training_step / breakdown /
    # sweep point asks again (a VGG16 meta forward costs ~20 ms)
    model = _meta_model(spec.build, spec.num_classes, image_size)
    x = torch.empty(batch, 3, image_size, image_size, device="meta")
    try:
        with torch.no_grad(), shape_kernels():
            model.train(train)(x)
        return True
    except (RuntimeError, ValueError, AssertionError):  # shape errors; batch norm's "more than 1 value per
        # channel"; ViT's torch._assert("Wrong image height!")
        return False


@functools.lru_cache(maxsize=2)
def _meta_model(build: Callable[..., nn.Module], num_classes: int, image_size: int) -> nn.Module:
    """One model on meta for the size checks of a spec at one image size: the checks in eval at
    batch 1 and in training at the run's batch follow each other, and a model of a large
    registry entry takes a quarter of a second to build even on meta. Shared between checks
    that only switch it between train and eval (meta tensors hold no values to change)."""
    return build_in_place(lambda: build(num_classes=num_classes, image_size=image_size), "meta")
