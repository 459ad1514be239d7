"""The one attention backend registry: the model asks for a backend by name and gets a function.

Every backend computes scaled-dot-product attention, causal by default (``causal=False``: no mask)

    o = softmax(q @ k^T * softmax_scale + causal_mask) @ v,   softmax_scale = 1/sqrt(head_dim)

with q (B, n_head, T, head_dim) and k, v (B, n_kv_head, T, head_dim), n_head a multiple of
n_kv_head (grouped-query attention: q head h reads k/v head h // (n_head // n_kv_head)).
The output o has q's shape and dtype. Inputs may be float32, float16 or bfloat16.
``window`` > 0 restricts each query to itself and the window - 1 keys before it (sliding-window
attention; 0 = full causal). ``docs`` (int32 cu_seqlens over the flattened (B * T) batch, from
``data.sampler``) restricts each token to its own document segment. fa2 does both in the kernel
(``fa2_varlen_attention`` for docs) and skips the key blocks outside them; ``flex`` through FlexAttention's
block masks; ``sdpa`` applies a dense boolean mask (correct, but off PyTorch's fast kernels; it warns once);
the others refuse them (the ``Backend`` fields ``supports_window``, ``supports_docs``).

Backends:
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention(is_causal=True, enable_gqa=...)``,
  PyTorch picks its own flash / memory-efficient / math kernel. Supports attention dropout.
- ``fa1`` / ``fa2``: our Triton FlashAttention-1 / -2 kernels from ``kernels/``
  (``fa1_attention`` / ``fa2_attention``). Without a CUDA GPU they run under Triton's
  interpreter (``TRITON_INTERPRET=1``, set when this module is imported on a machine without CUDA,
  before anything imports triton), which is very slow.
  They have no attention dropout: ``dropout_p > 0`` raises ``ValueError`` (config validation
  rejects ``model.dropout > 0`` with these backends before training starts).
- ``flex``: PyTorch FlexAttention (``torch.nn.attention.flex_attention``) with block masks for the causal
  mask, windows and documents (``model/flex.py``); compiled on CUDA, PyTorch's eager (unfused, slow)
  implementation on the CPU. No attention dropout.
- ``sdpa_flash`` / ``sdpa_cudnn``: SDPA pinned to PyTorch's FlashAttention-2 or cuDNN kernel
  (``torch.nn.attention.sdpa_kernel``), for comparing against a known kernel; fails where PyTorch
  has no such kernel for the inputs (cuDNN: CUDA only).
- ``auto``: ``fa3`` where its Gluon kernels run (an sm_90 GPU with a Triton they support, head_dim 64 or 128, no
  window or document masks), else ``fa2`` when a CUDA GPU is present, else ``sdpa`` (see ``resolve_backend``).

``REGISTRY`` holds one ``Backend`` entry per concrete backend: its kernel factory and what the rest of the
code asks about it (needs CUDA, dropout, windows, documents, head_dim range, torch.compile on the CPU). Config
validation, ``sample.py --attn``, ``bench/attention.py`` and the tests derive from it. A new backend = a kernel
module, one entry here and a ``conf/attn/<name>.yaml`` (``backend: <name>``).

``get_qkvpacked_backend`` gives fa1/fa2/fa3's attention on the fused qkv projection's output as one tensor (the
backward writes its gradient in place instead of concatenating dq, dk, dv); the model uses it in training.

For generation with a KV cache, ``get_kv_backend`` gives the same backends for seqlen_q <= seqlen_k
(new queries against the cached prefix), with the causal mask aligned bottom-right, and
``get_static_kv_backend`` the fixed-shape decode step (CUDA graphs) where a backend has one.
"""

from __future__ import annotations

import importlib
import os
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


if not torch.cuda.is_available():
    # Without a GPU the Triton kernels only run under Triton's interpreter, which Triton switches on when
    # `triton.language` is first imported; torch imports it too (building an optimizer does), possibly long
    # before fa1/fa2 is chosen (e.g. an sdpa job, then an fa2 job in one process). So set it now.
    os.environ.setdefault("TRITON_INTERPRET", "1")


class AttentionFn(Protocol):
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                 causal: bool = True, window: int = 0, docs: Optional[torch.Tensor] = None) -> torch.Tensor: ...


class QKVPackedAttentionFn(Protocol):
    def __call__(self, qkv: torch.Tensor, n_head: int, dropout_p: float = 0.0, window: int = 0) -> torch.Tensor: ...


class BackendUnavailableError(RuntimeError):
    """The requested attention backend cannot be loaded (e.g. the Triton kernels are missing)."""


@dataclass(frozen=True)
class Backend:
    """One registry entry. ``factory()`` returns the attention function (imports kernels lazily; raises
    BackendUnavailableError if they cannot be loaded). ``head_dims()``, if given, returns the (min, max)
    head_dim the kernel accepts (it may load the kernels); None means no limit."""
    name: str
    factory: Callable[[], AttentionFn]
    description: str
    needs_cuda: bool = False
    supports_dropout: bool = False
    cpu_dropout: bool = True  # with supports_dropout: dropout works on the CPU too
    head_dims: Optional[Callable[[], tuple[int, int]]] = None
    supports_window: bool = False  # window > 0 (model.attn_window)
    supports_docs: bool = False  # docs (data.document_mask)
    compiles_on_cpu: bool = True  # torch.compile (trainer.compile) can train the model on the CPU
    qkvpacked: Optional[Callable[[], QKVPackedAttentionFn]] = None  # the same on a packed qkv (get_qkvpacked_backend)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, causal: bool = True,
          window: int = 0, docs: Optional[torch.Tensor] = None) -> torch.Tensor:
    mask = None if window == 0 and docs is None else _dense_mask(q.shape[0], q.shape[2], window, docs, q.device)
    return F.scaled_dot_product_attention(  # a window or docs mask is causal
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal and mask is None,
        enable_gqa=q.shape[1] != k.shape[1]
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
    i = torch.arange(seqlen, device=device)[:, None]
    j = torch.arange(seqlen, device=device)[None, :]
    mask = (j <= i) & (j > i - window) if window else j <= i
    if docs is not None:
        segment = segment_ids(docs, batch, seqlen)
        mask = mask & (segment[:, :, None] == segment[:, None, :])
    return mask.view(-1, 1, seqlen, seqlen)


def segment_ids(docs: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """(batch, seqlen) index of the segment of ``docs`` (int32 cu_seqlens of the flattened batch * seqlen tokens)
    that each token lies in, same dtype and device as docs; two tokens may attend to each other only if equal."""
    flat = torch.arange(batch * seqlen, device=docs.device, dtype=docs.dtype)
    return torch.searchsorted(docs, flat, right=True).view(batch, seqlen)


_LOADED: dict[str, Callable] = {}  # kernel functions already imported (warn once per backend)


# SDPA pinned to one of PyTorch's kernels, by backend name.
SDPA_PINNED = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}


def _sdpa_pinned(name: str, sdpa: AttentionFn = _sdpa) -> AttentionFn:
    pinned = SDPA_PINNED[name]

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                  causal: bool = True, window: int = 0, docs: Optional[torch.Tensor] = None) -> torch.Tensor:
        _refuse_masks(name, window, docs)
        with sdpa_kernel(pinned):
            return sdpa(q, k, v, dropout_p, causal)

    attention.__name__ = f"{name}_attention" if sdpa is _sdpa else f"{name}_kv_attention"
    return attention


def _load_triton(name: str) -> Callable:
    if name in _LOADED:
        return _LOADED[name]
    fn_name = f"{name}_attention"
    if not torch.cuda.is_available():
        msg = (f"attn={name}: no CUDA GPU, running the Triton kernels under the Triton interpreter "
               "(TRITON_INTERPRET=1); this is very slow and meant for testing only")
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
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


def _check_dropout(name: str, dropout_p: float) -> None:
    if dropout_p > 0.0:
        raise ValueError(f"attn={name} has no attention dropout (got dropout_p={dropout_p}); "
                         "use model.dropout=0.0 or attn=sdpa")


def _triton_backend(name: str) -> AttentionFn:
    kernel = _load_triton(name)
    # Looked up now, not on first use: under torch.compile that would be traced (and break fullgraph).
    varlen = getattr(importlib.import_module("kernels"), f"{name}_varlen_attention", None)

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                  causal: bool = True, window: int = 0, docs: Optional[torch.Tensor] = None) -> torch.Tensor:
        _check_dropout(name, dropout_p)
        if window == 0 and docs is None:
            return kernel(q, k, v, causal=causal)  # the kernels take GQA (fewer k/v heads) and strided views
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

    attention.__name__ = f"{name}_attention"
    return attention


def _triton_qkvpacked(name: str) -> QKVPackedAttentionFn:
    _load_triton(name)  # the interpreter warning and the clear error if the kernels cannot be loaded
    kernel = getattr(importlib.import_module("kernels"), f"{name}_qkvpacked_attention")

    def attention(qkv: torch.Tensor, n_head: int, dropout_p: float = 0.0, window: int = 0) -> torch.Tensor:
        _check_dropout(name, dropout_p)
        _refuse_masks(name, window, None)
        return kernel(qkv, n_head, causal=True, window_size=(window - 1, 0) if window else (-1, -1))

    attention.__name__ = f"{name}_qkvpacked_attention"
    return attention


def _triton_head_dims(name: str) -> Callable[[], tuple[int, int]]:
    def head_dims() -> tuple[int, int]:
        _load_triton(name)  # raises BackendUnavailableError if the kernels cannot be loaded
        frontend = importlib.import_module("kernels.frontend")
        return frontend.MIN_HEAD_DIM, frontend.MAX_HEAD_DIM

    return head_dims


def _flex_backend() -> AttentionFn:
    try:
        flex = importlib.import_module("model.flex")
    except ImportError as e:  # torch < 2.5 has no torch.nn.attention.flex_attention
        raise BackendUnavailableError(f"attn=flex is not available with torch {torch.__version__} "
                                      f"({type(e).__name__}: {e}); it needs torch >= 2.5") from e
    return flex.factory()


def _refuse_masks(name: str, window: int, docs: Optional[torch.Tensor]) -> None:
    entry = REGISTRY[name]
    if window and not entry.supports_window:
        raise ValueError(f"attn={name} has no sliding-window attention (a layer has a window of {window} tokens: "
                         "model.attn_window); "
                         f"use one of: {', '.join(mask_backends('window'))}")
    if docs is not None and not entry.supports_docs:
        raise ValueError(f"attn={name} has no document masks (data.document_mask); "
                         f"use one of: {', '.join(mask_backends('docs'))}")


REGISTRY: dict[str, Backend] = {b.name: b for b in (
    Backend("sdpa", lambda: _sdpa, "PyTorch SDPA, PyTorch picks the kernel", supports_dropout=True,
            supports_window=True, supports_docs=True),
    Backend("sdpa_flash", lambda: _sdpa_pinned("sdpa_flash"), "PyTorch SDPA pinned to its FlashAttention-2 kernel",
            supports_dropout=True, cpu_dropout=False),  # PyTorch's CPU flash kernel has no dropout
    Backend("sdpa_cudnn", lambda: _sdpa_pinned("sdpa_cudnn"), "PyTorch SDPA pinned to cuDNN attention",
            needs_cuda=True, supports_dropout=True),
    Backend("fa1", lambda: _triton_backend("fa1"), "our Triton FlashAttention-1 kernel",
            head_dims=_triton_head_dims("fa1"), qkvpacked=lambda: _triton_qkvpacked("fa1")),
    Backend("fa2", lambda: _triton_backend("fa2"), "our Triton FlashAttention-2 kernel",
            head_dims=_triton_head_dims("fa2"), qkvpacked=lambda: _triton_qkvpacked("fa2"), supports_window=True, supports_docs=True),
    Backend("flex", _flex_backend, "PyTorch FlexAttention with block masks (compiled on CUDA)",
            supports_window=True, supports_docs=True, compiles_on_cpu=False),  # Inductor has no CPU Flex backward
    Backend("fa3", lambda: _triton_backend("fa3"),
            "our FlashAttention-3 kernels (Gluon, Hopper); FA2's where they do not apply",
            head_dims=_triton_head_dims("fa3"), qkvpacked=lambda: _triton_qkvpacked("fa3")),
)}
BACKENDS = ("auto", *REGISTRY)  # the values of attn.backend


def resolve_backend(name: str, head_dim: Optional[int] = None, masks: bool = False) -> str:
    """Map a configured backend name to a concrete one. 'auto': without CUDA 'sdpa'; with CUDA 'fa3' where its
    Gluon kernels run (``kernels.fa3.gluon_device_reason``: an sm_90 GPU and a Triton they support), the model's
    head_dim (None: not known) is one they take and no window or document masks are needed (``masks``: fa3 has
    none), else 'fa2'. On the H200 fa3 measured faster than fa2 in every cell (docs/benchmarks.md).

    Raises ValueError for a name outside ``BACKENDS``.
    """
    if name not in BACKENDS:
        raise ValueError(f"attn={name!r} is not a known attention backend; accepted: {', '.join(BACKENDS)}")
    if name == "auto":
        if not torch.cuda.is_available():
            return "sdpa"
        return "fa3" if not masks and _fa3_gluon_runs(head_dim) else "fa2"
    return name


def _fa3_gluon_runs(head_dim: Optional[int]) -> bool:
    try:
        fa3 = importlib.import_module("kernels.fa3")
    except ImportError:  # no triton: attn=fa2 then says so
        return False
    return (head_dim is None or head_dim in fa3.HEAD_DIMS) and fa3.gluon_device_reason(torch.device("cuda")) is None


def backend_info(name: str) -> Backend:
    """The registry entry of ``name`` ('auto' resolved). Raises ValueError for an unknown name."""
    return REGISTRY[resolve_backend(name)]


def mask_backends(kind: str) -> list[str]:
    """The backends with ``supports_window`` (kind 'window') or ``supports_docs`` (kind 'docs')."""
    return [b.name for b in REGISTRY.values() if getattr(b, f"supports_{kind}")]


def head_dim_limits(name: str) -> tuple[int, int] | None:
    """(min, max) head_dim the backend accepts, or None when it has no limit (sdpa).
    Raises BackendUnavailableError if the backend's kernels cannot be loaded."""
    entry = backend_info(name)
    return entry.head_dims() if entry.head_dims is not None else None


def get_backend(name: str) -> AttentionFn:
    """Return ``fn(q, k, v, dropout_p=0.0, causal=True, window=0, docs=None) -> o`` for backend ``name``
    (see module docstring).

    ``name`` may be 'auto'; it is resolved with ``resolve_backend``. Raises ValueError for an
    unknown name and BackendUnavailableError when fa1/fa2 cannot be imported from ``kernels``.
    """
    return backend_info(name).factory()


def get_qkvpacked_backend(name: str) -> Optional[QKVPackedAttentionFn]:
    """The backend's causal attention on one packed qkv, or None when it has none (sdpa, flex): ``fn(qkv, n_head,
    dropout_p=0.0, window=0) -> y`` with qkv (B, T, n_head + 2 * n_kv_head, head_dim), the fused projection's output
    viewed per head, and y (B, T, n_head, head_dim) contiguous. Its backward writes the gradient of qkv in place,
    where separate q, k, v views make autograd concatenate dq, dk, dv into it (a copy;
    ``kernels.fa2_qkvpacked_attention``). Window and dropout as ``get_backend``'s functions; no document masks.
    Raises as ``get_backend``."""
    entry = backend_info(name)
    return entry.qkvpacked() if entry.qkvpacked is not None else None


def _sdpa_bottom_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                       causal: bool = True) -> torch.Tensor:
    Tq, Tk = q.shape[2], k.shape[2]
    if Tq == Tk or not causal:  # e.g. a prefill from position 0: top-left and bottom-right alignment agree
        return _sdpa(q, k, v, dropout_p, causal)
    # SDPA's is_causal is aligned top-left (query i sees keys 0..i), wrong for new queries after a cached prefix.
    # One query (a decode step) sees every cached key: no mask, which also keeps SDPA's fastest kernels.
    mask = None if Tq == 1 else torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _split_kv(name: str) -> AttentionFn:
    forward, decode = get_backend(name), importlib.import_module("kernels.decode").fa2_decode

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                  causal: bool = True) -> torch.Tensor:
        if q.shape[2] == 1 and dropout_p == 0.0:  # a decode step: keys split across programs (no mask needed)
            return decode(q, k, v)
        return forward(q, k, v, dropout_p, causal)

    attention.__name__ = f"{name}_split_kv_attention"
    return attention


def _sdpa_static(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlen: torch.Tensor) -> torch.Tensor:
    Tq, Tk = q.shape[2], k.shape[2]
    if Tq == 1:  # a decode step: the keys 0 .. seqlen-1 (two kernels: a CUDA graph replays each one)
        mask = (torch.arange(Tk, device=q.device) < seqlen)[None, :]
    else:  # query i sits at position seqlen - Tq + i and sees the keys up to it; the rest of the buffer is masked
        last = seqlen - Tq + torch.arange(Tq, device=q.device)
        mask = torch.arange(Tk, device=q.device)[None, :] <= last[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def get_static_kv_backend(name: str) -> Callable | None:
    """Attention over a whole preallocated KV cache, for decode steps with fixed shapes (CUDA graphs):
    ``fn(q, k, v, seqlen) -> o`` with q (B, n_head, T_q, head_dim), k, v the cache buffers
    (B, n_kv_head, block_size, head_dim) and seqlen a 0-dim integer tensor on the device: keys 0 .. seqlen-1
    are filled, query i sees keys j <= seqlen - T_q + i. ``sdpa``: a boolean mask; ``fa2`` and ``fa3``:
    ``kernels.decode.fa2_decode`` (T_q = 1 only). None for backends without one (fa1, pinned SDPA).
    """
    name = resolve_backend(name)
    if name == "sdpa":
        return _sdpa_static
    if name in ("fa2", "fa3"):
        get_backend(name)  # the interpreter warning and the clear error if the kernels cannot be loaded
        decode = importlib.import_module("kernels.decode").fa2_decode
        return lambda q, k, v, seqlen: decode(q, k, v, seqlen=seqlen)
    return None


def get_kv_backend(name: str, split_kv: bool = False) -> AttentionFn:
    """Like ``get_backend``, for attention over a KV cache: ``fn(q, k, v, dropout_p=0.0, causal=True) -> o``
    with q (B, n_head, T_q, head_dim) the new tokens and k, v (B, n_kv_head, T_k, head_dim) every token so far,
    T_q <= T_k: query i sees key j iff j <= i + T_k - T_q (causal mask aligned bottom-right).

    fa1/fa2/fa3/flex are ``get_backend``'s functions (they align the mask bottom-right already); sdpa gets no
    mask for T_q == 1, ``is_causal`` for T_q == T_k and an explicit boolean mask otherwise, which
    ``sdpa_flash`` does not accept. ``split_kv`` (fa2, fa3) sends single-query calls (decode steps) to the
    split-K/V kernel ``kernels.decode.fa2_decode`` (flash-decoding). Raises as ``get_backend``, and
    ValueError for ``split_kv`` with another backend.
    """
    name = resolve_backend(name)
    if split_kv:
        if name not in ("fa2", "fa3"):
            raise ValueError(f"split_kv decode is for fa2 and fa3; attn={name} has none")
        return _split_kv(name)
    if name not in ("sdpa", *SDPA_PINNED):
        return get_backend(name)
    return _sdpa_bottom_right if name == "sdpa" else _sdpa_pinned(name, _sdpa_bottom_right)
