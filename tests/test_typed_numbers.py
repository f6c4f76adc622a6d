"""Issue #47, item 4: no typed numbers. A number the code produces is rendered from the result (a
markdown display from a code cell, or text a course module returns), never typed into prose.

This test scans every markdown cell of every lesson, docs/teaching.md, docs/facilitation.md and
README.md for figures with units (bytes in any unit, seconds and minutes, %, FLOP/s, a multiplier
such as ×4 or 2×). Code (fenced blocks and inline code) and formulas (``$...$``) are not prose and
are not scanned. Each figure found must be

* on a core-day lesson's **Time:** line: its minutes are checked against the day model by
  tests/test_day_plan.py (core path, demo, the lesson in full), so they are computed, not typed; or
* in docs/teaching.md's one-day table or extension plans, or the day model's rates: checked by
  tests/test_day_plan.py against the model; or
* listed in ``tests/data/typed_numbers.json`` with its reason, which says what kind of figure it is
  (``REASONS``): a formula's definition or a worked formula, a published figure with its citation, a
  definition (a unit, a dtype's size), an input the text sets (a question's card, a story's GPU),
  a library constant with its source, or a figure still to be rendered (said as such).

An entry that matches nothing is stale and fails too, so the list shrinks as figures are rendered.
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest

from conftest import LESSONS, ROOT, core_day_lessons

ALLOW = ROOT / "tests" / "data" / "typed_numbers.json"
DOCS = [ROOT / "docs" / "teaching.md", ROOT / "docs" / "facilitation.md", ROOT / "README.md"]
# what a reason may say: each entry's reason starts with one of these
REASONS = ("formula:", "definition:", "published:", "input:", "constant:", "plan:",
           "extension lesson, rendering pending", "homework lesson, rendering pending",
           "rendering pending:")

_UNIT = (r"KiB|MiB|GiB|TiB|KB|kB|MB|GB|TB|PFLOP/s|TFLOP/s|GFLOP/s|TFLOPS|FLOP/s|GB/s|TB/s|"
         r"ms|µs|us|ns|s|min|minutes?|seconds?|hours?|h|%|bytes?|B")
FIGURE = re.compile(
    r"(?<![\w.$`/-])[+\-−]?\d+(?:[,.]\d+)*(?:[–-]\d+(?:[,.]\d+)*)?\s?(?:" + _UNIT + r")(?![\w/])"
    r"|(?<![\w.])\d+(?:\.\d+)?×(?!\s?\d)"        # 2× (a multiplier, not a product 2 × 3)
    r"|(?<![\w.×])×\d+(?:\.\d+)?")                # ×4 (attached: 3 × 4 is a product)
_TIME_LINE = re.compile(r"\*\*Time:\*\*[^*]*")
_PLAN_ROW = re.compile(r"^\| \d+:\d\d–\d+:\d\d \|.*$|^\| \d\d \| [^|]+ \| \d+ \|$", re.M)


def prose(text: str) -> str:
    """Markdown with code, formulas, link targets and HTML tags taken out."""
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    text = re.sub(r"`[^`]*`", " ", text)
    text = re.sub(r"\$\$.*?\$\$", " ", text, flags=re.S)
    text = re.sub(r"\$[^$\n]*\$", " ", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return re.sub(r"<[^>]+>", " ", text)


def figures(text: str) -> list[str]:
    return [m.group(0) for m in FIGURE.finditer(prose(text))]


def _rel(path: Path, root: Path = ROOT) -> str:
    return str(path.relative_to(root))


def found(lessons: Path = LESSONS, docs: list[Path] = DOCS, root: Path = ROOT) -> dict[tuple[str, str], int]:
    """(file, figure) -> how often it occurs, over every scanned text, with the figures the day
    model checks left out."""
    counts: dict[tuple[str, str], int] = {}
    core = core_day_lessons()
    _rel_ = lambda path: _rel(path, root)  # noqa: E731
    for path in sorted(lessons.glob("[0-9][0-9]_*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] != "markdown":
                continue
            text = "".join(cell["source"])
            if path.name[:2] in core:
                text = _TIME_LINE.sub(" ", text)   # checked by tests/test_day_plan.py
            for fig in figures(text):
                counts[(_rel_(path), fig)] = counts.get((_rel_(path), fig), 0) + 1
    for path in docs:
        text = path.read_text()
        if path.name == "teaching.md":
            text = _PLAN_ROW.sub(" ", text)   # the day's and the extensions' rows: tests/test_day_plan.py
        for fig in figures(text):
            counts[(_rel_(path), fig)] = counts.get((_rel_(path), fig), 0) + 1
    return counts


def allowed() -> dict[tuple[str, str], str]:
    entries = json.loads(ALLOW.read_text())["allowed"]
    out = {}
    for e in entries:
        key = (e["file"], e["figure"])
        assert key not in out, f"{ALLOW.name} lists {key} twice"
        out[key] = e["reason"]
    return out


@functools.lru_cache(maxsize=None)
def _found() -> dict[tuple[str, str], int]:
    return found()


def test_every_typed_figure_is_allowed_with_its_reason():
    figs, allow = _found(), allowed()
    assert len(figs) > 50   # the scan sees the lessons' figures
    missing = sorted(k for k in figs if k not in allow)
    assert not missing, (f"{len(missing)} typed figures with units and no reason; render them from the code's "
                         f"result, or list each in {_rel(ALLOW)} with its reason: {missing[:20]}")


def test_every_allow_list_entry_is_used_and_says_why():
    figs, allow = _found(), allowed()
    stale = sorted(k for k in allow if k not in figs)
    assert not stale, f"{_rel(ALLOW)} lists figures no longer in the text: remove them: {stale[:20]}"
    vague = sorted(k for k, why in allow.items() if not why.startswith(REASONS) or len(why.split()) < 3)
    assert not vague, f"entries whose reason is not one of {REASONS} with words after it: {vague[:20]}"
    published = [k for k, why in allow.items() if why.startswith("published:")]
    uncited = [k for k in published if not re.search(r"https?://|\w+\.(?:cpp|h|py|md)\b|ref \d{3}|\(\w[^)]*\d{4}\)|#\d+",
                                                        allow[k])]
    assert not uncited, f"published figures without a citation (a URL, a source file, a reference): {uncited[:20]}"


def test_no_core_lesson_figure_is_left_as_an_extension_or_homework_figure():
    """The shortcut reasons are for lessons outside the core day only."""
    core = core_day_lessons()
    wrong = sorted(k for k, why in allowed().items()
                   if why.startswith(("extension lesson", "homework lesson"))
                   and Path(k[0]).name[:2] in core and k[0].startswith("lessons/"))
    assert not wrong, f"core-day lessons' figures given an extension/homework reason: {wrong}"


@pytest.mark.parametrize("text, expected", [
    ("It took 29.30 MiB and 4.9% more, ×4 and 2× faster, in 12 s.", ["29.30 MiB", "4.9%", "×4", "2×", "12 s"]),
    ("`x = 512 B` and $2 \\cdot 4\\,\\text{GiB}$ and ```\n8 GiB\n``` are code or formulas.", []),
    ("a 224 × 224 image, [ref](../a/1 MiB.md), <b>3 GB</b>", ["3 GB"]),
])
def test_the_scanner_finds_figures_in_prose_only(text, expected):
    assert figures(text) == expected


def test_a_planted_figure_fails(tmp_path):
    """The check can fail: a figure typed into README.md is found, and no entry allows it."""
    (tmp_path / "lessons").mkdir()
    planted = tmp_path / "README.md"
    planted.write_text((ROOT / "README.md").read_text() + "\nThe step took 123.45 MiB.\n")
    figs = found(lessons=tmp_path / "lessons", docs=[planted], root=tmp_path)
    assert ("README.md", "123.45 MiB") in figs and ("README.md", "123.45 MiB") not in allowed()
