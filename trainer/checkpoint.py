"""Checkpoint files: atomic writes, keep-last-N pruning, latest lookup, checked loading.

Files are ``<run_dir>/checkpoints/step_<step:08d>.pt``. A save writes ``<name>.tmp-<pid>`` in the
same folder, flushes and fsyncs it, then ``os.replace``s it onto the final name (atomic on POSIX)
and fsyncs the folder: a crash at any point leaves either the old set of checkpoints or the old set
plus the complete new one, never a half file under a checkpoint name. Temporary files are ignored
when looking for the latest checkpoint. Loading uses ``map_location="cpu"`` and
``weights_only=True`` (checkpoints hold only tensors and plain Python values).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step_(\d+)\.pt$")
REQUIRED_KEYS = ("model", "optimizer", "step", "tokens_seen", "rng", "sampler", "config", "model_args")


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, unreadable or not a checkpoint of this trainer."""


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step_{step:08d}.pt"


def step_of(path: Path) -> int:
    """The step in a checkpoint's file name (step_00000100.pt -> 100)."""
    m = _NAME.match(Path(path).name)
    if m is None:
        raise ValueError(f"{path} is not named like a checkpoint (step_<digits>.pt)")
    return int(m.group(1))


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoint files of a run, oldest step first (temporary files excluded)."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name)) and p.is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under torch.compile (``_orig_mod``) and DDP/DataParallel (``module``) wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        else:
            return model


def clean_state_dict(state_dict: dict) -> dict:
    """Strip ``_orig_mod.`` / ``module.`` prefixes, so weights load into an unwrapped model."""
    out = {}
    for k, v in state_dict.items():
        while k.startswith(("_orig_mod.", "module.")):
            k = k.split(".", 1)[1]
        out[k] = v
    return out


def save_checkpoint(state: dict, run_dir: Path, step: int, keep_last: int) -> Path:
    """Atomically write ``state`` as the checkpoint of ``step``, then keep only the newest
    ``keep_last`` checkpoints. Returns the path. On any error the temporary file is removed and
    existing checkpoints are untouched."""
    path = checkpoint_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: Path) -> dict:
    """Load a checkpoint onto the CPU. Raises CheckpointError naming ``path`` if the file is
    missing, unreadable (truncated, corrupt, not a torch file) or lacks trainer keys."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a folder; give a checkpoint file (e.g. "
                              f"<run folder>/checkpoints/step_00000100.pt), or resume a run by its run.name")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for truncated / foreign files
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable ({type(e).__name__}: {e}); "
                              "it was left as is; move it out of the checkpoints folder to resume from the one "
                              "before, or start a new run.name (resume=<path> of an older checkpoint works there too)"
                              ) from e
    missing = [k for k in REQUIRED_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} is not a trainer checkpoint (missing {', '.join(missing)})")
    return state


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems do not support fsync on directories
    finally:
        os.close(fd)
