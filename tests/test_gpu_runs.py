"""Lessons 10–14 on a GPU (gpulab/course/gpu_runs.py): each GPU path run under the CUDA stand-in
(tests/cuda_standin.py: a GPU named "stand-in GPU (no CUDA)", tensors on meta, counters from the
simulator), labelled as that GPU's, with the fields the lesson shows; and without it, each falls
back with a "no GPU" note and measures nothing."""
from types import SimpleNamespace

import pytest
import torch

from cuda_standin import STANDIN_NAME
from gpulab.course import gpu_runs as G
from gpulab.measure.engines import LABEL_CPU, label_cuda
from gpulab.measure.linetrack import track_lines

STANDIN_LABEL = label_cuda(STANDIN_NAME)

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for machines without CUDA")


def _meta_as_gpu(monkeypatch):
    """transformers makes tensors on its inputs' device, which under the stand-in is "meta": here
    they count as the GPU's too, so that reading a value gives the stand-in's zeros."""
    import cuda_standin
    is_cuda = cuda_standin._is_cuda
    monkeypatch.setattr(cuda_standin, "_is_cuda", lambda dev: is_cuda(dev) or (
        isinstance(dev, (str, torch.device)) and torch.device(dev).type == "meta"))


@pytest.fixture
def meta_counts_as_gpu(standin_gpu, monkeypatch):
    _meta_as_gpu(monkeypatch)
    return standin_gpu


# --- without a GPU: the lessons' CPU paths, and a note -----------------------------------------------

@needs_no_cuda
def test_without_a_gpu_every_function_falls_back_with_a_no_gpu_note():
    where = G.memtrack_where()
    assert (where.engine, where.device, where.label) == ("cpu", "cpu", LABEL_CPU)
    llm = G.llm_on_gpu()
    assert not llm.measured and llm.kv is None
    nccl = G.nccl_one_rank()
    assert nccl.backend == "gloo" and nccl.runs == []
    snap = G.own_step_snapshot()
    assert not snap.recorded
    for r in (where, llm, nccl, snap):
        assert G.NO_GPU in r.note and "no GPU measured" in r._repr_html_()


@needs_no_cuda
def test_without_a_gpu_the_capstone_batch_is_not_run_and_says_so():
    you = SimpleNamespace(card=SimpleNamespace(name="T4"))
    fit = SimpleNamespace(largest_batch=12, peak_bytes=10 * 2**20, capacity_bytes=14 * 2**30)
    check = G.check_batch_on_gpu(you, fit)
    assert not check.ran and check.result is None and check.batch == 12
    assert G.NO_GPU in check.note and "batch 12" in check.note and "T4" in check.note


# --- lesson 10 ----------------------------------------------------------------------------------------

LEAKY = """model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)).to(device)
losses = []
for i in range(2):
    x = torch.randn(64, 256, device=device)
    loss = model(x).pow(2).mean()
    losses.append(loss)
"""


def test_lesson_10_memtrack_runs_on_the_gpu(standin_gpu):
    where = G.memtrack_where()
    assert (where.engine, where.device, where.label) == ("cuda", "cuda", STANDIN_LABEL)
    ns = {"torch": torch, "nn": torch.nn, "device": where.device}
    report = track_lines(LEAKY, ns, engine=where.engine)
    assert report.label == STANDIN_LABEL and report.device == "cuda:0"
    appended = [s for s in report.steps if "losses.append" in s.source]
    assert len(appended) == 2 and appended[1].total_bytes > appended[0].total_bytes
    assert all(s.allocated_bytes is not None for s in report.steps)   # memory_allocated read per line


# --- lesson 11 ----------------------------------------------------------------------------------------

def _greedy_decode(self, input_ids, max_new_tokens=1, **kwargs):
    """generate()'s forwards with the cache it was given: a prefill, then one per new token but
    the last. (generate itself stops on token values, which the stand-in's zeros never end.)"""
    name = "cache" if "cache" in kwargs else "past_key_values"
    cache = {name: kwargs[name]}
    out = self(input_ids=input_ids, use_cache=True, **cache)
    for _ in range(max_new_tokens - 1):
        out = self(input_ids=out.logits[:, -1:].argmax(-1), use_cache=True, **cache)
    return input_ids


def test_lesson_11_step_and_kv_cache_on_the_gpu(meta_counts_as_gpu, monkeypatch):
    import transformers
    monkeypatch.setattr(transformers.GenerationMixin, "generate", _greedy_decode)
    gpu = meta_counts_as_gpu
    llm = G.llm_on_gpu("tiny-llama", recipes=("fp32",), seq_len=16, prompt_len=4, new_tokens=4)
    assert llm.measured and llm.label == STANDIN_LABEL
    row = llm.steps[0]
    assert row.label == STANDIN_LABEL
    kv = llm.kv
    assert kv.label == STANDIN_LABEL and [r[0] for r in kv.rows] == [4, 5, 6, 7]
    assert all(cache == formula for _, cache, formula, _ in kv.rows)   # the storages are the formula's bytes
    assert kv.peak_allocated >= kv.weights_bytes + kv.rows[-1][2]
    assert kv.per_token_formula == kv.rows[-1][2] - kv.rows[-2][2] > 0
    assert all(isinstance(r[3], int) for r in kv.rows)    # memory_allocated after each forward
    assert "reset_peak_memory_stats" in gpu.order and "max_memory_allocated" in gpu.order
    shown = llm._repr_html_()
    assert STANDIN_LABEL in shown and "max_memory_allocated" in shown and "formula" in shown


# --- lesson 12 ----------------------------------------------------------------------------------------

def test_lesson_12_asks_for_one_nccl_rank_on_the_gpu(standin_gpu, monkeypatch):
    # the worker processes cannot share the stand-in: the run itself is replaced, and what it
    # was asked for (one rank, the backend default_backend picks there) is checked
    from gpulab.distributed import runner, sharding
    asked = {}

    def fake_measure(specs, world_size=2, **kw):
        asked.update(specs=specs, world_size=world_size, backend=runner.default_backend(world_size))
        rank = SimpleNamespace(peak_bytes=3 * 2**20)
        return [SimpleNamespace(spec=s, run=SimpleNamespace(backend=asked["backend"]), ranks=[rank],
                                measured=lambda r: {"total": 2**20}, formula=lambda: {"total": 2**20}) for s in specs]

    monkeypatch.setattr(sharding, "measure_strategies", fake_measure)
    r = G.nccl_one_rank(width=64)
    assert asked["world_size"] == 1 and asked["backend"] == "nccl" == r.backend
    assert [s.strategy for s in asked["specs"]] == ["ddp", "fsdp2"]
    assert r.label.startswith(STANDIN_LABEL) and "1 nccl process" in r.label
    assert "2-process runs above use gloo" in r.note and "has 1" in r.note   # why the lesson's runs stay on gloo
    shown = r._repr_html_()
    assert "ddp" in shown and "fsdp2" in shown and "nccl" in shown


# --- lesson 13 ----------------------------------------------------------------------------------------

def _record_trace(gpu, monkeypatch):
    """``_record_memory_history`` / ``_snapshot`` for the stand-in: its simulator's allocations,
    frees and segments as a PyTorch trace, its segments as the snapshot's."""
    trace, state = [], {"on": False}
    sim = gpu.sim

    def segs():
        return {s.address: s.size for s in sim.segment_map()}

    def logged(fn, action):
        def wrapper(*args, **kwargs):
            before = segs()
            blk = args[0] if action == "free" else None
            out = fn(*args, **kwargs)
            if state["on"]:
                after = segs()
                trace.extend({"action": "segment_alloc", "addr": a, "size": n, "stream": 0}
                             for a, n in after.items() if a not in before)
                if action == "alloc" and out.size:
                    trace.append({"action": "alloc", "addr": out.addr, "size": out.requested, "stream": 0})
                if action == "free" and blk.size:
                    trace.append({"action": "free_requested", "addr": blk.addr, "size": blk.requested, "stream": 0})
                    trace.append({"action": "free_completed", "addr": blk.addr, "size": blk.requested, "stream": 0})
                trace.extend({"action": "segment_free", "addr": a, "size": n, "stream": 0}
                             for a, n in before.items() if a not in after)
            return out
        return wrapper

    monkeypatch.setattr(sim, "malloc", logged(sim.malloc, "alloc"))
    monkeypatch.setattr(sim, "free", logged(sim.free, "free"))
    monkeypatch.setattr(sim, "empty_cache", logged(sim.empty_cache, "empty"))

    def record(enabled="all", *args, **kwargs):
        state["on"] = enabled is not None
        gpu._log("_record_memory_history" if state["on"] else "_record_memory_history(None)")

    def snapshot(*args, **kwargs):
        segments = [{"device": 0, "address": seg.address, "total_size": seg.size, "stream": 0,
                     "segment_type": seg.pool, "allocated_size": seg.allocated_bytes,
                     "blocks": [{"address": b.addr, "size": b.size, "requested_size": b.requested,
                                 "state": "active_allocated" if b.allocated else "inactive"} for b in seg.blocks]}
                    for seg in sim.segment_map()]
        return {"segments": segments, "device_traces": [list(trace)]}

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", snapshot)
    return trace


def test_lesson_13_records_its_own_step_and_replays_it(standin_gpu, monkeypatch):
    trace = _record_trace(standin_gpu, monkeypatch)
    snap = G.own_step_snapshot("cnn", batch=4)
    assert snap.recorded and trace
    assert snap.label.startswith(STANDIN_LABEL) and snap.imported.label == snap.label
    assert snap.imported.from_gpu                       # no "gpulab" entry: a file PyTorch wrote
    order = standin_gpu.order
    assert order.index("_record_memory_history") < order.index("_record_memory_history(None)")
    rows = {r[0]: r for r in snap.rows()}
    assert snap.tracker_peak > 0 and snap.allocator_peak >= snap.tracker_peak
    assert rows["reserved peak"][1] == rows["reserved peak"][2]   # the simulator replays its own segments
    shown = snap._repr_html_()
    assert STANDIN_LABEL in shown and "replay" in shown


# --- lesson 14 ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_capstone():
    # the capstone's model; its fit answer stood in for (check_batch_on_gpu reads these three fields)
    from gpulab.course.capstone import your_model
    you = your_model("hf:tiny-gpt2", "T4", optimizer="adamw", seq_len=32)
    return you, SimpleNamespace(largest_batch=4, peak_bytes=3 * 2**20, capacity_bytes=14 * 2**30)


def test_lesson_14_runs_the_chosen_batch_on_the_gpu(tiny_capstone, meta_counts_as_gpu):
    you, base = tiny_capstone
    check = G.check_batch_on_gpu(you, base, steps=1)
    assert check.ran, check.note
    assert check.batch == 4 and check.label == STANDIN_LABEL
    assert check.result.measurement.label == STANDIN_LABEL and check.result.batch == 4
    rows = {r[0]: r for r in check.rows()}
    assert "max_memory_reserved − start" in rows and rows["live tensors' peak"][1] == "3.0 MiB"
    assert f"ran on {STANDIN_NAME}" in check.note and "within T4" in check.note
    assert STANDIN_LABEL in check._repr_html_()


def test_lesson_14_an_oom_is_caught_reported_and_freed(tiny_capstone, monkeypatch):
    from cuda_standin import standin_gpu as install
    you, base = tiny_capstone
    # 4 MiB: room for the batch's inputs, not for the step (its first matmul's cuBLAS workspace alone is 8 MiB)
    with install(monkeypatch, total_bytes=504 * 2**20, context_bytes=500 * 2**20) as gpu:
        _meta_as_gpu(monkeypatch)
        monkeypatch.setattr("gpulab.predict.step.check_fits", lambda peak, engine: None)   # past the guard
        check = G.check_batch_on_gpu(you, base, steps=1)
        assert check.oom and not check.ran, check.note
        assert "ran out of memory" in check.note and "memory freed" in check.note
        assert gpu.sim.memory_allocated() == 0


def test_lesson_14_the_guard_refuses_what_would_not_fit(tiny_capstone, monkeypatch):
    from cuda_standin import standin_gpu as install
    you, base = tiny_capstone
    with install(monkeypatch, total_bytes=501 * 2**20, context_bytes=500 * 2**20):
        check = G.check_batch_on_gpu(you, base, steps=1)
        assert check.refused and not check.ran and "not run" in check.note
