"""Context parallelism per rank: the sequence sharded over ``cp`` ranks, attention by ring.

PyTorch's ``torch.distributed.tensor.experimental.context_parallel`` shards the batch's sequence
dimension over a mesh axis and replaces ``scaled_dot_product_attention``'s flash / efficient ops
by a ring (``_context_parallel/_attention.py``: ``_templated_ring_attention`` in forward,
``_templated_ring_attention_backward`` in backward). Its default layout is load-balanced for
causal masks (``_ContextParallelOptions.enable_load_balance = True``: each rank takes a head
chunk and a tail chunk of the sequence, ``2·cp`` chunks in all), and its K/V rotation defaults to
one all-gather (``rotate_method = _RotateMethod.ALL_GATHER``, ``_AllGatherRotater``).

**What gpulab measures, and what it computes.** The CP machinery dispatches through DTensor ops
on real device meshes and was not run here on fake tensors; gpulab measures instead the rank's
step with its sequence shard, ``s/cp`` tokens (``sequence_shard``): every tensor of the layers
outside attention is a function of the rank's tokens only, so it is exactly the CP rank's, and
the attention ops save what the ring's do (the local q, k, v, the output and its logsumexp: the
ring's backward runs the same flash / efficient backward on them). What attention needs beyond
the shard is not in that run and is added as a **formula** (``ring_buffers``, labelled so), from
the source lines above, per attention layer:

* forward: the local K and V concatenated to send (``torch.cat([key.flatten(), value.flatten()])``,
  ``2·(s/cp)·b·kv·d`` values), their all-gather over the ring (``ft_c.all_gather_single``: the whole
  sequence's K and V, ``2·s·b·kv·d``), and the float32 merge of partial outputs (``_SDPAMerger``
  with ``convert_to_f32``: ``(s/cp)·b·a·d`` output and ``b·a·(s/cp)`` logsumexp);
* backward: the all-gather again (``2·s·b·kv·d``), the float32 accumulators of dq, dk, dv
  (``zeros_like(..., dtype=accum_dtype)``: ``(s/cp)·b·(a + 2·kv)·d``), and the dK/dV rotation by
  all-to-all (``_AllToAllRotater``: send and receive, ``2 × 2·(s/cp)·b·kv·d`` float32).

These are transient: alive during one attention layer's forward or backward. The larger of the two
(backward's) is what a rank's answer states beside its measured peak (``layout_notes``:
``transient_bytes``); measured peak plus it is an upper bound (it counts the buffers as if they
were alive at the peak, wherever that falls). The gathered K/V is the part of a CP rank that does not fall with cp: the
whole sequence's keys and values, one layer at a time.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from gpulab.measure.engines import LABEL_FORMULA
from gpulab.options import check_cp_ep_options, check_cp_options   # torch-free: the CLI checks them first
from gpulab.training.routing import is_moe
from gpulab.units import format_bytes

__all__ = ["RING_SOURCE", "RingBuffers", "check_context_parallel", "check_cp_ep_options", "check_cp_options", "layout_notes", "ring_buffers",
           "sequence_shard"]

RING_SOURCE = ("torch/distributed/tensor/experimental/_context_parallel/_attention.py: _ContextParallelOptions "
               "(enable_load_balance=True, rotate_method=ALL_GATHER), _templated_ring_attention[_backward], "
               "_AllGatherRotater, _AllToAllRotater, _SDPAMerger")


def check_context_parallel(w: Any, cp: int, tp: int = 1, sequence_parallel: bool = False) -> None:
    """ValueError, in one line: cp on a model that is not a language model, a sequence the
    load-balanced layout cannot split (``2·cp`` chunks; with sequence parallelism ``2·cp·tp``), or an
    eager-attention config (the ring replaces scaled_dot_product_attention's kernels)."""
    check_cp_options(cp)
    if cp == 1:
        return
    if w.kind != "tokens" or not w.seq_len:
        raise ValueError(f"--cp {cp} shards a language model's sequence; {w.name} is a {w.kind} model: leave --cp out")
    chunks = 2 * cp * (tp if sequence_parallel else 1)
    if w.seq_len % chunks:
        what = f"2·cp·tp = {chunks}" if sequence_parallel else f"2·cp = {chunks}"
        lower, upper = w.seq_len // chunks * chunks, (w.seq_len // chunks + 1) * chunks
        raise ValueError(f"--cp {cp}: sequence length {w.seq_len} does not split into {what} equal chunks (PyTorch's "
                         f"load-balanced causal layout gives each rank a head and a tail chunk): use a sequence "
                         f"length that {chunks} divides, e.g. {lower or upper} or {upper}")
    if getattr(w.config, "_attn_implementation", None) == "eager":
        raise ValueError(f"--cp {cp}: ring attention replaces scaled_dot_product_attention's kernels; this config asks "
                         f"for eager attention: use sdpa")


def sequence_shard(w: Any, cp: int) -> Any:
    """``w`` with one CP rank's batch: token ids (and labels) of ``seq_len/cp`` positions."""
    if cp == 1:
        return w
    shard = w.seq_len // cp
    vocab = w.config.vocab_size if w.config is not None else 2

    def make(b: int, dtype):
        ids = torch.randint(0, vocab, (b, shard))
        return (), {"input_ids": ids, "labels": ids}
    return dataclasses.replace(w, inputs=make, seq_len=shard,
                               input_text=f"token ids (B, {shard}) int64, also the labels: rank 0's sequence shard "
                                          f"({w.seq_len}/{cp})")


@dataclass(frozen=True)
class RingBuffers:
    """Ring attention's transient buffers of one attention layer on one CP rank (bytes; a formula)."""
    forward_bytes: int
    backward_bytes: int
    gathered_kv_bytes: int
    label: str = f"{LABEL_FORMULA}: {RING_SOURCE}"

    @property
    def peak_bytes(self) -> int:
        return max(self.forward_bytes, self.backward_bytes)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def ring_buffers(seq_len: int, cp: int, batch: int, heads: int, kv_heads: int, head_dim: int,
                 itemsize: int) -> RingBuffers:
    """``RingBuffers`` for a sequence of ``seq_len`` over ``cp`` ranks (module docstring's terms)."""
    local = seq_len // cp
    kv_local = 2 * local * batch * kv_heads * head_dim
    gathered = 2 * seq_len * batch * kv_heads * head_dim * itemsize
    forward = kv_local * itemsize + gathered + (local * batch * heads * head_dim + batch * heads * local) * 4
    backward = gathered + local * batch * (heads + 2 * kv_heads) * head_dim * 4 + 2 * kv_local * 4
    return RingBuffers(forward, backward, gathered)


def layout_notes(w: Any, r: Any, batch: int, itemsize: int) -> dict[str, dict[str, Any]]:
    """What one rank's answer states about its context- and expert-parallel layout (``w``: the
    whole workload; ``r``: the recipe; ``itemsize``: the activations' bytes per value): the ring's
    buffers (a formula, not in the measured run) and the all-to-all buffers (in the run), with
    the layout and its assumptions in words."""
    notes: dict[str, dict[str, Any]] = {}
    if r.cp > 1:
        c = w.config
        heads = c.num_attention_heads
        kv = getattr(c, "num_key_value_heads", None) or heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        ring = ring_buffers(w.seq_len, r.cp, batch, heads, kv, head_dim, itemsize)
        notes["context_parallel"] = {
            **ring.as_dict(), "transient_bytes": ring.peak_bytes,
            "text": (f"cp={r.cp}: rank 0's sequence shard of {w.seq_len // r.cp} tokens measured; ring attention's "
                     f"buffers per attention layer, not in that run, as a formula ({format_bytes(ring.peak_bytes)} at most, "
                     f"{format_bytes(ring.gathered_kv_bytes)} of it the whole sequence's K and V, which cp does "
                     f"not divide)")}
    if r.ep > 1:
        from gpulab.training.expert_parallel import ep_buffers, total_experts
        c = w.config
        # the rank's tokens: its sequence shard's, and with tp 1/tp of its tp group's (moe_parallel)
        tokens = batch * (w.seq_len // r.cp) // r.tp
        buffers = ep_buffers(r.routing, tokens, c.num_experts_per_tok, total_experts(c), r.ep,
                             c.hidden_size, itemsize)
        whole = "router whole" if r.tp > 1 else "attention and router whole"
        notes["expert_parallel"] = {
            **buffers.as_dict(), "tokens": tokens,
            "text": (f"ep={r.ep}: rank 0 holds {buffers.local_experts} of {total_experts(c)} experts per layer (their "
                     f"weights, gradients and optimizer state), {whole}; measured {buffers.text}")}
    if r.tp > 1 and w.config is not None and w.kind == "tokens" and is_moe(w.config):
        from gpulab.training.expert_parallel import total_experts
        from gpulab.training.moe_parallel import moe_tp_text
        notes["moe_tensor_parallel"] = {"experts_tp_split": r.ep == 1,
                                        "text": f"tp={r.tp}: {moe_tp_text(r.tp, r.ep, total_experts(w.config))}"}
    return notes
