"""Atomic file writes: a temporary file next to the target, fsync, then ``os.replace``.

A reader never sees a half-written file under the final name; a crash leaves at most a
``<name>.tmp-<pid>`` file, which ``remove_stale_temp_files`` deletes once no process writes it: the pid is
not running here and nobody holds the flock the writer keeps on the file while writing it (the pid says
nothing about a writer on another host sharing the folder; its lock does).

    atomic_write(path, lambda f: torch.save(state, f))      # f: a binary file object
    atomic_write_text(path, text)
    with atomic_path(path) as tmp:                           # for writers that need a path (np.memmap)
        ...write tmp...
    remove_stale_temp_files(folder)                          # -> [removed paths]
    check_writable(folder)                                   # OSError unless files can be made there
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from pathlib import Path
from typing import Callable, Iterator

_TEMP = re.compile(r"^(?P<name>.+)\.tmp-(?P<pid>\d+)$")


def temp_path(path: Path, pid: int | None = None) -> Path:
    """``<path>.tmp-<pid>`` (this process by default): the temporary name ``atomic_path`` writes to."""
    path = Path(path)
    return path.with_name(f"{path.name}.tmp-{os.getpid() if pid is None else pid}")


def check_writable(folder: Path) -> None:
    """Raise OSError (PermissionError, a read-only file system, ...) unless this process can create, write and remove
    a file in ``folder``, as the atomic writes do: a folder that cannot take them is refused before work starts,
    not at the first write. The probe, ``.write-check.tmp-<pid>``, is removed at once."""
    probe = temp_path(Path(folder) / ".write-check")
    with open(probe, "wb") as f:
        f.write(b"\0")
    os.unlink(probe)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path to write; on a normal exit it is fsynced and renamed to ``path``
    (and the folder fsynced). On any exception the temporary file is removed and ``path`` is
    untouched; the exception propagates."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        with _held_while_written(tmp):
            yield tmp
        _fsync_file(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


@contextlib.contextmanager
def _held_while_written(tmp: Path):
    """Create ``tmp`` and hold an flock on it until the block ends (see ``remove_stale_temp_files``)."""
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with contextlib.suppress(OSError):  # a file system without locks: the pid test is all there is
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)


def atomic_write(path: Path, write_fn: Callable, mode: str = "wb") -> Path:
    """Write ``path`` atomically: ``write_fn(f)`` gets the temporary file opened with ``mode``.
    Errors (e.g. OSError: disk full, read-only folder) propagate after the temporary is removed."""
    with atomic_path(path) as tmp:
        with open(tmp, mode) as f:
            write_fn(f)
    return Path(path)


def atomic_write_text(path: Path, text: str) -> Path:
    return atomic_write(path, lambda f: f.write(text), mode="w")


def remove_stale_temp_files(folder: Path, name_glob: str = "*") -> list[Path]:
    """Delete ``<name>.tmp-<pid>`` files in ``folder`` that no process writes any more (left by a killed
    writer; ``name_glob`` matches ``<name>``): the pid is not running here and the file's flock is free.
    Returns the removed paths. Temporary files of live writers, this process and other hosts included,
    are kept."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = []
    for p in sorted(folder.glob(f"{name_glob}.tmp-*")):
        m = _TEMP.match(p.name)
        if m and p.is_file() and not _alive(int(m.group("pid"))) and not _locked(p):
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _locked(path: Path) -> bool:
    """Whether a writer (of any host sharing the file system) holds the file's flock."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return True  # gone already: nothing to remove
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:  # no file locks here
        return False
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable; a no-op where the file system cannot fsync folders."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
