"""FlashAttention-3-style forward for Hopper (sm_90), written in Gluon (`triton.experimental.gluon`, Triton 3.6).

Source: Shah et al. 2024, "FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision",
Section 3.1 (producer-consumer warp specialisation, ping-pong scheduling) and Algorithm 2 (intra-warpgroup
overlap of the softmax with the two GEMMs). The arithmetic is FA2's (`kernels/fa2.py`): un-scaled
accumulation, exp2 with log2(e) folded into `qk_scale`, a base-2 LSE with +inf for rows that see no key,
flash-attn's masks aligned bottom-right (causal, and the sliding window (window_left, window_right): LEFT and
RIGHT constexprs say which edges exist, causal is RIGHT with window_right = 0), GQA by head index.

A tile is NUM_CONSUMERS * BLOCK_M query rows of one (batch, head). The grid is persistent: each CTA runs a
share of the tiles (`_tile`: a few heads at a time, so their K/V stay in L2; under causal, pairs of a long and a
short tile, so the shares are equal). Each CTA has
NUM_CONSUMERS + 1 partitions (`gl.warp_specialize`):
- producer (1 warp, few registers): per tile, TMA-loads the consumers' Q tiles (once the QK GEMMs of the
  previous tile are done with them: `q_empty`), then every K and V block of the
  tile's key range into a NUM_STAGES-deep shared-memory ring. `k_ready`/`v_ready` mbarriers say a slot is
  full; `k_empty`/`v_empty` (one arrival per consumer) say every consumer is done with it. The ring position
  runs on across tiles, so the next tile's loads overlap this tile's last blocks and epilogue.
- NUM_CONSUMERS (2 or 3) consumer warpgroups (4 warps each, most registers), one per BLOCK_M-row Q tile. Per
  K/V block j a consumer issues S_j = Q K_j^T (wgmma, async), then O += P_{j-1} V_{j-1} (wgmma, async, P from
  registers), waits for S_j only, runs the softmax of block j while the PV wgmma still runs, then waits for
  it and rescales O (FA3 Algorithm 2). With PINGPONG the consumers take turns issuing their GEMMs (one
  mbarrier each), so one warpgroup's softmax runs under the others' GEMMs. O leaves through its own shared
  buffer and a TMA store that completes under the next tile.
The producer loads the K/V blocks [lo, hi) of the tile's key range (`_key_range`; blocks outside it never: FA2's
stages [3]), so a sliding window costs what its band holds, not the whole row. Each consumer works out its own
ranges for its BLOCK_M rows: blocks of [lo_free, hi_free) are visible to all its rows and run unmasked, the ones
at the edges are masked (a compare per edge and a select per score against the row's key range), and the tile's
blocks that none of its rows see past its right edge (causal: past its diagonal) are skipped, only their ring slots
released (`_skip_block`). One loop runs both kinds of block, branching per block.
Packed sequences (DOCS, batch 1: the sequences back to back) are the same band with per-row edges: row i sees keys
[KEY_START[i], KEY_LIMIT[i]) (its own sequence, cut by a causal mask or window: `kernels.fa3.doc_bounds`), both
non-decreasing in i, so a tile's range and its all-visible blocks follow from its first and last rows' bounds. Tiles
straddle sequence edges: TMA loads whole blocks, and the mask drops the other sequence's keys.

q, k, v and o come through host-made 4-D TMA descriptors over (batch, heads, seqlen, head_dim) with the
inputs' own strides, so any 16-byte-aligned layout with a unit last stride works (the model's (B, T, H, D)
memory too); rows past seqlen read as 0 and are not written, and so do columns past head_dim (head_dim 96 runs
with HEAD_DIM 128: the zero columns add 0 to Q K^T and give O zero columns, never stored). Shared tiles are 2-D
for wgmma and seen as (1, 1, rows, HEAD_DIM) by TMA (`as_4d`: the same bytes and swizzle). This module is imported only on a
Triton whose Gluon API it was written against (`kernels/fa3.py` decides).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from .gluon_compat import aggregate, as_4d, constexpr_function, tma_load, tma_store


@aggregate
class KVRing:
    """The K/V blocks' NUM_STAGES-deep shared-memory ring and its mbarriers. Block number `it` (counted across the
    CTA's tiles, the same way by the producer and every consumer) lives in slot it % NUM_STAGES; the slot's
    barriers complete once per lap, so their phase is the lap's parity. `*_ready`: the TMA load has landed;
    `*_empty`: every consumer is done with the slot (one arrival each)."""
    k: gl.shared_memory_descriptor
    v: gl.shared_memory_descriptor
    k_ready: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    k_empty: gl.shared_memory_descriptor
    v_empty: gl.shared_memory_descriptor
    NUM_STAGES: gl.constexpr

    @constexpr_function
    def __init__(self, k, v, k_ready, v_ready, k_empty, v_empty, NUM_STAGES):
        self.k, self.v = k, v
        self.k_ready, self.v_ready, self.k_empty, self.v_empty = k_ready, v_ready, k_empty, v_empty
        self.NUM_STAGES = gl.constexpr(NUM_STAGES)

    @gluon.jit
    def slot(self, it):
        return it % self.NUM_STAGES

    @gluon.jit
    def phase(self, it):
        return (it // self.NUM_STAGES) & 1


@aggregate
class QTiles:
    """Each consumer's Q and O tiles, the Q tiles' barriers (`q_ready`: loaded; `q_empty`: its QK GEMMs are done),
    and the ping-pong turn barriers, one per consumer."""
    q: gl.shared_memory_descriptor
    o: gl.shared_memory_descriptor
    q_ready: gl.shared_memory_descriptor
    q_empty: gl.shared_memory_descriptor
    turns: gl.shared_memory_descriptor

    @constexpr_function
    def __init__(self, q, o, q_ready, q_empty, turns):
        self.q, self.o, self.q_ready, self.q_empty, self.turns = q, o, q_ready, q_empty, turns

@gluon.jit
def _softmax_block(s, m_i, l_i, key_start, key_limit, start_n, qk_scale, softcap_in, MASKED: gl.constexpr,
                   LEFT: gl.constexpr, SOFTCAP: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """Online softmax of one (BLOCK_M, BLOCK_N) score block (FA2 Algorithm 1, lines 8-9, base 2).

    key_start, key_limit (per row): the row sees keys [key_start, key_limit) (key_start only with LEFT, a sliding
    window's left edge). MASKED: a compare per edge and one select per score against the row's limits shifted to
    the block; the scale stays fused into the exp2's FFMA as in the unmasked path.
    l_i is each thread's share of the row sums (`_halve_columns`' (BLOCK_M, 4) layout), added across the 4 lanes
    only once per tile (`_row_sums`), as FA3 does: no shuffles on the way to the PV GEMM's wait.
    SOFTCAP: the scores are capped first, s -> tanh(s * softcap_in) (`_tanh`), with the host's qk_scale then
    softcap * log2(e): softcap * tanh(softmax_scale * s / softcap) in base 2 (Gemma 2's logit cap, flash-attn's
    `softcap`); the mask follows the cap, so masked scores stay -inf.
    Returns p (float32, un-normalised), alpha = exp2(m_old - m_new) and the new m_i, l_i.
    """
    if SOFTCAP:
        s = _tanh(s * softcap_in)
    if MASKED:
        cols = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)), 0)
        visible = cols < gl.expand_dims(key_limit - start_n, 1)
        if LEFT:
            visible = visible & (cols >= gl.expand_dims(key_start - start_n, 1))
        s = gl.where(visible, s, float("-inf"))
    row_max = gl.convert_layout(gl.max(_halve_columns(s, True, BLOCK_N), axis=1), gl.SliceLayout(1, s_layout),
                                assert_trivial=True)
    m_new = gl.maximum(m_i, row_max * qk_scale)
    if MASKED:
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see no key yet stay finite
    else:
        m_ref = m_new
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_ref, 1))
    alpha = gl.exp2(m_i - m_ref)
    alpha_l = gl.convert_layout(alpha, gl.SliceLayout(1, l_i.type.layout), assert_trivial=True)
    l_i = l_i * gl.expand_dims(alpha_l, 1) + _halve_columns(p, False, BLOCK_N)
    return p, alpha, m_new, l_i


@gluon.jit
def _tanh(x):
    """tanh, float32, by the hardware's approximation (`tanh.approx.f32`, max relative error 2^-10.99: below bf16's
    rounding), as FA3's softcap."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _to_operand(p, dtype: gl.constexpr, PACKED_CVT: gl.constexpr):
    """P (float32) rounded to dtype (float16 or bfloat16) for the PV GEMM's register operand.

    PACKED_CVT: two values per `cvt.rn.{bf16,f16}x2.f32` into one 32-bit register (inline PTX). With three
    consumer warpgroups (160 registers) `p.to(dtype)`'s scalar conversions, which LLVM moves across the K/V loop's
    back edge, came out of ptxas with a `PRMT` per packed register (32 a block, ~7 % of the loop's instructions);
    with two (240 registers) there are none, and the inline PTX costs 24 `MOV`s a block instead (SASS, Triton 3.6;
    docs/hopper-notes.md, forward variant 17). A thread's values 2 i and 2 i + 1 are adjacent columns of one row in
    the wgmma accumulator layout, the pair the A operand's layout puts in one register.
    """
    if PACKED_CVT:
        if dtype == gl.bfloat16:
            return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.bfloat16,
                                             is_pure=True, pack=2)
        else:
            return gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.float16,
                                             is_pure=True, pack=2)
    else:
        return p.to(dtype)


@gluon.jit
def _halve_columns(x, IS_MAX: gl.constexpr, N: gl.constexpr):
    """Max (IS_MAX) or sum of each row's values within each thread: an (M, N) tensor in the wgmma accumulator
    layout -> (M, 4), the 4 lanes that share a row.

    A thread holds columns 8 i + 2 lane + {0, 1} of its rows. `gl.max`/`gl.sum` fold a thread's values of a row
    as one dependent chain (31 FMNMX at N = 128, ~150 clocks before the first exp2 can start); halving the
    columns while the top half is in the same thread's registers does the same count at depth 5. Exact for the
    max; the sum only rounds in another order.
    """
    M: gl.constexpr = x.shape[0]
    if N > 8:
        a, b = gl.split(gl.permute(gl.reshape(x, [M, 2, N // 2]), (0, 2, 1)))
        if IS_MAX:
            r = _halve_columns(gl.maximum(a, b), IS_MAX, N // 2)
        else:
            r = _halve_columns(a + b, IS_MAX, N // 2)
    else:
        a, b = gl.split(gl.reshape(x, [M, N // 2, 2]))
        if IS_MAX:
            r = gl.maximum(a, b)
        else:
            r = a + b
    return r


@gluon.jit
def _row_sums(l_i, row_layout: gl.constexpr):
    """The row sums from the lanes' shares (`_softmax_block`'s l_i)."""
    return gl.convert_layout(gl.sum(l_i, axis=1), row_layout, assert_trivial=True)


@gluon.jit
def _snake_count(n_tiles):
    """How many of n_tiles this CTA takes when the CTAs take them in rounds of grid, every other round in reverse:
    the last, partial round's first places."""
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    rounds = n_tiles // grid
    place = gl.where(rounds % 2 == 0, pid, grid - 1 - pid)
    return rounds + gl.where(place < n_tiles - rounds * grid, 1, 0)


@gluon.jit
def _paired_count(n_tiles):
    """How many of the first n_tiles this CTA runs as the first and second tiles of pairs pid, pid + grid, ...
    (tiles 2 * pair and 2 * pair + 1)."""
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    firsts = gl.cdiv(gl.maximum(n_tiles - 2 * pid, 0), 2 * grid)
    seconds = gl.cdiv(gl.maximum(n_tiles - 2 * pid - 1, 0), 2 * grid)
    return firsts + seconds


@gluon.jit
def _n_tiles_of_cta(n_tiles, tail_start, PAIRED: gl.constexpr, SNAKE: gl.constexpr, TAIL: gl.constexpr):
    """How many tiles this CTA runs (`_tile`'s i = 0, 1, ...)."""
    if SNAKE:
        return _snake_count(n_tiles)
    if PAIRED:
        if TAIL:  # pairs before tail_start, then the tail's single tiles
            paired = gl.minimum(n_tiles, 2 * tail_start)
            return _paired_count(paired) + _snake_count(n_tiles - paired)
        return _paired_count(n_tiles)
    return gl.cdiv(gl.maximum(n_tiles - gl.program_id(0), 0), gl.num_programs(0))


@gluon.jit
def _tail_tile(j, tail_start, n_tiles_m, n_tiles):
    """The tail's j-th longest tile -> (batch * heads + head, query block). The tail is the pairs from tail_start
    on (an even n_tiles_m: pair u of a head holds its query blocks n_tiles_m - 1 - u and u): the middle blocks
    [u0, n_tiles_m - u0) of the head it starts in (when it starts within a head: pairs u >= u0 of head h0) and every
    block of the heads after it. Longest first is query block n_tiles_m - 1 first, and so on down, the heads in
    order at each block."""
    half = n_tiles_m // 2
    h0 = tail_start // half
    u0 = tail_start - h0 * half
    partial = gl.where(u0 > 0, 1, 0)
    whole = n_tiles // n_tiles_m - h0 - partial  # heads wholly in the tail
    top = u0 * whole  # blocks n_tiles_m - 1 down to n_tiles_m - u0: the whole heads only
    middle = (n_tiles_m - 2 * u0) * (whole + partial)  # blocks n_tiles_m - 1 - u0 down to u0: the partial head too
    per_top = gl.maximum(whole, 1)
    if j < top:
        pid_m = n_tiles_m - 1 - j // per_top
        bh = h0 + partial + j % per_top
    elif j < top + middle:
        jm = j - top
        pid_m = n_tiles_m - 1 - u0 - jm // (whole + partial)
        bh = h0 + jm % (whole + partial)
    else:
        jb = j - top - middle
        pid_m = u0 - 1 - jb // per_top
        bh = h0 + partial + jb % per_top
    return bh, pid_m


@gluon.jit
def _tile(i, n_tiles_m, n_tiles, tail_start, n_heads, seqlen_q, seqlen_k, window_left, window_right, KEY_START,
          KEY_LIMIT, TILE_ORDER, LEFT: gl.constexpr, RIGHT: gl.constexpr, DOCS: gl.constexpr, TAIL: gl.constexpr,
          ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
    """This CTA's i-th tile -> (batch, head, batch * n_heads + head, first row, first key of the tile's key
    range (a multiple of BLOCK_N), how many K/V blocks from there the producer loads).

    Both orders keep the query blocks of one (batch, head) together, so the CTAs running at once read the K/V of
    a few heads, which stay in L2. Tiles of about equal cost (no mask, or a sliding window's left edge): CTA p runs
    tiles p, p + grid, ... in (head, query block) order. Causal (a right edge only: `_paired`): each head's query blocks are paired longest with shortest (last with first, then the next two inwards,
    the middle one alone when there is an odd number: it pairs with the next head's, whose order is reversed), so
    every pair has about the same number of K/V blocks; CTA p runs pairs p, p + grid, ..., the long tile first
    (except in the reversed heads, whose pairs come short tile first). With TAIL (an even n_tiles_m), only the pairs
    before tail_start (a multiple of grid: whole rounds) run so; the rest run as single tiles, longest first, in
    rounds of grid, every other round in reverse (`_tail_tile`), which evens out the CTAs' last rounds: with equal
    pairs only, 2048 pairs on 132 CTAs take 16 rounds where 15.5 would do (`kernels.fa3.tail_start`).
    This balances the persistent CTAs' work as running all heads' longest blocks first did (an earlier order,
    which read ~130 heads' K/V at once: 78 % DRAM bandwidth, 12 % L2 hits at D = 128, N = 2k).
    Packed sequences (DOCS): tile costs follow the sequences' lengths, so the host sorts the tiles longest first
    (TILE_ORDER, `kernels.fa3.tile_order`) and the CTAs take them in rounds of grid, every other round in reverse
    (a snake: each CTA's long and short tiles even out).
    """
    if DOCS:
        place = gl.where(i % 2 == 0, gl.program_id(0), gl.num_programs(0) - 1 - gl.program_id(0))
        t = gl.load(TILE_ORDER + i * gl.num_programs(0) + place)
        pid_m = t % n_tiles_m
        bh = t // n_tiles_m
    elif _paired(LEFT, RIGHT):
        s = 2 * (gl.program_id(0) + (i // 2) * gl.num_programs(0)) + i % 2
        bh = s // n_tiles_m
        u = s % n_tiles_m
        if (n_tiles_m % 2 == 1) & (bh % 2 == 1):
            u = n_tiles_m - 1 - u
        pid_m = gl.where(u % 2 == 0, n_tiles_m - 1 - u // 2, u // 2)
        if TAIL:
            paired = _paired_count(gl.minimum(n_tiles, 2 * tail_start))
            if i >= paired:
                r = i - paired
                grid = gl.num_programs(0)
                place = gl.where(r % 2 == 0, gl.program_id(0), grid - 1 - gl.program_id(0))
                bh, pid_m = _tail_tile(r * grid + place, tail_start, n_tiles_m, n_tiles)
    else:
        t = gl.program_id(0) + i * gl.num_programs(0)
        pid_m = t % n_tiles_m
        bh = t // n_tiles_m
    start_m = pid_m * ROWS
    lo, hi = _key_range(start_m, ROWS, seqlen_q, seqlen_k, window_left, window_right, KEY_START, KEY_LIMIT, LEFT,
                        RIGHT, DOCS)
    first_n = lo // BLOCK_N * BLOCK_N
    # At least one block, so every partition runs the same code; a tile whose rows see no key masks it all.
    n_blocks = gl.maximum((hi + BLOCK_N - 1) // BLOCK_N - first_n // BLOCK_N, 1)
    return bh // n_heads, bh % n_heads, bh, start_m, first_n, n_blocks


@constexpr_function
def _paired(LEFT, RIGHT):
    """Whether tiles are scheduled in long-short pairs: a right edge only (causal), whose tiles' costs grow with
    the row; with a left edge (a sliding window) every tile costs about the same."""
    return bool(RIGHT) and not bool(LEFT)


@gluon.jit
def _key_range(row0, ROWS: gl.constexpr, seqlen_q, seqlen_k, window_left, window_right, KEY_START, KEY_LIMIT,
               LEFT: gl.constexpr, RIGHT: gl.constexpr, DOCS: gl.constexpr):
    """[lo, hi): the keys that some row of [row0, row0 + ROWS) sees, flash-attn's band aligned bottom-right [3]:
    row i sees key j iff i + d - window_left <= j <= i + d + window_right, d = seqlen_k - seqlen_q, a side
    limited only with LEFT / RIGHT (causal: RIGHT, window_right = 0). hi <= lo when no row sees a key.
    DOCS (packed sequences): row i sees keys [KEY_START[i], KEY_LIMIT[i]), both non-decreasing in i
    (`kernels.fa3.doc_bounds`), so the first row's start and the last row's limit bound the rows'."""
    if DOCS:
        lo = gl.load(KEY_START + gl.minimum(row0, seqlen_q - 1))
        hi = gl.load(KEY_LIMIT + gl.minimum(row0 + ROWS, seqlen_q) - 1)
    else:
        diag = seqlen_k - seqlen_q
        lo = row0 * 0
        hi = seqlen_k + row0 * 0
        if LEFT:
            lo = gl.maximum(row0 + diag - window_left, 0)
        if RIGHT:
            hi = gl.minimum(row0 + ROWS + diag + window_right, seqlen_k)
    return lo, hi


@gluon.jit
def _kv_block(j, kv_it, acc, p_op, m_i, l_i, turn, q_tile, ring, turn_bars, first_n, key_start, key_limit,
              lo_free, hi_free, qk_scale, softcap_in, CID: gl.constexpr, NEXT: gl.constexpr,
              PACKED_CVT: gl.constexpr, PINGPONG: gl.constexpr, LATE_K_RELEASE: gl.constexpr, LEFT: gl.constexpr,
              SOFTCAP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr,
              o_layout: gl.constexpr, p_layout: gl.constexpr):
    """K/V block j >= 1 of a consumer's tile (FA3 Algorithm 2): issue S_j = Q K_j^T and O += P_{j-1} V_{j-1},
    wait for S_j, softmax of block j under the PV GEMM, then wait for it and rescale O. The block holds keys
    [start_n, start_n + BLOCK_N), start_n = first_n + j * BLOCK_N, and is masked outside [lo_free, hi_free).
    LATE_K_RELEASE: K_j's slot goes back to the producer after the softmax rather than as soon as S_j is done
    (the arrive is a warpgroup barrier plus one elected arrive: `ForwardConfig.late_k_release`).
    Returns acc, p_op (P_j as the next PV GEMM's A operand), m_i, l_i, turn."""
    slot = ring.slot(kv_it + j)
    prev = ring.slot(kv_it + j - 1)
    if PINGPONG:
        mbarrier.wait(turn_bars.index(CID), turn & 1)
        turn += 1
    mbarrier.wait(ring.k_ready.index(slot), ring.phase(kv_it + j))
    s = warpgroup_mma(q_tile, ring.k.index(slot).permute((1, 0)),
                      gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout), use_acc=False, is_async=True)
    mbarrier.wait(ring.v_ready.index(prev), ring.phase(kv_it + j - 1))
    acc = warpgroup_mma(p_op, ring.v.index(prev), acc, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn_bars.index(NEXT))
    s = warpgroup_mma_wait(1, deps=(s,))  # S_j is done; the PV GEMM may still run
    if not LATE_K_RELEASE:
        mbarrier.arrive(ring.k_empty.index(slot))
    start_n = first_n + j * BLOCK_N
    if _masked(start_n, lo_free, hi_free, LEFT):
        p, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, key_start, key_limit, start_n, qk_scale, softcap_in, True,
                                            LEFT, SOFTCAP, BLOCK_N, s_layout)
    else:
        p, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, key_start, key_limit, start_n, qk_scale, softcap_in, False,
                                            LEFT, SOFTCAP, BLOCK_N, s_layout)
    if LATE_K_RELEASE:
        mbarrier.arrive(ring.k_empty.index(slot))
    acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
    mbarrier.arrive(ring.v_empty.index(prev))
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    p_op = gl.convert_layout(_to_operand(p, p_op.dtype, PACKED_CVT), p_layout)
    return acc, p_op, m_i, l_i, turn


@gluon.jit
def _masked(start_n, lo_free, hi_free, LEFT: gl.constexpr):
    """Whether the block at start_n needs the mask: outside [lo_free, hi_free), the keys every row sees."""
    if LEFT:
        return (start_n >= hi_free) | (start_n < lo_free)
    return start_n >= hi_free


@gluon.jit
def _skip_block(j, kv_it, turn, ring, turn_bars, CID: gl.constexpr, NEXT: gl.constexpr, PINGPONG: gl.constexpr):
    """K/V block j of the tile that none of this consumer's rows see (past its right edge): no GEMM, no softmax. It still takes
    its PINGPONG turn and frees the ring slot once the block has landed (an earlier arrival could count towards
    the slot's previous use)."""
    slot = ring.slot(kv_it + j)
    phase = ring.phase(kv_it + j)
    if PINGPONG:
        mbarrier.wait(turn_bars.index(CID), turn & 1)
        turn += 1
        mbarrier.arrive(turn_bars.index(NEXT))
    mbarrier.wait(ring.k_ready.index(slot), phase)
    mbarrier.arrive(ring.k_empty.index(slot))
    mbarrier.wait(ring.v_ready.index(slot), phase)
    mbarrier.arrive(ring.v_empty.index(slot))
    return turn


@gluon.jit
def _consumer(tiles, ring, o_desc, LSE, n_tiles_m, n_tiles, tail_start, n_heads, seqlen_q, seqlen_k, window_left,
              window_right, KEY_START, KEY_LIMIT, TILE_ORDER, qk_scale, softcap_in, CID: gl.constexpr,
              NUM_CONSUMERS: gl.constexpr, LEFT: gl.constexpr, RIGHT: gl.constexpr, DOCS: gl.constexpr,
              TAIL: gl.constexpr, SOFTCAP: gl.constexpr, PINGPONG: gl.constexpr,
              LATE_K_RELEASE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Consumer warpgroup CID: rows [start_m + CID * BLOCK_M, + BLOCK_M) of each of the CTA's tiles."""
    dtype: gl.constexpr = tiles.q.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    NEXT: gl.constexpr = (CID + 1) % NUM_CONSUMERS  # whose turn follows ours under PINGPONG
    PACKED_CVT: gl.constexpr = NUM_CONSUMERS > 2  # `_to_operand`: fewer instructions at 160 registers only
    o_tile = tiles.o.index(CID)
    turn_bars = tiles.turns
    kv_it = 0  # position in the K/V ring, running across tiles as in the producer
    turn = 0  # PINGPONG turns taken
    tile_count = 0
    for tile_i in range(_n_tiles_of_cta(n_tiles, tail_start, _paired(LEFT, RIGHT), DOCS, TAIL)):
        off_b, off_h, bh, start_m, first_n, n_blocks = _tile(
            tile_i, n_tiles_m, n_tiles, tail_start, n_heads, seqlen_q, seqlen_k, window_left, window_right, KEY_START,
            KEY_LIMIT, TILE_ORDER, LEFT, RIGHT, DOCS, TAIL, NUM_CONSUMERS * BLOCK_M, BLOCK_N)
        # This warpgroup's own key ranges [3]: keys [lo_free, hi_free) are seen by all its rows (unmasked blocks),
        # blocks before j0 and from n_own on by none of them (skipped: the tile's first blocks can be all left of
        # the last warpgroups' windows, its last block all above the first warpgroups' diagonal). Per row, keys
        # [key_start, key_limit) are visible.
        row0 = start_m + CID * BLOCK_M
        rows = row0 + gl.arange(0, BLOCK_M, layout=row_layout)
        if DOCS:  # the host's per-row bounds (rows past seqlen_q take the last row's: they are not stored)
            last_row = gl.minimum(row0 + BLOCK_M - 1, seqlen_q - 1)
            key_start = gl.load(KEY_START + gl.minimum(rows, seqlen_q - 1))
            key_limit = gl.load(KEY_LIMIT + gl.minimum(rows, seqlen_q - 1))
            hi_free = gl.load(KEY_LIMIT + gl.minimum(row0, seqlen_q - 1)) // BLOCK_N * BLOCK_N
            lo_free = (gl.load(KEY_START + last_row) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        else:
            diag = seqlen_k - seqlen_q
            if RIGHT:
                key_limit = gl.minimum(rows + (diag + window_right + 1), seqlen_k)
                hi_free = gl.minimum(gl.maximum(row0 + diag + window_right + 1, 0), seqlen_k) // BLOCK_N * BLOCK_N
            else:
                key_limit = gl.full([BLOCK_M], seqlen_k, gl.int32, layout=row_layout)
                hi_free = seqlen_k // BLOCK_N * BLOCK_N
            if LEFT:
                key_start = rows + (diag - window_left)
                lo_free = (gl.maximum(row0 + BLOCK_M - 1 + diag - window_left, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
            else:
                key_start = key_limit  # unused
                lo_free = hi_free * 0
        lo, hi = _key_range(row0, BLOCK_M, seqlen_q, seqlen_k, window_left, window_right, KEY_START, KEY_LIMIT, LEFT,
                            RIGHT, DOCS)
        n_own = gl.minimum(gl.maximum((hi + BLOCK_N - 1) // BLOCK_N - first_n // BLOCK_N, 1), n_blocks)
        if LEFT:
            j0 = gl.minimum(lo // BLOCK_N - first_n // BLOCK_N, n_own - 1)
        else:
            j0 = 0
        if row0 >= seqlen_q:  # no rows of ours (the padding of the last tile): block 0 only, the rest skipped
            n_own = 1
            j0 = 0
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_layout)
        l_i = _halve_columns(gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout), False, BLOCK_N)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
        q_tile = tiles.q.index(CID)
        mbarrier.wait(tiles.q_ready.index(CID), tile_count & 1)

        if LEFT:
            for j in range(0, j0):
                turn = _skip_block(j, kv_it, turn, ring, turn_bars, CID, NEXT, PINGPONG)
        # Block j0: S_j0 and its softmax (there is no PV GEMM to overlap yet).
        start_n = first_n + j0 * BLOCK_N
        slot = ring.slot(kv_it + j0)
        if PINGPONG:
            mbarrier.wait(turn_bars.index(CID), turn & 1)
            turn += 1
        mbarrier.wait(ring.k_ready.index(slot), ring.phase(kv_it + j0))
        s = warpgroup_mma(q_tile, ring.k.index(slot).permute((1, 0)),
                          gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout), use_acc=False, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn_bars.index(NEXT))
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(ring.k_empty.index(slot))
        if _masked(start_n, lo_free, hi_free, LEFT):
            p, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, key_start, key_limit, start_n, qk_scale, softcap_in,
                                                True, LEFT, SOFTCAP, BLOCK_N, s_layout)
        else:
            p, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, key_start, key_limit, start_n, qk_scale, softcap_in,
                                                False, LEFT, SOFTCAP, BLOCK_N, s_layout)
        p_op = gl.convert_layout(_to_operand(p, dtype, PACKED_CVT), p_layout)

        # Blocks (j0, n_own), masked or not decided per block at run time (one loop measured as fast as separate
        # unmasked and masked loops, and faster for causal at head_dim 64 up to 4k, under Triton 3.6 and 3.9:
        # docs/hopper-notes.md).
        for j in range(j0 + 1, n_own):
            acc, p_op, m_i, l_i, turn = _kv_block(
                j, kv_it, acc, p_op, m_i, l_i, turn, q_tile, ring, turn_bars, first_n, key_start, key_limit,
                lo_free, hi_free, qk_scale, softcap_in, CID, NEXT, PACKED_CVT, PINGPONG, LATE_K_RELEASE, LEFT,
                SOFTCAP, BLOCK_M, BLOCK_N, s_layout, o_layout, p_layout)
        mbarrier.arrive(tiles.q_empty.index(CID))  # every QK GEMM of ours is done: the buffer may take a new Q

        last = ring.slot(kv_it + n_own - 1)
        mbarrier.wait(ring.v_ready.index(last), ring.phase(kv_it + n_own - 1))
        acc = warpgroup_mma(p_op, ring.v.index(last), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        mbarrier.arrive(ring.v_empty.index(last))
        for j in range(n_own, n_blocks):
            turn = _skip_block(j, kv_it, turn, ring, turn_bars, CID, NEXT, PINGPONG)
        if PINGPONG:  # one more turn, so every consumer takes n_blocks + 1 per tile
            mbarrier.wait(turn_bars.index(CID), turn & 1)
            turn += 1
            mbarrier.arrive(turn_bars.index(NEXT))
        kv_it += n_blocks
        tile_count += 1

        # One division at the end [1]. Rows that saw no key keep m_i = -inf: output 0, internal LSE +inf.
        empty = m_i == float("-inf")
        l_i = gl.where(empty, 1.0, _row_sums(l_i, row_layout))
        o = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
        lse = gl.where(empty, float("inf"), m_i + gl.log2(l_i))
        gl.store(LSE + bh.to(gl.int64) * seqlen_q + rows, lse, mask=rows < seqlen_q)
        tma.store_wait(0)  # the previous tile's O has left o_tile
        o_tile.store(o.to(dtype))
        fence_async_shared()
        tma_store(o_desc, [off_b, off_h, row0, 0], as_4d(o_tile, o_desc))
    tma.store_wait(0)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, tiles, ring, n_tiles_m, n_tiles, tail_start, n_heads, seqlen_q, seqlen_k,
              window_left, window_right, KEY_START, KEY_LIMIT, TILE_ORDER, GROUP: gl.constexpr, LEFT: gl.constexpr,
              RIGHT: gl.constexpr, DOCS: gl.constexpr, TAIL: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The TMA warp: per tile the consumers' Q tiles, then K_j and V_j into the ring."""
    kv_it = 0
    tile_count = 0
    for tile_i in range(_n_tiles_of_cta(n_tiles, tail_start, _paired(LEFT, RIGHT), DOCS, TAIL)):
        off_b, off_h, bh, start_m, first_n, n_blocks = _tile(
            tile_i, n_tiles_m, n_tiles, tail_start, n_heads, seqlen_q, seqlen_k, window_left, window_right, KEY_START,
            KEY_LIMIT, TILE_ORDER, LEFT, RIGHT, DOCS, TAIL, NUM_CONSUMERS * BLOCK_M, BLOCK_N)
        off_hk = off_h // GROUP  # GQA: GROUP query heads share one K/V head
        q_phase = (tile_count & 1) ^ 1  # a fresh barrier passes phase 1 at once
        for i in gl.static_range(NUM_CONSUMERS):
            mbarrier.wait(tiles.q_empty.index(i), q_phase)
            mbarrier.expect(tiles.q_ready.index(i), q_desc.block_type.nbytes)
            tma_load(q_desc, [off_b, off_h, start_m + i * BLOCK_M, 0], tiles.q_ready.index(i),
                     as_4d(tiles.q.index(i), q_desc))
        for j in range(n_blocks):
            slot = ring.slot(kv_it)
            phase = ring.phase(kv_it)
            mbarrier.wait(ring.k_empty.index(slot), phase ^ 1)  # a fresh barrier passes phase 1 at once
            mbarrier.expect(ring.k_ready.index(slot), k_desc.block_type.nbytes)
            tma_load(k_desc, [off_b, off_hk, first_n + j * BLOCK_N, 0], ring.k_ready.index(slot), as_4d(ring.k.index(slot), k_desc))
            mbarrier.wait(ring.v_empty.index(slot), phase ^ 1)
            mbarrier.expect(ring.v_ready.index(slot), v_desc.block_type.nbytes)
            tma_load(v_desc, [off_b, off_hk, first_n + j * BLOCK_N, 0], ring.v_ready.index(slot), as_4d(ring.v.index(slot), v_desc))
            kv_it += 1
        tile_count += 1


@gluon.jit
def fa3_fwd_kernel(
    q_desc, k_desc, v_desc, o_desc, LSE,
    n_heads, seqlen_q, seqlen_k, window_left, window_right, KEY_START, KEY_LIMIT, TILE_ORDER, qk_scale, softcap_in,
    n_tiles_m, n_tiles, tail_start, GROUP: gl.constexpr, LEFT: gl.constexpr, RIGHT: gl.constexpr,
    DOCS: gl.constexpr, TAIL: gl.constexpr, SOFTCAP: gl.constexpr, PINGPONG: gl.constexpr,
    LATE_K_RELEASE: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    Q_LAYOUT: gl.constexpr, KV_LAYOUT: gl.constexpr,
):
    """Grid (min(n_tiles, CTAs that fit at once),): see the module docstring. n_tiles = n_tiles_m * batch * n_heads."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, BLOCK_M, HEAD_DIM], Q_LAYOUT)
    o_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, BLOCK_M, HEAD_DIM], Q_LAYOUT)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], KV_LAYOUT)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], KV_LAYOUT)
    q_bar = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    for i in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(turn_bars.index(i), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_CONSUMERS)  # one arrival per consumer
        mbarrier.init(v_empty.index(i), count=NUM_CONSUMERS)
    if PINGPONG:  # consumer 0 takes the first turn
        mbarrier.arrive(turn_bars.index(0))
    fence_async_shared()
    tiles = QTiles(q_smem, o_smem, q_bar, q_empty, turn_bars)
    ring = KVRing(k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, NUM_STAGES)

    # Written out per partition: tuple concatenation inside a Gluon kernel turns constexprs into tensors.
    # Registers: 24 for the producer warp, the rest shared by the consumer warpgroups.
    if NUM_CONSUMERS == 2:
        gl.warp_specialize(
            [
            (_consumer, (tiles, ring, o_desc, LSE, n_tiles_m, n_tiles, tail_start, n_heads, seqlen_q, seqlen_k,
                         window_left, window_right, KEY_START, KEY_LIMIT, TILE_ORDER, qk_scale, softcap_in, 0,
                         NUM_CONSUMERS, LEFT, RIGHT, DOCS, TAIL, SOFTCAP, PINGPONG, LATE_K_RELEASE, BLOCK_M, BLOCK_N,
                         HEAD_DIM)),
            (_consumer, (tiles, ring, o_desc, LSE, n_tiles_m, n_tiles, tail_start, n_heads, seqlen_q, seqlen_k,
                         window_left, window_right, KEY_START, KEY_LIMIT, TILE_ORDER, qk_scale, softcap_in, 1,
                         NUM_CONSUMERS, LEFT, RIGHT, DOCS, TAIL, SOFTCAP, PINGPONG, LATE_K_RELEASE, BLOCK_M, BLOCK_N,
                         HEAD_DIM)),
            (_producer, (q_desc, k_desc, v_desc, tiles, ring, n_tiles_m, n_tiles, tail_start, n_heads, seqlen_q,
                         seqlen_k, window_left, window_right, KEY_START, KEY_LIMIT, TILE_ORDER, GROUP, LEFT, RIGHT,
                         DOCS, TAIL, NUM_CONSUMERS, BLOCK_M, BLOCK_N)),
            ],
            [4, 1],
            [240, 24],
        )
    else:
        gl.warp_specialize(
            [
            (_consumer, (tiles, ring, o_desc, LSE, n_tiles_m, n_tiles, tail_start, n_heads, seqlen_q, seqlen_k,
                         window_left, window_right, KEY_START, KEY_LIMIT, TILE_ORDER, qk_scale, softcap_in, 0,
                         NUM_CONSUMERS, LEFT, RIGHT, DOCS, TAIL, SOFTCAP, PINGPONG, LATE_K_RELEASE, BLOCK_M, BLOCK_N,
                         HEAD_DIM)),
            (_consumer, (tiles, ring, o_desc, LSE, n_tiles_m, n_tiles, tail_start, n_heads, seqlen_q, seqlen_k,
                         window_left, window_right, KEY_START, KEY_LIMIT, TILE_ORDER, qk_scale, softcap_in, 1,
                         NUM_CONSUMERS, LEFT, RIGHT, DOCS, TAIL, SOFTCAP, PINGPONG, LATE_K_RELEASE, BLOCK_M, BLOCK_N,
                         HEAD_DIM)),
            (_consumer, (tiles, ring, o_desc, LSE, n_tiles_m, n_tiles, tail_start, n_heads, seqlen_q, seqlen_k,
                         window_left, window_right, KEY_START, KEY_LIMIT, TILE_ORDER, qk_scale, softcap_in, 2,
                         NUM_CONSUMERS, LEFT, RIGHT, DOCS, TAIL, SOFTCAP, PINGPONG, LATE_K_RELEASE, BLOCK_M, BLOCK_N,
                         HEAD_DIM)),
            (_producer, (q_desc, k_desc, v_desc, tiles, ring, n_tiles_m, n_tiles, tail_start, n_heads, seqlen_q,
                         seqlen_k, window_left, window_right, KEY_START, KEY_LIMIT, TILE_ORDER, GROUP, LEFT, RIGHT,
                         DOCS, TAIL, NUM_CONSUMERS, BLOCK_M, BLOCK_N)),
            ],
            [4, 4, 1],
            [160, 160, 24],
        )
