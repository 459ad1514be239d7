"""The front end shared by the FA1 and FA2 kernels: input validation, layout handling, and registration as a
differentiable `torch.library` custom op (so `torch.compile(..., fullgraph=True)` keeps it in one graph).

A kernel module provides two launchers:

    forward(q, k, v, causal, softmax_scale) -> (o, lse_internal)
    backward(do, q, k, v, o, lse_internal, causal, softmax_scale) -> (dq, dk, dv)

`lse_internal` is float32 (batch, n_heads, seqlen_q) in the kernel's own log base (2 for FA2, e for FA1),
with +inf for query rows that see no key, so the backward's `exp(s - lse)` is exactly 0 there.
`make_attention` turns the pair into the public function `fa*_attention(q, k, v, causal, softmax_scale,
return_lse)`. Everything that differs between FA1 and FA2 lives in their Triton kernels.
"""

import math
from typing import Callable

import torch
from torch import Tensor

from .common import INTERPRET

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256

ForwardLauncher = Callable[[Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor]]
BackwardLauncher = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor, Tensor]]


def validate(q, k, v, causal, softmax_scale) -> None:
    """Raise TypeError/ValueError naming the offending argument; see `make_attention` for the contract."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (batch, heads, seqlen, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}")
    if q.device.type == "cpu" and not INTERPRET:
        raise ValueError(
            "q, k, v are CPU tensors, but the Triton kernels run on a CUDA GPU: move them to a CUDA device, "
            "or set TRITON_INTERPRET=1 before importing `kernels` to run them (slowly) through Triton's interpreter"
        )
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q, k, v are on {q.device}; supported: CUDA (or CPU under TRITON_INTERPRET=1)")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k={tuple(k.shape)}, v={tuple(v.shape)}")
    (batch, n_heads, seqlen_q, head_dim), (batch_k, n_kv_heads, seqlen_k, head_dim_k) = q.shape, k.shape
    if batch_k != batch:
        raise ValueError(f"batch size differs: q has {batch}, k/v have {batch_k}")
    if head_dim_k != head_dim:
        raise ValueError(f"head_dim differs: q has {head_dim}, k/v have {head_dim_k}")
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim={head_dim} is out of range; supported: {MIN_HEAD_DIM} to {MAX_HEAD_DIM}")
    if n_kv_heads == 0 or n_heads % n_kv_heads != 0:
        raise ValueError(f"n_heads={n_heads} (q) must be a multiple of n_kv_heads={n_kv_heads} (k, v)")
    if seqlen_q == 0 or seqlen_k == 0 or batch == 0:
        raise ValueError(f"batch, seqlen_q and seqlen_k must be >= 1, got q={tuple(q.shape)}, k={tuple(k.shape)}")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale)):
        raise ValueError(f"softmax_scale must be a finite number or None, got {softmax_scale!r}")


def last_dim_contiguous(t: Tensor) -> Tensor:
    """Views with a unit-stride last dim (e.g. x.view(B, T, H, D).transpose(1, 2)) pass as they are."""
    return t if t.stride(-1) == 1 else t.contiguous()


def make_attention(name: str, forward: ForwardLauncher, backward: BackwardLauncher, lse_log_base: float):
    """Register `forward`/`backward` as the custom op `flashgpt::{name}_forward` with autograd, and return the
    public attention function. `lse_log_base` is the base of the kernels' internal LSE (2 or e)."""

    @torch.library.custom_op(f"flashgpt::{name}_forward", mutates_args=())
    def forward_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float) -> tuple[Tensor, Tensor]:
        return forward(q, k, v, causal, softmax_scale)

    @forward_op.register_fake
    def _(q, k, v, causal, softmax_scale):
        return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)

    @torch.library.custom_op(f"flashgpt::{name}_backward", mutates_args=())
    def backward_op(
        do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool, softmax_scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        return backward(last_dim_contiguous(do), q, k, v, o, lse, causal, softmax_scale)

    @backward_op.register_fake
    def _(do, q, k, v, o, lse, causal, softmax_scale):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        q, k, v, causal, softmax_scale = inputs
        o, lse = output
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.softmax_scale = causal, softmax_scale

    def backward_rule(ctx, do, dlse):
        # The LSE output is returned detached (as in flash-attn); only o carries a gradient.
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = backward_op(do, q, k, v, o, lse, ctx.causal, ctx.softmax_scale)
        return dq, dk, dv, None, None

    forward_op.register_autograd(backward_rule, setup_context=setup_context)
    to_natural = math.log(lse_log_base)

    def attention(q, k, v, causal=False, softmax_scale=None, return_lse=False):
        validate(q, k, v, causal, softmax_scale)
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(q.shape[-1])
        q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
        o, lse = forward_op(q, k, v, causal, float(softmax_scale))
        if not return_lse:
            return o
        # Internal +inf marks rows that see no key; the log-sum-exp of an empty set is -inf.
        lse = torch.where(torch.isinf(lse), float("-inf"), lse * to_natural).detach()
        return o, lse

    attention.__name__ = f"{name}_attention"
    return attention


PUBLIC_DOC = """{title}

    Computes o = softmax(q k^T * softmax_scale [+ causal mask]) v for every (batch, head), without materialising
    the (seqlen_q, seqlen_k) score matrix. Source: {source}

    Args:
        q: (batch, n_heads, seqlen_q, head_dim), float16, bfloat16 or float32 (float32 runs the matmuls in
           TF32 on the GPU), on a CUDA device (or the CPU under TRITON_INTERPRET=1).
        k, v: (batch, n_kv_heads, seqlen_k, head_dim), same dtype and device as q. n_heads must be a multiple of
           n_kv_heads (GQA/MQA): query head h reads K/V head h // (n_heads // n_kv_heads), with no copy.
           head_dim is any value from 16 to 256 (e.g. 80, 96); seqlen_q, seqlen_k >= 1, any value.
           Strided views whose last dim is contiguous (e.g. x.view(B, T, H, D).transpose(1, 2)) are used
           without a copy; other layouts are copied once.
        causal: if True, query i sees key j only when j <= i + seqlen_k - seqlen_q (the mask is aligned to the
           bottom-right corner, as in FlashAttention >= 2.1; for seqlen_q == seqlen_k this is j <= i). A query
           row that sees no key (possible when seqlen_q > seqlen_k) gets 0 output, 0 gradient and lse = -inf.
        softmax_scale: multiplier of q k^T; default 1 / sqrt(head_dim).
        return_lse: also return the log-sum-exp of each query row's scaled scores.

    Returns:
        o: like q in shape, dtype and device; or (o, lse) with lse (batch, n_heads, seqlen_q), float32, natural
        log (returned without gradient). Differentiable w.r.t. q, k and v; gradients are deterministic (no atomics).

    Raises:
        TypeError: a non-tensor input, unsupported or mismatched dtypes, a non-bool causal.
        ValueError: wrong rank, mismatched batch / head_dim / device / k-v shapes, n_heads not a multiple of
            n_kv_heads, head_dim outside 16..256, an empty dimension, a non-finite softmax_scale, or CPU tensors
            when Triton's interpreter is off (use a CUDA GPU or set TRITON_INTERPRET=1 before importing kernels).
    """
