"""Lesson 14's decision table with time (issue 46, item 6): each row's predicted step at its largest
batch, and the answer as the fastest plan that fits.

Every row of ``capstone.DecisionTable`` holds ``gpulab.fit``'s answer, and ``fit`` already predicts
the step's time at the batch it found (``FitResult.time``, a ``predict.plan_time.PlanTime``: a
roofline per op of the fake run on the card's datasheet, its assumptions named), or says why it
cannot (``FitResult.time_note``: a card with no peak for the row's dtype). So this adds no run: it
reads the rows. A row's speed is its tokens (or samples) a second at its largest batch; the time to
the table's global batch is its micro-batches times one micro-batch's step (each counted with its
optimizer step: an upper bound on accumulation, whose optimizer runs once). The fastest plan that
fits is the timed row with the most tokens a second, which is what ``gpulab fit MODEL --gpu CARD
--fastest`` answers over a longer list of recipes (``gpulab.predict.what_fits``).
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from gpulab.course.capstone import DecisionTable, Row
from gpulab.course.exercises import ChoiceExercise
from gpulab.tables import html_table

__all__ = ["FastestPlan", "exercise_fastest", "fastest_plan"]


@dataclass
class FastestPlan:
    table: DecisionTable

    def timed(self) -> list[Row]:
        return [r for r in self.table.rows if r.fit.time is not None]

    @property
    def fastest(self) -> Row | None:
        """The fitting row with the most tokens (or samples) a second at its largest batch."""
        return max(self.timed(), key=lambda r: r.fit.time.items_per_s, default=None)

    def to_global_batch_s(self, r: Row) -> float | None:
        m = self.table.micro_batches(r.name)
        return None if m is None or r.fit.time is None else m * r.fit.time.seconds

    def rows(self) -> list[list[Any]]:
        out = []
        for r in self.table.rows:
            t = r.fit.time
            if t is None:
                out.append([r.name, r.largest_batch, "—", "—", "—", "—", r.fit.time_note.split(" (")[0] or "not timed"])
                continue
            out.append([r.name, r.largest_batch, f"{t.seconds * 1e3:,.1f}", f"{t.items_per_s:,.0f}", f"{t.mfu:.1%}",
                        f"{self.to_global_batch_s(r):,.2f}", "fastest" if r is self.fastest else ""])
        return out

    def _repr_html_(self) -> str:
        t = next((r.fit.time for r in self.table.rows if r.fit.time is not None), None)
        unit = t.unit if t else "tokens"
        note = (f"{self.table.you.name} on {self.table.you.card.name}, each row at its largest batch (gpulab.fit). "
                + (f"{t.label}; {t.assumptions.text} ({t.assumptions.source}). " if t else "")
                + f"Seconds to the global batch of {self.table.target_batch}: micro-batches × the step, each with its "
                  f"optimizer step (an upper bound).")
        return html_table(["recipe", "largest batch", "step ms (predicted)", f"{unit}/s (predicted)", "MFU",
                           f"seconds to {self.table.target_batch} samples (predicted)", ""], self.rows(), note)

    def sentences(self) -> list[str]:
        f = self.fastest
        if f is None:
            return [f"No row could be timed on {self.table.you.card.name}: " + (self.table.rows[0].fit.time_note or "")]
        base = self.table.baseline
        out = [f"The fastest plan that fits: {f.name}, {f.fit.time.items_per_s:,.0f} {f.fit.time.unit}/s at batch "
               f"{f.largest_batch} (predicted, {f.fit.time.label.split('(')[1].rstrip(')')})."]
        big = max(self.table.rows, key=lambda r: r.largest_batch)
        if big is not f and big.fit.time is not None:
            out.append(f"The largest batch, {big.name}'s {big.largest_batch}, is not the fastest: "
                       f"{big.fit.time.items_per_s:,.0f} {big.fit.time.unit}/s. Memory bought is not speed.")
        untimed = [r.name for r in self.table.rows if r.fit.time is None]
        if untimed:
            out.append(f"Not timed: {', '.join(untimed)} ({base.fit.time_note or self.table.row(untimed[0]).fit.time_note.split(' (')[0]}).")
        return out

    def decision(self):
        from gpulab.course.capstone import _Html
        return _Html("<ul>" + "".join(f"<li>{html.escape(s)}</li>" for s in self.sentences()) + "</ul>")

    def __repr__(self) -> str:
        return "\n".join(self.sentences())


def fastest_plan(table: DecisionTable) -> FastestPlan:
    """The decision table's rows with their predicted time (module docstring); no run of its own."""
    return FastestPlan(table)


def exercise_fastest(plan: FastestPlan) -> ChoiceExercise:
    """Predict first: which row trains the most tokens a second on your card? Computed from the
    rows' predicted times when the checker runs."""
    keys = "abcdefgh"
    options = {keys[i]: r.name for i, r in enumerate(plan.table.rows)}
    none = keys[len(options)]
    options[none] = "none can be told: the card has no speed figures for these recipes"

    def expected() -> str:
        f = plan.fastest
        return next((k for k, name in options.items() if f is not None and name == f.name), none)

    def explain() -> str:
        return " ".join(plan.sentences())
    return ChoiceExercise(f"Each recipe at its own largest batch on {plan.table.you.card.name}: which trains the most "
                          f"{'tokens' if plan.table.you.workload.kind == 'tokens' else 'samples'} a second?",
                          options, expected, explain,
                          hint="Weigh each recipe's largest batch against the compute it adds per sample")
