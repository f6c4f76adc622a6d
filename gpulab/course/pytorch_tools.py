"""Lesson 13: gpulab and PyTorch's own memory tools, both ways.

* ``vgg16_step_snapshot``: a fake-engine VGG16 training step written as a PyTorch memory
  snapshot; the peak PyTorch's viewer and ``torch.cuda._memory_viz`` read from it next to
  gpulab's (``StepExport``), the viewer inline (``StepExport.viewer``), gpulab's own timeline.
* ``files_folder``: where the lesson writes its files (beside the notebook, or a private
  temporary folder; never a fixed folder shared with other users).
* ``make_example_snapshot`` / ``load_example_snapshot``: the small snapshot shipped for the
  tests (tests/data/), made by gpulab's export on the CPU (not a GPU recording), read back and
  replayed through the simulator.
* ``fresh_step`` / ``STEP_CODE`` / ``profile_step`` / ``compare_tools``: one training step of the
  small CNN on the CPU under ``torch.profiler`` (``profile_memory=True, record_shapes=True``)
  next to ``%%memtrack``'s lines and the tracker's categories: what each tool sees and misses.
* ``example_oom`` / ``read_oom``: out-of-memory messages in PyTorch's current format, every figure
  from a simulated run; read, sorted into a case and rebuilt in the simulator. ``read_oom`` never
  raises: text it cannot read gives a "could not read this message" result.

Nothing here prints; results are dataclasses with ``_repr_html_``; every number carries its
source label.
"""
from __future__ import annotations

import contextlib
import gc
import html
import json
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpulab.interop import oom_message as O
from gpulab.allocator.simulator import MiB
from gpulab.predict.cards import CUDA_CONTEXT_ASSUMED, parse_gpu
from gpulab.measure.engines import LABEL_SIMULATED
from gpulab.predict.step import StepResult, step as tracked_step
from gpulab.measure.linetrack import LineReport
from gpulab.models.registry import build_model, resolve_model
from gpulab.plots import to_png
from gpulab.interop.snapshot import MemorySnapshot, export_tracking, unrounded
from gpulab.interop.snapshot_import import ImportedSnapshot, read_snapshot
from gpulab.interop.snapshot_viewer import ViewerHTML, memory_viz_bytes
from gpulab.tables import STYLE, html_table
from gpulab.units import format_bytes, format_delta
from gpulab.course.exercises import ChoiceExercise

__all__ = [
    "EXAMPLE_SNAPSHOT", "FILES_FOLDER", "OOMExample", "OOMReading", "OOM_EXAMPLES", "OWN_MESSAGE",
    "OpRow", "PANEL_EXAMPLES", "PROFILER_CATEGORIES", "ProfiledStep", "REPO", "SEES", "STEP_CODE",
    "StepExport", "ToolComparison", "compare_tools", "example_oom", "example_text",
    "exercise_oom_case", "exercise_viewer_peak", "files_folder", "fresh_step",
    "growing_inputs_events", "load_example_snapshot", "make_example_snapshot", "profile_step",
    "provenance", "read_oom", "vgg16_step_snapshot"
]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_SNAPSHOT = REPO / "tests" / "data" / "snapshot_cnn_fake_step.pickle"
OK, NOT_OK = "✓", "✗"


def _check(ok: bool) -> str:
    return OK if ok else NOT_OK


# ---- the lesson's files ---------------------------------------------------------------------------

FILES_FOLDER = "lesson13_files"


def files_folder(name: str = FILES_FOLDER) -> Path:
    """The folder the lesson writes its files into: ``name`` in the working folder (in Jupyter,
    the notebook's), the student's own, the same after a restart and in JupyterLab's file browser;
    where that cannot be written (a read-only copy of the course), a new private temporary folder
    (``tempfile.mkdtemp``: readable only by its owner). Never a fixed folder under the shared
    /tmp, where another user could plant files or links first."""
    folder = Path(name)
    try:
        folder.mkdir(exist_ok=True)
        if folder.is_dir() and os.access(folder, os.W_OK | os.X_OK):
            return folder
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix=f"gpulab_{name}_"))


# ---- 1. a gpulab run in PyTorch's snapshot format -------------------------------------------------

@dataclass
class StepExport:
    """A training step exported as a PyTorch memory snapshot, with the peaks every tool reads
    from it. ``snapshot``: the whole step; ``at_peak``: the snapshot taken at the tracker's peak
    (what ``_memory_viz.memory`` and ``segsum`` describe)."""

    step: StepResult
    snapshot: MemorySnapshot
    at_peak: MemorySnapshot
    tracker_requested_peak: int      # gpulab's tracker, requested bytes (no rounding)
    tracker_rounded_peak: int        # gpulab's tracker, each storage rounded up to 512 B
    viz_peak: int                    # the viewer's Active Memory Timeline (process_alloc_data)
    viz_segment_peak: int            # the viewer's Active Cached Segment Timeline
    memory_viz: dict[str, int]       # torch.cuda._memory_viz.memory() at the peak, added up

    @property
    def label(self) -> str:
        return self.step.measurement.label

    @property
    def checks(self) -> dict[str, bool]:
        return {"viewer peak = tracker peak": self.viz_peak == self.tracker_requested_peak,
                "_memory_viz.memory at the peak = tracker peak": self.memory_viz["requested"] == self.tracker_requested_peak,
                "viewer's segment peak = simulated reserved peak": self.viz_segment_peak == self.snapshot.peak_reserved}

    def rows(self) -> list[list[str]]:
        r = self.tracker_requested_peak
        return [
            ["gpulab tracker: peak of live tensors (requested bytes)", f"{r:,} B", self.label, ""],
            ["gpulab tracker: the same, each storage rounded up to 512 B", f"{self.tracker_rounded_peak:,} B",
             self.label, ""],
            ["PyTorch's viewer, Active Memory Timeline (MemoryViz.js process_alloc_data, as "
             "gpulab.interop.snapshot_viewer.viz_peak follows it)", f"{self.viz_peak:,} B",
             "from the snapshot", _check(self.viz_peak == r)],
            ["torch.cuda._memory_viz.memory() at the peak: live allocations", f"{self.memory_viz['requested']:,} B",
             "from the snapshot", _check(self.memory_viz["requested"] == r)],
            ["… the same, their blocks (what memory_allocated() counts)", f"{self.memory_viz['allocated']:,} B",
             LABEL_SIMULATED, ""],
            ["PyTorch's viewer, Active Cached Segment Timeline (reserved)", f"{self.viz_segment_peak:,} B",
             LABEL_SIMULATED, _check(self.viz_segment_peak == self.snapshot.peak_reserved)],
        ]

    def _repr_html_(self) -> str:
        s = self.step
        cap = (f"{s.model}, batch {s.batch}, {s.optimizer}, one training step; snapshot: "
               f"{len(self.snapshot.trace):,} trace entries, {len(self.snapshot.data['segments'])} segments at the end")
        return html_table(["peak", "bytes", "source", "equal to the tracker's"], self.rows(), cap)

    def viewer(self, kind: str = "trace") -> ViewerHTML:
        """PyTorch's interactive view inline (needs the browser online) and the file to download."""
        return self.snapshot.viewer(kind, filename=f"{self.step.model}_step_snapshot.pickle")

    def timeline(self):
        """gpulab's own timeline of the same step (offline; a PNG)."""
        from gpulab.plots import timeline
        tr = unrounded(self.step.measurement.tracking)
        return to_png(timeline(tr, title=f"{self.step.model} step ({self.label})"))

    def save(self, path: str | Path, *, overwrite: bool = False) -> Path:
        return self.snapshot.save(path, overwrite=overwrite)


def vgg16_step_snapshot(batch: int = 8, optimizer: str = "sgd", model: str = "vgg16") -> StepExport:
    """One training step of ``model`` on the fake engine (CUDA's kernels, no compute), exported."""
    step = tracked_step(model, batch=batch, optimizer=optimizer, engine="fake", steps=1, guard=False)
    tr = step.measurement.tracking
    snap = export_tracking(tr, times="index")
    at_peak = export_tracking(tr, times="index", at="peak")
    return StepExport(step, snap, at_peak, unrounded(tr).peak_bytes, tr.peak_bytes, snap.viz_peak(),
                      snap.viz_peak(segments=True), memory_viz_bytes(at_peak.data))


def exercise_viewer_peak(export: StepExport) -> ChoiceExercise:
    """Predict first: the viewer's peak next to gpulab's 512-rounded peak (worked out from the export)."""
    def expected() -> str:
        v, r = export.viz_peak, export.tracker_rounded_peak
        return "a" if v == r else ("b" if v < r else "c")

    return ChoiceExercise(
        "gpulab's tracker reports the step's peak with every storage rounded up to 512 bytes, as the CUDA "
        "allocator rounds. PyTorch's viewer adds up the sizes in the snapshot's trace ('alloc' entries, "
        "written by alloc_found_block in CUDACachingAllocator.cpp). Its peak is …",
        {"a": "exactly gpulab's 512-rounded peak",
         "b": "a little smaller: the trace records the bytes each tensor asked for, before rounding",
         "c": "larger: the trace records whole segments"},
        expected,
        lambda: (f"The viewer shows {export.viz_peak:,} B, gpulab's rounded peak is {export.tracker_rounded_peak:,} B: "
                 "'alloc' entries carry orig_size, the requested bytes. Segments are a separate timeline "
                 f"(Active Cached Segment Timeline, {format_bytes(export.viz_segment_peak)})."))


# ---- 2. a snapshot read back ------------------------------------------------------------------------

def make_example_snapshot() -> MemorySnapshot:
    """The small snapshot shipped in tests/data/: one training step of the small CNN (batch 4,
    SGD) on the fake engine (CUDA's kernels, no compute), exported by gpulab with the event index
    as its clock, so the file is the same on every run. Made on a CPU: NOT a GPU recording."""
    step = tracked_step("cnn", batch=4, optimizer="sgd", engine="fake", steps=1, guard=False)
    snap = export_tracking(step.measurement.tracking, times="index")
    snap.data["gpulab"].update({
        "made_by": "gpulab.course.pytorch_tools.make_example_snapshot (tests/make_snapshot_fixture.py)",
        "workload": "cnn, batch 4, sgd, one training step, fake engine (CUDA kernels, no compute)",
        "not_a_gpu_recording": True})
    return snap


def load_example_snapshot(path: str | Path | None = None) -> ImportedSnapshot:
    """Read the shipped example snapshot (made fresh, the same way, when this checkout lacks it)."""
    p = Path(path) if path is not None else EXAMPLE_SNAPSHOT
    if p.is_file():
        return read_snapshot(p)
    return read_snapshot(make_example_snapshot().pickle_bytes())


def provenance(imported: ImportedSnapshot) -> str:
    """A plain statement of where a snapshot file came from (HTML)."""
    if imported.from_gpu:
        text = (f"This file was recorded on a GPU by PyTorch itself (device {imported.device}): its segments are the "
                "real allocator's, and the simulator's replay below is a test of the simulator.")
    else:
        meta = imported.data.get("gpulab", {})
        text = ("This file was made by gpulab on a CPU, not recorded on a GPU: "
                f"{meta.get('workload') or meta.get('source', '')}. Its segments are gpulab's simulated allocator's, so "
                "the simulator replaying its trace must give the same segments: that checks the export and the "
                "import, not the simulator against a GPU. Only a snapshot recorded on a real GPU can do that.")
    return f"{STYLE}<p class='gpulab-label' style='border-left:4px solid #c90;padding-left:8px'>{html.escape(text)}</p>"


# ---- 3. the profiler, %%memtrack and the tracker on one step -----------------------------------------

STEP_CODE = ("loss = nn.functional.cross_entropy(net(x), y)\n"
             "loss.backward()\n"
             "opt.step()\n"
             "opt.zero_grad(set_to_none=True)\n")


def fresh_step(model: str = "cnn", batch: int = 16, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer,
                                                                              torch.Tensor, torch.Tensor]:
    """A fresh model, SGD with momentum, and one batch (the same every call): ``net, opt, x, y``
    for ``STEP_CODE``."""
    spec = resolve_model(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        net = build_model(spec, spec.default_image_size, device="cpu")
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, spec.default_image_size, spec.default_image_size, generator=gen)
    y = torch.randint(0, spec.num_classes, (batch,), generator=gen)
    return net, opt, x, y


@contextlib.contextmanager
def _quiet_stderr():
    """Keep the profiler's own log lines (kineto writes them to file descriptor 2, with process
    ids and times) out of the notebook."""
    try:
        fd = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(fd, 2)
    finally:
        os.close(fd)


# torch/profiler/_memory_profiler.py: _CATEGORY_TO_INDEX (+1 in _coalesce_timeline; column 0 unused)
PROFILER_CATEGORIES = ("parameter", "optimizer_state", "input", "temporary", "activation", "gradient",
                       "autograd_detail", "unknown (no tensor or category)")


@dataclass
class OpRow:
    name: str
    calls: int
    self_bytes: int      # net bytes allocated by the op itself (frees negative)
    total_bytes: int     # the same with its children
    shapes: str


@dataclass
class ProfiledStep:
    """``torch.profiler`` on one step: the per-operator memory table (``key_averages``) and
    PyTorch's memory timeline by category (``export_memory_timeline``) at its peak."""

    ops: list[OpRow]
    memory_events: int            # '[memory]' rows: allocations/frees outside any operator
    memory_event_bytes: int
    net_bytes: int                # sum of every event's self memory: live bytes after - before
    timeline_peak: int | None     # PyTorch's memory timeline: peak of all categories
    timeline_at_peak: dict[str, int]
    model: str
    batch: int
    label: str = "torch.profiler on the CPU (profile_memory=True, record_shapes=True, with_stack=True)"


def profile_step(model: str = "cnn", batch: int = 16, top: int = 12) -> ProfiledStep:
    """Run ``STEP_CODE`` once on ``fresh_step(model, batch)`` under ``torch.profiler.profile``."""
    from torch.profiler import ProfilerActivity, profile

    def namespace():
        net, opt, x, y = fresh_step(model, batch)
        return {"net": net, "opt": opt, "x": x, "y": y, "nn": nn, "torch": torch}

    def profiled():
        return profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True)

    with _quiet_stderr(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # a first, unmeasured profile: the profiler's first use in a process allocates for itself
        # (seen as 1 MiB of "unknown" in the timeline of a fresh kernel's first run, not after)
        warm = namespace()
        with profiled():
            exec(STEP_CODE, warm)
        del warm
        ns = namespace()
        # no garbage collection inside the measured step: a collection there frees earlier cells'
        # tensors at a moment that differs from run to run, and the profiler records those frees
        gc.collect()
        gc.disable()
        try:
            with profiled() as prof:
                exec(STEP_CODE, ns)
        finally:
            gc.enable()
        avg = prof.key_averages(group_by_input_shape=True)
        events = prof.events()
        peak, at_peak = None, {}
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "timeline.json")
            try:
                prof.export_memory_timeline(path, device="cpu")   # deprecated, still public in 2.x
                with open(path) as f:
                    _times, sizes = json.load(f)
            except (AttributeError, ValueError, OSError, RuntimeError):
                sizes = []
    if sizes:
        totals = [sum(s) for s in sizes]
        i = max(range(len(totals)), key=totals.__getitem__)
        peak = totals[i]
        at_peak = dict(zip(PROFILER_CATEGORIES, sizes[i][1:]))
    rows = [OpRow(e.key, e.count, e.self_cpu_memory_usage, e.cpu_memory_usage, str(e.input_shapes)[:60])
            for e in avg if e.key != "[memory]" and (e.self_cpu_memory_usage or e.cpu_memory_usage)]
    rows.sort(key=lambda r: (-abs(r.self_bytes), r.name, r.shapes))
    mem = [e for e in events if e.name == "[memory]"]
    return ProfiledStep(rows[:top], len(mem), sum(e.cpu_memory_usage for e in mem),
                        sum(e.self_cpu_memory_usage for e in events if e.name != "[memory]")
                        + sum(e.cpu_memory_usage for e in mem), peak, at_peak, model, batch)


# what each tool sees and misses; the profiler's lines are checked against torch/autograd/profiler.py
# (_parse_kineto_results: an op's cpu_memory_usage is the sum of the memory records inside its time
# interval, frees negative; records outside every op become '[memory]' rows) and
# torch/profiler/_memory_profiler.py (categories inferred from the op graph; needs with_stack=True).
SEES = [
    ["torch.profiler, per-operator table (key_averages)",
     "every allocator call during each op, tensors or not (kernel workspaces too), with input shapes",
     "net bytes per op only (an allocation freed inside the op nets to 0); frees outside any op land in "
     "'[memory]'; nothing says what is alive at the peak, nor which line of your code"],
    ["torch.profiler, memory timeline (export_memory_timeline / profile_plot)",
     "live bytes over time by PyTorch's categories (parameter, gradient, activation, …), incl. non-tensor "
     "allocations as 'unknown'",
     "needs with_stack=True; categories are inferred from the op graph; deprecated in favour of snapshots"],
    ["%%memtrack (gpulab), per line",
     "every tensor storage each line created or freed: shape, dtype, bytes, category, file:line; the peak "
     "inside a line",
     "allocations that are not tensor storages (on a GPU: cuDNN's convolution workspaces, the cuBLAS "
     "workspace); per-op detail inside a line"],
    ["gpulab tracker, categories",
     "live bytes by category over time (parameters, buffers, inputs, optimizer state, gradients, "
     "activations, temporaries), on cpu, fake (any size, no GPU) and cuda",
     "op names and lines (the timeline has module and phase); non-tensor allocations; inputs are only "
     "'inputs' when labelled (ctx.label), else what autograd made of them"],
    ["memory snapshot (_record_memory_history / _dump_snapshot; gpulab's export)",
     "every allocator action on a GPU: blocks, segments, stack traces, out-of-memory events",
     "needs a GPU to record (gpulab's export is simulated); no categories unless added"],
]


@dataclass
class ToolComparison:
    """The same step seen by the profiler, ``%%memtrack`` and the tracker."""

    profiled: ProfiledStep
    lines: LineReport

    @property
    def tracker_peak(self) -> int:
        return self.lines.peak_bytes

    def op_rows(self) -> list[list[str]]:
        return [[r.name, str(r.calls), format_delta(r.self_bytes), format_delta(r.total_bytes), r.shapes]
                for r in self.profiled.ops]

    def line_rows(self) -> list[list[str]]:
        return [[str(s.line), s.source.strip()[:50], format_bytes(s.total_bytes), format_delta(s.delta_bytes),
                 format_bytes(s.peak_bytes), str(len(s.added)), str(len(s.removed))] for s in self.lines.steps]

    def category_rows(self) -> list[list[str]]:
        g = self.lines.tracking.peak_by_category
        p = self.profiled.timeline_at_peak
        pairs = [("parameters", "parameter"), ("buffers", None), ("inputs", "input"),
                 ("optimizer_state", "optimizer_state"), ("gradients", "gradient"), ("activations", "activation"),
                 ("temporaries", "temporary"), (None, "autograd_detail"), (None, "unknown (no tensor or category)")]
        rows = []
        for ours, theirs in pairs:
            rows.append([ours or "—", format_bytes(g.get(ours, 0)) if ours else "—",
                         theirs or "—", format_bytes(p.get(theirs, 0)) if theirs and p else "—"])
        rows.append(["total at the peak", format_bytes(self.tracker_peak), "total at the peak",
                     format_bytes(self.profiled.timeline_peak) if self.profiled.timeline_peak is not None else "n/a"])
        return rows

    @property
    def peak_difference(self) -> int | None:
        if self.profiled.timeline_peak is None:
            return None
        return self.profiled.timeline_peak - self.tracker_peak

    def _repr_html_(self) -> str:
        pr = self.profiled
        ops = html_table(["operator", "calls", "Self CPU Mem", "CPU Mem", "input shapes"], self.op_rows(),
                         f"{pr.label}: the {len(pr.ops)} operators with the largest self memory; "
                         f"'[memory]' (outside any op): {pr.memory_events} events, {format_delta(pr.memory_event_bytes)}")
        lines = html_table(["line", "code", "live after", "change", "peak in line", "tensors +", "tensors −"],
                           self.line_rows(), f"%%memtrack: {self.lines.label}")
        cats = html_table(["gpulab tracker", "bytes at its peak", "PyTorch's memory profiler", "bytes at its peak"],
                          self.category_rows(),
                          f"categories at each tool's peak: gpulab tracker ({self.lines.label}) vs "
                          "torch.profiler's memory timeline")
        diff = self.peak_difference
        note = ""
        if diff is not None:
            unknown = pr.timeline_at_peak.get("unknown (no tensor or category)", 0)
            note = (f"<p>Peaks: tracker {self.tracker_peak:,} B, profiler {pr.timeline_peak:,} B "
                    f"(difference {diff:+,} B). At the profiler's peak, {unknown:,} B are in its 'unknown' "
                    "category: allocations it could not tie to a tensor, or whose category its reading of the "
                    "operator graph did not settle (torch/profiler/_memory_profiler.py); that split can move "
                    "between runs of the same step. The two peaks fall at different moments, so their totals "
                    "need not differ by exactly that.</p>")
        sees = html_table(["tool", "sees", "misses"], SEES, "what each tool sees and misses")
        return f"{STYLE}{ops}<br>{lines}<br>{cats}{note}{sees}"


def compare_tools(profiled: ProfiledStep, lines: LineReport) -> ToolComparison:
    """Put the profiler's view of ``STEP_CODE`` next to ``%%memtrack``'s report of the same code."""
    return ToolComparison(profiled, lines)


# ---- 4. reading an out-of-memory message ----------------------------------------------------------------

OOM_EXAMPLES = ("fragmentation", "too big")


@dataclass
class OOMExample:
    """An out-of-memory message in PyTorch's current format, every figure from a simulated run."""

    kind: str
    text: str
    story: str
    label: str
    step: int | None = None               # the step of the synthetic sequence that failed
    step_expandable: int | None = None    # the same sequence with expandable_segments:True (None: it fits)
    figures: O.SimulatedOOM | None = field(default=None, repr=False)

    def formatted(self, style: str) -> str:
        """The same figures in another of PyTorch's formats (``format_oom_message`` styles)."""
        f = self.figures
        return O.format_oom_message(f.tried, f.total, f.free, f.allocated, f.reserved,
                                    this_process=f.reserved + f.context, style=style)

    def _repr_html_(self) -> str:
        more = ""
        if self.step is not None:
            more = (f" The same sequence with expandable_segments:True fails at step {self.step_expandable} instead of "
                    f"{self.step}." if self.step_expandable is not None else
                    " With expandable_segments:True the same sequence fits.")
        return (f"{STYLE}<p>{html.escape(self.story)}{html.escape(more)} "
                f"<span class='gpulab-label'>({html.escape(self.label)})</span></p>"
                f"<pre style='white-space:pre-wrap;border-left:4px solid #c33;padding-left:8px'>"
                f"torch.OutOfMemoryError: {html.escape(self.text)}</pre>")


def growing_inputs_events(steps: int = 30, activation_mib: int = 256, output_mib: int = 24) -> list[dict]:
    """Synthetic sizes (no tensors): inputs that grow step by step; each step makes a big working
    tensor (``activation_mib`` × step), keeps a small output (``output_mib`` × step), frees the
    working tensor. Each output lands in the previous step's freed block and splits it, leaving a
    free sliver that the next, bigger working tensor cannot use."""
    ev: list[dict] = []
    for i in range(1, steps + 1):
        ev.append({"kind": "alloc", "sid": f"h{i}", "nbytes": activation_mib * MiB * i})
        ev.append({"kind": "alloc", "sid": f"out{i}", "nbytes": output_mib * MiB * i})
        ev.append({"kind": "free", "sid": f"h{i}", "nbytes": activation_mib * MiB * i})
    return ev


def example_oom(kind: str = "fragmentation", card: str = "T4") -> OOMExample:
    """``"fragmentation"``: ``growing_inputs_events`` on the card; ``"too big"``: a VGG16 training
    step at batch 256 (fake engine, CUDA's kernels) on the card. The allocator may use the card
    less an assumed CUDA context; the message is formatted by ``gpulab.interop.oom_message.format_oom_message``
    from the simulator's figures at its first out-of-memory."""
    c = parse_gpu(card)
    if kind == "fragmentation":
        events, story = growing_inputs_events(), ("Inputs grow step by step; each step keeps a small output "
                                                  "and frees a big working tensor (synthetic sizes)")
    elif kind == "too big":
        step = tracked_step("vgg16", batch=256, optimizer="sgd", engine="fake", steps=1, guard=False)
        events, story = step.measurement.tracking.events, "A VGG16 training step at batch 256, SGD (fake engine, CUDA's kernels)"
    else:
        raise ValueError(f"unknown example {kind!r}; valid: {', '.join(OOM_EXAMPLES)}")
    total = c.reported_total_bytes    # what CUDA reports: a T4's 14.74 GiB, not its advertised 16 GB
    oom = O.simulated_oom(events, total, context_bytes=CUDA_CONTEXT_ASSUMED)
    if oom is None:
        raise ValueError(f"the {kind} example fits on {c.name}: no out-of-memory to read")
    story += (f", on a {c.name} ({format_bytes(total)} as CUDA reports it"
              + (f": {c.cuda_total_note}" if c.cuda_total_note else "")
              + f"; of which an assumed {format_bytes(CUDA_CONTEXT_ASSUMED)} CUDA context).")
    step = step_exp = None
    if kind == "fragmentation":       # 3 events per step
        step = oom.event_index // 3 + 1
        exp = O.simulated_oom(events, total, context_bytes=CUDA_CONTEXT_ASSUMED, expandable_segments=True)
        step_exp = None if exp is None else exp.event_index // 3 + 1
    return OOMExample(kind, oom.text, story, f"{LABEL_SIMULATED}: every figure from the simulator, in PyTorch's format",
                      step, step_exp, oom)


# the OOM reader panel's examples: name -> how to make the text (never a typed number)
PANEL_EXAMPLES = {
    "fragmentation (simulated, current format)": lambda: example_oom("fragmentation").text,
    "too big (simulated, current format)": lambda: example_oom("too big").text,
    "fragmentation (same figures, PyTorch 1.x format)": lambda: example_oom("fragmentation").formatted("legacy"),
    "not an out-of-memory message": lambda: "RuntimeError: CUDA error: device-side assert triggered",
}
OWN_MESSAGE = "my own message (paste it below)"


def example_text(name: str) -> str:
    """The text of one of ``PANEL_EXAMPLES`` (cached: the VGG16 example runs a fake step)."""
    if name not in _EXAMPLE_CACHE:
        if name not in PANEL_EXAMPLES:
            raise ValueError(f"unknown example {name!r}; valid: {', '.join(PANEL_EXAMPLES)}")
        _EXAMPLE_CACHE[name] = PANEL_EXAMPLES[name]()
    return _EXAMPLE_CACHE[name]


_EXAMPLE_CACHE: dict[str, str] = {}


@dataclass
class OOMReading:
    """What ``read_oom`` found: a diagnosis and its reproduction, or why the text could not be read."""

    text: str
    diagnosis: O.OOMDiagnosis | None = None
    reproduction: O.OOMReproduction | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def case(self) -> str | None:
        return self.diagnosis.case if self.diagnosis else None

    def _repr_html_(self) -> str:
        if self.error is not None:
            return (f"{STYLE}<div class='gpulab-oom-unreadable' style='border-left:4px solid #c90;padding-left:8px'>"
                    f"<b>Could not read this message.</b> {html.escape(_reason(self.error))}</div>")
        return self.diagnosis._repr_html_() + "<br>" + self.reproduction._repr_html_()


def _reason(error: str) -> str:
    prefix = "could not read this message: "
    why = error[len(prefix):] if error.startswith(prefix) else error
    return why[:1].upper() + why[1:]


def read_oom(text: Any) -> OOMReading:
    """Read, diagnose and reproduce an out-of-memory message; never raises on bad text."""
    try:
        diag = O.diagnose(text if isinstance(text, str) else O.parse_oom_message(text))
    except O.OOMParseError as exc:
        return OOMReading(str(text) if text is not None else "", error=str(exc))
    return OOMReading(text, diag, O.reproduce(diag))


def exercise_oom_case(text: str) -> ChoiceExercise:
    """Predict first: which case is this message? (worked out by ``gpulab.interop.oom_message.diagnose``)."""
    options = {"a": "fragmentation: free + reserved-but-unallocated would hold the request",
               "b": "too big: the live tensors and the request exceed the GPU",
               "c": "another process holds the memory"}
    key = {"fragmentation": "a", "too_big": "b", "other_processes": "c"}

    def expected() -> str:
        return key.get(O.diagnose(text).case, "b")

    return ChoiceExercise("Read the message above: 'Tried to allocate' vs 'free', and what is 'reserved by PyTorch "
                          "but unallocated'. Which case is it?", options, expected,
                          lambda: " ".join(O.diagnose(text).reasons[:2]))
