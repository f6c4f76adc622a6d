"""binder/ is enough to run every lesson without a GPU.

Builds a fresh virtual environment from binder/requirements.txt, the way repo2docker does
(``pip install -r binder/requirements.txt`` from the repository root), with one change: PyTorch's
CPU index (unreachable from CI) is swapped for the regular registry. Then installs an ipykernel
kernelspec for that venv into a temporary JUPYTER_PATH and checks, in that environment:

* every gpulab module imports, and every import statement of every lesson runs (the packages
  each lesson needs are there);
* lesson 00 runs whole, headless with nbclient, with no error (panels, matplotlib's inline
  backend, the engine and machine report);
* in a kernel of that environment, the calls of lessons 11 and 12 that reach deepest into the
  dependencies at run time, beyond their imports, run with no error: a LoRA step through peft
  and transformers, a real ``generate()`` with a transformers cache (lesson 11), and an FSDP2
  step in two torch.distributed workers started from the kernel's Python (lesson 12).
  Lessons 11 and 12 ran whole here until the suite-time issue: 156 s of a 2-core machine for
  what these three calls check in about 20 s. Every lesson runs whole in the development
  environment in tests/test_robustness.py (twice) and tests/test_browser.py.

Slow (downloads torch into a fresh venv; pip's cache makes reruns fast): ``pytest -m slow``.
"""
from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import nbformat
import pytest

from conftest import LESSONS, ROOT, notebook_client, notebook_errors

BINDER = ROOT / "binder"
LESSONS_DIR = pathlib.Path(os.environ.get("GPULAB_LESSONS_DIR", LESSONS)).resolve()
NOTEBOOKS = sorted(LESSONS_DIR.glob("[0-9][0-9]_*.ipynb"))
KERNEL = "gpulab-binder-test"
BUILD_TIMEOUT_S = 1800  # pip install of torch into a fresh venv; pip's cache makes it minutes
PYTORCH_INDEX = re.compile(r"^\s*--(extra-)?index-url\s+\S*download\.pytorch\.org\S*\s*$")


def test_binder_files_are_there():
    req = (BINDER / "requirements.txt").read_text()
    lines = [ln.split("#")[0].strip() for ln in req.splitlines()]
    assert any(PYTORCH_INDEX.match(ln) and "/whl/cpu" in ln for ln in lines), \
        "binder/requirements.txt must take torch from PyTorch's CPU index"
    assert any(ln.startswith("torch") for ln in lines) and any(ln.startswith("torchvision") for ln in lines)
    assert any(ln in (".", "-e .") for ln in lines), "binder/requirements.txt must install gpulab itself"
    post = BINDER / "postBuild"
    if post.exists():
        assert os.access(post, os.X_OK), "binder/postBuild must be executable"


def _rewrite_requirements(dst) -> None:
    """binder/requirements.txt without PyTorch's index (and without +cpu local versions); the
    repository itself (``.`` / ``-e .``, relative to the root, where repo2docker runs pip) as an
    absolute path, since the copy lies elsewhere."""
    out = []
    for line in (BINDER / "requirements.txt").read_text().splitlines():
        if PYTORCH_INDEX.match(line.split("#")[0]):
            continue
        line = re.sub(r"^(\s*(?:-e\s+)?)\.(\s*(?:#.*)?)$", lambda m: f"{m.group(1)}{ROOT}{m.group(2)}", line)
        out.append(re.sub(r"\+cpu\b", "", line))
    dst.write_text("\n".join(out) + "\n")


def test_the_binder_venv_is_installed_with_bytecode_as_pip_does(tmp_path):
    """repo2docker's pip compiles every module at install; the test's venv must too, or each
    lesson kernel recompiles torch from source where __pycache__ is not written."""
    cmd = _install_command(tmp_path / "python", tmp_path / "requirements.txt")
    assert "--no-compile" not in cmd
    assert pathlib.Path(cmd[0]).name != "uv" or "--compile-bytecode" in cmd, cmd


def _install_command(py: pathlib.Path, req: pathlib.Path) -> list[str]:
    """pip, as repo2docker runs it; or, when the project's venv has it (``make`` installs it),
    uv's ``pip install``, which reads the same requirements file and keeps every wheel it ever
    downloaded in its cache: torch and its CUDA libraries, already fetched for the project's own
    venv, are then linked from the cache instead of downloaded again. (pip's own cache does not
    help here: this registry's responses carry no caching headers, so pip stores nothing.)

    uv is told to compile the bytecode, as pip does by default: without it every kernel and
    every torch.distributed worker of the lessons compiles torch, transformers and torchvision
    from source again at import wherever Python does not write ``__pycache__`` (read-only
    installs, ``PYTHONDONTWRITEBYTECODE``, as in CI): about 8 s more CPU per process here."""
    uv = pathlib.Path(sys.executable).with_name("uv")
    if uv.exists():
        return [str(uv), "pip", "install", "--quiet", "--compile-bytecode", "--python", str(py), "-r", str(req)]
    return [str(py), "-m", "pip", "install", "-q", "-r", str(req)]


@pytest.fixture(scope="module")
def binder_kernel(tmp_path_factory):
    """A fresh venv built from binder/, registered as a kernel in a temporary JUPYTER_PATH.

    Built once per test session even when pytest-xdist spreads the lessons over several
    workers: the first worker to get here builds it under a file lock in the session's shared
    temporary folder; the others wait, then reuse it."""
    from filelock import FileLock
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # this session's folder, the same for every xdist worker
    tmp = shared / "binder"
    done = tmp / "built.txt"
    with FileLock(str(shared / "binder.lock"), timeout=BUILD_TIMEOUT_S):
        if not done.exists():
            tmp.mkdir(exist_ok=True)
            _build_binder_env(tmp)
            done.write_text("ok")
    return tmp / "jupyter-prefix" / "share" / "jupyter"


def _build_binder_env(tmp: pathlib.Path) -> None:
    req = tmp / "requirements.txt"
    _rewrite_requirements(req)
    venv = tmp / "venv"
    py = venv / "bin" / "python"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    r = subprocess.run(_install_command(py, req), cwd=str(ROOT), env=env,
                       capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert r.returncode == 0, f"installing binder/requirements.txt failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    post = BINDER / "postBuild"
    if post.exists():
        r = subprocess.run([str(post)], cwd=str(ROOT), capture_output=True, text=True, timeout=600,
                           env=dict(env, PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}"))
        assert r.returncode == 0, f"binder/postBuild failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    # ipykernel comes with jupyterlab; register the venv's kernel under a private prefix
    prefix = tmp / "jupyter-prefix"
    r = subprocess.run([str(py), "-m", "ipykernel", "install", "--prefix", str(prefix), "--name", KERNEL,
                        "--display-name", "gpulab (binder test)"], capture_output=True, text=True)
    assert r.returncode == 0, f"the binder venv has no working ipykernel:\n{r.stderr[-2000:]}"
    freeze = subprocess.run([str(py), "-m", "pip", "freeze"], capture_output=True, text=True).stdout
    print(f"binder venv built in {time.perf_counter() - t0:.0f} s; "
          + ", ".join(ln for ln in freeze.splitlines() if re.match(r"(torch|torchvision|jupyterlab|ipywidgets)==", ln)))


FULL_RUN = ("00_start_here",)


def _imports(path: pathlib.Path) -> list[str]:
    """Every import statement at the top level of a lesson's code cells (magics left out)."""
    out = []
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        src = "\n".join(ln for ln in cell.source.splitlines() if not ln.lstrip().startswith(("%", "!")))
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        out += [ast.get_source_segment(src, n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    return out


def test_every_lesson_has_imports_to_check():
    found = {p.stem: _imports(p) for p in NOTEBOOKS}
    assert all(found.values()), [k for k, v in found.items() if not v]
    assert any("gpulab.widgets" in i for i in found["00_start_here"])


@pytest.mark.slow
@pytest.mark.notebook
@pytest.mark.xdist_group("binder")
@pytest.mark.timeout(BUILD_TIMEOUT_S + 600)
def test_every_module_and_every_lesson_import_loads_in_binder_env(binder_kernel):
    py = binder_kernel.parents[2] / "venv" / "bin" / "python"
    script = ["import importlib, pkgutil, gpulab",
              "for m in pkgutil.walk_packages(gpulab.__path__, 'gpulab.'):",
              "    if not m.name.endswith('__main__'):",
              "        importlib.import_module(m.name)"]
    for p in NOTEBOOKS:
        script += [f"# {p.name}", *_imports(p)]
    r = subprocess.run([str(py), "-c", "\n".join(script)], cwd=str(LESSONS_DIR), capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, MPLBACKEND="Agg"))
    assert r.returncode == 0, f"an import fails in the binder env:\n{r.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.notebook
@pytest.mark.xdist_group("binder")  # one worker builds the venv and runs these; the others go on
@pytest.mark.timeout(BUILD_TIMEOUT_S + 600)  # the first one may wait for the build
@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.stem in FULL_RUN], ids=lambda p: p.stem)
def test_lesson_runs_in_binder_env(path, request, binder_kernel, monkeypatch):
    if getattr(request.config.option, "loadgroup", False):  # make test: pytest-xdist --dist loadgroup
        assert request.node.nodeid.endswith("@binder"), (
            "pytest-xdist did not tag this test with its xdist_group, so the Binder lessons are "
            "spread over every worker (and each waits for the build): pytest too new for xdist?")
    monkeypatch.setenv("JUPYTER_PATH", str(binder_kernel))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # as on Binder: the kernel's inline backend
    nb = nbformat.read(path, as_version=4)
    client = notebook_client(nb, timeout=300, kernel_name=KERNEL, store_widget_state=True,
                            resources={"metadata": {"path": str(LESSONS_DIR)}})
    t0 = time.perf_counter()
    client.execute()
    errors = notebook_errors(nb)
    assert not errors, f"{path.name} in the binder env: " + "; ".join(errors)
    print(f"{path.name} ran in the binder env in {time.perf_counter() - t0:.1f} s")


# What lessons 11 and 12 need from the environment at run time beyond their imports: lesson 11's
# own calls (peft wrapping a transformers model and training a step; generate() filling a
# transformers cache), and for lesson 12 one sharded step measured in gloo workers started with
# the kernel's own Python (sys.executable inside the Binder venv), through the runner that
# lesson 12's compare_strategies uses (README's measure_strategy, one strategy, not four).
DEEP_CALLS = {
    "11_transformers, peft": 'from gpulab.course.lora import lora_step\n'
                             'lora_step("tiny-llama", rank=8, batch=2, seq_len=32)',
    "11_transformers, generate()": 'from gpulab.course.kv_cache import measured_kv_cache\n'
                                   'measured_kv_cache("tiny-llama", prompt_len=8, new_tokens=16)',
    "12_beyond_one_gpu, workers": 'from gpulab.distributed.sharding import measure_strategy\n'
                                  'measure_strategy(strategy="fsdp2", world_size=2, model="transformer", width=128)',
}


@pytest.mark.slow
@pytest.mark.notebook
@pytest.mark.xdist_group("binder")
@pytest.mark.timeout(BUILD_TIMEOUT_S + 600)
def test_what_lessons_11_and_12_reach_runs_in_binder_env(binder_kernel, monkeypatch):
    monkeypatch.setenv("JUPYTER_PATH", str(binder_kernel))
    monkeypatch.delenv("MPLBACKEND", raising=False)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in DEEP_CALLS.values()]
    client = notebook_client(nb, timeout=300, kernel_name=KERNEL, resources={"metadata": {"path": str(LESSONS_DIR)}})
    t0 = time.perf_counter()
    client.execute()
    errors = notebook_errors(nb)
    assert not errors, "in the binder env: " + "; ".join(errors)
    for what, cell in zip(DEEP_CALLS, nb.cells):
        shown = [o for o in cell.outputs if o.get("output_type") == "execute_result"]
        assert shown, f"{what}: the call showed no result in the binder env: {cell.outputs}"
    sharded = json.dumps(nb.cells[2].outputs)
    assert "StrategyRun(fsdp2, 2 ranks" in sharded, f"the FSDP2 run did not show its two ranks: {sharded[:500]}"
    print(f"lessons 11 and 12's deepest calls ran in the binder env in {time.perf_counter() - t0:.1f} s")
