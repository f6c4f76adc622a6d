"""One timed fake run's steady step before any card (``RunOps``), made by the fake runs a memory
answer makes anyway, and laid out to a batch that was not run.

``gpulab fit``'s search and ``what_fits`` run each fake step with an ``OpTimer`` told every op by the
run's tracker (``predict.timing.timed_experiment``: no dispatch mode of its own, and the first step's
ops not recorded), and ``run_cache`` keeps the ops beside the timeline. ``predict.plan_time`` then costs
the answer's step from the runs the search made at the answer's batch, without a fake run of its own.

Where no run was made at a batch (a pipeline stage read off its search's extrapolation), its ops are
laid out from the runs at batches 2 and 3 (``at_batch``): for a fixed sequence, each op of the step is
the same op at every batch (checked: the two runs' ops must pair up one to one, by name, phase, kind,
FLOPs' dtype and group), and its FLOPs and bytes are ``a + b·c`` in the batch ``b`` (a matmul's rows,
an attention's queries and a norm's elements scale with it; a weight's bytes and the optimizer's do
not). ``tests/test_run_ops.py`` checks that, op kind by op kind, against a run at a third batch. Batch 1
is not laid out: its size-1 dimensions make some copies views (``predict.fit``'s ``_Extrapolation``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from gpulab.predict.timing import OpCost, OpTimer, step_ops

__all__ = ["RunOps", "at_batch", "of_run", "per_step"]


@dataclass(frozen=True)
class RunOps:
    """The steady-state step of one timed fake run (its last step's forward, backward and optimizer
    ops, in order), and what a plan adds to them: the bytes its activation offloading kept on the host
    (every step's, as the run's offloaded timeline holds them) and its parameters' and gradients'
    bytes after the step (what data parallelism moves)."""
    ops: tuple[OpCost, ...]
    offloaded_bytes: int
    param_bytes: int
    grad_bytes: int


def per_step(recipe: Any) -> int | None:
    """The micro-batches (forwards) a step of ``recipe`` runs, where known (``OpTimer``): a pipeline
    stage's run pushes one micro-batch through it; an interleaved rank's, its whole schedule."""
    if recipe.pp == 1:
        return recipe.accumulate
    return 1 if recipe.virtual_stages == 1 else None


def from_step(recipe: Any) -> int:
    """The first step whose ops a two-step run's timer records: the second, where the steps are told
    apart by their micro-batches (``per_step``); every step otherwise (the last is kept, as before)."""
    return 2 if per_step(recipe) is not None else 0


def of_run(m: Any, timer: OpTimer) -> RunOps:
    """The ``RunOps`` of a fake run (an ``engines.Measurement``) that ``timer`` watched."""
    after = next((s.by_category for s in m.snapshots if s.name == "after step"), {})
    offloaded = sum(r.nbytes for r in m.offloaded.records.values()) if m.offloaded is not None else 0
    return RunOps(tuple(step_ops(timer.ops)), offloaded, after.get("parameters", 0), after.get("gradients", 0))


def _same_op(a: OpCost, b: OpCost) -> bool:
    return (a.name, a.phase, a.step, a.dtype, a.kind, a.group) == (b.name, b.phase, b.step, b.dtype, b.kind, b.group)


def at_batch(lo: RunOps, hi: RunOps, base: int, batch: int) -> RunOps | None:
    """The ops at ``batch`` laid out from runs at ``base`` (``lo``) and ``base + 1`` (``hi``): each
    op's FLOPs and bytes ``a + (batch - base)·c`` (module docstring); None where the runs' ops do not
    pair up one to one, where ``base`` is 1, or where a figure would fall below 0."""
    if base < 2 or batch < 2 or len(lo.ops) != len(hi.ops) or not all(map(_same_op, lo.ops, hi.ops)):
        return None
    k = batch - base

    def line(a: int, b: int) -> int:
        return a + k * (b - a)
    ops = tuple(replace(a, flops=line(a.flops, b.flops), nbytes=line(a.nbytes, b.nbytes)) for a, b in zip(lo.ops, hi.ops))
    out = RunOps(ops, line(lo.offloaded_bytes, hi.offloaded_bytes), line(lo.param_bytes, hi.param_bytes),
                 line(lo.grad_bytes, hi.grad_bytes))
    if out.offloaded_bytes < 0 or any(o.flops < 0 or o.nbytes < 0 for o in ops):
        return None
    return out
