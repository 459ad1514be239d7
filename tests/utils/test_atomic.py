"""utils.atomic: atomic replacement, clean-up on failure, stale temporary files of dead processes."""

import os
import subprocess
import sys

import pytest

from utils.atomic import atomic_path, atomic_write, atomic_write_text, remove_stale_temp_files, temp_path


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_atomic_write_replaces_and_a_failure_leaves_the_old_file(tmp_path):
    path = tmp_path / "f.bin"
    atomic_write(path, lambda f: f.write(b"old"))
    assert path.read_bytes() == b"old"

    def fail(f):
        f.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write(path, fail)
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]
    atomic_write_text(path, "new")
    assert path.read_text() == "new"


def test_atomic_path_renames_only_on_success(tmp_path):
    target = tmp_path / "train.bin"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"x")
            raise RuntimeError("writer died")
    assert list(tmp_path.iterdir()) == []
    with atomic_path(target) as tmp:
        assert tmp == temp_path(target)
        tmp.write_bytes(b"x")
    assert target.read_bytes() == b"x" and list(tmp_path.iterdir()) == [target]


def test_remove_stale_temp_files_keeps_live_writers(tmp_path):
    dead = temp_path(tmp_path / "step_00000002.pt", dead_pid())
    mine = temp_path(tmp_path / "step_00000003.pt")
    parent = temp_path(tmp_path / "step_00000004.pt", os.getppid())
    other = tmp_path / "notes.txt"
    for p in (dead, mine, parent, other):
        p.write_bytes(b"half")
    assert remove_stale_temp_files(tmp_path, "step_*.pt") == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (mine, parent, other))


def test_check_writable_leaves_nothing_and_raises_where_no_file_can_be_made(tmp_path):
    from utils.atomic import check_writable

    check_writable(tmp_path)
    assert list(tmp_path.iterdir()) == []
    # tests run as root, whom permission bits do not stop: the probe's own name taken by a folder stops it
    temp_path(tmp_path / ".write-check").mkdir()
    with pytest.raises(OSError):
        check_writable(tmp_path)
    with pytest.raises(OSError):
        check_writable(tmp_path / "missing")
