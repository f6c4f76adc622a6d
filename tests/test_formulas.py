"""gpulab.formulas against independent references: numel() of real layers, real convolutions,
torch.utils.flop_counter.FlopCounterMode, and ``optimizer.state`` after a real step.

Big models are built on the meta device (shapes only), so every test here is quick.
"""
import math

import pytest
import torch
import torchvision
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from gpulab import formulas as F
from gpulab.predict.breakdown import breakdown, params_by_formula

# Published parameter counts (torchvision model docs / the original papers' tables).
EXACT_PARAMS = {"vgg16": 138_357_544, "alexnet": 61_100_840, "resnet18": 11_689_512}


def _tv_meta(name: str) -> nn.Module:
    """The torchvision model itself, built here on the meta device (not via gpulab)."""
    with torch.device("meta"):
        return getattr(torchvision.models, name)(weights=None)


# --- parameter counts --------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(EXACT_PARAMS))
def test_breakdown_total_params_exact(name):
    bd = breakdown(name)
    assert bd.total_params == EXACT_PARAMS[name]
    assert sum(p.numel() for p in _tv_meta(name).parameters()) == EXACT_PARAMS[name]
    # every parameter belongs to exactly one leaf row (none of these models reuses a module)
    assert sum(r.params for r in bd.layers) == EXACT_PARAMS[name]
    assert bd.param_bytes == 4 * EXACT_PARAMS[name]
    assert sum(r.param_bytes for r in bd.layers) == 4 * EXACT_PARAMS[name]


def test_breakdown_param_bytes_follow_dtype():
    bd = breakdown("alexnet", dtype="bf16")
    assert bd.dtype == "bfloat16"
    assert bd.total_params == EXACT_PARAMS["alexnet"]
    assert bd.param_bytes == 2 * EXACT_PARAMS["alexnet"]


@pytest.mark.parametrize("name", sorted(EXACT_PARAMS))
def test_params_by_formula_equals_numel_for_every_layer(name):
    model = _tv_meta(name)
    checked = {nn.Conv2d: 0, nn.Linear: 0, nn.BatchNorm2d: 0}
    for mod_name, mod in model.named_modules():
        if type(mod) in checked:
            numel = sum(p.numel() for p in mod.parameters(recurse=False))
            assert params_by_formula(mod) == numel, mod_name
            checked[type(mod)] += 1
    assert checked[nn.Conv2d] > 0 and checked[nn.Linear] > 0
    if name == "resnet18":
        assert checked[nn.BatchNorm2d] == 20  # 17 conv-bn pairs + 3 downsample bns
    # and in the breakdown: each row's formula (where it has one) matches its real count
    for row in breakdown(name).layers:
        if row.params_formula is not None:
            assert row.params_formula == row.params, row.name


@pytest.mark.parametrize("layer", [
    nn.Conv2d(3, 64, 3), nn.Conv2d(3, 64, 3, bias=False), nn.Conv2d(8, 16, (3, 5)),
    nn.Conv2d(32, 64, 3, groups=4), nn.Conv2d(32, 32, 3, groups=32, bias=False),  # depthwise
    nn.Conv2d(3, 8, 1, stride=2, padding=1, dilation=2),
    nn.Linear(10, 7), nn.Linear(10, 7, bias=False),
    nn.BatchNorm2d(12), nn.BatchNorm2d(12, affine=False), nn.BatchNorm1d(5),
    nn.LayerNorm(16), nn.LayerNorm((4, 8)), nn.LayerNorm(16, elementwise_affine=False),
    nn.LayerNorm(16, bias=False), nn.Embedding(100, 32), nn.Embedding(7, 3, padding_idx=0),
    nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(), nn.Flatten(),
], ids=repr)
def test_params_by_formula_vs_real_module(layer):
    assert params_by_formula(layer) == sum(p.numel() for p in layer.parameters())


def test_layer_formulas_directly():
    assert F.conv2d_params(3, 64, 3) == nn.Conv2d(3, 64, 3).weight.numel() + 64 == 1792
    assert F.linear_params(4096, 1000) == 4_097_000
    assert F.layernorm_params(768) == 2 * 768
    assert F.layernorm_params((4, 8), bias=False) == 32
    assert F.layernorm_params(768, elementwise_affine=False) == 0
    assert F.embedding_params(50257, 768) == nn.Embedding(50257, 768, device="meta").weight.numel()
    with pytest.raises(ValueError):
        F.conv2d_params(3, 64, 3, groups=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_batchnorm_buffer_bytes_vs_real_buffers(dtype):
    bn = nn.BatchNorm2d(64, dtype=dtype)
    real = sum(b.untyped_storage().nbytes() for b in bn.buffers())
    assert F.batchnorm_buffer_bytes(64, dtype) == real
    assert F.batchnorm_buffer_bytes(64, track_running_stats=False) == 0
    assert sum(1 for _ in nn.BatchNorm2d(64, track_running_stats=False).buffers()) == 0


# --- shapes and bytes ------------------------------------------------------------------------

@pytest.mark.parametrize("hw,k,s,p,d", [
    ((32, 32), 3, 1, 0, 1), ((32, 32), 3, 1, 1, 1), ((224, 224), 11, 4, 2, 1),
    ((31, 17), 3, 2, 1, 1), ((28, 28), 5, 3, 0, 2), ((20, 13), (3, 5), (2, 1), (1, 2), (2, 1)),
    ((7, 7), 7, 1, 0, 1), ((9, 10), 1, 2, 0, 1), ((16, 16), 3, 1, 2, 3),
])
def test_conv_output_size_vs_real_conv(hw, k, s, p, d):
    conv = nn.Conv2d(2, 3, k, stride=s, padding=p, dilation=d)
    with torch.no_grad():
        out = conv(torch.randn(1, 2, *hw))
    assert F.conv2d_output_hw(*hw, k, s, p, d) == tuple(out.shape[-2:])


@pytest.mark.parametrize("hw,k,s,p", [((224, 224), 2, 2, 0), ((55, 55), 3, 2, 0), ((13, 13), 3, 2, 1)])
def test_maxpool_output_size_uses_the_same_formula(hw, k, s, p):
    out = nn.MaxPool2d(k, s, p)(torch.randn(1, 1, *hw))
    assert F.conv2d_output_hw(*hw, k, s, p) == tuple(out.shape[-2:])


def test_tensor_bytes_reference_examples():
    # 500 x 500 RGB image, fp32: 500*500*3*4 B ("3M" in the articles: 3,000,000 B = 2.86 MiB)
    assert F.tensor_bytes((500, 500, 3), "float32") == 3_000_000
    # (256, 3, 100, 100) fp32 batch: 256*3*100*100*4 B ("31M")
    assert F.tensor_bytes((256, 3, 100, 100), "fp32") == 30_720_000
    assert F.output_bytes((256, 3, 100, 100), torch.float16) == 15_360_000


@pytest.mark.parametrize("shape,dtype", [
    ((500, 500, 3), torch.float32), ((2, 3, 4), torch.float16), ((7,), torch.int64),
    ((3, 5), torch.bool), ((4, 4), torch.complex64), ((0, 9), torch.float32), ((), torch.float64),
])
def test_tensor_bytes_vs_real_tensor(shape, dtype):
    assert F.tensor_bytes(shape, dtype) == torch.empty(shape, dtype=dtype).untyped_storage().nbytes()


def test_cuda_rounded_bytes():
    assert [F.cuda_rounded_bytes(n) for n in (0, 1, 4, 511, 512, 513, 3_000_000)] == \
        [0, 512, 512, 512, 512, 1024, 3_000_320]


def test_modelsize_estimate():
    assert F.modelsize_activation_bytes([(1, 64, 224, 224), (1, 10)]) == 2 * 4 * (64 * 224 * 224 + 10)
    assert F.modelsize_activation_bytes([(2, 3)], "fp16", backward_factor=1) == 12


# --- FLOPs ------------------------------------------------------------------------------------

def _count(fn) -> int:
    fc = FlopCounterMode(display=False)
    with fc:
        fn()
    return fc.get_total_flops()


@pytest.mark.parametrize("lead,fin,fout,bias", [
    ((8,), 64, 32, True), ((1,), 4096, 1000, True), ((4, 16), 128, 256, False), ((2, 3, 5), 7, 11, True),
])
def test_linear_flops_vs_flop_counter(lead, fin, fout, bias):
    layer = nn.Linear(fin, fout, bias=bias, device="meta")
    x = torch.empty(*lead, fin, device="meta")
    with torch.no_grad():
        counted = _count(lambda: layer(x))
    assert F.linear_flops(math.prod(lead), fin, fout) == counted


@pytest.mark.parametrize("cin,cout,k,s,p,d,g,hw", [
    (3, 64, 3, 1, 1, 1, 1, (224, 224)),
    (3, 96, 11, 4, 2, 1, 1, (227, 227)),
    (32, 64, 3, 1, 0, 1, 4, (15, 17)),       # grouped
    (32, 32, 3, 1, 1, 1, 32, (28, 28)),      # depthwise
    (32, 64, 1, 1, 0, 1, 1, (28, 28)),       # pointwise
    (8, 16, (3, 5), (2, 1), (1, 2), (2, 1), 2, (20, 13)),
])
def test_conv2d_flops_vs_flop_counter(cin, cout, k, s, p, d, g, hw):
    conv = nn.Conv2d(cin, cout, k, stride=s, padding=p, dilation=d, groups=g, device="meta")
    x = torch.empty(2, cin, *hw, device="meta")
    with torch.no_grad():
        out = conv(x)
        counted = _count(lambda: conv(x))
    assert F.conv2d_flops(2, cin, cout, tuple(out.shape[-2:]), k, g) == counted


def test_depthwise_separable_needs_fewer_flops():
    hw = (56, 56)
    full = F.conv2d_flops(1, 128, 128, hw, 3)
    separable = F.conv2d_flops(1, 128, 128, hw, 3, groups=128) + F.conv2d_flops(1, 128, 128, hw, 1)
    assert separable < full / 7


@pytest.mark.parametrize("input_grad", [True, False])
def test_backward_flops_vs_flop_counter(input_grad):
    layer = nn.Linear(64, 32, device="meta")
    conv = nn.Conv2d(4, 8, 3, device="meta")
    x = torch.empty(16, 64, device="meta", requires_grad=input_grad)
    xi = torch.empty(2, 4, 10, 10, device="meta", requires_grad=input_grad)
    y, yc = layer(x), conv(xi)
    lin_back = _count(lambda: y.sum().backward())
    conv_back = _count(lambda: yc.sum().backward())
    assert lin_back == F.backward_flops(F.linear_flops(16, 64, 32), needs_input_grad=input_grad)
    assert conv_back == F.backward_flops(F.conv2d_flops(2, 4, 8, (8, 8), 3), needs_input_grad=input_grad)


@pytest.mark.parametrize("name", ["vgg16", "alexnet", "resnet18"])
def test_breakdown_forward_flops_equal_flop_counter(name):
    """FlopCounterMode counts aten.convolution and aten.addmm here (no other op in these
    models has a flop formula in torch.utils.flop_counter: ReLU, pooling, BatchNorm and the
    residual adds count 0), which is exactly what the breakdown counts, so they agree exactly."""
    model = _tv_meta(name).eval()
    x = torch.empty(1, 3, 224, 224, device="meta")
    fc = FlopCounterMode(display=False)
    with fc, torch.no_grad():
        model(x)
    counted_ops = {str(op) for op in fc.get_flop_counts()["Global"]}
    assert counted_ops == {"aten.convolution", "aten.addmm"}
    bd = breakdown(name)
    assert bd.forward_flops == fc.get_total_flops()
    assert sum(r.flops for r in bd.layers) == fc.get_total_flops()


def test_vgg16_and_alexnet_flops_magnitudes():
    # VGG16: 15.47 G multiply-adds per 224x224 image; AlexNet (torchvision): 0.71 G
    assert breakdown("vgg16").forward_flops == 30_940_528_640
    assert breakdown("alexnet").forward_flops == 1_428_376_960
    # AlexNet: the fully connected layers hold the parameters, the convolutions do the work
    bd = breakdown("alexnet")
    conv = [r for r in bd.layers if r.type == "Conv2d"]
    fc = [r for r in bd.layers if r.type == "Linear"]
    assert sum(r.params for r in fc) > 0.9 * bd.total_params
    assert sum(r.flops for r in conv) > 0.9 * bd.forward_flops


# --- optimizer state --------------------------------------------------------------------------

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.01),
    "momentum": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
}


def _small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 6 * 6, 10), nn.ReLU(), nn.Linear(10, 3, bias=False))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("foreach", [False, True])
def test_optimizer_state_bytes_vs_real_optimizer(name, foreach):
    model = _small_model()
    params = list(model.parameters())
    kwargs = {"foreach": foreach}
    opt = OPTIMIZERS[name]([{"params": params, **kwargs}])
    model(torch.randn(4, 3, 8, 8)).sum().backward()
    opt.step()
    state_bytes = sum(v.untyped_storage().nbytes() for st in opt.state.values()
                      for v in st.values() if isinstance(v, torch.Tensor))
    step_bytes = sum(v.untyped_storage().nbytes() for st in opt.state.values()
                     for k, v in st.items() if k == "step" and isinstance(v, torch.Tensor))
    param_bytes = sum(p.untyped_storage().nbytes() for p in params)
    assert F.optimizer_state_bytes(param_bytes, len(params), name) == state_bytes
    assert F.optimizer_state_bytes(param_bytes, len(params), name, count_step_counters=False) == \
        state_bytes - step_bytes
    assert state_bytes - step_bytes == F.optimizer_state_multiplier(name) * param_bytes


def test_training_multipliers_match_the_articles():
    assert {k: F.training_multiplier(k) for k in ("sgd", "momentum", "adam", "adamw")} == \
        {"sgd": 2, "momentum": 3, "adam": 4, "adamw": 4}
    with pytest.raises(ValueError, match="valid optimizers: sgd, momentum, adam"):
        F.optimizer_state_multiplier("lion")


# --- the batch-size model ----------------------------------------------------------------------

def test_fit_memory_model_exact_on_exact_data():
    # batch sizes with an exactly representable mean and integer bytes: no rounding anywhere
    batches = [1, 2, 4, 8, 16, 32]
    fit = F.fit_memory_model(batches, [1_000_000 + 250_000 * b for b in batches])
    assert (fit.fixed_bytes, fit.per_sample_bytes, fit.r2) == (1_000_000, 250_000, 1.0)
    assert fit.max_batch(1_000_000 + 250_000 * 77) == 77


@pytest.mark.parametrize("fixed,per", [(1_000_000, 250_000), (123_456_789.5, 3_141_592.25), (0, 1)])
def test_fit_memory_model_recovers_line(fixed, per):
    batches = [1, 2, 4, 8, 16, 32]
    fit = F.fit_memory_model(batches, [fixed + b * per for b in batches])
    assert fit.fixed_bytes == pytest.approx(fixed, rel=1e-12, abs=1e-6)
    assert fit.per_sample_bytes == pytest.approx(per, rel=1e-12)
    assert fit.r2 == pytest.approx(1.0, abs=1e-12)
    assert fit.predict(64) == pytest.approx(fixed + 64 * per, rel=1e-12)


def test_fit_memory_model_noisy_vs_lstsq():
    torch.manual_seed(1)
    batches = [1, 3, 4, 9, 12, 20, 31]
    ys = [5e8 + b * 2e7 + float(torch.randn(()) * 1e6) for b in batches]
    A = torch.tensor([[1.0, b] for b in batches], dtype=torch.float64)
    sol = torch.linalg.lstsq(A, torch.tensor(ys, dtype=torch.float64).unsqueeze(1)).solution.squeeze(1)
    fit = F.fit_memory_model(batches, ys)
    assert fit.fixed_bytes == pytest.approx(float(sol[0]), rel=1e-9)
    assert fit.per_sample_bytes == pytest.approx(float(sol[1]), rel=1e-9)
    assert 0.99 < fit.r2 < 1.0


def test_fit_memory_model_rejects_bad_input():
    with pytest.raises(ValueError):
        F.fit_memory_model([1], [10.0])
    with pytest.raises(ValueError):
        F.fit_memory_model([1, 2], [10.0])
    with pytest.raises(ValueError):
        F.fit_memory_model([4, 4, 4], [1.0, 2.0, 3.0])


def test_max_batch():
    gib = 2**30
    assert F.max_batch(80 * gib, 10 * gib, gib) == 70
    assert F.max_batch(80 * gib, 10 * gib, gib + 1) == 69
    assert F.max_batch(1000, 100, 300) == 3          # exactly fits: 100 + 3*300 = 1000
    assert F.max_batch(999, 100, 300) == 2
    assert F.max_batch(100, 200, 10) == 0            # even the fixed part does not fit
    with pytest.raises(ValueError):
        F.max_batch(100, 0, 0)
    for cap, fixed, per in [(24e9, 3.3e9, 1.7e8), (16 * gib, 1e9, 123_457), (12345, 45, 7)]:
        b = F.max_batch(cap, fixed, per)
        assert F.linear_memory(b, fixed, per) <= cap < F.linear_memory(b + 1, fixed, per)
    fit = F.fit_memory_model([1, 2], [110.0, 120.0])
    assert fit.max_batch(1000) == 90  # 100 + 90 * 10 = 1000
