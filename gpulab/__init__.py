"""gpulab: see where GPU memory goes in PyTorch.

The handful of names a lesson uses; everything else lives in its submodule.

The names are loaded on first use (PEP 562): ``from gpulab import step`` imports torch then, while
``import gpulab.cli`` alone does not, so the command checks its arguments before torch loads.
"""
from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:   # for type checkers and editors; at run time __getattr__ below loads them
    from gpulab.categories import Category
    from gpulab.measure.engines import run
    from gpulab.measure.tracking import MemoryTracker
    from gpulab.options import Layout, Recipe
    from gpulab.predict.cards import Card
    from gpulab.predict.breakdown import breakdown
    from gpulab.predict.fit import fit
    from gpulab.predict.serve import serve
    from gpulab.predict.step import step
    from gpulab.units import format_bytes

__version__ = "0.1.0"


def _drop_torchao_enum_notice(record: logging.LogRecord) -> bool:
    """torch 2.15's pytree logs a deprecation notice for each Enum torchao (>= 0.18) registers as a
    constant (torch/utils/_pytree.py, ``register_constant``). transformers imports torchao whenever
    it is installed (quantizers/quantizer_torchao.py), so the notice would land in whichever lesson
    cell first builds a transformers model, once a kernel: noise about two libraries' versions, not
    about memory. Only that message is dropped; every other pytree record passes."""
    return "Calling register_constant() on Enum subclasses is deprecated" not in record.getMessage()


logging.getLogger("torch.utils._pytree").addFilter(_drop_torchao_enum_notice)

# each public name and the module it comes from
_SOURCES = {
    "Card": "gpulab.predict.cards",
    "Category": "gpulab.categories",
    "Layout": "gpulab.options",          # the parallel layout (GPUs, strategy, tp, cp, ep, pp), checked without torch
    "MemoryTracker": "gpulab.measure.tracking",
    "Recipe": "gpulab.options",          # what the training step does (optimizer, dtype, checkpointing, LoRA ...)
    "breakdown": "gpulab.predict.breakdown",
    "fit": "gpulab.predict.fit",
    "format_bytes": "gpulab.units",
    "run": "gpulab.measure.engines",
    "serve": "gpulab.predict.serve",
    "step": "gpulab.predict.step",
}

__all__ = ["Card", "Category", "Layout", "MemoryTracker", "Recipe", "breakdown", "fit", "format_bytes", "run", "serve",
           "step"]


def __getattr__(name: str) -> Any:
    if name in _SOURCES:
        value = getattr(importlib.import_module(_SOURCES[name]), name)
        globals()[name] = value    # once: later look-ups are plain attribute reads
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
