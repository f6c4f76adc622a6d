"""HTML building blocks shared by every view: the table style and a table builder.

A leaf module (imports nothing from gpulab), so result classes low in the library, such as
``tracking.TrackingResult``, can render themselves without importing ``views``."""
from __future__ import annotations

import html
from typing import Iterable, Sequence

__all__ = ["STYLE", "html_table"]

STYLE = ("<style>.gpulab-table{border-collapse:collapse;font-size:0.9em}"
         ".gpulab-table td,.gpulab-table th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:right}"
         ".gpulab-table td:first-child,.gpulab-table th:first-child{text-align:left}"
         ".gpulab-table td.gpulab-nw{white-space:nowrap}"
         ".gpulab-label{color:#555;font-size:0.85em}</style>")

# a short figure with its unit ("12.3 MiB", "+4.0 %", "3 / 5") is never broken over two lines: "12.3"
# above "MiB" is the bytes column a narrow notebook showed (issue 47). Only a cell with a space can
# wrap, so only such cells, starting as a number does, are marked; words and long text wrap as before
_NOWRAP_CHARS = 24
_NUMBER_START = "0123456789+-−~≈(<>≤≥"


def html_table(header: Sequence[str], rows: Iterable[Sequence[object]], caption: str = "") -> str:
    """An HTML table in the house style; every cell is escaped (so callers pass plain text: an
    escaped string would show its entities as text), and a short cell does not wrap."""
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(_cell(c) for c in r) + "</tr>" for r in rows)
    cap = f"<caption class='gpulab-label'>{html.escape(caption)}</caption>" if caption else ""
    return f"{STYLE}<table class='gpulab-table'>{cap}<tr>{head}</tr>{body}</table>"


def _cell(value: object) -> str:
    text = str(value)
    nowrap = (" class='gpulab-nw'" if len(text) <= _NOWRAP_CHARS and " " in text and text[:1] in _NUMBER_START
              else "")
    return f"<td{nowrap}>{html.escape(text)}</td>"
