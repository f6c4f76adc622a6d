"""The memory guard: a real run (cpu or cuda engine) starts only when the fake engine's
predicted peak fits in the memory that run may use. The panels, ``gpulab.step`` and the
``gpulab`` command share it, so a run that would not fit is refused with the same numbers
everywhere, instead of swapping the machine to a halt or waking the kernel's OOM killer."""
from __future__ import annotations

import torch

from gpulab.units import format_bytes

__all__ = ["GPU_MARGIN", "RAM_MARGIN", "check_fits", "cuda_free_for_run", "free_memory", "refusal"]

RAM_MARGIN = 0.7   # use at most 70% of the RAM that is available right now
GPU_MARGIN = 0.10  # keep 10% of what a GPU run could use in reserve (kernels' workspaces, rounding)


def cuda_free_for_run(free: int, reserved: int, allocated: int, margin: float = GPU_MARGIN) -> tuple[int, str]:
    """(bytes a cuda run may use, the sum that gave it). What the allocator can give a run is the
    device's free memory plus what it has cached but not allocated (reserved − allocated: free
    blocks it reuses before asking the driver), less a safety margin."""
    cached = max(0, reserved - allocated)
    usable = int((free + cached) * (1 - margin))
    return usable, (f"{format_bytes(free)} free on the GPU (cudaMemGetInfo) + {format_bytes(cached)} cached by "
                    f"PyTorch's allocator (reserved {format_bytes(reserved)} − allocated {format_bytes(allocated)}) "
                    f"− a {int(round(100 * margin))}% safety margin = {format_bytes(usable)}")


def free_memory(engine: str) -> tuple[int, str]:
    """(bytes free for an experiment, what that number is, with the numbers it used) on the
    engine's device."""
    if engine == "cuda":
        free, _total = torch.cuda.mem_get_info()
        return cuda_free_for_run(int(free), int(torch.cuda.memory_reserved()), int(torch.cuda.memory_allocated()))
    import psutil
    avail = psutil.virtual_memory().available
    return int(avail * RAM_MARGIN), (f"{int(RAM_MARGIN * 100)}% of the {format_bytes(avail)} of RAM available "
                                     f"now = {format_bytes(int(avail * RAM_MARGIN))}")


def refusal(peak: int, engine: str, free: int, what: str) -> str:
    """The one-line reason a real run is not started (plain text; the panels add markup)."""
    return (f"not run: the fake engine predicts a peak of {format_bytes(peak)} (fake tensors, no compute), more "
            f"than the {format_bytes(free)} a run may use on the {engine} engine ({what}); use a smaller batch or "
            f"input, or the fake engine (engine='fake', --engine fake), which answers without allocating anything")


def check_fits(peak: int, engine: str) -> str | None:
    """None when a predicted ``peak`` fits what a run on ``engine`` may use, else the refusal."""
    free, what = free_memory(engine)
    return None if peak <= free else refusal(peak, engine, free, what)
