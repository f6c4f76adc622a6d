"""HTML views of result objects (what ``_repr_html_`` returns). Every number carries its
unit and the label of where it came from."""
from __future__ import annotations

import html

from .tables import html_table  # noqa: F401  (re-exported: views are where callers look for it)
from .tracking import CATEGORIES
from .units import format_bytes


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


def measurement_html(m) -> str:
    if m.oom:
        return (f"<b>Out of memory</b> ({html.escape(m.label)}): {html.escape(str(m.error))}"
                "<br>Memory was released; try a smaller batch or the fake engine.")
    out = m.tracking._repr_html_() + f"<div class='gpulab-label'>{html.escape(m.label)}</div>"
    if m.allocator:
        a = m.allocator
        out += html_table(["allocator counter", "bytes"], [
            ["max_memory_allocated", format_bytes(a["max_memory_allocated"])],
            ["max_memory_reserved", format_bytes(a["max_memory_reserved"])],
            ["NVML used (nvidia-smi)", format_bytes(a["nvml_used"]) if a["nvml_used"] is not None else "n/a"],
            [m.beyond_tensors["label"], format_bytes(m.beyond_tensors["bytes"])],
        ], m.label)
    return out


def step_html(step) -> str:
    m = step.measurement
    title = (f"<b>{html.escape(step.model)}</b>, batch {step.batch}, {step.image_size}×{step.image_size}, "
             f"{html.escape(step.dtype)}, {html.escape(step.optimizer)} — engine <b>{m.engine}</b> "
             f"({html.escape(m.reason)})")
    if m.oom:
        return title + "<br>" + measurement_html(m)
    table = html_table(["category", f"formula", f"peak: {m.label}", "formula error"],
                       comparison_rows(step.predicted, m.peak_by_category)
                       + [["total", "", format_bytes(m.peak_bytes), ""]],
                       f"peak during {m.tracking.peak_phase}; binary units (1 MiB = 1024² B)")
    extra = measurement_html(m) if m.allocator else ""
    return title + table + extra


def breakdown_html(bd, max_rows: int = 60) -> str:
    rows = [[r.name, r.type, "×".join(map(str, r.output_shape)), f"{r.params:,}",
             format_bytes(r.output_bytes), f"{r.flops / 1e6:,.1f}"] for r in bd.layers[:max_rows]]
    rows.append(["total", "", "", f"{bd.total_params:,}", format_bytes(bd.total_output_bytes),
                 f"{bd.forward_flops / 1e6:,.1f}"])
    return html_table(["layer", "type", "output shape", "params", "output", "MFLOP"], rows,
                      f"{bd.model}, input {list(bd.input_shape)} {bd.dtype} — {bd.label}")
