"""Exact at any depth: a step laid out from fake runs of 1, 2 and 3 blocks equals the full-depth
fake run event for event (same storages, bytes, categories, phases), so the same peak, the same
categories at the peak and the same simulated reserved memory (gpulab.predict.layer_repeat)."""
from __future__ import annotations

import pytest
import torch

from gpulab.allocator.simulator import CachingAllocator
from gpulab.models import hf_configs
from gpulab.models.workload import resolve_workload
from gpulab.predict import layer_repeat as L
from gpulab.predict.fake_runs import fake_run as _run
from gpulab.predict.sharding import one_step_gradients
from gpulab.training.loop import user_recipe


def _workload(name: str, depth: int, seq_len: int = 32):
    cfg = hf_configs.make_config(name)
    cfg.num_hidden_layers = depth
    return resolve_workload(cfg, seq_len=seq_len)


def _both(w, recipe, dtype=torch.bfloat16, batch: int = 2):
    def run(wk, b, fresh=False):
        return _run(wk, b, dtype, recipe).tracking
    deep = L.Deep(w, run)
    return deep, deep.at(batch), run(w, batch)


def _assert_same(laid, full):
    assert laid is not None
    assert L.same_timeline(laid, full)
    assert laid.peak_bytes == full.peak_bytes
    assert laid.peak_by_category == full.peak_by_category
    reserved = [CachingAllocator().replay(t.events, strict=False).peak_reserved for t in (laid, full)]
    assert reserved[0] == reserved[1]
    # the records' own alloc indices in the same order (data parallel's gradient buckets count by them)
    made = [[(t.records[s].category, t.records[s].phase) for s in sorted(t.records, key=lambda s: t.records[s].created)]
            for t in (laid, full)]
    assert made[0] == made[1]
    assert one_step_gradients(laid) == one_step_gradients(full) > 0


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_plain_step_equals_full_depth(name):
    deep, laid, full = _both(_workload(name, 7), user_recipe("adamw", None))
    _assert_same(laid, full)
    assert deep.runs == 3 and "7 layers laid out" in deep.describe()


RECIPES = {
    "full checkpointing": dict(checkpointing="full"),
    "selective (SAC)": dict(checkpointing="selective"),
    "LoRA": dict(lora=8),
    "QLoRA": dict(lora=8, quantize="nf4"),
    "offload": dict(offload_activations=True),
    "accumulation": dict(accumulate=2),
    "chunked loss": dict(chunked_loss=4),
}


@pytest.mark.slow
@pytest.mark.parametrize("options", [*RECIPES.values(), pytest.param(
    dict(checkpointing="torchtitan-op"), marks=pytest.mark.extended, id="torchtitan's op-level SAC")],
    ids=[*RECIPES, "torchtitan's op-level SAC"])
def test_recipes_equal_full_depth(options):
    deep, laid, full = _both(_workload("tiny-llama", 7), user_recipe("adamw", None, **options))
    _assert_same(laid, full)


def test_a_deeper_batch_reuses_the_layout():
    """One layout serves every batch: batch 3 costs two small runs, and still equals the full depth."""
    w = _workload("tiny-llama", 6)
    recipe = user_recipe("adamw", None)
    runs = []

    def run(wk, b, fresh=False):
        runs.append(b)
        return _run(wk, b, torch.bfloat16, recipe).tracking
    deep = L.Deep(w, run)
    deep.at(2)
    n = len(runs)
    _assert_same(deep.at(3), _run(w, 3, torch.bfloat16, recipe).tracking)
    assert len(runs) - n == 2


def test_layers_not_alike_are_not_repeated():
    cfg = hf_configs.make_config("tiny-llama")
    cfg.num_hidden_layers = 16
    assert L.not_repeatable(cfg) is None
    assert "every-2" in L.not_repeatable(cfg, "every-2")
    cfg.layer_types = ["full_attention"] * 15 + ["sliding_attention"]   # no period short enough to repeat
    assert "not all alike (layer_types" in L.not_repeatable(cfg)
    cfg.layer_types = None
    cfg.mlp_only_layers = [3, 7]
    assert "mlp_only_layers" in L.not_repeatable(cfg)
    cfg.mlp_only_layers = []
    cfg.num_hidden_layers = 4
    assert "full depth is as cheap" in L.not_repeatable(cfg)
    assert "not a transformer" in L.not_repeatable(None)


def test_periodic_and_prefixed_layers_are_patterns():
    """Layers that repeat every few (Gemma's sliding and global layers, a mixture of experts every K
    layers) repeat by periods; DeepSeek's dense first layers are a prefix every small run holds."""
    cfg = hf_configs.make_config("tiny-llama")
    cfg.num_hidden_layers = 16
    assert L.block_pattern(cfg) == L.Pattern()
    cfg.layer_types = ["sliding_attention", "full_attention"] * 8
    assert L.block_pattern(cfg) == L.Pattern(0, 2, "layer_types every 2: sliding_attention, full_attention")
    assert L.not_repeatable(cfg) is None and L.Pattern(0, 2).blocks == 1
    cfg.layer_types = (["sliding_attention"] * 7 + ["full_attention"]) * 2   # 3 periods of 8 do not fit in 16
    assert "16 layers hold too few periods of 8 to repeat" in L.not_repeatable(cfg)
    cfg.layer_types = None
    cfg.first_k_dense_replace = 3
    assert L.block_pattern(cfg) == L.Pattern(3, 1, "the first 3 layers dense")
    cfg.first_k_dense_replace = 1      # one dense layer: a prefix too (a one-layer run would hold it alone)
    assert L.block_pattern(cfg) == L.Pattern(1, 1, "the first layer dense")
    cfg.first_k_dense_replace, cfg.decoder_sparse_step = None, 2
    assert L.block_pattern(cfg) == L.Pattern(0, 2, "decoder_sparse_step 2")
    cfg.mlp_only_layers = [0, 1]       # dense first layers, then a mixture of experts every 2
    assert L.block_pattern(cfg, min_depth=0) == L.Pattern(2, 2, "mlp_only_layers: the first 2 layers dense; "
                                                                "decoder_sparse_step 2")
    # 16 layers from runs of 4 and 6 a batch: not worth it, said so; the pattern itself stands
    assert "runs of 4 and 6 layers cost about what 16 layers do, so all 16 run" in L.not_repeatable(cfg)
    cfg.mlp_only_layers = None
    assert L.block_pattern(hf_configs.make_config("gemma-2-9b")) == L.Pattern(
        0, 2, "layer_types every 2: sliding_attention, full_attention")
    gemma3 = hf_configs.make_config("gemma-3-1b")
    pattern = L.block_pattern(gemma3, min_depth=0)
    assert (pattern.period, pattern.prefix) == (6, 0) and "every 6: sliding_attention, sliding_attention" in pattern.why
    assert pattern.depths(26) == (8, 14, 20) and pattern.depths(62) == (8, 14, 20)
    assert "runs of 8 and 14 layers cost about what 26 layers do, so all 26 run" in L.not_repeatable(gemma3)
    gemma3.num_hidden_layers, gemma3.layer_types = 62, [gemma3.layer_types[i % 6] for i in range(62)]   # 27B's depth
    assert L.not_repeatable(gemma3) is None
    for name in ("mixtral-8x7b", "qwen3-30b-a3b"):
        assert L.block_pattern(hf_configs.make_config(name)) == L.Pattern()
    assert L.block_pattern(hf_configs.make_config("deepseek-v2-lite")) == L.Pattern(1, 1, "the first layer dense")


def _shrunk(name: str, depth: int, seq_len: int = 32, **fields):
    """A built-in config's real layer pattern (``layer_types`` cut to ``depth``) at small sizes."""
    cfg = hf_configs.make_config(name)
    types = list(cfg.layer_types or []) if getattr(cfg, "layer_types", None) else None
    sizes = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 vocab_size=256)
    for key, value in {**sizes, **fields}.items():
        if hasattr(cfg, key):
            setattr(cfg, key, value)
    cfg.num_hidden_layers = depth
    if types:
        period = next(p for p in range(1, len(types)) if types[p:] == types[:-p])
        cfg.layer_types = [types[i % period] for i in range(depth)]
    return resolve_workload(cfg, seq_len=seq_len)


PATTERNS = {   # each built-in's own layer pattern, small: (name, depth, fields)
    "deepseek-v2 (2 dense, then MoE)": ("deepseek-v2-lite", 7, dict(
        first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, head_dim=8)),
    "deepseek-v2-lite (1 dense, then MoE)": ("deepseek-v2-lite", 7, dict(
        first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, head_dim=8)),
    "mixtral (MoE alike)": ("mixtral-8x7b", 6, dict(num_local_experts=4)),
    "qwen3-moe (MoE alike)": ("qwen3-30b-a3b", 6, dict(num_experts=8, moe_intermediate_size=32)),
}


@pytest.mark.slow
@pytest.mark.parametrize("spec", [pytest.param(*[v], marks=pytest.mark.extended) if "1 dense" in k else v
                                  for k, v in PATTERNS.items()], ids=list(PATTERNS))
def test_layer_patterns_equal_full_depth(spec):
    """Mixtures of experts (all MoE layers alike, or after a dense prefix) laid out from a few layers equal the
    full-depth run."""
    name, depth, fields = spec
    w = _shrunk(name, depth, **fields)
    deep, laid, full = _both(w, user_recipe("adamw", None))
    assert deep.copies >= 1 and deep.depths[2] < depth
    _assert_same(laid, full)
    assert f"{depth} layers laid out" in deep.describe()


def test_a_timeline_that_does_not_repeat_is_refused():
    """Runs whose deeper versions are not insertions of one block (here: three unrelated runs)
    give a reason, never a layout."""
    recipe = user_recipe("adamw", None)
    a = _run(_workload("tiny-llama", 2), 2, torch.bfloat16, recipe).tracking
    b = _run(_workload("tiny-gpt2", 3), 2, torch.bfloat16, recipe).tracking
    c = _run(_workload("tiny-llama", 4), 2, torch.bfloat16, recipe).tracking
    assert isinstance(L.learn(a, b, c), str)


@pytest.mark.slow
def test_fit_answers_the_same_with_and_without_layer_repeat(monkeypatch):
    """gpulab.fit of a 12-layer stack: the answer laid out from a few layers equals the answer from
    full-depth runs (batch, peak, categories, simulated reserved), and says how it was made."""
    from gpulab.predict import fit as fit_module, run_cache
    cfg = hf_configs.make_config("tiny-llama")
    cfg.num_hidden_layers = 12
    options = dict(optimizer="adamw", dtype="bf16", seq_len=64, context_bytes=0)
    run_cache.clear()
    laid = fit_module.fit(cfg, "96MiB", **options)
    assert "12 layers laid out from fake runs of 1 and 2 layers" in laid.layers
    run_cache.clear()
    monkeypatch.setattr(L, "not_repeatable", lambda *a, **k: "switched off by the test")   # what fit's runs read
    full = fit_module.fit(cfg, "96MiB", **options)
    assert full.layers == "switched off by the test"
    assert (laid.largest_batch, laid.peak_bytes, laid.reserved_bytes) == (full.largest_batch, full.peak_bytes,
                                                                            full.reserved_bytes)
    assert laid.peak_by_category == full.peak_by_category


def test_a_stack_too_deep_to_replay_is_refused_in_one_line():
    """100,000 tiny layers: the small runs answer quickly, then a ValueError says how many layers fit
    the replay, instead of a timeline of tens of millions of events."""
    w = _workload("tiny-llama", 100_000, seq_len=8)
    recipe = user_recipe("adamw", None)
    deep = L.Deep(w, lambda wk, b, fresh=False: _run(wk, b, torch.float32, recipe).tracking)
    with pytest.raises(ValueError, match="100,000 layers make a timeline of .* ask for at most"):
        deep.at(2)


def test_batch_one_gets_a_layout_of_its_own_where_it_differs():
    """Batch 1's size-1 dimensions can make other copies than larger batches: a layout learned at
    batch 2 serves batch 1 only if it rebuilds batch 1's 3-layer run exactly, else one is learned
    there; either way the full depth equals the full-depth run."""
    w = _workload("tiny-llama", 7)
    recipe = user_recipe("adamw", None)

    def run(wk, b, fresh=False):
        return _run(wk, b, torch.bfloat16, recipe).tracking
    deep = L.Deep(w, run)
    deep.at(2)
    _assert_same(deep.at(1), run(w, 1))
    assert not deep.why and 1 <= len(deep.layouts) <= 2


def _tp_workload(depth: int):
    """tiny-llama with heads and MLP width that tp=2 divides (as tests/test_tensor_parallel.py)."""
    cfg = hf_configs.make_config("tiny-llama")
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size = 4, 4, 176
    cfg.num_hidden_layers = depth
    return resolve_workload(cfg, seq_len=32)


TP = {
    "tp=2": dict(tp=2),
    "tp=2, sequence parallel": dict(tp=2, sequence_parallel=True),
    "tp=2, sequence parallel, pp middle stage": dict(tp=2, sequence_parallel=True, pp=4, pp_stage=1, microbatches=1),
    "tp=2, pp last stage": dict(tp=2, pp=4, pp_stage=3, microbatches=1),
}


@pytest.mark.parametrize("options", list(TP.values()), ids=list(TP))
def test_tensor_parallel_equals_full_depth(options):
    """A tensor-parallel rank's step (DTensor on the fake process group, with and without sequence
    parallelism, alone and as a pipeline stage) laid out from a few layers equals the full-depth run:
    the plan is applied layer by layer (training.tensor_parallel), so every layer's setup repeats alike."""
    deep, laid, full = _both(_tp_workload(7), user_recipe("adamw", None, **options))
    _assert_same(laid, full)
    assert deep.runs == 3 and "7 layers laid out" in deep.describe()


PERIODIC = {   # layers that repeat every few, small: (name, depth, fields); each laid out by periods
    "gemma-2 (sliding, global)": ("gemma-2-9b", 8, {}),
    "gemma-3 (5 sliding : 1 global)": ("gemma-3-1b", 26, {}),
    "qwen3-moe (MoE every 2)": ("qwen3-30b-a3b", 8, dict(num_experts=8, moe_intermediate_size=32,
                                                         decoder_sparse_step=2, mlp_only_layers=[])),
    "qwen3-moe (2 dense, then MoE every 2)": ("qwen3-30b-a3b", 10, dict(num_experts=8, moe_intermediate_size=32,
                                                                       decoder_sparse_step=2, mlp_only_layers=[0, 1])),
}


def _periodic(spec, recipe, batch: int = 2):
    name, depth, fields = spec
    w = _shrunk(name, depth, **fields)
    pattern = L.block_pattern(w.config, min_depth=0)
    assert isinstance(pattern, L.Pattern) and pattern.period > 1, pattern
    deep, laid, full = _both(w, recipe, batch=batch)
    assert deep.why == "" and deep.copies >= 2 and deep.depths[2] < depth
    assert deep.depths[0] == pattern.prefix + pattern.period + (depth - pattern.prefix) % pattern.period
    _assert_same(laid, full)
    assert f"each period of {pattern.period} layers" in deep.describe()
    return deep


@pytest.mark.slow
@pytest.mark.parametrize("spec", list(PERIODIC.values()), ids=list(PERIODIC))
def test_periodic_layers_equal_full_depth(spec):
    """Layers that repeat every few (Gemma-2's sliding and global layers, Gemma-3's five to one, a mixture of
    experts every 2 layers, after dense first layers or not), laid out from 1, 2 and 3 periods, equal the
    full-depth run: events, peak, categories, simulated reserved."""
    _periodic(spec, user_recipe("adamw", None))


PERIODIC_RECIPES = {name: {**RECIPES, **TP}[name] for name in (
    "full checkpointing", "selective (SAC)", "LoRA", "offload", "accumulation", "tp=2", "tp=2, sequence parallel")}
# Left out, training.tensor_parallel's matters, not the layout's: Qwen3-MoE under any tp (its plan's q_norm
# style 'replicated_with_grad_allreduce' is refused in one line). Gemma-2 under sequence parallelism runs since
# every norm of its block is sequence-parallel (it failed with "aten.add got mixed torch.Tensor and DTensor")
PERIODIC_CASES = [("gemma-2 (sliding, global)", name) for name in PERIODIC_RECIPES]
PERIODIC_CASES += [("qwen3-moe (2 dense, then MoE every 2)", name) for name in PERIODIC_RECIPES
                   if not name.startswith("tp=2")]
# make test runs one recipe for each periodic model (every recipe is laid out on alike layers in
# test_recipes_equal_full_depth above); the rest of the cross product is marked extended, which
# make test-extended and CI run
PERIODIC_IN_MAKE_TEST = {("gemma-2 (sliding, global)", "full checkpointing"),
                         ("qwen3-moe (2 dense, then MoE every 2)", "selective (SAC)")}
PERIODIC_PARAMS = [case if case in PERIODIC_IN_MAKE_TEST else pytest.param(*case, marks=pytest.mark.extended)
                   for case in PERIODIC_CASES]


@pytest.mark.slow
@pytest.mark.parametrize("spec, name", PERIODIC_PARAMS, ids=[f"{spec.split()[0]}-{name}" for spec, name in PERIODIC_CASES])
def test_periodic_recipes_equal_full_depth(spec, name):
    """Checkpointing (full, selective), LoRA, offload, accumulation and (Gemma-2) tensor parallelism laid out
    by periods equal the full-depth run."""
    _periodic(PERIODIC[spec], user_recipe("adamw", None, **PERIODIC_RECIPES[name]))


def test_a_layout_learned_on_one_pipeline_stage_lays_out_the_others():
    """The first stage's layout (learned from its runs of 1, 2 and 3 layers), moved onto the middle and last
    stages' own runs of 1 and 2 layers (``layer_repeat.transfer``: they hold the same layers with other ends,
    a received activation for the embedding, the norm, head and loss after), lays each of them out as its
    full-depth run: no 3-layer run there. tp=2 with sequence parallelism, as the 70B TP 8 × PP 4 layout."""
    w = _tp_workload(4)

    def deep_of(stage: int):
        recipe = user_recipe("adamw", None, tp=2, sequence_parallel=True, pp=4, pp_stage=stage, microbatches=1)

        def run(wk, b, fresh=False):
            return _run(wk, b, torch.bfloat16, recipe).tracking
        return L.Deep(w, run), run
    first, _ = deep_of(0)
    assert first.at(2) is not None and first.runs == 3 and not first.transferred
    for stage in (1, 3):
        deep, run = deep_of(stage)
        deep.peers = list(first.layouts)
        laid = deep.at(2)
        assert deep.transferred and deep.runs == 2, stage
        _assert_same(laid, run(w, 2))
