"""``attn=sdpa``, ``sdpa_flash``, ``sdpa_cudnn``: PyTorch's ``scaled_dot_product_attention``.

``sdpa`` lets PyTorch pick its flash / memory-efficient / math kernel and has every call form: windows and
documents as a dense boolean mask (correct, but off PyTorch's fast kernels; it warns once), the KV cache with the
causal mask aligned bottom-right, and a static-shape decode step (a mask over the whole cache). ``sdpa_flash`` /
``sdpa_cudnn`` pin PyTorch's FlashAttention-2 or cuDNN kernel (``torch.nn.attention.sdpa_kernel``), to compare
against a known kernel; they fail where PyTorch has no such kernel for the inputs (cuDNN: CUDA only).
None has logit soft-capping (softcap > 0 raises ValueError): SDPA takes an additive mask but no function of the
scores, so capping them means computing the (T_q, T_k) scores outside it, which is not SDPA any more.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from model.backends.base import Backend, segment_ids


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, causal: bool = True,
         window: int = 0, docs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SDPA, GQA through ``enable_gqa``; a window or documents as a dense mask (which is causal)."""
    mask = None if window == 0 and docs is None else dense_mask(q.shape[0], q.shape[2], window, docs, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          is_causal=causal and mask is None, enable_gqa=q.shape[1] != k.shape[1])


_WARNED_DENSE_MASK = []


def warn_dense_mask(stacklevel: int = 2) -> None:
    """Once per process: a window or documents make SDPA's mask dense, which is slow."""
    if _WARNED_DENSE_MASK:
        return
    _WARNED_DENSE_MASK.append(True)
    msg = ("attention through SDPA with model.attn_window or data.document_mask: a dense (T, T) mask, which takes "
           "SDPA off its fast kernels (slow; on a CUDA GPU attn=fa2 or fa3 skips the key blocks outside the window "
           "and the documents)")
    warnings.warn(msg, RuntimeWarning, stacklevel=stacklevel + 1)


def dense_mask(batch: int, seqlen: int, window: int, docs: Optional[torch.Tensor], device) -> torch.Tensor:
    """(batch or 1, 1, T, T) boolean mask, True = visible: key j for query i iff j <= i, i - window < j if
    window > 0 (the kernels' window_size=(window - 1, 0)), and i, j in one segment of docs if given."""
    if not torch.compiler.is_compiling():  # a warning would break the graph (the trainer warns before: warn_masks)
        warn_dense_mask(stacklevel=4)
    i = torch.arange(seqlen, device=device)[:, None]
    j = torch.arange(seqlen, device=device)[None, :]
    mask = (j <= i) & (j > i - window) if window else j <= i
    if docs is not None:
        segment = segment_ids(docs, batch, seqlen)
        mask = mask & (segment[:, :, None] == segment[:, None, :])
    return mask.view(-1, 1, seqlen, seqlen)


def sdpa_bottom_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                      causal: bool = True) -> torch.Tensor:
    """SDPA for T_q <= T_k new queries after a cached prefix: the causal mask aligned bottom-right."""
    Tq, Tk = q.shape[2], k.shape[2]
    if Tq == Tk or not causal:  # e.g. a prefill from position 0: top-left and bottom-right alignment agree
        return sdpa(q, k, v, dropout_p, causal)
    # SDPA's is_causal is aligned top-left (query i sees keys 0..i), wrong for new queries after a cached prefix.
    # One query (a decode step) sees every cached key: no mask, which also keeps SDPA's fastest kernels.
    mask = None if Tq == 1 else torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          enable_gqa=q.shape[1] != k.shape[1])


@dataclass(frozen=True, eq=False, kw_only=True)
class SdpaBackend(Backend):
    """``attn=sdpa``: every call form, dropout, windows and documents."""
    supports_dropout: bool = True
    supports_window: bool = True
    supports_docs: bool = True
    static_decode: bool = True

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                  causal: bool = True, window: int = 0, docs: Optional[torch.Tensor] = None,
                  softcap: float = 0.0) -> torch.Tensor:
        self.refuse_softcap(softcap)
        return sdpa(q, k, v, dropout_p, causal, window, docs)

    def warn_masks(self) -> None:
        warn_dense_mask()

    def kv_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                     causal: bool = True, softcap: float = 0.0) -> torch.Tensor:
        self.refuse_softcap(softcap)
        return sdpa_bottom_right(q, k, v, dropout_p, causal)

    def static_kv_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            seqlen: torch.Tensor, softcap: float = 0.0) -> torch.Tensor:
        self.refuse_softcap(softcap)
        Tq, Tk = q.shape[2], k.shape[2]
        if Tq == 1:  # a decode step: the keys 0 .. seqlen-1 (two kernels: a CUDA graph replays each one)
            mask = (torch.arange(Tk, device=q.device) < seqlen)[None, :]
        else:  # query i sits at position seqlen - Tq + i and sees the keys up to it; the rest of the buffer is masked
            last = seqlen - Tq + torch.arange(Tq, device=q.device)
            mask = torch.arange(Tk, device=q.device)[None, :] <= last[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


@dataclass(frozen=True, eq=False, kw_only=True)
class PinnedSdpaBackend(Backend):
    """SDPA pinned to one of PyTorch's kernels: dropout, no windows or documents, a KV cache where the kernel
    takes the bottom-right mask (PyTorch's flash kernel takes no mask: decode steps and prefills only)."""
    kernel: SDPBackend
    supports_dropout: bool = True

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                  causal: bool = True, window: int = 0, docs: Optional[torch.Tensor] = None,
                  softcap: float = 0.0) -> torch.Tensor:
        self.refuse_masks(window, docs)
        self.refuse_softcap(softcap)
        with sdpa_kernel(self.kernel):
            return sdpa(q, k, v, dropout_p, causal)

    def kv_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                     causal: bool = True, softcap: float = 0.0) -> torch.Tensor:
        self.refuse_softcap(softcap)
        with sdpa_kernel(self.kernel):
            return sdpa_bottom_right(q, k, v, dropout_p, causal)
