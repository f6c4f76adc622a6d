"""The panels' memory guard: before a cpu or cuda run, the fake engine predicts the peak; if it
would not fit in free memory (``gpulab.predict.guard``, shared with the API and the CLI), the panel does
not run and says why, offering the fake engine."""
from __future__ import annotations

from typing import Any, Callable

from gpulab.measure.engines import choose_engine
from gpulab.predict.guard import GPU_MARGIN, RAM_MARGIN, cuda_free_for_run, free_memory
from gpulab.units import format_bytes
from gpulab.widgets.base import GuardVerdict

__all__ = ["memory_guard"]


def memory_guard(predict_peak: Callable[[dict[str, Any]], int], engine_key: str = "engine",
                 resolve: Callable[[dict[str, Any]], str] | None = None) -> Callable:
    """A guard for ``Panel``: ``predict_peak(params)`` should run the experiment on the fake
    engine and return its peak in bytes. Runs on the fake engine are always allowed.
    ``resolve(params)``: the engine the panel's experiment will run on, where it chooses from its own
    prediction (``auto`` picks the fake engine for a large run); by default ``choose_engine`` of the
    engine control alone."""
    def guard(params: dict[str, Any]) -> GuardVerdict:
        engine = resolve(params) if resolve is not None else choose_engine(params.get(engine_key, "auto")).name
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
