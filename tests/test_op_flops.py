"""The time model's FLOPs for CPU flash attention (``predict.op_flops``): torch's registry gained
``_scaled_dot_product_flash_attention_for_cpu`` (and its backward) only in 2.15, so on 2.11 the CPU
engine's attention scored 0. Checked against the formula written out here from the shapes
(torch.utils.flop_counter's ``sdpa_flop_count``: 2·b·h·s²·d for q·kᵀ and as much for the weights
times v, causal masking not modelled; ``sdpa_backward_flop_count``: five such matmuls), the same on
every torch; and the answer naming the ops it has no formula for. Runs under torch 2.11 and 2.15.

``_grouped_mm`` (MoE experts), which neither release's registry has, by gpulab's formula: checked on
real CPU kernels (forward and backward, every operand pairing) against the per-group matmuls that
``offs`` delimits, and in a tiny Mixtral's step against the count from the routing (tokens·top-k rows
through three hidden×intermediate matrices)."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import gpulab
from gpulab.predict.card_speeds import speed_of
from gpulab.predict.op_flops import ADDED_FORMULAS, ADDED_SOURCES
from gpulab.predict.timing import OpCost, cost_ops

B, S, H, KV, D = 2, 16, 4, 2, 8   # batch, sequence, query heads, key/value heads (grouped), head dim
FORWARD = 2 * (2 * B * H * S * S * D)    # q·kᵀ and weights·v, each 2·b·h·s_q·s_k·d at the query's heads
BACKWARD = 5 * (2 * B * H * S * S * D)   # scores recomputed, grad v, grad scores, grad q, grad k


class _Attention(nn.Module):
    """One causal self-attention layer with grouped-query k/v (``enable_gqa``)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv, self.o = nn.Linear(H * D, H * D), nn.Linear(H * D, 2 * KV * D), nn.Linear(H * D, H * D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q = self.q(x).view(b, S, H, D).transpose(1, 2)
        k, v = self.kv(x).view(b, S, 2, KV, D).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, S, H * D))


def test_cpu_flash_attention_is_counted_as_torch_s_sdpa_formula_from_its_shapes():
    release = tuple(int(p) for p in torch.__version__.split(".")[:2])
    if release == (2, 11) or release >= (2, 15):   # the releases read: 2.11 lacks both formulas, 2.15 has both
        sdpa = {n for n in ADDED_SOURCES if "attention" in n}
        # 2.11: the CPU pair, and the CUDA ops' six, whose registry formulas refuse grouped-query k/v
        assert len(sdpa) == (2 + 6 if release == (2, 11) else 0)
    if release in ((2, 11), (2, 15)):                # neither has one for _grouped_mm
        assert "_grouped_mm" in ADDED_SOURCES and "gpulab's own formula" in ADDED_SOURCES["_grouped_mm"]
    t = gpulab.step(_Attention(), input_shape=(S, H * D), batch=B, fake_target="cpu", gpu="H100", time=True, steps=1).time
    fwd, bwd = t.by_op["_scaled_dot_product_flash_attention_for_cpu"], \
        t.by_op["_scaled_dot_product_flash_attention_for_cpu_backward"]
    assert (fwd.count, bwd.count) == (1, 1)
    assert (fwd.flops, bwd.flops) == (FORWARD, BACKWARD)
    assert not t.uncounted_compute and not any("attention" in n for n in t.no_formula)
    # the whole forward: the three linears' 2·tokens·in·out beside attention's
    assert t.forward_flops == FORWARD + 2 * B * S * H * D * (H * D + 2 * KV * D + H * D)


def test_grouped_query_attention_on_the_cuda_target_is_counted_at_the_query_s_heads():
    """The fake CUDA target gives grouped-query k/v to CUDA's flash op as they are (``fake_cuda._cuda_sdpa``):
    counted as the CPU's op is, on every torch (2.11's registry formula asserts equal heads; gpulab's replaces it)."""
    t = gpulab.step(_Attention(), input_shape=(S, H * D), batch=B, dtype="bf16", gpu="A100-80GB", time=True, steps=1).time
    fwd, bwd = t.by_op["_scaled_dot_product_flash_attention"], t.by_op["_scaled_dot_product_flash_attention_backward"]
    assert (fwd.count, bwd.count) == (1, 1)
    assert (fwd.flops, bwd.flops) == (FORWARD, BACKWARD)


def test_flop_counter_mode_given_the_added_formulas_counts_cpu_flash_attention():
    """What the capstone's ``step_flops`` passes FlopCounterMode (``custom_mapping``), on real tensors."""
    aten = torch.ops.aten
    with FlopCounterMode(display=False, custom_mapping=ADDED_FORMULAS) as counter:
        _Attention()(torch.randn(B, S, H * D)).sum().backward()
    counts = counter.get_flop_counts()["Global"]
    assert counts[aten._scaled_dot_product_flash_attention_for_cpu] == FORWARD
    assert counts[aten._scaled_dot_product_flash_attention_for_cpu_backward] == BACKWARD


def test_the_answer_names_the_ops_it_has_no_flop_formula_for():
    ops = [OpCost("mm", "forward", 1, 2 * 64 ** 3, 3 * 64 * 64 * 4, "fp32"),
           OpCost("_grouped_mm", "forward", 1, 0, 3 * 64 * 64 * 4, "", formula=False),
           OpCost("add", "forward", 1, 0, 3 * 64 * 4, "", formula=False),
           OpCost("add", "backward", 1, 0, 3 * 64 * 4, "", formula=False)]
    t = cost_ops(ops, speed_of("H100"), 64, "tokens")
    assert t.no_formula == {"_grouped_mm": 1, "add": 2} and t.uncounted_compute == {"_grouped_mm": 1}
    text = repr(t)
    assert "NB: no FLOP formula" in text and "_grouped_mm (1 calls): their compute is left out" in text
    assert "3 calls of 2 ops: add ×2, _grouped_mm ×1" in text
    assert t.as_dict()["no_formula"] == {"_grouped_mm": 1, "add": 2}
    assert not cost_ops(ops[:1], speed_of("H100"), 64, "tokens").formula_lines()


# _grouped_mm's operand pairings (torch/_meta_registrations.py, _create_grouped_mm_output_tensor), each with
# its group sizes from offs: (a's shape, b's shape, offs, the per-group (m, k, n) of each matmul)
_OFFS = (8, 24, 40, 48)
_SIZES = [e - s for s, e in zip((0, *_OFFS), _OFFS)]
GROUPED = {
    "2d-3d (tokens, k) x (g, k, n)": ((48, 32), (4, 32, 64), _OFFS, [(m, 32, 64) for m in _SIZES]),
    "3d-2d (g, m, k) x (k, n)": ((4, 16, 32), (32, 48), _OFFS, [(16, 32, n) for n in _SIZES]),
    "2d-2d (m, k) x (k, n), offs along k": ((32, 48), (48, 64), _OFFS, [(32, k, 64) for k in _SIZES]),
    "3d-3d batched": ((4, 16, 32), (4, 32, 16), None, [(16, 32, 16)] * 4),
}


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
@pytest.mark.parametrize("case", GROUPED.values(), ids=GROUPED.keys())
def test_grouped_mm_counts_its_groups_matmuls_forward_and_backward(case):
    """Real CPU kernels under FlopCounterMode: the forward is the groups' matmuls, 2·m·k·n each; its
    backward runs ``_grouped_mm`` twice more (grad of a, grad of b), each as many FLOPs again."""
    a_shape, b_shape, offs, groups = case
    a, b = torch.randn(a_shape, requires_grad=True), torch.randn(b_shape, requires_grad=True)
    offs = None if offs is None else torch.tensor(offs, dtype=torch.int32)
    with FlopCounterMode(display=False, custom_mapping=ADDED_FORMULAS) as counter:
        out = torch._grouped_mm(a, b, offs)
        forward = counter.get_total_flops()
        out.backward(torch.randn_like(out))
    per_groups = sum(2 * m * k * n for m, k, n in groups)
    assert (forward, counter.get_total_flops()) == (per_groups, 3 * per_groups)


def test_moe_experts_counted_as_the_routing_says():
    """A tiny Mixtral's training step (transformers' default experts implementation, ``_grouped_mm``):
    each MoE layer sends tokens·top-k rows through the fused gate-up (hidden → 2·intermediate) and the
    down (intermediate → hidden) matrices, 2·rows·hidden·intermediate·3 FLOPs forward, twice that
    backward; the rest of the forward by the linears' 2·tokens·in·out and attention's formula."""
    transformers = pytest.importorskip("transformers")
    h, i, e, k, heads, kv, vocab, layers, b, s = 32, 64, 4, 2, 4, 2, 128, 2, 2, 16
    cfg = transformers.MixtralConfig(hidden_size=h, intermediate_size=i, num_hidden_layers=layers,
                                     num_attention_heads=heads, num_key_value_heads=kv, num_local_experts=e,
                                     num_experts_per_tok=k, vocab_size=vocab, max_position_embeddings=64)
    t = gpulab.step(cfg, batch=b, seq_len=s, engine="fake", gpu="H100", time=True, steps=1).time
    tokens, d = b * s, h // heads
    experts = layers * 2 * (tokens * k) * h * i * 3
    rest = (layers * 2 * tokens * h * (h + 2 * kv * d + h + e)     # q, k, v, o and the router
            + layers * 2 * (2 * b * heads * s * s * d)               # attention (causal masking not modelled)
            + 2 * tokens * h * vocab)                                 # the LM head
    assert t.by_op["_grouped_mm"].count == layers * 6                # 2 forward, 4 backward per layer
    assert t.by_op["_grouped_mm"].flops == 3 * experts
    assert t.forward_flops == rest + experts
    assert "_grouped_mm" not in t.no_formula and not t.uncounted_compute
    assert t.added_formulas == {"_grouped_mm": layers * 6} and "gpulab's own formula" in repr(t)
