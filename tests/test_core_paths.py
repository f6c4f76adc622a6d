"""Lessons 00-10 state their core path for the one-day workshop (issue #26): the first markdown
cell's **Time:** line reads "about N minutes in full; core path about M minutes (...)", lessons 06
and 10 are homework (M = 0), and where the core path is shorter than the lesson, headings marked
"(optional)" show the student what it skips. What M is, the day model decides and
tests/test_day_plan.py checks (issue #37). The appendix (15) states a core path of 0 minutes:
reading after the workshop."""
import re

import nbformat
import pytest

from conftest import LESSONS

# lessons 00-10, and which of them are homework in the one-day workshop (a core path of 0)
NUMBERS = ("00", "01", "02", "03", "04", "05", "06", "07", "08", "09", "10")
HOMEWORK = {"06", "10"}
TIME = re.compile(r"\*\*Time:\*\* about (\d+) minutes in full; core path about (\d+) minutes \(([^)]*)\)")


def first_markdown(number: str) -> tuple[nbformat.NotebookNode, str]:
    (path,) = LESSONS.glob(f"{number}_*.ipynb")
    nb = nbformat.read(path, as_version=4)
    return nb, next(c.source for c in nb.cells if c.cell_type == "markdown")


@pytest.mark.parametrize("number", NUMBERS)
def test_time_line_states_the_core_path(number):
    nb, first = first_markdown(number)
    m = TIME.search(first)
    assert m, f"lesson {number}: no '**Time:** about N minutes in full; core path about M minutes (...)' line"
    full, core, which = int(m.group(1)), int(m.group(2)), m.group(3)
    assert (core == 0) == (number in HOMEWORK)
    assert core <= full
    if core == 0:
        assert "homework" in which
    else:
        assert which.endswith("the rest optional")
    headings = [line for c in nb.cells if c.cell_type == "markdown" for line in c.source.splitlines()
                if line.startswith("#")]
    if 0 < core < full:
        assert any(h.endswith("(optional)") for h in headings), f"lesson {number}: no heading marked (optional)"


def test_the_appendix_is_reading_after_the_workshop():
    """Lesson 15, the reference articles' claims tested, is in no day's core path."""
    _, first = first_markdown("15")
    m = TIME.search(first)
    assert m, "lesson 15: no '**Time:** about N minutes in full; core path about M minutes (...)' line"
    assert int(m.group(1)) > 0 and int(m.group(2)) == 0
    assert m.group(3) == "optional reading after the workshop"
