"""torchtitan's recipes as options of the one loop: its op-level selective activation checkpointing
(``checkpointing="torchtitan-op"``) against torchtitan's own policy on the same model, FSDP2's
MixedPrecisionPolicy per rank against a hand count from the config, and the float8 all-gather."""
import pytest
import torch

from gpulab.options import Layout, Recipe, settings_from
from gpulab.predict import sharding as S


def _tiny_llama():
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _alive_after_forward(model, ids) -> dict[str, int]:
    """The bytes of every storage an op made in the forward that is still alive when the loss exists,
    by op (what the forward keeps for backward, and its outputs): storages followed by
    ``torch.multiprocessing.reductions.StorageWeakRef``, under a dispatch mode outside the checkpoint's own."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.multiprocessing.reductions import StorageWeakRef
    made = {}

    class Made(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    seen = made.get(st.data_ptr())
                    if seen is None or seen[0].expired():   # an address freed and made again: the new storage
                        made[st.data_ptr()] = (StorageWeakRef(st), st.nbytes(), str(func.overloadpacket))
            return out
    with Made():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss   # transformers' checkpointing turns it off
    alive: dict[str, int] = {}
    for ref, nbytes, op in made.values():
        if not ref.expired():
            alive[op] = alive.get(op, 0) + nbytes
    del loss
    return alive


def _gpulab_policy(policy):
    from gpulab.models.adapt import enable_checkpointing
    model = _tiny_llama()
    model.train()
    return enable_checkpointing(model, policy)


def test_torchtitan_op_keeps_every_other_matmul():
    """7 linear layers a block (q, k, v, o, gate, up, down): torchtitan-op keeps the 1st, 3rd, 5th and 7th
    outputs (q, v, gate, down), gpulab's ``selective`` all seven; the rest of what stays is the same."""
    ids = torch.randint(0, 96, (2, 16))
    ours = _alive_after_forward(_gpulab_policy("torchtitan-op"), ids)
    keep_all = _alive_after_forward(_gpulab_policy("selective"), ids)
    h, kv, i, rows = 64, 32, 128, 2 * 16
    odd = rows * (h + kv + i + h) * 4   # q, v, gate, down outputs in fp32
    even = rows * (kv + h + i) * 4      # k, o, up
    assert (ours["aten.mm"], keep_all["aten.mm"]) == (2 * odd, 2 * (odd + even))   # two blocks
    # CPU attention (_scaled_dot_product_flash_attention_for_cpu) is not on torchtitan's list: recomputed
    assert not any("attention" in op for op in ours) and any("attention" in op for op in keep_all)


@pytest.mark.extended
def test_torchtitan_op_saves_what_torchtitans_own_policy_saves():
    """torchtitan's SelectiveAC wraps each block (its ``_wrap_block``, the policy it builds); gpulab's
    ``torchtitan-op`` goes through transformers' own checkpointing: the same storages stay alive after
    the forward, op by op. gpulab's ``selective`` (every matmul kept) keeps more: the comparison can fail.
    (Extended: importing torchtitan takes about 5 s.)"""
    ac = pytest.importorskip("torchtitan.distributed.activation_checkpoint",
                             reason="torchtitan (test extra) is not installed: pip install torchtitan==0.3.0")
    ids = torch.randint(0, 96, (2, 16))
    theirs_model = _tiny_llama()
    theirs_model.train()
    policy = ac.SelectiveAC(ac.SelectiveAC.Config(force_recompute_mm_shapes_by_fqns=[]))
    layers = theirs_model.model.layers
    for i in range(len(layers)):
        layers[i] = policy._wrap_block(layers[i], base_fqn=f"layers.{i}")
    theirs = _alive_after_forward(theirs_model, ids)
    ours = _alive_after_forward(_gpulab_policy("torchtitan-op"), ids)
    keep_all = _alive_after_forward(_gpulab_policy("selective"), ids)
    assert ours == theirs, (ours, theirs)
    assert keep_all != theirs


@pytest.mark.extended
def test_torchtitan_save_list_is_torchtitans():
    """The op list gpulab builds without importing torchtitan is torchtitan's ``_get_default_save_ops``."""
    ac = pytest.importorskip("torchtitan.distributed.activation_checkpoint",
                             reason="torchtitan (test extra) is not installed: pip install torchtitan==0.3.0")
    from gpulab.models.adapt import torchtitan_save_ops
    assert torchtitan_save_ops() == set(ac._get_default_save_ops())


def test_router_shapes_force_recompute():
    """An mm with the router's weight shape is recomputed and not counted (torchtitan's
    force_recompute_mm_shapes_by_fqns); the others alternate saved / recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy as P

    from gpulab.models.adapt import torchtitan_policy, torchtitan_save_ops

    class Ctx:
        is_recompute = False
    mm = torch.ops.aten.mm.default
    x, w, r = torch.empty(4, 8), torch.empty(8, 16), torch.empty(8, 3)
    policy = torchtitan_policy(torchtitan_save_ops(), {torch.Size((8, 3))})
    got = [policy(Ctx, mm, x, a) for a in (w, r, w, w, r, w)]
    assert got == [P.MUST_SAVE, P.PREFER_RECOMPUTE, P.PREFER_RECOMPUTE, P.MUST_SAVE, P.PREFER_RECOMPUTE,
                   P.PREFER_RECOMPUTE]
    assert policy(Ctx, torch.ops.aten.topk.default, x, 2) is P.MUST_SAVE
    assert policy(Ctx, torch.ops.aten.mul.Tensor, x, x) is P.PREFER_RECOMPUTE


@pytest.mark.parametrize("kw,msg", [
    (dict(recipe=Recipe("adamw", param_dtype="bf16"), layout=Layout()), "give strategy='fsdp2'"),
    (dict(recipe=Recipe("adamw", reduce_dtype="fp32"), layout=Layout(gpus=8, strategy="zero3")),
     "give strategy='fsdp2'"),
])
def test_fsdp2_settings_need_fsdp2(kw, msg):
    with pytest.raises(ValueError, match=msg):
        settings_from(kw["recipe"], kw["layout"], {})


@pytest.mark.parametrize("kw,msg", [
    (dict(fp8_all_gather=True), "give fp8='tensorwise'"),
    (dict(fp8="rowwise", fp8_all_gather=True), "give fp8='tensorwise'"),
    (dict(param_dtype="bf16", amp="bf16"), "leave out amp"),
    (dict(param_dtype="int8"), "param_dtype must be one of fp32, bf16, fp16"),
])
def test_precision_settings_refused_in_one_line(kw, msg):
    with pytest.raises(ValueError, match=msg):
        Recipe("adamw", **kw)


def test_recipe_defaults_are_the_dataclasses():
    """training.loop.RECIPE_DEFAULTS is read off Recipe and Layout, not typed twice."""
    import dataclasses

    from gpulab.training.loop import RECIPE_DEFAULTS, LoopRecipe, user_recipe
    fields = {f.name: f.default for c in (Recipe, Layout) for f in dataclasses.fields(c)}
    assert RECIPE_DEFAULTS and all(fields[k] == v for k, v in RECIPE_DEFAULTS.items())
    assert {"param_dtype", "reduce_dtype", "fp8_all_gather", "checkpointing", "tp"} <= set(RECIPE_DEFAULTS)
    assert user_recipe("adamw") == LoopRecipe("adamw")
    assert user_recipe("adamw", checkpointing="torchtitan-op").checkpointing == "torchtitan-op"


def _llama_params(v, h, i, layers, heads, kv_heads):
    """A Llama's parameters from its config, by hand: embedding and untied head, per block q/k/v/o,
    the SwiGLU MLP and two RMSNorms, and the final norm."""
    kv = h // heads * kv_heads
    block = h * h + 2 * h * kv + h * h + 3 * h * i + 2 * h
    return 2 * v * h + layers * block + h, block, 2 * v * h + h


def test_mixed_precision_policy_per_rank_against_a_hand_count():
    """fsdp2 with MixedPrecisionPolicy(bf16, fp32) over fp32 master weights, 4 ranks: sharded fp32
    parameters and gradients (4 bytes each / 4), AdamW's two fp32 moments (8 / 4), the largest unit
    all-gathered and its gradients in bf16 (2 + 2 bytes an element) and the reduce-scatter input in
    fp32 (4). The one-GPU run is made in bf16; per_rank's largest bytes of each category equal the count."""
    from gpulab.models.workload import resolve_workload
    from gpulab.predict.fake_runs import fake_run as _run
    from gpulab.training.loop import loop_recipe
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    total, block, root = _llama_params(256, 64, 128, 2, 4, 2)
    w = resolve_workload(cfg, seq_len=16)
    recipe, layout = settings_from(None, None, dict(optimizer="adamw", param_dtype="bf16", reduce_dtype="fp32",
                                                     gpus=4, strategy="fsdp2"))
    loop = loop_recipe(recipe, layout)
    one = _run(w, 1, torch.bfloat16, loop).tracking
    with torch.device("meta"):
        layers = S.count_layers(w.build(torch.device("meta"), torch.bfloat16))
    assert layers.total == total and layers.largest_unit == max(block, root)
    sh = S.Sharding(4, "fsdp2", **S.precision_policy(torch.bfloat16, torch.float32, torch.float32))
    assert (sh.master_elem, sh.reduce_elem, sh.run_dtype) == (4, 4, "bfloat16")
    t = S.per_rank(one, sh, layers, 2)
    n, unit = 4, layers.largest_unit

    def most(cat):
        return max(row.get(cat, 0) for row in t.series)
    k = {c: sum(1 for r in one.records.values() if r.category.value == c)
         for c in ("parameters", "gradients", "optimizer_state")}
    near = lambda a, b, m: abs(a - b) <= 513 * m   # each storage rounded up to 512 B, its shard to a byte
    assert near(most("parameters"), 4 * total // n + 2 * unit, k["parameters"] + 1), most("parameters")
    assert near(most("optimizer_state"), 8 * total // n, k["optimizer_state"]), most("optimizer_state")
    assert near(most("gradients"), 4 * total // n + (2 + 4) * unit, 2 * k["gradients"] + 2), most("gradients")
    # the formula alone says the same model states
    assert S.model_state_bytes(total, sh, layers, 2, 8) == (-(-4 * total // n)) * 2 + (-(-8 * total // n)) \
        + (2 + 2 + 4) * unit


def test_mixed_precision_policy_with_pp_is_taken():
    """torchtitan applies FSDP2 with its MixedPrecisionPolicy to each pipeline stage
    (``apply_fsdp_to_decoder`` per model part): the layout is answered, not refused."""
    recipe, layout = settings_from(Recipe("adamw", param_dtype="bf16", reduce_dtype="fp32"),
                                   Layout(gpus=8, strategy="fsdp2", pp=2), {})
    assert (recipe.param_dtype, layout.pp, layout.sharded_over) == ("bf16", 2, 4)


@pytest.mark.extended
def test_mixed_precision_policy_per_pipeline_stage_against_a_hand_count():
    """pp 2 × dp_shard 4, fsdp2 with MixedPrecisionPolicy(bf16, fp32) over fp32 master weights: each
    stage's rank holds its own stage's parameters sharded in fp32 (4 bytes / 4 ranks) and AdamW's fp32
    moments (8 / 4), plus its largest unit all-gathered in bf16 (2 bytes), counted by hand from the
    config per stage (first: embedding + 2 blocks; last: 2 blocks + norm + head). Run in fp32 without the
    policy the gathered unit is two fp32 copies (8 bytes): the comparison can fail. (Extended: two
    pipeline fits, about 15 s.)"""
    import gpulab
    import transformers
    v, h, i = 256, 64, 128
    cfg = transformers.LlamaConfig(vocab_size=v, hidden_size=h, intermediate_size=i, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    _, block, root = _llama_params(v, h, i, 2, 4, 2)
    stage = {"first": v * h + 2 * block, "last": 2 * block + h + v * h}
    unit, n = max(block, root), 4
    kw = dict(optimizer="adamw", dtype="fp32", seq_len=16, gpus=8, strategy="fsdp2", pp=2, predict_time=False,
              context_bytes=0)
    policy = gpulab.fit(cfg, "1GiB", param_dtype="bf16", reduce_dtype="fp32", **kw)
    plain = gpulab.fit(cfg, "1GiB", **kw)
    tensors = 2 * 9 + 2   # a stage's parameters at most: 2 blocks of 9, and the embedding or the norm and head
    near = lambda a, b, k: abs(a - b) <= 513 * k   # each storage rounded up to 512 B, its shard to a byte
    for rows, gathered in ((policy.ranks, 2 * unit), (plain.ranks, 8 * unit)):
        assert {r.role for r in rows} == set(stage)
        for r in rows:
            own, got = stage[r.role], r.peak_by_category
            assert near(got["parameters"], 4 * own // n + gathered, tensors + 2), (r.role, got)
            assert near(got["optimizer_state"], 8 * own // n, 3 * tensors), (r.role, got)   # two moments, a step


def test_float8_all_gather_gathers_one_byte_weights():
    """With the float8 all-gather a unit's converted weights are gathered at 1 byte an element, the
    rest (norms; the root's embedding and head, which stay in high precision) at the run's."""
    from gpulab.models.workload import resolve_workload
    from gpulab.training.fp8 import float8_numel
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    total, block, root = _llama_params(64, 256, 512, 2, 4, 4)
    w = resolve_workload(cfg, seq_len=16)
    with torch.device("meta"):
        layers = S.count_layers(w.build(torch.device("meta"), torch.bfloat16), float8=float8_numel)
    linear = block - 2 * 256                  # a block's weights but its two norms
    assert layers.largest_unit == block > root
    assert layers.gathered_bytes(2, float8=True) == max(linear + 2 * 2 * 256, 2 * root)
    sh = S.Sharding(8, "fsdp2", run_dtype="bfloat16", float8_all_gather=True)
    units = S.fsdp2_units(sh, layers, 2)
    assert [u[1] for u in units] == [layers.gathered_bytes(2, True), 2 * block]
    assert S.fsdp2_units(S.Sharding(8, "fsdp2"), layers, 2)[0][1] == 4 * block   # plain: two bf16 copies
