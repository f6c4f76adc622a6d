"""PyTorch's memory snapshots, both ways; this module writes them.

**Export** (here). Any gpulab timeline (a tracker result from the cpu, fake or cuda engine, or any
list of alloc/free events) is replayed through the simulated caching allocator
(``gpulab.allocator.simulator``), which records what ``torch.cuda.memory._record_memory_history()``
records on a GPU. The result is a dict in the format ``torch.cuda.memory._snapshot()`` returns
and ``_dump_snapshot()`` pickles, so PyTorch's own tools read it: ``torch.cuda._memory_viz``
(``trace_plot``, ``segment_plot``, ``memory``, ``segments``, ``segsum``, ``trace``) and
pytorch.org/memory_viz.

**What the viewer shows** (``gpulab.interop.snapshot_viewer``): the peaks PyTorch's viewer draws from a
snapshot, whether it can read the file, and its HTML for a notebook.

**Import** (``gpulab.interop.snapshot_import``). A snapshot pickle made on a real GPU is read back (with
an unpickler that builds only plain containers: no code in a file ever runs), its timeline is
rebuilt from the trace, and its alloc/free trace is replayed through the simulator: simulated vs
recorded reserved memory, segment by segment.

The format, from PyTorch's source:

* ``torch/csrc/cuda/memory_snapshot.cpp`` (``_memory_snapshot_pickled``): a segment has
  ``device, address, total_size, allocated_size, active_size, requested_size, stream,
  segment_type ('small'|'large'), segment_pool_id, is_expandable, frames, blocks``; a block
  ``address, size, requested_size, state ('active_allocated'|'active_pending_free'|'inactive'),
  frames``; a trace entry ``action, addr (device_free for 'oom'), size, stream, time_us, frames``;
  ``device_traces`` holds one list of entries per device; ``allocator_settings`` the allocator's
  configuration.
* ``c10/cuda/CUDACachingAllocator.cpp``: ``alloc_found_block`` records 'alloc' with the
  *requested* bytes (``orig_size``), ``free`` records 'free_requested' and ``free_block``
  'free_completed' with the block's ``requested_size``; ``alloc_block`` records 'segment_alloc'
  and ``release_block`` 'segment_free' with the segment's bytes; expandable segments record
  'segment_map' / 'segment_unmap'; an out-of-memory records 'oom' with the rounded request size
  and ``device_free``.
* ``torch/utils/viz/MemoryViz.js`` (the viewer ``trace_plot``'s HTML loads): ``annotate_snapshot``
  and ``process_alloc_data``; ``gpulab.interop.snapshot_viewer.viz_peak`` follows the latter line by line.

NB: an exported snapshot's segments, blocks and addresses are the *simulator's*, never a GPU's;
the file says so in its ``"gpulab"`` entry, and ``gpulab.interop.snapshot_import.ImportedSnapshot``
labels it so.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from gpulab.allocator.simulator import SIZE_MAX, CachingAllocator, Segment, SimulatedOutOfMemoryError, round_size
from gpulab.files import check_target, write_atomic
from gpulab.interop.snapshot_viewer import ViewerHTML, viz_peak
from gpulab.tables import html_table
from gpulab.measure.tracking import Event, TrackingResult
from gpulab.units import format_bytes

__all__ = [
    "ACTIONS", "BLOCK_STATES", "LABEL_EXPORTED", "MemorySnapshot", "export_tracking",
    "record_events", "unrounded"
]

# TraceEntry actions and their names (memory_snapshot.cpp, ``action_to_str``)
ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
           "segment_map", "segment_unmap", "snapshot", "oom")
BLOCK_STATES = ("active_allocated", "active_pending_free", "inactive")

LABEL_EXPORTED = ("exported by gpulab: {source}; segments, blocks and addresses from the simulated "
                  "caching allocator (not recorded on a GPU)")


class _RecordingAllocator(CachingAllocator):
    """The simulator, writing PyTorch's TraceEntry dicts where ``CUDACachingAllocator.cpp`` calls
    ``record_trace`` (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trace: list[dict[str, Any]] = []
        self.time_us = 0

    def _entry(self, action: str, addr: int, size: int, **extra: Any) -> dict[str, Any]:
        e = {"action": action, "addr": int(addr), "size": int(size), "stream": 0,
             "time_us": int(self.time_us), "frames": []}
        e.update(extra)
        self.trace.append(e)
        return e

    def malloc(self, nbytes: int):  # type: ignore[override]
        try:
            block = super().malloc(nbytes)
        except SimulatedOutOfMemoryError as exc:
            # record_trace(OOM, device_free, params.size(), ...): 'device_free' replaces 'addr'
            e = self._entry("oom", 0, round_size(nbytes))
            del e["addr"]
            e["device_free"] = int(exc.free or 0)
            raise
        if not block.is_null:
            self._entry("alloc", block.addr, nbytes)
        return block

    def free(self, block) -> None:  # type: ignore[override]
        if not block.is_null:
            self._entry("free_requested", block.addr, block.requested)
            self._entry("free_completed", block.addr, block.requested)
        super().free(block)

    def _alloc_block(self, pool, size, alloc_size, *, is_retry):  # type: ignore[override]
        blk = super()._alloc_block(pool, size, alloc_size, is_retry=is_retry)
        if blk is not None and not self.expandable_segments:
            self._entry("segment_alloc", blk.addr, alloc_size)
        return blk

    def _release_block(self, blk) -> None:  # type: ignore[override]
        self._entry("segment_free", blk.addr, blk.size)
        super()._release_block(blk)

    def _map_block(self, to_map, size) -> bool:  # type: ignore[override]
        addr, before = to_map.addr, self._total_reserved
        ok = super()._map_block(to_map, size)
        if ok:
            self._entry("segment_map", addr, self._total_reserved - before)
        return ok

    def _unmap_block(self, blk) -> None:  # type: ignore[override]
        seg = self._segments[blk.seg]
        rel = blk.addr - seg.base
        start = seg.base + -(-rel // seg.page) * seg.page        # segmentRight(ptr)
        before = self._total_reserved
        super()._unmap_block(blk)
        if self._total_reserved < before:
            self._entry("segment_unmap", start, before - self._total_reserved)


def _frame(filename: str, line: int, name: str) -> dict[str, Any]:
    return {"filename": str(filename), "line": int(line), "name": str(name)}


@dataclass
class MemorySnapshot:
    """A snapshot in PyTorch's format (``data``), made by gpulab. ``label`` says where its
    numbers come from. Views: ``trace_plot()`` / ``segment_plot()`` (PyTorch's HTML),
    ``viewer()`` (that HTML inline, with an offline notice and a download link), ``summary()``
    (``_memory_viz.segsum``), ``_repr_html_``."""

    data: dict[str, Any]
    label: str
    device: int = 0
    peak_allocated: int = 0        # simulated memory_allocated() peak (blocks)
    peak_reserved: int = 0         # simulated memory_reserved() peak (segments)
    ooms: int = 0

    # ---- files ----------------------------------------------------------------------------------
    def pickle_bytes(self) -> bytes:
        """The file's bytes: ``pickle.dumps`` of ``data``, as ``_dump_snapshot`` writes it."""
        return pickle.dumps(self.data)

    def save(self, path: str | Path, *, overwrite: bool = False) -> Path:
        """Write the snapshot pickle (what ``torch.cuda.memory._dump_snapshot(path)`` writes on a
        GPU); open it with ``python -m torch.cuda._memory_viz`` or drop it on pytorch.org/memory_viz.
        The file appears whole or not at all; an existing file is refused unless ``overwrite``."""
        return write_atomic(path, self.pickle_bytes(), overwrite=overwrite)

    # ---- what PyTorch's viewer shows ------------------------------------------------------------
    @property
    def trace(self) -> list[dict[str, Any]]:
        """The device's trace entries, in order."""
        return self.data["device_traces"][self.device]

    def viz_peak(self, segments: bool = False) -> int:
        """The peak of the viewer's "Active Memory Timeline" (requested bytes of live blocks), or
        with ``segments=True`` of its "Active Cached Segment Timeline" (reserved bytes)."""
        return viz_peak(self.data, self.device, segments=segments)

    def trace_plot(self, plot_segments: bool = False) -> str:
        """``torch.cuda._memory_viz.trace_plot(data)``: PyTorch's interactive timeline (HTML)."""
        from torch.cuda import _memory_viz
        return _memory_viz.trace_plot(self.data, plot_segments=plot_segments)

    def segment_plot(self) -> str:
        """``torch.cuda._memory_viz.segment_plot(data)``: the allocator state history (HTML)."""
        from torch.cuda import _memory_viz
        return _memory_viz.segment_plot(self.data)

    def summary(self) -> str:
        """``torch.cuda._memory_viz.segsum(data)``: PyTorch's text summary of the segments."""
        from torch.cuda import _memory_viz
        return _memory_viz.segsum(self.data)

    def viewer(self, kind: str = "trace", filename: str = "snapshot.pickle",
               height: int = 520) -> ViewerHTML:
        """PyTorch's interactive view of this snapshot for a notebook
        (``gpulab.interop.snapshot_viewer.ViewerHTML``).
        ``kind``: "trace" (Active Memory Timeline), "segments" (Active Cached Segment Timeline) or
        "state" (Allocator State History)."""
        kinds = {"trace": lambda: self.trace_plot(), "segments": lambda: self.trace_plot(True),
                 "state": self.segment_plot}
        if kind not in kinds:
            raise ValueError(f"unknown kind {kind!r}; valid: {', '.join(kinds)}")
        return ViewerHTML(kinds[kind](), self.pickle_bytes(), filename, self.label, height)

    # ---- views -----------------------------------------------------------------------------------
    def rows(self) -> list[list[str]]:
        trace = self.trace
        return [
            [f"trace entries (device_traces[{self.device}])", f"{len(trace):,}"],
            ["segments at the end", f"{len(self.data['segments']):,}"],
            ["peak of live tensors (Active Memory Timeline: requested bytes)", format_bytes(self.viz_peak())],
            ["peak allocated (blocks, memory_allocated)", format_bytes(self.peak_allocated)],
            ["peak reserved (segments, memory_reserved)", format_bytes(self.peak_reserved)],
            ["out-of-memory entries", str(self.ooms)],
        ]

    def _repr_html_(self) -> str:
        return html_table(["PyTorch memory snapshot", "value"], self.rows(), self.label)

    def __repr__(self) -> str:
        return (f"MemorySnapshot({len(self.trace)} trace entries, {len(self.data['segments'])} segments, "
                f"peak_reserved={self.peak_reserved:,} B; {self.label})")


def record_events(events: Iterable[Any], *, label: str = "", device: int = 0,
                  empty_cache_at: Iterable[int] = (),
                  frames: Callable[[Any], list[dict[str, Any]]] | None = None,
                  category: Callable[[Any], str | None] | None = None,
                  extra: Callable[[Any, Any], dict[str, Any] | None] | None = None,
                  time_us: Callable[[int, Any], int] | None = None,
                  until: int | None = None, **allocator_kwargs: Any) -> MemorySnapshot:
    """Replay ``events`` (objects or dicts with ``kind`` 'alloc'|'free'|'resize', ``sid``,
    ``nbytes``) through the simulated allocator, recording PyTorch's trace, and return the
    snapshot at the end (segments and blocks as ``torch.cuda.memory._snapshot()`` lists them).

    ``empty_cache_at``: event indices after which ``empty_cache()`` runs (as in
    ``gpulab.predict.replay.replay_events``). ``frames(sid)``, ``category(sid)``: what to attach to an
    allocation and its free (stack frames, a category the viewer colours by); ``extra(sid,
    event)``: gpulab's own fields for the 'alloc' and 'free_completed' entries an event makes.
    ``time_us(i, event)``: the entry's time (default: the event index). ``until``: stop after
    this event index (a snapshot taken at that moment, e.g. the peak). A simulated OOM is
    recorded as an 'oom' entry and the replay goes on without that allocation.
    NB: a 'resize' frees the old block, then allocates the new one (as the simulator's replay)."""
    label = label or LABEL_EXPORTED.format(source="events")
    sim = _RecordingAllocator(**allocator_kwargs)
    flush = set(empty_cache_at)
    live: dict[Any, Any] = {}
    block_sid: dict[int, Any] = {}
    peak_alloc = peak_res = 0
    ooms = 0
    unknown = "unknown" if category is not None else None
    for i, ev in enumerate(events):
        if until is not None and i > until:
            break
        get = ev.get if isinstance(ev, dict) else (lambda k, e=ev: getattr(e, k, None))
        kind, sid, nbytes = get("kind"), get("sid"), int(get("nbytes") or 0)
        sim.time_us = time_us(i, ev) if time_us is not None else i
        start = len(sim.trace)
        if kind in ("free", "resize", "alloc") and sid in live:   # an alloc of a live sid replaces it
            blk = live.pop(sid)
            block_sid.pop(blk.addr, None)
            sim.free(blk)
        if kind in ("alloc", "resize"):
            try:
                blk = sim.malloc(nbytes)
            except SimulatedOutOfMemoryError:
                ooms += 1
            else:
                if not blk.is_null:
                    live[sid] = blk
                    block_sid[blk.addr] = sid
        elif kind != "free":
            raise ValueError(f"event {i}: unknown kind {kind!r} (expected alloc, free or resize)")
        if i in flush:
            sim.empty_cache()
        _annotate(sim.trace[start:], sid, ev, frames, category, extra, unknown)
        peak_alloc = max(peak_alloc, sim.memory_allocated())
        peak_res = max(peak_res, sim.memory_reserved())
    segs = [_segment_dict(s, device, lambda addr: frames(block_sid[addr]) if frames is not None
                          and addr in block_sid else [])
            for s in sim.segment_map()]
    # snapshot() itself records a SNAPSHOT entry (addr 0, size: the active bytes) before the trace is read
    last = sim._entry("snapshot", 0, sum(s["active_size"] for s in segs))
    if unknown is not None:
        last["category"] = unknown   # so 'unknown' is among the categories even in a cut trace
    data = {
        "segments": segs,
        "device_traces": [[] for _ in range(device)] + [sim.trace],
        "allocator_settings": _settings(sim),
        "gpulab": {"label": label, "made_by": "gpulab.interop.snapshot.record_events", "torch": _torch_version(),
                   "note": "segments, blocks and addresses from gpulab's simulated caching allocator; "
                           "not recorded on a GPU"},
    }
    return MemorySnapshot(data, label, device, peak_alloc, peak_res, ooms)


def _annotate(entries: list[dict[str, Any]], sid: Any, ev: Any, frames, category, extra, unknown: str | None) -> None:
    """What one event's trace entries say about its storage: frames, category, gpulab's fields."""
    for e in entries:
        if e["action"] in ("alloc", "free_requested", "free_completed"):
            if frames is not None:
                e["frames"] = frames(sid)
            if category is not None:
                e["category"] = category(sid) or "unknown"
            if extra is not None and e["action"] in ("alloc", "free_completed"):
                more = extra(sid, ev)
                if more:
                    e["gpulab"] = more
        elif unknown is not None:
            # segments have no category; MemoryViz.js's annotate_snapshot expects 'unknown'
            # among the categories once any entry has one
            e["category"] = unknown


def _torch_version() -> str:
    import torch
    return str(torch.__version__)


def _segment_dict(seg: Segment, device: int, frames_at: Callable[[int], list]) -> dict[str, Any]:
    blocks = [{"address": b.addr, "size": b.size, "requested_size": b.requested,
               "state": "active_allocated" if b.allocated else "inactive",
               "frames": frames_at(b.addr) if b.allocated else []} for b in seg.blocks]
    allocated = sum(b.size for b in seg.blocks if b.allocated)
    return {"device": device, "address": seg.address, "total_size": seg.size,
            "allocated_size": allocated, "active_size": allocated,
            "requested_size": sum(b.requested for b in seg.blocks if b.allocated),
            "stream": 0, "segment_type": seg.pool, "segment_pool_id": (0, 0),
            "is_expandable": bool(seg.expandable), "frames": [], "blocks": blocks}


def _settings(sim: CachingAllocator) -> dict[str, Any]:
    conf = []
    if sim.expandable_segments:
        conf.append("expandable_segments:True")
    if sim.max_split_size_mb is not None:
        conf.append(f"max_split_size_mb:{sim.max_split_size_mb}")
    return {"PYTORCH_CUDA_ALLOC_CONF": ",".join(conf),
            # int64_t(max_split_size): SIZE_MAX reads -1
            "max_split_size": -1 if sim.max_split_size == SIZE_MAX else int(sim.max_split_size),
            "garbage_collection_threshold": 0.0, "expandable_segments": bool(sim.expandable_segments),
            "pinned_num_register_threads": 1, "release_lock_on_cudamalloc": False,
            "pinned_use_cuda_host_register": False, "roundup_power2_divisions": {}}


def export_tracking(result: TrackingResult, path: str | Path | None = None, *,
                    where: dict[int, str] | None = None, label: str = "", device: int = 0,
                    times: str = "tracker", at: str | int | None = None, overwrite: bool = False,
                    **allocator_kwargs: Any) -> MemorySnapshot:
    """A tracker result as a PyTorch memory snapshot (and written to ``path`` when given).

    Every storage the tracker saw becomes an allocation of its bytes (the requested size, as in a
    real trace), placed by the simulated allocator; each allocation carries gpulab's category
    (the viewer colours by it), its op and module as a stack frame, and ``where`` (file:line, as
    ``%%memtrack`` records it) as an outer frame. ``times``: "tracker" (the tracker's clock, µs
    since it started) or "index" (the event's index: a file that is the same on every run).
    ``at``: take the snapshot at that moment instead of the end: "peak" (the tracker's peak of
    requested bytes) or an index into ``result.events``. An existing file at ``path`` is refused
    (before any work) unless ``overwrite``."""
    if path is not None:
        check_target(path, overwrite=overwrite)
    if times not in ("tracker", "index"):
        raise ValueError(f"times must be 'tracker' or 'index', not {times!r}")
    until = _moment(result, at)
    records = result.records
    where = where or {}

    def frames(sid: int) -> list[dict[str, Any]]:
        r = records.get(sid)
        if r is None:
            return []
        out = [_frame(r.module or "<no module>", 0, f"{r.op} ({r.phase})")]
        loc = where.get(sid)
        if loc and ":" in loc:
            fname, _, line = loc.rpartition(":")
            out.append(_frame(fname, int(line) if line.isdigit() else 0, "<tracked code>"))
        return out

    def extra(sid: int, ev: Event) -> dict[str, Any]:
        r = records[sid]
        if ev.kind == "free":   # when and where it was freed
            return {"sid": int(sid), "phase": ev.phase, "module": ev.module}
        return {"sid": int(sid), "phase": ev.phase, "module": r.module, "op": r.op,
                "dtype": r.dtype, "shape": [int(d) for d in r.shape]}

    clock = (lambda i, e: round(e.time * 1e6)) if times == "tracker" else (lambda i, e: i)
    source = f"tracked storages on {result.device}"
    snap = record_events(result.events, label=label or LABEL_EXPORTED.format(source=source),
                         device=device, frames=frames,
                         category=lambda sid: records[sid].category.value if sid in records else None,
                         extra=extra, time_us=clock, until=until, **allocator_kwargs)
    snap.data["gpulab"].update({"made_by": "gpulab.interop.snapshot.export_tracking", "source": source,
                                "tracked_device": result.device})
    if path is not None:
        snap.save(path, overwrite=overwrite)
    return snap


def unrounded(result: TrackingResult) -> TrackingResult:
    """The same timeline counted in requested bytes (no 512-byte rounding): what a snapshot's
    trace records for each allocation, so what PyTorch's viewer adds up."""
    if not result.rounded:
        return result
    return TrackingResult.build(result.records, result.events, result.device, rounded=False)


def _moment(result: TrackingResult, at: str | int | None) -> int | None:
    if at is None:
        return None
    if at == "peak":
        return unrounded(result).peak_index
    if isinstance(at, int) and 0 <= at < len(result.events):
        return at
    raise ValueError(f"at must be None, 'peak' or an event index below {len(result.events)}, not {at!r}")

