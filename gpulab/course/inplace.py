"""Lesson 06, part 1: in-place operations and what autograd saves.

* ``saved_tensors(output)`` walks the autograd graph behind a tensor and lists every tensor
  a backward node keeps (``grad_fn._saved_*``), one row per storage, so a lesson can show
  *which* tensors a layer saves rather than assume it.
* ``inplace_experiment(...)`` runs a conv-ReLU (or conv-BN-ReLU) stack twice, with
  ``ReLU(inplace=False)`` and ``ReLU(inplace=True)``, under the same engine, and reports the
  peak, the forward-phase peak, the allocation traffic and what autograd saved, next to the
  formula for what autograd saves and the reference articles' claim.
* ``inplace_break(case)`` modifies a tensor in place after autograd saved it, catches the
  ``RuntimeError`` and returns the version-counter story as data.
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpulab import formulas as F
from gpulab.measure.engines import LABEL_FORMULA, Measured, Measurement
# The measuring core lives in the library (gpulab record runs it too); these names stay importable here.
from gpulab.record.runs.inplace import BLOCKS, MODES, InplaceRun, SavedTensor, conv_stack, run_inplace_pair, saved_activation_bytes, saved_tensors
from gpulab.record.runs.inplace import storage_key as _storage_key
from gpulab.units import format_bytes
from gpulab.views import error_percent, fmt_error, html_table

__all__ = [
    "BREAK_CASES", "InplaceBreak", "InplaceResult", "LABEL_ARTICLES", "SavedReport",
    "articles_inplace_saving", "counting_exercise", "exercise_inplace_step_peak",
    "exercise_saved_bytes", "feature_map_bytes", "inplace_break", "inplace_claims",
    "inplace_experiment", "predict_saved_bytes", "saved_table_html", "validate_positive"
]

LABEL_ARTICLES = "claim of refs 000 and 003 (docs/references.md)"


# --- what autograd saves ------------------------------------------------------------------------

@dataclass
class SavedReport:
    """What autograd kept for one forward, as data with an HTML table view."""
    title: str
    rows: list[SavedTensor]
    label: str

    @property
    def total_bytes(self) -> int:
        return saved_activation_bytes(self.rows)

    def __repr__(self) -> str:
        return f"SavedReport({self.title!r}, {len(self.rows)} storages, {self.total_bytes:,} B new)"

    def _repr_html_(self) -> str:
        return f"<b>{html.escape(self.title)}</b>" + saved_table_html(self.rows, self.label)


def saved_table_html(rows: list[SavedTensor], caption: str = "") -> str:
    """The saved storages as a table, largest first; by-reference ones marked."""
    body = [[", ".join(r.saved_by), "×".join(map(str, r.shape)) or "scalar", r.dtype,
             format_bytes(r.nbytes) + (" (exists anyway)" if r.by_reference else "")]
            for r in sorted(rows, key=lambda r: (r.by_reference, -r.nbytes))]
    body.append(["total new memory", "", "", format_bytes(saved_activation_bytes(rows))])
    return html_table(["saved by (grad_fn._saved_*)", "shape", "dtype", "bytes"], body, caption)


# --- the conv-ReLU stack ----------------------------------------------------------------------

def feature_map_bytes(batch: int, channels: int, image_size: int, dtype="float32") -> int:
    """One block's output: batch x channels x size x size elements."""
    return F.tensor_bytes((batch, channels, image_size, image_size), dtype)


def predict_saved_bytes(block: str, depth: int, channels: int, batch: int, image_size: int) -> int:
    """What autograd saves in a training forward of ``conv_stack`` (activations only: the
    input, weights and BN's running buffers are saved by reference).

    Read off tools/autograd/derivatives.yaml: a convolution saves its *input* and weight;
    ReLU (``threshold``) saves its *result*; batch norm saves its input and two per-channel
    statistics (save_mean, save_invstd). In a conv-ReLU stack the next conv's saved input is
    the ReLU result already counted, so each block adds one feature map, whether or not the
    ReLU works in place. With batch norm a block adds two maps (the conv output that BN saves
    and the ReLU result) plus 2 x channels floats.
    NB: independent of ``inplace``: an in-place ReLU writes over a tensor nobody saved."""
    fmap = feature_map_bytes(batch, channels, image_size)
    if block == "conv-relu":
        return depth * fmap
    if block == "conv-bn-relu":
        return depth * (2 * fmap + 2 * F.tensor_bytes([channels]))
    raise ValueError(f"unknown block {block!r}; valid blocks: {', '.join(BLOCKS)}")


def articles_inplace_saving(depth: int, fmap_bytes: int) -> int:
    """The reference articles' view: an in-place ReLU stores its output over its input, so
    each ReLU saves one feature map (their ``modelsize()`` simply skips in-place ReLUs)."""
    return depth * fmap_bytes


@dataclass
class InplaceResult(Measured):
    block: str
    depth: int
    channels: int
    batch: int
    image_size: int
    mode: str
    runs: dict[bool, InplaceRun]
    fmap_bytes: int
    predicted_saved_bytes: int
    articles_saving_bytes: int
    predicted_label: str = LABEL_FORMULA

    @property
    def measurement(self) -> Measurement:
        """The run whose engine and label speak for the comparison: the run without inplace."""
        return self.runs[False].measurement

    @property
    def peak_saving(self) -> int:
        return self.runs[False].peak_bytes - self.runs[True].peak_bytes

    @property
    def forward_peak_saving(self) -> int:
        return self.runs[False].forward_peak - self.runs[True].forward_peak

    @property
    def allocation_saving(self) -> int:
        return self.runs[False].allocated_bytes - self.runs[True].allocated_bytes

    def figure(self):
        from gpulab.course.plots_tradeoffs import inplace_figure
        return inplace_figure(self)

    @property
    def grads_match(self) -> bool | None:
        """Did both variants compute the same parameter gradients? (None: not compared, e.g.
        fake tensors carry no values, or a no_grad run)."""
        a, b = self.runs[False].grads, self.runs[True].grads
        if a is None or b is None:
            return None
        return all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b))

    def as_dict(self) -> dict[str, Any]:
        return {
            "block": self.block, "depth": self.depth, "channels": self.channels, "batch": self.batch,
            "image_size": self.image_size, "mode": self.mode, "engine": self.engine, "label": self.label,
            "fmap_bytes": self.fmap_bytes, "predicted_saved_bytes": self.predicted_saved_bytes,
            "articles_saving_bytes": self.articles_saving_bytes,
            "runs": {str(k): {"peak_bytes": r.peak_bytes, "forward_peak": r.forward_peak,
                              "allocated_bytes": r.allocated_bytes, "saved_bytes": r.saved_bytes,
                              "peak_by_category": r.measurement.peak_by_category}
                     for k, r in self.runs.items()},
            "peak_saving": self.peak_saving, "forward_peak_saving": self.forward_peak_saving,
            "allocation_saving": self.allocation_saving,
        }

    def __repr__(self) -> str:
        return (f"InplaceResult({self.block} x{self.depth}, {self.mode}, peak saving "
                f"{self.peak_saving:,} B, allocation saving {self.allocation_saving:,} B)")

    def _repr_html_(self) -> str:
        f, t = self.runs[False], self.runs[True]
        rows = []

        def row(name, a, b, formula=None, formula_label=""):
            save = None if a is None or b is None else a - b
            rows.append([name, "—" if a is None else format_bytes(a), "—" if b is None else format_bytes(b),
                         "—" if save is None else format_bytes(save),
                         formula_label + (format_bytes(formula) if formula is not None else "")])

        row("peak (live tensors)", f.peak_bytes, t.peak_bytes)
        row("peak while the forward ran", f.forward_peak, t.forward_peak)
        row("activations at the peak", f.measurement.peak_by_category.get("activations", 0),
            t.measurement.peak_by_category.get("activations", 0))
        row("temporaries at the peak", f.measurement.peak_by_category.get("temporaries", 0),
            t.measurement.peak_by_category.get("temporaries", 0))
        row("saved by autograd (grad_fn._saved_*)", f.saved_bytes, t.saved_bytes,
            self.predicted_saved_bytes if self.mode == "train step" else None,
            "formula: " if self.mode == "train step" else "")
        row("allocated in total (traffic)", f.allocated_bytes, t.allocated_bytes)
        err = (error_percent(self.predicted_saved_bytes, f.saved_bytes)
               if f.saved_bytes is not None else None)
        head = (f"<b>{self.block}</b> ×{self.depth}, {self.channels} channels, batch {self.batch}, "
                f"{self.image_size}×{self.image_size}, {html.escape(self.mode)} — "
                f"{html.escape(self.label)}")
        table = html_table(["", "inplace=False", "inplace=True", "saved by inplace", "formula"], rows,
                           "binary units (1 MiB = 1024² B); measured columns: " + self.label)
        claim = (f"<div>{LABEL_ARTICLES}: one feature map per ReLU = "
                 f"<b>{format_bytes(self.articles_saving_bytes)}</b>. Measured: peak "
                 f"<b>{format_bytes(self.peak_saving)}</b>, allocation traffic "
                 f"<b>{format_bytes(self.allocation_saving)}</b>."
                 + (f" Formula for the saved tensors vs measured: {fmt_error(err)}." if err is not None else "")
                 + "</div>")
        return head + table + claim


def validate_positive(**values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


def inplace_experiment(block: str = "conv-relu", depth: int = 4, channels: int = 16, batch: int = 8,
                       image_size: int = 32, mode: str = "train step", engine: str = "auto") -> InplaceResult:
    """The same stack with ``ReLU(inplace=False)`` and ``ReLU(inplace=True)``, tracked."""
    validate_positive(depth=depth, channels=channels, batch=batch, image_size=image_size)
    if block not in BLOCKS:
        raise ValueError(f"unknown block {block!r}; valid blocks: {', '.join(BLOCKS)}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(MODES)}")
    fmap = feature_map_bytes(batch, channels, image_size)
    flops = F.conv2d_flops(batch, channels, channels, (image_size, image_size), 3) * depth
    runs = run_inplace_pair(block, depth, channels, batch, image_size, mode, engine,
                            predicted_bytes=3 * depth * fmap, predicted_flops=3 * flops)
    return InplaceResult(block, depth, channels, batch, image_size, mode, runs, fmap,
                         predict_saved_bytes(block, depth, channels, batch, image_size),
                         articles_inplace_saving(depth, fmap))


# --- when in place breaks autograd ----------------------------------------------------------------

BREAK_CASES = {
    "sigmoid then mul_": "y = sigmoid(x) saves y (its backward is y·(1−y)); then y.mul_(2) overwrites it",
    "exp then add_": "y = exp(x) saves y (its backward is y); then y.add_(1) overwrites it",
    "linear then relu_": "y = linear(x) saves x and the weight, not y; then y.relu_() overwrites y",
    "sigmoid then .data.mul_": ("y = sigmoid(x) saves y; then y.data.mul_(2) overwrites it through .data, which "
                                "has a version counter of its own, so y's counter does not move"),
}


@dataclass
class InplaceBreak:
    case: str
    story: str
    saved_by_first_op: list[str]          # attributes of the first op's grad_fn that hold tensors
    saves_output: bool                    # does the first op keep its own output?
    version_before: int
    version_after: int
    error: str | None                     # the RuntimeError backward raised, or None
    grad_ok: bool                         # backward ran and produced a gradient
    # backward ran: does x.grad equal the gradient of the same computation written out of place?
    grad_matches: bool | None = None
    grad_max_error: float | None = None   # the largest |difference| between the two (when it ran)

    @property
    def silently_wrong(self) -> bool:
        """Backward raised nothing, yet the gradient differs from the out-of-place computation's."""
        return self.error is None and self.grad_matches is False

    def _repr_html_(self) -> str:
        if self.error:
            verdict = f"<b style='color:#b00'>backward failed</b>: <code>{html.escape(self.error)}</code>"
        elif self.silently_wrong:
            verdict = (f"<b style='color:#b00'>backward ran without an error, and the gradient is wrong</b>: "
                       f"it differs from the out-of-place computation's by up to {self.grad_max_error:.3g} "
                       f"(measured on CPU (live tensors))")
        else:
            verdict = ("<b style='color:#2a7'>backward worked</b>, and the gradient equals the out-of-place "
                       "computation's")
        return (f"<div><b>{html.escape(self.case)}</b>: {html.escape(self.story)}.<br>"
                f"first op saves: <code>{html.escape(', '.join(self.saved_by_first_op) or 'nothing')}</code>"
                f" (its own output: {'yes' if self.saves_output else 'no'}); y._version "
                f"{self.version_before} → {self.version_after}; {verdict}</div>")

    def __repr__(self) -> str:
        return (f"InplaceBreak({self.case!r}, version {self.version_before}->{self.version_after}, "
                f"error={self.error!r})")


def inplace_break(case: str = "sigmoid then mul_") -> InplaceBreak:
    """Run one of ``BREAK_CASES`` on a tiny CPU tensor and report what happened.

    Autograd gives every tensor a version counter, bumped by each in-place op; a saved tensor
    remembers the version it was saved at, and backward refuses to use it if the counter has
    moved (torch/csrc/autograd/saved_variable.cpp)."""
    if case not in BREAK_CASES:
        raise ValueError(f"unknown case {case!r}; valid cases: {', '.join(BREAK_CASES)}")
    torch.manual_seed(0)
    x = torch.randn(4, 3, requires_grad=True)
    if case in ("sigmoid then mul_", "sigmoid then .data.mul_"):
        y = torch.sigmoid(x)
    elif case == "exp then add_":
        y = torch.exp(x)
    else:
        w = torch.randn(3, 3, requires_grad=True)
        y = nn.functional.linear(x, w)
    node = y.grad_fn
    attrs = []
    saves_output = False
    for a in sorted(a for a in dir(node) if a.startswith("_saved_")):
        v = getattr(node, a)
        if isinstance(v, torch.Tensor):
            attrs.append(a)
            if _storage_key(v) == _storage_key(y):
                saves_output = True
    before = y._version
    if case == "sigmoid then mul_":
        y.mul_(2)
    elif case == "sigmoid then .data.mul_":
        y.data.mul_(2)  # the point of this case: .data bypasses the version counter
    elif case == "exp then add_":
        y.add_(1)
    else:
        y.relu_()
    after = y._version
    error = None
    try:
        y.sum().backward()
    except RuntimeError as exc:
        error = str(exc).split(" Hint:")[0]
    matches = max_err = None
    if error is None and x.grad is not None:
        # the same computation written out of place: the gradient the user meant to get
        x2 = x.detach().clone().requires_grad_(True)
        if case in ("sigmoid then mul_", "sigmoid then .data.mul_"):
            ref = torch.sigmoid(x2) * 2
        elif case == "exp then add_":
            ref = torch.exp(x2) + 1
        else:
            ref = torch.relu(nn.functional.linear(x2, w.detach()))
        ref.sum().backward()
        max_err = float((x.grad - x2.grad).abs().max())
        matches = bool(torch.allclose(x.grad, x2.grad))
    return InplaceBreak(case, BREAK_CASES[case], attrs, saves_output, before, after, error,
                        error is None and x.grad is not None, matches, max_err)


# --- the exercise and the articles' claims ---------------------------------------------------------

def counting_exercise(**kwargs):
    """An ``Exercise`` whose likely wrong answers come from counting tensors twice, not from
    dtypes: the base checker's "×2: check the bytes per element" hint would mislead there, so
    this one shows the exercise's own hint instead."""
    from gpulab.course.exercises import CheckResult, Exercise

    class CountingExercise(Exercise):
        def check(self, answer: Any) -> CheckResult:
            res = super().check(answer)
            if not res.ok and "bytes per element" in res.message:
                shown = f"{answer:,}" if isinstance(answer, (int, float)) else repr(answer)
                res = CheckResult(False, answer, res.expected,
                                  f"You said {shown}{self._unit()}, off by a whole factor. {self.hint} "
                                  f"Try again.")
            return res

    return CountingExercise(**kwargs)


def exercise_saved_bytes(depth: int = 4, channels: int = 16, batch: int = 8, image_size: int = 32):
    """Predict-first: bytes autograd saves in a conv-ReLU stack with ``ReLU(inplace=True)``."""
    fmap = feature_map_bytes(batch, channels, image_size)
    return counting_exercise(
        question=(f"A stack of {depth} blocks Conv2d({channels}→{channels}, 3×3, padding 1) + ReLU(inplace=True) "
                  f"runs a training forward on a float32 batch of {batch}×{channels}×{image_size}×{image_size} "
                  f"feature maps ({format_bytes(fmap)} each). How many bytes does autograd keep for backward, "
                  f"not counting the input batch and the weights?"),
        expected=lambda: predict_saved_bytes("conv-relu", depth, channels, batch, image_size),
        explain=(f"{depth} feature maps: each ReLU keeps its result, which is also what the next conv keeps as "
                 f"its input (one storage). The conv's own output is not saved by anyone, which is why ReLU may "
                 f"overwrite it, and also why inplace=False would save exactly the same bytes ({LABEL_FORMULA}, "
                 f"tools/autograd/derivatives.yaml)."),
        unit="bytes", rel_tol=0.0,
        hint="Which tensor does a conv keep for its backward, and which does ReLU keep? Count storages: a tensor "
             "two nodes keep is stored once.")


def inplace_claims(result: InplaceResult, broken: InplaceBreak | None = None):
    """The articles' in-place claims, with verdicts computed from ``result`` (a train-step
    ``inplace_experiment``) and optionally an ``inplace_break`` run."""
    from gpulab.course.claims import BREAKS, HOLDS, ClaimCheck, ClaimReport, Evidence
    checks = []
    lab = result.label
    fmap = result.fmap_bytes
    peak_ok = result.peak_saving >= 0.5 * result.articles_saving_bytes
    fwd_ok = result.forward_peak_saving >= 0.5 * fmap
    alloc_ok = result.allocation_saving == result.articles_saving_bytes
    if peak_ok:
        verdict = HOLDS
    elif alloc_ok or fwd_ok:
        verdict = "holds for allocations, breaks for the peak"
    else:
        verdict = BREAKS
    checks.append(ClaimCheck(
        "ReLU(inplace=True) writes its output over its input, so it saves memory: one feature map per ReLU.",
        "refs 000, 003", verdict,
        (f"Inplace allocates {format_bytes(result.allocation_saving)} less in total (the number refs 000 and 003 give: one map "
         f"per ReLU) and lowers the forward's peak by {format_bytes(result.forward_peak_saving)}, but the "
         f"{result.mode}'s peak moves by {format_bytes(result.peak_saving)}: a non-inplace ReLU's input is freed as "
         f"soon as the next layer runs, and autograd keeps the same tensors either way.")
        if not peak_ok else f"The peak drops by {format_bytes(result.peak_saving)}.",
        [Evidence("saving claimed by refs 000 and 003", format_bytes(result.articles_saving_bytes), LABEL_ARTICLES),
         Evidence("allocated in total: saved", format_bytes(result.allocation_saving), lab),
         Evidence("forward peak: saved", format_bytes(result.forward_peak_saving), lab),
         Evidence("peak of the step: saved", format_bytes(result.peak_saving), lab),
         Evidence("saved for backward (inplace False / True)",
                  f"{format_bytes(result.runs[False].saved_bytes or 0)} / "
                  f"{format_bytes(result.runs[True].saved_bytes or 0)}",
                  lab)]))
    relu_rows = [r for r in (result.runs[True].saved or []) if any(w.startswith("ReluBackward") for w in r.saved_by)]
    keeps_result = bool(relu_rows) and all(any(w.endswith("_saved_result") for w in r.saved_by
                                               if w.startswith("ReluBackward")) for r in relu_rows)
    match = result.grads_match
    ok = keeps_result and match is not False
    checks.append(ClaimCheck(
        "Backward still works after an in-place ReLU: the gradient only needs to know where the output is "
        "positive (dx = dy where y > 0).", "ref 000", HOLDS if ok else BREAKS,
        ("ReLU's backward node keeps its result (grad_fn._saved_result), whose sign equals the input's, so "
         "overwriting the input loses nothing it needs"
         + ("; the gradients of both variants are equal." if match else
            "; gradients not compared here (no values on this engine).")) if ok else
        "The measurement disagrees: see the evidence.",
        [Evidence("ReLU keeps", ", ".join(sorted({w for r in relu_rows for w in r.saved_by if "Relu" in w})) or "—",
                  lab),
         Evidence("gradients equal (inplace False vs True)", {True: "yes", False: "no", None: "not compared"}[match],
                  lab)]))
    if broken is not None:
        checks.append(ClaimCheck(
            "Use in-place operations wherever possible (ReLU(inplace=True) is the example).", "ref 003",
            BREAKS if broken.error else HOLDS,
            (f"{broken.case}: the first op saved its own output, the in-place op moved its version counter from "
             f"{broken.version_before} to {broken.version_after}, and backward refused: {broken.error}")
            if broken.error else f"{broken.case}: backward worked.",
            [Evidence("y._version before / after", f"{broken.version_before} / {broken.version_after}",
                      "measured on CPU (tiny tensors)")]))
    return ClaimReport("What refs 000 and 003 (docs/references.md) claim about in-place ReLU, tested", checks)


def exercise_inplace_step_peak(depth: int = 4, channels: int = 16, batch: int = 8, image_size: int = 32):
    """Predict-first (qualitative): does ``ReLU(inplace=True)`` lower the peak of a training
    step of the conv-ReLU stack? The answer is measured when the checker runs: both variants
    run under the live-tensor tracker (``inplace_experiment``) and their step peaks are compared."""
    from gpulab.course.exercises import ChoiceExercise
    fmap = feature_map_bytes(batch, channels, image_size)
    cache: dict[str, Any] = {}

    def result() -> InplaceResult:
        if "r" not in cache:
            cache["r"] = inplace_experiment("conv-relu", depth, channels, batch, image_size, engine="cpu")
        return cache["r"]

    def expected() -> str:
        r = result()
        drop = r.runs[False].peak_bytes - r.runs[True].peak_bytes
        if drop >= (depth - 0.5) * fmap:
            return "a"
        if drop >= 0.5 * fmap:
            return "b"
        return "c"

    def explain() -> str:
        r = result()
        off, on = r.runs[False], r.runs[True]
        return (f"Step peak {format_bytes(off.peak_bytes)} without and {format_bytes(on.peak_bytes)} with "
                f"inplace ({off.measurement.label}); one feature map is {format_bytes(fmap)} ({LABEL_FORMULA}). "
                f"The step's peak is in backward, where the saved tensors are the same either way; in place only "
                f"removes a ReLU input that was already freed when the next layer ran.")

    return ChoiceExercise(
        question=(f"A stack of {depth} Conv2d({channels}→{channels}, 3×3) + ReLU blocks, batch {batch}×{channels}×"
                  f"{image_size}×{image_size}, float32, runs one training step (forward + backward). You switch "
                  f"every ReLU to inplace=True. What happens to the peak of the whole step?"),
        options={"a": f"it drops by about {depth} feature maps, one per ReLU",
                 "b": "it drops by about one feature map",
                 "c": "it does not move"},
        expected=expected, explain=explain)
