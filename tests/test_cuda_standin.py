"""The cuda engine's code on every run, without a GPU: tests/cuda_standin.py answers torch.cuda
(tensors on meta, counters from gpulab's simulator, a GPU named "stand-in GPU (no CUDA)").

What is tested here is gpulab's own code on the cuda path: one run measured from its own
baseline, process-lifetime counters reported as differences, memory released after errors, the
guard's rule, the live tensors' allocator blocks, the CLI and every panel's cuda branch. The
real allocator's behaviour is tested against a real GPU in tests/test_cuda.py.
"""
import inspect
import json

import pytest
import torch

from cuda_standin import CUBLAS_WORKSPACE, STANDIN_NAME, GiB, standin_gpu as install
from gpulab import cli
from gpulab.allocator.simulator import MiB
from gpulab.measure.engines import LABEL_BLOCKS, allocator_blocks, run
from gpulab.predict.step import step as tracked_step
from gpulab.units import format_bytes


def _tensor(mib: float, ctx_device="cuda"):
    return torch.empty(int(mib * MiB) // 4, device=ctx_device)


# --- one run, not the process's history ---------------------------------------------------------------

def test_a_run_starts_from_a_clean_baseline_and_reports_its_own_peaks(standin_gpu):
    gpu = standin_gpu
    with pytest.raises(torch.OutOfMemoryError):
        _tensor(64 * 1024)              # an OOM earlier in the process
    kept = _tensor(3)                   # held before the run: the baseline
    stale = _tensor(50)                 # freed before the run: a cached segment, and an old peak
    del stale
    assert torch.cuda.memory_reserved() == 20 * MiB + 50 * MiB

    m = run(lambda ctx: _tensor(30, ctx.device) is not None, engine="cuda")   # a new 30 MiB segment
    a = m.allocator
    order = gpu.order
    reset = order.index("reset_peak_memory_stats")
    assert "empty_cache" in order[:reset] and "synchronize" in order[:reset]
    assert (a["baseline_allocated"], a["baseline_reserved"]) == (3 * MiB, 20 * MiB)  # the stale cache is gone
    assert a["peak_allocated_delta"] == 30 * MiB == a["max_memory_allocated"] - a["baseline_allocated"]
    assert a["peak_reserved_delta"] == 30 * MiB == a["max_memory_reserved"] - a["baseline_reserved"]
    assert a["num_ooms_this_run"] == 0 and a["num_ooms_since_process_start"] == 1
    assert a["num_alloc_retries_this_run"] == 0
    assert "num_ooms" not in a and "num_alloc_retries" not in a   # never a lifetime count unlabelled
    assert m.label == f"measured on {STANDIN_NAME} (cuda)"
    del kept


def test_the_cublas_workspace_is_reported_as_kept_by_the_process_not_as_every_run(standin_gpu):
    def matmul(ctx):
        a = torch.ones(64, 64, device=ctx.device)
        return ctx.snapshot("product").allocated_bytes if (a @ a) is not None else None

    first = run(matmul, engine="cuda")
    assert first.beyond_tensors["bytes"] == CUBLAS_WORKSPACE        # its first matmul made it ...
    assert first.beyond_tensors["kept_after_run"] == CUBLAS_WORKSPACE   # ... and it stays
    assert "until the process ends" in first.beyond_tensors["kept_label"]
    second = run(matmul, engine="cuda")
    assert second.allocator["baseline_allocated"] == CUBLAS_WORKSPACE
    assert second.beyond_tensors["bytes"] == second.beyond_tensors["kept_after_run"] == 0
    (snap,) = second.snapshots
    assert snap.allocated_bytes == snap.blocks_bytes == 64 * 64 * 4      # only `a` is alive by then
    html = second._repr_html_()
    assert "this run" in html and "since the process started" in html


# --- memory is released after errors -----------------------------------------------------------------

def test_an_oom_is_a_result_and_the_memory_is_given_back(monkeypatch):
    with install(monkeypatch, total_bytes=2 * GiB) as gpu:
        def too_big(ctx):
            keep = _tensor(100, ctx.device)
            more = _tensor(4096, ctx.device)
            return keep, more

        m = run(too_big, engine="cuda")
        assert m.oom and "out of memory" in m.error.lower() and STANDIN_NAME in m.error
        assert m.allocator["num_ooms_this_run"] == 1
        assert m.peak_bytes == 100 * MiB
        assert gpu.calls["empty_cache"] >= 2                         # before the run, and after the OOM
        assert torch.cuda.memory_allocated() == 0 and torch.cuda.memory_reserved() == 0


def test_an_error_that_is_not_an_oom_releases_memory_and_is_raised(standin_gpu):
    def bug(ctx):
        held = _tensor(30, ctx.device)
        raise ValueError("a bug in the experiment")

    with pytest.raises(ValueError, match="a bug"):
        run(bug, engine="cuda")
    assert torch.cuda.memory_allocated() == 0        # the traceback no longer holds the tensor
    assert torch.cuda.memory_reserved() == 0         # and the allocator gave the segment back


# --- the guard counts what the allocator can give back ----------------------------------------------------

def test_free_for_a_run_is_free_plus_cached_minus_a_margin():
    from gpulab.widgets.guard import GPU_MARGIN, cuda_free_for_run
    usable, what = cuda_free_for_run(free=6 * GiB, reserved=5 * GiB, allocated=1 * GiB)
    assert GPU_MARGIN == 0.10
    assert usable == int(10 * GiB * 0.9)
    for number in (format_bytes(6 * GiB), format_bytes(4 * GiB), format_bytes(usable), "10%"):
        assert number in what


def test_the_guards_use_the_cached_memory_and_say_their_numbers(monkeypatch):
    from gpulab.widgets.env import engine_guard
    from gpulab.widgets.guard import memory_guard
    with install(monkeypatch, total_bytes=4 * GiB, context_bytes=0, other_process_bytes=int(2.5 * GiB)):
        cache = _tensor(1000)           # 1000 MiB reserved ...
        del cache                       # ... and cached, not allocated
        free, _ = torch.cuda.mem_get_info()
        assert free == int(1.5 * GiB) - 1000 * MiB
        usable = int((free + 1000 * MiB) * 0.9)
        params = {"engine": "cuda"}
        for guard in (memory_guard(lambda p: p["peak"]),
                      engine_guard(lambda p: p["peak"], lambda p: 0, lambda p: p["peak"])):
            assert guard(dict(params, peak=free + 100 * MiB)).ok          # more than free, less than usable
            no = guard(dict(params, peak=usable + 1))
            assert not no.ok
            for number in (format_bytes(free), format_bytes(1000 * MiB), format_bytes(usable), "10%"):
                assert number in no.message


# --- the live tensors' allocator blocks --------------------------------------------------------------------

def test_a_large_block_is_not_split_when_1_mib_or_less_would_remain(standin_gpu):
    # 11 MiB takes a 12 MiB segment (>= 10 MiB: rounded to 2 MiB); 1 MiB would remain, which is not
    # more than kSmallSize, so the whole block is allocated (CUDACachingAllocator.cpp, should_split)
    m = run(lambda ctx: ctx.snapshot("held").allocated_bytes if _tensor(11, ctx.device) is not None else 0,
            engine="cuda")
    assert m.peak_bytes == 11 * MiB                                  # tensor bytes
    assert m.blocks.peak_bytes == 12 * MiB == m.allocator["peak_allocated_delta"]   # allocator blocks
    assert m.blocks.label == LABEL_BLOCKS
    html = m._repr_html_()
    assert "tensor bytes" in html and "allocator blocks" in html


@pytest.mark.parametrize("model,batch", [("resnet18", 1), ("resnet18", 32), ("cnn", 8), ("mlp", 8)])
def test_tracker_and_simulator_predict_memory_allocated_block_for_block(monkeypatch, model, batch):
    # no workspace: the run starts from an empty allocator, as the replay does
    with install(monkeypatch, workspace_bytes=0):
        res = tracked_step(model, batch=batch, optimizer="adam", engine="cuda", steps=1, guard=False)
    m = res.measurement
    assert m.allocator["peak_allocated_delta"] == m.blocks.peak_bytes
    assert m.beyond_tensors["bytes"] == 0
    (snap,) = [s for s in m.snapshots if s.name == "after step"]
    assert snap.allocated_bytes == snap.blocks_bytes
    assert m.blocks.peak_bytes >= m.peak_bytes            # blocks are never smaller than the tensors
    assert allocator_blocks(m.tracking.events) == m.blocks


@pytest.mark.parametrize("first,model,optimizer,empty_start_differs", [
    ("resnet18", "resnet18", "adam", True), ("resnet18", "cnn", "sgd", False), ("cnn", "alexnet", "momentum", True)])
def test_blocks_after_a_warm_up_follow_memory_allocated_block_for_block(standin_gpu, first, model, optimizer,
                                                                        empty_start_differs):
    # the warm-up leaves the cuBLAS workspace in a 20 MiB segment whose free room the next run
    # takes: the replay starts from the allocator's segments (memory_snapshot), so it sees that too
    tracked_step(first, batch=8, optimizer="sgd", engine="cuda", steps=1, guard=False)
    m = tracked_step(model, batch=8, optimizer=optimizer, engine="cuda", steps=1, guard=False).measurement
    assert m.allocator["peak_allocated_delta"] == m.blocks.peak_bytes
    (snap,) = [s for s in m.snapshots if s.name == "after step"]
    assert snap.allocated_bytes == snap.blocks_bytes
    # from an empty cache instead, the same events give other blocks where a large-pool tensor
    # would have taken the workspace segment's free room
    assert (allocator_blocks(m.tracking.events) != m.blocks) == empty_start_differs


def test_the_allocator_is_rebuilt_from_a_memory_snapshot(standin_gpu):
    from gpulab.allocator.simulator import rebuilt_allocator
    from gpulab.measure.gpu import allocator_segments
    keep = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (3 * MiB, 700, 5 * MiB, 12 * MiB, 300)]
    del keep[2]                       # a free gap between two allocated blocks of one segment
    segments = allocator_segments(0)
    sim = rebuilt_allocator(segments)
    assert sim is not None and sim.memory_allocated() == torch.cuda.memory_allocated()
    assert sim.memory_reserved() == torch.cuda.memory_reserved()
    assert [(s.pool, [(b.size, b.allocated) for b in s.blocks]) for s in sim.segment_map()] == \
        [(p, list(blocks)) for p, blocks in segments]
    # a layout the simulator cannot make (a 1000-byte block is not a rounded size) is refused
    assert rebuilt_allocator([("large", ((1000, True), (20 * MiB - 1000, False)))]) is None


# --- formulas compared like with like ------------------------------------------------------------------------

def test_step_formulas_are_compared_with_unrounded_tensor_bytes(standin_gpu):
    res = tracked_step("cnn", batch=4, optimizer="sgd", engine="cuda", steps=1, guard=False)
    assert res.peak_by_category["buffers"] == 6 * 512                  # six small buffers, 512-byte blocks
    assert res.tensor_bytes_by_category["buffers"] == res.predicted["buffers"] == 784
    html = res._repr_html_()
    assert "784 B" in html and "unrounded" in html


def test_parameter_memory_claim_holds_on_cuda(standin_gpu):
    from gpulab.course.parameters import model_params
    res = model_params("cnn", engine="cuda")
    assert res.engine == "cuda"
    assert res.param_bytes_measured == 4 * res.total_numel


# --- the CLI ---------------------------------------------------------------------------------------------------

def test_cli_step_on_the_cuda_engine(standin_gpu, capsys):
    assert cli.main(["step", "mlp", "--engine", "cuda", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["engine"] == "cuda" and STANDIN_NAME in d["label"] and not d["oom"]
    assert d["allocator"]["peak_allocated_delta"] == d["allocator_blocks"]["peak_bytes"] + d["beyond_tensors"]["bytes"]
    assert "num_ooms_this_run" in d["allocator"]
    assert d["peak_tensor_bytes_by_category"]["parameters"] == d["predicted"]["parameters"]
    assert cli.main(["step", "mlp", "--engine", "cuda"]) == 0
    text = capsys.readouterr().out
    assert "this run" in text and STANDIN_NAME in text and "allocator blocks" in text
    assert cli.main(["env", "--json"]) == 0
    env = json.loads(capsys.readouterr().out)
    assert env["engine"] == "cuda" and env["device"]["gpus"][0]["name"] == STANDIN_NAME


# --- every panel's cuda branch -----------------------------------------------------------------------------------

def _cuda_panels():
    import gpulab.widgets as W
    out = []
    for name in W.__all__:
        factory = getattr(W, name)
        if name.endswith("_panel") and "engine" in inspect.signature(factory).parameters:
            out.append(name)
    return out


SMALL = {"batch": 2, "largest": 4, "n_blocks": 4, "width": 32, "size_mib": 1, "card_gib": 1,
         "max_elements": 20, "channels": 8, "image_size": 32, "depth": 2}


@pytest.mark.parametrize("name", _cuda_panels())
def test_every_panel_runs_its_cuda_branch(standin_gpu, name):
    import gpulab.widgets as W
    factory = getattr(W, name)
    accepted = inspect.signature(factory).parameters
    kwargs = {k: v for k, v in SMALL.items() if k in accepted}
    if name in ("parameters_panel", "largest_batch_panel", "forward_table_panel", "inference_panel"):
        kwargs["model"] = "cnn"
    if name == "flops_panel":
        kwargs.pop("image_size", None)
    panel = factory(engine="cuda", **kwargs)
    panel.run()
    if name == "precision_panel":   # autocast("cuda") does not cast meta tensors: said, not faked
        assert panel.error == "ValueError: this torch cannot autocast to bfloat16 on cuda"
        return
    assert panel.error is None, panel.error
    assert panel.blocked is None, panel.blocked.message
    result = panel.result
    shown = str(getattr(result, "label", "")) + (result._repr_html_() if hasattr(result, "_repr_html_") else "")
    assert f"{STANDIN_NAME} (cuda)" in shown, shown[:500]
