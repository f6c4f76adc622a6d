"""Lesson 13's course module (gpulab.course.pytorch_tools) and the out-of-memory reader panel."""
from __future__ import annotations

import pathlib

import nbformat
import pytest

from gpulab.interop import oom_message as O
from gpulab.course import pytorch_tools as P
from gpulab.measure.linetrack import track_lines
from gpulab.interop.snapshot_import import read_snapshot

from conftest import LESSONS


@pytest.fixture(scope="module")
def export():
    return P.vgg16_step_snapshot(batch=8)


def test_vgg16_step_snapshot_peaks_agree(export):
    assert all(export.checks.values()), export.checks
    assert export.viz_peak == export.tracker_requested_peak < export.tracker_rounded_peak
    assert export.memory_viz["allocated"] >= export.memory_viz["requested"]
    html = export._repr_html_()
    assert "vgg16, batch 8" in html and "✓" in html and "✗" not in html
    assert "fake tensors" in html and "simulated allocator" in html


def test_viewer_and_timeline(export, tmp_path):
    v = export.viewer()
    assert v.filename == "vgg16_step_snapshot.pickle" and "online" in v._repr_html_()
    img = export.timeline()
    assert img.data[:8] == b"\x89PNG\r\n\x1a\n"
    p = export.save(tmp_path / "v.pickle")
    assert read_snapshot(p).peak_active == export.viz_peak


def test_the_lessons_files_go_to_the_students_own_folder(tmp_path, monkeypatch):
    """Lesson 13 writes beside the notebook (the same folder after a restart), or, where that is
    read-only, into a new private temporary folder: never into a fixed folder under the shared
    /tmp, where another user could have planted a link."""
    import stat

    monkeypatch.chdir(tmp_path)
    folder = P.files_folder()
    assert folder == pathlib.Path(P.FILES_FOLDER) and (tmp_path / P.FILES_FOLDER).is_dir()
    assert P.files_folder() == folder

    def read_only(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(pathlib.Path, "mkdir", read_only)
    a, b = P.files_folder("read_only_copy"), P.files_folder("read_only_copy")
    try:
        assert a != b and a.is_absolute() and a.is_dir() and stat.S_IMODE(a.stat().st_mode) == 0o700
    finally:
        a.rmdir()
        b.rmdir()
    nb = nbformat.read(LESSONS / "13_pytorch_memory_tools.ipynb", as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "workdir = tools.files_folder()" in code and "gettempdir" not in code and "/tmp" not in code


def test_exercise_viewer_peak(export):
    ex = P.exercise_viewer_peak(export)
    assert ex.expected() == "b"
    assert ex.check("b").ok and not ex.check("a").ok and not ex.check(...).ok


def test_example_snapshot_is_labelled_not_a_gpu():
    imp = P.load_example_snapshot()
    assert not imp.from_gpu
    note = P.provenance(imp)
    assert "not recorded on a GPU" in note and "made by gpulab on a CPU" in note
    rep = imp.replay()
    assert all(r[-1] == "0 B" for r in rep.total_rows()[:3])
    missing = P.load_example_snapshot("/nonexistent/snapshot.pickle")   # made fresh, the same way
    assert not missing.from_gpu and missing.peak_active > 0


def test_profiler_next_to_memtrack_and_the_tracker():
    prof = P.profile_step()
    assert prof.ops and any(r.self_bytes > 0 for r in prof.ops) and any(r.self_bytes < 0 for r in prof.ops)
    assert prof.timeline_peak is not None and prof.timeline_at_peak["parameter"] > 0
    net, opt, x, y = P.fresh_step()
    import torch
    lines = track_lines(P.STEP_CODE, {"net": net, "opt": opt, "x": x, "y": y, "nn": torch.nn}, engine="cpu")
    cmp = P.compare_tools(prof, lines)
    # the same step: the parameters agree exactly; the totals differ only by what is not a tensor
    assert lines.tracking.peak_by_category["parameters"] == prof.timeline_at_peak["parameter"]
    unknown = prof.timeline_at_peak["unknown (no tensor or category)"]
    assert abs(cmp.peak_difference) <= unknown + 4096
    html = cmp._repr_html_()
    for words in ("Self CPU Mem", "%%memtrack", "PyTorch&#x27;s memory profiler", "what each tool sees and misses"):
        assert words in html
    assert len(cmp.line_rows()) == 4


def test_fresh_step_is_the_same_every_time():
    a, b = P.fresh_step(), P.fresh_step()
    assert all(torch_equal(p, q) for p, q in zip(a[0].parameters(), b[0].parameters()))
    assert torch_equal(a[2], b[2]) and torch_equal(a[3], b[3])


def torch_equal(a, b) -> bool:
    import torch
    return bool(torch.equal(a, b))


@pytest.mark.parametrize("kind, case", [("fragmentation", "fragmentation"), ("too big", "too_big")])
def test_example_ooms_are_read_and_reproduced(kind, case):
    ex = P.example_oom(kind)
    assert ex.text.startswith("CUDA out of memory. Tried to allocate ") and "(simulated)" not in ex.text
    assert O.parse_oom_message(ex.text).format == O.FORMAT_CURRENT
    reading = P.read_oom(ex.text)
    assert reading.ok and reading.case == case and reading.reproduction.reproduced
    outcomes = {o.setting: o.ok for o in reading.reproduction.outcomes}
    if case == "fragmentation":
        assert outcomes["expandable_segments:True"] is True
        assert ex.step is not None and (ex.step_expandable is None or ex.step_expandable > ex.step)
    else:
        assert outcomes["expandable_segments:True"] is False
    assert "simulated allocator" in ex._repr_html_()
    legacy = O.parse_oom_message(ex.formatted("legacy"))
    assert legacy.format == O.FORMAT_LEGACY and legacy.tried.text == O.parse_oom_message(ex.text).tried.text
    assert P.exercise_oom_case(ex.text).expected() == {"fragmentation": "a", "too_big": "b"}[case]


@pytest.mark.parametrize("bad", ["", None, "RuntimeError: CUDA error: device-side assert triggered",
                                 "CUDA out of memory. Tried to allocate a lot"])
def test_read_oom_never_raises(bad):
    r = P.read_oom(bad)
    assert not r.ok and r.error.startswith("could not read this message")
    assert "Could not read this message" in r._repr_html_() and "gpulab-error" not in r._repr_html_()


def test_oom_panel():
    from gpulab.widgets import oom_panel
    panel = oom_panel()
    panel.run()
    assert panel.error is None and panel.result.case == "fragmentation"
    panel.set(example="too big (simulated, current format)")
    assert panel.result.case == "too_big"
    panel.set(example="fragmentation (same figures, PyTorch 1.x format)")
    assert panel.result.ok and panel.result.diagnosis.message.format == O.FORMAT_LEGACY
    panel.set(example="not an out-of-memory message")
    assert panel.error is None and not panel.result.ok
    panel.set(example=P.OWN_MESSAGE, text="hello")
    assert panel.error is None and not panel.result.ok
    own = O.format_oom_message(2 * 2**30, 16 * 2**30, 2**29, 14 * 2**30, 14 * 2**30)
    panel.set(text=own)
    assert panel.result.ok and panel.result.case == "too_big"
    with pytest.raises(ValueError):
        P.example_text("nope")


def test_oom_panel_reads_a_pasted_message_without_touching_the_dropdown():
    from gpulab.widgets import oom_panel
    panel = oom_panel()
    panel.run()
    assert panel.result.case == "fragmentation"
    own = O.format_oom_message(2 * 2**30, 16 * 2**30, 2**29, 14 * 2**30, 14 * 2**30)
    panel.controls["text"].value = own        # what typing or pasting into the text area does
    assert panel.controls["example"].value == P.OWN_MESSAGE
    assert panel.result.ok and panel.result.case == "too_big"
