"""Lessons 06-08: in place and inference, checkpointing, mixed precision.

Panels are built, their controls changed, and ``panel.result`` is checked against references
computed here independently: bytes from shapes written out by hand, what autograd saves read
with plain torch, segment layouts spelled out, dtypes observed under a plain ``torch.autocast``."""
import io
import math

import pytest
import torch
from torch import nn

from gpulab.course import checkpointing as C
from gpulab.course import inference as I
from gpulab.course import inplace as P
from gpulab.course import precision as M
from gpulab.measure.engines import LABEL_CPU, LABEL_FAKE_CPU
from gpulab.widgets.checkpoint import checkpoint_panel
from gpulab.widgets.inference_modes import grad_modes_panel
from gpulab.widgets.inplace import inplace_panel
from gpulab.widgets.lifetimes import lifetimes_panel
from gpulab.widgets.precision import precision_panel

NO_CUDA = not torch.cuda.is_available()
F32, I64 = 4, 8


def fmap(*shape, itemsize=F32):
    return math.prod(shape) * itemsize


def png_bytes(fig) -> int:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return len(buf.getvalue())


# --- lesson 06: what autograd saves -------------------------------------------------------------

def test_saved_tensors_relu_keeps_its_result():
    x = torch.randn(5, 7, requires_grad=True)
    y = torch.relu(x)
    rows = P.saved_tensors(y, [x])
    assert len(rows) == 1
    (row,) = rows
    assert row.saved_by == ("ReluBackward0._saved_result",)
    assert row.nbytes == 5 * 7 * F32
    assert row.key == y.untyped_storage()._cdata  # the output itself, not the input
    assert not row.by_reference


def test_saved_tensors_counts_a_shared_storage_once():
    x = torch.randn(2, 3, 8, 8)
    conv = nn.Conv2d(3, 4, 3, padding=1)
    w2 = torch.randn(4, 4, 3, 3)
    y = torch.relu(conv(x))
    z = nn.functional.conv2d(y, w2).sum()
    rows = P.saved_tensors(z, list(conv.parameters()) + [x, w2])
    relu_rows = [r for r in rows if any("Relu" in w for w in r.saved_by)]
    assert len(relu_rows) == 1 and len(relu_rows[0].saved_by) == 2  # ReLU's result = next conv's input
    assert P.saved_activation_bytes(rows) == fmap(2, 4, 8, 8)


@pytest.fixture(scope="module")
def inplace():
    panel = inplace_panel(depth=3, channels=8, batch=4, image_size=16, engine="cpu")
    panel.run()
    return panel


def test_inplace_panel_train_step(inplace):
    assert inplace.error is None, inplace.error
    r = inplace.result
    one = fmap(4, 8, 16, 16)
    assert r.label == LABEL_CPU
    # autograd saves one map per block either way (ReLU's result, which the next conv saves too)
    assert r.runs[False].saved_bytes == r.runs[True].saved_bytes == 3 * one == r.predicted_saved_bytes
    assert r.allocation_saving == 3 * one == r.articles_saving_bytes  # the ReLU outputs never allocated
    assert abs(r.forward_peak_saving - one) <= 4  # one map: the last ReLU's input and output (± the loss scalar)
    assert r.peak_saving == 0             # the peak is in backward, same tensors alive
    assert r.grads_match is True
    assert "inplace=True" in r._repr_html_() and LABEL_CPU in r._repr_html_()


def test_inplace_panel_batchnorm_and_no_grad(inplace):
    inplace.set(block="conv-bn-relu")
    r = inplace.result
    one = fmap(4, 8, 16, 16)
    assert r.runs[True].saved_bytes == 3 * (2 * one + 2 * 8 * F32)  # BN input + ReLU result + 2 stats
    inplace.set(mode="no_grad forward")
    r = inplace.result
    assert r.runs[False].saved is None and r.runs[False].saved_bytes is None
    assert r.allocation_saving == 3 * one
    assert r.peak_saving == 0
    inplace.set(block="conv-relu", mode="train step")


@pytest.mark.skipif(not NO_CUDA, reason="checks the message shown when CUDA is missing")
def test_inplace_panel_bad_engine(inplace):
    before = inplace.result
    with pytest.raises(ValueError, match="needs a GPU"):   # not offered without one
        inplace.set(engine="cuda")
    assert inplace.result is before  # the last good result is kept
    inplace.set(engine="cpu")
    assert inplace.error is None


def test_inplace_experiment_rejects_bad_values():
    with pytest.raises(ValueError, match="depth"):
        P.inplace_experiment(depth=0)
    with pytest.raises(ValueError, match="block"):
        P.inplace_experiment(block="conv-gelu")


@pytest.mark.parametrize("case,breaks", [("sigmoid then mul_", True), ("exp then add_", True),
                                         ("linear then relu_", False)])
def test_inplace_break(case, breaks):
    r = P.inplace_break(case)
    assert (r.version_before, r.version_after) == (0, 1)
    assert r.saves_output is breaks
    assert (r.error is not None) is breaks
    if breaks:
        assert "modified by an inplace operation" in r.error
    else:
        assert r.grad_ok


def test_inplace_exercise_and_claims(inplace):
    ex = P.exercise_saved_bytes(depth=4, channels=16, batch=8, image_size=32)
    assert ex.check(4 * fmap(8, 16, 32, 32)).ok
    wrong = ex.check(8 * fmap(8, 16, 32, 32))  # counting the conv outputs too
    assert not wrong.ok and "bytes per element" not in wrong.message
    report = P.inplace_claims(inplace.result, P.inplace_break())
    verdicts = [c.verdict for c in report]
    assert verdicts == ["holds for allocations, breaks for the peak", "holds", "breaks"]


# --- lesson 06: no_grad / eval / inference_mode -------------------------------------------------------

def reference_saved(batch, ch, size, training):
    """Written out from derivatives.yaml, independently of gpulab.course.inference."""
    full = fmap(batch, ch, size, size)
    half = batch * ch * (size // 2) ** 2
    total = full + full + half * I64 + half * F32   # BN input, ReLU result, pool indices, Linear input
    if training:
        total += 2 * ch * F32 + half * F32             # BN save_mean/invstd, dropout's mask
    return total


@pytest.fixture(scope="module")
def modes():
    panel = grad_modes_panel(batch=8, channels=4, image_size=8, engine="cpu")
    panel.run()
    return panel


def test_grad_modes_panel(modes):
    assert modes.error is None, modes.error
    r = modes.result
    runs = r.runs
    assert runs["train() + grad"].saved_bytes == reference_saved(8, 4, 8, True)
    assert runs["eval() + grad"].saved_bytes == reference_saved(8, 4, 8, False)
    for m in ("train() + no_grad", "eval() + no_grad", "eval() + inference_mode"):
        assert runs[m].saved_bytes == 0 and runs[m].grad_fn is None
        assert runs[m].held_bytes == 8 * 10 * F32  # only the logits stay
    assert runs["eval() + grad"].grad_fn == "AddmmBackward0"
    assert runs["train() + grad"].dropout_active and runs["train() + no_grad"].bn_stats_updated
    assert not runs["eval() + grad"].dropout_active and not runs["eval() + grad"].bn_stats_updated
    assert runs["eval() + inference_mode"].is_inference and not runs["eval() + inference_mode"].version_tracked
    assert runs["eval() + no_grad"].peak_bytes == runs["eval() + inference_mode"].peak_bytes
    assert runs["eval() + no_grad"].peak_bytes < runs["eval() + grad"].peak_bytes


def test_grad_modes_panel_resize_and_bad_size(modes):
    modes.set(batch=16)
    assert modes.result.runs["train() + grad"].saved_bytes == reference_saved(16, 4, 8, True)
    modes.set(batch=8)
    with pytest.raises(ValueError, match="even"):
        I.inference_modes(image_size=7)
    with pytest.raises(ValueError, match="mode"):
        I.inference_modes(modes=("train()",))


def test_inference_claims(modes):
    nograd = I.forward_lifetimes(batch=2, channels=4, image_size=16, engine="fake")
    report = I.inference_claims(modes.result, nograd)
    assert [c.verdict for c in report] == ["holds", "holds", "holds"]


# --- lesson 06: del in forward --------------------------------------------------------------------------

def unet_reference_sum(b, c, s):
    """Every intermediate of TinyUNet's forward, shapes written out again here."""
    h, q = s // 2, s // 4
    shapes = [(b, c, s, s)] * 2 + [(b, c, h, h)] + [(b, 2 * c, h, h)] * 2 + [(b, 2 * c, q, q)] + \
             [(b, 4 * c, q, q)] * 2 + [(b, 4 * c, h, h), (b, 6 * c, h, h), (b, 2 * c, h, h), (b, 2 * c, h, h),
                                       (b, 2 * c, s, s), (b, 3 * c, s, s), (b, c, s, s), (b, c, s, s), (b, 1, s, s)]
    return sum(fmap(*sh) for sh in shapes)


@pytest.fixture(scope="module")
def lifetimes():
    panel = lifetimes_panel(batch=2, channels=4, image_size=16, engine="cpu")
    panel.run()
    return panel


def test_lifetimes_no_grad(lifetimes):
    assert lifetimes.error is None, lifetimes.error
    r = lifetimes.result
    names, reuse = r.runs["names kept"], r.runs["del / reuse"]
    assert names.forward_peak == unet_reference_sum(2, 4, 16) == r.predicted_names_peak
    assert reuse.forward_peak < 0.6 * names.forward_peak


def test_lifetimes_with_grad(lifetimes):
    nograd = lifetimes.result
    lifetimes.set(grad_mode="train step")
    r = lifetimes.result
    assert r.grad_mode == "train step"
    # del still frees what autograd does not keep, but a smaller share than without autograd
    frac_grad = r.peak_saving / r.runs["names kept"].peak_bytes
    frac_nograd = nograd.peak_saving / nograd.runs["names kept"].peak_bytes
    assert 0 < frac_grad < frac_nograd
    lifetimes.set(grad_mode="no_grad forward")


def test_lifetimes_same_function_both_styles():
    torch.manual_seed(0)
    a = I.TinyUNet(4, "names kept")
    b = I.TinyUNet(4, "del / reuse")
    b.load_state_dict(a.state_dict())
    x = torch.randn(1, 3, 16, 16)
    assert torch.equal(a(x), b(x))
    with pytest.raises(ValueError, match="multiple of 4"):
        I.forward_lifetimes(image_size=18)


# --- lesson 07: checkpointing ----------------------------------------------------------------------

@pytest.mark.parametrize("n,k,sizes", [(16, 4, [4, 4, 4, 4]), (16, 5, [3, 3, 3, 3, 4]), (16, 9, [1] * 8 + [8]),
                                       (8, 3, [2, 2, 4]), (5, 1, [5])])
def test_segment_sizes_like_checkpoint_sequential(n, k, sizes):
    # torch/utils/checkpoint.py: segment_size = N // k; the last segment runs the rest
    assert C.segment_sizes(n, k) == sizes
    assert C.checkpoint_sequential_maps(n, k) == (k - 1) + max(sizes)


def test_chen_formula_minimum_at_sqrt_n():
    for n in (9, 16, 25, 36):
        best = min(range(1, n + 1), key=lambda k: C.chen_maps(n, k))
        assert best == math.isqrt(n)
        assert C.chen_maps(n, best) == 2 * math.isqrt(n)
    assert C.best_segments(16) == 4


def test_checkpoint_sequential_gradients_equal_plain():
    torch.manual_seed(0)
    net = C.block_stack(6, 8)
    x = torch.randn(4, 8)
    net(x).sum().backward()
    plain = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    torch.utils.checkpoint.checkpoint_sequential(net, 3, x, use_reentrant=False).sum().backward()
    assert all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(plain, net.parameters()))


@pytest.fixture(scope="module")
def ckpt():
    panel = checkpoint_panel(n_blocks=8, width=32, batch=64, repeats=2, engine="cpu")
    panel.run()
    assert panel.wait()   # the timings follow the memory on a worker thread
    return panel


def test_checkpoint_panel_memory(ckpt):
    assert ckpt.error is None, ckpt.error
    r = ckpt.result
    one = fmap(64, 32)
    assert r.map_bytes == one and [p.segments for p in r.points] == list(range(1, 9))
    base = r.baseline
    # without checkpointing: 8 saved maps, plus about one for the gradient in flight
    assert abs(base.activation_side - 8 * one) <= 1.5 * one
    for p in r.points:
        # formula (segments) within 1.5 maps of the measurement
        assert abs(p.activation_side - C.checkpoint_sequential_maps(8, p.segments) * one) <= 1.5 * one, p.segments
        if p.segments > 4:  # N // k == 1: the last segment holds everything else, nothing is saved
            assert p.peak_bytes == base.peak_bytes
    best = r.best
    expected_drop = (8 - C.checkpoint_sequential_maps(8, best.segments)) * one
    assert abs((base.peak_bytes - best.peak_bytes) - expected_drop) <= 1.5 * one
    assert abs(best.segments - math.sqrt(8)) <= 1.5
    assert all(p.timing is not None and len(p.timing.samples) == 2 for p in r.points)
    assert "1 thread" in r.timing_label
    assert png_bytes(r.figure()) > 10_000


def test_checkpoint_panel_divisors_and_fake(ckpt):
    ckpt.set(segments="divisors of N", engine="fake")
    r = ckpt.result
    assert [p.segments for p in r.points] == [1, 2, 4, 8]
    assert r.label == LABEL_FAKE_CPU and all(p.timing is None for p in r.points)
    assert "not timed" in r.timing_label
    assert png_bytes(r.figure()) > 5_000
    ckpt.set(segments=C.SEGMENT_CHOICES[0], engine="cpu")


def test_checkpoint_bad_input(ckpt):
    with pytest.raises(ValueError, match="segment counts"):
        C.checkpoint_sweep(8, 32, 64, [0, 3], engine="fake")
    with pytest.raises(ValueError, match="64 blocks"):
        C.checkpoint_sweep(65, engine="fake")
    if NO_CUDA:
        with pytest.raises(ValueError, match="needs a GPU"):   # not offered without one
            ckpt.set(engine="cuda")
        ckpt.set(engine="cpu")


def test_timing_helper():
    t = C.time_fn(lambda: sum(range(1000)), warmup=1, repeats=5)
    assert len(t.samples) == 5 and t.min <= t.low <= t.median <= t.high
    with pytest.raises(ValueError):
        C.time_fn(lambda: None, repeats=0)


def test_checkpoint_exercise_and_claims(ckpt):
    ex = C.exercise_checkpoint_maps(16, 4)
    assert ex.check(7).ok and not ex.check(16).ok and not ex.check(8).ok
    deeper = C.checkpoint_sweep(32, 32, 64, "divisors of N", engine="fake")
    report = C.checkpoint_claims(ckpt.result, deeper)
    assert report[0].verdict == "holds" and report[1].verdict == "holds"
    assert report[2].verdict.startswith("holds for memory")


# --- lesson 08: mixed precision -------------------------------------------------------------------------

def test_autocast_on_cpu_saves_bf16_tensors():
    """Independent reference: plain torch.autocast, read what the matmul saved."""
    lin = nn.Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16 and lin.weight.dtype == torch.float32
    assert y.grad_fn._saved_mat1.dtype == torch.bfloat16
    assert M.autocast_support("cpu")["bfloat16"]


@pytest.fixture(scope="module")
def precision():
    panel = precision_panel(model="cnn", batch=4, optimizer="adam", engine="cpu")
    panel.run()
    return panel


def test_precision_panel_bf16(precision):
    assert precision.error is None, precision.error
    r = precision.result
    assert r.modes == ("fp32", "autocast bfloat16", "pure bfloat16")
    fp32, amp, pure = (r.runs[m] for m in r.modes)
    net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
                        nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(1024, 128), nn.ReLU(), nn.Linear(128, 10))
    n = sum(p.numel() for p in net.parameters())
    tensors = sum(1 for _ in net.parameters())
    assert fp32.n_params == amp.n_params == n
    # autocast keeps fp32 weights, grads and Adam state: exactly the fp32 bytes
    assert amp.persistent == fp32.persistent == {"parameters": 4 * n, "gradients": 4 * n,
                                                 "optimizer_state": 8 * n + 4 * tensors}
    assert pure.persistent == {"parameters": 2 * n, "gradients": 2 * n, "optimizer_state": 4 * n + 4 * tensors}
    assert amp.bytes_per_param == pytest.approx(16 + 4 * tensors / n)
    assert r.param_dtypes("autocast bfloat16") == "float32"
    assert amp.saved_by_dtype.get("bfloat16", 0) > 0 and amp.saved_by_dtype.get("float32", 0) < 1024
    assert "int64" in amp.saved_by_dtype  # max-pool indices do not shrink
    assert 0.5 <= r.ratio("autocast bfloat16", "activations") < 1.0
    assert r.saving_percent("autocast bfloat16") > 0
    assert png_bytes(r.figure()) > 10_000
    assert LABEL_CPU in r._repr_html_()


def test_precision_panel_fp16_scaler(precision):
    precision.set(model="mlp", low="float16", batch=2)
    assert precision.error is None, precision.error
    r = precision.result
    amp = r.runs["autocast float16"]
    assert amp.scaler is not None and amp.scaler["scale"] == 2.0 ** 16  # no inf: the scale is unchanged
    assert amp.persistent == r.runs["fp32"].persistent
    precision.set(engine="fake")
    assert precision.error is None and precision.result.label == LABEL_FAKE_CPU
    assert precision.result.runs["autocast float16"].scaler["scale"] is None  # fake tensors hold no value
    precision.set(model="cnn", low="bfloat16", batch=4, engine="cpu")


def test_precision_bad_input(precision):
    precision.set(model="vgg16", image_size=16)
    assert precision.error and "too small" in precision.error
    precision.set(model="cnn", image_size=32)
    with pytest.raises(ValueError, match="low-precision dtype"):
        M.precision_step("mlp", low="int8", engine="fake")
    with pytest.raises(ValueError, match="steps"):
        M.precision_step("mlp", steps=0, engine="fake")


def test_precision_formulas_and_claims(precision):
    assert M.persistent_bytes_per_param("adam", "autocast bfloat16") == 16
    assert M.persistent_bytes_per_param("adam", "pure bfloat16") == 8
    assert M.apex_bytes_per_param("adam") == 16
    assert M.expected_ratio("parameters", "autocast bfloat16") == 1.0
    assert M.expected_ratio("activations", "autocast float16") == 0.5
    assert M.exercise_autocast_bytes_per_param().check(16).ok
    mlp = M.precision_step("mlp", batch=2, engine="fake")
    results = [precision.result, mlp]
    report = M.precision_claims(results)
    near = [r.model for r in results if abs(r.saving_percent(r.modes[1]) - 20) <= 10]
    far = [r.model for r in results if r.model not in near]
    expected = ("holds" if not far else "breaks" if not near
                else f"holds for {', '.join(near)}; breaks for {', '.join(far)}")
    assert report[0].verdict == expected
    assert mlp.saving_percent("autocast bfloat16") == 0  # the MLP's peak is in Adam's step: nothing shrinks
    assert report[1].verdict == "holds" and report[2].verdict == "holds"
