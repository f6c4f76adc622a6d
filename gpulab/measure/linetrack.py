"""Line-by-line memory tracking: which line of a piece of code created or freed which tensor.

``track_lines(code, namespace)`` runs ``code`` (a notebook cell's source) under one
``MemoryTracker`` with a ``sys.settrace`` line hook restricted to that code. Every time a line
of the code starts, the hook notes how many tracker events exist; the events between one line
start and the next belong to the line that ran (the first line event fires *before* a line
executes, so the events up to the next one are that line's). A loop therefore gives one row
per line per iteration, and functions defined in the code are followed into their own lines.

The result is a ``LineReport``: per executed line, the live tensor total after it, the peak
inside it, and the tensors it added and removed (shape, dtype, bytes, category, where created
as file:line). Views: ``str()`` / ``table()``, ``_repr_html_``, ``plot()``, ``timeline()``.

NB: only tensors the tracker sees are counted: those created while the code runs, and
existing ones it is shown (a model's parameters appear when the model first runs forward).
On CUDA the live total counts each storage rounded up to 512 bytes, as the allocator does.
"""
from __future__ import annotations

import contextlib
import html
import itertools
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from gpulab.measure.engines import LABEL_CPU, LABEL_FAKE_CPU, label_cuda
from gpulab.categories import Category
from gpulab.measure.tracking import MemoryTracker, TrackingResult
from gpulab.units import format_bytes, format_delta

__all__ = ["LineReport", "LineStep", "TensorChange", "track_lines"]

_counter = itertools.count(1)
_SKIP_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, contextlib)
                   if getattr(m, "__file__", None)) + (os.path.dirname(__file__) + os.sep,)


@dataclass(frozen=True)
class TensorChange:
    """One storage that a line added (alive after it) or removed (freed by it)."""
    sid: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int          # as counted in the report (512-rounded on CUDA)
    category: str
    where: str           # file:line where the storage was created ("cell:3" for the code itself)


@dataclass
class LineStep:
    """One execution of one line."""
    line: int                     # 1-based line number in the tracked code
    source: str
    total_bytes: int              # live tensors after the line ran
    delta_bytes: int              # change over the line
    peak_bytes: int               # highest live total while the line ran
    added: list[TensorChange] = field(default_factory=list)
    removed: list[TensorChange] = field(default_factory=list)
    allocated_bytes: int | None = None  # cuda only: torch.cuda.memory_allocated() after the line


def _changes(step, max_tensors: int, signs: tuple[str, str]):
    """(sign, tensor, 0) for the first ``max_tensors`` tensors a line added and removed, then
    (sign, None, how many more) where it did more."""
    for sign, items in ((signs[0], step.added), (signs[1], step.removed)):
        for t in items[:max_tensors]:
            yield sign, t, 0
        if len(items) > max_tensors:
            yield sign, None, len(items) - max_tensors


@dataclass
class LineReport:
    """What each executed line did to live memory (see the module docstring)."""
    steps: list[LineStep]
    engine: str
    label: str
    device: str
    rounded: bool
    tracking: TrackingResult = field(repr=False)
    filename: str = "<cell>"
    where: dict[int, str] = field(default_factory=dict, repr=False)  # sid -> where it was created ("cell:3")

    @property
    def peak_bytes(self) -> int:
        return self.tracking.peak_bytes

    @property
    def final_bytes(self) -> int:
        return self.steps[-1].total_bytes if self.steps else 0

    def totals(self) -> list[int]:
        return [s.total_bytes for s in self.steps]

    def steps_at(self, line: int) -> list[LineStep]:
        """Every execution of ``line`` (one per loop iteration)."""
        return [s for s in self.steps if s.line == line]

    def by_line(self) -> dict[int, int]:
        """Net bytes each line added over all its executions."""
        out: dict[int, int] = {}
        for s in self.steps:
            out[s.line] = out.get(s.line, 0) + s.delta_bytes
        return out

    # ---- views ---------------------------------------------------------------------------------
    def table(self, max_tensors: int = 6) -> str:
        head = (f"line-by-line memory, {self.label}, live tensors on {self.device}"
                + (" (each rounded up to 512 B)" if self.rounded else ""))
        lines = [head, f"{'line':>5}  {'live after':>12}  {'change':>12}  {'peak in line':>12}  source"]
        for s in self.steps:
            lines.append(f"{s.line:>5}  {format_bytes(s.total_bytes):>12}  {format_delta(s.delta_bytes):>12}  "
                         f"{format_bytes(s.peak_bytes):>12}  {s.source.strip()[:60]}")
            for sign, t, more in _changes(s, max_tensors, ("+", "-")):
                lines.append(f"{'':>7}{sign} ... {more} more" if t is None else
                             f"{'':>7}{sign} {str(tuple(t.shape)):<22}{t.dtype:<10}"
                             f"{format_bytes(t.nbytes):>11}  {t.category:<16}{t.where}")
        lines.append(f"peak {format_bytes(self.peak_bytes)}, at end {format_bytes(self.final_bytes)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return (f"LineReport({len(self.steps)} line executions, peak={self.peak_bytes:,} B, "
                f"final={self.final_bytes:,} B, label={self.label!r})")

    def _repr_html_(self, max_tensors: int = 6) -> str:
        from gpulab.tables import STYLE
        rows = []
        for s in self.steps:
            tens = [f"{sign} … {more} more" if t is None else
                    f"{sign} {html.escape(str(tuple(t.shape)))} {t.dtype} "
                    f"{format_bytes(t.nbytes)} <i>{t.category}</i> @ {html.escape(t.where)}"
                    for sign, t, more in _changes(s, max_tensors, ("+", "−"))]
            rows.append(f"<tr><td>{s.line}</td><td><code>{html.escape(s.source.strip()[:70])}</code></td>"
                        f"<td>{format_bytes(s.total_bytes)}</td><td>{format_delta(s.delta_bytes)}</td>"
                        f"<td>{format_bytes(s.peak_bytes)}</td>"
                        f"<td style='text-align:left;font-size:0.85em'>{'<br>'.join(tens)}</td></tr>")
        cap = (f"line-by-line memory: {self.label}; live tensors on {self.device}"
               + (", each rounded up to 512 B" if self.rounded else "")
               + f"; peak {format_bytes(self.peak_bytes)}")
        return (f"{STYLE}<table class='gpulab-table gpulab-linereport'><caption class='gpulab-label'>"
                f"{html.escape(cap)}</caption><tr><th>line</th><th>source</th><th>live after</th>"
                f"<th>change</th><th>peak in line</th><th>tensors added (+) / removed (−)</th></tr>"
                + "".join(rows) + "</table>")

    def plot(self, title: str | None = None):
        """Live total after each executed line (x: execution order, ticks: line numbers)."""
        from gpulab.plots import LessonFigure
        fig = LessonFigure(figsize=(7.0, 3.2), dpi=100, layout="constrained")
        ax = fig.add_subplot()
        xs = range(len(self.steps))
        ax.step(xs, [s.total_bytes / 2**20 for s in self.steps], where="mid", color="#4C72B0",
                label="live after the line")
        ax.plot(xs, [s.peak_bytes / 2**20 for s in self.steps], ".", color="#C44E52", label="peak in the line")
        if len(self.steps) <= 60:
            ax.set_xticks(list(xs), [str(s.line) for s in self.steps], fontsize=7)
        ax.set_xlabel("executed line (cell line number), in order")
        ax.set_ylabel("live tensors (MiB)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
        ax.set_title(title or f"memory line by line ({self.label})", fontsize=10)
        return fig

    def timeline(self, title: str | None = None):
        """The stacked-by-category timeline of every event (``gpulab.plots.timeline``)."""
        from gpulab.plots import timeline
        return timeline(self.tracking, title=title or f"memory over time by category ({self.label})")


class _LocatingTracker(MemoryTracker):
    """A ``MemoryTracker`` that also notes where each storage was created: the innermost
    stack frame outside torch, contextlib and gpulab (so the user's line, not a library's)."""

    def __init__(self, filename: str) -> None:
        super().__init__()
        self.where: dict[int, str] = {}
        self._filename = filename

    def _see(self, t, op, category=Category.TEMPORARIES, preexisting=False):
        first_new = self._next_sid
        rec = super()._see(t, op, category, preexisting)
        if rec is not None and rec.sid >= first_new and rec.sid not in self.where:
            self.where[rec.sid] = self._locate()
        return rec

    def _locate(self) -> str:
        f = sys._getframe(2)
        while f is not None:
            fn = f.f_code.co_filename
            if fn == self._filename:
                return f"cell:{f.f_lineno}"
            if not fn.startswith(_SKIP_DIRS) and not fn.startswith("<frozen"):
                return f"{os.path.basename(fn)}:{f.f_lineno}"
            f = f.f_back
        return "?"


def _engine_context(engine: str):
    if engine == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode
        return FakeTensorMode()
    return contextlib.nullcontext()


def track_lines(code: str, namespace: dict[str, Any] | None = None, engine: str = "auto",
                device: str | None = None) -> LineReport:
    """Run ``code`` in ``namespace`` (a new dict if None; a notebook passes its user namespace)
    and report memory per executed line.

    ``engine``: "cpu" (real tensors on the CPU), "fake" (code runs under ``FakeTensorMode``:
    shapes only; ``.item()`` and data-dependent code fail), "cuda" (the code's own CUDA tensors,
    plus ``torch.cuda.memory_allocated()`` after each line), or "auto" (cuda if available, else
    cpu). ``device``: which device's tensors to report (default: the busiest)."""
    eng = str(engine).lower()
    if eng == "auto":
        eng = "cuda" if torch.cuda.is_available() else "cpu"
    if eng not in ("cpu", "fake", "cuda"):
        raise ValueError(f"unknown engine {engine!r}; valid: auto, cpu, fake, cuda")
    if eng == "cuda" and not torch.cuda.is_available():
        raise ValueError("engine 'cuda' is not available here (no CUDA GPU); use cpu or fake")
    ns = {} if namespace is None else namespace
    filename = f"<memtrack-{next(_counter)}>"
    src_lines = code.splitlines()
    compiled = compile(code, filename, "exec")
    tracker = _LocatingTracker(filename)
    marks: list[tuple[int, int, int | None]] = []   # (line, event index at start, cuda allocated)
    on_cuda = eng == "cuda"

    def local(frame, event, arg):
        if event == "line":
            alloc = torch.cuda.memory_allocated() if on_cuda else None
            marks.append((frame.f_lineno, len(tracker._events), alloc))
        return local

    def global_trace(frame, event, arg):
        if frame.f_code.co_filename == filename:
            return local
        return None

    old = sys.gettrace()
    with _engine_context(eng):
        with tracker:
            sys.settrace(global_trace)
            try:
                exec(compiled, ns)
            finally:
                sys.settrace(old)
            end_alloc = torch.cuda.memory_allocated() if on_cuda else None
    n_events = len(tracker._events)
    result = tracker.result(device=device)
    label = {"cpu": LABEL_CPU, "fake": LABEL_FAKE_CPU}.get(eng) or label_cuda(torch.cuda.get_device_name())
    steps = _build_steps(result, tracker.where, marks, n_events, end_alloc, src_lines)
    return LineReport(steps, eng, label, result.device, result.rounded, result, filename, dict(tracker.where))


def _build_steps(result: TrackingResult, where: dict[int, str], marks, n_events: int,
                 end_alloc, src_lines: list[str]) -> list[LineStep]:
    # result.events holds only the chosen device's events, each with its global index
    events = result.events
    size: dict[int, int] = {}
    total = 0
    steps: list[LineStep] = []
    j = 0
    for k, (line, start, _alloc) in enumerate(marks):
        stop = marks[k + 1][1] if k + 1 < len(marks) else n_events
        after_alloc = marks[k + 1][2] if k + 1 < len(marks) else end_alloc
        before = total
        peak = total
        created_here: set[int] = set()
        added: dict[int, TensorChange] = {}
        removed: list[TensorChange] = []
        while j < len(events) and events[j].index < stop:
            e = events[j]
            j += 1
            rec = result.records[e.sid]
            old = size.get(e.sid, 0)
            new = 0 if e.kind == "free" else _rounded(result, e.nbytes)
            size[e.sid] = new
            total += new - old
            peak = max(peak, total)
            change = TensorChange(rec.sid, rec.shape, rec.dtype, old if e.kind == "free" else new,
                                  rec.category.value, where.get(rec.sid, "existing"))
            if e.kind == "alloc":
                created_here.add(e.sid)
                added[e.sid] = change
            elif e.kind == "free":
                if e.sid in created_here:
                    added.pop(e.sid, None)  # a temporary of this line: counted in the peak only
                else:
                    removed.append(change)
            else:
                added[e.sid] = change
        src = src_lines[line - 1] if 0 < line <= len(src_lines) else ""
        steps.append(LineStep(line, src, total, total - before, peak, list(added.values()), removed,
                              after_alloc))
    return steps


def _rounded(result: TrackingResult, nbytes: int) -> int:
    from gpulab.formulas import cuda_rounded_bytes
    return cuda_rounded_bytes(nbytes) if result.rounded else nbytes
