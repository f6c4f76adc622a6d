"""Every lesson executes headless, top to bottom, with no error output; and every lesson is
stored clean (no outputs, no execution counts)."""
import time

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import LESSONS, notebook_errors

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


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_lesson_executes(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3", store_widget_state=True,
                            resources={"metadata": {"path": str(LESSONS)}})
    t0 = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - t0
    errors = notebook_errors(nb)
    assert not errors, f"{path.name}: " + "; ".join(errors)
    print(f"{path.name} executed in {seconds:.1f} s")
