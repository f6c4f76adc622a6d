"""gpulab.course.kv_cache and .serving (lesson 11, part 2) against independent references: the configs' own
fields, the published parameter count, the caches a real ``generate()`` and a fake-tensor
prefill hold, peft's own count of trainable parameters, and a model's layers counted directly."""
from __future__ import annotations

import resource

import pytest
import torch
from torch import nn

from gpulab import formulas as F
from gpulab.models import hf_configs
from gpulab.predict.cards import CUDA_CONTEXT_ASSUMED, parse_gpu
from gpulab.course import kv_cache as K
from gpulab.course import serving as S
from gpulab.course import lora as KL
from gpulab.measure.engines import LABEL_CPU, LABEL_FAKE_CUDA, LABEL_FORMULA
from gpulab.units import GiB, MiB

# --- the formula ---------------------------------------------------------------------------------

def test_llama_2_7b_fp16_at_4096_tokens_is_exactly_2_gib_and_llama_3_8b_512_mib():
    assert K.kv_cache_for("llama-2-7b", 4096, 1, "float16").bytes == 2 * GiB
    r = K.kv_cache_for("hf:llama-3-8b", 4096, 1, "fp16")
    assert r.bytes == 512 * MiB and r.kv_heads == 8 and r.head_dim == 128 and r.label == LABEL_FORMULA
    # from the config's own fields, not through gpulab
    c = hf_configs.make_config("llama-3-8b")
    assert r.bytes == 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) \
        * 4096 * 2
    assert r.per_token_bytes * 4096 == r.bytes and K.kv_cache_for("llama-3-8b", 4096, 3).bytes == 3 * r.bytes
    assert "8 KV heads" in r.formula and r.as_dict()["bytes"] == r.bytes and "formula" in r._repr_html_()


def test_head_dim_is_read_off_any_config():
    assert K.attention_shape("gpt2")["head_dim"] == 768 // 12            # GPT2Config has no head_dim
    q = K.attention_shape("qwen2.5-0.5b")
    assert (q["head_dim"], q["kv_heads"], q["sliding_window"]) == (896 // 14, 2, None)
    cfg = hf_configs.make_config("tiny-llama")
    assert K.kv_cache_for(cfg, 10).bytes == K.kv_cache_bytes(2, 2, 16, 10, 1, 2)   # a config object works too
    m = K.kv_cache_for("mistral-7b", 8192, dtype="bf16")
    assert m.sliding_window == 4096 and m.windowed_bytes == K.kv_cache_for("mistral-7b", 4096, dtype="bf16").bytes


def test_attention_variants_mha_gqa_mqa():
    v = K.attention_variants("llama-3-8b", 8192, 1, "bf16")
    mha, gqa, mqa = v.rows
    assert (mha.kv_heads, gqa.kv_heads, mqa.kv_heads) == (32, 8, 1)
    assert mha.bytes == 4 * gqa.bytes == 32 * mqa.bytes and gqa.bytes == GiB
    assert gqa.fraction_of_mha == 0.25 and v.as_dict()["rows"][1]["variant"].startswith("grouped-query")
    assert K.attention_variants("llama-2-7b", 16).rows[1].variant == "this config (multi-head)"
    assert "multi-query" in v._repr_html_()


@pytest.mark.parametrize("kw", [{"layers": -1}, {"seq_len": 1.5}, {"batch": True}])
def test_kv_cache_bytes_refuses_bad_numbers(kw):
    args = {"layers": 2, "kv_heads": 2, "head_dim": 16, "seq_len": 8, "batch": 1, "dtype_bytes": 4} | kw
    with pytest.raises(ValueError):
        K.kv_cache_bytes(**args)


# --- measured ------------------------------------------------------------------------------------

def test_generate_cache_equals_the_formula_after_every_token(capfd, recwarn):
    r = K.measured_kv_cache("tiny-llama", prompt_len=8, new_tokens=16)
    assert [row.tokens for row in r.rows] == list(range(8, 24))            # prefill, then 15 decode forwards
    assert all(row.cache_seq_length == row.tokens for row in r.rows)
    assert all(row.measured_bytes == row.formula_bytes for row in r.rows) and r.all_equal
    assert r.rows[0].measured_bytes == 2 * 2 * 2 * 16 * 8 * 4            # 2 layers, 2 KV heads, head dim 16, fp32
    assert r.output_len == 24 and r.label == LABEL_CPU and r.engine == "cpu"
    # the whole generate(): weights, the last cache and the step's working set were alive at once
    assert r.peak_bytes >= r.weights_bytes + r.final_cache_bytes
    assert r.peak_by_category["parameters"] == sum(p.numel() * 4 for p in
                                                   hf_configs.build_causal_lm("tiny-llama").parameters())
    out = capfd.readouterr()
    assert "warn" not in (out.out + out.err).lower() and not [w for w in recwarn if "generat" in str(w.message)]
    assert r.as_dict()["all_equal"] and "equal" in r._repr_html_()


def test_generate_cache_of_gpt2_style_batch_of_three():
    r = K.measured_kv_cache("tiny-gpt2", prompt_len=5, new_tokens=4, batch=3)
    assert r.all_equal and len(r.rows) == 4 and r.rows[-1].formula_bytes == 2 * 2 * 4 * 16 * 8 * 3 * 4


def test_fake_prefill_of_llama_3_8b_holds_the_formula_exactly():
    r = K.fake_kv_cache("hf:llama-3-8b", seq_len=512)
    assert r.measured_bytes == r.formula_bytes == 64 * MiB and r.equal
    assert r.layer_shapes == [(1, 8, 512, 128)] * 32
    assert r.label == LABEL_FAKE_CUDA and r.peak_bytes > r.weights_bytes > 16 * 10**9
    # fake tensors: no weights, no compute. The process never held the 16 GB of weights it measured
    # (its own peak resident memory, not a clock: a wall-time limit fails on a busy machine; the
    # times are benchmarks/fit_speed.py's)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 < r.weights_bytes


def test_decode_step_estimate_against_a_fake_decode_step():
    d = S.fake_decode_step("hf:llama-3-8b", context_len=8192, batch=1)
    assert d.cache_growth_bytes == K.kv_cache_for("llama-3-8b", 1, dtype="bf16").bytes   # one token more
    assert d.estimate["estimate"] == d.estimate["cache_append"] == 8 * 128 * 8192 * 2   # one layer's keys again
    assert abs(d.working_set_bytes - d.estimate["estimate"]) / d.working_set_bytes < 0.05
    assert "self_attn" in d.peak_module and d.as_dict()["estimate_label"] == S.LABEL_ESTIMATE


# --- does it fit? ----------------------------------------------------------------------------------

def test_llama_3_8b_on_a_24_gib_card_at_8k():
    fit = S.inference_fit("llama-3-8b", "24GiB", 8192, batch=1)
    published = hf_configs.hf_entry("llama-3-8b").published_params
    assert fit.params == published and fit.weights_bytes == 2 * published
    assert fit.kv_cache_bytes == GiB
    assert fit.usable_bytes == parse_gpu("24GiB").memory_bytes - CUDA_CONTEXT_ASSUMED
    assert fit.total_bytes == fit.weights_bytes + fit.kv_cache_bytes + fit.activation_bytes
    assert fit.fits and fit.margin_bytes == fit.usable_bytes - fit.total_bytes and "to spare" in fit.verdict
    assert fit.activation_label == S.LABEL_ESTIMATE and fit.as_dict()["labels"]["weights"] == LABEL_FORMULA
    assert not S.inference_fit("llama-3-8b", "24GiB", 8192, batch=32).fits
    assert "margin" in fit._repr_html_()


def test_max_context_is_the_last_token_that_fits():
    for batch in (1, 8):
        mc = S.max_context("llama-3-8b", "RTX 4090", batch=batch)
        assert mc.fit.fits and not S.inference_fit("llama-3-8b", "RTX 4090", mc.tokens + 1, batch).fits
    assert S.max_context("llama-3-8b", "24GiB").limited_by == "the model's position limit"
    assert S.max_context("llama-3-8b", "24GiB").usable_tokens == 8192
    assert S.max_context("llama-3-8b", "24GiB", batch=16).limited_by == "memory"
    none = S.max_context("llama-3-8b", "8GiB")
    assert none.tokens == 0 and none.fit is None and "weights" in none.limited_by


# --- LoRA ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lora_cpu():
    return KL.lora_step("tiny-llama", rank=8, targets=("q_proj", "v_proj"), batch=2, seq_len=32, engine="cpu")


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")   # peft on transformers 5
def test_adapter_formula_equals_peft_count():
    import peft
    model = peft.get_peft_model(hf_configs.build_causal_lm("tiny-llama"), peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # q_proj 64 -> 64 and v_proj 64 -> 32 (2 KV heads of 16) in each of 2 layers
    assert trainable == KL.adapter_params_formula("tiny-llama", 8) == 2 * (F.lora_params(64, 64, 8)
                                                                          + F.lora_params(64, 32, 8))
    gpt2 = KL.lora_model_builder("tiny-gpt2", 4, ("c_attn",))()    # GPT-2's Conv1D
    assert KL.trainable_params(gpt2) == KL.adapter_params_formula("tiny-gpt2", 4, ("c_attn",)) == 2 * 4 * (64 + 192)


def test_lora_trains_the_adapters_only_on_the_cpu_engine(lora_cpu):
    r = lora_cpu
    base = sum(p.numel() for p in hf_configs.build_causal_lm("tiny-llama").parameters())
    assert r.base_params == base and r.trainable_params_peft == r.adapter_params == 3584 and r.adapter_tensors == 8
    for cat in ("parameters", "gradients", "optimizer_state", "inputs"):
        row = r.row(cat)
        assert (row.lora, row.full) == (row.lora_formula, row.full_formula), cat
    assert r.row("gradients").lora == 4 * r.adapter_params
    assert r.row("optimizer_state").lora == 8 * r.adapter_params + 4 * r.adapter_tensors   # Adam + step counters
    assert r.row("parameters").lora == r.row("parameters").full + 4 * r.adapter_params     # frozen base stays
    assert r.row("gradients").full == 4 * base
    assert 0 < r.row("activations").lora < r.row("activations").full                      # frozen layers save less
    assert r.label == LABEL_CPU and r.full.label == LABEL_CPU and r.lora.peak_bytes < r.full.peak_bytes
    d = r.as_dict()
    assert d["adapter_params"] == 3584 and len(d["rows"]) == 7 and "LoRA" in r._repr_html_()


def test_peft_needs_the_meta_skeleton_under_fake_tensors_and_lora_runs_on_the_fake_engine():
    check = KL.peft_on_fake("tiny-llama", 8)
    # Module._apply swaps FakeTensor parameters, and swap_tensors refuses tensors with weak references
    assert not check["native"] and "swap" in check["native_error"]
    assert check["via_skeleton"] and check["trainable_params"] == 3584
    r = KL.lora_step("tiny-llama", engine="fake")
    for cat in ("parameters", "gradients", "optimizer_state"):
        row = r.row(cat)
        assert (row.lora, row.full) == (row.lora_formula, row.full_formula), cat
    assert r.row("optimizer_state").lora == 8 * r.adapter_params   # CUDA keeps step counters on the host
    assert r.label == LABEL_FAKE_CUDA


def test_qlora_formula_counts_the_linear_weights_as_nf4():
    q = KL.qlora_formula("llama-3-8b", rank=8)
    with torch.device("meta"):
        model = hf_configs.build_causal_lm("llama-3-8b")
    proj = [m.weight.numel() for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    assert q.quantized_params == sum(proj) and q.quantized_bytes == sum(F.nf4_weight_bytes(n) for n in proj)
    assert q.kept_params == q.base_params - sum(proj) == 2 * 128256 * 4096 + 65 * 4096   # embed, lm_head, norms
    assert q.adapter_params == KL.adapter_params_formula("llama-3-8b", 8) and q.adapter_bytes == 4 * q.adapter_params
    assert q.optimizer_bytes == 2 * q.adapter_bytes and q.label == KL.LABEL_QLORA
    assert q.total_bytes < q.plain_lora_total_bytes / 2 and "NF4" in q._repr_html_()


@pytest.mark.parametrize("call, words", [
    (lambda: K.kv_cache_for("llama-9", 16), ["unknown transformer config", "llama-3-8b"]),
    (lambda: K.measured_kv_cache("tiny-llama", prompt_len=250, new_tokens=16), ["longer than", "256"]),
    (lambda: KL.adapter_params_formula("tiny-llama", 8, ("w_proj",)), ["no linear layer", "w_proj"]),
    (lambda: KL.lora_step("tiny-llama", targets="q_proj"), ["targets must be"]),
    (lambda: S.inference_fit("llama-3-8b", "H1000", 16), ["cannot read", "H100"]),
    (lambda: S.max_context("llama-3-8b", "H100", batch=0), ["batch must be a positive integer"]),
])
def test_bad_input_says_what_to_do(call, words):
    with pytest.raises(ValueError) as e:
        call()
    assert all(w in str(e.value) for w in words)
