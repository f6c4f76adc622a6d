"""gpulab: see where GPU memory goes in PyTorch.

The handful of names a lesson uses; everything else lives in its submodule.
"""
__version__ = "0.1.0"

from .engines import run
from .experiments import breakdown, training_step
from .fit import fit
from .tracking import Category, MemoryTracker
from .trainstep import step
from .units import format_bytes

__all__ = ["Category", "MemoryTracker", "breakdown", "fit", "format_bytes", "run", "step", "training_step"]
