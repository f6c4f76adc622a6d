"""Serving's time: the prefill and one decode step, each costed op by op from the same fake run that
measures their memory (``predict.generation``: the prefill is the run's first forward, the decode step
its second, over a cache filled to the context), on a card's speeds (``predict.timing.cost_ops``).

Decoding one token reads every weight and the whole KV cache to do 2 FLOPs a weight a sequence: it is
bandwidth-bound, and ``floor_s`` states that bound, (weights + KV cache bytes) / HBM bandwidth, beside
the op-by-op figure (which adds the activations' traffic, the kernels' launches and any compute-bound op).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpulab.predict.card_speeds import CardSpeed
from gpulab.predict.timing import StepTime, cost_ops

__all__ = ["ServeTime", "serve_time"]


@dataclass
class ServeTime:
    """Predicted prefill and decode times of ``batch`` sequences at a context (one GPU)."""
    card: str
    speed: CardSpeed
    batch: int
    prefill: StepTime          # the whole batch's prompt in one forward
    decode: StepTime           # one decode step of every sequence at the full context
    floor_s: float             # (weights + KV cache bytes) / HBM bandwidth: the bandwidth bound of a decode step
    weights_bytes: int
    kv_bytes: int

    @property
    def label(self) -> str:
        return f"predicted (roofline, {self.card})"

    def mfu(self, t: StepTime) -> float:
        """Forward FLOPs / (time × the peak of the dtype carrying most FLOPs): inference runs no backward."""
        return t.forward_flops / (t.seconds * self.speed.peak_flops(t.mfu_dtype)) if t.seconds and t.mfu_dtype else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.batch / self.decode.seconds if self.decode.seconds else 0.0

    def lines(self) -> list[str]:
        a = self.speed.assumptions
        p, d = self.prefill, self.decode
        return [f"time, {self.label}:",
                f"  prefill: {p.seconds * 1e3:,.1f} ms for {p.items:,} tokens ({p.items_per_s:,.0f} tokens/s, "
                f"MFU {self.mfu(p):.1%} of {p.mfu_dtype} peak (forward FLOPs); compute-bound {p.compute_bound_share:.0%} of op time)",
                f"  decode: {d.seconds * 1e3:,.2f} ms a step, {self.batch} token{'s' if self.batch > 1 else ''} "
                f"({self.decode_tokens_per_s:,.0f} tokens/s; {d.seconds * 1e3:,.2f} ms a token per sequence); "
                f"compute-bound {d.compute_bound_share:.0%} of op time",
                f"  decode floor: (weights {self.weights_bytes:,} B + KV cache {self.kv_bytes:,} B) / HBM "
                f"{self.speed.bandwidth_gbs:,.0f} GB/s = {self.floor_s * 1e3:,.2f} ms (memory efficiency "
                f"{a.memory_efficiency:g}); the op-by-op step adds activations, launches ({d.kernels:,} kernels) "
                f"and compute-bound ops",
                *p.uncounted_lines("prefill: "), *d.uncounted_lines("decode: "),
                f"  assumptions: {a.text} ({a.source})",
                f"  card: {self.speed.source}"]

    def __repr__(self) -> str:
        return "\n".join(self.lines())

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "batch": self.batch, "prefill": self.prefill.as_dict(),
                "decode": self.decode.as_dict(), "prefill_seconds": self.prefill.seconds,
                "decode_step_seconds": self.decode.seconds, "decode_tokens_per_s": self.decode_tokens_per_s,
                "decode_floor_seconds": self.floor_s, "prefill_mfu": self.mfu(self.prefill), "weights_bytes": self.weights_bytes, "kv_bytes": self.kv_bytes,
                "lines": self.lines()}


def serve_time(ops: list, speed: CardSpeed, batch: int, prompt_len: int, weights_bytes: int, kv_bytes: int) -> ServeTime:
    """The timed generation run's ``ops`` (``predict.generation.generation_peak(timer=...)``) costed on ``speed``."""
    prefill = cost_ops([o for o in ops if o.step == 1 and o.phase == "forward"], speed, batch * prompt_len, "tokens")
    decode = cost_ops([o for o in ops if o.step == 2 and o.phase == "forward"], speed, batch, "tokens")
    floor = (weights_bytes + kv_bytes) / (speed.bandwidth_bytes_s * speed.assumptions.memory_efficiency)
    return ServeTime(speed.name, speed, batch, prefill, decode, floor, weights_bytes, kv_bytes)
