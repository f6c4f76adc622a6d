"""Lesson 09's measurements on the GPU, for ``gpulab record``: the fragmentation scenario allocated
for real with the allocator's own counters, and a training step with the real allocator read
after every op beside the simulator's replay of the same run's events."""
from __future__ import annotations

from typing import Any

import torch

from gpulab.measure.engines import run
from gpulab.record.kinds import head, record_kind

__all__ = ["record_allocator_timeline", "record_fragmentation"]


def _fragmentation_experiment(n: int, block_mib: int, big_mib: int):
    """``replay.fragmentation_events`` made of real tensors (same sizes, same order)."""
    from gpulab.predict.replay import fragmentation_events

    def experiment(ctx) -> None:
        live: dict[int, torch.Tensor] = {}
        for ev in fragmentation_events(n, block_mib, big_mib):
            if ev["kind"] == "alloc":
                live[ev["sid"]] = torch.empty(ev["nbytes"], dtype=torch.uint8, device=ctx.device)
            else:
                del live[ev["sid"]]
        ctx.snapshot("end")
    return experiment


@record_kind("fragmentation")
def record_fragmentation(p: dict[str, Any]) -> dict[str, Any]:
    """The scenario of ``replay.fragmentation_events`` on the GPU, beside the simulator's replay."""
    from gpulab.predict.replay import fragmentation_events, replay_events
    m = run(_fragmentation_experiment(**p), engine="cuda")
    sim = replay_events(fragmentation_events(**p))
    return {**head(m), "peak_bytes": m.peak_bytes,
            "allocator": dict(m.allocator or {}), "seconds": round(m.seconds, 4), "oom": m.oom,
            "error": m.error, "simulated_peak_allocated": sim.peak_allocated,
            "simulated_peak_reserved": sim.peak_reserved}


@record_kind("allocator timeline")
def record_allocator_timeline(p: dict[str, Any]) -> dict[str, Any]:
    return _allocator_timeline(**p)


def _allocator_timeline(workload: str, model: str, batch: int, steps: int, optimizer: str,
                        expandable_segments: bool, empty_cache: bool) -> dict[str, Any]:
    """Lesson 09's training step on the GPU: the real allocator read after every op, and the
    simulator's replay of the same run's tracked events."""
    from gpulab.models.registry import resolve_model
    from gpulab.measure.real_timeline import AllocatorSampler, sampled, timeline
    from gpulab.predict.replay import steps_experiment, replay_events, tracked_events
    if workload != "training step" or expandable_segments or empty_cache:
        raise ValueError("the allocator timeline records the default training-step workload only")
    sampler = AllocatorSampler(0)
    m = run(sampled(steps_experiment(resolve_model(model), [batch] * steps, optimizer), sampler), engine="cuda")
    sim = replay_events(tracked_events(m)) if m.tracking is not None and not m.oom else None
    return {"engine": m.engine, "device": m.device, "label": m.label, "peak_bytes": m.peak_bytes,
            "peak_by_category": dict(m.peak_by_category), "allocator": dict(m.allocator or {}),
            "seconds": round(m.seconds, 4), "oom": m.oom, "error": m.error,
            "timeline": timeline(sampler).as_dict(),
            "simulated_peak_allocated": sim.peak_allocated if sim else None,
            "simulated_peak_reserved": sim.peak_reserved if sim else None}
