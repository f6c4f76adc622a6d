"""Chunked cross-entropy for a causal language model, torchtune's way.

transformers' causal LM computes the logits of every position at once (``lm_head`` on the whole
``(batch, seq, hidden)``), and its loss (``ForCausalLMLoss``) upcasts them all to float32 before
``cross_entropy``: with a 128K vocabulary that is the largest tensor of a step, held two or three
times over (the logits, their float32 copy, log_softmax's float32 output saved for backward).

torchtune's ``CEWithChunkedOutputLoss`` (with the model's ``num_output_chunks``, 8 by default)
applies the output projection to one chunk of positions at a time and upcasts each chunk in the
loss, so the float32 copies exist one chunk at a time; log_softmax's saved outputs remain, chunk
by chunk. ``chunked_lm_loss`` does the same with any transformers causal LM built by gpulab: the
base model's hidden states, then ``get_output_embeddings()`` (the head) and ``cross_entropy`` per
chunk on the shifted labels, summed and divided by the number of counted tokens: the same number
as the model's own loss (a test checks it). NB: a head that does more than a linear map (Gemma's
logit soft-capping) is not reproduced.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gpulab.options import check_chunks   # torch-free: the CLI checks first

__all__ = ["IGNORE_INDEX", "chunked_lm_loss", "check_chunks"]

IGNORE_INDEX = -100   # transformers' and torchtune's


def chunked_lm_loss(net: torch.nn.Module, data, chunks: int) -> torch.Tensor:
    """The causal-LM loss of ``net`` on one batch ``data`` (``((), {"input_ids", "labels", ...})``),
    computed ``chunks`` positions-chunks at a time (see the module docstring)."""
    args, kwargs = data
    labels = kwargs.get("labels")
    net = net.get_base_model() if hasattr(net, "get_base_model") else net   # peft's LoRA: the adapted model
    head = net.get_output_embeddings() if hasattr(net, "get_output_embeddings") else None
    base = getattr(net, "base_model", None)
    if labels is None or head is None or base is None or base is net:
        raise ValueError("chunked_loss needs a transformers causal language model and labels (an hf: model, or a "
                         "transformers config): it splits the model's output head from its body")
    inputs = {k: v for k, v in kwargs.items() if k != "labels" and not k.startswith("_")}
    hidden = base(*args, **inputs)[0]                                      # (batch, seq, hidden)
    shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)
    counted = (shifted != IGNORE_INDEX).sum()
    total = hidden.new_zeros((), dtype=torch.float32)
    for h, y in zip(hidden.chunk(chunks, dim=1), shifted.chunk(chunks, dim=1)):
        logits = head(h).float()
        total = total + F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                        ignore_index=IGNORE_INDEX, reduction="sum")
    return total / counted.clamp_min(1)
