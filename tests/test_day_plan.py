"""docs/teaching.md's one-day workshop (issues #26, #37): a day that fits, by a model checked here.

Each lesson's core path is modelled from its notebook and the record of its cells' run times
(gpulab/course/day_model.py: its core-path words at 180 a minute, 2 minutes per predict-first
question, its core-path code cells' measured run time from docs/lesson-times.json, and the demo
minutes its first cell states). The minutes each lesson states ("core path about M minutes") are
within 10% of that model; the guide's table gives each lesson exactly its stated minutes, starts
with 15 minutes of set-up, gives at least 10% of the lessons' minutes to questions, and all the
teaching (breaks excluded) fits 6½ hours; the model's own day (set-up, the modelled core paths
and a 10% buffer) fits too. Every lesson also has what the guide promises: outcomes, a time,
predict-first questions, and questions with answers."""
from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest

from conftest import LESSONS, ROOT
from gpulab.course.day_model import core_path, lesson_time, stated_minutes

GUIDE = ROOT / "docs" / "teaching.md"
RECORD = ROOT / "docs" / "lesson-times.json"
CORE = re.compile(r"core path about (\d+) minutes")
SLOT = re.compile(r"^\| (\d+):(\d\d)–(\d+):(\d\d) \| ([^|]+) \|([^|]*)\|([^|]*)\|")
NOTEBOOKS = sorted(LESSONS.glob("[0-9][0-9]_*.ipynb"))
TEACHING_MINUTES = 390   # 6½ hours
SET_UP_MINUTES = 15
BUFFER = 0.10            # of the lessons' minutes, for questions
TOLERANCE = 0.10         # a lesson's stated core path against the model's


def _plan(text: str | None = None) -> list[tuple[int, int, str, str, str]]:
    """(start minute, end minute, what, minutes column, demo column) for each row of the
    one-day table."""
    text = GUIDE.read_text() if text is None else text
    day = text[text.index("## A one-day workshop"):]
    day = day[:day.index("\n## ", 3)]
    rows = []
    for line in day.splitlines():
        m = SLOT.match(line)
        if m:
            h0, m0, h1, m1, what, minutes, demo = m.groups()
            rows.append((int(h0) * 60 + int(m0), int(h1) * 60 + int(m1), what.strip(),
                         minutes.strip(), demo.strip()))
    return rows


def _record() -> dict:
    return json.loads(RECORD.read_text())


def _notebook(number: str) -> Path:
    (path,) = LESSONS.glob(f"{number}_*.ipynb")
    return path


def off_by_more_than_tolerance(notebook: Path, record: dict) -> str | None:
    """A one-line complaint when the notebook's stated core path is more than 10% away from the
    model's figure, else None. Homework (a stated core path of 0) is not modelled."""
    stated, _ = stated_minutes(notebook)
    if stated == 0:
        return None
    model = lesson_time(notebook, record)
    if abs(stated - model.minutes) > TOLERANCE * model.minutes:
        return (f"{notebook.stem}: states a core path of {stated} minutes, the model gives "
                f"{model.minutes:.1f} ({model.row()}); state about {round(model.minutes)}")
    return None


# --- the record ------------------------------------------------------------------------------------

def test_the_record_says_how_and_where_it_was_measured():
    record = _record()
    assert "cpu_s" in record["about"] and "min(cpu_s, wall_s)" in record["about"]
    for path in NOTEBOOKS:
        entry = record["lessons"].get(path.stem)
        assert entry, f"{path.stem} is not in {RECORD.name}: .venv/bin/python benchmarks/lesson_times.py --record --only {path.name[:2]}"
        for key in ("date", "machine", "torch", "load_average_start", "load_average_end", "cells"):
            assert key in entry, f"{path.stem}: the record has no {key}"


# --- each lesson against the model -------------------------------------------------------------------

@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_lessons_stated_core_path_is_within_ten_percent_of_the_model(path):
    problem = off_by_more_than_tolerance(path, _record())
    assert problem is None, problem


def test_a_lesson_whose_stated_time_is_off_fails(tmp_path):
    """The check can fail: lesson 11 with its stated core path moved 20% off the model."""
    source = _notebook("11")
    record = _record()
    model = lesson_time(source, record).minutes
    nb = nbformat.read(source, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "markdown")
    wrong = round(model * 1.2) + 1
    first.source = CORE.sub(f"core path about {wrong} minutes", first.source, count=1)
    planted = tmp_path / source.name
    nbformat.write(nb, planted)
    problem = off_by_more_than_tolerance(planted, record)
    assert problem and f"states a core path of {wrong} minutes" in problem
    assert off_by_more_than_tolerance(source, record) is None


def test_a_core_path_cell_missing_from_the_record_fails_with_the_command_to_rerecord():
    path = _notebook("11")
    record = _record()
    cells = json.loads(path.read_text())["cells"]
    core_id = core_path(cells).code_ids[0]
    stripped = json.loads(json.dumps(record))
    del stripped["lessons"][path.stem]["cells"][core_id]
    with pytest.raises(ValueError, match=r"core-path code cell .* benchmarks/lesson_times.py --record --only 11$"):
        lesson_time(path, stripped)


def test_a_cell_missing_from_the_record_off_the_core_path_does_not_matter():
    """Cells added later to optional sections, or after the questions, have no record yet."""
    path = _notebook("11")
    record = _record()
    cells = json.loads(path.read_text())["cells"]
    core = set(core_path(cells).code_ids)
    elsewhere = [c["id"] for c in cells if c["cell_type"] == "code" and c["id"] not in core]
    assert elsewhere, "lesson 11 has no code cell off its core path"
    stripped = json.loads(json.dumps(record))
    for i in elsewhere:
        stripped["lessons"][path.stem]["cells"].pop(i, None)
    assert lesson_time(path, stripped).minutes == lesson_time(path, record).minutes


def test_the_core_path_stops_at_optional_headings_and_at_the_questions():
    cells = [
        {"cell_type": "markdown", "id": "a", "source": "# Title\nfour words of text"},
        {"cell_type": "code", "id": "b", "source": "ex.check(answer)"},
        {"cell_type": "markdown", "id": "c", "source": "## 2. More (optional)\nskipped words here"},
        {"cell_type": "markdown", "id": "p", "source": "## Predict first\nstill in the optional section"},
        {"cell_type": "code", "id": "d", "source": "skipped.check(1)"},
        {"cell_type": "markdown", "id": "e", "source": "### deeper\n```\n# code, no heading\n```\nstill optional"},
        {"cell_type": "markdown", "id": "f", "source": "## 3. Back on the path\n<b>two</b> [words](http://x.y/z)"},
        {"cell_type": "code", "id": "g", "source": "x = 1"},
        {"cell_type": "markdown", "id": "h", "source": "## Questions\n1. not the day"},
        {"cell_type": "code", "id": "i", "source": "late.check(2)"},
    ]
    core = core_path(cells)
    assert core.code_ids == ("b", "g") and core.questions == ("b",)
    assert "skipped words here" not in core.markdown and "still optional" not in core.markdown
    assert "still in the optional section" not in core.markdown
    assert "1. not the day" not in core.markdown and "## 3. Back on the path" in core.markdown


# --- the day ---------------------------------------------------------------------------------------

def test_the_day_is_set_up_the_lessons_core_paths_and_questions_within_six_and_a_half_hours():
    rows = _plan()
    assert rows, "no one-day table found in docs/teaching.md"
    for (_, end, *_), (start, *_) in zip(rows, rows[1:]):
        assert start == end, "the slots must follow each other without gaps"
    assert rows[0][2] == "set-up" and rows[0][1] - rows[0][0] == SET_UP_MINUTES
    lessons = {what[:2]: (end - start, minutes, demo) for start, end, what, minutes, demo in rows
               if what[:2].isdigit()}
    questions = sum(end - start for start, end, what, *_ in rows if what.startswith("questions"))
    for number, (slot, minutes, demo) in lessons.items():
        stated, stated_demo = stated_minutes(_notebook(number))
        assert slot == stated == int(minutes), f"lesson {number}: the plan's slot is not its stated core path"
        assert demo.startswith(f"{stated_demo} min"), f"lesson {number}: the demo column is not its stated demo"
    taught = sum(slot for slot, _, _ in lessons.values())
    assert questions >= BUFFER * taught, f"questions get {questions} minutes, under 10% of {taught}"
    assert SET_UP_MINUTES + taught + questions <= TEACHING_MINUTES
    record = _record()
    modelled = sum(lesson_time(_notebook(n), record).minutes for n in lessons)
    assert SET_UP_MINUTES + modelled * (1 + BUFFER) <= TEACHING_MINUTES, \
        f"the model's day is {SET_UP_MINUTES + modelled * (1 + BUFFER):.0f} minutes"
    assert {"11", "13", "14"} <= set(lessons), "the day must include LLMs, PyTorch's tools and the capstone"
    # every lesson not taught in the day is homework with a core path of 0, and the guide says so
    text = GUIDE.read_text()
    for path in NOTEBOOKS:
        number = path.name[:2]
        if number not in lessons:
            assert stated_minutes(path)[0] == 0, f"lesson {number} is neither in the day nor homework"
            assert f"lessons {number}" in text or f" {number} (" in text or f"lesson {number}" in text, \
                f"the guide does not place lesson {number}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_lesson_has_outcomes_time_predict_first_questions_and_answers(path):
    cells = nbformat.read(path, as_version=4).cells
    markdown = "\n".join(c.source for c in cells if c.cell_type == "markdown")
    first = next(c.source for c in cells if c.cell_type == "markdown")
    assert "**Time:**" in first and CORE.search(first), f"{path.name}: no Time line with a core path"
    if int(CORE.search(first).group(1)) > 0:
        assert re.search(r"demo about \d+ minutes", first), f"{path.name}: the Time line states no demo"
    opening = "\n".join(c.source for c in cells[:4] if c.cell_type == "markdown").lower()
    assert "check yourself" in opening, f"{path.name}: no 'check yourself' outcomes at the start"
    assert re.search(r"^#+ .*Predict first", markdown, re.M | re.I), f"{path.name}: no predict-first question"
    assert re.search(r"^## Questions", markdown, re.M), f"{path.name}: no Questions section"
    assert "<details><summary>Answers</summary>" in markdown, f"{path.name}: no answers block"
