"""The fake engine's CUDA target: what CUDA would run, predicted without a GPU.

References are independent of the emulation: a real CPU run with ``foreach=True`` (the
implementation CUDA picks by default), and a forward on fake tensors placed on a cuda
device, which dispatches CUDA's own kernels (it cannot run backward without a GPU)."""
import contextlib
import io
import json
import sys

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from gpulab import cli
from gpulab.training import loop as E
from gpulab.models import registry as M
from gpulab.measure.engines import LABEL_FAKE_CPU, LABEL_FAKE_CUDA, run
from gpulab.predict.step import step as tracked_step
from gpulab.measure import fake_cuda
from gpulab.measure.cuda_card import KernelTarget, kernel_target
from gpulab.measure.fake_cuda import STILL_DIFFERS, cuda_kernels
from gpulab.formulas import cuda_rounded_bytes
from gpulab.categories import Category
from gpulab.measure.tracking import TrackingResult

NO_CUDA = not torch.cuda.is_available()
optim_module = sys.modules["torch.optim.optimizer"]


def _mlp_params():
    net = M.build_model(M.resolve_model("mlp"), 32, device="meta")
    return [p for p in net.parameters()]


def test_mlp_adam_fake_step_follows_cudas_foreach():
    cuda = tracked_step("mlp", batch=8, optimizer="adam", engine="fake", steps=1, guard=False)                       # default: CUDA
    cpu = tracked_step("mlp", batch=8, optimizer="adam", engine="fake", steps=1, fake_target="cpu", guard=False)   # the CPU for-loop
    assert cuda.label == LABEL_FAKE_CUDA and cuda.measurement.kernels == "cuda"
    assert cpu.label == LABEL_FAKE_CPU and cpu.measurement.kernels == "cpu"
    # the for-loop keeps two param-sized temporaries of one tensor at a time; foreach makes one
    # temporary per parameter (the sqrt of exp_avg_sq): lower peak, as on a GPU
    assert cpu.peak_bytes == 39_997_688
    assert cuda.peak_bytes == 34_246_656 < cpu.peak_bytes
    assert cuda.measurement.tracking.peak_phase == "optimizer"


def test_cuda_target_equals_a_cpu_foreach_run_in_512_byte_blocks(monkeypatch):
    """Storage for storage, the CUDA target is a real CPU run with foreach=True, each storage
    rounded to 512 B, minus the step counters CUDA keeps in host memory."""
    monkeypatch.setattr(E, "make_optimizer", lambda name, params: torch.optim.Adam(params, lr=1e-3, foreach=True))
    ref = tracked_step("mlp", batch=8, optimizer="adam", engine="cpu", steps=1, guard=False).measurement.tracking
    monkeypatch.undo()   # the fake run picks foreach by itself
    fake = tracked_step("mlp", batch=8, optimizer="adam", engine="fake", steps=1, guard=False)
    rounded = TrackingResult.build(ref.records, ref.events, device="cpu", rounded=True)
    n_tensors = len(_mlp_params())
    expected = dict(rounded.peak_by_category)
    expected["optimizer_state"] -= n_tensors * cuda_rounded_bytes(4)   # 0-dim float32 steps, on the host
    assert fake.peak_by_category == expected
    assert fake.peak_bytes == rounded.peak_bytes - n_tensors * 512


def test_step_counters_live_on_the_host():
    r = tracked_step("mlp", batch=8, optimizer="adam", engine="fake", steps=1, guard=False)
    param_bytes = sum(cuda_rounded_bytes(p.numel() * 4) for p in _mlp_params())
    after = r.as_dict()["after_step_by_category"]
    assert after["parameters"] == after["gradients"] == param_bytes
    assert after["optimizer_state"] == 2 * param_bytes          # exp_avg, exp_avg_sq; no steps
    steps = [rec for rec in r.measurement.tracking.records.values() if rec.state_key == "step"]
    assert steps == []                                          # not on cuda:0
    # the formulas leave them out too, as they do for a real CUDA run
    assert r.predicted["optimizer_state"] == 2 * sum(p.numel() * 4 for p in _mlp_params())


def test_explicit_for_loop_is_respected_and_defaults_are_restored(monkeypatch):
    before = {m: m._default_to_fused_or_foreach for m in (sys.modules["torch.optim.adam"],
                                                          sys.modules["torch.optim.sgd"])}
    monkeypatch.setattr(E, "make_optimizer", lambda name, params: torch.optim.Adam(params, lr=1e-3, foreach=False))
    r = tracked_step("mlp", batch=8, optimizer="adam", engine="fake", steps=1, guard=False)
    # the for-loop's two param-sized temporaries of the largest tensor, in 512-byte blocks
    assert r.peak_by_category["temporaries"] == 2 * cuda_rounded_bytes(3 * 32 * 32 * 512 * 4)
    for m, f in before.items():
        assert m._default_to_fused_or_foreach is f is optim_module._default_to_fused_or_foreach


def _dropout_experiment(ctx):
    x = ctx.label(torch.randn(64, 256, requires_grad=True))
    y = nn.Dropout(0.5)(x)
    y.sum().backward()


def _saved_dtypes(m):
    return sorted(r.dtype for r in m.tracking.records.values() if r.category == Category.ACTIVATIONS)


def test_dropout_saves_a_bool_mask_under_the_cuda_target():
    cuda = run(_dropout_experiment, "fake", fake_target="cuda")
    cpu = run(_dropout_experiment, "fake", fake_target="cpu")
    assert _saved_dtypes(cuda) == ["bool"]      # native_dropout's mask, 1 byte per element
    assert _saved_dtypes(cpu) == ["float32"]    # the CPU's float noise tensor, 4 bytes per element
    assert cuda.peak_by_category["activations"] == cuda_rounded_bytes(64 * 256)
    assert cpu.peak_by_category["activations"] == 64 * 256 * 4


def test_fake_cuda_tensors_dispatch_the_same_dropout():
    """The independent reference: fake tensors on a cuda device run CUDA's dispatch (forward
    only), and dropout becomes native_dropout saving a bool mask."""
    with FakeTensorMode():
        x = torch.randn(64, 256, device="cuda", requires_grad=True)
        y = nn.functional.dropout(x, 0.5, True)
        assert type(y.grad_fn).__name__ == "NativeDropoutBackward0"
        assert y.grad_fn._saved_result1.dtype == torch.bool


@pytest.mark.skipif(not NO_CUDA, reason="on a GPU machine fake cuda tensors can run backward")
def test_fake_cuda_tensors_cannot_run_backward_without_a_gpu():
    """Why the CUDA target emulates on CPU fake tensors instead (gpulab.measure.fake_cuda)."""
    with FakeTensorMode():
        x = torch.randn(4, device="cuda", requires_grad=True)
        with pytest.raises(RuntimeError, match="hasPrimaryContext"):
            (x * 2).sum().backward()


_B, _H, _S, _D = 2, 2, 32, 8     # s×s: 4,096 elements, 512-byte blocks exactly in bool and float32


def _math_attention_with_dropout(ctx):
    q, k, v = (ctx.label(torch.randn(_B, _H, _S, _D, dtype=torch.bfloat16, requires_grad=True)) for _ in range(3))
    nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True).sum().backward()


def _saved_by_math_sdpa(device):
    """(dtype, shape) of what autograd saves for ``_scaled_dot_product_attention_math`` with dropout."""
    saved = []
    q, k, v = (torch.randn(_B, _H, _S, _D, dtype=torch.bfloat16, device=device, requires_grad=True)
               for _ in range(3))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, tuple(t.shape))) or t,
                                                  lambda t: t):
        torch.ops.aten._scaled_dot_product_attention_math(q, k, v, None, 0.1, True, None)
    return sorted(saved, key=str)


def test_math_attentions_dropout_saves_cudas_bool_mask():
    """The math composite (attention.cpp) calls ``at::dropout`` from C++ on the float32 weights: on a
    CUDA input ``native_dropout`` (a bool mask saved), on a CPU one ``_dropout_impl`` (a float32 noise
    saved). The reference is the installed torch's own dispatch on fake tensors on a cuda device (forward
    only); the CUDA target's fake CPU tensors save the same, and the predicted peak of a T4 step (sm75:
    bf16 takes the math kernel) is 3 bytes an s×s element below the CPU path's, exactly."""
    with FakeTensorMode():
        cuda = _saved_by_math_sdpa("cuda")
        cpu = _saved_by_math_sdpa("cpu")
    with FakeTensorMode(), kernel_target(KernelTarget("T4", (7, 5))), cuda_kernels():
        emulated = _saved_by_math_sdpa("cpu")
    square = (_B, _H, _S, _S)
    assert (torch.bool, square) in cuda and (torch.bool, square) not in cpu        # the reference differs
    assert emulated == cuda
    with kernel_target(KernelTarget("T4", (7, 5))):
        fixed = run(_math_attention_with_dropout, "fake", fake_target="cuda")
        with pytest.MonkeyPatch.context() as mp:      # without the op-level swap: the CPU's noise
            mp.setattr(fake_cuda, "_cuda_dropout_op", contextlib.nullcontext)
            noise = run(_math_attention_with_dropout, "fake", fake_target="cuda")
    assert "math attention" in fixed.kernels_note
    assert _saved_dtypes(fixed).count("bool") == 1 and "bool" not in _saved_dtypes(noise)
    elems = _B * _H * _S * _S
    assert noise.peak_bytes - fixed.peak_bytes == (4 - 1) * elems == 12_288
    assert noise.peak_by_category["activations"] - fixed.peak_by_category["activations"] == 3 * elems
    with cuda_kernels():      # a real tensor inside keeps the CPU's dropout (noise, saved by mul)
        real = torch.ops.aten.dropout(torch.randn(4, 4, requires_grad=True), 0.5, True)
    with FakeTensorMode():    # and a fake one after: the registration is gone
        after = torch.ops.aten.dropout(torch.randn(4, 4, requires_grad=True), 0.5, True)
    assert type(real.grad_fn).__name__ == type(after.grad_fn).__name__ == "MulBackward0"


@pytest.mark.parametrize("card, cc, dtype, backend, node", [
    ("A100", (8, 0), torch.bfloat16, "flash", "ScaledDotProductFlashAttentionBackward0"),
    ("H100", (9, 0), torch.bfloat16, "cudnn", "ScaledDotProductCudnnAttentionBackward0"),
    ("A100", (8, 0), torch.float32, "efficient", "ScaledDotProductEfficientAttentionBackward0"),
])
def test_grouped_query_attention_runs_the_cuda_kernel_chosen(card, cc, dtype, backend, node):
    """Grouped-query k/v (fewer heads than q, ``enable_gqa``) on the CUDA target: ``can_use_flash_attention``,
    ``can_use_cudnn_attention`` and ``can_use_mem_efficient_attention`` (sdp_utils.cpp) each take them, and
    attention.cpp gives each op key and value unrepeated. So the op autograd records is the chosen CUDA
    kernel's, never the CPU's flash (``_scaled_dot_product_flash_attention_for_cpu``), and the gradients of
    k and v keep their heads."""
    with FakeTensorMode(), kernel_target(KernelTarget(card, cc)) as target, cuda_kernels():
        q = torch.empty(1, 4, 64, 16, dtype=dtype, requires_grad=True)
        k, v = (torch.empty(1, 2, 64, 16, dtype=dtype, requires_grad=True) for _ in range(2))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.sum().backward()
    assert dict(target.seen) == {backend: 1}
    assert type(out.grad_fn).__name__ == node and "Cpu" not in type(out.grad_fn).__name__
    assert out.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_inplace_and_eval_dropout_are_left_alone():
    def experiment(ctx):
        x = ctx.label(torch.randn(8, 16, requires_grad=True))
        with torch.no_grad():
            nn.Dropout(0.5).eval()(x)
        nn.Dropout(0.5, inplace=True)(x * 1).sum().backward()
    a = run(experiment, "fake", fake_target="cuda")
    b = run(experiment, "fake", fake_target="cpu")
    assert _saved_dtypes(a) == _saved_dtypes(b)


def test_cli_step_reports_the_foreach_peak_and_a_cuda_label():
    def main(argv):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main(argv) == 0
        return json.loads(out.getvalue())
    d = main(["step", "mlp", "--engine", "fake", "--optimizer", "adam", "--batch", "8", "--json"])
    assert d["peak_bytes"] == 34_246_656 and "CUDA kernels" in d["label"] and d["kernels"] == "cuda"
    d = main(["step", "mlp", "--engine", "fake", "--optimizer", "adam", "--batch", "8", "--json",
              "--fake-target", "cpu"])
    assert d["peak_bytes"] == 39_997_688 and d["label"] == LABEL_FAKE_CPU and d["kernels"] == "cpu"


def test_bad_target_and_the_list_of_differences():
    with pytest.raises(ValueError, match="valid targets: cuda, cpu"):
        run(lambda ctx: None, "fake", fake_target="tpu")
    names = [n for n, _ in STILL_DIFFERS]
    assert "CUDA context" in names and "cuBLAS / cuDNN workspaces" in names


def test_lesson_04_can_show_the_differences():
    from gpulab.course.anatomy import fake_cuda_differences
    d = fake_cuda_differences()
    assert d.rows == STILL_DIFFERS and d.label == LABEL_FAKE_CUDA
    assert "cuBLAS / cuDNN workspaces" in d._repr_html_() and "CUDA context" in repr(d)


def test_the_context_figure_is_rendered_from_predict_context_not_typed_into_the_list():
    """Issue 47: STILL_DIFFERS carries no figure; lesson 04's view adds the one fit assumes, from
    predict.context's measurement (so a new measurement changes the lesson's text with it)."""
    import dataclasses
    import re
    from gpulab.course.anatomy import fake_cuda_differences
    from gpulab.predict import context as C
    assert not any(re.search(r"\d[\d,.]*\s*(MiB|GiB|MB|GB)", why) for _, why in STILL_DIFFERS)
    shown = dict(fake_cuda_differences().shown_rows())["CUDA context"]
    head = C.CONTEXT_MEASUREMENTS[0]
    assert f"{head.nbytes / 2**20:,.2f} MiB assumed" in shown and head.gpu in shown
    moved = dataclasses.replace(head, nbytes=head.nbytes + 2**20)
    old = C.CONTEXT_MEASUREMENTS
    try:
        C.CONTEXT_MEASUREMENTS = (moved,) + old[1:]
        import gpulab.predict.cards as K
        keep, K.CUDA_CONTEXT_ASSUMED = K.CUDA_CONTEXT_ASSUMED, moved.nbytes
        try:
            assert f"{moved.nbytes / 2**20:,.2f} MiB" in dict(fake_cuda_differences().shown_rows())["CUDA context"]
        finally:
            K.CUDA_CONTEXT_ASSUMED = keep
    finally:
        C.CONTEXT_MEASUREMENTS = old


def _activation_dtypes(result):
    recs = result.measurement.tracking.records.values()
    return sorted({(r.dtype, r.shape) for r in recs if r.category == Category.ACTIVATIONS})


def test_amp_on_the_fake_cuda_target_follows_cudas_autocast_lists():
    """The issue's module: Linear → softmax → LayerNorm under fp16 autocast. On CUDA softmax and
    layer_norm run in float32 (their outputs and what they save are float32); the CPU's lists keep
    them float16. The fake CUDA target follows CUDA; its CPU target follows the CPU."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 64), nn.Softmax(-1), nn.LayerNorm(64))
    kw = dict(input_shape=(64,), batch=16, optimizer="sgd", engine="fake", steps=1, amp="fp16", guard=False)
    cuda = tracked_step(model(), **kw)
    cpu = tracked_step(model(), fake_target="cpu", **kw)
    stats = (16, 1)   # layer_norm's mean and rstd, saved for backward, in the dtype of its input
    assert ("float32", stats) in _activation_dtypes(cuda) and ("float16", stats) not in _activation_dtypes(cuda)
    assert ("float16", stats) in _activation_dtypes(cpu) and ("float32", stats) not in _activation_dtypes(cpu)
    saved = [sum(r.nbytes for r in res.measurement.tracking.records.values() if r.category == Category.ACTIVATIONS)
             for res in (cuda, cpu)]
    assert saved[0] > saved[1]   # float32 where the CPU keeps float16
    assert "autocast op lists" not in [n for n, _ in STILL_DIFFERS]
