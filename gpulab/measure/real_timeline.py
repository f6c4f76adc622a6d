"""The real caching allocator over a run, op by op: ``memory_allocated`` and ``memory_reserved``
read after every ATen op that runs on the GPU (a ``TorchDispatchMode``), for ``gpulab record`` to
ship the real ``reserved`` timeline that lesson 09 draws next to the simulator's.

NB: one sample per op, after it: an allocation and its free inside one op, or a tensor freed
between two ops, shows at the next sample (reserved changes only inside ops — cudaMalloc — or
at ``empty_cache``, so its series is exact at op granularity). The series is kept compact:
``downsample`` keeps at most ``max_points`` samples: the series cut into equal stretches, and in
each the sample where allocated, and the one where reserved, is largest, so the peaks survive.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["AllocatorSampler", "MAX_POINTS", "RealTimeline", "downsample", "sampled", "timeline"]

MAX_POINTS = 2000


class AllocatorSampler(TorchDispatchMode):
    """Inside ``with``: after every op, append (allocated, reserved) of CUDA ``device``."""

    def __init__(self, device: int = 0) -> None:
        super().__init__()
        self.device = device
        self.allocated: list[int] = []
        self.reserved: list[int] = []

    def sample(self) -> None:
        self.allocated.append(int(torch.cuda.memory_allocated(self.device)))
        self.reserved.append(int(torch.cuda.memory_reserved(self.device)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.sample()
        return out


def downsample(*series: list[int], max_points: int = MAX_POINTS) -> list[int]:
    """The indices to keep, at most ``max_points``: the series (of equal length) cut into equal
    stretches, and in each stretch the index of every series' largest value (the first and last
    samples always kept), so each series keeps its peaks."""
    n = len(series[0])
    if n <= max_points:
        return list(range(n))
    keep = {0, n - 1}
    stretches = max(1, (max_points - 2) // len(series))
    for j in range(stretches):
        a, b = 1 + j * (n - 2) // stretches, 1 + (j + 1) * (n - 2) // stretches
        if b > a:
            keep |= {max(range(a, b), key=s.__getitem__) for s in series}
    return sorted(keep)


@dataclass
class RealTimeline:
    """The sampled series (bytes above the run's start, ``baseline_*``), downsampled together."""
    index: list[int]
    allocated: list[int]
    reserved: list[int]
    samples: int                     # ops sampled before downsampling
    baseline_allocated: int
    baseline_reserved: int
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "allocated": self.allocated, "reserved": self.reserved,
                "samples": self.samples, "baseline_allocated": self.baseline_allocated,
                "baseline_reserved": self.baseline_reserved,
                "note": "bytes above the run's start, read after every op (memory_allocated, memory_reserved)",
                **self.extra}


def sampled(experiment: Callable[[Any], Any], sampler: AllocatorSampler) -> Callable[[Any], Any]:
    """``experiment`` run with ``sampler`` active (an experiment for ``engines.run``): the
    sampler starts inside the run, after the engine's own reset, and samples once at the start
    and once at the end."""
    def wrapped(ctx):
        sampler.sample()
        with sampler:
            value = experiment(ctx)
        sampler.sample()
        return value
    return wrapped


def timeline(sampler: AllocatorSampler, max_points: int = MAX_POINTS) -> RealTimeline:
    """The sampler's series relative to its first sample, downsampled (``downsample``)."""
    if not sampler.reserved:
        return RealTimeline([], [], [], 0, 0, 0)
    a0, r0 = sampler.allocated[0], sampler.reserved[0]
    alloc = [a - a0 for a in sampler.allocated]
    res = [r - r0 for r in sampler.reserved]
    idx = downsample(alloc, res, max_points=max_points)
    return RealTimeline(idx, [alloc[i] for i in idx], [res[i] for i in idx], len(res), a0, r0)
