"""Lesson 02: where parameters live, checked layer by layer.

* ``layer_params(kind, ...)``: one layer (Conv2d, Linear, BatchNorm2d, LayerNorm, Embedding)
  built for real on an engine; its parameter and buffer tensors next to the formulas of
  ``gpulab.formulas`` written out in full.
* ``model_params(model, dtype)``: every leaf layer of a lesson model, formula vs ``numel()``,
  parameters vs buffers, and the weight memory in every dtype.

The counts are exact, so "measured" and "formula" must agree to the element; any
difference is a bug in a formula (the tests check that). What *is* measured is the memory:
the engine builds the model and the tracker sees each parameter and buffer storage.
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from torch import nn

from gpulab import formulas as F
from gpulab.measure.engines import LABEL_FORMULA, Measured, Measurement, RunContext, run
# The measuring core lives in the library (gpulab record runs it too).
from gpulab.record.runs.params import LAYER_KINDS, build_experiment, layer_experiment, make_layer
from gpulab.record.runs.params import live_by_category as _live_by_category
from gpulab.predict.breakdown import params_by_formula
from gpulab.models.registry import ModelSpec, build_model, resolve_model
from gpulab.plots import LessonFigure
from gpulab.categories import Category
from gpulab.units import GB, GiB, MiB, dtype_bytes, dtype_name, format_bytes, parse_dtype
from gpulab.views import error_percent, fmt_error, html_table

__all__ = [
    "BuffersDemo", "LESSON_MAX_CPU_BYTES", "LESSON_MAX_CPU_FLOPS", "LayerParams", "MODEL_DTYPES",
    "ModelParams", "NUMEL_LABEL", "ParamRow", "TABLE_DTYPES", "TYPE_COLORS", "TensorRow",
    "article_params", "buffer_bytes_by_formula", "conv_linear_params", "dtype_figure", "exercise",
    "exercise_conv_or_linear", "formula_text", "layer_figure", "layer_memory_bytes",
    "layer_param_count", "layer_params", "lesson_engine_limits", "model_layers_figure",
    "model_params", "parameter_claims", "params_vs_buffers"
]

MODEL_DTYPES = ("float32", "bfloat16", "float16", "float64")
# the dtypes of the "weight memory by dtype" table (formula: params x bytes per element)
TABLE_DTYPES = ("float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "int8")

# Lesson panels answer in about a second. Building a model on the CPU initialises every
# weight (VGG16's 138 M take several seconds on a 2-core CPU), so the lessons send models
# whose weights and outputs are predicted above this size to the fake engine when the
# engine is "auto". An explicit engine="cpu" is always honoured.
LESSON_MAX_CPU_BYTES = 192 * MiB
LESSON_MAX_CPU_FLOPS = 10 * 10**9

NUMEL_LABEL = "numel() of the real module"


def lesson_engine_limits() -> dict[str, int]:
    return {"max_cpu_bytes": LESSON_MAX_CPU_BYTES, "max_cpu_flops": LESSON_MAX_CPU_FLOPS}


# --- formulas written out -------------------------------------------------------------------

def formula_text(module: nn.Module) -> str:
    """The parameter formula of a leaf layer with its numbers filled in, e.g.
    ``"64×3×3×3 + 64"`` for Conv2d(3, 64, 3); "0" for layers without parameters;
    "" for a type gpulab has no formula for."""
    if isinstance(module, nn.Conv2d):
        kh, kw = module.kernel_size
        g = module.groups
        cin = f"({module.in_channels}/{g})" if g > 1 else f"{module.in_channels}"
        s = f"{module.out_channels}×{cin}×{kh}×{kw}"
        return s + (f" + {module.out_channels}" if module.bias is not None else "")
    if isinstance(module, nn.Linear):
        s = f"{module.in_features}×{module.out_features}"
        return s + (f" + {module.out_features}" if module.bias is not None else "")
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return f"2×{module.num_features}" if module.affine else "0 (affine=False)"
    if isinstance(module, nn.LayerNorm):
        n = F.numel(module.normalized_shape)
        if not module.elementwise_affine:
            return "0 (elementwise_affine=False)"
        return f"2×{n}" if getattr(module, "bias", None) is not None else f"{n}"
    if isinstance(module, nn.Embedding):
        return f"{module.num_embeddings}×{module.embedding_dim}"
    if not any(True for _ in module.parameters(recurse=False)):
        return "0"
    return ""


def article_params(module: nn.Module) -> int | None:
    """The reference articles' per-layer formulas, which leave out biases:
    Conv2d Cin×Cout×K×K, Linear M×N, BatchNorm 2N, Embedding N×W.

    NB: the articles' Conv2d formula also has no ``groups``; it is taken as written
    (Cin×Cout×K×K), so it overcounts a grouped or depthwise conv by the factor ``groups``."""
    if isinstance(module, nn.Conv2d):
        kh, kw = module.kernel_size
        return module.in_channels * module.out_channels * kh * kw
    if isinstance(module, nn.Linear):
        return module.in_features * module.out_features
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return 2 * module.num_features
    if isinstance(module, nn.Embedding):
        return module.num_embeddings * module.embedding_dim
    if isinstance(module, nn.LayerNorm):
        return None  # the articles give no LayerNorm formula
    if not any(True for _ in module.parameters(recurse=False)):
        return 0
    return None


def buffer_bytes_by_formula(module: nn.Module) -> int:
    """Bytes of a leaf layer's buffers by formula (BatchNorm's running statistics)."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        dt = module.running_mean.dtype if module.running_mean is not None else torch.float32
        return F.batchnorm_buffer_bytes(module.num_features, dt, module.track_running_stats)
    return 0


def _config(module: nn.Module) -> str:
    """A short constructor-like description, e.g. ``Conv2d(3, 64, k=3)``."""
    t = type(module).__name__
    if isinstance(module, nn.Conv2d):
        extra = f", groups={module.groups}" if module.groups > 1 else ""
        extra += "" if module.bias is not None else ", bias=False"
        return f"{t}({module.in_channels}, {module.out_channels}, k={module.kernel_size[0]}{extra})"
    if isinstance(module, nn.Linear):
        nob = "" if module.bias is not None else ", bias=False"
        return f"{t}({module.in_features}, {module.out_features}{nob})"
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return f"{t}({module.num_features})"
    if isinstance(module, nn.LayerNorm):
        return f"{t}({list(module.normalized_shape)})"
    if isinstance(module, nn.Embedding):
        return f"{t}({module.num_embeddings}, {module.embedding_dim})"
    return t


# --- one layer ----------------------------------------------------------------------------------

@dataclass
class TensorRow:
    name: str
    kind: str            # "parameter" or "buffer"
    shape: list[int]
    dtype: str
    numel: int
    nbytes: int          # storage bytes the tracker saw


class _LiveBytes:
    """Parameter and buffer bytes the tracker saw alive once the model was built (``live``)."""
    live: dict[str, int]

    @property
    def param_bytes_measured(self) -> int:
        return self.live.get(Category.PARAMETERS.value, 0)

    @property
    def buffer_bytes_measured(self) -> int:
        return self.live.get(Category.BUFFERS.value, 0)


@dataclass
class LayerParams(_LiveBytes, Measured):
    """One layer: its tensors as built, next to the formulas."""
    kind: str
    config: str
    module_repr: str
    dtype: str
    formula: str
    params_formula: int
    params_numel: int
    article_formula: int | None
    param_bytes_formula: int
    buffer_bytes_formula: int
    tensors: list[TensorRow]
    measurement: Measurement
    formula_label: str = LABEL_FORMULA
    live: dict[str, int] = field(default_factory=dict)  # tracker: live bytes by category, once built

    def _repr_html_(self) -> str:
        m = self.measurement
        head = (f"<b>{html.escape(self.module_repr)}</b> in {self.dtype} — engine <b>{m.engine}</b> "
                f"({html.escape(m.reason)})")
        summary = html_table(
            ["quantity", "formula", f"{NUMEL_LABEL} / {m.label}", "formula error"],
            [["parameters (count)", f"{self.formula} = {self.params_formula:,}", f"{self.params_numel:,}",
              fmt_error(error_percent(self.params_formula, self.params_numel))],
             ["formula of refs 000, 001, 003 (no bias)",
              "—" if self.article_formula is None else f"{self.article_formula:,}", f"{self.params_numel:,}",
              fmt_error(error_percent(self.article_formula, self.params_numel))],
             ["parameter memory", format_bytes(self.param_bytes_formula, digits=2),
              format_bytes(self.param_bytes_measured, digits=2),
              fmt_error(error_percent(self.param_bytes_formula, self.param_bytes_measured))],
             ["buffer memory", format_bytes(self.buffer_bytes_formula, digits=2),
              format_bytes(self.buffer_bytes_measured, digits=2),
              fmt_error(error_percent(self.buffer_bytes_formula, self.buffer_bytes_measured))]],
            f"memory: {m.label}; counts: {NUMEL_LABEL}; binary units (1 KiB = 1024 B)")
        tensors = html_table(["tensor", "kind", "shape", "dtype", "numel", "bytes"],
                             [[t.name, t.kind, "×".join(map(str, t.shape)) or "scalar", t.dtype,
                               f"{t.numel:,}", f"{t.nbytes:,} B"] for t in self.tensors],
                             f"every tensor of the layer ({m.label})")
        return head + summary + tensors

    def __repr__(self) -> str:
        return (f"LayerParams({self.config}, {self.dtype}, params={self.params_numel:,}, "
                f"formula={self.params_formula:,}, engine={self.measurement.engine})")


def layer_params(kind: str = "Conv2d", in_size: int = 64, out_size: int = 128, kernel: int = 3,
                 groups: int = 1, bias: bool = True, dtype: str | torch.dtype = "float32",
                 engine: str = "auto") -> LayerParams:
    """Build one layer on an engine and compare its tensors with the formulas."""
    dt = parse_dtype(dtype)
    if not dt.is_floating_point:
        raise ValueError(f"layers are built in a floating-point dtype, not {dtype_name(dt)}")
    meta = _build_layer_on("meta", dt, kind, in_size, out_size, kernel, groups, bias)
    n_formula = params_by_formula(meta)
    predicted = n_formula * dt.itemsize + buffer_bytes_by_formula(meta)

    def tensor_rows(layer: nn.Module) -> list[TensorRow]:
        rows = [TensorRow(n, "parameter", list(p.shape), dtype_name(p.dtype), p.numel(),
                          p.untyped_storage().nbytes()) for n, p in layer.named_parameters()]
        rows += [TensorRow(n, "buffer", list(b.shape), dtype_name(b.dtype), b.numel(),
                           b.untyped_storage().nbytes()) for n, b in layer.named_buffers()]
        return rows

    m = run(layer_experiment(dt, kind, in_size, out_size, kernel, groups, bias, tensor_rows), engine,
            predicted_bytes=predicted, **lesson_engine_limits())
    return LayerParams(
        kind=type(meta).__name__, config=_config(meta), module_repr=repr(meta), dtype=dtype_name(dt),
        formula=formula_text(meta), params_formula=n_formula,
        params_numel=sum(t.numel for t in m.value[0] if t.kind == "parameter"),
        article_formula=article_params(meta), param_bytes_formula=n_formula * dt.itemsize,
        buffer_bytes_formula=buffer_bytes_by_formula(meta), tensors=m.value[0], measurement=m,
        live=m.value[1])


def _build_layer_on(device, dt: torch.dtype, *args) -> nn.Module:
    return make_layer(*args, device=device, dtype=dt)


def layer_figure(result: LayerParams) -> Figure:
    """Parameter and buffer bytes of one layer: formula vs measurement, per tensor kind."""
    fig = LessonFigure(figsize=(6.4, 3.2), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    keys = ["parameters", "buffers"]
    pv = [result.param_bytes_formula, result.buffer_bytes_formula]
    mv = [result.param_bytes_measured, result.buffer_bytes_measured]
    unit, uname = _unit_for(max(pv + mv + [1]))
    xs = range(len(keys))
    ax.bar([x - 0.2 for x in xs], [v / unit for v in pv], 0.4, label=LABEL_FORMULA, color="#999999")
    ax.bar([x + 0.2 for x in xs], [v / unit for v in mv], 0.4, label=result.label, color=["#4C72B0", "#8172B3"])
    for x, p, v in zip(xs, pv, mv):
        txt = f"{v:,} B\nerror {fmt_error(error_percent(p, v))}" if v or p else "none"
        ax.text(x, max(p, v) / unit, txt, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), keys)
    ax.set_ylabel(f"memory ({uname})")
    ax.set_ylim(0, 1.3 * max(pv + mv + [1]) / unit)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncols=2)
    ax.set_title(f"{result.config}, {result.dtype}: formula vs {result.label}", fontsize=9)
    return fig


def _unit_for(nbytes: float) -> tuple[int, str]:
    if nbytes >= MiB:
        return MiB, "MiB"
    if nbytes >= 1024:
        return 1024, "KiB"
    return 1, "B"


# --- a whole model --------------------------------------------------------------------------------

@dataclass
class ParamRow:
    name: str
    type: str
    config: str
    formula: str
    params_formula: int | None
    params_numel: int
    article_formula: int | None
    buffer_bytes: int          # measured: storage bytes of the layer's own buffers
    buffer_bytes_formula: int

    @property
    def agrees(self) -> bool:
        return self.params_formula == self.params_numel


@dataclass
class ModelParams(_LiveBytes, Measured):
    """Every leaf layer of a model, formula vs numel(), and the model's weight memory."""
    model: str
    dtype: str
    rows: list[ParamRow]
    measurement: Measurement
    by_dtype: dict[str, int] = field(default_factory=dict)   # formula: params x bytes per element
    formula_label: str = LABEL_FORMULA
    live: dict[str, int] = field(default_factory=dict)  # tracker: live bytes by category, once built

    # ---- totals ----
    @property
    def total_numel(self) -> int:
        return sum(r.params_numel for r in self.rows)

    @property
    def total_formula(self) -> int:
        return sum(r.params_formula or 0 for r in self.rows)

    @property
    def total_article(self) -> int:
        return sum(r.article_formula or 0 for r in self.rows)

    @property
    def param_bytes_formula(self) -> int:
        return self.total_formula * dtype_bytes(self.dtype)

    @property
    def buffer_bytes_formula(self) -> int:
        return sum(r.buffer_bytes_formula for r in self.rows)

    @property
    def mismatches(self) -> list[ParamRow]:
        return [r for r in self.rows if not r.agrees]

    def params_by_type(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.rows:
            if r.params_numel:
                out[r.type] = out.get(r.type, 0) + r.params_numel
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "dtype": self.dtype, "engine": self.measurement.engine,
                "label": self.label, "total_params": self.total_numel, "total_formula": self.total_formula,
                "total_article": self.total_article, "param_bytes_formula": self.param_bytes_formula,
                "param_bytes_measured": self.param_bytes_measured,
                "buffer_bytes_formula": self.buffer_bytes_formula,
                "buffer_bytes_measured": self.buffer_bytes_measured, "by_dtype": dict(self.by_dtype)}

    def _repr_html_(self, max_rows: int = 80) -> str:
        m = self.measurement
        head = (f"<b>{html.escape(self.model)}</b> in {self.dtype} — engine <b>{m.engine}</b> "
                f"({html.escape(m.reason)})")
        bias_gap = self.total_numel - self.total_article
        summary = html_table(
            ["quantity", "formula", f"{NUMEL_LABEL} / {m.label}", "formula error"],
            [["parameters (count)", f"{self.total_formula:,}", f"{self.total_numel:,}",
              fmt_error(error_percent(self.total_formula, self.total_numel))],
             ["formulas of refs 000, 001, 003 (no bias)", f"{self.total_article:,}", f"{self.total_numel:,}",
              fmt_error(error_percent(self.total_article, self.total_numel))],
             ["parameter memory", format_bytes(self.param_bytes_formula, digits=2),
              format_bytes(self.param_bytes_measured, digits=2),
              fmt_error(error_percent(self.param_bytes_formula, self.param_bytes_measured))],
             ["buffer memory (BatchNorm running stats)", format_bytes(self.buffer_bytes_formula, digits=2),
              format_bytes(self.buffer_bytes_measured, digits=2),
              fmt_error(error_percent(self.buffer_bytes_formula, self.buffer_bytes_measured))]],
            f"{len(self.rows)} leaf layers; {len(self.mismatches)} disagree with their formula; "
            f"the bias-free formulas of refs 000, 001, 003 (docs/references.md) miss {bias_gap:,} parameters; binary units")
        rows = [[r.name, r.config, r.formula or "(no formula)",
                 "—" if r.params_formula is None else f"{r.params_formula:,}", f"{r.params_numel:,}",
                 "✓" if r.agrees else "✗", format_bytes(r.buffer_bytes) if r.buffer_bytes else ""]
                for r in self.rows[:max_rows]]
        if len(self.rows) > max_rows:
            rows.append([f"… {len(self.rows) - max_rows} more layers", "", "", "", "", "", ""])
        layers = html_table(["layer", "config", "formula", "= params (formula)", f"numel()", "agree",
                             "buffers"], rows, f"layer by layer; memory {m.label}")
        dtypes = html_table(["dtype", "bytes/element", "weight memory (formula)", "(decimal)"],
                            [[d, dtype_bytes(d), format_bytes(b, digits=1), format_bytes(b, "decimal", 1)]
                             for d, b in self.by_dtype.items()],
                            f"{self.total_numel:,} parameters × bytes per element ({LABEL_FORMULA})")
        return head + summary + layers + dtypes

    def __repr__(self) -> str:
        return (f"ModelParams({self.model}, {self.dtype}, params={self.total_numel:,}, "
                f"engine={self.measurement.engine})")


def model_params(model: str | ModelSpec = "vgg16", dtype: str | torch.dtype = "float32",
                 engine: str = "auto") -> ModelParams:
    """Build ``model`` on an engine; per leaf layer: formula vs numel(), buffers; totals
    measured by the tracker (parameters and buffers categories)."""
    spec = resolve_model(model)
    dt = parse_dtype(dtype)
    if dtype_name(dt) not in MODEL_DTYPES:
        raise ValueError(f"models are built in one of {', '.join(MODEL_DTYPES)}, not {dtype_name(dt)}")
    meta = build_model(spec, device="meta", dtype=dt)
    predicted = sum(p.numel() for p in meta.parameters()) * dt.itemsize

    def param_rows(net: nn.Module) -> list[ParamRow]:
        rows = []
        for name, mod in net.named_modules():
            if any(True for _ in mod.children()):
                continue
            rows.append(ParamRow(
                name=name, type=type(mod).__name__, config=_config(mod), formula=formula_text(mod),
                params_formula=params_by_formula(mod),
                params_numel=sum(p.numel() for p in mod.parameters(recurse=False)),
                article_formula=article_params(mod),
                buffer_bytes=sum(b.untyped_storage().nbytes() for b in mod.buffers(recurse=False)),
                buffer_bytes_formula=buffer_bytes_by_formula(mod)))
        return rows

    m = run(build_experiment(spec, dt, param_rows), engine, predicted_bytes=predicted, **lesson_engine_limits())
    rows, live = m.value
    total = sum(r.params_numel for r in rows)
    by_dtype = {d: total * dtype_bytes(d) for d in TABLE_DTYPES}
    return ModelParams(spec.name, dtype_name(dt), rows, m, by_dtype, live=live)


def layer_param_count(model: str | ModelSpec, layer: str) -> int:
    """numel() of one named layer's own parameters (meta device: no memory, no compute).
    The lessons' exercises use it to compute expected answers."""
    spec = resolve_model(model)
    net = build_model(spec, device="meta")
    mods = dict(net.named_modules())
    if layer not in mods:
        raise ValueError(f"{spec.name} has no layer {layer!r}")
    return sum(p.numel() for p in mods[layer].parameters(recurse=False))


def layer_memory_bytes(kind: str, dtype: str = "float32", **sizes: Any) -> int:
    """Parameter plus buffer bytes of one layer, built on the meta device (storage sizes
    of the real module). Used for expected answers of exercises."""
    dt = parse_dtype(dtype)
    layer = _build_layer_on("meta", dt, kind, sizes.get("in_size", 64), sizes.get("out_size", 128),
                            sizes.get("kernel", 3), sizes.get("groups", 1), sizes.get("bias", True))
    return (sum(p.untyped_storage().nbytes() for p in layer.parameters())
            + sum(b.untyped_storage().nbytes() for b in layer.buffers()))


# --- figures -----------------------------------------------------------------------------------

TYPE_COLORS = {"Conv2d": "#4C72B0", "Linear": "#DD8452", "BatchNorm2d": "#8172B3", "LayerNorm": "#55A868",
               "Embedding": "#C44E52"}


def model_layers_figure(result: ModelParams) -> Figure:
    """Parameters per layer with parameters (log scale), coloured by layer type; the
    formula is drawn as a black tick on each bar (it lands on the top when they agree)."""
    rows = [r for r in result.rows if r.params_numel]
    fig = LessonFigure(figsize=(max(6.4, 0.22 * len(rows) + 2.5), 3.8), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    xs = range(len(rows))
    ax.bar(list(xs), [r.params_numel for r in rows], 0.8,
           color=[TYPE_COLORS.get(r.type, "#937860") for r in rows])
    ax.scatter(list(xs), [r.params_formula or 0 for r in rows], marker="_", s=120, color="k", zorder=3,
               label=f"{LABEL_FORMULA}")
    ax.set_yscale("log")
    ax.set_ylabel("parameters (count, log scale)")
    ax.set_xticks(list(xs), [r.name for r in rows], rotation=90, fontsize=7)
    handles = [Patch(color=c, label=t) for t, c in TYPE_COLORS.items() if any(r.type == t for r in rows)]
    handles.append(ax.collections[0])
    ax.legend(handles=handles, fontsize=7, loc="upper left", ncols=3)
    total = result.total_numel
    ax.set_title(f"{result.model}: {total:,} parameters per layer\nbars: {NUMEL_LABEL} ({result.label})",
                 fontsize=9)
    return fig


def dtype_figure(result: ModelParams) -> Figure:
    """Weight memory of the model in each dtype (formula), with the measured bytes for the
    dtype the model was built in."""
    fig = LessonFigure(figsize=(6.4, 3.2), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    names = list(result.by_dtype)
    vals = [result.by_dtype[d] / MiB for d in names]
    bars = ax.bar(range(len(names)), vals, 0.6, color="#999999", label=LABEL_FORMULA)
    for b, v in zip(bars, vals):
        ax.text(b.get_x() + b.get_width() / 2, v, f"{v:,.1f}", ha="center", va="bottom", fontsize=7)
    if result.dtype in names:
        i = names.index(result.dtype)
        ax.bar([i + 0.35], [result.param_bytes_measured / MiB], 0.25, color="#4C72B0",
               label=f"measured: {result.label}")
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("weight memory (MiB)")
    ax.margins(y=0.15)
    ax.legend(fontsize=8)
    ax.set_title(f"{result.model}: {result.total_numel:,} parameters × bytes per element", fontsize=9)
    return fig


# --- predict-first exercises ---------------------------------------------------------------------

def exercise(name: str):
    """The lesson's predict-first exercises; expected values are computed here, when checked.

    * ``"vgg16_conv"``: parameters of VGG16's ``features.10``, Conv2d(128, 256, 3).
    * ``"batchnorm_bytes"``: bytes of BatchNorm2d(256) in float32, parameters and buffers.
    """
    from gpulab.course.exercises import Exercise
    if name == "vgg16_conv":
        layer = dict(build_model(resolve_model("vgg16"), device="meta").named_modules())["features.10"]
        return Exercise(
            question=f"How many parameters does VGG16's features.10, {_config(layer)}, have?",
            expected=lambda: layer_param_count("vgg16", "features.10"),
            explain=f"out × in × kh × kw weights plus one bias per output channel: {formula_text(layer)}.",
            unit="parameters",
            hint="Each output channel has one kh×kw filter per input channel, and one bias.",
            ratio_hint="each output channel has one kh×kw filter per input channel, and one bias.")
    if name == "batchnorm_bytes":
        bn = make_layer("BatchNorm2d", out_size=256, device="meta")
        return Exercise(
            question=f"{_config(bn)} in float32: how many bytes do its parameters and buffers hold together?",
            expected=lambda: layer_memory_bytes("BatchNorm2d", "float32", out_size=256),
            explain=(f"parameters {formula_text(bn)} (weight and bias) and buffers running_mean and "
                     f"running_var (N each), all 4 bytes, plus num_batches_tracked, one int64 (8 bytes)."),
            unit="bytes",
            hint="Parameters are only half of it: BatchNorm also keeps running statistics as buffers.")
    raise ValueError(f"unknown exercise {name!r}; valid: vgg16_conv, batchnorm_bytes")


def conv_linear_params(model: str | ModelSpec = "vgg16") -> dict[str, int]:
    """Parameters of the model's Conv2d layers and of its Linear layers (counted on the meta device)."""
    net = build_model(resolve_model(model), device="meta")
    out = {"Conv2d": 0, "Linear": 0}
    for m in net.modules():
        for kind, cls in (("Conv2d", nn.Conv2d), ("Linear", nn.Linear)):
            if isinstance(m, cls):
                out[kind] += sum(p.numel() for p in m.parameters(recurse=False))
    return out


def exercise_conv_or_linear(model: str = "vgg16"):
    """Predict-first (qualitative): which layers hold more of the model's parameters, the conv layers
    or the fully connected ones? Counted on the real model (meta device) when the checker runs."""
    from gpulab.course.exercises import ChoiceExercise

    def expected() -> str:
        c = conv_linear_params(model)
        if abs(c["Conv2d"] - c["Linear"]) <= 0.1 * max(c.values()):
            return "c"
        return "a" if c["Conv2d"] > c["Linear"] else "b"

    def explain() -> str:
        c = conv_linear_params(model)
        net = build_model(resolve_model(model), device="meta")
        first = next(m for m in net.modules() if isinstance(m, nn.Linear))
        n_first = sum(p.numel() for p in first.parameters())
        return (f"Conv2d layers: {c['Conv2d']:,} parameters; Linear layers: {c['Linear']:,} (counted on the real "
                f"model, {NUMEL_LABEL}). A conv's weights do not depend on the image size, only on channels × "
                f"kernel, so thirteen convs hold {c['Conv2d'] / 1e6:.1f} M. The first Linear, {_config(first)}, "
                f"connects every value of the flattened 512×7×7 map to every output: {n_first:,} parameters, "
                f"{n_first / sum(c.values()):.0%} of the model on its own.")

    return ChoiceExercise(
        question=f"In {model.upper()}, which layers hold more parameters: the 13 conv layers or the 3 fully connected ones?",
        options={"a": "the conv layers", "b": "the fully connected (Linear) layers", "c": "about the same"},
        expected=expected, explain=explain)


# --- parameters vs buffers ------------------------------------------------------------------------

@dataclass
class BuffersDemo(Measured):
    """One training step of a model with BatchNorm: what parameters and buffers each get."""
    model: str
    batch: int
    measurement: Measurement
    param_tensors: int
    params_with_grad: int
    buffer_tensors: int
    buffers_requiring_grad: int
    buffers_changed: list[str] | None     # None on the fake engine (no values to compare)
    live: dict[str, int]                  # tracker: live bytes by category after the step

    def _repr_html_(self) -> str:
        m = self.measurement
        changed = ("not known on fake tensors (no values)" if self.buffers_changed is None
                   else f"{len(self.buffers_changed)} of {self.buffer_tensors}")
        rows = [["tensors", f"{self.param_tensors}", f"{self.buffer_tensors}"],
                ["requires_grad / got a .grad after backward", f"{self.params_with_grad} of {self.param_tensors}",
                 f"{self.buffers_requiring_grad} of {self.buffer_tensors}"],
                ["seen by the optimizer (model.parameters())", "all", "none"],
                ["changed by the forward pass (train mode)", "no", changed],
                ["memory", format_bytes(self.live.get("parameters", 0), digits=2),
                 format_bytes(self.live.get("buffers", 0), digits=2)],
                ["gradient memory", format_bytes(self.live.get("gradients", 0), digits=2), "0 B"]]
        return (f"<b>{html.escape(self.model)}</b>, one forward + backward, batch {self.batch} — engine "
                f"<b>{m.engine}</b> ({html.escape(m.reason)})"
                + html_table(["", "parameters", "buffers"], rows, f"{m.label}; binary units"))

    def __repr__(self) -> str:
        return (f"BuffersDemo({self.model}: {self.param_tensors} parameters, {self.buffer_tensors} buffers, "
                f"engine={self.measurement.engine})")


def params_vs_buffers(model: str | ModelSpec = "cnn", batch: int = 8, engine: str = "auto") -> BuffersDemo:
    """Forward and backward once in train mode: parameters get gradients, buffers (BatchNorm's
    running statistics) get none but are updated by the forward itself."""
    spec = resolve_model(model)
    size = spec.default_image_size
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch size must be a positive integer, got {batch!r}")
    meta = build_model(spec, device="meta")
    predicted = 2 * sum(p.numel() for p in meta.parameters()) * 4

    def experiment(ctx: RunContext) -> dict[str, Any]:
        with ctx.phase("setup"):
            net = build_model(spec, device=ctx.device).train()
            ctx.tracker.register(model=net)
            x = ctx.label(torch.randn(batch, 3, size, size, device=ctx.device))
        before = None if ctx.engine == "fake" else {n: b.clone() for n, b in net.named_buffers()}
        net(x).sum().backward()
        changed = None if before is None else [n for n, b in net.named_buffers() if not torch.equal(b, before[n])]
        del before
        return {"params": [p.grad is not None for p in net.parameters()],
                "buffers": [b.requires_grad for b in net.buffers()], "changed": changed,
                "live": _live_by_category(ctx)}

    m = run(experiment, engine, predicted_bytes=predicted, **lesson_engine_limits())
    v = m.value
    return BuffersDemo(spec.name, batch, m, len(v["params"]), sum(v["params"]), len(v["buffers"]),
                       sum(v["buffers"]), v["changed"], v["live"])


# --- the articles' claims -------------------------------------------------------------------------

def parameter_claims(engine: str = "auto"):
    """The reference articles' per-layer parameter formulas and weight-memory rules, tested."""
    from gpulab.course.claims import BREAKS, HOLDS, ClaimCheck, ClaimReport, Evidence
    vgg = model_params("vgg16", "float32", engine)
    vgg16h = model_params("vgg16", "float16", engine)
    alex = model_params("alexnet", "float32", engine)
    res = model_params("resnet18", "float32", engine)
    dw = layer_params("Conv2d", 32, 32, 3, groups=32, bias=False, engine=engine)
    emb = layer_params("Embedding", 1000, 64, engine=engine)

    def of(r: ModelParams, t: str) -> tuple[int, int]:
        rows = [x for x in r.rows if x.type == t]
        return sum(x.article_formula or 0 for x in rows), sum(x.params_numel for x in rows)

    conv_a, conv_n = of(vgg, "Conv2d")
    fc_a, fc_n = of(vgg, "Linear")
    bn_a, bn_n = of(res, "BatchNorm2d")
    free = [x for r in (vgg, alex) for x in r.rows if x.type in ("ReLU", "MaxPool2d", "Dropout", "AdaptiveAvgPool2d")]
    n = vgg.total_numel
    mb, mib = n * 4 / 1e6, n * 4 / MiB
    src = "refs 000, 001 and 003"
    return ClaimReport("Parameter formulas and weight memory", [
        ClaimCheck("Conv2d(Cin, Cout, K) has Cin × Cout × K × K parameters", src,
                   "holds for plain convs without bias, breaks for grouped convs",
                   "the formula leaves out one bias per output channel (a tiny share in VGG16) and has no "
                   "groups: a depthwise conv has Cin/groups input channels per filter, not Cin",
                   [Evidence("VGG16 convs: the formula vs numel()", f"{conv_a:,} vs {conv_n:,} "
                             f"({fmt_error(error_percent(conv_a, conv_n))})", vgg.label),
                    Evidence(f"{dw.config}: the formula vs numel()", f"{dw.article_formula:,} vs {dw.params_numel:,}",
                             dw.label)]),
        ClaimCheck("Linear(M → N) has M × N parameters", src,
                   HOLDS if abs(error_percent(fc_a, fc_n)) < 0.1 else BREAKS,
                   "up to the N biases, which are 0.01% of VGG16's fully connected layers",
                   [Evidence("VGG16 FC layers: the formula vs numel()",
                             f"{fc_a:,} vs {fc_n:,} ({fmt_error(error_percent(fc_a, fc_n))})", vgg.label)]),
        ClaimCheck("BatchNorm(N) has 2N parameters", src, HOLDS if bn_a == bn_n else BREAKS,
                   "γ and β, one each per channel. But BatchNorm holds as much again in buffers "
                   "(running_mean and running_var, plus an int64 counter) that no formula in refs 000, 001 and 003 counts",
                   [Evidence("ResNet-18 BatchNorm layers: 2N vs numel()", f"{bn_a:,} vs {bn_n:,}", res.label),
                    Evidence("ResNet-18 buffers (running statistics)",
                             format_bytes(res.buffer_bytes_measured, digits=2), res.label)]),
        ClaimCheck("Embedding(N, W) has N × W parameters", src,
                   HOLDS if emb.article_formula == emb.params_numel else BREAKS, "one W-long row per token",
                   [Evidence(f"{emb.config}: N × W vs numel()", f"{emb.article_formula:,} vs {emb.params_numel:,}",
                             emb.label)]),
        ClaimCheck("ReLU, pooling and Dropout layers have no parameters", src,
                   HOLDS if all(x.params_numel == 0 for x in free) else BREAKS,
                   "they hold no weights, but their outputs (and what backward saves) take memory: lesson 03",
                   [Evidence("such layers in VGG16 and AlexNet", f"{len(free)} layers, "
                             f"{sum(x.params_numel for x in free)} parameters", vgg.label)]),
        ClaimCheck("parameter memory = parameter count × 4 B in float32 (× 2 in float16, × 8 in double)",
                   "refs 001 and 003",
                   HOLDS if (vgg.param_bytes_measured == 4 * n and vgg16h.param_bytes_measured == 2 * n) else BREAKS,
                   "every parameter is one element of its dtype; nothing else is stored with it",
                   [Evidence("VGG16 float32, measured", format_bytes(vgg.param_bytes_measured, digits=2), vgg.label),
                    Evidence("VGG16 float16, measured", format_bytes(vgg16h.param_bytes_measured, digits=2),
                             vgg16h.label)]),
        ClaimCheck("1 G = 1000 MB, and MB vs MiB need not be told apart in estimates", "refs 001 and 003",
                   "holds in MB, breaks in MiB",
                   f"VGG16's weights are {mb:,.1f} MB but {mib:,.1f} MiB, and nvidia-smi and PyTorch show MiB: "
                   f"a {100 * (mb / mib - 1):.1f}% gap at this size, {100 * (GiB / GB - 1):.1f}% at GiB scale",
                   [Evidence("VGG16 float32 weights", f"{format_bytes(n * 4, 'decimal')} = {format_bytes(n * 4)}",
                             LABEL_FORMULA)]),
    ])
