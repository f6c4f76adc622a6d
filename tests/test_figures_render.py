"""Every figure gpulab returns shows as a picture in any notebook front end.

A bare ``matplotlib.figure.Figure`` has no PNG formatter in a kernel that never imported pyplot (IPython
registers one for ``Figure`` only with the inline backend), so JupyterLab showed lessons 09 and 10's
plots as the text ``<Figure size 700x340 with 1 Axes>``. ``gpulab.plots.LessonFigure`` carries its own
``_repr_png_``; every figure the library builds is one.
"""
from __future__ import annotations

import ast
import pathlib

from IPython.core.formatters import DisplayFormatter

from conftest import ROOT

PNG_MAGIC = b"\x89PNG"


def _bare_figures(path: pathlib.Path) -> list[int]:
    """Lines of ``path`` that call ``Figure(...)`` (matplotlib's, by that name)."""
    tree = ast.parse(path.read_text())
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Figure"]


def test_the_library_builds_no_bare_matplotlib_figure():
    found = {str(p.relative_to(ROOT)): lines for p in sorted((ROOT / "gpulab").rglob("*.py"))
             if (lines := _bare_figures(p))}
    assert not found, f"build figures with gpulab.plots.LessonFigure (it shows itself as a PNG): {found}"


def test_lesson_09_and_10s_figures_format_as_png_without_pyplot():
    from gpulab.allocator.plots import allocated_vs_reserved, segment_map
    from gpulab.measure.linetrack import track_lines
    from gpulab.predict import replay as R
    from gpulab.record.lookup import find_allocator_record
    from gpulab.record.views import reserved_timelines

    step = R.workload("training step", "mlp", 4, steps=2)            # as lesson 09 calls them
    frag = R.workload("fragmentation")
    report = track_lines("import torch\nx = torch.zeros(1024, 256)\ny = x * 2\ndel x\n", engine="cpu")
    figures = [allocated_vs_reserved(step), segment_map(frag.segments),
               reserved_timelines(step, find_allocator_record(step)), report.plot()]
    formatter = DisplayFormatter()     # a kernel's formatter with no backend registered for Figure
    for fig in figures:
        data, _ = formatter.format(fig)
        assert data.get("image/png", b"").startswith(PNG_MAGIC), (type(fig), sorted(data))
