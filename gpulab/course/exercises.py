"""Predict-first exercises: the student writes a number, a checker says right or wrong and why.

The expected value is always computed (by a formula or a measurement) when the checker
runs, never typed into the lesson.
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any, Callable


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
    answers of the right order of magnitude, ``unit`` names what to type (e.g. "bytes")."""
    question: str
    expected: Callable[[], float]
    explain: str
    unit: str = ""
    rel_tol: float = 0.0
    hint: str = ""

    def check(self, answer: Any) -> CheckResult:
        exp = self.expected()
        if answer is None or answer is Ellipsis:
            return CheckResult(False, answer, exp, f"Replace the ... with your prediction{self._unit()} and run the cell again.")
        try:
            value = float(answer)
        except (TypeError, ValueError):
            return CheckResult(False, answer, exp, f"Expected a number{self._unit()}, got {answer!r}.")
        tol = abs(exp) * self.rel_tol
        if abs(value - exp) <= tol or value == exp:
            return CheckResult(True, answer, exp, f"{_num(exp)}{self._unit()}. {self.explain}")
        ratio = value / exp if exp else float("inf")
        why = ""
        if exp and abs(ratio - round(ratio)) < 1e-9 and round(ratio) in (2, 4, 8):
            why = f" Your answer is exactly {round(ratio)}x too big: check the bytes per element."
        elif exp and abs(1 / ratio - round(1 / ratio)) < 1e-9 and round(1 / ratio) in (2, 4, 8) if ratio else False:
            why = f" Your answer is exactly {round(1 / ratio)}x too small: check the bytes per element."
        elif exp and 0.5 < ratio < 2:
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
