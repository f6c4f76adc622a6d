"""Memory snapshots recorded on a real GPU that ship with gpulab, and their replay beside them.

``gpulab/interop/data/`` holds snapshot pickles ``torch.cuda.memory._snapshot()`` returned on a GPU,
unedited, with their provenance (``provenance.json``, ``README.md``). ``read_recorded_snapshot``
reads one with its label (*recorded on <GPU>, <date>, torch <version>*), so a student with no GPU
replays a real file; ``StartComparison`` shows its figures beside the simulator's replay from
the start rebuilt from the file and from an empty allocator (the *simulated allocator*'s).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gpulab.interop.snapshot_import import ImportedSnapshot, SnapshotReplay, read_snapshot
from gpulab.tables import html_table
from gpulab.units import format_delta

__all__ = ["DATA", "StartComparison", "read_recorded_snapshot", "recorded_label", "recorded_snapshots"]

DATA = Path(__file__).parent / "data"
LABEL = "recorded on {device}, {date}, torch {torch} (torch.cuda.memory._snapshot)"


def recorded_snapshots() -> dict[str, dict[str, str]]:
    """The shipped snapshots by name (file name without ``.pickle``): their provenance."""
    facts = json.loads((DATA / "provenance.json").read_text())
    return {Path(name).stem: dict(info) for name, info in facts.items()}


def recorded_label(name: str) -> str:
    """*recorded on NVIDIA H200, 2026-11-26, torch 2.11.0+cu130 (...)* for a shipped snapshot."""
    return LABEL.format(**recorded_snapshots()[name])


def read_recorded_snapshot(name: str = "step_vgg16_b1_sgd") -> ImportedSnapshot:
    """Read a shipped snapshot (``recorded_snapshots()`` lists them), labelled with its provenance."""
    known = recorded_snapshots()
    if name not in known:
        raise ValueError(f"no recorded snapshot {name!r} ships with gpulab; there are: {', '.join(sorted(known))}")
    imported = read_snapshot(DATA / f"{name}.pickle")
    imported.label = recorded_label(name)
    return imported


def _mib(nbytes: int) -> str:
    """Bytes in MiB, to the MiB where whole (segments are 2 MiB multiples): differences read at a glance."""
    return f"{nbytes / 2**20:,.0f} MiB" if nbytes % 2**20 == 0 else f"{nbytes / 2**20:,.2f} MiB"


def _agreeing_entries(imported: ImportedSnapshot, replay: SnapshotReplay) -> int:
    """Trace entries after which the replay's reserved bytes equal the file's."""
    return sum(1 for k, e in enumerate(imported.events)
               if e["index"] >= 0 and replay.simulated.reserved[k] == imported.recorded.reserved[e["index"]])


@dataclass
class StartComparison:
    """A file's figures beside two replays of its trace: from the start rebuilt from the file
    (``rebuilt``) and from an empty allocator (``empty``). Labels: the file's, *simulated allocator*."""
    imported: ImportedSnapshot
    rebuilt: SnapshotReplay
    empty: SnapshotReplay

    @classmethod
    def of(cls, imported: ImportedSnapshot) -> StartComparison:
        return cls(imported, imported.replay(), imported.replay(rebuild_start=False))

    def rows(self) -> list[list[str]]:
        imp = self.imported
        real_end = sum(s.size for s in imp.segments)
        entries = sum(1 for e in imp.events if e["index"] >= 0)
        rows = [["reserved at the end", _mib(real_end)],
                ["peak reserved", _mib(imp.peak_reserved)],
                ["segments at the end", str(len(imp.segments))],
                ["allocations and frees after which reserved equals the file's", f"{entries:,}"],
                ["allocations at the address the file records", f"{self.rebuilt.same_address[1]:,}"
                 if self.rebuilt.same_address else "—"]]
        for rep in (self.rebuilt, self.empty):
            end = sum(s.size for s in rep.segments)
            peak = rep.stats["reserved_bytes.all.peak"]
            rows[0].append(f"{_mib(end)} ({format_delta(end - real_end)})")
            rows[1].append(f"{_mib(peak)} ({format_delta(peak - imp.peak_reserved)})")
            rows[2].append(f"{len(rep.segments)} ({len(rep.segments) - len(imp.segments):+d})")
            rows[3].append(f"{_agreeing_entries(imp, rep):,}")
            rows[4].append(f"{rep.same_address[0]:,}" if rep.same_address else "— (its own addresses)")
        return rows

    def reading(self) -> str:
        """What the empty start changed, in a sentence (Markdown), every figure from this result:
        lesson 13 renders it instead of typing it (issue 47, item 4)."""
        real_end = sum(s.size for s in self.imported.segments)
        end = sum(s.size for s in self.empty.segments)
        extra = len(self.empty.segments) - len(self.imported.segments)
        return (f"From an empty allocator the same rules end with {len(self.empty.segments)} segments "
                f"({extra:+d} against the file's {len(self.imported.segments)}) and {_mib(end)} reserved "
                f"({format_delta(end - real_end)}).")

    def _repr_html_(self) -> str:
        header = ["", f"in the file: {self.imported.label}", "simulated allocator, start rebuilt from the file",
                  "simulated allocator, from an empty allocator"]
        return html_table(header, self.rows(), "the file's trace replayed from two starts; in brackets: simulated − file")

    def __repr__(self) -> str:
        return "\n".join(" | ".join(r) for r in self.rows())
