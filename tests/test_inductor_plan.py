"""Inductor's own memory plan for a compiled step (``training.inductor_plan``): the composition of
the tracker's timeline with each compiled call's plan, and the plan against a compiled CPU step's
real peak (inductor's generated code run, its allocations read from the profiler)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import gpulab
from gpulab.training.inductor_plan import GraphPlan, InductorPlans, planned_peak


def test_a_plans_peak_follows_its_buffers_lifetimes():
    """Buffers (alloc, free, first step, last step): a freed input, a temporary, a graph output
    (-1: never freed); the peak as torch._inductor.memory adds it up, and in 512-byte blocks."""
    plan = GraphPlan("backward", "cuda", kernels=3, ops=5, freeable_inputs=1,
                     buffers=((1000, 1000, 0, 1), (300, 300, 0, 2), (700, 700, 1, -1)))
    assert plan.peak() == 2000 and plan.input_bytes() == 1000 and plan.output_bytes() == 700
    assert plan.peak(rounded=True) == 1024 + 512 + 1024


def test_each_compiled_call_is_replaced_by_its_plan():
    """Outside the calls the tracker's live bytes stand; inside one, the bytes before it less the
    inputs the plan frees plus the plan's peak (here below what the op-by-op run reached)."""
    plan = GraphPlan("forward", "cpu", kernels=2, ops=4, freeable_inputs=0,
                     buffers=((100, 100, 0, 1), (50, 50, 1, -1)))
    plans = InductorPlans("cpu", graphs=[plan], calls=[(0, 2, 5)])
    events = [SimpleNamespace(index=i) for i in range(7)]
    totals = [10, 20, 400, 900, 300, 170, 60]   # events 2..4 are the call, run op by op
    assert planned_peak(events, totals, plans, rounded=False) == 20 + 150 == 170
    assert planned_peak(events, totals, plans, rounded=False, start=5) == 170   # the call is before the window
    assert max(totals) == 900   # the bound the plan replaces


@pytest.mark.extended
@pytest.mark.xfail(reason="open (#48 item 1): on this MLP the plan varied between runs (63,982,600 and 81,811,464 B "
                          "against a real 65,033,224 B); estimate_peak_memory's lifetimes leave out the wrapper's "
                          "in-place reuse, and the cause of the variation is not found", strict=False)
def test_the_plan_predicts_a_compiled_cpu_steps_real_peak():
    """An MLP's training step compiled by inductor on the CPU (its C++ kernels run): the real peak
    of step 2, from the CPU allocator's memory events (torch.profiler, profile_memory) above the
    bytes live when it starts, against gpulab's prediction from inductor's plan for the CPU: never
    below it, above it by at most one hidden-sized buffer (see NB); the op-by-op run of the same graphs
    within 3% of it."""
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(256, 4096), torch.nn.GELU(approximate="tanh"),
                                   torch.nn.Linear(4096, 256), torch.nn.LayerNorm(256))

    batch = 1024
    loss = lambda out: out.square().mean()   # noqa: E731
    pred = gpulab.step(build, input_shape=(256,), batch=batch, loss=loss, engine="cpu", compile=True,
                       optimizer="sgd", steps=2, guard=False)
    planned = pred.compiled["inductor_step_peaks"][-1]

    torch._dynamo.reset()
    net = build()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    compiled = torch.compile(net)   # inductor: code generated and run
    x = torch.randn(batch, 256)
    loss(compiled(x)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)   # before the window: the profiler sees no free of a block it did not see made
    live = sum(p.untyped_storage().nbytes() for p in net.parameters()) + x.nbytes
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        loss(compiled(x)).backward()
        opt.step()
    memory = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    running = best = 0
    for _, n in memory:
        running += n
        best = max(best, running)
    real = live + best
    # NB: inductor's wrapper writes a kernel's output into an input dying there (decide_inplace_update,
    # buffer reuse), which estimate_peak_memory's lifetimes do not: the plan sits above the real peak by
    # up to a buffer or two of the largest size, here one (batch × 4096 float32)
    assert real <= planned <= real + batch * 4096 * 4, (planned, real)
    # the op-by-op run of the same graphs (FX frees each value after its last use) is no strict
    # bound here: inductor's CPU code held 1.6% more than it (measured 2026-12, torch 2.15)
    assert abs(pred.peak_bytes - real) <= 0.03 * real, (pred.peak_bytes, planned, real)
