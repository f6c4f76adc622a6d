"""Lessons 00-10 state their core path for the one-day workshop (issue #26): the first markdown
cell's **Time:** line reads "about N minutes in full; core path about M minutes (...)", lessons 06
and 10 are homework (M = 0), and where the core path is shorter than the lesson, headings marked
"(optional)" show the student what it skips. What M is, the day model decides and
tests/test_day_plan.py checks (issue #37). The appendix (15) states a core path of 0 minutes:
reading after the workshop. Every lesson's core path runs on its own: no core-path code cell needs a
name that only an optional cell defines."""
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


# --- a core path runs on its own: no core-path code cell uses a name that only an optional cell defines

def _names(source: str) -> tuple[set[str], set[str]]:
    """(names a cell's code binds, names it reads), IPython's % and ! lines left out."""
    import ast
    tree = ast.parse("\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))))
    binds, reads = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (reads if isinstance(node.ctx, ast.Load) else binds).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            binds |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            binds.add(node.name)
        elif isinstance(node, ast.arg):
            binds.add(node.arg)
    return binds, reads


def names_only_off_the_core_path(cells: list[dict]) -> list[str]:
    """For each core-path code cell (gpulab.course.day_model.core_path) that reads a name bound only by a
    code cell off the core path above it (an optional section, a collapsed block), one line naming both."""
    from gpulab.course.day_model import cell_key, core_path
    core = set(core_path(cells).code_ids)
    on_core, off_core, problems = set(), set(), []
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        binds, reads = _names(source)
        key = cell_key(cell, index)
        if key in core:
            missing = sorted((reads - binds - on_core) & off_core)
            if missing:
                problems.append(f"cell {key} uses {', '.join(missing)}, defined only off the core path")
            on_core |= binds
        else:
            off_core |= binds
    return problems


@pytest.mark.parametrize("path", sorted(LESSONS.glob("[0-9][0-9]_*.ipynb")), ids=lambda p: p.stem[:2])
def test_a_core_path_runs_without_its_optional_cells(path):
    """An instructor who skips the optional sections runs every core-path cell: none of them may need a
    name that only an optional cell imports or assigns (lesson 11's published_check once did)."""
    cells = [dict(c) for c in nbformat.read(path, as_version=4).cells]
    assert names_only_off_the_core_path(cells) == [], path.stem


def test_the_core_path_check_can_fail():
    """The check sees a core cell that reads what only an optional section's cell imports."""
    md = lambda text: {"cell_type": "markdown", "source": text}
    code = lambda cid, text: {"cell_type": "code", "id": cid, "source": text}
    cells = [md("# 99 · x"), md("## 1. Extra (optional)"), code("a", "from math import tau"),
             md("## 2. Core"), code("b", "print(tau)")]
    assert names_only_off_the_core_path(cells) == ["cell b uses tau, defined only off the core path"]
