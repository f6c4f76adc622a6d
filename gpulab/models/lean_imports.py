"""transformers without two optional packages a memory answer never reads: torchvision and torchao.

Building any transformers model imports ``modeling_utils`` and ``processing_utils``, and through
them, when these packages are installed (transformers 5: ``utils/type_validators.py`` ->
``video_utils`` -> ``image_utils``; ``integrations/finegrained_fp8`` -> ``quantizers`` ->
``quantizer_torchao``):

* torchvision, for ``image_utils``' ``InterpolationMode`` and ``pil_to_tensor`` (image processors);
* torchao, for ``quantizer_torchao``'s safetensors support (loading torchao-quantized checkpoints).

A fake run of a model built from its config uses neither: gpulab builds the model, never an image
processor, never a quantized checkpoint (``--fp8`` imports torchao itself, ``torchvision:`` models
import torchvision themselves). ``skip_unused()`` makes transformers' availability checks for the two
answer False before those modules load, so they are not imported; measured in ``gpulab fit``'s fresh
process (``benchmarks/fit_speed.py``), where their imports cost about 0.3 of the import floor.

For a process that only answers (the CLI), never for a notebook's or a user's: afterwards that
process's transformers has no torchvision-backed image processing and no torchao quantization.
"""
from __future__ import annotations

import sys

__all__ = ["SKIPPED", "skip_unused"]

SKIPPED = ("torchvision", "torchao")
# the transformers modules that bind the checks when they load: once one is loaded it is too late
_BINDERS = ("transformers.image_utils", "transformers.video_utils", "transformers.quantizers.quantizer_torchao")


def _unavailable(*args, **kwargs) -> bool:
    return False


def skip_unused() -> bool:
    """Make transformers' ``is_torchvision_available`` and ``is_torchao_available`` answer False in
    this process (module docstring). False, changing nothing, when transformers' image utilities or
    torchao quantizer are already loaded (their checks are bound) or either package is imported."""
    if any(name in sys.modules for name in _BINDERS + SKIPPED):
        return False
    import transformers.utils
    import transformers.utils.import_utils as import_utils
    for package in SKIPPED:
        for module in (import_utils, transformers.utils):
            setattr(module, f"is_{package}_available", _unavailable)
    return True
