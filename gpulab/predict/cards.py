"""Common GPU cards and the parser for ``--gpu``: the one table of card sizes in gpulab.

Convention: a vendor's "N GB" of GPU memory is counted here as N GiB (N * 2**30 bytes),
as ``gpulab.course.sweeps.CARDS_GIB`` already does ("the vendors' '16 GB' cards hold
16 GiB"). It is a teaching simplification and an upper bound: what the device reports
is somewhat less. Where CUDA's own total is known (measured here, or printed by published
out-of-memory messages: ``Card.cuda_total_bytes``), plans use that instead
(``Card.reported_total_bytes``). Public ``nvidia-smi`` output shows 81,559 MiB (79.6 GiB) on an
"H100 80GB HBM3" and 15,360 MiB (15.0 GiB) on a "Tesla T4" sold as 16 GB, and the CUDA
context takes its share of that before any tensor exists.

A *size* typed after ``--gpu`` follows its unit literally: ``GiB``/``MiB``/``KiB``/``TiB``
are binary, ``GB``/``MB``/``KB``/``TB`` are decimal (``24GB`` is 24,000,000,000 bytes,
22.4 GiB), and a bare ``G``/``M``/``K``/``T`` is read as binary (``16G`` is 16 GiB, the
same reading this table gives a "16 GB" card). Every such choice is spelled out in the
returned card's ``note``.
"""
from __future__ import annotations

import difflib
import functools
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable

from gpulab.measure.cuda_card import KernelTarget, kernel_target, step_workspace_bytes
from gpulab.units import GB, KB, MB, GiB, KiB, MiB, format_bytes

__all__ = [
    "CARDS", "CUDA_CONTEXT_ASSUMED", "Card", "CardBudget", "FP8_CAPABILITY", "TB", "TiB", "as_card", "card_names",
    "card_target", "card_with_room", "check_fp8_card", "follows_card", "parse_gpu"
]

TiB = 1024 * GiB
TB = 1000 * GB

# What a CUDA process holds outside the caching allocator while it trains (the CUDA context with
# the kernels loaded so far, cuBLAS/cuDNN handles), measured by gpulab's own GPU validation
# (docs/gpu-validation-h200.md, "CUDA context"): NVML used − memory_reserved on an NVIDIA H200 after the
# model runs, torch 2.11.0+cu130, CUDA runtime 13.0, driver 580.159.04, lazy module loading,
# 2026-11-26 (1,197,342,720 bytes right after start); the larger of gpulab's measurements (an H100
# 80GB HBM3 measured 1,347,223,552 after twelve practitioner cases). ``predict.context`` labels it; a GPU run
# replaces it with its own measurement (``gpulab record``).
CUDA_CONTEXT_ASSUMED = 1_451_098_112


class CardBudget:
    """What a result that plans a run on a card needs: the allocator's reserved peak plus the
    CUDA context, and what is left (a mixin of properties over ``reserved_bytes``,
    ``context_bytes`` and ``capacity_bytes``)."""
    reserved_bytes: int
    context_bytes: int
    capacity_bytes: int

    @property
    def needed_bytes(self) -> int:
        """Reserved peak + CUDA context + the cuBLAS workspaces, where the result counts them apart
        (a ``workspace_bytes`` field: ``Card.workspace_bytes``)."""
        return self.reserved_bytes + self.context_bytes + getattr(self, "workspace_bytes", 0)

    @property
    def margin_bytes(self) -> int:
        """What is left on the card (negative: short by that much)."""
        return self.capacity_bytes - self.needed_bytes


@dataclass(frozen=True)
class Card:
    """A GPU card (or a plain memory size) that a lesson can plan for."""

    name: str                    # what we print, e.g. "H100" or "24 GiB"
    memory_bytes: int            # the memory a lesson plans with
    aliases: tuple[str, ...]     # other spellings ``parse_gpu`` accepts
    note: str                    # where memory_bytes comes from, in words
    # what CUDA itself reports as the card's total (cudaMemGetInfo; the "total capacity" of an
    # out-of-memory message), where it is known, and where that figure comes from
    cuda_total_bytes: int | None = None
    cuda_total_note: str = ""
    # the compute capability (major, minor) CUDA reports (torch.cuda.get_device_capability); it
    # decides the attention kernel and the cuBLAS workspace (``measure.cuda_card``). None: a plain
    # size, or a card CUDA does not run (AMD)
    capability: tuple[int, int] | None = None

    @property
    def kernel_target(self) -> KernelTarget:
        """What a fake CUDA-target run answering for this card follows (``measure.cuda_card``)."""
        return KernelTarget(self.name, self.capability)

    def workspace_bytes(self, training: bool = True) -> int:
        """The cuBLAS (and cuBLASLt) workspaces a step's matmuls leave allocated on this card
        (``measure.cuda_card.step_workspace_bytes``; ``CUBLAS_WORKSPACE_CONFIG`` honoured)."""
        return step_workspace_bytes(self.capability, training)

    @property
    def reported_total_bytes(self) -> int:
        """The total an out-of-memory message on this card states: CUDA's own figure where known.
        ``gpulab fit``, ``serve`` and ``what_fits`` plan with it."""
        return self.cuda_total_bytes or self.memory_bytes

    @property
    def total_text(self) -> str:
        """Where the total a plan uses comes from, in words."""
        if self.cuda_total_bytes:
            return (f"{format_bytes(self.cuda_total_bytes)}, the total CUDA reports ({self.cuda_total_note}); "
                    f"not the advertised {self.memory_bytes / GiB:g} GB")
        return f"{format_bytes(self.memory_bytes)}" + (f": {self.note}" if self.note else "")


def _card(name: str, gb: int, aliases: tuple[str, ...], spec: str, extra: str = "",
          cuda_total: tuple[int, str] | None = None, cc: tuple[int, int] | None = None) -> Card:
    note = f"advertised {gb} GB {spec}, counted here as {gb} GiB"
    return Card(name, gb * GiB, aliases, note + (f"; {extra}" if extra else ""),
                *(cuda_total or (None, "")), capability=cc)


# Sizes and memory types are as the vendors advertise them (not re-checked against their
# product pages when this table was written); the two nvidia-smi figures are from public
# nvidia-smi output of those cards. Compute capabilities (``cc``) are NVIDIA's ("CUDA GPUs"
# list; the H200 recorded here reported 9.0); B200's 180 GB is DGX B200's 1,440 GB over 8 GPUs.
# Aliases include the names ``torch.cuda.get_device_name()`` / nvidia-smi print, so a
# student can paste those; the "NVIDIA", "GeForce", "Tesla", "AMD" and "Instinct" prefixes
# are dropped before matching.
CARDS: tuple[Card, ...] = (
    _card("H100", 80, ("H100-80GB", "H100 80GB HBM3", "H100-SXM", "H100-SXM5", "H100-PCIe"),
          "(HBM3 on SXM5, HBM2e on PCIe)",
          "nvidia-smi on an H100 80GB HBM3 shows 81,559 MiB total (79.6 GiB); "
          "the 94 GB H100 NVL is not this card",
          cuda_total=(round(79.18 * GiB), "out-of-memory messages in prime-rl's benchmark report "
                                          "(benchmarks/results/BENCHMARKS.md, PrimeIntellect-ai/prime-rl, early 2026) "
                                          "print 'a total capacity of 79.18 GiB' on one H100 80GB HBM3 and 79.21 GiB "
                                          "on 8-GPU H100 nodes (to 0.01 GiB; the smaller taken); the same report's "
                                          "H200s print 139.80 GiB, the total measured here"), cc=(9, 0)),
    _card("H200", 141, ("H200-141GB", "H200-SXM", "H200 NVL"), "HBM3e",
          cuda_total=(150_109_880_320, "torch.cuda.mem_get_info() on an NVIDIA H200 (driver 580.159.04, "
                                       "CUDA 13.0), measured by this project's GPU validation on 2026-11-26: "
                                       "139.80 GiB, which its out-of-memory message printed as the total capacity"),
          cc=(9, 0)),
    _card("A100-40GB", 40, ("A100-SXM4-40GB", "A100-PCIE-40GB"), "HBM2", cc=(8, 0)),
    _card("A100-80GB", 80, ("A100-SXM4-80GB", "A100 80GB PCIe", "A100-PCIE-80GB"), "HBM2e", cc=(8, 0)),
    _card("B200", 180, ("B200-180GB", "B200-SXM"), "HBM3e", cc=(10, 0)),
    _card("L4", 24, (), "GDDR6", cc=(8, 9)),
    _card("L40S", 48, (), "GDDR6", cc=(8, 9)),
    _card("A10", 24, (), "GDDR6", cc=(8, 6)),
    _card("A10G", 24, (), "GDDR6", "the AWS variant of the A10 (G5 instances)", cc=(8, 6)),
    _card("T4", 16, ("T4-16GB",), "GDDR6",
          "nvidia-smi on a Tesla T4 shows 15,360 MiB total (15.0 GiB)",
          cuda_total=(round(14.74 * GiB), "out-of-memory messages published from T4s (Google Colab) print "
                                          "'GPU 0 has a total capacity of 14.74 GiB' (to 0.01 GiB)"), cc=(7, 5)),
    _card("V100-16GB", 16, ("V100-SXM2-16GB", "V100-PCIE-16GB"), "HBM2", cc=(7, 0)),
    _card("V100-32GB", 32, ("V100-SXM2-32GB", "V100-PCIE-32GB"), "HBM2", cc=(7, 0)),
    _card("RTX 3090", 24, ("3090",), "GDDR6X", cc=(8, 6)),
    _card("RTX 4090", 24, ("4090",), "GDDR6X", cc=(8, 9)),
    _card("RTX 4080", 16, ("4080",), "GDDR6X", cc=(8, 9)),
    _card("RTX 4070", 12, ("4070",), "GDDR6X", cc=(8, 9)),
    _card("RTX 3060", 12, ("3060",), "GDDR6", "an 8 GB RTX 3060 exists too: give 8GiB for it", cc=(8, 6)),
    _card("RTX 5090", 32, ("5090",), "GDDR7", cc=(12, 0)),
    _card("MI300X", 192, (), "HBM3", "AMD Instinct; no CUDA compute capability (ROCm's kernels are not modelled)"),
)

_PREFIXES = ("nvidia", "geforce", "tesla", "amd", "instinct")

# Several cards come in two sizes: a bare name is refused with both choices.
_AMBIGUOUS = {"a100": ("A100-40GB", "A100-80GB"), "v100": ("V100-16GB", "V100-32GB")}

_UNITS: dict[str, tuple[str, int]] = {
    # typed unit (lower case) -> (unit as printed, bytes)
    "kib": ("KiB", KiB), "mib": ("MiB", MiB), "gib": ("GiB", GiB), "tib": ("TiB", TiB),
    "k": ("KiB", KiB), "m": ("MiB", MiB), "g": ("GiB", GiB), "t": ("TiB", TiB),
    "kb": ("KB", KB), "mb": ("MB", MB), "gb": ("GB", GB), "tb": ("TB", TB),
}
_SIZE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)$")
_NUMBER = re.compile(r"^[+-]?(\d+(?:\.\d*)?|\.\d+)$")


def _key(text: str) -> str:
    """Lower case, separators dropped, vendor prefixes dropped: "NVIDIA GeForce RTX 4090"
    and "rtx-4090" both give "rtx4090"."""
    words = re.split(r"[^a-z0-9]+", text.lower())
    words = [w for w in words if w]
    while words and words[0] in _PREFIXES:
        words = words[1:]
    return "".join(words)


def _lookup() -> dict[str, Card]:
    table: dict[str, Card] = {}
    for card in CARDS:
        for spelling in (card.name, *card.aliases):
            key = _key(spelling)
            if key in table and table[key] is not card:
                raise RuntimeError(f"{spelling!r} names two cards")  # a mistake in CARDS
            table[key] = card
    return table


_BY_KEY = _lookup()


def card_names() -> list[str]:
    """The cards' names in table order: ``['H100', 'H200', 'A100-40GB', ...]``."""
    return [card.name for card in CARDS]


def _fail(text: str, reason: str = "", guesses: tuple[str, ...] = (), what: str = "--gpu") -> ValueError:
    """The one-line error every unreadable ``--gpu`` gets (``what``: how the caller names the value:
    the CLI's ``--gpu``, or "card" for a Python call, which has no command-line flag)."""
    msg = f"cannot read {what} {text!r}: "
    if reason:
        msg += reason + "; "
    msg += ("give a size such as 24GiB, 80GB or 512MiB (GiB/MiB/KiB/TiB binary, "
            "GB/MB/KB/TB decimal, a bare G binary), or a card: " + ", ".join(card_names()))
    if guesses:
        msg += f" (did you mean {' or '.join(guesses)}?)"
    return ValueError(msg)


def _size(text: str, number: str, unit: str, what: str = "--gpu") -> Card:
    label, scale = _UNITS[unit]
    n = round(Fraction(number) * scale)  # whole bytes: 0.3KiB is 307 B
    if n <= 0:
        raise _fail(text, "a size must be at least 1 byte", what=what)
    shown = number.rstrip("0").rstrip(".") if "." in number else number
    name = f"{shown} {label}"
    if scale in (KB, MB, GB, TB):
        note = f"{name} = {n:,} bytes (decimal), i.e. {format_bytes(n)}"
    else:
        note = f"{name} = {n:,} bytes (binary)"
        if unit in ("k", "m", "g", "t"):
            note += f"; a bare {unit.upper()} is read as {label}"
    return Card(name=name, memory_bytes=n, aliases=(), note=note)


def parse_gpu(text: str, what: str = "--gpu") -> Card:
    """Read a ``--gpu`` argument: a card name or alias, or a memory size with a unit.

    Cards match case-insensitively, with or without separators ("H100", "h100-80gb",
    "A100-40GB", "a100 40gb", "RTX4090", "4090", "NVIDIA GeForce RTX 4090"). Sizes need a
    unit: "24GiB", "24 GiB", "80gib", "1.5TiB", "512MiB" (binary), "24GB" (decimal:
    24,000,000,000 bytes), "16G" (a bare G is read as GiB, and the note says so).

    Raises ``ValueError`` with a one-line message listing the accepted forms and the card
    names for anything else: a bare number ("24"), a negative or zero size, an unknown name
    (with "did you mean ...?" for a near miss such as "T5"). ``what``: how the message names the
    value ("--gpu" on the command line, "card" from Python).
    """
    raw = "" if text is None else str(text)
    s = raw.strip()
    key = _key(s)
    if key in _BY_KEY:
        return _BY_KEY[key]
    if key in _AMBIGUOUS:
        raise _fail(raw, f"{s} comes in more than one size", _AMBIGUOUS[key], what)
    low = s.lower()
    m = _SIZE.match(low)
    if m and m.group(2) in _UNITS:
        return _size(raw, m.group(1), m.group(2), what)
    if _NUMBER.match(low):
        if low.startswith("-"):
            raise _fail(raw, "a size must be at least 1 byte", what=what)
        raise _fail(raw, f"a size needs a unit ({s}GiB or {s}GB?)", what=what)
    if low.startswith("-"):
        raise _fail(raw, "a size must be at least 1 byte", what=what)
    if m:
        raise _fail(raw, f"unknown unit {m.group(2)!r}", what=what)
    raise _fail(raw, "", _guesses(key), what)


def as_card(gpu: Any) -> Card:
    """The card a Python call asks for: a ``Card``, a name or size as ``--gpu`` takes it, or a whole
    number of bytes (at least 1: ``gpulab.fit(m, -5)`` is refused as a size, not blamed on the context)."""
    if isinstance(gpu, Card):
        return gpu
    if isinstance(gpu, int) and not isinstance(gpu, bool):
        if gpu < 1:
            raise ValueError(f"gpu {gpu:,} is not a card's size: give a positive number of bytes, a size such as "
                             f"'24GiB', or a card: {', '.join(card_names())}")
        return Card(f"{gpu:,} B", gpu, (), "")
    return parse_gpu(gpu, what="gpu")


def card_with_room(gpu: Any, context_bytes: Any, assumed: bool) -> Card:
    """``as_card(gpu)``, checked to hold the CUDA context (``context_bytes``) with room to spare.
    ``assumed``: the context is gpulab's assumption, not the user's, and the refusal says so and
    names the option that replaces it (``--context``, ``context_bytes=``)."""
    card = as_card(gpu)
    if not isinstance(context_bytes, int) or isinstance(context_bytes, bool) or context_bytes < 0:
        raise ValueError(f"context_bytes (--context) must be a whole number of bytes, 0 or more, got {context_bytes!r}")
    total = card.reported_total_bytes
    if context_bytes < total:
        return card
    if assumed:
        raise ValueError(f"{card.name} ({format_bytes(total)}) is no larger than the CUDA context gpulab assumes "
                         f"({format_bytes(context_bytes)}: an assumption from measured GPUs, not this card's): nothing "
                         f"is left for tensors; give the context your setup has with --context (context_bytes= in "
                         f"Python), or a larger card")
    raise ValueError(f"the CUDA context given (--context / context_bytes) {format_bytes(context_bytes)} is the whole "
                     f"of {card.name}'s {format_bytes(total)} or more: give a smaller context, or a larger card")


def _guesses(key: str) -> tuple[str, ...]:
    """Card names close to a mistyped key: the best match, and any nearly as good."""
    scored = sorted(((difflib.SequenceMatcher(None, key, k).ratio(), card.name)
                     for k, card in _BY_KEY.items()), reverse=True) if key else []
    best = scored[0][0] if scored else 0.0
    names: list[str] = []
    for ratio, name in scored:
        # 0.5: a one-character slip in a two-character name ("T5" for T4) still counts as close
        if ratio >= max(0.5, best - 0.1) and name not in names:
            names.append(name)
    return tuple(names[:2])


def card_target(gpu: Any) -> KernelTarget | None:
    """The kernels a question about ``gpu`` (a card name or size, a ``Card``, bytes) follows: the
    card's compute capability, or none known (a size: sm80 rules, and the label says so). None for
    what ``parse_gpu`` cannot read (the caller then raises its own error)."""
    if isinstance(gpu, Card):
        return gpu.kernel_target
    if isinstance(gpu, int) and not isinstance(gpu, bool):
        return KernelTarget(f"{gpu:,} B")
    try:
        return parse_gpu(gpu).kernel_target
    except ValueError:
        return None


# torch._scaled_mm (what torchao's float8 training runs its matmuls with) needs compute capability 8.9 or
# 9.0 and later (torch's own refusal: "torch._scaled_mm is only supported on CUDA devices with compute
# capability >= 9.0 or 8.9, or ROCm MI300+"; aten/src/ATen/native/cuda/Blas.cpp)
FP8_CAPABILITY = (8, 9)


def check_fp8_card(gpu: Any, fp8: Any) -> None:
    """``ValueError`` in one line when ``fp8`` (a float8 training recipe) is asked of a named card
    whose compute capability has no float8 matmul (``FP8_CAPABILITY``): a T4 (sm75) or an A100
    (sm80) would stop at its first step, so no batch "fits". A plain size, or a card without a CUDA
    capability (AMD: ROCm runs float8 on MI300), is taken: its kernels are not known to lack it."""
    if not fp8:
        return
    try:
        card = gpu if isinstance(gpu, Card) else parse_gpu(gpu) if isinstance(gpu, str) else None
    except ValueError:
        return   # the caller's own error for the card
    if card is None or card.capability is None or card.capability >= FP8_CAPABILITY:
        return
    major, minor = card.capability
    able = ", ".join(c.name for c in CARDS if c.capability and c.capability >= FP8_CAPABILITY)
    raise ValueError(f"fp8 {fp8!r} on {card.name}: its compute capability {major}.{minor} (sm{major}{minor}) has no "
                     f"float8 matmul (torch._scaled_mm needs 8.9 or 9.0 and later), so its first step would fail: "
                     f"leave out fp8 (--fp8), or ask for a card that has it ({able})")


def follows_card(fn: Callable | None = None, *, positional: bool = True) -> Callable:
    """``fn(model, gpu, ...)`` (``gpulab.fit``, ``gpulab.serve``; ``positional=False``: ``gpu=`` by
    keyword only, ``gpulab.step``) with its fake CUDA-target runs following ``gpu``'s kernels
    (``measure.cuda_card.kernel_target``); inside, ``measure.cuda_card.current_target()`` is that
    card's target, with the attention kernels its runs chose; ``fp8=`` asked of a card without float8
    matmuls is refused first (``check_fp8_card``). No ``gpu``: ``fn`` runs as it is."""
    if fn is None:
        return functools.partial(follows_card, positional=positional)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        gpu = kwargs.get("gpu", args[1] if positional and len(args) > 1 else None)
        if gpu is None:
            return fn(*args, **kwargs)
        # the card's kernels decide whether float8 runs at all (fp8= itself, or a Recipe's)
        check_fp8_card(gpu, kwargs.get("fp8") or getattr(kwargs.get("recipe"), "fp8", None))
        with kernel_target(card_target(gpu)):
            return fn(*args, **kwargs)
    return wrapper
