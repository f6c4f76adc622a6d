"""Every rank's parameter, gradient and optimizer-state shapes under a layout, gpulab's answer
(``gpulab.predict.rank_state``, the tensors ``fit`` counts) against torchtitan's own code.

torchtitan 0.3.0 (test-only, like DeepSpeed) builds its Llama-3 on the meta device, applies its own
``parallelize_llama`` (its ``Module.parallelize`` plans for TP and SP, FSDP2 over ``dp_shard × cp``)
and, for a pipeline, its own stage split (``_generate_llm_fqn_per_model_part`` and
``_pipeline_module_split``, what ``pipeline_llm`` runs before its schedule), on PyTorch's fake
process group as rank r, one process. Its tensors are then made on the CPU (``to_empty``) and
AdamW steps them. The gradients are made as ``zeros_like`` of each parameter, not by a backward:
torchtitan's Llama-3 attends with FlexAttention, whose backward refuses the CPU
(``torch.nn.attention.flex_attention._validate_device``: "FlexAttention does not support backward on
CPU"); a DTensor parameter's gradient has the parameter's placements (what ``zeros_like`` gives), so
the gradient column checks gpulab's gradients against torchtitan's parameters' local shapes.

gpulab's side ran a real backward on its fake engine. Compared per mesh, for the rank torchtitan
builds (rank 0 of the stage): per tensor, the local shape of the weight, its gradient and Adam's two
moments (under FSDP2, torchtitan's local shape is gpulab's with dim 0 split ``dp_shard × cp`` ways,
and gpulab holds rank 0's padded shard, ``ceil(d0 / n)`` rows: ``predict.sharding.shard_rows``), and the bytes per rank by category. Named differences:

* Adam's ``step``: torch keeps a 4-byte scalar per parameter whole on every rank; gpulab's formula
  splits every optimizer-state byte ``n`` ways (``predict.sharding.held_bytes``), so it holds
  ``ceil(4 / n)``: compared with that tolerance (4 bytes a tensor), the moments exactly.
* Not compared: what FSDP2 adds beside the rank's tensors (its gathered unit, ``RankState.extra``),
  which torchtitan's parameters do not show.

Its MoE, Qwen3-MoE (``torchtitan.models.qwen3``: ``parallelize_qwen3``, the same pipeline split),
against transformers' ``Qwen3MoeForCausalLM`` at a small size (2 layers, 8 experts, top-2), names
mapped by ``QWEN3_MOE_TO_HF``. The routed experts' weights are FSDP-sharded over torchtitan's
``efsdp`` mesh (``dp_shard·cp·tp / ep`` ranks, gpulab's ``experts_over``), the rest over
``dp_shard × cp``. Named differences besides the above:

* transformers fuses the experts' gate and up projections (``gate_up_proj``, E × 2F × D) where
  torchtitan keeps ``w1_EFD`` and ``w3_EFD``: compared joined (local shapes concatenated on dim 1,
  bytes summed), with two Adam ``step`` scalars on torchtitan's side to gpulab's one.
* torchtitan's FSDP2 splits the experts on dim 1 when ``efsdp × ep`` exceeds E
  (``apply_fsdp_to_decoder``: no padded experts); the shapes expected follow it, gpulab's bytes
  are alike.
* ``FSDP2_PAD``: where ``n`` does not divide a tensor's dim 0, FSDP2's rank 0 holds ``ceil(d0 / n)``
  rows (``FSDPParam._init_sharded_param`` pads every rank's shard to ``chunks[0]``'s size); gpulab
  holds the same (``predict.sharding.shard_rows``; it held ``ceil(bytes / n)``, the average rank,
  before). The router's (8, 64) gate over 16 ranks is such a tensor: its meshes now expect no
  difference; a line that differs there still carries the term.
"""
from __future__ import annotations

import functools
import math
import re

import pytest
import torch

titan = pytest.importorskip("torchtitan", reason="torchtitan is a test-only reference: make test installs it (pip install --no-deps "
                                                 "torchtitan==0.3.0, with spmd-types, tyro and torchdata from the test extras)")

from gpulab.categories import Category   # noqa: E402
from gpulab.options import Layout   # noqa: E402

DIM, HEADS, KV_HEADS, LAYERS, VOCAB, FFN, SEQ = 64, 4, 2, 4, 256, 128, 32
MOE_LAYERS, HEAD_DIM, EXPERTS, TOP_K, MOE_FFN = 2, 16, 8, 2, 32   # the MoE model's own (the rest as Llama-3's)

# torchtitan's Llama-3 names -> transformers' LlamaForCausalLM names (layer numbers within the stage)
TITAN_TO_HF = [
    (r"tok_embeddings\.weight", "embed_tokens.weight"),
    (r"layers\.(\d+)\.attention\.qkv_linear\.wq\.weight", "layers.{}.self_attn.q_proj.weight"),
    (r"layers\.(\d+)\.attention\.qkv_linear\.wk\.weight", "layers.{}.self_attn.k_proj.weight"),
    (r"layers\.(\d+)\.attention\.qkv_linear\.wv\.weight", "layers.{}.self_attn.v_proj.weight"),
    (r"layers\.(\d+)\.attention\.wo\.weight", "layers.{}.self_attn.o_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w1\.weight", "layers.{}.mlp.gate_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w3\.weight", "layers.{}.mlp.up_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w2\.weight", "layers.{}.mlp.down_proj.weight"),
    (r"layers\.(\d+)\.attention_norm\.weight", "layers.{}.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", "layers.{}.post_attention_layernorm.weight"),
    (r"norm\.weight", "norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
]


# torchtitan's Qwen3-MoE names -> transformers' Qwen3MoeForCausalLM names. transformers fuses the experts'
# gate and up projections into one tensor, ``mlp.experts.gate_up_proj`` (E, 2·F, D): ``Qwen3MoeExperts``
# takes ``gate, up = linear(x, gate_up_proj[e]).chunk(2, dim=-1)``, gate first. torchtitan's
# ``GroupedExperts`` keeps them apart: ``w1_EFD`` (the gate, E × F × D) and ``w3_EFD`` (up). Those rows
# name their part: (transformers name, fused dim, part index).
QWEN3_MOE_TO_HF = [
    (r"tok_embeddings\.weight", "embed_tokens.weight"),
    (r"layers\.(\d+)\.attention\.qkv_linear\.wq\.weight", "layers.{}.self_attn.q_proj.weight"),
    (r"layers\.(\d+)\.attention\.qkv_linear\.wk\.weight", "layers.{}.self_attn.k_proj.weight"),
    (r"layers\.(\d+)\.attention\.qkv_linear\.wv\.weight", "layers.{}.self_attn.v_proj.weight"),
    (r"layers\.(\d+)\.attention\.wo\.weight", "layers.{}.self_attn.o_proj.weight"),
    (r"layers\.(\d+)\.attention\.q_norm\.weight", "layers.{}.self_attn.q_norm.weight"),
    (r"layers\.(\d+)\.attention\.k_norm\.weight", "layers.{}.self_attn.k_norm.weight"),
    (r"layers\.(\d+)\.moe\.router\.gate\.weight", "layers.{}.mlp.gate.weight"),
    (r"layers\.(\d+)\.moe\.routed_experts\.inner_experts\.w1_EFD", ("layers.{}.mlp.experts.gate_up_proj", 1, 0)),
    (r"layers\.(\d+)\.moe\.routed_experts\.inner_experts\.w3_EFD", ("layers.{}.mlp.experts.gate_up_proj", 1, 1)),
    (r"layers\.(\d+)\.moe\.routed_experts\.inner_experts\.w2_EDF", "layers.{}.mlp.experts.down_proj"),
    (r"layers\.(\d+)\.attention_norm\.weight", "layers.{}.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", "layers.{}.post_attention_layernorm.weight"),
    (r"norm\.weight", "norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
]


def _hf_name(titan_name: str, first_layer: int, table=TITAN_TO_HF):
    """The transformers name of a torchtitan parameter: a string, or (name, fused dim, part) for a part of
    a tensor transformers fuses."""
    for pattern, hf in table:
        m = re.fullmatch(pattern, titan_name)
        if m:
            name, *part = (hf,) if isinstance(hf, str) else hf
            name = name.format(int(m.group(1)) - first_layer) if m.groups() else name
            return (name, *part) if part else name
    raise AssertionError(f"torchtitan parameter {titan_name} has no transformers name in its table")


def _fuse(rows) -> dict[str, dict]:
    """torchtitan's rows by transformers name; the parts of a fused tensor joined as transformers fuses
    them: local shapes concatenated on the fused dim (in part order), ``parts`` tensors (each with
    its own Adam ``step``: ``step_bytes`` summed)."""
    out, parts = {}, {}
    for key, row in rows:
        if isinstance(key, str):
            out[key] = row
        else:
            parts.setdefault(key[0], []).append((key[2], key[1], row))
    for name, got in parts.items():
        got.sort(key=lambda x: x[0])
        assert [i for i, _, _ in got] == list(range(len(got))), f"{name}: parts {[i for i, _, _ in got]}"
        dim = got[0][1]
        fused = dict(got[0][2], parts=len(got), step_bytes=sum(r["step_bytes"] for _, _, r in got))
        for what in ("param", "grad", "exp_avg", "exp_avg_sq"):
            shapes = [r[what] for _, _, r in got]
            assert all(s[:dim] + s[dim + 1:] == shapes[0][:dim] + shapes[0][dim + 1:] for s in shapes), (name, shapes)
            fused[what] = (*shapes[0][:dim], sum(s[dim] for s in shapes), *shapes[0][dim + 1:])
        out[name] = fused
    return out


def _gpulab_name(name: str) -> str:
    """A transformers name without the model prefix (a pipeline stage before the last is the decoder alone)."""
    return name[len("model."):] if name.startswith("model.") else name


def _local(t):
    return tuple((t.to_local() if hasattr(t, "to_local") else t).shape)


def _titan_llama_config(sp: bool):
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import (_EMBEDDING_INIT, _NORM_INIT, Llama3Model, _build_llama3_layers,
                                          _output_linear_init)
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config
    cfg = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=_build_llama3_layers(fuse_qkv=False, n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS,
                                    hidden_dim=FFN, attn_backend="flex",
                                    rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ, theta=500000,
                                                            scaling="none")))
    # what Llama3Model.Config.update_from_config adds past Decoder's checks (that one imports the trainer,
    # whose metrics need tensorboard)
    set_llama3_sharding_config(cfg, enable_sp=sp)
    return cfg


def _titan_qwen3_moe_config(sp: bool, ep: int):
    """torchtitan's Qwen3-MoE at a small size, built as its ``qwen3_configs`` flavours are (its own
    ``_build_qwen3_moe_layers``: every layer an MoE, softmax router with ``route_norm``, no shared expert),
    the q/k/v projections unfused so each maps onto transformers' own."""
    import torchtitan.models.qwen3 as q
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config
    cfg = q.Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=q._qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=q._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=q._LINEAR_INIT),
        layers=q._build_qwen3_moe_layers(
            fuse_qkv=False, n_layers=MOE_LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
            moe_hidden_dim=MOE_FFN, num_experts=EXPERTS, top_k=TOP_K, attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=SEQ, theta=1000000.0)))
    # what Qwen3Model.Config.update_from_config adds past Decoder's checks (as for Llama-3 above)
    set_qwen3_sharding_config(cfg, enable_sp=sp, enable_ep=ep > 1)
    return cfg


def titan_rank(world: int, rank: int, *, dp_shard: int = 1, tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1,
               sp: bool = False, model: str = "llama3") -> dict[str, dict]:
    """torchtitan's rank ``rank`` of the mesh: {transformers name: {"param", "grad", "exp_avg", "exp_avg_sq",
    "step": local shapes, "itemsize", "step_bytes", "parts"}} (layer numbers counted from the stage's first).
    ``model``: "llama3" (``parallelize_llama``) or "qwen3_moe" (``parallelize_qwen3``, module docstring);
    where torchtitan keeps as several tensors what transformers fuses into one (``TITAN_FUSED``), the row
    is their concatenation (shapes on the fused dim, bytes summed) and ``parts`` counts them."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as pdims
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part, _pipeline_module_split
    from torchtitan.models.llama3 import parallelize_llama

    pdims.device_type = "cpu"   # the CUDA build's default is "cuda"; no GPU here (a fresh process each call)
    parallelism = ParallelismConfig(data_parallel_shard_degree=dp_shard, tensor_parallel_degree=tp,
                                    context_parallel_degree=cp, pipeline_parallel_degree=pp,
                                    expert_parallel_degree=ep, enable_sequence_parallel=sp)
    moe = model == "qwen3_moe"
    if moe:
        from torchtitan.models.qwen3 import parallelize_qwen3 as parallelize
    else:
        parallelize = parallelize_llama
    training = TrainingConfig(seq_len=SEQ, local_batch_size=2)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        dims = pdims.ParallelDims.from_config(parallelism, world)
        dims.build_mesh()
        with torch.device("meta"):
            model = (_titan_qwen3_moe_config(sp, ep) if moe else _titan_llama_config(sp)).build()
        if pp > 1:
            names = _generate_llm_fqn_per_model_part(pp, MOE_LAYERS if moe else LAYERS)
            _, parts = _pipeline_module_split(model, dims.get_mesh("pp"), parallelism.pipeline_parallel_schedule,
                                              torch.device("cpu"), names)
            (model,) = parts
        model = parallelize(model, parallel_dims=dims, training=training, parallelism=parallelism,
                                  compile_config=CompileConfig(), ac_config=None, dump_folder="")
        model.to_empty(device="cpu")
        params = [p for p in model.parameters()]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3)
        opt.step()
        layer_ids = [int(n.split(".")[1]) for n, _ in model.named_parameters() if n.startswith("layers.")]
        first = min(layer_ids, default=0)
        rows = []
        for name, p in model.named_parameters():
            st = opt.state[p]
            rows.append((_hf_name(name, first, QWEN3_MOE_TO_HF if moe else TITAN_TO_HF),
                         {"param": _local(p), "grad": _local(p.grad), "exp_avg": _local(st["exp_avg"]),
                          "exp_avg_sq": _local(st["exp_avg_sq"]), "step": _local(st["step"]),
                          "itemsize": p.element_size(), "step_bytes": st["step"].element_size(), "parts": 1}))
        return _fuse(rows)
    finally:
        dist.destroy_process_group()


def titan_rank_apart(world: int, rank: int, **kw) -> dict[str, dict]:
    """``titan_rank`` in a fresh process: after one torchtitan mesh in a process, a later one there can
    fail inside ``fully_shard`` ("Expected param's DTensor mesh to be the same mesh passed to
    fully_shard"), state some layer keeps past ``destroy_process_group``; alone each runs."""
    import json
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import json, sys; sys.path.insert(0, {here!r}); import test_torchtitan_shapes as t; "
            f"print(json.dumps(t.titan_rank({world}, {rank}, **{kw!r})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {k: {f: tuple(v) if isinstance(v, list) else v for f, v in row.items()}
            for k, row in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def _gpulab_config():
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=DIM, intermediate_size=FFN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                       num_hidden_layers=LAYERS, vocab_size=VOCAB, tie_word_embeddings=False,
                       max_position_embeddings=SEQ)


def _gpulab_moe_config():
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(hidden_size=DIM, intermediate_size=FFN, moe_intermediate_size=MOE_FFN,
                          num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                          num_hidden_layers=MOE_LAYERS, vocab_size=VOCAB, num_experts=EXPERTS,
                          num_experts_per_tok=TOP_K, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                          tie_word_embeddings=False, max_position_embeddings=SEQ)


FSDP2_PAD = "FSDP2_PAD "   # the named term of a difference (module docstring)


def _split0(shape: tuple[int, ...], n: int, dim: int = 0) -> tuple[int, ...]:
    """FSDP2's local shard on rank 0: dim ``dim`` (0 unless told) split ``n`` ways (``Shard(dim)``, ceil on
    the first ranks)."""
    return (*shape[:dim], math.ceil(shape[dim] / n), *shape[dim + 1:]) if n > 1 else shape


def _expert_dim(gl, experts: int | None) -> int:
    """The dim torchtitan's FSDP2 splits a routed expert's weight on (``experts``: E a layer): its
    ``apply_fsdp_to_decoder`` takes ``Shard(1)`` when ``efsdp × ep`` exceeds E (no padded experts),
    ``Shard(0)`` otherwise. gpulab holds bytes (``ceil(bytes / n)``), alike for both when the dim divides."""
    return 1 if experts and gl.experts_over * gl.layout.ep > experts else 0


def compare(titan: dict[str, dict], gl, experts: int | None = None) -> list[str]:
    """Each difference between torchtitan's rank and gpulab's (``RankState``), as a line (``experts``:
    the routed experts a layer, for an MoE)."""
    out = []
    ours = {_gpulab_name(n): t for n, t in gl.tensors.items()}
    if set(ours) != set(titan):
        out.append(f"tensors: only torchtitan {sorted(set(titan) - set(ours))}, only gpulab {sorted(set(ours) - set(titan))}")
    for name in sorted(set(ours) & set(titan)):
        t, g = titan[name], ours[name]
        n = gl.experts_over if g.expert else gl.sharded_over   # routed experts: torchtitan's efsdp mesh
        d = _expert_dim(gl, experts) if g.expert else 0
        want = {"param": _split0(g.shape, n, d), "grad": _split0(g.grad, n, d),
                "exp_avg": _split0(g.state["exp_avg"], n, d), "exp_avg_sq": _split0(g.state["exp_avg_sq"], n, d)}
        for what, shape in want.items():
            if t[what] != shape:
                out.append(f"{name} {what}: torchtitan {t[what]}, gpulab {shape} (before the strategy: "
                           f"{g.shape if what == 'param' else g.grad if what == 'grad' else g.state[what]}, n {n})")
        elem = t["itemsize"]
        held = {Category.PARAMETERS: math.prod(t["param"]) * elem, Category.GRADIENTS: math.prod(t["grad"]) * elem,
                Category.OPTIMIZER_STATE: 2 * math.prod(t["exp_avg"]) * elem + t["step_bytes"]}
        for cat, nbytes in held.items():
            mine = g.held[cat.value]
            # Adam's step counter: one per tensor, whole on every rank in torch, split n ways by gpulab's
            # formula; torchtitan's w1_EFD and w3_EFD are two tensors (two steps) where transformers fuses one
            one = t["step_bytes"] // t.get("parts", 1)
            slack = t["step_bytes"] - math.ceil(one / n) if cat is Category.OPTIMIZER_STATE else 0
            if not nbytes - slack <= mine <= nbytes:
                # rank 0's FSDP2 shard: ceil(d0 / n) rows where n does not divide dim 0 (module docstring)
                pad = d == 0 and n > 1 and len(g.shape) > 0 and g.shape[0] % n != 0
                out.append(f"{FSDP2_PAD if pad else ''}{name} {cat.value} bytes: torchtitan {nbytes}, gpulab {mine}")
    return out


def _gpulab_rank(layout: Layout, stage: int, model: str = "llama3"):
    from gpulab.predict.rank_state import rank_state
    config = _gpulab_moe_config() if model == "qwen3_moe" else _gpulab_config()
    return rank_state(config, layout, stage=stage, seq_len=SEQ)


# (id, torchtitan world and degrees, gpulab layout, stage, xfail reason or None)
FSDP4 = dict(world=4, dp_shard=4)
MESHES = [
    ("fsdp4", FSDP4, Layout(gpus=4, strategy="fsdp2"), 0, None, True),
    ("tp2", dict(world=2, tp=2), Layout(tp=2), 0, None, False),
    ("tp2-sp", dict(world=2, tp=2, sp=True), Layout(tp=2, sequence_parallel=True), 0, None, False),
    ("pp2-stage0", dict(world=2, pp=2), Layout(pp=2), 0, None, False),
    ("pp2-stage1", dict(world=2, pp=2), Layout(pp=2), 1, None, False),
    ("cp2", dict(world=2, cp=2), Layout(gpus=2, strategy="fsdp2", cp=2), 0, None, False),
    ("fsdp2-tp2", dict(world=4, dp_shard=2, tp=2), Layout(gpus=4, strategy="fsdp2", tp=2), 0, None, False),
    ("fsdp2-tp2-sp", dict(world=4, dp_shard=2, tp=2, sp=True),
     Layout(gpus=4, strategy="fsdp2", tp=2, sequence_parallel=True), 0, None, False),
    ("fsdp2-cp2", dict(world=4, dp_shard=2, cp=2), Layout(gpus=4, strategy="fsdp2", cp=2), 0, None, False),
    ("fsdp2-pp2-stage0", dict(world=4, dp_shard=2, pp=2), Layout(gpus=4, strategy="fsdp2", pp=2), 0, None, False),
    ("fsdp2-pp2-stage1", dict(world=4, dp_shard=2, pp=2), Layout(gpus=4, strategy="fsdp2", pp=2), 1, None, False),
    ("pp2-tp2-stage0", dict(world=4, tp=2, pp=2), Layout(pp=2, tp=2), 0, None, False),
    ("pp2-tp2-stage1", dict(world=4, tp=2, pp=2), Layout(pp=2, tp=2), 1, None, False),
    ("cp2-tp2", dict(world=4, cp=2, tp=2), Layout(gpus=4, strategy="fsdp2", cp=2, tp=2), 0, None, False),
    ("cp2-pp2-stage0", dict(world=4, cp=2, pp=2), Layout(gpus=4, strategy="fsdp2", cp=2, pp=2), 0, None, False),
    ("cp2-pp2-stage1", dict(world=4, cp=2, pp=2), Layout(gpus=4, strategy="fsdp2", cp=2, pp=2), 1, None, False),
]


@functools.lru_cache(maxsize=1)
def _fsdp4() -> dict[str, dict]:
    return titan_rank(4, 0, dp_shard=4)


def _params(meshes):
    for mid, titan_kw, layout, stage, xfail, default in meshes:
        marks = [] if default else [pytest.mark.extended]
        if xfail:
            marks.append(pytest.mark.xfail(strict=True, raises=AssertionError, reason=xfail))
        yield pytest.param(titan_kw, layout, stage, id=mid, marks=marks)


@pytest.mark.parametrize("titan_kw,layout,stage", list(_params(MESHES)))
def test_llama_rank_shapes_match_torchtitan(titan_kw, layout, stage):
    kw = dict(titan_kw)
    world = kw.pop("world")
    pp = kw.get("pp", 1)
    rank = stage * (world // pp)   # pp is the mesh's outermost dimension: stage s starts at rank s·world/pp
    # the default run's one mesh in this process (cached: the comparator's own test reuses it), the rest apart
    titan = _fsdp4() if titan_kw == FSDP4 else titan_rank_apart(world, rank, **kw)
    ours = _gpulab_rank(layout, stage)
    diffs = compare(titan, ours)
    assert not diffs, f"{layout.mesh}, stage {stage}:\n" + "\n".join(diffs)


def test_compare_names_a_difference():
    """The comparison can fail: torchtitan's FSDP-4 rank against gpulab's FSDP-2 answer differs by each
    tensor's dim 0 (and its bytes)."""
    titan = _fsdp4()
    diffs = compare(titan, _gpulab_rank(Layout(gpus=2, strategy="fsdp2"), 0))
    assert any("lm_head.weight param: torchtitan (64, 64), gpulab (128, 64)" in d for d in diffs), diffs


# torchtitan's Qwen3-MoE (``parallelize_qwen3``: ``Module.parallelize`` for TP and EP, then
# ``apply_fsdp_to_decoder``: the routed experts' weights FSDP-sharded over its ``efsdp`` mesh, the rest
# over ``dp_shard × cp``). EP borrows its ranks from ``dp_shard × cp × tp`` (``ParallelDims.build_mesh``:
# efsdp = dp_shard·cp·tp / ep), and the experts' dim 0 is split ``ep`` ways then ``efsdp`` ways.
# (id, torchtitan world and degrees, gpulab Layout's arguments, stage, a named term expected or None, default run)
MOE_FSDP2_EP2 = dict(world=2, dp_shard=2, ep=2)
MOE_MESHES = [
    ("moe-fsdp2-ep2", MOE_FSDP2_EP2, dict(gpus=2, strategy="fsdp2", ep=2), 0, None, True),
    ("moe-fsdp4", dict(world=4, dp_shard=4), dict(gpus=4, strategy="fsdp2"), 0, None, False),
    ("moe-fsdp4-ep4", dict(world=4, dp_shard=4, ep=4), dict(gpus=4, strategy="fsdp2", ep=4), 0, None, False),
    ("moe-fsdp4-ep2", dict(world=4, dp_shard=4, ep=2), dict(gpus=4, strategy="fsdp2", ep=2), 0, None, False),
    # 16 ranks: torchtitan splits the experts on dim 1 (efsdp × ep > E); the router's (8, 64) gate over 16
    # ranks is padded to one row a rank (FSDP2's padding, which gpulab holds: predict.sharding.shard_rows)
    ("moe-fsdp16", dict(world=16, dp_shard=16), dict(gpus=16, strategy="fsdp2"), 0, None, False),
    ("moe-fsdp16-ep2", dict(world=16, dp_shard=16, ep=2), dict(gpus=16, strategy="fsdp2", ep=2), 0, None,
     False),
    ("moe-fsdp2-ep2-pp2-stage0", dict(world=4, dp_shard=2, ep=2, pp=2), dict(gpus=4, strategy="fsdp2", ep=2, pp=2),
     0, None, False),
    ("moe-fsdp2-ep2-pp2-stage1", dict(world=4, dp_shard=2, ep=2, pp=2), dict(gpus=4, strategy="fsdp2", ep=2, pp=2),
     1, None, False),
    ("moe-tp2", dict(world=2, tp=2), dict(tp=2), 0, None, False),
    ("moe-tp2-sp", dict(world=2, tp=2, sp=True), dict(tp=2, sequence_parallel=True), 0, None, False),
    ("moe-cp2", dict(world=2, cp=2), dict(gpus=2, strategy="fsdp2", cp=2), 0, None, False),
    ("moe-pp2-stage0", dict(world=2, pp=2), dict(pp=2), 0, None, False),
    ("moe-pp2-stage1", dict(world=2, pp=2), dict(pp=2), 1, None, False),
    ("moe-ep2-tp2", dict(world=2, tp=2, ep=2), dict(gpus=2, strategy="fsdp2", tp=2, ep=2), 0, None, False),
    ("moe-fsdp2-ep2-tp2", dict(world=4, dp_shard=2, tp=2, ep=2), dict(gpus=4, strategy="fsdp2", tp=2, ep=2), 0,
     None, False),
    ("moe-ep2-tp2-sp", dict(world=2, tp=2, ep=2, sp=True),
     dict(gpus=2, strategy="fsdp2", tp=2, ep=2, sequence_parallel=True), 0, None, False),
    ("moe-fsdp2-ep4-tp2", dict(world=4, dp_shard=2, tp=2, ep=4), dict(gpus=4, strategy="fsdp2", tp=2, ep=4), 0,
     None, False),
    ("moe-ep2-cp2", dict(world=2, cp=2, ep=2), dict(gpus=2, strategy="fsdp2", cp=2, ep=2), 0, None, False),
    ("moe-fsdp2-ep2-cp2", dict(world=4, dp_shard=2, cp=2, ep=2), dict(gpus=4, strategy="fsdp2", cp=2, ep=2), 0,
     None, False),
]


@functools.lru_cache(maxsize=1)
def _moe_fsdp2_ep2() -> dict[str, dict]:
    return titan_rank(2, 0, model="qwen3_moe", dp_shard=2, ep=2)


def _moe_params(meshes):
    for mid, titan_kw, layout_kw, stage, term, default in meshes:
        marks = [] if default else [pytest.mark.extended]
        yield pytest.param(titan_kw, layout_kw, stage, term == FSDP2_PAD, id=mid, marks=marks)


@pytest.mark.parametrize("titan_kw,layout_kw,stage,padded", list(_moe_params(MOE_MESHES)))
def test_moe_rank_shapes_match_torchtitan(titan_kw, layout_kw, stage, padded):
    kw = dict(titan_kw)
    world = kw.pop("world")
    rank = stage * (world // kw.get("pp", 1))
    layout = Layout(**layout_kw)
    ours = _gpulab_rank(layout, stage, "qwen3_moe")
    # the default run's one MoE mesh in this process, the rest apart (as for Llama-3 above)
    titan = _moe_fsdp2_ep2() if titan_kw == MOE_FSDP2_EP2 else titan_rank_apart(world, rank, model="qwen3_moe", **kw)
    diffs = compare(titan, ours, EXPERTS)
    named = [d for d in diffs if d.startswith(FSDP2_PAD)]
    assert not set(diffs) - set(named), f"{layout.mesh}, stage {stage}:\n" + "\n".join(diffs)
    # the named term where the mesh expects it and nowhere else (gpulab holding the padded rows ends it)
    assert bool(named) == padded, f"{layout.mesh}: FSDP2_PAD expected {padded}, found {named}"


def test_moe_compare_names_a_difference():
    """The MoE comparison can fail: torchtitan's EP 2 rank over 2 ranks against gpulab's EP 2 over 4 differs
    by the experts' share (the fused gate_up_proj against torchtitan's w1_EFD and w3_EFD joined) and by
    the rest's dim 0."""
    diffs = compare(_moe_fsdp2_ep2(), _gpulab_rank(Layout(gpus=4, strategy="fsdp2", ep=2), 0, "qwen3_moe"), EXPERTS)
    assert any(f"layers.0.mlp.experts.gate_up_proj param: torchtitan ({EXPERTS // 2}, {2 * MOE_FFN}, {DIM}), "
               f"gpulab ({EXPERTS // 4}, {2 * MOE_FFN}, {DIM})" in d for d in diffs), diffs
    assert any("lm_head.weight param: torchtitan (128, 64), gpulab (64, 64)" in d for d in diffs), diffs
