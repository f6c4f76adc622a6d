"""Benchmark: how long gpulab's any-model answers take on this machine (issue #12's targets).

* ``gpulab.step(name, batch=64, engine="fake")`` for every torchvision classification model
  (target: under 5 s each);
* ``gpulab.fit("hf:llama-3-8b", "80GiB", dtype="bf16", optimizer="adamw", seq_len=2048)``
  in a fresh process, the way the command runs (target: under 30 s, start-up included).

Run: ``python benchmarks/any_model_speed.py [--models N]``. Prints one line per measurement
and the ratios to the targets; nothing is asserted (a benchmark, not a test).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=int, default=0, help="only the first N torchvision models (0: all)")
    ap.add_argument("--skip-fit", action="store_true")
    args = ap.parse_args()
    if not args.skip_fit:
        cmd = [sys.executable, "-m", "gpulab", "fit", "hf:llama-3-8b", "--gpu", "80GiB", "--dtype", "bf16",
               "--optimizer", "adamw", "--seq-len", "2048", "--json"]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        wall = time.perf_counter() - t0
        print(f"gpulab fit hf:llama-3-8b --gpu 80GiB --dtype bf16 --optimizer adamw --seq-len 2048: "
              f"{wall:.1f} s (target 30 s: ratio {wall / 30:.2f}); exit {out.returncode}", flush=True)
    import gpulab
    from gpulab.models import torchvision_names
    names = list(torchvision_names())[: args.models or None]
    worst, slow = 0.0, []
    for name in names:
        t0 = time.perf_counter()
        r = gpulab.step(name, batch=64, engine="fake")
        dt = time.perf_counter() - t0
        worst = max(worst, dt)
        if dt > 5:
            slow.append(name)
        print(f"step {name:<22} batch 64 fake: {dt:5.2f} s, peak {r.peak_bytes / 2**30:6.2f} GiB", flush=True)
    print(f"{len(names)} torchvision models: slowest {worst:.2f} s (target 5 s: ratio {worst / 5:.2f}); "
          f"over 5 s: {', '.join(slow) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
