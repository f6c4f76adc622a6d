"""docs/teaching.md's one-day workshop (issue #26): its arithmetic holds and it is made of the
lessons' own core paths. Each lesson row's slot lasts exactly the core path its notebook states
(``core path about M minutes`` on the first cell's **Time:** line), the slots follow each other
without gaps, the core paths add up to 6½ hours, and the day includes lessons 11, 13 and the
capstone. Every lesson also has what the guide promises: outcomes, a time, predict-first
questions, and questions with answers."""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from conftest import LESSONS

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "teaching.md"
CORE = re.compile(r"core path about (\d+) minutes")
SLOT = re.compile(r"^\| (\d+):(\d\d)–(\d+):(\d\d) \| ([^|]+) \|")
NOTEBOOKS = sorted(LESSONS.glob("[0-9][0-9]_*.ipynb"))


def _plan() -> list[tuple[int, int, str]]:
    """(start minute, end minute, what) for each row of the one-day table."""
    text = GUIDE.read_text()
    day = text[text.index("## A one-day workshop"):]
    day = day[:day.index("\n## ", 3)]
    rows = []
    for line in day.splitlines():
        m = SLOT.match(line)
        if m:
            h0, m0, h1, m1, what = m.groups()
            rows.append((int(h0) * 60 + int(m0), int(h1) * 60 + int(m1), what.strip()))
    return rows


def _core_minutes(number: str) -> int:
    (path,) = LESSONS.glob(f"{number}_*.ipynb")
    first = next(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown")
    m = CORE.search(first)
    assert m, f"lesson {number} states no core path on its Time line"
    return int(m.group(1))


def test_the_day_is_the_lessons_core_paths_and_adds_up_to_six_and_a_half_hours():
    rows = _plan()
    assert rows, "no one-day table found in docs/teaching.md"
    for (_, end, _), (start, _, _) in zip(rows, rows[1:]):
        assert start == end, "the slots must follow each other without gaps"
    lessons = {what[:2]: end - start for start, end, what in rows if what[:2].isdigit()}
    for number, minutes in lessons.items():
        assert minutes == _core_minutes(number), f"lesson {number}: the plan's slot is not its core path"
    assert sum(lessons.values()) == 390
    assert {"11", "13", "14"} <= set(lessons), "the day must include LLMs, PyTorch's tools and the capstone"
    # every lesson not taught in the day is homework with a core path of 0, and the guide says so
    for path in NOTEBOOKS:
        number = path.name[:2]
        if number not in lessons:
            assert _core_minutes(number) == 0, f"lesson {number} is neither in the day nor homework"
            assert f"lessons {number}" in GUIDE.read_text() or f" {number} (" in GUIDE.read_text() \
                or f"lesson {number}" in GUIDE.read_text(), f"the guide does not place lesson {number}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_lesson_has_outcomes_time_predict_first_questions_and_answers(path):
    cells = nbformat.read(path, as_version=4).cells
    markdown = "\n".join(c.source for c in cells if c.cell_type == "markdown")
    first = next(c.source for c in cells if c.cell_type == "markdown")
    assert "**Time:**" in first and CORE.search(first), f"{path.name}: no Time line with a core path"
    opening = "\n".join(c.source for c in cells[:4] if c.cell_type == "markdown").lower()
    assert "check yourself" in opening, f"{path.name}: no 'check yourself' outcomes at the start"
    assert re.search(r"^#+ .*Predict first", markdown, re.M | re.I), f"{path.name}: no predict-first question"
    assert re.search(r"^## Questions", markdown, re.M), f"{path.name}: no Questions section"
    assert "<details><summary>Answers</summary>" in markdown, f"{path.name}: no answers block"
