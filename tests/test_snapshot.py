"""PyTorch memory snapshots both ways (gpulab.interop.snapshot exports, gpulab.interop.snapshot_viewer follows the
viewer, gpulab.interop.snapshot_import reads back), tested against PyTorch's own code:
torch.cuda._memory_viz runs on every export, the pickle uses only the opcodes MemoryViz.js's
unpickler reads, and the peaks the viewer computes equal gpulab's, to the byte."""
from __future__ import annotations

import base64
import contextlib
import io
import json
import pickle
import pickletools
import re

import pytest
from torch.cuda import _memory_viz as mv

from conftest import ROOT
from gpulab.allocator.simulator import CachingAllocator, MiB
from gpulab.predict.step import step as tracked_step
from gpulab.predict.replay import fragmentation_events, replay_events
from gpulab.interop.snapshot import ACTIONS, BLOCK_STATES, export_tracking, record_events, unrounded
from gpulab.interop.snapshot_import import read_snapshot
from gpulab.interop.snapshot_viewer import check_viewer_state, memory_viz_bytes, viewer_unreadable_opcodes, viz_peak

FIXTURE = ROOT / "tests" / "data" / "snapshot_cnn_fake_step.pickle"

# the keys torch/csrc/cuda/memory_snapshot.cpp (_memory_snapshot_pickled) writes
SEGMENT_KEYS = {"device", "address", "total_size", "allocated_size", "active_size", "requested_size", "stream",
                "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks"}
BLOCK_KEYS = {"address", "size", "requested_size", "state", "frames"}
TRACE_KEYS = {"action", "addr", "size", "stream", "time_us", "frames"}


def _identity(lines: str) -> str:   # instead of flamegraph.pl (which _memory_viz would download)
    return lines


@pytest.fixture(scope="module")
def vgg_step():
    return tracked_step("vgg16", batch=8, optimizer="sgd", engine="fake", steps=1, guard=False)


@pytest.fixture(scope="module")
def vgg_export(vgg_step):
    return export_tracking(vgg_step.measurement.tracking, times="index")


@pytest.fixture(scope="module")
def cnn_tracking():
    return tracked_step("cnn", batch=4, optimizer="sgd", engine="fake", steps=2, guard=False).measurement.tracking


# ---- the format -----------------------------------------------------------------------------------

def test_export_has_the_keys_pytorch_writes(vgg_export):
    data = vgg_export.data
    assert set(data) >= {"segments", "device_traces", "allocator_settings"}
    assert data["segments"], "the step leaves its segments cached"
    for seg in data["segments"]:
        assert set(seg) == SEGMENT_KEYS
        assert seg["segment_type"] in ("small", "large") and seg["segment_pool_id"] == (0, 0)
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
        addr = seg["address"]
        for b in seg["blocks"]:
            assert set(b) == BLOCK_KEYS and b["state"] in BLOCK_STATES
            assert b["address"] == addr
            addr += b["size"]
    trace = data["device_traces"][0]
    assert {e["action"] for e in trace} <= set(ACTIONS)
    assert {"alloc", "free_requested", "free_completed", "segment_alloc"} <= {e["action"] for e in trace}
    for e in trace:
        assert TRACE_KEYS <= set(e), e
        assert all(set(f) == {"filename", "line", "name"} for f in e["frames"])


def test_alloc_entries_carry_requested_bytes_and_categories(vgg_step, vgg_export):
    """alloc_found_block records orig_size, the bytes asked for (not the rounded block)."""
    tr = vgg_step.measurement.tracking
    allocs = [e for e in vgg_export.trace if e["action"] == "alloc"]
    assert [e["size"] for e in allocs] == [ev.nbytes for ev in tr.events if ev.kind == "alloc"]
    assert {e["category"] for e in allocs} <= {c.value for c in tr.records[0].category.__class__}
    assert any(e["frames"] and e["frames"][0]["name"].startswith("convolution") for e in allocs)


def test_memory_viz_accepts_the_export(vgg_export):
    data = vgg_export.data
    for html in (mv.trace_plot(data), mv.trace_plot(data, plot_segments=True), mv.segment_plot(data)):
        assert html.lstrip().startswith("<!DOCTYPE html>") and "MemoryViz.js" in html
        embedded = json.loads(re.search(r"const local_files = (.*)\n", html).group(1))[0]["base64"]
        assert pickle.loads(base64.b64decode(embedded)) == data   # what the viewer receives
    memory = mv.memory(data, format_flamegraph=_identity)
    segments = mv.segments(data, format_flamegraph=_identity)
    assert memory and segments
    for line in memory.splitlines() + segments.splitlines():
        stack, _, size = line.rpartition(" ")
        assert stack.startswith("stream_0") and int(size) >= 0
    summary = mv.segsum(data)                 # asserts its own accounting
    assert f"segments: {len(data['segments'])}" in summary
    trace = mv.trace(data)
    assert trace.startswith("Device 0") and f"{len(vgg_export.trace)} entries" in trace
    # _memory_viz.trace prints entries it has no case for as dicts: only the closing 'snapshot' entry
    # (which torch's own snapshot() records too)
    unknown = [ln for ln in trace.splitlines() if ln.startswith("{")]
    assert len(unknown) == 1 and "'action': 'snapshot'" in unknown[0]
    assert vgg_export.trace[-1]["action"] == "snapshot" and vgg_export.trace[-1]["size"] == sum(
        s["active_size"] for s in data["segments"])
    with contextlib.redirect_stdout(io.StringIO()):
        assert isinstance(mv.compare(data["segments"], data["segments"][:1], format_flamegraph=_identity), str)


def test_the_viewer_can_read_the_pickle(vgg_export):
    """MemoryViz.js unpickles the file itself (protocol 2-4, a fixed set of opcodes) and walks the
    trace backwards from the final segments (Allocator State History)."""
    data = vgg_export.data
    assert viewer_unreadable_opcodes(data) == []
    proto = next(arg for op, arg, _ in pickletools.genops(pickle.dumps(data)) if op.name == "PROTO")
    assert 2 <= proto <= 4
    assert check_viewer_state(data) == []
    # annotate_snapshot pushes 'unknown' onto a misspelt list when categories lack it: keep it in
    cats = [e["category"] for e in vgg_export.trace if "category" in e]
    assert "unknown" in cats


def test_viewer_peak_equals_gpulab_peak_to_the_byte(vgg_step, vgg_export):
    tr = vgg_step.measurement.tracking
    requested = unrounded(tr)
    assert vgg_export.viz_peak() == requested.peak_bytes
    # torch's own _memory_viz.memory() on the snapshot taken at that moment: the same bytes
    at_peak = export_tracking(tr, times="index", at="peak")
    got = memory_viz_bytes(at_peak.data)
    assert got["requested"] == requested.peak_bytes
    assert "total_allocated" in mv.segsum(at_peak.data)
    # the cached-segment timeline's top is the simulated reserved peak; the blocks, the simulated allocated
    assert vgg_export.viz_peak(segments=True) == vgg_export.peak_reserved
    lesson09 = replay_events(tr.events)                  # the simulator as lesson 09 replays it
    assert vgg_export.peak_reserved == lesson09.peak_reserved
    assert vgg_export.peak_allocated == lesson09.peak_allocated
    assert got["allocated"] == CachingAllocator().replay(tr.events[: requested.peak_index + 1]).allocated[-1]
    assert tr.peak_bytes >= requested.peak_bytes          # 512-rounding only adds


def test_export_to_a_file_and_read_back(tmp_path, cnn_tracking):
    path = tmp_path / "sub" / "step.pickle"
    snap = export_tracking(cnn_tracking, path)
    assert path.is_file() and pickle.loads(path.read_bytes()) == snap.data
    imp = read_snapshot(path)
    assert not imp.from_gpu and "not recorded on a GPU" in imp.label


def test_round_trip_export_import(cnn_tracking):
    snap = export_tracking(cnn_tracking, times="index")
    imp = read_snapshot(snap.pickle_bytes())
    # 0-byte storages never reach the allocator (PyTorch's allocate() hands out a null pointer
    # without calling malloc), so they have no trace entry
    empty = {sid for sid, r in cnn_tracking.records.items() if r.nbytes == 0}
    assert empty, "the step makes some empty tensors"
    kept = [e for e in cnn_tracking.events if e.sid not in empty]
    want = type(cnn_tracking).build(cnn_tracking.records, kept, cnn_tracking.device, rounded=False)
    got = imp.tracking()
    assert got is not None
    assert [(e.kind, e.nbytes) for e in got.events] == [(e.kind, e.nbytes) for e in want.events]
    assert [got.records[e.sid].category for e in got.events] == [want.records[e.sid].category for e in want.events]
    assert [(e.phase, e.module) for e in got.events] == [(e.phase, e.module) for e in want.events]
    assert got.series == want.series and got.peak_bytes == want.peak_bytes == unrounded(cnn_tracking).peak_bytes
    assert got.peak_by_category == want.peak_by_category
    assert imp.peak_active == want.peak_bytes == snap.viz_peak()
    assert imp.peak_reserved == snap.peak_reserved
    # the file's trace replayed through the simulator: the same segments, one by one
    rep = imp.replay()
    assert rep.stats["reserved_bytes.all.peak"] == imp.peak_reserved
    assert rep.stats["requested_bytes.all.peak"] == imp.peak_active
    assert all(r is not None and s is not None and r.size == s.size and r.allocated_bytes == s.allocated_bytes
               for r, s in rep.segment_pairs)
    assert all(row[-1] == "0 B" for row in rep.segment_rows())
    assert "simulated allocator" in rep._repr_html_()


def test_the_shipped_snapshot(tmp_path):
    """tests/data/snapshot_cnn_fake_step.pickle (made by tests/make_snapshot_fixture.py on the CPU)."""
    imp = read_snapshot(FIXTURE)
    assert not imp.from_gpu and imp.data["gpulab"]["not_a_gpu_recording"] is True
    assert "not recorded on a GPU" in imp.label
    assert imp.events and imp.peak_active > 0 and imp.peak_reserved >= imp.peak_active
    assert imp.tracking() is not None
    rep = imp.replay()
    assert rep.stats["reserved_bytes.all.peak"] == imp.peak_reserved
    assert [r.size for r, _ in rep.segment_pairs] == [s.size for _, s in rep.segment_pairs]
    fig = imp.timeline()
    assert fig.axes and "snapshot" in fig.axes[0].get_title()
    assert mv.segsum(imp.data) and check_viewer_state(imp.data) == []
    # a fresh export made the same way reads back the same way
    from gpulab.course.pytorch_tools import make_example_snapshot
    fresh = read_snapshot(make_example_snapshot().save(tmp_path / "fresh.pickle"))
    assert fresh.replay().stats["reserved_bytes.all.peak"] == fresh.peak_reserved


def test_import_of_a_trace_that_started_late(vgg_step):
    """A ring buffer that wrapped: the trace begins mid-run, so frees of blocks it never saw
    allocated, and blocks live at the end with no alloc, count from the start (as MemoryViz does)."""
    tr = vgg_step.measurement.tracking
    snap = export_tracking(tr, times="index", at="peak")
    data = pickle.loads(snap.pickle_bytes())
    trace = data["device_traces"][0]
    cut = len(trace) // 2
    while trace[cut]["action"] == "free_completed":  # do not split a free_requested/free_completed pair
        cut += 1
    data["device_traces"][0] = trace[cut:]
    imp = read_snapshot(data)
    before = [e for e in imp.events if e["index"] < 0]
    assert before, "blocks live before the trace began"
    live_end = sum(b["requested_size"] for s in data["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
    assert imp.recorded.allocated[-1] == live_end
    assert imp.peak_active == viz_peak(data) == unrounded(tr).peak_bytes
    assert imp.recorded.reserved[-1] == sum(s["total_size"] for s in data["segments"])
    rep = imp.replay()
    assert rep.stats["requested_bytes.all.current"] == live_end


def test_expandable_segments_export(cnn_tracking):
    snap = export_tracking(cnn_tracking, times="index", expandable_segments=True)
    actions = {e["action"] for e in snap.trace}
    assert "segment_map" in actions and "segment_alloc" not in actions
    assert snap.data["allocator_settings"]["expandable_segments"] is True
    assert all(s["is_expandable"] for s in snap.data["segments"])
    assert snap.viz_peak() == unrounded(cnn_tracking).peak_bytes
    assert mv.segsum(snap.data) and mv.trace_plot(snap.data)
    imp = read_snapshot(snap.data)
    assert imp.peak_reserved == snap.peak_reserved
    assert imp.replay(expandable_segments=True).stats["reserved_bytes.all.peak"] == snap.peak_reserved


def test_empty_cache_and_oom_entries():
    ev = [{"kind": "alloc", "sid": 0, "nbytes": 30 * MiB}, {"kind": "alloc", "sid": 1, "nbytes": 30 * MiB},
          {"kind": "free", "sid": 0}, {"kind": "alloc", "sid": 2, "nbytes": 40 * MiB}]
    flush = [2]
    snap = record_events(ev, empty_cache_at=flush)
    frees = [e for e in snap.trace if e["action"] == "segment_free"]
    assert [e["size"] for e in frees] == [30 * MiB]
    assert snap.peak_reserved == replay_events(ev, empty_cache_at=flush).peak_reserved == 70 * MiB
    assert viz_peak(snap.data, segments=True) == snap.peak_reserved
    assert check_viewer_state(snap.data) == []
    ev = fragmentation_events()
    tight = record_events(ev, capacity_bytes=60 * MiB)
    ooms = [e for e in tight.trace if e["action"] == "oom"]
    assert tight.ooms == len(ooms) > 0
    assert all("addr" not in e and e["device_free"] >= 0 and e["size"] == 12 * MiB for e in ooms)
    assert "raise OutOfMemoryError" in mv.trace(tight.data)


def test_viewer_html_states_the_cdn_and_offers_the_file(vgg_export):
    v = vgg_export.viewer(filename="vgg.pickle")
    page = v._repr_html_()
    assert "cdn.jsdelivr.net" in page and "online" in page and "pytorch.org/memory_viz" in page
    assert "<iframe srcdoc=" in page and "sandbox='allow-scripts'" in page
    link = re.search(r"href='data:application/octet-stream;base64,([^']+)'", page).group(1)
    assert base64.b64decode(link) == vgg_export.pickle_bytes()
    doc = v._frame_doc()
    assert "gpulab-offline" in doc and "getElementById('gpulab-offline')?.remove()" in doc
    with pytest.raises(ValueError, match="unknown kind"):
        vgg_export.viewer("3d")


# ---- reading files: bad input --------------------------------------------------------------------------

class _Evil:
    def __reduce__(self):
        import os
        return (os.system, ("echo pwned > /dev/null",))


@pytest.mark.parametrize("bad, words", [
    (b"", "not a memory snapshot pickle"),
    (b"not a pickle at all", "not a memory snapshot pickle"),
    (pickle.dumps(_Evil()), "does not run it"),
    (pickle.dumps({"device_traces": []}), "no 'segments'"),
    (pickle.dumps({"segments": [{"address": 0}]}), "lacks address/total_size/blocks"),
    (pickle.dumps({"segments": [], "device_traces": [[{"addr": 1}]]}), "has no 'action'"),
    (pickle.dumps(42), "no 'segments'"),
    (pickle.dumps({"segments": 3}), "must be lists"),
    (pickle.dumps({"segments": [], "device_traces": [5]}), "has no 'action'"),
])
def test_bad_files_are_refused_with_a_reason(bad, words):
    with pytest.raises(ValueError, match=re.escape(words)) as err:
        read_snapshot(bad)
    assert "_dump_snapshot" in str(err.value)


def test_a_missing_file_and_an_empty_snapshot(tmp_path):
    with pytest.raises(ValueError, match="no snapshot file"):
        read_snapshot(tmp_path / "nope.pickle")
    with pytest.raises(ValueError, match="empty"):
        read_snapshot({"segments": [], "device_traces": [[]]})


def test_reading_a_dict_leaves_it_as_it_was(cnn_tracking):
    data = export_tracking(cnn_tracking, at="peak").data
    for seg in data["segments"]:
        del seg["device"], seg["stream"]
    before = pickle.dumps(data)
    imp = read_snapshot(data)
    assert pickle.dumps(data) == before
    assert all(s["device"] == 0 and s["stream"] == 0 for s in imp.data["segments"])


def test_a_segments_only_list_reads_like_memory_viz_reads_it(cnn_tracking):
    """torch.cuda.memory_snapshot() returns the segments only; _memory_viz's _read wraps such a list."""
    snap = export_tracking(cnn_tracking, at="peak")
    imp = read_snapshot(snap.data["segments"])
    assert imp.events and all(e["index"] == -1 for e in imp.events)
    assert imp.recorded.allocated == []
    assert imp.replay().stats["requested_bytes.all.current"] == snap.viz_peak()


# ---- %%memtrack --snapshot ----------------------------------------------------------------------------

def test_memtrack_snapshot_flag(tmp_path):
    from IPython.core.interactiveshell import InteractiveShell
    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "gpulab.magic")
    sh.run_cell("import torch")
    sh.user_ns["snap_path"] = str(tmp_path / "cell.pickle")
    res = sh.run_cell("%%memtrack --engine cpu -o rep --snapshot {snap_path}\n"
                      "a = torch.zeros(1000)\nb = torch.ones(25, dtype=torch.int64)\ndel a\n")
    assert res.success, res.error_in_exec
    rep = sh.user_ns["rep"]
    imp = read_snapshot(tmp_path / "cell.pickle")
    assert imp.peak_active == rep.peak_bytes == 4200
    allocs = [e for e in imp.data["device_traces"][0] if e["action"] == "alloc"]
    assert [e["size"] for e in allocs] == [4000, 200]
    assert allocs[0]["frames"][-1]["filename"] == "cell" and allocs[0]["frames"][-1]["line"] == 1
    assert sh.user_ns["_memtrack_snapshot"].viz_peak() == 4200
    assert viewer_unreadable_opcodes(imp.data) == []
