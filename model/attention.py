"""The one attention registry: the model asks for a backend by name and gets a function.

Every backend computes causal scaled-dot-product attention

    o = softmax(q @ k^T * softmax_scale + causal_mask) @ v,   softmax_scale = 1/sqrt(head_dim)

with q (B, n_head, T, head_dim) and k, v (B, n_kv_head, T, head_dim), n_head a multiple of
n_kv_head (grouped-query attention: q head h reads k/v head h // (n_head // n_kv_head)).
The output o has q's shape and dtype. Inputs may be float32, float16 or bfloat16.
``window`` > 0 restricts each query to itself and the window - 1 keys before it (sliding-window
attention; 0 = full causal). ``docs`` (int32 cu_seqlens over the flattened (B * T) batch, from
``data.sampler``) restricts each token to its own document segment. fa2 does both in the kernel
(``fa2_varlen_attention`` for docs) and skips the key blocks outside them; ``sdpa`` applies a dense
boolean mask (correct, but off PyTorch's fast kernels; it warns once); the others refuse them
(``supports_window``, ``supports_docs``).

Backends:
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention(is_causal=True, enable_gqa=...)``,
  PyTorch picks its own flash / memory-efficient / math kernel. Supports attention dropout.
- ``fa1`` / ``fa2``: our Triton FlashAttention-1 / -2 kernels from ``kernels/``
  (``fa1_attention`` / ``fa2_attention``). Without a CUDA GPU they run under Triton's
  interpreter (``TRITON_INTERPRET=1``, set when this module is imported on a machine without CUDA,
  before anything imports triton), which is very slow.
  They have no attention dropout: ``dropout_p > 0`` raises ``ValueError`` (config validation
  rejects ``model.dropout > 0`` with these backends before training starts).
- ``sdpa_flash`` / ``sdpa_cudnn``: SDPA pinned to PyTorch's FlashAttention-2 or cuDNN kernel
  (``torch.nn.attention.sdpa_kernel``), for comparing against a known kernel; fails where PyTorch
  has no such kernel for the inputs (cuDNN: CUDA only).
- ``auto``: ``fa2`` when a CUDA GPU is present, ``sdpa`` otherwise (see ``resolve_backend``).
"""

from __future__ import annotations

import importlib
import logging
import os
import warnings
from typing import Callable, Optional, Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

log = logging.getLogger(__name__)

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels only run under Triton's interpreter, which Triton switches on when
    # `triton.language` is first imported; torch imports it too (building an optimizer does), possibly long
    # before fa1/fa2 is chosen (e.g. an sdpa job, then an fa2 job in one process). So set it now.
    os.environ.setdefault("TRITON_INTERPRET", "1")

BACKENDS = ("auto", "sdpa", "sdpa_flash", "sdpa_cudnn", "fa1", "fa2", "fa3")


class AttentionFn(Protocol):
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                 window: int = 0, docs: Optional[torch.Tensor] = None) -> torch.Tensor: ...


WINDOW_BACKENDS = ("sdpa", "fa2")  # the backends that take a sliding window and document segments


class BackendUnavailableError(RuntimeError):
    """The requested attention backend cannot be loaded (e.g. the Triton kernels are missing)."""


def resolve_backend(name: str) -> str:
    """Map a configured backend name to a concrete one: 'auto' -> 'fa2' with CUDA, else 'sdpa'.

    Raises ValueError for a name outside ``BACKENDS``.
    """
    if name not in BACKENDS:
        raise ValueError(f"attn={name!r} is not a known attention backend; accepted: {', '.join(BACKENDS)}")
    if name == "auto":
        return "fa2" if torch.cuda.is_available() else "sdpa"
    return name


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, window: int = 0,
          docs: Optional[torch.Tensor] = None) -> torch.Tensor:
    mask = None if window == 0 and docs is None else _dense_mask(q.shape[0], q.shape[2], window, docs, q.device)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=mask is None, enable_gqa=q.shape[1] != k.shape[1]
    )


_WARNED_DENSE_MASK = []


def _dense_mask(batch: int, seqlen: int, window: int, docs: Optional[torch.Tensor], device) -> torch.Tensor:
    """(batch or 1, 1, T, T) boolean mask, True = visible: key j for query i iff j <= i, i - window < j if
    window > 0 (the kernels' window_size=(window - 1, 0)), and i, j in one segment of docs if given."""
    if not _WARNED_DENSE_MASK and not torch.compiler.is_compiling():  # a warning would break the graph
        _WARNED_DENSE_MASK.append(True)
        msg = ("attn=sdpa with model.attn_window or data.document_mask: a dense (T, T) mask, which takes SDPA off "
               "its fast kernels (slow; attn=fa2 skips the key blocks outside the window and the documents)")
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        log.warning(msg)
    i = torch.arange(seqlen, device=device)[:, None]
    j = torch.arange(seqlen, device=device)[None, :]
    mask = (j <= i) & (j > i - window) if window else j <= i
    if docs is not None:  # segment index of every token of the flattened batch
        segment = torch.searchsorted(docs, torch.arange(batch * seqlen, device=device, dtype=docs.dtype), right=True)
        segment = segment.view(batch, seqlen)
        mask = mask & (segment[:, :, None] == segment[:, None, :])
    return mask.view(-1, 1, seqlen, seqlen)


_LOADED: dict[str, Callable] = {}  # kernel functions already imported (warn once per backend)


# SDPA pinned to one of PyTorch's kernels, by backend name (also used by bench/attention.py).
SDPA_PINNED = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}


def _sdpa_pinned(name: str) -> AttentionFn:
    pinned = SDPA_PINNED[name]

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                  window: int = 0, docs: Optional[torch.Tensor] = None) -> torch.Tensor:
        _refuse_masks(name, window, docs)
        with sdpa_kernel(pinned):
            return _sdpa(q, k, v, dropout_p)

    attention.__name__ = f"{name}_causal_attention"
    return attention


def _load_triton(name: str) -> Callable:
    if name in _LOADED:
        return _LOADED[name]
    fn_name = f"{name}_attention"
    if not torch.cuda.is_available():
        msg = (f"attn={name}: no CUDA GPU, running the Triton kernels under the Triton interpreter "
               "(TRITON_INTERPRET=1); this is very slow and meant for testing only")
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        log.warning(msg)
    try:
        kernels = importlib.import_module("kernels")
        fn = getattr(kernels, fn_name)
    except (ImportError, AttributeError) as e:
        raise BackendUnavailableError(
            f"attn={name} is not available: could not load kernels.{fn_name} ({type(e).__name__}: {e}). "
            "The Triton kernels need the `triton` package (Linux); use attn=sdpa without it."
        ) from e
    _LOADED[name] = fn
    return fn


def _triton_backend(name: str) -> AttentionFn:
    kernel = _load_triton(name)
    # Looked up now, not on first use: under torch.compile that would be traced (and break fullgraph).
    varlen = getattr(importlib.import_module("kernels"), f"{name}_varlen_attention", None)

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                  window: int = 0, docs: Optional[torch.Tensor] = None) -> torch.Tensor:
        if dropout_p > 0.0:
            raise ValueError(f"attn={name} has no attention dropout (got dropout_p={dropout_p}); "
                             "use model.dropout=0.0 or attn=sdpa")
        if window == 0 and docs is None:
            return kernel(q, k, v, causal=True)  # the kernels take GQA (fewer k/v heads) and strided views
        _refuse_masks(name, window, docs)
        if docs is None:
            return kernel(q, k, v, causal=True, window_size=(window - 1, 0))
        # Documents: the batch flattened to one packed sequence of B * T tokens, cut at docs (views, no copies
        # for the model's (B, T, H, D)-ordered q, k, v).
        B, H, T, D = q.shape
        packed = [t.transpose(1, 2).reshape(B * T, t.shape[1], D) for t in (q, k, v)]
        o = varlen(*packed, docs, docs, T, T, causal=True, window_size=(window - 1, 0) if window else (-1, -1),
                   check_offsets=False)  # the sampler's cuts are valid by construction
        return o.view(B, T, H, D).transpose(1, 2)

    attention.__name__ = f"{name}_causal_attention"
    return attention


def supports_window(name: str) -> bool:
    """Whether backend ``name`` ('auto' resolved) takes ``window`` > 0 (model.attn_window) and ``docs``
    (data.document_mask)."""
    return resolve_backend(name) in WINDOW_BACKENDS


def _refuse_masks(name: str, window: int, docs: Optional[torch.Tensor]) -> None:
    if window and name not in WINDOW_BACKENDS:
        raise ValueError(f"attn={name} has no sliding-window attention (model.attn_window={window}); "
                         f"use one of: {', '.join(WINDOW_BACKENDS)}")
    if docs is not None and name not in WINDOW_BACKENDS:
        raise ValueError(f"attn={name} has no document masks (data.document_mask); "
                         f"use one of: {', '.join(WINDOW_BACKENDS)}")


def head_dim_limits(name: str) -> tuple[int, int] | None:
    """(min, max) head_dim the backend accepts, or None when it has no limit (sdpa)."""
    if resolve_backend(name) not in ("fa1", "fa2", "fa3"):
        return None
    get_backend(name)  # raises BackendUnavailableError if the kernels cannot be loaded
    frontend = importlib.import_module("kernels.frontend")
    return frontend.MIN_HEAD_DIM, frontend.MAX_HEAD_DIM


def get_backend(name: str) -> AttentionFn:
    """Return ``fn(q, k, v, dropout_p=0.0) -> o`` for backend ``name`` (see module docstring).

    ``name`` may be 'auto'; it is resolved with ``resolve_backend``. Raises ValueError for an
    unknown name and BackendUnavailableError when fa1/fa2 cannot be imported from ``kernels``.
    """
    return _FACTORIES[resolve_backend(name)]()


# One entry per concrete backend (plus a conf/attn/<name>.yaml to expose it on the command line).
_FACTORIES: dict[str, Callable[[], AttentionFn]] = {
    "sdpa": lambda: _sdpa,
    "sdpa_flash": lambda: _sdpa_pinned("sdpa_flash"),
    "sdpa_cudnn": lambda: _sdpa_pinned("sdpa_cudnn"),
    "fa1": lambda: _triton_backend("fa1"),
    "fa2": lambda: _triton_backend("fa2"),
    "fa3": lambda: _triton_backend("fa3"),
}
assert set(BACKENDS) == {"auto", *_FACTORIES}
