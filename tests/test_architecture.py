"""Imports run one way: lessons -> widgets -> course -> library, never back; and every library
module imports only what its row in docs/architecture.md allows (the doc is the contract)."""
from __future__ import annotations

import ast
import pathlib
import re

from conftest import ROOT

PKG = ROOT / "gpulab"
DOC = ROOT / "docs" / "architecture.md"


def gpulab_imports(path: pathlib.Path, package: tuple[str, ...] | None = None) -> set[str]:
    """Dotted gpulab module names that a file imports (top level and inside functions),
    relative imports resolved against the file's package (by default, where it lies)."""
    if package is None:
        package = path.relative_to(ROOT).with_suffix("").parts[:-1]  # e.g. ("gpulab", "course")
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "gpulab"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[:len(package) - node.level + 1])
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "gpulab":
                continue
            if node.module is None or mod in ("gpulab", "gpulab.course", "gpulab.widgets"):
                # "from . import formulas": the names are modules when such files exist
                subs = {f"{mod}.{a.name}" for a in node.names}
                found |= {s for s in subs if _is_module(s)} or {mod}
            else:
                found.add(mod)
    return found


def _is_module(dotted: str) -> bool:
    p = ROOT.joinpath(*dotted.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def side(dotted: str) -> str:
    parts = dotted.split(".")
    if len(parts) > 1 and parts[1] in ("course", "widgets"):
        return parts[1]
    return "library"


def _module_name(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def documented_library() -> dict[str, set[str]]:
    """Rows of the library table in docs/architecture.md: module -> allowed gpulab modules."""
    text = DOC.read_text()
    section = text.split("## The library", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\|\s*`([\w_]+)`\s*\|[^|]*\|([^|]*)\|", line)
        if m:
            rows[m.group(1)] = set(re.findall(r"`([\w_]+)`", m.group(2)))
    return rows


def test_every_library_module_has_a_row_in_the_architecture_doc():
    rows = documented_library()
    files = {p.stem for p in PKG.glob("*.py")}
    assert files - rows.keys() == set(), f"add these modules to docs/architecture.md: {sorted(files - rows.keys())}"
    assert rows.keys() - files == set(), f"docs/architecture.md lists modules that do not exist: {sorted(rows.keys() - files)}"


def test_library_modules_import_only_what_their_row_allows():
    rows = documented_library()
    wrong = []
    for p in sorted(PKG.glob("*.py")):
        for dep in sorted(gpulab_imports(p)):
            if side(dep) != "library":
                wrong.append(f"gpulab/{p.name} imports {dep}: the library never imports the {side(dep)}")
            elif dep != "gpulab" and dep.split(".")[1] not in rows.get(p.stem, set()):
                wrong.append(f"gpulab/{p.name} imports {dep}, which its row in docs/architecture.md does not allow")
    assert not wrong, "\n".join(wrong)


def test_course_never_imports_widgets_and_widgets_never_import_lessons():
    wrong = []
    for p in sorted((PKG / "course").glob("*.py")):
        wrong += [f"{_module_name(p)} imports {d}" for d in gpulab_imports(p) if side(d) == "widgets"]
    assert not wrong, "the course must not import the widgets:\n" + "\n".join(wrong)


def test_library_imports_have_no_cycle():
    graph = {p.stem: {d.split(".")[1] for d in gpulab_imports(p) if d != "gpulab" and side(d) == "library"}
             for p in PKG.glob("*.py")}
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack + [node, nxt]
            if nxt not in state and (cycle := visit(nxt, stack + [node])):
                return cycle
        state[node] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            cycle = visit(n, [])
            assert cycle is None, "import cycle in the library: " + " -> ".join(cycle)


def test_the_checker_sees_wrong_way_imports(tmp_path):
    """The checks above cannot pass vacuously: a planted wrong-way import is found."""
    planted = tmp_path / "planted.py"  # read as if it lay in gpulab/
    planted.write_text("def f():\n    from .course import claims\n    from .widgets.base import Panel\n")
    deps = gpulab_imports(planted, package=("gpulab",))
    assert {"gpulab.course.claims", "gpulab.widgets.base"} <= deps
    assert {side(d) for d in deps} == {"course", "widgets"}
