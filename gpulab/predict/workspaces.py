"""cuDNN's convolution workspaces from runs recorded on a real card, for the fake engine's answers.

A fake run counts tensors; what cuDNN allocates through the caching allocator for its convolution
algorithms (``at::native::run_conv_plan``) depends on the algorithm it picks on that card at run
time, so the fake engine cannot predict it. Where the question is about the card a record was made
on, and that record holds a training step of the same model, batch, dtype, image size and
optimizer, the recorded figure is added at the peak, labelled with its provenance ("recorded on
NVIDIA H200, 2026-11-26, torch 2.11.0+cu130"); anywhere else the answer says "cuDNN workspaces:
not predicted" (``NOT_PREDICTED``).

The recorded figure is the step's ``beyond_tensors`` (``measure.engines.beyond_tensors``: the
allocator's peak beyond the live tensors' blocks) less what the run kept allocated after it
(``kept_after_run``: cuBLAS's workspaces, made by the first matmul of the process, which
``predict.cards.Card.workspace_bytes`` counts apart); never below zero.

``predict.step.step`` (``gpulab.step``) fills it in on the fake engine's CUDA target; the records are
read as data from the floor below (``measure.recorded``), not by wrapping the step from ``record/``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from gpulab.measure.recorded import load_records, record_label
from gpulab.predict.cards import Card, parse_gpu

__all__ = ["NOT_PREDICTED", "RecordedWorkspace", "recorded_cudnn_workspace"]

NOT_PREDICTED = "cuDNN workspaces: not predicted (they depend on the algorithm cuDNN picks at run time)"
_MATCH = ("model", "batch", "dtype", "image_size", "optimizer")


@dataclass(frozen=True)
class RecordedWorkspace:
    """The recorded cuDNN workspaces at the peak, or None (not predicted), and where that comes from."""
    nbytes: int | None    # None: not predicted
    label: str


def _card(gpu: Any) -> Card | None:
    if isinstance(gpu, Card):
        return gpu
    try:
        return parse_gpu(gpu) if isinstance(gpu, str) else None
    except ValueError:
        return None


def recorded_cudnn_workspace(gpu: Any, params: dict[str, Any], steps: int | None = None,
                             directory: str | os.PathLike | None = None) -> RecordedWorkspace:
    """The cuDNN workspaces at the peak of a recorded step on ``gpu`` with ``params`` (model, batch,
    dtype, image_size, optimizer; the same step count preferred), or why there is none."""
    card = _card(gpu)
    if card is None:
        return RecordedWorkspace(None, NOT_PREDICTED)
    for rec in load_records(directory):
        if _card(rec.provenance.get("gpu_name", "")) is not card:
            continue
        hits = [e for e in rec.data["experiments"] if e["kind"] == "step"
                and all(e["params"].get(k) == params.get(k) for k in _MATCH)
                and isinstance(e["result"].get("beyond_tensors"), dict)]
        hits.sort(key=lambda e: e["params"].get("steps") != steps)   # the same step count first
        if hits:
            beyond = hits[0]["result"]["beyond_tensors"]
            nbytes = max(0, int(beyond.get("bytes") or 0) - int(beyond.get("kept_after_run") or 0))
            return RecordedWorkspace(nbytes, f"cuDNN workspaces at the peak: {record_label(rec.provenance)} "
                                             "(the allocator's peak beyond the live tensors' blocks)")
    return RecordedWorkspace(None, f"{NOT_PREDICTED}; no step of these settings was recorded on {card.name}")
