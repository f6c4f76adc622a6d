"""Reading recorded GPU runs back: the JSON files ``gpulab record`` wrote on a real GPU (shipped
in ``gpulab/recorded/``, or a folder named by ``GPULAB_RECORDED_DIR``), checked (a stand-in GPU's
record is refused: ``measure.recorded``, re-exported here) and looked up by experiment and settings, each with
its label."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from gpulab.measure.recorded import (ENV_DIR, PACKAGE_DIR, PROVENANCE_FIELDS, RECORD_FORMAT, STAND_IN_MARKERS, Record,
                                     is_stand_in, load_records, record_label, records_dir, scan_records,
                                     validate_record)

__all__ = [
    "ENV_DIR", "NO_MATCH", "NO_RECORDS", "PACKAGE_DIR", "PROVENANCE_FIELDS", "RECORD_FORMAT",
    "Record", "RecordLookup", "STAND_IN_MARKERS", "find_allocator_record", "find_record",
    "find_record_series", "is_stand_in", "load_records", "record_label", "records_dir",
    "scan_records", "validate_record"
]


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
