"""FlashAttention-3-style forward for Hopper (sm_90), written in Gluon (`triton.experimental.gluon`, Triton 3.6).

Source: Shah et al. 2024, "FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision",
Section 3.1 (producer-consumer warp specialisation, ping-pong scheduling) and Algorithm 2 (intra-warpgroup
overlap of the softmax with the two GEMMs). The arithmetic is FA2's (`kernels/fa2.py`): un-scaled
accumulation, exp2 with log2(e) folded into `qk_scale`, a base-2 LSE with +inf for rows that see no key,
causal masks aligned bottom-right, GQA by head index.

One CTA = NUM_CONSUMERS * BLOCK_M query rows of one (batch, head), in NUM_CONSUMERS + 1 partitions (`gl.warp_specialize`):
- producer (1 warp, few registers): TMA-loads the two Q tiles once, then every K and V tile of the CTA's
  key range into a NUM_STAGES-deep shared-memory ring. `k_ready`/`v_ready` mbarriers say a slot is full;
  `k_empty`/`v_empty` (one arrival per consumer) say both consumers are done with it.
- NUM_CONSUMERS (2 or 3) consumer warpgroups (4 warps each, most registers), one per BLOCK_M-row Q tile. Per K/V block j a
  consumer issues S_j = Q K_j^T (wgmma, async), then O += P_{j-1} V_{j-1} (wgmma, async, P from registers),
  waits for S_j only, runs the softmax of block j while the PV wgmma still runs, then waits for it and
  rescales O (FA3 Algorithm 2). With PINGPONG the consumers take turns issuing their GEMMs (ordered by
  one mbarrier each), so one warpgroup's softmax runs under the other's GEMMs.
Every K/V block of [0, hi_free) is visible to every row of the CTA and runs unmasked; the blocks of
[hi_free, hi) are masked; blocks past hi are never loaded (FA2's causal stages [3]).

Tensors come through TMA descriptors made on the device per (batch, head), shape (seqlen, HEAD_DIM) with the
row stride of the input, so any 16-byte-aligned layout with a unit last stride works and rows past the end
read as 0 / are not written. This module is imported only on a Triton whose Gluon API it was written
against (`kernels/fa3.py` decides); it must import, not necessarily compile, elsewhere.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)


@gluon.jit
def _softmax_block(s, m_i, l_i, rows, start_n, seqlen_k, diag_offset, qk_scale,
                   MASKED: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """Online softmax of one (BLOCK_M, BLOCK_N) score block (FA2 Algorithm 1, lines 8-9, base 2).

    Returns p (float32, un-normalised), alpha = exp2(m_old - m_new) and the new m_i, l_i.
    """
    if MASKED:
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = gl.expand_dims(cols, 0) < seqlen_k
        if CAUSAL:
            visible = visible & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1) + diag_offset)
        s = gl.where(visible, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see no key yet stay finite
        p = gl.exp2(s - gl.expand_dims(m_ref, 1))
    else:
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        m_ref = m_new
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_ref, 1))
    alpha = gl.exp2(m_i - m_ref)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn_bars,
              o_desc, LSE, lse_offset, start_m, n_blocks, hi_free, seqlen_q, seqlen_k, qk_scale,
              CID: gl.constexpr, NUM_CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr):
    """One consumer warpgroup: rows [start_m + CID * BLOCK_M, + BLOCK_M) of the CTA's query block."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    NEXT: gl.constexpr = (CID + 1) % NUM_CONSUMERS  # whose turn follows ours under PINGPONG

    row0 = start_m + CID * BLOCK_M
    rows = row0 + gl.arange(0, BLOCK_M, layout=row_layout)
    diag_offset = seqlen_k - seqlen_q
    q_tile = q_smem.index(CID)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.full([BLOCK_M], 1.0, gl.float32, layout=row_layout)  # the first alpha = 0 clears it
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    mbarrier.wait(q_bar.index(CID), 0)

    # Block 0: S_0 and its softmax (there is no PV GEMM to overlap yet). n_blocks >= 1 always.
    if PINGPONG:
        mbarrier.wait(turn_bars.index(CID), 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)),
                      gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout), use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn_bars.index(NEXT))
    s = warpgroup_mma_wait(0, deps=(s,))
    mbarrier.arrive(k_empty.index(0))
    if hi_free <= 0:
        p, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, rows, 0, seqlen_k, diag_offset, qk_scale,
                                            True, CAUSAL, BLOCK_N, s_layout)
    else:
        p, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, rows, 0, seqlen_k, diag_offset, qk_scale,
                                            False, CAUSAL, BLOCK_N, s_layout)
    p_op = gl.convert_layout(p.to(dtype), p_layout)

    for j in range(1, n_blocks):
        slot = j % NUM_STAGES
        prev = (j - 1) % NUM_STAGES
        if PINGPONG:
            mbarrier.wait(turn_bars.index(CID), j & 1)
        mbarrier.wait(k_ready.index(slot), (j // NUM_STAGES) & 1)
        s = warpgroup_mma(q_tile, k_smem.index(slot).permute((1, 0)),
                          gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout), use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // NUM_STAGES) & 1)
        acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn_bars.index(NEXT))
        s = warpgroup_mma_wait(1, deps=(s,))  # S_j is done; the PV GEMM may still run
        mbarrier.arrive(k_empty.index(slot))
        start_n = j * BLOCK_N
        if start_n >= hi_free:
            p, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, rows, start_n, seqlen_k, diag_offset, qk_scale,
                                                True, CAUSAL, BLOCK_N, s_layout)
        else:
            p, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, rows, start_n, seqlen_k, diag_offset, qk_scale,
                                                False, CAUSAL, BLOCK_N, s_layout)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        mbarrier.arrive(v_empty.index(prev))
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)

    last = (n_blocks - 1) % NUM_STAGES
    mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // NUM_STAGES) & 1)
    acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
    mbarrier.arrive(v_empty.index(last))
    if PINGPONG:  # keep the turn count of both consumers equal: one turn per K/V block
        mbarrier.wait(turn_bars.index(CID), n_blocks & 1)
        mbarrier.arrive(turn_bars.index(NEXT))

    # One division at the end [1]. Rows that saw no key keep m_i = -inf: output 0, internal LSE +inf.
    empty = m_i == float("-inf")
    l_i = gl.where(empty, 1.0, l_i)
    o = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
    lse = gl.where(empty, float("inf"), m_i + gl.log2(l_i))
    gl.store(LSE + lse_offset + rows, lse, mask=rows < seqlen_q)
    q_tile.store(o.to(dtype))  # Q is no longer read: its tile stages O for the TMA store (rows past the end are dropped)
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [row0, 0], q_tile)
    tma.store_wait(0)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
              start_m, n_blocks, NUM_CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr):
    """The TMA warp: the consumers' Q tiles once, then K_j and V_j into ring slot j % NUM_STAGES when it is free."""
    for i in gl.static_range(NUM_CONSUMERS):
        mbarrier.expect(q_bar.index(i), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [start_m + i * BLOCK_M, 0], q_bar.index(i), q_smem.index(i))
    for j in range(n_blocks):
        slot = j % NUM_STAGES
        phase = (j // NUM_STAGES) & 1
        mbarrier.wait(k_empty.index(slot), phase ^ 1)  # a fresh barrier passes phase 1 at once
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [j * BLOCK_N, 0], k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [j * BLOCK_N, 0], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def fa3_fwd_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
    n_heads, seqlen_q, seqlen_k, qk_scale,
    GROUP: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    Q_LAYOUT: gl.constexpr, KV_LAYOUT: gl.constexpr,
):
    """Grid (cdiv(seqlen_q, NUM_CONSUMERS * BLOCK_M), batch * n_heads); see the module docstring."""
    if CAUSAL:  # longest rows first: the last query blocks have the most K/V blocks
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
    else:
        pid_m = gl.program_id(0)
    start_m = pid_m * (NUM_CONSUMERS * BLOCK_M)
    off_bh = gl.program_id(1)
    off_b = (off_bh // n_heads).to(gl.int64)
    off_h = (off_bh % n_heads).to(gl.int64)
    off_hk = off_h // GROUP  # GQA: GROUP query heads share one K/V head

    q_desc = tma.make_tensor_descriptor(Q + off_b * stride_qb + off_h * stride_qh, [seqlen_q, HEAD_DIM],
                                        [stride_qm, 1], [BLOCK_M, HEAD_DIM], Q_LAYOUT)
    o_desc = tma.make_tensor_descriptor(O + off_b * stride_ob + off_h * stride_oh, [seqlen_q, HEAD_DIM],
                                        [stride_om, 1], [BLOCK_M, HEAD_DIM], Q_LAYOUT)
    k_desc = tma.make_tensor_descriptor(K + off_b * stride_kb + off_hk * stride_kh, [seqlen_k, HEAD_DIM],
                                        [stride_kn, 1], [BLOCK_N, HEAD_DIM], KV_LAYOUT)
    v_desc = tma.make_tensor_descriptor(V + off_b * stride_vb + off_hk * stride_vh, [seqlen_k, HEAD_DIM],
                                        [stride_vn, 1], [BLOCK_N, HEAD_DIM], KV_LAYOUT)

    # Key range of the CTA [3]: [0, hi_free) is seen by every row, [hi_free, hi) only in part.
    diag_offset = seqlen_k - seqlen_q
    if CAUSAL:
        hi = gl.minimum(start_m + NUM_CONSUMERS * BLOCK_M + diag_offset, seqlen_k)
        hi_free = (gl.maximum(start_m + diag_offset + 1, 0) // BLOCK_N) * BLOCK_N
    else:
        hi = seqlen_k
        hi_free = (seqlen_k // BLOCK_N) * BLOCK_N
    # At least one block, so every consumer runs the same code; a CTA whose rows see no key masks it all.
    n_blocks = gl.maximum(gl.cdiv(hi, BLOCK_N), 1)

    dtype: gl.constexpr = Q.dtype.element_ty
    q_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, BLOCK_M, HEAD_DIM], Q_LAYOUT)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], KV_LAYOUT)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], KV_LAYOUT)
    q_bar = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(turn_bars.index(i), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_CONSUMERS)  # one arrival per consumer
        mbarrier.init(v_empty.index(i), count=NUM_CONSUMERS)
    if PINGPONG:  # consumer 0 takes the first turn
        mbarrier.arrive(turn_bars.index(0))
    fence_async_shared()

    lse_offset = off_bh.to(gl.int64) * seqlen_q
    # Written out per partition: tuple concatenation inside a Gluon kernel turns constexprs into tensors.
    # Registers: 24 for the producer warp, the rest shared by the consumer warpgroups.
    if NUM_CONSUMERS == 2:
        gl.warp_specialize(
            [
            (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn_bars, o_desc, LSE,
                         lse_offset, start_m, n_blocks, hi_free, seqlen_q, seqlen_k, qk_scale,
                         0, NUM_CONSUMERS, CAUSAL, PINGPONG, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES)),
            (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn_bars, o_desc, LSE,
                         lse_offset, start_m, n_blocks, hi_free, seqlen_q, seqlen_k, qk_scale,
                         1, NUM_CONSUMERS, CAUSAL, PINGPONG, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                         v_empty, start_m, n_blocks, NUM_CONSUMERS, BLOCK_M, BLOCK_N, NUM_STAGES)),
            ],
            [4, 1],
            [240, 24],
        )
    else:
        gl.warp_specialize(
            [
            (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn_bars, o_desc, LSE,
                         lse_offset, start_m, n_blocks, hi_free, seqlen_q, seqlen_k, qk_scale,
                         0, NUM_CONSUMERS, CAUSAL, PINGPONG, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES)),
            (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn_bars, o_desc, LSE,
                         lse_offset, start_m, n_blocks, hi_free, seqlen_q, seqlen_k, qk_scale,
                         1, NUM_CONSUMERS, CAUSAL, PINGPONG, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES)),
            (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn_bars, o_desc, LSE,
                         lse_offset, start_m, n_blocks, hi_free, seqlen_q, seqlen_k, qk_scale,
                         2, NUM_CONSUMERS, CAUSAL, PINGPONG, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                         v_empty, start_m, n_blocks, NUM_CONSUMERS, BLOCK_M, BLOCK_N, NUM_STAGES)),
            ],
            [4, 4, 1],
            [160, 160, 24],
        )
