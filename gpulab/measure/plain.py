"""An observer that changes nothing: a run's memory read from the CPU allocator's own events.

The tracker is a ``TorchDispatchMode``, and any dispatch mode changes what PyTorch allocates in a
few places (``isTensorSubclassLike`` is true whenever one is on: autograd then adds a gradient's
contributions out of place, ``MemoryTracker._accumulation_candidate``). To check that the tracker's
answer is the *untracked* run's, ``plain_peak`` runs the same experiment with no dispatch mode, no
saved-tensor hooks and no module hooks, under ``torch.profiler.profile(profile_memory=True)``, and
reads the peak of the CPU allocator's live bytes off its allocation events
(c10/core/impl/alloc_cpu.cpp's ``ProfiledCPUMemoryReporter`` reports each allocation and free with
the bytes allocated so far). Everything the experiment allocates is allocated inside the profile,
so the running total is the run's live bytes.

NB: the profiler sees every CPU allocation, also what no tensor owns (a kernel's scratch buffer);
the tracker sees tensor storages only. ``PlainPeak.allocations`` lets a caller look for those.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

__all__ = ["PlainPeak", "plain_peak"]


@dataclass(frozen=True)
class PlainPeak:
    """The CPU allocator's view of one untracked run: its peak and final live bytes, the number of
    allocation events, and the sizes of the allocations live at the peak (largest first)."""
    peak_bytes: int
    final_bytes: int
    n_events: int
    live_at_peak: tuple[int, ...]
    label: str = "measured on CPU by torch.profiler's memory events (no dispatch mode)"


class _Unobserved:
    """What an experiment calls on ``ctx.tracker``, doing nothing that changes PyTorch's paths: no
    dispatch mode, no hooks. Labels and phases are accepted and dropped."""

    _events: list = []
    _records: dict = {}

    def label(self, tensor: torch.Tensor, category: Any = None) -> torch.Tensor:
        return tensor

    def register(self, *args: Any, **kwargs: Any) -> None:
        return None

    @contextlib.contextmanager
    def _nothing(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        yield

    phase = paused = without_module_hooks = _nothing

    @contextlib.contextmanager
    def offloading(self, copy_back: bool) -> Iterator[None]:
        with torch.autograd.graph.save_on_cpu(pin_memory=False):
            yield


def plain_peak(experiment: Callable[[Any], Any]) -> PlainPeak:
    """Run ``experiment(ctx)`` on the CPU with real tensors and nothing observing PyTorch but its
    profiler; the peak of the allocator's live bytes."""
    from torch._C._profiler import _EventType
    from gpulab.measure.engines import RunContext

    ctx = RunContext("cpu", torch.device("cpu"), _Unobserved())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        experiment(ctx)
    allocs = []
    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        todo.extend(e.children)
        if e.typed[0] == _EventType.Allocation and e.typed[1].device.type == "cpu":
            allocs.append((e.start_time_ns, e.typed[1]))
    allocs.sort(key=lambda a: a[0])
    live: dict[int, int] = {}
    peak, at_peak, total = 0, (), 0
    for _, f in allocs:
        if f.alloc_size > 0:
            live[f.ptr] = f.alloc_size
        else:
            live.pop(f.ptr, None)
        total += f.alloc_size
        if total > peak:
            peak, at_peak = total, tuple(sorted(live.values(), reverse=True))
    return PlainPeak(peak, total, len(allocs), at_peak)
