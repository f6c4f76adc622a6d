"""The recipe optimizers (``formulas.RECIPE_OPTIMIZERS``): torch's Adafactor, and 8-bit AdamW and
paged 8-bit AdamW with bitsandbytes' state layout (``gpulab.training.eight_bit``).

References: the installed bitsandbytes' own ``AdamW8bit`` on the CPU (its state, key for key,
dtype for dtype, shape for shape), torch's Adafactor's own state, and the per-tensor formula
``formulas.shaped_optimizer_state_bytes`` against the tracker."""
from __future__ import annotations

import pytest
import torch

import gpulab
from gpulab import cli
from gpulab import formulas as F
from gpulab.training.eight_bit import AdamW8bit, PagedAdamW8bit


def _model():
    torch.manual_seed(0)
    # a 4096-element weight is the smallest kept in 8 bits; a 4095-element one keeps float32 state
    return torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 20), torch.nn.Linear(4095, 1, bias=False))


def _one_step(opt_cls, model):
    opt = opt_cls(model.parameters(), lr=1e-3)
    x = torch.randn(4, 300)
    (model[1](model[0](x)).sum() + model[2](torch.randn(4, 4095)).sum()).backward()
    opt.step()
    return opt


def _layout(opt):
    out = []
    for p, state in opt.state.items():
        out.append((tuple(p.shape), {k: (v.dtype, tuple(v.shape)) if torch.is_tensor(v) else type(v).__name__
                                     for k, v in state.items() if k != "unorm_vec"}))
    return out


def test_the_8bit_layout_is_bitsandbytes_own():
    bnb = pytest.importorskip("bitsandbytes")
    ours, theirs = _one_step(AdamW8bit, _model()), _one_step(bnb.optim.AdamW8bit, _model())
    assert _layout(ours) == _layout(theirs)
    qmaps = {id(s["qmap1"]) for s in ours.state.values() if "qmap1" in s}
    assert len(qmaps) == 1   # one map per optimizer, shared by every 8-bit tensor, as in bitsandbytes


def test_the_8bit_update_moves_the_weights_as_adamw_does():
    """Quantized moments, close arithmetic: after five steps the weights moved as a float32 AdamW
    moved them (the same direction; the sizes within 5%)."""
    torch.manual_seed(1)
    xs = [torch.randn(8, 300) for _ in range(5)]
    start = _model()
    moved = []
    for opt_cls in (AdamW8bit, torch.optim.AdamW):
        m = _model()
        opt = opt_cls(m.parameters(), lr=1e-3)
        for x in xs:
            opt.zero_grad()
            m[1](torch.tanh(m[0](x))).pow(2).sum().backward()
            opt.step()
        moved.append((m[0].weight - start[0].weight).detach().flatten())
    cos = torch.nn.functional.cosine_similarity(moved[0], moved[1], dim=0)
    assert cos > 0.99, cos
    assert abs(moved[0].norm() / moved[1].norm() - 1) < 0.05


@pytest.mark.parametrize("name", F.RECIPE_OPTIMIZERS)
def test_cpu_and_fake_agree_and_match_the_formula(name):
    kw = dict(batch=2, seq_len=32, optimizer=name, guard=False)
    cpu = gpulab.step("hf:tiny-gpt2", engine="cpu", **kw)
    fake = gpulab.step("hf:tiny-gpt2", engine="fake", fake_target="cpu", **kw)
    assert cpu.peak_by_category == fake.peak_by_category and cpu.step_peaks == fake.step_peaks
    state = cpu.as_dict()["after_step_by_category"]["optimizer_state"]
    assert state == cpu.predicted["optimizer_state"]
    adam = gpulab.step("hf:tiny-gpt2", engine="fake", fake_target="cpu", **{**kw, "optimizer": "adamw"})
    assert state < adam.as_dict()["after_step_by_category"]["optimizer_state"] / 3


def test_adafactor_keeps_row_and_column_statistics():
    m = _model()
    opt = torch.optim.Adafactor(m.parameters())
    m[0](torch.randn(2, 300)).sum().backward()
    opt.step()
    shapes = [tuple(p.shape) for p in m[0].parameters()]
    held = sum(v.numel() * v.element_size() for p in m[0].parameters() for v in opt.state[p].values())
    assert held == F.shaped_optimizer_state_bytes(shapes, "adafactor")


def test_paged_state_is_reported_apart_on_the_cuda_target():
    kw = dict(batch=8, optimizer="paged_adamw8bit", guard=False, engine="fake")
    cuda = gpulab.step("mlp", **kw).as_dict()
    cpu = gpulab.step("mlp", fake_target="cpu", **kw).as_dict()
    plain = gpulab.step("mlp", **{**kw, "optimizer": "adamw8bit"}).as_dict()
    from gpulab.models.workload import resolve_workload
    net = resolve_workload("mlp", None).build(torch.device("meta"), torch.float32)
    big = [p for p in net.parameters() if p.numel() >= 100_000]
    assert big
    # the large tensors' 8-bit states (2 bytes per element) are in unified memory, not on the device
    assert cuda["paged_peak_bytes"] == sum(2 * p.numel() for p in big)
    assert cuda["after_step_by_category"]["optimizer_state"] == \
        plain["after_step_by_category"]["optimizer_state"] - cuda["paged_peak_bytes"]
    assert "paged_peak_bytes" not in cpu   # on a CPU bitsandbytes falls back to plain buffers


def test_the_recipe_optimizers_are_named_everywhere_they_can_be(capsys):
    assert cli.main(["step", "mlp", "--batch", "4", "--engine", "fake", "--optimizer", "adamw8bit", "--json"]) == 0
    assert '"optimizer": "adamw8bit"' in capsys.readouterr().out
    with pytest.raises(ValueError, match="adafactor"):
        F.check_optimizer("lion", recipes=True)
    with pytest.raises(ValueError) as e:   # the lessons' formulas take the six of lesson 05 only
        F.optimizer_state_multiplier("adamw8bit")
    assert "adamw8bit" not in str(e.value).split("valid optimizers:")[1]
    from gpulab.training.optimizers import build_optimizer
    with pytest.raises(ValueError, match="no foreach"):   # bitsandbytes' kernel is its own: no foreach flag
        build_optimizer("adamw8bit", [torch.nn.Parameter(torch.zeros(2))], "foreach")
