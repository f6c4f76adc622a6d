"""Widget panels, one module per panel, all built on ``gpulab.widgets.base.Panel``."""
from .base import GuardVerdict, Panel
from .step import step_panel

__all__ = ["GuardVerdict", "Panel", "step_panel"]
