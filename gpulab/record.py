"""``gpulab record``: measure a fixed set of experiments on a real GPU, and read such records back.

A CPU-only student sees real GPU numbers only through **recorded runs**: JSON files that
``gpulab record`` wrote on a GPU and that ship in ``gpulab/recorded/`` (see its README.md). Every
figure read from one is labelled ``recorded on <GPU>, <date>, torch <version>``
(``engines.label_recorded``).

The record set (``EXPERIMENTS``, plain data: name, kind, parameters, the lesson panel it serves)
holds only what the library itself runs, so the command never imports the course:

* ``step`` (lesson 04's step panel, lesson 05's optimizer comparison, ``gpulab step``): one training
  step of every CLI model (vgg16, alexnet, resnet18, cnn, mlp) × sgd / momentum / adam, float32, at
  the model's default batch and image size, plus the step panel's default (cnn, batch 32, adam);
* ``step`` at growing batch sizes (lesson 04's batch sweep and largest-batch check): cnn at batch
  8 … 256 and resnet18 at batch 1 … 32, sgd, float32;
* ``fragmentation`` (lesson 09's allocator panel): the scenario of
  ``replay.fragmentation_events`` allocated for real on the GPU (8 × 6 MiB, every other freed,
  then 4 × 12 MiB), with the allocator's own counters;
* the CUDA context estimate (lesson 09, lesson 00): NVML used − ``memory_reserved`` before the
  experiments, in the record's ``device`` section.

NB: lesson 07's checkpoint sweep and lesson 08's autocast sweep live in ``gpulab.course`` and are
not recorded yet. ``--quick`` records a small subset (the two small models, one optimizer, the
fragmentation scenario) to check the command itself.

Each result is a plain JSON-able dict: a step's is ``StepResult.as_dict()`` (per-category peaks,
the allocator's ``memory_allocated`` / ``max_memory_allocated`` / ``memory_reserved`` peaks and
baselines of the run, NVML used, timings). Records from the test suite's stand-in GPU are refused
by ``validate_record``: only a real GPU's numbers may ever be shown as recorded.
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import re
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

from .engines import label_recorded, release_cuda_memory, run

RECORD_FORMAT = 1
ENV_DIR = "GPULAB_RECORDED_DIR"   # points the loader at another folder (tests, instructors)
PACKAGE_DIR = pathlib.Path(__file__).resolve().parent / "recorded"

# Provenance every record must carry (validate_record checks each one is present).
PROVENANCE_FIELDS = ("gpu_name", "gpu_total_bytes", "driver", "cuda_runtime", "cudnn", "torch",
                     "torchvision", "gpulab_version", "gpulab_commit", "date", "command", "stand_in")
# What a GPU that is not one says in its name (tests/cuda_standin.py's "stand-in GPU (no CUDA)").
STAND_IN_MARKERS = ("stand-in", "no cuda")


@dataclass(frozen=True)
class RecordExperiment:
    """One entry of the record set: data only, run by ``run_experiment``."""
    name: str
    kind: str                      # "step" or "fragmentation"
    params: dict[str, Any] = field(default_factory=dict)
    serves: str = ""               # the lesson panel that shows it
    quick: bool = False            # part of ``--quick``


def _step(name: str, model: str, batch: int, image_size: int, optimizer: str, serves: str,
          quick: bool = False) -> RecordExperiment:
    return RecordExperiment(name, "step", {"model": model, "batch": batch, "image_size": image_size,
                                           "optimizer": optimizer, "dtype": "float32"}, serves, quick)


def _experiments() -> tuple[RecordExperiment, ...]:
    defaults = {"vgg16": (1, 224), "alexnet": (1, 224), "resnet18": (1, 224), "cnn": (32, 32), "mlp": (32, 32)}
    out = []
    for model, (batch, size) in defaults.items():
        for opt in ("sgd", "momentum", "adam"):
            out.append(_step("step", model, batch, size, opt, "lesson 04 step panel, lesson 05, gpulab step",
                             quick=model in ("cnn", "mlp") and opt == "sgd"))
    out.append(_step("step", "cnn", 32, 32, "adam", "lesson 04 step panel (its default)"))
    for b in (8, 16, 64, 128, 256):
        out.append(_step("batch sweep", "cnn", b, 32, "sgd", "lesson 04 batch sweep, largest batch"))
    for b in (2, 4, 8, 16, 32):
        out.append(_step("batch sweep", "resnet18", b, 224, "sgd", "lesson 04 batch sweep, largest batch"))
    out.append(RecordExperiment("fragmentation", "fragmentation", {"n": 8, "block_mib": 6, "big_mib": 12},
                                "lesson 09 allocator panel (fragmentation)", quick=True))
    seen, unique = set(), []
    for e in out:   # the step panel's default repeats an entry of the grid: keep one
        key = (e.kind, tuple(sorted(e.params.items())))
        if key not in seen:
            seen.add(key)
            unique.append(e)
    return tuple(unique)


EXPERIMENTS: tuple[RecordExperiment, ...] = _experiments()


def experiment_set(quick: bool = False) -> tuple[RecordExperiment, ...]:
    return tuple(e for e in EXPERIMENTS if e.quick) if quick else EXPERIMENTS


# --- running ------------------------------------------------------------------------------------

def _fragmentation_experiment(n: int, block_mib: int, big_mib: int):
    """``replay.fragmentation_events`` made of real tensors (same sizes, same order)."""
    from .replay import fragmentation_events

    def experiment(ctx) -> None:
        live: dict[int, torch.Tensor] = {}
        for ev in fragmentation_events(n, block_mib, big_mib):
            if ev["kind"] == "alloc":
                live[ev["sid"]] = torch.empty(ev["nbytes"], dtype=torch.uint8, device=ctx.device)
            else:
                del live[ev["sid"]]
        ctx.snapshot("end")
    return experiment


def run_experiment(exp: RecordExperiment) -> dict[str, Any]:
    """Run one entry on the cuda engine; its result as a JSON-able dict."""
    if exp.kind == "step":
        from .experiments import training_step
        return training_step(engine="cuda", **exp.params).as_dict()
    if exp.kind == "fragmentation":
        m = run(_fragmentation_experiment(**exp.params), engine="cuda")
        from .replay import fragmentation_events, replay_events
        sim = replay_events(fragmentation_events(**exp.params))
        return {"engine": m.engine, "device": m.device, "label": m.label, "peak_bytes": m.peak_bytes,
                "allocator": dict(m.allocator or {}), "seconds": round(m.seconds, 4), "oom": m.oom,
                "error": m.error, "simulated_peak_allocated": sim.peak_allocated,
                "simulated_peak_reserved": sim.peak_reserved}
    raise ValueError(f"unknown record kind {exp.kind!r}")


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=pathlib.Path(__file__).parent,
                             capture_output=True, text=True, timeout=10, check=False)
        if out.returncode != 0 or not out.stdout.strip():
            return None
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "."], cwd=pathlib.Path(__file__).parent,
                               capture_output=True, timeout=30, check=False).returncode == 1
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() + ("-dirty" if dirty else "")   # -dirty: gpulab/ differs from that commit


def is_stand_in(gpu_name: str) -> bool:
    low = str(gpu_name).lower()
    return any(m in low for m in STAND_IN_MARKERS)


def provenance(command: Sequence[str] | None = None, device: int = 0) -> dict[str, Any]:
    """Where a record comes from: the GPU, driver, CUDA runtime, cuDNN, torch, torchvision, gpulab
    (version and commit), the date (UTC) and the command."""
    import importlib.metadata

    import torchvision

    from .gpu import device_report
    report = device_report()
    gpu = next((g for g in report.gpus if g.index == device), None)
    name = torch.cuda.get_device_name(device)
    try:
        version = importlib.metadata.version("gpulab")
    except importlib.metadata.PackageNotFoundError:
        version = None
    try:
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except RuntimeError as exc:   # e.g. a cuDNN too new for the device's compute capability
        cudnn = f"unusable: {exc}"
    return {
        "gpu_name": name,
        "gpu_total_bytes": int(gpu.total_bytes) if gpu else int(torch.cuda.get_device_properties(device).total_memory),
        "compute_capability": gpu.compute_capability if gpu else None,
        "driver": gpu.driver if gpu else "unknown",
        "cuda_runtime": torch.version.cuda, "cudnn": cudnn,
        "torch": torch.__version__, "torchvision": torchvision.__version__,
        "gpulab_version": version, "gpulab_commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": " ".join(command if command is not None else ["gpulab", *sys.argv[1:]]),
        "stand_in": is_stand_in(name),
    }


def record(quick: bool = False, command: Sequence[str] | None = None,
           progress: Callable[[int, int, RecordExperiment], None] | None = None) -> dict[str, Any]:
    """Run the record set on CUDA device 0; the whole record as a JSON-able dict."""
    if not torch.cuda.is_available():
        raise RuntimeError("gpulab record needs a CUDA GPU (torch.cuda.is_available() is False)")
    from .replay import beyond_allocator_bytes
    exps = experiment_set(quick)
    release_cuda_memory(0)
    data: dict[str, Any] = {"format": RECORD_FORMAT, "provenance": provenance(command),
                            "device": {"cuda_context_estimate": beyond_allocator_bytes(0)},
                            "quick": quick, "experiments": []}
    for i, exp in enumerate(exps):
        if progress:
            progress(i, len(exps), exp)
        data["experiments"].append({"name": exp.name, "kind": exp.kind, "params": dict(exp.params),
                                    "serves": exp.serves, "result": run_experiment(exp)})
    return data


def slug(gpu_name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-") or "gpu"


def write_record(data: dict[str, Any], out_dir: str | os.PathLike = ".") -> pathlib.Path:
    """Write ``<out_dir>/<gpu-slug>.json`` (one file per device); returns its path."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{slug(data['provenance']['gpu_name'])}.json"
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


# --- reading records back -----------------------------------------------------------------------

def validate_record(data: Any) -> list[str]:
    """What is wrong with a record (empty: it may ship and be shown). A stand-in GPU's record,
    a missing provenance field or a missing result is refused."""
    if not isinstance(data, dict):
        return ["not a JSON object"]
    problems = []
    prov = data.get("provenance")
    if not isinstance(prov, dict):
        return ["no provenance"]
    missing = [f for f in PROVENANCE_FIELDS if f not in prov]
    if missing:
        problems.append(f"provenance lacks {', '.join(missing)}")
    for f in ("gpu_name", "date", "torch", "driver"):
        if f in prov and not prov[f]:
            problems.append(f"provenance field {f} is empty")
    if prov.get("stand_in") or is_stand_in(prov.get("gpu_name", "")):
        problems.append(f"recorded on a stand-in, not a GPU ({prov.get('gpu_name')})")
    exps = data.get("experiments")
    if not isinstance(exps, list) or not exps:
        problems.append("no experiments")
    else:
        for i, e in enumerate(exps):
            if not isinstance(e, dict) or not {"kind", "params", "result"} <= e.keys() \
                    or not isinstance(e["params"], dict) or not isinstance(e["result"], dict):
                problems.append(f"experiment {i} lacks kind, params or result")
            elif e["result"].get("engine") != "cuda":
                problems.append(f"experiment {i} was not measured on the cuda engine")
    return problems


@dataclass
class Record:
    path: pathlib.Path
    data: dict[str, Any]

    @property
    def provenance(self) -> dict[str, Any]:
        return self.data["provenance"]

    @property
    def label(self) -> str:
        return record_label(self.provenance)


def record_label(prov: dict[str, Any]) -> str:
    """``recorded on <GPU name>, <date>, torch <version>``."""
    return label_recorded(prov["gpu_name"], prov["date"], prov["torch"])


def records_dir(directory: str | os.PathLike | None = None) -> pathlib.Path:
    """The folder records are read from: ``directory``, else $GPULAB_RECORDED_DIR, else the package's."""
    if directory is not None:
        return pathlib.Path(directory)
    return pathlib.Path(os.environ[ENV_DIR]) if os.environ.get(ENV_DIR) else PACKAGE_DIR


def scan_records(directory: str | os.PathLike | None = None) -> tuple[list[Record], dict[str, list[str]]]:
    """Every ``*.json`` in the folder: the valid records, and the refused files with why."""
    good, refused = [], {}
    folder = records_dir(directory)
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            refused[path.name] = [f"unreadable: {exc}"]
            continue
        problems = validate_record(data)
        if problems:
            refused[path.name] = problems
        else:
            good.append(Record(path, data))
    return good, refused


def load_records(directory: str | os.PathLike | None = None) -> list[Record]:
    """The valid records (stand-ins and files without full provenance are skipped)."""
    return scan_records(directory)[0]


@dataclass
class RecordLookup:
    """``find_record``'s answer: the recorded result and its label, or None and why. When records
    exist but none has these settings, ``mismatch`` says what was recorded instead (the part of
    ``reason`` after ``NO_MATCH``), for views that word the sentence their own way."""
    result: dict[str, Any] | None
    label: str = ""
    reason: str = ""
    provenance: dict[str, Any] | None = None
    mismatch: str = ""

    def __bool__(self) -> bool:
        return self.result is not None


NO_RECORDS = "no GPU recordings ship with this version of gpulab yet"
NO_MATCH = "no record for these settings"
_PLURALS = {"batch": "batch sizes", "image_size": "image sizes"}


def _values(entries: Iterable[dict[str, Any]], key: str) -> str:
    vals = sorted({e["params"].get(key) for e in entries}, key=lambda v: (str(type(v)), v))
    return ", ".join(str(v) for v in vals)


def find_record(kind: str, directory: str | os.PathLike | None = None, **params: Any) -> RecordLookup:
    """The recorded result of ``kind`` with exactly these parameters (the first record that has
    one), or a ``RecordLookup`` with ``result=None`` whose ``reason`` says what was recorded
    instead ("no record for these settings: recorded batch sizes for cnn, sgd are 8, 16, 32")."""
    records = load_records(directory)
    if not records:
        return RecordLookup(None, reason=NO_RECORDS)
    entries = [(r, e) for r in records for e in r.data["experiments"] if e["kind"] == kind]
    if not entries:
        return _no_match(f"no {kind} experiment was recorded")
    matched: list[str] = []
    for key, want in params.items():
        left = [(r, e) for r, e in entries if e["params"].get(key) == want]
        if not left:
            where = f" for {', '.join(matched)}" if matched else ""
            name = _PLURALS.get(key, key.replace("_", " ") + "s")
            return _no_match(f"({key} {want}): recorded {name}{where} are "
                             f"{_values((e for _, e in entries), key)}")
        entries = left
        matched.append(f"{key} {want}")
    rec, entry = entries[0]
    return RecordLookup(entry["result"], rec.label, "", rec.provenance)


def _no_match(what: str) -> RecordLookup:
    """No record has these settings; ``what`` says what was recorded instead."""
    sep = " " if what.startswith("(") else ": "
    return RecordLookup(None, reason=f"{NO_MATCH}{sep}{what}", mismatch=what)
