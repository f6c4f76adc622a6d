"""A timing with its spread, and a comparison of two timings that draws a conclusion only where the
spread allows it (issue 47, item 8: "timings show their spread and refuse to draw a conclusion the
noise does not support"). Used by every time comparison the core lessons render (04, 07).

A timing (``record.runs.checkpoint.Timing``) is a few samples; its **band** is [fastest, slowest]
(``"range"``) or its interquartile range (``"iqr"``). The ratio of two timings is given with its
span: from the lowest the two bands allow (the numerator's low over the denominator's high) to the
highest. When the span holds 1 the bands overlap, and the measurement cannot tell the two apart:
``NO_CONCLUSION``. Pure functions of the samples.
"""
from __future__ import annotations

from dataclasses import dataclass

from gpulab.record.runs.checkpoint import Timing

__all__ = ["NO_CONCLUSION", "Ratio", "band", "ratio", "spread"]

NO_CONCLUSION = "within noise: no conclusion"
BANDS = ("range", "iqr")


def band(t: Timing, kind: str = "range") -> tuple[float, float]:
    """(low, high) of ``t``'s samples: [fastest, slowest] for ``"range"``, the interquartile range
    for ``"iqr"`` (the range itself under four samples)."""
    if kind not in BANDS:
        raise ValueError(f"band must be one of {', '.join(BANDS)}, got {kind!r}")
    return (t.min, max(t.samples)) if kind == "range" else (t.low, t.high)


def spread(t: Timing, kind: str = "range", *, scale: float = 1e3, unit: str = "ms", digits: int = 1) -> str:
    """The figure beside its band: "12.3 ms [12.3–14.0]" (range: the fastest is the figure) or
    "12.8 ms [12.5–13.1]" (iqr: the median is)."""
    lo, hi = band(t, kind)
    mid = t.min if kind == "range" else t.median
    return f"{mid * scale:,.{digits}f} {unit} [{lo * scale:,.{digits}f}–{hi * scale:,.{digits}f}]"


@dataclass(frozen=True)
class Ratio:
    """A ratio of two timings (times ``scale``): the figure and the span its bands allow."""
    value: float
    low: float
    high: float

    @property
    def within_noise(self) -> bool:
        """Whether the span holds 1: the two bands overlap, so no difference is shown."""
        return self.low <= 1.0 <= self.high

    def text(self, digits: int = 2) -> str:
        """"×1.52 [×1.40–×1.66]", with ``NO_CONCLUSION`` added when the span holds 1."""
        s = f"×{self.value:.{digits}f} [×{self.low:.{digits}f}–×{self.high:.{digits}f}]"
        return f"{s}, {NO_CONCLUSION}" if self.within_noise else s


def ratio(num: Timing, den: Timing, kind: str = "range", *, scale: float = 1.0) -> Ratio:
    """``scale`` × num / den: the figure (fastest over fastest for ``"range"``, median over median for
    ``"iqr"``) and its span, from num's low over den's high to num's high over den's low."""
    (nl, nh), (dl, dh) = band(num, kind), band(den, kind)
    mid = num.min / den.min if kind == "range" else num.median / den.median
    return Ratio(scale * mid, scale * nl / dh, scale * nh / dl)
