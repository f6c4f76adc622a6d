"""GPU validation (issue 16, item 4): one command that checks gpulab's cuda path on a real GPU and
writes the report.

    PYTHONPATH=. python benchmarks/gpu_validation.py --out DIR [--md docs/gpu-validation.md]
        [--skip-lessons] [--skip-pytest] [--skip-models] [--time-limit S] [--commit SHA]
        [--models vgg16,cnn] [--lessons '0[7-9]_*.ipynb'] [--merge] [--record gpulab/recorded]

Exit status: 0 when every target passed, 1 when one was missed or not measured (the report is
written either way), 2 without a CUDA GPU. ``--merge`` keeps what DIR's earlier report (same GPU)
measured and this run does not measure again, so a validation longer than one command's time
limit is split over several commands into one report.

It measures, and reports each figure with its target and PASS / MISS (by how much):

* with ``--record DIR``, first ``gpulab record --out DIR`` (a subprocess with a timeout), and the
  file it wrote checked by ``gpulab.record.lookup.validate_record`` (provenance complete, not a stand-in);

* ``pytest -m cuda`` (a subprocess with a timeout; log and JUnit XML in DIR): passed / failed / skipped;
* every lesson in ``lessons/`` executed headless with nbclient (one subprocess per lesson, killed
  past its timeout; the executed notebooks are kept in DIR/lessons/): seconds, errors;
* for each CLI model (vgg16, alexnet, resnet18, cnn, mlp at their default batch and image size) ×
  sgd / momentum / adam, two training steps on the cuda engine, after one warm-up run (so that the
  allocations a process makes once, such as the cuBLAS workspace, sit in the engine's baseline, as
  in tests/test_cuda.py):

  - the tracker's peak replayed through the allocator simulator (``Measurement.blocks``: 512-byte
    rounding, unsplit large blocks) vs the tensors' own peak in the allocator's trace of the run
    (``gpulab.measure.non_tensor``); target within 0.5%;
  - the trace's tensors plus the allocations no tensor owns (cuDNN's convolution workspaces), live
    at its peak, vs ``max_memory_allocated`` − baseline; target within 0.5%;
  - the tracker's bytes after the step (its allocator blocks) vs ``memory_allocated`` − baseline
    at the same moment (the "after step" snapshot); target within 0.5%;
  - the tracked events replayed through ``gpulab.allocator.simulator.CachingAllocator`` (``replay_events``):
    the simulated reserved peak vs ``max_memory_reserved`` − baseline; target within 2%;
  - the fake engine's prediction (CUDA target, the same two steps, its events replayed as allocator
    blocks) vs the tensors' real peak (the trace's); target within 2%; the workspaces it does not
    predict are reported beside it;
  - optimizer state after the step = k × parameter bytes (sgd 0, momentum 1, adam 2); exact;
  - first-step vs steady-state (second step) peaks, as ``gpulab.step(..., steps=2)`` reports them;

* the CUDA context: NVML used − ``memory_reserved`` before any experiment (and after them).

The raw figures go to DIR/gpu-validation.json, the report to DIR/gpu-validation.md (and to
``--md`` when given). Both are rewritten after every part, so a run cut short still leaves a
report of what it measured; a part that fails is reported as failed, never skipped silently.
Without a CUDA GPU the command exits 2 with one line on stderr. Under the test suite's stand-in
GPU (tests/cuda_standin.py) the report says in its first lines that no GPU measured anything.

The measuring functions return plain data (dataclasses); ``render_markdown`` turns that data into
markdown and does nothing else. A benchmark script, not package code: it prints progress lines.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
LESSONS_DIR = ROOT / "lessons"
JSON_NAME = "gpu-validation.json"
MD_NAME = "gpu-validation.md"
REPORT_FORMAT = 1

MODELS = ("vgg16", "alexnet", "resnet18", "cnn", "mlp")
OPTIMIZERS = ("sgd", "momentum", "adam")
STATE_MULTIPLIER = {"sgd": 0, "momentum": 1, "adam": 2}   # optimizer state = k × parameter bytes
STEPS = 2                                                 # first step and steady state

# Targets (docs: DESIGN "Performance we hold ourselves to", issue 16 item 4), relative.
TRACKER_TOL = 0.005     # tracker + simulator vs memory_allocated (peak and after the step)
RESERVED_TOL = 0.02     # simulated reserved peak vs max_memory_reserved
FAKE_TOL = 0.02         # fake engine's prediction vs the real allocated peak

DEFAULT_TIME_LIMIT_S = 540     # the GPU machine allows 600 s a command: leave room to write up
PYTEST_TIMEOUT_S = 300
RECORD_TIMEOUT_S = 300
LESSON_TIMEOUT_S = 240
CELL_TIMEOUT_S = 200
NO_TARGET = "reported (no target)"
MIN_PART_S = 20                # a subprocess is not started with less time than this left


# ---- data ----------------------------------------------------------------------------------------

@dataclass
class ModelRun:
    """One model × optimizer: the cuda engine's figures next to the real allocator's, the
    simulator's and the fake engine's. Bytes are from the run's baseline (``None``: not measured)."""
    model: str
    optimizer: str
    batch: int | None = None
    image_size: int | None = None
    steps: int = STEPS
    tracker_peak: int | None = None           # live tensors, each rounded up to 512 B (the tracker's peak)
    blocks_peak: int | None = None            # the tracker's events replayed as allocator blocks
    real_peak: int | None = None              # max_memory_allocated - baseline
    after_step_tracked: int | None = None     # tracker, 512-rounded, at the "after step" snapshot
    after_step_blocks: int | None = None      # the same tensors as allocator blocks
    after_step_real: int | None = None        # memory_allocated - baseline at that moment
    sim_reserved_peak: int | None = None      # replay_events(tracked events).peak_reserved
    real_reserved_peak: int | None = None     # max_memory_reserved - baseline
    baseline_allocated: int | None = None
    baseline_reserved: int | None = None
    beyond_tensors: int | None = None         # allocator peak beyond the tensors' blocks (workspaces)
    # the allocator's own trace of the run (gpulab.measure.non_tensor): requests rounded to 512 B
    trace_peak: int | None = None             # the highest allocated bytes in the trace
    trace_tensor_peak: int | None = None      # the tracked tensors' allocations alone
    trace_tensors_at_peak: int | None = None  # at the trace's peak: tensors' bytes ...
    not_tensor_at_peak: int | None = None     # ... and the allocations no tensor owns (cuDNN workspaces)
    not_tensor_count: int | None = None
    not_tensor_largest: int | None = None
    trace_replay_peak: int | None = None      # the simulator replaying the trace (from the run's segments)
    trace_replay_reserved: int | None = None
    warmup_kept: int | None = None            # what the warm-up run left allocated (cuBLAS workspace)
    fake_blocks_peak: int | None = None       # fake engine (CUDA target), events replayed as blocks
    fake_tracker_peak: int | None = None
    fake_seconds: float | None = None
    fake_error: str | None = None
    parameter_bytes: int | None = None        # after the step, tracker categories (512-rounded)
    optimizer_state_bytes: int | None = None
    baseline_blocks: int | None = None        # blocks allocated before the run (memory_snapshot)
    seeded_blocks_peak: int | None = None     # diagnostic: the replay started from those blocks
    seeded_reserved_peak: int | None = None
    first_step_peak: int | None = None        # tracker peaks of step 1 and step 2
    steady_peak: int | None = None
    seconds: float | None = None
    error: str | None = None

    @property
    def state_multiplier(self) -> int | None:
        return STATE_MULTIPLIER.get(self.optimizer)


@dataclass
class LessonRun:
    name: str
    seconds: float | None = None
    ok: bool = False
    errors: list[str] = field(default_factory=list)
    timed_out: bool = False
    gpu_labels: int | None = None    # outputs labelled "measured on <this GPU> (cuda)"
    executed: str | None = None      # where the executed notebook was written
    skipped: str | None = None       # why it did not run (time limit)


@dataclass
class RecordRun:
    """``gpulab record`` run as a subprocess (``--record DIR``) and its file checked by
    ``gpulab.record.lookup.validate_record``."""
    command: str
    returncode: int | None = None
    seconds: float | None = None
    timed_out: bool = False
    path: str | None = None
    experiments: int | None = None
    problems: list[str] = field(default_factory=list)   # validate_record's answer, or why there is no file
    log: str | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and self.path is not None and not self.problems


@dataclass
class PytestRun:
    command: str
    returncode: int | None = None
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    seconds: float | None = None
    timed_out: bool = False
    failures: list[str] = field(default_factory=list)   # node ids of failed / errored tests
    log: str | None = None
    error: str | None = None         # the run itself could not start / be read


def build(kind: type, data: dict[str, Any]) -> Any:
    """The dataclass ``kind`` from its ``asdict`` form, fields it no longer has left out (a report
    written by an earlier version of a script)."""
    names = {f.name for f in fields(kind)}
    return kind(**{k: v for k, v in data.items() if k in names})


@dataclass
class Report:
    device: dict[str, Any]
    started: str
    context_before: dict[str, Any] | None = None
    context_after: dict[str, Any] | None = None
    models: list[ModelRun] = field(default_factory=list)
    lessons: list[LessonRun] = field(default_factory=list)
    pytest: PytestRun | None = None
    record: RecordRun | None = None
    not_run: list[str] = field(default_factory=list)    # parts left out, and why
    earlier: list[str] = field(default_factory=list)    # parts kept from an earlier run (--merge)
    seconds: float | None = None
    format: int = REPORT_FORMAT

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Report":
        r = build(cls, d)
        r.models = [build(ModelRun, m) for m in d.get("models", [])]
        r.lessons = [build(LessonRun, x) for x in d.get("lessons", [])]
        r.pytest = build(PytestRun, d["pytest"]) if d.get("pytest") else None
        r.record = build(RecordRun, d["record"]) if d.get("record") else None
        return r


@dataclass
class Check:
    """One comparison: ``measured`` against ``reference`` within ``tolerance`` (relative; 0: exact)."""
    subject: str
    measured: int | None
    reference: int | None
    tolerance: float

    @property
    def difference(self) -> float | None:
        """(measured − reference) / reference; None when a figure is missing."""
        if self.measured is None or self.reference is None:
            return None
        if self.reference == 0:
            return 0.0 if self.measured == 0 else float("inf")
        return (self.measured - self.reference) / self.reference

    @property
    def passed(self) -> bool | None:
        d = self.difference
        if d is None:
            return None
        if self.tolerance == 0:
            return self.measured == self.reference
        return abs(d) <= self.tolerance + 1e-12

    @property
    def verdict(self) -> str:
        d = self.difference
        if d is None:
            return "not measured"
        if self.passed:
            return "PASS"
        if d == float("inf"):
            return f"MISS by {_signed_bytes(self.measured - self.reference)} (reference 0)"
        return f"MISS by {_pct(d)} ({_signed_bytes(self.measured - self.reference)})"


def tracker_checks(r: ModelRun) -> tuple[Check, Check]:
    """The tracker's blocks against the tensors' own allocations in the allocator's trace (the
    allocations no tensor owns, cuDNN's workspaces, are checked apart: ``trace_check``); without
    a trace, against ``max_memory_allocated``."""
    if r.trace_tensor_peak is not None:   # the same rounding on both sides: each request to 512 B
        return (Check(f"{r.model}/{r.optimizer} peak", r.tracker_peak, r.trace_tensor_peak, TRACKER_TOL),
                Check(f"{r.model}/{r.optimizer} after step", r.after_step_blocks, r.after_step_real, TRACKER_TOL))
    return (Check(f"{r.model}/{r.optimizer} peak", r.blocks_peak, r.real_peak, TRACKER_TOL),
            Check(f"{r.model}/{r.optimizer} after step", r.after_step_blocks, r.after_step_real, TRACKER_TOL))


def trace_check(r: ModelRun) -> Check:
    """The simulator replaying the allocator's trace (tensors + allocations no tensor owns) from
    the run's starting segments, against ``max_memory_allocated``."""
    return Check(f"{r.model}/{r.optimizer}", r.trace_replay_peak, r.real_peak, TRACKER_TOL)


def reserved_check(r: ModelRun) -> Check:
    """The simulator's reserved peak, replaying the allocator's trace where there is one (the
    workspaces' blocks take room too), else the tracked tensors' events."""
    sim = r.trace_replay_reserved if r.trace_replay_reserved is not None else r.sim_reserved_peak
    return Check(f"{r.model}/{r.optimizer}", sim, r.real_reserved_peak, RESERVED_TOL)


def fake_check(r: ModelRun) -> Check:
    """The fake engine predicts tensors: against the tensors' real peak (the trace's), else the
    whole allocated peak."""
    if r.trace_tensor_peak is not None:   # the same rounding on both sides: each request to 512 B
        return Check(f"{r.model}/{r.optimizer}", r.fake_tracker_peak, r.trace_tensor_peak, FAKE_TOL)
    return Check(f"{r.model}/{r.optimizer}", r.fake_blocks_peak, r.real_peak, FAKE_TOL)


def state_check(r: ModelRun) -> Check:
    k = r.state_multiplier
    want = None if k is None or r.parameter_bytes is None else k * r.parameter_bytes
    return Check(f"{r.model}/{r.optimizer}", r.optimizer_state_bytes, want, 0.0)


# ---- measuring -----------------------------------------------------------------------------------

def cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def device_facts(command: Sequence[str] | None = None, commit: str | None = None) -> dict[str, Any]:
    """The GPU and the software, as ``gpulab record`` writes them (``record.provenance``), plus
    the Python version and the time; ``commit`` overrides the git commit (a machine without .git)."""
    from gpulab.record.runner import provenance
    facts = provenance(command if command is not None else ["benchmarks/gpu_validation.py", *sys.argv[1:]])
    facts["python"] = platform.python_version()
    facts["time_utc"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if commit:
        facts["gpulab_commit"] = commit
    facts["pytorch_cuda_alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or None
    return facts


def cuda_context(moment: str) -> dict[str, Any]:
    """NVML used − ``memory_reserved`` now (the CUDA context, other processes, memory outside
    PyTorch's allocator), after freeing what can be freed; ``gpulab.predict.replay.beyond_allocator_bytes``."""
    from gpulab.measure.engines import release_cuda_memory
    from gpulab.predict.replay import beyond_allocator_bytes
    try:
        release_cuda_memory(0)     # creates the context if nothing did yet (synchronize)
        out = dict(beyond_allocator_bytes(0))
    except Exception as exc:  # noqa: BLE001 - a report line, not a crash
        out = {"bytes": None, "label": f"could not be measured: {type(exc).__name__}: {exc}"}
    out["moment"] = moment
    return out


def _error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 500 else text[:500] + " …"


Layout = list[tuple[str, tuple[tuple[int, bool], ...]]]   # segments: (pool, ((block size, allocated), ...))


def baseline_layout(device: int = 0) -> Layout | None:
    """The allocator's segments now (``gpulab.measure.gpu.allocator_segments``: what the next run's
    baseline holds, the cuBLAS workspace and the free room around it)."""
    from gpulab.measure.gpu import allocator_segments
    return allocator_segments(device)


def _allocated(layout: Layout) -> int:
    return sum(n for _, blocks in layout for n, used in blocks if used)


def seeded_replay(events: Sequence[Any], layout: Layout) -> tuple[int, int] | None:
    """Peak allocated and reserved bytes above the baseline when the simulator starts from the
    baseline's segments (``gpulab.allocator.simulator.rebuilt_allocator``, as the cuda engine's own
    ``allocator_blocks`` does for allocated bytes); None when it cannot rebuild them."""
    from gpulab.allocator.simulator import rebuilt_allocator
    sim = rebuilt_allocator(layout)
    if sim is None:
        return None
    a0, r0 = sim.memory_allocated(), sim.memory_reserved()
    r = sim.replay(events, strict=False)
    return r.peak_allocated - a0, r.peak_reserved - r0


def measure_model(model: str, optimizer: str, steps: int = STEPS, fake: bool = True) -> ModelRun:
    """One model × optimizer on the cuda engine (after a warm-up run), with the simulator's and
    the fake engine's answers for the same steps. Never raises: an error is stored in the result."""
    import torch

    from gpulab.measure.engines import allocator_blocks
    from gpulab.predict.step import step as tracked_step
    from gpulab.predict.replay import replay_events
    run = ModelRun(model, optimizer, steps=steps)
    t0 = time.perf_counter()
    try:
        warm = tracked_step(model, optimizer=optimizer, engine="cuda", steps=1, guard=False)
        run.warmup_kept = (warm.measurement.beyond_tensors or {}).get("kept_after_run")
        del warm
        # free cached blocks so the measured run allocates like a first run, while what stays
        # allocated (the cuBLAS workspace) sits in the engine's baseline (as tests/test_cuda.py)
        torch.cuda.empty_cache()
        layout = baseline_layout()
        res = tracked_step(model, optimizer=optimizer, engine="cuda", steps=steps, guard=False)
        m = res.measurement
        run.batch, run.image_size = res.batch, res.image_size
        if m.engine != "cuda":
            raise RuntimeError(f"the step ran on the {m.engine} engine, not cuda")
        if m.oom:
            raise RuntimeError(f"out of memory: {m.error}")
        a = m.allocator or {}
        run.tracker_peak = m.peak_bytes
        run.blocks_peak = m.blocks.peak_bytes if m.blocks else None
        run.real_peak = a.get("peak_allocated_delta")
        run.real_reserved_peak = a.get("peak_reserved_delta")
        run.baseline_allocated, run.baseline_reserved = a.get("baseline_allocated"), a.get("baseline_reserved")
        run.beyond_tensors = (m.beyond_tensors or {}).get("bytes")
        nt = (m.beyond_tensors or {}).get("not_tensors")
        if nt:
            run.trace_peak, run.trace_tensor_peak = nt["trace_peak"], nt["tensor_peak"]
            run.trace_tensors_at_peak, run.not_tensor_at_peak = nt["tensors_at_peak"], nt["at_peak"]
            run.not_tensor_count, run.not_tensor_largest = nt["count"], nt["largest_bytes"]
            run.trace_replay_peak = nt.get("replayed_peak_allocated")
            run.trace_replay_reserved = nt.get("replayed_peak_reserved")
        snap = next((s for s in m.snapshots if s.name == "after step"), None)
        if snap is not None:
            run.after_step_tracked, run.after_step_blocks = snap.tracked_bytes, snap.blocks_bytes
            run.after_step_real = snap.allocated_bytes
            run.parameter_bytes = snap.by_category.get("parameters")
            run.optimizer_state_bytes = snap.by_category.get("optimizer_state")
        run.sim_reserved_peak = replay_events(m.tracking.events).peak_reserved
        seeded = seeded_replay(m.tracking.events, layout) \
            if layout is not None and a.get("baseline_allocated") == _allocated(layout) else None
        if seeded is not None:
            run.baseline_blocks = sum(used for _, blocks in layout for _, used in blocks)
            run.seeded_blocks_peak, run.seeded_reserved_peak = seeded
        run.first_step_peak, run.steady_peak = res.first_step_peak_bytes, res.steady_peak_bytes
    except Exception as exc:  # noqa: BLE001 - reported, the validation goes on
        run.error = _error(exc)
    run.seconds = round(time.perf_counter() - t0, 3)
    if fake:
        t1 = time.perf_counter()
        try:
            f = tracked_step(model, optimizer=optimizer, engine="fake", steps=steps, guard=False)   # CUDA target
            if f.measurement.oom:
                raise RuntimeError(f"out of memory: {f.measurement.error}")
            run.fake_tracker_peak = f.peak_bytes
            run.fake_blocks_peak = allocator_blocks(f.measurement.tracking.events).peak_bytes
        except Exception as exc:  # noqa: BLE001
            run.fake_error = _error(exc)
        run.fake_seconds = round(time.perf_counter() - t1, 3)
    return run


# ---- subprocesses (pytest, lessons): bounded in time, logged ---------------------------------------

def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.pop("MPLBACKEND", None)    # lessons as a student gets them: the inline backend
    return env


def run_bounded(cmd: Sequence[str], timeout: float, log: pathlib.Path,
                cwd: pathlib.Path = ROOT) -> tuple[int | None, bool, float]:
    """Run ``cmd`` in its own process group, output to ``log``; past ``timeout`` the group is
    killed. Returns (return code or None, timed out, seconds)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(list(cmd), cwd=cwd, stdout=fh, stderr=subprocess.STDOUT,
                                env=_child_env(), start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, timeout))
            return rc, False, time.monotonic() - t0
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)   # the group this call started, and only it
            except ProcessLookupError:
                pass
            proc.wait()
            fh.write(f"\n[gpu_validation] killed after {timeout:.0f} s (time limit)\n".encode())
            return None, True, time.monotonic() - t0


_SUMMARY = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")


def parse_pytest(log_text: str, junit_xml: str | None) -> dict[str, Any]:
    """Counts from pytest's JUnit XML (exact), else from its last summary line; failed node ids."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures: list[str] = []
    if junit_xml:
        import xml.etree.ElementTree as ET
        root = ET.fromstring(junit_xml)
        for case in root.iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            kinds = {child.tag for child in case}
            if "failure" in kinds:
                counts["failed"] += 1
                failures.append(name)
            elif "error" in kinds:
                counts["errors"] += 1
                failures.append(name + " (error)")
            elif "skipped" in kinds:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
        return {**counts, "failures": failures}
    lines = [ln for ln in log_text.splitlines() if _SUMMARY.search(ln)]
    if lines:
        for n, kind in _SUMMARY.findall(lines[-1]):
            key = "errors" if kind.startswith("error") else kind
            if key in counts:
                counts[key] = int(n)
    failures = re.findall(r"^(?:FAILED|ERROR) (\S+)", log_text, re.MULTILINE)
    return {**counts, "failures": failures}


def run_pytest(out: pathlib.Path, timeout: float, marker: str = "cuda") -> PytestRun:
    xml, log = out / "pytest-cuda.xml", out / "pytest-cuda.log"
    if xml.exists():
        xml.unlink()
    cmd = [sys.executable, "-m", "pytest", "-m", marker, "-q", "-p", "no:cacheprovider", "-rfEs",
           f"--junitxml={xml}", "tests"]
    res = PytestRun(" ".join(["python", *cmd[1:-2], "tests"]), log=log.name)
    try:
        rc, timed_out, seconds = run_bounded(cmd, timeout, log)
    except OSError as exc:
        res.error = _error(exc)
        return res
    res.returncode, res.timed_out, res.seconds = rc, timed_out, round(seconds, 1)
    text = log.read_text(errors="replace") if log.exists() else ""
    try:
        parsed = parse_pytest(text, xml.read_text() if xml.exists() and not timed_out else None)
    except Exception as exc:  # noqa: BLE001 - a broken XML: fall back on the log
        parsed = parse_pytest(text, None)
        res.error = f"JUnit XML unreadable ({_error(exc)}); counts from the log"
    res.passed, res.failed, res.errors, res.skipped = (parsed[k] for k in ("passed", "failed", "errors", "skipped"))
    res.failures = parsed["failures"]
    if rc not in (0, None) and not (res.failed or res.errors) and not res.error:
        res.error = f"pytest exited with status {rc}; see {log.name}"
    return res


def run_record(out: pathlib.Path, record_dir: pathlib.Path, timeout: float) -> RecordRun:
    """``gpulab record --out record_dir`` in a child process; the JSON it wrote, checked."""
    from gpulab.record.lookup import validate_record
    log, record_dir = out / "gpulab-record.log", pathlib.Path(record_dir).resolve()
    cmd = [sys.executable, "-m", "gpulab", "record", "--out", str(record_dir), "--json"]
    res = RecordRun(" ".join(["python", *cmd[1:]]), log=log.name)
    started = time.time()
    try:
        rc, timed_out, seconds = run_bounded(cmd, timeout, log)
    except OSError as exc:
        res.problems = [_error(exc)]
        return res
    res.returncode, res.timed_out, res.seconds = rc, timed_out, round(seconds, 1)
    text = log.read_text(errors="replace") if log.exists() else ""
    summary = next((ln for ln in reversed(text.splitlines()) if ln.startswith("{")), None)
    try:
        path = pathlib.Path(json.loads(summary)["path"]) if summary else None
    except (ValueError, KeyError, TypeError):
        path = None
    if path is None or not path.is_file() or path.stat().st_mtime < started - 1:
        res.problems = [f"no record written (exit status {rc}{', killed: time limit' if timed_out else ''}; "
                        f"see {log.name})"]
        return res
    res.path = str(path)
    try:
        data = json.loads(path.read_text())
        res.experiments = len(data.get("experiments", []))
        res.problems = validate_record(data)
    except (OSError, ValueError) as exc:
        res.problems = [f"unreadable: {_error(exc)}"]
    return res


def lesson_paths(pattern: str = "[0-9][0-9]_*.ipynb") -> list[pathlib.Path]:
    """The lessons matching ``pattern``: a glob in lessons/, or several separated by commas (the
    groups a GPU session runs side by side, e.g. ``11_*,15_*``)."""
    return sorted({p for one in pattern.split(",") if one.strip() for p in LESSONS_DIR.glob(one.strip())})


def execute_lesson(path: pathlib.Path, executed: pathlib.Path, result_json: pathlib.Path,
                   cell_timeout: float) -> int:
    """The child process's job: Run All of one lesson with nbclient, errors collected as the tests
    collect them (tests/conftest.py's ``notebook_client`` and ``notebook_errors``), the executed
    notebook and a small JSON written. Returns 0 when the lesson ran without error."""
    import nbformat
    sys.path.insert(0, str(ROOT / "tests"))
    try:   # the tests' client (waits that cannot miss a message) and error finder
        from conftest import notebook_client, notebook_errors
    except Exception:  # noqa: BLE001 - tests/ absent or broken: plain nbclient
        from nbclient import NotebookClient as notebook_client  # type: ignore[no-redef]

        def notebook_errors(nb):  # type: ignore[no-redef]
            return [f"cell {i}: {o.get('ename')}: {o.get('evalue')}" for i, c in enumerate(nb.cells)
                    for o in c.get("outputs", []) if o.get("output_type") == "error"]
    nb = nbformat.read(path, as_version=4)
    client = notebook_client(nb, timeout=int(cell_timeout), kernel_name="python3", store_widget_state=True,
                             resources={"metadata": {"path": str(path.parent)}})
    t0 = time.monotonic()
    stopped = None
    try:
        client.execute()
    except Exception as exc:  # noqa: BLE001 - CellExecutionError, CellTimeoutError, DeadKernelError
        ename = getattr(exc, "ename", None)   # a cell's own error: also in its outputs
        stopped = f"{ename}: {getattr(exc, 'evalue', '')}" if ename else _error(exc).splitlines()[0]
    seconds = time.monotonic() - t0
    errors = list(notebook_errors(nb))
    if stopped and not any(stopped in e for e in errors):
        errors.append(f"execution stopped: {stopped}")
    executed.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, executed)
    gpu_labels = None
    try:
        import torch
        if torch.cuda.is_available():
            from gpulab.measure.engines import label_cuda
            gpu_labels = json.dumps(nb.dict()).count(label_cuda(torch.cuda.get_device_name(0)))
    except Exception:  # noqa: BLE001 - a count for the report, not a check
        pass
    result_json.write_text(json.dumps({"seconds": round(seconds, 1), "errors": errors, "gpu_labels": gpu_labels}))
    return 0 if not errors else 1


def run_lesson(path: pathlib.Path, out: pathlib.Path, timeout: float,
               cell_timeout: float = CELL_TIMEOUT_S) -> LessonRun:
    """One lesson in a child process (``--run-lesson``), killed past ``timeout``."""
    lessons = out / "lessons"
    executed, result_json, log = lessons / path.name, lessons / f"{path.stem}.json", lessons / f"{path.stem}.log"
    for p in (executed, result_json):
        if p.exists():
            p.unlink()
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--run-lesson", str(path),
           "--executed", str(executed), "--result-json", str(result_json),
           "--cell-timeout", str(int(min(cell_timeout, timeout)))]
    res = LessonRun(path.stem)
    try:
        rc, timed_out, seconds = run_bounded(cmd, timeout, log)
    except OSError as exc:
        res.errors = [_error(exc)]
        return res
    res.seconds, res.timed_out = round(seconds, 1), timed_out
    if executed.exists():
        res.executed = str(executed.relative_to(out))
    if timed_out:
        res.errors = [f"killed after {timeout:.0f} s (lesson timeout)"]
        return res
    try:
        child = json.loads(result_json.read_text())
    except (OSError, ValueError):
        tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
        res.errors = [f"the lesson's process ended with status {rc} and no result: " + " / ".join(tail)]
        return res
    res.seconds = child.get("seconds", res.seconds)
    res.errors = list(child.get("errors", []))
    res.gpu_labels = child.get("gpu_labels")
    res.ok = rc == 0 and not res.errors
    return res


# ---- the report (pure: data -> markdown) ---------------------------------------------------------

def _mib(n: int | None) -> str:
    return "—" if n is None else f"{n / 2**20:,.2f} MiB"


def _signed_bytes(n: int) -> str:
    sign = "+" if n >= 0 else "−"
    n = abs(n)
    return f"{sign}{n:,} B" if n < 2**20 else f"{sign}{n / 2**20:,.2f} MiB"


def _pct(d: float | None) -> str:
    if d is None:
        return "—"
    if d == float("inf"):
        return "∞"
    return f"{'+' if d >= 0 else '−'}{abs(d) * 100:.2f}%"


def _target(tol: float) -> str:
    return "exact" if tol == 0 else f"within ±{tol * 100:g}%"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out


def _summary(checks: Sequence[Check], target: str) -> tuple[str, str]:
    measured = [c for c in checks if c.passed is not None]
    if not measured:
        return target, "not measured"
    bad = [c for c in measured if not c.passed]
    worst = max(measured, key=lambda c: abs(c.difference or 0))
    worst_text = f"worst {worst.subject} {_pct(worst.difference)}"
    if bad:
        return target, (f"MISS: {len(bad)} of {len(measured)} outside ({', '.join(c.subject for c in bad)}); "
                        + worst_text)
    return target, f"PASS: {len(measured)}/{len(measured)} within; " + worst_text


def is_stand_in(device: dict[str, Any]) -> bool:
    from gpulab.record.lookup import is_stand_in as named_stand_in
    return bool(device.get("stand_in")) or named_stand_in(device.get("gpu_name", ""))


def device_lines(device: dict[str, Any]) -> list[str]:
    name = device.get("gpu_name", "unknown")
    total = device.get("gpu_total_bytes")
    mem = f"{total / 2**30:,.1f} GiB" if total else "unknown"
    cudnn = str(device.get("cudnn"))
    cudnn = cudnn if len(cudnn) <= 60 else cudnn[:60] + " …"
    facts = (f"{name}, {mem}; driver {device.get('driver')}, CUDA runtime {device.get('cuda_runtime')}, "
             f"cuDNN {cudnn}, compute capability {device.get('compute_capability')}; "
             f"torch {device.get('torch')}, torchvision {device.get('torchvision')}, "
             f"Python {device.get('python')}; gpulab {device.get('gpulab_version')} "
             f"(commit {device.get('gpulab_commit') or 'unknown'}); {device.get('time_utc') or device.get('date')}")
    if is_stand_in(device):
        return [f"**Device: {name} — NOT A GPU.** This report comes from the test suite's stand-in "
                "(tests/cuda_standin.py: meta tensors, gpulab's own allocator simulator as the \"real\" "
                "counters). No GPU measured any figure below; it checks the script, not gpulab.", "",
                f"Software: {facts}."]
    lines = [f"**Device:** {facts}."]
    if device.get("pytorch_cuda_alloc_conf"):
        lines.append(f"PYTORCH_CUDA_ALLOC_CONF={device['pytorch_cuda_alloc_conf']} "
                     "(the simulator models the defaults).")
    return lines


PEAK_ROW = "tracker + simulator vs the tensors' real peak (the allocator's trace; without one, `max_memory_allocated`)"
FAKE_ROW = "fake engine (CUDA target) vs the tensors' real peak (the trace's; without one, the allocated peak)"


def summary_rows(report: Report) -> list[list[str]]:
    """[check, target, result] for every part that ran; a result starts with PASS, MISS or
    "not measured"."""
    runs = [r for r in report.models if r.error is None]
    peak_checks = [tracker_checks(r)[0] for r in runs]
    after_checks = [tracker_checks(r)[1] for r in runs]
    res_checks = [reserved_check(r) for r in runs]
    fake_checks = [fake_check(r) for r in runs]
    st_checks = [state_check(r) for r in runs]
    rows = []
    if report.record is not None:
        rec = report.record
        rows.append(["`gpulab record`", "writes a record `validate_record` accepts",
                     (f"PASS: {rec.experiments} experiments in `{rec.path}`" if rec.ok
                      else "MISS: " + "; ".join(rec.problems or [f"exit status {rec.returncode}"]))])
    if report.pytest is not None:
        p = report.pytest
        ok = p.returncode == 0 and not p.timed_out and p.failed == 0 and p.errors == 0 and p.passed > 0
        why = ("timed out" if p.timed_out else p.error or ("no test passed" if not p.passed else ""))
        rows.append(["`pytest -m cuda`", "all pass",
                     f"{'PASS' if ok else 'MISS'}: {p.passed} passed, {p.failed} failed, {p.errors} errors, "
                     f"{p.skipped} skipped" + (f" ({why})" if why and not ok else "")])
    if report.lessons:
        ran = [x for x in report.lessons if not x.skipped]
        good = [x for x in ran if x.ok]
        bad = [x.name for x in report.lessons if not x.ok]
        rows.append(["lessons, headless (nbclient)", "every lesson runs without error",
                     f"{'PASS' if not bad else 'MISS'}: {len(good)}/{len(report.lessons)} ran clean"
                     + (f"; failed or not run: {', '.join(bad)}" if bad else "")])
    if report.models:
        errs = [f"{r.model}/{r.optimizer}" for r in report.models if r.error]
        tracker = _target(TRACKER_TOL)
        rows.append([PEAK_ROW, *_summary(peak_checks, tracker)])
        traced = [r for r in runs if r.trace_tensors_at_peak is not None]
        if traced:
            rows.append(["simulator replaying the allocator's trace (tensors + cuDNN workspaces) vs "
                         "`max_memory_allocated`", *_summary([trace_check(r) for r in traced], tracker)])
        rows.append(["tracker + simulator vs `memory_allocated` (after step)", *_summary(after_checks, tracker)])
        rows.append(["simulated (the trace's replay; without one, the tracked events') vs real `max_memory_reserved`",
                     *_summary(res_checks, _target(RESERVED_TOL))])
        rows.append([FAKE_ROW, *_summary(fake_checks, _target(FAKE_TOL))])
        ws = [r for r in runs if r.not_tensor_at_peak is not None]
        worst = max(ws, key=lambda r: r.not_tensor_at_peak / max(1, r.real_peak or 1), default=None)
        rows.append(["diagnostic: allocations no tensor owns at the peak (not predicted by the fake engine)",
                     NO_TARGET, (f"largest share {worst.model}/{worst.optimizer}: {_mib(worst.not_tensor_at_peak)} "
                                 f"of {_mib(worst.real_peak)} ({len(ws)} runs)") if worst else "no trace"])
        rows.append(["optimizer state = k × parameters (sgd 0, momentum 1, adam 2)", *_summary(st_checks, "exact")])
        if errs:
            rows.append(["model runs", "every run completes", f"MISS: failed {', '.join(errs)}"])
        seeded = [Check(f"{r.model}/{r.optimizer}", r.seeded_blocks_peak, r.real_peak, TRACKER_TOL)
                  for r in runs if r.seeded_blocks_peak is not None]
        seeded_res = [Check(f"{r.model}/{r.optimizer}", r.seeded_reserved_peak, r.real_reserved_peak, RESERVED_TOL)
                      for r in runs if r.seeded_reserved_peak is not None]
        for name, checks in (("allocated", seeded), ("reserved", seeded_res)):
            worst = max(checks, key=lambda c: abs(c.difference or 0), default=None)
            rows.append([f"diagnostic: simulator started from the baseline's segments, peak {name}", NO_TARGET,
                         f"worst {worst.subject} {_pct(worst.difference)} ({len(checks)} runs)" if worst
                         else "not available (no memory_snapshot)"])
    ctx = report.context_before or {}
    rows.append(["CUDA context (NVML used − `memory_reserved`)", NO_TARGET,
                 _mib(ctx.get("bytes")) if ctx.get("bytes") is not None else ctx.get("label", "not measured")])
    return rows


def missed(report: Report) -> list[str]:
    """The summary's checks that did not pass (MISS or not measured), and the parts the time
    limit left out."""
    bad = [check for check, target, result in summary_rows(report)
           if target != NO_TARGET and result.startswith(("MISS", "not measured"))]
    return bad + [x for x in report.not_run if "time limit" in x]


def render_markdown(report: Report) -> str:
    """The report as markdown: device first, then a summary of every target, then the tables."""
    dev = report.device
    measured_on = "a stand-in (no GPU)" if is_stand_in(dev) else dev.get("gpu_name", "a GPU")
    L = ["# GPU validation", "",
         f"Generated by `benchmarks/gpu_validation.py` on {measured_on}; do not edit by hand, rerun the "
         "script (issue 16, item 4). Raw figures: `gpu-validation.json` in the run's `--out` folder, "
          "with the logs.", ""]
    L += device_lines(dev) + [""]
    rows = summary_rows(report)
    L += ["## Summary", ""] + _table(["check", "target", "result"], rows) + [""]
    if report.not_run:
        L += ["Not run: " + "; ".join(report.not_run) + ".", ""]
    if report.earlier:
        L += ["Merged (`--merge`, `--combine`) from runs of this script on the same GPU: "
              + "; ".join(report.earlier) + ".", ""]

    if report.record is not None:
        rec = report.record
        L += ["## `gpulab record`", "", f"`{rec.command}`: exit status "
              f"{'— (killed: time limit)' if rec.timed_out else rec.returncode}, {rec.seconds} s; "
              f"file `{rec.path}`, {rec.experiments} experiments. Log: `{rec.log}`.", ""]
        if rec.problems:
            L += ["Problems: " + "; ".join(rec.problems), ""]
    if report.pytest is not None:
        p = report.pytest
        L += ["## `pytest -m cuda`", "", f"`{p.command}`: exit status "
              f"{'— (killed: time limit)' if p.timed_out else p.returncode}, {p.seconds} s; "
              f"{p.passed} passed, {p.failed} failed, {p.errors} errors, {p.skipped} skipped. Log: `{p.log}`.", ""]
        if p.error:
            L += [f"Error: {p.error}", ""]
        if p.failures:
            L += ["Failed: " + ", ".join(f"`{f}`" for f in p.failures), ""]

    if report.lessons:
        L += ["## Lessons, executed headless", "",
              "Run All of each lesson in a fresh kernel (nbclient, one process per lesson, cell timeout "
              "and lesson timeout); `GPU labels`: outputs that say *measured on this GPU (cuda)*.", ""]
        L += _table(["lesson", "seconds", "GPU labels", "result", "errors"],
                    [[x.name, "—" if x.seconds is None else f"{x.seconds:.1f}",
                      "—" if x.gpu_labels is None else x.gpu_labels,
                      "not run" if x.skipped else ("PASS" if x.ok else ("MISS (timed out)" if x.timed_out else "MISS")),
                      x.skipped or "; ".join(x.errors) or ""] for x in report.lessons]) + [""]

    if report.models:
        L += _model_sections(report)
    if report.context_before or report.context_after:
        L += ["## CUDA context", "",
              "NVML's device-wide used memory minus `memory_reserved`: the CUDA context, other processes, "
              "memory not allocated through PyTorch's allocator (`gpulab.predict.replay.beyond_allocator_bytes`). "
              "Before the first experiment, the kernels not yet loaded (CUDA lazy loading) are not in it.", ""]
        ctx_rows = []
        for c in (report.context_before, report.context_after):
            if c:
                ctx_rows.append([c.get("moment", ""), _mib(c.get("bytes")), _mib(c.get("nvml_used")),
                                 _mib(c.get("reserved")), c.get("label", "")])
        L += _table(["moment", "context estimate", "NVML used", "memory_reserved", "label"], ctx_rows) + [""]
    if report.seconds is not None:
        L += [f"The validation took {report.seconds:.0f} s."]
    return "\n".join(L).rstrip() + "\n"


def _model_sections(report: Report) -> list[str]:
    runs = [r for r in report.models if r.error is None]
    L = ["## Tracker vs the CUDA caching allocator", "",
         f"Each model at its default batch and image size, {STEPS} training steps (float32) on the cuda "
         "engine, after one warm-up run: what a process allocates once (the cuBLAS workspace) is in the "
         "baseline. *tracker blocks*: the tracked tensors replayed through gpulab's allocator simulator "
         "(512-byte rounding, large blocks left unsplit when ≤ 1 MiB would remain); *real*: the "
         "allocator's counter minus the run's baseline; *beyond tensors*: the allocator's peak beyond the "
         "tensors' blocks. *trace*: the caching allocator's own record of the run "
         "(`torch.cuda.memory._record_memory_history`, taken by the cuda engine), each entry told apart as a "
         "tracked tensor's (same address and bytes) or an allocation no tensor owns "
         "(`gpulab.measure.non_tensor`; on GPUs measured so far, cuDNN's convolution workspaces); the "
         "trace holds requested bytes. The tracker's peak (each storage rounded to 512 B) is checked against "
         "the tensors' peak in the trace (each request rounded to 512 B); the simulator replaying the whole "
         "trace (tensors and workspaces) from the run's starting segments, against `max_memory_allocated`. "
         f"Target {_target(TRACKER_TOL)}.", ""]
    rows = []
    for r in runs:
        peak, after = tracker_checks(r)
        whole = trace_check(r)
        rows.append([r.model, r.optimizer, r.batch, _mib(r.tracker_peak), _mib(r.blocks_peak),
                     _mib(r.trace_tensor_peak), _pct(peak.difference), peak.verdict,
                     _mib(r.trace_tensors_at_peak), _mib(r.not_tensor_at_peak), r.not_tensor_count,
                     _mib(r.trace_replay_peak), _mib(r.real_peak), _pct(whole.difference), whole.verdict,
                     _mib(r.after_step_blocks), _mib(r.after_step_real),
                     _pct(after.difference), after.verdict, _mib(r.beyond_tensors)])
    L += _table(["model", "optimizer", "batch", "tracker (512 B)", "tracker blocks peak",
                 "trace: tensors' peak", "diff", "verdict", "trace at its peak: tensors",
                 "… allocations no tensor owns", "how many (whole run)", "simulator replaying the trace: peak",
                 "real peak (max_memory_allocated − baseline)", "diff", "verdict", "tracker blocks after step",
                 "real after step (memory_allocated − baseline)", "diff", "verdict", "beyond tensors (peak)"],
                rows) + [""]
    failed = [r for r in report.models if r.error]
    if failed:
        L += ["Runs that failed:", ""] + [f"- {r.model}/{r.optimizer}: {r.error}" for r in failed] + [""]

    L += ["## Simulated vs real reserved memory", "",
          "`gpulab.allocator.simulator.CachingAllocator` replaying the allocator's own trace of the run (tensors "
          "and the allocations no tensor owns) from the run's starting segments, vs `max_memory_reserved` − "
          "baseline (the verdict; without a trace, the next column's). Beside it, the tracked tensors' events "
          "alone replayed from an empty cache (`gpulab.predict.replay.replay_events`): they miss cuDNN's "
          "workspaces and the free room of segments the baseline already holds. "
          f"Target {_target(RESERVED_TOL)}.", ""]
    L += _table(["model", "optimizer", "simulator, the trace's replay", "simulator, tracked tensors only",
                 "real reserved peak", "baseline reserved", "diff", "verdict"],
                [[r.model, r.optimizer, _mib(r.trace_replay_reserved), _mib(r.sim_reserved_peak),
                  _mib(r.real_reserved_peak), _mib(r.baseline_reserved), _pct(reserved_check(r).difference),
                  reserved_check(r).verdict] for r in runs]) + [""]

    seeded = [r for r in runs if r.seeded_blocks_peak is not None]
    L += ["### Diagnostic: the simulator started from the baseline's blocks", "",
          ("The replays above start from an empty allocator; the real one starts from the run's baseline "
           "(blocks a process keeps, such as the cuBLAS workspace, whose segment's free room later "
           "requests use). Here the simulator first rebuilds the baseline's segments, block by block "
           "(`torch.cuda.memory_snapshot()`), then replays the run. No verdict: it says whether a "
           "difference above comes from that starting state."), ""]
    if seeded:
        L += _table(["model", "optimizer", "baseline blocks", "baseline allocated", "seeded blocks peak",
                     "real peak", "diff", "seeded reserved peak", "real reserved peak", "diff"],
                    [[r.model, r.optimizer, r.baseline_blocks, _mib(r.baseline_allocated),
                      _mib(r.seeded_blocks_peak), _mib(r.real_peak),
                      _pct(Check("", r.seeded_blocks_peak, r.real_peak, 0).difference),
                      _mib(r.seeded_reserved_peak), _mib(r.real_reserved_peak),
                      _pct(Check("", r.seeded_reserved_peak, r.real_reserved_peak, 0).difference)]
                     for r in seeded]) + [""]
    else:
        L += ["Not available: `torch.cuda.memory_snapshot()` did not give the baseline's blocks, or the "
              "simulator could not rebuild its segments.", ""]
    L += ["## Fake engine vs the real GPU", "",
          "`training_step(..., engine=\"fake\")` (fake tensors, CUDA's kernel choices, no compute): its peak, each "
          "storage rounded to 512 B, vs the tensors' real peak in the allocator's trace, each request rounded "
          "to 512 B (its events replayed as allocator blocks are beside it). The fake engine "
          "does not predict the allocations no tensor owns (cuDNN's workspaces: their sizes are cuDNN's "
          "choice on the GPU at hand); the real peak and the fake prediction's difference from it are "
          f"beside it. Target {_target(FAKE_TOL)}.", ""]
    L += _table(["model", "optimizer", "fake prediction (blocks)", "fake tracker (512 B)", "real tensors' peak",
                 "diff", "verdict", "real peak (all)", "diff from it", "fake seconds"],
                [[r.model, r.optimizer, _mib(r.fake_blocks_peak), _mib(r.fake_tracker_peak),
                  _mib(r.trace_tensor_peak), _pct(fake_check(r).difference),
                  f"error: {r.fake_error}" if r.fake_error else fake_check(r).verdict, _mib(r.real_peak),
                  _pct(Check("", r.fake_blocks_peak, r.real_peak, 0).difference),
                  "—" if r.fake_seconds is None else f"{r.fake_seconds:.2f}"] for r in runs]) + [""]

    L += ["## Optimizer state = k × parameter bytes", "",
          "The tracker's categories after the last step (each storage rounded to 512 B; the state tensors "
          "have the parameters' shapes, so the rounding cancels). CUDA keeps Adam's step counters on the "
          "host: they are not GPU bytes. Target: exact.", ""]
    L += _table(["model", "optimizer", "k", "parameters", "optimizer state", "k × parameters", "verdict"],
                [[r.model, r.optimizer, r.state_multiplier, _mib(r.parameter_bytes), _mib(r.optimizer_state_bytes),
                  _mib(state_check(r).reference), state_check(r).verdict] for r in runs]) + [""]

    L += ["## First step vs steady state", "",
          "The tracker's peak in step 1 (no optimizer state yet) and in step 2 (the state exists from the "
          "start: the steady state of a training run), as `gpulab.step(..., steps=2)` reports them. No target.", ""]
    L += _table(["model", "optimizer", "first step peak", "steady-state peak", "steady − first"],
                [[r.model, r.optimizer, _mib(r.first_step_peak), _mib(r.steady_peak),
                  "—" if r.first_step_peak is None or r.steady_peak is None
                  else _signed_bytes(r.steady_peak - r.first_step_peak)] for r in runs]) + [""]
    return L


# ---- the command ---------------------------------------------------------------------------------

# a section benchmarks/practitioner_validation.py wrote into the same file (--md): kept, after the report
KEPT_SECTION = re.compile(r"<!-- PRACTITIONER_START.*?<!-- PRACTITIONER_END -->\n?", re.S)


def write_report(report: Report, out: pathlib.Path, md: pathlib.Path | None = None) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / JSON_NAME).write_text(json.dumps(report.as_dict(), indent=1, sort_keys=True) + "\n")
    text = render_markdown(report)
    (out / MD_NAME).write_text(text)
    if md is not None:
        md.parent.mkdir(parents=True, exist_ok=True)
        kept = "".join(m.group(0) for m in KEPT_SECTION.finditer(md.read_text())) if md.exists() else ""
        md.write_text(text + ("\n" + kept if kept else ""))
    return text


def _put(items: list, item: Any, key: Callable[[Any], Any]) -> None:
    """Replace the entry with ``item``'s key (an earlier run's), else append."""
    for i, x in enumerate(items):
        if key(x) == key(item):
            items[i] = item
            return
    items.append(item)


def _model_key(r: ModelRun) -> tuple[str, str]:
    return (r.model, r.optimizer)


def load_report(out: pathlib.Path) -> Report | None:
    try:
        return Report.from_dict(json.loads((out / JSON_NAME).read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _measured(report: Report) -> str:
    parts = [f"{len(report.models)} model comparisons" if report.models else "",
             "`pytest -m cuda`" if report.pytest else "", "`gpulab record`" if report.record else "",
             f"{len(report.lessons)} lesson{'s' if len(report.lessons) > 1 else ''}" if report.lessons else ""]
    return ", ".join(x for x in parts if x) or "nothing"


def combine_reports(reports: Sequence[Report]) -> Report:
    """Reports of runs on one GPU made side by side (each its own --out) as one: the first is the
    base, each later one's model comparisons, lessons, pytest and record replace or join it; a
    part left out of one run and measured by another is no longer "not run"; ``earlier`` says
    which run measured what. Raises ValueError for reports of different GPUs."""
    if not reports:
        raise ValueError("no report to combine")
    names = {r.device.get("gpu_name") for r in reports}
    if len(names) > 1:
        raise ValueError(f"the reports come from different GPUs ({', '.join(sorted(map(str, names)))}); "
                         "combine one GPU's runs at a time")
    base = Report.from_dict(reports[0].as_dict())
    for r in reports[1:]:
        for m in r.models:
            _put(base.models, m, _model_key)
        for x in r.lessons:
            _put(base.lessons, x, lambda y: y.name)
        base.pytest = r.pytest or base.pytest
        base.record = r.record or base.record
        base.not_run += [x for x in r.not_run if x not in base.not_run]
        base.context_after = base.context_after or r.context_after
    base.lessons.sort(key=lambda x: x.name)
    done = {"lessons": bool(base.lessons), "pytest": base.pytest is not None, "model": bool(base.models)}
    measured = {f"{m.model}/{m.optimizer}" for m in base.models}
    base.not_run = [x for x in base.not_run
                    if not (x.startswith("lessons") and done["lessons"]) and not (x.startswith("pytest") and done["pytest"])
                    and not (x.startswith("model comparisons") and done["model"])
                    and x.split(":")[0] not in measured]
    base.earlier = [x for r in reports for x in r.earlier] + [
        f"run started {r.started} (commit {str(r.device.get('gpulab_commit') or 'unknown')[:7]}): {_measured(r)}"
        for r in reports]
    base.seconds = None
    return base


def validate(out: pathlib.Path, md: pathlib.Path | None = None, *, skip_lessons: bool = False,
             skip_pytest: bool = False, skip_models: bool = False, time_limit: float = DEFAULT_TIME_LIMIT_S,
             models: Sequence[str] = MODELS, optimizers: Sequence[str] = OPTIMIZERS,
             lessons: Sequence[pathlib.Path] | None = None, commit: str | None = None,
             command: Sequence[str] | None = None, merge: bool = False,
             record_dir: pathlib.Path | None = None,
             progress: Callable[[str], None] | None = None) -> Report:
    """The whole validation on CUDA device 0: models, then pytest, then the lessons, writing the
    report after each part. Needs ``torch.cuda.is_available()``.

    ``merge``: start from ``out``'s earlier report (same GPU): what this run measures replaces
    its entries (per model × optimizer, per lesson), the rest is kept and the report says so;
    a long validation can so be split over several commands."""
    t0 = time.monotonic()
    deadline = t0 + time_limit
    say = progress or (lambda _msg: None)
    out = pathlib.Path(out).resolve()          # the children run in the repository's root
    report = Report(device={}, started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    try:
        report.device = device_facts(command, commit)
    except Exception as exc:  # noqa: BLE001
        report.device = {"gpu_name": "unknown", "error": _error(exc)}
    report.context_before = cuda_context("before any experiment")
    old = load_report(out) if merge else None
    if old is not None and old.device.get("gpu_name") != report.device.get("gpu_name"):
        report.not_run.append(f"the earlier report in {out} (device {old.device.get('gpu_name')}) was not merged: "
                              "another device")
        old = None
    if old is not None:
        report.models, report.lessons, report.pytest = list(old.models), list(old.lessons), old.pytest
        report.record = old.record
        report.context_after = old.context_after
        report.earlier = [x for x in old.earlier if not x.startswith("run started ")]
        report.earlier.append(f"run started {old.started}: whatever this run did not measure again")

    def save() -> None:
        report.seconds = time.monotonic() - t0
        write_report(report, out, md)

    save()
    if record_dir is not None:
        say(f"gpulab record --out {record_dir}")
        report.record = run_record(out, record_dir, min(RECORD_TIMEOUT_S, deadline - time.monotonic() - 5))
        save()
    if skip_models:
        if old is None or not old.models:
            report.not_run.append("model comparisons (--skip-models)")
    else:
        for model in models:
            for opt in optimizers:
                if time.monotonic() > deadline:
                    report.not_run.append(f"{model}/{opt}: time limit reached")
                    continue
                say(f"model {model} / {opt}")
                _put(report.models, measure_model(model, opt), _model_key)
                save()
        report.context_after = cuda_context("after the model runs")
        save()
    from gpulab.measure.engines import release_cuda_memory
    try:
        release_cuda_memory(0)     # the children share the GPU with this process
    except Exception:  # noqa: BLE001
        pass
    if skip_pytest:
        if report.pytest is None:
            report.not_run.append("pytest -m cuda (--skip-pytest)")
    elif deadline - time.monotonic() < MIN_PART_S:
        report.not_run.append("pytest -m cuda: time limit reached")
    else:
        say("pytest -m cuda")
        report.pytest = run_pytest(out, min(PYTEST_TIMEOUT_S, deadline - time.monotonic() - 5))
        save()
    if skip_lessons:
        if not report.lessons:
            report.not_run.append("lessons (--skip-lessons)")
    else:
        for path in (lesson_paths() if lessons is None else lessons):
            left = deadline - time.monotonic() - 5
            if left < MIN_PART_S:
                if not any(x.name == path.stem and not x.skipped for x in report.lessons):
                    _put(report.lessons, LessonRun(path.stem, skipped="not run: time limit reached"),
                         lambda x: x.name)
                continue
            say(f"lesson {path.stem}")
            _put(report.lessons, run_lesson(path, out, min(LESSON_TIMEOUT_S, left)), lambda x: x.name)
            save()
        report.lessons.sort(key=lambda x: x.name)
    save()
    return report


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu_validation.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu-validation", help="folder for the JSON, the markdown and the logs")
    p.add_argument("--md", default=None, help="also write the markdown here (e.g. docs/gpu-validation.md)")
    p.add_argument("--skip-lessons", action="store_true")
    p.add_argument("--skip-pytest", action="store_true")
    p.add_argument("--skip-models", action="store_true")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated (default: the CLI models)")
    p.add_argument("--lessons", default="[0-9][0-9]_*.ipynb", help="a glob in lessons/, or several separated by commas (default: all)")
    p.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S,
                   help=f"seconds for the whole run (default {DEFAULT_TIME_LIMIT_S}); "
                        "parts past it are reported as not run")
    p.add_argument("--commit", default=None, help="gpulab's git commit, where the machine has no .git")
    p.add_argument("--record", default=None, metavar="DIR",
                   help="first run `gpulab record --out DIR` (a subprocess) and check the file it writes")
    p.add_argument("--combine", nargs="+", default=None, metavar="DIR",
                   help="no GPU needed: write one report into OUT (and --md) from the reports in these folders, "
                        "runs on one GPU made side by side")
    p.add_argument("--merge", action="store_true",
                   help="keep what OUT's earlier report (same GPU) measured and this run does not measure again")
    # the child process that runs one lesson (internal)
    p.add_argument("--run-lesson", default=None, help=argparse.SUPPRESS)
    p.add_argument("--executed", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cell-timeout", type=float, default=CELL_TIMEOUT_S, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.run_lesson:
        return execute_lesson(pathlib.Path(args.run_lesson), pathlib.Path(args.executed),
                              pathlib.Path(args.result_json), args.cell_timeout)
    if args.combine:
        try:
            report = combine_reports([Report.from_dict(json.loads((pathlib.Path(d) / JSON_NAME).read_text()))
                                      for d in args.combine])
        except (OSError, ValueError, TypeError, KeyError) as exc:
            print(f"gpu_validation: error: cannot combine {' '.join(args.combine)}: {exc}", file=sys.stderr)
            return 2
        write_report(report, pathlib.Path(args.out), pathlib.Path(args.md) if args.md else None)
        return 1 if missed(report) else 0
    if not cuda_available():   # the same check as `gpulab record`
        print("gpu_validation: error: the GPU validation needs a CUDA GPU (torch.cuda.is_available() is False); "
              "nothing was measured", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out)
    md = pathlib.Path(args.md) if args.md else None
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    report = validate(out, md, skip_lessons=args.skip_lessons, skip_pytest=args.skip_pytest,
                      skip_models=args.skip_models, time_limit=args.time_limit, models=models,
                      lessons=lesson_paths(args.lessons), commit=args.commit, merge=args.merge,
                      record_dir=pathlib.Path(args.record) if args.record else None,
                      command=["benchmarks/gpu_validation.py", *(sys.argv[1:] if argv is None else argv)],
                      progress=lambda msg: print(f"[gpu_validation] {msg}", flush=True))
    bad = missed(report)
    print(f"[gpu_validation] report: {out / MD_NAME}" + (f" and {md}" if md else "")
          + f"; raw figures: {out / JSON_NAME} ({report.seconds:.0f} s); "
          + (f"MISS: {', '.join(bad)}" if bad else "every target PASS"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
