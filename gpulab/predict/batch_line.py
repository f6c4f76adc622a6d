"""A fake run's timeline at any batch, made from runs at a few batches: the timelines of one model's
step at different batches are the same operations in the same order, and each storage's bytes are
affine in the batch (a CNN's activations, an MLP's inputs), which ``BatchLine.make`` checks exactly at
every batch it is given. ``course.sweeps.largest_batch`` makes the batches its search examines from the
line of its sweep and confirms its answer with one run (``predict.fit`` does the same from batches 2
and 3 of a transformer: its ``_Extrapolation``).
"""
from __future__ import annotations

from dataclasses import dataclass

from gpulab.measure.records import TrackingResult

__all__ = ["BatchLine"]


@dataclass
class BatchLine:
    """Every event's bytes of a fake run as ``a + batch·c``, read off the sweep's runs: the timelines
    at the sweep's batches are the same operations in the same order, and each storage's bytes are
    affine in the batch, checked exactly at every swept batch (``make`` returns None otherwise). A
    timeline at another batch is then made, not run (``at``); ``largest_batch`` confirms its answer
    with one run (``predict.fit`` does the same for a transformer)."""
    base: TrackingResult
    base_batch: int
    slopes: list[int]

    @classmethod
    def make(cls, runs: dict[int, TrackingResult]) -> "BatchLine | None":
        if len(runs) < 3:
            return None
        (b0, t0), (b1, t1), *rest = sorted(runs.items())
        if len(t0.events) != len(t1.events) or any(a.kind != b.kind or a.sid != b.sid
                                                   for a, b in zip(t0.events, t1.events)):
            return None
        slopes = []
        for a, b in zip(t0.events, t1.events):
            step, left = divmod(b.nbytes - a.nbytes, b1 - b0)
            if left or step < 0:
                return None
            slopes.append(step)
        line = cls(t0, b0, slopes)
        return line if all(line.same(line.at(b), t) for b, t in rest) else None

    def at(self, batch: int) -> TrackingResult:
        k = batch - self.base_batch
        events, sizes = [], {}
        for e, c in zip(self.base.events, self.slopes):
            if e.kind == "free":
                nbytes = sizes.get(e.sid, e.nbytes + k * c)
                events.append(e.with_bytes(nbytes, -nbytes))
            else:
                nbytes = e.nbytes + k * c
                events.append(e.with_bytes(nbytes, nbytes - sizes.get(e.sid, 0)))
                sizes[e.sid] = nbytes
        return TrackingResult.build(self.base.records, events, self.base.device, self.base.rounded)

    @staticmethod
    def same(a: TrackingResult, b: TrackingResult) -> bool:
        """The same timeline: every event's kind, storage and bytes."""
        return len(a.events) == len(b.events) and all(
            x.kind == y.kind and x.sid == y.sid and x.nbytes == y.nbytes for x, y in zip(a.events, b.events))
