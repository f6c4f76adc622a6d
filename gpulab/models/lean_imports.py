"""transformers without two optional packages a memory answer never reads: torchvision and torchao;
peft without bitsandbytes and torchao.

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

peft (LoRA and QLoRA candidates, ``models.lora.import_peft``) imports bitsandbytes at its own import
(``peft/helpers.py``: ``import bitsandbytes as bnb`` in a try), and bitsandbytes' import compiles its
CPU ops with ``torch.compile`` (``bitsandbytes/backends/default/ops.py``, ``_try_torch_compile``), which
imports ``torch._inductor.compile_fx``; wrapping a layer, peft imports torchao to ask whether its weight
is a torchao tensor (``peft/tuners/lora/torchao.py``, ``dispatch_torchao``). gpulab's LoRA wraps plain
``nn.Linear`` layers and its own ``QuantizedLinear`` (``models.quantized``), never bitsandbytes' layers,
and no layer or weight can be bitsandbytes' or torchao's before that package is imported. ``lean_peft()``,
around peft's first import in a process where ``skip_unused`` ran, makes bitsandbytes unimportable for
that import (peft's ``helpers.bnb`` is None) and afterwards lets it import again, and makes peft's
checks for bitsandbytes and torchao (``is_bnb_available``, ``is_bnb_4bit_available``,
``is_torchao_available``) answer False while the package is not imported (``--fp8`` imports torchao
first: then peft's own check answers). Measured: peft's import 1.4 s -> 0.2 s CPU, and neither
bitsandbytes' import (with ``torch._inductor``'s) nor torchao's (0.5 s) made when a layer is wrapped.

For a process that only answers (the CLI), never for a notebook's or a user's: afterwards that
process's transformers has no torchvision-backed image processing and no torchao quantization, and
its peft adapts no bitsandbytes layer.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator

__all__ = ["SKIPPED", "lean_peft", "skip_unused"]

SKIPPED = ("torchvision", "torchao")
# the transformers modules that bind the checks when they load: once one is loaded it is too late
_BINDERS = ("transformers.image_utils", "transformers.video_utils", "transformers.quantizers.quantizer_torchao")
_ANSWERING: list[bool] = [False]   # skip_unused ran: this process only answers (lean_peft acts)


def _unavailable(*args, **kwargs) -> bool:
    return False


def skip_unused() -> bool:
    """Make transformers' ``is_torchvision_available`` and ``is_torchao_available`` answer False in
    this process (module docstring). False, changing nothing, when transformers' image utilities or
    torchao quantizer are already loaded (their checks are bound) or either package is imported.
    Either way ``lean_peft`` then acts in this process (module docstring)."""
    _ANSWERING[0] = True
    if any(name in sys.modules for name in _BINDERS + SKIPPED):
        return False
    import transformers.utils
    import transformers.utils.import_utils as import_utils
    for package in SKIPPED:
        for module in (import_utils, transformers.utils):
            setattr(module, f"is_{package}_available", _unavailable)
    return True


# peft's availability checks (peft/import_utils.py) that import a package or ask for it where a layer is
# wrapped (peft/tuners/lora/model.py ``_create_new_module``: the bitsandbytes dispatchers; peft/tuners/lora/
# torchao.py ``dispatch_torchao``), and that package: with it not imported, no layer or weight can be its
_PEFT_CHECKS = {"is_bnb_available": "bitsandbytes", "is_bnb_4bit_available": "bitsandbytes",
                "is_torchao_available": "torchao"}


@contextlib.contextmanager
def lean_peft() -> Iterator[None]:
    """Around peft's first import (``models.lora.import_peft``): in a process where ``skip_unused`` ran,
    peft imported without bitsandbytes, and its checks for bitsandbytes and torchao answering False while
    the package is not imported (module docstring); elsewhere, or once peft is imported, nothing changes."""
    if not _ANSWERING[0] or "peft" in sys.modules:
        yield
        return
    blocked = "bitsandbytes" not in sys.modules
    if blocked:   # ``import bitsandbytes`` raises ImportError (peft.helpers' bnb is None)
        sys.modules["bitsandbytes"] = None
    try:
        yield
    finally:
        if blocked and "bitsandbytes" in sys.modules and sys.modules["bitsandbytes"] is None:
            del sys.modules["bitsandbytes"]
    checks = sys.modules.get("peft.import_utils")
    for name, package in _PEFT_CHECKS.items():
        peft_check = getattr(checks, name, None)
        if not callable(peft_check):
            continue
        guarded = _when_imported(package, peft_check)
        for module in [m for n, m in list(sys.modules.items()) if n.split(".")[0] == "peft" and m is not None]:
            if getattr(module, name, None) is peft_check:   # each module that bound it, and peft.import_utils
                setattr(module, name, guarded)


def _when_imported(package: str, check):
    def guarded() -> bool:
        return sys.modules.get(package) is not None and check()
    return guarded
