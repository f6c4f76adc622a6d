"""Lesson 03: activations, measured.

* ``forward_table``: one forward pass, layer by layer: output shape, values, the storage it
  allocated (an in-place ReLU allocates none), params: the cs231n VGG16 table from a live run,
  and its claims checked (``cs231n_claims``).
* ``inference_vs_training``: the same forward under ``torch.no_grad()`` (eval) and with
  grad (train); live memory after every layer, and the peak, by category.
* the lesson's predict-first exercises (``exercise``, ``exercise_where_activations``).

Where the parameters and the FLOPs are, and depthwise-separable convolutions:
``gpulab.course.flops``; the articles' ``modelsize()`` against what autograd saves:
``gpulab.course.modelsize``.

Every result is a dataclass with ``_repr_html_``; figures are built without pyplot.
"""
from __future__ import annotations

import functools

import html
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from matplotlib.figure import Figure

from gpulab import formulas as F
from gpulab.course.claims import BREAKS, HOLDS, ClaimCheck, ClaimReport, Evidence
from gpulab.measure.engines import LABEL_FORMULA, Measured, Measurement, run
from gpulab.record.runs.activations import NON_PARAM as _NON_PARAM
from gpulab.record.runs.activations import (LayerOut, forward_allocated, forward_experiment,
                                            forward_table_experiment)
from gpulab.predict.breakdown import breakdown, validate_batch
from gpulab.models.registry import ModelSpec, check_image_size, resolve_model
from gpulab.course.parameters import lesson_engine_limits
from gpulab.plots import CATEGORY_COLORS, LessonFigure
from gpulab.categories import CATEGORIES, Category
from gpulab.units import MiB, dtype_name, format_bytes, parse_dtype
from gpulab.views import error_percent, fmt_error, html_table

__all__ = [
    "ACT_DTYPES", "CS231N_CLAIMED_PARAMS", "CS231N_CLAIMED_VALUES", "CS231N_ISSUE", "ForwardRun",
    "ForwardTable", "GroupRow", "InferenceVsTraining", "cs231n_claims", "exercise",
    "exercise_where_activations", "first_block_vs_classifier", "forward_table", "forward_table_figure",
    "inference_training_figure", "inference_vs_training", "neighbour_peak_formula", "predicted_forward_bytes"
]

ACT_DTYPES = ("float32", "bfloat16", "float16")

# Claims quoted from the reference articles (and the cs231n notes they reproduce). These are
# the hypotheses the lesson tests, not expected answers.
CS231N_CLAIMED_VALUES = 24_000_000      # "TOTAL memory: 24M * 4 bytes ~= 93MB / image"
CS231N_CLAIMED_PARAMS = 138_000_000     # "TOTAL params: 138M parameters"
CS231N_ISSUE = "https://github.com/cs231n/cs231n.github.io/issues/88"

def _check_dtype(dtype) -> torch.dtype:
    dt = parse_dtype(dtype)
    if dtype_name(dt) not in ACT_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(ACT_DTYPES)}, not {dtype_name(dt)}")
    return dt


def _setup(model: str | ModelSpec, batch: int, image_size: int | None, dtype) -> tuple[ModelSpec, int, int, torch.dtype]:
    """Resolve the model once and check the settings: (spec, batch, image size, dtype)."""
    spec = resolve_model(model)
    validate_batch(batch)
    size = image_size or spec.default_image_size
    check_image_size(spec, size)
    return spec, batch, size, _check_dtype(dtype)


def _predicted(spec: ModelSpec, batch: int, size: int, dt: torch.dtype) -> dict[str, Any]:
    """What ``run`` needs to choose an engine: bytes of weights + every output, forward FLOPs and their dtype (a formula
    on the meta device: worked out once per model, batch, size and dtype in a process)."""
    return dict(_predicted_once(spec, batch, size, dt))


@functools.lru_cache(maxsize=128)
def _predicted_once(spec: ModelSpec, batch: int, size: int, dt: torch.dtype) -> tuple[tuple[str, int], ...]:
    bd = breakdown(spec, batch, size, dt)
    return (("predicted_bytes", bd.param_bytes + bd.total_output_bytes), ("predicted_flops", bd.forward_flops),
            ("dtype", dt))


def predicted_forward_bytes(model: str, batch: int, image_size: int | None, dtype) -> int:
    """A cheap upper-end estimate for the memory guard (formula: weights + every layer output)."""
    spec, batch, size, dt = _setup(model, batch, image_size, dtype)
    return _predicted(spec, batch, size, dt)["predicted_bytes"]


def neighbour_peak_formula(rows: Sequence[LayerOut], input_bytes: int) -> tuple[int, str]:
    """Formula for the peak of a ``no_grad`` forward through a chain of layers: the model
    input (held by the caller) plus the largest input + output pair of one layer; for a
    max-pool also its int64 index tensor (8 B per output value), which ``max_pool2d``
    allocates even under no_grad.

    NB: exact for a plain chain (VGG, AlexNet, the small models); a network with skip
    connections (ResNet) also keeps the branch's input alive, and an op may allocate
    temporaries inside a layer, so there the formula is a lower bound."""
    best, where = 0, ""
    for r in rows:
        if not r.new_storage:
            continue
        live = (0 if r.input_is_model_input else r.in_storage_bytes) + r.storage_bytes
        if r.type == "MaxPool2d":
            live += 8 * r.values
        if live > best:
            best, where = live, r.name
    return input_bytes + best, where


# --- the forward table (cs231n) ---------------------------------------------------------------

@dataclass
class GroupRow:
    """Consecutive leaf calls that share one output storage (Conv2d + in-place ReLU...):
    one row of the cs231n table."""
    name: str
    types: str
    shape: list[int]          # per image (C, H, W) or (features,)
    values: int               # per image
    nbytes: int               # storage bytes at the run's batch and dtype
    params: int


@dataclass
class ForwardTable(Measured):
    model: str
    batch: int
    image_size: int
    dtype: str
    input_shape: list[int]
    input_bytes: int
    rows: list[LayerOut]
    measurement: Measurement
    allocated_in_forward: int        # tracker: bytes allocated during the forward
    total_params: int

    def groups(self) -> list[GroupRow]:
        """The cs231n view: the input, then one row per storage the forward created, with
        the in-place / view / identity layers that followed merged into it."""
        per = self.batch
        out = [GroupRow("input", "image", self.input_shape[1:], F.numel(self.input_shape) // per,
                        self.input_bytes, 0)]
        for r in self.rows:
            if r.new_storage or len(out) == 1:
                out.append(GroupRow(r.name, r.type, r.output_shape[1:], r.values // per, r.storage_bytes,
                                    r.params))
            else:
                g = out[-1]
                g.name += f" + {r.name.rsplit('.', 1)[-1]}"
                g.types += f"+{r.type}"
                g.params += r.params
        return out

    # values per image under three accountings
    @property
    def values_cs231n_layers(self) -> int:
        """Input + every tensor headed by a conv, pool or fully connected layer: the rows the
        cs231n table lists (conv+ReLU as one row, no AdaptiveAvgPool2d)."""
        return sum(g.values for g in self.groups()
                   if g.name == "input" or g.types.split("+")[0] in ("Conv2d", "MaxPool2d", "Linear"))

    @property
    def values_created(self) -> int:
        """Input + every storage this forward allocated (measured)."""
        return sum(g.values for g in self.groups())

    @property
    def values_every_output(self) -> int:
        """Input + every leaf module's output counted as its own tensor (as if no layer
        worked in place): the naive count."""
        return F.numel(self.input_shape) // self.batch + sum(r.values for r in self.rows) // self.batch

    @property
    def formula_new_bytes(self) -> int:
        """Formula: sum over layers that create a new tensor of numel x element size."""
        return sum(r.out_bytes for r in self.rows if r.new_storage)

    @property
    def formula_pool_indices_bytes(self) -> int:
        """Formula: the int64 index tensor (one 8-byte index per output value) that
        ``max_pool2d`` allocates, even under no_grad, and drops at once.
        NB: observed on this torch's CPU kernels and fake tensors alike."""
        return sum(8 * r.values for r in self.rows if r.type == "MaxPool2d")

    def accountings(self) -> list[tuple[str, int]]:
        return [("cs231n rows: input + conv(+ReLU) + pool + FC outputs", self.values_cs231n_layers),
                ("every storage this forward created (measured)", self.values_created),
                ("every leaf output as its own tensor (ReLU not in place)", self.values_every_output)]

    def _repr_html_(self) -> str:
        m = self.measurement
        head = (f"<b>{html.escape(self.model)}</b>, batch {self.batch}, {self.image_size}×{self.image_size}, "
                f"{self.dtype}, eval mode under <code>torch.no_grad()</code> — engine <b>{m.engine}</b> "
                f"({html.escape(m.reason)})")
        rows = [[g.name, g.types, "×".join(map(str, g.shape)), f"{g.values:,}", format_bytes(g.nbytes),
                 f"{g.params:,}" if g.params else "0"] for g in self.groups()]
        rows.append(["total", "", "", f"{self.values_created:,}",
                     format_bytes(sum(g.nbytes for g in self.groups())), f"{self.total_params:,}"])
        table = html_table(["layer(s)", "type", "shape per image", "values per image",
                            f"memory (batch {self.batch}, {self.dtype})", "params"], rows,
                           f"one row per tensor the forward allocated; {m.label}")
        acc = html_table(["how the values are counted", "values per image", f"bytes per image ({self.dtype})"],
                         [[k, f"{v:,}", format_bytes(v * parse_dtype(self.dtype).itemsize)]
                          for k, v in self.accountings()],
                         f"per {self.image_size}×{self.image_size} image; binary units")
        with_idx = self.formula_new_bytes + self.formula_pool_indices_bytes
        check = html_table(["quantity", LABEL_FORMULA, m.label, "formula error"],
                           [["bytes allocated by the forward: layer outputs only",
                             format_bytes(self.formula_new_bytes, digits=2),
                             format_bytes(self.allocated_in_forward, digits=2),
                             fmt_error(error_percent(self.formula_new_bytes, self.allocated_in_forward))],
                            ["… + the int64 indices max_pool2d allocates and drops",
                             format_bytes(with_idx, digits=2), format_bytes(self.allocated_in_forward, digits=2),
                             fmt_error(error_percent(with_idx, self.allocated_in_forward))]],
                           "formula: Σ numel × bytes of every new output; measured: every storage the "
                           "tracker saw allocated during the forward")
        return head + table + acc + check

    def __repr__(self) -> str:
        return (f"ForwardTable({self.model}, batch={self.batch}, {self.image_size}px, {self.dtype}, "
                f"values/image={self.values_created:,}, engine={self.engine})")


def forward_table(model: str = "vgg16", batch: int = 1, image_size: int | None = None,
                  dtype: str | torch.dtype = "float32", engine: str = "auto") -> ForwardTable:
    """One eval-mode forward under ``no_grad``, traced layer by layer on an engine."""
    spec, batch, size, dt = _setup(model, batch, image_size, dtype)

    m = run(forward_table_experiment(spec, batch, size, dt), engine, **_predicted(spec, batch, size, dt),
            **lesson_engine_limits())
    allocated = forward_allocated(m)
    v = m.value
    return ForwardTable(spec.name, batch, size, dtype_name(dt), [batch, 3, size, size], v["input_bytes"], v["rows"],
                        m, allocated, v["params"])


def forward_table_figure(t: ForwardTable) -> Figure:
    """The cs231n picture: memory of each tensor (left) and parameters of each layer (right)."""
    groups = t.groups()
    fig = LessonFigure(figsize=(8.0, max(3.4, 0.2 * len(groups) + 1.2)), dpi=100, layout="constrained")
    ax1, ax2 = fig.subplots(1, 2, sharey=True)
    ys = list(range(len(groups)))
    unit, uname = (MiB, "MiB")
    ax1.barh(ys, [g.nbytes / unit for g in groups], color=CATEGORY_COLORS["activations"])
    ax2.barh(ys, [g.params for g in groups], color=CATEGORY_COLORS["parameters"])
    ax1.set_yticks(ys, [f"{g.types} {'×'.join(map(str, g.shape))}" for g in groups], fontsize=7)
    ax1.invert_yaxis()
    ax1.set_xlabel(f"output memory ({uname}, batch {t.batch}, {t.dtype})")
    ax2.set_xlabel("parameters (count, log scale)")
    ax2.set_xscale("log")
    ax1.set_title(f"activations: {t.values_created / 1e6:,.2f} M values/image", fontsize=9)
    ax2.set_title(f"parameters: {t.total_params / 1e6:,.1f} M", fontsize=9)
    fig.suptitle(f"{t.model} forward, one row per tensor — {t.label}", fontsize=10)
    return fig


# --- claims ---------------------------------------------------------------------------------------

def _verdict(ok: bool) -> str:
    return HOLDS if ok else BREAKS


def cs231n_claims(t: ForwardTable) -> ClaimReport:
    """The cs231n VGG16 numbers the articles quote, checked against a live forward."""
    rows_sum = t.values_cs231n_layers
    claimed = CS231N_CLAIMED_VALUES
    per_img = f"per {t.image_size}×{t.image_size} image"
    params_ok = abs(t.total_params - CS231N_CLAIMED_PARAMS) < 0.01 * CS231N_CLAIMED_PARAMS
    values_ok = abs(rows_sum - claimed) < 0.1 * claimed
    mb_ok = abs(rows_sum * 4 - 93e6) < 0.1 * 93e6
    return ClaimReport(f"The cs231n VGG16 table ({t.model}, {t.image_size}×{t.image_size})", [
        ClaimCheck("VGG16 has about 138M parameters", "cs231n notes, quoted in refs 000 and 003",
                   _verdict(params_ok),
                   "the count does not depend on the image size; the biases add only 13,416 to the weights",
                   [Evidence("parameters, numel()", f"{t.total_params:,}", t.label)]),
        ClaimCheck("a forward pass holds about 24M activation values per image",
                   "cs231n notes, quoted in refs 000 and 003", _verdict(values_ok),
                   f"the table's own rows add up to {rows_sum / 1e6:.2f} M, not 24 M (the total line does not "
                   f"match its rows: {CS231N_ISSUE}, open since 2016). Counting conv and ReLU outputs as separate "
                   f"tensors overshoots to {t.values_every_output / 1e6:.1f} M; no natural count gives 24 M",
                   [Evidence(f"the cs231n rows (input + conv+ReLU + pool + FC outputs), {per_img}", f"{rows_sum:,}",
                             t.label),
                    Evidence(f"every tensor this forward allocated, {per_img}", f"{t.values_created:,}", t.label),
                    Evidence("every leaf output as its own tensor", f"{t.values_every_output:,}", t.label)]),
        ClaimCheck("that is about 93 MB per image (float32), forward only", "cs231n notes", _verdict(mb_ok),
                   "24M × 4 B would be 96 MB (91.6 MiB), and 93 matches neither unit; the rows that are "
                   "really there take 61 MB",
                   [Evidence("the rows × 4 B",
                             f"{format_bytes(rows_sum * 4, 'decimal')} = {format_bytes(rows_sum * 4)}", LABEL_FORMULA),
                    Evidence(f"allocated by this forward ({t.dtype}, batch {t.batch})",
                             format_bytes(t.allocated_in_forward), t.label)]),
    ])


# --- inference vs training ----------------------------------------------------------------------

@dataclass
class ForwardRun:
    """One traced forward pass: rows with live memory after each layer, peak by category."""
    mode: str
    rows: list[LayerOut]
    measurement: Measurement
    end_by_category: dict[str, int]
    saved_by_dtype: dict[str, int]
    backward_peak: int = 0   # tracker: peak of activations + temporaries + inputs during backward

    @property
    def peak_bytes(self) -> int:
        return self.measurement.peak_bytes

    @property
    def peak_non_param(self) -> int:
        p = self.measurement.peak_by_category
        return sum(p.get(k, 0) for k in _NON_PARAM)

    @property
    def saved_bytes(self) -> int:
        """Bytes autograd holds for backward at the end of the forward (activations category)."""
        return self.end_by_category.get(Category.ACTIVATIONS.value, 0)


@dataclass
class InferenceVsTraining:
    model: str
    batch: int
    image_size: int
    dtype: str
    input_bytes: int
    inference: ForwardRun
    training: ForwardRun
    neighbour_formula: int
    neighbour_layer: str
    every_output_formula: int     # the articles' view: every leaf output kept (+ the input)

    @property
    def label(self) -> str:
        return self.training.measurement.label

    @property
    def ratio(self) -> float:
        return self.training.peak_non_param / max(1, self.inference.peak_non_param)

    def gap_note(self) -> str:
        """Why "every layer output kept" is above what autograd keeps, from this run: the formula
        counts an in-place layer's output (``ReLU(inplace=True)``) as a tensor of its own, though it
        shares the storage of the layer before, and leaves out the int64 max-pool indices autograd
        saves. "" when neither applies."""
        t = self.training
        inplace = [r for r in t.rows if not r.new_storage]
        inplace_bytes = sum(r.out_bytes for r in inplace)
        indices = t.saved_by_dtype.get("int64", 0)
        if not inplace_bytes and not indices:
            return ""
        explained = self.every_output_formula - inplace_bytes + indices
        rest = t.peak_non_param - explained
        layers = f"{len(inplace)} layer{'s' if len(inplace) != 1 else ''} write{'s' if len(inplace) == 1 else ''}"
        out = (f"Where the formula's error comes from: it counts every leaf layer's output as a tensor of its own, "
               f"but {layers} into the input's storage (in-place ReLU, or a layer that returns its input): "
               f"{format_bytes(inplace_bytes, digits=2)} counted twice; and it leaves out the int64 max-pool indices "
               f"autograd saves for backward: {format_bytes(indices, digits=2)}. The formula less the first, plus the "
               f"second: {format_bytes(explained, digits=2)}, against {format_bytes(t.peak_non_param, digits=2)} "
               f"({self.label})")
        if abs(rest) > 0.01 * max(1, t.peak_non_param):
            out += f"; a further {format_bytes(rest, digits=2)} is outside these two"
        return out + "."

    def _repr_html_(self) -> str:
        i, t = self.inference, self.training
        head = (f"<b>{html.escape(self.model)}</b>, batch {self.batch}, {self.image_size}×{self.image_size}, "
                f"{self.dtype} — engine <b>{t.measurement.engine}</b> ({html.escape(t.measurement.reason)})")
        cat_rows = [[c.value, format_bytes(i.measurement.peak_by_category.get(c.value, 0)),
                     format_bytes(t.measurement.peak_by_category.get(c.value, 0))]
                    for c in CATEGORIES if i.measurement.peak_by_category.get(c.value, 0)
                    or t.measurement.peak_by_category.get(c.value, 0)]
        cat_rows.append(["total at peak", format_bytes(i.peak_bytes), format_bytes(t.peak_bytes)])
        cat_rows.append(["total, not parameters", format_bytes(i.peak_non_param), format_bytes(t.peak_non_param)])
        cats = html_table(["category at the peak", "no_grad forward (eval)", "forward with grad (train)"],
                          cat_rows, f"{self.label}; binary units")
        cmp_rows = [
            ["no_grad peak, not parameters", f"input + largest in+out pair ({self.neighbour_layer}): "
             f"{format_bytes(self.neighbour_formula, digits=2)}", format_bytes(i.peak_non_param, digits=2),
             fmt_error(error_percent(self.neighbour_formula, i.peak_non_param))],
            ["forward with grad, not parameters", f"every layer output kept + input: "
             f"{format_bytes(self.every_output_formula, digits=2)}", format_bytes(t.peak_non_param, digits=2),
             fmt_error(error_percent(self.every_output_formula, t.peak_non_param))],
            ["saved for backward at the end of the forward", "—", format_bytes(t.saved_bytes, digits=2), ""],
        ]
        cmp = html_table(["quantity", LABEL_FORMULA, self.label, "formula error"], cmp_rows,
                         f"training keeps {self.ratio:,.1f}× the non-parameter memory of inference at the peak")
        dt = html_table(["saved tensors by dtype", "bytes"],
                        [[k, format_bytes(v, digits=2)] for k, v in sorted(t.saved_by_dtype.items())],
                        "int64: max-pool indices. Dropout's mask is a float tensor with the CPU's kernels, real "
                        "or fake (input × noise), a bool tensor with CUDA's fused kernel")
        note = self.gap_note()
        note = f"<p class='gpulab-label'>{html.escape(note)}</p>" if note else ""
        return head + cats + cmp + note + dt

    def __repr__(self) -> str:
        return (f"InferenceVsTraining({self.model}, batch={self.batch}, no_grad peak="
                f"{self.inference.peak_non_param:,} B, grad peak={self.training.peak_non_param:,} B)")


def _forward_run(spec: ModelSpec, batch: int, size: int, dt: torch.dtype, grad: bool, engine: str,
                 predicted: dict[str, int], backward: bool = False) -> ForwardRun:
    """A traced forward (train mode with grad, or eval mode under no_grad); with ``backward``
    also ``out.sum().backward()``, recording the peak of the non-weight memory during it."""
    if grad and backward:  # backward costs about twice the forward
        predicted = dict(predicted, predicted_flops=3 * predicted["predicted_flops"])
    m = run(forward_experiment(spec, batch, size, dt, grad, backward), engine, **predicted, **lesson_engine_limits())
    v = m.value
    return ForwardRun("forward with grad (train)" if grad else "no_grad forward (eval)", v["rows"], m,
                      v["end"], v["saved"], v["backward_peak"])


def inference_vs_training(model: str = "vgg16", batch: int = 1, image_size: int | None = None,
                          dtype: str | torch.dtype = "float32", engine: str = "auto") -> InferenceVsTraining:
    """The same forward twice: eval under ``no_grad`` (each layer's input can be freed as soon
    as the next layer has run) and train with grad (autograd keeps what backward needs)."""
    spec, batch, size, dt = _setup(model, batch, image_size, dtype)
    predicted = _predicted(spec, batch, size, dt)
    inf = _forward_run(spec, batch, size, dt, False, engine, predicted)
    tr = _forward_run(spec, batch, size, dt, True, engine, predicted)
    input_bytes = batch * 3 * size * size * dt.itemsize
    nb, where = neighbour_peak_formula(inf.rows, input_bytes)
    every = input_bytes + sum(r.out_bytes for r in tr.rows)
    return InferenceVsTraining(spec.name, batch, size, dtype_name(dt), input_bytes, inf, tr, nb, where, every)


def inference_training_figure(r: InferenceVsTraining) -> Figure:
    """Live non-parameter memory after each layer, both runs, with their peaks."""
    fig = LessonFigure(figsize=(7.6, 3.8), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    for run_, color in ((r.inference, "#4C72B0"), (r.training, "#C44E52")):
        xs = [row.index for row in run_.rows]
        ax.plot(xs, [row.live_after / MiB for row in run_.rows], "-o", ms=2.5, color=color, label=run_.mode)
        ax.axhline(run_.peak_non_param / MiB, color=color, ls="--", lw=0.8)
        # the no_grad peak is labelled at the right, under its line (its curve has fallen away, the legend is
        # above); the training peak at the left, before its curve has risen: neither label sits on a curve
        right = run_ is r.inference and bool(xs)
        ax.text(xs[-1] if right else 0, run_.peak_non_param / MiB, f"peak {run_.peak_non_param / MiB:,.1f} MiB",
                color=color, fontsize=8, va="top" if right else "bottom", ha="right" if right else "left")
    ax.plot([row.index for row in r.training.rows], [row.saved_after / MiB for row in r.training.rows], ":",
            color=CATEGORY_COLORS["activations"], label="of which saved for backward")
    rows = r.training.rows
    step = max(1, len(rows) // 30)
    ax.set_xticks([row.index for row in rows][::step], [row.name for row in rows][::step], rotation=90, fontsize=6)
    ax.set_ylabel("live tensors, not parameters (MiB)")
    ax.set_xlabel("after layer")
    ax.margins(y=0.12)
    ax.legend(fontsize=8, loc="center right")
    ax.set_title(f"{r.model}, batch {r.batch}, {r.image_size}×{r.image_size}, {r.dtype} — {r.label}", fontsize=9)
    return fig


# --- predict-first exercises ---------------------------------------------------------------------

def exercise(name: str):
    """The lesson's predict-first exercises; expected values are computed when checked.

    * ``"first_conv_values"``: values VGG16's first conv outputs for one 224×224 image.
    * ``"no_grad_peak_mib"``: VGG16's no_grad peak of non-parameter memory, one 224×224
      float32 image, in MiB (measured on the fake engine; 5% tolerance).
    """
    from gpulab.course.exercises import Exercise
    if name == "first_conv_values":
        def expected() -> int:
            first = next(r for r in breakdown("vgg16").layers if r.type == "Conv2d")
            return F.numel(first.output_shape[1:])
        return Exercise(
            question="How many values does VGG16's first conv layer output for one 224×224 RGB image?",
            expected=expected, unit="values",
            explain="64 output channels, and padding 1 with a 3×3 kernel keeps the 224×224 size: C × H × W.",
            hint="The output has one H×W plane per output channel, and this conv does not shrink the image.")
    if name == "no_grad_peak_mib":
        return Exercise(
            question=("Under torch.no_grad(), what is the peak of live memory other than the weights when VGG16 "
                      "runs on one 224×224 float32 image, in MiB?"),
            expected=lambda: inference_vs_training("vgg16", 1, 224, "float32", "fake").inference.peak_non_param / MiB,
            unit="MiB", rel_tol=0.05,
            explain=("without autograd a layer's input can go as soon as the layer has run, so the peak is the "
                     "input image plus the largest neighbouring pair: the two 64×224×224 conv outputs "
                     "(fake tensors, no compute)."),
            hint="Only the tensors a layer reads and writes are alive at once; find the largest such pair.")
    raise ValueError(f"unknown exercise {name!r}; valid: first_conv_values, no_grad_peak_mib")


def first_block_vs_classifier(model: str = "vgg16") -> dict[str, int]:
    """Output bytes (one 224×224 float32 image) of the first conv block (up to and including the
    first MaxPool2d) and of the classifier (layers named ``classifier.*``), from ``breakdown``."""
    layers = breakdown(model).layers
    first_pool = next(i for i, r in enumerate(layers) if r.type == "MaxPool2d")
    return {"first block": sum(r.output_bytes for r in layers[:first_pool + 1]),
            "classifier": sum(r.output_bytes for r in layers if r.name.startswith("classifier."))}


def exercise_where_activations(model: str = "vgg16"):
    """Predict-first (qualitative): where do a forward's outputs take the most memory, in the first
    conv block or in the classifier? Read from the layer-by-layer forward (``breakdown``) when checked."""
    from gpulab.course.exercises import ChoiceExercise

    def expected() -> str:
        d = first_block_vs_classifier(model)
        if abs(d["first block"] - d["classifier"]) <= 0.1 * max(d.values()):
            return "c"
        return "a" if d["first block"] > d["classifier"] else "b"

    def explain() -> str:
        d = first_block_vs_classifier(model)
        return (f"Every leaf layer's output for one 224×224 float32 image, each counted on its own (an in-place "
                f"ReLU's too, though it shares its conv's storage): the first block "
                f"{format_bytes(d['first block'])}, the "
                f"classifier {format_bytes(d['classifier'])} ({d['first block'] / max(1, d['classifier']):,.0f}×; "
                f"shapes from a forward of the real model). An output holds channels × H × W values: the first "
                f"block has only 64 channels, but at the full 224×224, while a Linear layer outputs 4096 values per "
                f"image. The parameters sit the other way round (lesson 02): activations are early, weights late.")

    return ChoiceExercise(
        question=(f"{model.upper()} runs a forward on one 224×224 image. Which part's layer outputs take more memory: "
                  f"the first block (two Conv2d(…, 64, 3, padding=1) + ReLU, then a max-pool) or the classifier "
                  f"(three Linear layers with their ReLUs and dropouts)?"),
        options={"a": "the first conv block", "b": "the classifier", "c": "about the same"},
        expected=expected, explain=explain)
