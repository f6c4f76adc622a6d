"""Reading a CUDA out-of-memory message: every figure in it, which case it is, and the situation
rebuilt in the simulated caching allocator.

PyTorch writes the message in ``DeviceCachingAllocator::malloc`` (``c10/cuda/CUDACachingAllocator.cpp``)
when ``cudaMalloc`` fails even after the allocator freed its unused cached segments. Two formats:

* **current** (PyTorch 2.x): ``CUDA out of memory. Tried to allocate {alloc_size}. GPU {n} has a
  total capacity of {total} of which {free} is free. [Process {pid} has {x} memory in use. ]...
  [Including non-PyTorch memory, this process has {x} memory in use. ][{allowed} allowed; ]Of the
  allocated memory {allocated} is allocated by PyTorch, [with {x} allocated in private pools (e.g.,
  CUDA Graphs), ]and {reserved - allocated} is reserved by PyTorch but unallocated. If reserved but
  unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid
  fragmentation.  See documentation for Memory Management  ({url})``. The URL is
  ``https://pytorch.org/docs/stable/notes/cuda.html#environment-variables`` in earlier 2.x
  releases, ``https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf``
  in recent ones (torch 2.15's ``libc10_cuda.so``).
* **legacy** (PyTorch 1.x): ``CUDA out of memory. Tried to allocate {alloc_size} (GPU {n};
  {total} total capacity; {allocated} already allocated; {free} free; [{allowed} allowed; ]{reserved}
  reserved in total by PyTorch)``, later followed by `` If reserved memory is >> allocated memory
  try setting max_split_size_mb to avoid fragmentation.  See documentation for Memory Management
  and PYTORCH_CUDA_ALLOC_CONF``.

Sizes are printed by ``format_size`` (``gpulab.allocator.simulator.format_size``): "N bytes" up to 1 KiB,
then KiB / MiB / GiB with two decimals, so each figure is known to half a unit of its last digit.
"Tried to allocate" is ``alloc_size``: the *segment* the allocator asked ``cudaMalloc`` for
(``get_allocation_size``: 2 MiB for a request up to 1 MiB, 20 MiB for 1-10 MiB, else the request
rounded up to 2 MiB), not always the tensor's own size. "free" is ``cudaMemGetInfo``'s: what the
whole device still has, after every process and the CUDA context.

Library code: results are data with HTML views; a message gpulab cannot read raises
:class:`OOMParseError` (a ``ValueError``) whose text starts "could not read this message".
"""
from __future__ import annotations

import html
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from gpulab.allocator.simulator import LARGE_BUFFER, MIN_BLOCK_SIZE, MIN_LARGE_ALLOC, ROUND_LARGE, SMALL_BUFFER, SMALL_SIZE, CachingAllocator, SimulatedOutOfMemoryError, format_size, get_allocation_size, round_size
from gpulab.tables import STYLE, html_table
from gpulab.units import GiB, KiB, MiB, format_bytes

FORMAT_CURRENT = "current"
FORMAT_LEGACY = "legacy"
DOCS_URL_2X = "https://pytorch.org/docs/stable/notes/cuda.html#environment-variables"
DOCS_URL_CURRENT = ("https://docs.pytorch.org/docs/stable/notes/cuda.html"
                    "#optimizing-memory-usage-with-pytorch-cuda-alloc-conf")
ADVICE_CURRENT = (" If reserved but unallocated memory is large try setting"
                  " PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid"
                  " fragmentation.  See documentation for Memory Management "
                  " ({url})")
ADVICE_LEGACY = (" If reserved memory is >> allocated memory try setting max_split_size_mb to avoid"
                 " fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF")

CASES = ("larger_than_gpu", "fragmentation", "other_processes", "memory_limit", "too_big")

_SIZE = r"(\d+ bytes|\d+\.\d+ (?:KiB|MiB|GiB))"
_UNITS = {"bytes": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB}
_HEAD = r"(?P<kind>CUDA|HIP) out of memory(?P<sim> \(simulated\))?\. Tried to allocate "
_CURRENT = re.compile(
    _HEAD + _SIZE.replace("(", "(?P<tried>", 1) + r"\. GPU (?P<gpu>\d+) has a total capaci?ty of "   # "capacty": PyTorch 2.1's spelling
    + _SIZE.replace("(", "(?P<total>", 1) + r" of which " + _SIZE.replace("(", "(?P<free>", 1)
    + r" is free\. (?P<procs>(?:(?:Process \d+|Including non-PyTorch memory, this process) has "
    + r"\d+(?:\.\d+)? (?:bytes|KiB|MiB|GiB) memory in use\. )*)"
    + r"(?:" + _SIZE.replace("(", "(?P<allowed>", 1) + r" allowed; )?"
    + r"Of the allocated memory " + _SIZE.replace("(", "(?P<allocated>", 1) + r" is allocated by PyTorch, "
    + r"(?:with " + _SIZE.replace("(", "(?P<private>", 1) + r" allocated in private pools \(e\.g\., CUDA Graphs\), )?"
    + r"and " + _SIZE.replace("(", "(?P<unallocated>", 1) + r" is reserved by PyTorch but unallocated\.")
_LEGACY = re.compile(
    _HEAD + _SIZE.replace("(", "(?P<tried>", 1) + r" \(GPU (?P<gpu>\d+); " + _SIZE.replace("(", "(?P<total>", 1)
    + r" total capacity; " + _SIZE.replace("(", "(?P<allocated>", 1) + r" already allocated; "
    + _SIZE.replace("(", "(?P<free>", 1) + r" free; (?:" + _SIZE.replace("(", "(?P<allowed>", 1) + r" allowed; )?"
    + _SIZE.replace("(", "(?P<reserved>", 1) + r" reserved in total by PyTorch\)")
_PROC = re.compile(r"(?:Process (?P<pid>\d+)|Including non-PyTorch memory, this process) has " + _SIZE + " memory in use")


class OOMParseError(ValueError):
    """The text is not an out-of-memory message gpulab can read; the message says why and what to paste."""


@dataclass(frozen=True)
class Amount:
    """One figure of the message: as printed, in bytes (nearest), and how far off that can be."""

    text: str
    bytes: int
    resolution: int   # half a unit of the last printed digit (0 for "N bytes")

    @classmethod
    def parse(cls, text: str) -> "Amount":
        number, unit = text.split(" ")
        scale = _UNITS[unit]
        if unit == "bytes":
            return cls(text, int(number), 0)
        return cls(text, int(round(float(number) * scale)), scale // 200)

    @classmethod
    def exact(cls, nbytes: int) -> "Amount":
        return cls(format_size(nbytes), int(nbytes), 0)

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class OOMMessage:
    """Every figure of an out-of-memory message (bytes; see :class:`Amount` for the precision).

    ``reserved`` is PyTorch's reserved memory: given in the legacy format, allocated + unallocated
    (+ private pools) in the current one; ``unallocated`` the reverse. ``this_process`` and
    ``other_processes`` (pid, bytes) come from NVML and appear only when PyTorch could ask it."""

    text: str
    format: str
    kind: str
    gpu: int
    tried: Amount
    total: Amount
    free: Amount
    allocated: Amount
    reserved: Amount
    unallocated: Amount
    this_process: Amount | None = None
    other_processes: tuple[tuple[int, Amount], ...] = ()
    allowed: Amount | None = None
    private_pools: Amount | None = None
    advice: str = ""          # "expandable_segments", "max_split_size_mb" or ""
    simulated: bool = False   # gpulab's simulator wrote it ("CUDA out of memory (simulated)")

    @property
    def others_bytes(self) -> int:
        return sum(a.bytes for _, a in self.other_processes)

    def rows(self) -> list[list[str]]:
        """What each figure is, as a table."""
        rows = [["Tried to allocate", self.tried.text,
                 "the new segment the allocator asked cudaMalloc for (get_allocation_size of the request): "
                 "2 MiB for a request up to 1 MiB, 20 MiB for 1–10 MiB, else the request rounded up to 2 MiB"],
                [f"GPU {self.gpu} total capacity", self.total.text, "the device's memory (cudaMemGetInfo's total)"],
                ["free", self.free.text, "what the device still had, for any process (cudaMemGetInfo's free)"]]
        for pid, amount in self.other_processes:
            rows.append([f"process {pid}", amount.text, "another process on this GPU (NVML): its memory is not yours to use"])
        if self.this_process is not None:
            rows.append(["this process (NVML)", self.this_process.text,
                         "everything this process holds on the GPU: PyTorch's reserved memory plus the CUDA "
                         "context and memory allocated outside PyTorch"])
        if self.allowed is not None:
            rows.append(["allowed", self.allowed.text, "torch.cuda.set_per_process_memory_fraction's limit"])
        rows.append(["allocated by PyTorch", self.allocated.text, "blocks handed to live tensors (memory_allocated())"])
        if self.private_pools is not None:
            rows.append(["in private pools", self.private_pools.text, "held by CUDA Graphs' private memory pools"])
        rows.append(["reserved but unallocated", self.unallocated.text,
                     "cached free blocks inside segments that still hold live tensors (the allocator already "
                     "returned wholly free segments before raising): fragmentation"])
        rows.append(["reserved by PyTorch", self.reserved.text, "segments (memory_reserved())"
                     + ("" if self.format == FORMAT_LEGACY else ": allocated + unallocated")])
        return rows

    def _repr_html_(self) -> str:
        table = html_table(["figure", "value", "what it is"], self.rows(), f"{self.format} format message, GPU {self.gpu}")
        return ("<div class='gpulab-oom-figures'><style>.gpulab-oom-figures td:last-child,"
                ".gpulab-oom-figures th:last-child{text-align:left}</style>" + table + "</div>")


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def parse_oom_message(text: Any) -> OOMMessage:
    """Every figure of a CUDA out-of-memory message (a whole traceback may be pasted: the message
    is found inside it). Raises :class:`OOMParseError` with what is wrong and what to paste."""
    paste = ("Paste the whole line that starts with 'torch.OutOfMemoryError: CUDA out of memory' "
             "(or 'RuntimeError: CUDA out of memory'), from 'Tried to allocate' to the end.")
    if not isinstance(text, str):
        raise OOMParseError(f"could not read this message: expected text (a str), got {type(text).__name__}. {paste}")
    flat = _normalise(text)
    if not flat:
        raise OOMParseError(f"could not read this message: it is empty. {paste}")
    if "out of memory" not in flat:
        if "can't allocate memory" in flat or "DefaultCPUAllocator" in flat:
            raise OOMParseError("could not read this message: it is the CPU's (DefaultCPUAllocator: can't allocate "
                                "memory), not a GPU's; the machine's RAM ran out, and its figures are not a GPU's.")
        raise OOMParseError(f"could not read this message: it does not say 'CUDA out of memory'. {paste}")
    if "Tried to allocate more than 1EB memory" in flat:
        raise OOMParseError("could not read this message as figures: 'Tried to allocate more than 1EB memory' "
                            "means a size was absurd (a negative or overflowing shape), not that memory ran out; "
                            "print the shapes of the tensors the failing line creates.")
    if "preemptively rejected" in flat:
        raise OOMParseError("could not read this message as figures: the allocator rejected the request before "
                            "asking CUDA, because it would exceed the limit set with "
                            "torch.cuda.set_per_process_memory_fraction; raise or remove that limit.")
    m = _CURRENT.search(flat)
    if m is not None:
        return _current(m, flat)
    m = _LEGACY.search(flat)
    if m is not None:
        return _legacy(m, flat)
    raise OOMParseError("could not read this message: it says 'out of memory' but its figures are not in a format "
                        "gpulab knows (PyTorch 1.x: '(GPU 0; … total capacity; … already allocated; …)'; 2.x: "
                        f"'GPU 0 has a total capacity of … of which … is free. … Of the allocated memory …'). {paste}")


def _current(m: re.Match, flat: str) -> OOMMessage:
    A = Amount.parse
    allocated, unallocated = A(m["allocated"]), A(m["unallocated"])
    private = A(m["private"]) if m["private"] else None
    reserved_bytes = allocated.bytes + unallocated.bytes
    # "allocated by PyTorch" already includes the private pools (allocated_bytes + allocated_in_private_pools)
    reserved = Amount(format_size(reserved_bytes), reserved_bytes, allocated.resolution + unallocated.resolution)
    others: list[tuple[int, Amount]] = []
    this = None
    for p in _PROC.finditer(m["procs"] or ""):
        if p["pid"] is None:
            this = A(p.group(2))
        else:
            others.append((int(p["pid"]), A(p.group(2))))
    tail = flat[m.end():]
    advice = ("expandable_segments" if "expandable_segments:True" in tail[:200]
              else "max_split_size_mb" if "max_split_size_mb" in tail[:200] else "")   # 2.1's advice
    return OOMMessage(flat[m.start():], FORMAT_CURRENT, m["kind"], int(m["gpu"]), A(m["tried"]), A(m["total"]),
                      A(m["free"]), allocated, reserved, unallocated, this, tuple(others),
                      A(m["allowed"]) if m["allowed"] else None, private, advice, bool(m["sim"]))


def _legacy(m: re.Match, flat: str) -> OOMMessage:
    A = Amount.parse
    allocated, reserved = A(m["allocated"]), A(m["reserved"])
    un = max(0, reserved.bytes - allocated.bytes)
    unallocated = Amount(format_size(un), un, allocated.resolution + reserved.resolution)
    advice = "max_split_size_mb" if "max_split_size_mb" in flat[m.end():][:200] else ""
    return OOMMessage(flat[m.start():], FORMAT_LEGACY, m["kind"], int(m["gpu"]), A(m["tried"]), A(m["total"]),
                      A(m["free"]), allocated, reserved, unallocated, None, (), A(m["allowed"]) if m["allowed"] else None,
                      None, advice, bool(m["sim"]))


def format_oom_message(tried: int, total: int, free: int, allocated: int, reserved: int, *, gpu: int = 0,
                       this_process: int | None = None, other_processes: Sequence[tuple[int, int]] = (),
                       allowed: int | None = None, private_pools: int = 0, style: str = "current",
                       simulated: bool = False) -> str:
    """The message PyTorch would print for these figures (bytes), character for character.

    ``style``: "current" (torch 2.15's text, docs.pytorch.org URL), "2.x" (the earlier 2.x URL),
    "legacy" (1.x with the max_split_size_mb advice) or "legacy-plain" (older 1.x, no advice).
    ``tried`` is the segment size (``alloc_size``), as in PyTorch. ``simulated`` inserts
    "(simulated)" after "CUDA out of memory", as gpulab's simulator does."""
    head = "CUDA out of memory" + (" (simulated)" if simulated else "") + ". Tried to allocate "
    allowed_info = f"{format_size(allowed)} allowed; " if allowed is not None else ""
    if style in ("legacy", "legacy-plain"):
        msg = (f"{head}{format_size(tried)} (GPU {gpu}; {format_size(total)} total capacity; "
               f"{format_size(allocated)} already allocated; {format_size(free)} free; {allowed_info}"
               f"{format_size(reserved)} reserved in total by PyTorch)")
        return msg + (ADVICE_LEGACY if style == "legacy" else "")
    if style not in ("current", "2.x"):
        raise ValueError(f"unknown style {style!r}; valid: current, 2.x, legacy, legacy-plain")
    proc = "".join(f"Process {pid} has {format_size(b)} memory in use. " for pid, b in other_processes)
    if this_process is not None:
        proc += f"Including non-PyTorch memory, this process has {format_size(this_process)} memory in use. "
    private = (f"with {format_size(private_pools)} allocated in private pools (e.g., CUDA Graphs), "
               if private_pools > 0 else "")
    url = DOCS_URL_CURRENT if style == "current" else DOCS_URL_2X
    return (f"{head}{format_size(tried)}. GPU {gpu} has a total capacity of {format_size(total)} of which "
            f"{format_size(free)} is free. {proc}{allowed_info}Of the allocated memory "
            f"{format_size(allocated + private_pools)} is allocated by PyTorch, {private}and "
            f"{format_size(reserved - allocated - private_pools)} is reserved by PyTorch but unallocated."
            + ADVICE_CURRENT.format(url=url))


# ---- which case is it? ---------------------------------------------------------------------------------

LEVERS_SMALLER = [
    "a smaller batch, or gradient accumulation to keep the effective batch (lesson 04)",
    "an optimizer with less state: SGD ×2 and momentum ×3 of the parameters vs Adam ×4 (lesson 05)",
    "inplace ops and no_grad / inference_mode where no backward is needed (lesson 06)",
    "activation checkpointing: recompute instead of storing (lesson 07)",
    "mixed precision (autocast bf16/fp16) or pure bf16 (lesson 08)",
    "sharding over several GPUs: ZeRO / FSDP split parameters, gradients and optimizer state (lesson 12)",
]
LEVERS_FRAGMENTATION = [
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before the first CUDA allocation): segments "
    "grow in place, so free pieces at their ends can be reused or unmapped (lesson 09)",
    "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:N (N ≥ 20): blocks of N MiB or more are never split into "
    "a tensor and a sliver; such cached blocks are freed and retried before an OOM",
    "fewer differently sized tensors: fixed or bucketed shapes (padding sequences to a few lengths)",
]


@dataclass
class OOMDiagnosis:
    """Which case an out-of-memory message is, why, and what to do about it."""

    message: OOMMessage
    case: str
    title: str
    reasons: list[str]
    levers: list[str]
    shortfall_bytes: int      # bytes missing even if fragmentation were fixed (≤ 0: none)
    margin_bytes: int         # the uncertainty of the figures behind the verdict (their printed precision)

    def _repr_html_(self) -> str:
        items = "".join(f"<li>{html.escape(r)}</li>" for r in self.reasons)
        levers = "".join(f"<li>{html.escape(x)}</li>" for x in self.levers)
        return (f"{STYLE}<div class='gpulab-oom'><p><b>{html.escape(self.title)}</b> "
                f"<span class='gpulab-label'>(case: {self.case})</span></p><ul>{items}</ul>"
                f"<p>What to do:</p><ol>{levers}</ol></div>" + self.message._repr_html_())

    def __repr__(self) -> str:
        return f"OOMDiagnosis({self.case}: {self.title})"


def diagnose(message: OOMMessage | str) -> OOMDiagnosis:
    """Sort a message into one of ``CASES``:

    * ``larger_than_gpu``: the one request is bigger than the whole device (or the allowed limit);
    * ``fragmentation``: the device's free memory was too small, but free + reserved-but-unallocated
      would have held it: the memory is there, in pieces (expandable_segments / max_split_size_mb);
    * ``other_processes``: it would fit if other processes on the GPU released theirs;
    * ``memory_limit``: a per-process memory fraction stops it short of the device;
    * ``too_big``: the live tensors and the request together do not fit: need less memory (the
      levers of lessons 04-08), or more GPUs (sharding)."""
    msg = parse_oom_message(message) if not isinstance(message, OOMMessage) else message
    X, F, U = msg.tried.bytes, msg.free.bytes, msg.unallocated.bytes
    margin = msg.tried.resolution + msg.free.resolution + msg.unallocated.resolution
    O = msg.others_bytes
    cap = msg.allowed.bytes if msg.allowed is not None else msg.total.bytes
    short = X - F - U
    sz = format_bytes
    reasons = [f"It asked for a new segment of {msg.tried} while the GPU had {msg.free} free"
               + (f": {sz(X - F)} short." if X > F else ".")]
    if X > cap:
        title = "One allocation is larger than the whole GPU."
        case = "larger_than_gpu"
        reasons.append(f"{msg.tried} is more than the {'allowed ' + str(msg.allowed) if msg.allowed else 'total capacity of ' + str(msg.total)}: "
                       "no allocator setting and no freeing of memory can help. Check the shapes and dtype "
                       "of the tensor the failing line makes (a wrong dimension, an accidental broadcast, "
                       "a float64).")
        levers = ["compute in chunks (e.g. attention or a loss over slices of the batch)",
                  "a smaller dtype (bf16/fp16, lesson 08)", LEVERS_SMALLER[5]]
    elif msg.allowed is not None and msg.reserved.bytes + X > msg.allowed.bytes and F >= X:
        case = "memory_limit"
        title = "A per-process memory limit, not the device, is the wall."
        reasons.append(f"torch.cuda.set_per_process_memory_fraction allows {msg.allowed} of {msg.total}; "
                       f"reserved {msg.reserved} + {msg.tried} would pass it, though the device has {msg.free} free.")
        levers = ["raise or remove the memory fraction"] + LEVERS_SMALLER[:2]
    elif short <= 0 and U > 0:
        case = "fragmentation"
        title = "Fragmentation: the memory is there, in pieces."
        reasons.append(f"PyTorch holds {msg.unallocated} reserved but unallocated, yet no free block was big "
                       f"enough: those bytes are slivers in segments that still hold live tensors. Free + "
                       f"unallocated = {sz(F + U)} ≥ {msg.tried}.")
        levers = LEVERS_FRAGMENTATION + [LEVERS_SMALLER[0]]
    elif O > 0 and short - O <= 0:
        case = "other_processes"
        title = "Other processes hold the memory this one needs."
        reasons.append(f"Other processes use {sz(O)} on this GPU; with that memory free, {msg.tried} would fit "
                       "(another notebook's kernel, a stale training run).")
        levers = ["stop the other processes (nvidia-smi lists them; restart or shut down other notebook kernels)",
                  "or make this process smaller (below)"] + LEVERS_SMALLER[:3]
    else:
        case = "too_big"
        title = "Too big: the live tensors and this request do not fit on the GPU."
        reasons.append(f"Even counting the {msg.unallocated} of cached free pieces, {sz(short)} is missing: "
                       f"live tensors take {msg.allocated}. Fragmentation is not the problem; the program needs "
                       f"at least {sz(short)} less at this moment if the free pieces could be used, {sz(X - F)} "
                       "less if they cannot (more, in practice: the next tensors need room too).")
        levers = list(LEVERS_SMALLER)
    if O > 0 and case != "other_processes":
        reasons.append(f"Other processes hold {sz(O)} on this GPU: that memory is not this process's to use.")
    if X in (SMALL_BUFFER, LARGE_BUFFER):
        reasons.append(f"{msg.tried} is a segment size: the tensor itself may have been smaller ("
                       + ("up to 1 MiB: small requests get a 2 MiB segment" if X == SMALL_BUFFER else
                          "1–10 MiB requests get a 20 MiB segment") + ").")
    if msg.this_process is not None:
        outside = msg.this_process.bytes - msg.reserved.bytes
        if outside > 0:
            reasons.append(f"This process holds {msg.this_process}, {sz(outside)} more than PyTorch's reserved "
                           f"{msg.reserved}: the CUDA context and memory allocated outside PyTorch.")
    if abs(short) <= margin and case in ("fragmentation", "too_big"):
        reasons.append("The figures are printed with two decimals, so this verdict is within their rounding: "
                       "treat it as borderline.")
    return OOMDiagnosis(msg, case, title, reasons, levers, short, margin)


# ---- the situation, rebuilt in the simulator -------------------------------------------------------------

def request_for(alloc_size: int) -> int:
    """A request whose new segment is ``alloc_size`` (``get_allocation_size``'s inverse): the
    message prints the segment, not the tensor. NB: for 2 MiB the request was at most 1 MiB, for
    20 MiB between 1 and 10 MiB *or* 18-20 MiB; the largest such request is taken."""
    if alloc_size <= SMALL_BUFFER:
        return SMALL_SIZE
    return max(MIN_BLOCK_SIZE, alloc_size // MIN_BLOCK_SIZE * MIN_BLOCK_SIZE)


@dataclass
class SimOutcome:
    """One simulated run of the rebuilt situation under one allocator setting."""

    setting: str
    ok: bool
    allocated: int
    reserved: int
    free: int
    message: str | None = None      # the simulated OOM message in PyTorch's format, when it failed

    def cells(self) -> list[str]:
        return [self.setting, "fits" if self.ok else "out of memory", format_size(self.allocated),
                format_size(self.reserved - self.allocated), format_size(self.free)]


@dataclass
class OOMReproduction:
    """The message's situation rebuilt in the simulated allocator: a device whose allocator may
    use PyTorch's reserved memory plus the free memory, holding the allocated bytes, with the
    unallocated bytes as free pieces (each too small for the request) inside segments that also
    hold live tensors; then the request. ``outcomes``: the same sequence under other settings."""

    diagnosis: OOMDiagnosis
    request_bytes: int
    capacity_bytes: int
    holes: int
    hole_bytes: int
    outcomes: list[SimOutcome]
    notes: list[str] = field(default_factory=list)

    @property
    def reproduced(self) -> bool:
        return not self.outcomes[0].ok

    @property
    def simulated_message(self) -> OOMMessage | None:
        text = self.outcomes[0].message
        return parse_oom_message(text) if text else None

    def figure_rows(self) -> list[list[str]]:
        m, sim = self.diagnosis.message, self.simulated_message
        def pair(label: str, a: Amount, b: Amount | None) -> list[str]:
            return [label, a.text, b.text if b is not None else "—"]
        return [pair("Tried to allocate", m.tried, sim.tried if sim else None),
                pair("free", m.free, sim.free if sim else None),
                pair("allocated by PyTorch", m.allocated, sim.allocated if sim else None),
                pair("reserved but unallocated", m.unallocated, sim.unallocated if sim else None)]

    def _repr_html_(self) -> str:
        pieces = (f"{self.holes} free piece{'s' if self.holes != 1 else ''} of {format_size(self.hole_bytes)} in "
                  f"segments with live tensors" if self.holes else "no free pieces")
        head = html_table(["figure", "in the message", "simulated allocator"], self.figure_rows(),
                          f"rebuilt: {pieces}, then a request of {format_size(self.request_bytes)}; the allocator "
                          f"may use {format_size(self.capacity_bytes)} (reserved + free)")
        out = html_table(["setting", "the request", "allocated", "reserved but unallocated", "free"],
                         [o.cells() for o in self.outcomes],
                         "the same sequence of requests under other settings (simulated allocator)")
        notes = "".join(f"<li>{html.escape(n)}</li>" for n in self.notes)
        return head + out + (f"<ul class='gpulab-label'>{notes}</ul>" if notes else "")


def _build(alloc: CachingAllocator, pieces: Sequence[tuple[int, int]], rest: int) -> None:
    """For each (segment, hole): a tensor of the whole segment, freed, then a tensor of the
    segment minus the hole in its place (the free block is split and the hole stays cached);
    then ``rest`` bytes of live tensors in a segment of their own."""
    for seg, hole in pieces:
        big = alloc.malloc(seg)
        alloc.free(big)
        alloc.malloc(seg - hole)
    if rest > 0:
        alloc.malloc(rest)


def _plan(allocated: int, unallocated: int, request: int) -> tuple[list[tuple[int, int]], int, list[str]]:
    """Segments with holes: every hole smaller than the request (so it cannot serve it) and larger
    than 1 MiB (a large-pool block is split only when more than 1 MiB would remain); every
    segment at least 10 MiB (so it is exactly its size) and its live part larger than its hole
    (so the next live part cannot land in an earlier hole)."""
    notes: list[str] = []
    # a request that fits in the small pool cannot use large-pool holes at all
    cap = request - MIN_BLOCK_SIZE if request > SMALL_SIZE else 64 * MiB
    cap = min(cap, 256 * MiB)
    if unallocated <= SMALL_SIZE or cap <= SMALL_SIZE:
        if unallocated > 0:
            notes.append(f"the {format_size(unallocated)} reserved but unallocated is not rebuilt: free pieces "
                         "this small (≤ 1 MiB, or no smaller than the request) cannot be made with large-pool rules")
        return [], _round_rest(allocated), notes
    k = -(-unallocated // cap)
    if k > 2000:
        k = 2000
        notes.append("the free pieces are rebuilt as 2,000 larger ones (the simulator's speed)")
    hole = max(SMALL_SIZE + MIN_BLOCK_SIZE, unallocated // k // MIN_BLOCK_SIZE * MIN_BLOCK_SIZE)
    hole = min(hole, cap)
    seg = max(MIN_LARGE_ALLOC, -(-(2 * hole + MIN_BLOCK_SIZE) // ROUND_LARGE) * ROUND_LARGE)
    live_each = seg - hole
    pieces = [(seg, hole)] * k
    rest = allocated - k * live_each
    if rest < 0:
        notes.append(f"allocated is rebuilt {format_size(-rest)} too high: {k} segments with a free piece each "
                     f"need at least {format_size(k * live_each)} of live tensors")
        rest = 0
    return pieces, _round_rest(rest), notes


def _round_rest(n: int) -> int:
    """Live bytes in a segment of their own, sized so that nothing free is left beside them:
    a multiple of 2 MiB, at least 10 MiB (kMinLargeAlloc), or nothing."""
    if n < MIN_LARGE_ALLOC // 2:
        return 0
    return max(MIN_LARGE_ALLOC, round(n / ROUND_LARGE) * ROUND_LARGE)


def _run(setting: str, kwargs: dict[str, Any], pieces, rest: int, request: int, capacity: int,
         total: int, outside: int, gpu: int) -> SimOutcome:
    alloc = CachingAllocator(capacity_bytes=capacity, **kwargs)
    try:
        _build(alloc, pieces, rest)
    except SimulatedOutOfMemoryError as exc:
        return SimOutcome(setting + " (failed while rebuilding)", False, exc.allocated, exc.reserved,
                          exc.free or 0, None)
    try:
        alloc.malloc(request)
    except SimulatedOutOfMemoryError as exc:
        text = format_oom_message(exc.alloc_size, total, exc.free or 0, exc.allocated, exc.reserved, gpu=gpu,
                                  this_process=exc.reserved + outside if outside >= 0 else None, simulated=True)
        return SimOutcome(setting, False, exc.allocated, exc.reserved, exc.free or 0, text)
    return SimOutcome(setting, True, alloc.memory_allocated(), alloc.memory_reserved(),
                      capacity - alloc.memory_reserved())


def reproduce(message: OOMMessage | OOMDiagnosis | str) -> OOMReproduction:
    """Rebuild the message's situation in the simulated allocator and run the request under the
    default settings, with ``expandable_segments``, with ``max_split_size_mb`` and, depending on
    the case, with the other processes gone or the live tensors reduced by the shortfall.

    NB: the message gives totals only; the real sequence of tensors, and how the free pieces are
    spread over the segments, are not in it. The rebuilt sequence produces the same figures
    (within their printed precision and 2 MiB per segment); what the other settings do is what
    they do *to this sequence*."""
    diag = message if isinstance(message, OOMDiagnosis) else diagnose(message)
    msg = diag.message
    request = request_for(msg.tried.bytes)
    capacity = msg.reserved.bytes + msg.free.bytes
    outside = (msg.this_process.bytes - msg.reserved.bytes) if msg.this_process is not None else -1
    pieces, rest, notes = _plan(msg.allocated.bytes, msg.unallocated.bytes, request)
    total, gpu = msg.total.bytes, msg.gpu
    runs = [("as in the message (default allocator)", {}),
            ("expandable_segments:True", {"expandable_segments": True})]
    if pieces:
        seg = pieces[0][0]
        n = max(20, seg // MiB)
        runs.append((f"max_split_size_mb:{n}", {"max_split_size_mb": n}))
    outcomes = [_run(name, kw, pieces, rest, request, capacity, total, outside, gpu) for name, kw in runs]
    if diag.case == "other_processes":
        outcomes.append(_run("other processes closed", {}, pieces, rest, request, capacity + msg.others_bytes,
                             total, outside, gpu))
    if diag.case == "too_big" and diag.shortfall_bytes > 0:
        cut = msg.tried.bytes - msg.free.bytes + ROUND_LARGE    # the free pieces cannot serve it
        _, smaller_rest, _ = _plan(max(0, msg.allocated.bytes - cut), msg.unallocated.bytes, request)
        outcomes.append(_run(f"live tensors {format_size(cut)} smaller", {}, pieces, smaller_rest if pieces else
                             _round_rest(max(0, msg.allocated.bytes - cut)), request, capacity, total, outside, gpu))
    if msg.tried.bytes in (SMALL_BUFFER, LARGE_BUFFER):
        notes.append(f"the message prints the segment ({msg.tried}); the request rebuilt is {format_size(request)}, "
                     "one size that needs such a segment")
    hole = pieces[0][1] if pieces else 0
    return OOMReproduction(diag, request, capacity, len(pieces), hole, outcomes, notes)


# ---- a message from a simulated run ------------------------------------------------------------------

@dataclass
class SimulatedOOM:
    """The first out-of-memory of a timeline replayed through the simulated allocator on a card:
    the figures, and the message PyTorch would print for them (``text``, current format)."""

    text: str
    event_index: int
    requested: int
    tried: int
    total: int
    free: int
    allocated: int
    reserved: int
    context: int
    label: str = "simulated allocator"


def simulated_oom(events: Sequence[Any], total_bytes: int, *, context_bytes: int = 0,
                  style: str = "current", **allocator_kwargs: Any) -> SimulatedOOM | None:
    """Replay ``events`` (kind/sid/nbytes) on a card of ``total_bytes`` of which
    ``context_bytes`` (the CUDA context, an assumption on a CPU) are taken before the first tensor;
    at the first simulated OOM return its figures and the message in PyTorch's format
    (``format_oom_message``: every number from the simulator). None when everything fits."""
    capacity = total_bytes - context_bytes
    if capacity <= 0:
        raise ValueError(f"the context ({format_size(context_bytes)}) leaves nothing of {format_size(total_bytes)}")
    alloc = CachingAllocator(capacity_bytes=capacity, **allocator_kwargs)
    live: dict[Any, Any] = {}
    for i, ev in enumerate(events):
        get = ev.get if isinstance(ev, dict) else (lambda k, e=ev: getattr(e, k, None))
        kind, sid, nbytes = get("kind"), get("sid"), int(get("nbytes") or 0)
        if sid in live and kind in ("free", "resize", "alloc"):
            alloc.free(live.pop(sid))
        if kind in ("alloc", "resize"):
            try:
                live[sid] = alloc.malloc(nbytes)
            except SimulatedOutOfMemoryError as exc:
                free = exc.free or 0
                text = format_oom_message(exc.alloc_size, total_bytes, free, exc.allocated, exc.reserved,
                                          this_process=exc.reserved + context_bytes, style=style)
                return SimulatedOOM(text, i, round_size(nbytes), exc.alloc_size, total_bytes, free,
                                    exc.allocated, exc.reserved, context_bytes)
    return None


__all__ = ["Amount", "CASES", "OOMDiagnosis", "OOMMessage", "OOMParseError", "OOMReproduction", "SimOutcome",
           "SimulatedOOM", "diagnose", "format_oom_message", "get_allocation_size", "parse_oom_message",
           "reproduce", "request_for", "simulated_oom"]
