"""The optimizers a training step can use, by name: the one list (``OPTIMIZERS``), the one check
(``check_optimizer``, from ``formulas``, whose state table it matches), and the builders:
``make_optimizer`` (torch's default implementation) and ``build_optimizer`` (for-loop, foreach or
fused, lesson 05)."""
from __future__ import annotations

import inspect
from typing import Any

import torch

from gpulab.formulas import OPTIMIZER_STATES, RECIPE_OPTIMIZERS, check_optimizer
from gpulab.options import check_implementation   # torch-free: IMPL_FLAGS' keys, checked before torch loads
from gpulab.training.eight_bit import AdamW8bit, PagedAdamW8bit

__all__ = [
    "ALL_OPTIMIZERS", "IMPLEMENTATIONS", "IMPL_FLAGS", "OPTIMIZERS", "OPTIMIZER_SPECS", "RECIPE_OPTIMIZERS", "UnsupportedImplementation",
    "build_optimizer", "check_implementation", "check_optimizer", "constructor", "make_optimizer",
]

OPTIMIZERS = tuple(OPTIMIZER_STATES)   # sgd, momentum, adam, adamw, rmsprop, adagrad: the lessons'
ALL_OPTIMIZERS = (*OPTIMIZERS, *RECIPE_OPTIMIZERS)   # what gpulab.step / gpulab.fit / the CLI take

# The hyper-parameters of every optimizer (memory does not depend on them, except momentum,
# which decides whether SGD keeps a buffer).
OPTIMIZER_SPECS: dict[str, tuple[type, dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.01}),
    "momentum": (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 1e-3}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 1e-3}),
    "adagrad": (torch.optim.Adagrad, {"lr": 1e-2}),
    "adafactor": (torch.optim.Adafactor, {"lr": 1e-2}),
    "adamw8bit": (AdamW8bit, {"lr": 1e-3}),              # bitsandbytes' layout (gpulab.training.eight_bit)
    "paged_adamw8bit": (PagedAdamW8bit, {"lr": 1e-3}),
}

# How torch runs the update (torch/optim/optimizer.py, ``_default_to_fused_or_foreach``):
#   for-loop: one small op per parameter tensor at a time (``foreach=False``);
#   foreach:  each op applied to the list of all parameters at once (``torch._foreach_*``);
#             the default on CUDA;
#   fused:    one kernel per group that updates in place (``fused=True``), where supported;
#   default:  what torch picks when neither flag is given (CPU: for-loop, CUDA: foreach).
IMPLEMENTATIONS = ("for-loop", "foreach", "fused")
IMPL_FLAGS = {"default": {}, "for-loop": {"foreach": False}, "foreach": {"foreach": True},
               "fused": {"fused": True}}


class UnsupportedImplementation(ValueError):
    """This optimizer cannot run with this implementation here; the message says why."""


def constructor(name: str, implementation: str) -> tuple[type, dict[str, Any]]:
    """The optimizer class and keyword arguments, or ``UnsupportedImplementation`` when this
    torch's class takes no such flag (e.g. RMSprop has no ``fused``)."""
    key = check_optimizer(name, recipes=True)
    impl = check_implementation(implementation)
    cls, kwargs = OPTIMIZER_SPECS[key]
    flags = IMPL_FLAGS[impl]
    accepted = inspect.signature(cls.__init__).parameters
    for flag in flags:
        if flag not in accepted:
            raise UnsupportedImplementation(
                f"torch {torch.__version__}: {cls.__name__} has no {impl} implementation "
                f"(its constructor takes no '{flag}' argument)")
    return cls, {**kwargs, **flags}


def build_optimizer(name: str, params, implementation: str = "default") -> torch.optim.Optimizer:
    """``torch.optim`` optimizer ``name`` (see ``gpulab.training.optimizers.OPTIMIZERS``) over ``params``,
    using the given implementation. Raises ``UnsupportedImplementation`` where this torch has no
    such implementation for this optimizer (e.g. RMSprop has no ``fused``) or refuses it for
    these parameters (e.g. ``fused`` on a device without fused kernels)."""
    cls, kwargs = constructor(name, implementation)
    try:
        return cls(params, **kwargs)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise UnsupportedImplementation(f"torch {torch.__version__} refuses {cls.__name__}({implementation}) "
                                        f"here: {exc}") from exc


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    """``torch.optim`` optimizer ``name`` over ``params`` as torch builds it by default (no
    implementation flag: for-loop on the CPU, foreach on CUDA)."""
    cls, kwargs = constructor(name, "default")
    return cls(params, **kwargs)
