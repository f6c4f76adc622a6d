"""The optimizers a training step can use, by name: one list, one check, one builder."""
from __future__ import annotations

import torch

__all__ = ["OPTIMIZERS", "make_optimizer"]

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "rmsprop", "adagrad")


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    key = str(name).lower()
    if key == "sgd":
        return torch.optim.SGD(params, lr=0.01)
    if key == "momentum":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    if key == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    if key == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    if key == "rmsprop":
        return torch.optim.RMSprop(params, lr=1e-3)
    if key == "adagrad":
        return torch.optim.Adagrad(params, lr=1e-2)
    raise ValueError(f"unknown optimizer {name!r}; valid optimizers: {', '.join(OPTIMIZERS)}")


