"""How fast the ``gpulab`` command answers before it has anything to compute (issue #34, item 2).

    python benchmarks/cli_startup.py [--repeats N]

Each command runs as a fresh process, round robin, N times (default 5); the table shows the
median wall time and its ratio to the import floor, ``python -c "import torch, transformers"``
(what any command that computes pays first). ``--help``, a bad option and a bad ``--gpu`` are
answered before torch is imported, so they cost a bare interpreter plus gpulab's parser; the
design's bar is half a second. A benchmark, not a test: it prints, it asserts nothing (the test,
``tests/test_cli_startup.py``, checks that torch is not imported, not the clock).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def commands() -> dict[str, list[str]]:
    """What is timed: the floors, then the command's quick answers (the console script when it is
    installed beside this interpreter, else ``python -m gpulab``)."""
    script = pathlib.Path(sys.executable).with_name("gpulab")
    gl = [str(script)] if script.exists() else ([shutil.which("gpulab")] if shutil.which("gpulab") else
                                                 [sys.executable, "-m", "gpulab"])
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "import torch, transformers (floor)": [sys.executable, "-c", "import torch, transformers"],
        "gpulab --help": [*gl, "--help"],
        "gpulab fit --help": [*gl, "fit", "--help"],
        "gpulab fit mlp --gpu T4 --bogus": [*gl, "fit", "mlp", "--gpu", "T4", "--bogus"],
        "gpulab fit mlp --gpu H1000": [*gl, "fit", "mlp", "--gpu", "H1000"],
        "gpulab fit mlp --gpu T4 --dtype fp17": [*gl, "fit", "mlp", "--gpu", "T4", "--dtype", "fp17"],
    }


def _time(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, check=False)
    return time.perf_counter() - t0


def measure(repeats: int) -> dict[str, float]:
    """Median seconds of each command, run round robin so a busy moment falls on all of them."""
    cmds = commands()
    for argv in cmds.values():   # warm the file cache once, untimed
        _time(argv)
    times: dict[str, list[float]] = {k: [] for k in cmds}
    for _ in range(repeats):
        for name, argv in cmds.items():
            times[name].append(_time(argv))
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    medians = measure(p.parse_args().repeats)
    floor = medians["import torch, transformers (floor)"]
    print(f"{'command':<40}{'median s':>10}{'/ floor':>10}")
    for name, s in medians.items():
        print(f"{name:<40}{s:>10.2f}{s / floor:>10.3f}")
    print(f"(floor = {floor:.2f} s; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
