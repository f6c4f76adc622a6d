"""Lesson 10 (optional section): a tensor held by a reference cycle outlives its ``del``.

Python frees an object the moment its reference count reaches zero. Objects that refer to each
other (a cycle) never reach zero on their own: they wait for the cycle collector (``gc``), and so
does every tensor they hold. Each experiment here runs a few lines under ``track_lines`` (the
engine of ``%%memtrack``) on the cpu engine, with the collector paused so that it runs exactly
where the code calls ``gc.collect()`` and nowhere else:

* ``self``: an object holding a tensor refers to itself;
* ``traceback``: a function keeps the exception it caught in a local, so its frame refers to the
  exception, whose traceback refers back to the frame, whose locals hold the tensor;
* ``break`` / ``weakref`` / ``message``: the fixes (drop the back reference; make it weak; keep the
  exception's message, not the exception).

``run_cycle(kind)`` returns a ``CycleRun``: the line report and which line freed the tensor.
``cycle_members(kind)`` lists what the collector found in the cycle (``gc.DEBUG_SAVEALL``), the
way PyTorch's ``torch.utils.viz._cycles`` finds cycles that hold CUDA tensors.
"""
from __future__ import annotations

import contextlib
import gc
import textwrap
import weakref
from dataclasses import dataclass

import torch

from gpulab.course.exercises import ChoiceExercise
from gpulab.measure.linetrack import LineReport, track_lines

__all__ = ["CYCLE_KINDS", "CycleMembers", "Holder", "CycleRun", "cycle_code", "cycle_members", "exercise_cycle_frees",
           "run_cycle"]



class Holder:
    """An object that holds a tensor (``holder.tensor``): the experiments' stand-in for a module, an
    optimizer wrapper or a trainer that keeps tensors in attributes."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


# Each kind: the lines that make the tensor and drop the last name for it (the collect line is appended).
_BODIES = {
    "self": """\
        holder = Holder(torch.zeros({n}))  # {size} held by an object
        holder.me = holder                    # the object refers to itself: a cycle
        del holder                            # no name is left, but the count never reaches 0
        """,
    "break": """\
        holder = Holder(torch.zeros({n}))  # {size} held by an object
        holder.me = holder                    # the same cycle
        holder.me = None                      # the fix: break the cycle before letting go
        del holder                            # the count reaches 0: freed now
        """,
    "weakref": """\
        holder = Holder(torch.zeros({n}))  # {size} held by an object
        holder.me = weakref.ref(holder)       # the fix: a weak back reference does not count
        del holder                            # the count reaches 0: freed now
        """,
    "traceback": """\
        def step():
            activations = torch.zeros({n}) # {size}, a local of this frame
            try:
                raise RuntimeError("bad batch")
            except RuntimeError as err:
                failure = err                 # frame -> exception -> traceback -> frame: a cycle
            return activations.sum()
        total = step()                        # the frame is gone from the stack, not from memory
        """,
    "message": """\
        def step():
            activations = torch.zeros({n}) # {size}, a local of this frame
            try:
                raise RuntimeError("bad batch")
            except RuntimeError as err:
                failure = str(err)            # the fix: keep the message, not the exception
            return activations.sum()
        total = step()                        # the frame and its locals are freed on return
        """,
}
CYCLE_KINDS = tuple(_BODIES)
_COLLECT = "found = gc.collect()                  # the cycle collector runs here\n"


def _check(kind: str, numel: int) -> None:
    if kind not in _BODIES:
        raise ValueError(f"unknown cycle kind {kind!r}; choose one of {', '.join(CYCLE_KINDS)}")
    if not isinstance(numel, int) or isinstance(numel, bool) or numel < 1:
        raise ValueError(f"numel must be a positive int (elements of the float32 tensor), got {numel!r}")


def cycle_code(kind: str = "self", numel: int = 256 * 1024) -> str:
    """The code ``run_cycle(kind)`` tracks: a ``numel``-element float32 tensor kept (or not) by a cycle,
    then ``gc.collect()``."""
    _check(kind, numel)
    size = f"{numel * 4 / 2**20:g} MiB" if numel * 4 >= 2**20 else f"{numel * 4:,} bytes"
    return textwrap.dedent(_BODIES[kind]).format(n=numel, size=size) + _COLLECT


def _namespace() -> dict:
    return {"torch": torch, "gc": gc, "weakref": weakref, "Holder": Holder}


@contextlib.contextmanager
def _collector_paused():
    """Collect what is already garbage, then pause automatic collection; restore it even on an error."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass
class CycleRun:
    """One tracked run: ``report`` (a ``LineReport``), the tensor's bytes, and the line that freed it."""
    kind: str
    code: str
    report: LineReport
    tensor_bytes: int
    freed_by: str | None        # the source of the line whose report removes the tensor; None: never freed
    collected: int              # what gc.collect() returned: unreachable objects it found

    @property
    def freed_by_collector(self) -> bool:
        return self.freed_by is not None and "gc.collect" in self.freed_by

    def _repr_html_(self) -> str:
        return self.report._repr_html_()

    def __repr__(self) -> str:
        where = self.freed_by.strip() if self.freed_by else "never (still alive at the end)"
        return f"CycleRun({self.kind}: {self.tensor_bytes:,} B tensor freed by: {where})"


def run_cycle(kind: str = "self", numel: int = 256 * 1024) -> CycleRun:
    """Run ``cycle_code(kind, numel)`` under the line tracker (cpu engine) with automatic collection
    paused, and find which line freed the ``numel``-element tensor."""
    code = cycle_code(kind, numel)
    ns = _namespace()
    nbytes = numel * 4
    with _collector_paused():
        report = track_lines(code, ns, engine="cpu")
    freed_by = next((s.source for s in report.steps
                     if any(t.nbytes == nbytes and t.shape == (numel,) for t in s.removed)), None)
    return CycleRun(kind, code, report, nbytes, freed_by, int(ns.get("found", 0)))


@dataclass(frozen=True)
class CycleMembers:
    """What the collector found unreachable after ``cycle_code(kind)`` (``gc.DEBUG_SAVEALL``)."""
    kind: str
    types: tuple[str, ...]                     # type names of the objects in the cycle, sorted
    tensors: tuple[tuple[tuple[int, ...], str, int], ...]   # (shape, dtype, bytes) of tensors among them

    def __repr__(self) -> str:
        ts = ", ".join(f"{tuple(s)} {d} ({b:,} B)" for s, d, b in self.tensors) or "none"
        return f"cycle ({self.kind}): {', '.join(self.types) or 'nothing'}; tensors: {ts}"


def cycle_members(kind: str = "self", numel: int = 256 * 1024) -> CycleMembers:
    """Build ``kind``'s cycle, then collect with ``gc.DEBUG_SAVEALL``: the collector puts what it
    found unreachable into ``gc.garbage`` instead of freeing it. List the objects' types and the
    tensors among them; then clear ``gc.garbage``, restore the debug flags and collect for real."""
    code = cycle_code(kind, numel).replace(_COLLECT, "")
    ns = _namespace()   # kept alive until the end: only the cycle itself is unreachable
    old_flags = gc.get_debug()
    with _collector_paused():
        exec(compile(code, "<cycle>", "exec"), ns)   # noqa: S102
        gc.set_debug(old_flags | gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            found = list(gc.garbage)
        finally:
            gc.set_debug(old_flags)
            gc.garbage.clear()
    types = tuple(sorted({type(o).__name__ for o in found if not isinstance(o, (dict, tuple, list))}))
    tensors = tuple((tuple(o.shape), str(o.dtype).replace("torch.", ""), o.untyped_storage().nbytes())
                    for o in found if isinstance(o, torch.Tensor))
    del found
    gc.collect()
    return CycleMembers(kind, types, tensors)


def exercise_cycle_frees(kind: str = "self", numel: int = 256 * 1024) -> ChoiceExercise:
    """Lesson 10, predict-first (qualitative): which line frees a tensor held by a cycle. The checker
    runs ``run_cycle(kind)`` under the tracker and reads the line whose report removes the tensor."""
    lines = [ln.split("#")[0].strip() for ln in cycle_code(kind, numel).splitlines() if ln.strip()]
    drop = next(ln for ln in lines if ln.startswith("del ") or ln.startswith("total ="))
    options = {"a": f"`{drop}`", "b": "`found = gc.collect()`", "c": "neither: it stays alive until the process ends"}

    def expected() -> str:
        run = run_cycle(kind, numel)
        if run.freed_by is None:
            return "c"
        return "b" if run.freed_by_collector else "a"

    def explain() -> str:
        run = run_cycle(kind, numel)
        where = f"`{run.freed_by.split('#')[0].strip()}`" if run.freed_by else "no line"
        return (f"Measured on CPU (live tensors), automatic collection paused: the {run.tensor_bytes:,}-byte tensor "
                f"is removed by {where}. Reference "
                f"counting frees an object when its count reaches zero; a cycle keeps every count above zero, so "
                f"only the cycle collector frees it, whenever it next runs.")

    return ChoiceExercise(
        question=(f"{'An object that refers to itself' if kind == 'self' else 'The code below'} holds a "
                  f"{numel * 4:,}-byte tensor; automatic garbage collection is paused. Which line frees the tensor?"),
        options=options, expected=expected, explain=explain)
