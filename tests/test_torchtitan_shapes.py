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
and gpulab holds ``ceil(bytes / n)``), and the bytes per rank by category. Named differences:

* Adam's ``step``: torch keeps a 4-byte scalar per parameter whole on every rank; gpulab's formula
  splits every optimizer-state byte ``n`` ways (``predict.sharding.held_bytes``), so it holds
  ``ceil(4 / n)``: compared with that tolerance (4 bytes a tensor), the moments exactly.
* Not compared: what FSDP2 adds beside the rank's tensors (its gathered unit, ``RankState.extra``),
  which torchtitan's parameters do not show.
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


def _hf_name(titan_name: str, first_layer: int) -> str:
    for pattern, hf in TITAN_TO_HF:
        m = re.fullmatch(pattern, titan_name)
        if m:
            return hf.format(int(m.group(1)) - first_layer) if m.groups() else hf
    raise AssertionError(f"torchtitan parameter {titan_name} has no transformers name in TITAN_TO_HF")


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


def titan_rank(world: int, rank: int, *, dp_shard: int = 1, tp: int = 1, cp: int = 1, pp: int = 1,
               sp: bool = False) -> dict[str, dict]:
    """torchtitan's rank ``rank`` of the mesh: {transformers name: {"param", "grad", "exp_avg", "exp_avg_sq",
    "step": local shapes, "itemsize", "step_bytes"}} (layer numbers counted from the stage's first)."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as pdims
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part, _pipeline_module_split
    from torchtitan.models.llama3 import parallelize_llama

    pdims.device_type = "cpu"   # the CUDA build's default is "cuda"; no GPU here (a fresh process each call)
    parallelism = ParallelismConfig(data_parallel_shard_degree=dp_shard, tensor_parallel_degree=tp,
                                    context_parallel_degree=cp, pipeline_parallel_degree=pp,
                                    enable_sequence_parallel=sp)
    training = TrainingConfig(seq_len=SEQ, local_batch_size=2)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        dims = pdims.ParallelDims.from_config(parallelism, world)
        dims.build_mesh()
        with torch.device("meta"):
            model = _titan_llama_config(sp).build()
        if pp > 1:
            names = _generate_llm_fqn_per_model_part(pp, LAYERS)
            _, parts = _pipeline_module_split(model, dims.get_mesh("pp"), parallelism.pipeline_parallel_schedule,
                                              torch.device("cpu"), names)
            (model,) = parts
        model = parallelize_llama(model, parallel_dims=dims, training=training, parallelism=parallelism,
                                  compile_config=CompileConfig(), ac_config=None, dump_folder="")
        model.to_empty(device="cpu")
        params = [p for p in model.parameters()]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3)
        opt.step()
        layer_ids = [int(n.split(".")[1]) for n, _ in model.named_parameters() if n.startswith("layers.")]
        first = min(layer_ids, default=0)
        out = {}
        for name, p in model.named_parameters():
            st = opt.state[p]
            out[_hf_name(name, first)] = {"param": _local(p), "grad": _local(p.grad), "exp_avg": _local(st["exp_avg"]),
                                          "exp_avg_sq": _local(st["exp_avg_sq"]), "step": _local(st["step"]),
                                          "itemsize": p.element_size(), "step_bytes": st["step"].element_size()}
        return out
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


def _split0(shape: tuple[int, ...], n: int) -> tuple[int, ...]:
    """FSDP2's local shard on rank 0: dim 0 split ``n`` ways (``Shard(0)``, ceil on the first ranks)."""
    return (math.ceil(shape[0] / n), *shape[1:]) if n > 1 else shape


def compare(titan: dict[str, dict], gl) -> list[str]:
    """Each difference between torchtitan's rank and gpulab's (``RankState``), as a line."""
    out = []
    ours = {_gpulab_name(n): t for n, t in gl.tensors.items()}
    if set(ours) != set(titan):
        out.append(f"tensors: only torchtitan {sorted(set(titan) - set(ours))}, only gpulab {sorted(set(ours) - set(titan))}")
    n = gl.sharded_over
    for name in sorted(set(ours) & set(titan)):
        t, g = titan[name], ours[name]
        want = {"param": _split0(g.shape, n), "grad": _split0(g.grad, n),
                "exp_avg": _split0(g.state["exp_avg"], n), "exp_avg_sq": _split0(g.state["exp_avg_sq"], n)}
        for what, shape in want.items():
            if t[what] != shape:
                out.append(f"{name} {what}: torchtitan {t[what]}, gpulab {shape} (before the strategy: "
                           f"{g.shape if what == 'param' else g.grad if what == 'grad' else g.state[what]}, n {n})")
        elem = t["itemsize"]
        held = {Category.PARAMETERS: math.prod(t["param"]) * elem, Category.GRADIENTS: math.prod(t["grad"]) * elem,
                Category.OPTIMIZER_STATE: 2 * math.prod(t["exp_avg"]) * elem + t["step_bytes"]}
        for cat, nbytes in held.items():
            mine = g.held[cat.value]
            # Adam's step counter: whole on every rank in torch, split n ways by gpulab's formula
            slack = t["step_bytes"] - math.ceil(t["step_bytes"] / n) if cat is Category.OPTIMIZER_STATE else 0
            if not nbytes - slack <= mine <= nbytes:
                out.append(f"{name} {cat.value} bytes: torchtitan {nbytes}, gpulab {mine}")
    return out


def _gpulab_rank(layout: Layout, stage: int):
    from gpulab.predict.rank_state import rank_state
    return rank_state(_gpulab_config(), layout, stage=stage, seq_len=SEQ)


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
