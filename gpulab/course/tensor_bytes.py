"""Lesson 01's experiments: shape x dtype -> bytes, views and copies, 512-byte rounding.

* ``measure(shape, dtype, operation, engine)``: allocate ``x = torch.empty(shape, dtype)`` on
  an engine, apply an operation (a view, a slice, a copy), delete ``x`` and see which storages
  live, next to the formulas. Returns a ``TensorBytesResult``.
* ``dtype_table(n, engine)``: one tensor of ``n`` elements for every dtype torch defines, its
  measured storage bytes next to ``numel x itemsize``.
* ``rounding_curve(dtype, max_elements, engine)``: what the CUDA caching allocator counts for
  small tensors: formula (``cuda_rounded_bytes``), simulated allocator, and on a GPU measured.
* ``tensor_claims()``: the reference articles' tensor-size examples, measured.

Every measurement runs through ``gpulab.measure.engines.run`` (the tracker sees each storage); every
result carries the label of where its numbers came from.
"""
from __future__ import annotations

import html
import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from gpulab import formulas as F
from gpulab.course.claims import BREAKS, HOLDS, ClaimCheck, ClaimReport, Evidence
from gpulab.measure.engines import LABEL_FORMULA, LABEL_SIMULATED, RunContext, choose_engine, run
from gpulab.record.runs.rounding import rounding_experiment
# The measuring core lives in the library (gpulab record runs it too); these names stay importable here.
from gpulab.record.runs.tensor import OPERATIONS, Operation, contiguous_strides, is_contiguous, is_quantized, operation, tensor_experiment
from gpulab.record.runs.tensor import empty_tensor as _empty
from gpulab.course.exercises import ChoiceExercise, Exercise
from gpulab.measure.tracking import TrackingResult
from gpulab.units import DTYPES, KB, MB, KiB, MiB, dtype_name, format_bytes, parse_dtype
from gpulab.views import error_percent, fmt_error, html_table

__all__ = [
    "CLAIM_TOLERANCE", "DEFAULT_SHAPE", "DtypeRow", "DtypeTable", "MAX_BYTES", "Prediction",
    "ROW_KEPT", "ROW_NEW", "ROW_PEAK", "ROW_X", "RoundingResult", "Row", "TENSOR_CPU_LIMIT",
    "TensorBytesResult", "check_size", "dtype_names", "dtype_table", "exercise_batch_bytes",
    "exercise_cuda_rounding", "exercise_slice_kept", "exercise_which_frees", "measure",
    "parse_shape", "predict", "rounding_curve", "tensor_claims"
]

try:  # the caching-allocator simulator (another module; optional here)
    from gpulab.allocator.simulator import CachingAllocator
except ImportError:  # pragma: no cover - only while the simulator is absent
    CachingAllocator = None

# Above this predicted peak the "auto" engine answers with fake tensors instead of the CPU.
# torch.empty does not touch its pages, but a copy writes every byte, and the lesson's
# machine is a shared 2-core box: 256 MiB keeps every cpu run well under a second.
TENSOR_CPU_LIMIT = 256 * MiB

MAX_BYTES = 2**62  # beyond this even a fake tensor's byte count overflows int64 arithmetic

DEFAULT_SHAPE = "256,3,100,100"   # the articles' (N, C, H, W) batch


# --- input parsing -------------------------------------------------------------------------------

_SHAPE_HELP = "a shape is whole numbers >= 0 separated by commas, e.g. 256,3,100,100 (or () for a scalar)"


def parse_shape(text: str | Sequence[int]) -> tuple[int, ...]:
    """``"256,3,100,100"``, ``"(256, 3, 100, 100)"``, ``"256x3x100x100"`` or a sequence of ints
    -> a tuple of ints. ``"()"`` is a scalar. Raises ``ValueError`` with a readable message."""
    if isinstance(text, (tuple, list, torch.Size)):
        dims = list(text)
        for d in dims:
            if isinstance(d, bool) or not isinstance(d, int) or d < 0:
                raise ValueError(f"{d!r} is not a size: {_SHAPE_HELP}")
        return tuple(int(d) for d in dims)
    s = str(text).strip()
    if not s:
        raise ValueError(f"the shape is empty: {_SHAPE_HELP}")
    inner = s.strip("()[] \t")
    if not inner:
        return ()
    parts = [p for p in re.split(r"[,x×*\s]+", inner) if p]
    dims = []
    for i, p in enumerate(parts):
        if not re.fullmatch(r"\d+", p):
            raise ValueError(f"{p!r} (entry {i + 1} of {s!r}) is not a size: {_SHAPE_HELP}")
        dims.append(int(p))
    return tuple(dims)


def check_size(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Formula bytes of ``shape`` x ``dtype``; ``ValueError`` if it is absurdly large."""
    nbytes = F.tensor_bytes(shape, dtype)
    if nbytes >= MAX_BYTES:
        raise ValueError(f"shape {tuple(shape)} in {dtype_name(dtype)} would be {nbytes:.3g} B "
                         f"({nbytes / 2**60:,.0f} EiB): too large to describe even with fake tensors")
    return nbytes


_KIND_ORDER = ("float", "float8", "complex", "int", "uint", "bool", "quantized", "other")


def dtype_names() -> list[str]:
    """Every dtype in ``gpulab.units.DTYPES``, in teaching order: floats (widest first), fp8,
    complex, signed ints, unsigned ints, bool, quantized."""
    def key(name: str):
        info = DTYPES[name]
        kind = _KIND_ORDER.index(info.kind) if info.kind in _KIND_ORDER else len(_KIND_ORDER)
        return (kind, -info.bits, name)
    return sorted(DTYPES, key=key)


# --- operations ---------------------------------------------------------------------------------

# --- the experiment -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    """One quantity: the formula's bytes next to the measured bytes."""

    quantity: str
    formula: int
    measured: int
    how: str = ""   # how the formula gets its number

    @property
    def error(self) -> float | None:
        return error_percent(self.formula, self.measured)


@dataclass
class TensorBytesResult:
    """``x = torch.empty(shape, dtype)``, ``y = <operation>(x)``, ``del x``: what is alive."""

    shape: tuple[int, ...]
    dtype: str
    operation: str
    code: str
    engine: str
    reason: str
    label: str                      # where the measured numbers come from
    element_bytes: int
    numel: int
    y_shape: tuple[int, ...]
    y_stride: tuple[int, ...]
    y_offset: int
    y_contiguous: bool
    shares_storage: bool            # measured: y's storage is x's storage
    rows: list[Row]
    y_shape_bytes: int              # numel(y) x itemsize: what y's shape alone suggests
    cuda: dict[str, int | None]     # allocator view of x: formula / simulated / measured
    seconds: float
    notes: list[str] = field(default_factory=list)
    formula_label: str = LABEL_FORMULA
    simulated_label: str = LABEL_SIMULATED

    def row(self, quantity: str) -> Row:
        for r in self.rows:
            if r.quantity == quantity:
                return r
        raise KeyError(f"no row {quantity!r}; rows: {', '.join(r.quantity for r in self.rows)}")

    @property
    def x_bytes(self) -> int:
        return self.row(ROW_X).measured

    @property
    def new_bytes(self) -> int:
        return self.row(ROW_NEW).measured

    @property
    def peak_bytes(self) -> int:
        return self.row(ROW_PEAK).measured

    @property
    def kept_bytes(self) -> int:
        return self.row(ROW_KEPT).measured

    @property
    def formula_bytes(self) -> int:
        return self.row(ROW_X).formula

    def as_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype, "operation": self.operation,
                "engine": self.engine, "label": self.label, "reason": self.reason,
                "rows": {r.quantity: {"formula": r.formula, "measured": r.measured} for r in self.rows},
                "y_shape": list(self.y_shape), "y_shape_bytes": self.y_shape_bytes,
                "shares_storage": self.shares_storage, "cuda": dict(self.cuda)}

    def __repr__(self) -> str:
        return (f"TensorBytesResult({self.shape} {self.dtype}, {self.code}: x {self.x_bytes:,} B, "
                f"new {self.new_bytes:,} B, kept {self.kept_bytes:,} B; {self.label})")

    def _repr_html_(self) -> str:
        head = (f"<div><code>x = torch.empty({self.shape}, dtype=torch.{self.dtype})</code>; "
                f"<code>{html.escape(self.code)}</code>; <code>del x</code> — engine <b>{self.engine}</b> "
                f"({html.escape(self.reason)})</div>")
        table = html_table(
            ["quantity", LABEL_FORMULA, self.label, "formula error", "formula rule"],
            [[r.quantity, _exact(r.formula), _exact(r.measured), fmt_error(r.error), r.how]
             for r in self.rows],
            f"bytes = numel × {self.element_bytes} B per element; binary units (1 MiB = 1024² B)")
        c = self.cuda
        cuda_rows = [["x's block: memory_allocated", _exact(c["formula_allocated"]),
                      _opt(c["simulated_allocated"]), _opt(c["measured_allocated"])],
                     ["memory_reserved (a fresh allocator / this process's peak)", "—",
                      _opt(c["simulated_reserved"]),
                      _opt(c["measured_reserved"])]]
        measured_head = (f"measured: {self.label}" if self.engine == "cuda"
                         else "measured on a GPU (none here)")
        cuda_table = html_table(["on a CUDA GPU", "formula (512-B blocks)", self.simulated_label,
                                 measured_head], cuda_rows,
                                "what the caching allocator would count for x alone")
        notes = "".join(f"<li>{html.escape(n)}</li>" for n in self.notes)
        return head + table + cuda_table + (f"<ul>{notes}</ul>" if notes else "")


ROW_X = "x: its storage"
ROW_NEW = "new storage made by the operation"
ROW_PEAK = "peak live (x and y)"
ROW_KEPT = "kept alive by y after del x"


def _exact(v: int) -> str:
    """'29.3 MiB (30,720,000 B)': the binary unit, and the exact count when it is not tiny."""
    text = format_bytes(v) if v < 1024 else f"{format_bytes(v)} ({v:,} B)"
    return text.replace(" ", "\u00a0")  # no line break inside a number


def _opt(v: int | None) -> str:
    return "n/a" if v is None else _exact(v)


@dataclass(frozen=True)
class Prediction:
    """The formulas' view of ``x = empty(shape, dtype); y = op(x); del x`` (bytes)."""

    x_bytes: int
    new_bytes: int
    kept_bytes: int
    y_shape: tuple[int, ...]
    y_shape_bytes: int

    @property
    def peak_bytes(self) -> int:
        return self.x_bytes + self.new_bytes


def predict(shape: str | Sequence[int] = DEFAULT_SHAPE, dtype: str | torch.dtype = "float32",
            operation_key: str = "slice") -> Prediction:
    """Formula only (nothing runs). Raises ``ValueError`` for a bad shape, dtype or operation."""
    shp = parse_shape(shape)
    dt = parse_dtype(dtype)
    op = operation(operation_key)
    if op.needs_dims and not shp:
        raise ValueError(f"{op.code} needs at least one dimension; the shape () is a scalar")
    base = check_size(shp, dt)
    y_shape = op.result_shape(shp)
    y_bytes = F.tensor_bytes(y_shape, dt)
    new = y_bytes if op.copies(shp) else 0
    return Prediction(base, new, new if op.copies(shp) else base, y_shape, y_bytes)


def measure(shape: str | Sequence[int] = DEFAULT_SHAPE, dtype: str | torch.dtype = "float32",
            operation_key: str = "slice", engine: str = "auto", *,
            max_cpu_bytes: int = TENSOR_CPU_LIMIT) -> TensorBytesResult:
    """Run ``x = empty(shape, dtype); y = op(x); del x`` on an engine and compare with formulas."""
    pred = predict(shape, dtype, operation_key)
    shp = parse_shape(shape)
    dt = parse_dtype(dtype)
    op = operation(operation_key)
    isz = dt.itemsize
    base, new_f, kept_f, y_bytes = pred.x_bytes, pred.new_bytes, pred.kept_bytes, pred.y_shape_bytes
    choice = choose_engine(engine, predicted_bytes=base + new_f, max_cpu_bytes=max_cpu_bytes)
    if is_quantized(dt) and choice.name != "cpu":
        raise ValueError(f"{dtype_name(dt)} is a quantized dtype: only the cpu engine can create it "
                         f"(fake tensors and CUDA have no quantized empty); choose engine 'cpu'")

    m = run(tensor_experiment(shp, dt, op), engine, predicted_bytes=base + new_f, max_cpu_bytes=max_cpu_bytes)
    if m.oom:
        raise MemoryError(f"out of memory on the {m.engine} engine ({m.error}); try the fake engine")
    v = m.value
    raw = TrackingResult.build(m.tracking.records, m.tracking.events, device=m.tracking.device,
                               rounded=False)
    recs = sorted(raw.records.values(), key=lambda r: r.created)
    x_rec = recs[0] if recs else None
    x_meas = x_rec.nbytes if x_rec else 0
    new_meas = sum(r.nbytes for r in recs[1:])
    rows = [
        Row(ROW_X, base, x_meas, "numel(x) × itemsize"),
        Row(ROW_NEW, new_f, new_meas, "numel(y) × itemsize if it copies, else 0"),
        Row(ROW_PEAK, base + new_f, raw.peak_bytes, "x + new"),
        Row(ROW_KEPT, kept_f, v["kept"], "x's storage if y is a view, else y's own"),
    ]
    cuda = {"formula_allocated": F.cuda_rounded_bytes(base), "simulated_allocated": None,
            "simulated_reserved": None, "measured_allocated": None, "measured_reserved": None}
    if CachingAllocator is not None and base < 2**50:
        sim = CachingAllocator()
        sim.malloc(base)
        cuda["simulated_allocated"] = sim.memory_allocated()
        cuda["simulated_reserved"] = sim.memory_reserved()
    if m.engine == "cuda":
        cuda["measured_allocated"] = v["x_allocated"]
        cuda["measured_reserved"] = m.allocator["max_memory_reserved"] if m.allocator else None
    res = TensorBytesResult(
        shape=shp, dtype=dtype_name(dt), operation=op.key, code=op.code, engine=m.engine,
        reason=m.reason, label=m.label, element_bytes=isz, numel=math.prod(shp),
        y_shape=v["y_shape"], y_stride=v["y_stride"], y_offset=v["y_offset"],
        y_contiguous=v["y_contiguous"], shares_storage=v["shares"], rows=rows,
        y_shape_bytes=y_bytes, cuda=cuda, seconds=m.seconds)
    res.notes = _notes(res)
    return res


def _notes(r: TensorBytesResult) -> list[str]:
    notes = []
    x_row = r.row(ROW_X)
    if x_row.formula != x_row.measured:
        notes.append(f"numel × itemsize says {x_row.formula:,} B but the storage holds {x_row.measured:,} B: "
                     f"{r.dtype} packs several values into each byte, while torch reports an itemsize of "
                     f"{r.element_bytes} B for it.")
    if r.shares_storage:
        notes.append(f"y is a view of x (shape {r.y_shape}, stride {r.y_stride}, offset {r.y_offset}): "
                     f"it points into x's storage, so the operation allocated {r.new_bytes:,} B.")
        if r.kept_bytes > r.y_shape_bytes:
            notes.append(f"y's shape alone suggests {format_bytes(r.y_shape_bytes)} ({r.y_shape_bytes:,} B), "
                         f"but after del x it still keeps all {format_bytes(r.kept_bytes)} of x's storage "
                         f"alive ({r.kept_bytes / max(1, r.y_shape_bytes):,.0f}×). "
                         f"{r.code}.clone() would keep only its own bytes.")
    else:
        notes.append(f"y has its own storage: the operation copied {format_bytes(r.new_bytes)}, "
                     f"so the peak was {format_bytes(r.peak_bytes)} while x and y both lived.")
    if r.operation == "transpose + contiguous" and r.shares_storage:
        notes.append("The transposed view was already contiguous here, so .contiguous() returned it "
                     "without copying.")
    c = r.cuda
    if c["formula_allocated"] != x_row.formula:
        notes.append(f"On a GPU the caching allocator rounds x up to {c['formula_allocated']:,} B "
                     f"(a multiple of 512 B): {c['formula_allocated'] - x_row.formula:,} B more.")
    if c["simulated_allocated"] is not None and c["simulated_allocated"] != c["formula_allocated"]:
        notes.append(f"The simulated allocator counts {c['simulated_allocated']:,} B for x, not the "
                     f"{c['formula_allocated']:,} B of the 512-byte rule: the block it carved x from "
                     f"would leave only {c['simulated_allocated'] - c['formula_allocated']:,} B over, and a "
                     f"large-pool block is split only when more than 1 MiB would be left (should_split, "
                     f"kSmallSize), so x gets the whole block and memory_allocated counts all of it.")
    if c["simulated_reserved"] is not None:
        notes.append(f"A fresh caching allocator would reserve {format_bytes(c['simulated_reserved'])} "
                     f"for x (simulated allocator): what nvidia-smi would count for it, on top of the CUDA context.")
    if r.engine == "fake":
        notes.append("Fake tensors have shapes, dtypes and storages but no data: these bytes were "
                     "counted, not allocated.")
    return notes


# --- every dtype ----------------------------------------------------------------------------------

@dataclass
class DtypeRow:
    name: str
    kind: str
    itemsize: int          # torch's element size (formula: bytes per element)
    formula_bytes: int     # n x itemsize
    measured_bytes: int | None
    note: str = ""

    @property
    def error(self) -> float | None:
        return error_percent(self.formula_bytes, self.measured_bytes)


@dataclass
class DtypeTable:
    n: int
    engine: str
    label: str
    rows: list[DtypeRow]
    formula_label: str = LABEL_FORMULA

    def row(self, name: str) -> DtypeRow:
        name = dtype_name(parse_dtype(name))
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(name)

    def __repr__(self) -> str:
        return f"DtypeTable(n={self.n}, {len(self.rows)} dtypes, {self.label})"

    def _repr_html_(self) -> str:
        rows = [[r.name, r.kind, f"{r.itemsize} B", f"{r.formula_bytes:,} B",
                 "—" if r.measured_bytes is None else f"{r.measured_bytes:,} B", fmt_error(r.error), r.note]
                for r in self.rows]
        return html_table(["dtype", "kind", "itemsize", f"formula: {self.n:,} × itemsize",
                           f"storage bytes: {self.label}", "formula error", "note"], rows,
                          f"one tensor of {self.n:,} elements per dtype (torch {torch.__version__})")


def dtype_table(n: int = 1000, engine: str = "auto") -> DtypeTable:
    """One ``n``-element tensor of every dtype, in a single engine run."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    names = dtype_names()
    total = sum(n * DTYPES[k].bytes for k in names)
    choice = choose_engine(engine, predicted_bytes=total, max_cpu_bytes=TENSOR_CPU_LIMIT)

    def experiment(ctx: RunContext) -> dict[str, str]:
        failed = {}
        keep = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in names:
                dt = DTYPES[name].dtype
                if is_quantized(dt) and ctx.engine != "cpu":
                    failed[name] = f"no quantized tensors on the {ctx.engine} engine"
                    continue
                try:
                    keep.append((name, _empty((n,), dt, ctx.device)))
                except (RuntimeError, NotImplementedError, TypeError) as exc:
                    failed[name] = f"cannot create on {ctx.engine}: {str(exc).splitlines()[0][:60]}"
        # map storages to dtypes by order of creation: the tracker records dtype names too
        return {"failed": failed, "order": [k for k, _ in keep]}

    m = run(experiment, engine, predicted_bytes=total, max_cpu_bytes=TENSOR_CPU_LIMIT)
    recs = sorted(m.tracking.records.values(), key=lambda r: r.created)
    measured = {name: rec.nbytes for name, rec in zip(m.value["order"], recs)}
    rows = []
    for name in names:
        info = DTYPES[name]
        meas = measured.get(name)
        note = m.value["failed"].get(name, "")
        if meas is not None and meas != n * info.bytes:
            note = (f"packed: {meas / n:g} B per element; itemsize reports the {info.bytes}-byte "
                    f"container, not the packed size")
        rows.append(DtypeRow(name, info.kind, info.bytes, n * info.bytes, meas, note))
    return DtypeTable(n, m.engine, m.label, rows)


# --- 512-byte rounding ----------------------------------------------------------------------------

@dataclass
class RoundingResult:
    """Bytes counted for tensors of 0..max_elements elements, by source."""

    dtype: str
    elements: list[int]
    requested: list[int]                 # formula: numel x itemsize
    rounded: list[int]                   # formula: cuda_rounded_bytes
    live: list[int]                      # measured storage bytes (live tensors) on the engine
    live_label: str
    simulated: list[int] | None          # simulated allocator: memory_allocated
    simulated_reserved: list[int] | None
    cuda: list[int] | None               # measured on a GPU: memory_allocated
    cuda_label: str | None
    engine: str
    reason: str
    formula_label: str = LABEL_FORMULA
    simulated_label: str = LABEL_SIMULATED

    @property
    def max_waste(self) -> tuple[int, int, int]:
        """(elements, requested, rounded) where rounding wastes the largest fraction (n > 0)."""
        best = None
        for e, q, r in zip(self.elements, self.requested, self.rounded):
            if q > 0 and (best is None or r / q > best[2] / best[1]):
                best = (e, q, r)
        return best or (0, 0, 0)

    def __repr__(self) -> str:
        return f"RoundingResult({self.dtype}, 0..{self.elements[-1]} elements, engine={self.engine})"

    def _repr_html_(self) -> str:
        picks = sorted({e for e in (1, 2, 100, 128, 129, 1000) if e <= self.elements[-1]} | {self.elements[-1]})
        rows = []
        for e in picks:
            i = self.elements.index(e)
            rows.append([f"{e:,}", f"{self.requested[i]:,} B", f"{self.rounded[i]:,} B",
                         f"{self.live[i]:,} B",
                         "n/a" if self.simulated is None else f"{self.simulated[i]:,} B",
                         "n/a (no GPU)" if self.cuda is None else f"{self.cuda[i]:,} B"])
        e, q, r = self.max_waste
        cap = (f"{self.dtype}: worst case {e} element(s) = {q:,} B counted as {r:,} B ({r / max(1, q):,.0f}×)"
               + ("" if self.simulated_reserved is None else
                  f"; a fresh allocator reserves {format_bytes(self.simulated_reserved[-1])} for any non-empty one "
                  f"(simulated)"))
        return html_table(["elements", "numel × itemsize (formula)", "rounded to 512 B (formula)",
                           f"storage bytes ({self.live_label})", f"memory_allocated ({self.simulated_label})",
                           f"memory_allocated ({self.cuda_label or 'measured on a GPU'})"], rows, cap)


def rounding_curve(dtype: str | torch.dtype = "float32", max_elements: int = 300,
                   engine: str = "auto") -> RoundingResult:
    """Tensors of 0..max_elements elements: requested bytes, the 512-byte rule, the simulator,
    and the live storage bytes the engine measures (on CUDA also ``memory_allocated``)."""
    dt = parse_dtype(dtype)
    if is_quantized(dt):
        raise ValueError(f"{dtype_name(dt)} is quantized: the rounding curve uses plain dtypes")
    if not isinstance(max_elements, int) or not 1 <= max_elements <= 100_000:
        raise ValueError(f"max_elements must be an integer from 1 to 100,000, got {max_elements!r}")
    elements = list(range(max_elements + 1))
    requested = [F.tensor_bytes((e,), dt) for e in elements]
    choice = choose_engine(engine, predicted_bytes=max(requested), max_cpu_bytes=TENSOR_CPU_LIMIT)

    m = run(rounding_experiment(elements, dt), engine, predicted_bytes=max(requested),
            max_cpu_bytes=TENSOR_CPU_LIMIT)
    raw = TrackingResult.build(m.tracking.records, m.tracking.events, device=m.tracking.device,
                               rounded=False)
    recs = sorted(raw.records.values(), key=lambda r: r.created)
    live = [r.nbytes for r in recs]
    if len(live) != len(elements):  # every empty() makes one storage; anything else is a bug
        raise RuntimeError(f"expected {len(elements)} storages, the tracker saw {len(live)}")
    sim = sim_res = None
    if CachingAllocator is not None:
        sim, sim_res = [], []
        for q in requested:
            a = CachingAllocator()
            a.malloc(q)
            sim.append(a.memory_allocated())
            sim_res.append(a.memory_reserved())
    cuda = list(m.value) if m.engine == "cuda" else None
    return RoundingResult(dtype_name(dt), elements, requested, [F.cuda_rounded_bytes(q) for q in requested],
                          live, m.label, sim, sim_res, cuda, m.label if cuda else None, m.engine, m.reason)


# --- predict-first exercises ----------------------------------------------------------------------

def exercise_batch_bytes(shape: Sequence[int] = (256, 3, 100, 100), dtype: str = "float16") -> Exercise:
    dt = parse_dtype(dtype)
    return Exercise(
        question=f"How many bytes does a tensor of shape {tuple(shape)} in {dtype_name(dt)} take?",
        expected=lambda: F.tensor_bytes(shape, dt),
        explain=(f"numel = {' × '.join(map(str, shape))} = {math.prod(shape):,} elements, × "
                 f"{dt.itemsize} B per {dtype_name(dt)} element."),
        unit="bytes", hint=f"Multiply the dimensions, then the bytes per element ({dtype_name(dt)}).")


def exercise_slice_kept(shape: Sequence[int] = (256, 3, 100, 100), dtype: str = "float32") -> Exercise:
    def expected() -> int:  # measured by the library, on the cpu engine (or fake if large)
        return measure(shape, dtype, "slice").kept_bytes
    return Exercise(
        question=(f"x = torch.empty({tuple(shape)}, dtype=torch.{dtype}); y = x[:1]; del x. "
                  f"How many bytes of tensor storage are still alive?"),
        expected=expected,
        explain=("y is a view: it points into x's storage, so the whole storage stays alive as long "
                 "as y does (measured with live-tensor accounting)."),
        unit="bytes", hint="Does y have a storage of its own, or does it point into x's?")


def exercise_cuda_rounding(n: int = 1000, dtype: str = "float32") -> Exercise:
    dt = parse_dtype(dtype)
    return Exercise(
        question=(f"On a GPU, how many bytes does torch.cuda.memory_allocated() count for a "
                  f"{dtype_name(dt)} tensor of {n:,} elements?"),
        expected=lambda: F.cuda_rounded_bytes(F.tensor_bytes((n,), dt)),
        explain=(f"{n:,} × {dt.itemsize} B = {F.tensor_bytes((n,), dt):,} B, rounded up to a multiple "
                 f"of 512 B by the caching allocator (kMinBlockSize)."),
        unit="bytes", hint="The caching allocator hands out blocks in multiples of 512 bytes.",
        ratio_hint="round the tensor's bytes up to the next multiple of 512 B; one block of 512 B is too small here.")


_WHICH_COPIES = {"a": "slice", "b": "strided slice", "c": "transpose", "d": "slice + clone"}


def exercise_which_frees(shape: Sequence[int] = (256, 3, 100, 100), dtype: str = "float32") -> ChoiceExercise:
    """Predict-first (qualitative): four ways to make ``y`` from ``x``; after ``del x``, which one lets
    x's storage go? Each is measured (``measure``, live-tensor accounting) when the checker runs."""
    cache: dict[str, TensorBytesResult] = {}

    def results() -> dict[str, TensorBytesResult]:
        if not cache:
            cache.update({k: measure(shape, dtype, op) for k, op in _WHICH_COPIES.items()})
        return cache

    def expected() -> str:
        return min(results(), key=lambda k: results()[k].kept_bytes)

    def explain() -> str:
        r = results()
        kept = "; ".join(f"{operation(op).code}: {format_bytes(r[k].kept_bytes)} kept"
                         for k, op in _WHICH_COPIES.items())
        return (f"After del x ({r['a'].label}): {kept}. A slice, a strided slice and a transpose are views: "
                f"they only change the offset, shape and strides, and point into x's storage, so the whole "
                f"storage lives as long as y does. clone() copies the slice into a storage of its own, and x's "
                f"storage is freed with x.")

    codes = {k: operation(op).code for k, op in _WHICH_COPIES.items()}
    return ChoiceExercise(
        question=(f"x = torch.empty({tuple(shape)}, dtype=torch.{dtype}), then one of four lines makes y, then "
                  f"del x. After which line is x's big storage freed?"),
        options=codes, expected=expected, explain=explain)


# --- the articles' claims ----------------------------------------------------------------------------

CLAIM_TOLERANCE = 0.01   # a claim given to 2-3 digits holds if within 1% of the measured value

_ARTICLE_EXAMPLES = (
    # (key, shape, dtype, claimed value, claimed unit letter, claim text, source)
    ("image", (500, 500, 3), "float32", 3, "M",
     "A 500×500 RGB image in float32 takes 500 × 500 × 3 × 4 B = 3M.",
     "refs 000 and 003"),
    ("batch", (256, 3, 100, 100), "float32", 31, "M",
     "A (256, 3, 100, 100) FloatTensor takes 256 × 3 × 100 × 100 × 4 B = 31M.",
     "refs 000 and 003"),
    ("array", (2, 3, 256, 256), "float32", 24, "M",
     "A 2×3×256×256 (B×C×H×W) array takes 24M.", "ref 001"),
    ("vgg_input", (224, 224, 3), "uint8", 150, "K",
     "A 224×224×3 input image is 150K when counted at 8 bits per value (×4 at 32 bits).",
     "ref 000, on the cs231n VGG16 figure"),
)


def _unit_verdict(claimed: float, dec: float, binary: float, dec_name: str, bin_name: str) -> tuple[str, str]:
    ok_dec = abs(dec - claimed) <= CLAIM_TOLERANCE * claimed
    ok_bin = abs(binary - claimed) <= CLAIM_TOLERANCE * claimed
    if ok_dec and ok_bin:
        return HOLDS, f"within 1% in both {dec_name} and {bin_name}"
    if ok_dec:
        return (f"holds in {dec_name}, breaks in {bin_name}",
                f"{claimed:g} {dec_name} is right (decimal), but in {bin_name}, the unit nvidia-smi and "
                f"PyTorch print, it is {binary:,.2f} {bin_name}: read as {bin_name}, the claim is "
                f"{100 * (claimed - binary) / binary:.1f}% too high")
    if ok_bin:
        return (f"holds in {bin_name}, breaks in {dec_name}",
                f"{claimed:g} {bin_name} is right, but it is {dec:,.2f} {dec_name}")
    return BREAKS, (f"The tensor is {dec:,.3g} {dec_name} = {binary:,.3g} {bin_name}: "
                    f"{claimed:g} is {claimed / binary:,.1f}× the binary size")


def tensor_claims(engine: str = "auto") -> ClaimReport:
    """The articles' tensor-size examples, each tensor created on an engine and measured."""
    total = sum(F.tensor_bytes(s, d) for _, s, d, *_ in _ARTICLE_EXAMPLES) * 2
    choice = choose_engine(engine, predicted_bytes=total, max_cpu_bytes=TENSOR_CPU_LIMIT)

    def experiment(ctx: RunContext) -> list[int]:
        sizes = []
        for _, shape, dtype, *_ in _ARTICLE_EXAMPLES:
            t = torch.empty(shape, dtype=parse_dtype(dtype), device=ctx.device)
            sizes.append(t.untyped_storage().nbytes())
            del t
        t = torch.empty((224, 224, 3), dtype=torch.float32, device=ctx.device)
        sizes.append(t.untyped_storage().nbytes())
        return sizes

    m = run(experiment, engine, predicted_bytes=total, max_cpu_bytes=TENSOR_CPU_LIMIT)
    recs = sorted(m.tracking.records.values(), key=lambda r: r.created)
    measured = [r.nbytes for r in recs]
    if measured != m.value:  # the tracker and torch must agree on every storage
        raise RuntimeError(f"tracker saw {measured}, torch reports {m.value}")
    checks = []
    for (key, shape, dtype, claimed, letter, text, source), nbytes in zip(_ARTICLE_EXAMPLES, measured):
        dec_unit, bin_unit = (MB, MiB) if letter == "M" else (KB, KiB)
        dec_name, bin_name = ("MB", "MiB") if letter == "M" else ("KB", "KiB")
        dec, binary = nbytes / dec_unit, nbytes / bin_unit
        ev = [Evidence(f"storage bytes of torch.empty({shape}, dtype=torch.{dtype})", f"{nbytes:,} B", m.label),
              Evidence(f"formula numel × itemsize", f"{F.tensor_bytes(shape, dtype):,} B", LABEL_FORMULA),
              Evidence(f"in {dec_name} (÷ {dec_unit:,})", f"{dec:,.3f} {dec_name}", LABEL_FORMULA),
              Evidence(f"in {bin_name} (÷ {bin_unit:,})", f"{binary:,.3f} {bin_name}", LABEL_FORMULA)]
        verdict, why = _unit_verdict(claimed, dec, binary, dec_name, bin_name)
        if key == "array":
            why += (f". No dtype gives 24M: float64 would be {F.tensor_bytes(shape, 'float64') / MiB:g} MiB. "
                    f"(The number matches {math.prod(shape):,} float64 values counted in bits: "
                    f"{math.prod(shape) * 64 / 2**20:g} Mibit — a guess at the slip.)")
        if key == "vgg_input":
            ev.append(Evidence("the same image in float32", f"{measured[-1]:,} B = {measured[-1] / KiB:,.1f} KiB",
                               m.label))
            why += f"; ×4 for float32 holds exactly ({measured[-1]:,} B = 4 × {nbytes:,} B)"
        checks.append(ClaimCheck(text, source, verdict, why, ev))
    return ClaimReport(f"What refs 000, 001 and 003 (docs/references.md) claim about tensor sizes, tested ({m.label})", checks)
