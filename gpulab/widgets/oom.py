"""The out-of-memory reader panel (lesson 13): pick an example or paste your own message; the
panel reads every figure, names the case and rebuilds it in the simulated allocator. Text it
cannot read gives a plain "could not read this message", never an error."""
from __future__ import annotations

import html
from typing import Any

import ipywidgets as W
from IPython.display import HTML

from gpulab.course.pytorch_tools import OWN_MESSAGE, PANEL_EXAMPLES, OOMReading, example_text, read_oom
from gpulab.widgets.base import Panel, dropdown

__all__ = ["compute_oom", "oom_panel", "render_oom"]


def compute_oom(example: str, text: str) -> OOMReading:
    message = text if example == OWN_MESSAGE else example_text(example)
    return read_oom(message)


def render_oom(reading: OOMReading) -> list[Any]:
    shown = html.escape(reading.text[:2000]) if reading.text else "<i>(empty)</i>"
    return [HTML(f"<pre style='white-space:pre-wrap;font-size:0.85em;border-left:4px solid #999;"
                 f"padding-left:8px'>{shown}</pre>"), reading]


def _pasted(example: W.Dropdown):
    """Pasting a message is enough: the dropdown moves to "your own message" by itself."""
    def on_text(change) -> None:
        if str(change["new"]).strip() and example.value != OWN_MESSAGE:
            example.value = OWN_MESSAGE
    return on_text


def oom_panel(example: str | None = None, text: str = "") -> Panel:
    options = list(PANEL_EXAMPLES) + [OWN_MESSAGE]
    controls = {
        "example": dropdown("message", options, example or (OWN_MESSAGE if text else options[0])),
        "text": W.Textarea(value=text, placeholder="paste a 'CUDA out of memory' message here", continuous_update=False,
                           layout=W.Layout(width="100%", height="90px")),
    }
    controls["text"].observe(_pasted(controls["example"]), names="value")   # before the panel's own observers
    return Panel("Read an out-of-memory message", controls, compute_oom, render_oom, auto_run=True,
                 description="Every figure, which case it is (fragmentation, too big, another process…), "
                             "and the situation rebuilt in the simulated allocator.")
