"""What a byte of memory is for: the seven categories every measurement, formula and view uses."""
from __future__ import annotations

from enum import Enum

__all__ = ["CATEGORIES", "Category"]


class Category(str, Enum):
    """What a storage is for. Declaration order is label strength: a storage that gets
    two labels keeps the one declared first."""

    PARAMETERS = "parameters"
    BUFFERS = "buffers"
    INPUTS = "inputs"
    OPTIMIZER_STATE = "optimizer_state"
    GRADIENTS = "gradients"
    ACTIVATIONS = "activations"
    TEMPORARIES = "temporaries"

    def __str__(self) -> str:  # so f-strings show "parameters", not "Category.PARAMETERS"
        return self.value


CATEGORIES: tuple[Category, ...] = tuple(Category)

