"""The line-by-line report against independently known tensor sizes; the leak lesson's loop
grows by a computed amount per iteration and its fix does not."""
import pytest
import torch
from torch import nn

from gpulab.formulas import cuda_rounded_bytes
from gpulab.measure.linetrack import LineReport, track_lines

LEAK = """model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
losses = []
for i in range(4):
    x = torch.randn(64, 256)
    loss = model(x).pow(2).mean()
    losses.append(loss)
"""


def ns():
    return {"torch": torch, "nn": nn}


def test_report_lists_tensors_with_shape_dtype_bytes_and_line():
    code = "a = torch.zeros(1000)\nb = torch.ones(10, 10, dtype=torch.float64)\ndel a\n"
    r = track_lines(code, ns(), engine="cpu")
    assert isinstance(r, LineReport) and [s.line for s in r.steps] == [1, 2, 3]
    s1, s2, s3 = r.steps
    assert [(t.shape, t.dtype, t.nbytes, t.where) for t in s1.added] == [((1000,), "float32", 4000, "cell:1")]
    assert [(t.shape, t.dtype, t.nbytes, t.where) for t in s2.added] == [((10, 10), "float64", 800, "cell:2")]
    assert [t.nbytes for t in s3.removed] == [4000] and not s3.added
    assert [s.total_bytes for s in r.steps] == [4000, 4800, 800]
    assert r.peak_bytes == 4800 and r.final_bytes == 800
    assert r.label == "measured on CPU (live tensors)"
    text = str(r)
    assert "(1000,)" in text and "float64" in text and "cell:2" in text
    html = r._repr_html_()
    assert "gpulab-linereport" in html and "cell:1" in html


def test_temporaries_inside_a_line_show_in_the_line_peak_only():
    r = track_lines("y = (torch.ones(256) * 2).sum()\n", ns(), engine="cpu")
    (s,) = r.steps
    # ones (1 KiB) and the product (1 KiB) are temporaries; the 4-byte sum stays
    assert s.total_bytes == 4 and s.peak_bytes >= 2 * 1024
    assert [t.nbytes for t in s.added] == [4]


def test_namespace_keeps_variables_and_functions_are_followed():
    code = "def make(n):\n    return torch.empty(n, dtype=torch.uint8)\nz = make(300)\n"
    space = ns()
    r = track_lines(code, space, engine="cpu")
    assert space["z"].numel() == 300
    where = [t.where for s in r.steps for t in s.added]
    assert where == ["cell:2"]  # created inside the function, on its line


def test_fake_engine_reports_without_data():
    r = track_lines("w = torch.empty(4096, 4096)\n", ns(), engine="fake")
    assert r.final_bytes == 4096 * 4096 * 4 and r.label == "fake tensors, CPU kernels (no compute)"


def test_unknown_engine_is_refused():
    with pytest.raises(ValueError):
        track_lines("x = 1\n", {}, engine="tpu")


def _growth(report, text):
    line = next(s.line for s in report.steps if text in s.source)
    totals = [s.total_bytes for s in report.steps_at(line)]
    return [b - a for a, b in zip(totals, totals[1:])]


def test_leak_grows_by_saved_activations_per_iteration():
    torch.manual_seed(0)
    r = track_lines(LEAK, ns(), engine="cpu")
    # x (64x256), ReLU output (64x512), second Linear output (64x10) kept for backward, + scalar loss
    expected = 4 * (64 * 256 + 64 * 512 + 64 * 10) + 4
    assert _growth(r, "losses.append") == [expected] * 3


def test_fix_with_item_is_flat():
    r = track_lines(LEAK.replace("losses.append(loss)", "losses.append(loss.item())"), ns(), engine="cpu")
    assert _growth(r, "losses.append") == [0, 0, 0]


def test_fix_with_detach_keeps_only_the_scalar():
    r = track_lines(LEAK.replace("losses.append(loss)", "losses.append(loss.detach())"), ns(), engine="cpu")
    assert _growth(r, "losses.append") == [4, 4, 4]


def test_timeline_and_plot_render():
    r = track_lines("a = torch.zeros(100)\n", ns(), engine="cpu")
    assert r.plot().axes and r.timeline().axes


def test_cuda_rounding_helper_matches_allocator_rule():
    assert cuda_rounded_bytes(4000) == 4096
