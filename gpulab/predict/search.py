"""Search for the largest batch that fits: a gallop from a guess, then bisection.

Shared by ``gpulab fit`` and lesson 04's largest-batch panel (``gpulab.course.sweeps``)."""
from __future__ import annotations

from typing import Callable

__all__ = ["largest_fitting"]


def largest_fitting(guess: int, fits: Callable[[int], bool], upper: int | None = None,
                    limit: int = 1 << 24) -> int:
    """Largest b >= 0 with fits(b), for a monotone ``fits`` (true up to some batch, false after;
    fits(0) is taken as true), starting from ``guess``; ``upper`` is a batch known not to fit.
    Two calls when the guess is right; otherwise it gallops away from the guess (bisecting
    straight away when the guess fits and ``upper`` bounds the answer), then bisects: at most
    about 2·log2(|answer − guess|) + 2 calls. ``limit``: the largest batch ever tried (galloping
    stops there: for a ``fits`` that never fails, ``limit`` is the answer)."""
    guess = min(max(1, int(guess)), limit)
    if upper is not None:
        guess = min(guess, upper - 1)
        if guess < 1:
            return 0
    guess_fits = fits(guess)
    if guess_fits and upper is not None:
        lo, hi = guess, upper        # bracketed: bisect straight away
    elif guess_fits:
        lo, step = guess, 1
        while True:
            cand = min(lo + step, limit)
            if cand == lo:           # at the limit, and it fits
                return lo
            if upper is not None and cand >= upper:
                hi = upper
                break
            if not fits(cand):
                hi = cand
                break
            lo, step = cand, step * 2
    else:
        hi, step = guess, 1
        while True:
            cand = hi - step
            if cand < 1:
                lo = 0
                break
            if fits(cand):
                lo = cand
                break
            hi, step = cand, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
