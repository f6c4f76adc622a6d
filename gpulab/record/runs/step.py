"""Lessons 04 and 05's training steps on the GPU, for ``gpulab record``: one entry per model,
batch and optimizer (``StepResult.as_dict()``)."""
from __future__ import annotations

from typing import Any

from gpulab.record.kinds import record_kind

__all__ = ["record_step"]


@record_kind("step")
def record_step(p: dict[str, Any]) -> dict[str, Any]:
    """A tracked training step of a named model on the cuda engine (no guard: the record set is
    sized for any GPU)."""
    from gpulab.predict.step import step
    return step(p["model"], batch=p["batch"], image_size=p["image_size"], optimizer=p["optimizer"],
                dtype=p["dtype"], steps=p["steps"], engine="cuda", guard=False).as_dict()
