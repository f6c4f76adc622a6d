"""The time side of a training step (issue 46, item 6), for lessons 04 and 07: each figure predicted
by the time model (``predict.timing``: a roofline per op of the fake run) and measured on this CPU.

* ``batch_throughput`` (lesson 04): samples a second against the batch, measured on this CPU and
  predicted for this CPU and for a named card; saturation read off the roofline (the step's
  arithmetic intensity, FLOPs per byte moved, against the machine's ridge point: peak FLOP/s over
  bytes a second, Williams, Waterman, Patterson, CACM 2009).
* ``recompute_time`` (lesson 07): the lesson's Linear+ReLU stack under ``checkpoint_sequential`` at a
  few segment counts: the recomputed forward's FLOPs and time as the time model counts them, and the
  measured steps with their spread. A conclusion is drawn only where the measured intervals do not
  overlap.

**How this CPU is timed.** On one torch thread, by ``time.thread_time`` (the CPU time this thread
got: on a shared machine another process's work delays a step without counting in it), after a
warm-up step; each recipe ``repeats`` times, kept as samples (``record.runs.checkpoint.Timing``):
the fastest is the figure, [fastest, slowest] the spread. This CPU as a "card" is measured the same
way (``measure.cpu_speed``: its fp32 matmul rate, copy bandwidth and per-op cost), so the prediction
for this CPU has no efficiency factor of its own.

**One fake run, two machines.** Each recipe is run once on the fake engine following this CPU's
kernels with the optimizer's foreach kernels (what CUDA picks by default, so both machines run the
same ops), and its ops are costed twice: on this CPU's measured rates and on the card's datasheet
(``predict.card_speeds``). NB: the card's own kernels differ in a few places (cuDNN's convolution
algorithms, fused attention): the card's figure is the time model's for these ops, labelled so.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from gpulab.course.exercises import ChoiceExercise
from gpulab.course.timing_spread import Ratio, ratio, spread
from gpulab.measure.cpu_speed import measure_cpu_speed, one_thread
from gpulab.measure.engines import run
from gpulab.models.workload import Workload, forward, resolve_workload
from gpulab.predict.card_speeds import CardSpeed, cpu_card_speed, speed_of
from gpulab.predict.timing import StepTime, step_time_of, timed_experiment
from gpulab.record.runs.checkpoint import Timing
from gpulab.tables import html_table
from gpulab.training.loop import train_experiment, user_recipe
from gpulab.units import format_bytes

__all__ = ["BatchThroughput", "RecomputeTime", "batch_throughput", "cpu_as_card", "exercise_batch_speedup",
           "exercise_recompute", "one_thread", "recompute_time", "ridge", "timed_cpu_steps"]

MEASURED = "measured on this CPU (one thread, thread CPU time)"




def cpu_as_card() -> CardSpeed:
    """This CPU measured as a card (about half a second): one thread, by its thread's CPU time."""
    with one_thread():
        return cpu_card_speed(measure_cpu_speed(matmul_n=512, copy_mib=32, tiny_ops=500, repeats=3,
                                                clock=time.thread_time))


def ridge(speed: CardSpeed, dtype: str = "fp32") -> float:
    """The roofline's ridge point: FLOPs per byte at which an op's compute time equals its memory
    time, (peak × compute efficiency) / (bandwidth × memory efficiency). Below it an op waits on memory."""
    a = speed.assumptions
    return speed.peak_flops(dtype) * a.compute_efficiency / (speed.bandwidth_bytes_s * a.memory_efficiency)


def _efficiencies(speed: CardSpeed) -> str:
    """"75% and 100%": the compute and memory efficiencies the time model assumes for ``speed``."""
    a = speed.assumptions
    return f"{a.compute_efficiency:.0%} and {a.memory_efficiency:.0%}"


def intensity(t: StepTime) -> float:
    """A step's arithmetic intensity: its FLOPs over the bytes its ops read and write."""
    moved = sum(o.nbytes for o in t.by_op.values())
    return t.flops / moved if moved else 0.0


def _predicted(w: Workload, batch: int, recipe, speeds: list[CardSpeed]) -> tuple[list[StepTime], int]:
    """One timed two-step fake run (this CPU's kernels), its last step costed on each of ``speeds``;
    and the run's peak bytes."""
    box: list = []
    m = run(timed_experiment(train_experiment(w, [batch, batch], torch.float32, recipe), box), "fake",
            fake_target="cpu")
    if m.tracking is None:
        raise RuntimeError(f"the timed fake run failed: {m.error}")
    per = w.seq_len if w.kind == "tokens" and w.seq_len else 1
    unit = "tokens" if per > 1 else "samples"
    return [step_time_of(box[0].ops, s, batch * per, unit) for s in speeds], m.peak_bytes


def timed_cpu_steps(w: Workload, batch: int, *, repeats: int = 3, warmup: int = 1) -> Timing:
    """Real training steps of ``w`` on this CPU (forward, loss, backward, Adam's foreach step,
    ``zero_grad``), no tracker, one thread, timed by ``time.thread_time`` after ``warmup`` steps."""
    torch.manual_seed(0)
    with one_thread():
        net = w.build("cpu", torch.float32)
        net.train()
        opt = torch.optim.Adam(net.parameters(), foreach=True)
        data = w.inputs(batch, torch.float32)
        samples = []
        for i in range(warmup + repeats):
            t0 = time.thread_time()
            w.loss(forward(net, data), data).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= warmup:
                samples.append(time.thread_time() - t0)
    return Timing(samples, warmup, "this CPU")


def _spread(t: Timing) -> str:
    return spread(t, "range")


# --- lesson 04: does a bigger batch run faster? -------------------------------------------------------

@dataclass
class BatchPoint:
    batch: int
    measured: Timing        # seconds a step on this CPU
    on_cpu: StepTime        # predicted for this CPU
    on_card: StepTime       # predicted for the card
    peak_bytes: int         # the fake run's peak (this CPU's kernels)

    def measured_per_s(self) -> tuple[float, float]:
        """(samples a second at the fastest step, at the slowest)."""
        return self.batch / self.measured.min, self.batch / max(self.measured.samples)


@dataclass
class BatchThroughput:
    """Throughput against batch (``batch_throughput``): data, with a table (``_repr_html_``), a
    figure and the sentences that answer the articles' three time beliefs."""
    model: str
    card: str
    cpu: CardSpeed
    card_speed: CardSpeed
    points: list[BatchPoint] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def unit(self) -> str:
        return self.points[0].on_cpu.unit

    def gain(self, which: str) -> float:
        """Throughput at the largest batch over throughput at the smallest: "measured", "cpu" or "card"."""
        first, last = self.points[0], self.points[-1]
        if which == "measured":
            return last.measured_per_s()[0] / first.measured_per_s()[0]
        attr = "on_cpu" if which == "cpu" else "on_card"
        return getattr(last, attr).items_per_s / getattr(first, attr).items_per_s

    def measured_gain(self, i: int = 0, j: int = -1) -> Ratio:
        """Measured throughput at point ``j`` over point ``i``: the fastest steps' figure and the span the
        [fastest, slowest] steps allow (``timing_spread.ratio``); within noise when the span holds ×1."""
        a, b = self.points[i], self.points[j]
        return ratio(a.measured, b.measured, "range", scale=b.batch / a.batch)

    @property
    def batch_ratio(self) -> float:
        return self.points[-1].batch / self.points[0].batch

    @property
    def memory_ratio(self) -> float:
        return self.points[-1].peak_bytes / self.points[0].peak_bytes

    def intensities(self) -> list[float]:
        return [intensity(p.on_card) for p in self.points]

    def saturated_on(self, which: str) -> bool:
        """Whether the last doubling of the batch (or the last step between batches) gains less than a
        third of its batch ratio in throughput there: the machine is saturated."""
        a, b = self.points[-2], self.points[-1]
        ratio = b.batch / a.batch
        if which == "measured":
            g = b.measured_per_s()[0] / a.measured_per_s()[0]
        else:
            attr = "on_cpu" if which == "cpu" else "on_card"
            g = getattr(b, attr).items_per_s / getattr(a, attr).items_per_s
        return g - 1 < (ratio - 1) / 3

    def rows(self) -> list[list[Any]]:
        out = []
        for p in self.points:
            fast, slow = p.measured_per_s()
            out.append([p.batch, format_bytes(p.peak_bytes), _spread(p.measured), f"{fast:,.0f} [{slow:,.0f}–{fast:,.0f}]",
                        f"{p.on_cpu.items_per_s:,.0f}", f"{p.on_card.items_per_s:,.0f}",
                        f"{intensity(p.on_card):.1f}", f"{p.on_card.compute_bound_share:.0%}"])
        return out

    def _repr_html_(self) -> str:
        head = [f"batch", "peak memory (fake run)", "step time, measured: fastest [fastest–slowest]",
                f"throughput measured ({self.unit}/s)", f"throughput predicted, this CPU",
                f"throughput predicted, {self.card}", "FLOPs per byte", f"compute-bound share on {self.card}"]
        note = (f"{self.model}, Adam (foreach). Measured: {MEASURED}, {len(self.points[0].measured.samples)} steps "
                f"after a warm-up. Predicted: {self.points[0].on_cpu.label} from this CPU's rates ({self.cpu.source}); "
                f"{self.points[0].on_card.label} from its datasheet, the same ops. Ridge point (peak FLOP/s × "
                f"compute efficiency ÷ (bandwidth × memory efficiency), the efficiencies the time model assumes: "
                f"{_efficiencies(self.cpu)} for this CPU, {_efficiencies(self.card_speed)} for the {self.card}): "
                f"this CPU {ridge(self.cpu):.1f}, {self.card} {ridge(self.card_speed):.1f} FLOPs per byte.")
        return html_table(head, self.rows(), note)

    def __repr__(self) -> str:
        return "\n".join(self.sentences())

    def sentences(self) -> list[str]:
        """The answers to the three beliefs, each from this run's numbers; a measured change is stated
        with the span its steps' spread allows, and a direction only where that span excludes ×1
        (``timing_spread.NO_CONCLUSION`` otherwise)."""
        b0, b1 = self.points[0].batch, self.points[-1].batch
        g, last = self.measured_gain(), self.measured_gain(-2, -1)
        if g.within_noise:
            whole = f"throughput changed {g.text(1)}"
        else:
            pace = ("short of proportional" if g.high < self.batch_ratio else
                    "proportional within the spread" if g.low <= self.batch_ratio else "more than proportional")
            whole = f"throughput {'grew' if g.low > 1 else 'fell'} {g.text(1)}, {pace},"
        step = (f"changed throughput {last.text(2)}" if last.within_noise else
                f"{'gained' if last.low > 1 else 'lost'} {last.text(2)} in throughput")
        return [
            f"A bigger batch runs proportionally faster? From batch {b0} to {b1} (×{self.batch_ratio:g}), "
            f"{whole} measured on this CPU (fastest steps; in brackets, what the slowest allow; predicted "
            f"×{self.gain('cpu'):.1f}), and ×{self.gain('card'):.1f} predicted on the {self.card}.",
            f"More memory used means faster? The peak grew ×{self.memory_ratio:.1f} over the same batches, while the "
            f"last step from batch {self.points[-2].batch} to {b1} {step} on this CPU.",
            f"Memory used is GPU use? Memory counts the bytes held; speed is set by the ops: with "
            f"{self.intensities()[-1]:.1f} FLOPs per byte moved at batch {b1}, the step sits "
            f"{'below' if self.intensities()[-1] < ridge(self.card_speed) else 'above'} the {self.card}'s ridge point "
            f"({ridge(self.card_speed):.1f}): {'its memory bandwidth' if self.intensities()[-1] < ridge(self.card_speed) else 'its compute'} "
            f"sets the pace, whatever the memory held.",
        ]

    def figure(self):
        """Left: throughput against batch, relative to the smallest batch, measured (bars: the spread)
        and predicted, with the proportional line. Right: peak memory against batch, relative."""
        from gpulab.plots import LessonFigure
        fig = LessonFigure(figsize=(8, 3.2), dpi=100, layout="constrained")
        ax, mx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
        bs = [p.batch for p in self.points]
        base = self.points[0].measured_per_s()[0]
        fast = [p.measured_per_s()[0] / base for p in self.points]
        slow = [p.measured_per_s()[1] / base for p in self.points]
        ax.errorbar(bs, fast, yerr=[[f - s for f, s in zip(fast, slow)], [0] * len(bs)], fmt="o-", color="#4C72B0",
                    capsize=3, label="measured, this CPU (bar: slowest step)")
        for attr, color, name in (("on_cpu", "#55A868", "predicted, this CPU"),
                                  ("on_card", "#DD8452", f"predicted, {self.card}")):
            y0 = getattr(self.points[0], attr).items_per_s
            ax.plot(bs, [getattr(p, attr).items_per_s / y0 for p in self.points], "s--", color=color, label=name)
        ax.plot(bs, [b / bs[0] for b in bs], ":", color="#888888", label="proportional to the batch")
        for a in (ax, mx):
            a.set_xscale("log", base=2)
            a.set_yscale("log", base=2)
            a.set_xlabel("batch")
        ax.set_ylabel(f"{self.unit}/s, relative to batch {bs[0]}")
        ax.legend(fontsize=7)
        mx.plot(bs, [p.peak_bytes / self.points[0].peak_bytes for p in self.points], "o-", color="#C44E52",
                label="peak memory (fake run)")
        mx.plot(bs, fast, "o-", color="#4C72B0", label="throughput, measured")
        mx.set_ylabel(f"relative to batch {bs[0]}")
        mx.legend(fontsize=7)
        fig.suptitle(f"{self.model}: {MEASURED}; predicted (roofline)", fontsize=9)
        return fig


def batch_throughput(model: Any = "cnn", batches: tuple[int, ...] = (1, 4, 16, 64), *, card: str = "H100",
                     repeats: int = 3) -> BatchThroughput:
    """Throughput against batch for ``model`` with Adam (foreach): measured on this CPU (``repeats`` steps
    after a warm-up at each batch) and predicted for this CPU and for ``card`` (module docstring)."""
    if len(batches) < 2 or list(batches) != sorted(set(batches)) or batches[0] < 1:
        raise ValueError(f"batches must be two or more increasing whole numbers from 1, got {batches!r}")
    t0 = time.perf_counter()
    w = resolve_workload(model)
    cpu, card_speed = cpu_as_card(), speed_of(card)
    recipe = user_recipe("adam", None, implementation="foreach")
    points = []
    for b in batches:
        (on_cpu, on_card), peak = _predicted(w, b, recipe, [cpu, card_speed])
        points.append(BatchPoint(b, timed_cpu_steps(w, b, repeats=repeats), on_cpu, on_card, peak))
    return BatchThroughput(w.name, card_speed.name, cpu, card_speed, points, time.perf_counter() - t0)


def exercise_batch_speedup(result: BatchThroughput) -> ChoiceExercise:
    """Predict first: from the smallest batch to the largest, how does throughput grow on this CPU?
    The answer is read off the measurement (``result``) when the checker runs."""
    b0, b1 = result.points[0].batch, result.points[-1].batch
    options = {"a": f"about ×{result.batch_ratio:g}: proportionally to the batch",
               "b": "more than ×1.5 but well short of proportional: it saturates",
               "c": "hardly at all (under ×1.5)"}

    def expected() -> str:
        g = result.gain("measured")
        return "a" if g >= 0.8 * result.batch_ratio else ("b" if g >= 1.5 else "c")

    def explain() -> str:
        return " ".join(result.sentences()[:1])
    return ChoiceExercise(f"From batch {b0} to batch {b1} (×{result.batch_ratio:g} the samples a step), the "
                          f"samples a second this CPU trains grow:", options, expected, explain)


# --- lesson 07: checkpointing's recompute, predicted and measured ----------------------------------------

@dataclass
class RecomputePoint:
    segments: int
    on_cpu: StepTime
    on_card: StepTime
    peak_bytes: int          # the fake run's peak
    measured: Timing         # this CPU, one thread


@dataclass
class RecomputeTime:
    """Lesson 07's stack over segment counts k (``recompute_time``): each step's time predicted by the
    time model (which counts the ops the run made, the recomputed forward included) and measured."""
    n_blocks: int
    width: int
    batch: int
    cpu: CardSpeed
    card: str
    points: list[RecomputePoint]

    def point(self, k: int) -> RecomputePoint:
        for p in self.points:
            if p.segments == k:
                return p
        raise KeyError(k)

    def predicted_ratio(self, k: int, which: str = "cpu") -> float:
        attr = "on_cpu" if which == "cpu" else "on_card"
        return getattr(self.point(k), attr).seconds / getattr(self.points[0], attr).seconds

    def recomputed_flops(self, k: int) -> int:
        """The extra FLOPs the time model counted at ``k`` against the first k: the forward run again."""
        return self.point(k).on_cpu.flops - self.points[0].on_cpu.flops

    def measured_ratio(self, k: int) -> float:
        return self.measured_span(k).value

    def measured_span(self, k: int) -> Ratio:
        """The step at ``k`` over the first k's, measured: fastest over fastest, and the span the
        [fastest, slowest] intervals allow (``timing_spread.ratio``)."""
        return ratio(self.point(k).measured, self.points[0].measured, "range")

    def separated(self, k: int) -> bool:
        """Whether the measured intervals [fastest, slowest] at ``k`` and at the first k do not overlap."""
        return not self.measured_span(k).within_noise

    def conclusion(self, k: int | None = None) -> str:
        k = self.points[-1].segments if k is None else k
        a, b = self.points[0].measured, self.point(k).measured
        k0 = self.points[0].segments
        if not self.separated(k):
            return (f"At k = {k} against k = {k0} the measured intervals overlap ({_spread(b)} against {_spread(a)}; "
                    f"{self.measured_span(k).text()}): on this machine, now, the measurement cannot tell them apart.")
        word = "slower" if b.min > a.min else "faster"
        return (f"At k = {k} the intervals do not overlap with k = {k0}'s: the step is {word}, "
                f"×{self.measured_ratio(k):.2f} as long comparing the fastest steps (the intervals allow "
                f"×{self.measured_span(k).low:.2f}–×{self.measured_span(k).high:.2f}), against ×"
                f"{self.predicted_ratio(k):.2f} predicted for this CPU.")

    def rows(self) -> list[list[Any]]:
        return [[p.segments, format_bytes(p.peak_bytes), f"{p.on_cpu.flops / 1e6:,.0f}",
                 f"{p.on_cpu.seconds * 1e3:,.2f}", _spread(p.measured),
                 "—" if p is self.points[0] else self.measured_span(p.segments).text(),
                 f"{p.on_card.seconds * 1e6:,.0f}"]
                for p in self.points]

    def _repr_html_(self) -> str:
        p = self.points[0]
        note = (f"{self.n_blocks} blocks of Linear({self.width}, {self.width}) + ReLU, batch {self.batch}, "
                f"checkpoint_sequential with k segments (k = 1: none), forward and backward. Predicted: "
                f"{p.on_cpu.label} from this CPU's rates ({self.cpu.source}), and {p.on_card.label} from its "
                f"datasheet, the same ops. Measured: {MEASURED}, {len(p.measured.samples)} steps of each k in turn "
                f"after a warm-up. {self.conclusion()}")
        return html_table(["k", "peak memory (fake run)", "MFLOPs a step (time model)", "step ms predicted, this CPU",
                           "step time measured: fastest [fastest–slowest]",
                           f"measured vs k = {p.segments}: fastest [span]", f"step µs predicted, {self.card}"],
                          self.rows(), note)

    def __repr__(self) -> str:
        k = self.points[-1].segments
        return (f"RecomputeTime(k = {k}: predicted ×{self.predicted_ratio(k):.2f} on this CPU, "
                f"×{self.predicted_ratio(k, 'card'):.2f} on {self.card}; {self.conclusion()})")

    def figure(self):
        """Step time against k: predicted for this CPU (bars), measured (every step, and its range)."""
        from gpulab.plots import LessonFigure
        fig = LessonFigure(figsize=(6.5, 3), dpi=100, layout="constrained")
        ax = fig.add_subplot()
        xs = list(range(len(self.points)))
        ax.bar([x - 0.2 for x in xs], [p.on_cpu.seconds * 1e3 for p in self.points], 0.35, color="#BBBBBB",
               label="predicted, this CPU (roofline)")
        for x, p in zip(xs, self.points):
            m = p.measured
            ax.plot([x + 0.2] * len(m.samples), [s * 1e3 for s in m.samples], "o", color="#4C72B0", alpha=0.6)
            ax.vlines(x + 0.2, m.min * 1e3, max(m.samples) * 1e3, color="#4C72B0")
        ax.plot([], [], "o", color="#4C72B0", label=f"{MEASURED}: each step")
        ax.set_xticks(xs, [f"k = {p.segments}" for p in self.points])
        ax.set_ylabel("ms a step")
        ax.set_ylim(0, None)
        ax.legend(fontsize=7, loc="lower right")
        fig.suptitle("checkpointing's recompute: predicted and measured", fontsize=9)
        return fig


def _stack_step(net, x, k: int) -> None:
    from torch.utils.checkpoint import checkpoint_sequential
    out = net(x) if k <= 1 else checkpoint_sequential(net, k, x, use_reentrant=False)
    out.sum().backward()


def recompute_time(n_blocks: int = 16, width: int = 128, batch: int = 512, segments: tuple[int, ...] = (1, 4, 16), *,
                   card: str = "H100", repeats: int = 7) -> RecomputeTime:
    """Lesson 07's stack (``record.runs.checkpoint.block_stack``) with ``checkpoint_sequential`` at each
    segment count: one fake run each (``memory_experiment``, under the time model's ``OpTimer``), its ops
    costed on this CPU and on ``card``; and real steps on this CPU, each k in turn, ``repeats`` rounds
    after a warm-up (so a slow spell of a shared machine falls on every k alike)."""
    from gpulab.record.runs.checkpoint import block_stack, memory_experiment
    cpu, card_speed = cpu_as_card(), speed_of(card)
    predicted = {}
    for k in segments:
        box: list = []
        m = run(timed_experiment(memory_experiment(n_blocks, width, batch, k), box), "fake", fake_target="cpu")
        if m.tracking is None:
            raise RuntimeError(f"the timed fake run failed: {m.error}")
        predicted[k] = ([step_time_of(box[0].ops, s, batch, "samples") for s in (cpu, card_speed)], m.peak_bytes)
    samples: dict[int, list[float]] = {k: [] for k in segments}
    with one_thread():
        torch.manual_seed(0)
        net, x = block_stack(n_blocks, width), torch.randn(batch, width)
        for j in range(1 + repeats):
            for k in segments:
                net.zero_grad(set_to_none=True)
                t0 = time.thread_time()
                _stack_step(net, x, k)
                if j:
                    samples[k].append(time.thread_time() - t0)
    points = [RecomputePoint(k, *predicted[k][0], predicted[k][1], Timing(samples[k], 1, "this CPU")) for k in segments]
    return RecomputeTime(n_blocks, width, batch, cpu, card_speed.name, points)


def exercise_recompute(result: RecomputeTime) -> ChoiceExercise:
    """Predict first: how much longer does the time model say a checkpointed step takes on the card?
    The answer is the prediction (fake runs on the card's datasheet: the same on every machine)."""
    k = result.points[-1].segments
    options = {"a": "the same time: nothing extra runs",
               "b": "longer, by less than half: the forward runs again, and the forward is about a third of a step",
               "c": "twice as long or more: everything runs twice"}

    def expected() -> str:
        r = result.predicted_ratio(k, "card")
        return "a" if r < 1.05 else ("b" if r < 1.5 else "c")

    def explain() -> str:
        return (f"The time model counts the ops the run made: in the backward each checkpointed segment's forward ran again (all but the last), "
                f"{result.recomputed_flops(k) / result.points[0].on_cpu.flops:.0%} more FLOPs, and the step is "
                f"×{result.predicted_ratio(k, 'card'):.2f} as long on the {result.card} (predicted).")
    return ChoiceExercise(f"The stack with k = {k} segments against no checkpointing: the step on the {result.card} "
                          f"(predicted) takes:", options, expected, explain,
                          hint="Count which forwards run again in the backward, and what share of a step a forward is")
