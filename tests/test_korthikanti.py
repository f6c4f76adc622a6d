"""Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
arXiv 2205.05198), Table 2, reproduced by gpulab's measured per-rank activations.

Table 2 gives the activation bytes one transformer layer saves for backward, per rank, for a
GPT layer (pre-LayerNorm, 4h GeLU MLP, dropout on the attention probabilities and after both
projections, 16-bit values, 1-byte dropout masks):

    no parallelism                         sbh(34 + 5as/h)
    tensor parallel                        sbh(10 + 24/t + 5as/(ht))
    tensor + sequence parallel             sbh(34/t + 5as/(ht))
    tensor parallel, selective recompute   sbh(10 + 24/t)
    tensor + sequence, selective recompute sbh(34/t)

(and "no parallelism, selective recompute" sbh·34). The shapes are the paper's Table 3: GPT-3
175B (a = 96, h = 12288), 530B (a = 128, h = 20480) and 1T (a = 160, h = 25600), s = 2048,
t = 8, micro-batch b = 1.

The layer measured: transformers' Starcoder2 layer set up as a GPT layer (LayerNorm with bias,
q/k/v/o with bias, 4h MLP with one-kernel tanh GeLU, attention and residual dropout 0.1, heads
as many key/value heads as query heads, eager attention), one layer, on fake tensors, tensor-
parallel over PyTorch's fake process group (``gpulab.step(..., tp=8, sequence_parallel=...)``;
the model's own ``base_model_tp_plan``); the bytes are what the layer's modules saved in forward
(``_saved_by_layer``: activation-category storages created in the forward, by layer). Selective
recomputation is Megatron-LM's: the core attention (QKᵀ, softmax, dropout, ·V) under
``torch.utils.checkpoint``, registered as an attention implementation.

The measured bytes equal the paper's exactly plus these terms, each asserted by name:

* ``fp32 softmax``: transformers' eager attention computes the softmax in float32
  (``softmax(..., dtype=torch.float32).to(q.dtype)``) and softmax's backward keeps its float32
  output: 4 bytes per score where the paper counts 2: + 2·a·s²·b/t (not with selective
  recompute: the scores are recomputed);
* ``layernorm stats``: each LayerNorm keeps a mean and a 1/std per token for backward, which the
  paper drops: 2 norms × 2 × s·b (/t with sequence parallelism) values, in the activation dtype on
  fake tensors (2 bytes; a GPU's kernel keeps them in float32: 4);
* ``gathered inputs`` (sequence parallelism only): PyTorch's DTensor saves the all-gathered
  input of the column-parallel q/k/v and MLP projections for their backward (2·s·b·h each,
  whole); Megatron-LM saves its sequence shard (2·s·b·h/t) and gathers it again in backward:
  + 2 × 2·s·b·h·(1 − 1/t); the norms' own outputs are then not saved at all.

Rotary position embeddings (Starcoder2's; GPT-3 has learned positions) add nothing per layer:
Q and K are saved once, after rotation, and cos/sin are made outside the layers.
"""
from __future__ import annotations

import pytest
import torch

import gpulab
from gpulab.course.transformer_activations import _saved_by_layer

S, B, T = 2048, 1, 8
SHAPES = {"GPT-3 175B": (96, 12288), "530B": (128, 20480), "1T": (160, 25600)}   # Table 3: (a, h)
SELECTIVE = "korthikanti_selective"
STAT_BYTES = 2   # LayerNorm's mean and 1/std, in the activation dtype (bf16) on fake tensors


def _selective_attention(module, query, key, value, attention_mask, **kwargs):
    """Megatron-LM's selective recomputation: the core attention checkpointed; only its inputs
    (Q, K, V) are kept, the scores recomputed in backward."""
    from torch.utils.checkpoint import checkpoint
    from transformers.models.starcoder2.modeling_starcoder2 import eager_attention_forward
    out, _ = checkpoint(eager_attention_forward, module, query, key, value, attention_mask, use_reentrant=False,
                        **kwargs)
    return out, None


def _gpt_layer(a: int, h: int, selective: bool):
    from transformers import AttentionInterface, Starcoder2Config
    AttentionInterface.register(SELECTIVE, _selective_attention)
    cfg = Starcoder2Config(hidden_size=h, num_attention_heads=a, num_key_value_heads=a, intermediate_size=4 * h,
                           num_hidden_layers=1, vocab_size=256, max_position_embeddings=S,
                           hidden_act="gelu_pytorch_tanh", residual_dropout=0.1, attention_dropout=0.1,
                           embedding_dropout=0.0, use_bias=True, use_cache=False, tie_word_embeddings=True,
                           bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = SELECTIVE if selective else "eager"
    return cfg


def _measured_layer(a: int, h: int, tp: int, sp: bool, selective: bool) -> int:
    r = gpulab.step(_gpt_layer(a, h, selective), batch=B, seq_len=S, optimizer="sgd", dtype="bf16", engine="fake",
                    steps=1, tp=tp, sequence_parallel=sp)
    per_layer, *_ = _saved_by_layer(r.measurement, 1)
    return per_layer[0]


def _table2(a: int, h: int, t: int, sp: bool, selective: bool) -> float:
    """Table 2's row, in bytes (t = 1: no parallelism)."""
    sbh = S * B * h
    scores = 0 if selective else 5 * a * S / (h * t)
    if sp:
        return sbh * (34 / t + scores)
    return sbh * (10 + 24 / t + scores)


ROWS = [(1, False, False), (T, False, False), (T, True, False), (1, False, True), (T, False, True), (T, True, True)]


@pytest.mark.parametrize("tp,sp,selective", ROWS,
                         ids=["none", "tp", "tp+sp", "none-selective", "tp-selective", "tp+sp-selective"])
@pytest.mark.parametrize("model", list(SHAPES))
def test_table2_rows_at_the_papers_shapes(model, tp, sp, selective):
    a, h = SHAPES[model]
    measured = _measured_layer(a, h, tp, sp, selective)
    terms = {
        "fp32 softmax": 0 if selective else 2 * a * S * S * B // tp,
        "layernorm stats": 2 * 2 * S * B * STAT_BYTES // (tp if sp else 1),
        "gathered inputs": 2 * 2 * S * B * h * (tp - 1) // tp if sp else 0,
    }
    assert measured == _table2(a, h, tp, sp, selective) + sum(terms.values()), (model, terms)


def test_the_dropped_terms_are_small_beside_the_rows():
    """What the paper drops is small at its shapes except DTensor's gathered inputs under sequence
    parallelism (+ 4·(1 − 1/t)·sbh on 34/t·sbh + scores) and the float32 softmax (2 of 5 score bytes)."""
    a, h = SHAPES["GPT-3 175B"]
    sbh = S * B * h
    assert 2 * 2 * S * B * STAT_BYTES / _table2(a, h, 1, False, False) < 1e-4
    gathered = 4 * sbh * (T - 1) / T
    assert 0.1 < gathered / _table2(a, h, T, True, False) < 0.5


def test_tensor_parallel_divides_what_table2_divides():
    """A tp run's layer against the unsplit run at a small shape: the 10·sbh Table 2 keeps whole
    (LayerNorm inputs and outputs, the two projections' dropout masks) stays, the rest falls by t."""
    a, h = 8, 512
    whole, split = _measured_layer(a, h, 1, False, False), _measured_layer(a, h, 4, False, False)
    kept = 10 * S * B * h + 2 * 2 * S * B * STAT_BYTES
    assert split - kept == (whole - kept) // 4
    with pytest.raises(ValueError, match="--tp 3 does not divide num_attention_heads = 8"):
        _measured_layer(a, h, 3, False, False)
