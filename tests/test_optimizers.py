"""gpulab.course.optimizers against independent references: the tensors a real torch.optim optimizer
keeps in ``optimizer.state`` (read directly, without the tracker), parameter sizes from
``numel()``, and the CLI's ``step`` command against the multipliers."""
import json

import pytest
import torch

from gpulab import formulas as F
from gpulab.course import optimizers as O
from gpulab.training.optimizers import OPTIMIZERS
from gpulab.models.registry import build_model, resolve_model

# Our own table of constructors, so the reference does not go through gpulab.course.optimizers.
TORCH_OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.01),
    "momentum": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
}


def _reference(model: str, optimizer: str, batch: int = 4):
    """One real step on the CPU, no tracker: (state bytes before step, after step, step-counter
    bytes, param bytes, n tensors, largest tensor bytes)."""
    torch.manual_seed(0)
    net = build_model(resolve_model(model))
    opt = TORCH_OPTIMIZERS[optimizer](net.parameters())

    def state_bytes(only=None):  # numel x element size of every state tensor (none share storage)
        return sum(v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items()
                   if isinstance(v, torch.Tensor) and (only is None or k == only))

    before = state_bytes()
    x = torch.randn(batch, 3, 32, 32)
    torch.nn.functional.cross_entropy(net(x), torch.randint(0, 10, (batch,))).backward()
    opt.step()
    params = list(net.parameters())
    return {"before": before, "after": state_bytes(), "steps": state_bytes("step"),
            "param_bytes": sum(p.numel() * 4 for p in params), "n": len(params),
            "largest": max(p.numel() * 4 for p in params)}


@pytest.fixture(scope="module")
def comparison():
    return O.compare_optimizers("mlp", OPTIMIZERS, batch=4, engine="cpu")


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_matches_optimizer_state_tensors(comparison, name):
    ref = _reference("mlp", name)
    run = comparison.row(name)
    assert run.engine == "cpu"
    assert run.param_bytes == ref["param_bytes"]
    assert run.state_before_bytes == ref["before"]
    assert run.state_after_bytes == ref["after"]
    assert run.step_counter_bytes == ref["steps"]
    # the multiplier, exactly, once the 4-byte step counters are set aside
    assert run.state_ratio == F.optimizer_state_multiplier(name)
    assert run.formula_state_bytes == run.state_after_bytes


def test_state_appears_in_first_step_except_adagrad(comparison):
    """torch.optim creates state lazily in step(); Adagrad fills its 'sum' in the constructor."""
    for run in comparison.runs:
        if run.optimizer == "adagrad":
            assert run.state_before_bytes == run.state_after_bytes > 0
        else:
            assert run.state_before_bytes == 0


def test_training_ratios_are_the_articles_multipliers(comparison):
    for run in comparison.runs:
        assert run.training_ratio == pytest.approx(F.training_multiplier(run.optimizer), abs=1e-4)


def test_fake_engine_measures_the_same_state():
    cpu = O.optimizer_run("cnn", "adam", batch=2, engine="cpu", steps=1)
    fake = O.optimizer_run("cnn", "adam", batch=2, engine="fake", steps=1)
    assert fake.engine == "fake" and fake.label != cpu.label
    assert fake.state_after_bytes == cpu.state_after_bytes == _reference("cnn", "adam")["after"]


def test_implementations_temporaries_follow_the_source():
    """Adam's update: the for-loop builds sqrt(v) and sqrt(v)/c for one tensor at a time (at most
    two copies of the largest parameter), foreach builds sqrt(v) for all parameters at once
    (one copy of every parameter), fused updates in place."""
    ref = _reference("mlp", "adam")
    cmp = O.compare_implementations("mlp", "adam", batch=2, engine="cpu")
    loop, each = cmp.row("for-loop").run, cmp.row("foreach").run
    assert ref["largest"] <= loop.step_temporaries_bytes <= 2 * ref["largest"]
    assert ref["param_bytes"] <= each.step_temporaries_bytes <= 2 * ref["param_bytes"]
    fused = cmp.row("fused")
    if fused.run is None:
        assert "fused" in fused.unsupported
    else:
        assert fused.run.step_temporaries_bytes <= 0.01 * ref["param_bytes"]
    # the state itself is the same whichever implementation made it
    states = {r.run.state_final_bytes for r in cmp.rows if r.run is not None}
    assert states == {ref["after"]}


def test_unsupported_implementation_is_a_row_not_an_error():
    cmp = O.compare_implementations("mlp", "rmsprop", implementations=("fused",), batch=2, engine="cpu")
    row = cmp.row("fused")
    assert row.run is None and "RMSprop" in row.unsupported
    with pytest.raises(O.UnsupportedImplementation):
        O.build_optimizer("rmsprop", [torch.nn.Parameter(torch.zeros(2))], "fused")
    assert "not supported" in cmp._repr_html_()


def test_zero_grad_set_to_none_frees_the_gradients():
    ref = _reference("mlp", "sgd")
    z = O.zero_grad_comparison("mlp", "sgd", batch=2, engine="cpu")
    assert z.between_steps(True)["gradients"] == 0
    assert z.between_steps(False)["gradients"] == ref["param_bytes"]
    # zeroed gradients stay alive, and accumulating into them needs the new gradient as well
    assert z.runs[False].step_peak_of_run(2) > z.runs[True].step_peak_of_run(2)


def test_mixed_precision_adam_is_16_bytes_per_parameter():
    mp = O.mixed_precision_states("mlp", batch=2, engine="cpu")
    ref = _reference("mlp", "adam")
    n = ref["param_bytes"] // 4
    bpp = mp.bytes_per_param()
    assert bpp["parameters"] == 4 and bpp["gradients"] == 4
    assert bpp["optimizer_state"] * n == 8 * n + ref["steps"]
    assert mp.autocast_dtype == "bfloat16"


def test_bad_input_names_what_is_valid():
    with pytest.raises(ValueError, match="valid optimizers"):
        O.optimizer_run("mlp", "lamb")
    with pytest.raises(ValueError, match="valid"):
        O.optimizer_run("mlp", "adam", implementation="cuda-graph")
    with pytest.raises(ValueError, match="positive"):
        O.optimizer_run("mlp", "adam", batch=0)
    with pytest.raises(ValueError):
        O.compare_optimizers("mlp", [])


def test_claims_verdicts_come_from_the_measurements(comparison):
    report = O.optimizer_claims(comparison)
    verdicts = {c.claim.split(":")[0].split(" keeps")[0]: c.verdict for c in report}
    assert all(v == "holds" for v in verdicts.values()), verdicts


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adamw"])
def test_cli_step_optimizer_state_is_multiplier_times_parameters(name, capsys):
    """The issue's check: ``gpulab step`` reports optimizer_state = multiplier x parameters
    (Adam-style optimizers add one 4-byte step counter per parameter tensor)."""
    from gpulab.cli import main
    assert main(["step", "mlp", "--optimizer", name, "--engine", "cpu", "--batch", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    params = d["after_step_by_category"]["parameters"]
    state = d["after_step_by_category"]["optimizer_state"]
    n_tensors = sum(1 for _ in build_model(resolve_model("mlp")).parameters())
    counters = 4 * n_tensors if name in ("adam", "adamw") else 0
    assert state == F.optimizer_state_multiplier(name) * params + counters


def test_exercises_expect_computed_values():
    ref = _reference("mlp", "adam")
    after = O.exercise_state_after_first_step("mlp", "adam")
    assert after.check(ref["after"]).ok
    assert after.check(round(ref["after"], -3)).ok          # a rounded answer is within tolerance
    no_counters = after.check(2 * ref["param_bytes"])       # the GPU's answer: the question asks for the CPU's
    assert not no_counters.ok and "step counters" in no_counters.message
    assert not after.check(4 * ref["param_bytes"]).ok       # params + grads + state is not the state
    before = O.exercise_state_before_first_step("mlp", "adam")
    assert before.check(ref["before"]).ok and ref["before"] == 0
    assert not before.check(ref["after"]).ok
