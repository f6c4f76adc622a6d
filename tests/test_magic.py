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
