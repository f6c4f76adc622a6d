"""The layouts torchtitan runs that gpulab refused before #45: EP × TP, EP × CP and CP × PP, and a mixture
of experts under TP (training.moe_parallel), each rank's parameters counted by hand from the config;
the mesh stated by gpulab step; --dp-replicate / --dp-shard (HSDP) checked against --gpus."""
from __future__ import annotations

import functools
from collections import Counter

import pytest
import transformers

import gpulab
from gpulab.categories import Category
from gpulab.models import hf_configs

H, F, E, K, L, V, SEQ = 64, 128, 8, 2, 2, 256, 64


def _mixtral(layers: int = L):
    return transformers.MixtralConfig(hidden_size=H, intermediate_size=F, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=4, num_local_experts=E,
                                      num_experts_per_tok=K, vocab_size=V, max_position_embeddings=256)


def _rank_params(tp: int, ep: int, layers: int = L, first: bool = True, last: bool = True) -> int:
    """Rank 0's parameters, by hand: attention's q, k, v column- and o row-split over tp (4·h·h/tp, 4 KV
    heads = 4 heads), both norms and the router (E × h) whole; experts E/ep whole under ep (etp 1), or
    all E with gate/up and down split over tp without ep (3·h·F/tp each); the embedding whole, the
    head column-split over tp; the final norm whole. The embedding (``embedding``: its share, V·h whole or
    V·h/tp split by vocabulary, as the tensor-parallel plan holds it) is added by the caller."""
    experts = (E // ep) * 3 * H * F if ep > 1 else E * 3 * H * F // tp
    layer = 4 * H * H // tp + 2 * H + E * H + experts
    return layers * layer + ((H + V * H // tp) if last else 0)


def _with_embedding(nbytes: int, tp: int, ep: int) -> bool:
    """``nbytes`` (bf16) is the hand count with the embedding whole or split over tp by vocabulary (the
    embedding's layout under tp is the plan's: training.tensor_parallel)."""
    return nbytes in {2 * (_rank_params(tp, ep) + V * H), 2 * (_rank_params(tp, ep) + V * H // tp)}


def _step(**kw):
    return _cached_step(tuple(sorted(kw.items())))


@functools.lru_cache(maxsize=None)
def _cached_step(kw: tuple):   # one run per layout, read by the tests that check it
    return gpulab.step(_mixtral(), batch=2, seq_len=SEQ, optimizer="adamw", dtype="bf16", engine="fake", steps=1,
                       **dict(kw))


def _params(r) -> tuple[int, Counter]:
    t = r.measurement.tracking
    held = [rec for rec in t.records.values() if rec.category is Category.PARAMETERS]
    return sum(rec.nbytes for rec in held), Counter(tuple(rec.shape) for rec in held)


def _collectives(r) -> Counter:
    names = ("all_to_all_single", "all_reduce", "reduce_scatter_tensor")
    return Counter((rec.op, tuple(rec.shape)) for rec in r.measurement.tracking.records.values()
                   if rec.phase == "forward" and rec.op in names)


@pytest.mark.parametrize("tp,ep", [(2, 1), pytest.param(2, 2, marks=pytest.mark.extended), (2, 4)])
def test_moe_under_tp_holds_what_the_config_gives(tp, ep):
    """tp alone: every expert's gate/up (E, 2F/tp, h) and down (E, h, F/tp), torchtitan's TensorParallel;
    with ep: E/ep whole experts (etp 1). bf16, so 2 bytes a parameter, counted against the hand count."""
    r = _step(tp=tp, ep=ep)
    nbytes, shapes = _params(r)
    assert _with_embedding(nbytes, tp, ep), nbytes
    local = E // ep
    expected = {(E, 2 * F // tp, H), (E, H, F // tp)} if ep == 1 else {(local, 2 * F, H), (local, H, F)}
    assert all(shapes[s] == L for s in expected), shapes
    note = r.recipe["moe_tensor_parallel"]
    assert note["experts_tp_split"] == (ep == 1)
    assert ("not tp-split" in note["text"]) == (ep > 1) and note["text"] in r.measurement.label
    assert r.mesh == r.answered_layout.mesh and r.mesh.startswith("mesh dp_replicate 1 × dp_shard") and r.mesh in r.measurement.label


def test_ep_with_tp_dispatches_a_tp_share_of_the_tokens():
    """EP 4 × TP 2 (etp 1): each tp rank dispatches (b·s/tp)·k rows (ReordererSequenceParallel) and its 2
    experts receive balanced ep·(b·s/tp)·k/E rows each; every MoE block's partial output, and attention's,
    is all-reduced over tp (b, s, h) once a layer (and the vocabulary-parallel embedding's output once)."""
    r = _step(tp=2, ep=4)
    mine = 2 * SEQ // 2
    rows = 4 * mine * K // E * (E // 4)
    assert rows == mine * K   # balanced: the dispatch receives as many rows as it sends
    # all-reduced over tp: each layer's attention and MoE block, and the vocabulary-parallel embedding's rows
    assert _collectives(r) == Counter({("all_to_all_single", (rows, H)): 2 * L, ("all_reduce", (2, SEQ, H)): 2 * L + 1})
    note = r.recipe["expert_parallel"]
    assert (note["tokens"], note["rows_received"], note["dispatch_send"]) == (mine, rows, mine * K * H * 2)


@pytest.mark.extended
def test_ep_with_tp_and_sequence_parallel_reduce_scatters():
    """With sequence parallelism the MoE block's partial sum goes back to the sequence shard by a
    reduce-scatter (torchtitan's PrepareModuleInputOutput on the block), as the attention's does."""
    r = _step(tp=2, ep=2, sequence_parallel=True)
    made = _collectives(r)
    # attention's and the MoE block's a layer (and the embedding's, as the plan holds it), none all-reduced
    assert made[("reduce_scatter_tensor", (2, SEQ // 2, H))] >= 2 * L and not any(op == "all_reduce" for op, _ in made)
    assert _with_embedding(_params(r)[0], 2, 2)


@pytest.mark.extended
def test_ep_with_cp_routes_the_sequence_shard():
    """EP 2 × CP 2: the rank's tokens are its sequence shard's, b·s/cp, and its parameters are EP's alone."""
    r = _step(ep=2, cp=2)
    mine = 2 * SEQ // 2
    assert _collectives(r)[("all_to_all_single", (mine * K, H))] == 2 * L   # balanced: receive = send
    assert _params(r)[0] == 2 * (_rank_params(1, 2) + V * H)   # tp 1: attention and embedding whole
    assert r.recipe["expert_parallel"]["tokens"] == mine and "cp=2" in r.measurement.label


def test_cp_with_pp_runs_each_stage_on_its_sequence_shard():
    """CP 2 × PP 2: stage 1 of a tiny Llama gets the hidden states of its sequence shard (b, s/cp, h) and
    holds its layers, norm and head; its activations are half of PP 2's alone (all linear in tokens but
    flash attention's random-number state, a 2-element and a 0-dim uint64 per layer: flash_api.cpp mha_fwd)."""
    cfg = hf_configs.make_config("tiny-llama")
    both = gpulab.step(cfg, batch=1, seq_len=256, optimizer="adamw", dtype="bf16", engine="fake", steps=1, cp=2,
                       pp=2, pp_stage=1)
    alone = gpulab.step(cfg, batch=1, seq_len=256, optimizer="adamw", dtype="bf16", engine="fake", steps=1, pp=2,
                        pp_stage=1)
    a, b = both.tensor_bytes_by_category, alone.tensor_bytes_by_category
    assert a["parameters"] == b["parameters"] and 2 * a["inputs"] == b["inputs"]
    rng = (2 * 8 + 8) * (cfg.num_hidden_layers // 2)   # the stage's layers' rng_state and unused
    assert 2 * (a["activations"] - rng) == b["activations"] - rng
    assert "cp 2 × tp 1 × pp 2" in both.mesh and "128 tokens" in both.measurement.label


def test_step_states_its_mesh_and_the_cli_sets_dp(capsys):
    from gpulab import cli
    from gpulab.command import checks
    parser = cli.build_parser()
    args = parser.parse_args(["fit", "hf:tiny-llama", "--gpu", "H100", "--gpus", "16", "--strategy", "fsdp2",
                              "--dp-replicate", "2", "--dp-shard", "4", "--tp", "2"])
    _, lay = checks.settings(args)
    assert (lay.dp_replicate, lay.dp_shard, lay.sharded_over) == (2, 4, 4)
    assert lay.mesh == "mesh dp_replicate 2 × dp_shard 4 × cp 1 × tp 2 × pp 1"
    assert cli.main(["fit", "hf:tiny-llama", "--gpu", "H100", "--gpus", "16", "--strategy", "fsdp2",
                     "--dp-replicate", "3"]) == 2
    assert "gpus=16 is not dp_replicate × dp_shard × cp × tp × pp = 3 × 5" in capsys.readouterr().err
    assert cli.main(["fit", "hf:tiny-llama", "--gpu", "H100", "--gpus", "8", "--strategy", "ddp", "--dp-shard", "2"]) == 2
    assert "dp_shard 2 shards each replica's state: give strategy fsdp2" in capsys.readouterr().err


@pytest.mark.extended
def test_fit_ep_with_tp_splits_experts_over_efsdp():
    """fit, EP 4 × TP 2 on 8 GPUs under FSDP2: the experts' own storages split over torchtitan's efsdp
    mesh, dp_shard·cp·tp/ep = 4·1·2/4 = 2 ranks, the rest over dp_shard·cp = 4."""
    f = gpulab.fit(_mixtral(), "24MiB", optimizer="adamw", dtype="bf16", seq_len=SEQ, context_bytes=0, ep=4, tp=2,
                   gpus=8, strategy="fsdp2")
    assert f.largest_batch >= 1 and "dp_shard × cp × tp / ep = 4 × 1 × 2 / 4 = 2 ranks" in f.sharding
    assert f.mesh == "mesh dp_replicate 1 × dp_shard 4 × cp 1 × tp 2 × pp 1 (ep 4 from dp_shard × cp × tp)"
    assert "not tp-split" in f.label


def _mixtral_8x7b_rank_params(tp: int, ep: int) -> int:
    """Mixtral-8x7B's rank-0 parameters from its config's numbers, by hand (the model's own counts)."""
    c = hf_configs.make_config("mixtral-8x7b")
    h, f, e, layers, v = c.hidden_size, c.intermediate_size, c.num_local_experts, c.num_hidden_layers, c.vocab_size
    d = h // c.num_attention_heads
    attention = (2 * h * h + 2 * h * c.num_key_value_heads * d) // tp
    layer = attention + 2 * h + e * h + (e // ep) * 3 * h * f
    return layers * layer + h + v * h // tp


@pytest.mark.extended
def test_mixtral_8x7b_ep_8_tp_2_rank_parameters():
    """The full-size probe: Mixtral-8x7B, EP 8 × TP 2, one step at batch 1 (seq 512): rank 0 holds 1 whole
    expert a layer, attention split in two; its parameter bytes equal the config's count."""
    r = gpulab.step("hf:mixtral-8x7b", batch=1, seq_len=512, optimizer="adamw", dtype="bf16", engine="fake",
                    steps=1, ep=8, tp=2)
    c = hf_configs.make_config("mixtral-8x7b")
    assert _params(r)[0] in {2 * (_mixtral_8x7b_rank_params(2, 8) + c.vocab_size * c.hidden_size // tp)
                             for tp in (1, 2)}   # the embedding whole or split by vocabulary, as the plan holds it
    assert "ep 8 from dp_shard × cp × tp" in r.mesh


def test_fsdp2_splits_ep_tp_experts_over_efsdp():
    """EP 4 × TP 2 on 8 GPUs, fsdp2 (formula over the run's storages, fit's own function): dp_shard 4, so the
    dense parameters and their optimizer state split 4 ways, the experts' over torchtitan's efsdp,
    dp_shard·cp·tp/ep = 2 ranks: the optimizer's bf16 moments (4 bytes a parameter) counted by hand. The
    experts' state is made by zeros_like on DTensors, which the tracker files under their global shape."""
    import torch
    from gpulab.models.workload import resolve_workload
    from gpulab.predict.fit import _sharding
    from gpulab.training.loop import LoopRecipe
    lay = gpulab.Layout(gpus=8, strategy="fsdp2", tp=2, ep=4)
    assert (lay.dp_shard, lay.sharded_over) == (4, 4)
    t = _step(tp=2, ep=4).measurement.tracking
    sh, one_rank = _sharding(resolve_workload(_mixtral(), seq_len=SEQ), LoopRecipe("adamw", tp=2, ep=4),
                             torch.bfloat16, lay.sharded_over, "fsdp2", False, layout=lay)
    assert sh.expert_ranks == 2 and "dp_shard × cp × tp / ep = 4 × 1 × 2 / 4 = 2 ranks" in sh.describe()
    rank = one_rank(t)
    state = [e for e in rank.events if e.kind == "alloc" and rank.records[e.sid].category is Category.OPTIMIZER_STATE]
    experts = L * (E // 4) * 3 * H * F
    dense = sum(rec.nbytes for rec in t.records.values() if rec.category is Category.PARAMETERS) // 2 - experts
    assert 4 * (dense / 4 + experts / 2) <= sum(e.nbytes for e in state) <= 4 * (dense / 4 + experts / 2) + len(state)


@pytest.mark.parametrize("kw,words", [
    (dict(model=transformers.DeepseekV2Config(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                              n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
                                              vocab_size=256), tp=2, ep=2),
     r"shared experts \(n_shared_experts = 2\).*not measured yet"),
    (dict(tp=2, ep=2, seq_len=65), r"the rank.s 65 positions do not split 2 ways.*that 2 divides"),
    (dict(model="hf:tiny-llama", tp=2, fp8="tensorwise"), r"fp8 with tp is not measured yet: .*Float8ColwiseParallel"),
    (dict(model="hf:tiny-llama", tp=2, compile=True), r"leave out compile with tp; torch.compile of the DTensor program"),
    (dict(model="hf:tiny-llama", pp=2, compile=True), r"leave out compile with pp \(torch.compile of a pipeline stage"),
])
def test_layouts_torchtitan_runs_that_are_refused_name_the_missing_piece(kw, words):
    model = kw.pop("model", None) or _mixtral()
    seq_len = kw.pop("seq_len", SEQ)
    with pytest.raises(ValueError, match=words) as e:
        gpulab.step(model, batch=2, seq_len=seq_len, optimizer="adamw", dtype="bf16", engine="fake", **kw)
    assert "\n" not in str(e.value)


@pytest.mark.extended
def test_qwen3_moe_under_tp_counted_by_hand():
    """A tiny Qwen3-MoE (q_norm and k_norm replicated: its plan's replicated_with_grad_allreduce) under tp 2:
    attention q, k, v, o split, experts' gate/up and down split (E × 3·h·f/tp), router and norms whole."""
    h, f, d, kv = 64, 32, 16, 2
    cfg = transformers.Qwen3MoeConfig(hidden_size=h, intermediate_size=128, moe_intermediate_size=f,
                                      num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=kv, head_dim=d,
                                      num_experts=E, num_experts_per_tok=K, vocab_size=V, max_position_embeddings=256)
    r = gpulab.step(cfg, batch=2, seq_len=SEQ, optimizer="adamw", dtype="bf16", engine="fake", steps=1, tp=2)
    layer = (2 * h * 4 * d + 2 * h * kv * d) // 2 + 2 * d + 2 * h + E * h + E * 3 * h * f // 2
    base = L * layer + h + V * h // 2
    assert _params(r)[0] in {2 * (base + V * h), 2 * (base + V * h // 2)}


@pytest.mark.extended
def test_llama_3_8b_cp_2_pp_2_stage_parameters():
    """The full-size probe: Llama-3-8B, CP 2 × PP 2, stage 0 (embedding + 16 layers) at batch 1, seq 1024:
    its parameters are the config's count (cp splits none), its input the sequence shard's token ids."""
    c = hf_configs.make_config("llama-3-8b")
    h, i, kv = c.hidden_size, c.intermediate_size, c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    r = gpulab.step("hf:llama-3-8b", batch=1, seq_len=1024, optimizer="adamw", dtype="bf16", engine="fake", steps=1,
                    cp=2, pp=2, pp_stage=0)
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    assert _params(r)[0] == 2 * (c.vocab_size * h + c.num_hidden_layers // 2 * layer)
    assert "cp 2 × tp 1 × pp 2" in r.mesh and "512 tokens" in r.measurement.label
