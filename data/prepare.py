"""Token cache: documents -> token ids -> ``train.bin`` / ``val.bin`` memmaps + ``meta.json``.

Layout, one folder per (source, tokenizer, split) under ``data.cache_dir``::

    cache/<data.name>-<tokenizer>-<hash>/train.bin   flat token ids (uint16 if vocab < 65536 else uint32)
                                         val.bin     the last ``val_fraction`` of the token stream
                                         train_docs.bin, val_docs.bin  int64 offsets in train.bin /
                                                     val.bin where a document starts (0 first; val.bin
                                                     may start inside one), for data.document_mask;
                                                     a cache written before them is rebuilt only when
                                                     data.document_mask asks for them
                                         meta.json   vocab size, tokenizer, source, dtype, token counts

Prepared once, on first use, then reused; the folder name hashes everything the tokens depend on.
Every file is written to a temporary name, flushed, fsynced and renamed (``os.replace``), and
meta.json is written last, so a folder with a meta.json is complete and a crash leaves no half file.
Documents are concatenated (BPE: separated by the tokenizer's EOT token), as in nanoGPT's prepare.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
from tqdm.auto import tqdm

from data.sources import DataError, load_documents, source_identity
from data.tokenizers import CharTokenizer, TiktokenTokenizer, Tokenizer, tokenizer_from_meta

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


def prepare_data(cfg) -> PreparedData:
    """Return the token cache for data config ``cfg``, building it first if it is missing."""
    folder = cache_folder(cfg)
    meta_path = folder / "meta.json"
    if meta_path.exists():
        try:
            data = load_prepared(folder)
            if data.train_docs is not None or not cfg.get("document_mask"):
                return data
            log.warning("token cache %s has no document starts (written before they were recorded), which "
                        "data.document_mask needs; rebuilding it", folder)
        except (ValueError, OSError, KeyError) as e:  # a derived cache: rebuild rather than fail
            log.warning("token cache %s is unusable (%s); rebuilding it", folder, e)
    log.info("preparing token cache %s (first use of this data config)", folder)
    _build(cfg, folder)
    return load_prepared(folder)


def load_prepared(folder: Path) -> PreparedData:
    folder = Path(folder)
    meta = json.loads((folder / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"])
    arrays = {}
    files = [("train", meta["train_tokens"], dtype), ("val", meta["val_tokens"], dtype)]
    if "train_docs" in meta:
        files += [("train_docs", meta["train_docs"], np.dtype(np.int64)),
                  ("val_docs", meta["val_docs"], np.dtype(np.int64))]
    for name, n, item in files:
        path = folder / f"{name}.bin"
        expected = n * item.itemsize
        if not path.exists() or path.stat().st_size != expected:
            raise ValueError(f"{path} is missing or has the wrong size (expected {expected} bytes)")
        arrays[name] = np.memmap(path, dtype=item, mode="r")
    return PreparedData(folder, meta, arrays["train"], arrays["val"], tokenizer_from_meta(meta),
                        arrays.get("train_docs"), arrays.get("val_docs"))


class _Encode:
    """datasets.map function: texts -> token ids (+ EOT after each document for BPE)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, batch: dict) -> dict:
        tok = self.tokenizer
        if isinstance(tok, TiktokenTokenizer):
            ids = [x + [tok.eot_token] for x in tok.encode_batch(batch["text"])]
        else:
            ids = [tok.encode(t) for t in batch["text"]]
        return {"ids": ids, "len": [len(x) for x in ids]}


def _build_tokenizer(cfg, docs) -> Tokenizer:
    if cfg.tokenizer == "char":
        return CharTokenizer.from_texts(tqdm(docs["text"], desc="collecting characters", unit="doc"))
    if cfg.tokenizer == "tiktoken":
        return TiktokenTokenizer(cfg.encoding)
    raise DataError(f"data.tokenizer={cfg.tokenizer!r} is not known; accepted: {', '.join(TOKENIZERS)}")


def _build(cfg, folder: Path) -> None:
    texts = load_documents(cfg)
    tokenizer = _build_tokenizer(cfg, texts)
    # Small corpora are tokenized in memory (no extra copy in the datasets cache); large ones on disk.
    tokens = texts.map(_Encode(tokenizer), batched=True, remove_columns=texts.column_names,
                       num_proc=cfg.num_proc, desc="tokenizing", keep_in_memory=texts.data.nbytes < 2**29)
    total = int(np.sum(tokens["len"], dtype=np.int64))
    n_val = int(total * cfg.val_fraction)
    n_train = total - n_val
    if n_train <= 0 or n_val <= 0:
        raise DataError(f"data {cfg.name!r} has {total} tokens: too few for a train/val split with "
                         f"data.val_fraction={cfg.val_fraction}")
    dtype = token_dtype(tokenizer.vocab_size)
    # Where each document starts in the stream, then in each split (val.bin starts at 0, maybe mid-document).
    starts = np.concatenate([[0], np.cumsum(np.asarray(tokens["len"], dtype=np.int64))[:-1]])
    starts = starts[np.asarray(tokens["len"]) > 0]
    docs = {"train": starts[starts < n_train],
            "val": np.union1d([0], starts[starts >= n_train] - n_train).astype(np.int64)}

    folder.mkdir(parents=True, exist_ok=True)
    suffix = f".tmp-{os.getpid()}"
    tmp = {s: folder / f"{s}.bin{suffix}" for s in ("train", "val", "train_docs", "val_docs")}
    try:
        for s in ("train", "val"):
            docs[s].tofile(tmp[f"{s}_docs"])
        out = {s: np.memmap(tmp[s], dtype=dtype, mode="w+", shape=(n,)) for s, n in (("train", n_train), ("val", n_val))}
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
        for s in tmp:
            _fsync(tmp[s])
            os.replace(tmp[s], folder / f"{s}.bin")
        meta = {
            "version": PREP_VERSION, "name": cfg.name, "source": source_identity(cfg), **tokenizer.meta(),
            "dtype": dtype.name, "train_tokens": n_train, "val_tokens": n_val, "documents": len(texts),
            "train_docs": len(docs["train"]), "val_docs": len(docs["val"]), "val_fraction": cfg.val_fraction,
        }
        write_text_atomic(folder / "meta.json", json.dumps(meta, indent=1))
    finally:
        for p in tmp.values():
            p.unlink(missing_ok=True)
    log.info("token cache ready: %s (%d train / %d val tokens, vocab %d)", folder, n_train, n_val, tokenizer.vocab_size)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file + fsync + os.replace."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
