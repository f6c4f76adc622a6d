"""%%memtrack in an in-process IPython shell."""
import pytest
from IPython.core.interactiveshell import InteractiveShell

from gpulab.measure.linetrack import LineReport


@pytest.fixture(scope="module")
def shell():
    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "gpulab.magic")
    sh.run_cell("import torch")
    return sh


def test_magic_returns_and_stores_the_report(shell):
    r = shell.run_cell_magic("memtrack", "--engine cpu -o rep",
                             "a = torch.zeros(1000)\nb = torch.ones(25, dtype=torch.int64)\ndel a\n")
    assert isinstance(r, LineReport)
    assert shell.user_ns["rep"] is r and shell.user_ns["_memtrack"] is r
    assert "b" in shell.user_ns and "a" not in shell.user_ns
    assert [s.total_bytes for s in r.steps] == [4000, 4200, 200]
    assert [t.nbytes for t in r.steps[1].added] == [200]


def test_magic_through_run_cell_with_fake_engine(shell):
    res = shell.run_cell("%%memtrack --engine fake\nc = torch.zeros(2048, 2048)\n")
    assert res.success
    r = res.result
    assert isinstance(r, LineReport) and r.final_bytes == 2048 * 2048 * 4
    assert r.label == "fake tensors, CPU kernels (no compute)"


def test_magic_errors_propagate(shell):
    res = shell.run_cell("%%memtrack --engine cpu\nraise ValueError('boom')\n")
    assert not res.success and isinstance(res.error_in_exec, ValueError)


@pytest.mark.parametrize("cell, line, error", [
    ("x = torch.zeros(3)\ny = xx + 1\n", "y = xx + 1", "NameError: name 'xx' is not defined"),
    ("x = torch.zeros(3)\ny = x.view(7)\n", "y = x.view(7)", "RuntimeError: shape '[7]' is invalid"),
    ("x = torch.zeros(3)\ny = (x\n", "y = (x", "SyntaxError: '(' was never closed"),
])
def test_a_typo_in_the_cell_shows_the_students_line_in_a_few_lines(shell, capsys, cell, line, error):
    """Issue 47: a typo printed ~40 lines of gpulab and torch frames and 'Could not get source'."""
    capsys.readouterr()
    res = shell.run_cell("%%memtrack --engine cpu\n" + cell)
    assert not res.success
    shown = capsys.readouterr()
    text = shown.out + shown.err
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) <= 6, text
    assert any(ln.startswith("---->") and ln.endswith(line) for ln in lines), text
    assert error in text
    assert "Could not get source" not in text and "linetrack.py" not in text and "magic.py" not in text


def test_a_students_error_keeps_its_type(shell):
    res = shell.run_cell("%%memtrack --engine cpu\nundefined_name\n")
    assert isinstance(res.error_in_exec, NameError)
