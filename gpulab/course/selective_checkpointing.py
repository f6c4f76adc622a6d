"""Lesson 07: Megatron-LM's selective recomputation of a transformer block.

``selective_checkpoint`` (not the op-level selective activation checkpointing of
``models.adapt``'s "selective" policy): a plain-PyTorch ``TransformerBlock`` trained with nothing,
the whole block, only the attention core (scores, softmax, weighted sum: the saved tensors that
grow with seq²) or only the MLP checkpointed; saved activations and step peak under the tracker
against op-by-op formulas (``attention_saved_bytes``, ``block_rest_saved_bytes``), recomputed
FLOPs (formula) and step-time ratios; ``exercise_selective``, the predict-first question.

Checkpointing a deep stack with ``checkpoint_sequential``: ``gpulab.course.checkpointing``.
"""
from __future__ import annotations

import html
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gpulab import formulas as F
from gpulab.record.runs.checkpoint import Timing, cpu_threads
from gpulab.measure.engines import LABEL_FORMULA, RunContext, choose_engine, run
from gpulab.course.inplace import validate_positive
from gpulab.course.timing_spread import ratio
from gpulab.units import format_bytes
from gpulab.views import error_percent, fmt_error, html_table

__all__ = [
    "SELECTIVE_MODES", "SELECTIVE_TEXT", "SelectivePoint", "SelectiveResult", "TransformerBlock",
    "attention_core", "attention_saved_bytes", "block_rest_saved_bytes", "exercise_selective",
    "recompute_flops", "selective_checkpoint", "selective_saved_bytes"
]


# --- selective checkpointing of a transformer block -----------------------------------------------------

SELECTIVE_MODES = ("none", "block", "attention core", "mlp")
SELECTIVE_TEXT = {"none": "no checkpointing", "block": "the whole block",
                  "attention core": "only the attention core (QKᵀ, softmax, ·V)", "mlp": "only the MLP"}


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(Q Kᵀ / √d_head) V on (batch, heads, seq, d_head) tensors: the part of attention
    whose saved tensors grow with seq². The scale is a Python number (its multiply saves
    nothing); softmax saves its output, the probabilities, which the second matmul saves too
    (the same storage)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    probs = torch.softmax((q @ k.transpose(-2, -1)) * scale, dim=-1)
    return probs @ v


class TransformerBlock(nn.Module):
    """A pre-norm transformer block in plain PyTorch:
    x + Attention(LayerNorm(x)), then + MLP(LayerNorm(.)) with MLP = Linear, GELU, Linear.

    ``checkpoint`` chooses what ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``
    wraps: "none", "block" (the whole block), "attention core" (``attention_core`` only) or
    "mlp" (the MLP only)."""

    def __init__(self, width: int = 128, heads: int = 4, mlp_ratio: int = 4, checkpoint: str = "none"):
        super().__init__()
        validate_positive(width=width, heads=heads, mlp_ratio=mlp_ratio)
        if width % heads:
            raise ValueError(f"width {width} must be a multiple of heads {heads}")
        if checkpoint not in SELECTIVE_MODES:
            raise ValueError(f"unknown checkpoint mode {checkpoint!r}; valid: {', '.join(SELECTIVE_MODES)}")
        self.heads, self.checkpoint = heads, checkpoint
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.out = nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, mlp_ratio * width), nn.Linear(mlp_ratio * width, width)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, s, d = t.shape
        # contiguous: the core's matmuls then save these very storages (no hidden copies inside the core)
        return t.view(b, s, self.heads, d // self.heads).transpose(1, 2).contiguous()

    def _attention(self, h: torch.Tensor) -> torch.Tensor:
        b, s, d = h.shape
        q, k, v = self._heads(self.q(h)), self._heads(self.k(h)), self._heads(self.v(h))
        if self.checkpoint == "attention core":
            o = checkpoint(attention_core, q, k, v, use_reentrant=False)
        else:
            o = attention_core(q, k, v)
        return self.out(o.transpose(1, 2).reshape(b, s, d))

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(h)))

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attention(self.ln1(x))
        h = self.ln2(x)
        return x + (checkpoint(self._mlp, h, use_reentrant=False) if self.checkpoint == "mlp" else self._mlp(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint == "block":
            return checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)


def attention_saved_bytes(batch: int, seq: int, heads: int, dtype_bytes: int = 4) -> int:
    """Bytes of the seq² tensors one layer of ``attention_core`` saves for backward:
    the probabilities, b · heads · s² · bytes (softmax saves its output; the ·V matmul saves
    the same storage). The scores Q Kᵀ are not saved: a multiply by a Python number saves
    nothing, and softmax's backward needs only its output.
    NB: an implementation that keeps the scores too (a mask applied with a tensor, softmax in
    fp32 under autocast) saves ×2; dropout on the probabilities adds its mask (1 B per element
    on CUDA) and the dropped probabilities (Korthikanti et al. 2022 count 5·a·s²·b bytes in
    fp16 with dropout). This block has no dropout."""
    validate_positive(batch=batch, seq=seq, heads=heads, dtype_bytes=dtype_bytes)
    return batch * heads * seq * seq * dtype_bytes


def block_rest_saved_bytes(batch: int, seq: int, width: int, mlp_ratio: int = 4, dtype_bytes: int = 4) -> int:
    """Everything else ``TransformerBlock`` saves (∝ b·s·d), counted op by op: LayerNorm 1's
    output (saved by the q, k, v Linears), the head-split q, k, v (3, saved by the matmuls),
    the merged heads (saved by the output Linear), the first residual sum (saved by LayerNorm
    2), LayerNorm 2's output (saved by fc1), fc1's output (saved by GELU, mlp_ratio) and GELU's
    output (saved by fc2, mlp_ratio): (7 + 2·mlp_ratio) · b·s·d values; plus each LayerNorm's
    mean and 1/std, 2 · 2 · b·s float32 values.
    NB: the block's input x is not counted (an input, alive anyway); neither are parameters."""
    validate_positive(batch=batch, seq=seq, width=width, mlp_ratio=mlp_ratio, dtype_bytes=dtype_bytes)
    return (7 + 2 * mlp_ratio) * batch * seq * width * dtype_bytes + 4 * batch * seq * 4


def selective_saved_bytes(mode: str, batch: int, seq: int, width: int, heads: int, mlp_ratio: int = 4,
                          dtype_bytes: int = 4, layers: int = 1) -> int:
    """Formula: activations saved at the end of the forward by ``layers`` blocks in a row, for
    each checkpoint mode. Every block after the first also saves its input (the previous
    block's output, an activation), b·s·d values each, in every mode.
    "block" keeps only each block's input (the first one is the model's input): nothing else. "attention core" drops
    the probabilities (its inputs q, k, v stay saved: checkpoint keeps them, and the plain
    block saves them anyway). "mlp" drops fc1's and GELU's outputs (checkpoint keeps
    LayerNorm 2's output, which the plain block saves too)."""
    validate_positive(layers=layers)
    att = attention_saved_bytes(batch, seq, heads, dtype_bytes)
    rest = block_rest_saved_bytes(batch, seq, width, mlp_ratio, dtype_bytes)
    per_layer = {"none": att + rest, "block": 0, "attention core": rest,
                 "mlp": att + rest - 2 * mlp_ratio * batch * seq * width * dtype_bytes}[mode]
    return layers * per_layer + (layers - 1) * batch * seq * width * dtype_bytes


def recompute_flops(mode: str, batch: int, seq: int, width: int, mlp_ratio: int = 4, layers: int = 1) -> int:
    """Formula: forward FLOPs that backward runs again for each mode (2 per multiply-add), per layer
    times ``layers``.
    Attention core: Q Kᵀ and P V, 2 · 2 · b·s²·d. MLP: 2 · 2 · b·s·d·(mlp_ratio·d). Block: the
    four d×d Linears (4 · 2 · b·s·d²), the MLP and the core.
    NB: softmax, LayerNorm, GELU and the adds are left out (a few FLOPs per element)."""
    core = 2 * 2 * batch * seq * seq * width
    mlp = 2 * F.linear_flops(batch * seq, width, mlp_ratio * width)
    per_layer = {"none": 0, "attention core": core, "mlp": mlp,
                 "block": 4 * F.linear_flops(batch * seq, width, width) + mlp + core}
    if mode not in per_layer:
        raise ValueError(f"unknown mode {mode!r}")
    return layers * per_layer[mode]


@dataclass
class SelectivePoint:
    mode: str
    saved_bytes: int                   # measured: activations alive at the end of the forward
    predicted_saved: int               # formula
    peak_bytes: int                    # measured: the whole step's peak
    peak_by_category: dict[str, int]
    flops: int                         # formula: forward FLOPs recomputed in backward
    timing: Timing | None

    @property
    def error_percent(self) -> float | None:
        return error_percent(self.predicted_saved, self.saved_bytes)


@dataclass
class SelectiveResult:
    batch: int
    seq: int
    width: int
    heads: int
    mlp_ratio: int
    layers: int
    points: list[SelectivePoint]
    label: str
    engine: str
    timing_label: str

    def point(self, mode: str) -> SelectivePoint:
        for p in self.points:
            if p.mode == mode:
                return p
        raise KeyError(mode)

    @property
    def attention_formula(self) -> int:
        """All layers' attention probabilities (formula)."""
        return self.layers * attention_saved_bytes(self.batch, self.seq, self.heads)

    @property
    def attention_measured(self) -> int:
        """Saved bytes that checkpointing only the attention core removes (measured: none − core)."""
        return self.point("none").saved_bytes - self.point("attention core").saved_bytes

    def bytes_saved(self, mode: str) -> int:
        """Measured activations that checkpointing ``mode`` removes, against no checkpointing."""
        return self.point("none").saved_bytes - self.point(mode).saved_bytes

    def bytes_per_flop(self, mode: str) -> float:
        """Measured bytes removed per recomputed FLOP (formula FLOPs)."""
        return self.bytes_saved(mode) / self.point(mode).flops

    @property
    def best_per_flop(self) -> str:
        return max((p.mode for p in self.points if p.mode != "none"), key=self.bytes_per_flop)

    def time_ratio(self, mode: str) -> float | None:
        p, base = self.point(mode), self.point("none")
        if p.timing is None or base.timing is None:
            return None
        return p.timing.min / base.timing.min

    def figure(self):
        from gpulab.plots import LessonFigure
        from gpulab.units import MiB
        fig = LessonFigure(figsize=(7.5, 3.2), dpi=100, layout="constrained")
        ax = fig.add_subplot()
        modes = [p.mode for p in self.points]
        xs = range(len(modes))
        w = 0.27
        ax.bar([x - w for x in xs], [p.predicted_saved / MiB for p in self.points], w, color="#BBBBBB",
               label="saved activations, formula")
        ax.bar(list(xs), [p.saved_bytes / MiB for p in self.points], w, color="#4C72B0",
               label=f"saved activations, {self.label}")
        ax.bar([x + w for x in xs], [p.peak_bytes / MiB for p in self.points], w, color="#DD8452",
               label=f"step peak, {self.label}")
        ax.set_xticks(list(xs), [SELECTIVE_TEXT[m].replace(" (", "\n(") for m in modes], fontsize=7)
        ax.set_ylabel("MiB")
        ax.set_ylim(0, 1.4 * max(p.peak_bytes for p in self.points) / MiB)
        ax.legend(fontsize=7, loc="upper right")
        ax.set_title(f"{self.layers} block(s): b = {self.batch}, s = {self.seq}, d = {self.width}, {self.heads} heads",
                     fontsize=9)
        return fig

    def _repr_html_(self) -> str:
        rows, base = [], self.point("none")
        for p in self.points:
            span = (None if p.mode == "none" or p.timing is None or base.timing is None
                    else ratio(p.timing, base.timing, "range").text())
            rows.append([SELECTIVE_TEXT[p.mode], format_bytes(p.predicted_saved), format_bytes(p.saved_bytes),
                         fmt_error(p.error_percent), format_bytes(p.peak_bytes),
                         "—" if p.mode == "none" else f"{p.flops / 1e6:.1f} M",
                         "—" if p.mode == "none" else f"{self.bytes_per_flop(p.mode):.4f}",
                         "—" if span is None else span])
        err = error_percent(self.attention_formula, self.attention_measured)
        head = (f"{self.layers} transformer block(s) in a row, batch {self.batch}, seq {self.seq}, width {self.width}, {self.heads} heads, "
                f"MLP ×{self.mlp_ratio}. Memory: {html.escape(self.label)}. Time: {html.escape(self.timing_label)}."
                f"<br>Attention probabilities saved, all layers: formula layers·b·heads·s²·4 B = "
                f"{format_bytes(self.attention_formula)}; measured (no checkpointing − attention core "
                f"checkpointed) {format_bytes(self.attention_measured)} (error {fmt_error(err)}). Most bytes "
                f"saved per recomputed FLOP: <b>{html.escape(SELECTIVE_TEXT[self.best_per_flop])}</b>.")
        return head + html_table(
            ["checkpointed", "saved activations (formula)", "saved activations (measured)", "error",
             "step peak (measured)", "recomputed FLOPs (formula)", "bytes saved per recomputed FLOP",
             "step time vs none: fastest runs [span their ranges allow]"], rows,
            "saved activations: alive at the end of the forward; binary units; FLOPs: formula")

    def __repr__(self) -> str:
        return (f"SelectiveResult(seq={self.seq}, saved: " + ", ".join(
            f"{p.mode}={format_bytes(p.saved_bytes)}" for p in self.points) + f", label={self.label!r})")


def _blocks(mode: str, width: int, heads: int, mlp_ratio: int, layers: int) -> nn.Sequential:
    return nn.Sequential(*[TransformerBlock(width, heads, mlp_ratio, mode) for _ in range(layers)])


def _selective_experiment(mode: str, batch: int, seq: int, width: int, heads: int, mlp_ratio: int, layers: int):
    def experiment(ctx: RunContext) -> None:
        with ctx.phase("setup"), torch.device(ctx.device):
            torch.manual_seed(0)
            block = _blocks(mode, width, heads, mlp_ratio, layers)
            ctx.tracker.register(block)
            x = ctx.label(torch.randn(batch, seq, width))
        with ctx.phase("forward"):
            out = block(x)
            loss = out.sum()
        del out
        ctx.snapshot("end of forward")
        with ctx.phase("backward"):
            loss.backward()
        return None
    return experiment


def selective_checkpoint(batch: int = 4, seq: int = 128, width: int = 128, heads: int = 4, mlp_ratio: int = 4,
                         layers: int = 4, engine: str = "auto", time_steps: bool = True, repeats: int = 5,
                         threads: int | None = 1) -> SelectiveResult:
    """One training step of ``layers`` ``TransformerBlock``s in a row for each mode in ``SELECTIVE_MODES``: the
    activations alive at the end of the forward and the step's peak (under the tracker, on
    ``engine``), the formulas, and (cpu/cuda) the step time without the tracker, round robin
    over the modes after a warm-up; ratios compare the fastest runs."""
    validate_positive(batch=batch, seq=seq, width=width, heads=heads, mlp_ratio=mlp_ratio, layers=layers,
                      repeats=repeats)
    predicted = selective_saved_bytes("none", batch, seq, width, heads, mlp_ratio, layers=layers) + 4 * F.tensor_bytes(
        (batch, seq, mlp_ratio * width))
    choice = choose_engine(engine, predicted_bytes=predicted,
                           predicted_flops=3 * recompute_flops("block", batch, seq, width, mlp_ratio, layers))
    measurements = {}
    with cpu_threads(threads if choice.name == "cpu" else None):
        for mode in SELECTIVE_MODES:
            m = run(_selective_experiment(mode, batch, seq, width, heads, mlp_ratio, layers), choice.name)
            if m.oom:
                raise MemoryError(m.error)
            measurements[mode] = m
        timings: dict[str, Timing | None] = {m: None for m in SELECTIVE_MODES}
        if time_steps and choice.name != "fake":
            timings = _time_selective(batch, seq, width, heads, mlp_ratio, layers, repeats,
                                      torch.device("cuda") if choice.name == "cuda" else torch.device("cpu"))
    if choice.name == "fake":
        timing_label = "not timed: fake tensors do no compute"
    elif not time_steps:
        timing_label = "not timed"
    else:
        where = (torch.cuda.get_device_name() if choice.name == "cuda" else
                 f"this CPU, {threads or torch.get_num_threads()} thread(s)")
        timing_label = (f"timed on {where} (untracked; 1 warm-up step per mode, then {repeats} rounds over every "
                        f"mode in turn; shared CPUs are noisy, and a GPU's balance of compute and overhead differs)")
    points = []
    for mode, m in measurements.items():
        end = next(s for s in m.snapshots if s.name == "end of forward")
        points.append(SelectivePoint(mode, end.by_category.get("activations", 0),
                                     selective_saved_bytes(mode, batch, seq, width, heads, mlp_ratio,
                                                           layers=layers),
                                     m.peak_bytes, m.peak_by_category,
                                     recompute_flops(mode, batch, seq, width, mlp_ratio, layers), timings[mode]))
    return SelectiveResult(batch, seq, width, heads, mlp_ratio, layers, points, measurements["none"].label, choice.name,
                           timing_label)


def _time_selective(batch, seq, width, heads, mlp_ratio, layers, repeats, device) -> dict[str, Timing]:
    torch.manual_seed(0)
    with torch.device(device):
        blocks = {m: _blocks(m, width, heads, mlp_ratio, layers) for m in SELECTIVE_MODES}
        x = torch.randn(batch, seq, width)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def step(mode: str) -> float:
        blk = blocks[mode]
        blk.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        blk(x).sum().backward()
        sync()
        return time.perf_counter() - t0

    for mode in SELECTIVE_MODES:
        step(mode)
    samples: dict[str, list[float]] = {m: [] for m in SELECTIVE_MODES}
    for _ in range(repeats):
        for mode in SELECTIVE_MODES:
            samples[mode].append(step(mode))
    where = str(device) if device.type != "cpu" else "this CPU"
    return {m: Timing(v, 1, where) for m, v in samples.items()}


def exercise_selective(result: SelectiveResult | Callable[[], SelectiveResult] | None = None):
    """Predict-first (qualitative): which part of a transformer block to checkpoint for the most
    activation bytes saved per recomputed FLOP. The answer is computed from a measurement
    (``selective_checkpoint``: bytes measured, FLOPs from the formula)."""
    from gpulab.course.exercises import ChoiceExercise
    cache: dict[str, SelectiveResult] = {}

    def res() -> SelectiveResult:
        if "r" not in cache:
            r = result() if callable(result) else result
            cache["r"] = r if r is not None else selective_checkpoint(time_steps=False)
        return cache["r"]

    keys = {"a": "block", "b": "attention core", "c": "mlp"}

    def expected() -> str:
        best = res().best_per_flop
        return next(k for k, m in keys.items() if m == best)

    def explain() -> str:
        r = res()
        parts = "; ".join(f"{SELECTIVE_TEXT[m]}: {format_bytes(r.bytes_saved(m))} for {r.point(m).flops / 1e6:.0f} M "
                          f"FLOPs = {r.bytes_per_flop(m):.4f} B/FLOP" for m in keys.values())
        return (f"Measured ({r.label}; FLOPs: {LABEL_FORMULA}) on {r.layers} block(s) at b = {r.batch}, s = {r.seq}, d = {r.width}, "
                f"{r.heads} heads: {parts}. The attention core saves b·heads·s² probabilities for 4·b·s²·d FLOPs: "
                f"heads/d bytes per FLOP, whatever s is, and its share of the memory grows with s². The MLP saves "
                f"2·4·b·s·d values for 16·b·s·d² FLOPs (2/d per FLOP); the whole block saves the most bytes but "
                f"recomputes every matmul. This is why Megatron-LM's selective recomputation (Korthikanti et al. "
                f"2022) recomputes only the attention core.")

    return ChoiceExercise(
        question=("A transformer block: LayerNorm → attention (q, k, v Linears, softmax(QKᵀ/√d)·V, output Linear) → "
                  "residual → LayerNorm → MLP (Linear d→4d, GELU, Linear 4d→d) → residual. You can wrap one part in "
                  "checkpoint(..., use_reentrant=False). Which choice removes the most saved activation bytes per "
                  "FLOP that backward has to recompute?"),
        options={"a": "the whole block", "b": "only the attention core (QKᵀ, softmax, ·V)",
                 "c": "only the MLP"},
        expected=expected, explain=explain)
