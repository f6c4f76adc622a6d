"""Every lesson is stored clean (no outputs, no execution counts). The execution of every lesson
(a fresh kernel's Run All with no error, then what a student reruns, rerun and compared) is one
test per lesson in test_robustness.py: one execution, several properties checked on it."""
import nbformat
import pytest

from conftest import LESSONS

NOTEBOOKS = sorted(LESSONS.glob("[0-9][0-9]_*.ipynb"))


def test_there_are_lessons():
    assert NOTEBOOKS, f"no lessons found in {LESSONS}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_lesson_is_stored_clean(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has stored outputs: clear them"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"
