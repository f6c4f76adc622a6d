"""The newcomer's set-up: what `make lab` and `make test` install and start.

The Makefile's choice of PyTorch build runs here for real, with stand-ins for the two programs it
asks (`nvidia-smi` for a GPU, `uv` for the install) so every branch is exercised without a GPU or a
download: a machine without an NVIDIA GPU gets PyTorch's CPU wheels, one with a GPU the default
build, an unreachable CPU index falls back and says so. `make lab` is started for real (as the
user this runs as: root in CI, as in a container) and must serve JupyterLab.
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAKE = shutil.which("make")
pytestmark = pytest.mark.skipif(MAKE is None, reason="make is not installed")

FAKE_UV = """#!/bin/sh
# stand-in for uv: log the arguments; fail on the CPU index when told to
echo "$@" >> "{log}"
case "$*" in *--index-url*) [ -n "$FAIL_CPU_INDEX" ] && {{ echo "dns error" >&2; exit 1; }} ;; esac
exit 0
"""
FAKE_NVIDIA_SMI = "#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n"


def _torch_stamp(tmp_path, *, gpu: bool, fail_cpu_index: bool = False, torch: str | None = None):
    """Run the Makefile's torch-build rule against stand-ins; return (result, uv calls, stamp)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\nexit 0\n")   # the venv exists: no venv rule
    (venv / "bin" / "python").chmod(0o755)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "uv.log"
    uv = bindir / "uv"
    uv.write_text(FAKE_UV.format(log=log))
    uv.chmod(0o755)
    if gpu:
        smi = bindir / "nvidia-smi"
        smi.write_text(FAKE_NVIDIA_SMI)
        smi.chmod(0o755)
    # PATH without any real nvidia-smi: only the stand-ins, then the system's basic tools
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    if fail_cpu_index:
        env["FAIL_CPU_INDEX"] = "1"
    args = [MAKE, "-C", str(ROOT), f"VENV={venv}", f"UV={uv}", f"{venv}/.gpulab-torch"]
    if torch:
        args.append(f"TORCH={torch}")
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    calls = log.read_text().splitlines() if log.exists() else []
    stamp = venv / ".gpulab-torch"
    return r, calls, (stamp.read_text().strip() if stamp.exists() else None)


def test_machine_without_gpu_gets_cpu_wheels(tmp_path):
    r, calls, stamp = _torch_stamp(tmp_path, gpu=False)
    assert r.returncode == 0, r.stderr
    assert stamp == "cpu"
    assert len(calls) == 1 and "--index-url https://download.pytorch.org/whl/cpu" in calls[0]
    assert "torch" in calls[0].split() and "torchvision" in calls[0].split()
    assert "CPU-only build" in r.stdout


def test_machine_with_gpu_gets_default_build(tmp_path):
    r, calls, stamp = _torch_stamp(tmp_path, gpu=True)
    assert r.returncode == 0, r.stderr
    assert stamp == "cuda"
    assert len(calls) == 1 and "--index-url" not in calls[0]


def test_unreachable_cpu_index_falls_back_and_says_so(tmp_path):
    r, calls, stamp = _torch_stamp(tmp_path, gpu=False, fail_cpu_index=True)
    assert r.returncode == 0, r.stderr
    assert stamp == "cuda"
    assert len(calls) == 2 and "--index-url" in calls[0] and "--index-url" not in calls[1]
    assert "could not be reached" in r.stdout and "TORCH_CPU_INDEX" in r.stdout


def test_insisting_on_cpu_fails_when_the_index_is_unreachable(tmp_path):
    r, calls, stamp = _torch_stamp(tmp_path, gpu=False, fail_cpu_index=True, torch="cpu")
    assert r.returncode != 0 and stamp is None
    assert "could not install the CPU build" in r.stderr


def test_unknown_build_is_refused(tmp_path):
    r, _, stamp = _torch_stamp(tmp_path, gpu=False, torch="rocm")
    assert r.returncode != 0 and stamp is None
    assert "TORCH must be auto, cpu or cuda" in r.stderr


def test_lab_installs_no_test_tools():
    """`make lab`'s install line is gpulab alone; the test extras belong to `make test`."""
    r = subprocess.run([MAKE, "-C", str(ROOT), "-n", "-B", "venv", "VENV=/nonexistent-venv", "UV=uv"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    installs = [ln for ln in r.stdout.splitlines() if re.search(r"\buv pip install\b.*-e ", ln)]
    assert installs and all("[test]" not in ln for ln in installs), installs
    r = subprocess.run([MAKE, "-C", str(ROOT), "-n", "-B", "quick", "VENV=/nonexistent-venv", "UV=uv"],
                       capture_output=True, text=True, timeout=60)
    assert any("-e '.[test]'" in ln for ln in r.stdout.splitlines())
    # every install writes the packages' .pyc files (see the Makefile: PYTHONDONTWRITEBYTECODE)
    every = [ln for ln in r.stdout.splitlines() if re.search(r"\buv pip install\b", ln)]
    assert every and all("--compile-bytecode" in ln for ln in every), every


def test_floors_are_consistent():
    """pyproject and binder/ ask for the same floors, and they are at least what the code uses."""
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert proj["requires-python"] == ">=3.11"
    deps = {re.split(r"[<>=!~ ]", d)[0]: d for d in proj["dependencies"]}
    binder = (ROOT / "binder" / "requirements.txt").read_text().splitlines()
    for name in ("torch", "torchvision"):
        assert deps[name] in binder, (deps[name], "binder/requirements.txt must ask for the same floor")
    floor = tuple(int(x) for x in deps["torch"].split(">=")[1].split(".")[:2])
    # torch.OutOfMemoryError (2.5) and the public torch.distributed.fsdp.fully_shard (2.6)
    assert floor >= (2, 6)
    runtime = (ROOT / "binder" / "runtime.txt").read_text().strip()
    assert runtime.startswith("python-3.") and int(runtime.split(".")[1]) >= 11


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_make_lab_starts_jupyterlab_as_this_user(tmp_path):
    """`make lab` serves the lessons, as root too (Jupyter refuses root without --allow-root)."""
    venv = pathlib.Path(sys.prefix)
    if not (venv / "bin" / "jupyter").exists():
        pytest.skip("jupyter is not installed next to this Python")
    port = _free_port()
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_RUNTIME_DIR=str(tmp_path / "rt"),
               JUPYTER_DATA_DIR=str(tmp_path / "data"))
    lab_args = (f"--no-browser --ip 127.0.0.1 --port {port} --IdentityProvider.token=gpulab-test "
                "--ServerApp.port_retries=0")
    # -o: take the installed .venv as it is (no reinstall inside the test)
    cmd = [MAKE, "-C", str(ROOT), "lab", f"VENV={venv}", f"LAB_ARGS={lab_args}",
           "-o", f"{venv}/.gpulab-lab", "-o", f"{venv}/.gpulab-torch", "-o", "pyproject.toml"]
    log = tmp_path / "lab.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline, status = time.time() + 180, None
        while time.time() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token=gpulab-test",
                                            timeout=5) as r:
                    status = r.status
                    break
            except OSError:
                time.sleep(1)
        text = log.read_text()
        assert status == 200, f"JupyterLab did not come up (exit {proc.poll()}):\n{text[-3000:]}"
        if os.geteuid() == 0:
            assert "--allow-root" in text and "running as root" in text
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
