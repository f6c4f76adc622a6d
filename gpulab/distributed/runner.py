"""Run an experiment in W local worker processes joined by ``torch.distributed``; gather each
rank's tracker result back to the caller.

* The workers are started with the ``spawn`` method (a notebook kernel has threads, so ``fork``
  is unsafe). Each joins one process group through a ``TCPStore`` that the caller opens on a
  socket it binds to the loopback address (127.0.0.1, a port the OS picks) and hands to the store
  (``master_listen_fd``): the store listens there only, not on every interface as it would by
  itself, and holds the port, so no other program can take it between choosing and joining.
  gloo is told to use the loopback interface, so nothing is sent beyond this machine.
* The workers die with the caller: on Linux each asks the kernel for SIGKILL when its parent
  exits (``prctl(PR_SET_PDEATHSIG)``), and everywhere a watcher thread ends a worker whose
  parent is gone, so a killed script or kernel leaves no rank running.
* The backend is gloo on the CPU, or nccl when there are at least W GPUs (one per rank).
* Every rank runs the experiment under a :class:`~gpulab.measure.tracking.MemoryTracker` and sends back
  its :class:`~gpulab.measure.tracking.TrackingResult` and whatever the experiment returned.
* A rank that raises is reported with its rank and message; a rank that dies without a word is
  reported with its exit code; ranks still running when one failed, or past the time limit, are
  killed. The group is always torn down and every worker is joined: the caller's process (a
  notebook kernel) survives whatever the workers do.

The experiment must be importable by the workers: a function defined at module level in a
module (not in a notebook cell, which spawned workers cannot import). A script must start the run
under ``if __name__ == "__main__":``, since every spawned worker imports the script first; one
that does not is told so in one line, whichever process notices it.
"""
from __future__ import annotations

import ctypes
import datetime
import multiprocessing
import os
import queue as queue_mod
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from gpulab.measure.tracking import MemoryTracker, TrackingResult
from gpulab.units import format_bytes

__all__ = [
    "BOOTSTRAPPING", "DistributedRun", "LOOPBACK", "MAX_WORLD_SIZE", "RankContext", "RankFailure",
    "RankResult", "UNGUARDED_SCRIPT", "WORKER_PREFIX", "default_backend", "loopback_interface",
    "loopback_store", "run_distributed"
]

MAX_WORLD_SIZE = 4
LOOPBACK = "127.0.0.1"
WORKER_PREFIX = "gpulab-rank"
# what multiprocessing raises (multiprocessing/spawn.py, _check_not_importing_main) when a process
# still importing its parent's main module tries to start one of its own
BOOTSTRAPPING = "has finished its bootstrapping phase"
UNGUARDED_SCRIPT = (
    "run_distributed was called while a process was still starting: a spawned process imports your "
    "script first, and its top level starts the run again. Put the call under "
    "`if __name__ == \"__main__\":` (see the README's example)")


@dataclass
class RankContext:
    """What an experiment gets in each worker: its rank, the world size, its device and the
    tracker that is recording (``tracker.label``, ``tracker.phase``, ``tracker.register``)."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    tracker: MemoryTracker

    def mark(self) -> int:
        """The tracker's event count now: a boundary for ``TrackingResult.peak_between``."""
        return len(self.tracker._events)


@dataclass
class RankResult:
    """One rank's measurement: the tracker's result on the rank's device and the experiment's
    own data (a dict it returned)."""

    rank: int
    tracking: TrackingResult
    data: dict[str, Any]
    seconds: float

    @property
    def peak_bytes(self) -> int:
        return self.tracking.peak_bytes

    @property
    def peak_by_category(self) -> dict[str, int]:
        return self.tracking.peak_by_category


@dataclass
class RankFailure:
    rank: int
    message: str

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.message}"


@dataclass
class DistributedRun:
    """The gathered results of one run over ``world_size`` processes."""

    world_size: int
    backend: str
    results: list[RankResult] = field(default_factory=list)
    failures: list[RankFailure] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures and len(self.results) == self.world_size

    def rank(self, r: int) -> RankResult:
        for res in self.results:
            if res.rank == r:
                return res
        raise KeyError(f"no result from rank {r}")

    def check(self) -> "DistributedRun":
        """Raise ``RuntimeError`` naming every failed rank; return self when all succeeded."""
        if not self.ok:
            missing = sorted(set(range(self.world_size)) - {r.rank for r in self.results}
                             - {f.rank for f in self.failures})
            lines = [str(f) for f in self.failures] + [f"rank {r}: no result" for r in missing]
            raise RuntimeError(f"distributed run over {self.world_size} {self.backend} processes failed: "
                               + "; ".join(lines))
        return self

    def __repr__(self) -> str:
        head = f"DistributedRun({self.world_size} × {self.backend}"
        if self.failures:
            return head + ", failed: " + "; ".join(map(str, self.failures)) + ")"
        peaks = ", ".join(f"rank {r.rank}: {format_bytes(r.peak_bytes)}" for r in sorted(self.results, key=lambda r: r.rank))
        return head + f"; peaks {peaks})"


def default_backend(world_size: int) -> str:
    """nccl when every rank can have its own GPU, gloo (CPU) otherwise."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def loopback_interface() -> str:
    """The name of this machine's loopback interface ("lo" on Linux, "lo0" on macOS)."""
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    return "lo"


def _check_args(experiment: Callable, world_size: int, backend: str, timeout_s: float) -> None:
    if not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be a whole number from 1 to {MAX_WORLD_SIZE} local processes, "
                         f"not {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', not {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"nccl needs one GPU per rank: {world_size} ranks, "
                         f"{torch.cuda.device_count()} GPU(s) here; use backend='gloo'")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, not {timeout_s!r}")
    module = getattr(experiment, "__module__", None)
    qualname = getattr(experiment, "__qualname__", "")
    if not callable(experiment) or module in (None, "__main__") or "<" in qualname:
        raise ValueError(
            "the experiment must be a function defined at module level in an importable module "
            "(the worker processes import it by name); a function from a notebook cell, a lambda "
            "or a nested function cannot be sent to them: put it in a .py file and import it")


def run_distributed(experiment: Callable[..., dict | None], world_size: int = 2, *, args: tuple = (),
                    backend: str = "auto", timeout_s: float = 120.0) -> DistributedRun:
    """Run ``experiment(ctx, *args)`` in ``world_size`` processes, one per rank, each under the
    tracker; wait at most ``timeout_s`` seconds (start-up included), then kill what is left.

    Returns a :class:`DistributedRun` whether or not the ranks succeeded (``.ok``,
    ``.failures``, ``.check()``); raises ``ValueError`` for arguments that cannot work."""
    this = multiprocessing.current_process()
    if this.name.startswith(WORKER_PREFIX) and getattr(this, "_inheriting", False):
        # one of our workers, still importing the caller's script (spawn.py sets `_inheriting`
        # meanwhile), and the script's top level starts the run again. The worker cannot go on:
        # it exits with this one line, not a traceback through multiprocessing's bootstrapping,
        # and the caller reports the run as failed, with the same advice
        raise SystemExit(f"{this.name}: {UNGUARDED_SCRIPT}")
    if backend == "auto":
        backend = default_backend(world_size) if isinstance(world_size, int) else "gloo"
    _check_args(experiment, world_size, backend, timeout_s)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results: queue_mod.Queue = ctx.Queue()
    t0 = time.perf_counter()
    # the caller holds the store (and so the port) for the whole run; the workers are clients
    store = loopback_store(world_size + 1, timeout_s)
    procs = [ctx.Process(target=_worker, daemon=True, name=f"{WORKER_PREFIX}{rank}",
                         args=(rank, world_size, store.port, backend, experiment, args, results, timeout_s,
                               os.getpid()))
             for rank in range(world_size)]
    run = DistributedRun(world_size=world_size, backend=backend)
    try:
        for p in procs:
            try:
                p.start()
            except RuntimeError as exc:
                if BOOTSTRAPPING in " ".join(str(exc).split()):   # multiprocessing's words for the same mistake
                    raise RuntimeError(UNGUARDED_SCRIPT) from exc
                raise
        _collect(run, procs, results, deadline=t0 + timeout_s, timeout_s=timeout_s)
    finally:
        _stop(procs)
        results.close()
        results.join_thread()
        del store
    run.results.sort(key=lambda r: r.rank)
    run.failures.sort(key=lambda f: f.rank)
    run.seconds = time.perf_counter() - t0
    return run


def _collect(run: DistributedRun, procs, results, deadline: float, timeout_s: float) -> None:
    pending = set(range(len(procs)))
    while pending:
        try:
            kind, rank, payload = results.get(timeout=0.2)
        except queue_mod.Empty:
            kind = None
        if kind == "ok":
            run.results.append(payload)
            pending.discard(rank)
        elif kind == "error":
            run.failures.append(RankFailure(rank, payload))
            pending.discard(rank)
            break  # the others wait on it in a collective: stop them below
        for rank in sorted(pending):
            code = procs[rank].exitcode
            if code is not None:
                try:  # its message may still be in the pipe
                    kind, r, payload = results.get(timeout=1.0)
                    if kind == "ok":
                        run.results.append(payload)
                    else:
                        run.failures.append(RankFailure(r, payload))
                    pending.discard(r)
                    continue
                except queue_mod.Empty:
                    hint = _script_hint() if code == 1 else ""
                    if hint and any(hint in f.message for f in run.failures):
                        hint = ""   # once per run is enough
                    run.failures.append(RankFailure(rank, f"worker process exited with code {code} "
                                                          "without sending a result" + hint))
                    pending.discard(rank)
        if any(f for f in run.failures) and pending:
            break
        if time.perf_counter() > deadline:
            for rank in sorted(pending):
                run.failures.append(RankFailure(rank, f"did not finish within {timeout_s:g} s; killed"))
            return
    for rank in sorted(pending):
        # a rank that died first can be heard of last: the others' collectives fail as soon as its
        # connection drops, and their errors may reach the queue before its exit is seen
        procs[rank].join(timeout=1.0)
        code = procs[rank].exitcode
        if code not in (None, 0):
            run.failures.append(RankFailure(rank, f"worker process exited with code {code} without sending a result"))
        else:
            run.failures.append(RankFailure(rank, "stopped: another rank failed, so this one could not go on"))


def _stop(procs) -> None:
    started = [p for p in procs if p.pid is not None]   # a start that failed leaves the rest unstarted
    for p in started:
        if p.is_alive():
            p.terminate()
    for p in started:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def loopback_store(world_size: int, timeout_s: float):
    """A ``TCPStore`` server for ``world_size`` clients that listens on 127.0.0.1 only.

    By itself the store's server listens on every interface (it binds the wildcard address
    whatever host it is given); here it gets a socket already bound to the loopback address
    (``master_listen_fd``), and owns it from then on."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        store = dist.TCPStore(LOOPBACK, port, world_size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()   # the store closes the descriptor when it is destroyed
    return store


def _die_with_parent(parent_pid: int) -> None:
    """End this worker when the process that started it exits, however it exits (SIGKILL too).

    NB: the kernel sends the death signal when the *thread* that started the worker ends
    (prctl(2)); ``run_distributed``'s thread waits for its workers and stops them before it returns,
    so that thread outlives them. Right after the prctl, a parent already gone (the worker now
    belongs to init or a subreaper) ends the worker at once: the signal would never come."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG = 1 (linux/prctl.h)
        except (OSError, AttributeError):
            pass

    def watch() -> None:   # also where prctl is missing, and for a parent gone before the prctl
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=watch, name="gpulab-parent-watch", daemon=True).start()


def _worker(rank: int, world_size: int, port: int, backend: str, experiment, args, results,
            timeout_s: float, parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    os.environ["MASTER_ADDR"] = LOOPBACK
    os.environ["MASTER_PORT"] = str(port)
    # W processes share this machine's cores: one intra-op thread each keeps them from
    # oversubscribing it (results do not depend on the thread count)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    try:
        store = dist.TCPStore(LOOPBACK, port, world_size + 1, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            device = torch.device("cpu")
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    except BaseException as exc:
        results.put(("error", rank, "could not join the process group: " + _describe(exc)))
        return
    try:
        tracker = MemoryTracker()
        with tracker:
            data = experiment(RankContext(rank, world_size, backend, device, tracker), *args) or {}
        result = tracker.result(device=str(device) if device.type == "cuda" else "cpu")
        results.put(("ok", rank, RankResult(rank, result, dict(data), time.perf_counter() - t0)))
    except BaseException as exc:  # report anything, SystemExit included, before tearing down
        results.put(("error", rank, _describe(exc)))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # the group may be broken by the failure being reported
            pass


def _script_hint() -> str:
    """When the caller is a script: the usual reason a spawned worker dies before it reports."""
    main = sys.modules.get("__main__")
    if getattr(main, "__file__", None) and not hasattr(main, "get_ipython"):
        return (f" (a worker imports {os.path.basename(main.__file__)} first: if the run is started at its "
                "top level, put it under `if __name__ == \"__main__\":`)")
    return ""


def _describe(exc: BaseException) -> str:
    """``Type: message (at file:line)``, the line being the innermost frame."""
    frame = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {os.path.basename(frame[0].filename)}:{frame[0].lineno})" if frame else ""
    return f"{type(exc).__name__}: {exc}{where}"
