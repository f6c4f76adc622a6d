"""Core benchmarks (numbers to watch, not timed tests).

    .venv/bin/python benchmarks/bench_core.py [--repeats N]

(a) the fake engine's VGG16 training step at batch 64 (momentum): target well under 1 s;
(b) the tracker's overhead on a small CNN training step on the CPU engine, against the
    same step written directly with torch and no tracker: target <= 1.3x;
(c) the CLI's wall time for ``gpulab step vgg16 --engine fake --batch 64 --optimizer
    momentum --json`` as a subprocess (torch + torchvision imports included).

Every timing is warmed up once and reported as the median of the repeats. The machine
load matters (2 shared cores): compare figures taken on the same machine, same load. (b) runs
torch on one thread by default (``--threads``) and reports process CPU time next to wall
time: on a loaded machine two intra-op threads fight the other processes and wall-time
ratios swing both ways, while CPU time stays put. It also reports the floor any
TorchDispatchMode costs (a mode that only calls the op), to show what is the tracker's own.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from gpulab.measure.engines import run
from gpulab.training.loop import step_experiment
from gpulab.predict.step import step as tracked_step
from gpulab.models.registry import small_cnn
from gpulab.measure.tracking import MemoryTracker


def median_time(fn, repeats: int, warmup: int = 1) -> tuple[float, list[float]]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


class _NullMode(TorchDispatchMode):
    """The cheapest possible dispatch mode: the floor under any TorchDispatchMode tracker."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


# --- (a) fake VGG16 step -------------------------------------------------------------------

def bench_fake_vgg16(repeats: int) -> dict:
    med, times = median_time(
        lambda: tracked_step("vgg16", batch=64, optimizer="momentum", engine="fake", steps=1, guard=False), repeats)
    return {"fake_vgg16_b64_step_s": med, "times": times}


# --- (b) tracker overhead ---------------------------------------------------------------------

BATCH, SIZE = 32, 32  # the cnn lesson defaults (models.MODELS["cnn"])


def plain_cnn_step() -> None:
    """One training step of the small CNN written directly with torch: no gpulab, no tracker."""
    net = small_cnn(10, SIZE)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn(BATCH, 3, SIZE, SIZE)
    y = torch.randint(0, 10, (BATCH,))
    loss = nn.functional.cross_entropy(net(x), y)
    loss.backward()
    del loss
    opt.step()


def null_mode_step() -> None:
    with _NullMode():
        plain_cnn_step()


def tracked_plain_step() -> None:
    """The same function under a bare MemoryTracker (the tracker's own cost only)."""
    with MemoryTracker() as tr:
        plain_cnn_step()
    tr.result()


_CNN_EXPERIMENT = step_experiment("cnn", BATCH, SIZE, "sgd", torch.float32, 1)


def engine_cnn_step() -> None:
    """The same step through the cpu engine (tracker, phases, labels, snapshot, result)."""
    run(_CNN_EXPERIMENT, engine="cpu")


def bench_tracker_overhead(repeats: int) -> dict:
    # interleave the variants so a change in machine load hits all of them alike
    fns = {"plain": plain_cnn_step, "null_mode": null_mode_step, "tracker": tracked_plain_step,
           "engine": engine_cnn_step}
    for fn in fns.values():
        fn()
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            cpu[k].append(time.process_time() - c0)
            wall[k].append(time.perf_counter() - t0)
    out = {}
    for label, times in (("wall", wall), ("cpu", cpu)):
        med = {k: statistics.median(v) for k, v in times.items()}
        for k, v in med.items():
            out[f"{label}_{k}_s"] = v
            out[f"{label}_{k}_ratio"] = v / med["plain"]
    return out


# --- (c) CLI ----------------------------------------------------------------------------------

CLI = [sys.executable, "-m", "gpulab", "step", "vgg16", "--engine", "fake", "--batch", "64",
       "--optimizer", "momentum", "--json"]


def bench_cli(repeats: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def once() -> None:
        out = subprocess.run(CLI, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
        json.loads(out.stdout)

    def floor(code: str):
        return lambda: subprocess.run([sys.executable, "-c", code], check=True)

    med, times = median_time(once, repeats)
    imp, _ = median_time(floor("import torch"), repeats)
    imp_tv, _ = median_time(floor("import torch, torchvision"), repeats)
    return {"cli_step_vgg16_s": med, "times": times, "python_import_torch_s": imp,
            "python_import_torch_torchvision_s": imp_tv}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", choices=["fake", "tracker", "cli"], default=None)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads for (b); 0 keeps torch's default")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, load average {os.getloadavg()[0]:.2f}")
    if args.only in (None, "fake"):
        a = bench_fake_vgg16(args.repeats)
        print(f"(a) fake VGG16 step, batch 64, momentum: median {a['fake_vgg16_b64_step_s']:.3f} s "
              f"(target well under 1 s)")
    if args.only in (None, "tracker"):
        if args.threads:
            torch.set_num_threads(args.threads)
        b = bench_tracker_overhead(max(args.repeats, 15))
        print(f"(b) cnn step (batch {BATCH}, sgd) on the cpu, {torch.get_num_threads()} thread(s), "
              f"median; ratio to plain torch (target for the tracker <= 1.3x):")
        names = {"plain": "plain torch", "null_mode": "no-op TorchDispatchMode (floor)",
                 "tracker": "under MemoryTracker", "engine": "run(step_experiment, engine='cpu')"}
        for k, name in names.items():
            print(f"    {name:<36} wall {b[f'wall_{k}_s'] * 1e3:7.1f} ms ({b[f'wall_{k}_ratio']:.2f}x)"
                  f"   cpu {b[f'cpu_{k}_s'] * 1e3:7.1f} ms ({b[f'cpu_{k}_ratio']:.2f}x)")
    if args.only in (None, "cli"):
        c = bench_cli(args.repeats)
        print(f"(c) CLI `gpulab step vgg16 --engine fake --batch 64 --optimizer momentum --json`: "
              f"median {c['cli_step_vgg16_s']:.2f} s; the floor it cannot go under, "
              f"python -c 'import torch': {c['python_import_torch_s']:.2f} s, "
              f"'import torch, torchvision': {c['python_import_torch_torchvision_s']:.2f} s")


if __name__ == "__main__":
    main()
