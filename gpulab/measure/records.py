"""The tracker's data: one record per storage, one event per change to live memory, and
``TrackingResult``, what the tracker saw on one device (its timeline by category, its peak), with
its views. ``measure.tracking`` makes them."""
from __future__ import annotations

from dataclasses import dataclass, field

from gpulab.categories import CATEGORIES, Category
from gpulab.formulas import cuda_rounded_bytes

__all__ = ["Event", "HOST_DEVICE", "PHASES", "StorageRecord", "TrackingResult", "UNIFIED_DEVICE"]

PHASES = ("setup", "forward", "backward", "optimizer")
HOST_DEVICE = "host"   # where results put offloaded activations' host copies (apart from every device)
UNIFIED_DEVICE = "unified"   # and paged optimizer state (CUDA unified memory, outside the caching allocator)


@dataclass
class StorageRecord:
    """One storage seen by the tracker."""

    sid: int                 # tracker-local id, unique for the tracker's lifetime
    nbytes: int              # current size in bytes (storages can be resized)
    device: str
    dtype: str               # dtype of the first tensor seen on this storage
    shape: tuple[int, ...]   # shape of the first tensor seen on this storage
    category: Category
    module: str              # module whose forward was running when it was created
    phase: str               # phase when it was created
    op: str                  # the op that created it (or "existing" / "label")
    created: int             # index of its alloc event
    freed: int | None = None  # index of its free event, None while alive
    preexisting: bool = False  # created before the tracker saw it
    state_key: str = ""        # the optimizer.state key it was found under ("exp_avg", "step", ...)
    apart: str = ""            # memory outside the device's allocator: HOST_DEVICE (an offloaded activation's
                               # host copy) or UNIFIED_DEVICE (a paged optimizer's state), else ""
    node: int = -1             # sequence number of the autograd node that made it (-1: not in backward)

    @property
    def alive(self) -> bool:
        return self.freed is None

    def copied(self) -> "StorageRecord":
        """``copy.copy(self)``, made as it makes it (a new instance with this one's attribute dict copied
        in, its ``__reduce_ex__`` route for a plain dataclass) without the route's cost: a deep timeline's
        layout copies thousands."""
        out = object.__new__(type(self))
        out.__dict__.update(self.__dict__)
        return out


@dataclass(frozen=True)
class Event:
    """One change to live memory. ``kind`` is 'alloc', 'free' or 'resize'."""

    index: int
    kind: str
    sid: int
    nbytes: int      # bytes after the event for alloc/resize; bytes released for free
    delta: int       # change in live bytes
    device: str
    phase: str
    module: str
    time: float      # seconds since the tracker started

    def with_bytes(self, nbytes: int, delta: int) -> "Event":
        """This event with other bytes: what ``dataclasses.replace(e, nbytes=, delta=)`` gives, made
        field by field (``replace`` costs about ten times more, on each of a deep timeline's events)."""
        return Event(self.index, self.kind, self.sid, nbytes, delta, self.device, self.phase, self.module, self.time)


@dataclass
class TrackingResult:
    """What the tracker saw on one device, as data. Views: ``table()``, ``_repr_html_``,
    ``gpulab.plots.timeline(result)``."""

    device: str
    rounded: bool
    records: dict[int, StorageRecord]
    events: list[Event]                         # events on this device only
    series: list[dict[str, int]] = field(repr=False)  # live bytes per category after each event
    peak_bytes: int = 0
    peak_index: int = -1                        # index into ``events`` (-1: nothing allocated)
    peak_by_category: dict[str, int] = field(default_factory=dict)
    final_bytes: int = 0
    final_by_category: dict[str, int] = field(default_factory=dict)

    @classmethod
    def build(cls, records: dict[int, StorageRecord], events: list[Event], device: str | None = None,
              rounded: bool | None = None) -> "TrackingResult":
        if device is None:
            device = _busiest_device(events)
        events = [e for e in events if e.device == device]
        rounded = rounds_to_cuda_blocks(device, rounded)
        size = cuda_rounded_bytes if rounded else _own_bytes
        current = {c.value: 0 for c in CATEGORIES}
        sizes: dict[int, int] = {}
        series: list[dict[str, int]] = []
        peak, peak_index, total = 0, -1, 0
        peak_split = dict(current)
        category = {sid: r.category.value for sid, r in records.items()}   # an enum's .value, read once per storage
        for i, e in enumerate(events):
            cat = category[e.sid]
            old = sizes.get(e.sid, 0)
            new = 0 if e.kind == "free" else size(e.nbytes)
            sizes[e.sid] = new
            current[cat] += new - old
            total += new - old
            series.append(dict(current))
            if total > peak:
                peak, peak_index, peak_split = total, i, dict(current)
        return cls(device=device, rounded=rounded,
                   records={sid: r for sid, r in records.items() if r.device == device},
                   events=events, series=series, peak_bytes=peak, peak_index=peak_index,
                   peak_by_category=peak_split, final_bytes=total, final_by_category=dict(current))

    # ---- queries -------------------------------------------------------------------------------
    def peak_between(self, start: int, end: int | None = None) -> tuple[int, dict[str, int], int]:
        """The peak of live bytes within the events whose tracker index is in [start, end) (a
        window between two ``RunContext.mark()`` calls, e.g. one training step): (bytes, bytes
        per category at that moment, index into ``events``; -1 when the window is empty, with
        the live bytes at its start)."""
        best, best_i = -1, -1
        before = -1
        for i, e in enumerate(self.events):
            if e.index < start:
                before = i
                continue
            if end is not None and e.index >= end:
                break
            total = sum(self.series[i].values())
            if total > best:
                best, best_i = total, i
        if best_i < 0:
            split = dict(self.series[before]) if before >= 0 else {c.value: 0 for c in CATEGORIES}
            return sum(split.values()), split, -1
        return best, dict(self.series[best_i]), best_i

    def storage_bytes(self, rec: StorageRecord) -> int:
        return cuda_rounded_bytes(rec.nbytes) if self.rounded else rec.nbytes

    def live_at(self, index: int) -> list[StorageRecord]:
        """Storages alive just after event ``index`` (``peak_index`` for the peak)."""
        alive: dict[int, StorageRecord] = {}
        for e in self.events[: index + 1]:
            if e.kind == "free":
                alive.pop(e.sid, None)
            else:
                alive[e.sid] = self.records[e.sid]
        return list(alive.values())

    def alive(self) -> list[StorageRecord]:
        """Storages still alive at the end of the recording."""
        return [r for r in self.records.values() if r.alive]

    @property
    def peak_phase(self) -> str:
        return self.events[self.peak_index].phase if self.peak_index >= 0 else ""

    @property
    def peak_module(self) -> str:
        return self.events[self.peak_index].module if self.peak_index >= 0 else ""

    def by_phase_peak(self) -> dict[str, int]:
        """Highest live total reached inside each phase."""
        out: dict[str, int] = {}
        for e, s in zip(self.events, self.series):
            tot = sum(s.values())
            out[e.phase] = max(out.get(e.phase, 0), tot)
        return out

    def as_dict(self) -> dict:
        return {
            "device": self.device,
            "rounded_to_512": self.rounded,
            "peak_bytes": self.peak_bytes,
            "peak_by_category": dict(self.peak_by_category),
            "peak_phase": self.peak_phase,
            "final_bytes": self.final_bytes,
            "final_by_category": dict(self.final_by_category),
            "storages": len(self.records),
            "events": len(self.events),
        }

    # ---- views -----------------------------------------------------------------------------------
    def table(self) -> str:
        from gpulab.units import format_bytes
        lines = [f"live tensors on {self.device}" + (" (each rounded up to 512 B)" if self.rounded else ""),
                 f"{'category':<16}{'at peak':>14}{'at end':>14}"]
        for c in CATEGORIES:
            lines.append(f"{c.value:<16}{format_bytes(self.peak_by_category.get(c.value, 0)):>14}"
                         f"{format_bytes(self.final_by_category.get(c.value, 0)):>14}")
        lines.append(f"{'total':<16}{format_bytes(self.peak_bytes):>14}{format_bytes(self.final_bytes):>14}")
        if self.peak_index >= 0:
            lines.append(f"peak during {self.peak_phase}" + (f" in {self.peak_module}" if self.peak_module else ""))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"TrackingResult(device={self.device!r}, peak_bytes={self.peak_bytes}, storages={len(self.records)})"

    def _repr_html_(self) -> str:
        from gpulab.tables import html_table
        from gpulab.units import format_bytes
        rows = [[c.value, format_bytes(self.peak_by_category.get(c.value, 0)),
                 format_bytes(self.final_by_category.get(c.value, 0))] for c in CATEGORIES]
        rows.append(["total", format_bytes(self.peak_bytes), format_bytes(self.final_bytes)])
        return html_table(["category", "at peak", "at end"], rows,
                          f"live tensors on {self.device}, peak during {self.peak_phase}")


def _busiest_device(events: list[Event]) -> str:
    totals: dict[str, int] = {}
    peaks: dict[str, int] = {}
    for e in events:
        totals[e.device] = totals.get(e.device, 0) + e.delta
        peaks[e.device] = max(peaks.get(e.device, 0), totals[e.device])
    if not peaks:
        return "cpu"
    return max(peaks, key=peaks.get)


def rounds_to_cuda_blocks(device: str, rounded: bool | None = None) -> bool:
    """Whether live bytes on ``device`` count each storage as the 512-byte multiple the CUDA caching
    allocator gives it: ``rounded`` when given, else yes on a CUDA device."""
    return device.startswith("cuda") if rounded is None else rounded


def _own_bytes(n: int) -> int:
    return n


def apart_devices(records: dict[int, StorageRecord]) -> dict[int, str]:
    """The storages counted on a device of their own, apart from the one they were made on
    (offloaded activations, paged optimizer state): storage id -> that device."""
    return {sid: r.apart for sid, r in records.items() if r.apart}


def live_by_category(records: dict[int, StorageRecord], events: list[Event], device: str) -> dict[str, int]:
    """The bytes alive after ``events`` on ``device`` per category, with each storage on the device
    ``apart_devices`` gives it and sized as ``TrackingResult.build`` sizes it: one pass, no copies."""
    apart = apart_devices(records)
    size = cuda_rounded_bytes if rounds_to_cuda_blocks(device) else _own_bytes
    sizes: dict[int, int] = {}
    for e in events:
        if apart.get(e.sid, e.device) == device:
            sizes[e.sid] = 0 if e.kind == "free" else e.nbytes
    current = {c.value: 0 for c in CATEGORIES}
    for sid, n in sizes.items():
        if n:
            current[records[sid].category.value] += size(n)
    return current
