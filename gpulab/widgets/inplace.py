"""In-place ReLU panel (lesson 06): the same conv stack with ReLU(inplace=False) and
ReLU(inplace=True) -> peak, forward peak, allocation traffic and saved-for-backward bytes,
next to the formula and the reference articles' claim. When the live engine is not cuda, the recorded
GPU run with the same settings is shown beside it, or a one-line note says that none matches."""
from __future__ import annotations

from typing import Any

from gpulab.course.inplace import BLOCKS, MODES, InplaceResult, inplace_experiment, saved_table_html
from gpulab.record.lookup import RecordLookup, find_record
from gpulab.record.views import counter_text, recorded_html
from gpulab.units import format_bytes
from gpulab.widgets.base import Panel, dropdown, slider, ENGINES, engine_dropdown
from gpulab.widgets.guard import memory_guard

__all__ = [
    "compute_inplace", "inplace_panel", "predict_inplace_peak", "recorded_inplace", "render_inplace"
]



def compute_inplace(block: str, depth: int, channels: int, batch: int, image_size: int, mode: str,
                    engine: str) -> InplaceResult:
    return inplace_experiment(block, int(depth), int(channels), int(batch), int(image_size), mode, engine)


def predict_inplace_peak(params: dict[str, Any]) -> int:
    """The guard's prediction: the larger of the two peaks on fake tensors."""
    r = compute_inplace(**dict(params, engine="fake"))
    return max(run.peak_bytes for run in r.runs.values())


def render_inplace(result: InplaceResult) -> list[Any]:
    from IPython.display import HTML
    items: list[Any] = [result]
    saved = result.runs[True].saved
    if saved:
        items.append(HTML(saved_table_html(saved, "what autograd keeps with ReLU(inplace=True), read from "
                                                  "grad_fn._saved_* — " + result.label)))
    items.append(result.figure())
    if result.engine != "cuda":
        items.append(HTML(recorded_html(recorded_inplace(result), _inplace_rows,
                                        ["ReLU", "peak (tracker)", "forward peak", "saved for backward",
                                         "max_memory_allocated − baseline"])))
    return items


def recorded_inplace(result: InplaceResult) -> RecordLookup:
    """The recorded GPU run with this result's settings, or why there is none."""
    return find_record("inplace", block=result.block, depth=result.depth, channels=result.channels,
                       batch=result.batch, image_size=result.image_size, mode=result.mode)


def _inplace_rows(r: dict[str, Any]) -> list[list[str]]:
    rows = []
    for key, run in r["runs"].items():
        rows.append([key, format_bytes(run["peak_bytes"]), format_bytes(run["forward_peak"]),
                     "—" if run.get("saved_bytes") is None else format_bytes(run["saved_bytes"]),
                     counter_text(run)])
    return rows


def inplace_panel(block: str = "conv-relu", depth: int = 4, channels: int = 16, batch: int = 8,
                  image_size: int = 32, mode: str = "train step", engine: str = "auto") -> Panel:
    controls = {
        "block": dropdown("block", BLOCKS, block),
        "depth": slider("blocks", depth, 1, 12),
        "channels": slider("channels", channels, 1, 256, log=True),
        "batch": slider("batch", batch, 1, 256, log=True),
        "image_size": slider("image size", image_size, 8, 256, step=8),
        "mode": dropdown("mode", MODES, mode),
        "engine": engine_dropdown(engine),
    }
    return Panel("ReLU(inplace=True): what it saves, and what it does not", controls, compute_inplace,
                 render_inplace, guard=memory_guard(predict_inplace_peak),
                 description="Two runs of the same stack, one with <code>ReLU(inplace=False)</code> and one with "
                             "<code>ReLU(inplace=True)</code>, each tracked tensor by tensor.")
