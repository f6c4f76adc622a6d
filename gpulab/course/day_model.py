"""How long a lesson's core path takes in the room: the one-day workshop's model (issue #37).

A lesson's core-path minutes are the sum of four parts, each computed from the notebook or
measured, none typed in:

* **reading**: the words of its core-path markdown at ``WORDS_PER_MINUTE`` (180);
* **predict first**: ``MINUTES_PER_QUESTION`` (2) for each predict-first question on the core
  path: each call of an exercise checker (``.check(``) in a core-path code cell, since every
  question's answer goes to one (gpulab/course/exercises.py);
* **running**: the headless run time of its core-path code cells, read from the record
  ``docs/lesson-times.json`` that ``benchmarks/lesson_times.py --record`` writes (per cell,
  ``min(cpu_s, wall_s)``: the kernel's CPU seconds, capped by the wall seconds so that a
  multithreaded cell is not counted twice);
* **demo**: the instructor's live demonstration, stated by the lesson's first markdown cell
  ("demo about N minutes" on its **Time:** line).

**The core path.** A notebook is read top to bottom, line by line through its markdown cells. A
heading whose text contains "(optional)" opens an optional section, which runs until the next
heading of the same or a higher level (as many ``#`` or fewer) without "(optional)" (a line in a
fenced code block is no heading, and a heading that starts "Predict first" belongs to the section
above it, whatever its level: it neither opens nor closes one); everything
inside it (markdown lines and code cells) is off the core path. The heading "## Questions" ends
the core path: the end-of-lesson questions and their collapsed answers are review, not the day.
A code cell belongs to the section of the last heading above it.

**Words.** In markdown text, HTML tags and link targets (``](url)``) are dropped; a word is then a
whitespace-separated token with at least one letter or digit (inline code and formulas count
as the words a student reads in them).

Bad input (a core-path code cell with no time in the record, no demo on the Time line) raises
``ValueError`` with one line that says what to do.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "WORDS_PER_MINUTE", "MINUTES_PER_QUESTION", "LessonTime", "CoreSection", "core_path",
    "lesson_time", "stated_minutes", "RECORD_COMMAND",
]

WORDS_PER_MINUTE = 180
MINUTES_PER_QUESTION = 2
RECORD_COMMAND = ".venv/bin/python benchmarks/lesson_times.py --record --only {number}"

_HEADING = re.compile(r"^(#{1,6})\s+(.*)$")
_QUESTIONS = re.compile(r"^##\s+Questions\b")
_CHECK = re.compile(r"\.check\(")
_PART_OF_SECTION = re.compile(r"predict first\b", re.I)   # "## Predict first" under "## 9. ... (optional)"
_TAG = re.compile(r"<[^>]+>")
_LINK_TARGET = re.compile(r"\]\([^)]*\)")
_WORD = re.compile(r"[A-Za-z0-9]")
_DEMO = re.compile(r"demo about (\d+) minutes")
_CORE = re.compile(r"core path about (\d+) minutes")


@dataclass(frozen=True)
class CoreSection:
    """What the core path of one notebook holds: its markdown lines, its code cells' ids, and
    the ids of its code cells that check a predict-first answer (once per ``.check(`` call)."""
    markdown: tuple[str, ...]
    code_ids: tuple[str, ...]
    questions: tuple[str, ...]


@dataclass(frozen=True)
class LessonTime:
    """One lesson's modelled core path, in its parts (minutes unless said otherwise)."""
    lesson: str
    words: int
    questions: int
    run_seconds: float
    demo: int

    @property
    def reading(self) -> float:
        return self.words / WORDS_PER_MINUTE

    @property
    def predicting(self) -> float:
        return self.questions * MINUTES_PER_QUESTION

    @property
    def running(self) -> float:
        return self.run_seconds / 60

    @property
    def minutes(self) -> float:
        return self.reading + self.predicting + self.running + self.demo

    def row(self) -> dict:
        """The parts as a table row (minutes to one decimal)."""
        return {"lesson": self.lesson, "words": self.words, "reading": round(self.reading, 1),
                "questions": self.questions, "predicting": self.predicting,
                "running": round(self.running, 1), "demo": self.demo, "core path": round(self.minutes, 1)}


def _words(text: str) -> int:
    text = _LINK_TARGET.sub("]", _TAG.sub(" ", text))
    return sum(1 for token in text.split() if _WORD.search(token))


def core_path(cells: list[dict]) -> CoreSection:
    """The core path of a notebook's cells (nbformat dicts: ``cell_type``, ``source``, ``id``)."""
    markdown, code, questions = [], [], []
    optional_at: int | None = None   # the level of the optional heading we are under, if any
    for cell in cells:
        source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        if cell["cell_type"] == "code":
            if optional_at is None:
                code.append(cell.get("id", ""))
                questions += [cell.get("id", "")] * len(_CHECK.findall(source))
            continue
        if cell["cell_type"] != "markdown":
            continue
        fenced = False   # inside a ``` block a line starting with # is code, not a heading
        for line in source.splitlines():
            if line.lstrip().startswith(("```", "~~~")):
                fenced = not fenced
            if not fenced and _QUESTIONS.match(line):
                return CoreSection(tuple(markdown), tuple(code), tuple(questions))
            m = None if fenced else _HEADING.match(line)
            if m and not _PART_OF_SECTION.match(m.group(2)):
                level, title = len(m.group(1)), m.group(2)
                if "(optional)" in title:
                    optional_at = level if optional_at is None else min(optional_at, level)
                elif optional_at is not None and level <= optional_at:
                    optional_at = None
            if optional_at is None:
                markdown.append(line)
    return CoreSection(tuple(markdown), tuple(code), tuple(questions))


def _first_markdown(cells: list[dict]) -> str:
    cell = next(c for c in cells if c["cell_type"] == "markdown")
    return cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])


def stated_minutes(notebook: Path) -> tuple[int, int | None]:
    """(core path, demo) minutes that a lesson's first markdown cell states; demo None if absent."""
    first = _first_markdown(json.loads(Path(notebook).read_text())["cells"])
    core, demo = _CORE.search(first), _DEMO.search(first)
    if not core:
        raise ValueError(f"{Path(notebook).name}: its first cell states no 'core path about N minutes'")
    return int(core.group(1)), int(demo.group(1)) if demo else None


def _seconds(cell: dict) -> float:
    cpu, wall = cell.get("cpu_s"), cell.get("wall_s")
    known = [s for s in (cpu, wall) if s is not None]
    return min(known) if known else math.nan


def lesson_time(notebook: Path, record: dict) -> LessonTime:
    """The modelled core path of one lesson notebook, from its text and the record of its cells'
    run times (the parsed ``docs/lesson-times.json``)."""
    notebook = Path(notebook)
    number = notebook.name[:2]
    cells = json.loads(notebook.read_text())["cells"]
    core = core_path(cells)
    _, demo = stated_minutes(notebook)
    if demo is None:
        raise ValueError(f"{notebook.name}: its first cell's Time line states no 'demo about N minutes'")
    measured = record.get("lessons", {}).get(notebook.stem, {}).get("cells", {})
    missing = [i for i in core.code_ids if i not in measured or math.isnan(_seconds(measured[i]))]
    if missing:
        raise ValueError(f"{notebook.stem}: core-path code cell {missing[0]} has no measured time in "
                         f"docs/lesson-times.json; re-record: {RECORD_COMMAND.format(number=number)}")
    run = sum(_seconds(measured[i]) for i in core.code_ids)
    words = sum(_words(line) for line in core.markdown)
    return LessonTime(notebook.stem, words, len(core.questions), run, demo)
