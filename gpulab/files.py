"""Writing a file the safe way: never half a file, never someone else's file by surprise.

``write_atomic`` writes into a temporary file beside the target and moves it into place with
``os.replace`` (atomic on POSIX and Windows), so an interrupted write leaves the old file or
none, never a truncated one; the temporary file is created with ``O_EXCL`` under a random name,
so a symlink planted at a guessable name is never followed. An existing target is refused unless
``overwrite=True``; a new file is put in place with ``os.link``, which never replaces, so a file
that appears at the target while the data is written is refused too. ``check_target`` asks the
same questions before any work is done (``gpulab record`` measures for minutes before it writes).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["FileExistsRefused", "check_target", "write_atomic"]


class FileExistsRefused(FileExistsError):
    """The target exists and overwriting was not asked for."""


def check_target(path: str | os.PathLike, *, overwrite: bool = False, flag: str = "overwrite=True") -> Path:
    """Raise a one-line error when ``path`` cannot be written as a new file: its folder is a file
    or not writable, it is a folder, or it exists and ``overwrite`` is false (``flag`` names the
    option that allows it: ``--force`` on the command line). Returns the path."""
    p = Path(path)
    if p.is_dir():
        raise IsADirectoryError(f"{p} is a folder: give a file name")
    parent = p.parent if str(p.parent) else Path(".")
    for folder in (parent, *parent.parents):
        if folder.exists():
            if not folder.is_dir():
                raise NotADirectoryError(f"cannot write {p}: {folder} is a file, not a folder")
            if not os.access(folder, os.W_OK | os.X_OK):
                raise PermissionError(f"cannot write {p}: no permission to write in {folder}")
            break
    if (p.exists() or p.is_symlink()) and not overwrite:
        raise _refused(p, flag)
    return p


def write_atomic(path: str | os.PathLike, data: bytes | str, *, overwrite: bool = False,
                 flag: str = "overwrite=True") -> Path:
    """Write ``data`` to ``path`` all at once (see the module docstring); returns the path.
    Creates missing folders. Raises ``FileExistsRefused`` for an existing file unless
    ``overwrite``."""
    p = check_target(path, overwrite=overwrite, flag=flag)
    p.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode() if isinstance(data, str) else bytes(data)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".part", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644 & ~_umask())
        if overwrite or not _link_new(tmp, p, flag):
            os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return p


def _link_new(tmp: str, p: Path, flag: str) -> bool:
    """Put ``tmp`` at ``p`` only if nothing is there, in one step (``link`` never replaces, so a
    file made at ``p`` while we wrote is refused, not overwritten); False where the file system
    has no hard links, and the caller falls back to a check and ``os.replace``."""
    try:
        os.link(tmp, p)
    except FileExistsError:
        raise _refused(p, flag) from None
    except OSError:   # no hard links here (some network or FUSE file systems, FAT)
        if p.exists() or p.is_symlink():
            raise _refused(p, flag) from None
        return False
    os.unlink(tmp)
    return True


def _refused(p: Path, flag: str) -> FileExistsRefused:
    return FileExistsRefused(f"{p} already exists: pass {flag} to replace it, or choose another name")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
