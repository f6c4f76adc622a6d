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
         ".gpulab-label{color:#555;font-size:0.85em}</style>")


def html_table(header: Sequence[str], rows: Iterable[Sequence[object]], caption: str = "") -> str:
    """An HTML table in the house style; every cell is escaped."""
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    cap = f"<caption class='gpulab-label'>{html.escape(caption)}</caption>" if caption else ""
    return f"{STYLE}<table class='gpulab-table'>{cap}<tr>{head}</tr>{body}</table>"
