"""FlashAttention-2 in Triton: forward and a three-kernel backward.

Source: Tri Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning" (2023),
Algorithm 1 (forward) and Algorithm 2 (backward), as moved from an FA1 Triton kernel in
`../shared/seed/fa2-triton-post.md`. The five changes over FA1 (`kernels/fa1.py`) are marked [1]..[5]:

  [1] un-scaled accumulation: `acc` is only rescaled by alpha = exp2(m_old - m_new) per K/V block and
      divided by l once, after the loop;
  [2] exp2: log2(e) is folded into the softmax scale once (`qk_scale`); the LSE is kept in base 2 and the
      front end returns it in natural log; m_i starts at -inf and l_i at 1.0, so the first alpha is 0;
  [3] masks in stages (`MASKED` is a tl.constexpr): K/V blocks every row of a Q block sees whole run with no
      mask (the write-up's STAGE 1 / STAGE 3), only the edge blocks are masked (STAGE 2: the causal diagonal,
      a sliding window's two edges, the block in which seqlen_k ends), blocks no row sees are never visited
      (`_stages`; the dK/dV kernel limits its loop over Q blocks the same way);
  [4] tl.dot(a, b, acc) accumulates in place (forward and backward);
  [5] @triton.autotune over BLOCK_M, BLOCK_N, num_warps, num_stages, keyed on power-of-two length buckets.

Backward: preprocess delta = rowsum(dO * O) (`common.bwd_preprocess`); dK/dV with the outer loop over K/V
blocks and the inner over Q blocks (and over the query heads that share a K/V head, so GQA needs no atomics);
dQ with the outer loop over Q blocks and the inner over K/V blocks. No atomics: gradients are bit-identical
from run to run.

Masks follow flash-attn (>= 2.1): aligned bottom-right, query i sees key j iff
i + diag_offset - window_left <= j <= i + diag_offset + window_right, diag_offset = seqlen_k - seqlen_q, a side
without a limit is unchecked (constexprs LEFT / RIGHT), causal is RIGHT with window_right = 0. Packed
variable-length sequences (VARLEN) are one (1, heads, total, head_dim) view; each program reads its sequence's
rows from cu_seqlens and applies the same masks within it, so another sequence's keys are never visited.

Logit soft-capping (Gemma 2, Gemma Team 2024; flash-attn's `softcap` argument): with softcap > 0 every score
s = softmax_scale * q.k becomes softcap * tanh(s / softcap) before the mask and the softmax. It is the constexpr
SOFTCAP, so the kernels without it compile as before. The kernels compute t = tanh(q.k * softcap_scale),
softcap_scale = softmax_scale / softcap, and use t where they used q.k, with qk_scale = softcap * log2(e) in place
of softmax_scale * log2(e) [2]; the row maxima stay max(t) * qk_scale, as tanh is increasing. The backward
recomputes t and multiplies dS by d(softcap * tanh(s / softcap)) / ds = 1 - t^2; dQ and dK keep their final
softmax_scale (the chain rule's ds / d(q.k)).
"""

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import (
    INTERPRET, LAUNCH_OPTIONS, block_d, bucket, bwd_preprocess, cdiv, check_grid, compile_sm90, empty_like_layout,
    grad_buffers,
    head_ptr, load_rows, load_tile, mma, next_power_of_2, softcap_args, store_tile, tanh, tile_source, upcast_dot,
    use_tma, visible_mask,
)
from .launch import launch

LOG2E = math.log2(math.e)


class Options(NamedTuple):
    """How the kernels run, not what they compute; the defaults measured fastest on the H200 (docs/hopper-notes.md).
    `forward` and `backward` take one (`options=`, default `DEFAULT_OPTIONS`, which the public functions use);
    the tuning tools pass their own."""
    tma: bool = True  # inner-loop tiles through TMA where the inputs allow (`common.use_tma`); False: pointers
    # Backward grid with packed sequences: "padded" = (cdiv(max_seqlen, BLOCK), sequences * heads), where every
    # program past its sequence's end returns at once (most of them with many short sequences); "flat" = only the
    # real blocks, sequence after sequence (`_flat_block`); "lpt" = only the real blocks, the longest-running first.
    varlen_bwd_grid: str = "lpt"
    # Packed-sequence backward autotunes over the short-sequence tiles (`_DKDV_VARLEN_SHAPES`, `_DQ_VARLEN_SHAPES`)
    varlen_bwd_tiles: bool = True


DEFAULT_OPTIONS = Options()
VARLEN_BWD_GRIDS = ("padded", "flat", "lpt")


# ---------------------------------------------------------------------------------------------- autotune
def _configs(shapes, interpret_shape=(32, 16)):
    if INTERPRET:  # one small config: the interpreter is slow, and BLOCK_M != BLOCK_N exercises the stage logic
        block_m, block_n = interpret_shape
        return [triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "TMA": True}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "TMA": tma}, num_warps=w, num_stages=s)
            for m, n, w, s, tma in shapes]


def _prune(max_tile, n_dense=None, broken=None):
    """Drop configs whose tile is too large for the head dim (they would spill registers or miss shared memory).
    With n_dense, the configs are a dense list followed by a varlen list: keep the varlen one only for VARLEN
    inputs with VARLEN_TILES (`Options.varlen_bwd_tiles`, part of the autotune key).
    broken(config, args): True for a config the GPU compiler cannot build for these arguments."""

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        head_dim = args["HEAD_DIM"]
        if n_dense is not None:
            configs = configs[n_dense:] if args["VARLEN"] and args["VARLEN_TILES"] else configs[:n_dense]
        if broken is not None:
            configs = [c for c in configs if not broken(c, args)]
        kept = [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * block_d(head_dim) <= max_tile]
        return kept or configs[-1:]

    return prune


def _dkdv_broken(config, args):
    """ptxas of CUDA 12.8 (Triton 3.6) segfaults on the TMA dK/dV kernel with 2 stages and no right limit (no
    causal, no right window), at every head dim (found by `compile_for_sm90` offline; Triton 3.9 compiles it).
    The autotuner skipped it anyway, after printing the whole PTX; 3 stages build."""
    return config.kwargs["TMA"] and config.num_stages == 2 and not args["RIGHT"]


_KEY = ["M_BUCKET", "N_BUCKET", "HEAD_DIM", "LEFT", "RIGHT", "VARLEN", "GROUP", "TMA_OK", "SOFTCAP"]
_BWD_KEY = _KEY + ["VARLEN_TILES"]
# (BLOCK_M, BLOCK_N, num_warps, num_stages, TMA): per kernel, the winners of `python -m tools.fa2_configs` on
# the H200 (docs/hopper-notes.md); the last one fits every head dim. Few on purpose: every config is compiled
# on the first use of a shape bucket.
_FWD_SHAPES = [(128, 64, 8, 3, False), (128, 64, 4, 2, True), (64, 128, 4, 3, True), (64, 64, 4, 3, True),
               (64, 64, 4, 2, False)]
_DKDV_SHAPES = [(64, 64, 4, 2, True), (64, 64, 4, 3, True), (32, 128, 4, 3, False), (64, 64, 4, 2, False)]
_DQ_SHAPES = [(128, 64, 8, 3, False), (128, 64, 8, 3, True), (64, 64, 4, 2, False)]
# Varlen backward with short sequences (median ~600 tokens): smaller tiles waste less on each sequence's
# diagonal and last block and give more programs to balance; pointer loads skip building TMA descriptors in
# programs that run only a few blocks. Used with `Options.varlen_bwd_tiles` (else the dense lists). Measured (H200,
# `bench.masks --mode varlen`, docs/benchmarks.md): lpt grid + these tiles 0.66 ms backward, padded grid + dense
# tiles 0.73-0.94 ms.
_DKDV_VARLEN_SHAPES = [(64, 64, 4, 2, True), (64, 64, 4, 3, True), (32, 64, 4, 2, True), (32, 128, 4, 3, False),
                       (32, 64, 4, 3, False)]
_DQ_VARLEN_SHAPES = [(128, 64, 8, 3, False), (128, 64, 8, 3, True), (64, 64, 4, 2, True), (64, 64, 4, 2, False)]
_FLAT_MAX_SEQS = 1024  # the flat grids hold every sequence's block count in registers: more take the padded grid



# ---------------------------------------------------------------------------------------------- masks
@triton.jit
def _stages(start, offset, before, after, n_inner, BEFORE: tl.constexpr, AFTER: tl.constexpr,
            BLOCK_OUTER: tl.constexpr, BLOCK_INNER: tl.constexpr):
    """Which inner blocks the outer block [start, start + BLOCK_OUTER) visits [3], when outer index x sees inner
    index y iff 0 <= y < n_inner and

        x + offset - before <= y <= x + offset + after      (a side is unlimited unless BEFORE / AFTER).

    Returns block-aligned lo <= lo_free <= hi_free, and hi: masked [lo, lo_free) (the window's left edge),
    unmasked [lo_free, hi_free) (every y seen by every x of the block: full inner blocks only), masked
    [hi_free, hi) (the right edge: the causal diagonal, the window, or where n_inner ends inside a block).
    Inner blocks outside [lo, hi) are never visited.

    Forward and dQ: x = query row, y = key, offset = seqlen_k - seqlen_q, (before, after) = the window.
    dK/dV: x = key, y = query row: the same band seen from the other side (offset negated, sides swapped).
    """
    end = start + BLOCK_OUTER - 1  # the block's last outer index
    # Unlimited sides: whole range, as int32 tensors (start * 0) like the limited ones, whichever sides are set.
    lo = start * 0
    lo_free = start * 0
    hi = n_inner + start * 0
    hi_free = (n_inner // BLOCK_INNER) * BLOCK_INNER + start * 0
    if BEFORE:  # clamp at 0 before dividing: the GPU's integer division truncates toward 0
        lo = (tl.maximum(start + offset - before, 0) // BLOCK_INNER) * BLOCK_INNER
        lo_free = tl.cdiv(tl.maximum(end + offset - before, 0), BLOCK_INNER) * BLOCK_INNER
    if AFTER:
        hi = tl.minimum(end + offset + after + 1, n_inner)
        hi_free = (tl.maximum(tl.minimum(start + offset + after + 1, n_inner), 0) // BLOCK_INNER) * BLOCK_INNER
    # A band narrower than a block has no unmasked middle: both edges then share one masked range.
    hi_free = tl.maximum(hi_free, lo)
    lo_free = tl.minimum(tl.maximum(lo_free, lo), hi_free)
    return lo, lo_free, hi_free, hi


@triton.jit
def _sequence(CU_Q, CU_K, off_b, seqlen_q, seqlen_k, VARLEN: tl.constexpr):
    """Where sequence off_b lies: (batch index for the strides, first query row, seqlen_q, first key row, seqlen_k).

    Varlen: the sequences lie back to back along the rows of a (1, heads, total, head_dim) view, so the batch
    stride is unused (index 0) and each sequence's rows come from cu_seqlens.
    """
    if VARLEN:  # (off_b * 0: int32 tensors in both branches, like the loads)
        q_start = tl.load(CU_Q + off_b)
        k_start = tl.load(CU_K + off_b)
        seq_q = tl.load(CU_Q + off_b + 1) - q_start
        seq_k = tl.load(CU_K + off_b + 1) - k_start
        b = off_b * 0
    else:
        q_start = off_b * 0
        k_start = off_b * 0
        seq_q = seqlen_q + off_b * 0
        seq_k = seqlen_k + off_b * 0
        b = off_b
    return b, q_start, seq_q, k_start, seq_k


@triton.jit
def _flat_block(CU, n_seqs, pid, BLOCK: tl.constexpr, SEQS: tl.constexpr, LPT: tl.constexpr):
    """Which block of which sequence program pid of a flat grid handles, the grid holding only the real blocks:
    every sequence's cdiv(length, BLOCK) blocks, at most cdiv(total, BLOCK) + n_seqs programs. Returns
    (sequence, level, the sequence's block count); sequence >= n_seqs for a program past the last block.

    Document order (not LPT): pid runs through the blocks of sequence 0, then 1, ..., each from the highest level.
    LPT (longest processing time first): pid runs through the levels from the highest down, at each level every
    sequence with more blocks than it; under a causal mask the level is the number of blocks the program visits
    (dQ: its block index, dK/dV: blocks after it), so the long programs of long sequences start first and the
    short ones fill the tail.
    SEQS: a power of two >= n_seqs; the block counts of all sequences are held in one vector.
    """
    i = tl.arange(0, SEQS)
    valid = i < n_seqs
    n_blocks = tl.cdiv(tl.load(CU + i + 1, mask=valid, other=0) - tl.load(CU + i, mask=valid, other=0), BLOCK)
    if LPT:
        # S(L) = sum(max(n_blocks - L, 0)) programs lie at levels >= L: find the highest L with S(L) > pid.
        lo = pid * 0
        hi = tl.max(n_blocks, 0)  # S(hi) = 0 <= pid
        while hi - lo > 1:
            mid = (lo + hi) // 2
            above = tl.sum(tl.maximum(n_blocks - mid, 0), 0) > pid
            lo = tl.where(above, mid, lo)
            hi = tl.where(above, hi, mid)
        rank = pid - tl.sum(tl.maximum(n_blocks - lo - 1, 0), 0)  # among the sequences with a block at level lo
        has = n_blocks > lo
        seq = tl.sum((tl.cumsum(has.to(tl.int32), 0) <= rank).to(tl.int32), 0)
        level = lo
    else:
        done = tl.cumsum(n_blocks, 0) <= pid  # sequences whose blocks all come before pid
        seq = tl.sum(done.to(tl.int32), 0)
        # The blocks of one sequence from the highest level down, as under LPT
        level = tl.sum(tl.where(i == seq, n_blocks, 0), 0) - 1 - (pid - tl.sum(tl.where(done, n_blocks, 0), 0))
    seq = tl.where(pid < tl.sum(n_blocks, 0), seq, n_seqs)
    return seq, level, tl.sum(tl.where(i == seq, n_blocks, 0), 0)


# ---------------------------------------------------------------------------------------------- forward
@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q,
    k_src, v_src, stride_kn, stride_vn,
    offs_m, offs_d, lo, hi, seqlen_k, diag_offset, window_left, window_right, qk_scale, softcap_scale,
    MASKED: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
    TMA: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """One stage of the inner loop over K/V blocks [lo, hi) for one Q block (Algorithm 1, lines 6-10)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = load_rows(k_src, start_n, cols, stride_kn, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, MASKED, TMA)
        qk = mma(q, tl.trans(k), None, UPCAST)
        if SOFTCAP:  # the capped score is softcap * t; qk_scale = softcap * log2(e) then scales t like qk
            qk = tanh(qk * softcap_scale)
        if MASKED:  # [3] an edge block: mask, and keep rows that see no key yet finite
            visible = visible_mask(offs_m[:, None], cols[None, :], seqlen_k, diag_offset, window_left, window_right,
                                   LEFT, RIGHT)
            s = tl.where(visible, qk * qk_scale, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(s, 1))
            m_ref = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            p = tl.math.exp2(s - m_ref[:, None])
        else:  # [3] block entirely visible: no mask at all
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_ref = m_ij
            p = tl.math.exp2(qk * qk_scale - m_ref[:, None])  # [2] exp2, scale already holds log2(e)
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]  # [1] rescale only; no division by l here
        v = load_rows(v_src, start_n, cols, stride_vn, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, MASKED, TMA)
        acc = mma(p.to(v.dtype), v, acc, UPCAST)  # [4] accumulate in place
        m_i = m_ij
    return acc, l_i, m_i


@triton.autotune(
    configs=_configs(_FWD_SHAPES), key=_KEY, prune_configs_by={"early_config_prune": _prune(128 * 128 * 128)},
)
@triton.jit
def _fwd(
    Q, K, V, O, LSE, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
    n_heads, seqlen_q, seqlen_k, window_left, window_right, qk_scale, softcap_scale,
    M_BUCKET, N_BUCKET,  # autotune key only
    GROUP: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr, VARLEN: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, TMA_OK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
):
    """One program = one BLOCK_M block of queries of one (sequence, head); grid (cdiv(max seqlen_q, BLOCK_M), B * H).

    qk_scale = softmax_scale * log2(e), folded once on the host [2]; with SOFTCAP the score is
    tanh(q.k * softcap_scale) * qk_scale with softcap_scale = softmax_scale / softcap and qk_scale = softcap * log2(e)
    (`common.softcap_args`), unused otherwise. K/V tiles come through TMA descriptors
    when the config asks for it (TMA) and the inputs allow it (TMA_OK). seqlen_q / seqlen_k are the tensors'
    row counts (the totals under VARLEN, where each program reads its sequence's bounds from CU_Q / CU_K).
    """
    if RIGHT:  # causal: longest rows first, the last Q blocks have the most K/V blocks to visit
        start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    else:
        start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_h = off_bh % n_heads
    off_hk = off_h // GROUP  # GQA: GROUP query heads share one K/V head
    lse_rows = seqlen_q
    off_b, q_start, seqlen_q, k_start, seqlen_k = _sequence(CU_Q, CU_K, off_bh // n_heads, seqlen_q, seqlen_k,
                                                            VARLEN)
    if start_m >= seqlen_q:  # varlen: a block past the end of a shorter sequence
        return
    q_base = head_ptr(Q, off_b, stride_qb, off_h, stride_qh) + q_start.to(tl.int64) * stride_qm
    k_base = head_ptr(K, off_b, stride_kb, off_hk, stride_kh) + k_start.to(tl.int64) * stride_kn
    v_base = head_ptr(V, off_b, stride_vb, off_hk, stride_vh) + k_start.to(tl.int64) * stride_vn
    o_base = head_ptr(O, off_b, stride_ob, off_h, stride_oh) + q_start.to(tl.int64) * stride_om
    lse_base = LSE + (off_b * n_heads + off_h).to(tl.int64) * lse_rows + q_start

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = load_tile(q_base, offs_m, stride_qm, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, True)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # [2]
    l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)  # [2] the first alpha = exp2(-inf) = 0 clears it
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    k_src = tile_source(k_base, seqlen_k, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, TMA and TMA_OK)
    v_src = tile_source(v_base, seqlen_k, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, TMA and TMA_OK)
    diag_offset = seqlen_k - seqlen_q
    lo, lo_free, hi_free, hi = _stages(start_m, diag_offset, window_left, window_right, seqlen_k, LEFT, RIGHT,
                                       BLOCK_M, BLOCK_N)
    for stage in tl.static_range(3):  # masked [lo, lo_free), unmasked [lo_free, hi_free), masked [hi_free, hi)
        if LEFT or stage != 0:  # only a left window has a left edge: don't compile an always-empty loop
            acc, l_i, m_i = _fwd_inner(
                acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, offs_m, offs_d,
                (lo, lo_free, hi_free)[stage], (lo_free, hi_free, hi)[stage], seqlen_k, diag_offset, window_left,
                window_right, qk_scale, softcap_scale, stage != 1, LEFT, RIGHT, BLOCK_N, HEAD_DIM, BLOCK_D, UPCAST,
                TMA and TMA_OK, SOFTCAP,
            )

    # [1] one division at the end. Rows that saw no key keep m_i = -inf: output 0, internal LSE +inf.
    empty = m_i == float("-inf")
    l_i = tl.where(empty, 1.0, l_i)
    o = acc / l_i[:, None]
    lse = tl.where(empty, float("inf"), m_i + tl.math.log2(l_i))  # [2] base 2
    store_tile(o_base, o.to(O.dtype.element_ty), offs_m, stride_om, seqlen_q, offs_d, HEAD_DIM, BLOCK_D)
    tl.store(lse_base + offs_m, lse, mask=offs_m < seqlen_q)


def window_edges(causal: bool, window_size: tuple[int, int], seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """The band's (left, right) edges the kernels apply, -1 where a side is unlimited: causal sets right to 0, and a
    side wider than any sequence (seqlen_q, seqlen_k: the longest) limits nothing, so it is dropped (no masking
    cost, no int32 overflow in the kernels)."""
    left, right = window_size
    if causal:
        right = 0
    return (-1 if left >= seqlen_k else left), (-1 if right >= seqlen_q else right)


def _mask_args(q, k, causal, window_size, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """What the kernels take for the mask, from (batch, heads, rows, head_dim) views of q and k: (batch, longest
    seqlen_q, longest seqlen_k, runtime args (CU_Q, CU_K, window_left, window_right), constexprs)."""
    varlen = cu_seqlens_q is not None
    if varlen:
        batch, max_q, max_k = cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k
        cu_q, cu_k = cu_seqlens_q, cu_seqlens_k
    else:
        batch, max_q, max_k = q.shape[0], q.shape[2], k.shape[2]
        cu_q = cu_k = q  # never read
    left, right = window_edges(causal, window_size, max_q, max_k)
    constexprs = dict(LEFT=left >= 0, RIGHT=right >= 0, VARLEN=varlen)
    return batch, max_q, max_k, (cu_q, cu_k, max(left, 0), max(right, 0)), constexprs


def _rows(t):
    """(total, heads, head_dim) packed sequences as the (1, heads, total, head_dim) view the kernels take."""
    return t.unsqueeze(0).transpose(1, 2)


def _packed(t):
    return t.transpose(1, 2).squeeze(0)


def forward(q, k, v, causal, softmax_scale, window_size=(-1, -1), cu_seqlens_q=None, cu_seqlens_k=None,
            max_seqlen_q=0, max_seqlen_k=0, options=None, softcap=0.0):
    """Launch the forward kernel. Returns o (like q) and the base-2 LSE, float32: (batch, n_heads, seqlen_q) for
    q (batch, n_heads, seqlen_q, head_dim); (n_heads, total_q) for packed q (total_q, n_heads, head_dim) with
    cu_seqlens_q / cu_seqlens_k (int32, batch + 1) and the longest sequences' lengths (varlen). `options`: how
    the kernel runs (`Options`; None: `DEFAULT_OPTIONS`). softcap > 0: every score s = softmax_scale * q.k
    becomes softcap * tanh(s / softcap) before the mask and the softmax (the LSE is over the capped scores);
    0 = off (the kernel is compiled without it)."""
    options = options or DEFAULT_OPTIONS
    varlen = cu_seqlens_q is not None
    if varlen:
        q, k, v = _rows(q), _rows(k), _rows(v)
    n_heads, seqlen_q, head_dim = q.shape[1:]
    n_kv_heads, seqlen_k = k.shape[1], k.shape[2]
    batch, max_q, max_k, mask, constexprs = _mask_args(q, k, causal, window_size, cu_seqlens_q, cu_seqlens_k,
                                                       max_seqlen_q, max_seqlen_k)
    check_grid(batch, n_heads)
    o = empty_like_layout(q)
    lse = torch.empty((q.shape[0], n_heads, seqlen_q), device=q.device, dtype=torch.float32)
    grid = lambda meta: (cdiv(max_q, meta["BLOCK_M"]), batch * n_heads)
    qk_scale, softcap_scale = softcap_args(softmax_scale, softcap, LOG2E)
    launch(
        _fwd, grid,
        q, k, v, o, lse, mask[0], mask[1], *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
        n_heads, seqlen_q, seqlen_k, *mask[2:], qk_scale, softcap_scale, bucket(max_q), bucket(max_k),
        GROUP=n_heads // n_kv_heads, **constexprs, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim),
        UPCAST=upcast_dot(q.dtype), TMA_OK=options.tma and use_tma(q, k, v), SOFTCAP=softcap > 0, **LAUNCH_OPTIONS,
    )
    if varlen:
        return _packed(o), lse[0]
    return o, lse


# ---------------------------------------------------------------------------------------------- backward
@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v,
    q_src, do_src, lse_base, delta_base, stride_qm, stride_dom,
    offs_n, offs_d, lo, hi, seqlen_q, seqlen_k, diag_offset, window_left, window_right, qk_scale, softcap_scale,
    MASKED: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Inner loop over Q blocks [lo, hi) for one K/V block, computing S^T and P^T (Algorithm 2, lines 8-16)."""
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + offs_m0
        q = load_rows(q_src, start_m, offs_m, stride_qm, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, MASKED, TMA)
        if MASKED:  # rows past seqlen_q get LSE +inf, so their P is exactly 0
            lse = tl.load(lse_base + offs_m, mask=offs_m < seqlen_q, other=float("inf"))
        else:
            lse = tl.load(lse_base + offs_m)
        qk_t = mma(k, tl.trans(q), None, UPCAST)
        if SOFTCAP:  # recomputed as in the forward
            qk_t = tanh(qk_t * softcap_scale)
        p_t = tl.math.exp2(qk_t * qk_scale - lse[None, :])
        if MASKED:  # keys past seqlen_k need no mask here: their dK/dV rows are never stored
            visible = visible_mask(offs_m[None, :], offs_n[:, None], seqlen_k, diag_offset, window_left,
                                   window_right, LEFT, RIGHT)
            p_t = tl.where(visible, p_t, 0.0)
        do = load_rows(do_src, start_m, offs_m, stride_dom, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, MASKED, TMA)
        dv = mma(p_t.to(do.dtype), do, dv, UPCAST)  # dV_j += P^T dO
        if MASKED:
            delta = tl.load(delta_base + offs_m, mask=offs_m < seqlen_q, other=0.0)
        else:
            delta = tl.load(delta_base + offs_m)
        dp_t = mma(v, tl.trans(do), None, UPCAST)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:  # d(softcap * tanh(s / softcap)) / ds = 1 - tanh^2
            ds_t = ds_t * (1.0 - qk_t * qk_t)
        dk = mma(ds_t.to(q.dtype), q, dk, UPCAST)  # dK_j += dS^T Q (scaled after the loop)
    return dk, dv


@triton.autotune(  # dK/dV tiles: BLOCK_N >= BLOCK_M
    configs=_configs(_DKDV_SHAPES, (16, 32)) + _configs(_DKDV_VARLEN_SHAPES, (16, 16)), key=_BWD_KEY,
    prune_configs_by={"early_config_prune": _prune(64 * 128 * 128, len(_configs(_DKDV_SHAPES)), _dkdv_broken)},
)
@triton.jit
def _bwd_dkdv(
    Q, K, V, DO, DK, DV, LSE, DELTA, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    n_heads, seqlen_q, seqlen_k, window_left, window_right, qk_scale, softmax_scale, softcap_scale, n_seqs,
    M_BUCKET, N_BUCKET,  # autotune key only
    GROUP: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr, VARLEN: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, TMA_OK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FLAT: tl.constexpr, LPT: tl.constexpr, SEQS: tl.constexpr, VARLEN_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
):
    """One program = one BLOCK_N block of keys of one (sequence, kv head);
    grid (cdiv(max seqlen_k, BLOCK_N), B * H_kv), or under FLAT (varlen) H_kv * (an upper bound on the number of
    key blocks of all sequences), the kv heads of one block next to each other (`_flat_block`)."""
    n_kv_heads = n_heads // GROUP
    if FLAT:
        off_hk = tl.program_id(0) % n_kv_heads
        seq, level, n_blocks = _flat_block(CU_K, n_seqs, tl.program_id(0) // n_kv_heads, BLOCK_N, SEQS, LPT)
        if seq >= n_seqs:
            return
        start_n = (n_blocks - 1 - level if RIGHT else level) * BLOCK_N  # causal: the first blocks see most rows
    else:
        start_n = tl.program_id(0) * BLOCK_N
        seq = tl.program_id(1) // n_kv_heads
        off_hk = tl.program_id(1) % n_kv_heads
    lse_rows = seqlen_q
    off_b, q_start, seqlen_q, k_start, seqlen_k = _sequence(CU_Q, CU_K, seq, seqlen_q, seqlen_k, VARLEN)
    if start_n >= seqlen_k:  # varlen: a block past the end of a shorter sequence
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_base = head_ptr(K, off_b, stride_kb, off_hk, stride_kh) + k_start.to(tl.int64) * stride_kn
    v_base = head_ptr(V, off_b, stride_vb, off_hk, stride_vh) + k_start.to(tl.int64) * stride_vn
    k = load_tile(k_base, offs_n, stride_kn, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, True)
    v = load_tile(v_base, offs_n, stride_vn, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Only the rows that can see this K/V block: key j is seen by rows j - diag_offset - window_right ..
    # j - diag_offset + window_left, the forward's band from the other side.
    diag_offset = seqlen_k - seqlen_q
    lo, lo_free, hi_free, hi = _stages(start_n, -diag_offset, window_right, window_left, seqlen_q, RIGHT, LEFT,
                                       BLOCK_N, BLOCK_M)
    for g in range(GROUP):  # every query head that reads this K/V head, in order: deterministic, no atomics
        off_h = off_hk * GROUP + g
        row0 = (off_b * n_heads + off_h).to(tl.int64) * lse_rows + q_start
        q_base = head_ptr(Q, off_b, stride_qb, off_h, stride_qh) + q_start.to(tl.int64) * stride_qm
        do_base = head_ptr(DO, off_b, stride_dob, off_h, stride_doh) + q_start.to(tl.int64) * stride_dom
        q_src = tile_source(q_base, seqlen_q, stride_qm, HEAD_DIM, BLOCK_M, BLOCK_D, TMA and TMA_OK)
        do_src = tile_source(do_base, seqlen_q, stride_dom, HEAD_DIM, BLOCK_M, BLOCK_D, TMA and TMA_OK)
        for stage in tl.static_range(3):  # masked [lo, lo_free), unmasked [lo_free, hi_free), masked [hi_free, hi)
            dk, dv = _bwd_dkdv_inner(
                dk, dv, k, v, q_src, do_src, LSE + row0, DELTA + row0, stride_qm, stride_dom, offs_n, offs_d,
                (lo, lo_free, hi_free)[stage], (lo_free, hi_free, hi)[stage], seqlen_q, seqlen_k, diag_offset,
                window_left, window_right, qk_scale, softcap_scale, stage != 1, LEFT, RIGHT, BLOCK_M, HEAD_DIM,
                BLOCK_D, UPCAST, TMA and TMA_OK, SOFTCAP,
            )

    dk = dk * softmax_scale
    dk_base = head_ptr(DK, off_b, stride_dkb, off_hk, stride_dkh) + k_start.to(tl.int64) * stride_dkn
    dv_base = head_ptr(DV, off_b, stride_dvb, off_hk, stride_dvh) + k_start.to(tl.int64) * stride_dvn
    store_tile(dk_base, dk.to(DK.dtype.element_ty), offs_n, stride_dkn, seqlen_k, offs_d, HEAD_DIM, BLOCK_D)
    store_tile(dv_base, dv.to(DV.dtype.element_ty), offs_n, stride_dvn, seqlen_k, offs_d, HEAD_DIM, BLOCK_D)


@triton.jit
def _bwd_dq_inner(
    dq, q, do, lse, delta,
    k_src, v_src, stride_kn, stride_vn,
    offs_m, offs_d, lo, hi, seqlen_k, diag_offset, window_left, window_right, qk_scale, softcap_scale,
    MASKED: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Inner loop over K/V blocks [lo, hi) for one Q block (Algorithm 2, lines 11-21, dQ part)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = load_rows(k_src, start_n, cols, stride_kn, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, MASKED, TMA)
        v = load_rows(v_src, start_n, cols, stride_vn, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, MASKED, TMA)
        qk = mma(q, tl.trans(k), None, UPCAST)
        if SOFTCAP:  # recomputed as in the forward
            qk = tanh(qk * softcap_scale)
        p = tl.math.exp2(qk * qk_scale - lse[:, None])
        if MASKED:
            visible = visible_mask(offs_m[:, None], cols[None, :], seqlen_k, diag_offset, window_left, window_right,
                                   LEFT, RIGHT)
            p = tl.where(visible, p, 0.0)
        dp = mma(do, tl.trans(v), None, UPCAST)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:  # d(softcap * tanh(s / softcap)) / ds = 1 - tanh^2
            ds = ds * (1.0 - qk * qk)
        dq = mma(ds.to(k.dtype), k, dq, UPCAST)  # dQ_i += dS K (scaled after the loop)
    return dq


@triton.autotune(
    configs=_configs(_DQ_SHAPES) + _configs(_DQ_VARLEN_SHAPES, interpret_shape=(16, 32)), key=_BWD_KEY,
    prune_configs_by={"early_config_prune": _prune(64 * 128 * 128, len(_configs(_DQ_SHAPES)))},
)
@triton.jit
def _bwd_dq(
    Q, K, V, DO, DQ, LSE, DELTA, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_dqb, stride_dqh, stride_dqm,
    n_heads, seqlen_q, seqlen_k, window_left, window_right, qk_scale, softmax_scale, softcap_scale, n_seqs,
    M_BUCKET, N_BUCKET,  # autotune key only
    GROUP: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr, VARLEN: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, TMA_OK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FLAT: tl.constexpr, LPT: tl.constexpr, SEQS: tl.constexpr, VARLEN_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
):
    """One program = one BLOCK_M block of queries of one (sequence, head);
    grid (cdiv(max seqlen_q, BLOCK_M), B * H), or under FLAT (varlen) H * (an upper bound on the number of query
    blocks of all sequences), the heads of one block next to each other (`_flat_block`)."""
    if FLAT:
        off_h = tl.program_id(0) % n_heads
        seq, level, n_blocks = _flat_block(CU_Q, n_seqs, tl.program_id(0) // n_heads, BLOCK_M, SEQS, LPT)
        if seq >= n_seqs:
            return
        start_m = level * BLOCK_M  # causal: the last blocks see most keys
    else:
        if RIGHT:
            start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
        else:
            start_m = tl.program_id(0) * BLOCK_M
        seq = tl.program_id(1) // n_heads
        off_h = tl.program_id(1) % n_heads
    off_hk = off_h // GROUP
    lse_rows = seqlen_q
    off_b, q_start, seqlen_q, k_start, seqlen_k = _sequence(CU_Q, CU_K, seq, seqlen_q, seqlen_k, VARLEN)
    if start_m >= seqlen_q:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_base = head_ptr(Q, off_b, stride_qb, off_h, stride_qh) + q_start.to(tl.int64) * stride_qm
    do_base = head_ptr(DO, off_b, stride_dob, off_h, stride_doh) + q_start.to(tl.int64) * stride_dom
    k_base = head_ptr(K, off_b, stride_kb, off_hk, stride_kh) + k_start.to(tl.int64) * stride_kn
    v_base = head_ptr(V, off_b, stride_vb, off_hk, stride_vh) + k_start.to(tl.int64) * stride_vn
    q = load_tile(q_base, offs_m, stride_qm, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, True)
    do = load_tile(do_base, offs_m, stride_dom, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, True)
    row_ok = offs_m < seqlen_q
    row0 = (off_b * n_heads + off_h).to(tl.int64) * lse_rows + q_start
    lse = tl.load(LSE + row0 + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + row0 + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    diag_offset = seqlen_k - seqlen_q
    lo, lo_free, hi_free, hi = _stages(start_m, diag_offset, window_left, window_right, seqlen_k, LEFT, RIGHT,
                                       BLOCK_M, BLOCK_N)  # as in the forward
    k_src = tile_source(k_base, seqlen_k, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, TMA and TMA_OK)
    v_src = tile_source(v_base, seqlen_k, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, TMA and TMA_OK)
    for stage in tl.static_range(3):  # as in the forward
        if LEFT or stage != 0:
            dq = _bwd_dq_inner(
                dq, q, do, lse, delta, k_src, v_src, stride_kn, stride_vn, offs_m, offs_d,
                (lo, lo_free, hi_free)[stage], (lo_free, hi_free, hi)[stage], seqlen_k, diag_offset, window_left,
                window_right, qk_scale, softcap_scale, stage != 1, LEFT, RIGHT, BLOCK_N, HEAD_DIM, BLOCK_D, UPCAST,
                TMA and TMA_OK, SOFTCAP,
            )
    dq = dq * softmax_scale
    dq_base = head_ptr(DQ, off_b, stride_dqb, off_h, stride_dqh) + q_start.to(tl.int64) * stride_dqm
    store_tile(dq_base, dq.to(DQ.dtype.element_ty), offs_m, stride_dqm, seqlen_q, offs_d, HEAD_DIM, BLOCK_D)


def backward(do, q, k, v, o, lse, causal, softmax_scale, window_size=(-1, -1), cu_seqlens_q=None, cu_seqlens_k=None,
             max_seqlen_q=0, max_seqlen_k=0, out=None, options=None, softcap=0.0):
    """Launch the three backward kernels. `lse` is the forward's base-2 LSE; the mask arguments and softcap are the
    forward's (the capped scores are recomputed: dS = P (dP - delta) (1 - tanh^2)).
    Returns dq, dk, dv like q, k, v (written into `out` when given: `common.grad_buffers`).
    `options`: how the kernels run (`Options`; None: `DEFAULT_OPTIONS`); ValueError for an unknown
    `varlen_bwd_grid`."""
    options = options or DEFAULT_OPTIONS
    if options.varlen_bwd_grid not in VARLEN_BWD_GRIDS:
        raise ValueError(f"Options.varlen_bwd_grid={options.varlen_bwd_grid!r}; accepted "
                         f"{', '.join(VARLEN_BWD_GRIDS)}")
    varlen = cu_seqlens_q is not None
    if varlen:
        do, q, k, v, o, lse = _rows(do), _rows(q), _rows(k), _rows(v), _rows(o), lse[None]
        if isinstance(out, (tuple, list)):  # packed like q, k, v; grad_buffers checks them
            out = tuple(_rows(t) if isinstance(t, torch.Tensor) else t for t in out)
    delta = bwd_preprocess(o, do)
    dq, dk, dv = grad_buffers(q, k, v, out)
    _launch_backward(do, q, k, v, lse, delta, dq, (dk, dv), causal, softmax_scale, window_size, cu_seqlens_q,
                     cu_seqlens_k, max_seqlen_q, max_seqlen_k, options, softcap)
    if varlen:
        return _packed(dq), _packed(dk), _packed(dv)
    return dq, dk, dv


def backward_dq(do, q, k, v, lse, delta, dq, causal, softmax_scale, window_size=(-1, -1), softcap=0.0,
                cu_seqlens=None, max_seqlen=0):
    """FA2's dQ kernel alone (FA2 paper, Algorithm 2's dQ_i update run query-block-major, as Triton's fused-attention
    tutorial does), for a backward whose dK and dV come from another kernel: writes dq (q's shape and dtype, a unit
    last stride, any other strides) from the forward's base-2 `lse` and delta = rowsum(dO * O)
    (`common.bwd_preprocess`), both contiguous float32 (batch, n_heads, seqlen_q). q, k, v, do: (batch, heads,
    seqlen, head_dim); with cu_seqlens (int32 (sequences + 1,), packed self-attention: the same offsets for queries
    and keys) the (1, heads, total, head_dim) view of packed sequences, lse and delta (1, n_heads, total), and
    max_seqlen >= 1 the longest sequence. Mask arguments as `backward`. ValueError for anything else."""
    batch, n_heads, seqlen_q = q.shape[:3]
    if dq.shape != q.shape or dq.dtype != q.dtype or dq.stride(-1) != 1:
        raise ValueError(f"backward_dq: dq must have q's shape {tuple(q.shape)} and dtype {q.dtype} and a unit last "
                         f"stride; got {tuple(dq.shape)} {dq.dtype} strides {tuple(dq.stride())}")
    for name, t in (("lse", lse), ("delta", delta)):
        if t.shape != (batch, n_heads, seqlen_q) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"backward_dq: {name} must be a contiguous float32 ({batch}, {n_heads}, {seqlen_q}) "
                             f"tensor; got {t.dtype} {tuple(t.shape)} strides {tuple(t.stride())}")
    if cu_seqlens is not None and (batch != 1 or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1
                                   or max_seqlen < 1):
        raise ValueError(f"backward_dq: packed sequences need q as (1, heads, total, head_dim), int32 1-D "
                         f"cu_seqlens and max_seqlen >= 1; got batch {batch}, cu_seqlens {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}, max_seqlen {max_seqlen}")
    _launch_backward(do, q, k, v, lse, delta, dq, None, causal, softmax_scale, window_size, cu_seqlens, cu_seqlens,
                     max_seqlen, max_seqlen, DEFAULT_OPTIONS, softcap)


def _launch_backward(do, q, k, v, lse, delta, dq, dkdv, causal, softmax_scale, window_size, cu_seqlens_q,
                     cu_seqlens_k, max_seqlen_q, max_seqlen_k, options, softcap):
    """The dK/dV kernel (into dkdv = (dk, dv); skipped when None) and the dQ kernel, on (batch, heads, seqlen,
    head_dim) views (packed sequences as `_rows` gives them)."""
    varlen = cu_seqlens_q is not None
    n_heads, seqlen_q, head_dim = q.shape[1:]
    n_kv_heads, seqlen_k = k.shape[1], k.shape[2]
    batch, max_q, max_k, mask, constexprs = _mask_args(q, k, causal, window_size, cu_seqlens_q, cu_seqlens_k,
                                                       max_seqlen_q, max_seqlen_k)
    flat = varlen and options.varlen_bwd_grid != "padded" and batch <= _FLAT_MAX_SEQS
    common = dict(
        GROUP=n_heads // n_kv_heads, **constexprs, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim),
        UPCAST=upcast_dot(q.dtype), TMA_OK=options.tma and use_tma(q, k, v, do),
        FLAT=flat, LPT=flat and options.varlen_bwd_grid == "lpt", SEQS=next_power_of_2(batch) if flat else 1,
        VARLEN_TILES=varlen and options.varlen_bwd_tiles, SOFTCAP=softcap > 0, **LAUNCH_OPTIONS,
    )
    qk_scale, softcap_scale = softcap_args(softmax_scale, softcap, LOG2E)
    sizes = (n_heads, seqlen_q, seqlen_k, *mask[2:], qk_scale, softmax_scale, softcap_scale, batch, bucket(max_q),
             bucket(max_k))
    qkv_do_strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
    if flat:  # every sequence's blocks, no more: sum(cdiv(len, BLOCK)) <= cdiv(total, BLOCK) + sequences
        grid_kv = lambda meta: (n_kv_heads * (cdiv(seqlen_k, meta["BLOCK_N"]) + batch),)
        grid_q = lambda meta: (n_heads * (cdiv(seqlen_q, meta["BLOCK_M"]) + batch),)
    else:
        grid_kv = lambda meta: (cdiv(max_k, meta["BLOCK_N"]), batch * n_kv_heads)
        grid_q = lambda meta: (cdiv(max_q, meta["BLOCK_M"]), batch * n_heads)
    if dkdv is not None:
        dk, dv = dkdv
        launch(_bwd_dkdv, grid_kv, q, k, v, do, dk, dv, lse, delta, *mask[:2], *qkv_do_strides, *dk.stride()[:3],
                           *dv.stride()[:3], *sizes, **common)
    launch(_bwd_dq, grid_q, q, k, v, do, dq, lse, delta, *mask[:2], *qkv_do_strides, *dq.stride()[:3], *sizes, **common)


def compile_for_sm90(kernel, left=True, right=True, varlen=True, tma=True, head_dim=64, group=2, grid="padded",
                     block_m=64, block_n=64, num_warps=4, num_stages=2, softcap=False):
    """Compile one kernel ("fwd", "dkdv" or "dq") for sm_90 with bf16 inputs, without a GPU (catches what only
    the GPU compiler rejects, which the interpreter runs). Call it without TRITON_INTERPRET; returns Triton's
    compiled kernel. grid: the backward's `Options.varlen_bwd_grid` (with varlen); softcap: the SOFTCAP variant."""
    fn = {"fwd": _fwd, "dkdv": _bwd_dkdv, "dq": _bwd_dq}[kernel].fn
    constexprs = dict(GROUP=group, LEFT=left, RIGHT=right, VARLEN=varlen, HEAD_DIM=head_dim,
                      BLOCK_D=block_d(head_dim), UPCAST=False, TMA_OK=tma, SOFTCAP=softcap, BLOCK_M=block_m,
                      BLOCK_N=block_n, TMA=tma)
    if kernel != "fwd":
        flat = varlen and grid != "padded"
        constexprs.update(FLAT=flat, LPT=flat and grid == "lpt", SEQS=32, VARLEN_TILES=varlen)
    types = dict(LSE="*fp32", DELTA="*fp32", CU_Q="*i32", CU_K="*i32", qk_scale="fp32", softmax_scale="fp32",
                 softcap_scale="fp32")
    return compile_sm90(fn, constexprs, lambda arg: types.get(arg, "*bf16" if arg.isupper() else "i32"),
                        num_warps, num_stages=num_stages)
