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


def _storages(module) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    return sorted((t.dtype, tuple(t.shape)) for t in [*module.parameters(), *module.buffers()])


@pytest.mark.parametrize("shape", [(4096, 4096), (100, 300), (11008, 4096)])
def test_nf4_and_int8_store_what_bitsandbytes_stores(shape):
    bnb = pytest.importorskip("bitsandbytes")
    n_in, n_out = shape
    ref = bnb.nn.Linear4bit(n_in, n_out, bias=False, compute_dtype=torch.bfloat16, compress_statistics=True,
                            quant_type="nf4")
    ref.weight = ref.weight._quantize("cpu")
    qs = ref.weight.quant_state
    ours = QuantizedLinear(torch.nn.Linear(n_in, n_out, bias=False), "nf4")
    assert (ours.weight.dtype, ours.weight.shape) == (ref.weight.dtype, ref.weight.shape)
    assert (ours.absmax.dtype, ours.absmax.shape) == (qs.absmax.dtype, qs.absmax.shape)
    assert (ours.absmax2.dtype, ours.absmax2.shape) == (qs.state2.absmax.dtype, qs.state2.absmax.shape)
    stored = sum(t.numel() * t.element_size() for t in (ref.weight, qs.absmax, qs.state2.absmax, qs.offset))
    assert quantized_weight_bytes(n_in * n_out, "nf4") == stored
    ref8 = bnb.nn.Linear8bitLt(n_in, n_out, bias=False, has_fp16_weights=False).to("cpu")
    ours8 = QuantizedLinear(torch.nn.Linear(n_in, n_out, bias=False), "int8")
    assert (ours8.weight.dtype, ours8.weight.shape) == (ref8.weight.dtype, ref8.weight.shape)
    assert (ours8.scb.dtype, ours8.scb.shape) == (ref8.weight.SCB.dtype, ref8.weight.SCB.shape)


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


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_the_cpu_and_fake_engines_agree_on_a_quantized_base(kind):
    # every training step alike; the setup differs by design: real tensors are built in full
    # precision, then quantized (models.adapt.quantized_build), fake ones built quantized
    cpu, fake = _bert("cpu", quantize=kind), _bert("fake", quantize=kind)
    assert cpu.step_peaks == fake.step_peaks
    assert cpu.measurement.tracking.peak_phase == "setup" != fake.measurement.tracking.peak_phase
    assert cpu.recipe == {"lora": 4, "quantize": kind}


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
    ({"quantize": "fp8", "lora": 4}, ["quantize", "nf4", "int8"]),
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
