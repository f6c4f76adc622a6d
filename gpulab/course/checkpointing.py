"""Lesson 07: activation checkpointing, memory against recompute time.

A deep stack of N identical blocks (Linear + ReLU, each block saves one activation map for
backward) is trained for one step with ``torch.utils.checkpoint.checkpoint_sequential``
(``use_reentrant=False``) over a sweep of segment counts k. For each k:

* memory: the peak of live tensors under the tracker (activations + temporaries at the
  peak, the "activation side"), next to two formulas: Chen et al. 2016's ``N/k + k`` and the
  exact segment layout of ``checkpoint_sequential``;
* time: the step timed without the tracker, after a warm-up, repeated; median and spread.

``time_fn`` is the timing helper: warm-up, synchronize on CUDA, repeat, keep every sample.

Megatron-LM's selective recomputation of a transformer block: ``gpulab.course.selective_checkpointing``.
"""
from __future__ import annotations

import dataclasses
import html
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gpulab import formulas as F
# The measuring core lives in the library (gpulab record runs it too); these names stay importable here.
from gpulab.record.runs.checkpoint import (Timing, block_stack, cpu_threads, run_checkpoint_sweep, time_fn,
                                           time_round_robin, timing_label)
from gpulab.measure.engines import LABEL_FORMULA, choose_engine
from gpulab.course.inplace import validate_positive
from gpulab.course.timing_spread import ratio
from gpulab.units import format_bytes
from gpulab.views import error_percent, fmt_error, html_table

__all__ = [
    "CheckpointResult", "LABEL_CHEN", "LABEL_SEQUENTIAL", "SEGMENT_CHOICES", "SegmentFormulas",
    "SegmentPoint", "best_segments", "checkpoint_claims", "checkpoint_halves", "checkpoint_sequential_maps",
    "checkpoint_sweep", "chen_maps", "exercise_checkpoint_maps", "exercise_many_segments", "segment_counts",
    "segment_sizes", "time_sweep"
]

SEGMENT_CHOICES = ("every k from 1 to N", "divisors of N")
LABEL_CHEN = "formula: Chen et al. 2016, N/k + k"
LABEL_SEQUENTIAL = "formula: checkpoint_sequential's segments"


# --- the model and the formulas -----------------------------------------------------------------------

def chen_maps(n_blocks: int, segments: int) -> float:
    """Chen et al. 2016 (arXiv:1604.06174, section 4.1): split N layers into k segments and keep
    only each segment's input; backward recomputes one segment at a time. Memory is
    O(N/k) for the segment being recomputed plus O(k) for the kept inputs, in units of one
    block's saved activations: ``N/k + k``, smallest at ``k = sqrt(N)`` (2 sqrt(N)).
    NB: an asymptotic cost model: it ignores the gradients in flight and how a real
    implementation cuts the segments (``checkpoint_sequential_maps``)."""
    validate_positive(n_blocks=n_blocks, segments=segments)
    return n_blocks / segments + segments


def segment_sizes(n_blocks: int, segments: int) -> list[int]:
    """How ``torch.utils.checkpoint.checkpoint_sequential`` cuts N modules into k segments:
    ``N // k`` modules per segment, the last segment takes the rest (torch/utils/checkpoint.py)."""
    validate_positive(n_blocks=n_blocks, segments=segments)
    k = min(segments, n_blocks)
    size = n_blocks // k
    return [size] * (k - 1) + [n_blocks - size * (k - 1)]


def checkpoint_sequential_maps(n_blocks: int, segments: int) -> int:
    """Saved maps at the peak for ``checkpoint_sequential(blocks, k)`` on one-map blocks:
    the k-1 segment boundaries it keeps, plus the largest segment held at once (the last
    segment runs without checkpointing, so its maps are saved in the forward; each earlier
    segment's maps exist again while backward recomputes it).
    NB: the gradient in flight and the recompute's own temporaries move the measured peak by
    about one map either way, depending on which segment the peak falls in."""
    sizes = segment_sizes(n_blocks, segments)
    return (len(sizes) - 1) + max(sizes)


def best_segments(n_blocks: int) -> int:
    """The k that minimises ``checkpoint_sequential_maps`` (the smallest such k)."""
    return min(range(1, n_blocks + 1), key=lambda k: (checkpoint_sequential_maps(n_blocks, k), k))


def _sizes_text(sizes: list[int]) -> str:
    """"4 + 4 + 4 + 4", or "8×1 + 8" when there are many equal segments."""
    if len(sizes) <= 8:
        return " + ".join(map(str, sizes))
    return f"{len(sizes) - 1}×{sizes[0]} + {sizes[-1]}"


@dataclass
class SegmentFormulas:
    """Both formulas for every k, in maps (one block's saved activation)."""
    n_blocks: int

    @property
    def rows(self) -> list[tuple[int, list[int], float, int]]:
        return [(k, segment_sizes(self.n_blocks, k), chen_maps(self.n_blocks, k),
                 checkpoint_sequential_maps(self.n_blocks, k)) for k in range(1, self.n_blocks + 1)]

    def _repr_html_(self) -> str:
        body = [[k, _sizes_text(sizes), f"{chen:.2f}", seq] for k, sizes, chen, seq in self.rows]
        return html_table(["k", "segment sizes (checkpoint_sequential)", "Chen: N/k + k", "kept boundaries + "
                           "largest segment"], body, f"N = {self.n_blocks}; {LABEL_FORMULA}, in maps")

    def __repr__(self) -> str:
        return f"SegmentFormulas(N={self.n_blocks}, best k={best_segments(self.n_blocks)})"


# --- the experiment ------------------------------------------------------------------------------------

@dataclass
class SegmentPoint:
    segments: int                     # k (1 = no checkpointing: one plain segment)
    peak_bytes: int                   # whole step, every category
    activation_side: int              # activations + temporaries at the peak
    peak_by_category: dict[str, int]
    chen_bytes: float                 # formula, Chen et al.
    sequential_bytes: int             # formula, checkpoint_sequential's segments
    timing: Timing | None             # None on the fake engine

    @property
    def error_percent(self) -> float | None:
        return error_percent(self.sequential_bytes, self.activation_side)


@dataclass
class CheckpointResult:
    n_blocks: int
    width: int
    batch: int
    map_bytes: int
    points: list[SegmentPoint]
    label: str
    engine: str
    timing_label: str
    predicted_label: str = LABEL_FORMULA

    def point(self, segments: int) -> SegmentPoint:
        for p in self.points:
            if p.segments == segments:
                return p
        raise KeyError(f"no point for k={segments}; have {[p.segments for p in self.points]}")

    @property
    def baseline(self) -> SegmentPoint:
        return self.point(1)

    @property
    def best(self) -> SegmentPoint:
        """The measured point with the lowest peak (smallest k on ties)."""
        return min(self.points, key=lambda p: (p.peak_bytes, p.segments))

    @property
    def sqrt_n(self) -> float:
        return math.sqrt(self.n_blocks)

    def recompute_overhead(self, p: SegmentPoint) -> float | None:
        """Predicted time relative to k=1: one extra forward of the checkpointed blocks. With
        backward costing about twice the forward (two matmuls per Linear, see
        ``formulas.backward_flops``), a forward is ~1/3 of a step."""
        sizes = segment_sizes(self.n_blocks, p.segments)
        recomputed = sum(sizes[:-1]) / self.n_blocks
        return 1.0 + recomputed / 3.0

    def figure(self):
        from gpulab.course.plots_tradeoffs import checkpoint_figure
        return checkpoint_figure(self)

    def slowdown(self, p: SegmentPoint, stat: str = "median") -> float | None:
        """Measured step time relative to k = 1, by ``stat`` ("median" or "min"); None when
        not timed."""
        if p.timing is None or self.baseline.timing is None:
            return None
        if stat not in ("median", "min"):
            raise ValueError(f"stat must be 'median' or 'min', got {stat!r}")
        return getattr(p.timing, stat) / getattr(self.baseline.timing, stat)

    def timing_verdict(self, p: "SegmentPoint | None" = None) -> str:
        """The sentence about ``p``'s step time (default: the best k) against k = 1 that the noise
        supports, computed from the two interquartile ranges: a difference is stated only when they do
        not overlap, and a checkpointed step measured faster than the plain one (recomputing cannot make
        it so) is called what it is, the machine's load changing between the timings."""
        p = p or self.best
        a, b = self.baseline.timing, p.timing
        if a is None or b is None:
            return "Not timed."
        if p.segments == 1:
            return "k = 1 is the step without checkpointing."
        r = ratio(b, a, "iqr")
        span = (f"k = {p.segments}: {b.low * 1e3:.1f}–{b.high * 1e3:.1f} ms, k = 1: {a.low * 1e3:.1f}–"
                f"{a.high * 1e3:.1f} ms (interquartile ranges of {len(b.samples)} and {len(a.samples)} timed steps)")
        if r.low > 1:
            return (f"At k = {p.segments} a step is slower than without checkpointing: ×{b.median / a.median:.2f} "
                    f"comparing medians, and the spreads do not overlap ({span}).")
        if r.high < 1:
            return (f"At k = {p.segments} a step measured faster than without checkpointing ({span}), which "
                    f"recomputing cannot make it: the machine's load changed between the timings. Time again "
                    f"on a quieter machine, or with more rounds.")
        return (f"The timings of k = {p.segments} and k = 1 overlap ({span}; {r.text()}): this run cannot tell "
                f"which is faster. More timed rounds, or a quieter machine, narrow the spreads.")

    def as_dict(self) -> dict[str, Any]:
        return {"n_blocks": self.n_blocks, "width": self.width, "batch": self.batch, "map_bytes": self.map_bytes,
                "engine": self.engine, "label": self.label, "timing_label": self.timing_label,
                "best_segments": self.best.segments,
                "points": [{"segments": p.segments, "peak_bytes": p.peak_bytes,
                            "activation_side": p.activation_side, "chen_bytes": p.chen_bytes,
                            "sequential_bytes": p.sequential_bytes,
                            "median_s": p.timing.median if p.timing else None,
                            "iqr_s": [p.timing.low, p.timing.high] if p.timing else None} for p in self.points]}

    def __repr__(self) -> str:
        b = self.best
        return (f"CheckpointResult(N={self.n_blocks}, best k={b.segments}: {b.peak_bytes:,} B vs "
                f"{self.baseline.peak_bytes:,} B without checkpointing)")

    def _repr_html_(self) -> str:
        base = self.baseline
        rows = []
        for p in self.points:
            t = p.timing
            slow = (ratio(t, base.timing, "iqr").text() if t and base.timing and p is not base else "—")
            pred = f"×{self.recompute_overhead(p):.2f}"
            rows.append([p.segments, _sizes_text(segment_sizes(self.n_blocks, p.segments)),
                         format_bytes(p.peak_bytes), format_bytes(p.activation_side),
                         format_bytes(p.sequential_bytes), fmt_error(p.error_percent), format_bytes(p.chen_bytes),
                         f"{t.median * 1e3:.1f} ({t.low * 1e3:.1f}–{t.high * 1e3:.1f})" if t else "—",
                         slow, pred])
        b = self.best
        head = (f"{self.n_blocks} blocks of Linear({self.width}, {self.width}) + ReLU, batch {self.batch}; "
                f"one map = {format_bytes(self.map_bytes)}. Memory: {html.escape(self.label)}. "
                f"Time: {html.escape(self.timing_label)}.<br>Lowest measured peak at <b>k = {b.segments}</b> "
                f"({format_bytes(b.peak_bytes)}, vs {format_bytes(base.peak_bytes)} without checkpointing); "
                f"√N = {self.sqrt_n:.1f}.<br>Time: {html.escape(self.timing_verdict())}")
        return head + html_table(
            ["k", "segment sizes", "peak", "activations + temporaries at peak", "formula (segments)",
             "formula error", "formula (Chen N/k + k)", "step ms: median (IQR)", "time vs k=1: median [span the IQRs allow]",
             "formula: time vs k=1"], rows,
            "k = 1 is no checkpointing; formulas count one map per saved block output; binary units")


def segment_counts(n_blocks: int, which: str = SEGMENT_CHOICES[0]) -> list[int]:
    if which not in SEGMENT_CHOICES:
        raise ValueError(f"unknown choice {which!r}; valid: {', '.join(SEGMENT_CHOICES)}")
    if which == "divisors of N":
        return [k for k in range(1, n_blocks + 1) if n_blocks % k == 0]
    return list(range(1, n_blocks + 1))


def checkpoint_sweep(n_blocks: int = 16, width: int = 128, batch: int = 512,
                     segments: str | list[int] = SEGMENT_CHOICES[0], engine: str = "auto",
                     repeats: int = 7, warmup: int = 1, time_steps: bool = True,
                     progress: Callable[[float, str], None] | None = None,
                     threads: int | None = 1) -> CheckpointResult:
    """Peak memory (tracked) and step time (untracked) for each segment count k.

    ``threads``: CPU threads for the sweep (see ``cpu_threads``; ignored on CUDA)."""
    validate_positive(n_blocks=n_blocks, width=width, batch=batch, repeats=repeats)
    if n_blocks > 64:
        raise ValueError(f"at most 64 blocks here (the sweep runs one step per k), got {n_blocks}")
    ks = segment_counts(n_blocks, segments) if isinstance(segments, str) else sorted(set(segments))
    if not ks or any(not isinstance(k, int) or k < 1 or k > n_blocks for k in ks):
        raise ValueError(f"segment counts must be integers from 1 to N={n_blocks}, got {ks}")
    if 1 not in ks:
        ks = [1] + ks  # the baseline is always measured
    map_bytes = F.tensor_bytes((batch, width))
    flops = 3 * F.linear_flops(batch, width, width) * n_blocks * 2
    choice = choose_engine(engine, predicted_bytes=(n_blocks + 4) * map_bytes, predicted_flops=flops)
    return _sweep(n_blocks, width, batch, ks, map_bytes, choice, repeats, warmup, time_steps, progress, threads)


def _sweep(n_blocks, width, batch, ks, map_bytes, choice, repeats, warmup, time_steps, progress,
           threads) -> CheckpointResult:
    runs = run_checkpoint_sweep(n_blocks, width, batch, ks, choice.name, repeats=repeats, warmup=warmup,
                                time_steps=time_steps, progress=progress, threads=threads)
    points: list[SegmentPoint] = []
    for k in ks:
        m = runs.measurements[k]
        pc = m.peak_by_category
        points.append(SegmentPoint(k, m.peak_bytes, pc.get("activations", 0) + pc.get("temporaries", 0), pc,
                                   chen_maps(n_blocks, k) * map_bytes,
                                   checkpoint_sequential_maps(n_blocks, k) * map_bytes, runs.timings[k]))
    return CheckpointResult(n_blocks, width, batch, map_bytes, points, runs.label, choice.name, runs.timing_label)


def time_sweep(result: CheckpointResult, repeats: int = 7, warmup: int = 1, threads: int | None = 1,
               progress: Callable[[int], None] | None = None,
               stop: Callable[[], bool] | None = None) -> CheckpointResult:
    """A sweep measured with ``time_steps=False``, its steps now timed: what ``checkpoint_sweep`` with
    ``time_steps=True`` gives, the memory measured first (a panel shows it, then the timings). The
    same round robin (``time_round_robin``: ``progress(round)``; ``stop()`` True raises
    ``TimingStopped``) and the same label; a fake sweep is returned as it is (nothing to time)."""
    if result.engine == "fake":
        return result
    validate_positive(repeats=repeats)
    device = torch.device("cuda") if result.engine == "cuda" else torch.device("cpu")
    threads = threads if result.engine == "cpu" else None
    ks = [p.segments for p in result.points]
    with cpu_threads(threads):
        timings = time_round_robin(result.n_blocks, result.width, result.batch, ks, device, warmup, repeats,
                                   progress, stop)
        label = timing_label(result.engine, True, device, warmup, repeats, threads)
    return dataclasses.replace(result, points=[dataclasses.replace(p, timing=timings[p.segments])
                                               for p in result.points], timing_label=label)


# --- checkpoint by hand (the articles' two halves) ----------------------------------------------------

def checkpoint_halves(net: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """The articles' manual form: ``checkpoint`` each half of a Sequential as a function
    (``use_reentrant=False``: the input need not require grad)."""
    n = len(net)
    first, second = net[: n // 2], net[n // 2:]
    y = checkpoint(first, x, use_reentrant=False)
    return checkpoint(second, y, use_reentrant=False)


# --- the exercise and the articles' claims ---------------------------------------------------------

def exercise_checkpoint_maps(n_blocks: int = 16, segments: int = 4):
    """Predict-first: saved activation maps at the peak with ``checkpoint_sequential(N blocks, k)``.

    The expected value is ``checkpoint_sequential_maps``: (k - 1) kept boundaries + the largest
    segment. Chen et al.'s N/k + k counts one more map when k divides N: the first segment's
    input, which is the model's input x. x exists whether or not you checkpoint, and the tracker
    files it under *inputs*, not activations, so the measured activation side follows (k-1) + N/k.
    An answer equal to Chen's count gets that explanation instead of a bare "wrong"."""
    from gpulab.course.exercises import CheckResult
    from gpulab.course.inplace import counting_exercise
    sizes = segment_sizes(n_blocks, segments)
    chen = chen_maps(n_blocks, segments)
    ex = counting_exercise(
        question=(f"A stack of N = {n_blocks} blocks, each saving one activation map for backward, is trained with "
                  f"checkpoint_sequential(blocks, {segments}, x, use_reentrant=False). Without checkpointing the "
                  f"peak holds {n_blocks} activation maps. How many activation maps does it hold at its peak now? "
                  f"Count the segment inputs checkpoint keeps and the largest segment alive at once; do not count "
                  f"the model's input x (it is an input, alive with or without checkpointing) or gradients."),
        expected=lambda: checkpoint_sequential_maps(n_blocks, segments),
        explain=(f"Segments of {sizes} blocks: the {len(sizes) - 1} inputs of the segments after the first are "
                 f"kept (the first segment's input is x itself), and at most {max(sizes)} maps of one segment "
                 f"exist at once (the last segment is not checkpointed, the others are recomputed one at a time "
                 f"in backward): (k - 1) + largest segment. Chen et al.'s N/k + k = {chen:g} counts x as one of "
                 f"the k kept inputs, so when k divides N it is exactly one map more ({LABEL_FORMULA}). The "
                 f"panel below measures the activation side within about one map of this (a gradient in "
                 f"flight, or a map freed before the step's peak, which comes in backward)."),
        unit="maps", rel_tol=0.0,
        hint="Count two things: the inputs checkpoint keeps at segment boundaries (the first segment's input is "
             "x, the model input), and the most maps of one segment that exist at the same time.")
    plain_check = ex.check

    def check(answer):
        res = plain_check(answer)
        try:
            said = float(answer)
        except (TypeError, ValueError, OverflowError):
            return res
        if not res.ok and chen != res.expected and said == chen:
            return CheckResult(False, answer, res.expected,
                               f"You said {chen:g} maps: that is Chen et al.'s N/k + k, which counts the k kept "
                               f"segment inputs including the first one. The first segment's input is the model's "
                               f"input x, not an activation: the tracker counts it under inputs, with or without "
                               f"checkpointing. Leave it out and count again.")
        return res

    ex.check = check
    return ex


def checkpoint_claims(result: CheckpointResult, deeper: CheckpointResult | None = None):
    """The articles' checkpointing claims, with verdicts computed from a sweep (and, for "the
    deeper, the more it saves", a second sweep of a deeper stack)."""
    from gpulab.course.claims import BREAKS, HOLDS, ClaimCheck, ClaimReport, Evidence
    checks = []
    base, best = result.baseline, result.best
    saved = base.peak_bytes - best.peak_bytes
    slow = result.slowdown(best, "min")
    lab = result.label
    ev = [Evidence("peak without checkpointing", format_bytes(base.peak_bytes), lab),
          Evidence(f"peak at k = {best.segments}", format_bytes(best.peak_bytes), lab)]
    if slow is not None:
        ev.append(Evidence(f"step time at k = {best.segments} vs k = 1 (fastest runs)", f"×{slow:.2f}",
                           result.timing_label))
    checks.append(ClaimCheck(
        "checkpoint keeps only part of what backward needs and recomputes the rest: less memory, more compute.",
        "article 003", HOLDS if saved > 0 and (slow is None or slow > 1.0) else BREAKS,
        (f"The lowest peak (k = {best.segments}) is {format_bytes(saved)} below no checkpointing "
         f"({100 * saved / base.peak_bytes:.0f}% of the step's peak)"
         + (f", and the step takes ×{slow:.2f} as long (fastest runs compared)." if slow is not None
            else "; not timed on this engine.")),
        ev))
    root = result.sqrt_n
    best_maps = best.activation_side / result.map_bytes
    # O(√N): the best peak is near Chen's minimum 2√N maps (+1.5 for the gradient in flight), at a k
    # of the order of √N (within a factor of two)
    near = best_maps <= 2 * root + 1.5 and root / 2 <= best.segments <= 2 * root
    checks.append(ClaimCheck(
        "Keep one activation every √N layers (Chen et al. 2016): memory falls from O(N) to O(√N).",
        "article 003", HOLDS if near else BREAKS,
        (f"The measured minimum is at k = {best.segments} segments (√N = {root:.1f}), holding {best_maps:.0f} maps "
         f"against {base.activation_side / result.map_bytes:.0f} without checkpointing; Chen's minimum is "
         f"2√N = {2 * root:.1f}. With checkpoint_sequential, k that does not "
         f"divide N wastes memory, and any k above N/2 saves nothing: its segments have N // k = 1 block and the "
         f"un-checkpointed last segment takes all the rest.")
        if near else (f"The measured minimum is at k = {best.segments} with {best_maps:.0f} maps, far from √N = "
                      f"{root:.1f} and 2√N = {2 * root:.1f} maps."),
        [Evidence("best k (measured)", str(best.segments), lab), Evidence("√N", f"{root:.2f}", LABEL_FORMULA),
         Evidence("best k (checkpoint_sequential formula)", str(best_segments(result.n_blocks)), LABEL_FORMULA)]))
    if slow is not None or deeper is not None:
        ev, parts, verdicts = [], [], []
        if deeper is not None:
            f1 = 1 - best.activation_side / base.activation_side
            d_best, d_base = deeper.best, deeper.baseline
            f2 = 1 - d_best.activation_side / d_base.activation_side
            verdicts.append("holds for memory" if f2 > f1 else "breaks for memory")
            parts.append(f"Activation memory saved at the best k: {100 * f1:.0f}% for N = {result.n_blocks}, "
                         f"{100 * f2:.0f}% for N = {deeper.n_blocks} (the √N rule: 1 − 2√N/N grows with N).")
            ev += [Evidence(f"activation side saved, N = {result.n_blocks}", f"{100 * f1:.0f}%", lab),
                   Evidence(f"activation side saved, N = {deeper.n_blocks}", f"{100 * f2:.0f}%", deeper.label)]
        if slow is not None:
            pred = result.recompute_overhead(best)
            verdicts.append("the slowdown is modest" if slow <= 1.5 else "breaks for speed on this CPU")
            med = result.slowdown(best)
            parts.append(f"At k = {best.segments} one step took ×{slow:.2f} as long comparing the fastest runs "
                         f"(×{med:.2f} comparing medians), against ×{pred:.2f} predicted for one extra forward of "
                         f"the checkpointed blocks; the rest is checkpoint's own Python overhead and this shared "
                         f"CPU's noise. {result.timing_verdict(best)} A GPU's ratio differs: measure there.")
            ev += [Evidence(f"measured time at k = {best.segments} vs k = 1, fastest runs", f"×{slow:.2f}",
                            result.timing_label),
                   Evidence(f"measured time at k = {best.segments} vs k = 1, medians", f"×{med:.2f}",
                            result.timing_label),
                   Evidence("formula: one extra forward of the checkpointed blocks", f"×{pred:.2f}", LABEL_FORMULA)]
        checks.append(ClaimCheck(
            "The deeper the model, the more it saves, and it is not noticeably slower.", "article 003",
            "; ".join(verdicts), " ".join(parts), ev))
    return ClaimReport("What the reference articles claim about checkpointing, tested", checks)


def exercise_many_segments(n_blocks: int = 16, segments: int = 12):
    """Predict-first (qualitative): more segments than N/2 with ``checkpoint_sequential``.
    The answer comes from ``checkpoint_sequential_maps`` (the segment layout of
    torch/utils/checkpoint.py), which the panel's measurement follows."""
    from gpulab.course.exercises import ChoiceExercise
    validate_positive(n_blocks=n_blocks, segments=segments)
    base = checkpoint_sequential_maps(n_blocks, 1)

    def expected() -> str:
        many, best = checkpoint_sequential_maps(n_blocks, segments), checkpoint_sequential_maps(n_blocks, 4)
        if many <= best:
            return "a"
        return "c" if many >= base else "b"

    sizes = segment_sizes(n_blocks, segments)
    return ChoiceExercise(
        question=(f"Same stack of N = {n_blocks} blocks. Someone reasons \"more checkpoints, less memory\" and "
                  f"calls checkpoint_sequential(blocks, {segments}, x, use_reentrant=False). Compared with k = 4 "
                  f"and with no checkpointing (k = 1), what does k = {segments} hold at its peak?"),
        options={"a": "fewer activation maps than k = 4",
                 "b": "more than k = 4 but fewer than k = 1",
                 "c": "as many as no checkpointing at all"},
        expected=expected,
        explain=(f"checkpoint_sequential cuts {n_blocks} blocks into segments of {n_blocks} // {segments} = "
                 f"{sizes[0]} block(s) and gives the last, un-checkpointed segment the rest: {sizes}. It keeps "
                 f"{len(sizes) - 1} boundaries and holds the last segment's {sizes[-1]} maps: "
                 f"{checkpoint_sequential_maps(n_blocks, segments)} maps, against {base} without checkpointing "
                 f"({LABEL_FORMULA}; the panel's k = {segments} point measures it)."))
