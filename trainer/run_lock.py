"""One live process owns a run folder: an exclusive ``fcntl.flock`` on ``<run folder>/.lock``,
whose content names the owner (PID and host).

The kernel drops the lock when its process dies (``kill -9`` included), so a lock left by a dead
process is only a file with a PID in it: the next process takes the folder over and says so. The
file is emptied on release but never deleted (deleting a lock file lets two processes lock two
different files). Own code rather than the ``filelock`` package: its lock file is truncated by
every process that tries it, so it cannot name the owner.

Under torchrun only the launching job's rank 0 takes the lock (train.py), so the ranks of one job
never refuse each other; each job of a sweep (``-m``) locks its own folder (``runs/<name>/<job>``).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import time
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"


class RunFolderBusy(RuntimeError):
    """Another live process owns the run folder."""


@contextlib.contextmanager
def own_run_folder(run_dir: str | Path) -> Iterator[None]:
    """Hold the run folder's lock for the ``with`` block; raise RunFolderBusy naming the owner."""
    path = Path(run_dir) / LOCK_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunFolderBusy(
                f"run folder {Path(run_dir)} is in use by {_owner(fd, wait=True) or 'another process'} (lock "
                f"{path}); wait for it to finish or stop it, or choose another run.name") from None
        except OSError as e:  # a file system without locks (some network or FUSE mounts): train, unguarded
            log.warning("cannot lock run folder %s (%s): make sure no other process trains in it", run_dir,
                        e.strerror or e)
        stale = _owner(fd)
        if stale:  # we hold the lock, so its last owner died without releasing it (kill -9, power loss)
            log.warning("run folder %s was owned by %s, which is no longer running; taking it over", run_dir, stale)
        _write(fd, f"{os.getpid()} {socket.gethostname()}")
        try:
            yield
        finally:
            _write(fd, "")  # released cleanly: no owner to report
    finally:
        os.close(fd)  # drops the lock


def busy_owner(run_dir: str | Path) -> str | None:
    """Who owns the run folder now ('PID <pid>[ on <host>]', or 'another process' if it has not written itself
    yet), or None when no live process holds its lock (no lock file, or a free one). Takes the lock for an
    instant when it is free; never creates the file."""
    try:
        fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDWR)
    except OSError:  # no lock file (no run ever took this folder), or one this user cannot open
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _owner(fd, wait=True) or "another process"
        except OSError:  # a file system without locks: no owner can be told
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _write(fd: int, text: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)


def _owner(fd: int, wait: bool = False) -> str:
    """'PID <pid> on <host>' from the lock file, '' if empty. wait: give a new owner 1 s to write it."""
    for _ in range(10 if wait else 1):
        pid, _, host = os.pread(fd, 256, 0).decode(errors="replace").strip().partition(" ")
        if pid:
            return f"PID {pid}" + (f" on {host}" if host and host != socket.gethostname() else "")
        if wait:
            time.sleep(0.1)
    return ""
