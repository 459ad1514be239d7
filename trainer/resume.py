"""The ``resume`` policy (auto / never / <path>) and the checks a checkpoint must pass to be resumed."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf

from model.gpt import GPT, GPTConfig
from model.layers import mlp_width
from model.loss import resolve_loss
from trainer.checkpoint import (Checkpoint, CheckpointError, UnreadableCheckpoint, check_weights, checkpoint_dir,
                                list_checkpoints, load_checkpoint, newest_checkpoint, step_of)
from trainer.config import ConfigError

log = logging.getLogger(__name__)

# Config keys a resumed run may change without a warning (run length, bookkeeping, where it writes).
MAY_CHANGE = frozenset({"trainer.max_steps", "resume", "run.name", "run.root", "ckpt.interval", "ckpt.keep_last",
                        "wandb.mode", "wandb.project", "wandb.group", "wandb.tags", "trainer.dist_timeout_s",
                        "eval.interval", "eval.iters", "data.cache_dir", "data.num_proc"})


def refusal(resume: str, run_dir: Path) -> Optional[str]:
    """Why the ``resume`` setting refuses ``run_dir`` from its file names alone (None if it does not):
    resume=never on a folder with checkpoints, or resume=<step_N.pt> into a folder with newer ones.
    Cheap (no file is read), so train.py asks before it locks or writes anything in the folder."""
    existing = list_checkpoints(run_dir)
    if resume == "never" and existing:
        return (f"resume=never: run folder {run_dir} already has checkpoints ({existing[-1].name}); "
                "use a new run.name, or resume=auto to continue it")
    if resume not in ("never", "auto"):
        try:
            step = step_of(Path(resume))
        except ValueError:
            return None
        return _newer_refusal(Path(resume), step, existing, run_dir)
    return None


def _newer_refusal(path: Path, step: int, existing: list[Path], run_dir: Path) -> Optional[str]:
    """Why resuming ``path`` (at ``step``) into ``run_dir`` would mix two runs there: the folder's own later
    checkpoints, or, for a checkpoint from elsewhere (a branch), any of another run's."""
    own = path.resolve().parent == checkpoint_dir(run_dir).resolve()
    others = [p for p in existing if p.resolve() != path.resolve() and (not own or step_of(p) > step)]
    if not others:
        return None
    if own:
        return (f"resume={path}: run folder {run_dir} has newer checkpoints ({others[-1].name}) that "
                "resuming an older step would mix with; use a new run.name")
    return (f"resume={path}: run folder {run_dir} holds another run's checkpoints ({others[-1].name}) that a "
            "branch from this checkpoint would mix with; use a new run.name")


def find_checkpoint(resume: str, run_dir: Path) -> tuple[Optional[Checkpoint], Optional[Path]]:
    """Apply the ``resume`` policy: auto (latest in the run folder, if any), never, or a file path.
    Returns (checkpoint, path) or (None, None). Raises ConfigError or CheckpointError."""
    reason = refusal(resume, run_dir)
    if reason:
        raise ConfigError(reason)
    if resume == "never":
        return None, None
    if resume == "auto":
        path = newest_checkpoint(run_dir, "or start a new run.name")
        return (_load(path), path) if path is not None else (None, None)
    path = Path(resume)
    if not path.exists():  # also a mistyped policy, e.g. resume=sometimes
        raise CheckpointError(f"checkpoint {path} does not exist (resume= takes auto, never or a checkpoint path)")
    ckpt = _load(path)
    reason = _newer_refusal(path, ckpt["step"], list_checkpoints(run_dir), run_dir)  # files named otherwise
    if reason:
        raise ConfigError(reason)
    return ckpt, path


def _load(path: Path) -> Checkpoint:
    """``load_checkpoint``; an unreadable file in a run's checkpoints folder gets the ways to resume without it."""
    try:
        return load_checkpoint(path)
    except UnreadableCheckpoint as e:
        if path.parent.name != "checkpoints":
            raise
        try:
            step = step_of(path)
        except ValueError:  # resume=<a file not named step_N.pt>: every other checkpoint of the run is a way out
            step = None
        older = [p for p in list_checkpoints(path.parent.parent)
                 if p.resolve() != path.resolve() and (step is None or step_of(p) < step)]
        if not older:  # nothing to fall back to in this run
            raise UnreadableCheckpoint(f"{e}; it was left as is, and it is this run's only checkpoint: start a new "
                                       "run.name, or move it out of the checkpoints folder to train this run again "
                                       "from step 0") from None
        raise UnreadableCheckpoint(f"{e}; it was left as is: move it out of the checkpoints folder to resume from "
                                   f"the one before ({older[-1].name}), or start a new run.name (resume=<path> of an "
                                   "older checkpoint works there too)") from None


# GPTConfig fields that do not shape the weights: a change is a warning (the config diff lists it), not a refusal.
NOT_SHAPE = ("attn", "dropout", "loss", "attn_softcap")


def model_identity(model_args: dict) -> dict:
    """The GPTConfig fields (``dataclasses.asdict``) that make the model what it is: those of NOT_SHAPE left out,
    the MLP's hidden width in place of the settings it derives from (``mlp_hidden``, ``multiple_of``),
    ``rope_theta`` only with RoPE, a per-layer ``attn_window`` list of one value as that value, and ``n_kv_head``
    null as n_head (the model it builds). A change of any of these changes the weights' shapes or the function."""
    args = {**dataclasses.asdict(GPTConfig()), **model_args}  # a checkpoint from before a field existed: its default
    identity = {k: v for k, v in args.items() if k not in NOT_SHAPE + ("mlp_hidden", "multiple_of")}
    identity["mlp_width"] = mlp_width(args["n_embd"], args["mlp"], args["mlp_hidden"], args["multiple_of"])
    window = args["attn_window"]  # one per layer, all equal: the same model as that one value
    if isinstance(window, (list, tuple)) and len(set(window)) == 1 and len(window) == args["n_layer"]:
        identity["attn_window"] = window[0]
    if identity["n_kv_head"] is None:
        identity["n_kv_head"] = args["n_head"]
    if args["pos_emb"] != "rope":
        del identity["rope_theta"]
    return identity


def check_compatible(ckpt: Checkpoint, model_args: GPTConfig, data_meta: dict, cfg: DictConfig,
                     device_type: str = "cpu") -> None:
    """Refuse (ConfigError) a checkpoint of another model shape, attention window or tokenizer, and
    (UnreadableCheckpoint, ``check_weights``) one whose weights do not fit the model its model_args give; warn,
    listing the keys, when other settings changed (e.g. the attention backend or model.dropout), as a resumed run
    then mixes two setups; warn when the token cache holds other tokens than the checkpoint's (``changed_data``).
    model.loss is compared as it runs on `device_type` (``resolve_loss``): full and auto are the same on a CPU."""
    old, new = model_identity(ckpt["model_args"]), model_identity(dataclasses.asdict(model_args))
    mlp = "the MLP's hidden width (model.mlp_hidden, or model.mlp's rule)"
    name = lambda k: mlp if k == "mlp_width" else f"model.{k}"
    diffs = [f"{name(k)}: checkpoint {old.get(k)!r}, config {new[k]!r}" for k in new if old.get(k) != new[k]]
    old_meta = ckpt["data_meta"]
    for k in ("tokenizer", "encoding", "chars", "vocab_size"):
        if old_meta.get(k) != data_meta.get(k):
            label = "data tokenizer" if k == "tokenizer" else f"data tokenizer {k}"
            diffs.append(f"{label}: checkpoint {old_meta.get(k)!r}, config {data_meta.get(k)!r}")
    if diffs:
        raise ConfigError(f"cannot resume from {ckpt.path}: the model or tokenizer differs:\n  " + "\n  ".join(diffs))
    with torch.device("meta"):  # shapes only
        check_weights(ckpt, GPT(model_args))
    # attn.backend as typed ("auto") may name the backend that ran before: the backends that run are compared
    changed = changed_settings(ckpt["config"], OmegaConf.to_container(cfg, resolve=True),
                               skip=MAY_CHANGE | {"attn.backend", "model.loss"})
    if ckpt["attn_backend"] != model_args.attn:
        changed.append(f"attention backend (resolved): {ckpt['attn_backend']} -> {model_args.attn}")
    old_loss = resolve_loss(ckpt["model_args"].get("loss", "full"), device_type)  # full: before the key existed
    new_loss = resolve_loss(model_args.loss, device_type)
    if old_loss != new_loss:
        changed.append(f"model.loss (as it runs here): {old_loss} -> {new_loss}")
    if changed:
        log.warning("resuming %s with changed settings (the run mixes both):\n  %s", ckpt.path, "\n  ".join(changed))
    data = changed_data(old_meta, data_meta)
    if data:
        log.warning("resuming %s on other data than it was trained on: the val split is other text now (the old "
                    "val text may lie in the train split), so val losses before and after do not compare:\n  %s",
                    ckpt.path, "\n  ".join(data))


def changed_data(old: dict, new: dict) -> list[str]:
    """'train.bin: <tokens> tokens, sha256 <hex> -> ...' for each split whose token count or sha256 differs
    between two token caches' meta.json (a checkpoint's ``data_meta`` and the cache now)."""
    out = []
    for split in ("train", "val"):
        a, b = (_split_id(meta, split) for meta in (old, new))
        if a != b:
            out.append(f"{split}.bin: {a[0]} tokens, sha256 {a[1]} -> {b[0]} tokens, sha256 {b[1]}")
    return out


def _split_id(meta: dict, split: str) -> tuple:
    files = meta.get("files") if isinstance(meta.get("files"), dict) else {}
    return meta.get(f"{split}_tokens"), (files.get(f"{split}.bin") or {}).get("sha256")


def changed_settings(old: dict, new: dict, prefix: str = "", skip: frozenset = MAY_CHANGE) -> list[str]:
    """'key: old -> new' for every differing leaf key outside `skip` (dotted keys)."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += changed_settings(a, b, f"{prefix}{k}.", skip)
        elif a != b and f"{prefix}{k}" not in skip:
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out
