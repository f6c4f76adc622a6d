"""Lesson 03: the reference articles' ``modelsize()`` against what autograd saves.

``modelsize_vs_saved``: the articles' estimate (every layer's output x 2) against what autograd
actually keeps for backward, per model, and the backward peak; ``modelsize_claims`` checks the
articles' two claims on it.

Every result is a dataclass with ``_repr_html_``; figures are built without pyplot.
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch
from matplotlib.figure import Figure

from gpulab import formulas as F
from gpulab.course.claims import ClaimCheck, ClaimReport, Evidence
from gpulab.record.runs.activations import LayerOut
from gpulab.record.runs.activations import remove as _remove, trace as _trace
from gpulab.predict.breakdown import validate_batch
from gpulab.models.registry import MODELS, ModelSpec, build_model, resolve_model
from gpulab.plots import CATEGORY_COLORS, LessonFigure
from gpulab.units import MiB, dtype_name, format_bytes
from gpulab.views import error_percent, fmt_error, html_table
from gpulab.course.activations import _check_dtype, _forward_run, _predicted, _setup, _verdict

__all__ = [
    "KEPT_ROWS", "ModelsizeComparison", "ModelsizeRow", "modelsize_claims", "modelsize_figure",
    "modelsize_output_shapes", "modelsize_vs_saved"
]

KEPT_ROWS = 40   # ``modelsize_vs_saved``'s kept rows: a panel's last eight settings of the five lesson models


# --- the articles' modelsize() vs what autograd saves ------------------------------------------

def modelsize_output_shapes(model: str | ModelSpec, batch: int = 1, image_size: int | None = None) -> list[list[int]]:
    """The output shape of every leaf module in execution order, skipping ``ReLU(inplace=True)``:
    what the articles' ``modelsize()`` collects (meta device, shapes only; each model, batch and size
    traced once per process: shapes do not change)."""
    spec = resolve_model(model)
    return [list(s) for s in _output_shapes(spec, batch, image_size or spec.default_image_size)]


@functools.lru_cache(maxsize=64)
def _output_shapes(spec: ModelSpec, batch: int, size: int) -> tuple[tuple[int, ...], ...]:
    net = build_model(spec, size, device="meta")
    x = torch.empty(batch, 3, size, size, device="meta")
    rows: list[LayerOut] = []
    handles = _trace(net, x, rows)
    try:
        with torch.no_grad():
            net(x)
    finally:
        _remove(handles)
    return tuple(tuple(r.output_shape) for r in rows if not (r.type == "ReLU" and r.inplace))


@dataclass
class ModelsizeRow:
    model: str
    image_size: int
    engine: str
    label: str
    modelsize_x2: int            # formula: the articles' estimate (outputs x 2)
    saved: int                   # measured: activations category at the end of a forward with grad
    saved_with_input: int        # + the input batch (autograd saves it too, for the first conv)
    saved_by_dtype: dict[str, int]
    no_grad_peak: int            # measured: non-parameter peak of a no_grad forward
    train_peak: int              # measured: non-parameter peak of a forward with grad
    backward_peak: int           # measured: peak of saved + activation grads + input during backward
    outputs: int                 # formula: modelsize()'s sum of outputs (x1)

    @property
    def error_percent(self) -> float | None:
        """modelsize() x2 against what autograd saved (input included)."""
        return error_percent(self.modelsize_x2, self.saved_with_input)

    @property
    def backward_error_percent(self) -> float | None:
        """modelsize() x2 against the activation-side peak during backward."""
        return error_percent(self.modelsize_x2, self.backward_peak)


@dataclass
class ModelsizeComparison:
    batch: int
    dtype: str
    rows: list[ModelsizeRow]

    def _repr_html_(self) -> str:
        rows = [[r.model, f"{r.image_size}", format_bytes(r.modelsize_x2, digits=2), format_bytes(r.outputs, digits=2),
                 format_bytes(r.saved_with_input, digits=2), fmt_error(r.error_percent),
                 ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(r.saved_by_dtype.items())),
                 format_bytes(r.backward_peak, digits=2), fmt_error(r.backward_error_percent),
                 format_bytes(r.no_grad_peak, digits=2), r.label] for r in self.rows]
        return html_table(["model", "image", "modelsize() ×2 (formula)", "×1 (outputs)",
                           "saved for backward", "×2 error", "saved by dtype",
                           "backward peak", "×2 error", "no_grad peak", "measured on"], rows,
                          f"batch {self.batch}, {self.dtype}; saved: what autograd holds at the end of a forward "
                          f"with grad, input included; backward peak: saved tensors + activation gradients + "
                          f"input during backward, weight gradients left out; binary units")

    def __repr__(self) -> str:
        return "ModelsizeComparison(" + ", ".join(f"{r.model}: {fmt_error(r.error_percent)}" for r in self.rows) + ")"


def modelsize_vs_saved(models: Sequence[str] = tuple(MODELS), batch: int = 1,
                       dtype: str | torch.dtype = "float32", engine: str = "auto",
                       kept: "OrderedDict[tuple, ModelsizeRow] | None" = None) -> ModelsizeComparison:
    """Each model at its default image size: the articles' estimate against a tracked forward.

    ``kept``: rows measured before (a panel keeps them), by model, batch, image size, dtype and engine
    asked for; a row found there is not measured again (its bytes are the same on every run: the fake
    engine computes nothing, the cpu engine's tracker counts storages). At most ``KEPT_ROWS``."""
    dt = _check_dtype(dtype)
    validate_batch(batch)
    rows = []
    for model in models:
        spec, _, size, _ = _setup(model, batch, None, dt)
        key = (spec, batch, size, dtype_name(dt), str(engine))
        if kept is not None and key in kept:
            kept.move_to_end(key)
            rows.append(kept[key])
            continue
        shapes = modelsize_output_shapes(spec, batch, size)
        est = F.modelsize_activation_bytes(shapes, dt)
        predicted = _predicted(spec, batch, size, dt)
        tr = _forward_run(spec, batch, size, dt, True, engine, predicted, backward=True)
        inf = _forward_run(spec, batch, size, dt, False, engine, predicted)
        input_bytes = batch * 3 * size * size * dt.itemsize
        rows.append(ModelsizeRow(spec.name, size, tr.measurement.engine, tr.measurement.label, est, tr.saved_bytes,
                                 tr.saved_bytes + input_bytes, tr.saved_by_dtype, inf.peak_non_param,
                                 tr.peak_non_param, tr.backward_peak, est // 2))
        if kept is not None:
            kept[key] = rows[-1]
            while len(kept) > KEPT_ROWS:
                kept.popitem(last=False)
    return ModelsizeComparison(batch, dtype_name(dt), rows)


def modelsize_figure(c: ModelsizeComparison) -> Figure:
    """Per model: the modelsize() estimate vs what autograd saved vs the no_grad peak (log scale)."""
    fig = LessonFigure(figsize=(7.6, 3.6), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    xs = range(len(c.rows))
    w = 0.21
    series = [("modelsize() ×2 (formula)", [r.modelsize_x2 for r in c.rows], "#999999"),
              ("saved for backward (measured)", [r.saved_with_input for r in c.rows], CATEGORY_COLORS["activations"]),
              ("backward peak, no weight grads (measured)", [r.backward_peak for r in c.rows], "#C44E52"),
              ("no_grad peak (measured)", [r.no_grad_peak for r in c.rows], "#4C72B0")]
    for i, (lab, vals, col) in enumerate(series):
        ax.bar([x + (i - 1.5) * w for x in xs], [v / MiB for v in vals], w, label=lab, color=col)
    for x, r in zip(xs, c.rows):
        ax.text(x, max(r.modelsize_x2, r.saved_with_input, r.backward_peak) / MiB, fmt_error(r.error_percent),
                ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.set_xticks(list(xs), [f"{r.model}\n{r.image_size}px\n{r.engine}" for r in c.rows], fontsize=8)
    ax.set_ylabel("MiB (log scale)")
    ax.margins(y=0.2)
    ax.legend(fontsize=8, loc="upper right")
    engines = "; ".join(sorted({f"{r.engine} = {r.label}" for r in c.rows}))
    ax.set_title(f"modelsize() vs what autograd saves, batch {c.batch}, {c.dtype} (numbers: modelsize() error)"
                 f"\nmeasured: {engines}", fontsize=8)
    return fig


def modelsize_claims(c: ModelsizeComparison) -> ClaimReport:
    """Refs 000 and 003 (docs/references.md): intermediate memory = every layer's output, doubled by backward."""
    errs = [r.error_percent or 0.0 for r in c.rows]
    bw = [r.backward_error_percent or 0.0 for r in c.rows]
    ratio = [r.backward_peak / max(1, r.saved_with_input) for r in c.rows]
    return ClaimReport(f"modelsize() and 'backward doubles the intermediates' (batch {c.batch}, {c.dtype})", [
        ClaimCheck("modelsize(): the intermediate memory of training is every layer's output × 2",
                   "ref 003", _verdict(max(abs(e) for e in errs) < 10),
                   f"it overestimates what autograd keeps by {min(errs):+.0f}% to {max(errs):+.0f}%: it counts "
                   "outputs nobody saves (a conv output consumed by an in-place ReLU is saved once, a pooling "
                   "output only as the next conv's input) and misses what it cannot see (int64 max-pool indices, "
                   "dropout masks, BatchNorm statistics)",
                   [Evidence(f"{r.model}: modelsize() ×2 vs saved", f"{format_bytes(r.modelsize_x2)} vs "
                             f"{format_bytes(r.saved_with_input)} ({fmt_error(r.error_percent)})", r.label)
                    for r in c.rows]),
        ClaimCheck("backward doubles the intermediates", "refs 000 and 003",
                   _verdict(all(1.8 <= q <= 2.2 for q in ratio)),
                   f"the activation-side peak during backward is ×{min(ratio):.2f} to ×{max(ratio):.2f} of what "
                   "the forward saved: backward frees each saved tensor once its layer is done, while it makes "
                   "that layer's input gradient, so the two overlap only a few layers at a time",
                   [Evidence(f"{r.model}: backward peak / saved", f"{format_bytes(r.backward_peak)} / "
                             f"{format_bytes(r.saved_with_input)} = "
                             f"×{r.backward_peak / max(1, r.saved_with_input):.2f}",
                             r.label) for r in c.rows]),
    ])
