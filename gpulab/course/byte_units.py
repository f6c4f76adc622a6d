"""Lesson 01's units: the same bytes in binary (KiB, MiB, GiB: what nvidia-smi and PyTorch print)
and decimal (KB, MB, GB) units, taught once in the course (lesson 01); other lessons refer to it.

* ``units_table(nbytes)`` / ``prefix_gaps()``: one byte count in both systems, and how far apart
  the two drift at K, M, G, T;
* ``exercise_image_mib()``, ``exercise_smi_gb(mib)``, ``exercise_mb_vs_mib(nbytes)``: predict-first
  checkers;
* ``unit_claims()``: the reference articles' statements about units, tested on this machine
  (NVML and nvidia-smi where there is a GPU).
"""
from __future__ import annotations

import inspect
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

import torch

from gpulab import formulas as F
from gpulab.course.claims import BREAKS, HOLDS, ClaimCheck, ClaimReport, Evidence
from gpulab.course.exercises import ChoiceExercise, Exercise
from gpulab.course.start import MachineReport, machine_report, nvidia_smi_style
from gpulab.measure.engines import LABEL_FORMULA, RunContext, run
from gpulab.measure.tracking import TrackingResult
from gpulab.units import GB, GiB, KB, KiB, MB, MiB
from gpulab.views import error_percent, html_table

__all__ = [
    "GAP_TOLERANCE", "PrefixGap", "UnitsTable", "exercise_image_mib", "exercise_mb_vs_mib", "exercise_smi_gb",
    "prefix_gaps", "unit_claims", "units_table"
]


# --- units ------------------------------------------------------------------------------------------

@dataclass
class UnitsTable:
    nbytes: int
    what: str

    def rows(self) -> list[list[str]]:
        n = self.nbytes
        return [["bytes", f"{n:,} B", "exact"],
                ["binary (what nvidia-smi and PyTorch print)",
                 f"{n / KiB:,.2f} KiB = {n / MiB:,.3f} MiB = {n / GiB:,.4f} GiB", "1 KiB = 1024 B"],
                ["decimal (SI)", f"{n / KB:,.2f} KB = {n / MB:,.3f} MB = {n / GB:,.4f} GB", "1 KB = 1000 B"]]

    def __repr__(self) -> str:
        return f"{self.what}: " + "; ".join(r[1] for r in self.rows())

    def _repr_html_(self) -> str:
        return html_table(["system", "value", "rule"], self.rows(), f"{self.what} ({LABEL_FORMULA})")


def units_table(nbytes: int, what: str = "") -> UnitsTable:
    return UnitsTable(int(nbytes), what or f"{int(nbytes):,} bytes")


@dataclass(frozen=True)
class PrefixGap:
    prefix: str
    binary: int        # 1024**k
    decimal: int       # 1000**k

    @property
    def gap_percent(self) -> float:
        """How much bigger the binary unit is than the decimal one, in %."""
        return 100.0 * (self.binary - self.decimal) / self.decimal


def prefix_gaps() -> list[PrefixGap]:
    return [PrefixGap(p, 1024**k, 1000**k) for k, p in enumerate("KMGT", start=1)]



# --- predict-first exercises --------------------------------------------------------------------------

def exercise_image_mib() -> Exercise:
    return Exercise(
        question="The articles' 500×500 RGB image in float32: how many MiB?",
        expected=lambda: F.tensor_bytes((500, 500, 3), "float32") / MiB,
        explain="500 × 500 × 3 × 4 B = 3,000,000 B, and 1 MiB = 1024 × 1024 = 1,048,576 B.",
        unit="MiB", rel_tol=0.01,
        hint="Count the bytes first, then divide by 1024 × 1024 (not by 1000 × 1000).")


def exercise_smi_gb(mib: int = 24576) -> Exercise:
    return Exercise(
        question=f"nvidia-smi says a card has {mib}MiB. How many GB (10⁹ bytes) is that?",
        expected=lambda: mib * MiB / GB,
        explain=f"{mib:,} MiB × 1,048,576 B = {mib * MiB:,} B; ÷ 1,000,000,000 B per GB.",
        unit="GB", rel_tol=0.01,
        hint="Go through bytes: MiB × 1024², then ÷ 1000³.")


def exercise_mb_vs_mib(nbytes: int = 3_000_000) -> ChoiceExercise:
    """Predict-first (qualitative): the same bytes written in MB and in MiB; which number is bigger?
    Worked out from the unit definitions (``gpulab.units``) when the checker runs."""
    def expected() -> str:
        in_mb, in_mib = nbytes / MB, nbytes / MiB
        return "a" if in_mb > in_mib else ("b" if in_mib > in_mb else "c")

    def explain() -> str:
        return (f"{nbytes:,} B = {nbytes / MB:,.4g} MB = {nbytes / MiB:,.4g} MiB ({LABEL_FORMULA}). 1 MiB = 1024 × 1024 "
                f"= {MiB:,} B is bigger than 1 MB = {MB:,} B, so fewer MiB fit in the same memory: the MB number is "
                f"{(MiB / MB - 1) * 100:.1f}% bigger. The gap grows to {(GiB / GB - 1) * 100:.1f}% for GB vs GiB: a card "
                f"sold as 24 GB holds only {24 * GB / GiB:.1f} GiB.")

    return ChoiceExercise(
        question=(f"The same {nbytes:,} bytes are written once in MB (10⁶ bytes) and once in MiB (2²⁰ bytes). "
                  f"Which number is bigger?"),
        options={"a": "the number in MB", "b": "the number in MiB", "c": "they are the same number"},
        expected=expected, explain=explain)



# --- the articles' claims about units ----------------------------------------------------------------

def _torch_summary_units() -> tuple[bool, str]:
    """Does the installed torch format memory_summary() in 1024-based units? Read from its source."""
    try:
        src = inspect.getsource(torch.cuda.memory.memory_summary)
    except (OSError, TypeError, AttributeError):
        return False, "source not available"
    found = [u for u in ("KiB", "MiB", "GiB") if u in src]
    return bool(found), ", ".join(found) if found else "no KiB/MiB/GiB found"


def _nvidia_smi_used_mib() -> int | None:
    """memory.used of GPU 0 as nvidia-smi prints it (MiB), or None without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10)
        return int(out.stdout.strip().splitlines()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


GAP_TOLERANCE = 5.0   # % a rough estimate may be off and still count as "no need to distinguish"


def unit_claims(engine: str = "auto") -> ClaimReport:
    """The articles' statements about units, with the evidence on this machine."""
    report = machine_report()
    gpu = report.gpus[0] if report.gpus else None
    checks = []

    # 1. article 003: "1 G = 1000 MB, 1 M = 1000 KB, 1 K = 1000 Byte"
    binary_torch, found = _torch_summary_units()
    ev = [Evidence("1 GiB vs 1 GB", f"{GiB:,} B vs {GB:,} B", LABEL_FORMULA),
          Evidence("units in torch.cuda.memory_summary()", found, f"read from torch {torch.__version__} source")]
    if gpu:
        ev.append(Evidence(f"{gpu['name']} total memory", nvidia_smi_style(gpu["total_bytes"]), "NVML (what nvidia-smi reads)"))
    else:
        ev.append(Evidence("nvidia-smi's memory column", "prints MiB; no GPU here to read it from",
                           "not measurable on this machine"))
    checks.append(ClaimCheck(
        "1 G = 1000 MB, 1 M = 1000 KB, 1 K = 1000 bytes.", "article 003",
        "holds for GB/MB/KB, breaks for the numbers PyTorch and nvidia-smi print" if binary_torch else HOLDS,
        "As SI prefixes this is right, but PyTorch's memory reports and nvidia-smi count in 1024-based "
        "MiB/GiB: reading their numbers with 1 G = 1000 M is off by 4.9% per M and 7.4% per G."
        if binary_torch else "The installed torch does not print binary units.", ev))

    # 2. article 001: K/M/G (1024) vs KB/MB/GB (1000): no need to tell them apart when estimating
    gaps = prefix_gaps()
    ev = [Evidence(f"1 {g.prefix}iB / 1 {g.prefix}B", f"{g.binary / g.decimal:.4f} (+{g.gap_percent:.1f}%)",
                   LABEL_FORMULA) for g in gaps]
    card = gpu["total_bytes"] if gpu else 24 * GiB
    card_label = f"NVML on {gpu['name']}" if gpu else f"{LABEL_FORMULA} (a 24 GiB card; no GPU here)"
    ev.append(Evidence("a card's memory in GiB and in GB",
                       f"{card / GiB:,.2f} GiB = {card / GB:,.2f} GB ({card / GB - card / GiB:,.2f} G apart)",
                       card_label))
    small = [g.prefix for g in gaps if g.gap_percent < GAP_TOLERANCE]
    large = [g.prefix for g in gaps if g.gap_percent >= GAP_TOLERANCE]
    verdict = (HOLDS if not large else BREAKS if not small else
               f"holds for {'/'.join(small)} (< {GAP_TOLERANCE:g}%), breaks for {'/'.join(large)}")
    checks.append(ClaimCheck(
        "K, M, G, T are 1024-based and KB, MB, GB, TB 1000-based, but for estimating memory the two "
        "need not be told apart.", "article 001", verdict,
        f"The gap grows with each prefix: +{gaps[1].gap_percent:.1f}% at M, +{gaps[2].gap_percent:.1f}% at G. "
        f"On a {card / GiB:,.0f} GiB card the two readings differ by {(card / GB) - (card / GiB):,.2f} G: "
        f"near the limit, enough to decide whether a batch fits.", ev))

    # 3. article 003's line tracker: NVML bytes / 1024**2 printed as "Mb", tensor sizes / 1000**2 as "M"
    shape = (30, 3, 512, 512)

    def experiment(ctx: RunContext) -> int:
        return torch.empty(shape, dtype=torch.float32, device=ctx.device).untyped_storage().nbytes()

    nbytes = F.tensor_bytes(shape, "float32")
    m = run(experiment, engine, predicted_bytes=nbytes, max_cpu_bytes=256 * MiB)
    measured = TrackingResult.build(m.tracking.records, m.tracking.events, device=m.tracking.device,
                                    rounded=False).peak_bytes
    ev = [Evidence(f"storage bytes of torch.empty({shape}, dtype=torch.float32)", f"{measured:,} B", m.label),
          Evidence("÷ 1000² (the article's comment: 94.37M)", f"{measured / MB:,.2f} MB", LABEL_FORMULA),
          Evidence("÷ 1024² (how its tracker divides NVML's bytes, printed as 'Mb')",
                   f"{measured / MiB:,.2f} MiB", LABEL_FORMULA)]
    diff = error_percent(measured / MB, measured / MiB)
    checks.append(ClaimCheck(
        "The tracker's 'Mb' (NVML used ÷ 1024²) and the tensor sizes in the comments "
        "(÷ 1000 ÷ 1000, 'M') can be added and subtracted as one unit.", "article 003",
        BREAKS if abs(diff) > 1 else HOLDS,
        f"They are different units: the same {measured:,}-byte tensor is {measured / MB:,.2f} in one and "
        f"{measured / MiB:,.2f} in the other; in MB it reads {diff:.1f}% higher. Differences of such mixed "
        f"numbers, like the article's 'extra ~400 MB', inherit that error.", ev))

    # 4. article 001: nvidia-smi is built on NVML (so NVML gives the numbers nvidia-smi shows)
    checks.append(_smi_claim(gpu, report))
    return ClaimReport("What the reference articles claim about units, tested", checks)


def _smi_claim(gpu: dict[str, Any] | None, report: MachineReport) -> ClaimCheck:
    """Article 001: nvidia-smi is built on NVML. On a GPU: nvidia-smi's memory.used vs NVML's."""
    claim, source = "nvidia-smi is built on NVML: its memory figures are NVML's.", "article 001"
    smi = _nvidia_smi_used_mib() if gpu else None
    if gpu and smi is not None:
        try:
            from gpulab.measure.gpu import nvml_used_bytes_at
            nv = nvml_used_bytes_at(int(gpu["index"]))
            total_mib = gpu["total_bytes"] / MiB
            ok = nv is not None and abs(nv / MiB - smi) <= 0.01 * total_mib
            ev = [Evidence("nvidia-smi memory.used", f"{smi:,} MiB", f"nvidia-smi on {gpu['name']}"),
                  Evidence("NVML nvmlDeviceGetMemoryInfo().used",
                           "n/a" if nv is None else f"{nv / MiB:,.0f} MiB", f"NVML on {gpu['name']}")]
            why = ("Both read the same device-wide counter (all processes and CUDA contexts included) and "
                   "print it in MiB; they agree within 1% of the card's memory." if ok else
                   "They differ by more than 1% of the card's memory here. Recent drivers may leave memory "
                   "the driver reserves out of nvidia-smi's 'used', while NVML's v1 query includes it.")
            return ClaimCheck(claim, source, HOLDS if ok else BREAKS, why, ev)
        except Exception as exc:  # never let a driver quirk break the lesson
            return ClaimCheck(claim, source, "not tested here", f"reading NVML failed: {exc}", [])
    return ClaimCheck(claim, source, "not tested here (no GPU)",
                      "Without an NVIDIA GPU and driver there is neither nvidia-smi nor NVML to compare; "
                      "on a GPU machine this check reads both.",
                      [Evidence("NVML", report.info["device"]["reason"] or "not available",
                                "gpulab.measure.gpu.device_report()")])
