"""HTML views of result objects (what ``_repr_html_`` returns). Every number carries its
unit and the label of where it came from."""
from __future__ import annotations

import html

from gpulab.tables import html_table  # noqa: F401  (re-exported: views are where callers look for it)
from gpulab.categories import CATEGORIES
from gpulab.units import format_bytes

__all__ = [
    "breakdown_html", "comparison_rows", "error_percent", "fit_html", "fmt_error",
    "measurement_html", "step_html"
]


def error_percent(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured in %, or None when undefined."""
    if predicted is None or measured is None or measured == 0:
        return None
    return 100.0 * (predicted - measured) / measured


def fmt_error(err: float | None) -> str:
    return "—" if err is None else f"{err:+.1f}%"


def comparison_rows(predicted: dict[str, int | None], measured: dict[str, int]) -> list[list[str]]:
    rows = []
    for c in CATEGORIES:
        p, m = predicted.get(c.value), measured.get(c.value, 0)
        rows.append([c.value, format_bytes(p) if p is not None else "— (no formula)", format_bytes(m),
                     fmt_error(error_percent(p, m))])
    return rows


def not_tensor_rows(nt: dict | None) -> list[list[str]]:
    """The allocator trace's allocations no tensor owns (``measure.non_tensor``), as table rows."""
    if not nt:
        return []
    sites = ", ".join(f"{k} ×{v}" for k, v in sorted(nt["sites"].items(), key=lambda kv: -kv[1]))
    return [[f"{nt['label']}: live at the trace's peak", format_bytes(nt["at_peak"])],
            ["the same: how many, the largest" + (f" (where: {sites})" if sites else ""),
             f"{nt['count']}, {format_bytes(nt['largest_bytes'])}"]]


def measurement_html(m) -> str:
    if m.oom:
        return (f"<b>Out of memory</b> ({html.escape(m.label)}): {html.escape(str(m.error))}"
                "<br>Memory was released; try a smaller batch or the fake engine.")
    out = m.tracking._repr_html_() + f"<div class='gpulab-label'>{html.escape(m.label)}</div>"
    if m.allocator:
        a, b = m.allocator, m.beyond_tensors
        rows = []
        if m.blocks is not None:   # two lines: the tensors' bytes, and the blocks they take
            rows += [[f"peak: {m.blocks.tensor_label}", format_bytes(m.peak_bytes)],
                     [f"peak: {m.blocks.label}", format_bytes(m.blocks.peak_bytes)]]
        rows += [
            ["max_memory_allocated − baseline (this run)", format_bytes(a["peak_allocated_delta"])],
            ["max_memory_reserved − baseline (this run)", format_bytes(a["peak_reserved_delta"])],
            ["baseline before the run: allocated / reserved",
             f"{format_bytes(a['baseline_allocated'])} / {format_bytes(a['baseline_reserved'])}"],
            [b["label"], format_bytes(b["bytes"])],
            [b["kept_label"], format_bytes(b["kept_after_run"])],
            *not_tensor_rows(b.get("not_tensors")),
            ["OOMs / allocation retries in this run (since the process started)",
             f"{a['num_ooms_this_run']} / {a['num_alloc_retries_this_run']} "
             f"({a['num_ooms_since_process_start']} / {a['num_alloc_retries_since_process_start']})"],
            ["NVML used (nvidia-smi; the whole device, all processes)",
             format_bytes(a["nvml_used"]) if a["nvml_used"] is not None else "n/a"],
        ]
        out += html_table(["allocator counter", "bytes"], rows, m.label)
    return out


def step_html(step) -> str:
    m = step.measurement
    shape = f"{step.image_size}×{step.image_size}" if step.kind == "image" else html.escape(step.input_text)
    title = (f"<b>{html.escape(step.model)}</b>, batch {step.batch}, {shape}, "
             f"{html.escape(step.dtype)}{', autocast ' + step.amp if step.amp else ''}, {html.escape(step.optimizer)} "
             f"— engine <b>{m.engine}</b> ({html.escape(m.reason)})")
    if m.oom:
        return title + "<br>" + measurement_html(m)
    rounded = m.tracking.rounded   # cuda: compare the formulas with unrounded tensor bytes
    table = html_table(["category", "formula", f"peak{' tensor bytes (unrounded)' if rounded else ''}: {m.label}",
                        "formula error"],
                       comparison_rows(step.predicted, step.tensor_bytes_by_category)
                       + [["total" + (" (each storage rounded up to 512 B)" if rounded else ""), "",
                           format_bytes(m.peak_bytes), ""]],
                       f"peak during {m.tracking.peak_phase}; binary units (1 MiB = 1024² B)")
    extra = measurement_html(m) if m.allocator else ""
    state_note = ""
    if getattr(step, "steps", 0) == 1 and (step.predicted.get("optimizer_state") or 0) > 0 \
            and not step.tensor_bytes_by_category.get("optimizer_state", 0):
        state_note = ("<p class='gpulab-label'>optimizer_state: the formula counts the state the optimizer keeps; "
                      "in a single step <code>optimizer.step()</code> creates it after this peak (during "
                      f"{html.escape(m.tracking.peak_phase)}), so the peak holds none of it. From the second step on "
                      "it is alive through every forward and backward.</p>")
    gap_note = _backward_peak_gaps(step.predicted, step.tensor_bytes_by_category, m.tracking.peak_phase)
    steps = ""
    if len(step.step_peaks) > 1:
        steps = ("<p>Each step's peak: " + ", ".join(f"step {i + 1}: <b>{format_bytes(p)}</b>"
                                                     for i, p in enumerate(step.step_peaks))
                 + ". From the second step on, the optimizer state exists: that is the steady state every later "
                   "step lives in.</p>")
    return title + table + state_note + gap_note + steps + extra


def _backward_peak_gaps(predicted: dict, measured: dict, phase: str) -> str:
    """Why the gradients and activations at a backward peak sit more than 10% under their formulas."""
    def under(category: str) -> bool:
        formula = predicted.get(category) or 0
        return formula > 0 and measured.get(category, 0) < 0.9 * formula
    notes = []
    if phase == "backward" and under("gradients"):
        notes.append("gradients: at this peak, during backward, only the layers backward has already reached "
                     "have their gradient; all of them exist once it ends.")
    if under("activations"):
        notes.append("activations: the formula counts every layer's output; autograd saves only what each "
                     "backward formula needs, and backward frees it as it goes (lesson 03).")
    return "".join(f"<p class='gpulab-label'>{html.escape(n)}</p>" for n in notes)


def fit_html(r) -> str:
    """``gpulab.fit``'s answer: the batch, the peak by category, the allocator, the context, the margin.
    ``html_table`` escapes every cell and the caption: text goes in as text, never escaped twice."""
    head = (f"<b>{html.escape(r.model)}</b> on <b>{html.escape(r.card)}</b> ({format_bytes(r.capacity_bytes)}), "
            f"{html.escape(r.optimizer)}, {html.escape(r.dtype)}{', autocast ' + r.amp if r.amp else ''}: "
            + (f"largest batch <b>{html.escape(getattr(r, 'largest_batch_text', str(r.largest_batch)))}</b>"
               if r.largest_batch else
               f"<b>batch 1 does not fit</b>: short by {format_bytes(-r.margin_bytes)}"))
    rows = [[k, format_bytes(v), ""] for k, v in r.peak_by_category.items() if v]
    rows += [["live tensors (peak)", format_bytes(r.peak_bytes), "fake tensors, CUDA kernels' allocations"],
             ["allocator overhead", format_bytes(r.allocator_overhead_bytes), "simulated allocator"],
             ["CUDA context", format_bytes(r.context_bytes), r.as_dict()["context_label"]],
             ["cuBLAS workspaces", format_bytes(getattr(r, "workspace_bytes", 0)),
              r.as_dict().get("workspace_label", "")],
             ["needed", format_bytes(r.needed_bytes), ""],
             ["margin", format_bytes(r.margin_bytes), f"of {format_bytes(r.capacity_bytes)}"]]
    table = html_table(["at batch " + str(max(1, r.largest_batch)), "bytes", "source"], rows,
                       f"{r.input_text}; {r.method}; {r.runs} fake runs, {r.seconds:.1f} s")
    levers = ""
    if r.levers:
        levers = html_table(["lever", "batch 1 would need", "fits?", "formula"],
                            [[lv.name, format_bytes(lv.peak_bytes), "yes" if lv.fits else "no",
                              lv.formula] for lv in r.levers], r.levers[0].label)
    kernels = f"<p>{html.escape(r.kernels)}</p>" if getattr(r, "kernels", "") else ""
    return head + table + kernels + levers


def breakdown_html(bd, max_rows: int = 60) -> str:
    rows = [[r.name, r.type, "×".join(map(str, r.output_shape)), f"{r.params:,}",
             format_bytes(r.output_bytes), f"{r.flops / 1e6:,.1f}"] for r in bd.layers[:max_rows]]
    rows.append(["total", "", "", f"{bd.total_params:,}", format_bytes(bd.total_output_bytes),
                 f"{bd.forward_flops / 1e6:,.1f}"])
    return html_table(["layer", "type", "output shape", "params", "output", "MFLOP"], rows,
                      f"{bd.model}, input {list(bd.input_shape)} {bd.dtype} — {bd.label}")
