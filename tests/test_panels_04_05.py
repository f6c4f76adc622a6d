"""Panels of lessons 04 and 05, headless: build, change controls, assert on ``panel.result``
against independent references; bad input ends in ``panel.error``, never an exception."""
import statistics

import pytest
import torch
from IPython.display import Image
from matplotlib.figure import Figure

from gpulab.models.registry import build_model, resolve_model
from gpulab.course.sweeps import CONTEXT_OVERHEAD_ASSUMED, LargestBatch, SweepResult
from gpulab.course.optimizers import ImplementationComparison, OptimizerComparison
from gpulab.units import GiB, MiB
from gpulab.widgets import implementation_panel, largest_batch_panel, optimizer_panel, sweep_panel

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")


def _params(model):
    ps = list(build_model(resolve_model(model), device="meta").parameters())
    return sum(p.numel() * 4 for p in ps), len(ps)


def test_sweep_panel_fits_its_points():
    panel = sweep_panel(model="cnn", optimizer="sgd", largest=8, engine="cpu")
    panel.run()
    r = panel.result
    assert panel.error is None and isinstance(r, SweepResult)
    assert [p.batch for p in r.points] == [1, 2, 4, 8]
    slope, intercept = statistics.linear_regression([p.batch for p in r.points], [p.peak_bytes for p in r.points])
    assert r.fit.per_sample_bytes == pytest.approx(slope) and r.fit.fixed_bytes == pytest.approx(intercept)
    out = panel._render(r)
    assert out[0] is r and isinstance(out[1], Image) and out[1].data[:4] == b"\x89PNG"
    assert "measured on CPU (live tensors)" in r._repr_html_() and "MiB" in r._repr_html_()


def test_sweep_panel_controls_change_the_experiment():
    panel = sweep_panel(model="cnn", largest=4, engine="cpu")
    panel.set(model="mlp", optimizer="adam")
    assert panel.result.model == "mlp" and panel.result.optimizer == "adam"
    panel.set(model="vgg16", engine="fake", largest=16)
    r = panel.result
    assert r.engine == "fake" and r.label == "fake tensors, CUDA kernels' allocations (no compute)"  # a GPU's answer
    assert [p.batch for p in r.points] == [2, 4, 8, 16]


@no_gpu
def test_sweep_panel_bad_engine_is_an_error_message():
    panel = sweep_panel(model="cnn", largest=4, engine="cpu")
    with pytest.raises(ValueError, match="needs a GPU"):   # not offered without one
        panel.set(engine="cuda")


def test_largest_batch_panel_answers_for_the_card():
    panel = largest_batch_panel(model="vgg16", card_gib=8, optimizer="sgd")
    panel.run()
    r = panel.result
    assert panel.error is None and isinstance(r, LargestBatch)
    # the slider holds whole MiB: the measured context (1,383.88 MiB) as 1,383 MiB
    assert r.card_bytes == 8 * GiB and r.context_overhead_bytes == CONTEXT_OVERHEAD_ASSUMED // 2**20 * 2**20
    small = r.answer("whole card").live_batch
    panel.set(card_gib=24, context_mib=1024)
    r = panel.result
    assert r.card_bytes == 24 * GiB and r.answer("card − CUDA context").capacity_bytes == 23 * GiB
    assert r.answer("whole card").live_batch > 2 * small
    # the verified batch agrees with the fit's prediction to within a couple of images
    a = r.answer("whole card")
    assert abs(a.live_batch - a.fit_batch) <= 2
    if not torch.cuda.is_available():
        assert "No GPU here: prediction only" in r.gpu_note
    assert isinstance(panel._render(r)[1], Image)


def test_largest_batch_panel_refuses_an_unknown_card():
    with pytest.raises(ValueError, match="card must be one of"):
        largest_batch_panel(card_gib=7)


def test_optimizer_panel_state_against_parameter_sizes():
    panel = optimizer_panel(model="mlp", batch=4, engine="cpu")
    panel.run()
    r = panel.result
    assert panel.error is None and isinstance(r, OptimizerComparison)
    pb, n = _params("mlp")
    want = {"sgd": 0, "momentum": pb, "adam": 2 * pb + 4 * n, "adamw": 2 * pb + 4 * n,
            "rmsprop": pb + 4 * n, "adagrad": pb + 4 * n}
    assert {run.optimizer: run.state_after_bytes for run in r.runs} == want
    # the state does not depend on the batch
    panel.set(batch=32)
    assert {run.optimizer: run.state_after_bytes for run in panel.result.runs} == want
    panel.set(engine="fake")
    assert {run.optimizer: run.state_after_bytes for run in panel.result.runs} == want
    assert panel.result.label == "fake tensors, CPU kernels (no compute)"  # compared with the cpu engine


@no_gpu
def test_optimizer_panel_bad_engine_is_an_error_message():
    panel = optimizer_panel(model="mlp", batch=4, engine="cpu")
    with pytest.raises(ValueError, match="needs a GPU"):   # not offered without one
        panel.set(engine="cuda")


def test_implementation_panel_rows_and_unsupported_fused():
    panel = implementation_panel(model="mlp", optimizer="adam", batch=2, engine="cpu")
    panel.run()
    r = panel.result
    assert panel.error is None and isinstance(r, ImplementationComparison)
    assert [row.implementation for row in r.rows] == ["for-loop", "foreach", "fused"]
    pb, _ = _params("mlp")
    assert r.row("foreach").run.step_temporaries_bytes >= pb
    panel.set(optimizer="rmsprop")
    assert panel.error is None
    fused = panel.result.row("fused")
    assert fused.run is None and "fused" in fused.unsupported
    assert "not supported" in panel.result._repr_html_()
    assert isinstance(panel._render(panel.result)[1], Image)


def test_panel_figures_carry_labels():
    panel = optimizer_panel(model="mlp", batch=2, engine="cpu")
    panel.run()
    fig = panel.result.figure()
    assert isinstance(fig, Figure)
    texts = " ".join(t.get_text() for ax in fig.axes for t in [ax.title] + ax.get_legend().get_texts())
    assert "measured on CPU (live tensors)" in texts and "formula" in texts


def test_guard_blocks_a_cpu_run_that_would_not_fit(monkeypatch):
    from gpulab.widgets import guard
    monkeypatch.setattr(guard, "free_memory", lambda engine: (1 * MiB, "test: 1 MiB free"))
    panel = sweep_panel(model="cnn", largest=32, engine="cpu")
    panel.run()
    assert panel.result is None and panel.blocked is not None and "fake" in panel.blocked.message
