"""Several GPUs in `gpulab fit` (gpulab.predict.sharding): one rank's bytes as DDP, DeepSpeed's
ZeRO stages and FSDP2 hold them, checked against DeepSpeed's own estimator functions, the ZeRO
paper's formula and the one-GPU run they are made from."""
import math
import os

import pytest
import torch

from gpulab import formulas as F
from gpulab.predict import sharding as S
from gpulab.predict.fit import fit

LLAMA3_8B = 8_030_261_248


@pytest.fixture(scope="module")
def llama_layers():
    from gpulab.models.workload import resolve_workload
    w = resolve_workload("hf:llama-3-8b", seq_len=16)
    with torch.device("meta"):
        return S.count_layers(w.build(torch.device("meta"), torch.bfloat16))


def test_llama_3_8b_counts_as_deepspeed_counts_it(llama_layers):
    assert llama_layers.total == LLAMA3_8B
    assert llama_layers.largest_layer == 128_256 * 4096          # the embedding (and the untied head)
    assert llama_layers.largest_unit == LLAMA3_8B - 32 * 218_112_000   # FSDP2's root: embedding, head, norm


@pytest.mark.parametrize("strategy,n", [("zero2", 2), ("zero2", 8), ("zero2", 64), ("zero3", 8), ("zero3", 64)])
def test_zero_model_states_equal_deepspeeds_own_estimator(llama_layers, strategy, n):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    s2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    s3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    sh = S.Sharding(n, strategy)
    ours = S.model_state_bytes(LLAMA3_8B, sh, llama_layers, 2, 0)
    if strategy == "zero3":
        _, theirs, _ = s3.estimate_zero3_model_states_mem_needs(LLAMA3_8B, llama_layers.largest_layer, n, 1,
                                                                cpu_offload=False)
    else:
        _, theirs = s2.estimate_zero2_model_states_mem_needs(LLAMA3_8B, n, 1, cpu_offload=False)
    assert abs(ours - theirs) <= 18, (ours, theirs)    # DeepSpeed truncates 18Ψ/N, gpulab rounds each shard up
    assert S.deepspeed_estimate(LLAMA3_8B, sh, llama_layers) == theirs
    if strategy == "zero2":   # offloaded: the 16-bit weights alone stay, as DeepSpeed's estimator says
        _, off = s2.estimate_zero2_model_states_mem_needs(LLAMA3_8B, n, 1, cpu_offload=True)
        assert S.model_state_bytes(LLAMA3_8B, S.Sharding(n, strategy, True), llama_layers, 2, 0) == off


def test_zero1_is_the_papers_p_os_with_deepspeeds_sixteen_bytes(llama_layers):
    for n in (2, 8, 64):
        assert S.model_state_bytes(LLAMA3_8B, S.Sharding(n, "zero1"), llama_layers, 2, 0) == \
            F.zero_bytes_per_device(LLAMA3_8B, n, 1, optimizer_bytes_per_param=16)


def test_lesson_12s_question_two_80_gib_cards_do_not_hold_zero2_three_do(llama_layers):
    """DeepSpeed's figure at N = 2 is 88 GB a GPU: more than an 80 GiB card (85.9 GB); the paper's
    formula (2 + (2 + 12)/N) says 72 GB."""
    card = 80 * 2**30
    per_gpu = {n: S.model_state_bytes(LLAMA3_8B, S.Sharding(n, "zero2"), llama_layers, 2, 0) for n in (2, 3)}
    assert per_gpu[2] > card > per_gpu[3]
    assert F.zero_bytes_per_device(LLAMA3_8B, 2, 2) < card     # the paper's model states alone would fit


@pytest.fixture(scope="module")
def gpt2_runs():
    return {st: fit("hf:gpt2", "80GiB", optimizer="adamw", dtype="bf16", seq_len=64,
                    gpus=None if st is None else 4, strategy=st) for st in (None, "ddp", "zero2", "zero3", "fsdp2")}


def test_one_rank_holds_less_as_more_is_sharded(gpt2_runs):
    peak = {k: v.peak_bytes for k, v in gpt2_runs.items()}
    # at the same batch the peaks order as the strategies shard; the answer's batch grows with it
    assert gpt2_runs["ddp"].largest_batch <= gpt2_runs[None].largest_batch <= gpt2_runs["fsdp2"].largest_batch
    assert all(v.sharding.startswith("4 GPUs, " + (k or "")) for k, v in gpt2_runs.items() if k)
    assert gpt2_runs[None].sharding == "" and peak["ddp"] > 0


def test_per_rank_resizes_each_storage_as_the_strategy_holds_it():
    """The one-GPU run's parameters, gradients and optimizer state, resized storage by storage:
    their largest bytes over the run against the strategy's formula on the one-GPU figures."""
    from gpulab.predict.fake_runs import fake_run as _run
    from gpulab.models.workload import resolve_workload
    from gpulab.training.loop import user_recipe
    w = resolve_workload("hf:gpt2", seq_len=32)
    one = _run(w, 1, torch.bfloat16, user_recipe("adamw", None)).tracking
    with torch.device("meta"):
        layers = S.count_layers(w.build(torch.device("meta"), torch.bfloat16))
    n, p = 4, layers.total

    def most(t, cat):
        return max(row.get(cat, 0) for row in t.series)

    def near(a, b, storages):   # each storage rounded up to 512 B on the CUDA target, its shard to a byte
        return abs(a - b) <= 513 * storages

    k = {c: sum(1 for r in one.records.values() if r.category.value == c)
         for c in ("parameters", "gradients", "optimizer_state")}
    assert near(most(one, "parameters"), 2 * p, k["parameters"])
    g1 = S.one_step_gradients(one)
    assert near(g1, 2 * p, k["gradients"])
    for strategy in ("ddp", "zero1", "zero2", "zero3", "fsdp2"):
        t = S.per_rank(one, S.Sharding(n, strategy), layers, 2)
        gathered = {"zero3": 4 * layers.largest_layer, "fsdp2": 4 * layers.largest_unit}.get(strategy, 0)
        params = 2 * p // n if strategy in ("zero3", "fsdp2") else 2 * p
        state = {"ddp": 4 * p, "fsdp2": 4 * p // n}.get(strategy, 16 * p // n)
        grads = {"ddp": most(one, "gradients") + g1, "zero1": most(one, "gradients"), "zero3": 0}.get(
            strategy, most(one, "gradients") // n)
        assert near(most(t, "parameters"), params + gathered, k["parameters"] + 1), strategy
        assert near(most(t, "optimizer_state"), state, k["optimizer_state"]), strategy
        assert near(most(t, "gradients"), grads, 2 * k["gradients"] + 1), strategy
        # foreach AdamW's step makes parameter-sized copies: on a sharded optimizer, the shard's
        assert stepped(one) >= 2 * p, stepped(one)
        assert stepped(t) == (stepped(one) if strategy == "ddp" else stepped(one, n, strategy == "fsdp2")), strategy


def stepped(t, n=1, rows=False):
    """The bytes the optimizer step's temporaries are made with (each split ``n`` ways, rounded up; with
    ``rows``, FSDP2's rank-0 shard of a tensor of the parameter's shape, ``ceil(d0 / n)`` rows)."""
    ids = {sid for sid, r in t.records.items() if r.category.value == "temporaries" and r.phase == "optimizer"}

    def share(e):
        r = t.records[e.sid]
        d0 = r.shape[0] if rows and r.shape and math.prod(r.shape) * getattr(torch, r.dtype).itemsize == r.nbytes else 0
        return -(-d0 // n) * (e.nbytes // d0) if d0 and e.nbytes % d0 == 0 else -(-e.nbytes // n)
    return sum(share(e) for e in t.events if e.kind == "alloc" and e.sid in ids)


@pytest.mark.parametrize("kw,msg", [
    (dict(gpus=4), "name how the step is spread"),
    (dict(strategy="fsdp2"), "say how many with gpus=N"),
    (dict(offload_optimizer=True), "say how many with gpus=N"),
    (dict(gpus=2, strategy="zero2", lora=4), "with LoRA or QLoRA use fsdp2"),
    (dict(gpus=0, strategy="ddp"), "1 or more"),
    (dict(gpus=2, strategy="zero4"), "unknown strategy"),
    (dict(gpus=2, strategy="ddp", offload_optimizer=True), "ddp keeps the optimizer"),
    (dict(gpus=2, strategy="zero3", optimizer="sgd"), "use optimizer adam or adamw"),
    (dict(gpus=2, strategy="zero2", dtype=None), "use dtype bf16"),
])
def test_what_cannot_be_answered_says_what_to_do(kw, msg):
    args = dict(optimizer="adamw", dtype="bf16", seq_len=16)
    args.update(kw)
    with pytest.raises(ValueError, match=msg):
        fit("hf:gpt2", "80GiB", **args)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp2_per_rank_matches_lesson_12s_gloo_measurement():
    """Lesson 12 measures FSDP2 (fully_shard on every layer and the root) in two gloo processes;
    per_rank, from one process's run of the same model, gives each rank's sharded parameters,
    gradients and Adam state to FSDP2's padding, and bounds what it gathers while computing."""
    import gpulab
    from gpulab.distributed.sharding import StrategySpec, batch, build, measure_strategies
    spec = StrategySpec("fsdp2", "transformer", width=64, layers=2, batch=4, seq_len=16, steps=2)
    (measured,) = measure_strategies([spec], world_size=2, timeout_s=300)
    x, _ = batch("transformer", spec.batch, spec.seq_len, seed=0)
    one = gpulab.step(lambda: build("transformer", spec.width, spec.layers), x, batch=spec.batch,
                      optimizer="adam", engine="cpu", loss=lambda out: out.float().pow(2).mean())
    model = build("transformer", spec.width, spec.layers)
    layers = S.count_layers(model)
    rank = S.per_rank(one.measurement.tracking, S.Sharding(2, "fsdp2"), layers, 4)
    n_tensors = sum(1 for _ in model.parameters())
    pad = 2 * 4 * n_tensors          # FSDP2 pads each parameter's shard to a multiple of the world size
    m = measured.measured(0)
    gathered = 4 * layers.largest_unit * 4 // 2    # the two copies per_rank adds, in fp32

    def most(cat):
        return max(row.get(cat, 0) for row in rank.series)
    assert abs(m["parameters"] - (most("parameters") - 2 * layers.largest_unit * 4)) <= pad, (m, most("parameters"))
    assert abs(m["optimizer_state"] - most("optimizer_state")) <= 2 * pad, (m, most("optimizer_state"))
    assert abs(m["gradients"] - S.one_step_gradients(one.measurement.tracking) / 2) <= pad, m
    assert m["parameters while computing"] <= most("parameters"), (m, most("parameters"), gathered)


def test_fsdp2_holds_rank_zeros_padded_shard_as_fully_shard_allocates_it():
    """FSDP2 chunks each parameter on dim 0 and allocates every rank's shard at the first chunk's size
    (``FSDPParam._init_sharded_param``: ``padded_sharded_param_size``). A router-like (8, 64) weight over
    16 ranks: rank 0 holds 1 row, twice numel / 16. torch's own ``fully_shard`` on the fake process group
    (rank 0 of 16) gives the padded size; gpulab's per_rank holds it for the parameter, its gradient and
    each moment, where a (64, 64) weight splits evenly. ``ceil(bytes / n)`` (the unpadded split) would not."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from gpulab.categories import Category
    from gpulab.measure.records import Event, StorageRecord, TrackingResult
    n = 16
    net = torch.nn.Sequential(torch.nn.Linear(64, 8, bias=False), torch.nn.Linear(64, 64, bias=False))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        fully_shard(net, mesh=init_device_mesh("cpu", (n,)))
        fsdp = {tuple(p._orig_size): p for p in net._get_fsdp_state()._fsdp_param_group.fsdp_params}
        theirs = {shape: p._sharded_param_data.numel() * 4 for shape, p in fsdp.items()}   # fp32, padded storage
    finally:
        dist.destroy_process_group()
    assert theirs == {(8, 64): 1 * 64 * 4, (64, 64): 4 * 64 * 4}
    records, events, sid = {}, [], 0
    for shape in theirs:
        for cat in (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE, Category.OPTIMIZER_STATE):
            nbytes = shape[0] * shape[1] * 4
            records[sid] = StorageRecord(sid, nbytes, "cuda:0", "float32", shape, cat, "", "forward", "x", sid)
            events.append(Event(sid, "alloc", sid, nbytes, nbytes, "cuda:0", "forward", "", 0.0))
            sid += 1
    t = TrackingResult.build(records, events, "cuda:0", rounded=False)
    rank = S.per_rank(t, S.Sharding(n, "fsdp2"), S.Layers(0, 0, 0), 4)
    held = {}
    for e in rank.events:
        r = rank.records[e.sid]
        if r.op == "x":
            held.setdefault((tuple(r.shape), r.category), []).append(e.nbytes)
    for shape, nbytes in theirs.items():
        for cat in (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE):
            assert set(held[shape, cat]) == {nbytes}, (shape, cat, held[shape, cat])
    assert -(-8 * 64 * 4 // n) != theirs[(8, 64)]   # the unpadded split differs: the test can fail
