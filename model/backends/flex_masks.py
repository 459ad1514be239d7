"""FlexAttention with block masks: the masks, their caches and the call behind ``attn=flex``
(``model/backends/flex.py``, which imports this module when the backend is loaded: it compiles).

``attention(q, k, v, causal=True, window=0, docs=None, softcap=0.0)`` has the contract of every backend's
``attention`` and ``kv_attention`` (``model.backends.base.Backend``: q (B, n_head, T_q, D), k, v (B, n_kv_head, T_k, D),
T_q <= T_k; o like q; softmax scale 1/sqrt(D)). The mask is one ``mask_mod``: key j is visible to query i iff
j <= i + T_k - T_q (causal, aligned bottom-right as for the other backends' KV-cache path), i - j < window if
window > 0 (the query itself and the window - 1 keys before it, as fa2's ``window_size=(window - 1, 0)``), and i, j
lie in one segment of ``docs`` (cu_seqlens of the flattened (B * T) batch, the fa2 varlen path's input). A window or
docs implies causal. softcap > 0 is a ``score_mod``, softcap * tanh(score / softcap) on Flex's scaled score, which
Flex applies before the block mask: the same order as fa2's kernels. One function object per softcap value
(``softcap_score_mod``), so the compiled Flex sees the same function from call to call and does not recompile.

Block masks: one per (T_q, T_k, window, device) for causal and windowed attention, built once and cached;
document masks change with every batch, so they are built once per ``docs`` tensor (every layer of a forward
passes the same one) and reused by its layers. Under ``torch.compile`` of the model they are built inside the
graph instead (a Python cache would be traced as guards), where the compiler fuses them.

Devices:
- CUDA: ``torch.compile(flex_attention, dynamic=False)`` (one compiled function per process, as PyTorch advises,
  with one kernel per shape; eager Flex materializes the (T_q, T_k) scores) and a compiled ``create_block_mask``
  (eager, it materializes (B, T_q, T_k) indices).
- CPU (tests): eager FlexAttention, PyTorch's unfused implementation; slow, the backend warns once. PyTorch's
  ``flex_attention`` refuses inputs that need gradients on CPU (its fused CPU kernel has no backward, torch 2.13),
  so training on CPU calls the operator that ``flex_attention`` runs in eager mode,
  ``torch._higher_order_ops.flex_attention``, whose math forward and backward run on any device (a private
  PyTorch API: on a version where it moved, training on CPU fails with a ``BackendUnavailableError``).
  ``torch.compile`` of the model cannot train it on the CPU (Inductor has no CPU Flex backward; the backend's
  ``compiles_on_cpu=False`` makes config validation refuse trainer.compile there).
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Callable, Optional

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention, noop_mask

from model.backends.base import BackendUnavailableError, segment_ids

# Compiled lazily, on the first call; one compiled function for every layer and model of the process. Static
# shapes: by default a call with a second shape (another batch or length) recompiles for dynamic shapes and every
# later call runs that generic kernel ("automatic dynamic"; the likely cause of a slow Flex in an H200 benchmark,
# docs/results/masks_h200_2026-12-01.log); with dynamic=False each shape gets its own kernel, up to torch._dynamo's
# recompile limit (8). Inside a compiled model this function is traced like any other, with the model's settings.
_compiled_flex = torch.compile(flex_attention, dynamic=False)
_compiled_block_mask = torch.compile(create_block_mask)


def mask_mod(offset: int, window: int, segment: Optional[torch.Tensor]) -> Callable:
    """The visibility rule as a Flex ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor``: causal with query i at key
    position i + offset (offset = T_k - T_q), within ``window`` keys if > 0, within one segment if ``segment``
    ((B, T) integer segment index of every token) is given."""
    def visible(b, h, q_idx, kv_idx):
        q_pos = q_idx + offset
        keep = kv_idx <= q_pos
        if window:
            keep = keep & (q_pos - kv_idx < window)
        if segment is not None:
            keep = keep & (segment[b, q_idx] == segment[b, kv_idx])
        return keep

    return visible


def _create(mod: Callable, batch: Optional[int], q_len: int, kv_len: int, device: torch.device) -> BlockMask:
    # Compiled on CUDA: eager create_block_mask materializes (batch, q_len, kv_len) index tensors. Inside a
    # compiled model it is traced into the graph as is.
    compiled = device.type == "cuda" and not torch.compiler.is_compiling()
    return (_compiled_block_mask if compiled else create_block_mask)(mod, batch, None, q_len, kv_len, device=device)


@functools.lru_cache(maxsize=32)
def _static_block_mask(q_len: int, kv_len: int, window: int, device: torch.device) -> BlockMask:
    return _create(mask_mod(kv_len - q_len, window, None), None, q_len, kv_len, device)


class _DocumentMasks:
    """The block masks of the last ``docs`` tensor seen, one per (T, window): a forward passes one docs tensor to
    every layer, so its masks are built once per batch. The sampler makes a new cu_seqlens tensor per batch; a
    tensor changed in place keeps its (stale) masks."""

    def __init__(self):
        self.docs: Optional[torch.Tensor] = None
        self.masks: dict[tuple[int, int, int], BlockMask] = {}

    def get(self, docs: torch.Tensor, batch: int, seqlen: int, window: int) -> BlockMask:
        if docs is not self.docs:
            self.docs, self.masks = docs, {}
        key = (batch, seqlen, window)
        if key not in self.masks:
            self.masks[key] = document_block_mask(docs, batch, seqlen, window)
        return self.masks[key]


_DOCUMENT_MASKS = _DocumentMasks()


def document_block_mask(docs: torch.Tensor, batch: int, seqlen: int, window: int) -> BlockMask:
    """Block mask of causal attention within the segments of ``docs`` (int32 cu_seqlens of the flattened
    (batch * seqlen) tokens), and within ``window`` keys if > 0; shape (batch, 1, seqlen, seqlen)."""
    return _create(mask_mod(0, window, segment_ids(docs, batch, seqlen)), batch, seqlen, seqlen, docs.device)


def block_mask(q: torch.Tensor, k: torch.Tensor, causal: bool, window: int,
               docs: Optional[torch.Tensor]) -> Optional[BlockMask]:
    """The block mask of one call (see the module docstring), or None where every query sees every key (no
    causal mask, or a single query: a decode step)."""
    (B, _, q_len, _), kv_len = q.shape, k.shape[2]
    if docs is not None:
        if torch.compiler.is_compiling():
            return document_block_mask(docs, B, q_len, window)
        return _DOCUMENT_MASKS.get(docs, B, q_len, window)
    if not (causal or window) or (q_len == 1 and not window):
        return None
    if torch.compiler.is_compiling():
        return _create(mask_mod(kv_len - q_len, window, None), None, q_len, kv_len, q.device)
    return _static_block_mask(q_len, kv_len, window, q.device)


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[BlockMask],
          score_mod: Optional[Callable] = None) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    if q.is_cuda:
        return _compiled_flex(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=gqa)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _flex_cpu_autograd(q, k, v, mask, score_mod)
    if torch.compiler.is_compiling():
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=gqa)
    with warnings.catch_warnings():  # "called without torch.compile": eager on purpose here (the backend warns once)
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=gqa)


def _flex_cpu_autograd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[BlockMask],
                       score_mod: Optional[Callable] = None) -> torch.Tensor:
    """Flex's eager (math) implementation with autograd on CPU: the operator ``flex_attention`` dispatches to,
    called past its CPU backward refusal. It takes GQA (fewer k/v heads) as is."""
    try:
        from torch._higher_order_ops.flex_attention import flex_attention as flex_op

        if mask is None:
            mask = create_block_mask(noop_mask, None, None, q.shape[2], k.shape[2], device=q.device)
        out = flex_op(q, k, v, score_mod or _identity_score, mask.as_tuple(), 1.0 / math.sqrt(q.shape[-1]), {})
    except (ImportError, TypeError) as e:  # the private operator moved or changed its signature
        raise BackendUnavailableError(
            f"attn=flex cannot train on the CPU with torch {torch.__version__}: FlexAttention has no CPU backward "
            f"and its eager operator failed ({type(e).__name__}: {e}); use attn=sdpa on the CPU") from e
    return out[0]  # (out, logsumexp[, max_scores])


def _identity_score(score, b, h, q_idx, kv_idx):
    return score


def _capped(softcap) -> Callable:
    def capped(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return capped


@functools.lru_cache(maxsize=None)
def softcap_score_mod(softcap: float) -> Callable:
    """Logit soft-capping as a Flex ``score_mod``: score -> softcap * tanh(score / softcap), the score already
    scaled by 1/sqrt(head_dim) (Gemma 2; fa2's ``softcap``). Cached: one function object per value."""
    return _capped(softcap)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, window: int = 0,
              docs: Optional[torch.Tensor] = None, softcap: float = 0.0) -> torch.Tensor:
    """FlexAttention with the block mask of (causal, window, docs) and softcap > 0 as a score_mod; see the module
    docstring."""
    score_mod = None
    if softcap:
        # Under torch.compile the layer's softcap can be a symbolic float (dynamic=True), which a score_mod may not
        # capture: a 0-dim tensor then (traced into the graph, no per-call cost).
        score_mod = (_capped(torch.full((), softcap, dtype=torch.float32, device=q.device))
                     if torch.compiler.is_compiling() else softcap_score_mod(float(softcap)))
    return _flex(q, k, v, block_mask(q, k, causal, window, docs), score_mod)
