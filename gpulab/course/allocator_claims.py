"""Lesson 09's reference-article claims about the caching allocator, put to the test (the appendix,
lessons/15_appendix_reference_claims.ipynb, section 09): "nvidia-smi shows more than your
tensors", "empty_cache slows training down" and "PyTorch uses an extra ~400 MB beyond the
tensors". Each verdict is computed from the replayed training step, the cudaMalloc/cudaFree
counts and the device-level reading that ``gpulab.predict.replay`` returns."""
from __future__ import annotations

from typing import Any

from gpulab.course.claims import BREAKS, HOLDS, ClaimCheck, ClaimReport, Evidence
from gpulab.measure.engines import LABEL_SIMULATED
from gpulab.units import MB, format_bytes

__all__ = ["allocator_claims"]

# ref 003's "about 400 MB" beyond the tensors; a device reading within this share of it "holds"
CLAIMED_EXTRA = 400 * MB
EXTRA_TOLERANCE = 0.5


def allocator_claims(step: Any, cost: dict[str, dict[str, int]], beyond: dict[str, Any]) -> ClaimReport:
    """``step``: ``replay.workload("training step", ...)`` (tracked peak, simulated allocated and
    reserved peaks); ``cost``: ``replay.empty_cache_cost(...)``; ``beyond``:
    ``replay.beyond_allocator_bytes()`` (``bytes`` is None where no GPU can be read)."""
    tensors, allocated, reserved = step.tracked_peak, step.peak_allocated, step.peak_reserved
    ordered = tensors <= allocated <= reserved
    more = ordered and reserved > tensors
    smi = ClaimCheck(
        "nvidia-smi shows more than your tensors", "ref 003",
        HOLDS if more else BREAKS,
        (f"Each layer adds to the one below: the cache adds {format_bytes(reserved - allocated)} over the "
         f"allocated peak, and nvidia-smi adds the CUDA context on top, which only a GPU can measure. "
         f"Workspaces are inside allocated and reserved, not in that last line.") if more else
        "The replay's layers are not in the order tensors ≤ allocated ≤ reserved, or reserved adds nothing here.",
        [Evidence("live tensors, peak (512-rounded)", format_bytes(tensors), step.source_label),
         Evidence("allocated_bytes.all.peak", format_bytes(allocated), LABEL_SIMULATED),
         Evidence("reserved_bytes.all.peak", format_bytes(reserved), LABEL_SIMULATED)])

    off, on = cost["without"], cost["with empty_cache"]
    slower = (on["cudaMalloc calls"] > off["cudaMalloc calls"]
              and on["peak reserved"] >= off["peak reserved"])
    empty = ClaimCheck(
        "empty_cache() slows training down", "ref 003",
        "holds as a direction (counts, not times)" if slower else BREAKS,
        (f"With empty_cache() after every step the allocator calls cudaMalloc {on['cudaMalloc calls']} times "
         f"instead of {off['cudaMalloc calls']}, and the peak reserved memory is no lower. How much time that "
         "costs depends on the GPU and the step's length: time it on a GPU.") if slower else
        "empty_cache() after every step did not add cudaMalloc calls, or it lowered the peak reserved memory.",
        [Evidence(f"{k}: cudaMalloc / cudaFree calls", f"{v['cudaMalloc calls']} / {v['cudaFree calls']}",
                  LABEL_SIMULATED) for k, v in cost.items()]
        + [Evidence(f"{k}: peak reserved", format_bytes(v["peak reserved"]), LABEL_SIMULATED)
           for k, v in cost.items()])

    extra = beyond.get("bytes")
    if extra is None:
        verdict = "cannot be tested here"
        why = ("Memory outside the allocator (the CUDA context, other processes) needs a GPU and NVML; the "
               "articles' figure was nvidia-smi's count on the author's GPU and CUDA version, not a constant.")
        value = "not measurable here"
    else:
        close = abs(extra - CLAIMED_EXTRA) <= EXTRA_TOLERANCE * CLAIMED_EXTRA
        verdict = HOLDS if close else BREAKS
        why = (f"On this GPU nvidia-smi counts {format_bytes(extra)} beyond what the allocator reserved "
               f"({'within' if close else 'not within'} {EXTRA_TOLERANCE:.0%} of 400 MB): it depends on the GPU, "
               "the driver, the CUDA version and lazy loading.")
        value = format_bytes(extra)
    context = ClaimCheck(
        "PyTorch uses an extra ~400 MB beyond the tensors", "ref 003", verdict, why,
        [Evidence("claimed extra", "400 MB", "published by ref 003"),
         Evidence("nvidia-smi extra, outside the allocator", value, beyond["label"])])
    return ClaimReport("Lesson 09: the caching allocator, the articles' claims", [smi, empty, context])
