"""Reading a PyTorch memory snapshot back, and replaying its trace through the simulator.

A snapshot pickle (``torch.cuda.memory._dump_snapshot``, made on a GPU, or a file
``gpulab.interop.snapshot`` exported) is read with an unpickler that builds only plain containers: no
code in a file ever runs (``load_snapshot``). ``read_snapshot`` rebuilds one device's timeline
from its trace (``ImportedSnapshot``: live requested bytes and reserved bytes after each entry,
the final segments, gpulab's views, and the allocator's state at its first entry, rebuilt by
``gpulab.interop.snapshot_start``); ``replay_snapshot`` replays its alloc/free trace through the
simulated caching allocator from that state (``SnapshotReplay``: simulated vs recorded reserved
memory, segment by segment, and each allocation's address vs the file's). The format is described
in ``gpulab.interop.snapshot``.

NB: a file gpulab exported holds the simulator's segments, not a GPU's; it says so in its
``"gpulab"`` entry and its ``ImportedSnapshot`` is labelled so (``from_gpu`` is False). Only a
file recorded on a real GPU tests the simulator.
"""
from __future__ import annotations

import html
import io
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpulab.allocator.simulator import BlockInfo, CachingAllocator, Segment, SimulatedOutOfMemoryError
from gpulab.interop.snapshot import LABEL_EXPORTED
from gpulab.interop.snapshot_start import StartSegment, adopt_start, start_state, widened
from gpulab.interop.snapshot_trace import LIVE_STATES, final_live, walk_trace
from gpulab.interop.snapshot_viewer import blocks_at, device_trace
from gpulab.tables import html_table
from gpulab.categories import Category
from gpulab.measure.tracking import Event, StorageRecord, TrackingResult
from gpulab.units import format_bytes, format_delta

__all__ = [
    "ImportedSnapshot", "LABEL_RECORDED", "allocator_kwargs", "Series", "SnapshotReplay", "StartSegment",
    "load_snapshot", "read_snapshot", "replay_snapshot"
]

LABEL_RECORDED = "recorded on a GPU by PyTorch (torch.cuda.memory._snapshot), device {device}"
_HOW = ("make one on a GPU with torch.cuda.memory._record_memory_history(), then your code, then "
        "torch.cuda.memory._dump_snapshot('snapshot.pickle')")


# ---- reading the file ---------------------------------------------------------------------------

class _PlainUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, strings and numbers only: a snapshot needs nothing else, and
    a pickle that asks for any class or function is refused instead of run."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(
            f"this file asks to load {module}.{name}: a memory snapshot holds only plain data, "
            "so gpulab does not run it")


def load_snapshot(source: str | Path | bytes | dict | list) -> dict[str, Any]:
    """Read a snapshot: a path to a pickle (``torch.cuda.memory._dump_snapshot``), its bytes, or
    the dict ``torch.cuda.memory._snapshot()`` returned (or the list of segments
    ``torch.cuda.memory_snapshot()`` returns). Returns a new dict (the given one is not changed)
    whose segments all have ``device`` and ``stream``. Raises ``ValueError`` saying what is wrong
    and how to make a good file."""
    if isinstance(source, (dict, list)):
        data = source
    else:
        if isinstance(source, (bytes, bytearray)):
            raw = bytes(source)
        else:
            p = Path(source)
            if not p.is_file():
                raise ValueError(f"no snapshot file at {p}: {_HOW}")
            raw = p.read_bytes()
        try:
            data = _PlainUnpickler(io.BytesIO(raw)).load()
        except pickle.UnpicklingError as exc:
            raise ValueError(f"not a memory snapshot pickle ({exc}); {_HOW}") from None
        except Exception as exc:  # noqa: BLE001 (truncated, or not a pickle at all)
            raise ValueError(f"not a memory snapshot pickle ({type(exc).__name__}: {exc}); {_HOW}") from None
    if isinstance(data, list):          # segments only (torch.cuda.memory_snapshot()), as _memory_viz reads it
        data = {"segments": data, "device_traces": []}
    if not isinstance(data, dict) or "segments" not in data:
        raise ValueError(f"not a memory snapshot: no 'segments' entry; {_HOW}")
    data = dict(data)
    data.setdefault("device_traces", [])
    if not isinstance(data["segments"], list) or not isinstance(data["device_traces"], list):
        raise ValueError("not a memory snapshot: 'segments' and 'device_traces' must be lists; " + _HOW)
    segments = []
    for k, seg in enumerate(data["segments"]):
        if not isinstance(seg, dict) or not {"address", "total_size", "blocks"} <= seg.keys():
            raise ValueError("not a memory snapshot: a segment lacks address/total_size/blocks; " + _HOW)
        _check_segment(seg, k)
        seg = dict(seg)
        seg.setdefault("device", 0)
        seg.setdefault("stream", 0)
        segments.append(seg)
    data["segments"] = segments
    for trace in data["device_traces"]:
        if not isinstance(trace, list) or not all(isinstance(e, dict) and "action" in e for e in trace):
            raise ValueError("not a memory snapshot: a trace entry has no 'action'; " + _HOW)
        for i, e in enumerate(trace):
            _check_entry(e, i)
    return data


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bad_field(where: str, key: str, value: Any, need: str) -> ValueError:
    return ValueError(f"not a memory snapshot: {where}'s {key!r} must be {need}, got {value!r} "
                      f"({type(value).__name__}); {_HOW}")


def _check_segment(seg: dict[str, Any], k: int) -> None:
    """A segment's fields of the types torch writes (``_snapshot()``: whole numbers of bytes, a list
    of block dicts with a ``size``): one line naming the segment, the field and its value otherwise."""
    where = f"segment {k}"
    for key in ("address", "total_size"):
        if not _whole(seg[key]) or seg[key] < 0:
            raise _bad_field(where, key, seg[key], "a whole number of bytes, 0 or more")
    for key in ("device", "stream"):
        if seg.get(key) is not None and not _whole(seg[key]):
            raise _bad_field(where, key, seg[key], "a whole number")
    if not isinstance(seg["blocks"], list):
        raise _bad_field(where, "blocks", seg["blocks"], "a list of blocks (dicts with a size and a state)")
    for j, b in enumerate(seg["blocks"]):
        if not isinstance(b, dict) or "size" not in b:
            raise ValueError(f"not a memory snapshot: {where}, block {j} is not a dict with a 'size' (got "
                             f"{str(b)[:60]}); {_HOW}")
        for key in ("size", "requested_size", "address"):
            if key in b and b[key] is not None and (not _whole(b[key]) or b[key] < 0):
                raise _bad_field(f"{where}, block {j}", key, b[key], "a whole number of bytes, 0 or more")


# the trace actions that name a block or segment by its address and size (torch's TraceEntry)
_SIZED_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
                  "segment_unmap")


def _check_entry(e: dict[str, Any], i: int) -> None:
    """A trace entry's fields of the types torch writes: ``addr`` and ``size`` whole numbers (and
    present where the action needs them), ``stream`` a whole number."""
    where = f"trace entry {i} ({e['action']!r})"
    if not isinstance(e["action"], str):
        raise _bad_field(where, "action", e["action"], "a name such as 'alloc' or 'free_completed'")
    for key in ("addr", "size"):
        if key not in e and e["action"] in _SIZED_ACTIONS:
            raise ValueError(f"not a memory snapshot: {where} has no {key!r} (torch writes the address and size of "
                             f"every {e['action']}); {_HOW}")
        if key in e and (not _whole(e[key]) or e[key] < 0):
            raise _bad_field(where, key, e[key], "a whole number, 0 or more")
    if e.get("stream") is not None and not _whole(e["stream"]):
        raise _bad_field(where, "stream", e["stream"], "a whole number")


# ---- the timeline in the file -------------------------------------------------------------------


@dataclass
class Series:
    """Allocated and reserved bytes after each event (what
    ``gpulab.allocator.plots.allocated_vs_reserved`` draws): in a file's recorded timeline
    ``allocated`` is the live tensors' requested bytes, in a replay the simulator's blocks."""
    allocated: list[int]
    reserved: list[int]
    workload: str
    label: str
    empty_cache_every_step: bool = False
    step_ends: list[int] = field(default_factory=list)

    @property
    def peak_allocated(self) -> int:
        return max(self.allocated, default=0)

    @property
    def peak_reserved(self) -> int:
        return max(self.reserved, default=0)


@dataclass
class ImportedSnapshot:
    """A snapshot read back: its timeline (rebuilt from the trace) and the events to replay.

    ``events``: alloc/free events (``kind``, ``sid``, ``nbytes`` = requested bytes, ``index`` of
    the trace entry, -1 for blocks live before the trace began, ``category`` when the file has
    one); ``recorded``: live requested bytes and reserved bytes after each trace entry, as the
    file records them; ``segments``: the final segments as :class:`gpulab.allocator.simulator.Segment`."""

    data: dict[str, Any]
    device: int
    label: str
    from_gpu: bool
    events: list[dict[str, Any]]
    recorded: Series
    segments: list[Segment]
    segment_order: list[int]       # creation order of ``segments`` (trace index; -1: before it)
    ooms: int = 0
    streams: int = 1
    releases: list[int] = field(default_factory=list)   # how many events came before each release burst
    # (events before it, bytes it asked for, its stream)
    oom_requests: list[tuple[int, int, int]] = field(default_factory=list)
    capacity: int | None = None       # from the first oom entry: reserved then + the free memory it reports
    # the allocator's state at the trace's first entry (segments and live blocks), None when it
    # cannot be rebuilt (``start_problem`` says why)
    start_segments: list[StartSegment] | None = None
    start_problem: str = ""
    start_active: int = 0       # live requested bytes and reserved bytes before the first entry
    start_reserved: int = 0
    # each segment_free: (events before it, the segment's address, its stream)
    segment_frees: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def settings(self) -> dict[str, Any]:
        """The allocator settings the file records (``allocator_settings``) that the simulator takes,
        as its keyword arguments: ``expandable_segments``, ``max_split_size_mb``."""
        return allocator_kwargs(self.data.get("allocator_settings"))[0]

    @property
    def unmodelled_settings(self) -> list[str]:
        """The file's settings away from their defaults that the simulator does not model."""
        return allocator_kwargs(self.data.get("allocator_settings"))[1]

    @property
    def peak_active(self) -> int:
        """Peak of live requested bytes over the trace (the viewer's Active Memory Timeline), the
        state before its first entry included."""
        return max(self.recorded.peak_allocated, self.start_active)

    @property
    def peak_reserved(self) -> int:
        """Peak of reserved bytes over the trace, the state before its first entry included (a trace
        that begins with a release starts higher than after its first entry)."""
        return max(self.recorded.peak_reserved, self.start_reserved)

    @property
    def source(self) -> str:
        """A short form of the label: "recorded on GPU <device>" or "exported by gpulab, segments simulated"."""
        return f"recorded on GPU {self.device}" if self.from_gpu else "exported by gpulab, segments simulated"

    @property
    def categories(self) -> set[str]:
        """The categories the file's allocations carry (gpulab's, in a file gpulab exported)."""
        return {e["category"] for e in self.events if e["kind"] == "alloc" and e.get("category")}

    def replay(self, *, rebuild_start: bool = True, **allocator_kwargs: Any) -> SnapshotReplay:
        """Replay the file's alloc/free trace, and its releases, through the simulated allocator with
        the file's own settings (``settings``), or the ones given: ``expandable_segments``,
        ``max_split_size_mb``, ``capacity_bytes``. The replay starts from the allocator's state at
        the trace's first entry (``start_segments``) and puts new segments where the GPU's went;
        ``rebuild_start=False`` starts from an empty allocator instead (the blocks live before the
        trace allocated first, segments at the simulator's own addresses), to see what the start
        changes."""
        return replay_snapshot(self, rebuild_start=rebuild_start, **allocator_kwargs)

    def tracking(self) -> TrackingResult | None:
        """The timeline as a gpulab ``TrackingResult`` (unrounded requested bytes), when every
        allocation carries a gpulab category (files gpulab exported); else None."""
        cats = {c.value for c in Category}
        allocs = [e for e in self.events if e["kind"] == "alloc"]
        if not allocs or any(e.get("category") not in cats for e in allocs):
            return None
        dev = f"cuda:{self.device}"
        records: dict[int, StorageRecord] = {}
        events: list[Event] = []
        for e in self.events:
            g = e.get("gpulab") or {}
            if e["kind"] == "alloc":
                records[e["sid"]] = StorageRecord(
                    sid=e["sid"], nbytes=e["nbytes"], device=dev, dtype=str(g.get("dtype", "")),
                    shape=tuple(g.get("shape", ())), category=Category(e["category"]),
                    module=str(g.get("module", "")), phase=str(g.get("phase", "")), op=str(g.get("op", "")),
                    created=len(events))
                delta = e["nbytes"]
            else:
                records[e["sid"]].freed = len(events)
                delta = -records[e["sid"]].nbytes
            rec = records[e["sid"]]
            events.append(Event(len(events), e["kind"], e["sid"], rec.nbytes, delta, dev,
                                str(g.get("phase", rec.phase)), str(g.get("module", rec.module)),
                                float(e.get("time_us", 0)) / 1e6))
        return TrackingResult.build(records, events, device=dev, rounded=False)

    def timeline(self, title: str | None = None):
        """gpulab's view of the file's timeline: stacked by category when the file has gpulab's
        categories (``gpulab.plots.timeline``), else live vs reserved bytes
        (``gpulab.allocator.plots.allocated_vs_reserved``)."""
        tr = self.tracking()
        if tr is not None:
            from gpulab.plots import timeline
            return timeline(tr, title=title or f"from the snapshot file ({self.source})")
        from gpulab.allocator.plots import allocated_vs_reserved
        return allocated_vs_reserved(self.recorded, title=title or f"live tensors (requested bytes) vs reserved, "
                                                                   f"from the snapshot file ({self.source})")

    def rows(self) -> list[list[str]]:
        return [["trace entries", f"{len(device_trace(self.data, self.device)):,}"],
                ["allocations in the trace", f"{sum(1 for e in self.events if e['kind'] == 'alloc' and e['index'] >= 0):,}"],
                ["blocks live before the trace began", f"{sum(1 for e in self.events if e['index'] < 0):,}"],
                ["segments at the end", f"{len(self.segments):,}"],
                ["peak of live tensors (requested bytes)", format_bytes(self.peak_active)],
                ["peak reserved", format_bytes(self.peak_reserved)],
                ["reserved at the end", format_bytes(sum(s.size for s in self.segments))],
                ["streams", str(self.streams)], ["out-of-memory entries", str(self.ooms)],
                ["allocator settings", ", ".join(f"{k}={v}" for k, v in self.settings.items()) or "defaults"]]

    @property
    def mid_run(self) -> bool:
        """Whether the trace begins mid-run: blocks or segments existed before its first entry
        (history turned on after the model was loaded, or a ring buffer that wrapped)."""
        return any(e["index"] < 0 for e in self.events) or any(k < 0 for k in self.segment_order)

    def start_text(self) -> str:
        """What existed before the trace's first entry, in words (empty for a trace from the start)."""
        if not self.mid_run:
            return ""
        before = [e for e in self.events if e["index"] < 0]
        live = f"{len(before)} blocks ({format_bytes(sum(e['nbytes'] for e in before))}) were live"
        if self.start_segments is None:
            segs = [s for s, k in zip(self.segments, self.segment_order) if k < 0]
            return (f"a mid-run trace: before its first entry, {live}, in {len(segs)} segments "
                    f"({format_bytes(sum(s.size for s in segs))}) the trace never made. That start is not "
                    f"rebuilt ({self.start_problem}): the replay allocates those blocks first, in address order, "
                    "in segments of its own, so differences in reserved memory can come from that start rather "
                    "than from the simulator")
        segs = self.start_segments
        exact = sum(s.exact for s in segs)
        sizes = ("every block's size as the file gives it" if exact == len(before) else
                 f"{exact} of the blocks' sizes as the file gives them, the other {len(before) - exact} their "
                 "requested bytes rounded as the allocator rounds them, made larger where the replay finds the GPU's "
                 "allocator had less free room after them")
        return (f"a mid-run trace: before its first entry, {live}, in {len(segs)} segments "
                f"({format_bytes(sum(s.size for s in segs))}) the trace never made. The replay starts from that "
                "state, rebuilt from the file (walking its final segments back through the trace): the segments at "
                f"their recorded addresses and sizes, the live blocks in them ({sizes}), the rest free")

    def _repr_html_(self) -> str:
        note = f"<p>{html.escape(self.start_text())}.</p>" if self.mid_run else ""
        return html_table(["snapshot file", "value"], self.rows(), self.label) + note

    def __repr__(self) -> str:
        return (f"ImportedSnapshot(device={self.device}, {len(self.events)} events, "
                f"peak_active={self.peak_active:,} B, peak_reserved={self.peak_reserved:,} B; {self.label})")


def read_snapshot(source: str | Path | bytes | dict | list, device: int | None = None) -> ImportedSnapshot:
    """Read a snapshot and rebuild one device's timeline from its trace (by default the device
    with the most trace entries, or the first with segments)."""
    data = load_snapshot(source)
    if device is None:
        device = _default_device(data)
    trace = device_trace(data, device)
    meta = data.get("gpulab") if isinstance(data.get("gpulab"), dict) else None
    from_gpu = meta is None
    label = (LABEL_RECORDED.format(device=device) if from_gpu
             else str(meta.get("label") or LABEL_EXPORTED.format(source="source not stated")))
    segs = [s for s in data["segments"] if int(s.get("device", 0)) == device]
    walk = walk_trace(trace)
    before = walk.before
    for addr, (nbytes, size, stream) in sorted(final_live(segs).items()):   # live at the end, never allocated in the trace
        if addr not in walk.live and addr not in walk.seen:
            sid, walk.next_sid = walk.next_sid, walk.next_sid + 1
            before.append({"kind": "alloc", "sid": sid, "nbytes": nbytes, "index": -1, "addr": addr,
                           "block_size": size, "stream": stream})
    before.sort(key=lambda e: e["addr"])
    # the totals before the trace: what was live then, and the end's reserved minus the trace's changes
    reserved_end = sum(int(s["total_size"]) for s in segs)
    act = start_active = sum(e["nbytes"] for e in before)
    res = start_reserved = reserved_end - sum(walk.res_delta)
    act_series, res_series = [], []
    for da, dr in zip(walk.act_delta, walk.res_delta):
        act += da
        res += dr
        act_series.append(act)
        res_series.append(res)
    recorded = Series(act_series, res_series, "snapshot", label)
    segments = [_segment(k, s) for k, s in enumerate(segs)]
    order = [walk.seg_created.get(s["address"], -1) for s in segs]
    streams = {int(e.get("stream", 0) or 0) for e in trace}
    capacity = None
    if walk.oom_requests and walk.oom_requests[0][2] >= 0:   # the device's free memory, as cudaMemGetInfo said
        capacity = res_series[walk.oom_reserved[0]] + walk.oom_requests[0][2]
    settings = allocator_kwargs(data.get("allocator_settings"))[0]
    start, problem = start_state(segs, trace, before, settings, capacity)
    imported = ImportedSnapshot(data, device, label, from_gpu, before + walk.events, recorded, segments, order,
                                walk.ooms, max(1, len(streams)), [len(before) + k for k in walk.releases],
                                [(len(before) + k, n, st) for k, n, _, st in walk.oom_requests], capacity,
                                start, problem, start_active, start_reserved)
    imported.segment_frees = [(len(before) + k, addr, st) for k, addr, st in walk.segment_frees]
    return imported


def allocator_kwargs(settings: dict[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    """(the simulator's keyword arguments, the settings it does not model) from a snapshot's
    ``allocator_settings`` (torch's ``_snapshot()`` writes them: ``expandable_segments``,
    ``max_split_size`` in bytes or -1, ``roundup_power2_divisions``, ``garbage_collection_threshold``)."""
    if not isinstance(settings, dict):
        return {}, []
    kwargs: dict[str, Any] = {}
    if settings.get("expandable_segments"):
        kwargs["expandable_segments"] = True
    split = int(settings.get("max_split_size", -1) or -1)
    if split > 0 and split < (1 << 62):
        kwargs["max_split_size_mb"] = split // (1 << 20)
    missing = []
    divisions = settings.get("roundup_power2_divisions")
    if isinstance(divisions, dict) and any(int(v or 0) for v in divisions.values()):
        missing.append("roundup_power2_divisions")
    if float(settings.get("garbage_collection_threshold", 0) or 0) > 0:
        missing.append("garbage_collection_threshold")
    return kwargs, missing


def _default_device(data: dict[str, Any]) -> int:
    """The device with the most trace entries and segments (a trace on a device that has no
    segments loses to one that has them), else the first with segments."""
    traces = data["device_traces"]
    with_trace = [i for i, t in enumerate(traces) if t]
    with_segs = sorted({int(s.get("device", 0)) for s in data["segments"]})
    if with_trace:
        return max(with_trace, key=lambda i: (i in with_segs, len(traces[i])))
    if with_segs:
        return with_segs[0]
    raise ValueError("the snapshot is empty: no trace entries and no segments. Record with "
                     "torch.cuda.memory._record_memory_history() before the code you want to see")


def _segment(k: int, s: dict[str, Any]) -> Segment:
    """A segment of the file as the simulator's ``Segment`` (pool from ``segment_type``; files
    without it: a small segment is 2 MiB, kSmallBuffer)."""
    infos = []
    for addr, b in blocks_at(s):
        alloc = b.get("state") in LIVE_STATES
        infos.append(BlockInfo(addr=addr, offset=addr - s["address"], size=int(b["size"]), allocated=alloc,
                               requested=int(b.get("requested_size", b["size"]) or 0) if alloc else 0))
    pool = str(s.get("segment_type", "large" if s["total_size"] > 2 * 2**20 else "small"))
    return Segment(id=k, pool=pool, address=int(s["address"]), size=int(s["total_size"]), blocks=tuple(infos),
                   expandable=bool(s.get("is_expandable", False)))


# ---- replaying an imported trace ------------------------------------------------------------------

@dataclass
class SnapshotReplay:
    """An imported trace replayed through the simulated allocator, next to what the file records.

    ``simulated``: allocated (blocks) and reserved bytes after each event; ``segment_pairs``:
    the final segments of both (file, simulated), matched in order of creation within each pool."""

    imported: ImportedSnapshot
    simulated: Series
    segments: list[Segment]
    stats: dict[str, int]
    settings: dict[str, Any]
    segment_pairs: list[tuple[Segment | None, Segment | None]]
    simulated_ooms: int = 0           # the file's refused requests the simulator refused too
    rebuilt_start: bool = False       # started from the allocator's state at the trace's first entry
    # (allocations the simulator put at the address the GPU's allocator did, allocations in the
    # trace); None when the simulator's addresses are its own (start not rebuilt)
    same_address: tuple[int, int] | None = None
    start_refinements: int = 0        # guessed start blocks widened after a replay put a block in their room
    start_refused: str = ""           # why the simulator did not take the rebuilt start (then: from empty)

    @property
    def label(self) -> str:
        return "simulated allocator" + (f" ({self._settings_text()})" if self.settings else "")

    def _settings_text(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.settings.items())

    def segment_rows(self) -> list[list[str]]:
        rows = []
        for n, (real, sim) in enumerate(self.segment_pairs, 1):
            pool = (real or sim).pool
            rows.append([str(n), pool,
                         format_bytes(real.size) if real else "—", format_bytes(sim.size) if sim else "—",
                         format_bytes(real.allocated_bytes) if real else "—",
                         format_bytes(sim.allocated_bytes) if sim else "—",
                         format_delta((sim.size if sim else 0) - (real.size if real else 0))])
        return rows

    def total_rows(self) -> list[list[str]]:
        imp = self.imported
        real_end = sum(s.size for s in imp.segments)
        sim_end = sum(s.size for s in self.segments)
        return [
            ["reserved at the end", format_bytes(real_end), format_bytes(sim_end), format_delta(sim_end - real_end)],
            ["peak reserved", format_bytes(imp.peak_reserved), format_bytes(self.stats["reserved_bytes.all.peak"]),
             format_delta(self.stats["reserved_bytes.all.peak"] - imp.peak_reserved)],
            ["peak of live tensors (requested bytes)", format_bytes(imp.peak_active),
             format_bytes(self.stats["requested_bytes.all.peak"]),
             format_delta(self.stats["requested_bytes.all.peak"] - imp.peak_active)],
            ["segments at the end", str(len(imp.segments)), str(len(self.segments)),
             f"{len(self.segments) - len(imp.segments):+d}"],
        ] + ([["out-of-memory errors", str(imp.ooms), str(self.simulated_ooms),
               f"{self.simulated_ooms - imp.ooms:+d}"]] if imp.ooms else []) + (
            [["allocations at the address the file records", f"{self.same_address[1]:,}",
              f"{self.same_address[0]:,}", f"{self.same_address[0] - self.same_address[1]:+,d}"]]
            if self.same_address else [])

    def _repr_html_(self) -> str:
        src = self.imported.label
        head = html_table(["", f"in the file: {src}", self.label, "simulated − file"], self.total_rows(),
                          "the file's trace replayed through gpulab's simulator")
        segs = html_table(["#", "pool", "reserved: file", "reserved: simulated", "allocated: file",
                           "allocated: simulated", "simulated − file"], self.segment_rows(),
                          "segments at the end: those at the same address side by side, then the rest in order of "
                          "creation within each pool" if self.rebuilt_start else
                          "segments at the end, in order of creation within each pool")
        missing = self.imported.unmodelled_settings
        note = (f"<p>The file's settings the simulator does not model: {', '.join(missing)}.</p>" if missing else "")
        start = ""
        if self.imported.mid_run:
            why = f"the simulator refused the rebuilt start: {self.start_refused}" if self.start_refused else \
                "rebuild_start=False"
            start = self.imported.start_text() if self.rebuilt_start or self.imported.start_segments is None else (
                f"a mid-run trace, replayed here from an empty allocator ({why}): the blocks live "
                "before its first entry are allocated first, in segments of the simulator's own")
            start = f"<p>{html.escape(start)}.</p>"
        return head + segs + note + start

    def __repr__(self) -> str:
        return (f"SnapshotReplay(peak_reserved simulated={self.stats['reserved_bytes.all.peak']:,} B, "
                f"in the file={self.imported.peak_reserved:,} B)")


def replay_snapshot(imported: ImportedSnapshot, *, rebuild_start: bool = True,
                    **allocator_kwargs: Any) -> SnapshotReplay:
    """See :meth:`ImportedSnapshot.replay`. The file's own allocator settings unless given here;
    each burst of segment releases in the trace replayed where it happened (the segments it names,
    where the simulator holds them at the file's addresses; else as ``empty_cache()``);
    one pool per stream, as the real allocator reuses a block only on the stream it was made for
    (a simulator per stream: their sums are the device's; a capacity is the device's, shared by
    them); a request the GPU refused (an ``oom`` entry) put to its own stream's. With
    ``rebuild_start`` (the default) the replay starts from the allocator's state at the trace's
    first entry (``imported.start_segments``: segments at their addresses, the blocks live then)
    and a segment the trace made goes where the GPU put it, so best fit breaks ties between equal
    free blocks by the same addresses; each allocation's address is then compared with the
    file's. Where the simulator puts an allocation at the front of the free room after a start
    block whose size the file does not give, the GPU's allocator did not, so that block kept an
    unsplit remainder: it is widened just enough and the replay run again (``widened``; at most
    ``_MAX_REFINEMENTS`` times, counted in ``start_refinements``). Without ``rebuild_start`` (or
    when the start cannot be rebuilt, ``imported.start_problem``) the blocks live before the trace
    are allocated first, in address order, on an empty allocator.
    NB: a retry after a failed cudaMalloc releases only the cache of the request's own stream here
    (the real allocator's ``release_cached_blocks`` frees every stream's)."""
    kwargs = dict(imported.settings)
    if imported.capacity is not None:
        kwargs["capacity_bytes"] = imported.capacity
    kwargs.update(allocator_kwargs)
    starts = imported.start_segments if rebuild_start else None
    replay, miss = _replay_from(imported, kwargs, starts)
    for refined in range(1, _MAX_REFINEMENTS + 1):
        # an allocation put in the free room after a block whose size the file does not give: the
        # GPU did not, so that room was smaller (the block kept an unsplit remainder). Widen, retry.
        wider = widened(starts, *miss) if replay.rebuilt_start and miss is not None else None
        if wider is None:
            break
        starts = wider
        replay, miss = _replay_from(imported, kwargs, starts)
        replay.start_refinements = refined
    return replay


# at most this many replays more, each widening one guessed block of a rebuilt start
_MAX_REFINEMENTS = 64


def _replay_from(imported: ImportedSnapshot, kwargs: dict[str, Any],
                 starts: list[StartSegment] | None) -> tuple[SnapshotReplay, tuple[int, int] | None]:
    """One replay from ``starts`` (None: from an empty allocator), and the first allocation the
    simulator put elsewhere than the file says: (its simulated address, its bytes), or None."""
    run = _Replay(kwargs)
    before_bytes = {e["sid"]: e["nbytes"] for e in imported.events if e["index"] < 0}
    rebuilt, refused = False, ""
    if starts is not None:
        try:
            run.live = adopt_start(starts, run.sim_of, before_bytes)
            rebuilt = True
        except ValueError as exc:           # a simulator refused the start: replay from empty
            run, refused = _Replay(kwargs), str(exc)
    run.sim_of(0)
    run.req = sum(before_bytes[sid] for sid in run.live)
    run.record()                            # the start (dropped from the series below)
    releases = set(imported.releases)
    for k, n, stream in imported.oom_requests:
        run.ooms.setdefault(k, []).append((n, stream))
    if rebuilt and not kwargs.get("expandable_segments"):     # the simulator's segments are the file's: free those
        for k, addr, stream in imported.segment_frees:
            run.frees.setdefault(k, []).append((addr, stream))
    same_address = 0
    miss: tuple[int, int] | None = None
    for k, e in enumerate(imported.events):
        run.before_event(k, k in releases)
        if e["kind"] == "alloc" and e["sid"] not in run.live:   # (a block in the rebuilt start is live already)
            block = run.malloc(e, e.get("segment_address") if rebuilt else None)
            placed = block is not None and e["index"] >= 0 and block.addr == e.get("addr")
            same_address += placed
            if not placed and miss is None and block is not None:
                miss = (block.addr, e["nbytes"])
        elif e["kind"] == "free" and e["sid"] in run.live:
            sim, block = run.live.pop(e["sid"])
            sim.free(block)
            run.req -= e["nbytes"]
        run.record()
    run.before_event(len(imported.events), len(imported.events) in releases)
    sims = run.sims
    stats = sims[0].stats() if len(sims) == 1 else {key: sum(one.stats()[key] for one in sims.values())
                                                     for key in sims[0].stats()}
    if len(sims) > 1:    # the peaks of the sums
        stats.update({"allocated_bytes.all.peak": max(run.alloc), "reserved_bytes.all.peak": max(run.res),
                      "requested_bytes.all.peak": max(run.requested)})
    segments = [seg for one in sims.values() for seg in one.segment_map()]
    settings = {k: v for k, v in kwargs.items() if v not in (None, False)}
    allocs = sum(1 for e in imported.events if e["kind"] == "alloc" and e["index"] >= 0)
    compared = rebuilt            # else the addresses are the simulator's own
    return SnapshotReplay(imported, Series(run.alloc[1:], run.res[1:], "snapshot, replayed", "simulated allocator"),
                          segments, stats, settings, _pair_segments(imported, segments, by_address=rebuilt),
                          run.simulated_ooms, rebuilt, (same_address, allocs) if compared else None, 0, refused), miss


class _Replay:
    """The simulators of one replay (one per stream, sharing the device's capacity) and its series."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        self.kwargs = kwargs
        self.capacity = kwargs.get("capacity_bytes")
        self.sims: dict[int, CachingAllocator] = {}
        self.live: dict[int, tuple[CachingAllocator, Any]] = {}
        self.ooms: dict[int, list[tuple[int, int]]] = {}     # events before it -> (bytes, stream) refused
        self.simulated_ooms = 0
        self.frees: dict[int, list[tuple[int, int]]] = {}    # events before it -> (address, stream) released
        self.req = 0
        self.alloc: list[int] = []
        self.res: list[int] = []
        self.requested: list[int] = []

    def sim_of(self, stream: int) -> CachingAllocator:
        if stream not in self.sims:
            self.sims[stream] = CachingAllocator(**self.kwargs)
        sim = self.sims[stream]
        if self.capacity is not None:   # one device: what the other streams hold is not this one's to take
            sim.capacity_bytes = self.capacity - sum(o.memory_reserved() for o in self.sims.values() if o is not sim)
        return sim

    def before_event(self, k: int, release: bool) -> None:
        """A release burst before event k, then the requests the GPU refused there: does the
        simulator refuse each too, on its stream? A burst releases the very segments the file
        names where the simulator holds them (release_available_cached_blocks frees only oversize
        ones); else it is replayed as empty_cache() (release_cached_blocks)."""
        if release:
            named = self.frees.get(k, [])
            if not named or not all(self.sim_of(stream).release_segment(addr) for addr, stream in named):
                for one in self.sims.values():
                    one.empty_cache()
        for n, stream in self.ooms.get(k, ()):
            sim = self.sim_of(stream)
            try:
                sim.free(sim.malloc(n))
            except SimulatedOutOfMemoryError:
                self.simulated_ooms += 1

    def malloc(self, e: dict[str, Any], segment_address: int | None) -> Any:
        sim = self.sim_of(int(e.get("stream", 0) or 0))
        try:
            block = sim.malloc(e["nbytes"], segment_address=segment_address)
        except SimulatedOutOfMemoryError:
            return None
        self.live[e["sid"]] = (sim, block)
        self.req += e["nbytes"]
        return block

    def record(self) -> None:
        self.alloc.append(sum(one.memory_allocated() for one in self.sims.values()))
        self.res.append(sum(one.memory_reserved() for one in self.sims.values()))
        self.requested.append(self.req)


def _pair_segments(imported: ImportedSnapshot, segments: list[Segment], *,
                   by_address: bool) -> list[tuple[Segment | None, Segment | None]]:
    """The file's final segments beside the simulator's: those at the same address (when the
    simulator placed segments where the GPU did), then the rest in order of creation in each pool."""
    pairs: list[tuple[Segment | None, Segment | None]] = []
    for pool in ("large", "small"):
        created = sorted((p for p in zip(imported.segment_order, imported.segments) if p[1].pool == pool),
                         key=lambda p: (p[0], p[1].address))
        real = [s for _, s in created]
        simulated = sorted((s for s in segments if s.pool == pool), key=lambda s: (s.id, s.address))
        if by_address:
            at = {s.address: s for s in simulated}
            both = [(r, at.pop(r.address)) for r in real if r.address in at]
            paired = {id(r) for r, _ in both}
            pairs += both
            real = [r for r in real if id(r) not in paired]
            simulated = [s for s in simulated if s.address in at]
        for k in range(max(len(real), len(simulated))):
            pairs.append((real[k] if k < len(real) else None, simulated[k] if k < len(simulated) else None))
    return pairs
