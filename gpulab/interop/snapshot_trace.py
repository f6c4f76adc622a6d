"""A snapshot's trace walked once: what ``gpulab.interop.snapshot_import`` builds its timeline from.

``walk_trace`` turns one device's trace entries (``torch.cuda.memory._snapshot()``'s
``device_traces``) into gpulab's alloc/free events (each with its address, its stream, and the
segment ``cudaMalloc`` gave it when one was made for it), each entry's change to live requested
bytes and reserved bytes, the blocks freed that the trace never allocated (live before its first
entry), the segments it makes and releases, its release bursts and its ``oom`` entries.
``final_live`` reads the blocks live at the end from the final segments.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpulab.interop.snapshot_viewer import blocks_at

__all__ = ["LIVE_STATES", "final_live", "walk_trace"]

# blocks a tensor still holds (active_pending_free: freed, waiting for another stream's use)
LIVE_STATES = ("active_allocated", "active_pending_free")


def final_live(segs: list[dict[str, Any]]) -> dict[int, tuple[int, int, int]]:
    """Blocks live at the end, by address: (requested bytes, block size, the segment's stream)."""
    final_live: dict[int, tuple[int, int, int]] = {}
    for s in segs:
        for addr, b in blocks_at(s):
            if b.get("state") in LIVE_STATES:
                final_live[addr] = (int(b.get("requested_size", b["size"]) or b["size"]), int(b["size"]),
                                    int(s.get("stream", 0) or 0))
    return final_live


@dataclass
class Walk:
    """What one pass over a device trace finds: gpulab events, blocks freed that were allocated
    before the trace began, and each entry's change to active and reserved bytes."""
    events: list[dict[str, Any]] = field(default_factory=list)
    before: list[dict[str, Any]] = field(default_factory=list)
    live: dict[int, int] = field(default_factory=dict)        # addr -> sid
    seen: set[int] = field(default_factory=set)                # addresses of every alloc and free in the trace
    sizes: dict[int, int] = field(default_factory=dict)       # sid -> bytes
    next_sid: int = 0
    act_delta: list[int] = field(default_factory=list)
    res_delta: list[int] = field(default_factory=list)
    seg_created: dict[int, int] = field(default_factory=dict)
    ooms: int = 0
    releases: list[int] = field(default_factory=list)   # len(events) when a burst of segment releases began
    segment_frees: list[tuple[int, int, int]] = field(default_factory=list)   # (len(events), addr, stream)
    oom_requests: list[tuple[int, int, int, int]] = field(default_factory=list)   # (len(events), bytes, device_free or -1, stream)
    oom_reserved: list[int] = field(default_factory=list)   # index of the trace entry of each oom

    def new_sid(self, nbytes: int) -> int:
        sid, self.next_sid = self.next_sid, self.next_sid + 1
        self.sizes[sid] = nbytes
        return sid


def walk_trace(trace: list[dict[str, Any]]) -> Walk:
    w = Walk()
    for i, e in enumerate(trace):
        a = e.get("action")
        d_act = d_res = 0
        if a == "alloc":
            sid = w.new_sid(int(e["size"]))
            w.live[e["addr"]] = sid
            w.seen.add(e["addr"])
            ev = {"kind": "alloc", "sid": sid, "nbytes": int(e["size"]), "index": i, "time_us": e.get("time_us", 0),
                  "stream": int(e.get("stream", 0) or 0), "addr": e["addr"]}
            prev = trace[i - 1] if i else {}
            if prev.get("action") == "segment_alloc" and prev.get("stream") == e.get("stream"):
                ev["segment_address"] = prev["addr"]      # the segment cudaMalloc gave this request
            elif prev.get("action") == "segment_map" and prev.get("stream") == e.get("stream"):
                j = i - 1                                 # the first page this request mapped: where a
                while j > 0 and trace[j - 1].get("action") == "segment_map":   # new virtual range begins
                    j -= 1
                ev["segment_address"] = trace[j]["addr"]
            if e.get("category") is not None:
                ev["category"] = e["category"]
            if isinstance(e.get("gpulab"), dict):
                ev["gpulab"] = e["gpulab"]
            w.events.append(ev)
            d_act = int(e["size"])
        elif a == "free_completed":
            sid = w.live.pop(e["addr"], None)
            if sid is None:      # allocated before the trace began (or the ring buffer wrapped)
                sid = w.new_sid(int(e["size"]))
                w.before.append({"kind": "alloc", "sid": sid, "nbytes": int(e["size"]), "index": -1, "addr": e["addr"],
                                 "stream": int(e.get("stream", 0) or 0), "freed_at": i})
            w.seen.add(e["addr"])
            ev = {"kind": "free", "sid": sid, "nbytes": w.sizes[sid], "index": i, "time_us": e.get("time_us", 0)}
            if isinstance(e.get("gpulab"), dict):
                ev["gpulab"] = e["gpulab"]
            w.events.append(ev)
            d_act = -w.sizes[sid]
        elif a in ("segment_alloc", "segment_map"):
            d_res = int(e["size"])
            w.seg_created[e["addr"]] = i
        elif a in ("segment_free", "segment_unmap"):
            d_res = -int(e["size"])
            if a == "segment_free":
                w.segment_frees.append((len(w.events), int(e["addr"]), int(e.get("stream", 0) or 0)))
            # a burst of releases is release_cached_blocks (empty_cache(), or a retry after a failed
            # cudaMalloc): one release where its first entry is
            if i == 0 or trace[i - 1].get("action") not in ("segment_free", "segment_unmap"):
                w.releases.append(len(w.events))
        elif a == "oom":
            w.ooms += 1
            free = e.get("device_free")          # -1: the entry does not say (0 is a full card)
            w.oom_requests.append((len(w.events), int(e.get("size", 0)), -1 if free is None else int(free),
                                   int(e.get("stream", 0) or 0)))
            w.oom_reserved.append(i)
        w.act_delta.append(d_act)
        w.res_delta.append(d_res)
    return w
