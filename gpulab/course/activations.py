"""Lesson 03: activations and FLOPs, measured.

* ``forward_table``: one forward pass, layer by layer: output shape, values, the storage it
  allocated (an in-place ReLU allocates none), params: the cs231n VGG16 table from a live run.
* ``inference_vs_training``: the same forward under ``torch.no_grad()`` (eval) and with
  grad (train); live memory after every layer, and the peak, by category.
* ``params_vs_flops``: which layers hold the parameters and which do the work (AlexNet).
* ``depthwise_vs_standard``: a MobileNet-style depthwise-separable block against a standard
  convolution with the same in/out channels: params, FLOPs, what autograd saves.
* ``modelsize_vs_saved``: the reference articles' ``modelsize()`` estimate (every layer's
  output x 2) against what autograd actually keeps for backward, per model.

Every result is a dataclass with ``_repr_html_``; figures are built without pyplot.
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Sequence

import torch
from matplotlib.figure import Figure

from gpulab import formulas as F
from gpulab.course.claims import BREAKS, HOLDS, ClaimCheck, ClaimReport, Evidence
from gpulab.measure.engines import LABEL_FORMULA, Measured, Measurement, run
# The measuring core lives in the library (gpulab record runs it too); these names stay importable here.
from gpulab.record.runs.activations import ACTIVATION_SIDE as _ACTIVATION_SIDE
from gpulab.record.runs.activations import NON_PARAM as _NON_PARAM
from gpulab.record.runs.activations import LayerOut, forward_allocated, forward_experiment, forward_table_experiment, saved_by_dtype as _saved_by_dtype
from gpulab.record.runs.activations import live as _live, remove as _remove, trace as _trace
from gpulab.record.runs.activations import DEPTHWISE_BLOCKS, depthwise_experiment, separable_block, standard_block
from gpulab.record.runs.activations import build_in as _build_in, peak_since as _peak_since
from gpulab.predict.breakdown import breakdown, validate_batch
from gpulab.models.registry import MODELS, ModelSpec, build_model, check_image_size, resolve_model
from gpulab.course.parameters import NUMEL_LABEL, lesson_engine_limits
from gpulab.plots import CATEGORY_COLORS, LessonFigure
from gpulab.categories import CATEGORIES, Category
from gpulab.units import MiB, dtype_name, format_bytes, parse_dtype
from gpulab.views import error_percent, fmt_error, html_table

__all__ = [
    "ACT_DTYPES", "BlockMeasure", "CS231N_CLAIMED_PARAMS", "CS231N_CLAIMED_VALUES", "CS231N_ISSUE",
    "DepthwiseResult", "FlopRow", "ForwardRun", "ForwardTable", "GroupRow", "InferenceVsTraining",
    "LABEL_FLOP_COUNTER", "ModelsizeComparison", "ModelsizeRow", "ParamsFlops", "cs231n_claims",
    "depthwise_figure", "depthwise_saved_formula", "depthwise_vs_standard", "exercise",
    "exercise_where_activations", "first_block_vs_classifier", "flops_claims", "forward_table",
    "forward_table_figure", "inference_training_figure", "inference_vs_training",
    "modelsize_claims", "modelsize_figure", "modelsize_output_shapes", "modelsize_vs_saved",
    "neighbour_peak_formula", "params_flops_figure", "params_vs_flops", "predicted_forward_bytes"
]

ACT_DTYPES = ("float32", "bfloat16", "float16")
LABEL_FLOP_COUNTER = "counted by torch.utils.flop_counter (meta tensors, no compute)"

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


def _predicted(spec: ModelSpec, batch: int, size: int, dt: torch.dtype) -> dict[str, int]:
    """What ``run`` needs to choose an engine: bytes of weights + every output, forward FLOPs."""
    bd = breakdown(spec, batch, size, dt)
    return {"predicted_bytes": bd.param_bytes + bd.total_output_bytes, "predicted_flops": bd.forward_flops}


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


# --- 1. the forward table (cs231n) ---------------------------------------------------------------

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


def flops_claims(r: "ParamsFlops") -> ClaimReport:
    """Ref 001 (docs/references.md) on AlexNet: the FC layers hold most parameters, the conv layers do most FLOPs."""
    cp, cf = r.share(("Conv2d",))
    lp, lf = r.share(("Linear",))
    return ClaimReport(f"Parameters and FLOPs ({r.model}, {r.image_size}×{r.image_size})", [
        ClaimCheck("the fully connected layers hold most of the parameters", "ref 001 (AlexNet)",
                   _verdict(lp > 50), "the first FC layer alone multiplies the flattened feature map by 4096",
                   [Evidence("FC share of parameters", f"{lp:.1f}%", NUMEL_LABEL),
                    Evidence("conv share of parameters", f"{cp:.1f}%", NUMEL_LABEL)]),
        ClaimCheck("the convolution layers do most of the computation", "ref 001 (AlexNet)",
                   _verdict(cf > 50), "each conv weight is reused at every output position; an FC weight once "
                   "per image",
                   [Evidence("conv share of forward FLOPs", f"{cf:.1f}%", LABEL_FORMULA),
                    Evidence("total forward FLOPs", f"{r.total_flops / 1e9:,.3f} GFLOP", LABEL_FORMULA),
                    Evidence("the same, counted", f"{r.counted_total / 1e9:,.3f} GFLOP", LABEL_FLOP_COUNTER)]),
    ])


# --- 2. inference vs training ----------------------------------------------------------------------

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
                        "int64: max-pool indices. Dropout's mask is a float tensor on CPU and fake tensors "
                        "(input × noise), a bool tensor with CUDA's fused kernel")
        return head + cats + cmp + dt

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
        ax.text(0, run_.peak_non_param / MiB, f"peak {run_.peak_non_param / MiB:,.1f} MiB", color=color,
                fontsize=8, va="bottom")
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


# --- 3. where the parameters are, where the FLOPs are ------------------------------------------------

@dataclass
class FlopRow:
    name: str
    type: str
    params: int
    flops: int            # formula
    flops_counted: int    # torch.utils.flop_counter


@dataclass
class ParamsFlops:
    model: str
    batch: int
    image_size: int
    rows: list[FlopRow]
    counted_total: int

    @property
    def total_params(self) -> int:
        return sum(r.params for r in self.rows)

    @property
    def total_flops(self) -> int:
        return sum(r.flops for r in self.rows)

    def share(self, types: Sequence[str] = ("Conv2d",)) -> tuple[float, float]:
        """(% of params, % of FLOPs) in layers of these types."""
        p = sum(r.params for r in self.rows if r.type in types)
        f = sum(r.flops for r in self.rows if r.type in types)
        return 100 * p / max(1, self.total_params), 100 * f / max(1, self.total_flops)

    def _repr_html_(self) -> str:
        rows = [[r.name, r.type, f"{r.params:,}", f"{100 * r.params / max(1, self.total_params):.1f}%",
                 f"{r.flops / 1e6:,.1f}", f"{100 * r.flops / max(1, self.total_flops):.1f}%",
                 f"{r.flops_counted / 1e6:,.1f}", fmt_error(error_percent(r.flops, r.flops_counted))]
                for r in self.rows]
        rows.append(["total", "", f"{self.total_params:,}", "100%", f"{self.total_flops / 1e6:,.1f}", "100%",
                     f"{self.counted_total / 1e6:,.1f}",
                     fmt_error(error_percent(self.total_flops, self.counted_total))])
        t = html_table(["layer", "type", "params", "% params", "MFLOP (formula)", "% FLOPs", "MFLOP (counted)",
                        "formula error"], rows,
                       f"{self.model}, batch {self.batch}, {self.image_size}×{self.image_size}; forward FLOPs, "
                       f"2 per multiply-add; params: numel(); counted: {LABEL_FLOP_COUNTER}")
        cp, cf = self.share(("Conv2d",))
        lp, lf = self.share(("Linear",))
        s = html_table(["layer type", "% of params", "% of FLOPs"],
                       [["Conv2d", f"{cp:.1f}%", f"{cf:.1f}%"], ["Linear (FC)", f"{lp:.1f}%", f"{lf:.1f}%"]],
                       LABEL_FORMULA)
        return t + s

    def __repr__(self) -> str:
        cp, cf = self.share(("Conv2d",))
        return f"ParamsFlops({self.model}, conv: {cp:.1f}% params / {cf:.1f}% FLOPs)"


def params_vs_flops(model: str = "alexnet", batch: int = 1, image_size: int | None = None) -> ParamsFlops:
    """Per layer with parameters: params (numel) and forward FLOPs (formula, and counted by
    FlopCounterMode on the meta device)."""
    from torch.utils.flop_counter import FlopCounterMode
    spec, batch, size, dt = _setup(model, batch, image_size, "float32")
    bd = breakdown(spec, batch, size)
    net = build_model(spec, size, device="meta").eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        net(torch.empty(batch, 3, size, size, device="meta"))
    per_module = counter.get_flop_counts()
    root = type(net).__name__
    rows = []
    for r in bd.layers:
        if not r.params and not r.flops:
            continue
        counted = sum(per_module.get(f"{root}.{r.name}", {}).values())
        rows.append(FlopRow(r.name, r.type, r.params, r.flops, counted))
    return ParamsFlops(spec.name, batch, size, rows, counter.get_total_flops())


def params_flops_figure(r: ParamsFlops) -> Figure:
    """Share of parameters and of FLOPs per layer, side by side."""
    fig = LessonFigure(figsize=(max(6.4, 0.35 * len(r.rows) + 2.5), 3.6), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    xs = range(len(r.rows))
    tp, tf = max(1, r.total_params), max(1, r.total_flops)
    ax.bar([x - 0.2 for x in xs], [100 * row.params / tp for row in r.rows], 0.4, label="% of parameters",
           color=CATEGORY_COLORS["parameters"])
    ax.bar([x + 0.2 for x in xs], [100 * row.flops / tf for row in r.rows], 0.4, label="% of forward FLOPs",
           color="#DD8452")
    ax.set_xticks(list(xs), [f"{row.name}\n{row.type}" for row in r.rows], rotation=90, fontsize=7)
    ax.set_ylabel("% of the model total")
    cp, cf = r.share(("Conv2d",))
    lp, lf = r.share(("Linear",))
    ax.legend(fontsize=8)
    ax.set_title(f"{r.model} {r.image_size}×{r.image_size}: conv {cp:.0f}% params / {cf:.0f}% FLOPs; "
                 f"FC {lp:.0f}% params / {lf:.0f}% FLOPs ({LABEL_FORMULA})", fontsize=9)
    return fig


# --- 4. depthwise-separable vs standard convolution --------------------------------------------------

@dataclass
class BlockMeasure:
    name: str
    params: int
    flops_formula: int
    flops_counted: int
    saved_bytes: int          # tracker: saved for backward at the end of the forward (input included)
    output_bytes: int
    no_grad_peak: int         # tracker: peak of a no_grad forward, not parameters
    train_peak: int           # tracker: peak of a forward with grad, not parameters
    param_bytes: int


@dataclass
class DepthwiseResult(Measured):
    in_channels: int
    out_channels: int
    image_size: int
    batch: int
    bn_relu: bool
    dtype: str
    standard: BlockMeasure
    separable: BlockMeasure
    measurement: Measurement
    saved_formula: dict[str, int]

    @property
    def flops_ratio(self) -> float:
        return self.separable.flops_counted / max(1, self.standard.flops_counted)

    @property
    def saved_ratio(self) -> float:
        return self.separable.saved_bytes / max(1, self.standard.saved_bytes)

    def training_total(self, b: BlockMeasure) -> int:
        """Saved activations + weights + their gradients (what one training step of the
        block adds up to, without optimizer state)."""
        return b.saved_bytes + 2 * b.param_bytes

    def claims(self) -> ClaimReport:
        s, d = self.standard, self.separable
        tot_s, tot_d = self.training_total(s), self.training_total(d)
        more_saved = d.saved_bytes > s.saved_bytes
        more_total = tot_d > tot_s
        if more_total == more_saved:
            total_verdict = _verdict(more_total)
        else:
            total_verdict = "holds for saved activations, breaks for the whole step at this size"
        return ClaimReport(f"Depthwise-separable vs standard ({self.in_channels}→{self.out_channels} channels, "
                           f"{self.image_size}×{self.image_size}, batch {self.batch})", [
            ClaimCheck("a depthwise-separable convolution needs much less computation", "ref 001 (MobileNet)",
                       _verdict(self.flops_ratio < 1), f"formula ratio 1/C_out + 1/9 = "
                       f"{1 / self.out_channels + 1 / 9:.3f}",
                       [Evidence("separable / standard FLOPs", f"×{self.flops_ratio:.3f}", LABEL_FLOP_COUNTER)]),
            ClaimCheck("…but it uses more memory, because every step's output must be saved", "ref 001",
                       _verdict(more_saved),
                       "the separable block also saves its C_in×H×W intermediate"
                       + (" (twice: the depthwise output for BatchNorm and the ReLU output for the 1×1 conv)"
                          if self.bn_relu else "") + "; this holds at every size",
                       [Evidence("saved for backward, standard", format_bytes(s.saved_bytes), self.label),
                        Evidence("saved for backward, separable", format_bytes(d.saved_bytes), self.label),
                        Evidence("the same by formula", f"{format_bytes(self.saved_formula['standard'])} vs "
                                 f"{format_bytes(self.saved_formula['separable'])}", LABEL_FORMULA)]),
            ClaimCheck("…so a separable block costs more memory in training", "ref 001 (implied)", total_verdict,
                       "with the weights and their gradients counted, the answer depends on the shape: a large "
                       "feature map makes the saved activations dominate (separable costs more); many channels "
                       "on a small map make the weights dominate (separable costs much less)",
                       [Evidence("saved + weights + grads, standard", format_bytes(tot_s), self.label),
                        Evidence("saved + weights + grads, separable", format_bytes(tot_d), self.label)]),
        ])

    def _repr_html_(self) -> str:
        s, d = self.standard, self.separable
        m = self.measurement
        head = (f"in {self.in_channels} → out {self.out_channels} channels, {self.image_size}×{self.image_size}, "
                f"batch {self.batch}, {self.dtype}"
                + (", each conv followed by BatchNorm + ReLU" if self.bn_relu else "")
                + f" — engine <b>{m.engine}</b> ({html.escape(m.reason)})")

        def row(label, a, b, fmt):
            return [label, fmt(a), fmt(b), f"×{b / a:.3f}" if a else "—"]
        mb = lambda v: format_bytes(v, digits=2)  # noqa: E731
        rows = [row("parameters (numel)", s.params, d.params, lambda v: f"{v:,}"),
                row(f"forward MFLOP ({LABEL_FORMULA})", s.flops_formula, d.flops_formula, lambda v: f"{v / 1e6:,.2f}"),
                row("forward MFLOP (counted)", s.flops_counted, d.flops_counted, lambda v: f"{v / 1e6:,.2f}"),
                row(f"saved for backward ({m.label})", s.saved_bytes, d.saved_bytes, mb),
                row(f"saved for backward ({LABEL_FORMULA})", self.saved_formula["standard"],
                    self.saved_formula["separable"], mb),
                row("output", s.output_bytes, d.output_bytes, mb),
                row("peak of a no_grad forward (not parameters)", s.no_grad_peak, d.no_grad_peak, mb),
                row("peak of a forward with grad (not parameters)", s.train_peak, d.train_peak, mb),
                row("saved + weights + gradients", self.training_total(s), self.training_total(d), mb)]
        t = html_table(["quantity", "standard 3×3 conv", "depthwise-separable", "separable / standard"], rows,
                       "the block input counts as saved (inside a network it is the previous layer's output)")
        return head + t

    def __repr__(self) -> str:
        return (f"DepthwiseResult({self.in_channels}->{self.out_channels}, {self.image_size}px: FLOPs ×"
                f"{self.flops_ratio:.3f}, saved ×{self.saved_ratio:.2f})")


def depthwise_saved_formula(cin: int, cout: int, hw: int, batch: int, bn_relu: bool, dtype) -> dict[str, int]:
    """What autograd saves, by formula (bytes), input included.

    A conv saves its input (for the weight gradient); BatchNorm saves its input and two
    per-channel statistics (mean and inverse std); an in-place ReLU saves its output, which is
    also the next conv's input, so it is counted once. BatchNorm's running statistics are saved
    too, but they are buffers, not activations.
    NB: the statistics are taken in the input dtype, as this torch's CPU and meta kernels keep
    them; CUDA kernels may keep them in float32 for 16-bit inputs (2·C·2 bytes more per layer)."""
    b = parse_dtype(dtype).itemsize
    plane = batch * hw * hw * b
    if not bn_relu:
        return {"standard": cin * plane, "separable": 2 * cin * plane}
    stats = lambda c: 2 * c * b  # noqa: E731
    std = cin * plane + cout * plane + cout * plane + stats(cout)
    sep = cin * plane + 2 * cin * plane + 2 * cout * plane + stats(cin) + stats(cout)
    return {"standard": std, "separable": sep}


def depthwise_vs_standard(in_channels: int = 64, out_channels: int = 128, image_size: int = 56, batch: int = 8,
                          bn_relu: bool = True, dtype: str | torch.dtype = "float32",
                          engine: str = "auto") -> DepthwiseResult:
    """Both blocks on the same input, measured on an engine: saved-for-backward bytes at the end
    of a forward with grad, the peak of a no_grad forward, params and FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode
    for k, v in (("in channels", in_channels), ("out channels", out_channels), ("image size", image_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{k} must be a positive integer, got {v!r}")
    validate_batch(batch)
    dt = _check_dtype(dtype)
    shape = (batch, in_channels, image_size, image_size)
    builders = {"standard": standard_block, "separable": separable_block}

    flops_formula = {
        "standard": F.conv2d_flops(batch, in_channels, out_channels, (image_size, image_size), 3),
        "separable": F.conv2d_flops(batch, in_channels, in_channels, (image_size, image_size), 3, groups=in_channels)
        + F.conv2d_flops(batch, in_channels, out_channels, (image_size, image_size), 1)}
    counted = {}
    for k, build in builders.items():
        with torch.device("meta"):
            blk = build(in_channels, out_channels, bn_relu)
        with FlopCounterMode(display=False) as fc, torch.no_grad():
            blk(torch.empty(shape, device="meta"))
        counted[k] = fc.get_total_flops()
    plane = batch * image_size * image_size * dt.itemsize
    predicted_bytes = 8 * (in_channels + out_channels) * plane
    predicted_flops = 2 * sum(counted.values())  # each block runs forward twice (grad, no_grad)

    m = run(depthwise_experiment(in_channels, out_channels, image_size, batch, bn_relu, dt), engine,
            predicted_bytes=predicted_bytes, predicted_flops=predicted_flops,
            **lesson_engine_limits())
    blocks = {k: BlockMeasure(k, v["params"], flops_formula[k], counted[k], v["saved"], v["output"],
                              v["no_grad_peak"], v["grad_peak"], v["param_bytes"]) for k, v in m.value.items()}
    return DepthwiseResult(in_channels, out_channels, image_size, batch, bn_relu, dtype_name(dt),
                           blocks["standard"], blocks["separable"], m,
                           depthwise_saved_formula(in_channels, out_channels, image_size, batch, bn_relu, dt))


def depthwise_figure(r: DepthwiseResult) -> Figure:
    """Three panels: parameters, forward FLOPs, saved-for-backward memory."""
    fig = LessonFigure(figsize=(8.0, 3.2), dpi=100, layout="constrained")
    axes = fig.subplots(1, 3)
    s, d = r.standard, r.separable
    items = [("parameters (K)", s.params / 1e3, d.params / 1e3),
             ("forward FLOPs (MFLOP)", s.flops_counted / 1e6, d.flops_counted / 1e6),
             ("saved for backward (MiB)", s.saved_bytes / MiB, d.saved_bytes / MiB)]
    for ax, (title, a, b) in zip(axes, items):
        bars = ax.bar(["standard", "separable"], [a, b], color=["#4C72B0", "#55A868"])
        for bar, v in zip(bars, [a, b]):
            ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:,.2f}", ha="center", va="bottom", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.margins(y=0.18)
        ax.tick_params(labelsize=8)
    fig.suptitle(f"{r.in_channels}→{r.out_channels} ch, {r.image_size}×{r.image_size}, batch {r.batch}, {r.dtype}"
                 f"{' +BN+ReLU' if r.bn_relu else ''}; memory: {r.label}; FLOPs: counted", fontsize=9)
    return fig


# --- 5. the articles' modelsize() vs what autograd saves ------------------------------------------

def modelsize_output_shapes(model: str | ModelSpec, batch: int = 1, image_size: int | None = None) -> list[list[int]]:
    """The output shape of every leaf module in execution order, skipping ``ReLU(inplace=True)``:
    what the articles' ``modelsize()`` collects (meta device, shapes only)."""
    spec = resolve_model(model)
    size = image_size or spec.default_image_size
    net = build_model(spec, size, device="meta")
    x = torch.empty(batch, 3, size, size, device="meta")
    rows: list[LayerOut] = []
    handles = _trace(net, x, rows)
    try:
        with torch.no_grad():
            net(x)
    finally:
        _remove(handles)
    return [r.output_shape for r in rows if not (r.type == "ReLU" and r.inplace)]


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
                       dtype: str | torch.dtype = "float32", engine: str = "auto") -> ModelsizeComparison:
    """Each model at its default image size: the articles' estimate against a tracked forward."""
    dt = _check_dtype(dtype)
    validate_batch(batch)
    rows = []
    for model in models:
        spec, _, size, _ = _setup(model, batch, None, dt)
        shapes = modelsize_output_shapes(spec, batch, size)
        est = F.modelsize_activation_bytes(shapes, dt)
        predicted = _predicted(spec, batch, size, dt)
        tr = _forward_run(spec, batch, size, dt, True, engine, predicted, backward=True)
        inf = _forward_run(spec, batch, size, dt, False, engine, predicted)
        input_bytes = batch * 3 * size * size * dt.itemsize
        rows.append(ModelsizeRow(spec.name, size, tr.measurement.engine, tr.measurement.label, est, tr.saved_bytes,
                                 tr.saved_bytes + input_bytes, tr.saved_by_dtype, inf.peak_non_param,
                                 tr.peak_non_param, tr.backward_peak, est // 2))
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
        return (f"Layer outputs for one 224×224 float32 image: the first block {format_bytes(d['first block'])}, the "
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
