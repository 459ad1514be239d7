"""Split-K/V decode attention (flash-decoding) in Triton: one new query per (batch, head) against a long K/V prefix.

A decode step has one query row per (batch, head), so the FA2 forward launches only batch * n_heads programs
(12 at batch 1 for GPT-2), each walking all keys alone while most of the GPU idles. Here the keys are split
into `num_splits` slices (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference"):

  1. `_split` kernel, grid (batch * n_heads, num_splits): each program computes the softmax attention of its
     query over its slice: a normalised partial output and the slice's log-sum-exp (base 2), float32;
  2. `_combine` kernel, grid (batch * n_heads,): o = sum_s exp2(lse_s - lse) * o_s with lse = log2 sum_s exp2(lse_s).

One query sees every cached key (the bottom-right causal mask of seqlen_q = 1 masks nothing), so there is no
mask. With `seqlen` (a device tensor) only the first `seqlen` keys count: k, v can then be a whole
preallocated KV cache, so the shapes stay the same from step to step and the step can be captured in a CUDA
graph; the splits are planned over the whole buffer and those past `seqlen` do no work.
`softcap` > 0 caps every score as `fa2_attention` does (softcap * tanh(s / softcap), the constexpr SOFTCAP).
Forward only (inference); registered as the custom op `flashgpt::fa2_decode` so torch.compile keeps it as one node.
"""

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import (
    INTERPRET, LAUNCH_OPTIONS, block_d, cdiv, check_grid, head_ptr, load_tile, next_power_of_2, softcap_args, tanh,
)
from .frontend import check_softcap, check_softcap_scale, type_name, validate

LOG2E = math.log2(math.e)
BLOCK_N = 64  # keys per inner step; a split is a multiple of it


@triton.jit
def _split(
    Q, K, V, O_PART, LSE_PART,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    n_heads, seqlen_k, split_size, num_splits, qk_scale, softcap_scale, SEQLEN,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SEQLEN: tl.constexpr, SOFTCAP: tl.constexpr,
):
    off_bh, split = tl.program_id(0), tl.program_id(1)
    if HAS_SEQLEN:  # the number of valid keys, read on the device (static shapes)
        seqlen_k = tl.minimum(tl.load(SEQLEN), seqlen_k).to(tl.int32)  # clamped in the tensor's width first
    off_b, off_h = off_bh // n_heads, off_bh % n_heads
    off_hk = off_h // GROUP  # GQA: GROUP query heads share one K/V head
    k_base = head_ptr(K, off_b, stride_kb, off_hk, stride_kh)
    v_base = head_ptr(V, off_b, stride_vb, off_hk, stride_vh)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(head_ptr(Q, off_b, stride_qb, off_h, stride_qh) + offs_d, mask=offs_d < HEAD_DIM, other=0.0)
    # [BLOCK_D]; the scale (with log2 e) folded in once; with SOFTCAP the one inside the tanh (fa2's _fwd)
    q = q.to(tl.float32) * (softcap_scale if SOFTCAP else qk_scale)

    lo = split * split_size
    hi = tl.minimum(lo + split_size, seqlen_k)  # empty (hi <= lo) only for splits past SEQLEN
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        # one query row: a tl.dot would need >= 16 rows, so the scores are a broadcast multiply and a row sum
        k = load_tile(k_base, cols, stride_kn, hi, offs_d, HEAD_DIM, BLOCK_D, True).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1)  # [BLOCK_N], base 2
        if SOFTCAP:
            s = tanh(s) * qk_scale
        s = tl.where(cols < hi, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.math.exp2(m_i - m_new)  # 0 on the first step (m_i = -inf, m_new finite)
        p = tl.math.exp2(s - m_new)
        v = load_tile(v_base, cols, stride_vn, hi, offs_d, HEAD_DIM, BLOCK_D, True).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    part = off_bh.to(tl.int64) * num_splits + split
    empty = l_i == 0.0  # an empty split: output 0, LSE -inf (weight 0 in the combine)
    l_i = tl.where(empty, 1.0, l_i)
    tl.store(O_PART + part * BLOCK_D + offs_d, acc / l_i)
    tl.store(LSE_PART + part, tl.where(empty, -float("inf"), m_i + tl.math.log2(l_i)))


@triton.jit
def _combine(
    O_PART, LSE_PART, O, stride_ob, stride_oh, n_heads, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    off_bh = tl.program_id(0)
    off_b, off_h = off_bh // n_heads, off_bh % n_heads
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    base = off_bh.to(tl.int64) * num_splits
    lse = tl.load(LSE_PART + base + offs_s, mask=offs_s < num_splits, other=-float("inf"))
    w = tl.math.exp2(lse - tl.max(lse, axis=0))
    w = w / tl.sum(w, axis=0)
    o = tl.load(O_PART + (base + offs_s[:, None]) * BLOCK_D + offs_d[None, :], mask=offs_s[:, None] < num_splits,
                other=0.0)
    o = tl.sum(w[:, None] * o, axis=0)
    tl.store(head_ptr(O, off_b, stride_ob, off_h, stride_oh) + offs_d, o.to(O.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def default_num_splits(batch: int, n_heads: int, seqlen_k: int, device: torch.device) -> int:
    """Enough splits for about two programs per SM (one per 4 "SMs" under the interpreter), at most one per
    BLOCK_N keys."""
    sms = 4 if INTERPRET else torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(cdiv(2 * sms, batch * n_heads), cdiv(seqlen_k, BLOCK_N)))


def _forward(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, num_splits: int, seqlen: Tensor | None,
             softcap: float = 0.0) -> Tensor:
    batch, n_heads, _, head_dim = q.shape
    n_kv_heads, seqlen_k = k.shape[1], k.shape[2]
    check_grid(batch, n_heads)
    if num_splits <= 0:
        num_splits = default_num_splits(batch, n_heads, seqlen_k, q.device)
    split_size = cdiv(cdiv(seqlen_k, num_splits), BLOCK_N) * BLOCK_N
    num_splits = cdiv(seqlen_k, split_size)  # no empty split (unless seqlen < seqlen_k)
    bd = block_d(head_dim)
    o_part = torch.empty((batch * n_heads, num_splits, bd), device=q.device, dtype=torch.float32)
    lse_part = torch.empty((batch * n_heads, num_splits), device=q.device, dtype=torch.float32)
    qk_scale, softcap_scale = softcap_args(softmax_scale, softcap, LOG2E)
    _split[(batch * n_heads, num_splits)](
        q, k, v, o_part, lse_part, q.stride(0), q.stride(1), *k.stride()[:3], *v.stride()[:3],
        n_heads, seqlen_k, split_size, num_splits, qk_scale, softcap_scale, seqlen,
        GROUP=n_heads // n_kv_heads, HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_N=BLOCK_N, HAS_SEQLEN=seqlen is not None,
        SOFTCAP=softcap > 0, **LAUNCH_OPTIONS,
    )
    o = torch.empty_like(q)
    _combine[(batch * n_heads,)](
        o_part, lse_part, o, o.stride(0), o.stride(1), n_heads, num_splits,
        HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_S=max(2, next_power_of_2(num_splits)), **LAUNCH_OPTIONS,
    )
    return o


@torch.library.custom_op("flashgpt::fa2_decode", mutates_args=())
def _decode_op(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, num_splits: int,
               seqlen: Tensor | None = None, softcap: float = 0.0) -> Tensor:
    return _forward(q, k, v, softmax_scale, num_splits, seqlen, softcap)


@_decode_op.register_fake
def _(q, k, v, softmax_scale, num_splits, seqlen=None, softcap=0.0):
    return torch.empty_like(q)


def _no_backward(ctx, grad_o):
    raise RuntimeError("fa2_decode is not differentiable (a decode step of inference): call it under torch.no_grad(), "
                       "or use fa2_attention, whose backward exists, for gradients")


# a backward that says why, in place of torch.library's "no autograd formula was registered"
_decode_op.register_autograd(_no_backward)


def fa2_decode(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float | None = None,
               num_splits: int | None = None, seqlen: Tensor | None = None, softcap: float = 0.0) -> Tensor:
    """Attention of one query per (batch, head) over all of k, v, with the keys split across programs.

    Args:
        q: (batch, n_heads, 1, head_dim), float16, bfloat16 or float32, CUDA (or CPU under TRITON_INTERPRET=1).
        k, v: (batch, n_kv_heads, seqlen_k, head_dim), same dtype and device; n_heads a multiple of n_kv_heads.
           Views with a contiguous last dim (e.g. a KV cache's prefix k_cache[:, :, :n]) are read in place.
        softmax_scale: multiplier of q k^T; default 1 / sqrt(head_dim).
        num_splits: slices of the keys, each handled by its own program; default: about two programs per SM.
        seqlen: optional integer tensor of one element on q's device: only keys 0 .. seqlen-1 count (k, v may
           be a whole KV cache; the value is read on the device, so it is not checked: it must be >= 1 (below 1
           the output is NaN), and values above seqlen_k count as seqlen_k).
        softcap: logit soft-capping as in `fa2_attention` (a float >= 0, 0.0 = off).

    Returns:
        o, like q: softmax(q k^T * softmax_scale) v (scores capped with softcap), as
        ``fa2_attention(q, k, v, causal=True, softcap=softcap)`` for seqlen_q = 1
        (with ``seqlen``: over k[:, :, :seqlen], v[:, :, :seqlen]).
        Not differentiable: a backward through it raises RuntimeError.

    Raises:
        ValueError: seqlen_q != 1, num_splits < 1, a seqlen that is not a one-element integer tensor on q's
            device, or anything ``fa2_attention`` rejects (softcap too).
        TypeError: as ``fa2_attention``, and a num_splits that is not an int (a bool included).
    """
    validate(q, k, v, True, softmax_scale)
    check_softcap(softcap, "fa2_decode", True)
    if q.shape[2] != 1:
        raise ValueError(f"fa2_decode takes one query per (batch, head); got seqlen_q={q.shape[2]}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)):
        raise TypeError(f"num_splits must be an int or None, got {type_name(num_splits)}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 or None, got {num_splits}")
    if seqlen is not None and (not isinstance(seqlen, Tensor) or seqlen.numel() != 1 or seqlen.is_floating_point()
                               or seqlen.is_complex() or seqlen.dtype == torch.bool or seqlen.device != q.device):
        raise ValueError(f"seqlen must be a one-element integer tensor on {q.device}, got {seqlen!r}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    check_softcap_scale(softmax_scale, softcap)
    k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    q = q.contiguous()
    return _decode_op(q, k, v, float(softmax_scale), num_splits or 0, seqlen, float(softcap))
