"""Lesson 11, section 7: the levers people reach for when an LLM's training step does not fit,
each measured as a recipe of the one training loop (``gpulab.step``), next to its formula.

* **The logits and their loss** (``logits_levers``): a language model's output head makes
  ``b·s·V`` logits, and its cross-entropy works in float32, ``b·s·V·4`` bytes (1 GiB for one
  2,048-token sequence at Llama 3's 128,256-token vocabulary), with a gradient of the same size in
  backward. Computing the head and the loss a chunk of positions at a time (torchtune's
  ``CEWithChunkedOutputLoss``: ``chunked_loss=K``) holds one chunk's float32 logits at once. The
  model is a small Llama-style config with Llama 3's vocabulary, so the head dominates and the fake
  runs take seconds.
* **Offloading and compile** (``offload_and_compile``): saved activations copied to host memory
  (``offload_activations``: the device's peak drops, the host's rises by what was saved), and the
  model under ``torch.compile`` with AOTAutograd's min-cut partitioner (``compile``: it chooses what
  to save for backward and recomputes cheap pointwise ops instead).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpulab.course.exercises import Exercise
from gpulab.measure.engines import LABEL_FAKE_CUDA, LABEL_FORMULA
from gpulab.predict.step import StepResult, step
from gpulab.tables import html_table
from gpulab.units import format_bytes

__all__ = ["LLAMA3_VOCAB", "LeverRow", "LeverTable", "exercise_logits_bytes", "logits_config", "logits_levers",
           "offload_and_compile"]

LLAMA3_VOCAB = 128_256   # Llama 3's tokenizer (hf_configs' llama-3-8b entry)


def logits_config(vocab: int = LLAMA3_VOCAB, hidden: int = 256, layers: int = 2):
    """A small Llama-style config with a large vocabulary: its output head and loss dominate."""
    import transformers
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                    num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                                    intermediate_size=-(-int(2.75 * hidden) // 64) * 64, use_cache=False,
                                    max_position_embeddings=8192, tie_word_embeddings=False)


@dataclass(frozen=True)
class LeverRow:
    name: str
    peak_bytes: int                   # the device's peak (live tensors)
    by_category: dict[str, int]
    host_bytes: int = 0               # what offloading put in host memory, at its peak
    result: StepResult | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class LeverTable:
    """Each lever's run beside the plain one, and the formula the plain run is read against."""
    title: str
    setting: str
    rows: list[LeverRow]
    formula: dict[str, int] = field(default_factory=dict)     # what the formula counts, bytes
    label: str = LABEL_FAKE_CUDA

    def row(self, name: str) -> LeverRow:
        return next(r for r in self.rows if r.name == name)

    @property
    def baseline(self) -> LeverRow:
        return self.rows[0]

    def saved_bytes(self, name: str) -> int:
        return self.baseline.peak_bytes - self.row(name).peak_bytes

    def as_dict(self) -> dict[str, Any]:
        return {"title": self.title, "setting": self.setting, "label": self.label, "formula": dict(self.formula),
                "rows": [{"name": r.name, "peak_bytes": r.peak_bytes, "by_category": dict(r.by_category),
                          "host_bytes": r.host_bytes, "saved_bytes": self.saved_bytes(r.name)} for r in self.rows]}

    def _repr_html_(self) -> str:
        cats = ("activations", "temporaries")
        rows = [[r.name, format_bytes(r.peak_bytes), *(format_bytes(r.by_category.get(c, 0)) for c in cats),
                 format_bytes(r.host_bytes) if r.host_bytes else "", format_bytes(self.saved_bytes(r.name))]
                for r in self.rows]
        table = html_table(["recipe", "device peak", "activations at the peak", "temporaries at the peak",
                            "host (offloaded)", "saved"], rows, f"{self.title}: {self.setting} [{self.label}]")
        if not self.formula:
            return table
        frows = [[k, format_bytes(v)] for k, v in self.formula.items()]
        return table + html_table(["what the formula counts", "bytes"], frows, LABEL_FORMULA)


def _row(name: str, r: StepResult) -> LeverRow:
    offloaded = r.measurement.offloaded   # the host copies' timeline, when activations were offloaded
    return LeverRow(name, r.peak_bytes, dict(r.peak_by_category), offloaded.peak_bytes if offloaded else 0, r)


def logits_levers(vocab: int = LLAMA3_VOCAB, seq_len: int = 2048, batch: int = 1, chunks: int = 8,
                  hidden: int = 256, layers: int = 2) -> LeverTable:
    """One bf16 training step (AdamW) of ``logits_config``'s model, fake tensors following CUDA's
    kernels: the loss as transformers computes it, then in ``chunks`` chunks of positions."""
    config = logits_config(vocab, hidden, layers)
    kw = dict(batch=batch, seq_len=seq_len, dtype="bf16", optimizer="adamw", engine="fake")
    plain = step(config, **kw)
    chunked = step(config, chunked_loss=chunks, **kw)
    n = batch * seq_len * vocab
    formula = {f"float32 logits, b·s·V·4 ({batch} × {seq_len:,} × {vocab:,} × 4)": 4 * n,
               "their gradient in backward, the same": 4 * n,
               f"one chunk's float32 logits, b·s·V·4 / {chunks}": 4 * n // chunks}
    return LeverTable("The logits and their loss", f"{layers}-layer Llama-style model, {hidden} wide, vocabulary "
                      f"{vocab:,}, {batch} × {seq_len:,} tokens, bf16, AdamW",
                      [_row("loss as transformers computes it", plain), _row(f"head and loss in {chunks} chunks", chunked)],
                      formula)


def offload_and_compile(model: str = "hf:tiny-gpt2", batch: int = 4, seq_len: int = 128) -> LeverTable:
    """One AdamW step of ``model`` on fake tensors (CUDA's kernels): plain, with the saved
    activations offloaded to host memory, and under torch.compile's partitioner."""
    kw = dict(batch=batch, seq_len=seq_len, optimizer="adamw", engine="fake", use_cache=False)
    rows = [_row("plain", step(model, **kw)),
            _row("activations offloaded to the host", step(model, offload_activations=True, **kw)),
            _row("torch.compile (AOTAutograd's partitioner)", step(model, compile=True, **kw))]
    return LeverTable("Offloading and compile", f"{model}, {batch} × {seq_len} tokens, float32, AdamW", rows)


def exercise_logits_bytes(seq_len: int = 2048, vocab: int = LLAMA3_VOCAB) -> Exercise:
    """Predict-first: the bytes of one sequence's float32 logits."""
    return Exercise(
        question=f"How many bytes do the float32 logits of one {seq_len:,}-token sequence take at a vocabulary of "
                 f"{vocab:,} tokens (Llama 3's)?",
        expected=lambda: seq_len * vocab * 4,
        explain=(f"{seq_len:,} positions × {vocab:,} logits × 4 bytes = {format_bytes(seq_len * vocab * 4)} "
                 f"({LABEL_FORMULA}); backward makes a gradient of the same size, and the model's own bf16 logits "
                 f"come on top. Chunking the head and the loss keeps one chunk of them at a time."),
        unit="bytes", rel_tol=0.01,
        hint="One logit per position per vocabulary entry, 4 bytes each in float32.")
