"""Context parallelism (gpulab.training.context_parallel) and expert parallelism
(gpulab.training.expert_parallel) per rank, against counts made independently of the runs."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import transformers

import gpulab
from gpulab.models import hf_configs
from gpulab.training.context_parallel import ring_buffers
from gpulab.training.expert_parallel import ep_buffers
from gpulab.training.routing import parse_routing

SEQ = 2048
# What each flash attention call keeps whatever its tokens: flash_api.cpp mha_fwd allocates a 2-element
# uint64 rng_state and a 0-dim uint64 "unused" on the GPU (torch's meta kernel gives the same), and autograd
# saves both for backward (ScaledDotProductFlashAttentionBackward0: rng_state_, unused_). Not divided by cp.
FLASH_RNG_BYTES = 2 * 8 + 8


def _llama():
    cfg = hf_configs.make_config("tiny-llama")
    cfg.max_position_embeddings = 4 * SEQ
    return cfg


def _mixtral(experts: int = 8, k: int = 2):
    return transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, num_local_experts=experts,
                                      num_experts_per_tok=k, vocab_size=256, max_position_embeddings=256)


def _cp(cp: int, **kw):
    return gpulab.step(_llama(), batch=1, seq_len=SEQ, optimizer="adamw", dtype="bf16", engine="fake", cp=cp, **kw)


def test_context_parallel_activations_fall_by_cp():
    """SDPA (flash on the fake CUDA target) saves q, k, v, the output and a logsumexp per row, all
    linear in the rank's tokens, and its random-number state, which is not: a rank's activations less
    that state are 1/cp of the whole sequence's, exactly; parameters and optimizer state do not change."""
    runs = {cp: _cp(cp) for cp in (1, 2, 4)}
    rng = FLASH_RNG_BYTES * _llama().num_hidden_layers
    act = {cp: r.tensor_bytes_by_category["activations"] - rng for cp, r in runs.items()}
    assert act[1] == 2 * act[2] == 4 * act[4]
    assert runs[4].tensor_bytes_by_category["parameters"] == runs[1].tensor_bytes_by_category["parameters"]
    note = runs[4].recipe["context_parallel"]
    assert "formula" in note["label"] and "_AllGatherRotater" in note["label"]
    assert "512 tokens" in runs[4].measurement.label


def test_ring_buffers_counted_by_hand():
    """Read off the tiny Llama config: the whole sequence's K and V gathered per layer,
    2·s·b·kv·d bf16 values; backward adds float32 dq, dk, dv and the dK/dV rotation's send and receive."""
    cfg = _llama()
    a, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // a
    r = ring_buffers(SEQ, 4, 1, a, kv, d, 2)
    local = SEQ // 4
    assert r.gathered_kv_bytes == 2 * SEQ * kv * d * 2
    assert r.backward_bytes == r.gathered_kv_bytes + local * (a + 2 * kv) * d * 4 + 2 * 2 * local * kv * d * 4
    assert r.forward_bytes == 2 * local * kv * d * 2 + r.gathered_kv_bytes + (local * a * d + a * local) * 4
    assert r.peak_bytes == max(r.forward_bytes, r.backward_bytes)
    assert ring_buffers(4 * SEQ, 4, 1, a, kv, d, 2).gathered_kv_bytes == 4 * r.gathered_kv_bytes   # not / cp


def test_context_parallel_refusals_say_what_divides():
    with pytest.raises(ValueError, match=r"does not split into 2·cp = 8 equal chunks.*8 divides"):
        gpulab.step(_llama(), batch=1, seq_len=100, optimizer="adamw", engine="fake", cp=4)
    with pytest.raises(ValueError, match=r"2·cp·tp = 16"):
        gpulab.step(_llama(), batch=1, seq_len=72, optimizer="adamw", engine="fake", cp=4, tp=2,
                    sequence_parallel=True)
    with pytest.raises(ValueError, match="shards a language model's sequence"):
        gpulab.step("resnet18", batch=2, optimizer="adamw", engine="fake", cp=2)
    with pytest.raises(ValueError, match="whole number of ranks"):
        gpulab.step(_llama(), batch=1, seq_len=64, optimizer="adamw", engine="fake", cp=0)
    with pytest.raises(ValueError, match=r"not a multiple of tp × cp = 2 × 2 = 4"):
        gpulab.fit(_llama(), "24MiB", optimizer="adamw", seq_len=64, context_bytes=0, cp=2, tp=2, gpus=6,
                   strategy="ddp")


def _expert_params(cfg, ep: int) -> int:
    """One rank's parameter count from the config: the dense parts whole, each MoE layer's router
    whole (E × h) and E/ep experts of (2·I·h + h·I)."""
    h, i, L, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    E = cfg.num_local_experts
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    attention = h * h + 2 * h * kv + h * h
    per_layer = attention + 2 * h + E * h + (E // ep) * 3 * h * i
    return L * per_layer + h + v * h * (1 if cfg.tie_word_embeddings else 2)


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_expert_parallel_rank_holds_its_experts(ep):
    cfg = _mixtral()
    r = gpulab.step(cfg, batch=2, seq_len=64, optimizer="adamw", dtype="bf16", engine="fake", ep=ep)
    by = r.tensor_bytes_by_category
    params = 2 * _expert_params(cfg, ep)
    assert by["parameters"] == pytest.approx(params, abs=512 * 40)
    assert by["optimizer_state"] == pytest.approx(2 * params, abs=512 * 80)


@pytest.mark.parametrize("routing,rows", [("balanced", 2 * 64 * 2), ("worst", 4 * 2 * 64 * 2)])
def test_all_to_all_buffers_are_in_the_run(routing, rows):
    """The dispatch's receive buffer (rows × h) is made by the all-to-all on the fake group, once per
    MoE layer; balanced: the rank's own tokens·k rows; worst: ep·tokens·k (every token of the group to
    experts 0 and 1, both on rank 0)."""
    cfg = _mixtral()
    r = gpulab.step(cfg, batch=2, seq_len=64, optimizer="adamw", dtype="bf16", engine="fake", ep=4,
                    routing=routing, steps=1)
    made = Counter(tuple(rec.shape) for rec in r.measurement.tracking.records.values()
                   if rec.op == "all_to_all_single" and rec.phase == "forward")
    layers = cfg.num_hidden_layers   # per MoE layer: the dispatch's receive buffer, then the combine's (tokens·k rows)
    assert made == Counter({(rows, 64): layers}) + Counter({(2 * 64 * 2, 64): layers})
    note = r.recipe["expert_parallel"]
    assert note["rows_received"] == rows and note["dispatch_receive"] == rows * 64 * 2
    assert note["dispatch_send"] == 2 * 64 * 2 * 64 * 2
    assert "rank 0 holds 2 of 8 experts" in r.measurement.label


@pytest.mark.parametrize("ep", [4, 8])
@pytest.mark.parametrize("routing", ["balanced", "worst"])
def test_fewer_local_experts_than_top_k(ep, routing):
    """Mixtral-style E=8, top-2 at ep 8 holds 1 expert a layer (fewer than k) and at ep 4 two: the
    router stays global (E × h weight, top-2 over all 8, as torchtitan's TokenChoiceTopKRouter keeps
    num_experts = E), the rank's expert weights are exactly E/ep experts (gate_up 2I × h and down h × I
    each, counted from the config), and the dispatch's receive buffer has the rows the routing gives
    rank 0's experts out of the group's ep·tokens tokens: balanced ep·tokens·k/E per expert (tokens·k
    in all), worst every token to experts 0 and 1 (ep·tokens rows each, only those on rank 0)."""
    from gpulab.measure.records import Category
    from gpulab.training.expert_parallel import expert_rank_model
    from gpulab.training.loop import LoopRecipe
    from gpulab.models.workload import resolve_workload
    cfg = _mixtral()
    h, f, E, k, tokens = cfg.hidden_size, cfg.intermediate_size, 8, 2, 2 * 64
    r = gpulab.step(cfg, batch=2, seq_len=64, optimizer="adamw", dtype="bf16", engine="fake", ep=ep,
                    routing=routing, steps=1)
    t = r.measurement.tracking
    expert_shapes = {(E // ep, 2 * f, h), (E // ep, h, f)}
    held = Counter(tuple(rec.shape) for rec in t.records.values() if rec.category is Category.PARAMETERS)
    assert {s: n for s, n in held.items() if s in expert_shapes} == {s: cfg.num_hidden_layers for s in expert_shapes}
    assert held[(E, h)] == cfg.num_hidden_layers   # each layer's router whole
    net = expert_rank_model(resolve_workload(cfg, seq_len=64), LoopRecipe("adamw", ep=ep), torch.bfloat16)
    routers = [m for m in net.modules() if hasattr(m, "top_k") and hasattr(m, "weight")]
    assert [(m.top_k, m.num_experts, tuple(m.weight.shape)) for m in routers] == [(k, E, (E, h))] * 2
    per_expert = tokens * ep * k // E if routing == "balanced" else tokens * ep
    rows = per_expert * (E // ep if routing == "balanced" else min(k, E // ep))
    made = Counter(tuple(rec.shape) for rec in t.records.values()
                   if rec.op == "all_to_all_single" and rec.phase == "forward")
    assert made == Counter({(rows, h): 2}) + Counter({(tokens * k, h): 2})
    note = r.recipe["expert_parallel"]
    assert (note["rows_received"], note["local_experts"]) == (rows, E // ep)
    assert note["dispatch_receive"] == rows * h * 2 and note["dispatch_send"] == tokens * k * h * 2
    assert f"rank 0 holds {E // ep} of 8 experts" in r.measurement.label


def test_ep_buffers_under_capacity():
    b = ep_buffers(parse_routing("capacity:1.25"), 128, 2, 8, 4, 64, 2)
    assert b.rows_received == 2 * 160   # ceil(1.25 · (4·128)·2 / 8) = 160 rows each for rank 0's 2 experts


def test_expert_parallel_refusals_say_what_divides():
    with pytest.raises(ValueError, match=r"--ep 3 does not divide the 8 experts.*--ep 2 or 4 or 8"):
        gpulab.step(_mixtral(), batch=2, seq_len=64, optimizer="adamw", engine="fake", ep=3)
    with pytest.raises(ValueError, match="dense model"):
        gpulab.step(_llama(), batch=2, seq_len=64, optimizer="adamw", engine="fake", ep=2)
    with pytest.raises(ValueError, match="routing assumption"):
        gpulab.step(_mixtral(), batch=2, seq_len=64, optimizer="adamw", engine="fake", ep=2, routing="router")
    with pytest.raises(ValueError, match=r"--ep 4 does not divide gpus=6"):
        gpulab.fit(_mixtral(), "24MiB", optimizer="adamw", seq_len=64, context_bytes=0, ep=4, gpus=6,
                   strategy="ddp")
    with pytest.raises(ValueError, match=r"--ep 8 does not divide the 4 data-parallel ranks.*2 × 1 × 2 = 4"):
        gpulab.Layout(gpus=8, strategy="fsdp2", tp=2, ep=8, dp_replicate=2)   # HSDP: ep borrows dp_shard × cp × tp


def _dense_and_expert_params(cfg, ep: int) -> tuple[int, int]:
    """(every parameter but the experts', rank 0's experts' parameters), counted from the config: the
    router whole (E × h), E/ep experts a layer (gate_up 2f × h and down h × f each)."""
    h, f, v, L, E = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers,
                     cfg.num_local_experts)
    dense = L * (4 * h * h + 2 * h + E * h) + h + v * h * (1 if cfg.tie_word_embeddings else 2)
    return dense, L * (E // ep) * 3 * h * f


@pytest.mark.parametrize("strategy", ["fsdp2", "zero1", "zero3"])
def test_expert_parallel_under_a_sharding_strategy(strategy):
    """ep 4 of 8 GPUs under FSDP2 / ZeRO: formula, as torchtitan's dp_shard_mod_ep and DeepSpeed-MoE's expert
    data-parallel group lay it out: the rank's experts split over gpus / ep = 2 ranks, the rest over 8.
    Parameters (bf16): FSDP2 and ZeRO-3 split them (2·dense/8 + 2·experts/2), ZeRO-1 keeps them whole;
    optimizer state: FSDP2 the run's own bf16 moments split alike (4 bytes a parameter), ZeRO DeepSpeed's
    16 bytes a parameter split alike. Each storage is split on its own (rounded up), hence the slack."""
    from gpulab.measure.records import Category
    from gpulab.predict import sharding as S
    from gpulab.training.expert_parallel import expert_parameter_shapes, expert_rank_model
    from gpulab.training.loop import LoopRecipe
    from gpulab.models.workload import resolve_workload
    cfg = _mixtral()
    t = gpulab.step(cfg, batch=2, seq_len=64, optimizer="adamw", dtype="bf16", engine="fake", ep=4,
                    steps=1).measurement.tracking
    w = resolve_workload(cfg, seq_len=64)
    net = expert_rank_model(w, LoopRecipe("adamw", ep=4), torch.bfloat16)
    sh = S.Sharding(8, strategy, ep=4)
    rank = S.per_rank(t, sh, S.count_layers(net), 2, expert_parameter_shapes(net))
    dense, experts = _dense_and_expert_params(cfg, 4)

    def held(cat):
        return sum(e.nbytes for e in rank.events if e.kind == "alloc" and rank.records[e.sid].category is cat
                   and not rank.records[e.sid].op.startswith(strategy))
    split_params = 2 * dense / 8 + 2 * experts / 2
    slack = 512 * 60
    assert held(Category.PARAMETERS) == pytest.approx(2 * (dense + experts) if strategy == "zero1" else split_params,
                                                      abs=slack)
    per_param = 4 if strategy == "fsdp2" else 16
    assert held(Category.OPTIMIZER_STATE) == pytest.approx(per_param * (dense / 8 + experts / 2), abs=2 * slack)
    assert "expert data-parallel group (torchtitan's efsdp), gpus / ep = 8 / 4 = 2 ranks" in sh.describe()


def test_fit_per_rank_with_cp_and_ep():
    one = gpulab.fit(_mixtral(), "24MiB", optimizer="adamw", dtype="bf16", seq_len=64, context_bytes=0)
    four = gpulab.fit(_mixtral(), "24MiB", optimizer="adamw", dtype="bf16", seq_len=64, context_bytes=0, ep=4)
    assert four.largest_batch >= one.largest_batch
    assert "expert_parallel" in four.recipe and "rank 0 holds 2 of 8" in four.label
    cp = gpulab.fit(_llama(), "24MiB", optimizer="adamw", dtype="bf16", seq_len=SEQ, context_bytes=0, cp=4,
                    gpus=8, strategy="ddp")
    assert "ring attention" in cp.label and cp.recipe["cp"] == 4


def test_lesson_12s_section_10():
    import time

    from gpulab.course.context_expert import (cp_table, ep_table, exercise_cp_activations, exercise_ep_parameters,
                                              table2_rows)
    t0 = time.perf_counter()
    cps = cp_table()
    rng = FLASH_RNG_BYTES * _llama().num_hidden_layers   # cp_table's model: the tiny Llama
    assert (cps.row(131072, 8).activations - rng) * 8 == cps.row(131072, 1).activations - rng
    assert cps.row(131072, 8).gathered_kv == 4 * cps.row(32768, 8).gathered_kv
    ex = exercise_cp_activations(cps)
    assert ex.check(cps.row(131072, 8).activations).ok and not ex.check(cps.row(131072, 1).activations).ok
    eps = ep_table()
    assert eps.row(4).parameters < eps.row(1).parameters
    assert eps.row(4, "worst").dispatch_receive == 4 * eps.row(4).dispatch_receive
    ex = exercise_ep_parameters(eps)
    assert ex.check(eps.row(4).parameters).ok and not ex.check(eps.row(1).parameters // 4).ok
    t2 = table2_rows()
    a, h, s, t = 8, 512, 512, 4
    assert t2.row("no parallelism").difference == 2 * a * s * s + 2 * 2 * s * 2
    assert t2.row("tensor + sequence parallel t=4").difference == 2 * a * s * s // t + 2 * 2 * s * 2 // t + \
        4 * s * h * (t - 1) // t
    for table in (cps, eps, t2):
        assert "<table" in table._repr_html_()
    assert time.perf_counter() - t0 < 240


def test_cli_cp_and_ep(capsys):
    from gpulab import cli
    assert cli.main(["step", "hf:tiny-llama", "--engine", "fake", "--batch", "1", "--seq-len", "100", "--cp", "4"]) == 2
    assert "gpulab: error: --cp 4: sequence length 100 does not split into 2·cp = 8" in capsys.readouterr().err
    assert cli.main(["step", "hf:tiny-llama", "--engine", "fake", "--batch", "1", "--ep", "2"]) == 2
    assert "dense model" in capsys.readouterr().err
    assert cli.main(["fit", "hf:tiny-llama", "--gpu", "64MiB", "--context", "1MiB", "--optimizer", "adamw",
                     "--dtype", "bf16", "--seq-len", "256", "--cp", "2", "--gpus", "4", "--strategy", "ddp"]) == 0
    out = capsys.readouterr().out
    assert "layout: cp=2: rank 0's sequence shard of 128 tokens measured" in out and "cp=2" in out.splitlines()[0]


def test_expert_parallel_pipeline_stages():
    """ep with pp: each stage holds its layers' E/ep experts (formula: the config's counts, exact), its MoE
    layers' all-to-all in its run; fit answers per stage under FSDP2 with the experts over gpus/(pp·ep)."""
    cfg = _mixtral()
    cfg.num_hidden_layers = 4
    r = gpulab.step(cfg, batch=2, seq_len=64, optimizer="adamw", dtype="bf16", engine="fake", ep=4, pp=2,
                    pp_stage=1, microbatches=2, steps=1)
    h, f, v, E = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_local_experts
    layer = 4 * h * h + 2 * h + E * h + (E // 4) * 3 * h * f
    assert r.tensor_bytes_by_category["parameters"] == 2 * (2 * layer + h + v * h)   # last stage: norm and head
    made = Counter(rec.op for rec in r.measurement.tracking.records.values() if rec.phase == "forward")
    assert made["all_to_all_single"] == 2 * 2 * 1   # 2 MoE layers × dispatch and combine × the 1 in flight (last stage)
    fit = gpulab.fit(cfg, "24MiB", optimizer="adamw", dtype="bf16", seq_len=64, context_bytes=0, ep=2, pp=2,
                     gpus=8, strategy="fsdp2")
    assert len(fit.ranks) == 2 and "dp_shard × cp / ep = 4 × 1 / 2 = 2 ranks" in fit.sharding and "rank 0 holds 4 of 8" in fit.label
    with pytest.raises(ValueError, match=r"--ep 4 does not divide the 2 data-parallel ranks of each stage"):
        gpulab.fit(cfg, "24MiB", optimizer="adamw", dtype="bf16", seq_len=64, context_bytes=0, ep=4, pp=2, gpus=4,
                   strategy="fsdp2")


def test_fsdp2_with_cp_shards_over_dp_shard_times_cp():
    """torchtitan's fsdp mesh is dp_shard × cp ("when cp is used, FSDP is also applied", ParallelDims.build_mesh):
    on 8 GPUs with cp 8 and fsdp2 the rank holds 1/8 of the parameters, gradients and optimizer state (each
    storage split on its own and rounded up: at most a byte per storage over the exact eighth). gpulab spread
    FSDP over gpus ÷ cp = 1 rank before, so nothing was sharded."""
    from gpulab.measure.records import Category
    from gpulab.models.workload import resolve_workload
    from gpulab.predict import sharding as S
    lay = gpulab.Layout(gpus=8, strategy="fsdp2", cp=8)
    assert (lay.dp_replicate, lay.dp_shard, lay.sharded_over) == (1, 1, 8)
    t = gpulab.step(_llama(), batch=1, seq_len=SEQ, optimizer="adamw", dtype="bf16", engine="fake", cp=8,
                    steps=1).measurement.tracking
    net = resolve_workload(_llama(), seq_len=SEQ).build(torch.device("meta"), torch.bfloat16)
    rank = S.per_rank(t, S.Sharding(lay.sharded_over, "fsdp2"), S.count_layers(net), 2)

    def held(run, cat):
        allocs = [e for e in run.events if e.kind == "alloc" and run.records[e.sid].category is cat
                  and not run.records[e.sid].op.startswith("fsdp2")]
        return sum(e.nbytes for e in allocs), allocs

    def padded(e):   # FSDP2's rank 0: ceil(d0 / 8) rows of a tensor (fully_shard's padded shard)
        shape = t.records[e.sid].shape
        return -(-shape[0] // 8) * (e.nbytes // shape[0]) if shape and e.nbytes % shape[0] == 0 else e.nbytes / 8
    for cat in (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE):
        (whole, allocs), (mine, _) = held(t, cat), held(rank, cat)
        most = sum(padded(e) for e in allocs)
        assert whole > 0 and whole / 8 <= mine <= most + len(allocs), (cat, whole / 8, mine, most)
    fit = gpulab.fit(_llama(), "24MiB", optimizer="adamw", dtype="bf16", seq_len=SEQ, context_bytes=0, layout=lay)
    assert fit.sharding.startswith("8 GPUs, fsdp2") and "N = dp_shard × cp = 1 × 8 = 8 ranks" in fit.sharding
    assert fit.mesh == "mesh dp_replicate 1 × dp_shard 1 × cp 8 × tp 1 × pp 1" and fit.mesh in fit.label
    one = gpulab.fit(_llama(), "24MiB", optimizer="adamw", dtype="bf16", seq_len=SEQ, context_bytes=0, cp=8, gpus=8,
                     strategy="ddp")
    assert one.sharding.startswith("8 GPUs, ddp")   # ddp replicates: cp 8 of 8 GPUs leaves no replica to spread over
    assert "dp_replicate × dp_shard = 1 × 1 = 1 replicas" in one.sharding


def test_mixtral_ep_8_states_its_mesh():
    """The usual Mixtral layout, 8 GPUs, fsdp2, ep 8 (1 local expert, top-2): it answers, with the mesh
    torchtitan's ParallelDims names (ep borrowed from dp_shard × cp) in the label, the text and --json."""
    import json

    from gpulab.command.answers import fit_text
    f = gpulab.fit(_mixtral(), "24MiB", optimizer="adamw", dtype="bf16", seq_len=64, context_bytes=0, ep=8, gpus=8,
                   strategy="fsdp2")
    mesh = "mesh dp_replicate 1 × dp_shard 8 × cp 1 × tp 1 × pp 1 (ep 8 from dp_shard × cp)"
    assert f.largest_batch >= 1 and f.mesh == mesh and mesh in f.label and "rank 0 holds 1 of 8" in f.label
    assert "dp_shard × cp / ep = 8 × 1 / 8 = 1 ranks" in f.sharding
    d = json.loads(json.dumps(f.as_dict(), default=str))
    assert d["mesh"] == mesh and f"layout: {mesh}" in fit_text(d)
