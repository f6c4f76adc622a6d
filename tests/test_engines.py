"""Engines: the fake engine must answer exactly what the cpu engine measures; the automatic
choice follows its limits; refusals name what is available; out-of-memory is a result."""
import pytest
import torch

from gpulab.measure import engines
from gpulab.measure.engines import LABEL_CPU, LABEL_FAKE_CPU, EngineUnavailable, Measurement, choose_engine, engine_status, run
from gpulab.predict.step import step as tracked_step
from gpulab.categories import CATEGORIES


# --- fake == cpu -------------------------------------------------------------------------------

def _after_step(res):
    (snap,) = [s for s in res.measurement.snapshots if s.name == "after step"]
    return snap


@pytest.mark.parametrize("model,optimizer,steps", [
    ("cnn", "sgd", 1), ("cnn", "momentum", 1), ("cnn", "adam", 2), ("cnn", "rmsprop", 1),
    ("mlp", "sgd", 1), ("mlp", "adamw", 1), ("mlp", "adagrad", 2), ("mlp", "momentum", 2),
])
def test_fake_and_cpu_engines_agree_exactly(model, optimizer, steps):
    cpu = tracked_step(model, batch=8, optimizer=optimizer, engine="cpu", steps=steps, guard=False)
    # like with like: the fake engine's CPU target follows the CPU's kernels (the default CUDA
    # target follows CUDA's: tests/test_fake_cuda.py)
    fake = tracked_step(model, batch=8, optimizer=optimizer, engine="fake", steps=steps, fake_target="cpu", guard=False)
    assert (cpu.engine, fake.engine) == ("cpu", "fake")
    assert cpu.peak_bytes > 0
    assert fake.peak_bytes == cpu.peak_bytes
    assert fake.peak_by_category == cpu.peak_by_category
    assert fake.measurement.tracking.peak_phase == cpu.measurement.tracking.peak_phase
    assert _after_step(fake).by_category == _after_step(cpu).by_category
    assert _after_step(fake).tracked_bytes == _after_step(cpu).tracked_bytes
    assert [(e.kind, e.nbytes) for e in fake.measurement.tracking.events] == \
        [(e.kind, e.nbytes) for e in cpu.measurement.tracking.events]


@pytest.mark.parametrize("optimizer,mult", [("sgd", 0), ("momentum", 1), ("adam", 2)])
def test_after_step_snapshot_holds_params_grads_state(optimizer, mult):
    res = tracked_step("cnn", batch=4, optimizer=optimizer, engine="cpu", steps=1, guard=False)
    after = _after_step(res).by_category
    n_params = 152_074   # conv 896 + bn 64 + conv 18,496 + bn 128 + fc 131,200 + fc 1,290
    assert after["parameters"] == after["gradients"] == 4 * n_params
    steps = 4 * 12 if optimizer == "adam" else 0   # one 4-byte step counter per param tensor
    assert after["optimizer_state"] == mult * 4 * n_params + steps
    # BatchNorm running_mean + running_var (fp32) and num_batches_tracked (int64), 32 and 64 ch
    assert after["buffers"] == (2 * 32 * 4 + 8) + (2 * 64 * 4 + 8)
    assert after["inputs"] == 4 * 3 * 32 * 32 * 4 + 4 * 8
    assert after["activations"] == after["temporaries"] == 0
    assert res.as_dict()["after_step_by_category"] == after
    assert res.measurement.tracking.final_bytes == 0   # everything is freed once it returns


def test_fake_engine_answers_vgg16_at_batch_64():
    res = tracked_step("vgg16", batch=64, optimizer="momentum", engine="fake", steps=1, fake_target="cpu", guard=False)
    params = 138_357_544 * 4
    after = _after_step(res).by_category
    assert after["parameters"] == after["gradients"] == after["optimizer_state"] == params
    assert res.peak_by_category["parameters"] == params
    assert res.peak_bytes > 5 * 2**30          # far more than this test could allocate for real
    assert res.measurement.label == LABEL_FAKE_CPU and res.measurement.device == "cpu (fake tensors)"


# --- choosing an engine --------------------------------------------------------------------------

@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_auto_prefers_cuda_when_present(gpu):
    assert choose_engine().name == "cuda"
    assert choose_engine("auto", predicted_bytes=10**15, predicted_flops=10**18).name == "cuda"
    assert choose_engine("cuda").name == "cuda"
    assert engine_status()["cuda"][0] is True


def test_auto_without_gpu_follows_limits(no_gpu):
    assert choose_engine().name == "cpu"
    assert choose_engine("auto", predicted_bytes=100, predicted_flops=100).name == "cpu"
    limit = engines.DEFAULT_MAX_CPU_BYTES
    assert choose_engine("auto", predicted_bytes=limit).name == "cpu"          # at the limit: cpu
    big = choose_engine("auto", predicted_bytes=limit + 1)
    assert big.name == "fake" and "MiB" in big.reason
    assert choose_engine("auto", predicted_flops=engines.DEFAULT_MAX_CPU_FLOPS).name == "cpu"
    slow = choose_engine("auto", predicted_flops=engines.DEFAULT_MAX_CPU_FLOPS + 1)
    assert slow.name == "fake" and "GFLOP" in slow.reason
    assert choose_engine("auto", predicted_bytes=2000, max_cpu_bytes=1000).name == "fake"
    assert choose_engine("auto", predicted_flops=2000, max_cpu_flops=1000).name == "fake"
    assert choose_engine("AUTO").name == "cpu"


def test_a_float16_flop_counts_cpu_fp16_slowdown_times(no_gpu):
    """Most CPUs have no float16 units: ``auto`` counts a float16 FLOP ``CPU_FP16_SLOWDOWN`` times against the
    FLOP limit, and says so; float32 and bfloat16 FLOPs count once."""
    limit, weight = 1000 * engines.CPU_FP16_SLOWDOWN, engines.CPU_FP16_SLOWDOWN
    for dt in (None, torch.float32, torch.bfloat16):
        assert choose_engine("auto", predicted_flops=limit, max_cpu_flops=limit, dtype=dt).name == "cpu"
    assert choose_engine("auto", predicted_flops=1000, max_cpu_flops=limit, dtype=torch.float16).name == "cpu"
    slow = choose_engine("auto", predicted_flops=1001, max_cpu_flops=limit, dtype=torch.float16)
    assert slow.name == "fake" and f"in float16, counted {weight}x" in slow.reason
    assert choose_engine("cpu", predicted_flops=10**15, dtype=torch.float16).name == "cpu"   # asked: as asked


def test_explicit_engines(no_gpu):
    for name in ("cpu", "fake", "CPU", "Fake"):
        choice = choose_engine(name, predicted_bytes=10**15)
        assert choice.name == name.lower() and choice.reason == "asked for explicitly"


def test_unavailable_cuda_names_what_is_available(no_gpu):
    with pytest.raises(EngineUnavailable) as e:
        choose_engine("cuda")
    msg = str(e.value)
    assert "'cuda'" in msg and "not available" in msg
    assert msg.endswith("available: auto, cpu, fake")
    assert isinstance(e.value, ValueError)
    with pytest.raises(EngineUnavailable):
        run(lambda ctx: None, engine="cuda")


def test_unknown_engine_names_valid_ones():
    with pytest.raises(EngineUnavailable) as e:
        choose_engine("tpu")
    assert "unknown engine 'tpu'" in str(e.value)
    for name in ("auto", "cuda", "cpu", "fake"):
        assert name in str(e.value)


def test_training_step_auto_engine_without_gpu(no_gpu):
    assert tracked_step("mlp", batch=2, optimizer="sgd", engine="auto", steps=1, guard=False).engine == "cpu"
    big = tracked_step("vgg16", batch=64, optimizer="sgd", engine="auto", steps=1, guard=False)
    assert big.engine == "fake" and "MiB" in big.measurement.reason
    slow = tracked_step("alexnet", batch=1, optimizer="sgd", engine="auto", steps=1, max_cpu_flops=10**9, guard=False)
    assert slow.engine == "fake" and "GFLOP" in slow.measurement.reason


# --- run(): values, labels, snapshots -----------------------------------------------------------

@pytest.mark.parametrize("engine,label", [("cpu", LABEL_CPU), ("fake", LABEL_FAKE_CPU)])
def test_run_returns_value_label_and_tracking(engine, label):
    def experiment(ctx):
        x = ctx.label(torch.ones(1000, device=ctx.device))
        y = x * 2
        snap = ctx.snapshot("two alive")
        del y
        return snap.tracked_bytes

    m = run(experiment, engine=engine)
    assert isinstance(m, Measurement) and not m.oom and m.error is None
    assert (m.engine, m.label) == (engine, label)
    assert m.value == 8000
    assert m.snapshots[0].by_category["inputs"] == m.snapshots[0].by_category["temporaries"] == 4000
    assert m.peak_bytes == 8000 and m.peak_by_category["inputs"] == 4000
    assert m.tracking.final_bytes == 0 and m.seconds > 0
    assert m.allocator is None and m.beyond_tensors is None
    assert engine in repr(m)


# --- out of memory -----------------------------------------------------------------------------

def _raiser(make_exc):
    def experiment(ctx):
        keep = torch.empty(1000, device=ctx.device)
        more = keep + 1
        raise make_exc()   # a fresh exception, as torch raises (its traceback holds these locals)
    return experiment


@pytest.mark.parametrize("engine", ["cpu", "fake"])
@pytest.mark.parametrize("make_exc", [
    lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    lambda: MemoryError("no more memory"),
    lambda: RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 10 bytes"),
], ids=["OutOfMemoryError", "MemoryError", "cpu-allocator"])
def test_oom_is_a_result_not_an_exception(engine, make_exc):
    exc = make_exc()
    m = run(_raiser(make_exc), engine=engine)
    assert m.oom is True
    assert type(exc).__name__ in m.error and str(exc) in m.error
    assert m.value is None
    assert m.peak_bytes == 8000              # what it held when it failed
    assert m.tracking.final_bytes == 0       # ... and all of it was released afterwards
    assert "OOM" in repr(m)


def test_a_real_cpu_oom_is_caught():
    m = run(lambda ctx: torch.empty(2**50, dtype=torch.uint8), engine="cpu")   # 1 PiB
    assert m.oom and "can't allocate memory" in m.error


def test_other_errors_propagate():
    def bad(ctx):
        raise ValueError("a bug in the experiment")
    with pytest.raises(ValueError, match="a bug"):
        run(bad, engine="cpu")
    with pytest.raises(RuntimeError, match="reduction dim"):   # a shape error, not an OOM
        run(lambda ctx: torch.ones(2, 3) @ torch.ones(2, 3), engine="fake")


def test_categories_complete_in_measurements():
    res = tracked_step("mlp", batch=2, optimizer="sgd", engine="cpu", steps=1, guard=False)
    assert set(res.peak_by_category) == {c.value for c in CATEGORIES}
    assert set(res.predicted) == {c.value for c in CATEGORIES}


def test_storages_held_by_reference_cycles_are_freed_before_the_result():
    def cyclic(ctx):
        holder = {"t": torch.empty(1000, device=ctx.device)}
        holder["self"] = holder          # garbage only the cycle collector can free
        return 1

    def oom_in_cycle(ctx):
        keep = torch.empty(500, device=ctx.device)
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except torch.OutOfMemoryError as e:
            saved = e                     # frame -> exception -> traceback -> frame
            raise

    for engine in ("cpu", "fake"):
        m = run(cyclic, engine=engine)
        assert (m.value, m.peak_bytes, m.tracking.final_bytes) == (1, 4000, 0)
        m = run(oom_in_cycle, engine=engine)
        assert m.oom and (m.peak_bytes, m.tracking.final_bytes) == (2000, 0)
