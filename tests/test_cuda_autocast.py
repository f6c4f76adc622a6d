"""CUDA's autocast table on the fake CUDA target, checked against PyTorch itself.

Two independent references, both from the installed torch, not from gpulab's table:

* the dispatcher: the ops that have an ``AutocastCUDA`` kernel
  (``torch._C._dispatch_get_registrations_for_dispatch_key``) are exactly the ops of
  ``CUDA_AUTOCAST``, op for op;
* CUDA's own autocast kernels: fake tensors on a cuda device dispatch the real ``AutocastCUDA``
  wrappers (forward only: backward needs a GPU). Each case below runs twice, there with CUDA's
  autocast, and on fake CPU tensors with ``torch.autocast("cpu")`` under gpulab's emulation;
  the dtypes and shapes of every tensor autograd saves, of every op's output and of the results
  must be equal. The emulation side runs under ``fake_cuda.cuda_kernels()``, as the fake engine
  does (it includes CUDA's fused RMSNorm kernel).
"""
import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from gpulab.measure import cuda_autocast
from gpulab.measure.cuda_autocast import CUDA_AUTOCAST, POLICIES, cuda_autocast_policy, cuda_policy_of
from gpulab.measure.fake_cuda import cuda_kernels


def test_the_table_is_cudas_registrations_op_for_op():
    registered = {n.removeprefix("aten::") for n in
                  torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA") if n.startswith("aten::")}
    table = set(CUDA_AUTOCAST)
    written = set(cuda_autocast._TABLE_2_15) | set(cuda_autocast._OLDER_ONLY)
    assert not registered - written, f"CUDA autocasts ops gpulab's written tables lack (torch {torch.__version__})"
    if "rms_norm" in registered:   # torch 2.15's registrations: its table whole
        assert CUDA_AUTOCAST == cuda_autocast._TABLE_2_15
    assert not registered - table, f"CUDA autocasts ops gpulab's table lacks (torch {torch.__version__})"
    assert not table - registered, f"gpulab's table has ops CUDA does not autocast (torch {torch.__version__})"
    assert set(CUDA_AUTOCAST.values()) == set(POLICIES)
    assert cuda_policy_of("aten::softmax.int") == "fp32_set_opt_dtype"
    assert cuda_policy_of("aten::linear.default") == "lower_precision_fp"
    assert cuda_policy_of("aten::relu") is None


class _Outputs(TorchDispatchMode):
    """Every op's outputs as (dtype, shape)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.seen.append((t.dtype, tuple(t.shape)))
        return out


def _trace(case, device: str, low: torch.dtype):
    """Run ``case(device)`` on fake tensors under ``device``'s autocast: (saved, outputs, results)."""
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t
    with FakeTensorMode(), torch.device(device):
        inputs = case.inputs()
        with contextlib.ExitStack() as stack:
            if device == "cuda":   # torch.autocast("cuda") refuses without a GPU: set the state it sets
                before = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
                torch.set_autocast_enabled("cuda", True)
                torch.set_autocast_dtype("cuda", low)
                stack.callback(torch.set_autocast_dtype, "cuda", before[1])
                stack.callback(torch.set_autocast_enabled, "cuda", before[0])
                stack.callback(torch.clear_autocast_cache)
            else:
                stack.enter_context(cuda_kernels())   # what the fake engine runs under for a CUDA target
                stack.enter_context(torch.autocast("cpu", dtype=low))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
            outputs = stack.enter_context(_Outputs())
            result = case.run(*inputs)
    results = [(t.dtype, tuple(t.shape)) for t in (result if isinstance(result, tuple) else (result,))]
    return saved, outputs.seen, results


class Case:
    def __init__(self, name, shapes, run, dtypes=None, grad=True):
        self.name, self.shapes, self.run = name, shapes, run
        self.dtypes = dtypes or [torch.float32] * len(shapes)
        self.grad = grad

    def inputs(self):
        out = []
        for shape, dt in zip(self.shapes, self.dtypes):
            t = torch.empty(shape, dtype=dt)
            out.append(t.requires_grad_(self.grad and dt.is_floating_point))
        return out


def _block(x, w1, w2, g):
    h = F.linear(x, w1)
    h = F.softmax(h, -1)
    h = F.layer_norm(h, (h.shape[-1],), g)
    return F.linear(F.gelu(h), w2)


def _rmsnorm(x, w):
    var = x.pow(2).mean(-1, keepdim=True)
    return w * (x * torch.rsqrt(var + 1e-6))


H = torch.float16
CASES = [
    Case("issue: linear, softmax, layer_norm", [(4, 8), (8, 8), (8,)],
         lambda x, w, g: F.layer_norm(F.softmax(F.linear(x, w), -1), (8,), g)),
    Case("block: linear, softmax, layer_norm, gelu, linear", [(2, 5, 8), (16, 8), (8, 16), (16,)], _block),
    Case("llama rmsnorm (pow, mean, rsqrt)", [(2, 5, 8), (8,)], _rmsnorm),
    Case("rms_norm op", [(2, 5, 8), (8,)], lambda x, w: F.rms_norm(F.linear(x, torch.eye(8)), (8,), w)),
    Case("weight used twice is cast once", [(4, 8), (8, 8)], lambda x, w: F.linear(F.linear(x, w), w)),
    Case("matmul, bmm, baddbmm, addmm, einsum", [(3, 4, 8), (3, 8, 4), (3, 4, 4), (4, 8), (8, 8)],
         lambda a, b, c, x, w: (a @ b, torch.bmm(a, b), torch.baddbmm(c, a, b), torch.addmm(x[:, :8], x, w),
                                torch.einsum("bik,bkj->bij", a, b))),
    Case("mv, addmv, addr, dot promote", [(8, 8), (8,), (8,)],
         lambda m, v, u: (torch.mv(m, v), torch.addmv(u, m, v), torch.addr(m, u, v), torch.dot(u, v))),
    Case("conv2d, group_norm, upsample", [(2, 3, 8, 8), (4, 3, 3, 3)],
         lambda x, w: F.interpolate(F.group_norm(F.conv2d(x, w), 2), scale_factor=2)),
    Case("conv1d, conv_transpose2d", [(2, 3, 8), (4, 3, 3), (2, 4, 5, 5), (4, 2, 3, 3)],
         lambda x, w, y, v: (F.conv1d(x, w), F.conv_transpose2d(y, v))),
    Case("losses: cross_entropy, mse, l1, smooth_l1, kl_div", [(4, 10), (4, 10), (4,)],
         lambda x, y, t: (F.cross_entropy(F.linear(x, torch.eye(10)), t.long().clamp(0, 9)),
                          F.mse_loss(F.linear(x, torch.eye(10)), y), F.l1_loss(x.half(), y),
                          F.smooth_l1_loss(x, y), F.kl_div(F.log_softmax(x.half(), -1), y, reduction="batchmean"))),
    Case("nll_loss and bce_with_logits on fp16 logits", [(4, 10), (4, 10)],
         lambda x, y: (F.nll_loss(F.log_softmax(F.linear(x, torch.eye(10)), -1), torch.zeros(4, dtype=torch.long)),
                       F.binary_cross_entropy_with_logits(F.linear(x, torch.eye(10)), y))),
    Case("exp, log, softplus, logsumexp, cumsum, prod, sum", [(4, 8), (8, 8)],
         lambda x, w: tuple(f(F.linear(x, w)) for f in (torch.exp, torch.log, F.softplus,
                                                         lambda h: torch.logsumexp(h, -1),
                                                         lambda h: torch.cumsum(h, 0), lambda h: h.prod(-1),
                                                         lambda h: h.sum(), lambda h: h.sum(0)))),
    Case("norms: norm, vector_norm, matrix_norm, frobenius", [(4, 8), (8, 8)],
         lambda x, w: tuple(f(F.linear(x, w)) for f in (torch.norm, lambda h: torch.norm(h, 2, 1),
                                                         torch.linalg.vector_norm, torch.linalg.matrix_norm,
                                                         lambda h: torch.norm(h, "fro", dim=(0, 1))))),
    Case("promote: addcmul, addcdiv, atan2, cross", [(4, 3), (3, 3)],
         lambda x, w: (torch.addcmul(x, F.linear(x, w), x), torch.addcdiv(x, F.linear(x, w), x + 2),
                       torch.atan2(F.linear(x, w), x), torch.linalg.cross(F.linear(x, w), x))),
    Case("cat and stack pass through on CUDA (the CPU promotes)", [(4, 8), (8, 8)],
         lambda x, w: (torch.cat([F.linear(x, w), x]), torch.stack([F.linear(x, w), x]))),
    Case("pure fp16 input to fp32 ops", [(4, 8)], lambda x: (F.softmax(x, -1), F.layer_norm(x, (8,)), x.sum()),
         dtypes=[H]),
    Case("integer and float64 inputs are not eligible", [(4, 8), (4, 8)],
         lambda x, d: (F.softmax(d, -1), torch.exp(d), x.sum(), F.linear(d, d[:3])),
         dtypes=[torch.int64, torch.float64]),
    Case("inference: no grad", [(4, 8), (8, 8)], lambda x, w: F.softmax(F.linear(x, w), -1), grad=False),
]


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_emulation_saves_what_cudas_autocast_saves(case, low):
    cuda = _trace(case, "cuda", low)
    emulated = _trace(case, "cpu", low)
    assert emulated[2] == cuda[2], "results' dtypes"
    assert emulated[0] == cuda[0], "tensors saved for backward"
    assert sorted(emulated[1], key=str) == sorted(cuda[1], key=str), "every op's outputs"


def test_without_the_emulation_the_cpu_table_differs():
    """The reference is not blind: the CPU's own table keeps softmax and layer_norm in fp16."""
    case = CASES[0]
    cuda = _trace(case, "cuda", torch.float16)
    saved = []
    with FakeTensorMode(), torch.device("cpu"):
        x, w, g = case.inputs()
        with torch.autocast("cpu", dtype=torch.float16), torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append((t.dtype, tuple(t.shape))) or t, lambda t: t):
            out = case.run(x, w, g)
    assert out.dtype == torch.float16 and cuda[2] == [(torch.float32, (4, 8))]
    assert saved != cuda[0]


def test_binary_cross_entropy_is_refused_as_on_cuda():
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.float16):
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(torch.rand(3), torch.rand(3))


def test_the_cpu_table_comes_back():
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.softmax(torch.randn(3).bfloat16(), 0).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.softmax(torch.randn(3).bfloat16(), 0).dtype == torch.bfloat16
        assert F.binary_cross_entropy(torch.rand(3), torch.rand(3)).dtype == torch.float32
        assert torch.cat([torch.randn(2), torch.randn(2).bfloat16()]).dtype == torch.float32
