"""Token cache: documents -> token ids -> ``train.bin`` / ``val.bin`` memmaps + ``meta.json``.

Layout, one folder per (source, tokenizer, split) under ``data.cache_dir``::

    cache/<data.name>-<tokenizer>-<hash>/train.bin   flat token ids (uint16 if vocab < 65536 else uint32)
                                         val.bin     the last ``val_fraction`` of the token stream
                                         train_docs.bin, val_docs.bin  int64 offsets in train.bin /
                                                     val.bin where a document starts (0 first; val.bin
                                                     may start inside one), for data.document_mask;
                                                     a cache written before them is rebuilt only when
                                                     data.document_mask asks for them
                                         meta.json   vocab size, tokenizer, source, dtype, token counts,
                                                     each .bin's size, mtime and sha256

Prepared once, on first use, then reused; the folder name hashes everything the tokens depend on.
Every file is written to a temporary name (``<name>.tmp-<pid>``), flushed, fsynced and renamed
(``os.replace``), and meta.json is written last, so a folder with a meta.json is complete. Ctrl-C or
SIGTERM during a build removes its temporary files (``PreparationInterrupted``); those of a killed
process are removed at the next start. A meta.json that fails validation, or a .bin whose size or
checksum differs from it, means the cache is rebuilt (the checksum is only read when the file's
mtime changed, so a large cache is not re-read at every start).
Documents are concatenated (BPE: separated by the tokenizer's EOT token), as in nanoGPT's prepare.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
from tqdm.auto import tqdm

from data.sources import DataError, derived_fingerprint, load_documents, source_identity
from data.tokenizers import CharTokenizer, TiktokenTokenizer, Tokenizer, tokenizer_from_meta
from utils.atomic import atomic_path, atomic_write_text, remove_stale_temp_files

log = logging.getLogger(__name__)

PREP_VERSION = 1  # bump when the on-disk format or the text cleaning changes (not for added files: see above)
TOKENIZERS = ("char", "tiktoken")


@dataclass
class PreparedData:
    dir: Path
    meta: dict
    train: np.memmap     # 1-D token ids
    val: np.memmap
    tokenizer: Tokenizer
    train_docs: Optional[np.ndarray] = None  # int64 offsets in train where a document starts, ascending, from 0
    val_docs: Optional[np.ndarray] = None     # (None: a cache from before they were recorded)

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size < 2**16 else np.dtype(np.uint32)


def cache_folder(cfg) -> Path:
    """The cache folder for data config ``cfg`` (its name hashes source, tokenizer and split)."""
    tok = "char" if cfg.tokenizer == "char" else f"tiktoken:{cfg.encoding}"
    key = {"version": PREP_VERSION, "source": source_identity(cfg), "tokenizer": tok, "val_fraction": cfg.val_fraction}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return Path(cfg.cache_dir) / f"{cfg.name}-{tok.replace(':', '-')}-{digest}"


class PreparationInterrupted(Exception):
    """Ctrl-C or SIGTERM while the token cache was built: its temporary files were removed."""

    def __init__(self, folder: Path, signum: int):
        self.signum = signum
        super().__init__(f"data preparation interrupted by {signal.Signals(signum).name}: nothing was kept in "
                         f"{folder}; the next start prepares it again")


class _Terminated(BaseException):
    """SIGTERM turned into an exception, so cleanup runs (BaseException: no `except Exception` swallows it)."""

    def __init__(self, signum: int):
        self.signum = signum


@contextlib.contextmanager
def _sigterm_raises():
    if threading.current_thread() is not threading.main_thread():  # signal handlers: main thread only
        yield
        return

    def handler(signum, frame):
        raise _Terminated(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def prepare_data(cfg) -> PreparedData:
    """Return the token cache for data config ``cfg``, building it first if it is missing or unusable."""
    folder = cache_folder(cfg)
    for path in remove_stale_temp_files(folder):
        log.info("removed %s, left by a process that was stopped while writing it", path)
    meta_path = folder / "meta.json"
    reason = "first use of this data config"
    if meta_path.is_dir():  # not something the cache wrote, so not removed here
        raise DataError(f"data.cache_dir={cfg.cache_dir!r}: {meta_path} is a folder where the token cache keeps its "
                        "meta.json file; remove it (the cache is then rebuilt) or choose another data.cache_dir")
    if meta_path.exists():
        reason = "rebuilding it"
        try:
            data = load_prepared(folder)
            if data.train_docs is not None or not cfg.get("document_mask"):
                return data
            log.warning("token cache %s has no document starts (written before they were recorded), which "
                        "data.document_mask needs; rebuilding it", folder)
        except (ValueError, OSError, KeyError) as e:  # a derived cache: rebuild rather than fail
            log.warning("token cache %s is unusable (%s); rebuilding it", folder, e)
        meta_path.unlink(missing_ok=True)  # the folder counts as incomplete until the rebuild writes a new one
    log.info("preparing token cache %s (%s)", folder, reason)
    created = not folder.exists()
    try:
        with _sigterm_raises():
            _build(cfg, folder)
    except BaseException as e:  # the temporary files are gone; an interrupt becomes one line
        if created:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if empty
        if isinstance(e, (KeyboardInterrupt, _Terminated)):
            raise PreparationInterrupted(folder, getattr(e, "signum", signal.SIGINT)) from None
        raise
    return load_prepared(folder)


def load_prepared(folder: Path) -> PreparedData:
    """Open a built cache; ValueError naming the field or file if it is unusable."""
    folder = Path(folder)
    meta = json.loads((folder / "meta.json").read_text())
    check_meta(meta)
    arrays = {}
    for name, item in _bin_files(meta).items():
        path = folder / f"{name}.bin"
        expected = meta["files"][path.name]
        st = path.stat()
        if st.st_size != expected["size"]:
            raise ValueError(f"{path} has {st.st_size} bytes, meta.json says {expected['size']}")
        if st.st_mtime_ns != expected["mtime_ns"] and file_sha256(path) != expected["sha256"]:
            raise ValueError(f"{path} changed since it was written (its sha256 differs from meta.json's)")
        arrays[name] = np.memmap(path, dtype=item, mode="r")
    return PreparedData(folder, meta, arrays["train"], arrays["val"], tokenizer_from_meta(meta),
                        arrays.get("train_docs"), arrays.get("val_docs"))


def _bin_files(meta: dict) -> dict[str, np.dtype]:
    """The cache's .bin files (name without .bin -> item dtype); the document starts only if recorded."""
    files = {"train": np.dtype(meta["dtype"]), "val": np.dtype(meta["dtype"])}
    if "train_docs" in meta or "val_docs" in meta:
        files.update(train_docs=np.dtype(np.int64), val_docs=np.dtype(np.int64))
    return files


def check_meta(meta) -> None:
    """Validate every field of a meta.json that loading relies on; ValueError names the first bad one."""
    def need(ok: bool, field: str, accepted: str) -> None:
        if not ok:
            raise ValueError(f"meta.json field {field!r} = {meta.get(field) if isinstance(meta, dict) else meta!r}: "
                             f"expected {accepted}")

    def count(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 1

    need(isinstance(meta, dict), "<root>", "a JSON object")
    need(meta.get("version") == PREP_VERSION, "version", str(PREP_VERSION))
    need(isinstance(meta.get("name"), str), "name", "the data.name string")
    need(isinstance(meta.get("source"), dict), "source", "an object describing the source")
    need(isinstance(meta.get("documents"), int) and meta["documents"] >= 0, "documents", "an integer >= 0")
    need(isinstance(meta.get("val_fraction"), float) and 0 < meta["val_fraction"] < 1, "val_fraction",
         "a number in (0, 1)")
    need(meta.get("tokenizer") in TOKENIZERS, "tokenizer", " or ".join(TOKENIZERS))
    need(count(meta.get("vocab_size")), "vocab_size", "a positive integer")
    if meta["tokenizer"] == "char":
        chars = meta.get("chars")
        need(isinstance(chars, str) and len(chars) == meta["vocab_size"], "chars", "a string of vocab_size characters")
    else:
        need(isinstance(meta.get("encoding"), str), "encoding", "a tiktoken encoding name")
    dtype = token_dtype(meta["vocab_size"])
    need(meta.get("dtype") == dtype.name, "dtype", f"{dtype.name!r} for vocab_size {meta['vocab_size']}")
    for name, item in _bin_files(meta).items():
        counted = f"{name}_tokens" if name in ("train", "val") else name  # train_docs / val_docs: a count
        need(count(meta.get(counted)), counted, "a positive integer")
        info = meta.get("files", {}).get(f"{name}.bin") if isinstance(meta.get("files"), dict) else None
        need(isinstance(info, dict) and info.get("size") == meta[counted] * item.itemsize
             and isinstance(info.get("mtime_ns"), int) and isinstance(info.get("sha256"), str),
             "files", f"{{'{name}.bin': {{size: {counted} * itemsize, mtime_ns, sha256}}, ...}}")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


class _Encode:
    """datasets.map function: texts -> token ids (+ EOT after each document for BPE)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, batch: dict) -> dict:
        tok = self.tokenizer
        texts = [t or "" for t in batch["text"]]  # null rows of a hub dataset: empty documents
        if isinstance(tok, TiktokenTokenizer):
            ids = [x + [tok.eot_token] for x in tok.encode_batch(texts)]
        else:
            ids = [tok.encode(t) for t in texts]
        return {"ids": ids, "len": [len(x) for x in ids]}


def _too_few(cfg, total: int) -> DataError:
    return DataError(f"data {cfg.name!r} has {total} tokens: too few for a train/val split with "
                     f"data.val_fraction={cfg.val_fraction}")


def _build_tokenizer(cfg, docs) -> Tokenizer:
    if cfg.tokenizer == "char":
        chars = CharTokenizer.collect(tqdm(docs["text"], desc="collecting characters", unit="doc"))
        if not chars:  # empty files: no vocabulary at all
            raise _too_few(cfg, 0)
        return CharTokenizer(chars)
    if cfg.tokenizer == "tiktoken":
        return TiktokenTokenizer(cfg.encoding)
    raise DataError(f"data.tokenizer={cfg.tokenizer!r} is not known; accepted: {', '.join(TOKENIZERS)}")


def _allocate(path: Path, size: int) -> None:
    """Give `path` its `size` bytes on disk before it is written through a memmap: a full disk is then an OSError
    (ENOSPC) here, where writing into a sparse file's holes would kill the process with SIGBUS."""
    with open(path, "r+b") as f:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(f.fileno(), 0, size)
        else:  # no preallocation on this platform (macOS): a sparse file
            f.truncate(size)


def _cannot_write(cfg, folder: Path, e: OSError) -> DataError:
    return DataError(f"data.cache_dir={cfg.cache_dir!r}: cannot write the token cache {folder} "
                     f"({e.strerror or e}); choose a writable data.cache_dir with free space")


def _build(cfg, folder: Path) -> None:
    try:  # an unwritable data.cache_dir fails now, not after the corpus is read and tokenized
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise _cannot_write(cfg, folder, e) from e
    texts = load_documents(cfg)
    tokenizer = _build_tokenizer(cfg, texts)
    # Small corpora are tokenized in memory (no extra copy in the datasets cache); large ones on disk.
    tokens = texts.map(_Encode(tokenizer), batched=True, remove_columns=texts.column_names,
                       num_proc=cfg.num_proc, desc="tokenizing", keep_in_memory=texts.data.nbytes < 2**29,
                       new_fingerprint=derived_fingerprint(texts, json.dumps(tokenizer.meta(), sort_keys=True)))
    total = int(np.sum(tokens["len"], dtype=np.int64))
    n_val = int(total * cfg.val_fraction)
    n_train = total - n_val
    if total >= 2 and n_val <= 0:  # a single token cannot be split whatever the fraction
        raise DataError(f"data.val_fraction={cfg.val_fraction} gives 0 validation tokens of the {total} tokens of "
                        f"data {cfg.name!r}: too few for a validation split; raise data.val_fraction or add data")
    if n_train <= 0 or n_val <= 0:
        raise _too_few(cfg, total)
    dtype = token_dtype(tokenizer.vocab_size)
    # Where each document starts in the stream, then in each split (val.bin starts at 0, maybe mid-document).
    starts = np.concatenate([[0], np.cumsum(np.asarray(tokens["len"], dtype=np.int64))[:-1]])
    starts = starts[np.asarray(tokens["len"]) > 0]
    docs = {"train": starts[starts < n_train],
            "val": np.union1d([0], starts[starts >= n_train] - n_train).astype(np.int64)}

    try:  # the folder exists: made at the start
        names = ("train", "val", "train_docs", "val_docs")
        with contextlib.ExitStack() as stack:  # the files are renamed only if all were written
            tmp = {s: stack.enter_context(atomic_path(folder / f"{s}.bin")) for s in names}
            for s in ("train", "val"):
                docs[s].tofile(tmp[f"{s}_docs"])
            for s, n in (("train", n_train), ("val", n_val)):
                _allocate(tmp[s], n * dtype.itemsize)
            out = {s: np.memmap(tmp[s], dtype=dtype, mode="r+", shape=(n,)) for s, n in (("train", n_train), ("val", n_val))}
            pos = 0
            with tqdm(total=total, desc=f"writing {folder.name}", unit="tok", unit_scale=True) as bar:
                for batch in tokens.iter(batch_size=1024):
                    ids = np.concatenate([np.asarray(x, dtype=dtype) for x in batch["ids"]]) if batch["ids"] else np.empty(0, dtype)
                    # The stream's first n_train tokens go to train.bin, the rest to val.bin.
                    a = ids[: max(0, n_train - pos)]
                    b = ids[len(a):]
                    if len(a):
                        out["train"][pos: pos + len(a)] = a
                    if len(b):
                        start = pos + len(a) - n_train
                        out["val"][start: start + len(b)] = b
                    pos += len(ids)
                    bar.update(len(ids))
            for arr in out.values():
                arr.flush()
            out.clear()  # drop the memmaps before the files are synced and renamed
        files = {}
        for s in names:  # os.replace kept each file's mtime
            path = folder / f"{s}.bin"
            st = path.stat()
            files[path.name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": file_sha256(path)}
        meta = {
            "version": PREP_VERSION, "name": cfg.name, "source": source_identity(cfg), **tokenizer.meta(),
            "dtype": dtype.name, "train_tokens": n_train, "val_tokens": n_val, "documents": len(texts),
            "train_docs": len(docs["train"]), "val_docs": len(docs["val"]), "val_fraction": cfg.val_fraction,
            "files": files,
        }
        atomic_write_text(folder / "meta.json", json.dumps(meta, indent=1))  # last: a folder with meta.json is complete
    except OSError as e:  # a full data.cache_dir; the temporary files are gone
        raise _cannot_write(cfg, folder, e) from e
    log.info("token cache ready: %s (%d train / %d val tokens, vocab %d)", folder, n_train, n_val, tokenizer.vocab_size)
