"""Weight-only quantized linear layers (``gpulab.models.quantized``) and the recipe's ``quantize``:
bitsandbytes' storage layout checked against bitsandbytes itself (it quantizes on the CPU too),
the cpu and fake engines agreeing, QLoRA through ``gpulab.step``, and generation with int8 / NF4
weights."""
from __future__ import annotations

import pytest
import torch

import gpulab
from gpulab import cli
from gpulab.categories import Category
from gpulab.models.quantized import QuantizedLinear, quantize_linears, quantized_weight_bytes
from gpulab.predict.generation import generation_peak


def _storages(module) -> list[tuple[str, tuple[int, ...]]]:
    return sorted((str(t.dtype), tuple(t.shape)) for t in [*module.parameters(), *module.buffers()])


def _bnb_4bit(n_in: int, n_out: int, quant_type: str, double_quant: bool):
    """bitsandbytes' own Linear4bit, quantized on the CPU: the weight and every tensor of its
    QuantState (and of the nested state2 with double quantization)."""
    bnb = pytest.importorskip("bitsandbytes")
    ref = bnb.nn.Linear4bit(n_in, n_out, bias=False, compress_statistics=double_quant, quant_type=quant_type)
    ref.weight = ref.weight._quantize("cpu")
    qs = ref.weight.quant_state
    held = [ref.weight.data, qs.absmax, qs.code]
    if double_quant:
        held += [qs.offset, qs.state2.absmax, qs.state2.code]
    assert (qs.quant_type, qs.blocksize, qs.nested) == (quant_type, 64, double_quant)
    return held


def _from_bnb_source(n: int, double_quant: bool) -> int:
    """Bytes per layer as bitsandbytes 0.50.2's functional.quantize_4bit makes them: the packed
    weight ((n + 1) // 2 uint8), get_4bit_type's 16 float32 values, and per block of 64 one float32
    absmax; with compress_statistics a uint8 absmax per block instead, quantize_blockwise's float32
    absmax per 256 blocks, its copy of the 256-value float32 dynamic map, and the float32 offset."""
    blocks = -(-n // 64)
    statistics = blocks + 4 * -(-blocks // 256) + 4 * 256 + 4 if double_quant else 4 * blocks
    return (n + 1) // 2 + 4 * 16 + statistics


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("shape", [(4096, 4096), (100, 300), (11008, 4096)])
def test_4bit_stores_what_bitsandbytes_stores(shape, quant_type, double_quant):
    n_in, n_out = shape
    theirs = _bnb_4bit(n_in, n_out, quant_type, double_quant)
    ours = QuantizedLinear(torch.nn.Linear(n_in, n_out, bias=False), quant_type, double_quant)
    assert _storages(ours) == sorted((str(t.dtype), tuple(t.shape)) for t in theirs)
    stored = sum(t.numel() * t.element_size() for t in theirs)
    assert quantized_weight_bytes(n_in * n_out, quant_type, double_quant) == stored == _from_bnb_source(
        n_in * n_out, double_quant)


def test_int8_stores_what_bitsandbytes_stores():
    bnb = pytest.importorskip("bitsandbytes")
    ref8 = bnb.nn.Linear8bitLt(100, 300, bias=False, has_fp16_weights=False).to("cpu")
    ours8 = QuantizedLinear(torch.nn.Linear(100, 300, bias=False), "int8")
    assert (ours8.weight.dtype, ours8.weight.shape) == (ref8.weight.dtype, ref8.weight.shape)
    assert (ours8.scb.dtype, ours8.scb.shape) == (ref8.weight.SCB.dtype, ref8.weight.SCB.shape)


def test_the_4bit_defaults_are_read_from_bitsandbytes_and_transformers():
    """What "bitsandbytes' defaults" means, read off the two libraries: Linear4bit (and
    Params4bit) default to FP4 with double quantization and no compute dtype (the input's);
    transformers' BitsAndBytesConfig to FP4 without double quantization, computing in float32."""
    import inspect
    bnb = pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig
    defaults = {k: v.default for k, v in inspect.signature(bnb.nn.Linear4bit.__init__).parameters.items()}
    assert (defaults["quant_type"], defaults["compress_statistics"], defaults["compute_dtype"]) == ("fp4", True, None)
    params = inspect.signature(bnb.nn.Params4bit.__new__).parameters
    assert (params["quant_type"].default, params["compress_statistics"].default, params["blocksize"].default) == \
        ("fp4", True, None)   # blocksize None: 64
    config = BitsAndBytesConfig(load_in_4bit=True)
    assert (config.bnb_4bit_quant_type, config.bnb_4bit_use_double_quant, config.bnb_4bit_compute_dtype) == \
        ("fp4", False, torch.float32)


def _layer_run(compute: str, double_quant: bool, n_in: int = 256, n_out: int = 384, tokens: int = 8):
    """One 4-bit layer's forward and backward on a bf16 input, tracked on the cpu engine: the
    (dtype, shape) of every storage each phase creates."""
    from gpulab.measure.engines import run
    from gpulab.models.quantized import COMPUTE_DTYPES

    def experiment(ctx):
        with ctx.phase("setup"):
            layer = QuantizedLinear(torch.nn.Linear(n_in, n_out, bias=False, dtype=torch.bfloat16), "fp4",
                                    double_quant, COMPUTE_DTYPES.get(compute))
            x = torch.zeros(tokens, n_in, dtype=torch.bfloat16, requires_grad=True)
        with ctx.phase("forward"):
            out = layer(x)
        with ctx.phase("backward"):
            out.backward(torch.ones_like(out))
    m = run(experiment, "cpu")
    made: dict[str, list] = {}
    for r in m.tracking.records.values():
        made.setdefault(r.phase, []).append((r.dtype, r.shape))
    return {k: sorted(v) for k, v in made.items()}


@pytest.mark.parametrize("double_quant", [True, False])
def test_the_compute_dtype_decides_the_dequantized_weights_dtype(double_quant):
    """Linear4bit.forward with a compute dtype: x.to(it), MatMul4Bit, the output .to(x's dtype).
    gemm_4bit's fallback dequantizes into the compute dtype (with double quantization its float32
    absmax, then the offset added: two float32 arrays per block); backward's dequantize_4bit writes
    the weight in the dtype it was quantized from, then .to the gradient's (the compute) dtype."""
    f32, bf16, w, blocks = "float32", "bfloat16", (384, 256), (384 * 256 // 64,)
    absmax = [(f32, blocks)] * 2 if double_quant else []
    own, fp32 = _layer_run("input", double_quant), _layer_run("fp32", double_quant)
    assert own["forward"] == sorted(absmax + [(bf16, w), (bf16, (8, 384))])
    assert fp32["forward"] == sorted(absmax + [(f32, (8, 256)), (f32, w), (f32, (8, 384)), (bf16, (8, 384))])
    in_backward = absmax[:1] + [(bf16, w)]
    assert sorted(set(in_backward) - set(own["backward"])) == []
    assert fp32["backward"].count((f32, w)) == 1 and fp32["backward"].count((bf16, w)) == 1
    assert own["backward"].count((f32, w)) == 0


def test_fp4_and_double_quantization_through_the_recipe_name_their_choices(capsys):
    """quantize="fp4" stores what nf4 stores (the same sizes); without double quantization the
    absmax is float32 per block. The parameters' and buffers' bytes of the quantized layers are
    quantized_weight_bytes per layer, and each answer names the choices."""
    from gpulab.models.quantized import QuantizedLinear as Q
    from gpulab.models.workload import resolve_workload
    from gpulab.training.loop import recipe_workload, user_recipe
    w = resolve_workload("hf:tiny-llama", None, seq_len=32)
    for kind, dq in (("nf4", True), ("fp4", True), ("fp4", False)):
        model = recipe_workload(w, user_recipe("adamw", lora=4, quantize=kind, double_quant=dq)).build(
            torch.device("meta"), torch.bfloat16)
        layers = [m for m in model.modules() if isinstance(m, Q)]
        held = sum(t.numel() * t.element_size() for m in layers for t in [m.weight, *m.buffers()])
        assert held == sum(quantized_weight_bytes(m.in_features * m.out_features, kind, dq) for m in layers)
    kw = dict(batch=2, seq_len=32, engine="fake", fake_target="cpu", guard=False, optimizer="adamw", lora=4, steps=1)
    nf4, fp4 = gpulab.step("hf:tiny-llama", quantize="nf4", **kw), gpulab.step("hf:tiny-llama", quantize="fp4", **kw)
    assert nf4.peak_by_category == fp4.peak_by_category
    plain = gpulab.step("hf:tiny-llama", quantize="fp4", double_quant=False, quant_compute_dtype="fp32", **kw)
    assert plain.recipe == {"lora": 4, "quantize": "fp4", "double_quant": False, "quant_compute_dtype": "fp32",
                            "lora_dtype": "fp32"}
    assert cli.main(["step", "hf:tiny-llama", "--seq-len", "32", "--batch", "1", "--engine", "fake", "--lora", "4",
                     "--quantize", "fp4", "--no-double-quant", "--quant-compute-dtype", "fp32"]) == 0
    assert "quantize=fp4, double_quant=False, quant_compute_dtype=fp32" in capsys.readouterr().out.splitlines()[0]


def test_the_head_stays_and_every_other_linear_is_quantized():
    from gpulab.models import hf_configs
    model = quantize_linears(hf_configs.build_causal_lm(hf_configs.make_config("tiny-llama")), "nf4")
    kinds = {type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert kinds == {"QuantizedLinear", "Linear"}
    assert type(model.get_output_embeddings()) is torch.nn.Linear


def _bert(engine: str, **kw):
    target = {"fake_target": "cpu"} if engine == "fake" else {}
    return gpulab.step("hf:bert-base-uncased", batch=2, seq_len=32, optimizer="adamw", engine=engine, guard=False,
                       lora=4, **target, **kw)


@pytest.mark.parametrize("kind", ["nf4", pytest.param("int8", marks=pytest.mark.extended)])   # int8: make test-extended (time)
def test_the_cpu_and_fake_engines_agree_on_a_quantized_base(kind):
    # every training step alike; the setup differs by design: real tensors are built in full
    # precision, then quantized (models.adapt.quantized_build), fake ones built quantized
    cpu, fake = _bert("cpu", quantize=kind), _bert("fake", quantize=kind)
    assert cpu.step_peaks == fake.step_peaks
    assert cpu.measurement.tracking.peak_phase == "setup" != fake.measurement.tracking.peak_phase
    named = {"double_quant": True, "quant_compute_dtype": "input"} if kind == "nf4" else {}
    assert cpu.recipe == {"lora": 4, "quantize": kind, "lora_dtype": "fp32", **named}   # the choices named


def test_qlora_holds_a_quarter_of_the_weights_and_int8_keeps_its_inputs():
    plain, nf4, int8 = _bert("fake"), _bert("fake", quantize="nf4"), _bert("fake", quantize="int8")
    p = Category.PARAMETERS.value
    # BERT-base: 85 M of its 110 M parameters are in the quantized linear layers (not embeddings)
    assert nf4.peak_by_category[p] < 0.45 * plain.peak_by_category[p]
    assert nf4.peak_by_category[p] < int8.peak_by_category[p] < 0.6 * plain.peak_by_category[p]
    acts = Category.ACTIVATIONS.value
    # MatMul4Bit saves only the packed weight; MatMul8bitLt keeps its input, as nn.Linear does
    assert int8.peak_by_category[acts] > nf4.peak_by_category[acts]


def test_an_8b_qlora_step_at_full_size_never_holds_the_bf16_weights():
    r = gpulab.step("hf:llama-3-8b", batch=1, seq_len=256, dtype="bf16", optimizer="adamw", engine="fake", lora=8,
                    quantize="nf4", use_cache=False)
    assert r.peak_bytes < 9 * 2 ** 30          # bf16 weights alone would be 15 GiB
    assert r.measurement.tracking.peak_phase != "setup"
    assert r.measurement.peak_by_category[Category.PARAMETERS.value] < 6 * 2 ** 30


@pytest.mark.parametrize("kw, words", [
    ({"quantize": "nf4"}, ["lora=RANK", "QLoRA"]),
    ({"quantize": "fp8", "lora": 4}, ["quantize", "nf4", "fp4", "int8"]),
    ({"quantize": "int8", "lora": 4, "double_quant": False}, ["double_quant", "4-bit", "fp4"]),
    ({"lora": 4, "quant_compute_dtype": "fp32"}, ["quant_compute_dtype", "4-bit"]),
    ({"quantize": "nf4", "lora": 4, "quant_compute_dtype": "fp64"}, ["quant_compute_dtype", "fp32", "input"]),
])
def test_bad_quantization_is_refused_with_what_to_do(kw, words):
    with pytest.raises(ValueError) as e:
        gpulab.step("hf:tiny-llama", batch=1, engine="fake", **kw)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_the_cli_takes_qlora(capsys):
    assert cli.main(["step", "hf:tiny-llama", "--seq-len", "32", "--batch", "1", "--engine", "fake", "--qlora"]) == 0
    assert "lora=8, quantize=nf4" in capsys.readouterr().out.splitlines()[0]


def test_generation_with_quantized_weights():
    full, int8, nf4 = (generation_peak("tiny-llama", prompt_len=8, new_tokens=4, dtype="float32", weights=w)
                       for w in (None, "int8", "nf4"))
    assert nf4.weights_bytes < int8.weights_bytes < full.weights_bytes
    assert nf4.cache_bytes == int8.cache_bytes == full.cache_bytes
    with pytest.raises(ValueError, match="weights must be one of"):
        generation_peak("tiny-llama", prompt_len=8, new_tokens=4, weights="int4")
