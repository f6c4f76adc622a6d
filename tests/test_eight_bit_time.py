"""The 8-bit AdamW step's time, from the run: on the fake CUDA target each parameter tensor's update is
one op mirroring bitsandbytes' fused kernel (``training.bnb_kernels``), costed by the bytes it reads and
writes, while the memory answer stays what it was (the kernel allocates nothing).

References: the bytes are counted here by hand from the parameter shapes and bitsandbytes' kernels'
reads and writes (csrc/kernels.cu: ``kOptimizerStatic8bit2StateBlockwise`` reads g, p, state1,
state2, absmax1, absmax2 and the two 256-entry float32 maps, writes p, state1, state2, absmax1,
absmax2; ``kOptimizer32bit2State`` reads g, p, state1, state2, writes p, state1, state2); the card's
speeds are its datasheet row (``speed_of``), applied with the roofline written out below.
"""
from __future__ import annotations

import math

import pytest
import torch

import gpulab
from gpulab.predict.card_speeds import speed_of
from gpulab.training import eight_bit


def _model() -> torch.nn.Module:
    # 300x500 (586 blocks, the last one partial), 500x10 (20 blocks): 8-bit state; the biases: 32-bit
    return torch.nn.Sequential(torch.nn.Linear(300, 500), torch.nn.ReLU(), torch.nn.Linear(500, 10))


def _step(optimizer: str, **kw):
    return gpulab.step(_model(), batch=4, input_shape=(300,), optimizer=optimizer, engine="fake", gpu="H100",
                       time=True, guard=False, **kw)


def _by_hand(params: list[torch.Tensor], elem: int) -> list[tuple[str, int, int]]:
    """(op, bytes, FLOPs) of each tensor's update, counted from its shape alone."""
    ops = []
    for p in params:
        n = p.numel()
        if n >= 4096:
            blocks = math.ceil(n / 256)
            reads = 2 * n * elem + 2 * n + 2 * 4 * blocks + 2 * 256 * 4   # p, g; 2 uint8 states; 2 absmax; 2 maps
            writes = n * elem + 2 * n + 2 * 4 * blocks                   # p; 2 states; 2 absmax
            ops.append(("adamw8bit_blockwise_update", reads + writes, 18 * n))
        else:
            reads, writes = 2 * n * elem + 2 * 4 * n, n * elem + 2 * 4 * n   # p, g, 2 float32 states; p, states
            ops.append(("adamw32bit_update", reads + writes, 14 * n))
    return ops


def test_the_8bit_step_is_the_roofline_of_the_kernels_bytes():
    r = _step("adamw8bit")
    t = r.time
    ops = _by_hand(list(_model().parameters()), 4)
    assert {name: t.by_op[name].count for name in ("adamw8bit_blockwise_update", "adamw32bit_update")} == \
        {"adamw8bit_blockwise_update": 2, "adamw32bit_update": 2}
    for name in ("adamw8bit_blockwise_update", "adamw32bit_update"):
        assert t.by_op[name].nbytes == sum(b for n, b, _ in ops if n == name)
        assert t.by_op[name].flops == sum(f for n, _, f in ops if n == name)
    s = speed_of("H100")
    a = s.assumptions
    by_hand = sum(max(f / (s.peak_tflops["fp32"] * 1e12 * a.compute_efficiency),
                      b / (s.bandwidth_gbs * 1e9 * a.memory_efficiency)) + a.launch_overhead_s for _, b, f in ops)
    assert t.by_phase["optimizer"] > 0
    assert t.by_phase["optimizer"] == pytest.approx(by_hand, rel=1e-9)
    assert "bitsandbytes" in "".join(t.formula_lines())   # the formula's source is named in the answer


def test_the_kernel_allocates_nothing_the_memory_answer_is_unchanged(monkeypatch):
    with_ops = _step("adamw8bit").measurement
    monkeypatch.setattr(eight_bit, "_fused_update", lambda p, state, group: None)   # no op issued at all
    without = _step("adamw8bit").measurement
    a, b = with_ops.tracking, without.tracking
    assert (a.peak_bytes, a.peak_by_category, a.final_by_category) == (b.peak_bytes, b.peak_by_category,
                                                                       b.final_by_category)
    assert [(e.kind, e.nbytes) for e in a.events] == [(e.kind, e.nbytes) for e in b.events]   # every allocation


def test_the_8bit_step_moves_fewer_bytes_than_fp32_adamw_foreach():
    eight, fp32 = _step("adamw8bit").time, _step("adamw", implementation="foreach").time
    # AdamW foreach's in-place ops return nothing: their written tensors count (predict.timing._written)
    assert fp32.by_op["_foreach_lerp_"].nbytes == 3 * 4 * sum(p.numel() for p in _model().parameters())
    moved = sum(o.nbytes for o in eight.by_op.values() if o.name.startswith("adamw"))
    moved_fp32 = sum(o.nbytes for o in fp32.by_op.values() if o.name.startswith("_foreach"))
    # fp32 AdamW's foreach ops (torch.optim.adam._multi_tensor_adam: lerp_, mul_, addcmul_, sqrt, div_, add_,
    # addcdiv_ and the weight decay's mul_) move 21 float32 words an element; the 8-bit kernel with float32
    # weights 16 bytes and its absmax: a ratio of about 5
    assert 4.5 < moved_fp32 / moved < 5.5
    assert eight.by_phase["optimizer"] < fp32.by_phase["optimizer"]
