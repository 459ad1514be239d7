"""``attn=fa1``, ``fa2``, ``fa3``: the project's Triton / Gluon kernels (``kernels/``).

fa1 / fa2 are the Triton FlashAttention-1 / -2 kernels, fa3 the Gluon FlashAttention-3 kernels for Hopper (FA2's
where they do not apply). fa2 and fa3 do sliding windows in the kernel and skip the key blocks outside them; fa2
and fa3 do documents too (``fa*_varlen_attention``, and ``fa*_varlen_qkvpacked_attention`` on the fused qkv: the
batch as one packed sequence, each row seeing its own document). fa1 refuses both. All three take the fused qkv
(``fa*_qkvpacked_attention``); fa2 and fa3 decode through the split-K/V kernel ``fa2_decode`` (flash-decoding).
fa2 and fa3 have logit soft-capping (``softcap``) in every call form (fa3: in its Gluon kernels; decode through
``fa2_decode``); fa1 refuses it.
None has attention dropout (``dropout_p > 0`` raises ValueError; config validation refuses model.dropout > 0).

Without a CUDA GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set by ``model.backends``
before anything imports triton), which is very slow; loading them then warns once per backend.

Every use of ``kernels`` is in this module: the kernel functions each backend loads (``fa1_kernels``,
``fa2_kernels``, ``fa3_kernels``) and what config validation and ``attn=auto`` ask the kernels
(``TritonBackend.head_dim_limits``, ``fa3_runs``). The imports are lazy: without triton, attn=sdpa still works.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, NamedTuple, Optional

import torch

from model.backends.base import Backend, BackendUnavailableError


class Kernels(NamedTuple):
    """The kernel functions of one backend (``kernels`` package), None where the backend has no such form."""
    attention: Callable
    qkvpacked: Callable
    varlen: Optional[Callable] = None
    varlen_qkvpacked: Optional[Callable] = None
    decode: Optional[Callable] = None


def fa1_kernels() -> Kernels:
    from kernels import fa1_attention, fa1_qkvpacked_attention

    return Kernels(fa1_attention, fa1_qkvpacked_attention)


def fa2_kernels() -> Kernels:
    from kernels import (
        fa2_attention, fa2_decode, fa2_qkvpacked_attention, fa2_varlen_attention, fa2_varlen_qkvpacked_attention,
    )

    return Kernels(fa2_attention, fa2_qkvpacked_attention, varlen=fa2_varlen_attention,
                   varlen_qkvpacked=fa2_varlen_qkvpacked_attention, decode=fa2_decode)


def fa3_kernels() -> Kernels:
    from kernels import (
        fa2_decode, fa3_attention, fa3_qkvpacked_attention, fa3_varlen_attention, fa3_varlen_qkvpacked_attention,
    )

    return Kernels(fa3_attention, fa3_qkvpacked_attention, varlen=fa3_varlen_attention,
                   varlen_qkvpacked=fa3_varlen_qkvpacked_attention, decode=fa2_decode)


def fa3_runs(head_dim: Optional[int], backward: bool = True) -> bool:
    """Whether fa3's Gluon kernels run on this machine's GPU (``kernels.fa3.gluon_device_reason``: an sm_90 GPU and
    a Triton they support) for ``head_dim`` (None: not known), in both directions (``backward``) or in the forward
    alone: at 256 only the forward is Gluon's (``kernels.fa3.BACKWARD_HEAD_DIMS``). False without triton."""
    try:
        from kernels import fa3
    except ImportError:  # no triton: attn=fa2 then says so
        return False
    if head_dim is not None and head_dim not in (fa3.BACKWARD_HEAD_DIMS if backward else fa3.HEAD_DIMS):
        return False
    return fa3.gluon_device_reason(torch.device("cuda")) is None


def _window_size(window: int) -> tuple[int, int]:
    return (window - 1, 0) if window else (-1, -1)


@dataclass(frozen=True, eq=False, kw_only=True)
class TritonBackend(Backend):
    """A backend on the project's kernels; ``load_kernels`` imports them."""
    load_kernels: Callable[[], Kernels]
    limits_head_dim: bool = True
    qkvpacked: bool = True

    @cached_property
    def kernels(self) -> Kernels:
        if not torch.cuda.is_available():
            msg = (f"attn={self.name}: no CUDA GPU, running the Triton kernels under the Triton interpreter "
                   "(TRITON_INTERPRET=1); this is very slow and meant for testing only")
            warnings.warn(msg, RuntimeWarning, stacklevel=4)
        try:
            return self.load_kernels()
        except ImportError as e:
            raise self._unavailable(e) from e

    def _unavailable(self, e: ImportError) -> BackendUnavailableError:
        return BackendUnavailableError(
            f"attn={self.name} is not available: could not load kernels.{self.name}_attention "
            f"({type(e).__name__}: {e}). The Triton kernels need the `triton` package (Linux); "
            "use attn=sdpa without it.")

    def load(self) -> "TritonBackend":
        self.kernels  # noqa: B018 (imports them once; the call forms then read the cached functions)
        return self

    def head_dim_limits(self) -> tuple[int, int]:
        # not self.load(): config validation asks this first, and a refused config should not warn about the
        # interpreter that it will never start
        try:
            from kernels.frontend import MAX_HEAD_DIM, MIN_HEAD_DIM
        except ImportError as e:
            raise self._unavailable(e) from e

        return MIN_HEAD_DIM, MAX_HEAD_DIM

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                  causal: bool = True, window: int = 0, docs: Optional[torch.Tensor] = None,
                  softcap: float = 0.0) -> torch.Tensor:
        self.refuse_dropout(dropout_p)
        self.refuse_softcap(softcap)
        if window == 0 and docs is None:  # GQA (fewer k/v heads) and strided views
            return self.kernels.attention(q, k, v, causal=causal, softcap=softcap)
        self.refuse_masks(window, docs)
        if docs is None:
            return self.kernels.attention(q, k, v, causal=True, window_size=(window - 1, 0), softcap=softcap)
        # Documents: the batch flattened to one packed sequence of B * T tokens, cut at docs (views, no copies
        # for the model's (B, T, H, D)-ordered q, k, v).
        B, H, T, D = q.shape
        packed = [t.transpose(1, 2).reshape(B * T, t.shape[1], D) for t in (q, k, v)]
        o = self.kernels.varlen(*packed, docs, docs, T, T, causal=True, window_size=_window_size(window),
                                softcap=softcap, check_offsets=False)  # the sampler's cuts are valid by construction
        return o.view(B, T, H, D).transpose(1, 2)

    def qkvpacked_attention(self, qkv: torch.Tensor, n_head: int, dropout_p: float = 0.0,
                            window: int = 0, softcap: float = 0.0, docs: Optional[torch.Tensor] = None) -> torch.Tensor:
        self.refuse_dropout(dropout_p)
        self.refuse_masks(window, docs)
        self.refuse_softcap(softcap)
        if docs is None:
            return self.kernels.qkvpacked(qkv, n_head, causal=True, window_size=_window_size(window), softcap=softcap)
        # Documents: the batch as one packed sequence of B * T tokens (a view), the gradient written into qkv's.
        B, T, heads, D = qkv.shape
        o = self.kernels.varlen_qkvpacked(qkv.view(B * T, heads, D), docs, T, n_head, causal=True,
                                          window_size=_window_size(window), softcap=softcap,
                                          check_offsets=False)  # the sampler's cuts are valid by construction
        return o.view(B, T, n_head, D)

    def split_kv_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                           causal: bool = True, softcap: float = 0.0) -> torch.Tensor:
        if not self.split_kv:
            raise ValueError(self.lacks("split_kv"))
        self.refuse_softcap(softcap)
        if q.shape[2] == 1 and dropout_p == 0.0:  # a decode step: keys split across programs (no mask needed)
            return self.kernels.decode(q, k, v, softcap=softcap)
        return self.attention(q, k, v, dropout_p, causal, softcap=softcap)

    def static_kv_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            seqlen: torch.Tensor, softcap: float = 0.0) -> torch.Tensor:
        if not self.static_decode:
            raise ValueError(self.lacks("static_decode"))
        self.refuse_softcap(softcap)
        return self.kernels.decode(q, k, v, seqlen=seqlen, softcap=softcap)  # T_q = 1 only
