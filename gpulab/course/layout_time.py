"""Lesson 12's time side (issue 46, item 6): what DDP, ZeRO, FSDP and tensor parallelism spend
communicating, and the pipeline's bubble, for a named card and link.

One rank's step is timed once (``predict.plan_time.timed_rank``: a roofline per op of the fake run on
the card's datasheet, a deep stack laid out from two small depths), and every data-parallel strategy
is costed on it by ``predict.plan_time.plan_time`` (its collectives' bytes from the rank's own
parameters and gradients, NCCL's bus factors from ``predict.comm_time``, the overlap each strategy
allows named in ``plan_time.OVERLAP``), within one node (NVLink) and across nodes (the network).

Two figures here are formulas on that same rank, not runs of their own (each would cost a timed
fake run of the tensor-parallel or pipelined layout, seconds apiece; ``gpulab fit --tp/--pp`` makes
them):

* tensor parallelism: Megatron-LM's four all-reduces of a layer's activations (b·s·h in the run's
  dtype) a layer, two in the forward and two in the backward (Shoeybi et al. 2019, "Megatron-LM",
  §3), each costed by ``comm_time.collective_seconds`` on the node's link, on the critical path
  (``predict.timing.TP_OVERLAP``). NB: the compute is not divided by the tensor-parallel degree here:
  the figure is the communication alone.
* the pipeline's bubble: ``plan_time.bubble_seconds`` with t the rank's forward + backward divided
  evenly over the stages (a stage's share of the layers), one micro-batch at a time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gpulab.course.exercises import ChoiceExercise
from gpulab.models.workload import resolve_workload
from gpulab.options import Layout
from gpulab.predict.card_speeds import CardSpeed, speed_of
from gpulab.predict.comm_time import BUS_FACTOR_SOURCE, COMM_ASSUMPTION, collective_seconds, link_for
from gpulab.predict.plan_time import BUBBLE_SOURCE, OVERLAP, PlanTime, bubble_seconds, plan_time, timed_rank
from gpulab.predict.timing import TP_OVERLAP
from gpulab.tables import html_table
from gpulab.training.loop import user_recipe
from gpulab.units import format_bytes

__all__ = ["LayoutTimes", "exercise_exposed", "layout_times"]

STRATEGIES = ("ddp", "zero1", "fsdp2")
TP_SOURCE = "Shoeybi et al. 2019, Megatron-LM, §3: two all-reduces a layer in the forward, two in the backward"


@dataclass
class Bubble:
    schedule: str
    pp: int
    microbatches: int
    virtual_stages: int
    stage_s: float        # t: one stage's forward + backward of one micro-batch
    seconds: float

    @property
    def fraction(self) -> float:
        """The bubble over the m·t the micro-batches take."""
        return self.seconds / (self.microbatches * self.stage_s)


@dataclass
class LayoutTimes:
    model: str
    card: str
    speed: CardSpeed
    batch: int
    seq_len: int
    rank_s: float                                       # one rank's step (no communication)
    depth: str
    plans: dict[tuple[str, int], PlanTime] = field(default_factory=dict)   # (strategy, gpus)
    tp: tuple[int, int, float, str] = (1, 0, 0.0, "")   # (degree, bytes a step, seconds, link)
    bubbles: list[Bubble] = field(default_factory=list)

    def rows(self) -> list[list[Any]]:
        out = []
        for (strategy, gpus), p in self.plans.items():
            for c in p.comm:
                out.append([f"{strategy}, {gpus} GPUs", c.name, format_bytes(c.nbytes), c.link,
                            f"{c.seconds * 1e3:,.1f}", f"{c.exposed_s * 1e3:,.1f}", OVERLAP[strategy]])
        degree, nbytes, seconds, link = self.tp
        out.append([f"tensor parallel, tp = {degree}", "activation all-reduces (4 a layer)", format_bytes(nbytes), link,
                    f"{seconds * 1e3:,.1f}", f"{seconds * 1e3:,.1f}", TP_OVERLAP])
        return out

    def _repr_html_(self) -> str:
        a = self.speed.assumptions
        note = (f"{self.model}, batch {self.batch} × {self.seq_len} tokens a GPU, bf16, AdamW; predicted (roofline, "
                f"{self.card}). One rank's step without communication: {self.rank_s * 1e3:,.1f} ms ({self.depth}). "
                f"{COMM_ASSUMPTION}. Kernels: {a.text}. Links: {self.speed.links.source}. Tensor parallelism: bytes by "
                f"formula ({TP_SOURCE}).")
        head = ["layout", "collective", "bytes a step", "link", "ms", "ms exposed (adds to the step)", "overlap assumed"]
        bubbles = html_table(["schedule", "stages p", "micro-batches m", "chunks v", "stage's t ms", "bubble ms",
                              "bubble / (m·t)"],
                             [[b.schedule, b.pp, b.microbatches, b.virtual_stages, f"{b.stage_s * 1e3:,.1f}",
                               f"{b.seconds * 1e3:,.1f}", f"{b.fraction:.3f}"] for b in self.bubbles],
                             f"the pipeline's bubble: {BUBBLE_SOURCE}; t: the rank's forward + backward over p stages")
        return html_table(head, self.rows(), note) + bubbles

    def __repr__(self) -> str:
        return "\n".join(self.sentences())

    def sentences(self) -> list[str]:
        out = []
        for (strategy, gpus), p in self.plans.items():
            out.append(f"{strategy} over {gpus} GPUs: {sum(c.seconds for c in p.comm) * 1e3:,.1f} ms of communication, "
                       f"{p.exposed_comm_s * 1e3:,.1f} ms of it exposed; step {p.seconds * 1e3:,.1f} ms "
                       f"({p.rank.seconds * 1e3:,.1f} ms of kernels).")
        return out

    def figure(self):
        """Each layout's step: kernels, exposed communication, hidden communication (hatched)."""
        from gpulab.plots import LessonFigure
        fig = LessonFigure(figsize=(8, 3.6), dpi=100, layout="constrained")
        ax = fig.add_subplot()
        names, kernels, exposed, hidden = [], [], [], []
        for (strategy, gpus), p in self.plans.items():
            names.append(f"{strategy}, {gpus} GPUs")
            kernels.append(p.rank.seconds * 1e3)
            exposed.append(p.exposed_comm_s * 1e3)
            hidden.append((sum(c.seconds for c in p.comm) - p.exposed_comm_s) * 1e3)
        degree, _, tp_s, _ = self.tp
        names.append(f"tp = {degree}: all-reduces")
        kernels.append(self.rank_s * 1e3)
        exposed.append(tp_s * 1e3)
        hidden.append(0.0)
        for b in self.bubbles:
            names.append(f"pp = {b.pp}, {b.schedule}" + (f" v={b.virtual_stages}" if b.virtual_stages > 1 else "")
                         + f", m={b.microbatches}: bubble")
            kernels.append(b.microbatches * b.stage_s * 1e3)
            exposed.append(b.seconds * 1e3)
            hidden.append(0.0)
        ys = list(range(len(names)))[::-1]
        ax.barh(ys, kernels, color="#4C72B0", label="kernels (the rank's step; a pipeline: m·t)")
        ax.barh(ys, exposed, left=kernels, color="#C44E52", label="exposed: communication, or the bubble")
        ax.barh(ys, hidden, left=[k + e for k, e in zip(kernels, exposed)], color="white", edgecolor="#C44E52",
                hatch="//", label="communication hidden under compute")
        ax.set_yticks(ys, names, fontsize=8)
        ax.set_xlabel("ms a step")
        ax.legend(fontsize=7, loc="lower right")
        fig.suptitle(f"{self.model} on {self.card}: predicted (roofline, {self.card}), links named", fontsize=9)
        return fig


def layout_times(model: str = "hf:llama-3-8b", gpu: str = "H100", *, seq_len: int = 1024, batch: int = 1,
                 gpus: tuple[int, ...] = (8, 64), tp: int = 8, pp: int = 4, microbatches: int = 8) -> LayoutTimes:
    """The communication of DDP, ZeRO-1 and FSDP2 over each of ``gpus`` (one node, then several), tensor
    parallelism's all-reduces at degree ``tp``, and the bubble of ``pp`` stages over ``microbatches``
    (GPipe, 1F1B, interleaved with two chunks), for ``model`` in bf16 with AdamW on ``gpu`` (module docstring)."""
    speed = speed_of(gpu)
    if speed.links is None:
        raise ValueError(f"{speed.name} has no link figures in gpulab's card table: name a GPU card")
    w = resolve_workload(model, seq_len=seq_len)
    dt = torch.bfloat16
    recipe = user_recipe("adamw", None)
    rank = timed_rank(w, batch, dt, recipe, speed)
    out = LayoutTimes(w.name, speed.name, speed, batch, seq_len, rank.step.seconds, rank.depth)
    for n in gpus:
        for strategy in STRATEGIES:
            out.plans[(strategy, n)] = plan_time(w, batch, dt, recipe, Layout(gpus=n, strategy=strategy), speed,
                                                 rank=rank)
    cfg = w.config
    act = batch * seq_len * cfg.hidden_size * torch.empty((), dtype=dt).element_size()
    bw, link = link_for(speed.links, tp)
    calls = 4 * cfg.num_hidden_layers
    out.tp = (tp, calls * act, calls * collective_seconds("all_reduce", act, tp, bw), link)
    step = rank.step
    t = (step.by_phase.get("forward", 0.0) + step.by_phase.get("backward", 0.0)) / pp
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        out.bubbles.append(Bubble(schedule, pp, microbatches, v, t, bubble_seconds(pp, t, v)))
    return out


def exercise_exposed(result: LayoutTimes) -> ChoiceExercise:
    """Predict first: inside one node, which strategy leaves the most communication exposed (adding to
    the step)? Computed from the plans when the checker runs."""
    n = min(g for _, g in result.plans)
    keys = dict(zip("abc", STRATEGIES))
    options = {"a": "DDP: it all-reduces every gradient, twice the bytes of a reduce-scatter",
               "b": "ZeRO-1: it reduce-scatters the gradients, then all-gathers the updated parameters",
               "c": "FSDP2: it gathers the parameters in the forward and again in the backward"}

    def expected() -> str:
        worst = max(STRATEGIES, key=lambda s: result.plans[(s, n)].exposed_comm_s)
        return next(k for k, s in keys.items() if s == worst)

    def explain() -> str:
        return (" ".join(result.sentences()[:len(STRATEGIES)]) + " What decides is not the bytes but what overlaps: "
                "each strategy's assumption is in the table.")
    return ChoiceExercise(f"{result.model} over {n} GPUs of one node ({result.card}, NVLink): which strategy's "
                          f"communication adds the most time to the step?", options, expected, explain)
