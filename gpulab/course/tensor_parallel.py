"""Lesson 12, section 8: tensor and sequence parallelism, one rank measured on PyTorch's fake process
group (``gpulab.step(..., tp=N, sequence_parallel=...)``), beside Korthikanti et al.'s shape of the
answer: without sequence parallelism, activations are a part every rank holds whole plus a part
split t ways, A(t) = R + S/t (Table 2: sbh·(10 + 24/t + 5as/(ht)) for GPT-3's block).
"""
from __future__ import annotations

from dataclasses import dataclass

from gpulab.course.exercises import Exercise

__all__ = ["TPRow", "TPTable", "exercise_tp_activations", "tp_config", "tp_table"]


def tp_config(layers: int = 2):
    """A small Llama-style config whose heads (4) and MLP width (176) divide by 2 and 4."""
    from gpulab.models import hf_configs
    cfg = hf_configs.make_config("tiny-llama")
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size = 4, 4, 176
    cfg.num_hidden_layers = layers
    return cfg


@dataclass(frozen=True)
class TPRow:
    tp: int
    sequence_parallel: bool
    parameters: int
    optimizer_state: int
    activations: int
    peak: int


@dataclass(frozen=True)
class TPTable:
    rows: tuple[TPRow, ...]
    label: str

    def row(self, tp: int, sequence_parallel: bool = False) -> TPRow:
        return next(r for r in self.rows if r.tp == tp and r.sequence_parallel == sequence_parallel)

    def replicated_and_split(self) -> tuple[int, int]:
        """(R, S) of A(t) = R + S/t, from the runs at t = 1 and 2 without sequence parallelism."""
        a1, a2 = self.row(1).activations, self.row(2).activations
        split = 2 * (a1 - a2)
        return a1 - split, split

    def _repr_html_(self) -> str:
        from gpulab.tables import html_table
        from gpulab.units import format_bytes
        body = [[str(r.tp), "yes" if r.sequence_parallel else "no", format_bytes(r.parameters),
                 format_bytes(r.optimizer_state), format_bytes(r.activations), format_bytes(r.peak)] for r in self.rows]
        return html_table(["tp", "sequence parallel", "parameters", "AdamW state", "activations", "peak"], body,
                          caption=f"one rank of the tensor-parallel group; {self.label}")


def tp_table(layers: int = 2, batch: int = 2, seq_len: int = 64, degrees: tuple[int, ...] = (1, 2, 4)) -> TPTable:
    """One rank's memory at each tensor-parallel degree, with and without sequence parallelism (bf16,
    AdamW, two steps: fake runs, the tp > 1 ones in a fake process group)."""
    import gpulab
    rows, label = [], ""
    for tp in degrees:
        for sp in ((False, True) if tp > 1 else (False,)):
            r = gpulab.step(tp_config(layers), batch=batch, seq_len=seq_len, optimizer="adamw", dtype="bf16",
                            engine="fake", tp=tp, sequence_parallel=sp)
            by = r.tensor_bytes_by_category
            rows.append(TPRow(tp, sp, by["parameters"], by["optimizer_state"], by["activations"], r.peak_bytes))
            label = r.measurement.label
    return TPTable(tuple(rows), f"{label}, PyTorch's fake process group (rank 0; every rank of the group is alike)")


def exercise_tp_activations(table: TPTable) -> Exercise:
    """Predict A(4) without sequence parallelism from A(1) and A(2): R + S/4, checked against the
    measured A(4) within 1%."""
    r, s = table.replicated_and_split()
    return Exercise(
        question=(f"One rank holds {table.row(1).activations:,} bytes of activations at t = 1 and "
                  f"{table.row(2).activations:,} at t = 2. How many at t = 4 (no sequence parallelism)?"),
        expected=lambda: table.row(4).activations,
        explain=(f"A(t) = R + S/t: S = 2·(A(1) − A(2)) = {s:,} bytes is split t ways (q, k, v, the attention "
                 f"output, the MLP's insides), R = {r:,} bytes stays whole on every rank (the norms' inputs, the "
                 f"residual stream, the logits); A(4) = R + S/4, measured on rank 0 of a fake process group."),
        unit="bytes", rel_tol=0.01, hint="only the split part S divides by t; R stays")
