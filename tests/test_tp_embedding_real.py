"""The embedding and head under tensor parallelism, as gpulab lays them out (torchtitan's layout:
``gpulab.training.tensor_parallel``), checked on two real gloo ranks against a one-process run,
and gpulab's fake process group (what its answers measure) against those real ranks."""
from __future__ import annotations

import pytest
import torch

import dist_experiments
from gpulab.distributed.runner import run_distributed

LAYOUTS = [(False, False), (True, False), (False, True), (True, True)]   # (sequence_parallel, loss_parallel)
VOCAB, HIDDEN = 96, 32   # dist_experiments.tp_embedding_and_head's tiny Llama


def _fake_world_shapes(sp: bool, lp: bool) -> dict:
    """The same layout on gpulab's fake process group (rank 0 of 2), one forward and backward."""
    from torch.distributed.tensor import DTensor
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpulab.training.tensor_parallel import fake_world, loss_parallel_context, tensor_parallel
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    net = LlamaForCausalLM(cfg)
    ids = torch.randint(0, VOCAB, (2, 8))
    with fake_world(2) as mesh, loss_parallel_context(lp):
        tensor_parallel(net, mesh, sp, lp)
        net(input_ids=ids, labels=ids).loss.backward()
        out = {}
        for name, p in (("embedding", net.model.embed_tokens.weight), ("head", net.lm_head.weight)):
            w, g = (t.to_local() if isinstance(t, DTensor) else t for t in (p, p.grad))
            out[name] = {"weight": tuple(w.shape), "weight_bytes": w.nbytes, "grad": tuple(g.shape),
                         "grad_bytes": g.nbytes, "grad_placements": str(getattr(p.grad, "placements", None))}
    return out


@pytest.mark.extended   # two spawned ranks importing torch and transformers: about 35 s on 2 cores
def test_embedding_and_head_on_two_real_ranks():
    run = run_distributed(dist_experiments.tp_embedding_and_head, 2, args=(LAYOUTS,), backend="gloo",
                          timeout_s=240).check()
    shard = {"weight": (VOCAB // 2, HIDDEN), "weight_bytes": VOCAB // 2 * HIDDEN * 4,
             "grad": (VOCAB // 2, HIDDEN), "grad_bytes": VOCAB // 2 * HIDDEN * 4, "grad_placements": "(Shard(dim=0),)"}
    for rank in (0, 1):
        data = run.rank(rank).data
        for sp, lp in LAYOUTS:
            got = data[(sp, lp)]
            # the vocabulary split, weight and gradient alike, with or without SP and loss parallelism
            assert got["embedding"] == shard and got["head"] == shard, (rank, sp, lp)
            # and the numbers right: the loss, and the rank's rows of the one-process gradients
            assert got["loss"] == pytest.approx(data["reference_loss"], rel=1e-5)
            assert got["embedding_grad_error"] < 1e-5 and got["head_grad_error"] < 1e-5
            if rank == 0:   # gpulab's fake process group measures what the real rank 0 holds
                assert _fake_world_shapes(sp, lp) == {"embedding": got["embedding"], "head": got["head"]}
        # the DTensor route to the same split (torch's RowwiseParallel on the nn.Embedding, transformers'
        # embedding_rowwise) keeps the gradient whole and replicated: DTensor's embedding backward has no
        # vocabulary-sharded strategy (the module docstring's NB)
        whole = {"weight": (VOCAB // 2, HIDDEN), "weight_bytes": VOCAB // 2 * HIDDEN * 4, "grad": (VOCAB, HIDDEN),
                 "grad_bytes": VOCAB * HIDDEN * 4, "grad_placements": "(Replicate(),)"}
        assert data[("dtensor_rowwise", False)] == data[("dtensor_rowwise", True)] == whole
        assert data["transformers_embedding_rowwise"] == whole


@pytest.mark.extended   # make test checks the split through gpulab.step (test_tensor_parallel's parameters,
@pytest.mark.parametrize("sp,lp", LAYOUTS)   # the Gemma-2 test's tied gradient below)
def test_fake_world_holds_the_vocabulary_split(sp, lp):
    """What gpulab's answers measure, rank 0 of 2, against the split counted from the config (the real
    two-rank run above checks the same)."""
    shard = {"weight": (VOCAB // 2, HIDDEN), "weight_bytes": VOCAB // 2 * HIDDEN * 4,
             "grad": (VOCAB // 2, HIDDEN), "grad_bytes": VOCAB // 2 * HIDDEN * 4, "grad_placements": "(Shard(dim=0),)"}
    assert _fake_world_shapes(sp, lp) == {"embedding": shard, "head": shard}


def _gemma2(layers: int = 2):
    from gpulab.models import hf_configs
    cfg = hf_configs.make_config("gemma-2-2b")
    cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = 512, 64, 128, 16
    cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.sliding_window = layers, 4, 2, 16
    cfg.layer_types = cfg.layer_types[:layers]
    return cfg


def test_gemma2_with_sequence_parallelism():
    """The probe's failure: Gemma-2's block normalizes the attention's and the MLP's outputs too
    (post_attention_layernorm, pre_ and post_feedforward_layernorm), and sequence parallelism left two
    of them whole, so the residual add met a plain tensor ("aten.add.Tensor got mixed torch.Tensor and
    DTensor"). Now every norm of the block runs on the sequence shard; its tied embedding and head stay
    one parameter, split by vocabulary; the scaled embedding and the soft-capped logits run on it, with
    loss parallelism too."""
    import gpulab
    from torch.distributed.tensor import DTensor

    from gpulab.training.tensor_parallel import fake_world, loss_parallel_context, tensor_parallel
    cfg = _gemma2()
    from transformers import AutoModelForCausalLM
    net = AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 32))
    with fake_world(2) as mesh, loss_parallel_context(True):
        tensor_parallel(net, mesh, sequence_parallel=True, loss_parallel=True)
        block = net.model.layers[0]
        seen = {}
        for name in ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            getattr(block, name).register_forward_hook(lambda m, a, o, name=name: seen.setdefault(name, o))
        out = net(input_ids=ids, labels=ids)
        out.loss.backward()
        assert all(isinstance(o, DTensor) and o.to_local().shape[1] == 16 for o in seen.values()), seen
        assert net.lm_head.weight is net.model.embed_tokens.weight
        assert net.lm_head.weight.grad.to_local().shape == (cfg.vocab_size // 2, cfg.hidden_size)
        assert isinstance(out.logits, DTensor) and out.logits.to_local().shape[-1] == cfg.vocab_size // 2
    # gpulab's answer on the probe's path (the fake engine): one rank's parameters, counted from the config:
    # the projections split two ways, the tied embedding once, split by vocabulary, the norms whole
    r = gpulab.step(cfg, batch=2, seq_len=32, optimizer="adamw", dtype="bf16", engine="fake", tp=2,
                    sequence_parallel=True, loss_parallel=True)
    h, f, v, n = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    split = n * (2 * h * q + 2 * h * kv + 3 * h * f) + v * h
    assert r.tensor_bytes_by_category["parameters"] == 2 * (split // 2 + n * 4 * h + h)
    assert "sequence parallel, logits and loss sharded on the vocabulary" in r.as_dict()["recipe"]["tensor_parallel"]["text"]
