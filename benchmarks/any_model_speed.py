"""Benchmark: how long gpulab's any-model answers take on this machine (issue #12's targets).

* ``gpulab.step(name, batch=64, engine="fake")`` for every torchvision classification model
  (target: under 5 s each);
* ``gpulab.fit("hf:llama-3-8b", "80GiB", dtype="bf16", optimizer="adamw", seq_len=2048)``
  in a fresh process, the way the command runs (target: under 30 s, start-up included).

Run: ``python benchmarks/any_model_speed.py [--models N] [--skip-fit] [--only NAME ...]``. Prints
one line per measurement, with wall time and the process's CPU time (the machine may be shared:
CPU time is what the work itself costs), and the ratios to the targets; nothing is asserted (a
benchmark, not a test).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time


def _children_cpu() -> float:
    """CPU seconds (user + system) used by this process's finished child processes."""
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=int, default=0, help="only the first N torchvision models (0: all)")
    ap.add_argument("--skip-fit", action="store_true")
    ap.add_argument("--only", nargs="*", default=[], help="only these torchvision models")
    args = ap.parse_args()
    if not args.skip_fit:
        cmd = [sys.executable, "-m", "gpulab", "fit", "hf:llama-3-8b", "--gpu", "80GiB", "--dtype", "bf16",
               "--optimizer", "adamw", "--seq-len", "2048", "--json"]
        t0, c0 = time.perf_counter(), _children_cpu()
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        wall, cpu = time.perf_counter() - t0, _children_cpu() - c0
        print(f"gpulab fit hf:llama-3-8b --gpu 80GiB --dtype bf16 --optimizer adamw --seq-len 2048: "
              f"{wall:.1f} s wall, {cpu:.1f} s CPU (target 30 s: ratio {wall / 30:.2f} wall, {cpu / 30:.2f} CPU); "
              f"exit {out.returncode}", flush=True)
    import gpulab
    from gpulab.models.registry import torchvision_names
    names = list(torchvision_names())[: args.models or None]
    if args.only:
        names = [n for n in names if n in args.only]
    # Wall time is what a student waits; process CPU time (time.process_time: this process's
    # user + system time) is what the work costs, and stays put when other programs share the
    # machine's cores, so both are shown, and both are held to the target.
    rows = []
    for name in names:
        t0, c0 = time.perf_counter(), time.process_time()
        r = gpulab.step(name, batch=64, engine="fake")
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        rows.append((name, wall, cpu))
        print(f"step {name:<22} batch 64 fake: {wall:5.2f} s wall, {cpu:5.2f} s CPU, "
              f"peak {r.peak_bytes / 2**30:6.2f} GiB", flush=True)
    for label, col in (("wall", 1), ("CPU", 2)):
        worst = max(rows, key=lambda r: r[col])
        slow = [f"{r[0]} ({r[col]:.1f} s)" for r in sorted(rows, key=lambda r: -r[col]) if r[col] > 5]
        print(f"{len(rows)} torchvision models, {label} time: slowest {worst[0]} {worst[col]:.2f} s "
              f"(target 5 s: ratio {worst[col] / 5:.2f}); over 5 s: {len(slow)}{': ' + ', '.join(slow) if slow else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
