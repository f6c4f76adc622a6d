"""Reading recorded GPU runs back: the JSON files ``gpulab record`` wrote on a real GPU (shipped
in ``gpulab/recorded/``, or a folder named by ``GPULAB_RECORDED_DIR``), checked (a stand-in GPU's
record is refused) and looked up by experiment and settings, each with its label."""

from __future__ import annotations

import json
import os
import pathlib
from dataclasses import dataclass
from typing import Any, Iterable, Sequence


from gpulab.measure.engines import label_recorded

__all__ = [
    "ENV_DIR", "NO_MATCH", "NO_RECORDS", "PACKAGE_DIR", "PROVENANCE_FIELDS", "RECORD_FORMAT",
    "Record", "RecordLookup", "STAND_IN_MARKERS", "find_allocator_record", "find_record",
    "find_record_series", "is_stand_in", "load_records", "record_label", "records_dir",
    "scan_records", "validate_record"
]

RECORD_FORMAT = 1
ENV_DIR = "GPULAB_RECORDED_DIR"   # points the loader at another folder (tests, instructors)
PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent / "recorded"

# Provenance every record must carry (validate_record checks each one is present).
PROVENANCE_FIELDS = ("gpu_name", "gpu_total_bytes", "driver", "cuda_runtime", "cudnn", "torch",
                     "torchvision", "gpulab_version", "gpulab_commit", "date", "command", "stand_in")
# What a GPU that is not one says in its name (tests/cuda_standin.py's "stand-in GPU (no CUDA)").
STAND_IN_MARKERS = ("stand-in", "no cuda")


def is_stand_in(gpu_name: str) -> bool:
    low = str(gpu_name).lower()
    return any(m in low for m in STAND_IN_MARKERS)


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
_PLURALS = {"batch": "batch sizes", "image_size": "image sizes", "n_blocks": "block counts N",
            "low": "16-bit dtypes", "steps": "step counts", "expandable_segments": "expandable_segments settings",
            "empty_cache": "empty_cache settings", "max_elements": "largest element counts",
            "grad_mode": "modes", "layer": "layers"}


def _values(entries: Iterable[dict[str, Any]], key: str) -> str:
    vals = sorted({tuple(v) if isinstance(v, list) else v for v in (e["params"].get(key) for e in entries)},
                  key=lambda v: (str(type(v)), v))
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


def find_allocator_record(run: Any, directory: str | os.PathLike | None = None) -> RecordLookup:
    """The recorded GPU run of a lesson-09 workload (``replay.workload``'s ``AllocatorRun``: its
    workload, settings, expandable_segments, empty_cache_every_step), or why there is none."""
    flags = {"expandable_segments": run.expandable_segments, "empty_cache": run.empty_cache_every_step}
    if run.workload == "fragmentation":
        if any(flags.values()):
            if not load_records(directory):
                return RecordLookup(None, reason=NO_RECORDS)
            return _no_match("(expandable segments or empty_cache): the fragmentation scenario was "
                             "recorded with neither")
        return find_record("fragmentation", directory, **run.settings)
    return find_record("allocator timeline", directory, workload=run.workload, **run.settings, **flags)


def find_record_series(kind: str, key: str, values: Sequence[Any], directory: str | os.PathLike | None = None,
                       **params: Any) -> RecordLookup:
    """``find_record`` for each of ``values`` of ``key`` (e.g. every batch of a sweep), the other
    parameters fixed: ``result["points"]`` holds the recorded results in that order, labelled by
    the first one's record; when one is missing, that lookup (its note names what was recorded)."""
    points, first = [], None
    for v in values:
        hit = find_record(kind, directory, **params, **{key: v})
        if not hit:
            return hit
        first = first or hit
        points.append(hit.result)
    if first is None:
        return RecordLookup(None, reason=f"{NO_MATCH}: no {key} given")
    return RecordLookup({"points": points}, first.label, "", first.provenance)


def _no_match(what: str) -> RecordLookup:
    """No record has these settings; ``what`` says what was recorded instead."""
    sep = " " if what.startswith("(") else ": "
    return RecordLookup(None, reason=f"{NO_MATCH}{sep}{what}", mismatch=what)
