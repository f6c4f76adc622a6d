"""A simulator of PyTorch's CUDA caching allocator, in pure Python.

The rules follow ``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``); each
function below names the C++ function it models.  A CPU-only student can replay a timeline of
tensor allocations through :class:`CachingAllocator` and see what ``torch.cuda.memory_reserved()``
and ``torch.cuda.memory_stats()`` *would* report on a GPU.  Every number it produces is
*simulated*, never a measurement.

What is modelled (one default stream, one device):

* 512-byte rounding (``round_size``), the small pool (<= 1 MiB, packed in 2 MiB segments) and the
  large pool (1-10 MiB requests in 20 MiB segments, larger ones rounded up to 2 MiB;
  ``get_allocation_size``);
* best fit over cached free blocks (``get_free_block``, incl. the ``max_split_size`` and
  "oversize block" rules), splitting (``should_split``, ``alloc_found_block``) and merging of free
  neighbours (``free_block``, ``try_merge_blocks``);
* a device capacity: when ``cudaMalloc`` would fail the allocator frees cached blocks and retries
  (``release_available_cached_blocks``, ``release_cached_blocks``, ``alloc_block``) and otherwise
  raises :class:`SimulatedOutOfMemoryError` with PyTorch's message;
* ``empty_cache`` (``release_cached_blocks``), which returns only whole free segments;
* a start that is not empty (:meth:`CachingAllocator.add_segment`: segments cudaMalloc'ed before
  the simulation began, at their addresses, with their blocks; ``add_expandable_segment``: an
  expandable segment's mapped pages), new segments placed at given addresses
  (``malloc(..., segment_address=)``) and a named segment released (``release_segment``), so that
  a replay of a real trace that began mid-run starts from the real allocator's state and breaks
  best-fit ties by the same addresses;
* ``expandable_segments`` (``ExpandableSegment``, ``try_allocate_expandable_block``,
  ``map_block``, ``unmap_block``);
* the statistics of ``torch.cuda.memory_stats()`` under the same key names.

What is not modelled (NB):

* streams, events and ``record_stream``: every block lives on one stream and is reusable the
  moment it is freed;
* CUDA graphs / private pools, IPC, free-memory callbacks;
* ``garbage_collection_threshold`` (``garbage_collect_cached_blocks``) and
  ``set_per_process_memory_fraction``: omitted; the ``capacity_bytes`` argument plays the role of
  the device's total memory instead;
* ``roundup_power2_divisions`` (off by default in PyTorch): sizes are rounded to 512 bytes only;
* memory outside the allocator (the CUDA context, other processes), which nvidia-smi counts but
  the allocator does not: ``capacity_bytes`` is all the allocator may use;
* the cuBLAS and cuDNN workspaces, which PyTorch takes from the caching allocator: they are not
  tensors, so a replay of tracked tensors does not contain them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

__all__ = [
    "MIN_BLOCK_SIZE",
    "SMALL_SIZE",
    "SMALL_BUFFER",
    "LARGE_BUFFER",
    "MIN_LARGE_ALLOC",
    "ROUND_LARGE",
    "Block",
    "BlockInfo",
    "Segment",
    "AllocEvent",
    "ReplayResult",
    "CachingAllocator",
    "SimulatedOutOfMemoryError",
    "round_size",
    "pool_for_size",
    "get_allocation_size",
    "should_split",
    "format_size",
    "simulate",
    "SegmentLayout",
    "rebuilt_allocator",
]

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# --- constants, from c10/cuda/CUDACachingAllocator.cpp --------------------------------------
MIN_BLOCK_SIZE = 512  # kMinBlockSize = 512: all sizes are rounded to at least 512 bytes
SMALL_SIZE = 1 * MiB  # kSmallSize = 1048576: largest "small" allocation is 1 MiB
SMALL_BUFFER = 2 * MiB  # kSmallBuffer = 2097152: "small" allocations are packed in 2 MiB blocks
LARGE_BUFFER = 20 * MiB  # kLargeBuffer = 20971520: "large" allocations may be packed in 20 MiB
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc = 10485760: 1-10 MiB requests may use kLargeBuffer
ROUND_LARGE = 2 * MiB  # kRoundLarge = 2097152: round up large allocations to 2 MiB
# CUDAAllocatorConfig::max_split_size() defaults to SIZE_MAX ("no limit");
# memory_stats()["max_split_size"] then reads -1 (static_cast<int64_t>(SIZE_MAX)).
SIZE_MAX = 2**64 - 1
# NativeCachingAllocator::allocate: "Tried to allocate more than 1EB memory."
ONE_EXA_BYTES = 1152921504606846976
# find_expandable_block: `segment_size = pool->is_small ? kSmallBuffer : kLargeBuffer` -- the
# page ("segment_size_") an expandable segment maps at a time: 2 MiB small pool, 20 MiB large.
EXPANDABLE_PAGE_SMALL = SMALL_BUFFER
EXPANDABLE_PAGE_LARGE = LARGE_BUFFER
# NB: with no capacity given, expandable segments reserve this much virtual address space
# (PyTorch reserves 1 1/8 of the device's total memory: `prop.totalGlobalMem * 9 / 8`).
DEFAULT_VIRTUAL_BYTES = 1 << 40
# NB: simulated device addresses start here; cudaMalloc's real addresses differ, and a freed
# range is never handed out again (only the order of addresses matters for best-fit ties).
_BASE_ADDRESS = 0x7F0000000000

PoolName = Literal["small", "large"]
_STAT_ARRAYS = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)
_STAT_TYPES = ("all", "small_pool", "large_pool")  # StatType::AGGREGATE, SMALL_POOL, LARGE_POOL


# --- small pure functions ----------------------------------------------------------------------


def round_size(nbytes: int) -> int:
    """Round a request up to a multiple of 512 bytes, at least 512 (``round_size``).

    NB: ``roundup_power2_divisions`` (opt-in via ``PYTORCH_CUDA_ALLOC_CONF``) is not modelled.
    """
    if nbytes < MIN_BLOCK_SIZE:  # if (size < kMinBlockSize) return kMinBlockSize;
        return MIN_BLOCK_SIZE
    return MIN_BLOCK_SIZE * ((nbytes + MIN_BLOCK_SIZE - 1) // MIN_BLOCK_SIZE)


def pool_for_size(size: int) -> PoolName:
    """The pool a *rounded* size is served from (``get_pool``: ``size <= kSmallSize``)."""
    return "small" if size <= SMALL_SIZE else "large"


def get_allocation_size(size: int) -> int:
    """Bytes cudaMalloc'ed for a new segment for a rounded ``size`` (``get_allocation_size``)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)


def should_split(
    block_size: int,
    size: int,
    *,
    small_pool: bool,
    max_split_size: int = SIZE_MAX,
    expandable_segments: bool = False,
) -> bool:
    """Whether a free block of ``block_size`` is split to serve ``size`` (``should_split``).

    Small pool (or expandable segments): split when the remainder is >= 512 bytes.  Large pool:
    split only when the request is below ``max_split_size`` and the remainder is > 1 MiB.
    """
    remaining = block_size - size
    if small_pool or expandable_segments:
        return remaining >= MIN_BLOCK_SIZE
    return size < max_split_size and remaining > SMALL_SIZE


def format_size(nbytes: int) -> str:
    """Format bytes as PyTorch's ``format_size`` does (``12.00 MiB``; binary units)."""
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    if nbytes <= 1048576:
        return f"{nbytes / 1024.0:.2f} KiB"
    if nbytes <= 1073741824:
        return f"{nbytes / 1048576.0:.2f} MiB"
    return f"{nbytes / 1073741824.0:.2f} GiB"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# --- result objects ----------------------------------------------------------------------------


class SimulatedOutOfMemoryError(MemoryError):
    """The simulated device has no room for a new segment, even after freeing cached blocks.

    Attributes mirror the numbers in the message: ``requested`` (bytes asked), ``alloc_size``
    (segment bytes the allocator tried to obtain), ``capacity``, ``free``, ``allocated`` and
    ``reserved`` (bytes, at the time of the failure).
    """

    def __init__(
        self,
        message: str,
        *,
        requested: int = 0,
        alloc_size: int = 0,
        capacity: int | None = None,
        free: int | None = None,
        allocated: int = 0,
        reserved: int = 0,
    ) -> None:
        super().__init__(message)
        self.requested = requested
        self.alloc_size = alloc_size
        self.capacity = capacity
        self.free = free
        self.allocated = allocated
        self.reserved = reserved


@dataclass(eq=False)
class Block:
    """A handle to one allocation, as returned by :meth:`CachingAllocator.malloc`.

    ``size`` is the block the allocator handed out (rounded, possibly larger than the request when
    the remainder was too small to split); ``requested`` is the bytes asked for. ``allocated``
    turns False when the block is freed. A 0-byte request returns a *null* block (``addr == 0``,
    ``size == 0``, ``segment == -1``, ``pool == "none"``), like PyTorch's null data pointer.
    Handles compare by identity.
    """

    addr: int
    size: int
    requested: int
    segment: int
    pool: str
    allocated: bool = True
    _owner: Any = field(default=None, repr=False)

    @property
    def is_null(self) -> bool:
        """True for the handle of a 0-byte request (no memory behind it)."""
        return self.segment == -1 and self.size == 0


@dataclass(frozen=True)
class BlockInfo:
    """One block of a :class:`Segment` (a snapshot; ``requested`` is 0 for free blocks)."""

    addr: int
    offset: int  # bytes from the start of the segment
    size: int
    allocated: bool
    requested: int


@dataclass(frozen=True)
class Segment:
    """One segment (cudaMalloc'ed range, or mapped range of an expandable segment).

    ``blocks`` are in address order and tile the segment exactly.
    """

    id: int
    pool: str
    address: int
    size: int
    blocks: tuple[BlockInfo, ...]
    expandable: bool = False

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the segment handed out to tensors."""
        return sum(b.size for b in self.blocks if b.allocated)

    @property
    def requested_bytes(self) -> int:
        """Bytes the live allocations in the segment asked for."""
        return sum(b.requested for b in self.blocks if b.allocated)

    @property
    def free_bytes(self) -> int:
        """Cached, unallocated bytes of the segment."""
        return self.size - self.allocated_bytes

    @property
    def is_split(self) -> bool:
        """True when the segment is cut into more than one block."""
        return len(self.blocks) > 1

    def __repr__(self) -> str:
        kind = "expandable " if self.expandable else ""
        return (
            f"Segment(id={self.id}, {kind}{self.pool} pool, {format_size(self.size)} at "
            f"{self.address:#x}, {len(self.blocks)} blocks, "
            f"{format_size(self.allocated_bytes)} allocated)"
        )


@dataclass
class AllocEvent:
    """A minimal event for :meth:`CachingAllocator.replay` (any object with these fields works)."""

    kind: str  # 'alloc' | 'free' | 'resize'
    sid: int
    nbytes: int = 0
    device: str | None = "cuda"


@dataclass
class ReplayResult:
    """The outcome of replaying an event list through the simulated allocator.

    ``allocated`` and ``reserved`` hold, for each event (same length as the events), the
    ``allocated_bytes.all.current`` and ``reserved_bytes.all.current`` after it. ``peak_*`` are the
    maxima over the replay (including the state it started from). ``oom_events`` lists the indices
    of events that raised a simulated OOM (the replay goes on without that allocation);
    ``skipped`` counts events ignored by ``cuda_only``. ``stats`` and ``segments`` describe the
    final state. Label: *simulated allocator*.
    """

    allocated: list[int]
    reserved: list[int]
    stats: dict[str, int]
    peak_allocated: int
    peak_reserved: int
    oom_events: list[int] = field(default_factory=list)
    skipped: int = 0
    segments: list[Segment] = field(default_factory=list)

    def __repr__(self) -> str:
        return (
            f"ReplayResult(events={len(self.allocated)}, "
            f"peak_allocated={format_size(self.peak_allocated)}, "
            f"peak_reserved={format_size(self.peak_reserved)}, "
            f"final_reserved={format_size(self.stats.get('reserved_bytes.all.current', 0))}, "
            f"ooms={len(self.oom_events)}, skipped={self.skipped}; simulated allocator)"
        )


# --- internal state ----------------------------------------------------------------------------


class _Blk:
    """Internal block (``struct Block``): a node of its segment's doubly linked list."""

    __slots__ = (
        "addr",
        "size",
        "requested",
        "pool",
        "seg",
        "allocated",
        "prev",
        "next",
        "mapped",
        "expandable",
        "handle",
        "dead",
    )

    def __init__(
        self, addr: int, size: int, pool: _Pool, seg: int, *, mapped: bool = True,
        expandable: bool = False,
    ) -> None:
        self.addr = addr
        self.size = size
        self.requested = 0
        self.pool = pool
        self.seg = seg
        self.allocated = False
        self.prev: _Blk | None = None
        self.next: _Blk | None = None
        self.mapped = mapped
        self.expandable = expandable
        self.handle: Block | None = None
        self.dead = False

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class _Pool:
    """``BlockPool``: free mapped blocks ordered by (size, address) -- ``BlockComparatorSize`` --
    and, for expandable segments, unmapped ranges by address (``BlockComparatorAddress``)."""

    def __init__(self, name: PoolName) -> None:
        self.name = name
        self.is_small = name == "small"
        self.stat_index = 1 if self.is_small else 2
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[tuple[int, int], _Blk] = {}
        self.unmapped_addrs: list[int] = []
        self.unmapped: dict[int, _Blk] = {}

    def insert(self, b: _Blk) -> None:
        key = (b.size, b.addr)
        bisect.insort(self.keys, key)
        self.blocks[key] = b

    def erase(self, b: _Blk) -> None:
        key = (b.size, b.addr)
        i = bisect.bisect_left(self.keys, key)
        assert i < len(self.keys) and self.keys[i] == key, "block not in pool"
        del self.keys[i]
        del self.blocks[key]

    def insert_unmapped(self, b: _Blk) -> None:
        bisect.insort(self.unmapped_addrs, b.addr)
        self.unmapped[b.addr] = b

    def erase_unmapped(self, b: _Blk) -> None:
        i = bisect.bisect_left(self.unmapped_addrs, b.addr)
        assert i < len(self.unmapped_addrs) and self.unmapped_addrs[i] == b.addr
        del self.unmapped_addrs[i]
        del self.unmapped[b.addr]


class _Seg:
    """A cudaMalloc'ed segment, or an ``ExpandableSegment`` (virtual range mapped in pages)."""

    __slots__ = ("id", "pool", "base", "size", "head", "expandable", "page")

    def __init__(
        self, id: int, pool: _Pool, base: int, size: int, *, expandable: bool = False,
        page: int = 0,
    ) -> None:
        self.id = id
        self.pool = pool
        self.base = base
        self.size = size  # cudaMalloc'ed bytes, or the virtual size of an expandable segment
        self.head: _Blk | None = None
        self.expandable = expandable
        self.page = page


class _Stat:
    """``struct Stat``: current, peak, allocated (total increase), freed (total decrease)."""

    __slots__ = ("current", "peak", "allocated", "freed")

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self.allocated = 0
        self.freed = 0

    def increase(self, amount: int) -> None:  # increase_stat
        current = self.current = self.current + amount
        if current > self.peak:   # max(), without the call (millions of these in one fit)
            self.peak = current
        self.allocated += amount

    def decrease(self, amount: int) -> None:  # decrease_stat
        self.current -= amount
        assert self.current >= 0, "Negative tracked stat in simulated allocator (logic error)."
        self.freed += amount


# --- the allocator -----------------------------------------------------------------------------


class CachingAllocator:
    """A model of one device's ``DeviceCachingAllocator`` (default stream only).

    Args:
        capacity_bytes: memory the allocator may reserve in total (the device's free memory);
            ``None`` means unlimited (no OOM).
        max_split_size_mb: ``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:N``; blocks of at least this
            size are never split. PyTorch requires at least 20 (kLargeBuffer / 1 MiB).
        expandable_segments: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.
        max_non_split_rounding_mb: how much larger than a request (>= max_split_size) a cached
            oversize block may be and still serve it; PyTorch's default is 20 (kLargeBuffer).

    Library code never prints: results are returned as data (:meth:`stats`,
    :meth:`segment_map`) or text (:meth:`memory_summary`).
    """

    def __init__(
        self,
        capacity_bytes: int | None = None,
        max_split_size_mb: int | None = None,
        expandable_segments: bool = False,
        *,
        max_non_split_rounding_mb: int | None = None,
    ) -> None:
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if max_split_size_mb is not None and max_split_size_mb < LARGE_BUFFER // MiB:
            # parseMaxSplitSize: "max_split_size_mb too small, must be >= 20" (older: "> 20")
            raise ValueError(
                f"max_split_size_mb too small, must be >= {LARGE_BUFFER // MiB}, "
                f"got {max_split_size_mb}"
            )
        self.capacity_bytes = capacity_bytes
        self.max_split_size_mb = max_split_size_mb
        self.expandable_segments = bool(expandable_segments)
        self.max_split_size = SIZE_MAX if max_split_size_mb is None else max_split_size_mb * MiB
        self.max_non_split_rounding_size = (
            LARGE_BUFFER if max_non_split_rounding_mb is None else max_non_split_rounding_mb * MiB
        )
        self._small = _Pool("small")
        self._large = _Pool("large")
        self._segments: dict[int, _Seg] = {}
        self._active: dict[int, _Blk] = {}  # allocated blocks by address ("allocated_blocks")
        self._next_segment_id = 0
        self._next_address = _BASE_ADDRESS
        self._segment_address: int | None = None  # where malloc was told to put a new segment
        self._total_reserved = 0  # total_allocated_memory in the C++ source
        self._stats: dict[str, list[_Stat]] = {
            name: [_Stat(), _Stat(), _Stat()] for name in _STAT_ARRAYS
        }
        self._oversize_allocations = _Stat()
        self._oversize_segments = _Stat()
        self._counters = {
            "num_alloc_retries": 0,
            "num_ooms": 0,
            "num_sync_all_streams": 0,
            "num_device_alloc": 0,
            "num_device_free": 0,
        }

    # ---- public API ---------------------------------------------------------------------------

    def malloc(self, nbytes: int, *, segment_address: int | None = None) -> Block:
        """Allocate ``nbytes`` (``DeviceCachingAllocator::malloc``) and return its :class:`Block`.

        ``segment_address``: where to put the segment if this request needs a new one (cudaMalloc's
        answer, read from a real trace's ``segment_alloc``; for expandable segments, where a new
        virtual range begins, its first ``segment_map``); ignored when that range overlaps a
        segment the simulator holds.

        A 0-byte request returns a null block without touching the allocator: PyTorch's
        ``allocate()`` only calls ``malloc`` when ``size != 0`` and hands out a null pointer.

        Raises:
            SimulatedOutOfMemoryError: the capacity leaves no room even after freeing the cache.
        """
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative number of bytes ({nbytes})")
        if nbytes == 0:
            return Block(addr=0, size=0, requested=0, segment=-1, pool="none",
                         allocated=False, _owner=self)
        if nbytes >= ONE_EXA_BYTES:
            raise SimulatedOutOfMemoryError(
                "CUDA out of memory (simulated). Tried to allocate more than 1EB memory.",
                requested=nbytes,
            )
        size = round_size(nbytes)
        pool = self._small if size <= SMALL_SIZE else self._large  # get_pool
        alloc_size = get_allocation_size(size)

        # First, try to get a block from the existing pool.
        blk = self._get_free_block(pool, size)
        if blk is None:
            # alloc_block || (release_available_cached_blocks && alloc_block)
            #             || (release_cached_blocks && alloc_block(isRetry=true))
            self._segment_address = segment_address
            try:
                blk = self._alloc_block(pool, size, alloc_size, is_retry=False)
                if blk is None and self._release_available_cached_blocks(pool, size):
                    blk = self._alloc_block(pool, size, alloc_size, is_retry=False)
                if blk is None and self._release_cached_blocks():
                    blk = self._alloc_block(pool, size, alloc_size, is_retry=True)
            finally:
                self._segment_address = None
        if blk is None:
            self._counters["num_ooms"] += 1
            raise self._oom_error(nbytes, alloc_size)

        split = should_split(
            blk.size, size, small_pool=pool.is_small, max_split_size=self.max_split_size,
            expandable_segments=self.expandable_segments,
        )
        return self._alloc_found_block(blk, pool, size, nbytes, split)

    def free(self, block: Block) -> None:
        """Return a block to the cache (``DeviceCachingAllocator::free`` and ``free_block``).

        Freeing a null block (0-byte request) does nothing, as ``free(nullptr)`` does.

        Raises:
            ValueError: the block was already freed, or was not allocated by this allocator.
        """
        if not isinstance(block, Block):
            raise TypeError(
                f"free() expects a Block returned by malloc(), got {type(block).__name__}"
            )
        if block.is_null:
            return
        blk = self._active.get(block.addr)
        if blk is None or blk.handle is not block:
            if block._owner is self and not block.allocated:
                raise ValueError(
                    f"double free: the block at {block.addr:#x} ({format_size(block.size)}, "
                    f"{block.requested} bytes requested) was already freed"
                )
            raise ValueError(
                f"invalid block: the block at {block.addr:#x} was not allocated by this allocator"
            )
        del self._active[blk.addr]
        blk.allocated = False
        blk.handle = None
        block.allocated = False
        idx = blk.pool.stat_index
        for i in (0, idx):
            self._stats["allocation"][i].decrease(1)
            self._stats["allocated_bytes"][i].decrease(blk.size)
        if blk.size >= self.max_split_size:
            self._oversize_allocations.decrease(1)
        self._free_block(blk)

    def empty_cache(self) -> None:
        """Release every cached segment that holds no allocated block (``emptyCache``).

        Split segments with any allocated block stay; with expandable segments, fully free pages
        are unmapped (``release_cached_blocks`` -> ``release_blocks``).
        """
        self._release_cached_blocks()

    def release_segment(self, address: int) -> bool:
        """cudaFree the segment at ``address`` if it is wholly free (``release_block``), as a real
        trace's ``segment_free`` entry says the allocator did (``release_cached_blocks``, or
        ``release_available_cached_blocks`` freeing oversize blocks before a retry). Returns False,
        changing nothing, when no such segment is there (or it is an expandable segment's)."""
        for seg in self._segments.values():
            if seg.base == address:
                blk = seg.head
                if seg.expandable or blk is None or blk.allocated or blk.next is not None:
                    return False
                self._release_block(blk)
                return True
        return False

    def add_segment(
        self, address: int, blocks: Iterable[tuple[int, int | None]], *,
        pool: PoolName | None = None,
    ) -> list[Block]:
        """Take over a segment that was cudaMalloc'ed before the simulation began, as it was then.

        ``address``: where the segment starts; ``blocks``: its blocks in address order, tiling it,
        each ``(size, requested)`` for an allocated block (``requested``: the bytes it was asked
        for) or ``(size, None)`` for a free one (free neighbours are merged, as the allocator
        always keeps them). ``pool``: "small" or "large"; by default small when the segment is
        ``kSmallBuffer`` (2 MiB) or less, as ``get_allocation_size`` makes no large segment that
        small. Returns the allocated blocks' handles, in address order, to :meth:`free` later.

        The segment counts in the statistics from here on (``segment``, ``reserved_bytes``,
        ``allocated_bytes``, ...), as it would in a real allocator's, but no ``num_device_alloc``:
        this simulation did not cudaMalloc it.

        Raises:
            ValueError: the blocks do not tile a segment (sizes not positive multiples of 512
                bytes), the range overlaps a segment already held, a capacity would be exceeded,
                or the allocator uses expandable segments (NB: taking over an expandable segment's
                mapped pages is not modelled).
        """
        if self.expandable_segments:
            raise ValueError("add_segment: a start with expandable segments is not modelled")
        merged = _segment_blocks(blocks)
        total = sum(size for size, _ in merged)
        name = pool if pool is not None else ("small" if total <= SMALL_BUFFER else "large")
        if name not in ("small", "large"):
            raise ValueError(f"add_segment: pool must be 'small' or 'large', not {pool!r}")
        if self._overlaps(int(address), total):
            raise ValueError(f"add_segment: {total} bytes at {int(address):#x} overlap a segment "
                             "the simulator already holds")
        if self.capacity_bytes is not None and self._total_reserved + total > self.capacity_bytes:
            raise ValueError(f"add_segment: {format_size(total)} more would exceed the capacity "
                             f"({format_size(self.capacity_bytes)})")
        the_pool = self._small if name == "small" else self._large
        seg = _Seg(self._next_segment_id, the_pool, int(address), total)
        self._next_segment_id += 1
        self._segments[seg.id] = seg
        self._next_address = max(self._next_address, seg.base + total)
        self._total_reserved += total
        idx = the_pool.stat_index
        for i in (0, idx):
            self._stats["segment"][i].increase(1)
            self._stats["reserved_bytes"][i].increase(total)
        if total >= self.max_split_size:
            self._oversize_segments.increase(1)
        handles: list[Block] = []
        prev: _Blk | None = None
        addr = seg.base
        for size, requested in merged:
            blk = prev = _append_block(seg, prev, _Blk(addr, size, the_pool, seg.id))
            addr += size
            if requested is None:
                the_pool.insert(blk)
                if len(merged) > 1:  # a free piece of a split segment: inactive_split
                    for i in (0, idx):
                        self._stats["inactive_split"][i].increase(1)
                        self._stats["inactive_split_bytes"][i].increase(size)
                continue
            handles.append(self._hand_out(blk, requested))
        return handles

    def add_expandable_segment(
        self, base: int, runs: Iterable[tuple[int, Iterable[tuple[int, int | None]]]], *,
        pool: PoolName,
    ) -> list[Block]:
        """Take over an expandable segment that existed before the simulation began
        (``ExpandableSegment``): its virtual range starts at ``base`` (as large as the ones this
        simulator reserves), and ``runs`` are its mapped ranges, each ``(address, blocks)`` with
        blocks as :meth:`add_segment` takes them; the rest is unmapped. Addresses and sizes are
        whole pages (2 MiB small pool, 20 MiB large: ``find_expandable_block``'s
        ``segment_size``). Returns the allocated blocks' handles, in address order. Needs
        ``expandable_segments=True``; raises ``ValueError`` for what is not such a segment.
        NB: the virtual range is cut short where a segment already held begins above ``base``
        (take over the highest segments first)."""
        if not self.expandable_segments:
            raise ValueError("add_expandable_segment: this allocator does not use expandable segments")
        the_pool = self._small if pool == "small" else self._large
        page = EXPANDABLE_PAGE_SMALL if pool == "small" else EXPANDABLE_PAGE_LARGE
        total = DEFAULT_VIRTUAL_BYTES if self.capacity_bytes is None else self.capacity_bytes
        base = int(base)
        # NB: the virtual range ends before the next segment held, where that comes first
        virtual = min(_ceil_div(total + total // 8, page) * page, (self._room_at(base) or 0) // page * page)
        parts = sorted((int(a), _segment_blocks(blocks)) for a, blocks in runs)
        mapped = sum(n for _, blocks in parts for n, _ in blocks)
        pos = base
        for a, blocks in parts:
            size = sum(n for n, _ in blocks)
            if a < pos or (a - base) % page or size % page or a + size > base + virtual:
                raise ValueError(f"add_expandable_segment: the run at {a:#x} is not whole pages of "
                                 f"{format_size(page)} inside the segment, after the one before")
            pos = a + size
        if self._overlaps(base, virtual):
            raise ValueError(f"add_expandable_segment: {base:#x} overlaps a segment the simulator holds")
        if self.capacity_bytes is not None and self._total_reserved + mapped > self.capacity_bytes:
            raise ValueError("add_expandable_segment: its mapped pages would exceed the capacity")
        seg = _Seg(self._next_segment_id, the_pool, base, virtual, expandable=True, page=page)
        self._next_segment_id += 1
        self._segments[seg.id] = seg
        self._next_address = max(self._next_address, base + virtual)
        self._total_reserved += mapped
        for i in (0, the_pool.stat_index):
            self._stats["reserved_bytes"][i].increase(mapped)
        pieces: list[tuple[int, int, int | None, bool]] = []  # (addr, size, requested, mapped)
        pos = base
        for a, blocks in parts:
            if a > pos:
                pieces.append((pos, a - pos, None, False))
            for n, requested in blocks:
                pieces.append((a, n, requested, True))
                a += n
            pos = a
        if pos < base + virtual:
            pieces.append((pos, base + virtual - pos, None, False))
        handles: list[Block] = []
        prev: _Blk | None = None
        for addr, n, requested, is_mapped in pieces:
            blk = prev = _append_block(seg, prev, _Blk(addr, n, the_pool, seg.id, mapped=is_mapped, expandable=True))
            if not is_mapped:
                the_pool.insert_unmapped(blk)
            elif requested is None:
                the_pool.insert(blk)
            else:
                handles.append(self._hand_out(blk, requested))
        return handles

    def stats(self) -> dict[str, int]:
        """The allocator statistics under ``torch.cuda.memory_stats()`` key names (sorted)."""
        out: dict[str, int] = {}
        for name, arr in self._stats.items():
            for type_name, stat in zip(_STAT_TYPES, arr):
                prefix = f"{name}.{type_name}."
                out[prefix + "current"] = stat.current
                out[prefix + "peak"] = stat.peak
                out[prefix + "allocated"] = stat.allocated
                out[prefix + "freed"] = stat.freed
        for name, stat in (
            ("oversize_allocations", self._oversize_allocations),
            ("oversize_segments", self._oversize_segments),
        ):
            out[name + ".current"] = stat.current
            out[name + ".peak"] = stat.peak
            out[name + ".allocated"] = stat.allocated
            out[name + ".freed"] = stat.freed
        out.update(self._counters)
        out["max_split_size"] = -1 if self.max_split_size == SIZE_MAX else self.max_split_size
        return dict(sorted(out.items()))

    def reset_peak_stats(self) -> None:
        """Set every peak to its current value (``resetPeakStats``)."""
        for arr in self._stats.values():
            for stat in arr:
                stat.peak = stat.current
        self._oversize_allocations.peak = self._oversize_allocations.current
        self._oversize_segments.peak = self._oversize_segments.current

    def reset_accumulated_stats(self) -> None:
        """Zero the cumulative counters (``resetAccumulatedStats``)."""
        for arr in self._stats.values():
            for stat in arr:
                stat.allocated = stat.freed = 0
        for stat in (self._oversize_allocations, self._oversize_segments):
            stat.allocated = stat.freed = 0
        for key in self._counters:
            self._counters[key] = 0

    def memory_allocated(self) -> int:
        """``torch.cuda.memory_allocated()``: bytes in allocated blocks."""
        return self._stats["allocated_bytes"][0].current

    def memory_reserved(self) -> int:
        """``torch.cuda.memory_reserved()``: bytes held in segments."""
        return self._stats["reserved_bytes"][0].current

    def max_memory_allocated(self) -> int:
        """``torch.cuda.max_memory_allocated()``."""
        return self._stats["allocated_bytes"][0].peak

    def max_memory_reserved(self) -> int:
        """``torch.cuda.max_memory_reserved()``."""
        return self._stats["reserved_bytes"][0].peak

    def segment_map(self) -> list[Segment]:
        """Every segment and its blocks, in address order (cf. ``torch.cuda.memory_snapshot()``).

        As in ``snapshot()``, an expandable segment is reported as one :class:`Segment` per
        contiguous mapped range (all with the expandable segment's id).
        """
        out: list[Segment] = []
        for seg in self._segments.values():
            run: list[_Blk] = []
            b = seg.head
            while b is not None:
                if b.mapped:
                    run.append(b)
                elif run:
                    out.append(self._segment_info(seg, run))
                    run = []
                b = b.next
            if run:
                out.append(self._segment_info(seg, run))
        out.sort(key=lambda s: s.address)
        return out

    def memory_summary(self) -> str:
        """A short text table of the statistics (cf. ``torch.cuda.memory_summary()``)."""
        s = self.stats()
        cap = "unlimited" if self.capacity_bytes is None else format_size(self.capacity_bytes)
        split = "unlimited" if self.max_split_size_mb is None else f"{self.max_split_size_mb} MiB"
        lines = [
            "Simulated PyTorch CUDA caching allocator (gpulab.allocator.simulator; not a GPU measurement)",
            f"capacity: {cap} | max_split_size: {split} | "
            f"expandable_segments: {self.expandable_segments}",
            f"{'metric':<34}{'current':>14}{'peak':>14}",
            "-" * 62,
        ]
        rows = [
            ("Allocated memory", "allocated_bytes", True),
            ("Active memory", "active_bytes", True),
            ("Requested memory", "requested_bytes", True),
            ("Reserved memory (segments)", "reserved_bytes", True),
            ("Non-releasable memory", "inactive_split_bytes", True),
            ("Allocations", "allocation", False),
            ("Segments (cudaMalloc)", "segment", False),
        ]
        for label, key, is_bytes in rows:
            for type_name, sub in (("all", label), ("large_pool", "  from large pool"),
                                   ("small_pool", "  from small pool")):
                cur = s[f"{key}.{type_name}.current"]
                peak = s[f"{key}.{type_name}.peak"]
                if is_bytes:
                    cur_s, peak_s = format_size(cur), format_size(peak)
                else:
                    cur_s, peak_s = str(cur), str(peak)
                lines.append(f"{sub:<34}{cur_s:>14}{peak_s:>14}")
        lines.append("-" * 62)
        lines.append(
            f"alloc retries: {s['num_alloc_retries']} | OOMs: {s['num_ooms']} | "
            f"device allocs: {s['num_device_alloc']} | device frees: {s['num_device_free']}"
        )
        return "\n".join(lines)

    def replay(
        self, events: Iterable[Any], *, cuda_only: bool = False, strict: bool = True
    ) -> ReplayResult:
        """Replay storage events through this allocator.

        Each event has ``kind`` ('alloc' | 'free' | 'resize'), ``sid`` (storage id), ``nbytes`` and
        optionally ``device`` (attributes, or keys of a mapping). 'resize' frees the storage's old
        block, then allocates ``nbytes``. NB: a real ``resize_`` allocates the new buffer before
        freeing the old one (it copies the data), so its momentary peak is higher.

        Args:
            cuda_only: skip events whose ``device`` does not start with ``'cuda'`` (an event with
                no device is skipped too); skipped events still get an entry in the series.
            strict: raise ``ValueError`` on an 'alloc' of a live sid or a 'free' of an unknown sid;
                with ``strict=False`` the first frees the old block and the second is ignored.

        A simulated OOM does not stop the replay: the event index goes to ``oom_events``, the
        storage stays unallocated and its later 'free' is ignored.
        """
        live: dict[Any, Block] = {}
        failed: set[Any] = set()
        alloc_series: list[int] = []
        reserved_series: list[int] = []
        oom_events: list[int] = []
        skipped = 0
        peak_alloc = self.memory_allocated()
        peak_res = self.memory_reserved()

        def do_malloc(i: int, sid: Any, nbytes: int) -> None:
            try:
                live[sid] = self.malloc(nbytes)
            except SimulatedOutOfMemoryError:
                oom_events.append(i)
                failed.add(sid)

        for i, ev in enumerate(events):
            kind = _event_field(ev, "kind")
            sid = _event_field(ev, "sid")
            nbytes = int(_event_field(ev, "nbytes", 0) or 0)
            device = _event_field(ev, "device", None)
            if cuda_only and not str(device or "").startswith("cuda"):
                skipped += 1
            elif kind == "alloc":
                if sid in live:
                    if strict:
                        raise ValueError(f"event {i}: 'alloc' of storage {sid!r}, which is live")
                    self.free(live.pop(sid))
                failed.discard(sid)
                do_malloc(i, sid, nbytes)
            elif kind == "free":
                if sid in live:
                    self.free(live.pop(sid))
                elif sid in failed:
                    failed.discard(sid)
                elif strict:
                    raise ValueError(f"event {i}: 'free' of storage {sid!r}, which is not live")
            elif kind == "resize":
                if sid in live:
                    self.free(live.pop(sid))
                failed.discard(sid)
                do_malloc(i, sid, nbytes)
            else:
                raise ValueError(f"event {i}: unknown kind {kind!r} (expected alloc/free/resize)")
            a, r = self.memory_allocated(), self.memory_reserved()
            alloc_series.append(a)
            reserved_series.append(r)
            peak_alloc = max(peak_alloc, a)
            peak_res = max(peak_res, r)

        return ReplayResult(
            allocated=alloc_series,
            reserved=reserved_series,
            stats=self.stats(),
            peak_allocated=peak_alloc,
            peak_reserved=peak_res,
            oom_events=oom_events,
            skipped=skipped,
            segments=self.segment_map(),
        )

    def replay_peak(self, events: Iterable[Any]) -> tuple[int, int]:
        """(``peak_reserved``, ``len(oom_events)``) of ``replay(events, strict=False)``, without its
        series, stats and segment map: the same ``malloc`` and ``free`` calls in the same order, the reserved
        bytes read after each event as ``replay`` reads them. For events with ``kind``, ``sid`` and ``nbytes``
        attributes (``measure.records.Event``), on every device; what ``gpulab fit`` asks of each batch it
        checks."""
        live: dict[Any, Block] = {}
        failed: set[Any] = set()
        reserved = self._stats["reserved_bytes"][0]
        peak, ooms = reserved.current, 0
        malloc, free = self.malloc, self.free
        for ev in events:
            kind, sid = ev.kind, ev.sid
            if kind == "free":
                if sid in live:
                    free(live.pop(sid))
                else:
                    failed.discard(sid)
            elif kind == "alloc" or kind == "resize":
                if sid in live:
                    free(live.pop(sid))
                failed.discard(sid)
                try:
                    live[sid] = malloc(int(ev.nbytes or 0))
                except SimulatedOutOfMemoryError:
                    ooms += 1
                    failed.add(sid)
            else:
                raise ValueError(f"unknown event kind {kind!r} (expected alloc/free/resize)")
            if reserved.current > peak:
                peak = reserved.current
        return peak, ooms

    def check_invariants(self) -> None:
        """Verify internal consistency; raise ``AssertionError`` describing the first violation.

        Checks that blocks tile each segment, free neighbours are merged, the pools hold exactly
        the free mapped blocks, and the statistics equal what the blocks add up to.
        """
        free_in_pools = {id(b) for p in (self._small, self._large) for b in p.blocks.values()}
        unmapped_in_pools = {
            id(b) for p in (self._small, self._large) for b in p.unmapped.values()
        }
        seen_free: set[int] = set()
        seen_unmapped: set[int] = set()
        alloc = [0, 0, 0]
        requested = [0, 0, 0]
        count = [0, 0, 0]
        reserved = [0, 0, 0]
        segments = [0, 0, 0]
        inactive = [0, 0, 0]
        inactive_n = [0, 0, 0]
        for seg in self._segments.values():
            b = seg.head
            assert b is not None and b.prev is None, f"segment {seg.id}: bad head"
            assert b.addr == seg.base, f"segment {seg.id}: head not at segment base"
            pos, total, prev = seg.base, 0, None
            idx = seg.pool.stat_index
            while b is not None:
                assert not b.dead, "dead block linked"
                assert b.prev is prev, "broken prev link"
                assert b.addr == pos, f"segment {seg.id}: gap or overlap at {pos:#x}"
                assert b.seg == seg.id and b.pool is seg.pool
                assert b.size > 0
                if prev is not None and not b.allocated and not prev.allocated:
                    assert b.mapped != prev.mapped, f"segment {seg.id}: unmerged free neighbours"
                if b.allocated:
                    assert self._active.get(b.addr) is b and b.handle is not None
                    for i in (0, idx):
                        alloc[i] += b.size
                        requested[i] += b.requested
                        count[i] += 1
                elif b.mapped:
                    seen_free.add(id(b))
                    if not seg.expandable and b.is_split():
                        for i in (0, idx):
                            inactive[i] += b.size
                            inactive_n[i] += 1
                else:
                    assert seg.expandable
                    seen_unmapped.add(id(b))
                if b.mapped:
                    for i in (0, idx):
                        reserved[i] += b.size
                pos += b.size
                total += b.size
                prev, b = b, b.next
            assert total == seg.size, f"segment {seg.id}: blocks sum to {total}, not {seg.size}"
            if not seg.expandable:
                for i in (0, idx):
                    segments[i] += 1
        assert seen_free == free_in_pools, "pool free lists disagree with segments"
        assert seen_unmapped == unmapped_in_pools, "unmapped lists disagree with segments"
        assert len(self._active) == count[0]
        assert reserved[0] == self._total_reserved
        for name, want in (
            ("allocated_bytes", alloc), ("active_bytes", alloc), ("requested_bytes", requested),
            ("allocation", count), ("active", count), ("reserved_bytes", reserved),
            ("segment", segments), ("inactive_split_bytes", inactive),
            ("inactive_split", inactive_n),
        ):
            got = [s.current for s in self._stats[name]]
            assert got == want, f"{name}: stats say {got}, blocks add up to {want}"
        if self.capacity_bytes is not None:
            assert self._total_reserved <= self.capacity_bytes

    def __repr__(self) -> str:
        cap = "None" if self.capacity_bytes is None else format_size(self.capacity_bytes)
        return (
            f"CachingAllocator(allocated={format_size(self.memory_allocated())}, "
            f"reserved={format_size(self.memory_reserved())}, segments={len(self._segments)}, "
            f"capacity={cap}, max_split_size_mb={self.max_split_size_mb}, "
            f"expandable_segments={self.expandable_segments})"
        )

    # ---- internals: finding and carving blocks ------------------------------------------------

    def _get_free_block(self, pool: _Pool, size: int) -> _Blk | None:
        """Best fit: smallest cached block >= size, lowest address first (``get_free_block``)."""
        keys = pool.keys
        i = bisect.bisect_left(keys, (size, -1))  # pool.blocks.lower_bound(&p.search_key)
        if i == len(keys):
            return None
        blk = pool.blocks[keys[i]]
        if blk.expandable:
            # "for the purposes of best fit we consider its size to be the size it can expand to":
            # skip ahead while the next candidate could grow less than this one.
            while blk.expandable and i + 1 < len(keys):
                nxt = pool.blocks[keys[i + 1]]
                if _expandable_size(nxt) < _expandable_size(blk):
                    i, blk = i + 1, nxt
                else:
                    break
        # Do not return an oversized block for a large request
        if size < self.max_split_size and blk.size >= self.max_split_size:
            return None
        # Allow oversized block size to be rounded up but within a limit
        # (kLargeBuffer; max_non_split_rounding_size in newer releases)
        if size >= self.max_split_size and blk.size >= size + self.max_non_split_rounding_size:
            return None
        pool.erase(blk)
        return blk

    def _alloc_found_block(
        self, blk: _Blk, pool: _Pool, size: int, orig_size: int, split: bool
    ) -> Block:
        """Hand out ``blk``, splitting off the remainder if asked (``alloc_found_block``)."""
        idx = pool.stat_index
        already_split = blk.is_split()
        if split:
            remaining = blk
            blk = _Blk(remaining.addr, size, pool, remaining.seg, expandable=remaining.expandable)
            blk.prev = remaining.prev
            if blk.prev is not None:
                blk.prev.next = blk
            else:
                self._segments[blk.seg].head = blk
            blk.next = remaining
            remaining.prev = blk
            remaining.addr += size
            remaining.size -= size
            pool.insert(remaining)
            if already_split and not blk.expandable:
                # An already-split inactive block is being shrunk by size bytes.
                for i in (0, idx):
                    self._stats["inactive_split_bytes"][i].decrease(blk.size)
            elif not blk.expandable:
                # A new split inactive block is being created from a previously unsplit block.
                for i in (0, idx):
                    self._stats["inactive_split_bytes"][i].increase(remaining.size)
                    self._stats["inactive_split"][i].increase(1)
        elif already_split and not blk.expandable:
            # An already-split block is becoming active
            for i in (0, idx):
                self._stats["inactive_split_bytes"][i].decrease(blk.size)
                self._stats["inactive_split"][i].decrease(1)

        return self._hand_out(blk, orig_size)

    def _hand_out(self, blk: _Blk, orig_size: int) -> Block:
        """Mark ``blk`` allocated for ``orig_size`` requested bytes, count it, return its handle."""
        blk.allocated = True
        blk.requested = orig_size
        for i in (0, blk.pool.stat_index):
            self._stats["allocation"][i].increase(1)
            self._stats["allocated_bytes"][i].increase(blk.size)
            self._stats["active"][i].increase(1)
            self._stats["active_bytes"][i].increase(blk.size)
            self._stats["requested_bytes"][i].increase(orig_size)
        if blk.size >= self.max_split_size:
            self._oversize_allocations.increase(1)
        handle = Block(addr=blk.addr, size=blk.size, requested=orig_size, segment=blk.seg,
                       pool=blk.pool.name, allocated=True, _owner=self)
        blk.handle = handle
        self._active[blk.addr] = blk
        return handle

    def _free_block(self, blk: _Blk) -> None:
        """Put a freed block back in its pool, merging free neighbours (``free_block``)."""
        pool = blk.pool
        original_size = blk.size
        requested = blk.requested
        blk.requested = 0
        net_blocks = 0
        net_bytes = 0
        for candidate in (blk.prev, blk.next):
            subsumed = self._try_merge_blocks(blk, candidate, pool)
            if subsumed > 0:
                net_blocks -= 1
                net_bytes -= subsumed
        pool.insert(blk)
        if blk.is_split():
            net_blocks += 1
            net_bytes += blk.size
        for i in (0, pool.stat_index):
            # inactive_split excludes expandable segments, as in the source
            if not blk.expandable:
                if net_blocks > 0:
                    self._stats["inactive_split"][i].increase(net_blocks)
                elif net_blocks < 0:
                    self._stats["inactive_split"][i].decrease(-net_blocks)
                if net_bytes > 0:
                    self._stats["inactive_split_bytes"][i].increase(net_bytes)
                elif net_bytes < 0:
                    self._stats["inactive_split_bytes"][i].decrease(-net_bytes)
            self._stats["active"][i].decrease(1)
            self._stats["active_bytes"][i].decrease(original_size)
            self._stats["requested_bytes"][i].decrease(requested)

    def _try_merge_blocks(self, dst: _Blk, src: _Blk | None, pool: _Pool) -> int:
        """Absorb free neighbour ``src`` into ``dst``; return its size (``try_merge_blocks``)."""
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        if dst.prev is src:  # [src dst]
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
            else:
                self._segments[dst.seg].head = dst
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        if src.mapped:
            pool.erase(src)
        else:
            pool.erase_unmapped(src)
        dst.size += src.size
        src.dead = True
        return src.size

    # ---- internals: obtaining and releasing device memory -------------------------------------

    def _alloc_block(
        self, pool: _Pool, size: int, alloc_size: int, *, is_retry: bool
    ) -> _Blk | None:
        """cudaMalloc a segment of ``alloc_size``, or grow an expandable one (``alloc_block``)."""
        if is_retry:
            self._counters["num_alloc_retries"] += 1
        if self.expandable_segments:
            return self._try_allocate_expandable_block(pool, size)
        # cudaMalloc fails (cudaErrorMemoryAllocation) when the capacity would be exceeded; the
        # same test as set_fraction's `total_allocated_memory + size > allowed_memory_maximum`.
        cap = self.capacity_bytes
        if cap is not None and self._total_reserved + alloc_size > cap:
            return None
        seg = self._new_segment(pool, alloc_size)
        blk = _Blk(seg.base, alloc_size, pool, seg.id)
        seg.head = blk
        self._total_reserved += alloc_size
        for i in (0, pool.stat_index):
            self._stats["segment"][i].increase(1)
            self._stats["reserved_bytes"][i].increase(alloc_size)
        if alloc_size >= self.max_split_size:
            self._oversize_segments.increase(1)
        self._counters["num_device_alloc"] += 1
        return blk

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """Free oversize cached blocks, enough for ``size`` (``release_available_cached_blocks``).

        NB: the source releases the chosen blocks unconditionally; here split or expandable blocks
        are skipped (releasing them would break their segment). With the default
        ``max_split_size`` (unlimited) this does nothing, as in the source.
        """
        if self.max_split_size == SIZE_MAX:
            return False
        key_size = max(size, self.max_split_size)
        keys = pool.keys
        i = bisect.bisect_left(keys, (key_size, -1))
        if i == len(keys):
            # No single block is large enough; free multiple oversize blocks, largest first
            if i == 0:
                return False
            released = 0
            i -= 1
            while released < key_size and i >= 0:
                blk = pool.blocks[keys[i]]
                if blk.size < self.max_split_size:
                    break
                if not blk.is_split() and not blk.expandable:
                    released += blk.size
                    self._release_block(blk)
                i -= 1
            return released >= key_size
        blk = pool.blocks[keys[i]]
        if blk.is_split() or blk.expandable:
            return False
        self._release_block(blk)
        return True

    def _release_cached_blocks(self) -> bool:
        """Free all non-split cached blocks (``release_cached_blocks`` / ``release_blocks``)."""
        self._counters["num_sync_all_streams"] += 1  # synchronize_and_free_events
        for pool in (self._large, self._small):
            to_unmap: list[_Blk] = []
            for key in list(pool.keys):
                blk = pool.blocks[key]
                if blk.expandable:
                    to_unmap.append(blk)
                elif blk.prev is None and blk.next is None:
                    self._release_block(blk)
            for blk in to_unmap:
                if blk.dead:
                    continue
                self._unmap_block(blk)
                if blk.prev is None and blk.next is None and not blk.mapped:
                    self._release_expandable_segment(blk)
        return True

    def _release_block(self, blk: _Blk) -> None:
        """cudaFree a whole free segment (``release_block``)."""
        assert not blk.expandable and not blk.is_split() and not blk.allocated
        pool = blk.pool
        pool.erase(blk)
        self._total_reserved -= blk.size
        for i in (0, pool.stat_index):
            self._stats["segment"][i].decrease(1)
            self._stats["reserved_bytes"][i].decrease(blk.size)
        if blk.size >= self.max_split_size:
            self._oversize_segments.decrease(1)
        self._counters["num_device_free"] += 1
        del self._segments[blk.seg]
        blk.dead = True

    def _new_segment(self, pool: _Pool, size: int, *, expandable: bool = False,
                     page: int = 0) -> _Seg:
        base = self._segment_address
        if expandable and base is not None and (self._room_at(base) or 0) >= page:
            # NB: a virtual range placed where the trace says ends before the next segment held
            size = min(size, (self._room_at(base) or 0) // page * page)
        if base is None or self._overlaps(base, size):
            align = max(ROUND_LARGE, page)
            base = _ceil_div(self._next_address, align) * align
        self._segment_address = None
        self._next_address = max(self._next_address, base + size)
        seg = _Seg(self._next_segment_id, pool, base, size, expandable=expandable, page=page)
        self._next_segment_id += 1
        self._segments[seg.id] = seg
        return seg

    def _room_at(self, base: int) -> int | None:
        """Bytes from ``base`` to the next segment held above it (None: ``base`` is inside one)."""
        room = None
        for seg in self._segments.values():
            if seg.base <= base < seg.base + seg.size:
                return None
            if seg.base > base:
                room = seg.base - base if room is None else min(room, seg.base - base)
        return DEFAULT_VIRTUAL_BYTES * 1024 if room is None else room

    def _overlaps(self, base: int, size: int) -> bool:
        """Whether [base, base + size) meets a segment the simulator holds."""
        return any(base < seg.base + seg.size and seg.base < base + size
                   for seg in self._segments.values())

    # ---- internals: expandable segments -------------------------------------------------------
    # NB: one ExpandableSegment per pool (one stream); its virtual size is 9/8 of the capacity
    # (`prop.totalGlobalMem + prop.totalGlobalMem / 8`), or DEFAULT_VIRTUAL_BYTES with no
    # capacity. Pages are 2 MiB (small pool) and 20 MiB (large pool). Mapping fails when the
    # mapped pages would exceed the capacity (cuMemCreate's CUDA_ERROR_OUT_OF_MEMORY). As in the
    # source, memory_stats() counts no "segment" for expandable memory, only reserved bytes.

    def _try_allocate_expandable_block(self, pool: _Pool, size: int) -> _Blk | None:
        """Map enough pages at the lowest fitting address (``try_allocate_expandable_block``)."""
        candidate = self._find_expandable_block(pool, size)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            # invariant: free -> unmapped -> *; map_block maps some of it and merges with free
            remaining = size - candidate.size
            nxt = candidate.next
            assert nxt is not None and not nxt.mapped
            if not self._map_block(nxt, min(remaining, nxt.size)):
                return None
            candidate = nxt
        pool.erase(candidate)
        return candidate

    def _find_expandable_block(self, pool: _Pool, size: int) -> _Blk:
        """Lowest address where free + unmapped space fits ``size`` (``find_expandable_block``)."""

        def allocatable(b: _Blk | None) -> bool:
            return b is not None and not b.allocated

        def has_available_address_space(b: _Blk | None) -> bool:
            got = 0
            while got < size and b is not None and allocatable(b):
                got += b.size
                b = b.next
            return got >= size

        for addr in pool.unmapped_addrs:
            c = pool.unmapped[addr]
            if allocatable(c.prev):
                c = c.prev  # a free mapped block right before the gap can be used too
            if has_available_address_space(c):
                return c
        page = EXPANDABLE_PAGE_SMALL if pool.is_small else EXPANDABLE_PAGE_LARGE
        total = DEFAULT_VIRTUAL_BYTES if self.capacity_bytes is None else self.capacity_bytes
        virtual = _ceil_div(total + total // 8, page) * page
        seg = self._new_segment(pool, virtual, expandable=True, page=page)
        blk = _Blk(seg.base, virtual, pool, seg.id, mapped=False, expandable=True)
        seg.head = blk
        pool.insert_unmapped(blk)
        return blk

    def _map_block(self, to_map: _Blk, size: int) -> bool:
        """Back the first ``size`` bytes (whole pages) of an unmapped range (``map_block``)."""
        seg = self._segments[to_map.seg]
        rel = to_map.addr - seg.base
        begin = rel // seg.page  # segmentLeft
        end = _ceil_div(rel + size, seg.page)  # segmentRight
        mapped = (end - begin) * seg.page
        if mapped == 0:
            return False
        if self.capacity_bytes is not None and self._total_reserved + mapped > self.capacity_bytes:
            return False  # cuMemCreate -> CUDA_ERROR_OUT_OF_MEMORY; pages created so far released
        pool = to_map.pool
        pool.erase_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            remaining = _Blk(to_map.addr + mapped, to_map.size - mapped, pool, to_map.seg,
                             mapped=False, expandable=True)
            remaining.prev = to_map
            remaining.next = to_map.next
            if to_map.next is not None:
                to_map.next.prev = remaining
            to_map.next = remaining
            pool.insert_unmapped(remaining)
            to_map.size = mapped
        self._try_merge_blocks(to_map, to_map.prev, pool)
        self._try_merge_blocks(to_map, to_map.next, pool)
        pool.insert(to_map)
        self._total_reserved += mapped
        for i in (0, pool.stat_index):
            self._stats["reserved_bytes"][i].increase(mapped)
        self._counters["num_device_alloc"] += 1
        return True

    def _unmap_block(self, blk: _Blk) -> None:
        """Unmap the whole pages inside a free block (``unmap_block``)."""
        seg = self._segments[blk.seg]
        pool = blk.pool
        rel = blk.addr - seg.base
        begin = _ceil_div(rel, seg.page)  # segmentRight(ptr)
        end = (rel + blk.size) // seg.page  # segmentLeft(ptr + size)
        if begin >= end:
            return
        pool.erase(blk)
        u_addr = seg.base + begin * seg.page
        u_size = (end - begin) * seg.page
        before = u_addr - blk.addr
        if before > 0:  # prev? -> before_free -> block
            bf = _Blk(blk.addr, before, pool, blk.seg, expandable=True)
            bf.prev, bf.next = blk.prev, blk
            if blk.prev is not None:
                blk.prev.next = bf
            else:
                seg.head = bf
            blk.prev = bf
            pool.insert(bf)
        after = blk.size - (before + u_size)
        if after > 0:  # block -> after_free -> next?
            af = _Blk(u_addr + u_size, after, pool, blk.seg, expandable=True)
            af.prev, af.next = blk, blk.next
            if blk.next is not None:
                blk.next.prev = af
            blk.next = af
            pool.insert(af)
        blk.addr = u_addr
        blk.size = u_size
        blk.mapped = False
        self._try_merge_blocks(blk, blk.prev, pool)
        self._try_merge_blocks(blk, blk.next, pool)
        pool.insert_unmapped(blk)
        self._total_reserved -= u_size
        for i in (0, pool.stat_index):
            self._stats["reserved_bytes"][i].decrease(u_size)
        self._counters["num_device_free"] += 1

    def _release_expandable_segment(self, blk: _Blk) -> None:
        """Drop a wholly unmapped expandable segment (``release_expandable_segment``)."""
        seg = self._segments[blk.seg]
        assert blk.size == seg.size and not blk.mapped, "block disagrees with segment"
        blk.pool.erase_unmapped(blk)
        del self._segments[seg.id]
        blk.dead = True

    # ---- internals: reporting -----------------------------------------------------------------

    def _segment_info(self, seg: _Seg, run: list[_Blk]) -> Segment:
        start = run[0].addr
        blocks = tuple(
            BlockInfo(addr=b.addr, offset=b.addr - start, size=b.size, allocated=b.allocated,
                      requested=b.requested if b.allocated else 0)
            for b in run
        )
        return Segment(id=seg.id, pool=seg.pool.name, address=start,
                       size=sum(b.size for b in run), blocks=blocks, expandable=seg.expandable)

    def _oom_error(self, nbytes: int, alloc_size: int) -> SimulatedOutOfMemoryError:
        """PyTorch's OOM message (``malloc``: "CUDA out of memory. Tried to allocate ...")."""
        allocated = self.memory_allocated()
        reserved = self.memory_reserved()
        cap = self.capacity_bytes if self.capacity_bytes is not None else 0
        # NB: cudaMemGetInfo's "free" would also exclude the CUDA context and other processes.
        free = max(cap - self._total_reserved, 0)
        msg = (
            f"CUDA out of memory (simulated). Tried to allocate {format_size(alloc_size)}. "
            f"GPU 0 has a total capacity of {format_size(cap)} of which {format_size(free)} "
            f"is free. Of the allocated memory {format_size(allocated)} is allocated by PyTorch, "
            f"and {format_size(reserved - allocated)} is reserved by PyTorch but unallocated. "
            "If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
        )
        return SimulatedOutOfMemoryError(
            msg, requested=nbytes, alloc_size=alloc_size, capacity=self.capacity_bytes,
            free=free, allocated=allocated, reserved=reserved,
        )


def _append_block(seg: "_Seg", prev: "_Blk | None", blk: "_Blk") -> "_Blk":
    """``blk`` put after ``prev`` in ``seg``'s address-ordered list (first when ``prev`` is None),
    as a segment taken over from a file is laid out; returns ``blk``."""
    blk.prev = prev
    if prev is None:
        seg.head = blk
    else:
        prev.next = blk
    return blk


def _segment_blocks(blocks: Iterable[tuple[int, int | None]]) -> list[list[Any]]:
    """``add_segment``'s blocks checked, free neighbours merged into one (as ``try_merge_blocks``
    always leaves them): a list of [size, requested bytes or None]."""
    merged: list[list[Any]] = []
    for size, requested in blocks:
        size = int(size)
        if size <= 0 or size % MIN_BLOCK_SIZE:
            raise ValueError(f"add_segment: block size {size} is not a positive multiple of "
                             f"{MIN_BLOCK_SIZE} bytes (round_size)")
        if requested is not None and not 0 <= int(requested) <= size:
            raise ValueError(f"add_segment: {requested} bytes requested from a {size}-byte block")
        if requested is None and merged and merged[-1][1] is None:
            merged[-1][0] += size
        else:
            merged.append([size, None if requested is None else int(requested)])
    if not merged:
        raise ValueError("add_segment: a segment needs at least one block")
    return merged


def _expandable_size(b: _Blk) -> int:
    """Size a free block could grow to by mapping the unmapped range after it."""
    return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)


def _event_field(ev: Any, name: str, default: Any = ...) -> Any:
    """Read ``name`` from an event object or mapping."""
    if isinstance(ev, dict):
        if default is ... and name not in ev:
            raise ValueError(f"event {ev!r} has no {name!r}")
        return ev.get(name, default)
    if default is ...:
        try:
            return getattr(ev, name)
        except AttributeError:
            raise ValueError(f"event {ev!r} has no attribute {name!r}") from None
    return getattr(ev, name, default)


# One segment as ``torch.cuda.memory_snapshot()`` lists it: its pool ("small" / "large") and its
# blocks in address order, each (size, allocated).
SegmentLayout = tuple[str, tuple[tuple[int, bool], ...]]


def rebuilt_allocator(segments: Iterable[SegmentLayout], **kwargs: Any) -> CachingAllocator | None:
    """A simulated allocator holding these segments, blocks where the real one has them, so that a
    replay starting from it uses their free room as the real allocator does (a run after a
    warm-up starts with the cuBLAS workspace's segment and the free room beside it).

    A large segment is made whole (one request of its size, freed), then its blocks are requested
    in address order; a small segment comes with its first block; the free room is requested too
    and freed at the end, when it merges back into the free blocks it was. None when the result is
    not the layout asked for (e.g. expandable segments)."""
    layout = [(pool, tuple((int(n), bool(used)) for n, used in blocks)) for pool, blocks in segments]
    sim = CachingAllocator(**kwargs)
    gaps = []
    try:
        for pool, blocks in layout:
            if pool != "small":
                sim.free(sim.malloc(sum(n for n, _ in blocks)))
            for nbytes, used in blocks:
                if used:
                    sim.malloc(nbytes)
                    continue
                # free room is held while the rest is built (so no later block lands in it), in
                # pieces a small segment serves (a request over 1 MiB would go to the large pool)
                while nbytes > 0:
                    piece = min(nbytes, SMALL_SIZE) if pool == "small" else nbytes
                    gaps.append(sim.malloc(piece))
                    nbytes -= piece
        for blk in gaps:
            sim.free(blk)
    except SimulatedOutOfMemoryError:
        return None
    rebuilt = sorted((seg.pool, tuple((b.size, b.allocated) for b in seg.blocks)) for seg in sim.segment_map())
    return sim if rebuilt == sorted(layout) else None


def simulate(
    events: Iterable[Any], *, cuda_only: bool = False, strict: bool = True,
    **allocator_kwargs: Any,
) -> ReplayResult:
    """Replay ``events`` through a new :class:`CachingAllocator` built from ``allocator_kwargs``."""
    return CachingAllocator(**allocator_kwargs).replay(events, cuda_only=cuda_only, strict=strict)
