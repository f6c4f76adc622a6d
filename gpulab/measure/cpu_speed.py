"""This CPU's speeds, measured on the spot: an fp32 matmul's FLOP rate, a large copy's memory
bandwidth and eager PyTorch's cost per op. A step-time prediction for "this CPU"
(``predict.card_speeds.cpu_card_speed``) reads them as a card's peak, bandwidth and launch cost.

Each figure is the best of ``repeats`` timed runs after a warm-up (nanoGPT's ``bench.py`` times
the same way): the best run is the machine's rate with the least interference from other work.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

__all__ = ["CpuSpeed", "measure_cpu_speed", "one_thread"]


@dataclass(frozen=True)
class CpuSpeed:
    """Measured rates of this CPU, with how they were measured."""
    fp32_flops: float      # FLOP/s of an n×n fp32 matmul (2·n³ FLOPs)
    bytes_per_s: float     # bytes read + written per second by a large tensor copy
    op_overhead_s: float   # seconds per tiny eager op (one-element add): dispatch, no work
    threads: int
    how: str

    @property
    def text(self) -> str:
        return (f"fp32 matmul {self.fp32_flops / 1e9:.1f} GFLOP/s, copy {self.bytes_per_s / 1e9:.2f} GB/s, "
                f"{self.op_overhead_s * 1e6:.1f} µs per op, {self.threads} threads ({self.how})")


def _best(fn, repeats: int, clock=time.perf_counter) -> float:
    fn()   # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def measure_cpu_speed(matmul_n: int = 1024, copy_mib: int = 128, tiny_ops: int = 2000,
                      repeats: int = 5, clock=time.perf_counter) -> CpuSpeed:
    """Measure this CPU (about a second): ``matmul_n``² fp32 matmul, a ``copy_mib`` MiB copy,
    ``tiny_ops`` one-element adds; each the best of ``repeats`` by ``clock`` (``time.thread_time``
    with one torch thread: the CPU time this thread got, whatever else the machine runs)."""
    a = torch.randn(matmul_n, matmul_n)
    b = torch.randn(matmul_n, matmul_n)
    t_mm = _best(lambda: torch.mm(a, b), repeats, clock)
    src = torch.ones(copy_mib * 2**20 // 4)
    dst = torch.empty_like(src)
    t_copy = _best(lambda: dst.copy_(src), repeats, clock)
    x = torch.zeros(1)

    def tiny() -> None:
        for _ in range(tiny_ops):
            torch.add(x, x)
    t_tiny = _best(tiny, repeats, clock)
    how = (f"best of {repeats} by {getattr(clock, '__name__', 'clock')}: {matmul_n}x{matmul_n} mm, {copy_mib} MiB copy_ (read + write), "
           f"{tiny_ops} one-element adds")
    return CpuSpeed(2 * matmul_n ** 3 / t_mm, 2 * src.numel() * src.element_size() / t_copy,
                    t_tiny / tiny_ops, torch.get_num_threads(), how)


@contextlib.contextmanager
def one_thread():
    """torch on one thread for the code inside (``time.thread_time`` then counts all its work)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
