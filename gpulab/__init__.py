"""gpulab: see where GPU memory goes in PyTorch.

The handful of names a lesson uses; everything else lives in its submodule.
"""
__version__ = "0.1.0"

from gpulab.measure.engines import run
from gpulab.predict.breakdown import breakdown
from gpulab.predict.fit import fit
from gpulab.predict.serve import serve
from gpulab.categories import Category
from gpulab.measure.tracking import MemoryTracker
from gpulab.predict.step import step
from gpulab.units import format_bytes

__all__ = ["Category", "MemoryTracker", "breakdown", "fit", "format_bytes", "run", "serve", "step"]
