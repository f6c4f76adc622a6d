"""The training loop every tracked step runs: a fresh model from a workload, then one
forward, backward and optimizer step per batch, in the tracker's phases."""
from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch

from gpulab.training.optimizers import make_optimizer
from gpulab.measure.engines import Measurement, RunContext
from gpulab.models.registry import ModelSpec

__all__ = ["AMP_DTYPES", "step_experiment", "step_peaks", "train_experiment", "validate_amp"]


def step_experiment(spec: ModelSpec, batch: int, image_size: int, optimizer: str, dtype: torch.dtype,
                    steps: int = 1):
    """The experiment function ``run`` calls: fresh model, ``steps`` training steps."""
    from gpulab.models.workload import image_workload
    return train_experiment(image_workload(spec, image_size), [batch] * steps, optimizer, dtype)


AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def train_experiment(w, batches: Sequence[int], optimizer: str, dtype: torch.dtype | None, amp: str | None = None):
    """Fresh model from the workload ``w``, then one training step per entry of ``batches``
    (forward, backward, optimizer step; from the second step on the gradients are set to None
    first). ``amp``: run forward under ``torch.autocast`` in fp16 or bf16. The value returned
    holds ``step_marks``: the tracker's event count at the start of each step and at the end,
    so each step's own peak can be read off the timeline."""
    from gpulab.models.workload import forward

    def experiment(ctx: RunContext) -> dict[str, Any]:
        with ctx.phase("setup"):
            net = w.build(ctx.device, dtype)
            opt = make_optimizer(optimizer, [p for p in net.parameters() if p.requires_grad])
        data, data_batch, marks = None, None, []
        for i, b in enumerate(batches):
            if b != data_batch:
                data = None
                with ctx.phase("setup"), torch.device(ctx.device):
                    data = w.inputs(b, dtype)
                    for t in [*data[0], *data[1].values()]:
                        if isinstance(t, torch.Tensor):
                            ctx.label(t)
                data_batch = b
            marks.append(ctx.mark())
            if i:
                opt.zero_grad(set_to_none=True)
            with ctx.phase("forward"), _autocast(ctx.device, amp):
                output = forward(net, data)
                loss = w.loss(output, data)
                del output
            with ctx.phase("backward"):
                loss.backward()
            del loss
            with ctx.phase("optimizer"):
                opt.step()
        marks.append(ctx.mark())
        ctx.snapshot("after step")
        return {"n_param_tensors": sum(1 for _ in net.parameters()), "step_marks": marks}
    return experiment


def _autocast(device: torch.device, amp: str | None):
    if amp is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AMP_DTYPES[amp])


def validate_amp(amp: str | None) -> str | None:
    if amp is None or str(amp).lower() in ("", "none", "off", "no"):
        return None
    key = str(amp).lower()
    if key not in AMP_DTYPES:
        raise ValueError(f"unknown --amp {amp!r}; valid: {', '.join(AMP_DTYPES)} (or leave it out for no autocast)")
    return key


def step_peaks(m: Measurement) -> list[int]:
    """Each training step's own peak, from the step marks the experiment returned."""
    marks = (m.value or {}).get("step_marks") if isinstance(m.value, dict) else None
    if not marks or m.tracking is None or m.oom:
        return []
    return [m.tracking.peak_between(a, b)[0] for a, b in zip(marks, marks[1:])]

