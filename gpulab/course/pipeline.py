"""Lesson 12, section 9: pipeline parallelism, each stage measured on fake tensors with its own modules and
its schedule's micro-batches in flight (``gpulab.step(..., pp=N, pp_stage=i, schedule=...)``): under 1F1B
the first stage holds ``min(pp, M)`` micro-batches' activations and the last one, under GPipe every stage
holds all ``M``; and the "how many H100s for Llama-3.1-70B at 8K" exercise: each layout's model states
per stage from counted parameters (instant), then ``gpulab fit`` (the command) for the measured answer.
"""
from __future__ import annotations

from dataclasses import dataclass

from gpulab.course.exercises import Exercise
from gpulab.course.tensor_parallel import tp_config

__all__ = ["LayoutRow", "LayoutTable", "PPRow", "PPTable", "exercise_gpipe_first_stage", "layout_states",
           "pp_config", "pp_table"]


def pp_config(layers: int = 4):
    """Section 8's small Llama-style config (``tp_config``), 4 layers deep: one a stage at pp = 4."""
    return tp_config(layers)


@dataclass(frozen=True)
class PPRow:
    schedule: str
    stage: int
    role: str
    in_flight: int        # the schedule's count (not measured)
    parameters: int
    activations: int      # measured: the most the stage's step held at once
    peak: int


@dataclass(frozen=True)
class PPTable:
    rows: tuple[PPRow, ...]
    pp: int
    microbatches: int
    label: str

    def row(self, schedule: str, stage: int) -> PPRow:
        return next(r for r in self.rows if r.schedule == schedule and r.stage == stage)

    def one_micro_batch(self) -> int:
        """One micro-batch's activations, measured: two middle stages (the same modules) of 1F1B, which
        hold one micro-batch apart."""
        return self.row("1f1b", 1).activations - self.row("1f1b", 2).activations

    def _repr_html_(self) -> str:
        from gpulab.tables import html_table
        from gpulab.units import format_bytes
        body = [[r.schedule, str(r.stage), r.role, str(r.in_flight), format_bytes(r.parameters),
                 format_bytes(r.activations), format_bytes(r.peak)] for r in self.rows]
        return html_table(["schedule", "stage", "holds", "micro-batches in flight (schedule's count)", "parameters",
                           "activations held at most (measured)", "peak"], body,
                          caption=f"pp = {self.pp}, {self.microbatches} micro-batches; {self.label}")


def pp_table(pp: int = 4, microbatches: int = 8, batch: int = 2, seq_len: int = 32) -> PPTable:
    """Each stage of 1F1B, and the first and last of GPipe, one rank measured (bf16, AdamW, two steps on
    fake tensors: the stage's modules, its micro-batches in flight)."""
    import gpulab
    from gpulab.training.pipeline import in_flight, stage_role
    rows, label = [], ""
    for schedule, stages in (("1f1b", range(pp)), ("gpipe", (0, pp - 1))):
        for s in stages:
            r = gpulab.step(pp_config(pp), batch=batch, seq_len=seq_len, optimizer="adamw", dtype="bf16",
                            engine="fake", pp=pp, pp_stage=s, schedule=schedule, microbatches=microbatches)
            by = r.tensor_bytes_by_category
            held = max(point["activations"] for point in r.measurement.tracking.series)
            rows.append(PPRow(schedule, s, stage_role(s, pp), in_flight(schedule, s, pp, microbatches),
                              by["parameters"], held, r.peak_bytes))
            label = r.measurement.label
    return PPTable(tuple(rows), pp, microbatches, f"{label}; in flight: the schedule's count, not measured")


def exercise_gpipe_first_stage(table: PPTable) -> Exercise:
    """Predict the first stage's activations under GPipe from 1F1B's rows, checked against the measured
    GPipe run within 5%."""
    first, extra = table.row("1f1b", 0), table.row("gpipe", 0).in_flight - table.row("1f1b", 0).in_flight
    return Exercise(
        question=(f"Under 1F1B the first stage holds {first.in_flight} micro-batches in flight and measures "
                  f"{first.activations:,} bytes of activations at most. GPipe runs all {table.microbatches} "
                  f"forwards before any backward. How many bytes of activations does the first stage hold under "
                  f"GPipe?"),
        expected=lambda: table.row("gpipe", 0).activations,
        explain=(f"Each micro-batch in flight keeps what its forward saved: one micro-batch is "
                 f"{table.one_micro_batch():,} bytes (stage 1 minus stage 2 under 1F1B: the same modules, one "
                 f"micro-batch apart), and GPipe holds {extra} more than 1F1B on the first stage. The last stage "
                 f"holds {table.row('1f1b', table.pp - 1).in_flight} under 1F1B and all "
                 f"{table.microbatches} under GPipe; measured on fake tensors, stage by stage."),
        unit="bytes", rel_tol=0.05, hint="every extra micro-batch in flight adds one micro-batch's saved activations")


@dataclass(frozen=True)
class LayoutRow:
    tp: int
    pp: int
    first: int            # model states per GPU of the first stage (bytes)
    middle: int
    last: int

    @property
    def largest(self) -> int:
        return max(self.first, self.middle, self.last)


@dataclass(frozen=True)
class LayoutTable:
    model: str
    rows: tuple[LayoutRow, ...]
    capacity: int
    label: str
    parameters: int = 0   # the whole model's, counted on the meta device

    def reading(self) -> str:
        """The whole model's states in a sentence (Markdown), from the counted parameters: lesson 12
        renders it instead of typing the figure (issue 47, item 4)."""
        from gpulab.units import format_bytes
        return (f"{self.model} has {self.parameters / 1e9:.1f} billion parameters: at 8 bytes each, "
                f"{format_bytes(8 * self.parameters, 'decimal', 0)} of model states "
                f"({format_bytes(8 * self.parameters)}) before any activation.")

    def _repr_html_(self) -> str:
        from gpulab.tables import html_table
        from gpulab.units import format_bytes
        body = [[str(r.tp), str(r.pp), str(r.tp * r.pp), format_bytes(r.first), format_bytes(r.middle) if r.pp > 2
                 else "-", format_bytes(r.last), "yes" if r.largest < self.capacity else "no"] for r in self.rows]
        return html_table(["tp", "pp", "GPUs a replica", "first stage", "middle stage", "last stage",
                           f"under {format_bytes(self.capacity)}?"], body, caption=f"{self.model}: {self.label}")


def layout_states(model: str = "hf:llama-3.1-70b", layouts: tuple[tuple[int, int], ...] = ((8, 1), (8, 2), (8, 4),
                                                                                         (4, 4), (8, 8)),
                  gpu: str = "H100") -> LayoutTable:
    """Model states per GPU (bf16 weights and gradients, Adam's two bf16 moments: 8 bytes a parameter, as
    gpulab's pure-bf16 run holds them) of each stage for each (tp, pp), from the parameters of a one-layer
    build counted on the meta device: a block's, the embedding's, the final norm's and the head's, the
    matrices divided by tp and the norms whole. A formula over counted parameters (no activations):
    ``gpulab fit`` measures the rest."""
    import torch

    from gpulab.models import hf_configs
    from gpulab.models.workload import resolve_workload
    from gpulab.predict.cards import parse_gpu
    from gpulab.predict.layer_pattern import with_depth
    config = resolve_workload(model).config
    with torch.device("meta"):
        one = hf_configs.build_model(with_depth(config, 1), torch.bfloat16)

    def count(module, tp: int) -> int:
        return sum(p.numel() // (tp if p.dim() == 2 else 1) for p in module.parameters())
    rows = []
    for tp, pp in layouts:
        n = config.num_hidden_layers // pp
        block, embedding = n * count(one.model.layers[0], tp), count(one.model.embed_tokens, tp)
        ends = count(one.model.norm, tp) + (count(one.lm_head, tp) if not config.tie_word_embeddings else embedding)
        if pp == 1:   # one stage holds everything
            rows.append(LayoutRow(tp, pp, *[8 * (block + embedding + ends)] * 3))
        else:
            rows.append(LayoutRow(tp, pp, 8 * (block + embedding), 8 * block, 8 * (block + ends)))
    card = parse_gpu(gpu)
    whole = config.num_hidden_layers * count(one.model.layers[0], 1) + count(one.model.embed_tokens, 1) \
        + count(one.model.norm, 1) + (count(one.lm_head, 1) if not config.tie_word_embeddings else 0)
    return LayoutTable(model, tuple(rows), card.reported_total_bytes,
                       "formula: model states per GPU from parameters counted on the meta device (matrices split "
                       "tp ways, norms whole), 8 bytes a parameter; activations not included", whole)
