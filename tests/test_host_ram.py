"""Host RAM while loading a checkpoint, measured per method in a child process.

The references: the checkpoint's own byte count (the formula layers x (width² + width) x 4 bytes,
checked against what the writer saved), and each child's resident memory before it loads."""
import glob
import os
import tempfile

import psutil
import pytest

from gpulab.measure import host_ram
from gpulab.measure.host_ram import LOAD_METHODS, loading_peaks

LAYERS, WIDTH = 4, 4096          # 256 MiB of float32 weights


@pytest.fixture(scope="module")
def peaks():
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "gpulab-host-ram-*")))
    result = loading_peaks(LAYERS, WIDTH, timeout_s=300)
    after = set(glob.glob(os.path.join(tempfile.gettempdir(), "gpulab-host-ram-*")))
    assert after <= before, f"temporary checkpoints left behind: {sorted(after - before)}"
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
    got, err = host_ram._child("naive", 1, 8, str(tmp_path), 0.5)
    assert got is None and "timed out after 0.5 s" in err and "killed" in err
    assert psutil.Process().children(recursive=True) == []


def test_a_failing_child_is_reported_and_the_folder_removed(monkeypatch):
    monkeypatch.setattr(host_ram, "_CHILD", "import json, sys\n"
                        "if sys.argv[1] == 'write': print(json.dumps({'weights': 8}))\n"
                        "else: raise SystemExit('no such checkpoint')")
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "gpulab-host-ram-*")))
    result = loading_peaks(1, 8, methods=("naive", "mmap"))
    assert [r.error for r in result.rows] == ["the child process failed (exit 1): no such checkpoint"] * 2
    assert "failed" in result.table()
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "gpulab-host-ram-*"))) <= before
    monkeypatch.setattr(host_ram, "_CHILD", "raise SystemExit(3)")
    with pytest.raises(RuntimeError, match="could not write the checkpoint"):
        loading_peaks(1, 8)
