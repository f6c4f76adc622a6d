"""What PyTorch's memory viewer shows of a snapshot, and whether it can open it.

A snapshot (the dict ``torch.cuda.memory._snapshot()`` returns; see ``gpulab.interop.snapshot`` for the
format) is drawn by ``torch/utils/viz/MemoryViz.js``, the script the HTML of
``torch.cuda._memory_viz.trace_plot`` / ``segment_plot`` loads in a browser. That script never
runs here, so this module follows it in Python:

* ``viz_series`` / ``viz_peak``: the totals of its "Active Memory Timeline" and "Active Cached
  Segment Timeline" (``process_alloc_data``, after ``annotate_snapshot``);
* ``check_viewer_state``: its "Allocator State History" walk (``simulate_memory``), and what in
  a trace would break it;
* ``viewer_unreadable_opcodes``: pickle opcodes its own ``unpickle`` cannot read;
* ``memory_viz_bytes``: the bytes ``torch.cuda._memory_viz.memory()`` lists, added up;
* ``ViewerHTML``: the viewer's HTML for a notebook, with a plain statement that it loads its
  script from a CDN (so it needs the browser online) and the file to download.
"""
from __future__ import annotations

import html
import pickle
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from gpulab.tables import STYLE
from gpulab.units import format_bytes

__all__ = [
    "OFFLINE_NOTICE", "VIEWER_OPCODES", "VIEWER_URL", "ViewerHTML", "blocks_at",
    "check_viewer_state", "device_trace", "memory_viz_bytes", "viewer_unreadable_opcodes",
    "viz_peak", "viz_series"
]

VIEWER_URL = "https://pytorch.org/memory_viz"
# the pickle opcodes MemoryViz.js's ``unpickle`` understands (its switch statement): a file the
# viewer opens must use no other
VIEWER_OPCODES = frozenset({
    "PROTO", "APPEND", "APPENDS", "LIST", "TUPLE", "NEWFALSE", "NEWTRUE", "NONE", "BINGET",
    "BININT", "BININT1", "BININT2", "EMPTY_DICT", "EMPTY_LIST", "FRAME", "LONG1", "LONG_BINGET",
    "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "SETITEMS", "SETITEM", "DICT",
    "SHORT_BINUNICODE", "BINUNICODE", "STOP", "EMPTY_TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
    "BINFLOAT"})


# ---- reading the format as the viewer reads it --------------------------------------------------

def device_trace(data: dict[str, Any], device: int) -> list[dict[str, Any]]:
    """``data["device_traces"][device]``; empty when the file has no trace for that device."""
    traces = data["device_traces"]
    return traces[device] if device < len(traces) else []


def blocks_at(segment: dict[str, Any]) -> Iterator[tuple[int, dict[str, Any]]]:
    """A segment's blocks with their addresses: the segment's, plus the sizes of the blocks before
    (MemoryViz.js ``annotate_snapshot``; the file does not store a block's address)."""
    addr = segment["address"]
    for b in segment["blocks"]:
        yield addr, b
        addr += b["size"]


def _annotated(trace: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """MemoryViz.js ``annotate_snapshot``: a 'free_requested' directly followed by the
    'free_completed' of the same address becomes one 'free'."""
    out: list[dict[str, Any]] = []
    for t in trace:
        if (t.get("action") == "free_completed" and out and out[-1].get("action") == "free_requested"
                and out[-1].get("addr") == t.get("addr")):
            out[-1] = dict(out[-1], action="free")
            continue
        out.append(t)
    return out


# ---- what the viewer computes -------------------------------------------------------------------

def viz_series(data: dict[str, Any], device: int = 0, segments: bool = False) -> list[int]:
    """The total that MemoryViz.js's ``process_alloc_data`` plots after each action (its
    ``max_size`` is the largest): blocks still live at the end and never allocated in the trace
    (and frees of blocks allocated before it) count from the start."""
    trace = _annotated(device_trace(data, device))
    alloc = "segment_alloc" if segments else "alloc"
    frees = ("segment_free",) if segments else ("free", "free_completed")
    elements: list[int] = []            # sizes
    initially: list[int] = []
    actions: list[int] = []
    addr_to_alloc: dict[int, int] = {}
    for e in trace:
        a = e.get("action")
        if a == alloc:
            elements.append(int(e["size"]))
            addr_to_alloc[e["addr"]] = len(elements) - 1
            actions.append(len(elements) - 1)
        elif a in frees:
            if e["addr"] in addr_to_alloc:
                actions.append(addr_to_alloc.pop(e["addr"]))
            else:
                elements.append(int(e["size"]))
                initially.append(len(elements) - 1)
                actions.append(len(elements) - 1)
    for seg in data["segments"]:
        if seg.get("device") != device:
            continue
        if segments:
            if seg["address"] not in addr_to_alloc:
                elements.append(int(seg["total_size"]))
                initially.append(len(elements) - 1)
        else:
            for addr, b in blocks_at(seg):
                if b["state"] == "active_allocated" and addr not in addr_to_alloc:
                    elements.append(int(b.get("requested_size", b["size"])))
                    initially.append(len(elements) - 1)
    initially.reverse()
    if not actions and initially:
        actions.append(initially.pop())
    current = set(initially)
    total = sum(elements[i] for i in initially)
    series = []
    for elem in actions:
        if elem in current:
            current.discard(elem)
            total -= elements[elem]
        else:
            current.add(elem)
            total += elements[elem]
        series.append(total)
    return series


def viz_peak(data: dict[str, Any], device: int = 0, segments: bool = False) -> int:
    """``max_size`` of MemoryViz.js's ``process_alloc_data``: the top of the viewer's "Active
    Memory Timeline" (``segments=True``: of its "Active Cached Segment Timeline")."""
    return max(viz_series(data, device, segments), default=0)


def check_viewer_state(data: dict[str, Any], device: int = 0) -> list[str]:
    """Walk the trace backwards from the final segments as MemoryViz.js's ``simulate_memory``
    (the "Allocator State History" view) does; return what would break it: a
    'free_requested' whose block is not live (the viewer throws), a 'segment_alloc' whose
    segment is not there (the viewer removes the wrong one). Empty: consistent."""
    problems: list[str] = []
    mine = [s for s in data["segments"] if s.get("device") == device]
    segs = {s["address"] for s in mine}
    blocks = {addr for s in mine for addr, b in blocks_at(s)
              if b["state"] in ("active_allocated", "active_pending_free")}
    trace = _annotated(device_trace(data, device))
    for i in range(len(trace) - 1, -1, -1):
        e, a = trace[i], trace[i].get("action")
        if a in ("free", "free_completed"):
            blocks.add(e["addr"])
        elif a == "free_requested":
            if e["addr"] not in blocks:
                problems.append(f"entry {i}: free_requested of {e['addr']:#x}, not live then")
        elif a == "alloc":
            blocks.discard(e["addr"])
        elif a == "segment_free":
            segs.add(e["addr"])
        elif a == "segment_alloc":
            if e["addr"] not in segs:
                problems.append(f"entry {i}: segment_alloc of {e['addr']:#x}, not in the segments then")
            segs.discard(e["addr"])
    return problems


def viewer_unreadable_opcodes(data: dict[str, Any]) -> list[str]:
    """Pickle opcodes in ``pickle.dumps(data)`` (what ``_memory_viz._format_viz`` embeds) that
    MemoryViz.js's ``unpickle`` cannot read; empty when the viewer can read the file."""
    import pickletools
    return sorted({op.name for op, _, _ in pickletools.genops(pickle.dumps(data))} - VIEWER_OPCODES)


def memory_viz_bytes(data: dict[str, Any]) -> dict[str, int]:
    """What ``torch.cuda._memory_viz.memory(data)`` says is in the segments, added up from its
    flamegraph lines (made without downloading flamegraph.pl): ``requested`` (bytes the live
    allocations asked for), ``allocated`` (their blocks, rounding gaps included) and
    ``reserved`` (every block, free ones too)."""
    from torch.cuda import _memory_viz
    out = {"requested": 0, "allocated": 0, "reserved": 0}
    for line in _memory_viz.memory(data, format_flamegraph=lambda lines: lines).splitlines():
        stack, _, size = line.rpartition(" ")
        if not stack:
            continue
        n = int(size)
        state = stack.split(";")[1] if ";" in stack else ""
        out["reserved"] += n
        if state == "active_allocated":
            out["allocated"] += n
            if not stack.endswith(";<gaps>"):
                out["requested"] += n
    return out


# ---- the viewer in a notebook ---------------------------------------------------------------------

OFFLINE_NOTICE = ("PyTorch's viewer is a web page: when your browser shows it, it loads MemoryViz.js "
                  "from cdn.jsdelivr.net (and d3 from cdn.skypack.dev). The torch wheel does not ship "
                  "that script, so this view needs the browser to be online. Offline, the frame below shows "
                  "only a red line saying so: use gpulab's own timeline instead, or download the file and "
                  f"drop it on {VIEWER_URL} later.")


@dataclass
class ViewerHTML:
    """PyTorch's viewer HTML (from ``torch.cuda._memory_viz``) in an isolated ``<iframe>``, a
    plain notice that it loads its script from a CDN (and a note that stays visible if that
    fails), and a download link for the snapshot file (an ``<a download>`` with the file inline)."""

    viz_html: str
    file_bytes: bytes
    filename: str
    label: str
    height: int = 520

    def download_link(self) -> str:
        import base64
        b64 = base64.b64encode(self.file_bytes).decode("ascii")
        return (f"<a download='{html.escape(self.filename)}' href='data:application/octet-stream;base64,{b64}'>"
                f"download {html.escape(self.filename)}</a> ({format_bytes(len(self.file_bytes))})")

    def _frame_doc(self) -> str:
        note = ("<div id='gpulab-offline' style='font:13px sans-serif;color:#a33'>Loading PyTorch's "
                "MemoryViz.js from cdn.jsdelivr.net… If this line stays, the browser is offline or blocks "
                "the CDN: see gpulab's timeline in the notebook.</div>")
        doc = self.viz_html.replace("<body>", "<body>" + note, 1)
        # the template's module script: remove the note once the import succeeded
        return doc.replace("add_local_files(local_files,",
                           "document.getElementById('gpulab-offline')?.remove();\nadd_local_files(local_files,", 1)

    def _repr_html_(self) -> str:
        src = html.escape(self._frame_doc(), quote=True)
        return (f"{STYLE}<div class='gpulab-viewer'><p class='gpulab-label'>{html.escape(OFFLINE_NOTICE)}</p>"
                f"<p>{self.download_link()} — then open <a href='{VIEWER_URL}' target='_blank'>{VIEWER_URL}</a> "
                f"and drop the file on it. <span class='gpulab-label'>{html.escape(self.label)}</span></p>"
                f"<iframe srcdoc=\"{src}\" sandbox='allow-scripts' style='width:100%;height:{self.height}px;"
                "border:1px solid #ccc'></iframe></div>")
