"""How long a lesson's core path takes in the room: the one-day workshop's model (issues #37, #47).

A lesson's core-path minutes are the sum of five parts, each computed from the notebook or
measured, none typed in, times the talk factor:

* **reading**: the words of its core-path markdown, and of the markdown its core-path cells
  render, at ``WORDS_PER_MINUTE`` (150);
* **predict first**: ``MINUTES_PER_QUESTION`` (2.5) for each predict-first question on the core
  path: each call of an exercise checker (``.check(``) in a core-path code cell, since every
  question's answer goes to one (gpulab/course/exercises.py);
* **running**: the wall time of its core-path code cells, read from the record
  ``docs/lesson-times.json`` that ``benchmarks/lesson_times.py --record`` writes (per cell,
  ``wall_s``: the seconds a student waits for it, on a shared 2-core machine);
* **looking**: ``MINUTES_PER_DISPLAY`` (1) for each table or plot its core-path cells display
  (the record's ``tables`` and ``plots``: HTML tables and images among a cell's outputs; panels
  are the demo's);
* **demo**: the instructor's live demonstration, stated by the lesson's first markdown cell
  ("demo about N minutes" on its **Time:** line);

and ``TALK_FACTOR`` (1.15): the instructor's words around each part and the room's short
questions, on top of all five. The day adds 15 minutes of set-up and 10% of the lessons' minutes
for the room's questions (tests/test_day_plan.py).

**The core path.** A notebook is read top to bottom, line by line through its markdown cells. A
heading whose text contains "(optional)" opens an optional section, which runs until the next
heading of the same or a higher level (as many ``#`` or fewer) without "(optional)" (a line in a
fenced code block is no heading, and a heading that starts "Predict first" belongs to the section
above it, whatever its level: it neither opens nor closes one); everything
inside it (markdown lines and code cells) is off the core path. The heading "## Questions" ends
the core path: the end-of-lesson questions and their collapsed answers are review, not the day.
A collapsed block (from a line starting ``<details`` to the line holding ``</details>``) is off the
core path too: detail kept for those who open it. A code cell belongs to the section of the last heading above it. ``section`` models one section
(an extension module's part) the same way, without a demo.

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
    "WORDS_PER_MINUTE", "MINUTES_PER_QUESTION", "MINUTES_PER_DISPLAY", "TALK_FACTOR", "LessonTime",
    "CoreSection", "core_path", "section", "lesson_time", "section_time", "stated_minutes",
    "words_of", "cell_key", "RECORD_COMMAND",
]

WORDS_PER_MINUTE = 150
MINUTES_PER_QUESTION = 2.5
MINUTES_PER_DISPLAY = 1.0
TALK_FACTOR = 1.15
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
    """One lesson's modelled core path (or one section), in its parts (minutes unless said
    otherwise): ``words`` read (markdown and rendered markdown), predict-first ``questions``,
    ``run_seconds`` of wall time, ``displays`` (tables and plots) and the ``demo``."""
    lesson: str
    words: int
    questions: int
    run_seconds: float
    demo: int
    displays: int = 0

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
    def looking(self) -> float:
        return self.displays * MINUTES_PER_DISPLAY

    @property
    def minutes(self) -> float:
        return TALK_FACTOR * (self.reading + self.predicting + self.running + self.looking + self.demo)

    def row(self) -> dict:
        """The parts as a table row (minutes to one decimal)."""
        return {"lesson": self.lesson, "words": self.words, "reading": round(self.reading, 1),
                "questions": self.questions, "predicting": self.predicting,
                "running": round(self.running, 1), "displays": self.displays,
                "looking": round(self.looking, 1), "demo": self.demo,
                "core path": round(self.minutes, 1)}


def cell_key(cell: dict, index: int) -> str:
    """How the record names a code cell: its id, or ``cell-<index>`` for a cell stored without one."""
    return cell.get("id") or f"cell-{index}"


def words_of(text: str) -> int:
    """The words a student reads in a markdown text (see the module's **Words**)."""
    text = _LINK_TARGET.sub("]", _TAG.sub(" ", text))
    return sum(1 for token in text.split() if _WORD.search(token))


_words = words_of


def core_path(cells: list[dict], whole: bool = False) -> CoreSection:
    """The core path of a notebook's cells (nbformat dicts: ``cell_type``, ``source``, ``id``);
    with ``whole``, the lesson in full: every section and collapsed block up to the questions."""
    markdown, code, questions = [], [], []
    optional_at: int | None = None   # the level of the optional heading we are under, if any
    for index, cell in enumerate(cells):
        source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        if cell["cell_type"] == "code":
            if optional_at is None:
                code.append(cell_key(cell, index))
                questions += [cell_key(cell, index)] * len(_CHECK.findall(source))
            continue
        if cell["cell_type"] != "markdown":
            continue
        fenced = False   # inside a ``` block a line starting with # is code, not a heading
        collapsed = False   # inside a <details> block: read by those who open it, not in the day
        for line in source.splitlines():
            if line.lstrip().startswith(("```", "~~~")):
                fenced = not fenced
            if not fenced and _QUESTIONS.match(line):
                return CoreSection(tuple(markdown), tuple(code), tuple(questions))
            if not fenced and not whole and line.lstrip().startswith("<details"):
                collapsed = True
            if collapsed:
                collapsed = "</details>" not in line
                continue
            m = None if fenced else _HEADING.match(line)
            if m and not whole and not _PART_OF_SECTION.match(m.group(2)):
                level, title = len(m.group(1)), m.group(2)
                if "(optional)" in title:
                    optional_at = level if optional_at is None else min(optional_at, level)
                elif optional_at is not None and level <= optional_at:
                    optional_at = None
            if optional_at is None:
                markdown.append(line)
    return CoreSection(tuple(markdown), tuple(code), tuple(questions))


def section(cells: list[dict], title: str) -> CoreSection:
    """One section of a notebook: from the heading whose text starts with ``title`` to the next
    heading of the same or a higher level (a "Predict first" heading belongs to it), its markdown
    lines, code cells and checkers. ValueError when no heading starts so."""
    markdown, code, questions = [], [], []
    level: int | None = None   # the level of the section's heading once found
    done = False
    for index, cell in enumerate(cells):
        if done:
            break
        source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        if cell["cell_type"] == "code":
            if level is not None:
                code.append(cell_key(cell, index))
                questions += [cell_key(cell, index)] * len(_CHECK.findall(source))
            continue
        if cell["cell_type"] != "markdown":
            continue
        fenced = False
        for line in source.splitlines():
            if line.lstrip().startswith(("```", "~~~")):
                fenced = not fenced
            m = None if fenced else _HEADING.match(line)
            if m and level is None and m.group(2).startswith(title):
                level = len(m.group(1))
            elif m and level is not None and len(m.group(1)) <= level \
                    and not _PART_OF_SECTION.match(m.group(2)):
                done = True
                break
            if level is not None:
                markdown.append(line)
    if level is None:
        raise ValueError(f"no heading starts with {title!r}: name a section by its heading's first words")
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
    wall = cell.get("wall_s")
    return math.nan if wall is None else wall


def _modelled(name: str, number: str, part: CoreSection, record: dict, demo: int) -> LessonTime:
    measured = record.get("lessons", {}).get(name, {}).get("cells", {})
    missing = [i for i in part.code_ids if i not in measured or math.isnan(_seconds(measured[i]))
               or "tables" not in measured[i]]
    if missing:
        raise ValueError(f"{name}: core-path code cell {missing[0]} has no measured time or displays in "
                         f"docs/lesson-times.json; re-record: {RECORD_COMMAND.format(number=number)}")
    cells = [measured[i] for i in part.code_ids]
    run = sum(_seconds(c) for c in cells)
    words = sum(words_of(line) for line in part.markdown) + sum(c.get("words", 0) for c in cells)
    displays = sum(c["tables"] + c["plots"] for c in cells)
    return LessonTime(name, words, len(part.questions), run, demo, displays)


def lesson_time(notebook: Path, record: dict, whole: bool = False) -> LessonTime:
    """The modelled core path of one lesson notebook (with ``whole``, the lesson in full), from its
    text and the record of its cells' run times and displays (the parsed ``docs/lesson-times.json``)."""
    notebook = Path(notebook)
    cells = json.loads(notebook.read_text())["cells"]
    _, demo = stated_minutes(notebook)
    if demo is None:
        raise ValueError(f"{notebook.name}: its first cell's Time line states no 'demo about N minutes'")
    return _modelled(notebook.stem, notebook.name[:2], core_path(cells, whole), record, demo)


def section_time(notebook: Path, title: str, record: dict) -> LessonTime:
    """The modelled minutes of one section of a lesson (``section``), without a demo: an extension
    module's part."""
    notebook = Path(notebook)
    cells = json.loads(notebook.read_text())["cells"]
    return _modelled(notebook.stem, notebook.name[:2], section(cells, title), record, 0)
