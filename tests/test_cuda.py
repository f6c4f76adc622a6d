"""The cuda engine against the CUDA caching allocator's own counters and NVML. Skipped without
a CUDA device.

The design's promise: the tracker's live tensors, replayed through gpulab's simulated allocator
(512-byte rounding, and large blocks left unsplit when 1 MiB or less would remain), agree with
``torch.cuda.memory_allocated`` to within 1% on every lesson model: allocator blocks compared
with allocator blocks. The 512-rounded tensor bytes are a lower bound of both. Each model runs once first, so one-time allocations that are not tensors of the
experiment (the cuBLAS workspace, cuDNN's first-call buffers) already belong to the baseline
the engine subtracts; the engine reports any remaining gap as ``beyond_tensors``.
"""
import pytest
import torch

from gpulab.predict.step import step as tracked_step
from gpulab.formulas import cuda_rounded_bytes

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MODELS = [("vgg16", 8), ("alexnet", None), ("resnet18", None), ("mlp", None), ("cnn", None)]


def _step(model, batch, optimizer="sgd"):
    tracked_step(model, batch=batch, optimizer=optimizer, engine="cuda", steps=1, guard=False)   # warm-up
    # give back the cached free blocks so the measured run allocates like a first run, while
    # the workspaces that stay allocated (cuBLAS) sit in the engine's baseline
    torch.cuda.empty_cache()
    return tracked_step(model, batch=batch, optimizer=optimizer, engine="cuda", steps=1, guard=False)


def _close(a: int, b: int, rel: float = 0.01) -> bool:
    return abs(a - b) <= rel * max(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("model,batch", MODELS)
def test_tracker_peak_matches_allocator(model, batch):
    res = _step(model, batch)
    m = res.measurement
    assert m.engine == "cuda" and not m.oom
    assert m.label.startswith("measured on ") and m.label.endswith("(cuda)")
    alloc = m.allocator
    allocator_peak = alloc["peak_allocated_delta"]
    assert allocator_peak == alloc["max_memory_allocated"] - alloc["baseline_allocated"]
    assert m.tracking.rounded and m.tracking.device.startswith("cuda")
    # the allocator's own trace of the run, its entries told apart (gpulab.measure.non_tensor):
    # the tracker's blocks are the tensors' allocations; the rest (cuDNN's convolution workspaces,
    # seen on an H200) makes up max_memory_allocated
    nt = m.beyond_tensors["not_tensors"]
    assert _close(m.peak_bytes, nt["tensor_peak"]), (m.peak_bytes, nt)      # both: 512-byte rounding
    assert _close(nt["replayed_peak_allocated"], allocator_peak), (nt, allocator_peak)
    assert _close(nt["replayed_peak_reserved"], alloc["peak_reserved_delta"], 0.02), (nt, alloc)
    assert m.peak_bytes <= m.blocks.peak_bytes             # tensor bytes: a lower bound
    assert m.beyond_tensors["bytes"] == allocator_peak - m.blocks.peak_bytes
    assert alloc["num_ooms_this_run"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("model,batch", MODELS)
def test_after_step_snapshot_matches_allocator(model, batch):
    res = _step(model, batch, optimizer="adam")
    (snap,) = [s for s in res.measurement.snapshots if s.name == "after step"]
    assert snap.allocated_bytes is not None and snap.blocks_bytes is not None
    assert _close(snap.blocks_bytes, snap.allocated_bytes), snap
    assert snap.tracked_bytes <= snap.blocks_bytes
    assert sum(snap.by_category.values()) == snap.tracked_bytes
    # exp_avg and exp_avg_sq have the parameters' shapes; the step counters live on the CPU
    # (foreach) or, if fused Adam is the default, one 4-byte (512-byte block) tensor each
    params = snap.by_category["parameters"]
    n_tensors = res.measurement.value["n_param_tensors"]
    assert snap.by_category["gradients"] == params
    assert snap.by_category["optimizer_state"] in (2 * params, 2 * params + 512 * n_tensors)


@pytest.mark.slow
def test_nvml_used_covers_the_reserved_pool():
    res = _step("cnn", None)
    alloc = res.measurement.allocator
    if alloc["nvml_used"] is None:
        pytest.skip("NVML (nvidia-ml-py) is not available")
    assert alloc["nvml_used"] >= alloc["memory_reserved"] >= alloc["memory_allocated"]
    assert alloc["max_memory_reserved"] >= alloc["max_memory_allocated"]


def test_tensor_bytes_rounded_like_the_allocator():
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    sizes = [1, 100, 128, 129, 1000, 262_144]
    ts = [torch.empty(n, device="cuda") for n in sizes]
    used = torch.cuda.memory_allocated() - before
    assert used == sum(cuda_rounded_bytes(4 * n) for n in sizes)
    del ts
