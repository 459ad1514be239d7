"""FlashAttention-1 baseline in Triton: the FA1-style kernel that `../shared/seed/fa2-triton-post.md` starts from.

Source: Tri Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness" (2022),
Algorithm 1 (forward) and Algorithm 4 (backward), in the form the seed write-up describes for its FA1 kernel:

  - the accumulator is kept normalised after every K/V block: acc = diag(l_new)^-1 (diag(l_old) e^(m_old -
    m_new) acc + e^(m_ij - m_new) P V), one division per K/V block;
  - natural `exp`, and a natural-log LSE;
  - causal: "FA1 traverses every K/V block and checks the causal mask condition each time" (the write-up);
    so the forward and both backward loops visit every block, masked, with no stage split and no loop bound
    that skips future blocks (FA2's stages are what removes that work);
  - fixed BLOCK_M = BLOCK_N = 64, no autotune; products added as `acc += tl.dot(p, v)`.
  - backward in three kernels: preprocess delta (`common.bwd_preprocess`), dK/dV (outer loop over K/V blocks),
    dQ (outer loop over Q blocks); no atomics.

Shapes, GQA, masks (bottom-right aligned) and errors are those of `fa2_attention`: the front end is shared.
"""

import torch
import triton
import triton.language as tl

from .common import (
    LAUNCH_OPTIONS, block_d, bwd_preprocess, cdiv, check_grid, empty_like_layout, grad_buffers, head_ptr, load_tile,
    mma, store_tile, upcast_dot, visible_mask,
)
from .launch import launch

BLOCK_M = 64
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 2


@triton.jit
def _fwd(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
    n_heads, seqlen_q, seqlen_k, softmax_scale,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b, off_h = off_bh // n_heads, off_bh % n_heads
    off_hk = off_h // GROUP
    q_base = head_ptr(Q, off_b, stride_qb, off_h, stride_qh)
    k_base = head_ptr(K, off_b, stride_kb, off_hk, stride_kh)
    v_base = head_ptr(V, off_b, stride_vb, off_hk, stride_vh)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = load_tile(q_base, offs_m, stride_qm, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, True)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    diag_offset = seqlen_k - seqlen_q

    for start_n in range(0, seqlen_k, BLOCK_N):  # every K/V block, masked each time
        cols = start_n + offs_n
        k = load_tile(k_base, cols, stride_kn, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, True)
        s = mma(q, tl.trans(k), None, UPCAST) * softmax_scale
        visible = visible_mask(offs_m[:, None], cols[None, :], seqlen_k, diag_offset, 0, 0, False, CAUSAL)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see no key yet stay finite
        p = tl.exp(s - m_ref[:, None])
        alpha = tl.exp(m_i - m_ref)
        l_new = alpha * l_i + tl.sum(p, 1)
        l_div = tl.where(l_new == 0.0, 1.0, l_new)
        # Keep acc normalised: rescale the old part by l_old * alpha / l_new, divide the new P by l_new.
        acc = acc * (l_i * alpha / l_div)[:, None]
        p = p / l_div[:, None]
        v = load_tile(v_base, cols, stride_vn, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, True)
        acc += mma(p.to(v.dtype), v, None, UPCAST)
        l_i = l_new
        m_i = m_new

    # Rows that saw no key: acc is 0 already; internal LSE +inf (the backward then gets P = 0).
    lse = tl.where(m_i == float("-inf"), float("inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
    o_base = head_ptr(O, off_b, stride_ob, off_h, stride_oh)
    store_tile(o_base, acc.to(O.dtype.element_ty), offs_m, stride_om, seqlen_q, offs_d, HEAD_DIM, BLOCK_D)
    tl.store(LSE + off_bh.to(tl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)


def forward(q, k, v, causal, softmax_scale):
    """Launch the forward kernel. Returns o (like q) and the natural-log LSE, float32 (batch, n_heads, seqlen_q)."""
    batch, n_heads, seqlen_q, head_dim = q.shape
    n_kv_heads, seqlen_k = k.shape[1], k.shape[2]
    check_grid(batch, n_heads)
    o = empty_like_layout(q)
    lse = torch.empty((batch, n_heads, seqlen_q), device=q.device, dtype=torch.float32)
    grid = (cdiv(seqlen_q, BLOCK_M), batch * n_heads)
    launch(
        _fwd, grid,
        q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
        n_heads, seqlen_q, seqlen_k, softmax_scale,
        GROUP=n_heads // n_kv_heads, CAUSAL=causal, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim),
        UPCAST=upcast_dot(q.dtype), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        **LAUNCH_OPTIONS,
    )
    return o, lse


@triton.jit
def _bwd_dkdv(
    Q, K, V, DO, DK, DV, LSE, DELTA,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    n_heads, seqlen_q, seqlen_k, softmax_scale,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    n_kv_heads = n_heads // GROUP
    off_b, off_hk = tl.program_id(1) // n_kv_heads, tl.program_id(1) % n_kv_heads
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k_base = head_ptr(K, off_b, stride_kb, off_hk, stride_kh)
    v_base = head_ptr(V, off_b, stride_vb, off_hk, stride_vh)
    k = load_tile(k_base, offs_n, stride_kn, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, True)
    v = load_tile(v_base, offs_n, stride_vn, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    diag_offset = seqlen_k - seqlen_q

    for g in range(GROUP):  # the query heads that share this K/V head, in order: no atomics
        off_h = off_hk * GROUP + g
        off_bh = off_b * n_heads + off_h
        q_base = head_ptr(Q, off_b, stride_qb, off_h, stride_qh)
        do_base = head_ptr(DO, off_b, stride_dob, off_h, stride_doh)
        for start_m in range(0, seqlen_q, BLOCK_M):  # every Q block, masked each time
            offs_m = start_m + offs_m0
            row_ok = offs_m < seqlen_q
            q = load_tile(q_base, offs_m, stride_qm, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, True)
            do = load_tile(do_base, offs_m, stride_dom, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, True)
            lse = tl.load(LSE + off_bh.to(tl.int64) * seqlen_q + offs_m, mask=row_ok, other=float("inf"))
            delta = tl.load(DELTA + off_bh.to(tl.int64) * seqlen_q + offs_m, mask=row_ok, other=0.0)
            s = mma(q, tl.trans(k), None, UPCAST) * softmax_scale  # (BLOCK_M, BLOCK_N)
            visible = visible_mask(offs_m[:, None], offs_n[None, :], seqlen_k, diag_offset, 0, 0, False, CAUSAL)
            p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
            dv += mma(tl.trans(p).to(do.dtype), do, None, UPCAST)
            dp = mma(do, tl.trans(v), None, UPCAST)
            ds = p * (dp - delta[:, None])
            dk += mma(tl.trans(ds).to(q.dtype), q, None, UPCAST)

    dk = dk * softmax_scale
    dk_base = head_ptr(DK, off_b, stride_dkb, off_hk, stride_dkh)
    dv_base = head_ptr(DV, off_b, stride_dvb, off_hk, stride_dvh)
    store_tile(dk_base, dk.to(DK.dtype.element_ty), offs_n, stride_dkn, seqlen_k, offs_d, HEAD_DIM, BLOCK_D)
    store_tile(dv_base, dv.to(DV.dtype.element_ty), offs_n, stride_dvn, seqlen_k, offs_d, HEAD_DIM, BLOCK_D)


@triton.jit
def _bwd_dq(
    Q, K, V, DO, DQ, LSE, DELTA,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_dqb, stride_dqh, stride_dqm,
    n_heads, seqlen_q, seqlen_k, softmax_scale,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b, off_h = off_bh // n_heads, off_bh % n_heads
    off_hk = off_h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_base = head_ptr(Q, off_b, stride_qb, off_h, stride_qh)
    do_base = head_ptr(DO, off_b, stride_dob, off_h, stride_doh)
    k_base = head_ptr(K, off_b, stride_kb, off_hk, stride_kh)
    v_base = head_ptr(V, off_b, stride_vb, off_hk, stride_vh)
    q = load_tile(q_base, offs_m, stride_qm, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, True)
    do = load_tile(do_base, offs_m, stride_dom, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, True)
    row_ok = offs_m < seqlen_q
    lse = tl.load(LSE + off_bh.to(tl.int64) * seqlen_q + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + off_bh.to(tl.int64) * seqlen_q + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    diag_offset = seqlen_k - seqlen_q

    for start_n in range(0, seqlen_k, BLOCK_N):  # every K/V block, masked each time
        cols = start_n + offs_n0
        k = load_tile(k_base, cols, stride_kn, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, True)
        v = load_tile(v_base, cols, stride_vn, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, True)
        s = mma(q, tl.trans(k), None, UPCAST) * softmax_scale
        visible = visible_mask(offs_m[:, None], cols[None, :], seqlen_k, diag_offset, 0, 0, False, CAUSAL)
        p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
        dp = mma(do, tl.trans(v), None, UPCAST)
        ds = p * (dp - delta[:, None])
        dq += mma(ds.to(k.dtype), k, None, UPCAST)

    dq = dq * softmax_scale
    dq_base = head_ptr(DQ, off_b, stride_dqb, off_h, stride_dqh)
    store_tile(dq_base, dq.to(DQ.dtype.element_ty), offs_m, stride_dqm, seqlen_q, offs_d, HEAD_DIM, BLOCK_D)


def backward(do, q, k, v, o, lse, causal, softmax_scale, out=None):
    """Launch the three backward kernels. `lse` is the forward's natural-log LSE. Returns dq, dk, dv (written into
    `out` when given: `common.grad_buffers`)."""
    batch, n_heads, seqlen_q, head_dim = q.shape
    n_kv_heads, seqlen_k = k.shape[1], k.shape[2]
    delta = bwd_preprocess(o, do)
    dq, dk, dv = grad_buffers(q, k, v, out)
    meta = dict(
        GROUP=n_heads // n_kv_heads, CAUSAL=causal, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim),
        UPCAST=upcast_dot(q.dtype), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        **LAUNCH_OPTIONS,
    )
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
    launch(
        _bwd_dkdv, (cdiv(seqlen_k, BLOCK_N), batch * n_kv_heads),
        q, k, v, do, dk, dv, lse, delta, *strides, *dk.stride()[:3], *dv.stride()[:3],
        n_heads, seqlen_q, seqlen_k, softmax_scale, **meta,
    )
    launch(
        _bwd_dq, (cdiv(seqlen_q, BLOCK_M), batch * n_heads),
        q, k, v, do, dq, lse, delta, *strides, *dq.stride()[:3], n_heads, seqlen_q, seqlen_k, softmax_scale, **meta,
    )
    return dq, dk, dv
