"""Recorded GPU runs as data: the JSON files ``gpulab record`` wrote on a real GPU (shipped in
``gpulab/recorded/``, or a folder named by ``GPULAB_RECORDED_DIR``), read and checked (a stand-in
GPU's record, or one without full provenance, is refused), each with its label.

A floor below ``predict``, so a prediction can take a recorded figure as data (``predict.workspaces``:
cuDNN's workspaces recorded on a card); ``record.lookup`` finds a record by experiment and settings."""
from __future__ import annotations

import json
import os
import pathlib
from dataclasses import dataclass
from typing import Any

from gpulab.measure.engines import label_recorded

__all__ = ["ENV_DIR", "PACKAGE_DIR", "PROVENANCE_FIELDS", "RECORD_FORMAT", "Record", "STAND_IN_MARKERS", "is_stand_in",
           "load_records", "record_label", "records_dir", "scan_records", "validate_record"]

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
