"""Host RAM while loading a checkpoint: the peak resident memory of a fresh Python process per way.

``loading_peaks(layers, width)`` writes one model's weights to a temporary folder (``torch.save``
and safetensors), then starts one child Python process per loading method; each child measures
its own resident memory before it loads (torch imported, nothing built) and its peak after loading
and after one forward pass that reads every weight. The methods:

* ``naive``: build the model on the CPU (random init: one copy), ``torch.load`` the state dict (a
  second copy), ``load_state_dict`` copies the second into the first;
* ``meta_assign``: build on the meta device (shapes only, no storage), ``torch.load``,
  ``load_state_dict(assign=True)``: the loaded tensors become the parameters, one copy;
* ``mmap``: as ``meta_assign`` with ``torch.load(mmap=True)``: the file is mapped, pages are read
  when a weight is first used;
* ``safetensors``: as ``meta_assign`` with ``safetensors.torch.load_file`` (its default backend
  maps the file too).

The peak is the kernel's high-water mark of the child's resident set (``VmHWM`` in
``/proc/self/status`` on Linux; ``ru_maxrss`` on macOS), which counts the pages of a mapped file
once they are touched, as well as the process's own memory. NB: not Linux's ``ru_maxrss``: a child
inherits into it the high-water mark of the process image it was started from (its parent's, up to
``exec``), so a child of a large notebook kernel would report the kernel's size.
NB: a just-written checkpoint sits in the page cache, so mapped pages come from RAM, not disk;
the page cache itself is not in any process's resident set. The model is ``layers`` float32
``Linear(width, width)`` layers in an ``nn.Sequential``. The child is killed after ``timeout_s``
and its row says so. Linux and macOS (``resource``); the temporary files are always removed.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from gpulab.units import format_bytes

__all__ = ["LOAD_METHODS", "HostRamResult", "LoadPeak", "loading_peaks"]

LOAD_METHODS = ("naive", "meta_assign", "mmap", "safetensors")

# The child: argv = method, layers, width, folder. It prints one JSON line.
_CHILD = r'''
import json, resource, sys, time
import torch
from torch import nn
import safetensors.torch as st

def status(key):   # Linux: this process's own counters, in bytes
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

LINUX = sys.platform.startswith("linux")

def rss_now():
    return status("VmRSS") if LINUX else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

def peak():   # macOS: ru_maxrss is in bytes there
    return status("VmHWM") if LINUX else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

def build(layers, width):
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

method, layers, width, folder = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
pt, sf = folder + "/model.pt", folder + "/model.safetensors"
torch.set_num_threads(1)
if method == "write":
    sd = build(layers, width).state_dict()
    torch.save(sd, pt)
    st.save_file(sd, sf)
    print(json.dumps({"weights": sum(t.nbytes for t in sd.values())}))
    sys.exit(0)
before = rss_now()
t0 = time.perf_counter()
if method == "naive":
    model = build(layers, width)
    model.load_state_dict(torch.load(pt))
else:
    with torch.device("meta"):
        model = build(layers, width)
    sd = {"meta_assign": lambda: torch.load(pt), "mmap": lambda: torch.load(pt, mmap=True),
          "safetensors": lambda: st.load_file(sf)}[method]()
    model.load_state_dict(sd, assign=True)
    del sd
after_load = peak()
with torch.no_grad():
    model(torch.ones(1, width)).sum().item()
print(json.dumps({"before": before, "after_load": after_load, "after_use": peak(),
                  "seconds": time.perf_counter() - t0}))
'''


@dataclass(frozen=True)
class LoadPeak:
    """One method's child process: resident bytes before loading, and its peak after loading and after use."""
    method: str
    before_bytes: int = 0
    peak_load_bytes: int = 0
    peak_use_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None     # why the child gave no numbers (timed out and killed, or failed)

    def rise(self, after_use: bool = True) -> int:
        """Peak minus what the process held before loading."""
        return (self.peak_use_bytes if after_use else self.peak_load_bytes) - self.before_bytes


@dataclass
class HostRamResult:
    """``rows``: one ``LoadPeak`` per method; ``weights_bytes``: the state dict's own tensor bytes."""
    layers: int
    width: int
    weights_bytes: int
    rows: list[LoadPeak] = field(default_factory=list)
    label: str = "measured on CPU (peak resident set of a child process)"

    def row(self, method: str) -> LoadPeak:
        for r in self.rows:
            if r.method == method:
                return r
        raise KeyError(f"no row for {method!r}; measured: {', '.join(r.method for r in self.rows)}")

    def ratio(self, method: str, after_use: bool = True) -> float:
        """The method's rise over the process's baseline, in units of the checkpoint's weights."""
        return self.row(method).rise(after_use) / self.weights_bytes

    def table(self) -> str:
        lines = [f"host RAM while loading {format_bytes(self.weights_bytes)} of weights "
                 f"({self.layers} x Linear({self.width}, {self.width}), float32), {self.label}",
                 f"{'method':<12} {'before':>10} {'peak, loaded':>13} {'peak, used':>11} {'rise/weights':>13}"]
        for r in self.rows:
            if r.error:
                lines.append(f"{r.method:<12} {r.error}")
                continue
            lines.append(f"{r.method:<12} {format_bytes(r.before_bytes):>10} {format_bytes(r.peak_load_bytes):>13} "
                         f"{format_bytes(r.peak_use_bytes):>11} "
                         f"{self.ratio(r.method, False):>5.2f} / {self.ratio(r.method):.2f}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def _repr_html_(self) -> str:
        import html
        return f"<pre class='gpulab-table'>{html.escape(self.table())}</pre>"


def _check(layers, width, methods, timeout_s) -> None:
    for name, v in (("layers", layers), ("width", width)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    unknown = [m for m in methods if m not in LOAD_METHODS]
    if unknown or not methods:
        raise ValueError(f"unknown loading method(s) {unknown or methods!r}; choose from {', '.join(LOAD_METHODS)}")
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if sys.platform == "win32":
        raise ValueError("loading_peaks needs the resource module (Linux or macOS); on Windows use WSL")


def _child(method: str, layers: int, width: int, folder: str, timeout_s: float) -> tuple[dict | None, str | None]:
    """Run the child for ``method``; (its JSON, None) or (None, why not). A child past ``timeout_s`` is killed."""
    cmd = [sys.executable, "-c", _CHILD, method, str(layers), str(width), folder]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:   # subprocess.run kills the child before raising
        return None, f"timed out after {timeout_s:g} s: the child process was killed"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return None, f"the child process failed (exit {done.returncode}): {last}"
    return json.loads(done.stdout.strip().splitlines()[-1]), None


def loading_peaks(layers: int = 4, width: int = 4096, methods: tuple[str, ...] = LOAD_METHODS,
                  timeout_s: float = 120.0) -> HostRamResult:
    """Write a ``layers`` x ``Linear(width, width)`` float32 checkpoint to a temporary folder, then load
    it once per method, each in a fresh child process, and return the peaks (see the module docstring).
    The default, 4 x 4096², is 256 MiB of weights; each child runs one after the other (a machine with
little RAM, such as Binder's, holds one child at a time)."""
    methods = tuple(methods)
    _check(layers, width, methods, timeout_s)
    with tempfile.TemporaryDirectory(prefix="gpulab-host-ram-") as folder:
        wrote, err = _child("write", layers, width, folder, timeout_s)
        if err:
            raise RuntimeError(f"could not write the checkpoint: {err}")
        result = HostRamResult(layers, width, int(wrote["weights"]))
        for m in methods:
            t0 = time.perf_counter()
            got, err = _child(m, layers, width, folder, timeout_s)
            if err:
                result.rows.append(LoadPeak(m, seconds=time.perf_counter() - t0, error=err))
            else:
                result.rows.append(LoadPeak(m, int(got["before"]), int(got["after_load"]), int(got["after_use"]),
                                            float(got["seconds"])))
    return result
