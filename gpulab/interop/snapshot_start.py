"""The allocator's state at a snapshot trace's first entry, rebuilt from the file.

Most snapshots recorded on a GPU begin mid-run (history turned on after the model was loaded, or a
ring buffer that wrapped): segments and live blocks existed before the first trace entry. They
are in the file, walked backwards: the final ``segments`` hold every segment the trace never made
(and a ``segment_free`` in the trace gives one it released before making it again), and the
blocks live at entry 0 are those the trace frees without allocating them, or that are live at
the end and never touched; with expandable segments, the pages mapped then are the final ones
walked back through the trace's ``segment_map`` / ``segment_unmap`` entries. ``start_state``
rebuilds them (addresses, sizes, blocks); ``adopt_start`` hands them to simulators
(``CachingAllocator.add_segment``, ``add_expandable_segment``), so a replay starts where
PyTorch's allocator was; ``widened`` corrects a block size the file does not give.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, replace
from typing import Any, Callable

from gpulab.allocator.simulator import (DEFAULT_VIRTUAL_BYTES, LARGE_BUFFER, MIN_BLOCK_SIZE, SMALL_BUFFER,
                                       SMALL_SIZE, Block, CachingAllocator, round_size)

__all__ = ["StartSegment", "adopt_start", "start_state", "widened"]


@dataclass(frozen=True)
class StartSegment:
    """A segment that existed before the trace's first entry, as it was then (rebuilt from the file).

    ``blocks``: in address order, tiling the segment: ``(address, size, sid)`` for a block live at
    entry 0 (``sid``: its event's, in ``ImportedSnapshot.events``) or ``(address, size, None)``
    for free room. ``exact``: how many of the live blocks' sizes the file gives (blocks still live
    at the end, or an allocation in the trace placed right after one); the others are their
    requested bytes rounded as the allocator rounds them, with the room up to the next block when
    the allocator would not have split it off. NB: a block freed in the trace that had an unsplit
    remainder, followed by free room larger than 1 MiB that nothing is allocated in before it is
    freed, reads as its rounded request (the file does not say): it is listed in ``guessed``, and
    ``widened`` makes it larger when a replay shows the room after it was smaller."""
    address: int
    size: int
    pool: str
    stream: int
    blocks: tuple[tuple[int, int, int | None], ...]
    exact: int = 0
    # live blocks whose size is a guess that may be short (large pool, free room of more than the
    # allowed remainder after them, nothing allocated there): (sid, smallest size, largest size)
    guessed: tuple[tuple[int, int, int], ...] = ()
    # a mapped range of an expandable segment: where that segment's virtual range begins
    expandable_base: int | None = None

    @property
    def live_bytes(self) -> int:
        return sum(size for _, size, sid in self.blocks if sid is not None)


def start_state(segs: list[dict[str, Any]], trace: list[dict[str, Any]], before: list[dict[str, Any]],
                settings: dict[str, Any], capacity: int | None = None) -> tuple[list[StartSegment] | None, str]:
    """The allocator's segments and live blocks at the trace's first entry, walked back from the end.

    A segment existed then when the trace never makes it (a final segment with no ``segment_alloc``
    at its address) or releases it before making one there (its ``segment_free`` gives the size).
    The blocks live then are ``before`` (freed in the trace but never allocated in it, or live at the
    end and never touched). Each block's size: the final segments' where the block is still there;
    else ``round_size`` of its request, plus the room up to the next block when the allocator would
    not have split that room off (large pool: a remainder of 1 MiB or less, ``should_split``; a
    request of ``max_split_size`` or more is never split, up to kLargeBuffer of slack,
    ``get_free_block``). With expandable segments, the mapped ranges then (``_expandable_runs``),
    each block its rounded request (``should_split`` splits off any remainder of 512 bytes or more).
    Returns (None, why) when the start cannot be rebuilt.
    NB: a trace that begins between a ``segment_alloc`` and its ``alloc`` (a ring buffer that
    wrapped inside one ``malloc``) reads that new segment as one cached before the trace."""
    expandable = bool(settings.get("expandable_segments") or any(s.get("is_expandable") for s in segs)
                      or any(e.get("action") in ("segment_map", "segment_unmap") for e in trace))
    if expandable:
        runs, problem = _expandable_runs(segs, trace, capacity)
        if runs is None:
            return None, problem
        found = {a: (size, pool, stream) for (stream, pool, _), spans in runs.items() for a, size in spans}
        bases = {a: base for (_, _, base), spans in runs.items() for a, _ in spans}
    else:
        found = _fixed_segments(segs, trace)
    if not found and not before:
        return [], ""            # the trace starts from an empty allocator: nothing to rebuild
    split_limit = (settings.get("max_split_size_mb") or 0) * (1 << 20) or None
    allocs = sorted((int(e["addr"]), i) for i, e in enumerate(trace) if e.get("action") == "alloc")
    before = sorted(before, key=lambda e: e["addr"])
    addrs = [e["addr"] for e in before]
    starts: list[StartSegment] = []
    placed = 0
    for a in sorted(found):
        size, pool, stream = found[a]
        inside = before[bisect.bisect_left(addrs, a):bisect.bisect_left(addrs, a + size)]
        placed += len(inside)
        blocks: list[tuple[int, int, int | None]] = []
        guessed: list[tuple[int, int, int]] = []
        pos, exact = a, 0
        for j, e in enumerate(inside):
            nxt = inside[j + 1]["addr"] if j + 1 < len(inside) else a + size
            if e["addr"] > pos:
                blocks.append((pos, e["addr"] - pos, None))
            if "block_size" in e:
                n = e["block_size"]
                exact += 1
            else:
                n = round_size(e["nbytes"])
                gap = nxt - (e["addr"] + n)
                slack = SMALL_SIZE if split_limit is None or n < split_limit else LARGE_BUFFER - 1
                # the first block the trace allocates in the room after it, while it lives, begins
                # where it ends: the room's front (alloc_found_block carves from the front)
                front = _first_alloc_in(allocs, e["addr"] + n, nxt, e.get("freed_at", len(trace)))
                if pool == "large" and not expandable and front is not None and front - (e["addr"] + n) <= slack:
                    n = front - e["addr"]
                    exact += 1
                elif pool == "large" and not expandable and 0 < gap <= slack:
                    n += gap      # a remainder the allocator would not split off (should_split)
                elif pool == "large" and gap > slack and not expandable:
                    guessed.append((e["sid"], n, n + slack))
            if e["addr"] + n > nxt:
                return None, f"the block at {e['addr']:#x} overlaps the next one: the file disagrees with itself"
            blocks.append((e["addr"], n, e["sid"]))
            pos = e["addr"] + n
        if pos < a + size:
            blocks.append((pos, a + size - pos, None))
        starts.append(StartSegment(a, size, pool, stream, tuple(blocks), exact, tuple(guessed),
                                   bases[a] if expandable else None))
    if placed != len(before):
        return None, f"{len(before) - placed} of the blocks live before the trace lie in no segment the file names"
    return starts, ""


def _fixed_segments(segs: list[dict[str, Any]], trace: list[dict[str, Any]]) -> dict[int, tuple[int, str, int]]:
    """Segments (not expandable) that existed at the trace's first entry: address -> (bytes, pool,
    stream). A final segment the trace never makes; a segment the trace releases before making one
    at its address (its ``segment_free`` gives the size)."""
    first: dict[int, dict[str, Any]] = {}
    for e in trace:
        if e.get("action") in ("segment_alloc", "segment_free"):
            first.setdefault(int(e["addr"]), e)
    found: dict[int, tuple[int, str, int]] = {}
    for s in segs:
        a = int(s["address"])
        if a not in first:
            size = int(s["total_size"])
            found[a] = (size, str(s.get("segment_type", "small" if size <= SMALL_BUFFER else "large")),
                        int(s.get("stream", 0) or 0))
    for a, e in first.items():
        if e["action"] == "segment_free":
            size = int(e["size"])
            found[a] = (size, "small" if size <= SMALL_BUFFER else "large", int(e.get("stream", 0) or 0))
    return found


def _expandable_runs(segs: list[dict[str, Any]], trace: list[dict[str, Any]], capacity: int | None
                     ) -> tuple[dict[tuple[int, str, int], list[tuple[int, int]]] | None, str]:
    """Expandable segments' mapped ranges at the trace's first entry: (stream, pool, base) ->
    [(address, bytes)]. The final mapped pages, walked back through the trace (a ``segment_map``
    had not happened yet, a ``segment_unmap`` had not either). A map or unmap entry belongs to the
    pool whose pages its size is made of (20 MiB large, 2 MiB small) and, where both fit, whose
    known pages on its stream are nearest. A segment's virtual range begins at the lowest address
    the file shows for it (``find_expandable_block`` maps a new segment from its start, and always
    the lowest free pages) and is as large as the simulator's (9/8 of the capacity); addresses
    beyond it belong to another segment of the same pool."""
    known: dict[tuple[int, str], list[int]] = {}
    for s in segs:
        if not s.get("is_expandable"):
            return None, "expandable and fixed segments together: such a start is not modelled"
        known.setdefault((int(s.get("stream", 0) or 0), str(s.get("segment_type", "large"))), []).append(
            int(s["address"]))
    page = {"small": SMALL_BUFFER, "large": LARGE_BUFFER}
    entries = [e for e in trace if e.get("action") in ("segment_map", "segment_unmap")]
    owner: list[tuple[int, str]] = []
    for e in entries:
        stream, addr = int(e.get("stream", 0) or 0), int(e["addr"])
        pools = [p for p in ("large", "small") if int(e["size"]) % page[p] == 0]
        near = [(min((abs(addr - a) for a in known.get((stream, p), ())), default=1 << 62), p) for p in pools]
        owner.append((stream, min(near)[1]))
    pages: dict[tuple[int, str], set[int]] = {key: set() for key in [*known, *owner]}
    for s in segs:
        key = (int(s.get("stream", 0) or 0), str(s.get("segment_type", "large")))
        pages[key].update(range(int(s["address"]), int(s["address"]) + int(s["total_size"]), page[key[1]]))
    for e, key in zip(reversed(entries), reversed(owner)):
        span = set(range(int(e["addr"]), int(e["addr"]) + int(e["size"]), page[key[1]]))
        pages[key] = pages[key] - span if e["action"] == "segment_map" else pages[key] | span
    total = DEFAULT_VIRTUAL_BYTES if capacity is None else capacity
    runs: dict[tuple[int, str, int], list[tuple[int, int]]] = {}
    for key, got in pages.items():
        size = page[key[1]]
        virtual = -(-(total + total // 8) // size) * size
        seen = sorted({*known.get(key, ()), *(int(e["addr"]) for e, k in zip(entries, owner) if k == key)} | got)
        bases: list[int] = []
        for a in seen:                    # a segment per virtual range, from the lowest address seen
            if not bases or a >= bases[-1] + virtual:
                bases.append(a)
        for a in sorted(got):
            base = max(b for b in bases if b <= a)
            spans = runs.setdefault((key[0], key[1], base), [])
            if spans and spans[-1][0] + spans[-1][1] == a:
                spans[-1] = (spans[-1][0], spans[-1][1] + size)
            else:
                spans.append((a, size))
    return runs, ""


def _first_alloc_in(allocs: list[tuple[int, int]], lo: int, hi: int, before: int) -> int | None:
    """The lowest address in [lo, hi) that a trace entry before index ``before`` allocated
    (``allocs``: (address, entry index), sorted), or None."""
    k = bisect.bisect_left(allocs, (lo, -1))
    while k < len(allocs) and allocs[k][0] < hi:
        if allocs[k][1] < before:
            return allocs[k][0]
        k += 1
    return None


def widened(starts: list[StartSegment] | None, address: int, nbytes: int) -> list[StartSegment] | None:
    """The start with one guessed block made larger, when a replay put a request of ``nbytes`` at
    ``address``, the front of the free room right after that block, where the GPU's allocator did
    not: the room was then too small for it (best fit takes the smallest free block that fits, and
    the simulator's room was no larger than the block it chose instead), so the block kept at least
    the room's bytes minus the request, plus 512 (``kMinBlockSize``), as an unsplit remainder. None
    when no guessed block ends at ``address`` or the widening breaks the allocator's rules (a
    remainder past what it leaves unsplit, or a free room of 1 MiB or less left after it)."""
    for k, seg in enumerate(starts or ()):
        if not seg.address <= address < seg.address + seg.size:
            continue
        limits = {sid: (low, high) for sid, low, high in seg.guessed}
        for j, (a, n, sid) in enumerate(seg.blocks[:-1]):
            room_addr, room, free = seg.blocks[j + 1]
            if sid not in limits or a + n != address or free is not None:
                continue
            grow = room - round_size(nbytes) + MIN_BLOCK_SIZE
            if grow <= 0 or n + grow > limits[sid][1] or room - grow <= SMALL_SIZE:
                return None
            blocks = list(seg.blocks)
            blocks[j:j + 2] = [(a, n + grow, sid), (room_addr + grow, room - grow, None)]
            return starts[:k] + [replace(seg, blocks=tuple(blocks))] + starts[k + 1:]
        return None
    return None


def adopt_start(starts: list[StartSegment], sim_of: Callable[[int], CachingAllocator],
                requested: dict[int, int]) -> dict[int, tuple[CachingAllocator, Block]]:
    """Give each start segment to the simulator of its stream (``sim_of(stream)``), its live blocks
    allocated with their requested bytes (``requested[sid]``). Returns sid -> (simulator, block).
    Raises ``ValueError`` when a simulator refuses one (``CachingAllocator.add_segment``)."""
    live: dict[int, tuple[CachingAllocator, Block]] = {}
    groups: dict[tuple[int, str, int], list[StartSegment]] = {}
    for seg in starts:
        if seg.expandable_base is not None:
            groups.setdefault((seg.stream, seg.pool, seg.expandable_base), []).append(seg)
    for (stream, pool, base), runs in sorted(groups.items(), key=lambda g: -g[0][2]):   # highest first
        sim = sim_of(stream)
        handles = sim.add_expandable_segment(base, [(r.address, [(n, None if sid is None else requested[sid])
                                                                 for _, n, sid in r.blocks]) for r in runs], pool=pool)
        sids = [sid for r in sorted(runs, key=lambda r: r.address) for _, _, sid in r.blocks if sid is not None]
        live.update({sid: (sim, handle) for sid, handle in zip(sids, handles)})
    for seg in starts:
        if seg.expandable_base is not None:
            continue
        sim = sim_of(seg.stream)
        handles = sim.add_segment(seg.address, [(n, None if sid is None else requested[sid])
                                                for _, n, sid in seg.blocks], pool=seg.pool)
        for sid, handle in zip((sid for _, _, sid in seg.blocks if sid is not None), handles):
            live[sid] = (sim, handle)
    return live
