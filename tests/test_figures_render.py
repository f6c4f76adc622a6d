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


def test_the_lesson_check_finds_what_renders_wrongly():
    """``conftest.rendering_errors``, which test_robustness runs on every lesson's executed outputs (and
    notebook_errors with it): each fault a student met in JupyterLab (#47 item 8) is found, and the right
    outputs pass."""
    import nbformat.v4 as v4

    from conftest import rendering_errors

    def nb(*cells, widgets=None):
        book = v4.new_notebook(cells=list(cells))
        if widgets:
            book.metadata["widgets"] = widgets
        return book
    png = v4.new_output("display_data", {"image/png": "iVBO", "text/plain": "<Figure size 700x340 with 1 Axes>"})
    text_fig = v4.new_output("execute_result", {"text/plain": "<Figure size 700x340 with 1 Axes>"}, execution_count=1)
    assert rendering_errors(nb(v4.new_code_cell("report.plot()", outputs=[png]))) == []
    assert "shows as text" in rendering_errors(nb(v4.new_code_cell("x = 1", outputs=[text_fig])))[0]
    assert "no image came out" in rendering_errors(nb(v4.new_code_cell("leaky.timeline(title='t')")))[0]
    assert rendering_errors(nb(v4.new_code_cell("p = step_panel()\nreport.plot()"))) == []   # a panel's own output
    entity = v4.new_output("stream", name="stdout", text="model &#x27;vgg16&#x27; &gt; 1 GiB\n")
    assert "entities shown as text" in rendering_errors(nb(v4.new_code_cell("print(t)", outputs=[entity])))[0]
    twice = v4.new_output("display_data", {"text/html": "<td>&amp;#x27;x&amp;#x27;</td>", "text/plain": "t"})
    assert "escaped twice" in rendering_errors(nb(v4.new_code_cell("t", outputs=[twice])))[0]
    fine = v4.new_output("display_data", {"text/html": "<td>&#x27;x&#x27; &gt; 1</td>", "text/plain": "&gt;"})
    assert rendering_errors(nb(v4.new_code_cell("t", outputs=[fine]))) == []
    state = {"state": {"1": {"state": {"outputs": [{"output_type": "display_data",
                                                    "data": {"text/plain": "<Figure size 640x480 with 1 Axes>"}}]}}}}
    assert "panel shows a figure as text" in rendering_errors(nb(widgets=state))[0]
