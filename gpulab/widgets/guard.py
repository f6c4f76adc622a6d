"""The memory guard: before a cpu or cuda run, the fake engine predicts the peak; if it
would not fit in free memory, the panel does not run and says why, offering the fake engine."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..engines import choose_engine
from ..units import format_bytes
from .base import GuardVerdict

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
    return int(avail * RAM_MARGIN), f"{int(RAM_MARGIN * 100)}% of the RAM available now"


def memory_guard(predict_peak: Callable[[dict[str, Any]], int], engine_key: str = "engine") -> Callable:
    """A guard for ``Panel``: ``predict_peak(params)`` should run the experiment on the fake
    engine and return its peak in bytes. Runs on the fake engine are always allowed."""
    def guard(params: dict[str, Any]) -> GuardVerdict:
        engine = choose_engine(params.get(engine_key, "auto")).name
        if engine == "fake":
            return GuardVerdict(True)
        peak = predict_peak(params)
        free, what = free_memory(engine)
        if peak <= free:
            return GuardVerdict(True)
        return GuardVerdict(False,
                            f"<b>Not run:</b> the fake engine predicts a peak of <b>{format_bytes(peak)}</b> "
                            f"(fake tensors, no compute), more than the {format_bytes(free)} a run may use on the "
                            f"<b>{engine}</b> engine ({what}). Running it would run out of memory. Choose a smaller "
                            f"batch or image, or switch to the <b>fake</b> engine, which answers the same "
                            f"question without allocating anything.",
                            suggestion={engine_key: "fake"} if engine_key in params else None)
    return guard
