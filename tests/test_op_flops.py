"""The time model's FLOPs for CPU flash attention (``predict.op_flops``): torch's registry gained
``_scaled_dot_product_flash_attention_for_cpu`` (and its backward) only in 2.15, so on 2.11 the CPU
engine's attention scored 0. Checked against the formula written out here from the shapes
(torch.utils.flop_counter's ``sdpa_flop_count``: 2·b·h·s²·d for q·kᵀ and as much for the weights
times v, causal masking not modelled; ``sdpa_backward_flop_count``: five such matmuls), the same on
every torch; and the answer naming the ops it has no formula for. Runs under torch 2.11 and 2.15."""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import gpulab
from gpulab.predict.card_speeds import speed_of
from gpulab.predict.op_flops import ADDED_FORMULAS
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
        assert len(ADDED_FORMULAS) == (2 if release == (2, 11) else 0)
    t = gpulab.step(_Attention(), input_shape=(S, H * D), batch=B, fake_target="cpu", gpu="H100", time=True, steps=1).time
    fwd, bwd = t.by_op["_scaled_dot_product_flash_attention_for_cpu"], \
        t.by_op["_scaled_dot_product_flash_attention_for_cpu_backward"]
    assert (fwd.count, bwd.count) == (1, 1)
    assert (fwd.flops, bwd.flops) == (FORWARD, BACKWARD)
    assert not t.uncounted_compute and not any("attention" in n for n in t.no_formula)
    # the whole forward: the three linears' 2·tokens·in·out beside attention's
    assert t.forward_flops == FORWARD + 2 * B * S * H * D * (H * D + 2 * KV * D + H * D)


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
