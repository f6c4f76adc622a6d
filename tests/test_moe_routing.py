"""MoE routing as a named assumption (``training.routing``): the fake engine against a real CPU
step of a tiny Mixtral with the same per-expert counts, balanced vs worst, Megatron's formula."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from gpulab.measure.engines import run
from gpulab.models.workload import resolve_workload
from gpulab.training.loop import LoopRecipe, train_experiment
from gpulab.training.routing import (Routing, activations_by_expert, counts_of_run, eager_expert_bytes, expert_rows, megatron_layer_bytes,
                                     parse_routing, ran_routed)

transformers = pytest.importorskip("transformers")

H, I, E, K, B, S = 32, 64, 4, 2, 2, 16   # hidden, expert intermediate, experts, top-k, batch, sequence
T = B * S                                # tokens per MoE layer call


def tiny_mixtral(implementation: str | None = None):
    cfg = transformers.MixtralConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=E, num_experts_per_tok=K,
                                     vocab_size=128, max_position_embeddings=64)
    if implementation:
        cfg._experts_implementation = implementation
    return cfg


def tiny_qwen3_moe(implementation: str | None = None):
    cfg = transformers.Qwen3MoeConfig(hidden_size=H, intermediate_size=2 * I, moe_intermediate_size=I,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      num_experts=E, num_experts_per_tok=K, decoder_sparse_step=1, mlp_only_layers=[],
                                      vocab_size=128, max_position_embeddings=64)
    if implementation:
        cfg._experts_implementation = implementation
    return cfg


def _step(w, routing, engine: str):
    return run(train_experiment(w, [B, B], torch.float32, LoopRecipe("adam", seed=0, routing=routing)), engine,
               fake_target="cpu")


def _expert_activations(m, layer: int = 0) -> dict[int, int]:
    """Saved activations filed under each expert's module in one MoE layer (the first step's)."""
    marks = m.value["step_marks"]
    return {e: n for (owner, e), n in activations_by_expert(m.tracking, marks[0], marks[1]).items()
            if owner.endswith(f"layers.{layer}.mlp.experts")}


def test_parse_routing():
    assert parse_routing(None) is None
    assert parse_routing("capacity:1.25") == Routing("capacity", capacity_factor=1.25)
    assert parse_routing("worst").kind == "worst"
    assert parse_routing([[1, 2], [3, 0]]).counts == ((1, 2), (3, 0))
    for bad in ("even", "capacity", "capacity:0", "capacity:x"):
        with pytest.raises(ValueError, match="routing"):
            parse_routing(bad)


def test_rows_per_expert():
    assert expert_rows(Routing(), 10, 2, 3) == [7, 7, 6]               # 20 rows, remainder spread
    assert expert_rows(Routing("worst"), 10, 2, 4) == [10, 10, 0, 0]
    assert expert_rows(parse_routing("capacity:1.25"), 10, 2, 4) == [7] * 4   # ceil(1.25 * 20 / 4)
    assert expert_rows(parse_routing("capacity:9"), 10, 2, 4) == [10] * 4     # at most every token once
    assert sum(expert_rows(Routing(), 1000, 8, 128)) == 8000


@pytest.mark.parametrize("make", [tiny_mixtral, tiny_qwen3_moe])
def test_fake_equals_real_cpu_step_with_the_routers_counts(make):
    """A real CPU step (eager experts, the router's random choice) and the fake engine told the same
    per-expert counts hold the same bytes: the peak and every category's peak, and at the end."""
    w = resolve_workload(make("eager"), None, batch=B, seq_len=S)
    box = {}

    def build(device, dtype):
        net = w.build(device, dtype)
        box["counts"], _ = counts_of_run(net)
        return net
    real = _step(dataclasses.replace(w, build=build), "router", "cpu")
    counts = box["counts"]
    assert len(counts) == 4 and all(sum(c) == T * K for c in counts)   # 2 layers x 2 steps
    assert len({tuple(c) for c in counts}) > 1                          # not all balanced: a real test
    for engine in ("cpu", "fake"):
        m = _step(w, Routing.exact(counts), engine)
        assert m.peak_bytes == real.peak_bytes, engine
        assert m.peak_by_category == real.peak_by_category, engine
        assert m.tracking.final_by_category == real.tracking.final_by_category, engine
    # each expert's saved activations, filed under it, are what the eager loop saves for its rows
    per_expert = _expert_activations(m)
    assert per_expert == {e: eager_expert_bytes(n, H, I, 4) - n * I * 4 for e, n in enumerate(counts[0]) if n}


def test_balanced_vs_worst():
    """Worst routing (every token to the same k experts) holds more in its busiest experts, by the
    eager loop's per-row bytes times the extra rows; the experts left idle hold nothing."""
    w = resolve_workload(tiny_mixtral(), None, batch=B, seq_len=S)
    bal, worst = _step(w, "balanced", "fake"), _step(w, "worst", "fake")
    b, wo = _expert_activations(bal), _expert_activations(worst)
    per_row = eager_expert_bytes(1, H, I, 4) - I * 4   # SiLU's own saved output aside (see below)
    assert b == {e: T * K // E * per_row for e in range(E)}
    assert wo == {e: T * per_row for e in range(K)}
    assert max(wo.values()) - max(b.values()) == (T - T * K // E) * per_row
    # the activation's output is saved too, filed under act_fn (a module of its own): I per row
    assert sum(wo.values()) == sum(b.values())   # the same rows in all: k per token
    # Yet the step's peak is lower under worst: in backward each expert the loop ran takes its weights'
    # gradient through select_backward (``gate_up_proj[e]``), a zero tensor the whole parameter's size
    # per expert, so the more experts are hit, the more of them (steps x MoE layers x hit experts).
    for m, hit in ((bal, E), (worst, K)):
        full = [r for r in m.tracking.records.values() if r.op == "select_backward" and r.shape == (E, 2 * I, H)]
        assert len(full) == 2 * 2 * hit
    assert bal.tracking.peak_phase == "backward" and worst.peak_bytes < bal.peak_bytes
    assert "worst" in Routing("worst").label


def test_capacity_pads_and_drops():
    w = resolve_workload(tiny_mixtral(), None, batch=B, seq_len=S)
    per_row = eager_expert_bytes(1, H, I, 4) - I * 4
    for factor, rows in ((1.5, 24), (0.5, 8)):   # ceil(F * 32 * 2 / 4)
        m = _step(w, f"capacity:{factor}", "fake")
        assert _expert_activations(m) == {e: rows * per_row for e in range(E)}


def test_step_labels_the_routing_and_non_moe_refuses():
    import gpulab
    r = gpulab.step(tiny_mixtral(), batch=B, seq_len=S, engine="fake", steps=1, routing="capacity:1.25")
    assert "capacity 1.25" in r.measurement.label and r.recipe["routing"] == "capacity:1.25"
    r = gpulab.step(tiny_mixtral("eager"), batch=B, seq_len=S, engine="fake", steps=1)   # none stated, eager: balanced
    assert "balanced" in r.measurement.label and r.recipe["routing"] == "balanced" and ran_routed(r.measurement.tracking)
    r = gpulab.step(tiny_mixtral(), batch=B, seq_len=S, engine="fake", steps=1)   # none stated, grouped_mm: no assumption
    assert "grouped_mm" in r.measurement.label and "needs no routing assumption" in r.measurement.label
    assert r.recipe["routing"] == "router" and not ran_routed(r.measurement.tracking)
    dense = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    with pytest.raises(ValueError, match="no routed experts") as exc:
        gpulab.step(dense, batch=B, seq_len=S, engine="fake", routing="worst")
    assert "\n" not in str(exc.value)
    r = gpulab.step(dense, batch=B, seq_len=S, engine="fake", steps=1)
    assert "routing" not in r.recipe and "routing" not in r.measurement.label


def test_megatron_formula_and_where_gpulab_differs():
    """A layer's experts measured, against Megatron-LM's formula. Megatron-LM's ``compute_activation_memory`` (``theoretical_memory_usage.py``) counts a layer as
    ``s·b·h·(18 + 4·ffn/h)`` bytes; its MLP term, ``4·ffn/h``, is a dense GeLU MLP's and reads
    neither ``num_experts`` nor ``moe_router_topk``. Read with ffn = k·moe_ffn (the routed rows as one
    wide MLP), it differs from what the eager experts loop saves, term by term:

    * the input: Megatron counts the layer's input once (2 bytes per h, inside the 18); each routed
      row gathers its own copy (``hidden_states[token_idx]``): k copies per token;
    * a gated MLP: the gate/up output is 2·I wide (Megatron's GeLU input: ffn), and SiLU's output
      and the product are saved too (Megatron: one ffn-wide input of the second linear);
    * the weighting: the down output (h per row) is saved for the multiply by the routing weight,
      the weighted output (h per row) by ``index_add_``'s derivative, and the routing weight itself
      (fp32) and ``torch.where``'s int64 index per row: none in Megatron;
    * the router (fp32 softmax, top-k indices) and what the layer's attention saves are in Megatron's 18.
    """
    k, moe_ffn, h, b2 = K, I, H, 2   # 16-bit activations, as Megatron's formula assumes
    rows = T * k
    # measured: one bf16 step on the fake engine (CUDA's kernels), layer 0's experts under balanced
    # routing, each expert's saved activations plus the activation function's outputs
    w = resolve_workload(tiny_mixtral(), None, batch=B, seq_len=S)
    m = run(train_experiment(w, [B], torch.bfloat16, LoopRecipe("adam", seed=0, routing="balanced")), "fake",
            fake_target="cuda")
    experts = sum(n for (owner, _), n in activations_by_expert(m.tracking).items() if ".layers.0." in owner)
    act_fn = sum(r.nbytes for r in m.tracking.records.values()
                 if r.module.endswith("layers.0.mlp.experts.act_fn") and r.category.value == "activations")
    eager = eager_expert_bytes(rows, h, moe_ffn, b2, weight_itemsize=4)
    assert experts + act_fn == eager
    megatron_mlp = T * h * 4 * (k * moe_ffn / h)                  # the MLP term of Megatron's formula
    megatron_input = T * h * 2                                      # the first linear's input, in the 18
    assert megatron_layer_bytes(S, B, h, k * moe_ffn) == T * h * 18 + megatron_mlp
    # the gated MLP's 4 intermediate-wide tensors per row vs Megatron's 2 (4·ffn bytes = 2 of 2 bytes)
    gated = rows * (2 * moe_ffn + moe_ffn + moe_ffn) * b2
    assert gated == 2 * megatron_mlp
    # the rest: k gathered inputs (Megatron: 1), the down output, routing weight and index per row
    assert eager - gated == k * megatron_input + 2 * rows * h * b2 + rows * (4 + 16)


@pytest.mark.parametrize("make", [tiny_mixtral, tiny_qwen3_moe])
def test_grouped_mm_fake_equals_real_cpu_step_whatever_the_router_chose(make):
    """transformers' default experts implementation (a config that names none: ``grouped_mm``, torch's
    ``_grouped_mm`` over the tokens·k rows sorted by expert) has no data-dependent shapes: the fake
    engine runs it as it is (routing "router", no assumption) and holds what a real CPU step holds
    (peak, every category, end), and two real steps whose routers chose differently hold the same."""
    w = resolve_workload(make(), None, batch=B, seq_len=S)
    assert w.build("meta", torch.float32).config._experts_implementation == "grouped_mm"
    runs, counts = {}, {}
    for seed in (0, 1):
        def build(device, dtype, seed=seed):
            net = w.build(device, dtype)
            counts[seed], _ = counts_of_run(net)
            return net
        runs[seed] = run(train_experiment(dataclasses.replace(w, build=build), [B, B], torch.float32,
                                          LoopRecipe("adam", seed=seed, routing="router")), "cpu")
    real = runs[0]
    assert counts[0] != counts[1] and all(sum(c) == T * K for c in counts[0] + counts[1])
    assert any(r.op == "_grouped_mm" for r in real.tracking.records.values())   # torch's kernel, not the fallback
    fake = _step(w, "router", "fake")
    for m in (fake, runs[1]):
        assert m.peak_bytes == real.peak_bytes
        assert m.peak_by_category == real.peak_by_category
        assert m.tracking.final_by_category == real.tracking.final_by_category
    assert not ran_routed(fake.tracking) and "router's own choice" in Routing("router").label


def _force_routers(net, forced: bool) -> None:
    """Each router's top-k indices replaced, after it ran, by experts 0..k-1 for every token (forced:
    the worst case) or kept as it chose: the same ops on the same shapes either way (a ``where``)."""
    def hook(mod, args, out):
        logits, weights, index = out
        first = torch.arange(K, dtype=index.dtype).expand_as(index)
        return logits, weights, torch.where(torch.full_like(index, forced, dtype=torch.bool), first, index)
    for m in net.modules():
        if hasattr(m, "top_k") and getattr(m, "weight", None) is not None and m.weight.shape[0] == E:
            m.register_forward_hook(hook)


@pytest.mark.parametrize("make", [tiny_mixtral, tiny_qwen3_moe])
def test_grouped_mm_bytes_do_not_follow_the_routing(make):
    """The default experts implementation's bytes under two forced routings: every token to the same
    k experts (the routers' answers overwritten: the worst case) and the router's random choice, each a
    real CPU step:
    the same peak, every category, every tensor's size in the same order. This is why an answer with
    no routing stated runs grouped_mm and names no routing assumption."""
    w = resolve_workload(make(), None, batch=B, seq_len=S)
    runs, counts = {}, {}
    for forced in (True, False):
        def build(device, dtype, forced=forced):
            net = w.build(device, dtype)
            _force_routers(net, forced)
            counts[forced], _ = counts_of_run(net)
            return net
        runs[forced] = run(train_experiment(dataclasses.replace(w, build=build), [B], torch.float32,
                                            LoopRecipe("adam", seed=0)), "cpu")
    assert all(c == [T] * K + [0] * (E - K) for c in counts[True])       # forced: the worst case
    assert all(max(c) < T for c in counts[False])                        # the router's own: spread out
    worst, spread = runs[True], runs[False]
    assert worst.peak_bytes == spread.peak_bytes and worst.peak_by_category == spread.peak_by_category
    sizes = [[(r.op, r.nbytes) for r in m.tracking.records.values()] for m in (worst, spread)]
    assert sizes[0] == sizes[1]
    assert not ran_routed(worst.tracking) and any(r.op == "_grouped_mm" for r in worst.tracking.records.values())


def test_the_stated_default_is_what_the_run_took():
    """No routing stated: the label's choice (from the config) is the one the built model ran, for the
    built-in MoE configs (transformers' grouped_mm: no assumption) and an eager config (balanced)."""
    from gpulab.models import hf_configs
    from gpulab.training.routing import default_routing, experts_implementation, install_routing, stated_routing
    for name in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v2-lite"):
        cfg = hf_configs.make_config(name)
        cfg.num_hidden_layers = 2 if name != "deepseek-v2-lite" else cfg.first_k_dense_replace + 1
        net = resolve_workload(cfg, None, batch=1, seq_len=8).build("meta", torch.bfloat16)
        assert experts_implementation(cfg) == experts_implementation(net) == "grouped_mm", name
        assert install_routing(net, None) == stated_routing(None, cfg) == Routing("router", implementation="grouped_mm")
    eager = tiny_mixtral("eager")
    net = resolve_workload(eager, None, batch=B, seq_len=S).build("meta", torch.float32)
    assert experts_implementation(eager) == experts_implementation(net) == "eager"
    assert install_routing(net, None) == stated_routing(None, eager) == Routing()
    assert stated_routing(None, tiny_mixtral(), ep=2) == Routing()   # expert parallelism dispatches by counts
    assert stated_routing(parse_routing("router"), tiny_mixtral()) == default_routing("grouped_mm")
    assert stated_routing(parse_routing("worst"), tiny_mixtral()).kind == "worst"


@pytest.mark.slow
def test_balanced_experts_laid_out_equal_full_depth():
    """The eager mirror under a stated routing (balanced: each expert its own module, one call count
    per MoE layer) laid out by layer repeat from a few layers equals the full-depth run, as the
    default grouped_mm does (tests/test_layer_repeat.py's MoE patterns)."""
    from test_layer_repeat import PATTERNS, _assert_same, _both, _shrunk

    from gpulab.training.loop import user_recipe
    name, depth, fields = PATTERNS["mixtral (MoE alike)"]
    deep, laid, full = _both(_shrunk(name, depth, **fields), user_recipe("adamw", None, routing="balanced"))
    assert deep.copies >= 1 and deep.depths[2] < depth and ran_routed(full)
    _assert_same(laid, full)


def test_the_cli_text_answer_says_how_the_experts_ran(tmp_path, capsys):
    """gpulab fit's text answer prints the MoE part of its label on a line of its own: grouped_mm's
    'no routing assumption' with no --routing, the assumption with one."""
    from conftest import run_main
    (tmp_path / "config.json").write_text(tiny_mixtral().to_json_string())
    model = f"hf:{tmp_path / 'config.json'}"
    for extra, said in (([], "MoE experts: transformers' grouped_mm, the router's own choice"),
                        (["--routing", "worst"], "MoE routing assumed worst: every token to the same k experts")):
        code, out, err = run_main(["fit", model, "--gpu", "24MiB", "--context", "1KiB", "--seq-len", "16", *extra], capsys)
        assert code == 0, err
        assert any(line.startswith(said) for line in out.splitlines()), out
