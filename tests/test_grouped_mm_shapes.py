"""``gpulab.measure.grouped_mm_shapes``: ``torch._grouped_mm``'s output on meta and fake tensors where
this torch's meta kernel refuses float32 (torch 2.11, Colab's). The reference is torch itself: the
real CPU kernel's output (shape and dtype) for the same arguments, and, on a torch whose meta kernel
takes float32 (2.15), that meta kernel's output (shape, strides and dtype)."""
from __future__ import annotations

import pytest
import torch

from gpulab.measure import grouped_mm_shapes
from gpulab.measure.grouped_mm_shapes import grouped_mm_output

pytestmark = pytest.mark.skipif(grouped_mm_shapes._OP is None, reason="this torch has no torch._grouped_mm")

OP = grouped_mm_shapes._OP
# (a's shape, b's shape, offs): transformers' forward (2D tokens x 3D experts) and the backward forms
CASES = [((48, 32), (4, 32, 64), (8, 24, 40, 48)),
         ((48, 64), (4, 64, 32), (16, 16, 32, 48)),
         ((32, 48), (48, 64), (8, 24, 40, 48)),    # grad of the weights: a^T (K, S) x grad (S, N) per group
         ((4, 16, 32), (4, 32, 16), None)]


def _args(a_shape, b_shape, offs, dtype, device):
    a = torch.randn(a_shape, dtype=dtype, device="cpu").to(device)
    b = torch.randn(b_shape, dtype=dtype, device="cpu").to(device)
    o = None if offs is None else torch.tensor(offs, dtype=torch.int32).to(device)
    return a, b, o


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_the_answer_is_the_cpu_kernels_output_shape_and_dtype(monkeypatch, case, dtype):
    monkeypatch.setattr(grouped_mm_shapes, "OLD_META", True)
    a, b, o = _args(*case, dtype, "cpu")
    try:
        real = OP(a, b, o)
    except RuntimeError as exc:   # this torch's CPU kernel does not take the dtype: nothing to compare
        pytest.skip(f"torch {torch.__version__}'s CPU _grouped_mm: {exc}")
    out = grouped_mm_output(OP, (a, b, o), {})
    assert out.is_meta and (tuple(out.shape), out.dtype) == (tuple(real.shape), real.dtype)


@pytest.mark.parametrize("case", CASES)
def test_where_torchs_meta_kernel_takes_float32_the_answer_equals_it(monkeypatch, case):
    if grouped_mm_shapes.OLD_META:
        pytest.skip(f"torch {torch.__version__}'s meta _grouped_mm refuses float32: the case this module answers")
    monkeypatch.setattr(grouped_mm_shapes, "OLD_META", True)
    a, b, o = _args(*case, torch.float32, "meta")
    ref = OP(a, b, o)
    out = grouped_mm_output(OP, (a, b, o), {})
    assert (tuple(out.shape), out.stride(), out.dtype) == (tuple(ref.shape), ref.stride(), ref.dtype)


def test_other_ops_dtypes_and_torches_are_left_to_torch(monkeypatch):
    a, b, o = _args(*CASES[0], torch.bfloat16, "meta")
    assert grouped_mm_output(OP, (a, b, o), {}) is NotImplemented or grouped_mm_shapes.OLD_META is False
    monkeypatch.setattr(grouped_mm_shapes, "OLD_META", True)
    assert grouped_mm_output(OP, (a, b, o), {}) is NotImplemented          # bf16: torch's meta kernel answers
    assert grouped_mm_output(torch.ops.aten.mm.default, (a, b), {}) is NotImplemented
    monkeypatch.setattr(grouped_mm_shapes, "OLD_META", False)
    a32, b32, o32 = _args(*CASES[0], torch.float32, "meta")
    assert grouped_mm_output(OP, (a32, b32, o32), {}) is NotImplemented


def test_a_fake_step_of_an_fp32_moe_model_runs_its_grouped_mm():
    """transformers' default experts implementation (grouped_mm) in float32 on the fake engine."""
    import gpulab
    from gpulab.course.modern_models import small_mixtral
    r = gpulab.step(small_mixtral(1), batch=2, seq_len=16, engine="fake", steps=1, routing="router")
    assert r.peak_bytes > 0
