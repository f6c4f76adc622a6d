"""Benchmark: how long a student waits after moving a panel's control, per core-day panel (#47 item 9).

    .venv/bin/python benchmarks/panel_latency.py [--only 04 11 12] [--changes 4] [--every-control] [--browser] [--json FILE]

Each lesson is opened and run top to bottom, then every gpulab panel on it gets ``--changes``
changes the way tests/test_browser.py makes them: the first slider one step left (right at its
lower end), and again, then the first dropdown to its next option, and again; a run-only panel is
then run (its Run button). Prints, per panel: the median and the largest wait over those changes,
and for the what-if panel its formula side (every move) and its measured side apart. The kernel-side
mode also prints the kernel process's CPU time per change (all its threads: the what-if's worker
included), which a shared machine's load does not inflate as it does the wait. ``--every-control``
(kernel mode): each panel's every control moved once instead (a slider one step, a dropdown to its next
option, the engine's included), each move's wait printed with the control's name: a dtype or model
dropdown can cost more than the first slider.

* default: the lesson runs in a fresh kernel through nbclient (as tests/test_lessons.py runs it) and
  the changes are made in that kernel: the wait is the kernel's, from the change to the rendered answer;
* ``--browser``: JupyterLab and headless Chromium (Playwright, the system Chromium), as
  tests/test_browser.py drives them: the wait is from the key press or selection to the panel's status
  saying it is done, as the page shows it (the comm messages both ways included). Chromium, the
  Jupyter server and the kernel share the machine's cores. Each change here moves the panel's first
  slider (its first dropdown where it has none), so a run-only panel sweeps a new setting every time.

Also prints the what-if formula's own latency over 500 moves (target: under 0.1 s). The machine may
be shared (2 cores): the load average is printed beside each lesson. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(os.environ.get("GPULAB_BENCH_ROOT") or Path(__file__).resolve().parents[1])   # another tree: a baseline
sys.path.insert(0, str(ROOT / "tests"))

PANEL_LESSONS = ("00", "01", "02", "03", "04", "05", "07", "08", "09", "11", "12", "13", "14")

# runs inside the lesson's kernel after its Run All: finds the panels, changes them, prints JSON
DRIVER = r'''
import gc as _gc, json as _json, time as _time, ipywidgets as _W
from gpulab.widgets.base import Panel as _Panel
try:
    from gpulab.widgets.whatif import WhatIfPanel as _WhatIf
except ImportError:   # a tree without the what-if panel (a baseline)
    class _WhatIf: pass

def _one_step(c):
    """``c``'s value one step on: a slider one step left (right at its lower end), a dropdown its next option."""
    if isinstance(c, _W.IntSlider):
        return c.value - c.step if c.value - c.step >= c.min else c.value + c.step
    opts = list(c._options_values)
    if len(opts) < 2:
        return None
    k = opts.index(c.value)
    if isinstance(c, _W.Dropdown):
        return opts[(k + 1) % len(opts)]
    return opts[k - 1] if k > 0 else opts[k + 1]

def _gpulab_moves(panel, n):
    if __EVERY__:   # every control once, in the panel's order (then again, while n asks for more)
        order = [c for c in panel.controls.values() if isinstance(c, (_W.IntSlider, _W.SelectionSlider, _W.Dropdown))]
        return [(c, None) for c in (order * n)[:max(n, len(order))]]
    sliders = [c for c in panel.controls.values() if isinstance(c, (_W.IntSlider, _W.SelectionSlider))]
    drops = [c for c in panel.controls.values() if isinstance(c, _W.Dropdown)]
    moves = []
    for i in range(n):
        if i < 2 and sliders:
            c = sliders[0]
            if isinstance(c, _W.IntSlider):   # one step, as ArrowLeft (ArrowRight at the lower end)
                moves.append((c, c.value - c.step if c.value - c.step >= c.min else c.value + c.step))
            else:
                opts = list(c._options_values)
                k = opts.index(c.value)
                moves.append((c, opts[k - 1] if k > 0 else opts[min(k + 1, len(opts) - 1)]))
        elif drops:
            c = drops[0]
            opts = list(c._options_values)
            moves.append((c, opts[(opts.index(c.value) + 1) % len(opts)]))
    return moves

_rows = []
_found = [o for o in _gc.get_objects() if issubclass(type(o), (_Panel, _WhatIf))]   # no weak proxies
for _p in _found:
    _title = getattr(_p, "title", "What if? (lesson 11)")
    _waits, _measured, _cpu, _moved = [], [], [], []
    if not hasattr(_p, "controls") or not _p.controls:
        continue
    _n = len(_gpulab_moves(_p, __CHANGES__))
    for _i in range(_n):
        _mv = _gpulab_moves(_p, __CHANGES__)
        if _i >= len(_mv):
            break
        _c, _v = _mv[_i]
        if _v is None:
            _v = _one_step(_c)
            if _v is None or _v == _c.value:
                continue
        _name = next(k for k, c in _p.controls.items() if c is _c)
        _t0, _c0 = _time.perf_counter(), _time.process_time()
        _c.value = _v
        if isinstance(_p, _Panel) and not _p.auto_run:
            _p.run()
        _waits.append(_time.perf_counter() - _t0)
        if isinstance(_p, _WhatIf):
            _p.wait(300)
            _measured.append(_time.perf_counter() - _t0)
        _cpu.append(_time.process_time() - _c0)
        _moved.append([_name, str(_v), _waits[-1], _cpu[-1], getattr(_p, "error", None)])
    _rows.append({"panel": _title, "kind": "live" if getattr(_p, "auto_run", True) else "run-only",
                  "waits": _waits, "measured": _measured, "cpu": _cpu, "error": getattr(_p, "error", None),
                  "moves": _moved})
print("GPULAB-LATENCY " + _json.dumps(_rows))
'''


def kernel_latency(path: Path, changes: int, timeout: int = 900, every: bool = False) -> list[dict]:
    import nbformat
    from nbformat.v4 import new_code_cell

    from conftest import notebook_client
    nb = nbformat.read(path, as_version=4)
    client = notebook_client(nb, timeout=timeout, kernel_name="python3",
                             resources={"metadata": {"path": str(ROOT / "lessons")}})
    with client.setup_kernel():
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code":
                client.execute_cell(cell, i)
        probe = new_code_cell(DRIVER.replace("__CHANGES__", str(changes)).replace("__EVERY__", str(every)))
        nb.cells.append(probe)
        client.execute_cell(probe, len(nb.cells) - 1)
    text = "".join(o.get("text", "") for o in probe.outputs if o.get("output_type") == "stream")
    line = next((ln for ln in text.splitlines() if ln.startswith("GPULAB-LATENCY ")), None)
    if line is None:
        raise RuntimeError(f"{path.name}: the driver printed no result: {text[-500:]}")
    return json.loads(line.removeprefix("GPULAB-LATENCY "))


def browser_latency(paths: list[Path], changes: int) -> dict[str, list[dict]]:
    """The same changes in JupyterLab + headless Chromium (tests/test_browser.py's server and helpers)."""
    import tempfile

    from playwright.sync_api import sync_playwright

    import test_browser as B
    out: dict[str, list[dict]] = {}
    chromium = B._find_chromium()
    if chromium is None:
        raise SystemExit("no Chromium: apt-get install -y chromium (or set GPULAB_CHROMIUM)")
    labs = B._serve_lab(ROOT / "lessons", Path(tempfile.mkdtemp()))
    lab = next(labs)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=B.CHROMIUM_ARGS, headless=True)
            for path in paths:
                load = os.getloadavg()[0]
                page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
                B._open_and_run_all(page, lab, path.name)
                B._wait_run_all(page, lab)
                rows = []
                panels = page.locator(".gpulab-panel")
                for i in range(panels.count()):
                    panel = panels.nth(i)
                    panel.scroll_into_view_if_needed()
                    B._wait_panel_idle(page, panel)
                    waits = []
                    for _ in range(changes):
                        before = B._status_text(panel), B._output_text(panel)
                        t0 = time.perf_counter()
                        moved = B._nudge_control(page, panel)
                        if moved is None:
                            break
                        btn = panel.locator("button.gpulab-run").first
                        if btn.count() and "needed after a change" in btn.inner_text():
                            btn.click()
                        waits.append(_wait_done(page, panel, before, t0))
                    rows.append({"panel": panel.locator("h4").first.inner_text()[:70], "waits": waits})
                out[path.stem] = rows + [{"load": [load, os.getloadavg()[0]]}]
                page.context.close()
                lab.shutdown_kernels()
            browser.close()
    finally:
        next(labs, None)
    return out


def _wait_done(page, panel, before: tuple[str, str], t0: float, limit_s: float = 300.0) -> float:
    """Seconds from ``t0`` until the panel's status says done (or failed) with something new shown."""
    import test_browser as B
    while time.perf_counter() - t0 < limit_s:
        status, output = B._status_text(panel), B._output_text(panel)
        done = any(w in status for w in ("done in", "measured in", "failed", "not run"))
        if done and (status, output) != before:
            return time.perf_counter() - t0
        page.wait_for_timeout(25)
    return float("nan")


def formula_latency(moves: int = 500) -> tuple[float, float]:
    """(median, max) seconds of the what-if panel's formula side per move (the panel's own update)."""
    import random

    from gpulab.widgets.whatif import WhatIfPanel
    panel = WhatIfPanel(auto_measure=False)
    rng = random.Random(0)
    waits = []
    for _ in range(moves):
        name = rng.choice(["model", "seq_len", "batch", "recompute", "precision", "optimizer", "zero", "dp", "tp"])
        c = panel.controls[name]
        t0 = time.perf_counter()
        c.value = rng.choice(list(c._options_values))
        waits.append(time.perf_counter() - t0)
    return statistics.median(waits), max(waits)


def _fmt(waits: list[float]) -> str:
    if not waits:
        return "no change possible"
    return f"median {statistics.median(waits):6.2f} s, max {max(waits):6.2f} s over {len(waits)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="lesson numbers (default: the core day's lessons with panels)")
    ap.add_argument("--changes", type=int, default=4)
    ap.add_argument("--browser", action="store_true", help="JupyterLab + headless Chromium, as the browser test")
    ap.add_argument("--every-control", action="store_true",
                    help="kernel mode: move every control of each panel once (a slider one step, a dropdown to its "
                         "next option; --changes more moves go round again) and print each move's wait")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    wanted = args.only or PANEL_LESSONS
    paths = [p for p in sorted((ROOT / "lessons").glob("[0-9][0-9]_*.ipynb")) if p.name[:2] in wanted]
    try:
        med, top = formula_latency()
        print(f"what-if formula side: median {1000 * med:.2f} ms, max {1000 * top:.2f} ms per move (target < 100 ms)")
    except ImportError:
        print("what-if formula side: no what-if panel in this tree")
    everything: dict[str, list[dict]] = {}
    if args.browser:
        everything = browser_latency(paths, args.changes)
    else:
        for path in paths:
            load = os.getloadavg()[0]
            everything[path.stem] = kernel_latency(path, args.changes, every=args.every_control)
            everything[path.stem].append({"load": [load, os.getloadavg()[0]]})
    for lesson, rows in everything.items():
        load = next((r["load"] for r in rows if "load" in r), None)
        print(f"{lesson}" + (f" (load {load[0]:.1f} -> {load[1]:.1f} on {os.cpu_count()} cores)" if load else ""))
        for r in rows:
            if "panel" not in r:
                continue
            line = f"  {r['panel'][:60]:60s} {r.get('kind', ''):8s} {_fmt(r['waits'])}"
            if r.get("cpu"):
                line += f"; CPU median {statistics.median(r['cpu']):.2f} s, max {max(r['cpu']):.2f} s"
            if r.get("measured"):
                line += f"; measured side {_fmt(r['measured'])}"
            if r.get("error"):
                line += f"; error {r['error'][:80]}"
            print(line)
            if args.every_control:
                for name, value, wait, cpu, error in r.get("moves", []):
                    print(f"      {name} -> {value[:24]:24s} {wait:6.2f} s (CPU {cpu:.2f} s)" + (f"; {error[:60]}" if error else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
