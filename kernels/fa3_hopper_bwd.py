"""FlashAttention-3-style backward for Hopper (sm_90), written in Gluon (`triton.experimental.gluon`, Triton 3.6).

Source: Shah et al. 2024, "FlashAttention-3", Section 3 and Appendix B.1 (the backward: producer-consumer
warp specialisation, dK/dV accumulated in registers per key block, dQ accumulated in float32 in global memory
through TMA reduce-add); the arithmetic is FA2's Algorithm 2 with the base-2 LSE of `kernels/fa2.py` (P = exp2(S * qk_scale
- lse), dS = P * (dP - delta), delta = rowsum(dO * O)); with SOFTCAP the forward's logit cap, S -> tanh(S *
softcap_in), and dS scaled by the cap's derivative 1 - tanh^2.

One CTA owns NUM_CONSUMERS (1 or 2) * 64 keys of one (batch, kv head) and loops over every query block (of HEADS
query heads of its GQA group) that can see them. With HEADS < GROUP (FA3's way with GQA) the group's CTAs for the
same keys add their dK and dV into float32 accumulators (TMA reduce-adds; not bit-reproducible), so the CTAs in
flight read fewer heads' Q and dO; with HEADS = GROUP dK and dV stay in registers over the whole group and are
stored once. Partitions (`gl.warp_specialize`):
- producer (1 warp): TMA-loads the CTA's K and V tiles once, then Q_i and dO_i of each query block into a
  NUM_STAGES-deep ring, and with them (cp.async, as the rows of odd seqlen_q break TMA's 16-byte strides) the
  block's LSE and delta, which the consumers would otherwise wait on from global memory (`ready` says a slot is
  full: the TMA bytes and the 32 threads' cp.async arrivals; `empty`, one arrival per consumer, that it may be
  reused).
- NUM_CONSUMERS consumer warpgroups, one per 64 keys. Per query block (BLOCK_M = 64 or 128 rows) a consumer
  issues S^T = K Q^T and dP^T = V dO^T (async wgmmas), waits for S^T only, computes P^T while dP^T runs, issues
  dV += P^T dO (P^T from registers), waits for dP^T, computes dS^T, issues dK += dS^T Q (dS^T from registers),
  stores dS^T to shared memory and computes its part of dQ_i = dS K (SPLIT_DQ: "cols", a share of the columns
  over all the CTA's keys; "rows", a share of the rows over all the CTA's keys), which goes through its own float32 shared tile and one TMA reduce-add
  (`cp.reduce.async.bulk.tensor`) into the float32 dQ accumulator, completing under the next block. dQ's order
  of additions varies, so it is not bit-reproducible (FA3's trade). With SEPARATE_DQ the consumers stop after
  dK's GEMM and the host runs FA2's query-major dQ kernel next (`kernels.fa2.backward_dq`): no dS exchange and
  no accumulator, the shared memory for them left out.
Rows past seqlen_q read as 0 through TMA (Q, dO) and cp.async's zero-fill (LSE, delta), so their P is 1 but
their dS is 0 and their dO rows are 0: they add nothing to dK or dV, and their dQ rows land in the accumulator's
padding. Keys past seqlen_k read as 0, so their dS adds nothing to dQ and their dK/dV rows are clipped by the TMA
store. Columns past head_dim (head_dim 96 runs with HEAD_DIM 128) read as 0 the same way: they add 0 to S and
dP, give dK, dV and dQ zero columns there, and are clipped by the stores and the reduce-adds. Only the band's edges
need a mask (flash-attn's masks, as in the forward: RIGHT, the causal diagonal or a right window, query blocks
[lo, m_free); LEFT, a sliding window's left edge, query blocks [m_free_hi, hi)); query blocks none of whose rows see
a key of the CTA's are never visited, so a window's cost follows its band. Packed
sequences (DOCS) take per-key and per-row bounds from the host (`kernels.fa3.doc_bounds`): key n is seen by rows
[QUERY_START[n], QUERY_LIMIT[n]), row i sees keys [KEY_START[i], KEY_LIMIT[i]).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from .fa3_hopper import _tanh
from .gluon_compat import aggregate, as_4d, constexpr_function, cp_async_load, tma_load, tma_reduce_add, tma_store

BLOCK_KEYS = gl.constexpr(64)  # keys per consumer warpgroup (a wgmma's 64 rows)


@aggregate
class Keys:
    """The CTA's K tile (NUM_CONSUMERS * 64 keys, one tile) and V tiles (one per consumer), loaded once (`loaded`)."""
    k: gl.shared_memory_descriptor
    v: gl.shared_memory_descriptor
    loaded: gl.shared_memory_descriptor

    @constexpr_function
    def __init__(self, k, v, loaded):
        self.k, self.v, self.loaded = k, v, loaded


@aggregate
class QueryRing:
    """The NUM_STAGES-deep ring of query blocks: Q_i, dO_i and the block's LSE and delta (`stats`). Block number
    `it` lives in slot it % NUM_STAGES; the slot's barriers complete once per lap, so their phase is the lap's
    parity. `ready`: the TMA bytes and the producer's 32 cp.async arrivals have landed; `empty`: every consumer is
    done with the slot (one arrival each)."""
    q: gl.shared_memory_descriptor
    do: gl.shared_memory_descriptor
    stats: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    NUM_STAGES: gl.constexpr

    @constexpr_function
    def __init__(self, q, do, stats, ready, empty, NUM_STAGES):
        self.q, self.do, self.stats, self.ready, self.empty = q, do, stats, ready, empty
        self.NUM_STAGES = gl.constexpr(NUM_STAGES)

    @gluon.jit
    def slot(self, it):
        return it % self.NUM_STAGES

    @gluon.jit
    def phase(self, it):
        return (it // self.NUM_STAGES) & 1


@aggregate
class DsBuffers:
    """dS^T of a query block, double-buffered so a warpgroup may write the next block's while the other still
    reads this one's (`ready`: every warpgroup's share is in; `free`: every warpgroup is done reading), and each
    warpgroup's float32 dQ staging tile for its TMA reduce-add."""
    ds: gl.shared_memory_descriptor
    dq: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    free: gl.shared_memory_descriptor

    @constexpr_function
    def __init__(self, ds, dq, ready, free):
        self.ds, self.dq, self.ready, self.free = ds, dq, ready, free

    @gluon.jit
    def slot(self, it):
        return it % 2

    @gluon.jit
    def phase(self, it):
        return (it // 2) & 1


@gluon.jit
def _dq_reduce(dq, dq_tile, dq_desc, off_b, off_h, start_m, dq_col):
    """dQ_i's partial sum (registers, float32) into the accumulator: through this warpgroup's shared tile and one
    TMA reduce-add, which completes in the background."""
    tma.store_wait(0)  # the previous block's reduce-add has read dq_tile
    dq_tile.store(dq)
    fence_async_shared()
    tma_reduce_add(dq_desc, [off_b, off_h, start_m, dq_col], as_4d(dq_tile, dq_desc))


@gluon.jit
def _load_stats(stats, bar, LSE, DELTA, bh, start_m, seqlen_q, BLOCK_M: gl.constexpr):
    """The producer warp's cp.async of one query block's LSE and then its delta into the (2 * BLOCK_M,) shared
    tile `stats`; each thread then arrives on `bar` once its copies have landed (32 arrivals). Rows past seqlen_q
    are zero-filled."""
    layout: gl.constexpr = gl.BlockedLayout([2 * BLOCK_M // 32], [32], [1], [0])
    i = gl.arange(0, 2 * BLOCK_M, layout=layout)
    rows = start_m + i % BLOCK_M
    offs = bh.to(gl.int64) * seqlen_q + rows
    cp_async_load(stats, gl.where(i < BLOCK_M, LSE + offs, DELTA + offs),
                                           mask=rows < seqlen_q)
    async_copy.mbarrier_arrive(bar, increment_count=False)


@gluon.jit
def _mask_band(p_t, keys, key_first, key_last, LEFT: gl.constexpr, RIGHT: gl.constexpr):
    """p_t (keys x queries) with 0 where the key is outside the query's [key_first, key_last] (key_first with
    LEFT, key_last with RIGHT).

    Non-pure inline PTX (setp + selp, what `gl.where` gives): LLVM cannot hoist it, so the branch around it
    stays a branch. With `gl.where` LLVM turned the branch into selects run for every query block, masked or not
    (64 compares and 64 selects per thread).
    """
    key = gl.expand_dims(keys, 1)
    if LEFT and RIGHT:
        return gl.inline_asm_elementwise(
            "{ .reg .pred visible; setp.le.s32 visible, $2, $4; setp.ge.and.s32 visible, $2, $3, visible; "
            "selp.f32 $0, $1, 0f00000000, visible; }",
            "=r,r,r,r,r", [p_t, key, gl.expand_dims(key_first, 0), gl.expand_dims(key_last, 0)],
            dtype=gl.float32, is_pure=False, pack=1)
    elif LEFT:
        return gl.inline_asm_elementwise(
            "{ .reg .pred visible; setp.ge.s32 visible, $2, $3; selp.f32 $0, $1, 0f00000000, visible; }",
            "=r,r,r,r", [p_t, key, gl.expand_dims(key_first, 0)], dtype=gl.float32, is_pure=False, pack=1)
    else:
        return gl.inline_asm_elementwise(
            "{ .reg .pred visible; setp.le.s32 visible, $2, $3; selp.f32 $0, $1, 0f00000000, visible; }",
            "=r,r,r,r", [p_t, key, gl.expand_dims(key_last, 0)], dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def _cta_block(seqlen_k, SECTION_HEADS, BLOCK_ORDER, DOCS: gl.constexpr, BLOCK_N: gl.constexpr):
    """This CTA's (key block, batch * n_kv_heads index) in a 1-D grid of key blocks x (batch, kv head) pairs,
    launched in sections of SECTION_HEADS pairs, key-major within a section: the hardware starts CTAs in launch
    order, so every pair's first key block (under a causal mask the longest) starts before any second one, while
    the CTAs in flight share a few pairs' Q, dO and dQ accumulator in L2 (SECTION_HEADS = 1: one pair's key blocks
    after another's). Packed sequences (DOCS): the key blocks in the host's longest-first order (BLOCK_ORDER,
    `kernels.fa3.block_order`)."""
    n_blocks = (seqlen_k + BLOCK_N - 1) // BLOCK_N
    n_pairs = gl.num_programs(0) // n_blocks
    pid = gl.program_id(0)
    section = pid // (SECTION_HEADS * n_blocks)
    first = section * SECTION_HEADS
    heads = gl.minimum(SECTION_HEADS, n_pairs - first)
    rank = pid - first * n_blocks
    block = rank // heads
    if DOCS:
        block = gl.load(BLOCK_ORDER + block)
    return block, first + rank % heads


@gluon.jit
def _query_range(start_n, seqlen_q, seqlen_k, window_left, window_right, QUERY_START, QUERY_LIMIT,
                 LEFT: gl.constexpr, RIGHT: gl.constexpr, DOCS: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr):
    """The query blocks that see keys [start_n, start_n + BLOCK_N): [lo, hi), masked below m_free (the right
    edge) and from m_free_hi on (the left edge), and how many there are. Query m sees key n iff
    m + d - window_left <= n <= m + d + window_right, d = seqlen_k - seqlen_q (bottom-right), a side limited only
    with LEFT / RIGHT; the same band as the forward's, seen from the keys. DOCS (packed sequences): key n is seen
    by rows [QUERY_START[n], QUERY_LIMIT[n]), both non-decreasing in n (`kernels.fa3.doc_bounds`)."""
    hi = ((seqlen_q + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    if DOCS:
        first_key = gl.minimum(start_n, seqlen_k - 1)
        last_key = gl.minimum(start_n + BLOCK_N, seqlen_k) - 1
        lo = gl.load(QUERY_START + first_key) // BLOCK_M * BLOCK_M
        m_free = (gl.load(QUERY_START + last_key) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        m_free_hi = gl.load(QUERY_LIMIT + first_key) // BLOCK_M * BLOCK_M
        hi = gl.minimum((gl.load(QUERY_LIMIT + last_key) + BLOCK_M - 1) // BLOCK_M * BLOCK_M, hi)
    else:
        diag_offset = seqlen_k - seqlen_q
        lo = hi * 0
        m_free = lo
        m_free_hi = hi
        if RIGHT:  # m >= n - d - window_right
            lo = (gl.maximum(start_n - diag_offset - window_right, 0) // BLOCK_M) * BLOCK_M
            m_free = ((gl.maximum(start_n + BLOCK_N - 1 - diag_offset - window_right, 0) + BLOCK_M - 1)
                      // BLOCK_M) * BLOCK_M
        if LEFT:  # m <= n - d + window_left
            hi = gl.minimum((gl.maximum(start_n + BLOCK_N - diag_offset + window_left, 0) + BLOCK_M - 1)
                            // BLOCK_M * BLOCK_M, hi)
            m_free_hi = gl.maximum(start_n - diag_offset + window_left + 1, 0) // BLOCK_M * BLOCK_M
    lo = gl.minimum(lo, hi)
    m_free = gl.minimum(gl.maximum(m_free, lo), hi)
    m_free_hi = gl.minimum(gl.maximum(m_free_hi, lo), hi)
    return lo, m_free, m_free_hi, gl.maximum(hi - lo, 0) // BLOCK_M


@gluon.jit
def _cta_heads(pair, n_heads, GROUP: gl.constexpr, HEADS: gl.constexpr):
    """(batch, first query head, kv head) of the CTA's `pair` index: the batch's n_heads / HEADS runs of HEADS
    query heads, GROUP of which share a kv head."""
    n_runs = n_heads // HEADS
    first_head = (pair % n_runs) * HEADS
    return pair // n_runs, first_head, first_head // GROUP


@gluon.jit
def _step(it, lo, n_m, first_head, HEADS: gl.constexpr, LOCKSTEP: gl.constexpr, BLOCK_M: gl.constexpr):
    """Step `it` of a CTA's HEADS * n_m query blocks: (query head, first row). Head after head from `lo` on, or
    with LOCKSTEP the last block first, every one of its heads at each block (`kernels.fa3.BackwardConfig`)."""
    if LOCKSTEP:
        return first_head + it % HEADS, lo + (n_m - 1 - it // HEADS) * BLOCK_M
    return first_head + it // n_m, lo + (it % n_m) * BLOCK_M


@gluon.jit
def _column_halves(x):
    """An (M, N) register tensor as its columns [0, N/2) and [N/2, N): in the wgmma accumulator layout a thread
    holds both halves of its rows, so no data moves (`fa3_hopper._halve_columns`)."""
    M: gl.constexpr = x.shape[0]
    N: gl.constexpr = x.shape[1]
    return gl.split(gl.permute(gl.reshape(x, [M, 2, N // 2]), (0, 2, 1)))


@gluon.jit
def _reduce_add(x, tile, desc, off_b, off_hk, row, col):
    """x (registers, float32) added into desc's tensor at [off_b, off_hk, row, col] through the shared `tile`, once
    the tile's previous TMA copy has read it."""
    tma.store_wait(0)
    tile.store(x)
    fence_async_shared()
    tma_reduce_add(desc, [off_b, off_hk, row, col], as_4d(tile, desc))


@gluon.jit
def _kv_reduce(x, tile, desc, off_b, off_hk, row, CHUNK: gl.constexpr):
    """A (64, HEAD_DIM) float32 partial dK or dV into its accumulator, CHUNK columns (1 or 2 chunks) at a time
    through this warpgroup's float32 staging tile (the dQ one, free once the loop is done) and TMA reduce-adds."""
    HEAD_DIM: gl.constexpr = x.shape[1]
    gl.static_assert((HEAD_DIM == CHUNK) | (HEAD_DIM == 2 * CHUNK), "dK/dV reduce-adds take 1 or 2 chunks")
    if HEAD_DIM == CHUNK:
        _reduce_add(x, tile, desc, off_b, off_hk, row, 0)
    else:
        left, right = _column_halves(x)
        _reduce_add(left, tile, desc, off_b, off_hk, row, 0)
        _reduce_add(right, tile, desc, off_b, off_hk, row, CHUNK)
    tma.store_wait(0)


@gluon.jit
def _consumer(keys_smem, ring, dsb, dk_desc, dv_desc, dq_desc, n_heads, seqlen_q, seqlen_k, window_left, window_right,
              KEY_START, KEY_LIMIT, QUERY_START, QUERY_LIMIT, BLOCK_ORDER, SECTION_HEADS, qk_scale, softcap_in,
              softmax_scale, CID: gl.constexpr,
              NUM_CONSUMERS: gl.constexpr, GROUP: gl.constexpr, HEADS: gl.constexpr, LEFT: gl.constexpr,
              RIGHT: gl.constexpr,
              DOCS: gl.constexpr, SOFTCAP: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
              SPLIT_DQ: gl.constexpr, SEPARATE_DQ: gl.constexpr, LOCKSTEP: gl.constexpr):
    """Consumer warpgroup CID: keys [start_n + 64 * CID, + 64) of the CTA's key block.

    SPLIT_DQ "cols" or "rows" (`kernels.fa3.BackwardConfig`): the warpgroups share dS through shared memory and
    each computes HEAD_DIM / NUM_CONSUMERS columns, or BLOCK_M / NUM_CONSUMERS rows, of dQ_i over all the CTA's
    keys (FA3's split: each dQ element is added once per CTA).
    """
    dtype: gl.constexpr = ring.q.dtype
    BLOCK_N: gl.constexpr = NUM_CONSUMERS * BLOCK_KEYS
    k_smem = keys_smem.k
    DQ_M: gl.constexpr = BLOCK_M // NUM_CONSUMERS if SPLIT_DQ == "rows" else BLOCK_M
    DQ_N: gl.constexpr = HEAD_DIM // NUM_CONSUMERS if SPLIT_DQ == "cols" else HEAD_DIM
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_N, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    block, pair = _cta_block(seqlen_k, SECTION_HEADS, BLOCK_ORDER, DOCS, BLOCK_N)
    start_n = block * BLOCK_N
    off_b, first_head, off_hk = _cta_heads(pair, n_heads, GROUP, HEADS)
    lo, m_free, m_free_hi, n_m = _query_range(start_n, seqlen_q, seqlen_k, window_left, window_right, QUERY_START,
                                              QUERY_LIMIT, LEFT, RIGHT, DOCS, BLOCK_M, BLOCK_N)
    # K is one (BLOCK_N, HEAD_DIM) tile: wider-than-swizzle tiles are stored in column panels, so two stacked
    # (64, HEAD_DIM) tiles would not read as one (BLOCK_N, HEAD_DIM) tile for SPLIT_DQ.
    k_tile = k_smem.slice(CID * BLOCK_KEYS, BLOCK_KEYS, dim=0)
    v_tile = keys_smem.v.index(CID)
    if SPLIT_DQ == "cols":
        dq_b = k_smem.slice(CID * DQ_N, DQ_N, dim=1)  # dQ_i[:, cols] = dS_i K[:, cols]
    else:
        dq_b = k_smem  # dQ_i[rows, :] = dS_i[rows, :] K
    keys = start_n + CID * BLOCK_KEYS + gl.arange(0, BLOCK_KEYS, layout=gl.SliceLayout(1, s_layout))
    diag_offset = seqlen_k - seqlen_q

    dk = gl.zeros([BLOCK_KEYS, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([BLOCK_KEYS, HEAD_DIM], gl.float32, layout=acc_layout)
    dq_tile = dsb.dq.index(CID)
    DQ_ROW: gl.constexpr = CID * DQ_M if SPLIT_DQ == "rows" else 0
    dq_col = CID * DQ_N if SPLIT_DQ == "cols" else 0
    mbarrier.wait(keys_smem.loaded, 0)
    for it in range(HEADS * n_m):
        slot = ring.slot(it)
        off_h, start_m = _step(it, lo, n_m, first_head, HEADS, LOCKSTEP, BLOCK_M)
        q_tile = ring.q.index(slot)
        do_tile = ring.do.index(slot)
        mbarrier.wait(ring.ready.index(slot), ring.phase(it))
        zeros = gl.zeros([BLOCK_KEYS, BLOCK_M], gl.float32, layout=s_layout)
        s_t = warpgroup_mma(k_tile, q_tile.permute((1, 0)), zeros, use_acc=False, is_async=True)
        stats = ring.stats.index(slot)  # the LSE and delta came with Q_i and dO_i
        # dP^T's accumulator starts at -delta, so the GEMM gives dP^T - delta (no delta held in registers until
        # dS, where they are scarcest)
        delta = stats.slice(BLOCK_M, BLOCK_M).load(col_layout)
        dp_t = warpgroup_mma(v_tile, do_tile.permute((1, 0)), zeros - gl.expand_dims(delta, 0), is_async=True)
        # Past seqlen_q the LSE and delta are zero-filled and Q_i and dO_i read as zero, so those queries give
        # P^T = 1 and dS^T = 1 * (0 - 0) = 0: they add nothing to dV and dK, and no mask is needed.
        lse = stats.slice(0, BLOCK_M).load(col_layout)
        s_t = warpgroup_mma_wait(1, deps=(s_t,))  # S^T is done; dP^T may still run
        if SOFTCAP:  # the forward's cap (`fa3_hopper._softmax_block`); its derivative scales dS below
            t = _tanh(s_t * softcap_in)
            p_t = gl.exp2(t * qk_scale - gl.expand_dims(lse, 0))
        else:
            p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse, 0))
        if DOCS:  # the host's per-row key bounds (rows past seqlen_q take the last row's: their dS is 0)
            if (start_m < m_free) | (start_m >= m_free_hi):
                cols = gl.minimum(start_m + gl.arange(0, BLOCK_M, layout=col_layout), seqlen_q - 1)
                p_t = _mask_band(p_t, keys, gl.load(KEY_START + cols), gl.load(KEY_LIMIT + cols) - 1, True, True)
        elif LEFT:
            if (start_m < m_free) | (start_m >= m_free_hi):
                cols = start_m + gl.arange(0, BLOCK_M, layout=col_layout)
                p_t = _mask_band(p_t, keys, cols + (diag_offset - window_left), cols + (diag_offset + window_right),
                                 LEFT, RIGHT)
        elif RIGHT:
            if start_m < m_free:
                cols = start_m + gl.arange(0, BLOCK_M, layout=col_layout)
                p_t = _mask_band(p_t, keys, cols, cols + (diag_offset + window_right), LEFT, RIGHT)
        p_op = gl.convert_layout(p_t.to(dtype), op_layout)
        dv = warpgroup_mma(p_op, do_tile, dv, is_async=True)  # dV += P^T dO
        dp_t, p_op = warpgroup_mma_wait(1, deps=(dp_t, p_op))
        if SOFTCAP:  # d/ds softcap * tanh(s * scale / softcap) = scale * (1 - tanh^2); scale is applied at the end
            ds_t = (p_t * dp_t * (1.0 - t * t)).to(dtype)
        else:
            ds_t = (p_t * dp_t).to(dtype)
        ds_op = gl.convert_layout(ds_t, op_layout)
        dk = warpgroup_mma(ds_op, q_tile, dk, is_async=True)  # dK += dS^T Q (scaled at the end)

        if SEPARATE_DQ:  # dQ comes from FA2's query-major kernel after this one
            dv, dk, ds_op = warpgroup_mma_wait(0, deps=(dv, dk, ds_op))
            mbarrier.arrive(ring.empty.index(slot))
        else:
            # dS^T to shared memory (double-buffered: the other warpgroup may still read the previous block's).
            buf = dsb.slot(it)
            ds_all = dsb.ds.index(buf)
            mbarrier.wait(dsb.free.index(buf), dsb.phase(it) ^ 1)  # a fresh barrier passes phase 1
            ds_all.slice(CID * BLOCK_KEYS, BLOCK_KEYS, dim=0).store(ds_t)
            fence_async_shared()
            mbarrier.arrive(dsb.ready.index(buf))
            mbarrier.wait(dsb.ready.index(buf), dsb.phase(it))  # every warpgroup's dS^T is in
            dq_a = ds_all.slice(DQ_ROW, DQ_M, dim=1).permute((1, 0))
            dq = warpgroup_mma(dq_a, dq_b, gl.zeros([DQ_M, DQ_N], gl.float32, layout=dq_layout), use_acc=False,
                               is_async=True)
            dv, dk, dq, ds_op = warpgroup_mma_wait(0, deps=(dv, dk, dq, ds_op))
            mbarrier.arrive(dsb.free.index(buf))
            mbarrier.arrive(ring.empty.index(slot))  # every GEMM that reads Q_i and dO_i is done
            _dq_reduce(dq, dq_tile, dq_desc, off_b, off_h, start_m + DQ_ROW, dq_col)
    row_k = start_n + CID * BLOCK_KEYS
    if HEADS < GROUP:  # the group's other CTAs add theirs to the same keys' float32 accumulators
        _kv_reduce(dv, dq_tile, dv_desc, off_b, off_hk, row_k, DQ_N)
        _kv_reduce(dk * softmax_scale, dq_tile, dk_desc, off_b, off_hk, row_k, DQ_N)
    else:
        # This warpgroup's V tile is no longer read (K is: the other warpgroup's dQ GEMM may still run under
        # a split dQ): it stages dV, then dK, for the TMA stores.
        v_tile.store(dv.to(dtype))
        fence_async_shared()
        tma_store(dv_desc, [off_b, off_hk, row_k, 0], as_4d(v_tile, dv_desc))
        tma.store_wait(0)
        v_tile.store((dk * softmax_scale).to(dtype))
        fence_async_shared()
        tma_store(dk_desc, [off_b, off_hk, row_k, 0], as_4d(v_tile, dk_desc))
        tma.store_wait(0)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, do_desc, keys_smem, ring, LSE, DELTA, n_heads, seqlen_q, seqlen_k, window_left,
              window_right, QUERY_START, QUERY_LIMIT, BLOCK_ORDER, SECTION_HEADS, NUM_CONSUMERS: gl.constexpr,
              GROUP: gl.constexpr, HEADS: gl.constexpr,
              LEFT: gl.constexpr, RIGHT: gl.constexpr, DOCS: gl.constexpr, BLOCK_M: gl.constexpr,
              LOCKSTEP: gl.constexpr):
    """The loading warp: the CTA's K and V once, then Q_i and dO_i (TMA) and LSE_i and delta_i (cp.async) of every
    query block into the ring."""
    BLOCK_N: gl.constexpr = NUM_CONSUMERS * BLOCK_KEYS
    block, pair = _cta_block(seqlen_k, SECTION_HEADS, BLOCK_ORDER, DOCS, BLOCK_N)
    start_n = block * BLOCK_N
    off_b, first_head, off_hk = _cta_heads(pair, n_heads, GROUP, HEADS)
    kv_bar = keys_smem.loaded
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + NUM_CONSUMERS * v_desc.block_type.nbytes)
    tma_load(k_desc, [off_b, off_hk, start_n, 0], kv_bar, as_4d(keys_smem.k, k_desc))
    for c in gl.static_range(NUM_CONSUMERS):
        row = start_n + c * BLOCK_KEYS
        tma_load(v_desc, [off_b, off_hk, row, 0], kv_bar, as_4d(keys_smem.v.index(c), v_desc))
    lo, _, _, n_m = _query_range(start_n, seqlen_q, seqlen_k, window_left, window_right, QUERY_START, QUERY_LIMIT,
                                 LEFT, RIGHT, DOCS, BLOCK_M, BLOCK_N)
    for it in range(HEADS * n_m):
        slot = ring.slot(it)
        off_h, start_m = _step(it, lo, n_m, first_head, HEADS, LOCKSTEP, BLOCK_M)
        ready = ring.ready.index(slot)
        mbarrier.wait(ring.empty.index(slot), ring.phase(it) ^ 1)  # a fresh barrier passes phase 1
        mbarrier.expect(ready, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma_load(q_desc, [off_b, off_h, start_m, 0], ready, as_4d(ring.q.index(slot), q_desc))
        tma_load(do_desc, [off_b, off_h, start_m, 0], ready, as_4d(ring.do.index(slot), do_desc))
        _load_stats(ring.stats.index(slot), ready, LSE, DELTA, off_b * n_heads + off_h, start_m, seqlen_q, BLOCK_M)


@gluon.jit
def fa3_bwd_kernel(
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, DELTA,
    n_heads, seqlen_q, seqlen_k, window_left, window_right, KEY_START, KEY_LIMIT, QUERY_START, QUERY_LIMIT,
    BLOCK_ORDER, SECTION_HEADS, qk_scale, softcap_in, softmax_scale, GROUP: gl.constexpr, HEADS: gl.constexpr,
    LEFT: gl.constexpr, RIGHT: gl.constexpr,
    DOCS: gl.constexpr, SOFTCAP: gl.constexpr, NUM_CONSUMERS: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr, SPLIT_DQ: gl.constexpr, SEPARATE_DQ: gl.constexpr,
    LOCKSTEP: gl.constexpr,
    Q_LAYOUT: gl.constexpr, KV_LAYOUT: gl.constexpr, DS_LAYOUT: gl.constexpr, DQ_LAYOUT: gl.constexpr,
):
    """Grid (cdiv(seqlen_k, NUM_CONSUMERS * 64) * batch * n_heads / HEADS,), in sections of SECTION_HEADS (batch,
    HEADS query heads) pairs (`_cta_block`): see the module docstring. HEADS = GROUP: dk_desc and dv_desc are over
    dK and dV (the inputs' dtype, boxes of 64 keys); HEADS < GROUP: over zeroed float32 accumulators (batch,
    n_kv_heads, seqlen_k, head_dim) with the dQ boxes' (64, columns), to which the group's CTAs reduce-add. LSE, DELTA:
    float32 (batch, n_heads, seqlen_q); dq_desc: over the zeroed float32 (batch, n_heads, seqlen_q, head_dim) dQ
    accumulator padded to whole BLOCK_M-row blocks (any strides TMA takes: the host keeps it in q's memory order),
    with the (1, 1, rows, columns) boxes of one warpgroup's share of dQ_i (SPLIT_DQ); with SEPARATE_DQ never
    written (the host passes a one-box stand-in). The launch sets `maxnreg` (`BackwardConfig.maxnreg`)."""
    dtype: gl.constexpr = q_desc.dtype
    k_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS * BLOCK_KEYS, HEAD_DIM], KV_LAYOUT)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, BLOCK_KEYS, HEAD_DIM], KV_LAYOUT)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], Q_LAYOUT)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], Q_LAYOUT)
    ds_smem = gl.allocate_shared_memory(dtype, [2, NUM_CONSUMERS * BLOCK_KEYS, BLOCK_M], DS_LAYOUT)
    DQ_M: gl.constexpr = BLOCK_M // NUM_CONSUMERS if SPLIT_DQ == "rows" else BLOCK_M
    DQ_N: gl.constexpr = HEAD_DIM // NUM_CONSUMERS if SPLIT_DQ == "cols" else HEAD_DIM
    dq_smem = gl.allocate_shared_memory(gl.float32, [NUM_CONSUMERS, DQ_M, DQ_N], DQ_LAYOUT)
    # per ring slot the query block's LSE and delta (loaded where they are used, their global-load latency stalled
    # the consumers' loop: Nsight Compute, docs/hopper-notes.md)
    stats_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 2 * BLOCK_M],
                                           gl.SwizzledSharedLayout(1, 1, 1, [0]))  # per buffer
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=NUM_CONSUMERS)
        mbarrier.init(ds_free.index(i), count=NUM_CONSUMERS)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1 + 32)  # the TMA's expect, the producer's 32 threads' cp.async
        mbarrier.init(empty.index(i), count=NUM_CONSUMERS)  # one arrival per consumer
    fence_async_shared()
    keys_smem = Keys(k_smem, v_smem, kv_bar)
    ring = QueryRing(q_smem, do_smem, stats_smem, ready, empty, NUM_STAGES)
    dsb = DsBuffers(ds_smem, dq_smem, ds_ready, ds_free)

    # Written out per partition: tuple concatenation inside a Gluon kernel turns constexprs into tensors.
    if NUM_CONSUMERS == 1:  # the consumer is the default partition; the kernel's maxnreg sets its registers
        gl.warp_specialize(
            [
            (_consumer, (keys_smem, ring, dsb, dk_desc, dv_desc, dq_desc, n_heads, seqlen_q, seqlen_k, window_left,
                         window_right, KEY_START, KEY_LIMIT, QUERY_START, QUERY_LIMIT, BLOCK_ORDER, SECTION_HEADS,
                         qk_scale, softcap_in, softmax_scale, 0, NUM_CONSUMERS, GROUP, HEADS, LEFT, RIGHT, DOCS,
                         SOFTCAP,
                         BLOCK_M, HEAD_DIM, SPLIT_DQ, SEPARATE_DQ, LOCKSTEP)),
            (_producer, (q_desc, k_desc, v_desc, do_desc, keys_smem, ring, LSE, DELTA, n_heads, seqlen_q, seqlen_k,
                         window_left, window_right, QUERY_START, QUERY_LIMIT, BLOCK_ORDER, SECTION_HEADS,
                         NUM_CONSUMERS, GROUP, HEADS, LEFT, RIGHT, DOCS, BLOCK_M, LOCKSTEP)),
            ],
            [1],
            [24],
        )
    else:
        gl.warp_specialize(
            [
            (_consumer, (keys_smem, ring, dsb, dk_desc, dv_desc, dq_desc, n_heads, seqlen_q, seqlen_k, window_left,
                         window_right, KEY_START, KEY_LIMIT, QUERY_START, QUERY_LIMIT, BLOCK_ORDER, SECTION_HEADS,
                         qk_scale, softcap_in, softmax_scale, 0, NUM_CONSUMERS, GROUP, HEADS, LEFT, RIGHT, DOCS,
                         SOFTCAP,
                         BLOCK_M, HEAD_DIM, SPLIT_DQ, SEPARATE_DQ, LOCKSTEP)),
            (_consumer, (keys_smem, ring, dsb, dk_desc, dv_desc, dq_desc, n_heads, seqlen_q, seqlen_k, window_left,
                         window_right, KEY_START, KEY_LIMIT, QUERY_START, QUERY_LIMIT, BLOCK_ORDER, SECTION_HEADS,
                         qk_scale, softcap_in, softmax_scale, 1, NUM_CONSUMERS, GROUP, HEADS, LEFT, RIGHT, DOCS,
                         SOFTCAP,
                         BLOCK_M, HEAD_DIM, SPLIT_DQ, SEPARATE_DQ, LOCKSTEP)),
            (_producer, (q_desc, k_desc, v_desc, do_desc, keys_smem, ring, LSE, DELTA, n_heads, seqlen_q, seqlen_k,
                         window_left, window_right, QUERY_START, QUERY_LIMIT, BLOCK_ORDER, SECTION_HEADS,
                         NUM_CONSUMERS, GROUP, HEADS, LEFT, RIGHT, DOCS, BLOCK_M, LOCKSTEP)),
            ],
            [4, 1],
            [240, 24],
        )
