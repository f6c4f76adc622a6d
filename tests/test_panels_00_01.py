"""Lessons 00 and 01: the engine panel, the tensor-bytes and rounding panels, their pure
experiments, the exercises and the claim checks. References are computed independently here,
with plain torch (storage nbytes, data pointers) and plain arithmetic."""
import math
import warnings

import pytest
import torch

import gpulab.widgets.env as env_widget
from gpulab.course import byte_units as U
from gpulab.course import start as S
from gpulab.course import tensor_bytes as T
from gpulab.measure.engines import LABEL_CPU, LABEL_FAKE_CPU, LABEL_FAKE_CUDA, LABEL_FORMULA, LABEL_SIMULATED
from gpulab.course.tensor_plots import dtype_figure, engine_demo_figure, rounding_figure, tensor_bytes_figure
from gpulab.units import DTYPES
from gpulab.widgets import engine_panel, rounding_panel, tensor_bytes_panel

from conftest import cuda

NO_CUDA = not torch.cuda.is_available()


def storage_nbytes(shape, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.empty(shape, dtype=dtype).untyped_storage().nbytes()


def swap_first_last(x):
    perm = list(range(x.dim()))
    perm[0], perm[-1] = perm[-1], perm[0]
    return x.permute(perm)


# Written out again here, independently of gpulab.course.tensor_bytes.OPERATIONS.
REFERENCE_OPS = {
    "tensor": lambda x: x,
    "view": lambda x: x.reshape(-1),
    "transpose": swap_first_last,
    "slice": lambda x: x.narrow(0, 0, min(1, x.shape[0])),
    "strided slice": lambda x: x[0::2],
    "slice + clone": lambda x: x.narrow(0, 0, min(1, x.shape[0])).clone(),
    "transpose + contiguous": lambda x: swap_first_last(x).contiguous(),
}


def reference(shape, dtype, op):
    """(x bytes, new bytes, peak, kept) from plain torch: storages compared by data pointer."""
    x = torch.empty(shape, dtype=dtype)
    y = REFERENCE_OPS[op](x)
    xb = x.untyped_storage().nbytes()
    shared = y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    new = 0 if shared else y.untyped_storage().nbytes()
    return xb, new, xb + new, y.untyped_storage().nbytes()


# --- the tensor-bytes panel --------------------------------------------------------------------

@pytest.fixture(scope="module")
def tb_panel():
    p = tensor_bytes_panel()
    p.run()
    return p


def test_default_panel_is_the_articles_batch_sliced(tb_panel):
    r = tb_panel.result
    assert tb_panel.error is None and tb_panel.blocked is None
    assert r.shape == (256, 3, 100, 100) and r.dtype == "float32" and r.operation == "slice"
    ref = storage_nbytes((256, 3, 100, 100), torch.float32)
    assert ref == 30_720_000
    assert r.x_bytes == ref == r.formula_bytes
    assert r.kept_bytes == ref                     # the slice keeps the whole storage alive
    assert r.y_shape_bytes == 3 * 100 * 100 * 4    # although its shape says 120,000 B
    assert r.new_bytes == 0 and r.shares_storage
    if NO_CUDA:
        assert r.engine == "cpu" and r.label == LABEL_CPU
    assert r.cuda["formula_allocated"] == 30_720_000  # already a multiple of 512
    # > 10 MiB: the segment is rounded up to 2 MiB (30 MiB); the 737,280 B left over is under
    # 1 MiB, so the block is not split and memory_allocated counts the whole 30 MiB block
    assert r.cuda["simulated_reserved"] == 30 * 2**20
    assert r.cuda["simulated_allocated"] == 30 * 2**20
    assert any("should_split" in n for n in r.notes)
    assert "gpulab-table" in r._repr_html_()


@pytest.mark.parametrize("op", list(REFERENCE_OPS))
@pytest.mark.parametrize("shape", ["6,5,4", "7,1", "5"])
def test_each_operation_matches_plain_torch(tb_panel, op, shape):
    tb_panel.set(shape=shape, dtype="float32", operation=op, engine="cpu")
    assert tb_panel.error is None, tb_panel.error
    r = tb_panel.result
    dims = tuple(int(s) for s in shape.split(","))
    xb, new, peak, kept = reference(dims, torch.float32, op)
    assert (r.x_bytes, r.new_bytes, r.peak_bytes, r.kept_bytes) == (xb, new, peak, kept)
    for row in r.rows:  # the formulas agree exactly for every plain dtype
        assert row.formula == row.measured, row


def test_contiguous_of_an_already_contiguous_transpose_does_not_copy(tb_panel):
    tb_panel.set(shape="1,8", operation="transpose + contiguous", engine="cpu")
    assert tb_panel.result.new_bytes == 0 and tb_panel.result.shares_storage
    assert any("already contiguous" in n for n in tb_panel.result.notes)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float8_e4m3fn", "complex128", "bool", "int64",
                                   "uint16", "qint32"])
def test_dtype_control(tb_panel, dtype):
    tb_panel.set(shape="10,3", dtype=dtype, operation="tensor", engine="cpu")
    assert tb_panel.error is None, tb_panel.error
    d = DTYPES[dtype].dtype
    assert tb_panel.result.x_bytes == storage_nbytes((10, 3), d) == 30 * d.itemsize


def test_fake_engine_control(tb_panel):
    tb_panel.set(shape="256,3,100,100", dtype="float32", operation="transpose + contiguous", engine="fake")
    r = tb_panel.result
    assert r.engine == "fake" and r.label == LABEL_FAKE_CPU
    assert (r.x_bytes, r.new_bytes, r.peak_bytes, r.kept_bytes) == reference(
        (256, 3, 100, 100), torch.float32, "transpose + contiguous")


@pytest.mark.skipif(not NO_CUDA, reason="auto picks cuda on a GPU machine")
def test_large_shape_on_auto_switches_to_fake_and_says_so(tb_panel):
    tb_panel.set(shape="100000,100000", dtype="float32", operation="slice", engine="auto")
    assert tb_panel.error is None and tb_panel.blocked is None
    r = tb_panel.result
    assert r.engine == "fake" and r.label == LABEL_FAKE_CPU
    assert "limit" in r.reason
    assert r.kept_bytes == 100000 * 100000 * 4


def test_explicit_cpu_too_big_is_blocked_with_a_fake_suggestion(tb_panel):
    tb_panel.set(shape="100000,100000,100", dtype="float32", operation="tensor", engine="cpu")
    assert tb_panel.blocked is not None and not tb_panel.blocked.ok
    assert tb_panel.blocked.suggestion == {"engine": "fake"}
    tb_panel._apply_suggestion(None)
    assert tb_panel.blocked is None and tb_panel.result.engine == "fake"
    assert tb_panel.result.x_bytes == 100000 * 100000 * 100 * 4


@pytest.mark.parametrize("bad, words", [
    ("", "empty"), ("a,b", "'a'"), ("3,-1", "'-1'"), ("2.5", "'2.5'"), ("256;3", "'256;3'"),
    ("99999999999,99999999999,99999", "too large"),
])
def test_bad_shape_gives_a_readable_error_and_no_exception(tb_panel, bad, words):
    tb_panel.set(shape="4,4", dtype="float32", operation="tensor", engine="cpu")
    before = tb_panel.result
    out = tb_panel.set(shape=bad)  # must not raise
    assert out is tb_panel
    assert tb_panel.error is not None and words in tb_panel.error
    assert "shape" in tb_panel.error or "large" in tb_panel.error
    assert "Traceback" not in tb_panel.error
    assert tb_panel.result is before            # the last good result stays
    tb_panel.set(shape="4,4")
    assert tb_panel.error is None


def test_scalar_shape_and_operations_that_need_a_dimension(tb_panel):
    tb_panel.set(shape="()", dtype="float64", operation="tensor", engine="cpu")
    assert tb_panel.error is None and tb_panel.result.x_bytes == 8
    tb_panel.set(operation="slice")
    assert tb_panel.error and "at least one dimension" in tb_panel.error


def test_quantized_on_fake_is_a_readable_error(tb_panel):
    tb_panel.set(shape="4,4", dtype="qint8", operation="tensor", engine="fake")
    assert tb_panel.error and "only the cpu engine" in tb_panel.error


@pytest.mark.skipif(not NO_CUDA, reason="checks the no-GPU message")
def test_cuda_engine_without_gpu_is_a_readable_error(tb_panel):
    with pytest.raises(ValueError, match="needs a GPU"):   # not offered without one
        tb_panel.set(shape="4,4", dtype="float32", operation="tensor", engine="cuda")


def test_tensor_bytes_figure_has_units_legend_and_label():
    r = T.measure("256,3,100,100", "float32", "slice", "cpu")
    fig = tensor_bytes_figure(r)
    ax = fig.axes[0]
    assert ax.get_ylabel() == "bytes (MiB)"
    assert r.label in ax.get_title()
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "formula" in texts and any(r.label in t for t in texts)


# --- pure pieces -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, shape", [("256,3,100,100", (256, 3, 100, 100)), ("(2, 3)", (2, 3)),
                                         ("[4]", (4,)), ("2x3x4", (2, 3, 4)), ("()", ()), (" 7 , 0 ", (7, 0)),
                                         ((1, 2), (1, 2))])
def test_parse_shape(text, shape):
    assert T.parse_shape(text) == shape


@pytest.mark.parametrize("shape", [(2, 3), (1, 5), (5, 1), (3, 1, 1, 4), (1, 1), (0, 3), (4,), (2, 3, 4), (1, 3, 1)])
def test_is_contiguous_matches_torch(shape):
    x = torch.empty(shape)
    t = x.transpose(0, -1)
    assert T.contiguous_strides(shape) == x.stride()
    assert T.is_contiguous(t.shape, t.stride()) == t.is_contiguous()


def test_dtype_table_every_dtype_against_torch():
    t = T.dtype_table(1000, "cpu")
    assert {r.name for r in t.rows} == set(DTYPES)
    for r in t.rows:
        ref = storage_nbytes((1000,), DTYPES[r.name].dtype)
        assert r.measured_bytes == ref, r.name
        assert r.formula_bytes == 1000 * DTYPES[r.name].dtype.itemsize
    assert t.label == LABEL_CPU
    fig = dtype_figure(t)
    assert "bytes per element" in fig.axes[0].get_xlabel() and t.label in fig.axes[0].get_title()


def test_dtype_table_on_fake_marks_quantized_unmeasurable():
    t = T.dtype_table(100, "fake")
    assert t.label == LABEL_FAKE_CPU
    assert t.row("qint8").measured_bytes is None and t.row("qint8").note
    assert t.row("float16").measured_bytes == 200


# --- the rounding panel -------------------------------------------------------------------------------

def test_rounding_panel_against_arithmetic_and_torch():
    p = rounding_panel()
    p.run()
    assert p.error is None
    r = p.result
    assert r.elements[-1] == 300
    for n, q, rounded, live in zip(r.elements, r.requested, r.rounded, r.live):
        assert q == 4 * n
        assert rounded == (0 if n == 0 else math.ceil(4 * n / 512) * 512)
        assert live == storage_nbytes((n,), torch.float32)
    assert r.simulated[1:] == r.rounded[1:]                     # the simulator applies the same rule
    assert set(r.simulated_reserved[1:]) == {2 * 2**20}         # small pool: one 2 MiB segment
    assert r.max_waste == (1, 4, 512)
    if NO_CUDA:
        assert r.cuda is None
    p.set(dtype="float64", max_elements=64)
    assert p.result.requested[-1] == 512 and p.result.rounded[-1] == 512 and p.result.rounded[65 - 1] == 512
    fig = rounding_figure(p.result)
    assert fig.axes[0].get_ylabel() == "bytes counted (B)"
    assert LABEL_SIMULATED in " ".join(t.get_text() for t in fig.axes[0].get_legend().get_texts())


# --- the engine panel (lesson 00) --------------------------------------------------------------------

def test_engine_panel_default_and_controls(monkeypatch):
    p = engine_panel()
    p.run()
    assert p.error is None
    d = p.result
    ref = storage_nbytes((4 * 2**20 // 4,), torch.float32)
    assert d.formula_bytes == d.measured_bytes == ref
    assert d.simulated_allocated == ref and d.simulated_reserved == 20 * 2**20  # 1-10 MiB: a 20 MiB segment
    if NO_CUDA:
        assert d.engine == "cpu" and d.label == LABEL_CPU
        p.set(size_mib=65536)                       # over the 2 GiB cpu limit: fake, and it says why
        assert p.result.engine == "fake" and "limit" in p.result.reason
        assert p.result.measured_bytes == 65536 * 2**20
        p.set(size_mib=256, cpu_limit_mib=64)
        assert p.result.engine == "fake"
    p.set(size_mib=1, engine="fake", cpu_limit_mib=2048)
    assert p.result.label == LABEL_FAKE_CPU and p.result.measured_bytes == 2**20
    assert p.result.simulated_reserved == 2 * 2**20
    # an explicit cpu run bigger than free memory is refused, with the fake engine offered
    monkeypatch.setattr(env_widget, "free_memory", lambda engine: (1024, "test memory"))
    p.set(size_mib=16, engine="cpu")
    assert p.blocked is not None and p.blocked.suggestion == {"engine": "fake"}
    fig = engine_demo_figure(d)
    assert fig.axes[0].get_xlabel() == "bytes (MiB)" and d.label in fig.axes[0].get_title()


def test_machine_report_and_labels():
    m = S.machine_report()
    assert m.engine in ("cuda", "cpu", "fake") and m.engine_reason
    assert m.cpu_cores >= 1
    html = m._repr_html_()
    assert "engine" in html and "torch" in html
    if NO_CUDA:
        assert m.gpus == [] and "no CUDA GPU" in repr(m)
    labels = [lab for lab, _, _ in S.label_guide().rows]
    assert LABEL_FORMULA in labels and LABEL_CPU in labels and LABEL_FAKE_CPU in labels and LABEL_FAKE_CUDA in labels and LABEL_SIMULATED in labels


def test_units_and_prefix_gaps():
    rows = U.units_table(3_000_000).rows()
    assert "2.861 MiB" in rows[1][1] and "3.000 MB" in rows[2][1]
    gaps = {g.prefix: round(g.gap_percent, 1) for g in U.prefix_gaps()}
    assert gaps == {"K": 2.4, "M": 4.9, "G": 7.4, "T": 10.0}


# --- exercises: right answers computed here, wrong ones rejected ----------------------------------

def test_units_exercises_lesson_01():
    ex = U.exercise_image_mib()
    assert ex.check(500 * 500 * 3 * 4 / 1024**2)
    assert ex.check(2.86)
    assert not ex.check(3.0) and not ex.check(3_000_000) and not ex.check(...)
    ex = U.exercise_smi_gb(24576)
    assert ex.check(24576 * 2**20 / 10**9)
    assert not ex.check(24) and not ex.check(24.576)


def test_exercises_lesson_01():
    ex = T.exercise_batch_bytes()
    assert ex.check(256 * 3 * 100 * 100 * 2)
    wrong = ex.check(256 * 3 * 100 * 100 * 4)
    assert not wrong and "2x too big" in wrong.message
    ex = T.exercise_slice_kept()
    assert ex.check(256 * 3 * 100 * 100 * 4)
    assert not ex.check(3 * 100 * 100 * 4)
    ex = T.exercise_cuda_rounding()
    assert ex.check(4096)
    assert not ex.check(4000)


# --- claims ----------------------------------------------------------------------------------------

def test_tensor_claims_are_measured():
    rep = T.tensor_claims()
    by_source = {c.claim.split(" takes")[0].split(" is ")[0]: c for c in rep}
    assert len(rep) == 4
    image, batch, array, vgg = rep.checks
    assert image.verdict == "holds in MB, breaks in MiB"
    assert batch.verdict == "holds in MB, breaks in MiB"
    assert array.verdict == "breaks"
    assert vgg.verdict == "holds in KB, breaks in KiB"
    assert image.evidence[0].value == f"{500 * 500 * 3 * 4:,} B"
    assert batch.evidence[0].value == f"{256 * 3 * 100 * 100 * 4:,} B"
    assert array.evidence[0].value == f"{2 * 3 * 256 * 256 * 4:,} B"
    assert by_source and "gpulab-claim" in rep._repr_html_()


def test_unit_claims():
    rep = U.unit_claims()
    assert len(rep) == 4
    si, estimate, tracker, smi = rep.checks
    assert "breaks" in si.verdict            # torch prints MiB
    assert estimate.verdict.startswith("holds for K/M") and "breaks for G/T" in estimate.verdict
    assert tracker.verdict == "breaks"
    assert tracker.evidence[0].value == f"{30 * 3 * 512 * 512 * 4:,} B"
    if NO_CUDA:
        assert smi.verdict == "not tested here (no GPU)"


# --- on a GPU -------------------------------------------------------------------------------------

@cuda
def test_cuda_rounding_measured_matches_formula_and_simulator():
    r = T.rounding_curve("float32", 300, "cuda")
    assert r.cuda == r.rounded
    assert r.simulated == r.rounded


@cuda
def test_cuda_tensor_bytes_measured():
    r = T.measure("1000", "float32", "slice + clone", "cuda")
    assert r.cuda["measured_allocated"] == r.cuda["formula_allocated"] == 4096
    assert r.x_bytes == 4000
