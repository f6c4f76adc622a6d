"""Any model as a *workload*: how to build it, what one batch of its inputs is, and its loss.

``resolve_workload(model, ...)`` turns what a user has into a ``Workload``:

* a registered name: a lesson model or any torchvision classification model (``resnet50``,
  ``torchvision:resnet50``): images in, class logits out, cross-entropy against random labels;
* ``hf:NAME`` (a built-in transformer config, ``gpulab.models.hf_configs``) or a
  ``transformers.PretrainedConfig``: a causal language model built from the config (random
  weights, nothing downloaded), token ids of ``seq_len`` in, the model's own LM loss;
* an ``nn.Module`` instance: copied for every run (gpulab never trains your module), or on the
  fake engine rebuilt as fake tensors of the same shapes;
* a zero-argument callable that builds the module: called on the run's device (under fake
  tensors on the fake engine, so an 8B model costs no RAM).

Inputs: example tensors (a tensor, a tuple/list of them, or a dict of keyword arguments) are
*templates*: fresh random tensors of their dtypes and shapes, with the first dimension set to
the batch, are made on the run's device. A callable ``inputs(batch)`` makes them itself (it is
called with the run's device as default device). Otherwise ``input_shape`` (without the batch
dimension) gives a float input, and failing that the input is read off the module: token ids
for a transformers model or a first ``nn.Embedding``, images for a first ``nn.Conv2d``,
vectors for a first ``nn.Linear``.

Loss: a ``loss(output)`` callable returning a scalar, or by default cross-entropy against random
class labels on the output's logits (the first tensor of a tuple, ``.logits`` of a model
output; a transformers model's own ``.loss`` when it computed one).
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from gpulab.models import hf_configs
from gpulab.models.registry import ModelSpec, build_in_place, build_skeleton, check_image_size, close_model_names, is_model_name, materialize, resolve_model
from gpulab.units import dtype_name

__all__ = [
    "Batch", "DEFAULT_MODULE_IMAGE_SIZE", "DEFAULT_MODULE_SEQ_LEN", "DEFAULT_SEQ_LEN", "KINDS",
    "Workload", "copy_module", "default_loss", "forward", "image_workload", "logits_of", "loss_of",
    "resolve_workload", "step_failed"
]

KINDS = ("image", "tokens", "module")
DEFAULT_SEQ_LEN = 512
DEFAULT_MODULE_IMAGE_SIZE = 224
DEFAULT_MODULE_SEQ_LEN = 128

Batch = tuple[tuple[Any, ...], dict[str, Any]]   # positional and keyword arguments of forward


@dataclass(frozen=True)
class Workload:
    """A model and what one training step feeds it. ``build(device, dtype)`` makes a fresh
    module on ``device`` (a fake mode in force makes it fake); ``inputs(batch)`` makes one
    batch on the current default device; ``loss(output, batch)`` gives the scalar to
    backpropagate."""
    name: str
    kind: str
    description: str
    default_batch: int
    build: Callable[[torch.device | str, torch.dtype | None], nn.Module]
    inputs: Callable[[int, torch.dtype | None], Batch]
    loss: Callable[[Any, Batch], torch.Tensor]
    input_text: str                     # what ``inputs`` makes, for messages ("token ids (B, 512) int64")
    spec: ModelSpec | None = None       # registered image models: the registry's entry
    image_size: int | None = None
    seq_len: int | None = None
    source: str = ""                    # where a config came from
    config: Any = None                  # a transformer's config
    make: Callable[[torch.dtype | None], nn.Module] | None = None   # the model, unplaced (None: an instance)
    facts: hf_configs.ConfigFacts | None = None   # a transformer's: what its config says, read once

    def describe_input(self, batch: int) -> str:
        return re.sub(r"\bB\b", str(batch), self.input_text)   # every B: the inputs' and the labels' shapes

    def parameter_counts(self, dtype: torch.dtype | None = None) -> tuple[int, int]:
        """(parameters, trainable parameters) of the model as ``build`` makes it, on the meta device
        (shapes only, nothing allocated)."""
        with torch.device("meta"):
            params = list(self.build(torch.device("meta"), dtype).parameters())
        return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def resolve_workload(model: Any, inputs: Any = None, *, batch: int | None = None,
                     input_shape: tuple[int, ...] | None = None, seq_len: int | None = None,
                     image_size: int | None = None, loss: Callable | None = None) -> Workload:
    """What ``gpulab.step`` / ``gpulab.fit`` run, from whatever the user has (module docstring).
    Bad input raises ``ValueError`` saying what was tried and how to pass it instead."""
    if loss is not None and not callable(loss):
        raise ValueError(f"loss must be a callable loss(output) -> scalar tensor, got {type(loss).__name__}")
    if isinstance(model, Workload):
        return model
    if isinstance(model, (str, ModelSpec)):
        key = model if isinstance(model, ModelSpec) else str(model).strip()
        if isinstance(key, str) and key.lower().startswith(hf_configs.HF_PREFIX):
            _no_image_size(key, image_size)
            return _language_workload(*hf_configs.resolve(key), inputs, seq_len, loss)
        if isinstance(key, str) and not is_model_name(key):
            raise ValueError(_unknown_name(key))
        spec = resolve_model(key)
        if seq_len is not None:   # an image model's input is sized by image_size; a length would go unused
            raise ValueError(f"seq_len {seq_len!r} (--seq-len) sizes a language model's token ids, but {spec.name} "
                             f"takes images: leave it out, and size the images with image_size (--image-size; "
                             f"default {spec.default_image_size})")
        if inputs is not None or input_shape is not None or loss is not None:
            return _module_workload(spec.name, lambda: spec.build(num_classes=spec.num_classes,
                                                                  image_size=image_size or spec.default_image_size),
                                    None, inputs, input_shape, seq_len, image_size or spec.default_image_size, loss,
                                    spec.description)
        return image_workload(spec, image_size, batch)
    if image_size is not None and hf_configs.is_config(model):   # refused before the config is checked
        _no_image_size(f"{hf_configs.HF_PREFIX}{getattr(model, 'model_type', 'config')}", image_size)
    if (resolved := hf_configs.resolve(model)) is not None:   # a transformers config
        return _language_workload(*resolved, inputs, seq_len, loss)
    if isinstance(model, nn.Module):
        return _module_workload(type(model).__name__, None, model, inputs, input_shape, seq_len, image_size, loss,
                                f"your {type(model).__name__} (copied for each run, never changed)")
    if callable(model):
        name = getattr(model, "__name__", type(model).__name__)
        return _module_workload(name, model, None, inputs, input_shape, seq_len, image_size, loss,
                                f"the module {name}() builds")
    raise ValueError(f"cannot use {type(model).__name__} as a model: pass a model name (e.g. 'resnet50', "
                     f"'hf:gpt2'), a transformers config, an nn.Module, or a function that builds one")


def _no_image_size(name: str, image_size: int | None) -> None:
    """A language model's input is token ids: an image size given for it would go unused."""
    if image_size is not None:
        raise ValueError(f"image_size {image_size!r} (--image-size) sizes an image model's input, but {name} is a "
                         f"language model that takes token ids: leave it out, and give the tokens per sequence "
                         f"with seq_len (--seq-len)")


def _unknown_name(name: str) -> str:
    close = close_model_names(name) + hf_configs.close_names(name)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return (f"unknown model {name!r}{hint}; valid: a lesson model (vgg16, alexnet, resnet18, mlp, cnn), any "
            f"torchvision classification model (resnet50 or torchvision:resnet50), a built-in transformer "
            f"config ({', '.join(hf_configs.HF_PREFIX + n for n in hf_configs.hf_names())}), a transformers config, "
            f"an nn.Module, or a function that builds one")


# --- image models from the registry -------------------------------------------------------------

def image_workload(spec: ModelSpec, image_size: int | None = None, batch: int | None = None) -> Workload:
    """A registered image classifier: (B, 3, S, S) images in the model's dtype and int64
    labels; cross-entropy on the logits (the first output of GoogLeNet / Inception's tuples)."""
    size = image_size or spec.default_image_size
    check_image_size(spec, size, batch)

    def build(device, dtype):
        return build_in_place(lambda: spec.build(num_classes=spec.num_classes, image_size=size), device, dtype)

    def inputs(b: int, dtype):
        x = torch.randn(b, 3, size, size, dtype=dtype)
        y = torch.randint(0, spec.num_classes, (b,))
        return (x,), {"_labels": y}

    def ce(output, data):
        return nn.functional.cross_entropy(logits_of(output), data[1]["_labels"])

    return Workload(spec.name, "image", spec.description, spec.default_batch, build, inputs, ce,
                    f"images (B, 3, {size}, {size}) and int64 labels (B,)", spec=spec, image_size=size,
                    make=lambda dtype: spec.build(num_classes=spec.num_classes, image_size=size))


def logits_of(output: Any) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, ``.logits`` of a model output, or the
    first tensor of a tuple (GoogLeNet's and Inception's auxiliary outputs in training)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, torch.Tensor):
                return item
    raise ValueError(f"the model returned {type(output).__name__}, with no tensor of logits in it: pass "
                     f"loss=lambda output: ... returning a scalar tensor")


def default_loss(output: Any, data: Batch) -> torch.Tensor:
    """The model's own loss when it computed one (transformers with ``labels``), else
    cross-entropy of the logits' last dimension against random class labels."""
    own = getattr(output, "loss", None)
    if isinstance(own, torch.Tensor) and own.dim() == 0:
        return own
    logits = logits_of(output)
    if logits.dim() < 2 or not logits.is_floating_point():
        raise ValueError(f"the default loss is cross-entropy over the output's last dimension, but the output is a "
                         f"{dtype_name(logits.dtype)} tensor of shape {tuple(logits.shape)}: pass "
                         f"loss=lambda output: ... returning a scalar tensor")
    flat = logits.reshape(-1, logits.shape[-1])
    target = torch.randint(0, flat.shape[-1], (flat.shape[0],), device=flat.device)
    return nn.functional.cross_entropy(flat, target)


# --- transformers ---------------------------------------------------------------------------------

def _language_workload(config, facts: hf_configs.ConfigFacts, inputs, seq_len: int | None, loss) -> Workload:
    """A transformer's workload from its config, checked, and the facts ``hf_configs.resolve`` read off it."""
    name, max_len = facts.name, facts.max_positions
    if seq_len is None:
        seq_len = min(DEFAULT_SEQ_LEN, max_len) if max_len else DEFAULT_SEQ_LEN
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"sequence length must be a positive integer, got {seq_len!r}")
    if max_len and seq_len > max_len:
        raise ValueError(f"sequence length {seq_len} is longer than {name} takes ({max_len} positions); "
                         f"use --seq-len {max_len} or less")
    vocab = int(facts.vocab_size)

    def build(device, dtype):
        return build_in_place(lambda: hf_configs.build_model(config, dtype), device, dtype)

    if inputs is not None:
        make, text = _inputs_from(inputs)
    else:
        def make(b: int, dtype):
            ids = torch.randint(0, vocab, (b, seq_len))
            return (), {"input_ids": ids, "labels": ids}
        text = f"token ids (B, {seq_len}) int64, also the labels"
    return Workload(name, "tokens", facts.description, 1, build, make, loss_of(loss), text, seq_len=seq_len,
                    source=facts.source, config=config, make=lambda dtype: hf_configs.build_model(config, dtype),
                    facts=facts)


def loss_of(loss: Callable | None) -> Callable[[Any, Batch], torch.Tensor]:
    if loss is None:
        return default_loss
    return lambda output, data: loss(output)


# --- your module ------------------------------------------------------------------------------------

def _returning_a_module(builder: Callable[[], Any], name: str) -> Callable[[], nn.Module]:
    """``builder``, with a ``ValueError`` when what it returns is not an ``nn.Module``."""
    def build() -> nn.Module:
        module = builder()
        if not isinstance(module, nn.Module):
            shown = repr(module)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            got = "None (no return statement?)" if module is None else f"{type(module).__name__} {shown}"
            raise ValueError(f"the builder {name}() must return an nn.Module (the model), but it returned {got}: "
                             f"pass a function that builds and returns the model (e.g. lambda: MyNet()), or the "
                             f"model itself")
        return module
    return build


def _module_workload(name: str, builder: Callable[[], nn.Module] | None, instance: nn.Module | None, inputs,
                     input_shape, seq_len, image_size, loss, description: str) -> Workload:
    if builder is not None:
        builder = _returning_a_module(builder, name)
    if instance is not None:
        def build(device, dtype):
            return copy_module(instance, device, dtype)
        probe = instance
    else:
        def build(device, dtype):
            return build_in_place(builder, device, dtype)
        probe = None
    if inputs is not None:
        make, text = _inputs_from(inputs)
    elif input_shape is not None:
        shape = _shape(input_shape)

        def make(b: int, dtype):
            return (torch.randn(b, *shape, dtype=dtype),), {}
        text = f"a float tensor (B, {', '.join(map(str, shape))})" if shape else "a float tensor (B,)"
    else:
        if probe is None:
            probe = build_skeleton(builder)
        make, text = _inputs_read_off(probe, seq_len, image_size)
    return Workload(name, "module", description, 1, build, make, loss_of(loss), text, seq_len=seq_len,
                    image_size=image_size, make=None if builder is None else lambda dtype: builder())


def step_failed(w: Workload, batch: int, where: str, exc: BaseException) -> str:
    """The one-line message for a model whose training step raised: what was run, with which
    input gpulab made, the model's own error, and how to pass an input instead."""
    what = " ".join(str(exc).split())[:300]
    hint = " (a model that reads tensor values while it runs cannot run on fake tensors: try engine='cpu')" \
        if where == "on the fake engine" else ""
    return (f"a training step of {w.name} failed {where} with the input gpulab made, "
            f"{w.describe_input(batch)}: {type(exc).__name__}: {what}{hint}; pass inputs=<example tensors, or a "
            f"function of the batch size> or input_shape=(...) without the batch dimension, and loss=... if the "
            f"output is not logits")


def copy_module(module: nn.Module, device, dtype: torch.dtype | None) -> nn.Module:
    """A copy of ``module`` on ``device`` (in ``dtype``, if given): a real copy of its values,
    or, under a fake mode or on meta, tensors of the same shapes without copying any data."""
    from gpulab.models.registry import active_fake_mode
    if active_fake_mode() is not None or torch.device(device).type == "meta":
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        with unset_fake_temporarily():
            memo = {id(t): _meta_like(t, dtype) for t in [*module.parameters(), *module.buffers()]}
            skeleton = copy.deepcopy(module, memo)
        return skeleton if torch.device(device).type == "meta" else materialize(skeleton, device)
    # each tensor copied straight onto the device (one new storage each, nothing else: a plain
    # deepcopy would detach the originals, which a tracker would count as the run's memory)
    memo = {id(t): _copy_to(t, device, dtype) for t in [*module.parameters(), *module.buffers()]}
    return copy.deepcopy(module, memo)


def _copy_to(t: torch.Tensor, device, dtype: torch.dtype | None) -> torch.Tensor:
    dt = dtype if dtype is not None and t.is_floating_point() else t.dtype
    c = torch.empty(t.shape, dtype=dt, device=device)
    with torch.no_grad():
        c.copy_(t)
    return nn.Parameter(c, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else c


def _meta_like(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    dt = dtype if dtype is not None and t.is_floating_point() else t.dtype
    m = torch.empty(t.shape, dtype=dt, device="meta")
    return nn.Parameter(m, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else m


def _shape(shape) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    except (TypeError, ValueError):
        raise ValueError(f"input_shape must be a tuple of positive integers (without the batch), got {shape!r}") \
            from None
    if any(d < 1 for d in dims):
        raise ValueError(f"input_shape must be a tuple of positive integers (without the batch), got {shape!r}")
    return dims


def _inputs_from(inputs) -> tuple[Callable[[int, Any], Batch], str]:
    """Example tensors as templates, or a callable ``inputs(batch)``."""
    if callable(inputs) and not isinstance(inputs, torch.Tensor):
        def call(b: int, dtype):
            out = inputs(b)
            return _as_batch(out, "inputs(batch)")
        return call, f"what {getattr(inputs, '__name__', 'inputs')}(B) returns"
    template = _as_batch(inputs, "inputs")
    ranges = {id(t): _int_range(t) for t in [*template[0], *template[1].values()]}   # read now, outside any mode

    def fresh(b: int, dtype):
        args = tuple(_like(t, b, ranges[id(t)]) for t in template[0])
        kwargs = {k: _like(t, b, ranges[id(t)]) for k, t in template[1].items()}
        return args, kwargs
    parts = [_describe(t) for t in template[0]] + [f"{k}={_describe(t)}" for k, t in template[1].items()]
    return fresh, "; ".join(parts)


def _as_batch(obj, what: str) -> Batch:
    if isinstance(obj, torch.Tensor):
        return (obj,), {}
    if isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return (), dict(obj)
    if isinstance(obj, (tuple, list)) and obj and all(isinstance(v, torch.Tensor) for v in obj):
        return tuple(obj), {}
    raise ValueError(f"{what} must be a tensor, a tuple or list of tensors, or a dict of tensors (keyword "
                     f"arguments of forward), got {type(obj).__name__}")


def _like(t: torch.Tensor, batch: int, int_range: tuple[int, int]) -> torch.Tensor:
    """A fresh tensor like ``t`` with its first dimension set to ``batch``: random normal for
    floats, random integers within the template's range (``int_range``)."""
    shape = (batch, *t.shape[1:]) if t.dim() else ()
    if t.is_floating_point():
        return torch.randn(shape, dtype=t.dtype)
    if t.dtype == torch.bool:
        return torch.zeros(shape, dtype=torch.bool)
    lo, hi = int_range
    return torch.randint(lo, hi + 1, shape, dtype=t.dtype)


def _int_range(t: torch.Tensor) -> tuple[int, int]:
    """An integer template's smallest and largest value ((0, 0) for floats, empty or data-less ones)."""
    if t.is_floating_point() or t.dtype == torch.bool or t.numel() == 0 or t.device.type == "meta" \
            or isinstance(t, torch._subclasses.FakeTensor):
        return 0, 0
    return int(t.min()), int(t.max())


def _describe(t: torch.Tensor) -> str:
    dims = ", ".join(["B", *map(str, t.shape[1:])]) if t.dim() else ""
    return f"{dtype_name(t.dtype)} ({dims})"


def _inputs_read_off(module: nn.Module, seq_len: int | None, image_size: int | None
                     ) -> tuple[Callable[[int, Any], Batch], str]:
    """Guess the input from the module: a transformers model or a first Embedding takes token
    ids, a first Conv2d / Conv1d images / sequences, a first Linear vectors."""
    config = getattr(module, "config", None)
    if hf_configs.is_config(config):
        vocab, n = hf_configs.vocab_size(config), seq_len or DEFAULT_MODULE_SEQ_LEN

        def ids(b: int, dtype):
            t = torch.randint(0, vocab, (b, n))
            return (), {"input_ids": t, "labels": t}
        return ids, f"token ids (B, {n}) int64, also the labels (a transformers model)"
    first = next((m for m in module.modules() if any(True for _ in m.parameters(recurse=False))), None)
    where = f"(read off its first layer, {first})" if first is not None else ""
    if isinstance(first, nn.Embedding):
        n, vocab = seq_len or DEFAULT_MODULE_SEQ_LEN, first.num_embeddings

        def tokens(b: int, dtype):
            return (torch.randint(0, vocab, (b, n)),), {}
        return tokens, f"token ids (B, {n}) int64 {where}"
    if isinstance(first, nn.Conv2d):
        s, c = image_size or DEFAULT_MODULE_IMAGE_SIZE, first.in_channels

        def images(b: int, dtype):
            return (torch.randn(b, c, s, s, dtype=dtype),), {}
        return images, f"images (B, {c}, {s}, {s}) {where}"
    if isinstance(first, nn.Conv1d):
        n, c = seq_len or DEFAULT_MODULE_SEQ_LEN, first.in_channels

        def signals(b: int, dtype):
            return (torch.randn(b, c, n, dtype=dtype),), {}
        return signals, f"sequences (B, {c}, {n}) {where}"
    if isinstance(first, nn.Linear):
        d = first.in_features

        def vectors(b: int, dtype):
            return (torch.randn(b, d, dtype=dtype),), {}
        return vectors, f"vectors (B, {d}) {where}"
    raise ValueError(f"cannot tell what input {type(module).__name__} takes {where}: pass inputs=<example "
                     f"tensors, or a function of the batch size> or input_shape=(...) without the batch dimension")


def forward(net: nn.Module, data: Batch):
    """Call ``net`` on one batch (labels that only the default image loss uses are not passed)."""
    args, kwargs = data
    return net(*args, **{k: v for k, v in kwargs.items() if not k.startswith("_")})
