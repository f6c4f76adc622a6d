"""Predict-first exercises: the student writes a number, a checker says right or wrong and why.

The expected value is always computed (by a formula or a measurement) when the checker
runs, never typed into the lesson.
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Any, Callable

__all__ = [
    "CheckResult", "ChoiceExercise", "Exercise", "exercise_detach_keeps",
    "exercise_empty_cache_partial"
]


@dataclass
class CheckResult:
    ok: bool
    answer: Any
    expected: Any
    message: str

    def _repr_html_(self) -> str:
        mark = "✅ Right" if self.ok else "❌ Not yet"
        color = "#2a7" if self.ok else "#c33"
        return (f"<div class='gpulab-check' style='border-left:4px solid {color};padding-left:8px'>"
                f"<b>{mark}.</b> {html.escape(self.message)}</div>")

    def __repr__(self) -> str:
        return f"{'RIGHT' if self.ok else 'WRONG'}: {self.message}"

    def __bool__(self) -> bool:
        return self.ok


@dataclass
class Exercise:
    """``Exercise(question, expected=lambda: ..., explain=...)``; ``ex.check(answer)``.

    ``rel_tol`` is the relative tolerance (0 means exact); ``explain`` says how the
    expected value comes about and is shown with every verdict; ``hint`` for wrong
    answers of the right order of magnitude, ``unit`` names what to type (e.g. "bytes"); a wrong
    answer within a factor ``close`` of the expected value is called close (2 suits a size; a
    ratio near 1, such as a FLOPs ratio, needs a tighter one)."""
    question: str
    expected: Callable[[], float]
    explain: str
    unit: str = ""
    rel_tol: float = 0.0
    hint: str = ""
    ratio_hint: str = ""   # said instead of "check the bytes per element" for an answer 2, 4 or 8x off
    close: float = 2.0

    def check(self, answer: Any) -> CheckResult:
        exp = self.expected()
        if answer is None or answer is Ellipsis:
            return CheckResult(False, answer, exp, f"Replace the ... with your prediction{self._unit()} and run the cell again.")
        try:
            value = float(answer)
        except (TypeError, ValueError):
            return CheckResult(False, answer, exp, f"Expected a number{self._unit()}, got {answer!r}.")
        except OverflowError:   # an int too large for a float (10**400)
            value = math.inf
        if not math.isfinite(value):
            shown = repr(answer) if len(repr(answer)) <= 40 else repr(answer)[:37] + "..."
            return CheckResult(False, answer, exp, f"{shown} is not a size: expected a finite number"
                                                   f"{' of' + self._unit() if self.unit else ''}. "
                                                   f"Try again.")
        tol = abs(exp) * self.rel_tol
        if abs(value - exp) <= tol or value == exp:
            return CheckResult(True, answer, exp, f"{_num(exp)}{self._unit()}. {self.explain}")
        ratio = value / exp if exp else float("inf")
        why = ""
        if exp and abs(ratio - round(ratio)) < 1e-9 and round(ratio) in (2, 4, 8):
            why = f" Your answer is exactly {round(ratio)}x too big: {self.ratio_hint or 'check the bytes per element.'}"
        elif exp and abs(1 / ratio - round(1 / ratio)) < 1e-9 and round(1 / ratio) in (2, 4, 8) if ratio else False:
            why = f" Your answer is exactly {round(1 / ratio)}x too small: {self.ratio_hint or 'check the bytes per element.'}"
        elif exp and 1 / self.close < ratio < self.close:
            why = " Close, but not within tolerance." + (f" {self.hint}" if self.hint else "")
        elif self.hint:
            why = f" {self.hint}"
        return CheckResult(False, answer, exp, f"You said {_num(value)}{self._unit()}.{why} Try again.")

    def _unit(self) -> str:
        return f" {self.unit}" if self.unit else ""

    def reveal(self) -> CheckResult:
        exp = self.expected()
        return CheckResult(True, exp, exp, f"The answer: {_num(exp)}{self._unit()}. {self.explain}")


def _num(v: float) -> str:
    return f"{int(v):,}" if float(v).is_integer() else f"{v:,.4g}"


@dataclass
class ChoiceExercise:
    """A qualitative predict-first question: ``ChoiceExercise(question, options, expected, explain)``.

    ``options`` maps a short key ("a", "b", ...) to the text of each choice; ``expected`` is a
    callable that works out the right key when the checker runs (from a formula or a
    measurement), never a key typed into the lesson. ``ex.check("b")``."""
    question: str
    options: dict[str, str]
    expected: Callable[[], str]
    explain: str | Callable[[], str]
    # what a wrong answer is told to look at again; the default fits any question
    hint: str = "Read the question again beside what the lesson has shown so far"

    def _explain(self) -> str:
        return self.explain() if callable(self.explain) else self.explain

    def check(self, answer: Any) -> CheckResult:
        keys = ", ".join(f'"{k}"' for k in self.options)
        if answer is None or answer is Ellipsis:
            return CheckResult(False, answer, None, f"Replace the ... with one of {keys} and run the cell again.")
        key = str(answer).strip().lower().strip("()\"' ")
        if key not in self.options:
            return CheckResult(False, answer, None, f"Answer with one of {keys}; got {answer!r}.")
        exp = self.expected()
        if key == exp:
            return CheckResult(True, answer, exp, f"({exp}) {self.options[exp]}. {self._explain()}")
        return CheckResult(False, answer, exp, f"Not ({key}): {self.options[key]}. {self.hint}, then try again.")

    def reveal(self) -> CheckResult:
        exp = self.expected()
        return CheckResult(True, exp, exp, f"The answer: ({exp}) {self.options[exp]}. {self._explain()}")

    def _repr_html_(self) -> str:
        items = "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>" for k, v in self.options.items())
        return f"<div class='gpulab-question'>{html.escape(self.question)}<ul>{items}</ul></div>"


# --- lessons 09 and 10 need no course module of their own: their checkers live here -------------------

def exercise_empty_cache_partial(mib: int = 6) -> ChoiceExercise:
    """Lesson 09, predict-first (qualitative): two tensors share one segment; one is freed and
    ``empty_cache()`` is called. The answer is worked out by the allocator simulator, without and
    with expandable segments (whose free pages can be unmapped from a segment still in use)."""
    from gpulab.allocator.simulator import MiB, CachingAllocator

    def reserved_drop(expandable: bool) -> int:
        a = CachingAllocator(expandable_segments=expandable)
        x = a.malloc(mib * MiB)
        a.malloc(mib * MiB)
        before = a.memory_reserved()
        a.free(x)
        a.empty_cache()
        return before - a.memory_reserved()

    def expected() -> str:
        drop = reserved_drop(False)
        return "a" if drop == 0 else ("b" if drop <= mib * MiB else "c")

    def explain() -> str:
        off, on = reserved_drop(False), reserved_drop(True)
        exp_text = (f"it drops by {on / MiB:g} MiB: empty_cache() unmaps the free pages of a segment still in use"
                    if on else
                    "it drops by 0 MiB here too: empty_cache() can unmap free pages of a segment still in use, but "
                    "pages are 20 MiB in the large pool, and the freed block shares its page with the live one")
        return (f"Simulated allocator: reserved drops by {off / MiB:g} MiB with the default allocator, because "
                f"empty_cache() returns only whole free segments and this one still holds a live block. With "
                f"expandable_segments {exp_text}.")

    return ChoiceExercise(
        question=(f"A fresh allocator (default settings). Two float32 tensors of {mib} MiB each land in the same "
                  f"20 MiB segment. You delete one and call torch.cuda.empty_cache(). What happens to "
                  f"memory_reserved()?"),
        options={"a": "nothing: it stays the same",
                 "b": f"it drops by the freed {mib} MiB",
                 "c": "it drops to the remaining tensor's size"},
        expected=expected, explain=explain)


def exercise_detach_keeps(iterations: int = 4) -> ChoiceExercise:
    """Lesson 10, predict-first (qualitative): what an evaluation loop keeps per iteration when it
    appends ``loss.detach()``. Measured by the live-tensor tracker when the checker runs."""
    import torch
    from torch import nn

    from gpulab.measure.tracking import MemoryTracker

    def growth() -> int:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
        losses = []
        with MemoryTracker() as t:
            for _ in range(iterations):
                x = torch.randn(64, 256)
                loss = model(x).pow(2).mean()
                losses.append(loss.detach())
            del x, loss
        kept = sum(r.nbytes for r in t.result().alive() if not r.preexisting)
        return kept // iterations

    def expected() -> str:
        g = growth()
        return "a" if g == 0 else ("b" if g <= 64 else "c")

    def explain() -> str:
        return (f"Measured on CPU (live tensors): {growth()} bytes kept per iteration, the 4-byte scalar loss "
                f"itself. detach() returns a tensor that shares the loss's storage but has no grad_fn, so the "
                f"graph, and the activations it saved, die when loss is rebound. Unlike loss.item() it does not "
                f"copy the value to the CPU, so on a GPU it does not wait for the kernels to finish.")

    return ChoiceExercise(
        question=(f"The same leaky evaluation loop, fixed with losses.append(loss.detach()). How much does each "
                  f"iteration keep alive once the loop has moved on?"),
        options={"a": "nothing at all", "b": "a few bytes: the scalar loss", "c": "the graph's saved activations"},
        expected=expected, explain=explain)
