"""Lesson 04's PyTorch counters (gpulab.course.counters): each stand-in against an independent
computation (by hand for one tensor, from the returned model and optimizer for a training
step, a prefix sum of 512-rounded events for the peak), and on a GPU the plain PyTorch lines
against the same function's stand-ins (skipped without CUDA)."""
from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F

from gpulab.course.counters import COUNTERS, cuda_counters, read_counters, simulated_counters
from gpulab.predict.cards import parse_gpu
from gpulab.predict.context import context_assumption

MiB = 1 << 20


def _r512(n: int) -> int:
    return max(512, -(-n // 512) * 512)


def one_tensor(device):
    return torch.empty(3 * MiB, dtype=torch.uint8, device=device)


def two_steps(device, batch=4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to(device)
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(batch, 64, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    for _ in range(2):     # the lesson's order: zero_grad() at the top of each step
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model, optimizer


def test_one_3_mib_tensor_by_hand():
    """A 3 MiB request: one block of 3 MiB in a 20 MiB segment (1-10 MiB requests,
    kLargeBuffer in CUDACachingAllocator.cpp); free = total - 20 MiB - the assumed context."""
    r = read_counters(one_tensor, engine="cpu", card="T4")
    t4 = parse_gpu("T4")
    ctx = context_assumption("lazy").nbytes
    assert r.simulated("allocated") == 3 * MiB
    assert r.simulated("max_allocated") == 3 * MiB
    assert r.simulated("reserved") == r.simulated("max_reserved") == 20 * MiB
    assert r.simulated("total") == t4.cuda_total_bytes
    assert r.simulated("free") == t4.cuda_total_bytes - 20 * MiB - ctx
    assert r.tracker_peak_unrounded == 3 * MiB
    assert r.measured_label is None and all(row.measured is None for row in r.rows)


def test_a_given_context_is_subtracted_and_said():
    r = read_counters(one_tensor, engine="cpu", card="H100", context_bytes=300 * MiB)
    assert r.simulated("free") == parse_gpu("H100").reported_total_bytes - 20 * MiB - 300 * MiB
    assert "given" in r.context_label


@pytest.mark.parametrize("engine, target", [("cpu", "cpu"), ("fake", "cpu"), ("fake", "cuda")])
def test_allocated_after_the_loop_is_what_the_returned_objects_hold(engine, target):
    """Independent of the tracker: sum the 512-rounded storages of the model's parameters,
    buffers, gradients and Adam's state tensors on the tracked device (Adam's ``step`` counters stay on the
    CPU when the parameters are on a GPU: the CUDA target leaves them out)."""
    kept = {}

    def train(device):
        kept["objs"] = two_steps(device)
        return kept["objs"]

    r = read_counters(train, engine=engine, fake_target=target)
    model, opt = kept["objs"]
    tensors = list(model.parameters()) + list(model.buffers()) + [p.grad for p in model.parameters()]
    assert all(t is not None for t in tensors)   # the gradients are alive: zero_grad() comes first
    for state in opt.state.values():
        tensors += [v for k, v in state.items() if isinstance(v, torch.Tensor) and (target == "cpu" or k != "step")]
    assert r.simulated("allocated") == sum(_r512(t.untyped_storage().nbytes()) for t in tensors)


def test_max_allocated_is_the_rounded_prefix_peak_and_reserved_holds_it():
    """max_memory_allocated's stand-in: the highest running sum of 512-rounded allocations and
    frees, recomputed here from the events; reserved is whole segments (multiples of 2 MiB) and
    never below allocated."""
    from gpulab.measure.engines import run
    m = run(lambda ctx: two_steps(ctx.device, batch=64), "cpu")
    live, total, peak = {}, 0, 0
    for e in m.tracking.events:
        total -= live.pop(e.sid, 0)
        if e.kind != "free":
            live[e.sid] = _r512(e.nbytes)
            total += live[e.sid]
        peak = max(peak, total)
    figures = simulated_counters(m.tracking.events)
    assert figures["max_allocated"] == peak
    assert figures["allocated"] == total
    assert figures["max_reserved"] % (2 * MiB) == 0 and figures["max_reserved"] >= peak
    assert figures["reserved"] >= figures["allocated"]


def test_rows_name_every_counter_and_the_view_labels_its_sources():
    r = read_counters(one_tensor, engine="cpu")
    names = [row.counter for row in r.rows]
    assert names == [c[0] for c in COUNTERS]
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "mem_get_info"):
        assert any(name in n for n in names)
    html = r._repr_html_()
    assert "simulated allocator" in html and "measured on CPU (live tensors)" in html
    assert "assumed" in html and "requested_bytes.all.peak" in html and "no PyTorch counter" not in html
    assert "memory_allocated" in repr(r)


def test_measured_column_only_when_given():
    fake = {"allocated": 1, "max_allocated": 2, "reserved": 3, "max_reserved": 4, "free": 5, "total": 6}
    r = read_counters(one_tensor, engine="cpu", measured=fake, measured_on="NVIDIA H100 80GB HBM3")
    assert r.measured_label == "measured on NVIDIA H100 80GB HBM3 (cuda)"
    assert [row.measured for row in r.rows] == [1, 2, 3, 4, 5, 6]
    assert r.table_rows()[-1][-1] == "—"          # no requested_bytes given: no figure invented
    r = read_counters(one_tensor, engine="cpu", measured={**fake, "max_requested": 7 * 1024 * 1024},
                      measured_on="NVIDIA H100 80GB HBM3")
    last = r.table_rows()[-1]
    assert last[0] == 'torch.cuda.memory_stats()["requested_bytes.all.peak"]' and last[-1] == "7.0 MiB"


def test_refuses_the_cuda_engine_and_cuda_counters_needs_a_gpu():
    with pytest.raises(ValueError, match="cuda_counters"):
        read_counters(one_tensor, engine="cuda")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA GPU"):
            cuda_counters(one_tensor)


# ---- on a GPU ---------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_cuda_counters_one_tensor_match_the_stand_ins(tmp_path):
    """One 3 MiB tensor on an emptied cache: PyTorch's allocated and reserved grow by exactly
    what the simulator says; mem_get_info's total is the device's; the snapshot file loads."""
    path = tmp_path / "one.pickle"
    out = cuda_counters(one_tensor, snapshot_path=str(path))
    r = read_counters(one_tensor, engine="cpu")
    before = out["allocated_before"]
    assert out["max_allocated"] - before == r.simulated("max_allocated")
    assert out["total"] == torch.cuda.mem_get_info()[1]
    assert out["reserved"] >= out["allocated"] and out["free"] <= out["total"] - out["reserved"]
    with open(path, "rb") as f:
        assert "segments" in pickle.load(f)


@needs_cuda
def test_cuda_counters_training_step_against_the_fake_cuda_prediction():
    """The tensors' peak predicted on fake tensors with CUDA's kernels, against PyTorch's
    max_memory_allocated over the same function: within 0.5% plus what the allocator holds
    beyond tensors (cuBLAS's workspace, at most 32 MiB on current GPUs, when this process's
    first matmul makes it)."""
    out = cuda_counters(two_steps)
    r = read_counters(two_steps, engine="fake", fake_target="cuda")
    measured = out["max_allocated"] - out["allocated_before"]
    predicted = r.simulated("max_allocated")
    assert predicted * 0.995 <= measured <= predicted * 1.005 + 32 * MiB
    assert out["max_reserved"] >= out["max_allocated"]
