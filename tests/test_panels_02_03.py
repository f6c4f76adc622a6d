"""Lessons 02 (parameters) and 03 (activations and FLOPs): panels, experiments, checkers.

Each panel is built, each control changed, and ``panel.result`` compared with an independent
reference: ``numel()`` and storage bytes of modules built here with torch / torchvision,
``FlopCounterMode``, tensors collected with ``saved_tensors_hooks``, and the cs231n VGG16
table worked out from the VGG16 configuration by hand.
"""
from __future__ import annotations

import math

import pytest
import torch
import torchvision
from matplotlib.figure import Figure
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from gpulab.course import activations as A
from gpulab.course import flops as FL
from gpulab.course import modelsize as MS
from gpulab.course import parameters as P
from gpulab.measure.engines import LABEL_CPU, LABEL_FAKE_CPU
from gpulab.models.registry import small_cnn
from gpulab.widgets import (depthwise_panel, flops_panel, forward_table_panel, inference_panel, layer_panel,
                            modelsize_panel, parameters_panel)

NO_CUDA = not torch.cuda.is_available()
# exact byte counts are asserted on the host engines; on a GPU machine "auto" would pick cuda,
# whose counts are rounded to 512-byte blocks, so there the tests name the host engine
AUTO = "auto" if NO_CUDA else "cpu"
AUTO_FAKE = "auto" if NO_CUDA else "fake"


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _buffer_bytes(module: nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers())


def _leaf_numels(model: nn.Module) -> dict[str, int]:
    return {n: sum(p.numel() for p in m.parameters(recurse=False))
            for n, m in model.named_modules() if not any(True for _ in m.children())}


def _saved_reference(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves in one forward; weights, buffers (BatchNorm
    saves its running statistics too) and the input excluded."""
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), x]}
    del out
    return sum(v for k, v in seen.items() if k not in skip)


# --- lesson 02: one layer ---------------------------------------------------------------------------

def test_layer_panel_default_matches_a_real_conv():
    p = layer_panel(engine=AUTO)
    p.run()
    r = p.result
    ref = nn.Conv2d(64, 128, 3)
    assert p.error is None
    assert r.params_numel == r.params_formula == _numel(ref) == 73_856
    assert r.param_bytes_measured == r.param_bytes_formula == _param_bytes(ref)
    assert r.buffer_bytes_measured == 0
    assert r.label == LABEL_CPU
    assert r.formula == "128×64×3×3 + 128"
    assert r.article_formula == 64 * 128 * 9      # the articles' bias-free version


@pytest.mark.parametrize("change, ref", [
    ({"kernel": 5}, lambda: nn.Conv2d(64, 128, 5)),
    ({"groups": 64, "out_size": 64}, lambda: nn.Conv2d(64, 64, 3, groups=64)),
    ({"bias": False}, lambda: nn.Conv2d(64, 128, 3, bias=False)),
    ({"in_size": 96, "out_size": 48, "groups": 3}, lambda: nn.Conv2d(96, 48, 3, groups=3)),
    ({"kind": "Linear", "in_size": 300, "out_size": 70}, lambda: nn.Linear(300, 70)),
    ({"kind": "LayerNorm", "out_size": 768, "bias": False}, lambda: nn.LayerNorm(768, bias=False)),
    ({"kind": "Embedding", "in_size": 5000, "out_size": 32}, lambda: nn.Embedding(5000, 32)),
])
def test_layer_panel_each_control(change, ref):
    p = layer_panel(engine=AUTO)
    p.set(**change)
    assert p.error is None, p.error
    r, m = p.result, ref()
    assert r.params_numel == r.params_formula == _numel(m)
    assert r.param_bytes_measured == _param_bytes(m)
    assert [t.shape for t in r.tensors if t.kind == "parameter"] == [list(q.shape) for q in m.parameters()]


def test_layer_panel_batchnorm_buffers_dtype_and_engine():
    p = layer_panel(kind="BatchNorm2d", out_size=256, engine=AUTO)
    p.run()
    ref = nn.BatchNorm2d(256)
    r = p.result
    assert r.params_numel == 512 and r.buffer_bytes_measured == r.buffer_bytes_formula == _buffer_bytes(ref)
    assert r.buffer_bytes_measured == 256 * 4 * 2 + 8
    p.set(dtype="bfloat16")
    ref16 = nn.BatchNorm2d(256, dtype=torch.bfloat16)
    assert p.result.param_bytes_measured == _param_bytes(ref16) == 1024
    assert p.result.buffer_bytes_measured == _buffer_bytes(ref16) == 256 * 2 * 2 + 8  # the counter stays int64
    p.set(engine="fake")
    assert p.result.label == LABEL_FAKE_CPU and p.result.buffer_bytes_measured == _buffer_bytes(ref16)


def test_layer_panel_bad_input_is_a_readable_error():
    p = layer_panel()
    p.set(groups=3)                     # 3 does not divide 64
    assert p.error.startswith("ValueError") and "groups=3 must divide" in p.error
    with pytest.raises(ValueError, match="in must be a positive integer"):
        P.layer_params("Linear", 0, 10)
    with pytest.raises(ValueError, match="unknown layer"):
        P.layer_params("Conv3d")
    if NO_CUDA:
        with pytest.raises(ValueError, match="needs a GPU"):   # not offered without one
            p.set(groups=1, engine="cuda")


# --- lesson 02: a whole model ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["vgg16", "alexnet"])
def test_parameters_panel_matches_torchvision_layer_by_layer(name):
    p = parameters_panel(model=name, engine=AUTO_FAKE)
    p.run()
    r = p.result
    ref = getattr(torchvision.models, name)(weights=None)
    assert p.error is None
    assert {row.name: row.params_numel for row in r.rows} == _leaf_numels(ref)
    assert not r.mismatches                       # every formula equals numel()
    assert r.total_numel == r.total_formula == _numel(ref)
    assert r.param_bytes_measured == _param_bytes(ref)
    assert r.by_dtype["bfloat16"] == 2 * _numel(ref) and r.by_dtype["int8"] == _numel(ref)
    assert r.measurement.engine == "fake"          # too big to initialise on a laptop CPU in a second


def test_parameters_panel_controls_resnet_buffers_dtype_engine():
    p = parameters_panel(engine=AUTO)
    p.set(model="resnet18")
    ref = torchvision.models.resnet18(weights=None)
    r = p.result
    assert r.buffer_bytes_measured == r.buffer_bytes_formula == _buffer_bytes(ref)
    assert r.param_bytes_measured == _param_bytes(ref) and r.label == LABEL_CPU
    p.set(dtype="float16")
    assert p.result.param_bytes_measured == 2 * _numel(ref)
    p.set(model="cnn", dtype="float32", engine="fake")
    fake = p.result
    p.set(engine="cpu")
    assert fake.label == LABEL_FAKE_CPU and p.result.label == LABEL_CPU
    assert fake.param_bytes_measured == p.result.param_bytes_measured == _param_bytes(small_cnn())
    if NO_CUDA:
        with pytest.raises(ValueError, match="needs a GPU"):   # not offered without one
            p.set(engine="cuda")


def test_params_vs_buffers():
    d = P.params_vs_buffers("cnn", batch=4, engine=AUTO)
    ref = small_cnn()
    assert d.param_tensors == d.params_with_grad == len(list(ref.parameters()))
    assert d.buffer_tensors == len(list(ref.buffers())) and d.buffers_requiring_grad == 0
    assert sorted(d.buffers_changed) == sorted(n for n, _ in ref.named_buffers())  # train mode updates them
    assert d.live["gradients"] == d.live["parameters"] == _param_bytes(ref)
    assert d.live["buffers"] == _buffer_bytes(ref)
    with pytest.raises(ValueError, match="batch"):
        P.params_vs_buffers("cnn", batch=0)


def test_parameter_claims():
    c = {x.claim.split(" has ")[0].split(" ")[0]: x for x in P.parameter_claims(engine="fake")}
    assert c["Conv2d(Cin,"].verdict == "holds for plain convs without bias, breaks for grouped convs"
    assert c["Linear(M"].verdict == "holds" and c["BatchNorm(N)"].verdict == "holds"
    assert c["Embedding(N,"].verdict == "holds"
    assert all(x.evidence and all(e.label for e in x.evidence) for x in c.values())


def test_lesson_02_exercises():
    conv = P.exercise("vgg16_conv")
    assert conv.check(256 * 128 * 3 * 3 + 256).ok
    assert not conv.check(256 * 128 * 3 * 3).ok           # the articles' bias-free count
    bn = P.exercise("batchnorm_bytes")
    assert bn.check(_param_bytes(nn.BatchNorm2d(256)) + _buffer_bytes(nn.BatchNorm2d(256))).ok
    assert not bn.check(2 * 256 * 4).ok                   # parameters only
    assert not bn.check(...).ok
    with pytest.raises(ValueError):
        P.exercise("nope")


# --- lesson 03: the forward table -------------------------------------------------------------------------

VGG16_CFG = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]


def _cs231n_values(size: int = 224) -> int:
    """The cs231n VGG16 rows, from the configuration: input, each conv, each pool, the FCs."""
    total, c, hw = 3 * size * size, 3, size
    for v in VGG16_CFG:
        if v == "M":
            hw //= 2
        else:
            c = v
        total += c * hw * hw
    return total + 4096 + 4096 + 1000


def test_forward_table_panel_reproduces_cs231n():
    p = forward_table_panel(engine=AUTO_FAKE)
    p.run()
    t = p.result
    assert p.error is None and t.label == LABEL_FAKE_CPU
    assert t.values_cs231n_layers == _cs231n_values() == 15_237_608
    assert t.values_created == _cs231n_values() + 512 * 7 * 7      # + torchvision's AdaptiveAvgPool2d copy
    assert t.total_params == _numel(torchvision.models.vgg16(weights=None))
    groups = t.groups()
    assert [g.types for g in groups[1:3]] == ["Conv2d+ReLU", "Conv2d+ReLU"]  # in-place ReLU shares the row
    assert groups[1].values == 64 * 224 * 224 and groups[1].nbytes == 64 * 224 * 224 * 4
    assert t.allocated_in_forward == t.formula_new_bytes + t.formula_pool_indices_bytes
    claims = A.cs231n_claims(t)
    assert [c.verdict for c in claims] == ["holds", "breaks", "breaks"]


def test_forward_table_panel_controls():
    p = forward_table_panel(engine=AUTO_FAKE)
    p.set(batch=4)
    assert p.result.values_cs231n_layers == _cs231n_values()            # per image
    assert p.result.groups()[1].nbytes == 4 * 64 * 224 * 224 * 4
    p.set(batch=1, image_size=128)
    assert p.result.values_cs231n_layers == _cs231n_values(128)
    p.set(dtype="bfloat16")
    assert p.result.groups()[1].nbytes == 64 * 128 * 128 * 2
    p.set(model="cnn", image_size=32, dtype="float32", engine="cpu")
    t = p.result
    assert t.label == LABEL_CPU
    assert t.allocated_in_forward == t.formula_new_bytes + t.formula_pool_indices_bytes
    p.set(engine="fake")
    assert p.result.allocated_in_forward == t.allocated_in_forward   # fake and cpu allocate the same


def test_forward_table_panel_bad_input():
    p = forward_table_panel()
    p.set(model="alexnet", image_size=48)
    assert p.error.startswith("ValueError") and "too small for alexnet" in p.error
    with pytest.raises(ValueError, match="batch size"):
        A.forward_table("cnn", batch=0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        A.forward_table("cnn", dtype="int8")


# --- lesson 03: inference vs training ----------------------------------------------------------------------

def test_inference_panel_vgg16_peaks():
    p = inference_panel(engine=AUTO_FAKE)
    p.run()
    r = p.result
    image, conv1 = 3 * 224 * 224 * 4, 64 * 224 * 224 * 4
    assert r.inference.peak_non_param == image + 2 * conv1 == r.neighbour_formula
    assert r.training.peak_non_param > 2.5 * r.inference.peak_non_param
    # max-pool indices: one int64 per pooled value, saved for backward
    pooled = sum(c * (224 // 2 ** (i + 1)) ** 2 for i, c in enumerate([64, 128, 256, 512, 512]))
    assert r.training.saved_by_dtype["int64"] == 8 * pooled
    assert r.training.saved_bytes == sum(r.training.saved_by_dtype.values())


def test_inference_panel_saved_bytes_match_saved_tensors_hooks():
    p = inference_panel(model="cnn", batch=32, engine="cpu")
    p.run()
    r = p.result
    torch.manual_seed(0)
    ref = small_cnn().train()
    assert r.training.saved_bytes == _saved_reference(ref, torch.randn(32, 3, 32, 32))
    assert r.label == LABEL_CPU
    cpu = r
    p.set(engine="fake")
    assert p.result.label == LABEL_FAKE_CPU
    assert p.result.training.saved_bytes == cpu.training.saved_bytes
    assert p.result.inference.peak_non_param == cpu.inference.peak_non_param
    p.set(batch=64)
    bn_stats = 2 * (32 + 64) * 4       # BatchNorm's saved mean and inverse std: per channel, not per image
    assert p.result.training.saved_bytes - bn_stats == 2 * (cpu.training.saved_bytes - bn_stats)
    p.set(dtype="bfloat16")
    r16 = p.result
    # half the bytes, twice the batch: the same float bytes, but the int64 max-pool indices do not
    # halve, and under no_grad the peak moves to the first max-pool
    assert r16.inference.peak_non_param == r16.neighbour_formula > cpu.inference.peak_non_param
    assert r16.neighbour_layer == "3"
    assert r16.training.saved_by_dtype["int64"] == 2 * cpu.training.saved_by_dtype["int64"]
    stats32, stats16 = 2 * (32 + 64) * 4, 2 * (32 + 64) * 2   # BatchNorm statistics, in the input dtype
    assert r16.training.saved_by_dtype["bfloat16"] - stats16 == cpu.training.saved_by_dtype["float32"] - stats32
    if NO_CUDA:
        with pytest.raises(ValueError, match="needs a GPU"):   # not offered without one
            p.set(engine="cuda")


# --- lesson 03: params vs FLOPs ------------------------------------------------------------------------------

def test_flops_panel_alexnet_against_flop_counter():
    p = flops_panel()
    p.run()
    r = p.result
    ref = torchvision.models.alexnet(weights=None).to("meta")
    with FlopCounterMode(display=False) as fc:
        ref(torch.empty(1, 3, 224, 224, device="meta"))
    assert r.counted_total == r.total_flops == fc.get_total_flops()
    assert r.total_params == _numel(ref)
    conv_p, conv_f = r.share(("Conv2d",))
    fc_p, fc_f = r.share(("Linear",))
    assert conv_p < 5 and conv_f > 90 and fc_p > 95 and math.isclose(conv_f + fc_f, 100)
    assert [c.verdict for c in FL.flops_claims(r)] == ["holds", "holds"]
    p.set(batch=4)
    assert p.result.total_flops == 4 * r.total_flops
    p.set(batch=1, model="vgg16")
    assert p.result.counted_total == p.result.total_flops and p.result.share(("Linear",))[0] > 85
    p.set(model="alexnet", image_size=32)
    assert p.error and "too small" in p.error


# --- lesson 03: depthwise-separable vs standard ------------------------------------------------------------

def _ref_blocks(cin, cout, bn):
    std = [nn.Conv2d(cin, cout, 3, padding=1, bias=False)] + ([nn.BatchNorm2d(cout), nn.ReLU(True)] if bn else [])
    sep = [nn.Conv2d(cin, cin, 3, padding=1, groups=cin, bias=False)] + (
        [nn.BatchNorm2d(cin), nn.ReLU(True)] if bn else []) + [nn.Conv2d(cin, cout, 1, bias=False)] + (
        [nn.BatchNorm2d(cout), nn.ReLU(True)] if bn else [])
    return nn.Sequential(*std), nn.Sequential(*sep)


def _ref_saved(block, shape, dtype=torch.float32):
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x)
    skip = {q.untyped_storage().data_ptr() for q in [*block.parameters(), *block.buffers()]}
    del out
    return sum(v for k, v in seen.items() if k not in skip)   # the block input counts


@pytest.mark.parametrize("change", [{}, {"in_channels": 32}, {"out_channels": 64}, {"image_size": 28},
                                    {"batch": 2}, {"bn_relu": False}, {"dtype": "bfloat16"}, {"engine": "fake"}])
def test_depthwise_panel_each_control(change):
    p = depthwise_panel(in_channels=16, out_channels=32, image_size=20, batch=4, engine=AUTO)
    p.set(**change)
    assert p.error is None, p.error
    r = p.result
    cin, cout, hw, b, bn = r.in_channels, r.out_channels, r.image_size, r.batch, r.bn_relu
    std, sep = _ref_blocks(cin, cout, bn)
    assert (r.standard.params, r.separable.params) == (_numel(std), _numel(sep))
    for blk, got in ((std, r.standard), (sep, r.separable)):
        with FlopCounterMode(display=False) as fc:
            blk(torch.randn(b, cin, hw, hw))
        assert got.flops_counted == got.flops_formula == fc.get_total_flops()
    dt = getattr(torch, r.dtype)
    shape = (b, cin, hw, hw)
    assert r.standard.saved_bytes == _ref_saved(std.to(dt), shape, dt)
    assert r.separable.saved_bytes == _ref_saved(sep.to(dt), shape, dt)
    assert r.saved_formula == {"standard": r.standard.saved_bytes, "separable": r.separable.saved_bytes}
    assert r.separable.saved_bytes > r.standard.saved_bytes
    assert r.label == (LABEL_FAKE_CPU if change.get("engine") == "fake" else LABEL_CPU)


def test_depthwise_claims_depend_on_shape():
    early = FL.depthwise_vs_standard(32, 64, 112, 8, engine="fake").claims()
    late = FL.depthwise_vs_standard(512, 512, 7, 8, engine="fake").claims()
    assert [c.verdict for c in early] == ["holds", "holds", "holds"]
    assert [c.verdict for c in late][:2] == ["holds", "holds"]
    assert late[2].verdict.startswith("holds for saved activations, breaks")


def test_depthwise_bad_input():
    with pytest.raises(ValueError, match="in channels"):
        FL.depthwise_vs_standard(in_channels=0)
    with pytest.raises(ValueError, match="batch size"):
        FL.depthwise_vs_standard(batch=0)


# --- lesson 03: modelsize() vs saved ---------------------------------------------------------------------

def _article_modelsize(model: nn.Sequential, x: torch.Tensor, type_size: int = 4) -> int:
    """The articles' algorithm, literally: feed the input through model.modules()[1:] in turn,
    skipping in-place ReLUs, add up every output's numel, x type_size x 2."""
    total, inp = 0, x
    with torch.no_grad():
        for m in list(model.modules())[1:]:
            if isinstance(m, nn.ReLU) and m.inplace:
                continue
            inp = m(inp)
            total += inp.numel()
    return total * type_size * 2


def test_modelsize_panel():
    p = modelsize_panel(engine=AUTO_FAKE)
    p.run()
    c = p.result
    rows = {r.model: r for r in c.rows}
    assert rows["cnn"].modelsize_x2 == _article_modelsize(small_cnn(), torch.randn(1, 3, 32, 32))
    ref = small_cnn().train()
    x = torch.randn(1, 3, 32, 32)
    assert rows["cnn"].saved_with_input == _saved_reference(ref, x) + x.numel() * 4
    assert rows["cnn"].label == (LABEL_CPU if NO_CUDA else LABEL_FAKE_CPU) and rows["vgg16"].label == LABEL_FAKE_CPU
    assert all(r.error_percent > 20 for r in c.rows)          # modelsize() x2 overestimates every model
    assert all(r.saved_with_input <= r.backward_peak < 1.5 * r.saved_with_input for r in c.rows)
    assert [x.verdict for x in MS.modelsize_claims(c)] == ["breaks", "breaks"]
    p.set(batch=2)
    rows2 = {r.model: r for r in p.result.rows}
    assert rows2["vgg16"].modelsize_x2 == 2 * rows["vgg16"].modelsize_x2
    assert rows2["vgg16"].saved_with_input == 2 * rows["vgg16"].saved_with_input


# --- lesson 03: exercises and figures ----------------------------------------------------------------------

def test_lesson_03_exercises():
    first = A.exercise("first_conv_values")
    assert first.check(64 * 224 * 224).ok and not first.check(3 * 224 * 224).ok
    peak = A.exercise("no_grad_peak_mib")
    right = (3 * 224 * 224 + 2 * 64 * 224 * 224) * 4 / 2**20
    assert peak.check(right).ok and peak.check(round(right)).ok
    assert not peak.check(2 * 64 * 224 * 224 * 4 / 2**20 * 3).ok     # "every layer kept" style guess
    with pytest.raises(ValueError):
        A.exercise("nope")


def test_render_gives_figures_that_show_as_png_and_carry_labels():
    p = depthwise_panel(in_channels=8, out_channels=16, image_size=8, batch=1, engine=AUTO)
    p.run()
    items = p._render(p.result)
    assert isinstance(items[1], Figure) and items[1]._repr_png_()[:4] == b"\x89PNG"
    fig = FL.depthwise_figure(p.result)
    assert isinstance(fig, Figure) and LABEL_CPU in fig._suptitle.get_text()
    t = A.forward_table("cnn", engine=AUTO)
    assert LABEL_CPU in A.forward_table_figure(t)._suptitle.get_text()
    layer = P.layer_params(engine=AUTO)
    assert LABEL_CPU in P.layer_figure(layer).axes[0].get_title()
