"""The library's layout is a contract, written in docs/architecture.md and checked here.

Imports run one way: lessons -> widgets -> course -> library, never back. Inside the library,
packages stand in an order, bottom to top (base, allocator, measure, ... front): a module imports
only modules of its own package or of packages below it, each only what its row in the doc
allows, with no cycle between modules or between packages. Every module is under a size ceiling
(the allocator simulator, a mirror of one C++ file, is the one exception), declares ``__all__``,
and every package says what is in it. The course (gpulab/course/, where a teacher edits) stands
under the same ceilings, one module per question, each named in the doc's course table. Each check
is a pure function of data, so a planted violation is shown to fail it."""
from __future__ import annotations

import ast
import pathlib
import re

from conftest import ROOT

PKG = ROOT / "gpulab"
DOC = ROOT / "docs" / "architecture.md"
MAX_MODULE_LINES = 700
LONG_MODULE_EXCEPTIONS = {"allocator.simulator"}   # a mirror of CUDACachingAllocator.cpp, kept whole
MAX_FUNCTION_LINES = 80
SIDES = ("course", "widgets")


# --- reading the code -----------------------------------------------------------------------------

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
            subs = {f"{mod}.{a.name}" for a in node.names}   # "from gpulab.predict import fit"
            found |= {s for s in subs if _is_module(s)} or {mod}
    return found


def _is_module(dotted: str) -> bool:
    p = ROOT.joinpath(*dotted.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def side(dotted: str) -> str:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in SIDES else "library"


def short(dotted: str) -> str:
    """gpulab.measure.engines -> measure.engines; gpulab.predict (a package) -> predict.__init__."""
    rest = dotted.split(".", 1)[1] if "." in dotted else "__init__"
    if (PKG.joinpath(*rest.split(".")) / "__init__.py").exists():
        rest += ".__init__"
    return rest


def module_files(inside: str | None = None) -> dict[str, pathlib.Path]:
    """Every module by its short name: the library's (course and widgets excluded), or with
    ``inside`` one side's (``"course"``: course.start, course.kv_cache, ...)."""
    out = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG).with_suffix("").parts
        if (rel[0] == inside if inside else rel[0] not in SIDES) and not (len(rel) > 1 and rel[-1] == "__init__"):
            out[".".join(rel)] = p                                    # (a package's __init__: its docstring)
    return out


def library_files() -> dict[str, pathlib.Path]:
    return module_files()


def line_counts(files: dict[str, pathlib.Path]) -> dict[str, int]:
    return {m: len(p.read_text().splitlines()) for m, p in files.items()}


def library_graph() -> dict[str, set[str]]:
    return {name: {short(d) for d in gpulab_imports(p) if side(d) == "library" and d != "gpulab"} - {name}
            for name, p in library_files().items()}


# --- reading the contract -------------------------------------------------------------------------

def read_doc(text: str) -> tuple[list[str], dict[str, str], dict[str, set[str]]]:
    """docs/architecture.md's library section: the units' order bottom to top, each module's unit,
    and each module's allowed imports (short names)."""
    section = text.split("## The library", 1)[1].split("\n## ", 1)[0]
    order_line = next(l for l in section.splitlines() if l.startswith("Order, bottom to top:"))
    order = re.findall(r"`([\w.]+)`", order_line)
    unit_of: dict[str, str] = {}
    allowed: dict[str, set[str]] = {}
    unit = None
    for line in section.splitlines():
        h = re.match(r"###\s+`?([\w.]+)`?", line)
        if h:
            unit = h.group(1)
            continue
        m = re.match(r"\|\s*`([\w.]+)`\s*\|[^|]*\|([^|]*)\|", line)
        if m and unit:
            unit_of[m.group(1)] = unit
            allowed[m.group(1)] = set(re.findall(r"`([\w.]+)`", m.group(2)))
    return order, unit_of, allowed


def read_course_doc(text: str) -> set[str]:
    """docs/architecture.md's course section: the modules its table names (first column)."""
    section = text.split("## The course", 1)[1].split("\n## ", 1)[0]
    return {m for line in section.splitlines() if (first := re.match(r"\|([^|]*)\|", line))
            for m in re.findall(r"`(course\.[\w.]+)`", first.group(1))}


# --- the checks, as pure functions ----------------------------------------------------------------

def undocumented(files: set[str], unit_of: dict[str, str]) -> list[str]:
    return ([f"{m}: add its row to docs/architecture.md" for m in sorted(files - unit_of.keys())] +
            [f"{m}: docs/architecture.md lists a module that does not exist" for m in sorted(unit_of.keys() - files)])


def misplaced(unit_of: dict[str, str], order: list[str]) -> list[str]:
    """A package's module sits in its package's section; a top-level module in a section that
    is not a package's; every section is in the order."""
    wrong = []
    for m, u in sorted(unit_of.items()):
        if u not in order:
            wrong.append(f"{m}: section {u} is not in the order line")
        pkg = m.split(".")[0] if "." in m else None
        if pkg and pkg != u:
            wrong.append(f"{m}: listed under {u}, but it lies in the package {pkg}")
        if not pkg and (PKG / u).is_dir():
            wrong.append(f"{m}: a top-level module listed under the package {u}")
    return wrong


def not_allowed(graph: dict[str, set[str]], allowed: dict[str, set[str]]) -> list[str]:
    return [f"{m} imports {d}, which its row in docs/architecture.md does not allow"
            for m in sorted(graph) for d in sorted(graph[m])
            if d not in allowed.get(m, set()) and not d.endswith("__init__") and not m.endswith("__init__")]


def against_the_order(graph: dict[str, set[str]], unit_of: dict[str, str], order: list[str]) -> list[str]:
    rank = {u: i for i, u in enumerate(order)}
    wrong = []
    for m in sorted(graph):
        for d in sorted(graph[m]):
            um, ud = unit_of.get(m), unit_of.get(d) or unit_of.get(d.rsplit(".", 1)[0] + ".__init__")
            if d.endswith(".__init__"):
                ud = d.split(".")[0]
            if um in rank and ud in rank and rank[ud] > rank[um]:
                wrong.append(f"{m} ({um}) imports {d} ({ud}), which stands above it")
    return wrong


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
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
        if n not in state and (cycle := visit(n, [])):
            return cycle
    return None


def package_graph(graph: dict[str, set[str]], unit_of: dict[str, str]) -> dict[str, set[str]]:
    """Packages (and the base and front sections) as nodes."""
    def unit(m: str) -> str:
        return m.split(".")[0] if "." in m and not m.startswith("__") else unit_of.get(m, m)
    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        out.setdefault(unit(m), set()).update(unit(d) for d in deps if unit(d) != unit(m))
    return out


def too_long(lines: dict[str, int]) -> list[str]:
    return [f"{m}: {n} lines (ceiling {MAX_MODULE_LINES}): split it by subject" for m, n in sorted(lines.items())
            if n > MAX_MODULE_LINES and m not in LONG_MODULE_EXCEPTIONS]


def long_functions(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [f"{path.name}:{n.lineno} {n.name}: {n.end_lineno - n.lineno + 1} lines"
            for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]


def declares_all(path: pathlib.Path) -> bool:
    return any(isinstance(n, (ast.Assign, ast.AnnAssign)) and
               any(getattr(t, "id", None) == "__all__" for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))
               for n in ast.parse(path.read_text()).body)


def _doc() -> tuple[list[str], dict[str, str], dict[str, set[str]]]:
    return read_doc(DOC.read_text())


# --- the tests ------------------------------------------------------------------------------------

def test_every_library_module_has_a_row_in_its_package_section():
    order, unit_of, _ = _doc()
    assert not undocumented(set(library_files()), unit_of)
    assert not misplaced(unit_of, order)


def test_library_modules_import_only_what_their_row_allows():
    _, _, allowed = _doc()
    assert not not_allowed(library_graph(), allowed)


def test_packages_import_only_packages_below_them():
    order, unit_of, _ = _doc()
    assert not against_the_order(library_graph(), unit_of, order)


def test_no_cycle_between_modules_or_between_packages():
    _, unit_of, _ = _doc()
    graph = library_graph()
    assert find_cycle(graph) is None, "import cycle: " + " -> ".join(find_cycle(graph))
    pkgs = package_graph(graph, unit_of)
    assert find_cycle(pkgs) is None, "package cycle: " + " -> ".join(find_cycle(pkgs))


def test_the_library_never_imports_the_course_or_widgets_and_the_course_never_the_widgets():
    wrong = [f"gpulab.{m} imports {d}" for m, p in library_files().items()
             for d in gpulab_imports(p) if side(d) != "library"]
    for p in sorted((PKG / "course").glob("*.py")):
        wrong += [f"course/{p.name} imports {d}" for d in gpulab_imports(p) if side(d) == "widgets"]
    assert not wrong, "\n".join(wrong)


def test_modules_stay_under_the_size_ceiling_and_functions_short():
    assert not too_long(line_counts(library_files()))
    assert not [f for p in PKG.rglob("*.py") for f in long_functions(p)]


def test_every_module_declares_all_and_every_package_says_what_is_in_it():
    missing = [str(p.relative_to(ROOT)) for p in PKG.rglob("*.py")
               if p.name != "__main__.py" and not declares_all(p)]
    assert not missing, "no __all__ in: " + ", ".join(sorted(missing))
    for init in PKG.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init.relative_to(ROOT)}: say what is in this package"


def test_every_course_module_has_a_row_and_stays_under_the_library_ceilings():
    """The course, one module per question: each named in the course table, under 700 lines
    (its functions under 80 and its __all__: the two tests above cover all of gpulab)."""
    files = module_files("course")
    assert not undocumented(set(files), dict.fromkeys(read_course_doc(DOC.read_text()), "course"))
    assert not too_long(line_counts(files))


def test_top_level_keeps_to_ten_modules():
    top = [p.name for p in PKG.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert len(top) <= 10, sorted(top)


# --- the checks cannot pass vacuously: planted violations fail them --------------------------------

PLANTED_DOC = """
## The library, bottom to top

Order, bottom to top: `base` → `measure` → `predict` → `front`.

### base
| `units` | sizes | — |

### `measure`
| `measure.engines` | runs | `units` |

### `predict`
| `predict.fit` | fit | `measure.engines`, `units` |

### front
| `cli` | the command | `predict.fit` |

## The course

| module | lesson | what it holds |
|---|---|---|
| `course.a`, `course.b` | 01 | a question about `course.c`'s result |

## Next
"""


def test_planted_violations_fail_every_check(tmp_path):
    order, unit_of, allowed = read_doc(PLANTED_DOC)
    assert order == ["base", "measure", "predict", "front"]
    good = {"units": set(), "measure.engines": {"units"}, "predict.fit": {"measure.engines", "units"},
            "cli": {"predict.fit"}}
    assert not not_allowed(good, allowed) and not against_the_order(good, unit_of, order)
    assert find_cycle(good) is None and find_cycle(package_graph(good, unit_of)) is None
    # an import the row does not allow, and one that goes up the order
    upward = {**good, "measure.engines": {"units", "predict.fit"}}
    assert not_allowed(upward, allowed) and against_the_order(upward, unit_of, order)
    # a module cycle, and a package cycle without a module cycle
    assert find_cycle({**good, "units": {"cli"}})
    two = {**good, "measure.engines": {"units", "predict.other"}, "predict.other": set()}
    assert find_cycle(two) is None and {"measure", "predict"} <= set(find_cycle(package_graph(two, unit_of)))
    # a module missing from the doc, a row for nothing, a module under the wrong package
    assert undocumented(set(good) | {"measure.gpu"}, unit_of) and undocumented({"units"}, unit_of)
    assert misplaced({**unit_of, "predict.step": "measure"}, order)
    # too long, and no __all__
    assert too_long({"measure.engines": MAX_MODULE_LINES + 1}) and not too_long({"allocator.simulator": 5000})
    # the course: a module without a row, and one over the ceiling
    course = dict.fromkeys(read_course_doc(PLANTED_DOC), "course")
    assert set(course) == {"course.a", "course.b"} and not undocumented({"course.a", "course.b"}, course)
    assert undocumented({"course.a", "course.b", "course.c"}, course) and too_long({"course.a": MAX_MODULE_LINES + 1})
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES + "    return x\n")
    assert long_functions(planted) and not declares_all(planted)
    # a wrong-way import is seen, relative or absolute, at top level or inside a function
    planted.write_text("def f():\n    from .course import claims\n    from gpulab.widgets.base import Panel\n")
    deps = gpulab_imports(planted, package=("gpulab",))
    assert {"gpulab.course.claims", "gpulab.widgets.base"} <= deps
    assert {side(d) for d in deps} == {"course", "widgets"}

