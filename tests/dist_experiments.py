"""Experiments for tests/test_distributed.py: the runner's workers import them by name (spawned
processes cannot import functions defined inside a test)."""
import os
import time

import torch
import torch.distributed as dist


def all_reduce_rank(ctx):
    t = torch.full((1024,), float(ctx.rank + 1))
    dist.all_reduce(t)
    return {"sum": float(t[0])}


def raise_on_rank1(ctx):
    if ctx.rank == 1:
        raise RuntimeError("rank one refuses")
    dist.barrier()  # rank 0 waits for rank 1 forever: the runner must stop it
    return {}


def hang_on_rank1(ctx):
    if ctx.rank == 1:
        time.sleep(3600)
    return {}


def die_on_rank0(ctx):
    if ctx.rank == 0:
        os._exit(3)
    dist.barrier()
    return {}


def write_pid_and_sleep(ctx, directory):
    """Each rank writes its pid to ``directory/rank<N>.pid``, then sleeps: a run for killing its parent."""
    import pathlib
    path = pathlib.Path(directory) / f"rank{ctx.rank}.pid"
    path.with_suffix(".tmp").write_text(str(os.getpid()))
    path.with_suffix(".tmp").rename(path)
    time.sleep(3600)
    return {}


def tp_embedding_and_head(ctx, layouts):
    """One forward and backward of a tiny Llama on each rank of a real two-rank mesh, for each
    (sequence_parallel, loss_parallel) in ``layouts``: gpulab's layout (``training.tensor_parallel``)
    and, for the embedding, the DTensor route to the same vocabulary split (torch's ``RowwiseParallel``
    on the ``nn.Embedding``, torchtitan's ``apply_tp`` before 0.3). Returns, per layout, the local
    shapes and bytes of the embedding's and the head's weight and gradient, the loss, and how far the
    rank's embedding and head gradient rows are from the same rows of a one-process run."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpulab.training.tensor_parallel import loss_parallel_context, tensor_parallel

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)

    def model():
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg)

    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    whole = model()
    reference = whole(input_ids=ids, labels=ids).loss
    reference.backward()

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    def described(p):
        w, g = local(p), local(p.grad)
        return {"weight": tuple(w.shape), "weight_bytes": w.nbytes, "grad": tuple(g.shape), "grad_bytes": g.nbytes,
                "grad_placements": str(getattr(p.grad, "placements", None))}

    out = {}
    for sp, lp in layouts:
        net = model()
        with loss_parallel_context(lp):
            tensor_parallel(net, mesh, sp, lp)
            loss = net(input_ids=ids, labels=ids).loss
            loss.backward()
        emb, head = net.model.embed_tokens.weight, net.lm_head.weight
        rows = local(emb).shape[0]
        start = ctx.rank * rows
        out[(sp, lp)] = {
            "embedding": described(emb), "head": described(head), "loss": float(local(loss).detach()),
            "embedding_grad_error": float((local(emb.grad) - whole.model.embed_tokens.weight.grad[start:start + rows]).abs().max()),
            "head_grad_error": float((local(head.grad) - whole.lm_head.weight.grad[start:start + rows]).abs().max())}
    for sp in sorted({sp for sp, _ in layouts}):   # the DTensor route: its gradient's shape
        net = model()
        parallelize_module(net.model, mesh, {"embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate())})
        hidden = net.model.embed_tokens(ids)
        (hidden.full_tensor() if isinstance(hidden, DTensor) else hidden).float().pow(2).sum().backward()
        out[("dtensor_rowwise", sp)] = described(net.model.embed_tokens.weight)
    # transformers' own embedding_rowwise (5.25's EmbeddingParallel, as from_pretrained(tp_plan=...) applies it)
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES
    net = model()
    style = ALL_PARALLEL_STYLES["embedding_rowwise"]
    style.shard_param(net.model.embed_tokens, "weight", mesh)
    style.install_forward(net.model.embed_tokens, mesh)
    net.model.embed_tokens(ids).float().pow(2).sum().backward()
    out["transformers_embedding_rowwise"] = described(net.model.embed_tokens.weight)
    out["reference_loss"] = float(reference)
    return out
