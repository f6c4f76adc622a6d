"""Tensor and sequence parallelism measured per rank on PyTorch's fake process group
(gpulab.training.tensor_parallel), against counts made independently of the run."""
from __future__ import annotations

import pytest
import torch

import gpulab
from gpulab.models import hf_configs
from gpulab.training.tensor_parallel import check_tensor_parallel

SEQ, BATCH = 64, 2


def _config(layers: int = 2):
    cfg = hf_configs.make_config("tiny-llama")
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size = 4, 4, 176
    cfg.num_hidden_layers = layers
    return cfg


def _step(tp: int, sp: bool = False):
    return gpulab.step(_config(), batch=BATCH, seq_len=SEQ, optimizer="adamw", dtype="bf16", engine="fake",
                       tp=tp, sequence_parallel=sp)


def _split_params(cfg, tp: int) -> int:
    """One rank's parameter bytes in bf16, counted from the config: q, k, v, o, gate, up, down and the
    head split tp ways; the norms whole on every rank; the embedding split by vocabulary, with or
    without sequence parallelism (torchtitan's layout, transformers' own ``embedding_rowwise``)."""
    h, f, v, n = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    split = n * (h * h + 2 * h * kv + h * h + 3 * h * f) + v * h * (0 if cfg.tie_word_embeddings else 1)
    whole = n * 2 * h + h
    embedding = v * h
    return 2 * (split // tp + whole + embedding // tp)


@pytest.mark.parametrize("tp,sp", [(2, False), (4, False), (2, True), (4, True)])
def test_parameters_and_adam_state_per_rank(tp, sp):
    r = _step(tp, sp)
    params = _split_params(_config(), tp)
    by = r.tensor_bytes_by_category
    assert by["parameters"] == pytest.approx(params, abs=512 * 40)     # 512-byte blocks, one per tensor
    assert by["optimizer_state"] == pytest.approx(2 * params, abs=512 * 80)
    assert r.as_dict()["recipe"]["tp"] == tp


def test_activations_are_a_replicated_part_plus_a_split_part():
    """Without sequence parallelism the norms' inputs and the residual stream are whole on every rank
    and the attention and MLP insides are split: A(t) = R + S/t (Korthikanti et al. 2022, Table 2:
    sbh(10 + 24/t + 5as/(ht)) for GPT-3's block), plus E at t > 1, so A(1) - A(2) = 2 (A(2) - A(4)) - E."""
    a = {tp: _step(tp).tensor_bytes_by_category["activations"] for tp in (1, 2, 4)}
    # E: what the vocabulary-parallel embedding saves at any tp > 1: its local token ids (int64) for the
    # lookup's backward and its mask (in the model's bf16) for the masking multiply's
    e = BATCH * SEQ * (8 + 2)
    assert a[1] - a[2] == 2 * (a[2] - a[4]) - e
    assert a[2] - a[4] > 0


def test_sequence_parallelism_splits_what_tensor_parallelism_leaves_whole():
    """With sequence parallelism every activation of the blocks is split t ways, except what PyTorch's
    DTensor keeps that Megatron-LM does not: the all-gathered input of each column-wise projection
    is saved for its backward (Megatron saves its sequence shard and gathers again in backward) and the
    gathered logits; so A_sp(t) = G + (R + S)/t, and A_sp(2) - A_sp(4) = (R + S)/4 exactly, with
    R + S the non-SP run's A(1) less what it does not split (its G-like terms)."""
    sp = {tp: _step(tp, True).tensor_bytes_by_category["activations"] for tp in (2, 4)}
    plain = {tp: _step(tp).tensor_bytes_by_category["activations"] for tp in (2, 4)}
    assert sp[2] < plain[2] and sp[4] < plain[4]
    split_part = 4 * (sp[2] - sp[4])            # R + S
    assert sp[2] - split_part // 2 == sp[4] - split_part // 4     # the same G at both degrees


def _loss_parallel_saves(tp: int) -> int:
    """The activations loss parallelism leaves out at ``tp``: without it every rank saves the whole
    vocabulary's fp32 log-softmax (transformers' loss upcasts the gathered logits), with it the rank's
    vocabulary shard; D(t) = L·(1 - 1/t) - x, x the loss-parallel cross-entropy's own per-token values."""
    a = {lp: gpulab.step(_config(), batch=BATCH, seq_len=SEQ, optimizer="adamw", dtype="bf16", engine="fake", tp=tp,
                         loss_parallel=lp).tensor_bytes_by_category["activations"] for lp in (False, True)}
    return a[False] - a[True]


def test_loss_parallel_splits_the_logits_activations():
    """L = 4·B·S·V, the fp32 log-softmax of the logits: D(2) = L/2 - x, x within B·S fp32 pairs."""
    logits = BATCH * SEQ * _config().vocab_size
    assert _loss_parallel_saves(2) == pytest.approx(4 * logits / 2, abs=BATCH * SEQ * 8 + 64)


@pytest.mark.extended
def test_loss_parallel_splits_the_logits_activations_exactly():
    """L = 4·(D(4) - D(2)), x cancelled: the whole fp32 log-softmax, 4 bytes a logit, to the byte."""
    assert 4 * (_loss_parallel_saves(4) - _loss_parallel_saves(2)) == 4 * BATCH * SEQ * _config().vocab_size


def test_layouts_that_do_not_divide_are_refused_in_one_line():
    cfg = _config()
    with pytest.raises(ValueError, match="--tp 3 does not divide num_attention_heads = 4"):
        check_tensor_parallel(cfg, 3)
    with pytest.raises(ValueError, match="give --tp 2 or more"):
        check_tensor_parallel(cfg, 1, sequence_parallel=True)
    with pytest.raises(ValueError, match="loss parallelism .* give --tp 2 or more"):
        gpulab.Layout(loss_parallel=True)
    with pytest.raises(ValueError, match="no tensor-parallel plan"):
        check_tensor_parallel(hf_configs.make_config("tiny-gpt2"), 2)
    with pytest.raises(ValueError, match="fake engine"):
        gpulab.step(cfg, batch=2, seq_len=16, optimizer="adamw", engine="cpu", tp=2)
    with pytest.raises(ValueError, match="leave out lora"):
        gpulab.step(cfg, batch=2, seq_len=16, optimizer="adamw", engine="fake", tp=2, lora=4)


def test_fit_answers_per_rank_with_tp_over_the_gpus():
    """gpulab.fit with tp: the batch one rank of the tensor-parallel group fits; with gpus, tp divides it."""
    cfg = _config()
    one = gpulab.fit(cfg, "24MiB", optimizer="adamw", dtype="bf16", seq_len=SEQ, context_bytes=0)
    four = gpulab.fit(cfg, "24MiB", optimizer="adamw", dtype="bf16", seq_len=SEQ, context_bytes=0, tp=4)
    assert four.largest_batch > one.largest_batch
    with pytest.raises(ValueError, match="not a multiple of tp=4"):
        gpulab.fit(cfg, "24MiB", optimizer="adamw", dtype="bf16", seq_len=SEQ, context_bytes=0, tp=4, gpus=6,
                   strategy="fsdp2")


def _megatron_shard(cfg, tp: int) -> float:
    """Parameters on one rank as Megatron-LM's theoretical_memory_usage.py counts them
    (compute_weight_and_optimizer_memory, pipeline size 1): the transformer layers'
    2·L·h²·((1 + g/a)·q/h + (f/h)·3/2 + 2/h + 1/(L·h)), with SwiGLU's 3/2, plus the embedding and an
    untied output layer, all divided by the tensor-parallel size."""
    L, h, f, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    a, g = cfg.num_attention_heads, cfg.num_key_value_heads
    layers = 2 * L * h * h * ((1 + g / a) * 1 + (f / h) * 1.5 + 2 / h + 1 / (L * h))
    embeddings = h * V * (1 if cfg.tie_word_embeddings else 2)
    return (layers + embeddings) / tp


@pytest.mark.parametrize("tp", [2, 4])
def test_parameters_per_rank_against_megatrons_formula(tp):
    """The split model's own parameters on rank 0 (DTensors' local shards, counted from the module)
    against Megatron-LM's count. The terms that differ, documented: Megatron counts each norm as a
    LayerNorm's weight and bias (2h; a Llama RMSNorm has h) and divides every parameter by the
    tensor-parallel size, where sequence parallelism keeps the norms whole on every rank."""
    from torch.distributed.tensor import DTensor

    from gpulab.training.tensor_parallel import fake_world, tensor_parallel
    cfg = _config()
    with fake_world(tp) as mesh, torch.device("meta"):
        model = tensor_parallel(hf_configs.build_model(cfg, torch.bfloat16), mesh, sequence_parallel=True)
        ours = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    L, h = cfg.num_hidden_layers, cfg.hidden_size
    megatron_norms, our_norms = (2 * L * 2 * h + 2 * h) / tp, 2 * L * h + h
    assert ours == pytest.approx(_megatron_shard(cfg, tp) - megatron_norms + our_norms, abs=0.5)


def test_lesson_12s_table_and_exercise():
    from gpulab.course.tensor_parallel import exercise_tp_activations, tp_table
    table = tp_table()
    assert [(r.tp, r.sequence_parallel) for r in table.rows] == [(1, False), (2, False), (2, True), (4, False),
                                                                  (4, True)]
    assert table.row(4, True).activations < table.row(4).activations < table.row(2).activations
    ex = exercise_tp_activations(table)
    assert ex.check(table.row(4).activations).ok
    assert not ex.check(table.row(2).activations).ok
    assert "fake process group" in table._repr_html_()


def test_a_plans_own_embedding_entry_is_the_same_vocabulary_split():
    """A plan that names the embedding ``embedding_rowwise`` (transformers 5.15 adds it to a tied config's
    plan; 5.25's lfm2 and diffllama configs have it) gets the same vocabulary-parallel embedding as one
    that does not; a style gpulab does not measure is still refused in one line."""
    from torch.distributed.tensor import DTensor

    from gpulab.training.tensor_parallel import fake_world, tensor_parallel
    from transformers import AutoModelForCausalLM
    cfg = _config()
    shapes = []
    for entry in ({}, {"embed_tokens": "embedding_rowwise"}):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        model.config.base_model_tp_plan = {**(model.config.base_model_tp_plan or {}), **entry}
        with fake_world(2) as mesh:
            weight = tensor_parallel(model, mesh).model.embed_tokens.weight
            assert isinstance(weight, DTensor)
            shapes.append(tuple(weight.to_local().shape))
    assert shapes == [(cfg.vocab_size // 2, cfg.hidden_size)] * 2
    model.config.base_model_tp_plan = {**model.config.base_model_tp_plan, "norm": "sequence_parallel"}
    with fake_world(2) as mesh, pytest.raises(ValueError, match="'sequence_parallel' of norm is not one"):
        tensor_parallel(model, mesh)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied head"])
def test_setup_holds_only_the_ranks_shard(tied):
    """A rank's setup never holds the whole model: built on meta, split there, then given storage
    (torchtitan's meta build, parallelize, ``to_empty``). Its setup peak is its own parameters (counted
    from the config) plus the batch's token ids and labels, under the whole model's bytes; a tied head
    stays one parameter with the embedding."""
    cfg = _config()
    cfg.tie_word_embeddings = tied
    r = gpulab.step(cfg, batch=BATCH, seq_len=SEQ, optimizer="adamw", dtype="bf16", engine="fake", tp=2)
    tracking = r.measurement.tracking
    setup = max(sum(tracking.series[i].values()) for i, e in enumerate(tracking.events) if e.phase == "setup")
    local, whole = _split_params(cfg, 2), _split_params(cfg, 1)
    inputs = 2 * BATCH * SEQ * 8   # int64 token ids and labels
    assert r.tensor_bytes_by_category["parameters"] == pytest.approx(local, abs=512 * 40)   # 512-byte blocks
    assert local + inputs <= setup <= local + inputs + 512 * 40
    assert setup < whole


def test_the_vocabulary_parallel_embedding_makes_no_reference_cycle():
    """The split embedding's forward lives in the module's __dict__ and holds the module weakly: the module
    dies with its last reference, no gc.collect needed (a cycle kept a fake run's storages alive after its
    step, so ``measure.engines`` paid a full collection after every first-stage run). Its lookup is still the
    rank's: rank 0 holds rows 0..V/2-1, the other tokens are zero before the (fake) all-reduce."""
    import gc
    import weakref

    from torch.distributed.tensor import Replicate

    from gpulab.training.tensor_parallel import fake_world, vocab_parallel_embedding
    torch.manual_seed(0)
    whole = torch.randn(16, 4)
    ids = torch.tensor([[0, 3, 7, 8, 15]])
    enabled = gc.isenabled()
    gc.disable()
    try:
        with fake_world(2) as mesh:
            module = torch.nn.Embedding(16, 4)
            module.weight.data.copy_(whole)
            out = vocab_parallel_embedding(module, mesh, Replicate())(ids)
            dead = weakref.ref(module)
            del module
            assert dead() is None, "the split embedding is kept alive by a reference cycle"
    finally:
        if enabled:
            gc.enable()
    expected = torch.where((ids < 8).unsqueeze(-1), whole[ids.clamp(max=7)], torch.zeros(()))
    assert torch.equal(out, expected)


@pytest.mark.extended   # two fake pipeline-stage runs: some 10 s on 2 cores
def test_a_pipeline_tp_rank_needs_no_collection_and_answers_as_one_with_the_cycle():
    """Stage 0 of a pp 2 × tp 2 step (sequence parallel: the embedding reduce-scattered) leaves no tracked
    storage for ``gc.collect`` to free, and its timeline is event for event, byte for byte, the one made with
    the old reference cycle put back (the module holding itself: its storages then freed by the collection
    after the run) up to its last allocation; after it the same storages are freed, the embedding's sooner.
    So the same peaks and the same reserved peak."""
    from gpulab.allocator.simulator import CachingAllocator
    from gpulab.measure import engines
    from gpulab.training import tensor_parallel

    def run():
        r = gpulab.step(_config(), batch=BATCH, seq_len=SEQ, optimizer="adamw", dtype="bf16", engine="fake",
                        tp=2, sequence_parallel=True, pp=2, pp_stage=0)
        return r.measurement.tracking

    collected = []
    real_gc = engines.gc

    class Counting:
        def __getattr__(self, name):
            return getattr(real_gc, name)

        def collect(self, *args):
            collected.append(args)
            return real_gc.collect(*args)
    split = tensor_parallel.vocab_parallel_embedding

    def with_cycle(module, mesh, layout):   # the old forward's hold on its module, as a cycle
        out = split(module, mesh, layout)
        module.__dict__["_held"] = module
        return out
    engines.gc = Counting()
    try:
        fast = run()
        assert collected == [], "a stage-0 TP run left a tracked storage for gc.collect"
        tensor_parallel.vocab_parallel_embedding = with_cycle
        try:
            slow = run()
        finally:
            tensor_parallel.vocab_parallel_embedding = split
        assert collected, "the cycle put back should have needed a collection"
    finally:
        engines.gc = real_gc

    def events(t):
        return [(e.kind, e.nbytes, e.phase, t.records[e.sid].category) for e in t.events]
    a, b = events(fast), events(slow)
    last = max(i for i, e in enumerate(a) if e[0] != "free")   # after it: only the run's end, freeing
    assert a[:last + 1] == b[:last + 1] and sorted(a[last + 1:]) == sorted(b[last + 1:])
    assert (fast.peak_bytes, fast.peak_by_category) == (slow.peak_bytes, slow.peak_by_category)
    assert CachingAllocator().replay_peak(fast.events) == CachingAllocator().replay_peak(slow.events)
    assert fast.final_by_category == slow.final_by_category
