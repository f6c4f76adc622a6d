"""gpulab.course.transformer_params, .transformer_memory and .transformer_activations (lesson 11,
part 1) against independent references: numel() of the models transformers builds, the published
parameter counts, optimizer state after real and fake training steps, and what autograd saved per
layer in a full GPT-2 / Llama forward."""
from __future__ import annotations

import copy

import pytest
import torch

from gpulab import formulas as F
from gpulab.models import hf_configs
from gpulab.course import transformer_activations as ta
from gpulab.course import transformer_memory as tm
from gpulab.course import transformer_params as tp
from gpulab.measure.fake_cuda import cuda_sdpa_backend
from gpulab.measure.engines import LABEL_CPU, LABEL_FAKE_CUDA, LABEL_FORMULA

NAMES = ["gpt2", "gpt2-medium", "llama-3-8b", "llama-2-7b", "mistral-7b", "qwen2.5-0.5b", "tiny-gpt2", "tiny-llama"]


# --- 1. parameters ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_param_formula_equals_numel_of_the_model_transformers_builds(name):
    with torch.device("meta"):
        model = hf_configs.build_causal_lm(hf_configs.make_config(name))
    b = tp.param_formula(name)
    assert b.total == sum(p.numel() for p in model.parameters())
    assert b.label == LABEL_FORMULA
    assert b.total == b.embedding + b.position + b.layers * b.per_layer + b.final_norm + b.lm_head


def test_param_formula_matches_the_published_counts():
    assert tp.param_formula("gpt2").total == 124_439_808
    assert tp.param_formula("llama-3-8b").total == 8_030_261_248
    assert tp.param_formula("mistral-7b").total == 7_241_732_096
    for name in NAMES:   # and every published count of the built-in table
        published = hf_configs.hf_entry(name).published_params
        if published is not None:
            assert tp.param_formula(name).total == published, name


def test_param_formula_parts_per_family():
    g, ll = tp.param_formula("gpt2"), tp.param_formula("llama-3-8b")
    assert g.position == 1024 * 768 and ll.position == 0              # learned positions vs RoPE
    assert g.lm_head == 0 and ll.lm_head == 4096 * 128256              # tied vs untied
    assert g.per_layer_norms == 2 * 2 * 768 and ll.per_layer_norms == 2 * 4096   # LayerNorm vs RMSNorm
    with torch.device("meta"):
        layer = hf_configs.build_causal_lm("llama-3-8b").model.layers[0]
    assert ll.per_layer_attention == sum(p.numel() for p in layer.self_attn.parameters())
    assert ll.per_layer_mlp == sum(p.numel() for p in layer.mlp.parameters())
    assert ll.per_layer == sum(p.numel() for p in layer.parameters())


def test_param_formula_follows_config_switches():
    """Qwen2's q/k/v biases, Llama's attention_bias / mlp_bias, GPT-2's n_inner."""
    for name, changes in [("tiny-llama", {"attention_bias": True, "mlp_bias": True}), ("tiny-gpt2", {"n_inner": 100}),
                          ("tiny-llama", {"tie_word_embeddings": True, "head_dim": 32})]:
        cfg = hf_configs.make_config(name)
        for k, v in changes.items():
            setattr(cfg, k, v)
        with torch.device("meta"):
            model = hf_configs.build_causal_lm(cfg)
        assert tp.param_formula(cfg).total == sum(p.numel() for p in model.parameters()), (name, changes)


def test_unsupported_family_is_refused_with_the_supported_ones_named():
    import transformers
    with pytest.raises(ValueError, match="supported model types are gpt2, llama, mistral, qwen2"):
        tp.param_formula(transformers.BertConfig())


def test_exercise_layer_params_expects_one_layers_numel():
    ex = tp.exercise_layer_params("llama-3-8b")
    with torch.device("meta"):
        layer = hf_configs.build_causal_lm("llama-3-8b").model.layers[0]
    truth = sum(p.numel() for p in layer.parameters())
    assert "Llama" in ex.question or "llama" in ex.question
    assert ex.expected() == truth
    assert ex.check(truth).ok and not ex.check(truth * 2).ok and not ex.check(...).ok


# --- 2. bytes per parameter ----------------------------------------------------------------------------

def test_bytes_per_param_table():
    n = 8_030_261_248
    rows = {r.recipe: r for r in tm.bytes_per_param_table(n)}
    assert set(rows) == set(tm.RECIPES)
    got = {k: (r.weights, r.gradients, r.optimizer_state, r.master_weights, r.total) for k, r in rows.items()}
    assert got["fp32"] == (4, 4, 8, 0, 16)
    assert got["zero-mixed"] == (2, 2, 8, 4, 16)                 # 2 + 2 + 12 (master + two moments)
    assert got["autocast"] == (4, 4, 8, 0, 16)
    assert got["pure-bf16"] == (2, 2, 4, 0, 8)
    assert got["bf16-fp32-adam"] == (2, 2, 8, 0, 12)
    eight = F.eight_bit_optimizer_state_bytes(n, 2) / n
    assert got["adam-8bit"] == (2, 2, eight, 0, 4 + eight)
    assert all(r.label == LABEL_FORMULA and r.source for r in rows.values())
    assert "16-bit copies" in rows["autocast"].note


@pytest.mark.parametrize("key,sizes", [("fp32", (4, 4, 8)), ("pure-bf16", (2, 2, 4))])
def test_measured_bytes_per_param_cpu_equals_the_formula_exactly(key, sizes):
    row = tm.measured_bytes_per_param("tiny-llama", key, engine="cpu", seq_len=32)
    n, tensors = tp.counted_params("tiny-llama")
    assert row.label == LABEL_CPU and row.formula.label == LABEL_FORMULA
    w, g, s = sizes
    # the CPU keeps Adam's step counters with the state: one float32 scalar per parameter tensor
    assert row.step_counter_bytes == 4 * tensors
    assert (row.weight_bytes, row.gradient_bytes, row.optimizer_state_bytes) == (w * n, g * n, s * n + 4 * tensors)
    assert (row.weights, row.gradients, row.optimizer_state) == (w, g, (s * n + 4 * tensors) / n)
    assert (row.weight_bytes, row.gradient_bytes, row.optimizer_state_bytes) == \
        (row.formula.weight_bytes, row.formula.gradient_bytes, row.formula.optimizer_state_bytes)
    assert row.formula.optimizer_state_bytes == F.optimizer_state_bytes(n * s // 2, tensors, "adam", True)


def test_measured_bytes_per_param_fake_llama3_8b_pure_bf16_adamw():
    """On the fake engine's CUDA target the step counters are host memory: exactly 2, 2, 4."""
    row = tm.measured_bytes_per_param("llama-3-8b", "pure-bf16", engine="fake", seq_len=128, batch=1,
                                      optimizer="adamw")
    assert row.label == LABEL_FAKE_CUDA
    assert row.n_params == 8_030_261_248
    assert (row.weights, row.gradients, row.optimizer_state, row.total) == (2, 2, 4, 8)
    assert row.step_counter_bytes == 0 and row.formula.optimizer_state_bytes == row.optimizer_state_bytes


def test_recipes_gpulab_step_cannot_run_say_why():
    for key in ("zero-mixed", "bf16-fp32-adam", "adam-8bit"):
        with pytest.raises(ValueError, match="cannot measure"):
            tm.measured_bytes_per_param("tiny-llama", key)
    with pytest.raises(ValueError, match="valid: fp32"):
        tm.recipe("fp64")


# --- 3. activations per layer ------------------------------------------------------------------------

def test_korthikanti_formula_and_terms():
    s, b, h, a = 2048, 1, 12288, 96          # GPT-3 175B's layer, the paper's Table 2 shape
    assert ta.korthikanti_bytes(s, b, h, a) * h == s * b * h * (34 * h + 5 * a * s)
    assert ta.korthikanti_bytes(s, b, h, a, quadratic=False) == 34 * s * b * h
    terms = ta.korthikanti_terms(s, b, h, a)
    assert sum(t.bytes for t in terms) == ta.korthikanti_bytes(s, b, h, a)
    assert sum(t.bytes for t in terms if t.kind == "scores") == 5 * a * s * s * b
    blocks = {blk: sum(t.bytes for t in terms if t.block == blk) for blk in ("attention", "mlp", "layernorm")}
    assert blocks == {"attention": 11 * s * b * h + 5 * a * s * s * b, "mlp": 19 * s * b * h, "layernorm": 4 * s * b * h}
    with pytest.raises(ValueError):
        ta.korthikanti_bytes(0, 1, 8, 2)


def test_cuda_sdpa_backend_choice():
    q = torch.empty(1, 12, 128, 64, dtype=torch.bfloat16, device="meta")
    k8 = torch.empty(1, 4, 128, 64, dtype=torch.bfloat16, device="meta")
    assert cuda_sdpa_backend(q, q, q, None, True) == "flash"
    assert cuda_sdpa_backend(q, k8, k8, None, True) == "flash"          # grouped-query k/v
    assert cuda_sdpa_backend(q.float(), q.float(), q.float()) == "efficient"   # no fp32 flash
    mask = torch.empty(1, 1, 128, 128, dtype=torch.bool, device="meta")
    assert cuda_sdpa_backend(q, q, q, mask) == "efficient"               # flash takes no mask
    odd = torch.empty(1, 12, 128, 300, dtype=torch.bfloat16, device="meta")
    assert cuda_sdpa_backend(odd, odd, odd) == "math"


@pytest.fixture(scope="module")
def gpt2_sweep():
    return ta.activation_vs_seq("gpt2", (128, 256))


def _gelu_new_extra(s, b, inner, value_bytes=2):
    """NewGELUActivation's element-wise ops save tanh(.), 0.5*x and 1 + tanh(.): 3 tensors of s*b*inner."""
    return 3 * s * b * inner * value_bytes


def _layernorm_stats(s, b, stat_bytes=2):
    """Two LayerNorms per layer, each saving a mean and a 1/std per token (bf16 on fake CPU tensors)."""
    return 2 * 2 * s * b * stat_bytes


def test_gpt2_eager_is_the_formula_plus_what_gpt2_saves_beyond_it(gpt2_sweep):
    run = next(r for r in gpt2_sweep.runs if r.attn_implementation == "eager" and r.seq_len == 128)
    s, b, h = 128, 1, 768
    assert run.label == LABEL_FAKE_CUDA and run.attention_kernel == "eager"
    assert len(set(run.per_layer_bytes)) == 1 and run.n_layers == 12       # every layer the same
    assert run.formula_bytes == ta.korthikanti_bytes(s, b, h, 12)
    # exact to the byte: Korthikanti's 34sbh + 5as^2b, gelu_new's three extra tensors, LayerNorm stats
    assert run.bytes_per_layer == run.formula_bytes + _gelu_new_extra(s, b, 4 * h) + _layernorm_stats(s, b)
    assert not [d for d in run.differences if d.bytes < 0]                 # GPT-2 has every term (dropout on)
    assert sum(d.bytes for d in run.differences) == run.bytes_per_layer - run.formula_bytes
    mlp = next(d for d in run.differences if d.where == "mlp")
    assert mlp.bytes == _gelu_new_extra(s, b, 4 * h) and "tanh" in mlp.why
    assert run.error_percent == pytest.approx(100 * (run.formula_bytes - run.bytes_per_layer) / run.bytes_per_layer)


def test_gpt2_with_a_one_kernel_gelu_is_within_0_1_percent_of_the_formula():
    """The tolerance (docstring of measured_layer_activations): with GELU as one kernel only the
    LayerNorm statistics are beyond the formula, 16 B per token at most against 34*h."""
    cfg = hf_configs.make_config("gpt2", use_cache=False)   # the formula models no KV cache
    cfg.activation_function = "gelu_pytorch_tanh"
    run = ta.measured_layer_activations(cfg, 128, 1, "eager")
    assert run.bytes_per_layer - run.formula_bytes == _layernorm_stats(128, 1)
    assert abs(run.error_percent) < 0.1
    assert 100 * _layernorm_stats(128, 1, stat_bytes=4) / run.formula_bytes < 0.1   # fp32 stats on a GPU too


def test_gpt2_sdpa_runs_flash_and_keeps_no_scores(gpt2_sweep):
    for s in (128, 256):
        run = next(r for r in gpt2_sweep.runs if r.attn_implementation == "sdpa" and r.seq_len == s)
        assert run.attention_kernel == "flash"
        assert run.formula_bytes == ta.korthikanti_bytes(s, 1, 768, 12, quadratic=False)
        logsumexp = 4 * 1 * 12 * s                                       # float32 per query row
        assert run.bytes_per_layer == (run.formula_bytes + _gelu_new_extra(s, 1, 4 * 768) + _layernorm_stats(s, 1)
                                       + logsumexp)
        assert run.rng_bytes_per_layer == 2 * 8 + 8   # flash_api.cpp mha_fwd: uint64 rng_state[2] and unused[], on the GPU


def test_the_quadratic_term_shows_eager_minus_sdpa_grows_with_s_squared(gpt2_sweep):
    r1, r2 = gpt2_sweep.rows
    assert (r1.seq_len, r2.seq_len) == (128, 256)
    ratio = r2.scores_measured / r1.scores_measured
    assert ratio == pytest.approx(4, rel=0.05)
    assert r2.scores_formula == 4 * r1.scores_formula
    assert r1.label == LABEL_FAKE_CUDA and r1.formula_label == LABEL_FORMULA


def test_tiny_llama_cpu_has_no_dropout_terms():
    run = ta.measured_layer_activations("tiny-llama", 64, 2, "eager", engine="cpu")
    assert run.label == LABEL_CPU and run.n_layers == 2 and len(set(run.per_layer_bytes)) == 1
    absent = {d.what for d in run.differences if d.label == LABEL_FORMULA}
    assert absent == {"softmax dropout mask", "dropped probabilities (input of ·V)", "attention dropout mask",
                      "MLP dropout mask"}
    assert sum(d.bytes for d in run.differences) == run.bytes_per_layer - run.formula_bytes
    # what was saved is exactly what the tracker recorded in the layers' forward
    recs = [r for r in run.measurement.tracking.records.values()
            if r.category.value == "activations" and r.phase == "forward" and ".layers." in r.module]
    assert sum(r.nbytes for r in recs) == sum(run.per_layer_bytes)


def test_tiny_gpt2_cpu_eager_and_sdpa():
    eager = ta.measured_layer_activations("tiny-gpt2", 64, 1, "eager", torch.float32, engine="cpu")
    assert not [d for d in eager.differences if d.bytes < 0]               # dropout on: every term exists
    sdpa = ta.measured_layer_activations("tiny-gpt2", 64, 1, "sdpa", torch.float32, engine="cpu")
    # on the CPU, SDPA with dropout falls back to the math composite: the scores are stored
    assert sdpa.attention_kernel == "math" and sdpa.formula_bytes == sdpa.formula_full_bytes
    assert eager.as_dict()["bytes_per_layer"] == eager.bytes_per_layer


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="eager, sdpa"):
        ta.measured_layer_activations("tiny-gpt2", 16, 1, "flash")
    with pytest.raises(ValueError, match="longer than"):
        ta.measured_layer_activations("tiny-gpt2", 4096, 1, "eager", engine="cpu")
    with pytest.raises(ValueError):
        ta.activation_vs_seq("tiny-gpt2", ())


def test_config_is_not_changed():
    cfg = hf_configs.make_config("tiny-gpt2")
    before = copy.deepcopy(cfg.to_dict())
    ta.measured_layer_activations(cfg, 16, 1, "eager", engine="cpu")
    assert cfg.to_dict() == before
