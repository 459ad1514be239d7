"""Atomic file writes: a temporary file next to the target, fsync, then ``os.replace``.

A reader never sees a half-written file under the final name; a crash leaves at most a
``<name>.tmp-<pid>`` file, which ``remove_stale_temp_files`` deletes once that process is gone.

    atomic_write(path, lambda f: torch.save(state, f))      # f: a binary file object
    atomic_write_text(path, text)
    with atomic_path(path) as tmp:                           # for writers that need a path (np.memmap)
        ...write tmp...
    remove_stale_temp_files(folder)                          # -> [removed paths]
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Callable, Iterator

_TEMP = re.compile(r"^(?P<name>.+)\.tmp-(?P<pid>\d+)$")


def temp_path(path: Path, pid: int | None = None) -> Path:
    """``<path>.tmp-<pid>`` (this process by default): the temporary name ``atomic_path`` writes to."""
    path = Path(path)
    return path.with_name(f"{path.name}.tmp-{os.getpid() if pid is None else pid}")


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path to write; on a normal exit it is fsynced and renamed to ``path``
    (and the folder fsynced). On any exception the temporary file is removed and ``path`` is
    untouched; the exception propagates."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


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
    """Delete ``<name>.tmp-<pid>`` files in ``folder`` whose process no longer runs (left by a killed
    writer; ``name_glob`` matches ``<name>``). Returns the removed paths. Temporary files of live
    processes, this one included, are kept. The pid test is per machine: on a folder shared by
    several nodes, call it from one node only."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = []
    for p in sorted(folder.glob(f"{name_glob}.tmp-*")):
        m = _TEMP.match(p.name)
        if m and p.is_file() and not _alive(int(m.group("pid"))):
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
