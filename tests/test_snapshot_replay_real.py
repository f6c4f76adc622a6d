"""A snapshot's replay with what the file records (issue 25): its allocator settings, one pool per
stream, its release bursts. Checked on snapshots recorded on an NVIDIA H200 (tests/data/h200) and
on traces written here."""
import copy
import pickle

import pytest

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
