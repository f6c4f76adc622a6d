"""Benchmark: how long each lesson takes to execute headless, as a student's Run All does.

    .venv/bin/python benchmarks/lesson_times.py [--only 11 12 ...] [--cells N] [--json FILE]
    .venv/bin/python benchmarks/lesson_times.py --record [--only 11 12 ...]
    .venv/bin/python benchmarks/lesson_times.py --model

Each lesson runs once, top to bottom, in a fresh kernel through nbclient, the way
tests/test_robustness.py executes it (the same client, whose waits cannot miss a reply;
the inline matplotlib backend, as a student gets it). Prints one line per lesson: wall seconds,
and the CPU seconds the kernel and every process it started (torch.distributed workers) used,
counted from the kernel's rusage once it is shut down and reaped. The machine may be shared
(2 cores, other engineers' jobs): wall time then stretches, CPU time stays what the lesson
costs. ``--cells N`` also lists each lesson's N slowest cells (from nbclient's timing metadata).

``--record`` writes each code cell's seconds, keyed by its cell id, into docs/lesson-times.json
(issue #37: the day model, gpulab/course/day_model.py, reads it): for each cell, the CPU
seconds of the kernel and of every process it started, read from /proc through psutil just
before and just after the cell runs, the cell's wall seconds (what the day model counts), and what
it displays (HTML tables, images, rendered markdown's words); with the machine, the torch
version, the date and the load average before and after each lesson. ``--only`` re-records those
lessons and keeps the others' entries. ``--model`` runs nothing: it prints each lesson's modelled
core path from the notebooks and that record, in its parts, beside the minutes the lesson states.

The targets of issue #21: lesson 12 under 90 s, every other lesson under 60 s (wall, on a
quiet 2-core machine). Nothing is asserted: a benchmark, not a test.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import nbformat  # noqa: E402

from conftest import notebook_client  # noqa: E402  (the tests' client: sliced polls)

sys.path.insert(0, str(ROOT))
from gpulab.course.day_model import cell_key  # noqa: E402  (how the record names a cell)

LESSONS = ROOT / "lessons"
RECORD = ROOT / "docs" / "lesson-times.json"
TARGET_S = {"12": 90.0}
DEFAULT_TARGET_S = 60.0


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's reaped children and, through them, theirs."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _cell_seconds(cell) -> float | None:
    """A cell's execution time from nbclient's timing metadata (execute_input to execute_reply)."""
    ex = cell.get("metadata", {}).get("execution", {})
    a, b = ex.get("iopub.execute_input"), ex.get("shell.execute_reply")
    if not (a and b):
        return None
    parse = lambda s: dt.datetime.fromisoformat(s.replace("Z", "+00:00"))  # noqa: E731
    return (parse(b) - parse(a)).total_seconds()


def _kernel_cpu(client) -> float | None:
    """CPU seconds (user + system) the kernel and every process it started have used so far:
    its own, its reaped children's, and its live descendants' (torch.distributed workers)."""
    import psutil
    try:
        kernel = psutil.Process(client.km.provisioner.process.pid)
        t = kernel.cpu_times()
        total = t.user + t.system + t.children_user + t.children_system
        for child in kernel.children(recursive=True):
            try:
                c = child.cpu_times()
                total += c.user + c.system
            except psutil.Error:   # ended between the listing and the read
                pass
        return total
    except (AttributeError, psutil.Error):
        return None


def _cpu_hooks(client, keys: list[str]) -> dict:
    """Hooks that put each code cell's kernel CPU seconds into the returned dict, by its key."""
    spent, start = {}, {}

    def before(cell, cell_index, **_):
        start[cell_index] = _kernel_cpu(client)

    def after(cell, cell_index, **_):
        a, b = start.pop(cell_index, None), _kernel_cpu(client)
        if a is not None and b is not None:
            spent[keys[cell_index]] = b - a

    client.on_cell_execute, client.on_cell_executed = before, after
    return spent


def time_lesson(path: Path, timeout: int = 600) -> dict:
    nb = nbformat.read(path, as_version=4)
    # each cell's key as the stored file has it (nbformat gives a cell stored without an id a new
    # random one on reading; the day model reads the file and names such a cell by its index)
    keys = [cell_key(c, i) for i, c in enumerate(json.loads(path.read_text())["cells"])]
    client = notebook_client(nb, timeout=timeout, kernel_name="python3", store_widget_state=True,
                             record_timing=True, resources={"metadata": {"path": str(LESSONS)}})
    cpu_by_id = _cpu_hooks(client, keys)
    load0 = os.getloadavg()[0]
    c0, t0 = _children_cpu(), time.perf_counter()
    error = None
    try:
        client.execute()
    except Exception as e:   # a failing cell: report it, go on with the next lesson
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    wall = time.perf_counter() - t0
    cpu = _children_cpu() - c0   # the kernel is shut down and waited for by execute()
    cells = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            s = _cell_seconds(cell)
            if s is not None:
                first = next((ln for ln in cell.source.splitlines() if ln.strip()), "")
                c = cpu_by_id.get(keys[i])
                cells.append({"cell": i, "id": keys[i], "seconds": round(s, 2),
                              "cpu_s": None if c is None else round(c, 2), "source": first[:70],
                              **displays(cell)})
    return {"lesson": path.stem, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "error": error,
            "load_start": round(load0, 2), "load_end": round(os.getloadavg()[0], 2),
            "cells": sorted(cells, key=lambda c: -c["seconds"])}


def displays(cell) -> dict:
    """What a student looks at in a code cell's outputs, besides the panels (the demo): ``tables``,
    the outputs that show an HTML table; ``plots``, those that show an image; ``words``, the words
    of the markdown a cell renders (text/markdown outputs: prose the student reads, counted as the
    lesson's markdown is, gpulab.course.day_model)."""
    sys.path.insert(0, str(ROOT))
    from gpulab.course.day_model import words_of
    tables = plots = words = 0
    for out in cell.get("outputs", []):
        data = out.get("data", {})
        if any(k.startswith("image/") for k in data):
            plots += 1
        elif "<table" in str(data.get("text/html", "")):
            tables += 1
        if "text/markdown" in data:
            md = data["text/markdown"]
            words += words_of(md if isinstance(md, str) else "".join(md))
    return {"tables": tables, "plots": plots, "words": words}


def _machine() -> str:
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() \
        else platform.processor()
    return f"{model}, {os.cpu_count()} cores visible, {platform.system()} {platform.release()}"


def write_record(rows: list[dict], path: Path = RECORD) -> None:
    """Merge these lessons' cell times into the record (other lessons' entries are kept)."""
    import torch
    record = json.loads(path.read_text()) if path.exists() else {}
    record["about"] = (
        "Per code cell of each lesson, executed headless (benchmarks/lesson_times.py --record: "
        "nbclient, a fresh kernel, the lesson's default engine, one lesson at a time). cpu_s: CPU "
        "seconds (user + system) of the kernel and every process it started, read from /proc "
        "before and after the cell; wall_s: the cell's wall seconds (nbclient's execute_input to "
        "execute_reply), stretched by the machine's load, recorded per lesson; tables, plots: the "
        "cell's outputs that show an HTML table or an image (panels excluded); words: the words of "
        "the markdown the cell renders. The day model (gpulab/course/day_model.py) counts a cell at "
        "its wall_s: the time a student waits, on a 2-core machine shared with other jobs (the load "
        "average is recorded with each lesson), so an upper estimate for a quiet laptop.")
    lessons = record.setdefault("lessons", {})
    for r in rows:
        if r["error"]:
            continue   # a failed run is no measurement of the lesson
        lessons[r["lesson"]] = {
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": _machine(), "torch": torch.__version__,
            "load_average_start": r["load_start"], "load_average_end": r["load_end"],
            "wall_s": r["wall_s"], "cpu_s": r["cpu_s"],
            "cells": {c["id"]: {"cpu_s": c["cpu_s"], "wall_s": c["seconds"], "tables": c["tables"],
                                "plots": c["plots"], "words": c["words"]}
                      for c in sorted(r["cells"], key=lambda c: c["cell"])}}
    record["lessons"] = dict(sorted(lessons.items()))
    path.write_text(json.dumps(record, indent=1) + "\n")


def print_model() -> int:
    """Each lesson's modelled core path (gpulab.course.day_model) beside what it states."""
    sys.path.insert(0, str(ROOT))
    from gpulab.course.day_model import lesson_time, stated_minutes
    record = json.loads(RECORD.read_text())
    from gpulab.course.day_model import (MINUTES_PER_DISPLAY, MINUTES_PER_QUESTION, TALK_FACTOR,
                                         WORDS_PER_MINUTE)
    print(f"rates: {WORDS_PER_MINUTE} words a minute, {MINUTES_PER_QUESTION} minutes a question, "
          f"{MINUTES_PER_DISPLAY} a table or plot, cells at their recorded wall time, the demo, "
          f"all x {TALK_FACTOR} for talk")
    print(f"{'lesson':<30}{'words':>6}{'read':>6}{'quest':>6}{'pred':>6}{'run':>6}{'disp':>6}{'look':>6}"
          f"{'demo':>6}{'model':>7}{'stated':>7}")
    for p in sorted(LESSONS.glob("[0-9][0-9]_*.ipynb")):
        stated = stated_minutes(p)[0]
        if stated == 0:
            print(f"{p.stem:<30}homework (a stated core path of 0): not in the day")
            continue
        try:
            r = lesson_time(p, record).row()
        except ValueError as e:
            print(f"{p.stem:<30}{str(e)}")
            continue
        print(f"{p.stem:<30}{r['words']:>6}{r['reading']:>6}{r['questions']:>6}{r['predicting']:>6}"
              f"{r['running']:>6}{r['displays']:>6}{r['looking']:>6}{r['demo']:>6}{r['core path']:>7}"
              f"{stated:>7}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", default=[], help="lesson numbers or name prefixes (e.g. 11 12)")
    ap.add_argument("--cells", type=int, default=0, help="also list each lesson's N slowest cells")
    ap.add_argument("--json", type=Path, help="also write the figures to this file")
    ap.add_argument("--record", action="store_true",
                    help=f"merge each cell's seconds into {RECORD.relative_to(ROOT)} (the day model's record)")
    ap.add_argument("--model", action="store_true", help="print the day model's figures; run nothing")
    args = ap.parse_args()
    if args.model:
        return print_model()
    os.environ.pop("MPLBACKEND", None)   # the kernel picks the inline backend, as for a student
    paths = sorted(LESSONS.glob("[0-9][0-9]_*.ipynb"))
    if args.only:
        paths = [p for p in paths if any(p.stem.startswith(o) for o in args.only)]
    if not paths:
        print(f"no lesson matches {args.only}", file=sys.stderr)
        return 2
    load = os.getloadavg()[0]
    print(f"{len(paths)} lessons, {os.cpu_count()} cores, load average {load:.1f} at the start")
    print(f"{'lesson':<28}{'wall s':>8}{'cpu s':>8}{'target':>8}")
    rows = []
    for p in paths:
        r = time_lesson(p)
        target = TARGET_S.get(p.stem[:2], DEFAULT_TARGET_S)
        r["target_s"] = target
        rows.append(r)
        flag = "" if r["wall_s"] < target else "  over"
        print(f"{p.stem:<28}{r['wall_s']:>8.1f}{r['cpu_s']:>8.1f}{target:>8.0f}{flag}"
              + (f"  FAILED {r['error']}" if r["error"] else ""), flush=True)
        for c in r["cells"][:args.cells]:
            print(f"    cell {c['cell']:>3} {c['seconds']:>7.1f} s  {c['source']}", flush=True)
        if args.record:   # lesson by lesson: a run cut short keeps what it measured
            write_record([r])
    print(f"{'total':<28}{sum(r['wall_s'] for r in rows):>8.1f}{sum(r['cpu_s'] for r in rows):>8.1f}")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    if args.json:
        args.json.write_text(json.dumps({"load_start": load, "lessons": rows}, indent=1) + "\n")
    if args.record:
        print(f"recorded in {RECORD.relative_to(ROOT)}"
              + "".join(f"; {r['lesson']} FAILED, not recorded" for r in rows if r["error"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
