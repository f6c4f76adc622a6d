"""Every writer writes whole files, and never over an existing one unless asked: snapshots
(``save``, ``export_tracking``), ``%%memtrack --snapshot``, ``gpulab record`` (which checks its
target before it measures)."""
from __future__ import annotations

import os

import pytest
import torch

from gpulab import MemoryTracker, cli
from gpulab.record import runner as R
from gpulab.files import FileExistsRefused, check_target, write_atomic
from gpulab.interop.snapshot import export_tracking


def _tracked():
    with MemoryTracker() as t:
        x = torch.ones(256)
        del x
    return t.result()


def test_write_atomic_refuses_an_existing_file_unless_asked(tmp_path):
    p = tmp_path / "out.bin"
    write_atomic(p, b"one")
    with pytest.raises(FileExistsRefused, match="overwrite=True"):
        write_atomic(p, b"two")
    assert p.read_bytes() == b"one"
    write_atomic(p, b"two", overwrite=True)
    assert p.read_bytes() == b"two"
    assert [f.name for f in tmp_path.iterdir()] == ["out.bin"]   # no temporary file left


def test_an_interrupted_write_leaves_the_old_file_whole(tmp_path, monkeypatch):
    p = tmp_path / "snap.pickle"
    p.write_bytes(b"the old file")

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(p, b"x" * 1_000_000, overwrite=True)
    assert p.read_bytes() == b"the old file"
    assert [f.name for f in tmp_path.iterdir()] == ["snap.pickle"]


def test_a_file_made_while_writing_is_not_overwritten(tmp_path, monkeypatch):
    """Another writer creates the target after the check, just before ours lands: without
    overwrite, theirs stays (a new file goes in with os.link, which never replaces)."""
    p = tmp_path / "out.bin"
    real_replace, real_link = os.replace, os.link

    def theirs_first(real):
        def put(src, dst, *a, **k):
            p.write_bytes(b"theirs")
            return real(src, dst, *a, **k)
        return put

    monkeypatch.setattr(os, "replace", theirs_first(real_replace))
    monkeypatch.setattr(os, "link", theirs_first(real_link))
    with pytest.raises(FileExistsRefused, match="overwrite=True"):
        write_atomic(p, b"ours")
    assert p.read_bytes() == b"theirs"
    assert [f.name for f in tmp_path.iterdir()] == ["out.bin"]


def test_without_hard_links_a_new_file_is_still_written_and_an_old_one_refused(tmp_path, monkeypatch):
    def no_links(src, dst, *a, **k):
        raise PermissionError(1, "Operation not permitted (a file system without hard links)")

    monkeypatch.setattr(os, "link", no_links)
    p = tmp_path / "out.bin"
    write_atomic(p, b"one")
    assert p.read_bytes() == b"one"
    with pytest.raises(FileExistsRefused):
        write_atomic(p, b"two")
    write_atomic(p, b"two", overwrite=True)
    assert p.read_bytes() == b"two" and [f.name for f in tmp_path.iterdir()] == ["out.bin"]


def test_a_planted_symlink_is_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    link = tmp_path / "snap.pickle"
    link.symlink_to(victim)
    with pytest.raises(FileExistsRefused):
        write_atomic(link, b"data")
    write_atomic(link, b"data", overwrite=True)   # replaces the link itself, not what it points to
    assert victim.read_text() == "precious" and not link.is_symlink() and link.read_bytes() == b"data"


def test_check_target_says_what_is_wrong(tmp_path):
    afile = tmp_path / "a_file"
    afile.write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file, not a folder"):
        check_target(afile / "out.json")
    with pytest.raises(IsADirectoryError, match="give a file name"):
        check_target(tmp_path)
    with pytest.raises(FileExistsRefused, match="--force"):
        check_target(afile, flag="--force")
    assert check_target(tmp_path / "new" / "deeper.json") == tmp_path / "new" / "deeper.json"


def test_snapshot_export_refuses_an_existing_file_before_any_work(tmp_path):
    tr = _tracked()
    p = tmp_path / "s.pickle"
    snap = export_tracking(tr, p)
    assert p.read_bytes() == snap.pickle_bytes()
    with pytest.raises(FileExistsRefused):
        export_tracking(tr, p)
    with pytest.raises(FileExistsRefused):
        snap.save(p)
    snap.save(p, overwrite=True)
    export_tracking(tr, p, overwrite=True)


def test_memtrack_snapshot_refuses_an_existing_file_before_running_the_cell(tmp_path):
    from IPython.core.error import UsageError
    from IPython.core.interactiveshell import InteractiveShell

    # the one in-process shell the other magic tests use (IPython keeps one singleton a process:
    # globalipapp's TerminalInteractiveShell beside it fails in whichever test comes second)
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "gpulab.magic")
    target = tmp_path / "cell.pickle"
    target.write_bytes(b"someone's file")
    ip.user_ns.pop("ran_it", None)
    with pytest.raises(UsageError, match="--force"):
        ip.run_cell_magic("memtrack", f"--engine cpu --snapshot {target}", "ran_it = torch.ones(8)")
    assert "ran_it" not in ip.user_ns and target.read_bytes() == b"someone's file"
    ip.run_cell_magic("memtrack", f"--engine cpu --snapshot {target} --force", "import torch\nran_it = torch.ones(8)")
    assert "ran_it" in ip.user_ns and target.read_bytes()[:1] == b"\x80"   # a pickle now


def test_write_record_refuses_an_existing_file(tmp_path):
    data = {"provenance": {"gpu_name": "Some GPU 24GB"}, "experiments": []}
    path = R.write_record(data, tmp_path)
    assert path == R.record_path(tmp_path, "Some GPU 24GB")
    with pytest.raises(FileExistsRefused):
        R.write_record(data, tmp_path)
    R.write_record(data, tmp_path, overwrite=True)


@pytest.mark.parametrize("case", ["out is a file", "record exists"])
def test_record_checks_its_target_before_measuring(tmp_path, monkeypatch, capsys, case):
    from cuda_standin import STANDIN_NAME
    from cuda_standin import standin_gpu as install

    def must_not_measure(*a, **k):
        raise AssertionError("measured before checking --out")

    if case == "out is a file":
        out = tmp_path / "a_file"
        out.write_text("x")
    else:
        out = tmp_path
        R.record_path(out, STANDIN_NAME).write_text("{}")
    with install(monkeypatch):
        monkeypatch.setattr(R, "record", must_not_measure)
        assert cli.main(["record", "--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nothing was recorded" in err
    assert ("is a file" in err) if case == "out is a file" else ("--force" in err)
