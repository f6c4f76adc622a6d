"""Tests for gpulab.allocator.simulator, the caching-allocator simulator.

Each expected number is worked out by hand from the rule in c10/cuda/CUDACachingAllocator.cpp
that the test names, not read back from the implementation.
"""

from __future__ import annotations

import os
import random
import shutil
from types import SimpleNamespace

import pytest

from gpulab.allocator.simulator import AllocEvent, Block, CachingAllocator, ReplayResult, Segment, SimulatedOutOfMemoryError, format_size, get_allocation_size, round_size, should_split, simulate

KiB = 1024
MiB = 1024 * 1024


def reserved(a: CachingAllocator) -> int:
    return a.stats()["reserved_bytes.all.current"]


def allocated(a: CachingAllocator) -> int:
    return a.stats()["allocated_bytes.all.current"]


# --- rounding and segment sizes ------------------------------------------------------------------


def test_round_size_512_bytes():
    # kMinBlockSize = 512: sizes below 512 become 512, others round up to a multiple of 512
    assert round_size(1) == 512
    assert round_size(512) == 512
    assert round_size(513) == 1024
    assert round_size(1000) == 1024
    a = CachingAllocator()
    b = a.malloc(1)
    assert (b.size, b.requested) == (512, 1)
    assert a.malloc(513).size == 1024
    assert allocated(a) == 512 + 1024
    assert a.stats()["requested_bytes.all.current"] == 1 + 513


def test_get_allocation_size_rule():
    assert get_allocation_size(512) == 2 * MiB  # <= kSmallSize -> kSmallBuffer
    assert get_allocation_size(1 * MiB) == 2 * MiB
    assert get_allocation_size(1 * MiB + 512) == 20 * MiB  # < kMinLargeAlloc -> kLargeBuffer
    assert get_allocation_size(10 * MiB - 512) == 20 * MiB
    assert get_allocation_size(10 * MiB) == 10 * MiB  # >= kMinLargeAlloc -> 2 MiB multiple
    assert get_allocation_size(10 * MiB + 512) == 12 * MiB


def test_small_requests_share_one_2mib_segment():
    a = CachingAllocator()
    x = a.malloc(1000)
    y = a.malloc(1000)
    assert x.pool == y.pool == "small"
    assert x.segment == y.segment
    assert y.addr == x.addr + 1024  # carved from the remainder right after x
    s = a.stats()
    assert s["reserved_bytes.all.current"] == 2 * MiB
    assert s["reserved_bytes.small_pool.current"] == 2 * MiB
    assert s["segment.all.current"] == 1
    assert s["allocated_bytes.all.current"] == 2048
    assert s["allocation.all.current"] == 2


def test_one_mib_plus_one_goes_to_20mib_large_segment():
    a = CachingAllocator()
    b = a.malloc(1 * MiB + 1)
    assert b.pool == "large"
    assert b.size == 1 * MiB + 512
    s = a.stats()
    assert s["reserved_bytes.all.current"] == 20 * MiB
    assert s["reserved_bytes.large_pool.current"] == 20 * MiB
    assert s["reserved_bytes.small_pool.current"] == 0
    # exactly 1 MiB is still "small": kSmallSize is the largest small allocation
    assert a.malloc(1 * MiB).pool == "small"


def test_12mib_request_gets_exact_12mib_segment():
    a = CachingAllocator()
    b = a.malloc(12 * MiB)
    assert b.size == 12 * MiB
    assert reserved(a) == 12 * MiB
    [seg] = a.segment_map()
    assert seg.size == 12 * MiB and len(seg.blocks) == 1


def test_10mib_plus_one_rounds_segment_to_2mib_multiple():
    a = CachingAllocator()
    b = a.malloc(10 * MiB + 1)
    # request rounds to 10 MiB + 512; >= kMinLargeAlloc so the segment is rounded up to 12 MiB;
    # the remainder 2 MiB - 512 is > 1 MiB, so the block is split
    assert b.size == 10 * MiB + 512
    assert reserved(a) == 12 * MiB
    assert [blk.size for blk in a.segment_map()[0].blocks] == [10 * MiB + 512, 2 * MiB - 512]
    # and 9 MiB (< kMinLargeAlloc) takes a 20 MiB segment
    a2 = CachingAllocator()
    a2.malloc(9 * MiB)
    assert reserved(a2) == 20 * MiB


def test_zero_byte_request_is_a_null_block():
    a = CachingAllocator()
    b = a.malloc(0)
    assert b.is_null and b.addr == 0 and b.size == 0 and not b.allocated
    assert reserved(a) == 0 and a.stats()["allocation.all.current"] == 0
    a.free(b)  # free(nullptr) is a no-op
    a.free(b)


# --- best fit, split, merge --------------------------------------------------------------------


def test_best_fit_picks_smallest_adequate_cached_block():
    a = CachingAllocator()
    blocks = [a.malloc(n * MiB) for n in (30, 14, 22)]
    seg_of = {n: b.segment for n, b in zip((30, 14, 22), blocks)}
    for b in blocks:
        a.free(b)
    b20 = a.malloc(20 * MiB)
    assert b20.segment == seg_of[22]  # not 30 (larger) and not 14 (too small)
    b12 = a.malloc(12 * MiB)
    assert b12.segment == seg_of[14]
    assert reserved(a) == 66 * MiB  # no new segment
    assert allocated(a) == 32 * MiB  # both split: 2 MiB remainders are > 1 MiB


def test_small_pool_splits_remainder_of_512_bytes():
    assert should_split(1024, 512, small_pool=True)
    assert not should_split(1024, 1024, small_pool=True)
    a = CachingAllocator()
    x = a.malloc(1024)
    y = a.malloc(1024)
    a.free(x)  # a free 1024-byte block between the segment start and y
    z = a.malloc(512)  # best fit is that 1024-byte hole; remainder 512 >= 512 -> split
    assert z.addr == x.addr and z.size == 512
    assert [b.size for b in a.segment_map()[0].blocks] == [512, 512, 1024, 2 * MiB - 2048]
    assert y.allocated


def test_large_pool_splits_only_when_remainder_exceeds_1mib():
    assert should_split(20 * MiB, 18 * MiB + 512 * KiB, small_pool=False)
    assert not should_split(20 * MiB, 19 * MiB, small_pool=False)  # remainder == 1 MiB
    a = CachingAllocator()
    b = a.malloc(19 * MiB)  # 20 MiB segment, remainder exactly 1 MiB: not > kSmallSize
    assert b.size == 20 * MiB and b.requested == 19 * MiB
    assert allocated(a) == 20 * MiB
    assert a.stats()["requested_bytes.all.current"] == 19 * MiB
    a2 = CachingAllocator()
    c = a2.malloc(18 * MiB + 512 * KiB)  # remainder 1.5 MiB > 1 MiB: split
    assert c.size == 18 * MiB + 512 * KiB
    assert [blk.size for blk in a2.segment_map()[0].blocks] == [c.size, 1536 * KiB]
    assert a2.stats()["inactive_split_bytes.all.current"] == 1536 * KiB


def test_merge_of_free_neighbours_restores_one_block():
    a = CachingAllocator()
    x, y, z = a.malloc(512), a.malloc(512), a.malloc(512)
    a.free(x)
    a.free(z)  # z merges with the tail remainder
    assert [b.allocated for b in a.segment_map()[0].blocks] == [False, True, False]
    assert a.stats()["inactive_split.all.current"] == 2
    assert a.stats()["inactive_split_bytes.all.current"] == 2 * MiB - 512
    a.free(y)  # merges with both neighbours
    [seg] = a.segment_map()
    assert [(b.size, b.allocated) for b in seg.blocks] == [(2 * MiB, False)]
    s = a.stats()
    assert s["inactive_split.all.current"] == 0
    assert s["inactive_split_bytes.all.current"] == 0
    assert s["active_bytes.all.current"] == 0


def test_empty_cache_releases_only_fully_free_segments():
    a = CachingAllocator()
    keep = a.malloc(4 * MiB)  # 20 MiB segment, stays partly allocated
    tmp = a.malloc(5 * MiB)  # carved from the same 20 MiB segment
    big = a.malloc(12 * MiB)  # its own 12 MiB segment
    small = a.malloc(100)  # a 2 MiB small segment
    for b in (tmp, big, small):
        a.free(b)
    assert reserved(a) == 34 * MiB
    a.empty_cache()
    s = a.stats()
    assert s["reserved_bytes.all.current"] == 20 * MiB
    assert s["segment.all.current"] == 1
    assert s["num_device_free"] == 2
    assert [seg.size for seg in a.segment_map()] == [20 * MiB]
    a.free(keep)
    a.empty_cache()
    assert reserved(a) == 0 and a.segment_map() == []


def test_double_free_and_foreign_block_raise():
    a, other = CachingAllocator(), CachingAllocator()
    b = a.malloc(4096)
    a.free(b)
    with pytest.raises(ValueError, match="double free"):
        a.free(b)
    c = other.malloc(4096)
    with pytest.raises(ValueError, match="not allocated by this allocator"):
        a.free(c)
    fake = Block(addr=123, size=512, requested=1, segment=0, pool="small")
    with pytest.raises(ValueError):
        a.free(fake)
    # a stale handle must not free the block that now reuses its address
    d = a.malloc(4096)
    assert d.addr == b.addr
    with pytest.raises(ValueError, match="double free"):
        a.free(b)
    assert d.allocated and allocated(a) == 4096


# --- capacity, OOM and retries -----------------------------------------------------------------


def test_oom_raises_and_allocator_stays_consistent():
    a = CachingAllocator(capacity_bytes=100 * MiB)
    x = a.malloc(60 * MiB)
    with pytest.raises(SimulatedOutOfMemoryError) as exc:
        a.malloc(60 * MiB)
    assert isinstance(exc.value, MemoryError)
    msg = str(exc.value)
    assert "Tried to allocate 60.00 MiB" in msg
    assert "total capacity of 100.00 MiB of which 40.00 MiB is free" in msg
    assert "60.00 MiB is allocated by PyTorch" in msg
    s = a.stats()
    assert s["num_ooms"] == 1
    assert s["num_alloc_retries"] == 1  # alloc_block(isRetry=true) ran once, and failed
    assert s["reserved_bytes.all.current"] == 60 * MiB
    assert s["allocated_bytes.all.current"] == 60 * MiB
    a.check_invariants()
    y = a.malloc(30 * MiB)  # still fits: 90 MiB <= 100 MiB
    a.free(x)
    a.free(y)
    assert allocated(a) == 0 and reserved(a) == 90 * MiB


def test_retry_after_releasing_cached_blocks_succeeds():
    a = CachingAllocator(capacity_bytes=100 * MiB)
    a.free(a.malloc(60 * MiB))  # 60 MiB cached, unused
    b = a.malloc(80 * MiB)  # 60 + 80 > 100: release_cached_blocks, then retry
    s = a.stats()
    assert b.size == 80 * MiB
    assert s["num_alloc_retries"] == 1
    assert s["num_ooms"] == 0
    assert s["reserved_bytes.all.current"] == 80 * MiB
    assert s["reserved_bytes.all.peak"] == 80 * MiB
    assert s["segment.all.current"] == 1


# --- max_split_size_mb -------------------------------------------------------------------------


def test_max_split_size_rules():
    with pytest.raises(ValueError):
        CachingAllocator(max_split_size_mb=10)  # must be >= kLargeBuffer / 1 MiB = 20

    # default: a cached 64 MiB block serves 12 MiB and is split
    a = CachingAllocator()
    a.free(a.malloc(64 * MiB))
    a.malloc(12 * MiB)
    assert (allocated(a), reserved(a)) == (12 * MiB, 64 * MiB)

    # max_split 32 MiB: a small request may not take an oversize block -> new 12 MiB segment
    a = CachingAllocator(max_split_size_mb=32)
    a.free(a.malloc(64 * MiB))
    a.malloc(12 * MiB)
    assert (allocated(a), reserved(a)) == (12 * MiB, 76 * MiB)

    # an oversize request within kLargeBuffer (20 MiB) of the cached block reuses it, unsplit
    a = CachingAllocator(max_split_size_mb=32)
    a.free(a.malloc(64 * MiB))
    b = a.malloc(50 * MiB)  # 64 < 50 + 20
    assert b.size == 64 * MiB
    assert (allocated(a), reserved(a)) == (64 * MiB, 64 * MiB)
    assert a.stats()["oversize_allocations.current"] == 1

    # ... but not when the cached block is 20 MiB or more larger
    a = CachingAllocator(max_split_size_mb=32)
    a.free(a.malloc(64 * MiB))
    a.malloc(40 * MiB)  # 64 >= 40 + 20
    assert (allocated(a), reserved(a)) == (40 * MiB, 104 * MiB)
    assert a.stats()["max_split_size"] == 32 * MiB
    assert CachingAllocator().stats()["max_split_size"] == -1


def test_max_split_release_available_cached_blocks_before_full_flush():
    # release_available_cached_blocks frees one oversize block big enough, no retry counted
    a = CachingAllocator(capacity_bytes=100 * MiB, max_split_size_mb=32)
    a.free(a.malloc(64 * MiB))
    a.malloc(40 * MiB)  # not served by the 64 MiB block; 64 + 40 > 100
    s = a.stats()
    assert s["reserved_bytes.all.current"] == 40 * MiB
    assert s["num_alloc_retries"] == 0
    assert s["num_device_free"] == 1
    assert s["num_ooms"] == 0


# --- expandable segments -----------------------------------------------------------------------


def _growing_batch(a: CachingAllocator) -> None:
    """Note [Expandable Segments]: each iteration needs a slightly larger tensor."""
    for mib in range(40, 60, 2):  # 40, 42, ..., 58 MiB
        a.free(a.malloc(mib * MiB))


def test_expandable_segments_reduce_reserved_when_sizes_grow():
    default = CachingAllocator()
    _growing_batch(default)
    # every request is >= 10 MiB and larger than any cached block: one new exact segment each
    assert reserved(default) == sum(range(40, 60, 2)) * MiB == 490 * MiB
    assert default.stats()["segment.all.current"] == 10

    exp = CachingAllocator(expandable_segments=True)
    _growing_batch(exp)
    # large-pool pages are 20 MiB: 40 MiB maps 2 pages; 42 MiB grows the free 40 MiB block by
    # one page to 60 MiB, which then serves 44..58 MiB
    assert reserved(exp) == 60 * MiB
    assert exp.stats()["reserved_bytes.all.peak"] == 60 * MiB
    assert exp.stats()["segment.all.current"] == 0  # expandable memory counts no segment
    [seg] = exp.segment_map()
    assert seg.expandable and seg.size == 60 * MiB
    exp.empty_cache()  # unmaps every fully free page
    assert reserved(exp) == 0 and exp.segment_map() == []


def test_expandable_segments_small_pool_pages_are_2mib():
    a = CachingAllocator(expandable_segments=True)
    blocks = [a.malloc(768 * KiB) for _ in range(3)]  # 2.25 MiB in total
    assert reserved(a) == 4 * MiB  # two 2 MiB pages, one segment
    assert len({b.segment for b in blocks}) == 1
    a.check_invariants()


def test_expandable_segments_capacity_oom_and_recovery():
    a = CachingAllocator(capacity_bytes=100 * MiB, expandable_segments=True)
    x = a.malloc(50 * MiB)  # maps 3 pages of 20 MiB = 60 MiB; 10 MiB free after x
    assert reserved(a) == 60 * MiB
    y = a.malloc(50 * MiB)  # the free 10 MiB + 2 more pages: exactly 50 MiB, 100 MiB mapped
    assert reserved(a) == 100 * MiB
    assert y.addr == x.addr + 50 * MiB
    with pytest.raises(SimulatedOutOfMemoryError, match="Tried to allocate 20.00 MiB"):
        a.malloc(1536 * KiB)  # needs one more 20 MiB page: 120 MiB > 100 MiB
    s = a.stats()
    assert (s["num_ooms"], s["num_alloc_retries"]) == (1, 1)
    a.check_invariants()
    a.free(x)
    a.empty_cache()  # unmaps the 2 whole pages inside x (0-40 MiB); 40-50 MiB stays mapped
    assert reserved(a) == 60 * MiB
    z = a.malloc(1536 * KiB)  # served from the mapped 10 MiB left of x
    assert z.addr == x.addr + 40 * MiB and reserved(a) == 60 * MiB
    w = a.malloc(30 * MiB)  # re-maps 2 pages at the lowest address: the hole at the start
    assert w.addr == x.addr and reserved(a) == 100 * MiB
    [seg] = a.segment_map()  # 0-100 MiB is mapped again: one contiguous range
    assert seg.size == 100 * MiB
    a.check_invariants()


# --- replay ------------------------------------------------------------------------------------


def test_replay_small_event_list_expected_series_and_peaks():
    ev = SimpleNamespace
    events = [
        ev(kind="alloc", sid=1, nbytes=1000, device="cuda:0"),  # 1024 in a 2 MiB small segment
        ev(kind="alloc", sid=2, nbytes=3 * MiB, device="cuda:0"),  # new 20 MiB segment, split
        ev(kind="free", sid=1, nbytes=1000, device="cuda:0"),
        ev(kind="resize", sid=2, nbytes=5 * MiB, device="cuda:0"),  # free 3, reuse the 20 MiB
        ev(kind="alloc", sid=3, nbytes=25 * MiB, device="cuda:0"),  # 26 MiB segment, unsplit
        ev(kind="alloc", sid=4, nbytes=4096, device="cpu"),  # ignored only with cuda_only
        ev(kind="free", sid=2, nbytes=5 * MiB, device="cuda:0"),
        ev(kind="free", sid=3, nbytes=25 * MiB, device="cuda:0"),
    ]
    r = simulate(events, cuda_only=True)
    assert isinstance(r, ReplayResult)
    assert r.allocated == [
        1024,
        1024 + 3 * MiB,
        3 * MiB,
        5 * MiB,
        31 * MiB,  # 5 MiB + 26 MiB (remainder 1 MiB is not > 1 MiB: no split)
        31 * MiB,
        26 * MiB,
        0,
    ]
    assert r.reserved == [2 * MiB, 22 * MiB, 22 * MiB, 22 * MiB, 48 * MiB, 48 * MiB, 48 * MiB,
                          48 * MiB]
    assert r.peak_allocated == 31 * MiB
    assert r.peak_reserved == 48 * MiB
    assert r.skipped == 1
    assert r.stats["allocated_bytes.all.peak"] == 31 * MiB
    assert r.stats["reserved_bytes.all.peak"] == 48 * MiB
    assert "simulated" in repr(r)

    # without cuda_only the cpu event is replayed too (4096 bytes in the small segment)
    r2 = CachingAllocator().replay(events)
    assert r2.skipped == 0 and r2.allocated[5] == 31 * MiB + 4096


def test_replay_strictness_and_oom_events():
    with pytest.raises(ValueError):
        simulate([AllocEvent("free", 7)])
    assert simulate([AllocEvent("free", 7)], strict=False).allocated == [0]
    r = simulate(
        [AllocEvent("alloc", 1, 80 * MiB), AllocEvent("alloc", 2, 40 * MiB),
         AllocEvent("free", 2), AllocEvent("free", 1)],
        capacity_bytes=100 * MiB,
    )
    assert r.oom_events == [1]
    assert r.allocated == [80 * MiB, 80 * MiB, 80 * MiB, 0]
    assert r.stats["num_ooms"] == 1


# --- stats keys and invariants under a random workload -----------------------------------------

REQUIRED_KEYS = [
    "allocated_bytes.all.current", "allocated_bytes.all.peak",
    "reserved_bytes.all.current", "reserved_bytes.all.peak",
    "active_bytes.all.current", "active_bytes.all.peak",
    "inactive_split_bytes.all.current",
    "segment.all.current", "segment.all.peak",
    "allocation.all.current",
    "num_alloc_retries", "num_ooms",
    "requested_bytes.all.current", "requested_bytes.all.peak",
    "allocated_bytes.small_pool.current", "allocated_bytes.large_pool.current",
    "reserved_bytes.small_pool.current", "reserved_bytes.large_pool.current",
    "segment.small_pool.current", "segment.large_pool.current",
]


def _check_segment_map(a: CachingAllocator) -> None:
    segs = a.segment_map()
    s = a.stats()
    spans = []
    for seg in segs:
        assert isinstance(seg, Segment)
        assert sum(b.size for b in seg.blocks) == seg.size
        pos = seg.address
        for prev, b in zip((None,) + seg.blocks[:-1], seg.blocks):
            assert b.addr == pos  # blocks tile the segment
            pos += b.size
            if prev is not None:
                assert prev.allocated or b.allocated  # free neighbours are always merged
        spans.append((seg.address, seg.address + seg.size))
    spans.sort()
    for (s0, e0), (s1, _) in zip(spans, spans[1:]):
        assert e0 <= s1  # segments do not overlap
    alloc = sum(b.size for seg in segs for b in seg.blocks if b.allocated)
    assert s["allocated_bytes.all.current"] == alloc
    assert s["active_bytes.all.current"] == alloc
    assert s["reserved_bytes.all.current"] == sum(seg.size for seg in segs)
    assert s["requested_bytes.all.current"] == sum(seg.requested_bytes for seg in segs)
    for pool in ("small", "large"):
        assert s[f"reserved_bytes.{pool}_pool.current"] == sum(
            seg.size for seg in segs if seg.pool == pool)
        assert s[f"allocated_bytes.{pool}_pool.current"] == sum(
            seg.allocated_bytes for seg in segs if seg.pool == pool)
    assert s["allocated_bytes.all.current"] <= s["reserved_bytes.all.current"]
    assert s["requested_bytes.all.current"] <= s["allocated_bytes.all.current"]
    for key in ("allocated_bytes", "reserved_bytes", "segment", "requested_bytes"):
        assert s[f"{key}.all.peak"] >= s[f"{key}.all.current"]
        assert s[f"{key}.all.current"] == (
            s[f"{key}.small_pool.current"] + s[f"{key}.large_pool.current"])
    if not a.expandable_segments:
        assert s["segment.all.current"] == len(segs)
        assert s["inactive_split_bytes.all.current"] == sum(
            b.size for seg in segs if seg.is_split for b in seg.blocks if not b.allocated)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"capacity_bytes": 256 * MiB},
        {"max_split_size_mb": 24, "capacity_bytes": 256 * MiB},
        {"expandable_segments": True},
        {"expandable_segments": True, "capacity_bytes": 256 * MiB},
    ],
    ids=["default", "capacity", "max_split", "expandable", "expandable_capacity"],
)
def test_random_workload_invariants(kwargs):
    rng = random.Random(1234)
    a = CachingAllocator(**kwargs)
    live: list[Block] = []
    peak_alloc = peak_res = 0
    ooms = 0
    for step in range(400):
        if live and (rng.random() < 0.45 or len(live) > 60):
            a.free(live.pop(rng.randrange(len(live))))
        else:
            kind = rng.random()
            if kind < 0.4:
                n = rng.randint(0, 4096)
            elif kind < 0.7:
                n = rng.randint(4096, 1 * MiB + 4096)
            elif kind < 0.9:
                n = rng.randint(1 * MiB, 12 * MiB)
            else:
                n = rng.randint(10 * MiB, 48 * MiB)
            try:
                live.append(a.malloc(n))
            except SimulatedOutOfMemoryError:
                ooms += 1
        if step % 37 == 0:
            a.empty_cache()
        s = a.stats()
        peak_alloc = max(peak_alloc, s["allocated_bytes.all.current"])
        peak_res = max(peak_res, s["reserved_bytes.all.current"])
        a.check_invariants()
        _check_segment_map(a)
    s = a.stats()
    for key in REQUIRED_KEYS:
        assert key in s, key
    assert s["allocated_bytes.all.peak"] == peak_alloc
    assert s["reserved_bytes.all.peak"] == peak_res
    assert s["num_ooms"] == ooms
    if "capacity_bytes" in kwargs:
        assert peak_res <= kwargs["capacity_bytes"]
    for b in live:
        a.free(b)
    a.empty_cache()
    assert a.stats()["reserved_bytes.all.current"] == 0
    assert a.stats()["allocated_bytes.all.current"] == 0
    a.check_invariants()


def test_reset_peak_stats_and_text_views():
    a = CachingAllocator()
    a.free(a.malloc(30 * MiB))
    a.reset_peak_stats()
    s = a.stats()
    assert s["allocated_bytes.all.peak"] == 0
    assert s["reserved_bytes.all.peak"] == 30 * MiB
    text = a.memory_summary()
    assert "Simulated" in text and "Reserved memory" in text and "30.00 MiB" in text
    assert "reserved=30.00 MiB" in repr(a)
    assert format_size(1024) == "1024 bytes"
    assert format_size(1536) == "1.50 KiB"
    assert format_size(12 * MiB) == "12.00 MiB"


# --- against the real allocator (needs a GPU) ----------------------------------------------------


def _cuda_available() -> bool:
    # only import torch where a GPU could exist, so the CPU-only run stays fast
    if not (shutil.which("nvidia-smi") or os.path.exists("/dev/nvidiactl")):
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device")
def test_simulator_matches_real_caching_allocator():
    import gc

    import torch

    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        pytest.skip("PYTORCH_CUDA_ALLOC_CONF is set; the simulator here models the defaults")
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    if torch.cuda.memory_allocated() != 0 or torch.cuda.memory_reserved() != 0:
        pytest.skip("the CUDA caching allocator is not empty in this process")
    torch.cuda.reset_peak_memory_stats()

    sizes = [1000, 3 * MiB, 512, 25 * MiB, 1 * MiB + 1, 12 * MiB, 19 * MiB, 700 * KiB]
    frees = {3: [0], 5: [1, 3], 7: [2, 4]}  # after step i, free these earlier tensors
    keys = ["allocated_bytes.all.current", "allocated_bytes.all.peak",
            "reserved_bytes.all.current", "reserved_bytes.all.peak", "segment.all.current"]
    sim = CachingAllocator()
    real: dict[int, torch.Tensor] = {}
    simb: dict[int, Block] = {}

    def compare(step: str) -> None:
        torch.cuda.synchronize()
        got = torch.cuda.memory_stats()
        want = sim.stats()
        assert {k: got[k] for k in keys} == {k: want[k] for k in keys}, step

    for i, n in enumerate(sizes):
        real[i] = torch.empty(n, dtype=torch.uint8, device="cuda")
        simb[i] = sim.malloc(n)
        compare(f"alloc {i}")
        for j in frees.get(i, []):
            del real[j]
            sim.free(simb.pop(j))
            compare(f"free {j}")
    real.clear()
    for b in simb.values():
        sim.free(b)
    compare("all freed")
    torch.cuda.empty_cache()
    sim.empty_cache()
    compare("empty_cache")


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device")
def test_the_simulator_is_rebuilt_from_the_real_allocators_segments():
    """``gpu.allocator_segments`` reads ``torch.cuda.memory_snapshot()``; ``rebuilt_allocator``
    makes the same segments and blocks, and a replay from there follows the real allocator."""
    import gc

    import torch

    from gpulab.allocator.simulator import rebuilt_allocator
    from gpulab.measure.gpu import allocator_segments

    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        pytest.skip("PYTORCH_CUDA_ALLOC_CONF is set; the simulator here models the defaults")
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    keep = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (3 * MiB, 700, 5 * MiB, 12 * MiB, 300)]
    del keep[2]
    torch.cuda.synchronize()
    segments = allocator_segments(0)
    assert segments is not None
    sim = rebuilt_allocator(segments)
    assert sim is not None
    assert sim.memory_allocated() == torch.cuda.memory_allocated()
    assert sim.memory_reserved() == torch.cuda.memory_reserved()
    more = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")   # lands in the 5 MiB gap
    sim.malloc(4 * MiB)
    torch.cuda.synchronize()
    assert (sim.memory_allocated(), sim.memory_reserved()) == \
        (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
    del keep, more


# --- a start that is not empty: segments made before the simulation, new ones at given addresses ---


def test_add_segment_takes_over_a_segment_as_it_was():
    """A 20 MiB large segment at a given address: 4 MiB live, 2 + 3 MiB free (one block: free
    neighbours are merged, try_merge_blocks), 11 MiB live. The stats count it as the allocator's."""
    a = CachingAllocator()
    base = 0x7F2000000000
    live = a.add_segment(base, [(4 * MiB, 4 * MiB - 100), (2 * MiB, None), (3 * MiB, None), (11 * MiB, 11 * MiB)])
    a.check_invariants()
    assert [(b.addr, b.size, b.requested) for b in live] == [(base, 4 * MiB, 4 * MiB - 100),
                                                            (base + 9 * MiB, 11 * MiB, 11 * MiB)]
    (seg,) = a.segment_map()
    assert seg.address == base and seg.pool == "large"
    assert [(b.offset, b.size, b.allocated) for b in seg.blocks] == [(0, 4 * MiB, True), (4 * MiB, 5 * MiB, False),
                                                                     (9 * MiB, 11 * MiB, True)]
    s = a.stats()
    assert s["reserved_bytes.all.current"] == 20 * MiB and s["segment.large_pool.current"] == 1
    assert s["allocated_bytes.all.current"] == 15 * MiB and s["requested_bytes.all.current"] == 15 * MiB - 100
    assert s["inactive_split_bytes.all.current"] == 5 * MiB and s["num_device_alloc"] == 0
    # get_free_block: the 5 MiB free block serves a 5 MiB request (remainder 0: no split)
    assert a.malloc(5 * MiB).addr == base + 4 * MiB
    a.free(live[0])
    a.check_invariants()
    assert a.segment_map()[0].blocks[0].size == 4 * MiB and not a.segment_map()[0].blocks[0].allocated


def test_best_fit_ties_break_by_the_segments_addresses():
    """BlockComparatorSize orders equal sizes by address: of two free 2 MiB small segments, the
    lower address serves the request, whichever was taken over first."""
    a = CachingAllocator()
    a.add_segment(0x7F3000000000, [(2 * MiB, None)])
    a.add_segment(0x7F1000000000, [(2 * MiB, None)])
    assert a.malloc(512).addr == 0x7F1000000000
    a.check_invariants()


def test_a_new_segment_goes_where_it_is_told_unless_that_overlaps():
    a = CachingAllocator()
    a.add_segment(0x7F2000000000, [(4 * MiB, 4 * MiB), (16 * MiB, None)])
    b = a.malloc(30 * MiB, segment_address=0x7F1000000000)      # cudaMalloc's answer on the GPU
    assert b.addr == 0x7F1000000000
    c = a.malloc(30 * MiB, segment_address=0x7F1000000000)      # taken: the simulator's own address
    assert c.addr not in (0x7F1000000000, 0x7F2000000000) and c.addr >= 0x7F2000000000 + 20 * MiB
    d = a.malloc(4 * MiB, segment_address=0x7F0000000000)       # served from a cached block: no segment
    assert a.stats()["segment.all.current"] == 3 and d.addr != 0x7F0000000000
    a.check_invariants()


def test_add_segment_refuses_what_is_not_a_segment():
    a = CachingAllocator(capacity_bytes=30 * MiB)
    a.add_segment(0x7F0000000000, [(20 * MiB, None)])
    with pytest.raises(ValueError, match="overlap"):
        a.add_segment(0x7F0000000000 + 10 * MiB, [(2 * MiB, None)])
    with pytest.raises(ValueError, match="multiple of 512"):
        a.add_segment(0x7F1000000000, [(1000, 1000)])
    with pytest.raises(ValueError, match="capacity"):
        a.add_segment(0x7F1000000000, [(20 * MiB, None)])
    with pytest.raises(ValueError, match="requested"):
        a.add_segment(0x7F1000000000, [(2 * MiB, 3 * MiB)])
    with pytest.raises(ValueError, match="expandable"):
        CachingAllocator(expandable_segments=True).add_segment(0x7F0000000000, [(2 * MiB, None)])
    a.check_invariants()


def test_release_segment_frees_only_a_wholly_free_segment_at_that_address():
    """release_block: a segment whose one block is free is cudaFree'd; a split or busy one stays."""
    a = CachingAllocator()
    a.add_segment(0x7F0000000000, [(20 * MiB, None)])
    busy = a.add_segment(0x7F1000000000, [(4 * MiB, 4 * MiB), (16 * MiB, None)])
    assert not a.release_segment(0x7F1000000000) and not a.release_segment(0x7F2000000000)
    assert a.release_segment(0x7F0000000000)
    assert reserved(a) == 20 * MiB and a.stats()["num_device_free"] == 1
    a.free(busy[0])
    assert a.release_segment(0x7F1000000000) and reserved(a) == 0
    a.check_invariants()


def test_add_expandable_segment_takes_over_mapped_pages():
    """An ExpandableSegment whose virtual range starts at 0x302000000: 20 MiB pages, the first
    mapped (2 MiB live, 18 MiB free), the next two unmapped, the fourth mapped and free. A 30 MiB
    request maps pages at the lowest address where free and unmapped room fits it
    (find_expandable_block): right after the live block."""
    a = CachingAllocator(expandable_segments=True)
    base = 0x302000000
    (live,) = a.add_expandable_segment(base, [(base, [(2 * MiB, 2 * MiB), (18 * MiB, None)]),
                                             (base + 60 * MiB, [(20 * MiB, None)])], pool="large")
    a.check_invariants()
    assert live.addr == base and reserved(a) == 40 * MiB
    assert [(s.address, s.size) for s in a.segment_map()] == [(base, 20 * MiB), (base + 60 * MiB, 20 * MiB)]
    b = a.malloc(30 * MiB)
    assert b.addr == base + 2 * MiB and reserved(a) == 60 * MiB     # one more page mapped: 18 + 20 MiB >= 30
    a.check_invariants()
    with pytest.raises(ValueError, match="whole pages"):
        CachingAllocator(expandable_segments=True).add_expandable_segment(base, [(base, [(2 * MiB, None)])],
                                                                          pool="large")
    with pytest.raises(ValueError, match="does not use expandable"):
        CachingAllocator().add_expandable_segment(base, [(base, [(20 * MiB, None)])], pool="large")
