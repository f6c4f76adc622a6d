"""Host RAM while loading a checkpoint, measured per method in a child process.

The references: the checkpoint's own byte count (the formula layers x (width² + width) x 4 bytes,
checked against what the writer saved), and each child's resident memory before it loads."""
import contextlib
import glob
import os
import tempfile

import psutil
import pytest

from gpulab.measure import host_ram
from gpulab.measure.host_ram import LOAD_METHODS, loading_peaks

LAYERS, WIDTH = 4, 4096          # 256 MiB of float32 weights


@contextlib.contextmanager
def _own_tempdir(folder):
    """Python's temporary folder pointed at ``folder`` while the block runs: the checkpoints these
    tests write land there alone, so other processes' runs (lesson 14's cells in a parallel test
    worker write the same prefix in the shared /tmp) cannot make a left-behind folder seem ours."""
    saved = tempfile.tempdir
    tempfile.tempdir = str(folder)
    try:
        yield
    finally:
        tempfile.tempdir = saved


def _left_behind(folder) -> list[str]:
    return sorted(glob.glob(os.path.join(str(folder), "gpulab-host-ram-*")))


@pytest.fixture(scope="module")
def peaks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("host-ram")
    with _own_tempdir(folder):
        result = loading_peaks(LAYERS, WIDTH, timeout_s=300)
    assert _left_behind(folder) == [], f"temporary checkpoints left behind: {_left_behind(folder)}"
    return result


def test_weights_are_the_checkpoints_bytes(peaks):
    assert peaks.weights_bytes == LAYERS * (WIDTH * WIDTH + WIDTH) * 4
    assert [r.method for r in peaks.rows] == list(LOAD_METHODS)
    assert all(r.error is None for r in peaks.rows), [r.error for r in peaks.rows]


def test_naive_holds_two_copies(peaks):
    # the random init and the loaded state dict are both alive when load_state_dict copies
    assert peaks.ratio("naive") >= 1.8
    assert peaks.ratio("naive") <= 2.3


@pytest.mark.parametrize("method", ["meta_assign", "mmap", "safetensors"])
def test_one_copy_at_most(peaks, method):
    assert 0.8 <= peaks.ratio(method) <= 1.3           # after a forward pass has read every weight
    assert peaks.ratio(method) < peaks.ratio("naive") - 0.5


@pytest.mark.parametrize("method", ["mmap", "safetensors"])
def test_mapped_pages_arrive_when_touched(peaks, method):
    # loaded but not yet read: only the pages the loader itself touched (headers, small tensors)
    assert peaks.ratio(method, after_use=False) <= 0.1
    assert peaks.ratio("meta_assign", after_use=False) >= 0.8   # a plain torch.load reads every byte


def test_views(peaks):
    text = peaks.table()
    assert "naive" in text and "rise/weights" in text and "256.1 MiB" in text
    assert "<pre" in peaks._repr_html_()
    with pytest.raises(KeyError, match="measured"):
        peaks.row("pickle")


@pytest.mark.parametrize("kwargs, match", [
    ({"layers": 0}, "layers must be a positive int"),
    ({"width": 2.5}, "width must be a positive int"),
    ({"methods": ("naive", "fast")}, "unknown loading method"),
    ({"methods": ()}, "unknown loading method"),
    ({"timeout_s": 0}, "timeout_s must be a positive number"),
])
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        loading_peaks(**kwargs)


def test_a_child_past_its_timeout_is_killed(tmp_path, monkeypatch):
    monkeypatch.setattr(host_ram, "_CHILD", "import time\ntime.sleep(60)")
    # this worker may hold other tests' long-lived children (a JupyterLab server, a kernel): only
    # a process started by this call counts
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    got, err = host_ram._child("naive", 1, 8, str(tmp_path), 0.5)
    assert got is None and "timed out after 0.5 s" in err and "killed" in err
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_a_failing_child_is_reported_and_the_folder_removed(monkeypatch, tmp_path):
    monkeypatch.setattr(host_ram, "_CHILD", "import json, sys\n"
                        "if sys.argv[1] == 'write': print(json.dumps({'weights': 8}))\n"
                        "else: raise SystemExit('no such checkpoint')")
    with _own_tempdir(tmp_path):
        result = loading_peaks(1, 8, methods=("naive", "mmap"))
    assert [r.error for r in result.rows] == ["the child process failed (exit 1): no such checkpoint"] * 2
    assert "failed" in result.table()
    assert _left_behind(tmp_path) == []
    monkeypatch.setattr(host_ram, "_CHILD", "raise SystemExit(3)")
    with pytest.raises(RuntimeError, match="could not write the checkpoint"):
        loading_peaks(1, 8)


# --- lesson 14's predict-first checker reads the measured numbers ------------------------------------

def _synthetic(ratios: dict[str, tuple[float, float]], weights: int = 100 * 2**20):
    from gpulab.measure.host_ram import HostRamResult, LoadPeak
    base = 500 * 2**20
    rows = [LoadPeak(m, base, base + int(a * weights), base + int(b * weights)) for m, (a, b) in ratios.items()]
    return HostRamResult(1, 8, weights, rows)


def test_the_checker_reads_the_measurement(peaks):
    from gpulab.course.checkpoint_loading import copies, exercise_loading_copies
    assert copies(peaks) == (2, 1, 0, 1)
    q = exercise_loading_copies(peaks)
    assert q.check("c").ok and not q.check("b").ok and not q.check("d").ok
    assert f"{peaks.ratio('naive'):.2f}" in q.reveal().message


def test_the_checker_follows_other_numbers():
    from gpulab.course.checkpoint_loading import exercise_loading_copies
    same = {"naive": (1.0, 1.0), "meta_assign": (1.0, 1.0), "mmap": (1.1, 1.1), "safetensors": (1.0, 1.0)}
    assert exercise_loading_copies(_synthetic(same)).check("a").ok
    odd = dict(same, naive=(3.0, 3.0))
    q = exercise_loading_copies(_synthetic(odd))
    assert not any(q.check(k).ok for k in "abcd")


def test_the_checker_refuses_a_failed_child():
    from gpulab.course.checkpoint_loading import copies
    from gpulab.measure.host_ram import HostRamResult, LoadPeak
    failed = HostRamResult(1, 8, 100, [LoadPeak("naive", error="timed out after 1 s: the child process was killed")])
    with pytest.raises(ValueError, match="run loading_peaks again"):
        copies(failed)


def test_measured_once_per_session(monkeypatch):
    from gpulab.course import checkpoint_loading as cl
    calls = []
    monkeypatch.setattr(cl, "_MEASURED", {})
    monkeypatch.setattr(cl, "loading_peaks", lambda layers, width, methods: calls.append(1) or _synthetic(
        {m: (1.0, 1.0) for m in methods}))
    first = cl.measured_loading(1, 8)
    assert cl.measured_loading(1, 8) is first and len(calls) == 1
    assert cl.measured_loading(1, 8, fresh=True) is not first and len(calls) == 2
