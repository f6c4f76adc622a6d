"""A snapshot's replay with what the file records (issue 25): its allocator settings, one pool per
stream, its release bursts, its start state. Checked on snapshots recorded on an NVIDIA H200
(tests/data/h200), on traces written here, and on traces the simulator itself recorded."""
import copy
import pickle
import random

import pytest

from gpulab.interop.snapshot import record_events
from gpulab.interop.snapshot_import import allocator_kwargs, read_snapshot

H200 = "tests/data/h200/"
MiB = 1 << 20


def _totals(rep):
    return [(row[1], row[2]) for row in rep.total_rows()]


@pytest.mark.parametrize("name", ["allocator_default", "allocator_expandable"])
def test_h200_files_with_two_streams_replay_to_the_same_reserved_bytes_and_segments(name):
    imp = read_snapshot(H200 + name + ".pickle")
    assert imp.from_gpu and imp.streams == 2
    rep = imp.replay()
    for recorded, simulated in _totals(rep):
        assert recorded == simulated, _totals(rep)
    assert sorted(s.size for s in imp.segments) == sorted(s.size for s in rep.segments)


def test_the_files_own_settings_are_the_default_and_matter():
    imp = read_snapshot(H200 + "allocator_expandable.pickle")
    assert imp.settings == {"expandable_segments": True} and imp.unmodelled_settings == []
    assert "expandable_segments=True" in imp.replay().label
    plain = imp.replay(expandable_segments=False)      # the caller's word wins, and is worse here
    assert plain.stats["reserved_bytes.all.peak"] > imp.peak_reserved


def test_one_pool_per_stream_is_what_makes_the_segments_match():
    imp = read_snapshot(H200 + "allocator_default.pickle")
    one = copy.copy(imp)
    one.events = [dict(e, stream=0) for e in imp.events]
    merged = one.replay()
    assert len(merged.segments) < len(imp.segments) == len(imp.replay().segments)


def test_settings_the_simulator_does_not_model_are_named():
    data = pickle.load(open(H200 + "allocator_default.pickle", "rb"))
    settings = dict(data["allocator_settings"], garbage_collection_threshold=0.6,
                    roundup_power2_divisions={"1": 4}, max_split_size=256 * MiB)
    kwargs, missing = allocator_kwargs(settings)
    assert kwargs == {"max_split_size_mb": 256}
    assert missing == ["roundup_power2_divisions", "garbage_collection_threshold"]
    data["allocator_settings"] = settings
    html = read_snapshot(data).replay()._repr_html_()
    assert "does not model: roundup_power2_divisions, garbage_collection_threshold" in html


def _trace_with_empty_cache():
    """A 12 MiB request (its own 12 MiB segment: 10 MiB or more is rounded to 2 MiB) and an 8 MiB
    one (a 20 MiB segment); the first freed and empty_cache() called (a segment_free), then a
    4 MiB request that fits the second segment."""
    a, b = 0x7f0000000000, 0x7f0002000000
    seg = 20 * MiB
    trace = [
        {"action": "segment_alloc", "addr": a, "size": 12 * MiB, "stream": 0},
        {"action": "alloc", "addr": a, "size": 12 * MiB, "stream": 0},
        {"action": "segment_alloc", "addr": b, "size": seg, "stream": 0},
        {"action": "alloc", "addr": b, "size": 8 * MiB, "stream": 0},
        {"action": "free_requested", "addr": a, "size": 12 * MiB, "stream": 0},
        {"action": "free_completed", "addr": a, "size": 12 * MiB, "stream": 0},
        {"action": "segment_free", "addr": a, "size": 12 * MiB, "stream": 0},
        {"action": "alloc", "addr": b + 8 * MiB, "size": 4 * MiB, "stream": 0},
    ]
    blocks = [{"address": b, "size": 8 * MiB, "requested_size": 8 * MiB, "state": "active_allocated"},
              {"address": b + 8 * MiB, "size": 4 * MiB, "requested_size": 4 * MiB, "state": "active_allocated"},
              {"address": b + 12 * MiB, "size": 8 * MiB, "requested_size": 0, "state": "inactive"}]
    segments = [{"device": 0, "address": b, "total_size": seg, "stream": 0, "segment_type": "large",
                 "allocated_size": 12 * MiB, "active_size": 12 * MiB, "requested_size": 12 * MiB, "blocks": blocks}]
    return {"segments": segments, "device_traces": [trace]}


def test_a_release_burst_is_replayed_where_it_happened():
    imp = read_snapshot(_trace_with_empty_cache())
    assert imp.releases == [3]            # after alloc, alloc, free: then the burst, then the last alloc
    rep = imp.replay()
    for recorded, simulated in _totals(rep):
        assert recorded == simulated, _totals(rep)
    assert [s.size for s in rep.segments] == [20 * MiB]
    kept = copy.copy(imp)
    kept.releases = []                    # without the release the first segment stays cached
    assert sum(s.size for s in kept.replay().segments) == 32 * MiB


@pytest.mark.parametrize("name", ["allocator_default", "allocator_expandable"])
def test_an_oom_entry_gives_the_capacity_and_the_simulator_refuses_the_same_request(name):
    imp = read_snapshot(H200 + name + ".pickle")
    (oom,) = [e for e in imp.data["device_traces"][0] if e["action"] == "oom"]
    at = imp.data["device_traces"][0].index(oom)
    assert imp.ooms == 1 and imp.capacity == imp.recorded.reserved[at] + oom["device_free"]
    rep = imp.replay()
    assert rep.simulated_ooms == 1 and f"capacity_bytes={imp.capacity}" in rep.label
    assert ["out-of-memory errors", "1", "1", "+0"] in rep.total_rows()
    assert imp.replay(capacity_bytes=None).simulated_ooms == 0     # without it, the card has no end


def test_the_default_device_is_one_with_segments():
    data = pickle.load(open(H200 + "step_cnn_b32_sgd.pickle", "rb"))
    noise = [dict(e) for e in data["device_traces"][0]] * 2   # a longer trace on a device with no segments
    data = dict(data, device_traces=[data["device_traces"][0], noise])
    assert read_snapshot(data).device == 0


def _layout(segments):
    """Segments block for block: (segment address, ((block address, size, allocated), ...))."""
    return sorted((s.address, tuple((b.addr, b.size, b.allocated) for b in s.blocks)) for s in segments)


def _reserved_after_each_entry_agrees(imp, rep):
    return all(rep.simulated.reserved[k] == imp.recorded.reserved[e["index"]]
               for k, e in enumerate(imp.events) if e["index"] >= 0)


# recorded on the H200 (summary.json, the files' final segments): segments, reserved bytes at the end
H200_STEPS = {"step_cnn_b32_sgd": (7, 110 * MiB), "step_alexnet_b1_sgd": (13, 578 * MiB),
              "step_vgg16_b1_sgd": (19, 1288 * MiB)}


@pytest.mark.parametrize("name", sorted(H200_STEPS))
def test_a_mid_run_h200_step_replays_exactly_from_its_rebuilt_start(name):
    """History recorded for one step after a warm-up: every segment existed before the first entry.
    From the rebuilt start the simulator puts every allocation where the H200's allocator did and
    ends with its segments block for block; from an empty allocator it does not."""
    imp = read_snapshot(H200 + name + ".pickle")
    segments, reserved = H200_STEPS[name]
    assert imp.mid_run and len(imp.start_segments) == segments == len(imp.segments)
    assert sum(s.size for s in imp.segments) == reserved
    rep = imp.replay()
    assert rep.rebuilt_start and len(rep.segments) == segments
    assert sum(s.size for s in rep.segments) == reserved
    assert rep.stats["reserved_bytes.all.peak"] == imp.peak_reserved == reserved
    assert rep.stats["requested_bytes.all.peak"] == imp.peak_active
    assert _layout(rep.segments) == _layout(imp.segments)
    assert _reserved_after_each_entry_agrees(imp, rep)
    placed, allocs = rep.same_address
    assert placed == allocs == sum(1 for e in imp.data["device_traces"][0] if e["action"] == "alloc")
    for real, sim in rep.segment_pairs:
        assert real.address == sim.address and real.size == sim.size
    empty = imp.replay(rebuild_start=False)       # the same trace from an empty allocator
    assert not empty.rebuilt_start and empty.same_address is None
    assert _layout(empty.segments) != _layout(imp.segments)
    assert not _reserved_after_each_entry_agrees(imp, empty)
    assert "rebuild_start=False" in empty._repr_html_() and "rebuilt from the file" in rep._repr_html_()


def test_vgg16s_start_from_empty_was_the_4_mib_and_8_segments_too_many():
    imp = read_snapshot(H200 + "step_vgg16_b1_sgd.pickle")
    empty = imp.replay(rebuild_start=False)
    assert len(empty.segments) == 27 and sum(s.size for s in empty.segments) == 1288 * MiB + 4 * MiB
    assert empty.stats["reserved_bytes.all.peak"] == imp.peak_reserved + 4 * MiB
    rep = imp.replay()
    assert ["segments at the end", "19", "19", "+0"] in rep.total_rows()
    assert ["allocations at the address the file records", "144", "144", "+0"] in rep.total_rows()


def test_the_rebuilt_start_is_the_files_segments_with_the_blocks_live_at_entry_0():
    imp = read_snapshot(H200 + "step_vgg16_b1_sgd.pickle")
    before = {e["sid"]: e for e in imp.events if e["index"] < 0}
    starts = {s.address: s for s in imp.start_segments}
    assert set(starts) == {s.address for s in imp.segments}
    placed = [b for s in imp.start_segments for b in s.blocks if b[2] is not None]
    assert sorted(sid for _, _, sid in placed) == sorted(before)
    assert all(addr == before[sid]["addr"] for addr, _, sid in placed)
    for seg in imp.start_segments:            # blocks tile each segment
        assert seg.blocks[0][0] == seg.address and sum(n for _, n, _ in seg.blocks) == seg.size
        assert all(a + n == b for (a, n, _), (b, _, _) in zip(seg.blocks, seg.blocks[1:]))
    # the start holds what the recorded timeline starts with: the live tensors' requested bytes
    assert sum(e["nbytes"] for e in before.values()) == imp.recorded.allocated[0] - (
        imp.events[len(before)]["nbytes"] if imp.events[len(before)]["kind"] == "alloc" else 0)


def _workload(seed, n=400):
    """Random allocations (small, 1-12 MiB, 12-60 MiB) and frees."""
    rng = random.Random(seed)
    live, events, sid = [], [], 0
    for _ in range(n):
        if live and rng.random() < 0.45:
            events.append({"kind": "free", "sid": live.pop(rng.randrange(len(live)))})
        else:
            nbytes = rng.choice([rng.randint(1, MiB), rng.randint(MiB, 12 * MiB), rng.randint(12 * MiB, 60 * MiB)])
            events.append({"kind": "alloc", "sid": sid, "nbytes": nbytes})
            live.append(sid)
            sid += 1
    return events


@pytest.mark.parametrize("settings", [{}, {"max_split_size_mb": 40}, {"capacity_bytes": 600 * MiB}],
                         ids=["defaults", "max_split_size_mb=40", "a 600 MiB card"])
@pytest.mark.parametrize("seed", range(8))
def test_a_trace_the_simulator_recorded_replays_exactly_from_any_entry(seed, settings):
    """The simulator records a trace (with two empty_cache() calls) and the state at its end; cut
    the trace anywhere and what is left is a mid-run file whose start must be rebuilt: blocks freed
    before they are allocated, segments released before they are made, blocks split off with an
    unsplit remainder. Its replay gives every address and the final layout back, block for block.
    With max_split_size_mb, a cudaMalloc that needs room first frees oversize cached blocks
    (release_available_cached_blocks): those releases are the very segments the file names. On a
    600 MiB card, out-of-memory entries give the capacity (a full card's device_free is 0), and
    the simulator's own retries and refusals happen where the recording's did."""
    snap = record_events(_workload(seed), empty_cache_at=[100, 250], **settings).data
    trace = snap["device_traces"][0]
    cuts = [0, 37, 150, 300, len(trace) // 2, len(trace) - 5]
    # NB: a cut between a segment_alloc and its alloc (inside one malloc) reads that segment as cached
    cuts = [c for c in cuts if not c or trace[c - 1]["action"] != "segment_alloc"]
    for cut in cuts:
        imp = read_snapshot(dict(snap, device_traces=[trace[cut:]]))
        assert imp.start_segments is not None, imp.start_problem
        rep = imp.replay()
        assert _layout(rep.segments) == _layout(imp.segments), cut
        assert rep.same_address[0] == rep.same_address[1], cut
        assert _reserved_after_each_entry_agrees(imp, rep), cut
        assert rep.stats["reserved_bytes.all.peak"] == imp.peak_reserved, cut
        assert rep.simulated_ooms == imp.ooms, cut
        if imp.ooms:
            assert imp.capacity == settings["capacity_bytes"]
        if cut and imp.mid_run:
            assert _layout(imp.replay(rebuild_start=False).segments) != _layout(imp.segments) or not any(
                e["index"] < 0 for e in imp.events)


def test_a_start_block_whose_size_the_file_does_not_give_is_widened_until_the_replay_agrees(monkeypatch):
    """A block live at the start and freed in the trace, with free room of more than 1 MiB after it
    and nothing allocated there: the file does not say whether it kept an unsplit remainder. When
    the replay puts a request in that room and the GPU's allocator did not, the room was smaller:
    the block is widened and the trace replayed again, until every address agrees."""
    import gpulab.interop.snapshot_import as S

    snap = record_events(_workload(0, 8000), empty_cache_at=[2000, 5000]).data
    trace = snap["device_traces"][0]
    imp = read_snapshot(dict(snap, device_traces=[trace[len(trace) // 2:]]))
    assert any(seg.guessed for seg in imp.start_segments)
    rep = imp.replay()
    assert rep.start_refinements >= 1 and rep.same_address[0] == rep.same_address[1]
    assert _layout(rep.segments) == _layout(imp.segments)
    monkeypatch.setattr(S, "_MAX_REFINEMENTS", 0)       # the first guess alone
    first = imp.replay()
    assert first.start_refinements == 0 and first.same_address[0] < first.same_address[1]


def test_a_trace_that_begins_with_a_release_peaks_before_its_first_entry():
    """The empty_cache() trace above, from its segment_free on: 32 MiB were reserved before the
    first entry (the 12 MiB segment it releases and the 20 MiB one), 20 MiB after. That start is
    the peak, in the file's figures and in the replay's, which releases the segment the file names."""
    data = _trace_with_empty_cache()
    data["device_traces"] = [data["device_traces"][0][6:]]
    imp = read_snapshot(data)
    assert imp.start_reserved == imp.peak_reserved == 32 * MiB and max(imp.recorded.reserved) == 20 * MiB
    assert sorted(s.size for s in imp.start_segments) == [12 * MiB, 20 * MiB]
    rep = imp.replay()
    assert rep.stats["reserved_bytes.all.peak"] == 32 * MiB and rep.same_address == (1, 1)
    assert _layout(rep.segments) == _layout(imp.segments)


@pytest.mark.parametrize("seed", range(4))
def test_an_expandable_segments_trace_the_simulator_recorded_replays_exactly_from_any_entry(seed):
    """With expandable segments the start is the pages mapped then (the final ones walked back
    through segment_map / segment_unmap), in virtual ranges that begin at the lowest address the
    file shows; new ranges begin where the trace maps them."""
    snap = record_events(_workload(seed), empty_cache_at=[100, 250], expandable_segments=True).data
    trace = snap["device_traces"][0]
    for cut in range(0, len(trace), 25):
        if cut and trace[cut - 1]["action"] == "segment_map":
            continue          # NB: inside one malloc
        imp = read_snapshot(dict(snap, device_traces=[trace[cut:]]))
        assert imp.start_segments is not None, imp.start_problem
        rep = imp.replay()
        assert rep.rebuilt_start and rep.same_address[0] == rep.same_address[1], cut
        assert _layout(rep.segments) == _layout(imp.segments), cut
        assert _reserved_after_each_entry_agrees(imp, rep), cut


@pytest.mark.parametrize("name", ["allocator_default", "allocator_expandable"])
def test_the_h200_allocator_files_cut_at_any_entry_replay_exactly(name):
    """The H200 files with two streams, an empty_cache() and an out-of-memory request, with and
    without expandable segments, made mid-run by dropping the first entries: each replays to the
    GPU's addresses, segments and reserved bytes."""
    data = pickle.load(open(H200 + name + ".pickle", "rb"))
    trace = data["device_traces"][0]
    for cut in range(len(trace)):
        if cut and trace[cut - 1]["action"] in ("segment_alloc", "segment_map"):
            continue          # NB: inside one malloc
        imp = read_snapshot(dict(data, device_traces=[trace[cut:]]))
        rep = imp.replay()
        assert rep.rebuilt_start and rep.same_address[0] == rep.same_address[1], cut
        assert _layout(rep.segments) == _layout(imp.segments), cut
        assert rep.stats["reserved_bytes.all.peak"] == imp.peak_reserved, cut


def test_a_start_that_cannot_be_rebuilt_says_so():
    """Expandable and fixed segments in one file: that start is not modelled, and the replay says
    it began from an empty allocator."""
    data = pickle.load(open(H200 + "allocator_expandable.pickle", "rb"))
    trace = data["device_traces"][0]
    fixed = pickle.load(open(H200 + "step_cnn_b32_sgd.pickle", "rb"))["segments"][0]
    imp = read_snapshot(dict(data, device_traces=[trace[30:]], segments=data["segments"] + [fixed]))
    assert imp.mid_run and imp.start_segments is None and "expandable and fixed" in imp.start_problem
    assert "not rebuilt (expandable and fixed" in imp.start_text()
    rep = imp.replay()
    assert not rep.rebuilt_start and rep.same_address is None
    # a card too small for the start (a capacity given by hand): the replay says why it began empty
    small = read_snapshot(H200 + "step_vgg16_b1_sgd.pickle").replay(capacity_bytes=100 * MiB)
    assert not small.rebuilt_start and "exceed the capacity" in small.start_refused
    assert "the simulator refused the rebuilt start" in small._repr_html_()


def test_an_oom_request_is_put_to_its_own_streams_pool():
    """Stream 0 has a free 16 MiB block inside a segment that still holds a tensor (so no release
    frees it); a 16 MiB request on stream 1 needs a new segment, which the card has no room for.
    The GPU refused it (an oom entry on stream 1); so must the simulator, on stream 1: on stream 0
    the cached block would have served it."""
    s1 = 0x51
    a = 0x7f0000000000
    trace = [
        {"action": "segment_alloc", "addr": a, "size": 20 * MiB, "stream": 0},
        {"action": "alloc", "addr": a, "size": 4 * MiB, "stream": 0},
        {"action": "alloc", "addr": a + 4 * MiB, "size": 16 * MiB, "stream": 0},
        {"action": "free_requested", "addr": a + 4 * MiB, "size": 16 * MiB, "stream": 0},
        {"action": "free_completed", "addr": a + 4 * MiB, "size": 16 * MiB, "stream": 0},
        {"action": "oom", "addr": 8 * MiB, "device_free": 8 * MiB, "size": 16 * MiB, "stream": s1},
    ]
    blocks = [{"address": a, "size": 4 * MiB, "requested_size": 4 * MiB, "state": "active_allocated"},
              {"address": a + 4 * MiB, "size": 16 * MiB, "requested_size": 0, "state": "inactive"}]
    segments = [{"device": 0, "address": a, "total_size": 20 * MiB, "stream": 0, "segment_type": "large",
                 "blocks": blocks}]
    imp = read_snapshot({"segments": segments, "device_traces": [trace]})
    assert imp.capacity == 28 * MiB and imp.oom_requests == [(3, 16 * MiB, s1)]
    assert imp.replay().simulated_ooms == 1
    on_default = copy.copy(imp)
    on_default.oom_requests = [(3, 16 * MiB, 0)]
    assert on_default.replay().simulated_ooms == 0


def test_a_mid_run_trace_says_so_and_what_existed_before_it():
    imp = read_snapshot(H200 + "step_vgg16_b1_sgd.pickle")     # history turned on after a warm-up step
    assert imp.mid_run
    before = [e for e in imp.events if e["index"] < 0]
    assert len(before) > 0 and f"{len(before)} blocks" in imp.start_text()
    assert "mid-run" in imp._repr_html_() and "mid-run" in imp.replay()._repr_html_()
    fresh = read_snapshot({"segments": [], "device_traces": [[
        {"action": "segment_alloc", "addr": 0x1000, "size": 2 * MiB, "stream": 0},
        {"action": "alloc", "addr": 0x1000, "size": 512, "stream": 0},
        {"action": "free_requested", "addr": 0x1000, "size": 512, "stream": 0},
        {"action": "free_completed", "addr": 0x1000, "size": 512, "stream": 0},
        {"action": "segment_free", "addr": 0x1000, "size": 2 * MiB, "stream": 0}]]})
    assert not fresh.mid_run and fresh.start_text() == "" and fresh.releases == [2]


def test_the_shipped_h200_snapshot_is_the_tests_file_labelled_with_its_provenance():
    """Lesson 13 replays gpulab/interop/data/step_vgg16_b1_sgd.pickle: a copy of the H200 file
    here, byte for byte, shipped as package data, labelled with where and when it was recorded."""
    import json
    import pathlib
    import tomllib

    from gpulab.interop.recorded_snapshots import DATA, StartComparison, read_recorded_snapshot, recorded_snapshots

    assert (DATA / "step_vgg16_b1_sgd.pickle").read_bytes() == pathlib.Path(H200 + "step_vgg16_b1_sgd.pickle").read_bytes()
    facts = recorded_snapshots()["step_vgg16_b1_sgd"]
    summary = json.loads(pathlib.Path(H200 + "summary.json").read_text())
    assert (facts["device"], facts["torch"]) == (summary["device"], summary["torch"])
    imp = read_recorded_snapshot()
    assert imp.from_gpu and imp.label.startswith("recorded on NVIDIA H200, 2026-11-26, torch 2.11.0+cu130")
    cmp = StartComparison.of(imp)
    rows = {r[0]: r[1:] for r in cmp.rows()}
    assert rows["segments at the end"] == ["19", "19 (+0)", "27 (+8)"]
    assert rows["reserved at the end"] == ["1,288 MiB", "1,288 MiB (0 B)", "1,292 MiB (+4.0 MiB)"]
    assert rows["allocations at the address the file records"] == ["144", "144", "— (its own addresses)"]
    assert cmp.reading() == ("From an empty allocator the same rules end with 27 segments (+8 against the file's 19) "
                             "and 1,292 MiB reserved (+4.0 MiB).")   # lesson 13 renders it
    html = cmp._repr_html_()
    assert "in the file: recorded on NVIDIA H200, 2026-11-26, torch 2.11.0+cu130" in html
    assert "simulated allocator, start rebuilt from the file" in html
    data = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["gpulab"]
    assert {"interop/data/*.pickle", "interop/data/*.json", "interop/data/README.md"} <= set(data)
    with pytest.raises(ValueError, match="no recorded snapshot"):
        read_recorded_snapshot("nope")
