"""Lesson 12, section 10: context and expert parallelism, one rank measured on fake tensors, and
Korthikanti et al.'s Table 2 rows beside gpulab's measured ones.

* ``cp_table``: one rank's activations at long sequences (32K, 128K tokens) without context
  parallelism and with the sequence sharded over ``cp`` ranks (``gpulab.step(..., cp=N)``: the
  rank's shard measured, ring attention's K/V buffers a labelled formula,
  ``training.context_parallel``);
* ``ep_table``: a mixture of experts' rank under expert parallelism (``gpulab.step(..., ep=N)``):
  its experts' parameters and AdamW state, and the all-to-all buffers per MoE layer under the
  routing assumption (``training.expert_parallel``);
* ``table2_rows``: Table 2's no-parallelism, tensor-parallel and tensor + sequence-parallel rows
  for a GPT layer, beside the bytes one measured layer saved (tests/test_korthikanti.py checks the
  paper's own shapes, exactly, term by term).
"""
from __future__ import annotations

from dataclasses import dataclass

from gpulab.course.exercises import Exercise

__all__ = ["CPRow", "EPRow", "Table2Row", "cp_table", "ep_table", "exercise_cp_activations", "exercise_ep_parameters",
           "gpt_layer_config", "moe_config", "table2_rows"]


def _html(headers: list[str], body: list[list[str]], caption: str) -> str:
    from gpulab.tables import html_table
    return html_table(headers, body, caption=caption)


@dataclass(frozen=True)
class CPRow:
    seq_len: int
    cp: int
    activations: int
    peak: int
    ring_transient: int       # ring attention's buffers of one layer (a formula; 0 without cp)
    gathered_kv: int          # of which the whole sequence's K and V


@dataclass(frozen=True)
class CPTable:
    rows: tuple[CPRow, ...]
    label: str

    def row(self, seq_len: int, cp: int) -> CPRow:
        return next(r for r in self.rows if r.seq_len == seq_len and r.cp == cp)

    def _repr_html_(self) -> str:
        from gpulab.units import format_bytes as f
        body = [[f"{r.seq_len:,}", str(r.cp), f"{r.seq_len // r.cp:,}", f(r.activations), f(r.peak),
                 f(r.ring_transient) if r.cp > 1 else "—", f(r.gathered_kv) if r.cp > 1 else "—"] for r in self.rows]
        return _html(["sequence", "cp", "rank's tokens", "activations", "peak (measured)",
                      "ring buffers per layer (formula)", "of which whole-sequence K and V"], body,
                     f"rank 0 of the context-parallel group; {self.label}")


def cp_table(seq_lens: tuple[int, ...] = (32768, 131072), degrees: tuple[int, ...] = (1, 8)) -> CPTable:
    """One rank's activations at each sequence length and context-parallel degree (a small Llama
    config, bf16, AdamW, batch 1, fake runs)."""
    import gpulab
    from gpulab.models import hf_configs
    rows, label = [], ""
    for s in seq_lens:
        cfg = hf_configs.make_config("tiny-llama")
        cfg.max_position_embeddings = max(seq_lens)
        for cp in degrees:
            r = gpulab.step(cfg, batch=1, seq_len=s, optimizer="adamw", dtype="bf16", engine="fake", cp=cp)
            note = r.recipe.get("context_parallel", {})
            rows.append(CPRow(s, cp, r.tensor_bytes_by_category["activations"], r.peak_bytes,
                              note.get("transient_bytes", 0), note.get("gathered_kv_bytes", 0)))
            label = note.get("label", label)
    return CPTable(tuple(rows), f"fake tensors, CUDA kernels' allocations; ring buffers: {label}")


def moe_config(experts: int = 8, top_k: int = 2):
    """A small Mixtral config: 2 layers, ``experts`` experts of width 128, top-``top_k`` routing."""
    import transformers
    return transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, num_local_experts=experts,
                                      num_experts_per_tok=top_k, vocab_size=256, max_position_embeddings=256)


@dataclass(frozen=True)
class EPRow:
    ep: int
    routing: str
    parameters: int
    optimizer_state: int
    dispatch_receive: int     # the all-to-all's receive buffer per MoE layer (0 without ep)
    rows_received: int
    peak: int


@dataclass(frozen=True)
class EPTable:
    rows: tuple[EPRow, ...]
    label: str

    def row(self, ep: int, routing: str = "balanced") -> EPRow:
        return next(r for r in self.rows if r.ep == ep and r.routing == routing)

    def _repr_html_(self) -> str:
        from gpulab.units import format_bytes as f
        body = [[str(r.ep), r.routing, f(r.parameters), f(r.optimizer_state),
                 f"{f(r.dispatch_receive)} ({r.rows_received} rows)" if r.ep > 1 else "—", f(r.peak)]
                for r in self.rows]
        return _html(["ep", "routing", "parameters", "AdamW state", "all-to-all receive per layer", "peak"], body,
                     f"rank 0 of the expert-parallel group; {self.label}")


def ep_table(layouts: tuple[tuple[int, str], ...] = ((1, "balanced"), (4, "balanced"), (4, "worst")),
             batch: int = 2, seq_len: int = 64) -> EPTable:
    """One rank of a small mixture of experts at each (ep, routing) (bf16, AdamW, fake runs)."""
    import gpulab
    rows, label = [], ""
    for ep, routing in layouts:
        r = gpulab.step(moe_config(), batch=batch, seq_len=seq_len, optimizer="adamw", dtype="bf16", engine="fake",
                        ep=ep, routing=routing)
        by, note = r.tensor_bytes_by_category, r.recipe.get("expert_parallel", {})
        rows.append(EPRow(ep, routing, by["parameters"], by["optimizer_state"], note.get("dispatch_receive", 0),
                          note.get("rows_received", 0), r.peak_bytes))
        label = r.measurement.label
    return EPTable(tuple(rows), label)


def gpt_layer_config(heads: int, hidden: int, seq_len: int, attn_implementation: str = "eager"):
    """A GPT layer as transformers' Starcoder2 builds it (LayerNorm with bias, 4h tanh-GeLU MLP,
    attention and residual dropout 0.1, as many key/value heads as heads), one layer: the layer
    Korthikanti et al. count, with a tensor-parallel plan."""
    from transformers import Starcoder2Config
    cfg = Starcoder2Config(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads,
                           intermediate_size=4 * hidden, num_hidden_layers=1, vocab_size=256,
                           max_position_embeddings=seq_len, hidden_act="gelu_pytorch_tanh", residual_dropout=0.1,
                           attention_dropout=0.1, embedding_dropout=0.0, use_bias=True, use_cache=False,
                           tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = attn_implementation
    return cfg


@dataclass(frozen=True)
class Table2Row:
    layout: str
    tp: int
    sequence_parallel: bool
    formula: float            # Korthikanti et al. 2022, Table 2
    measured: int             # what the layer's modules saved in forward, rank 0

    @property
    def difference(self) -> float:
        return self.measured - self.formula


@dataclass(frozen=True)
class Table2:
    rows: tuple[Table2Row, ...]
    shape: str

    def row(self, layout: str) -> Table2Row:
        return next(r for r in self.rows if r.layout == layout)

    def _repr_html_(self) -> str:
        from gpulab.units import format_bytes as f
        body = [[r.layout, f(r.formula), f(r.measured), f"{r.difference:+,.0f} B"] for r in self.rows]
        return _html(["layout", "Table 2 (formula)", "measured (one layer, rank 0)", "measured − formula"], body,
                     f"{self.shape}; the differences are terms the paper drops: float32 softmax output "
                     f"(2·a·s²·b/t), LayerNorm mean and 1/std, and with sequence parallelism DTensor's saved "
                     f"all-gathered inputs (4·s·b·h·(1 − 1/t))")


def table2_rows(heads: int = 8, hidden: int = 512, seq_len: int = 512, tp: int = 4) -> Table2:
    """Table 2's rows sbh(34 + 5as/h), sbh(10 + 24/t + 5as/(ht)) and sbh(34/t + 5as/(ht)) beside one
    measured GPT layer at b = 1 (bf16, fake tensors, the fake process group)."""
    import gpulab
    from gpulab.course.transformer_activations import _saved_by_layer
    s, h, a = seq_len, hidden, heads
    rows = []
    for name, t, sp in (("no parallelism", 1, False), (f"tensor parallel t={tp}", tp, False),
                        (f"tensor + sequence parallel t={tp}", tp, True)):
        r = gpulab.step(gpt_layer_config(a, h, s), batch=1, seq_len=s, optimizer="sgd", dtype="bf16",
                        engine="fake", steps=1, tp=t, sequence_parallel=sp)
        measured = _saved_by_layer(r.measurement, 1)[0][0]
        formula = s * h * ((34 / t if sp else 10 + 24 / t) + 5 * a * s / (h * t))
        rows.append(Table2Row(name, t, sp, formula, measured))
    return Table2(tuple(rows), f"GPT layer, a={a}, h={h}, s={s}, b=1, bf16")


def exercise_cp_activations(table: CPTable) -> Exercise:
    """Predict a rank's activations at the longest sequence with the largest cp, from the run without."""
    s = max(r.seq_len for r in table.rows)
    cp = max(r.cp for r in table.rows)
    whole = table.row(s, 1)
    return Exercise(
        question=(f"At {s:,} tokens one GPU holds {whole.activations:,} bytes of activations (flash attention). "
                  f"With the sequence split over cp = {cp} ranks, how many bytes of activations does one rank hold?"),
        expected=lambda: table.row(s, cp).activations,
        explain=(f"Every saved tensor but a few bytes is per token: q, k, v, the attention output and its logsumexp, "
                 f"the MLP's insides, the logits (flash attention's seed and offset, per layer, are not). A rank "
                 f"holds {s // cp:,} tokens' worth: 1/{cp}. What attention needs beyond "
                 f"the shard, the whole sequence's K and V ({table.row(s, cp).gathered_kv:,} bytes per layer), is "
                 f"transient, one layer at a time, and does not fall with cp."),
        unit="bytes", rel_tol=0.01, hint="which saved tensors are per token?")


def exercise_ep_parameters(table: EPTable, ep: int = 4) -> Exercise:
    """Predict a rank's parameter bytes under ep from the run without and the experts' share."""
    cfg = moe_config()
    expert_bytes = 2 * cfg.num_hidden_layers * cfg.num_local_experts * 3 * cfg.hidden_size * cfg.intermediate_size
    return Exercise(
        question=(f"One GPU holds {table.row(1).parameters:,} bytes of bf16 parameters, {expert_bytes:,} of them the "
                  f"{cfg.num_local_experts} experts of each of its {cfg.num_hidden_layers} MoE layers. With ep = {ep}, "
                  f"how many bytes of parameters does one rank hold?"),
        expected=lambda: table.row(ep).parameters,
        explain=(f"Only the experts are split: each rank keeps {cfg.num_local_experts // ep} of them per layer; "
                 f"attention, norms, embeddings and the router (which scores all experts) stay whole. Gradients "
                 f"and AdamW's two moments follow the parameters."),
        unit="bytes", rel_tol=0.01, hint="what is not an expert stays whole")
