"""Robustness: what students do to notebooks; and the one execution test of every lesson.

* Run All, then rerun what a student reruns in the same kernel: the predict-first cells (the
  exercise, the answer, its check) and the cells that show a panel (a student shows one again,
  and its controls call the lesson's experiments). Each shows the same numbers as the first time,
  in its outputs and in its panels' Output widgets (timings excluded: "done in 0.23 s", numbers
  with a time unit, table columns headed time/ms/s). The measurement cells in between are not
  rerun: a second Run All doubled each lesson's cost, the suite's largest, to rerun cells that
  students run once.
* A restart is a fresh kernel's Run All: this test's first pass is one, and the browser test
  (tests/test_browser.py) runs every lesson that way in JupyterLab, so it is not run again here
  (each lesson's execution is the suite's largest cost). The Binder test runs lesson 00 so in
  Binder's environment.
* Click Run rapidly, or while a run is in progress: the panel runs once more with the newest
  values (one queued rerun, not one per click), re-enables the button, and shows no error.
"""
from __future__ import annotations

import ast
import copy
import html as htmllib
import json
import os
import pathlib
import re
import sys
import time

import nbformat
import pytest
import torch
from nbclient import NotebookClient

from conftest import LESSONS, core_day_lessons, notebook_client, notebook_errors

LESSONS_DIR = pathlib.Path(os.environ.get("GPULAB_LESSONS_DIR", LESSONS)).resolve()
NOTEBOOKS = sorted(LESSONS_DIR.glob("[0-9][0-9]_*.ipynb"))

# ---------------------------------------------------------------------------------------------
# normalising outputs: keep the numbers a student reads, drop timings and object addresses

TIME_UNIT = r"(?:ns|µs|us|ms|s|sec|secs|seconds?|min|minutes?|it/s|s/it|steps?/s|img/s|images/s)"
_TIMING = [
    re.compile(r"done in\s+[\d.]+\s*s", re.I),
    re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?\s*" + TIME_UNIT + r"(?![A-Za-z])"),
    re.compile(r"\b0x[0-9a-f]+\b", re.I),
    re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d(:\d\d(\.\d+)?)?"),  # wall-clock stamps
    re.compile(r"[×x]\s*[\d.]+\s+(as long|comparing)", re.I),  # time ratios ("takes ×1.37 as long")
    # a verdict made from a time ratio (lesson 07: checkpointing's slowdown on this shared CPU)
    re.compile(r"the slowdown is modest|breaks for speed on this CPU", re.I),
    # lesson 07's sentence on what the timings' spreads support (CheckpointResult.timing_verdict): which of
    # its three it is depends on this shared CPU's noise, run to run
    re.compile(r"At k = \d+ a step (?:is slower|measured faster).*?(?:do not overlap \(.*?\)\)\.|more rounds\.)"
               r"|The timings of k = \d+ and k = 1 overlap.*?narrow the spreads\.", re.S),
    # the machine's free RAM right now (not a lesson's measurement; other processes move it)
    re.compile(r"available now[\s|]+[\d.,]+\s*[KMGT]i?B\s*/\s*[\d.,]+\s*[KMGT]i?B", re.I),
]
# On a GPU, figures that another process or the allocator's caching history moves between two
# runs of the same cell (NVML's device-wide "used", reserved memory and what is derived from them)
# are not the lesson's measurements: blanked there, like timings. On the CPU they are simulated,
# hence deterministic, and compared.
ON_GPU = torch.cuda.is_available()
_GPU_VOLATILE = re.compile(r"(nvml|nvidia-smi|reserved|beyond the allocator|cuda context)", re.I)
_GPU_VOLATILE_TEXT = re.compile(r"(?i)\b(nvml|nvidia-smi|reserved)\b([^.|<]{0,60}?)[-+]?\d[\d,]*(?:\.\d+)?\s*[KMGT]i?B")
_TIME_HEADER = re.compile(r"\b(time|times|ms|seconds?|sec|latency|throughput|speed|slowdown|speedup|"
                          r"overhead|duration|elapsed|it/s|s/it)\b", re.I)
_ROW = re.compile(r"<tr[^>]*>(.*?)</tr>", re.S | re.I)
_CELL = re.compile(r"<t([hd])[^>]*>(.*?)</t[hd]>", re.S | re.I)
_TAG = re.compile(r"<[^>]+>")
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?%?")


def _drop_time_columns(html: str) -> str:
    """In each HTML table, blank out the columns whose header mentions a time."""
    def table(m: re.Match) -> str:
        body = m.group(0)
        rows = _ROW.findall(body)
        if not rows:
            return body
        header = [_TAG.sub("", c[1]) for c in _CELL.findall(rows[0])]
        drop = {i for i, h in enumerate(header) if _volatile_label(htmllib.unescape(h))}
        out = []
        for r in rows:
            cells = [_TAG.sub("", c[1]) for c in _CELL.findall(r)]
            if cells and _volatile_label(htmllib.unescape(cells[0])):
                # a row about a time (e.g. "step time at k = 4 vs k = 1": ×1.37): keep its label only
                cells = [cells[0]]
            out.append(" | ".join(c for i, c in enumerate(cells) if i not in drop))
        return "<table>" + "\n".join(out) + "</table>"
    return re.sub(r"<table.*?</table>", table, html, flags=re.S | re.I)


def _volatile_label(label: str) -> bool:
    """A column header or row label whose numbers change from run to run: a time, and on a GPU
    a device-wide or reserved figure."""
    return bool(_TIME_HEADER.search(label) or (ON_GPU and _GPU_VOLATILE.search(label)))


# matplotlib's font-cache messages ("findfont: Font family [...] not found. Falling back to ...",
# "findfont: Found a missing font file. Rebuilding cache.") say how this machine's cache stood when a
# figure was first drawn (a cache written by a venv since deleted), not what the lesson computed
_FONT_CACHE = re.compile(r"findfont: [^\n]*")


def normalise(text: str, is_html: bool = False) -> str:
    text = _FONT_CACHE.sub("", text)
    if is_html:
        text = _drop_time_columns(text)
        text = htmllib.unescape(_TAG.sub(" ", re.sub(r"<(style|script)[^>]*>.*?</\1>", "", text, flags=re.S | re.I)))
    for pat in _TIMING:
        text = pat.sub("<t>", text)
    if ON_GPU:
        text = _GPU_VOLATILE_TEXT.sub(lambda m: f"{m.group(1)}{m.group(2)}<gpu>", text)
    return re.sub(r"\s+", " ", text).strip()


def _texts(outputs) -> list[str]:
    """The readable text of a list of outputs (stream, text/plain, text/html; images skipped).

    Consecutive stream outputs are one text: how a kernel cuts what a cell prints into stream
    messages depends on when its output thread flushes (under load, more often), not on what
    the lesson printed."""
    texts = []
    merged: list[dict] = []
    for out in outputs:
        if (out.get("output_type") == "stream" and merged and merged[-1].get("output_type") == "stream"
                and merged[-1].get("name") == out.get("name")):
            merged[-1] = dict(merged[-1], text=merged[-1].get("text", "") + out.get("text", ""))
        else:
            merged.append(out)
    for out in merged:
        kind = out.get("output_type")
        if kind == "stream":
            texts.append(normalise(out.get("text", "")))
        elif kind in ("execute_result", "display_data"):
            data = out.get("data", {})
            if "text/html" in data:
                texts.append(normalise(data["text/html"], is_html=True))
            elif "text/plain" in data and "application/vnd.jupyter.widget-view+json" not in data \
                    and not any(k.startswith("image/") for k in data):
                texts.append(normalise(data["text/plain"]))
        elif kind == "error":
            texts.append(f"ERROR {out.get('ename')}: {out.get('evalue')}")
    return [t for t in texts if t]


def _widget_views(outputs) -> list[str]:
    """The model ids of the widgets a cell's outputs display."""
    views = []
    for out in outputs:
        view = out.get("data", {}).get("application/vnd.jupyter.widget-view+json")
        if view and view.get("model_id"):
            views.append(view["model_id"])
    return views


def _shown_widget_texts(outputs, state: dict) -> list[str]:
    """Texts inside the Output widgets that a cell's displayed widgets hold (their children, and
    theirs), in the order reached: a panel's result as the student sees it under that cell."""
    texts, seen = [], set()
    todo = list(reversed(_widget_views(outputs)))
    while todo:
        mid = todo.pop()
        if mid in seen or mid not in state:
            continue
        seen.add(mid)
        model = state[mid]
        st = model.get("state", model) if isinstance(model, dict) else {}
        if st.get("_model_name") == "OutputModel":
            texts.append(" || ".join(_texts(st.get("outputs", []))))
        refs = re.findall(r"IPY_MODEL_([\w-]+)", json.dumps({k: v for k, v in st.items() if k != "outputs"}))
        todo.extend(reversed(refs))
    return texts


def _widget_texts(state: dict) -> list[str]:
    """Texts shown inside Output widgets (where panels render), in creation order."""
    texts = []
    for model in state.values():
        st = model.get("state", model) if isinstance(model, dict) else {}
        if st.get("_model_name") == "OutputModel":
            texts.append(" || ".join(_texts(st.get("outputs", []))))
    return texts


def _errors(outputs) -> list[str]:
    errs = []
    for out in outputs:
        if out.get("output_type") == "error":
            errs.append(f"{out.get('ename')}: {out.get('evalue')}")
        if out.get("output_type") == "stream" and out.get("name") == "stderr" and "Traceback" in out.get("text", ""):
            errs.append("traceback on stderr")
        if "gpulab-error" in json.dumps(out.get("data", {})):
            errs.append("a panel showed an error")
    return errs


def _run_pass(client: NotebookClient, nb, only: set[int] | None = None) -> dict:
    """Execute the code cells (those numbered in ``only``, else all) in the client's current
    kernel; return per-cell texts, and per cell the texts of the panels it shows."""
    client.widget_state.clear() if hasattr(client, "widget_state") else None
    texts, errors, outputs = {}, [], {}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or (only is not None and i not in only):
            continue
        cell.outputs = []
        client.execute_cell(cell, i)
        texts[i] = _texts(cell.outputs)
        outputs[i] = copy.deepcopy(cell.outputs)
        errors += [f"cell {i}: {e}" for e in _errors(cell.outputs)]
    state = copy.deepcopy(getattr(client, "widget_state", {}))
    widgets = _widget_texts(state)
    errors += [f"panel output {j}: a panel showed an error" for j, w in enumerate(widgets) if "Could not run" in w]
    shown = {i: _shown_widget_texts(outs, state) for i, outs in outputs.items()}
    return {"cells": texts, "widgets": widgets, "shown": shown, "errors": errors, "outputs": outputs}


def _called_names(source: str) -> tuple[set[str], set[str]]:
    """The names a cell calls (functions and methods) and the names it assigns at top level
    (IPython magics left out)."""
    src = "\n".join(ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!")))
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return set(), set()
    calls = {n.func.id if isinstance(n.func, ast.Name) else n.func.attr
             for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))}
    assigned = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    return calls, assigned


def student_reruns(nb, first: dict) -> set[int]:
    """The code cells a student reruns: the predict-first cells (one that makes an exercise,
    ``exercise_*(...)``, the ``answer = ...`` cell, the ``.check(answer)`` cell) and every cell
    that showed a widget in the first pass (a panel, shown again)."""
    cells = set()
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        calls, assigned = _called_names(cell.source)
        if (any(c.startswith("exercise_") or c == "check" for c in calls) or "answer" in assigned
                or _widget_views(first["outputs"].get(i, []))):
            cells.add(i)
    return cells


def _around_first_difference(a: str, b: str, width: int = 200) -> tuple[str, str]:
    """The two texts from a little before the first character where they differ."""
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    start = max(0, i - width // 2)
    return a[start:start + 2 * width], b[start:start + 2 * width]


# torch.profiler's memory timeline infers each allocation's category from the op graph
# (torch/profiler/_memory_profiler.py); between two runs of the same step in one kernel it has put
# 1 MiB of activations under "unknown" in one run and not in the other (about one run in eight on
# this machine), with the same total. Lesson 13 says so; the rerun check compares the tracker's
# side, the totals and the peaks of that table, not the profiler's split between its categories.
_PROFILER_SPLIT = re.compile(r"\b(" + "|".join(re.escape(c) for c in
                             ("parameter", "optimizer_state", "gradient", "activation", "temporary",
                              "autograd_detail", "unknown (no tensor or category)", "input", "buffer"))
                             + r") \| [0-9.,]+ (?:B|KiB|MiB|GiB)")


_PROFILER_FIGURES = re.compile(r"(profiler|At the profiler's peak,) [0-9,]+ B( \(difference [+-]?[0-9,]+ B\))?")


def _without_profiler_split(texts: list[str]) -> list[str]:
    """The texts without the profiler's own split and its peak (its category of a megabyte can
    move between runs, and with it the moment of its peak): the tracker's side stays compared."""
    return [_PROFILER_FIGURES.sub(r"\1 … B", _PROFILER_SPLIT.sub(r"\1 | …", t)) for t in texts]


def _diff(a: dict, b: dict, nb) -> list[str]:
    diffs = []
    for i, ta in a["cells"].items():
        tb = b["cells"].get(i)
        if tb is not None and "profile_step(" in nb.cells[i].source:
            ta, tb = _without_profiler_split(ta), _without_profiler_split(tb)
        if tb is not None and ta != tb:
            src = nb.cells[i].source.splitlines()[0][:60] if nb.cells[i].source else ""
            fa, fb = _around_first_difference(" / ".join(ta), " / ".join(tb))
            diffs.append(f"cell {i} ({src!r}):\n  first:  …{fa}\n  second: …{fb}")
    for i, wb in b["shown"].items():
        wa = a["shown"].get(i, [])
        src = nb.cells[i].source.splitlines()[0][:60] if nb.cells[i].source else ""
        if len(wa) != len(wb):
            diffs.append(f"cell {i} ({src!r}): {len(wa)} output widgets the first time, {len(wb)} the second")
        for j, (x, y) in enumerate(zip(wa, wb)):
            if x != y:
                fa, fb = _around_first_difference(x, y)
                diffs.append(f"cell {i} ({src!r}), output widget {j}:\n  first:  …{fa}\n  second: …{fb}")
    return diffs


def test_on_a_gpu_reserved_and_nvml_figures_are_not_compared(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ON_GPU", True)
    a = ("<table><tr><th>counter</th><th>bytes</th></tr><tr><td>max_memory_allocated</td><td>3 MiB</td></tr>"
         "<tr><td>max_memory_reserved</td><td>20 MiB</td></tr><tr><td>NVML used (nvidia-smi)</td><td>900 MiB</td></tr></table>")
    b = a.replace("20 MiB", "22 MiB").replace("900 MiB", "1,013 MiB")
    assert normalise(a, True) == normalise(b, True)
    assert normalise(a, True) != normalise(a.replace("3 MiB", "4 MiB"), True)   # allocated still compared
    assert normalise("NVML used 900.0 MiB; peak 3 MiB") == normalise("NVML used 913.5 MiB; peak 3 MiB")
    monkeypatch.setattr(sys.modules[__name__], "ON_GPU", False)                 # on the CPU: simulated, compared
    assert normalise(a, True) != normalise(b, True)


def test_a_print_cut_into_several_stream_messages_reads_as_one():
    one = [{"output_type": "stream", "name": "stdout", "text": "alexnet 61,100,840\nresnet18 11,689,512\n"}]
    two = [{"output_type": "stream", "name": "stdout", "text": "alexnet 61,100,840\n"},
           {"output_type": "stream", "name": "stdout", "text": "resnet18 11,689,512\n"}]
    assert _texts(one) == _texts(two)
    assert _texts(one) != _texts([dict(one[0], text="alexnet 61,100,841\nresnet18 11,689,512\n")])


def test_the_profilers_own_split_is_left_out_of_the_rerun_check_and_nothing_else():
    first = ("gradients | 517.5 KiB | gradient | 518.0 KiB activations | 7.7 MiB | activation | 6.5 MiB "
             "unknown (no tensor or category) | 1.0 MiB total at the peak | 10.8 MiB")
    second = first.replace("gradient | 518.0 KiB", "gradient | 517.5 KiB").replace(
        "activation | 6.5 MiB", "activation | 7.5 MiB").replace("1.0 MiB total", "16 B total")
    assert _without_profiler_split([first]) == _without_profiler_split([second])
    assert _without_profiler_split([first]) != _without_profiler_split([first.replace("7.7 MiB", "7.8 MiB")])
    assert _without_profiler_split([first]) != _without_profiler_split([first.replace("10.8 MiB", "10.9 MiB")])
    note = "Peaks: tracker 11,298,024 B, profiler 11,298,536 B (difference +512 B). At the profiler's peak, 1,048,592 B are"
    moved = note.replace("11,298,536 B (difference +512 B)", "11,298,024 B (difference +0 B)").replace("1,048,592", "16")
    assert _without_profiler_split([note]) == _without_profiler_split([moved])
    assert _without_profiler_split([note]) != _without_profiler_split([note.replace("tracker 11,298,024", "tracker 11,298,536")])


def test_a_student_reruns_the_predict_first_cells_and_the_panels_only():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (
        "%matplotlib inline\nfrom gpulab.course.x import measure, exercise_peak\nrun = measure()",  # 0: measures
        "q = exercise_peak(run)\nprint(q.question)",                                               # 1: predict-first
        "answer = ...  # bytes",                                                                   # 2
        "q.check(answer)",                                                                         # 3
        "from gpulab.widgets import step_panel\nstep_panel()",                                    # 4: a panel
        "table = run.table()",                                                                     # 5
    )]
    view = {"output_type": "display_data", "data": {"application/vnd.jupyter.widget-view+json": {"model_id": "ab12"}}}
    first = {"outputs": {4: [view]}}
    assert student_reruns(nb, first) == {1, 2, 3, 4}
    assert student_reruns(nb, {"outputs": {}}) == {1, 2, 3}     # a cell that showed no widget is not a panel


def test_a_cells_panel_texts_are_those_its_widgets_hold():
    out = lambda text: {"_model_name": "OutputModel", "outputs": [{"output_type": "stream", "name": "stdout", "text": text}]}
    state = {"box": {"_model_name": "VBoxModel", "children": ["IPY_MODEL_c1", "IPY_MODEL_o1"]},
             "c1": {"_model_name": "IntSliderModel", "value": 3}, "o1": out("peak 3 MiB"),
             "o2": out("another cell's panel")}
    view = {"output_type": "display_data", "data": {"application/vnd.jupyter.widget-view+json": {"model_id": "box"}}}
    assert _shown_widget_texts([view], state) == ["peak 3 MiB"]
    assert _shown_widget_texts([], state) == []


def test_normalise_drops_timings_keeps_memory():
    assert normalise("done in 0.23 s; peak 12.5 MiB") == normalise("done in 1.70 s; peak 12.5 MiB")
    # lesson 07's sentence about the timings' spreads: which of its three it is, is noise
    import dataclasses

    from gpulab.course.checkpointing import checkpoint_sweep
    from gpulab.record.runs.checkpoint import Timing
    r = checkpoint_sweep(4, 8, 4, "divisors of N", "fake")
    texts = set()
    for base, other in (((10, 11, 12), (14, 15, 16)), ((10, 14, 20), (12, 13, 15)), ((20, 22, 24), (10, 11, 12))):
        pts = [dataclasses.replace(p, timing=Timing([t / 1e3 for t in (base if p.segments == 1 else other)], 1, "cpu"))
               for p in r.points]
        timed = dataclasses.replace(r, points=pts)
        texts.add(normalise(f"Time: {timed.timing_verdict(timed.points[-1])} Lowest 2 MiB"))
    assert len(texts) == 1 and "Lowest 2 MiB" in texts.pop()   # the three read alike; the memory stays
    assert normalise("step took 31 ms, 4.0 GiB") == normalise("step took 45 ms, 4.0 GiB")
    assert normalise("peak 12.5 MiB") != normalise("peak 12.6 MiB")
    a = "<table><tr><th>segments</th><th>peak</th><th>time (ms)</th></tr><tr><td>2</td><td>3 MiB</td><td>12.1</td></tr></table>"
    b = a.replace("12.1", "19.7")
    assert normalise(a, True) == normalise(b, True)
    assert normalise(a, True) != normalise(a.replace("3 MiB", "4 MiB"), True)


# ---------------------------------------------------------------------------------------------

CELL_TIMEOUT_S = 300   # one cell; nbclient fails the test with CellTimeoutError past it


# the core day's lessons (docs/teaching.md's day table) in make test; the extension and homework lessons
# in make test-extended, which CI runs after it (make test's time, as the browser test splits them)
DAY = core_day_lessons()
RUN_LESSONS = [p if p.name[:2] in DAY else pytest.param(p, marks=pytest.mark.extended) for p in NOTEBOOKS]


@pytest.mark.notebook
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("path", RUN_LESSONS, ids=lambda p: getattr(p, "stem", None))
def test_lesson_executes_and_reruns(path, monkeypatch):
    """One execution of each lesson, several properties checked on it: Run All works (no error
    output, no traceback on stderr, no panel showing an error); rerunning what a student reruns
    (``student_reruns``) in the same kernel works and shows the same numbers."""
    monkeypatch.delenv("MPLBACKEND", raising=False)  # as a student gets it: the inline backend
    nb = nbformat.read(path, as_version=4)
    client = notebook_client(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", store_widget_state=True,
                            resources={"metadata": {"path": str(LESSONS_DIR)}})
    with client.setup_kernel():
        t0 = time.perf_counter()
        first = _run_pass(client, nb)
        seconds = time.perf_counter() - t0
        client.set_widgets_metadata()  # the widget state, where panels' Output widgets keep their contents
        errors = first["errors"] + notebook_errors(nb)
        assert not errors, f"{path.name}, Run All: " + "; ".join(errors)
        rerun = student_reruns(nb, first)
        t0 = time.perf_counter()
        second = _run_pass(client, nb, only=rerun)
        print(f"{path.name}: Run All in {seconds:.1f} s; {len(rerun)} of {len(first['cells'])} code cells "
              f"rerun in {time.perf_counter() - t0:.1f} s")
        assert not second["errors"], f"{path.name}, rerun in the same kernel: " + "; ".join(second["errors"])
        rerun_diffs = _diff(first, second, nb)
    assert not rerun_diffs, (f"{path.name}: numbers differ between the first run and a rerun in the same kernel:\n"
                             + "\n".join(rerun_diffs))


# ---------------------------------------------------------------------------------------------
# rapid clicks, in process

def test_rapid_clicks_each_run():
    from gpulab.widgets import step_panel
    panel = step_panel(model="cnn", batch=4, engine="fake")
    for _ in range(3):
        panel.run_button.click()
    assert panel.runs == 3
    assert panel.error is None and panel.blocked is None
    assert not panel.run_button.disabled
    assert "done in" in panel.status.value
    assert panel.result.batch == 4


def test_a_model_too_big_for_the_image_size_moves_the_size_and_answers():
    """Found by the panel benchmark: the step panel at image size 32, model -> alexnet, refused the pair
    ("image size 32 is too small for alexnet"). The size now follows to the model's default, and a size
    the new model takes is left as the student set it."""
    from gpulab.models.registry import resolve_model
    from gpulab.widgets import step_panel
    panel = step_panel(model="cnn", batch=2, image_size=32, engine="fake")
    panel.controls["model"].value = "alexnet"
    assert panel.controls["image_size"].value == resolve_model("alexnet").default_image_size
    panel.run_button.click()
    assert panel.error is None and panel.blocked is None and panel.result.image_size == panel.controls["image_size"].value
    panel.controls["image_size"].value = 240
    panel.controls["model"].value = "cnn"
    assert panel.controls["image_size"].value == 240


def test_click_during_run_queues_one_rerun_with_newest_values():
    from gpulab.widgets import step_panel
    panel = step_panel(model="cnn", batch=4, engine="fake")
    inner = panel._compute
    calls = []

    def compute(**params):
        calls.append(params["batch"])
        if len(calls) == 1:  # the student moves the slider and clicks three times mid-run
            assert panel.run_button.disabled, "the Run button must be disabled during a run"
            panel.controls["batch"].value = 8
            panel.run_button.click()
            panel.controls["batch"].value = 16
            panel.run_button.click()
            panel.run_button.click()
            assert calls == [4], "a click during a run must not start a nested run"
        return inner(**params)

    panel._compute = compute
    panel.run_button.click()
    assert calls == [4, 16], f"expected the first run and one rerun with the newest batch, got {calls}"
    assert panel.runs == 2
    assert panel.result.batch == 16
    assert panel.error is None and panel.blocked is None
    assert not panel.run_button.disabled
    assert "done in" in panel.status.value

    # afterwards the panel behaves normally again
    panel.run_button.click()
    assert calls == [4, 16, 16] and panel.runs == 3


def test_error_during_rerun_is_shown_and_panel_recovers():
    from gpulab.widgets import step_panel
    panel = step_panel(model="cnn", batch=4, engine="fake")
    inner = panel._compute
    state = {"n": 0}

    def compute(**params):
        state["n"] += 1
        if state["n"] == 1:
            panel.run_button.click()        # queue a rerun ...
            return inner(**params)
        if state["n"] == 2:
            raise RuntimeError("boom")       # ... which fails
        return inner(**params)

    panel._compute = compute
    panel.run_button.click()
    assert state["n"] == 2 and panel.error == "RuntimeError: boom"
    assert not panel.run_button.disabled and "failed" in panel.status.value
    panel.run_button.click()                 # the next click works again
    assert panel.error is None and panel.result is not None and "done in" in panel.status.value
