"""The checkpoint format, alone: file names, atomic save, keep-last, latest lookup, checked load.

A checkpoint is ``<run folder>/checkpoints/step_<8 digits>.pt``, a ``torch.save`` dict read back
with ``weights_only=True`` (tensors and plain Python values only). Format version 1 (``FORMAT_VERSION``)
holds, besides ``format_version``:

    model          unwrapped state dict (no ``_orig_mod.`` / ``module.`` prefixes)
    optimizer      optimizer state dict;  scaler: GradScaler state dict
    step, tokens_seen (int, whole job), best_val_loss (float or None), wandb_run_id (str or None)
    world_size     processes of the job that wrote it
    rng            [trainer.runtime.rng_state() of rank 0, of rank 1, ...]
    sampler        data.sampler.ShardedBatchSampler.merge_states(...) of all ranks
    config         the resolved config (dict);  model_args: model.gpt.GPTConfig as a dict
    data_meta      the token cache's meta.json (tokenizer);  attn_backend: resolved backend name
    torch_version  str

Files written before versions existed (format 0) have the same keys without ``format_version`` and load
unchanged. Keys added inside ``model_args`` / ``config`` later (``ADDED_DEFAULTS``, e.g. the attention
window) read as their default from a file written before them. ``load_checkpoint`` returns a ``Checkpoint``
mapping whose lookups check the key's presence and type, so a missing or malformed key raises ``CheckpointError`` naming the file and the key.
"""

from __future__ import annotations

import logging
import os  # noqa: F401  (tests patch os.replace through this module)
import pickle
import re
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import torch

from utils.atomic import atomic_write, remove_stale_temp_files

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_NAME = re.compile(r"^step_(\d+)\.pt$")
REQUIRED_KEYS = ("model", "optimizer", "step", "tokens_seen", "rng", "sampler", "config", "model_args")
WEIGHTS_KEYS = ("model", "model_args", "data_meta")  # what sampling needs: a checkpoint stripped of the rest will do
# Type of every key the trainer and sample.py read (a tuple: any of these).
KEY_TYPES: dict[str, tuple] = {
    "model": (dict,), "optimizer": (dict,), "scaler": (dict,), "step": (int,), "tokens_seen": (int,),
    "best_val_loss": (float, type(None)), "wandb_run_id": (str, type(None)), "world_size": (int,),
    "rng": (list, dict), "sampler": (dict,), "config": (dict,), "model_args": (dict,), "data_meta": (dict,),
    "attn_backend": (str,), "torch_version": (str,), "format_version": (int,),
}


# Keys added to format 1 later, with the value a checkpoint written before them implies.
# The block options (model.pos_emb ... model.tie_embeddings): a file without them holds a GPT-2.
_BLOCK_DEFAULTS = {"pos_emb": "learned", "rope_theta": 10000.0, "norm": "layernorm", "norm_eps": 1e-5, "mlp": "gelu",
                   "mlp_hidden": None, "multiple_of": 256, "qk_norm": False, "tie_embeddings": True}
ADDED_DEFAULTS: dict[str, dict] = {
    "model_args": {"attn_window": 0, "attn_softcap": 0.0, **_BLOCK_DEFAULTS},
    "config": {"model": {"attn_window": 0, "attn_softcap": 0.0, **_BLOCK_DEFAULTS},
               "data": {"document_mask": False, "split_scenes": False}},
}


def _with_defaults(value: dict, defaults: dict) -> dict:
    out = dict(value)
    for k, d in defaults.items():
        if k not in out:
            out[k] = d
        elif isinstance(d, dict) and isinstance(out[k], dict):
            out[k] = _with_defaults(out[k], d)
    return out


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, unreadable, not a checkpoint of this trainer, or could not be written."""


class UnreadableCheckpoint(CheckpointError):
    """A checkpoint file that cannot be resumed from: not a checkpoint of this trainer, or corrupt."""


class CheckpointWriteError(CheckpointError, OSError):
    """Writing a checkpoint failed (disk full, read-only folder, file-size limit); older ones are intact."""


class Checkpoint(Mapping):
    """A loaded checkpoint: ``ckpt[key]`` checks that the key exists and has its type (``KEY_TYPES``),
    else raises CheckpointError naming the file and the key. ``version`` is its format version."""

    def __init__(self, path: Path, data: dict):
        self.path, self._data = Path(path), data
        self.version = data.get("format_version", 0)

    def __getitem__(self, key: str) -> Any:
        if key not in self._data:
            raise CheckpointError(f"checkpoint {self.path} has no {key!r} entry (format version {self.version}); "
                                  "it was not written by this trainer, or is damaged")
        value = self._data[key]
        types = KEY_TYPES.get(key)
        if types and not isinstance(value, types):
            raise CheckpointError(f"checkpoint {self.path}: {key!r} is a {type(value).__name__}, expected "
                                  f"{' or '.join(t.__name__ for t in types)}")
        return _with_defaults(value, ADDED_DEFAULTS[key]) if key in ADDED_DEFAULTS else value

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self._data else default

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


def pack(state: dict, run_info: dict) -> dict:
    """The dict to save: a TrainState's entries (model ... wandb_run_id, rng, sampler, world_size)
    plus ``run_info`` (config, model_args, data_meta, attn_backend), version and torch version."""
    return {"format_version": FORMAT_VERSION, **state, **run_info, "torch_version": str(torch.__version__)}


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


def _named(run_dir: Path, files: bool) -> list[Path]:
    """Entries of a run's checkpoints folder named like a checkpoint, oldest step first: the regular files, or with
    files=False the rest."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name)) and p.is_file() == files]
    return [p for _, p in sorted(found)]


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoint files of a run, oldest step first (temporary files excluded)."""
    return _named(run_dir, files=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def newest_checkpoint(run_dir: Path, instead: str) -> Path | None:
    """``latest_checkpoint``, or UnreadableCheckpoint when an entry named like a later checkpoint is not a file (a
    folder, a broken link): the latest file would silently stand for a run that went further. ``instead``: the
    caller's way round it, appended to the message."""
    path = latest_checkpoint(run_dir)
    newer = [p for p in not_files(run_dir) if path is None or step_of(p) > step_of(path)]
    if newer:
        kind = "a folder" if newer[-1].is_dir() else "not a file (a broken link?)"
        raise UnreadableCheckpoint(f"checkpoint {newer[-1]} is {kind}; it was left as is: move it out of the "
                                   f"checkpoints folder to use the one before, {instead}")
    return path


def not_files(run_dir: Path) -> list[Path]:
    """Entries of a run's checkpoints folder named like a checkpoint that are not regular files (a folder, a broken
    link), oldest step first: `list_checkpoints` leaves them out."""
    return _named(run_dir, files=False)


def remove_orphans(run_dir: Path) -> list[Path]:
    """Delete ``step_*.pt.tmp-<pid>`` files of writers that died mid-save (e.g. ``kill -9``), with a warning."""
    removed = remove_stale_temp_files(checkpoint_dir(run_dir), "step_*.pt")
    if removed:
        log.warning("removed %d unfinished checkpoint file(s) of a killed earlier save: %s",
                    len(removed), ", ".join(str(p) for p in removed))
    return removed


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


def check_weights(ckpt: Checkpoint, model: torch.nn.Module) -> None:
    """Raise UnreadableCheckpoint when ``ckpt``'s model weights do not fit ``model`` (a missing or unexpected key,
    or a tensor of another shape): a file edited by hand or written by other code, which load_state_dict would
    refuse with a traceback. ``model`` may live on the meta device: only keys and shapes are compared."""
    weights = clean_state_dict(ckpt["model"])
    expected = model.state_dict()
    shape = lambda t: tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__  # noqa: E731
    problems = [f"missing {k}" for k in expected if k not in weights]
    problems += [f"unexpected {k}" for k in weights if k not in expected]
    problems += [f"{k} is {shape(weights[k])}, the model's {shape(t)}" for k, t in expected.items()
                 if k in weights and shape(weights[k]) != shape(t)]
    if problems:
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise UnreadableCheckpoint(f"checkpoint {ckpt.path} is corrupt or unreadable: its weights do not fit the "
                                   f"model its model_args describe ({'; '.join(problems[:3])}{more})")


def save_checkpoint(state: dict, run_dir: Path, step: int, keep_last: int) -> Path:
    """Atomically write ``state`` as the checkpoint of ``step``, then keep only the newest
    ``keep_last`` checkpoints. Returns the path. A failed write raises CheckpointWriteError (an
    OSError) naming the path and the cause; the temporary file is removed, existing checkpoints
    are untouched and none is pruned."""
    path = checkpoint_path(run_dir, step)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: _save(state, f))
    except OSError as e:
        cause = f"[Errno {e.errno}] {e.strerror}" if e.strerror else str(e)
        try:
            older = "the older checkpoints are intact" if list_checkpoints(run_dir) else "no checkpoint was saved"
        except OSError:  # the folder cannot be read either
            older = "the older checkpoints were not touched"
        raise CheckpointWriteError(f"could not write checkpoint {path}: {cause}; {older}") from e
    for old in list_checkpoints(run_dir)[:-keep_last]:
        old.unlink(missing_ok=True)
    return path


class _KeepWriteError:
    """A file whose write errors are kept: torch.save reports a failed write as a RuntimeError without the
    cause ("unexpected pos ..."), so the OSError (disk full, file-size limit) is re-raised from here."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def _save(state: dict, f) -> None:
    out = _KeepWriteError(f)
    try:
        torch.save(state, out)
        f.flush()  # a failure of the last buffered bytes shows here
    except RuntimeError:
        if out.error is not None:
            raise out.error from None
        raise


def load_checkpoint(path: Path, keys: tuple[str, ...] = REQUIRED_KEYS) -> Checkpoint:
    """Load a checkpoint onto the CPU. Raises CheckpointError naming ``path`` if the file is missing
    or of a newer format than this code reads; UnreadableCheckpoint (a CheckpointError) if it is not a checkpoint
    (not a zip file torch.save writes, or a torch file without ``keys``: by default those training resumes from)
    or corrupt (truncated, or changed bytes: every record's CRC-32 in the zip file is checked, one extra read of
    the file)."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a folder; give a checkpoint file (e.g. "
                              f"<run folder>/checkpoints/step_00000100.pt), or resume a run by its run.name")
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} is not a regular file (a device, a pipe or a socket); give a "
                              "checkpoint file")
    state = _read(path)
    missing = [k for k in keys if not isinstance(state, dict) or k not in state]
    if missing:
        raise UnreadableCheckpoint(f"not a checkpoint file: {path} (a torch file, but not a trainer checkpoint: "
                              f"missing {', '.join(missing)})")
    ckpt = Checkpoint(path, state)
    if not isinstance(ckpt.version, int) or ckpt.version > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {ckpt.version!r}; this code reads up to "
                              f"{FORMAT_VERSION} (update the code)")
    return ckpt


ZIP_MAGIC = b"PK\x03\x04"  # the start of every file torch.save writes (a zip archive)


def _read(path: Path) -> Any:
    with open(path, "rb") as f:
        head = f.read(len(ZIP_MAGIC))
    if head and head != ZIP_MAGIC:  # random bytes, text, an old-style pickle: not even a cut-short checkpoint
        raise UnreadableCheckpoint(f"not a checkpoint file: {path} (not a file torch.save writes)")
    is_zip = zipfile.is_zipfile(path)
    if head and not is_zip:  # torch.load's own error for it is an unhelpful OSError (EINVAL)
        raise UnreadableCheckpoint(f"checkpoint {path} is corrupt or unreadable (cut short or damaged: its zip "
                                   "archive has no end record)")
    try:
        if is_zip:  # torch.load does not check the records' CRC-32: a flipped byte would load
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
            if bad is not None:
                raise zipfile.BadZipFile(f"record {bad} fails its CRC-32 check")
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for truncated / foreign files
        if isinstance(e, pickle.UnpicklingError) and "Weights only load failed" in str(e) and is_zip:
            raise UnreadableCheckpoint(f"not a checkpoint file: {path} (a torch file holding Python objects, "
                                       "not a trainer checkpoint)") from None
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else "the file ends early: empty or cut short"
        raise UnreadableCheckpoint(f"checkpoint {path} is corrupt or unreadable ({type(e).__name__}: {first_line})"
                                   ) from None
