"""FP8 training as torchao converts it (``training.fp8``, ``gpulab.step(fp8=...)``, ``--fp8``).

The references are independent of gpulab's own accounting: the bytes of the float8 casts of a
single linear layer, counted from torchao's ``float8_linear.py`` (forward casts the input and the
weight; backward casts the output's gradient twice, the weight and the input again), and a real
CPU run of the same converted layer, which must match the fake engine to the byte.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import gpulab
from gpulab.training.fp8 import fp8_added, fp8_layers

from conftest import run_main

pytest.importorskip("torchao.float8")

M, K, N = 16, 64, 32   # input rows, in_features, out_features


def _linear_step(engine: str, fp8: str | None):
    return gpulab.step(nn.Sequential(nn.Linear(K, N, bias=False)), input_shape=(K,), batch=M, engine=engine,
                       dtype="bf16", optimizer="sgd", fp8=fp8, steps=1)


def _cpu_scaled_mm_takes_row_scales() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes rowwise scales (torch 2.11's takes one scale per
    tensor only: "Now _scaled_mm only supports per-tensor scaling for CPU backend", Blas.cpp)."""
    a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_linear_layers_float8_casts_are_numel_bytes_and_the_fake_engine_equals_a_real_cpu_run(recipe):
    if recipe == "rowwise" and not _cpu_scaled_mm_takes_row_scales():
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes per-tensor scales only: no real rowwise run")
    fake, real = _linear_step("fake", recipe), _linear_step("cpu", recipe)
    a, b = fp8_added(fake.measurement.tracking, ["0"]), fp8_added(real.measurement.tracking, ["0"])
    # torchao's forward: input (M, K) and weight (N, K) to float8, one byte per element
    assert a.made["float8 casts"]["forward"] == M * K + N * K
    # backward: grad_output (M, N) for grad_input and again for grad_weight, the weight, the input
    assert a.made["float8 casts"]["backward"] == 2 * M * N + N * K + M * K
    assert a.counts["float8 casts"] == 6
    # scales: tensorwise one number per cast (fp32, computed in float64: at most 8 bytes each);
    # rowwise one per row or column of each cast (vectors: more than 8 bytes each)
    per_scale = a.total("scales") / a.counts["scales"]
    assert per_scale <= 8 if recipe == "tensorwise" else per_scale > 8
    assert a.as_dict() == b.as_dict()                               # fake == real, byte for byte
    assert "measured on CPU" in real.measurement.label and "fake" in fake.measurement.label


def test_torchao_saves_the_bf16_input_not_its_float8_copy():
    """What autograd keeps for backward is bf16's: FP8 adds temporaries, it saves no activation."""
    def saved(r):
        return sorted((x.dtype, tuple(x.shape)) for x in r.measurement.tracking.records.values()
                      if x.category.value == "activations")
    bf16, f8 = _linear_step("fake", None), _linear_step("fake", "tensorwise")
    assert saved(bf16) == saved(f8) and not any("float8" in d for d, _ in saved(f8))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_transformer_step_runs_on_fake_tensors_with_both_recipes(recipe):
    from gpulab.course.fp8 import lesson_config
    cfg = lesson_config()
    r = gpulab.step(cfg, batch=2, seq_len=128, engine="fake", dtype="bf16", optimizer="adamw", fp8=recipe)
    assert r.recipe["fp8"] == recipe and r.engine == "fake"
    with torch.device("meta"):
        converted, kept = fp8_layers(gpulab.models.workload.resolve_workload(cfg, None).make(torch.bfloat16))
    assert kept == ["lm_head"] and len(converted) == 2 * 7     # q k v o gate up down per layer
    added = fp8_added(r.measurement.tracking, converted)
    assert added.counts["float8 casts"] == 2 * 6 * len(converted)   # two steps, six casts per layer per step


def test_the_head_and_layers_whose_dims_do_not_divide_by_16_stay_in_high_precision():
    from gpulab.models.workload import resolve_workload
    with torch.device("meta"):
        converted, kept = fp8_layers(resolve_workload("hf:tiny-llama", None).make(torch.bfloat16))
    assert "lm_head" in kept and converted
    assert all(n.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) for n in converted)


def test_fp8_raises_the_lessons_peak_and_the_exercise_reads_it():
    from gpulab.course.fp8 import exercise_fp8_peak, fp8_comparison
    c = fp8_comparison(batch=2, seq_len=256)
    assert set(c.runs) == {"bf16", "tensorwise", "rowwise"}
    ex = exercise_fp8_peak(c)
    right = "a" if c.extra_bytes("rowwise") < 0 else "b" if c.extra_bytes("rowwise") == 0 else "c"
    assert ex.check(right).ok and not ex.check({"a": "c"}.get(right, "a")).ok
    assert "measured on fake tensors" in ex.reveal().message.lower()


@pytest.mark.parametrize("kwargs,match", [
    (dict(fp8="blockwise"), "fp8 must be one of tensorwise, rowwise"),
    (dict(fp8="rowwise", dtype="fp64"), "fp8 casts fp32, bf16 or fp16 weights"),
    (dict(fp8="rowwise", lora=8), "leave out lora and quantize with fp8"),
])
def test_bad_fp8_settings_are_one_line_errors(kwargs, match):
    with pytest.raises(ValueError, match=match) as e:
        gpulab.step("hf:tiny-llama", batch=1, engine="fake", **kwargs)
    assert "\n" not in str(e.value)


def test_a_torchao_older_than_the_one_read_is_refused_in_one_line(monkeypatch):
    """Colab ships torchao 0.10: its float8 layers are not the ones the lesson's claims were read from."""
    import importlib.metadata
    from gpulab.training import fp8
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.10.0" if name == "torchao" else real(name))
    with pytest.raises(ValueError, match=r"torchao >= 0\.18.*this has torchao 0\.10: pip install -U 'torchao>=0\.18'") as e:
        _linear_step("fake", "rowwise")
    assert "\n" not in str(e.value)
    assert fp8._torchao_version() == (0, 10)


def test_a_model_without_a_convertible_linear_layer_is_refused():
    with pytest.raises(ValueError, match="has none"):
        gpulab.step(nn.Sequential(nn.Linear(10, 3)), input_shape=(10,), batch=2, engine="fake", fp8="tensorwise")


def test_cli_refuses_an_unknown_recipe_in_one_line(capsys):
    code, out, err = run_main(["step", "hf:tiny-llama", "--fp8", "blockwise"], capsys)
    assert code == 2 and err.count("\n") == 1 and "gpulab:" in err and "tensorwise, rowwise" in err


def test_cli_step_with_fp8_shows_the_recipe(capsys):
    code, out, err = run_main(["step", "hf:tiny-llama", "--engine", "fake", "--batch", "1", "--dtype", "bf16",
                            "--fp8", "rowwise", "--json"], capsys)
    import json
    assert code == 0, err
    assert json.loads(out)["recipe"]["fp8"] == "rowwise"


@pytest.mark.parametrize("gpu,recipe,cc", [("T4", "tensorwise", "7.5"), ("A100-40GB", "rowwise", "8.0"),
                                           ("V100-16GB", "tensorwise", "7.0")])
def test_fp8_on_a_card_without_float8_matmuls_is_refused(gpu, recipe, cc):
    """Issue 44 item 6: a T4 (sm75) and an A100 (sm80) answered with a batch, where torch._scaled_mm
    needs compute capability 8.9 or 9.0+; now refused before any run, naming the card, its capability
    and what to do. Cards that have it, sizes and AMP cards are taken."""
    from gpulab.predict.cards import check_fp8_card
    with pytest.raises(ValueError, match=rf"fp8 '{recipe}' on {gpu}: its compute capability {cc} .*leave out fp8"):
        check_fp8_card(gpu, recipe)
    with pytest.raises(ValueError, match=rf"on {gpu}: its compute capability {cc}"):
        gpulab.fit("hf:tiny-llama", gpu, fp8=recipe, seq_len=32)
    for able in ("H100", "L4", "RTX 4090", "B200", "24GiB", "MI300X"):
        check_fp8_card(able, recipe)
    check_fp8_card("T4", None)
