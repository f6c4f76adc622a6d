"""Lesson 10's reference-article claims about tracking memory line by line, put to the test (the
appendix, lessons/15_appendix_reference_claims.ipynb, section 10): "track GPU memory line by line
to find where it goes", "at the first tracked line, hundreds of MB are already used" and
"variables you no longer reference still hold memory". Each verdict is computed from line reports
of ``gpulab.measure.linetrack.track_lines`` (what ``%%memtrack`` shows)."""
from __future__ import annotations

from gpulab.course.claims import BREAKS, HOLDS, ClaimCheck, ClaimReport, Evidence
from gpulab.measure.linetrack import LineReport, track_lines
from gpulab.units import format_bytes

__all__ = ["LEAKY_LOOP", "VIEW_CELL", "tracking_claims", "tracking_reports"]

# lesson 10's first report: a view keeps its storage alive after `del a`
VIEW_CELL = """\
import torch
a = torch.zeros(1024, 256)
b = a[:10]
del a
del b
"""
# lesson 10's leak: an evaluation loop without no_grad keeps each graph-attached loss in a list
LEAKY_LOOP = """\
import torch
from torch import nn
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
losses = []
for i in range(4):
    x = torch.randn(64, 256)
    loss = model(x).pow(2).mean()
    losses.append(loss)
"""


def tracking_reports(engine: str = "cpu") -> tuple[LineReport, LineReport]:
    """Lesson 10's two cells (the view, the leaky loop), tracked line by line."""
    return track_lines(VIEW_CELL, engine=engine), track_lines(LEAKY_LOOP, engine=engine)


def _line(report: LineReport, text: str) -> int:
    return next(s.line for s in report.steps if text in s.source)


def tracking_claims(view: LineReport, leaky: LineReport) -> ClaimReport:
    """``view``: ``VIEW_CELL`` tracked; ``leaky``: ``LEAKY_LOOP`` tracked (``tracking_reports``)."""
    added = [t for s in leaky.steps for t in s.added]
    located = [t for t in added if t.where]
    per_line = bool(added) and len(located) == len(added)
    where = ClaimCheck(
        "Track GPU memory line by line to find where it goes", "ref 003",
        HOLDS if per_line else BREAKS,
        (f"Yes, and per tensor: each of the {len(added)} storages the loop added is listed with its shape, dtype, "
         "bytes, category and the line that created it. Unlike a total read from nvidia-smi, live-tensor "
         "tracking separates tensors from the allocator's cache and the CUDA context.") if per_line else
        "Some storage the loop added is not tied to a line.",
        [Evidence("storages added by the loop", str(len(added)), leaky.label),
         Evidence("of them tied to a line of the cell", str(len(located)), leaky.label)])

    first = leaky.steps[0].total_bytes - leaky.steps[0].delta_bytes if leaky.steps else 0
    start = ClaimCheck(
        "At the first tracked line, hundreds of MB are already used", "ref 003",
        BREAKS if first == 0 else HOLDS,
        ("Not for tensors: live-tensor tracking starts at 0 B. The articles' number was nvidia-smi's: the "
         "CUDA context and the allocator's cache, which only a GPU can show (lesson 09).") if first == 0 else
        f"The tracker found {format_bytes(first)} of tensors alive before the first line.",
        [Evidence("live tensors before the first line", format_bytes(first), leaky.label)])

    deleted = view.steps_at(_line(view, "del a"))[0]
    view_kept = deleted.removed == [] and deleted.total_bytes > 0
    growth = [s.total_bytes for s in leaky.steps_at(_line(leaky, "losses.append"))]
    steps = [b - a for a, b in zip(growth, growth[1:])]
    leak = bool(steps) and all(d > 0 for d in steps)
    kept = ClaimCheck(
        "Variables you no longer reference still hold memory", "ref 003",
        "holds, when something else references their storage" if view_kept and leak else BREAKS,
        ("Sometimes: a view keeps the storage of a deleted tensor alive, and a graph-attached loss kept in a list "
         "keeps what its forward saved. The report shows the line that made the reference.")
        if view_kept and leak else "The tracked cells freed what was deleted, and the loop did not grow.",
        [Evidence("`del a` with a view b = a[:10]: freed / still alive",
                  f"{format_bytes(sum(t.nbytes for t in deleted.removed))} / {format_bytes(deleted.total_bytes)}",
                  view.label),
         Evidence("leaky loop: growth per iteration", ", ".join(format_bytes(d) for d in steps), leaky.label)])
    return ClaimReport("Lesson 10: tracking memory line by line, the articles' claims", [where, start, kept])
