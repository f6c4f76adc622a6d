"""Lesson 12's machinery: the distributed runner (real torch.distributed processes, gloo on
loopback), per-rank measurements of DDP / ZeRO-1 / FSDP2 against ZeRO's formulas, failures,
and the formulas at scale."""
from __future__ import annotations

import math
import multiprocessing
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import dist_experiments
from gpulab.distributed.runner import run_distributed
from gpulab.distributed.sharding import build, fsdp_shard_numel, measure_strategy
from gpulab.measure.tracking import MemoryTracker

pytestmark = pytest.mark.slow


def _no_workers_left():
    deadline = time.time() + 10
    while time.time() < deadline:
        if not [p for p in multiprocessing.active_children() if p.name.startswith("gpulab-rank")]:
            return True
        time.sleep(0.2)
    return False


def test_runner_gathers_every_rank():
    run = run_distributed(dist_experiments.all_reduce_rank, 2, timeout_s=90).check()
    assert run.backend == "gloo" and [r.rank for r in run.results] == [0, 1]
    assert all(r.data["sum"] == 3.0 for r in run.results)
    # each rank's tracker saw its own 4 KiB tensor
    assert all(r.tracking.peak_bytes >= 4096 for r in run.results)
    assert _no_workers_left()


def test_a_failing_rank_is_reported_and_the_others_stopped():
    t0 = time.time()
    run = run_distributed(dist_experiments.raise_on_rank1, 2, timeout_s=90)
    assert not run.ok and time.time() - t0 < 60
    msgs = {f.rank: f.message for f in run.failures}
    assert "RuntimeError: rank one refuses" in msgs[1]
    assert 0 in msgs  # stopped, since it could not go on
    with pytest.raises(RuntimeError, match="rank 1: RuntimeError: rank one refuses"):
        run.check()
    assert _no_workers_left()


def test_a_hanging_rank_is_killed_after_the_timeout():
    run = run_distributed(dist_experiments.hang_on_rank1, 2, timeout_s=20)
    assert not run.ok
    assert any(f.rank == 1 and "did not finish within 20 s" in f.message for f in run.failures)
    assert run.seconds < 40
    assert _no_workers_left()


def test_a_rank_that_dies_is_reported_with_its_exit_code():
    run = run_distributed(dist_experiments.die_on_rank0, 2, timeout_s=60)
    assert any(f.rank == 0 and "exited with code 3" in f.message for f in run.failures)
    assert _no_workers_left()


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="from 1 to 4"):
        run_distributed(dist_experiments.all_reduce_rank, 5)
    with pytest.raises(ValueError, match="module level"):
        run_distributed(lambda ctx: None, 2)
    with pytest.raises(ValueError, match="strategy must be one of"):
        measure_strategy(strategy="zero4")


def _param_info(width=96, layers=2):
    model = build("transformer", width, layers)
    shapes = [tuple(p.shape) for p in model.parameters()]
    return shapes, sum(math.prod(s) for s in shapes), len(shapes)


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp2-no-reshard"])
def test_fsdp_shards_are_the_full_bytes_over_the_world_size(strategy):
    # the formula states FSDP's padding: ceil(dim 0 / N) rows per rank
    sr = measure_strategy(strategy=strategy, world_size=2, width=96)
    shapes, psi, tensors = _param_info(96)
    shard = fsdp_shard_numel(shapes, 2)
    assert math.ceil(psi / 2) <= shard <= psi / 2 + sum(math.prod(s[1:]) for s in shapes if s)
    for b in sr.ranks:
        assert b.at_end["parameters"] == 4 * shard
        assert b.at_end["gradients"] == 4 * shard
        assert b.at_end["optimizer_state"] == 8 * shard + 4 * tensors  # + Adam's float32 step counters
        assert b.gathered_max > 0  # FSDP gathered parameters to compute
    if strategy == "fsdp2-no-reshard":  # everything gathered at once during the step
        assert sr.ranks[0].gathered_max == 4 * psi


def test_fsdp_shard_numel_is_torch_chunk_padded():
    for shape in [(7, 3), (1, 5), (10,), (3, 4, 5)]:
        for n in (1, 2, 3, 4):
            first = torch.empty(shape).chunk(n, dim=0)[0]
            assert fsdp_shard_numel([shape], n) == first.numel()


def test_ddp_and_zero1_per_rank():
    shapes, psi, tensors = _param_info(96)
    ddp = measure_strategy(strategy="ddp", world_size=2, width=96)
    for b in ddp.ranks:
        assert b.at_end["parameters"] == b.at_end["gradients"] == 4 * psi
        assert b.at_end["optimizer_state"] == 8 * psi + 4 * tensors
        assert b.at_end["communication buffers"] == 4 * psi  # the reducer's buckets
    assert ddp.formula()["total"] == 16 * psi
    z1 = measure_strategy(strategy="zero1", world_size=2, width=96)
    states = [b.at_end["optimizer_state"] for b in z1.ranks]
    numels = [b.state_numel for b in z1.ranks]
    assert sum(numels) == psi and all(n > 0 for n in numels)
    assert sum(states) == 8 * psi + 4 * tensors  # every state once, across the ranks
    for state, n in zip(states, numels):
        assert 8 * n < state < 8 * n + 4 * tensors
    assert all(b.at_end["gradients"] == 4 * psi for b in z1.ranks)
    # the same training: each rank's losses equal under every strategy
    assert [b.losses for b in z1.ranks] == [b.losses for b in ddp.ranks]


def test_bucket_view_makes_the_buckets_the_gradients():
    shapes, psi, _ = _param_info(64)
    b = measure_strategy(strategy="ddp", world_size=2, width=64, bucket_view=True).ranks[0]
    assert b.at_end["gradients"] == 4 * psi and b.at_end["communication buffers"] == 0


def test_tracker_sees_storage_resizes():
    original = torch.UntypedStorage.resize_
    with MemoryTracker() as tr:
        t = torch.empty(1000)
        t.untyped_storage().resize_(0)
        t.untyped_storage().resize_(4000)
        del t
    res = tr.result(device="cpu")
    assert [e.kind for e in res.events] == ["alloc", "resize", "resize", "free"]
    assert res.peak_bytes == 4000
    assert torch.UntypedStorage.resize_ is original  # unwrapped again


# --- safety: what listens, what is left running --------------------------------------------------

def test_the_store_listens_on_loopback_only():
    """The rendezvous store refuses a client on another address of this machine (127.0.0.2 is
    in the loopback range but is not the address the store was bound to; a store listening on
    every interface, as TCPStore does by itself, accepts it)."""
    import socket

    from gpulab.distributed.runner import LOOPBACK, loopback_store
    store = loopback_store(2, timeout_s=10)
    try:
        with socket.create_connection((LOOPBACK, store.port), timeout=5):
            pass
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", store.port), timeout=5).close()
    finally:
        del store


def test_a_failure_while_starting_workers_is_reported_as_itself(monkeypatch):
    """The second worker cannot be started: the caller sees that error (not "can only join a
    started process" from the clean-up), and the first worker, already started, is stopped."""
    from multiprocessing.context import SpawnProcess

    real_start = SpawnProcess.start
    started = []

    def start(self):
        if started:
            raise OSError("out of process slots (a test)")
        started.append(self)
        real_start(self)

    monkeypatch.setattr(SpawnProcess, "start", start)
    with pytest.raises(OSError, match="out of process slots"):
        run_distributed(dist_experiments.all_reduce_rank, 2, timeout_s=60)
    assert len(started) == 1 and started[0].exitcode is not None   # stopped and joined


def test_multiprocessings_bootstrapping_error_says_what_to_do(monkeypatch):
    """The RuntimeError spawn raises when a process still importing the main module starts another
    (multiprocessing/spawn.py) comes out as one sentence with the fix."""
    from multiprocessing.context import SpawnProcess

    def start(self):   # what _check_not_importing_main raises, word for word and line for line
        raise RuntimeError("""
        An attempt has been made to start a new process before the
        current process has finished its bootstrapping phase.""")

    monkeypatch.setattr(SpawnProcess, "start", start)
    with pytest.raises(RuntimeError, match='Put the call under `if __name__ == "__main__":`'):
        run_distributed(dist_experiments.all_reduce_rank, 2, timeout_s=60)


def test_stopping_workers_that_never_started_is_not_an_error():
    """A failure while starting the workers is reported as itself, not as "can only join a
    started process" from the clean-up."""
    from gpulab.distributed.runner import _stop
    ctx = multiprocessing.get_context("spawn")
    _stop([ctx.Process(target=time.sleep, args=(0,)) for _ in range(2)])


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"   # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_workers_die_with_a_killed_parent(tmp_path, sig):
    """A script running run_distributed, killed with SIGKILL or SIGTERM (no clean-up of its own
    runs), leaves no rank running."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
        import dist_experiments
        from gpulab.distributed.runner import run_distributed
        if __name__ == "__main__":
            run_distributed(dist_experiments.write_pid_and_sleep, 2, args=({str(tmp_path)!r},), timeout_s=150)
    """))
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(__file__).parents[1]))
    parent = subprocess.Popen([sys.executable, str(script)], env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids: list[int] = []
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(pids) < 2:
            pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
            time.sleep(0.3)
        assert len(pids) == 2, "the workers did not start"
        assert all(_pid_alive(p) for p in pids)
        parent.send_signal(sig)
        parent.wait(timeout=10)
        deadline = time.time() + 15
        while time.time() < deadline and any(_pid_alive(p) for p in pids):
            time.sleep(0.2)
        assert not [p for p in pids if _pid_alive(p)], "workers outlived their killed parent"
    finally:
        for pid in pids + [parent.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        parent.wait(timeout=10)


@pytest.mark.timeout(180)
def test_an_unguarded_script_is_told_what_to_do(tmp_path):
    """The README's example saved as a script without `if __name__ == "__main__":`: the workers
    import the script and start the run again. The failure says so, and no clean-up error masks it."""
    script = tmp_path / "unguarded.py"
    script.write_text("from gpulab.distributed.runner import run_distributed\n"
                      "import sys; sys.path.insert(0, %r)\n"
                      "import dist_experiments\n"
                      "run_distributed(dist_experiments.all_reduce_rank, 2, timeout_s=90).check()\n"
                      % str(pathlib.Path(__file__).parent))
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(__file__).parents[1]))
    r = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=150)
    assert r.returncode != 0
    assert 'if __name__ == "__main__":' in r.stderr
    assert "can only join a started process" not in r.stderr
    # the workers say it in one line each; the only traceback is the script's own, from check(),
    # whose message gives the advice once, not once per rank
    assert r.stderr.count("Traceback") == 1, r.stderr
    assert r.stderr.count("gpulab-rank") == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: distributed run over 2 gloo processes failed")
    assert last.count('if __name__ == "__main__":') == 1


def test_strategies_in_one_set_of_processes_measure_what_separate_runs_do():
    """measure_strategies (one spawn, a tracker per spec) gives each rank exactly the breakdown
    that measure_strategy (a spawn per spec) gives: lesson 12 relies on it."""
    from gpulab.distributed.sharding import StrategySpec, measure_strategies
    specs = [StrategySpec(strategy=s, model="transformer", width=64, layers=2, batch=4, seq_len=16)
             for s in ("ddp", "fsdp2")]
    together = measure_strategies(specs, 2)
    for spec, t in zip(specs, together):
        apart = measure_strategy(spec, 2)
        assert t.spec == spec and t.world_size == 2
        for x, y in zip(apart.ranks, t.ranks):
            assert (x.at_end, x.params_max, x.gathered_max, x.losses) == \
                   (y.at_end, y.params_max, y.gathered_max, y.losses), spec.strategy
            if spec.strategy == "ddp":   # FSDP2's peak moves between runs with its threads' timing
                assert (x.peak_bytes, x.at_peak) == (y.peak_bytes, y.at_peak)
    with pytest.raises(ValueError, match="non-empty list of StrategySpec"):
        measure_strategies([], 2)
