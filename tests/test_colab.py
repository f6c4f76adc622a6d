"""Every lesson opens from Google Colab (issue #37): an "Open in Colab" link, then a first code cell
that installs gpulab into Colab's runtime without replacing Colab's torch, and does nothing
anywhere else (the lessons run headless in the tests, in Binder and in JupyterLab).

The cell is run here in IPython with its ``%pip`` magic replaced by a recorder: outside Colab the
recorder must stay silent; with a stand-in ``google.colab`` module it must receive the install
line, pinned to the torch and torchvision this Python has. ``make test-colab`` runs the lessons
and the quick suite under Colab's own versions (colab/pins.txt)."""
from __future__ import annotations

import re
import sys
import types
from importlib.metadata import version
from pathlib import Path

import nbformat
import pytest
from IPython.core.interactiveshell import InteractiveShell

from conftest import LESSONS

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(LESSONS.glob("[0-9][0-9]_*.ipynb"))
COLAB = "https://colab.research.google.com/github/gpulab/gpulab/blob/main/lessons/{name}"
INSTALL_LINE = '"gpulab @ git+https://github.com/gpulab/gpulab"'


def _cells(path: Path) -> list:
    return nbformat.read(path, as_version=4).cells


def _install_cell(path: Path):
    return next(c for c in _cells(path) if c.cell_type == "code")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_lesson_links_to_itself_on_colab_before_its_first_code_cell(path):
    cells = _cells(path)
    first_code = next(i for i, c in enumerate(cells) if c.cell_type == "code")
    before = "\n".join(c.source for c in cells[:first_code] if c.cell_type == "markdown")
    assert f"]({COLAB.format(name=path.name)})" in before, f"{path.name}: no Open in Colab link to itself"
    # the title cell, with its Time line, stays the first markdown cell (tests/test_day_plan.py)
    first_markdown = next(c for c in cells if c.cell_type == "markdown")
    assert first_markdown.source.startswith("# ") and "**Time:**" in first_markdown.source


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_lessons_first_code_cell_is_the_colab_install_cell(path):
    cell = _install_cell(path)
    assert 'if "google.colab" in sys.modules:' in cell.source, f"{path.name}: first code cell is not the install"
    assert INSTALL_LINE in cell.source
    assert cell.source == _install_cell(NOTEBOOKS[0]).source, f"{path.name}: its install cell differs from 00's"


class _PipRecorder:
    """Stands in for IPython's %pip magic for one run: records each line it is given."""

    def __init__(self, shell: InteractiveShell):
        self.shell, self.lines = shell, []

    def __enter__(self):
        self.saved = self.shell.magics_manager.magics["line"].get("pip")
        self.shell.register_magic_function(lambda line: self.lines.append(line), "line", "pip")
        return self

    def __exit__(self, *exc):
        if self.saved is None:
            del self.shell.magics_manager.magics["line"]["pip"]
        else:
            self.shell.magics_manager.magics["line"]["pip"] = self.saved


def _run(source: str) -> list[str]:
    shell = InteractiveShell.instance()
    with _PipRecorder(shell) as pip:
        result = shell.run_cell(source, store_history=False)
    assert result.success, result.error_in_exec or result.error_before_exec
    return pip.lines


def test_the_install_cell_does_nothing_outside_colab():
    assert "google.colab" not in sys.modules
    assert _run(_install_cell(NOTEBOOKS[0]).source) == []


def test_on_colab_the_install_cell_keeps_the_installed_torch(monkeypatch):
    """With a stand-in google.colab loaded, %pip gets gpulab pinned to this torch and torchvision
    (pip then keeps them or stops: it never downloads another torch), and Colab's custom widget
    manager is enabled once."""
    enabled = []
    output = types.ModuleType("google.colab.output")
    output.enable_custom_widget_manager = lambda: enabled.append(True)
    colab = types.ModuleType("google.colab")
    colab.output = output
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    monkeypatch.setitem(sys.modules, "google.colab.output", output)
    (line,) = _run(_install_cell(NOTEBOOKS[0]).source)
    assert INSTALL_LINE in line
    assert f"torch=={version('torch')}" in line.split() and f"torchvision=={version('torchvision')}" in line.split()
    assert enabled == [True]


def _pins() -> dict[str, str]:
    lines = (ROOT / "colab" / "pins.txt").read_text().splitlines()
    return dict(ln.split("==") for ln in lines if ln and not ln.startswith("#"))


def _floors() -> dict[str, str]:
    import tomllib
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {m.group(1): m.group(2) for d in deps if (m := re.match(r"([\w-]+)>=([\d.]+)", d))}


def _v(text: str) -> tuple[int, ...]:
    parts = [int(x) for x in text.split("+")[0].split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


# Colab's versions meet gpulab's floors (colab/pins.txt, 2026-08-19): `make test-colab` runs the
# lessons and the quick suite under them, and the install cell's == pins keep Colab's torch.
@pytest.mark.parametrize("name", ["torch", "torchvision", "transformers", "ipywidgets", "peft", "matplotlib",
                                  "psutil", "nvidia-ml-py"])
def test_colabs_versions_meet_gpulabs_floors(name):
    """pip keeps what Colab has only if it satisfies gpulab's floor."""
    floor, colab = _floors()[name], _pins()[name]
    assert _v(floor) <= _v(colab), f"gpulab needs {name}>={floor}; Colab has {colab}: pip would replace it"


def test_the_readme_links_every_lesson_to_colab():
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in NOTEBOOKS if COLAB.format(name=p.name) not in readme]
    assert not missing, f"README.md has no Open in Colab link for {missing}"
