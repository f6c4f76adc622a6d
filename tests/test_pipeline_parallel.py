"""Pipeline parallelism measured per stage (gpulab.training.pipeline, gpulab.predict.pipeline_fit): the
stage split, the schedules' in-flight counts, the per-rank answer, the refusals, and Megatron-LM's
report_theoretical_memory for weights and optimizer state per rank under TP x PP x DP."""
from __future__ import annotations

import pytest
import torch

import gpulab
from gpulab.models import hf_configs
from gpulab.predict.layer_repeat import with_depth
from gpulab.training.pipeline import (check_pipeline, check_pp_options, distinct_stages, in_flight,
                                      interleaved_actions, pipeline_stage)

SEQ = 32


def _config(layers: int = 4, vocab: int = 1024):
    cfg = hf_configs.make_config("tiny-llama")
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size = 4, 4, 176
    cfg.num_hidden_layers, cfg.vocab_size = layers, vocab
    return cfg


def _counts(cfg):
    """(one block's parameters, the embedding's, the final norm's), counted from the config."""
    h, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    return 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h, v * h, h


def test_stages_hold_their_share_of_the_layers_and_the_ends():
    cfg = _config(layers=8)
    block, embedding, norm = _counts(cfg)
    want = {0: 2 * block + embedding, 1: 2 * block, 2: 2 * block, 3: 2 * block + norm + embedding}   # untied head
    for stage, params in want.items():
        small = with_depth(cfg, 2)   # a stage of 8 / 4 layers, as fit and step build it
        with torch.device("meta"):
            part = pipeline_stage(hf_configs.build_model(small, torch.bfloat16), 4, stage)
        assert sum(p.numel() for p in part.parameters()) == params, stage


def test_the_schedules_counts():
    """GPipe: every stage holds all M; 1F1B: stage i holds min(pp - i, M) (the schedule's count)."""
    assert [in_flight("gpipe", s, 4, 8) for s in range(4)] == [8, 8, 8, 8]
    assert [in_flight("1f1b", s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", s, 4, 2) for s in range(4)] == [2, 2, 2, 1]
    shapes = distinct_stages(4, 8, "1f1b")
    assert [(s.stages, s.role, s.in_flight, s.bounded_by) for s in shapes] == [
        ((0,), "first", 4, None), ((1,), "middle", 3, None), ((2,), "middle", 2, 1), ((3,), "last", 1, None)]
    gpipe = distinct_stages(8, 8, "gpipe")
    assert [(s.stages, s.role) for s in gpipe] == [((0,), "first"), ((1, 2, 3, 4, 5, 6), "middle"), ((7,), "last")]


def _stage(stage: int, schedule: str = "1f1b", microbatches: int = 8, engine: str = "fake", **kw):
    return gpulab.step(_config(), batch=2, seq_len=SEQ, optimizer="adamw", dtype="bf16", engine=engine,
                       fake_target="cpu", pp=4, pp_stage=stage, schedule=schedule, microbatches=microbatches, **kw)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_a_fake_stage_equals_a_real_cpu_stage(stage):
    """One micro-batch through a stage on fake tensors (CPU kernels) equals the same on real CPU tensors
    but for the causal mask: transformers materializes it when it cannot read the mask's values, and
    attention saves it, (B, 1, S, S); the real CPU run skips it."""
    fake, real = _stage(stage, microbatches=1), _stage(stage, microbatches=1, engine="cpu")
    ours, theirs = fake.tensor_bytes_by_category, real.tensor_bytes_by_category
    mask = 2 * SEQ * SEQ * 2                     # (2, 1, S, S) in bf16, held while the micro-batch is
    assert ours.pop("activations") - theirs.pop("activations") in (0, mask)
    assert ours == theirs
    assert fake.peak_bytes - real.peak_bytes in (0, mask)


def test_in_flight_activations_are_measured_per_micro_batch():
    """The first stage's activations grow by one micro-batch's with each one in flight (1F1B holds
    min(4, M) there), and under 1F1B the first stage holds more than the last; GPipe holds M everywhere."""
    acts = {m: _held(_stage(0, microbatches=m)) for m in (1, 2, 4)}
    assert acts[4] - acts[2] == 2 * (acts[2] - acts[1]) > 0
    first, last = (_held(_stage(s)) for s in (0, 3))
    assert first > last
    gpipe_first = _held(_stage(0, schedule="gpipe"))
    assert gpipe_first - first == 4 * (acts[2] - acts[1])    # 8 in flight instead of 4


def _held(result) -> int:
    """The most activations the step held at once (the stage's peak can fall in its optimizer step)."""
    return max(s["activations"] for s in result.measurement.tracking.series)


def test_tensor_and_sequence_parallel_stages():
    """pp with tp (and SP): a middle stage receives a sequence shard; its parameters are split."""
    whole = _stage(1).tensor_bytes_by_category
    split = gpulab.step(_config(), batch=2, seq_len=SEQ, optimizer="adamw", dtype="bf16", engine="fake",
                        fake_target="cpu", pp=4, pp_stage=1, tp=2, sequence_parallel=True).tensor_bytes_by_category
    assert split["parameters"] < whole["parameters"] and split["activations"] < whole["activations"]


def test_bad_layouts_and_options_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"--pp 3 does not divide num_hidden_layers = 4: .*\(1, 2, 4\)"):
        check_pipeline(_config(), 3)
    with pytest.raises(ValueError, match="decoder language models"):
        gpulab.step("resnet18", batch=2, optimizer="adamw", engine="fake", pp=2)
    with pytest.raises(ValueError, match="give --pp 2 or more"):
        gpulab.step(_config(), batch=2, seq_len=SEQ, engine="fake", microbatches=4)
    with pytest.raises(ValueError, match="schedule must be one of 1f1b, gpipe"):
        gpulab.step(_config(), batch=2, seq_len=SEQ, engine="fake", pp=2, schedule="zigzag")
    with pytest.raises(ValueError, match="pp_stage must be a stage from 0 to 1"):
        gpulab.step(_config(), batch=2, seq_len=SEQ, engine="fake", pp=2, pp_stage=2)
    with pytest.raises(ValueError, match="leave out accumulate with pp"):
        gpulab.step(_config(), batch=2, seq_len=SEQ, engine="fake", pp=2, accumulate=2)
    with pytest.raises(ValueError, match=r"not a multiple of tp × pp = 2 × 2 = 4: .*gpus = dp × tp × pp"):
        gpulab.fit(_config(), "1GiB", optimizer="adamw", seq_len=SEQ, context_bytes=0, tp=2, pp=2, gpus=6)


def _megatron_params(cfg, tp: int, pp: int) -> tuple[float, float]:
    """(the most loaded shard's parameters, every other shard's) as Megatron-LM's
    compute_weight_and_optimizer_memory counts them (megatron/training/theoretical_memory_usage.py):
    the transformer layers 2·L·h²·((1 + g/a)·q/h + (f/h)·3/2 + 2/h + 1/(L·h)) with SwiGLU's 3/2, the
    embedding h·V (V padded to a multiple of 128·tp: 1,024 here needs none); the most loaded shard
    (1/pp of the layers + the embedding)/tp, the others (1/pp of the layers)/tp."""
    L, h, f, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    a, g = cfg.num_attention_heads, cfg.num_key_value_heads
    assert V % (128 * tp) == 0
    layers = 2 * L * h * h * ((1 + g / a) * 1 + (f / h) * 1.5 + 2 / h + 1 / (L * h))
    return (layers / pp + h * V) / tp, layers / (pp * tp)


def test_weights_and_optimizer_state_per_rank_against_megatron():
    """gpulab fit's per-stage answer (tp 2 × pp 2 × dp 2, ZeRO-1 in bf16 with Adam) against Megatron-LM's
    report_theoretical_memory, its formula computed here. With its distributed optimizer Megatron counts
    6 + 12/dp bytes a parameter: a bf16 weight (2) and an fp32 gradient (4) on every rank, an fp32 main
    copy of the weight (4) and Adam's two fp32 moments (8) split dp ways. gpulab's ZeRO-1 follows
    DeepSpeed's layout: the same bf16 weights (2) and the same 12/dp of optimizer state (fp32 master
    copy and moments), compared byte for byte, plus DeepSpeed's fp32 gradient partition (4/dp, which
    gpulab files with the optimizer state; Megatron keeps a whole fp32 gradient on every rank, its 4 of 6). The parameter counts differ by documented terms only:
    - norms: Megatron counts each as a LayerNorm's weight and bias (2h) split by tp, the final one
      spread over the stages (2h/pp each); a Llama RMSNorm has h, whole on every tp rank (sequence
      parallelism), the final one on the last stage;
    - the untied output head: Megatron's "other shards" have layers only; gpulab's last stage holds
      the head (h·V/tp, as heavy as the first stage's embedding), so it is as loaded as the first."""
    cfg, tp, pp, dp = _config(), 2, 2, 2
    fit = gpulab.fit(cfg, "1GiB", optimizer="adam", dtype="bf16", seq_len=SEQ, context_bytes=0, tp=tp, pp=pp,
                     gpus=tp * pp * dp, strategy="zero1", sequence_parallel=True)
    rows = {r.role: r for r in fit.ranks}
    most, other = _megatron_params(cfg, tp, pp)
    L, h, V = cfg.num_hidden_layers // pp, cfg.hidden_size, cfg.vocab_size
    megatron_norms = (L * 2 * 2 * h + 2 * h / pp) / tp
    ours = {"first": most - megatron_norms + L * 2 * h,
            "last": other - megatron_norms + L * 2 * h + h + h * V / tp}
    tensors = {"first": 1 + L * 9, "last": L * 9 + 2}
    for role, n in ours.items():
        by = rows[role].peak_by_category
        slack = 512 * tensors[role]   # the fake CUDA target's 512-byte blocks, one per tensor
        assert by["parameters"] == pytest.approx(2 * n, abs=slack), role
        megatron_sharded = 12 * n / dp           # its fp32 main copy and Adam's moments, dp ways
        deepspeed_grads = 4 * n / dp             # DeepSpeed's fp32 gradient partition, filed as optimizer state
        assert by["optimizer_state"] == pytest.approx(megatron_sharded + deepspeed_grads, abs=3 * slack), role


def test_fit_answers_per_rank_for_every_stage_shape():
    cfg = _config(layers=8)
    f = gpulab.fit(cfg, "1GiB", optimizer="adamw", dtype="bf16", seq_len=SEQ, context_bytes=0, tp=2, pp=4,
                   microbatches=8, gpus=16, strategy="zero1")
    assert sorted(s for r in f.ranks for s in r.stages) == [0, 1, 2, 3]
    assert [r.ranks for r in f.ranks] == ["ranks 0-3", "ranks 4-7", "ranks 8-11", "ranks 12-15"]
    run = [r for r in f.ranks if r.peak_bytes is not None]
    assert len(run) == 3 and sum(r.binds for r in f.ranks) == 1
    assert all(r.largest_batch >= f.largest_batch for r in run)
    assert "schedule's count" in f.label and "1f1b, 8 micro-batches" in f.pipeline
    assert f.as_dict()["ranks"][0]["role"] == "first"


@pytest.mark.parametrize("stage,schedule", [(0, "1f1b"), (1, "1f1b"), (3, "gpipe")])
def test_held_copies_peak_as_the_real_micro_batches_do(stage, schedule):
    """fit runs one micro-batch per stage and holds the schedule's others as copies of what its forward
    kept (predict.pipeline_fit.hold_in_flight): the same peak, category by category, as running all of
    them forward, then backward (gpulab.step's run), on the fake CUDA target."""
    from gpulab.measure.engines import run
    from gpulab.models.workload import resolve_workload
    from gpulab.predict.pipeline_fit import hold_in_flight
    from gpulab.training.loop import LoopRecipe, train_experiment
    w = resolve_workload(with_depth(_config(8), 2), seq_len=SEQ)

    def timeline(microbatches: int):
        r = LoopRecipe("adamw", pp=4, pp_stage=stage, microbatches=microbatches, schedule=schedule)
        return run(train_experiment(w, [2, 2], torch.bfloat16, r), "fake", fake_target="cuda").tracking
    real, made = timeline(8), hold_in_flight(timeline(1), in_flight(schedule, stage, 4, 8))
    assert made.peak_bytes == real.peak_bytes
    assert made.peak_by_category == real.peak_by_category


def test_lesson_12s_pipeline_table_and_exercise():
    from gpulab.course.pipeline import exercise_gpipe_first_stage, layout_states, pp_table
    table = pp_table()
    first, last = table.row("1f1b", 0), table.row("1f1b", 3)
    assert (first.in_flight, last.in_flight) == (4, 1) and first.activations > last.activations
    assert table.row("gpipe", 3).activations > last.activations
    ex = exercise_gpipe_first_stage(table)
    assert ex.check(first.activations + 4 * table.one_micro_batch()).ok
    assert not ex.check(first.activations).ok
    layouts = layout_states("hf:llama-3.1-70b", layouts=((8, 1), (8, 4)))
    whole, staged = layouts.rows
    assert whole.first == whole.last and staged.middle < staged.first < whole.first / 3
    assert "formula" in layouts._repr_html_()
    # the sentence lesson 12 renders: Llama-3.1-70B's parameters by its config's formula (80 layers of
    # 8192 wide attention with 8 KV heads of 128, a 28672 MLP, two norms; embedding and head untied)
    h, kv, inter, vocab = 8192, 8 * 128, 28672, 128256
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h
    assert layouts.parameters == 80 * per_layer + 2 * vocab * h + h
    assert layouts.reading().startswith("hf:llama-3.1-70b has 70.6 billion parameters: at 8 bytes each, 564 GB")


def _megatron_interleaved_held(pp: int, v: int, m: int, rank: int) -> int:
    """Chunk micro-batches an interleaved rank holds at its first backward, from Megatron-LM's
    forward_backward_pipelining_with_interleaving (megatron/core/pipeline_parallel/schedules.py):
    num_warmup_microbatches = (pp - rank - 1) * 2 + (num_model_chunks - 1) * pp capped at M·V (all M·V
    when M == pp); the first steady-state forward, if any is left, adds one."""
    total = m * v
    warmup = total if m == pp else min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    return warmup + (1 if warmup < total else 0)


@pytest.mark.parametrize("pp,v,m", [(4, 2, 8), (4, 3, 12), (8, 2, 16), (4, 2, 12), (2, 4, 4)])
def test_interleaved_in_flight_follows_megatron_and_its_memory_penalty(pp, v, m):
    """The count torch's schedule gives (interleaved_actions) against Megatron-LM's warm-up count, and on
    the first rank against report_theoretical_memory's interleaved_schedule_memory_penalty,
    1 + (pp - 1) / (pp·V), times pp micro-batches of a stage (formula; M a multiple of pp above it)."""
    counts = [in_flight("interleaved", r, pp, m, v) for r in range(pp)]
    if m == pp:   # the one difference: Megatron runs every forward first; torch keeps its warm-up, fewer held
        assert all(c <= m * v == _megatron_interleaved_held(pp, v, m, r) for r, c in enumerate(counts))
        assert counts[0] == m * v
        return
    assert counts == [_megatron_interleaved_held(pp, v, m, r) for r in range(pp)]
    assert counts[0] / v == pytest.approx(pp * (1 + (pp - 1) / (pp * v)), abs=1e-12)
    actions = interleaved_actions(pp, v, m, 0)
    assert sorted(actions) == sorted((k, c * pp, mb) for k in "BF" for c in range(v) for mb in range(m))


def test_torch_and_megatron_differ_where_micro_batches_equal_stages():
    """M == pp: Megatron-LM's interleaved schedule runs all M·V forwards before any backward on every
    rank; torch's ScheduleInterleaved1F1B (which gpulab runs) keeps each rank's warm-up, so later ranks
    hold fewer: pp 4 × 2 chunks, M 4: 8, 8, 7, 5 against Megatron's 8 on each."""
    assert [in_flight("interleaved", r, 4, 4, 2) for r in range(4)] == [8, 8, 7, 5]
    assert [_megatron_interleaved_held(4, 2, 4, r) for r in range(4)] == [8, 8, 8, 8]


def test_an_interleaved_rank_holds_its_schedules_chunk_micro_batches():
    """Measured: a middle rank of pp 4 × 2 chunks (virtual stages 1 and 5 of 8, both middle) holds, at
    once, in_flight chunk micro-batches' activations, each what one micro-batch through one middle stage
    of an 8-stage pipeline keeps; its weights are a 4-stage pipeline's middle stage's."""
    kw = dict(batch=2, seq_len=SEQ, optimizer="adamw", dtype="bf16", engine="fake", fake_target="cpu")
    inter = gpulab.step(_config(8), pp=4, pp_stage=1, schedule="interleaved", virtual_stages=2, microbatches=8, **kw)
    chunk = gpulab.step(_config(8), pp=8, pp_stage=1, microbatches=1, **kw)
    stage = gpulab.step(_config(8), pp=4, pp_stage=1, microbatches=1, **kw)
    assert in_flight("interleaved", 1, 4, 8, 2) == 9
    assert _held(inter) == 9 * _held(chunk)
    assert inter.tensor_bytes_by_category["parameters"] == stage.tensor_bytes_by_category["parameters"]
    assert inter.recipe["virtual_stages"] == 2 and inter.recipe["schedule"] == "interleaved"


def test_interleaved_layouts_that_do_not_divide_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"pp × virtual_stages = 2 × 3 = 6 does not divide num_hidden_layers = 4"):
        gpulab.step(_config(), batch=2, seq_len=SEQ, engine="fake", pp=2, schedule="interleaved", virtual_stages=3)
    with pytest.raises(ValueError, match=r"9 micro-batches make 2 rounds and 2 does not divide 9.*multiple of 4"):
        check_pp_options(4, 9, "interleaved", 0, 2)
    with pytest.raises(ValueError, match="add --schedule interleaved"):
        check_pp_options(4, 8, "1f1b", 0, 2)
    with pytest.raises(ValueError, match="--virtual-stages 2 or more"):
        check_pp_options(4, 8, "interleaved", 0, 1)
    with pytest.raises(ValueError, match="give --pp 2 or more"):
        check_pp_options(1, None, "1f1b", 0, 2)


@pytest.mark.extended   # ~30 s quiet; the interleaved schedule's chunks per rank stay in the default run
def test_fit_answers_an_interleaved_pipeline_per_rank():
    f = gpulab.fit(_config(8), "24MiB", optimizer="adamw", dtype="bf16", seq_len=SEQ, context_bytes=0, pp=4,
                   microbatches=8, schedule="interleaved", virtual_stages=2)
    assert [(r.stages, r.in_flight) for r in f.ranks] == [((0,), 11), ((1,), 9), ((2,), 7), ((3,), 5)]
    assert [r.holds for r in f.ranks][::3] == ["embedding + layers 0, 4", "layers 3, 7 + norm + head + loss"]
    assert sum(r.binds for r in f.ranks) == 1 and f.largest_batch >= 1
    assert "ScheduleInterleaved1F1B" in f.label and "in 2 chunks" in f.pipeline and "interleaved" in f.layers


def test_other_stages_are_read_off_their_own_extrapolation(monkeypatch):
    """fit reads each non-binding stage at the pipeline's micro-batch off its own search's a + b·c line
    (confirmed there by a fake run at its own largest micro-batch) instead of running it: the same rows as
    running them."""
    from gpulab.predict import pipeline_fit
    kw = dict(optimizer="adamw", dtype="bf16", seq_len=SEQ, context_bytes=0, pp=4, microbatches=8)
    read = gpulab.fit(_config(layers=8), "24MiB", **kw)
    assert any("read off its search's extrapolation" in r.note for r in read.ranks)
    monkeypatch.setattr(pipeline_fit, "stage_at", lambda runs, batch, largest: (runs(batch), False))
    run = gpulab.fit(_config(layers=8), "24MiB", **kw)
    assert [(r.peak_bytes, r.reserved_bytes, r.peak_by_category) for r in read.ranks] == \
        [(r.peak_bytes, r.reserved_bytes, r.peak_by_category) for r in run.ranks]


def test_stages_whose_layers_differ_from_the_first_are_refused_in_one_line():
    """Each stage is measured from a model built with the first layers/pp layers: where the config's
    layers are not all alike, every stage (and interleaved chunk) must hold the same kinds, or the
    answer would be another stage's. Gemma-2 alternates sliding and global layers (42: stages of an odd
    number of layers differ); DeepSeek-V2-Lite's first layer alone is dense (no split works)."""
    gemma, _ = hf_configs.config_and_name("gemma-2-9b")
    for pp in (3, 7, 21):
        check_pipeline(gemma, pp)
    with pytest.raises(ValueError, match=r"not all alike \(layer_types\).*chunk 1 holds other layers.*3, 7, 21$"):
        check_pipeline(gemma, 2)
    with pytest.raises(ValueError, match="chunks of 7 layers"):
        check_pipeline(gemma, 3, virtual=2)
    deepseek, _ = hf_configs.config_and_name("deepseek-v2-lite")
    with pytest.raises(ValueError, match=r"first_k_dense_replace 1.*measure it without --pp"):
        check_pipeline(deepseek, 3)
    for name in ("mixtral-8x7b", "qwen3-30b-a3b", "llama-3-8b"):   # alike: every split that divides
        check_pipeline(hf_configs.config_and_name(name)[0], 4)


def test_layout_bad_inputs_found_by_the_probe():
    """#45's probe: what-fits with a pipeline leaves out (saying why) the candidates the layout cannot take and
    keeps the rest; a stage's every-K checkpointing counted from its first layer is said in the answer where
    it differs from the whole model's count (8 layers, pp 2, every-3: 2 a stage, where the whole model puts
    layers 0, 3 in stage 0 and 6 in stage 1); a config with fewer layers than stages is refused."""
    from gpulab.predict.pipeline_fit import every_k_note
    from gpulab.predict.what_fits import what_fits
    wf = what_fits(_config(), "64MiB", batch=1, optimizer="adamw", seq_len=SEQ, context_bytes=0, pp=2)
    names = [t.name for t in wf.tried]
    assert names and not any("LoRA" in n or "chunks" in n or "in backward" in n for n in names)
    assert any(w.startswith("loss in 8 chunks (") and "leave out chunked_loss with pp" in w for w in wf.left_out)
    assert wf.as_dict()["left_out"] == wf.left_out
    assert every_k_note("every-3", 8, 2).startswith("; checkpointing every-3 counted from each stage's first layer "
                                                    "(2 of its 4 layers checkpointed in every stage), where the whole "
                                                    "model's every-3 puts 2, 1 in the stages in turn")
    assert every_k_note("every-2", 8, 2) == every_k_note("full", 8, 2) == ""
    f = gpulab.fit(_config(layers=8), "64MiB", optimizer="adamw", dtype="bf16", seq_len=SEQ, context_bytes=0, pp=2,
                   checkpointing="every-3")
    assert every_k_note("every-3", 8, 2) in f.pipeline
    with pytest.raises(ValueError, match="num_hidden_layers = 1, too few to split: leave --pp out"):
        check_pipeline(_config(layers=1), 2)
    with pytest.raises(ValueError, match="--pp 4 splits the layers into 4 stages of at least one layer each; this "
                                         "config has num_hidden_layers = 2: give a pp from 2 to 2"):
        check_pipeline(_config(layers=2), 4)
