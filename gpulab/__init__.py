"""gpulab: see where GPU memory goes in PyTorch."""
__version__ = "0.1.0"
