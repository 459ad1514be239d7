"""What every attention backend shares: the ``Backend`` base class (its capabilities and its four call forms),
``BackendUnavailableError``, ``segment_ids`` and the capability look-ups that refusal messages use.

A leaf: it imports no other module of the project, so the backend modules and the table import it and nothing
imports in a circle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


class BackendUnavailableError(RuntimeError):
    """The requested attention backend cannot be loaded (e.g. the Triton kernels are missing)."""


def segment_ids(docs: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """(batch, seqlen) index of the segment of ``docs`` (int32 cu_seqlens of the flattened batch * seqlen tokens)
    that each token lies in, same dtype and device as docs; two tokens may attend to each other only if equal."""
    flat = torch.arange(batch * seqlen, device=docs.device, dtype=docs.dtype)
    return torch.searchsorted(docs, flat, right=True).view(batch, seqlen)


_TABLE: dict[str, "Backend"] = {}  # every concrete backend by name, in the order model.backends lists them


def register(*backends: "Backend") -> dict[str, "Backend"]:
    """Make ``backends`` the table (``model.backends.REGISTRY`` calls this once) and return it."""
    _TABLE.clear()
    _TABLE.update((b.name, b) for b in backends)
    return _TABLE


def backends_with(capability: str) -> list[str]:
    """The names of the backends whose ``capability`` (a ``Backend`` field, e.g. 'supports_window') is true."""
    return [b.name for b in _TABLE.values() if getattr(b, capability)]


def one_of(names: list[str], last: str = "or") -> str:
    """'a, b or c' (``last``: the word before the final name)."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {last} {names[-1]}"


@dataclass(frozen=True, eq=False, kw_only=True)
class Backend:
    """One attention backend: what the rest of the code asks about it, and its call forms.

    Every call form computes scaled-dot-product attention, o = softmax(q @ k^T * softmax_scale + mask) @ v with
    softmax_scale = 1/sqrt(head_dim), q (B, n_head, T_q, head_dim), k, v (B, n_kv_head, T_k, head_dim) (n_head a
    multiple of n_kv_head: grouped-query attention), o like q (shape and dtype; float32, float16 or bfloat16):
    - ``attention(q, k, v, dropout_p=0.0, causal=True, window=0, docs=None)``: training and evaluation (T_q = T_k).
      ``window`` > 0: each query sees itself and the window - 1 keys before it; ``docs``: int32 cu_seqlens over the
      flattened (B * T) batch, each token sees its own document only. Both imply causal.
    - ``qkvpacked_attention(qkv, n_head, dropout_p=0.0, window=0, docs=None)`` (``qkvpacked``): causal attention
      on the fused projection's output qkv (B, T, n_head + 2 * n_kv_head, head_dim) -> (B, T, n_head, head_dim)
      contiguous, ``window`` and ``docs`` as in ``attention``; its backward writes qkv's gradient in place instead
      of concatenating dq, dk, dv.
    - ``kv_attention(q, k, v, dropout_p=0.0, causal=True)``: new queries against a KV cache, T_q <= T_k, the causal
      mask aligned bottom-right (query i sees key j iff j <= i + T_k - T_q).
    - ``split_kv_attention`` (``split_kv``): the same, single-query calls through the split-K/V decode kernel.
    - ``static_kv_attention(q, k, v, seqlen)`` (``static_decode``): fixed shapes for CUDA graphs; k, v the whole
      cache buffers (B, n_kv_head, block_size, head_dim), seqlen a 0-dim integer tensor on the device: keys
      0 .. seqlen-1 are filled, query i sees keys j <= seqlen - T_q + i.

    Every call form also takes ``softcap`` (float, 0.0 = off; model.attn_softcap): > 0 caps each score
    s = softmax_scale * q.k to softcap * tanh(s / softcap) before the mask and the softmax (Gemma 2's attention logit
    soft-capping), on backends with ``supports_softcap``.
    A form the backend lacks, or a dropout / window / documents / softcap it cannot do, raises ValueError naming the
    backends that can. ``load()`` imports what the call forms need (raises BackendUnavailableError).
    """
    name: str
    description: str
    needs_cuda: bool = False
    supports_dropout: bool = False
    cpu_dropout: bool = True  # with supports_dropout: dropout works on the CPU too
    supports_window: bool = False  # window > 0 (model.attn_window)
    supports_docs: bool = False  # docs (data.document_mask)
    supports_softcap: bool = False  # softcap > 0 (model.attn_softcap), in every call form the backend has
    compiles_on_cpu: bool = True  # torch.compile (trainer.compile) can train the model on the CPU
    limits_head_dim: bool = False  # head_dim_limits() is a range (it imports the kernels' front end to read it)
    qkvpacked: bool = False  # has qkvpacked_attention
    split_kv: bool = False  # has split_kv_attention
    static_decode: bool = False  # has static_kv_attention (CUDA-graph decode)

    def __deepcopy__(self, memo: dict) -> "Backend":  # one object per backend: a copied model shares it
        return self

    def load(self) -> "Backend":
        """Import what the call forms need, once; the model calls it when it is built, so that nothing is imported
        while torch.compile traces a call. Returns self. Raises BackendUnavailableError."""
        return self

    def head_dim_limits(self) -> Optional[tuple[int, int]]:
        """(min, max) head_dim the backend accepts, or None for no limit."""
        return None

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                  causal: bool = True, window: int = 0, docs: Optional[torch.Tensor] = None,
                  softcap: float = 0.0) -> torch.Tensor:
        raise NotImplementedError

    def qkvpacked_attention(self, qkv: torch.Tensor, n_head: int, dropout_p: float = 0.0,
                            window: int = 0, softcap: float = 0.0, docs: Optional[torch.Tensor] = None) -> torch.Tensor:
        raise ValueError(f"attn={self.name} has no packed-qkv attention; "
                         f"use {one_of(backends_with('qkvpacked'))}")

    def kv_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                     causal: bool = True, softcap: float = 0.0) -> torch.Tensor:
        return self.attention(q, k, v, dropout_p, causal, softcap=softcap)

    def split_kv_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                           causal: bool = True, softcap: float = 0.0) -> torch.Tensor:
        raise ValueError(self.lacks("split_kv"))

    def static_kv_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            seqlen: torch.Tensor, softcap: float = 0.0) -> torch.Tensor:
        raise ValueError(self.lacks("static_decode"))

    def lacks(self, form: str) -> str:
        """The refusal message for a call form the backend lacks: 'split_kv' or 'static_decode'."""
        if form == "split_kv":
            return f"split_kv decode is for {one_of(backends_with('split_kv'), 'and')}; attn={self.name} has none"
        return (f"attn={self.name} has no static-shape decode (CUDA graphs); "
                f"use {one_of(backends_with('static_decode'))}")

    def refuse_dropout(self, dropout_p: float) -> None:
        if dropout_p > 0.0:
            anywhere = [f"attn={b.name}" for b in _TABLE.values()
                        if b.supports_dropout and b.cpu_dropout and not b.needs_cuda]
            raise ValueError(f"attn={self.name} has no attention dropout (got dropout_p={dropout_p}); "
                             f"use model.dropout=0.0 or {one_of(anywhere)}")

    def refuse_softcap(self, softcap: float) -> None:
        if softcap and not self.supports_softcap:
            raise ValueError(f"attn={self.name} has no attention logit soft-capping (softcap={softcap}: "
                             f"model.attn_softcap); use one of: {', '.join(backends_with('supports_softcap'))}")

    def warn_masks(self) -> None:
        """Called once by the trainer, outside any compiled region, when a window or documents are on: a backend
        whose masks cost far more than its unmasked attention warns here (a warning inside a compiled step would
        break its graph, so it is not given there)."""

    def refuse_masks(self, window: int, docs: Optional[torch.Tensor]) -> None:
        if window and not self.supports_window:
            raise ValueError(f"attn={self.name} has no sliding-window attention (a layer has a window of {window} "
                             f"tokens: model.attn_window); use one of: {', '.join(backends_with('supports_window'))}")
        if docs is not None and not self.supports_docs:
            raise ValueError(f"attn={self.name} has no document masks (data.document_mask); "
                             f"use one of: {', '.join(backends_with('supports_docs'))}")
