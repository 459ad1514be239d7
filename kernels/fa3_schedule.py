"""What the Gluon kernels' packed-sequence calls derive from cu_seqlens: each row's keys and each key's rows
(`doc_bounds`), and the order the forward takes its tiles and the backward its key blocks in, longest first
(`tile_order`, `block_order`). One small Triton launch each.

A model passes one cu_seqlens to every layer, so `kernels.fa3` makes these once per offsets tensor, except under
CUDA graphs, where each layer's call makes them again (`fa3._made_once`) in every replay: five launches a layer,
forward and backward, where written with torch operators they take 49 (counted with a dispatch mode).
"""

import torch
import triton
import triton.language as tl

from .common import LAUNCH_OPTIONS, compile_sm90, next_power_of_2
from .launch import launch

BOUNDS_BLOCK = 256  # positions a program of `_doc_bounds` takes
SORT_MAX = 4096  # the most tiles or key blocks one program sorts; more take torch's argsort


@triton.jit
def _doc_bounds(CU, START, LIMIT, n_offsets, steps, total, before, after, BEFORE: tl.constexpr,
                AFTER: tl.constexpr, BLOCK: tl.constexpr):
    pos = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = pos < total
    # The sequence of pos: the last offset <= pos, by binary search in `steps` halvings (torch.searchsorted(
    # right=True) - 1): an empty sequence's offset equals the next one's, so it is skipped.
    seq = tl.zeros([BLOCK], dtype=tl.int32)
    hi = seq + (n_offsets - 1)
    for _ in range(steps):
        mid = (seq + hi + 1) // 2
        below = tl.load(CU + mid) <= pos
        seq = tl.where(below, mid, seq)
        hi = tl.where(below, hi, mid - 1)
    seq = tl.minimum(seq, n_offsets - 2)
    start = tl.load(CU + seq, mask=inside, other=0)
    limit = tl.load(CU + seq + 1, mask=inside, other=0)
    if BEFORE:
        start = tl.maximum(start, pos - before)
    if AFTER:
        limit = tl.minimum(limit, pos + (after + 1))
    tl.store(START + pos, start, mask=inside)
    tl.store(LIMIT + pos, limit, mask=inside)


def doc_bounds(cu_seqlens: torch.Tensor, total: int, before: int, after: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each position i of `total` packed positions, [start, limit): the positions of its own sequence (rows
    cu_seqlens[b]:cu_seqlens[b + 1]) from i - before to i + after (-1: unlimited on that side). cu_seqlens: int32
    (n + 1,) non-decreasing offsets from 0 to total. Two int32 (total,) tensors on cu_seqlens' device, both
    non-decreasing in i (what the Gluon kernels' tile ranges rely on).

    Packed self-attention with window (left, right) (`fa2.window_edges`, causal: right = 0): row i sees keys
    doc_bounds(cu, total, left, right), and key j is seen by rows doc_bounds(cu, total, right, left), flash-attn's
    varlen mask when every sequence has as many queries as keys."""
    start = torch.empty(total, device=cu_seqlens.device, dtype=torch.int32)
    limit = torch.empty_like(start)
    if total:
        n_offsets = cu_seqlens.shape[0]
        launch(_doc_bounds, (triton.cdiv(total, BOUNDS_BLOCK),), cu_seqlens, start, limit, n_offsets,
               (n_offsets - 1).bit_length(), total, max(before, 0), max(after, 0), BEFORE=before >= 0,
               AFTER=after >= 0, BLOCK=BOUNDS_BLOCK, **LAUNCH_OPTIONS)
    return start, limit


@triton.jit
def _longest_first(START, LIMIT, ORDER, n, size, total, block_n, n_bh, TILES: tl.constexpr, BLOCK: tl.constexpr):
    # Blocks i of `size` positions: their extent from the first position's start to the last one's limit, in key
    # blocks of block_n (TILES) or in positions; sorted by (-extent, i): a stable descending argsort.
    i = tl.arange(0, BLOCK)
    inside = i < n
    first = i * size
    last = tl.minimum(first + size, total) - 1
    start = tl.load(START + first, mask=inside, other=0)
    limit = tl.load(LIMIT + last, mask=inside, other=0)
    if TILES:
        extent = (limit + block_n - 1) // block_n - start // block_n
    else:
        extent = limit - start
    key = (total - extent).to(tl.int64) * BLOCK + i
    key = tl.where(inside, key, (2 * total + 1).to(tl.int64) * BLOCK)
    order = (tl.sort(key) % BLOCK).to(tl.int32)
    # TILES: every head of one row block together, tile numbers bh * n + m
    for bh in range(n_bh):
        tl.store(ORDER + i * n_bh + bh, order + bh * n, mask=inside)


def _sort_warps(block: int) -> int:
    return 4 if block <= 1024 else 8


def _sorted_blocks(start, limit, size: int, block_n: int, n_bh: int, tiles: bool) -> torch.Tensor:
    total = start.shape[0]
    n = triton.cdiv(total, size)
    if n > SORT_MAX:  # beyond one program's sort
        first = torch.arange(0, total, size, device=start.device)
        last = (first + size).clamp(max=total) - 1
        extent = ((limit[last] + block_n - 1) // block_n - start[first] // block_n if tiles
                  else limit[last] - start[first])
        order = torch.argsort(extent, descending=True, stable=True).to(torch.int32)
        heads = torch.arange(n_bh, device=start.device, dtype=torch.int32) * n
        return (order[:, None] + heads[None, :]).flatten()
    order = torch.empty(n * n_bh, device=start.device, dtype=torch.int32)
    block = max(16, next_power_of_2(n))
    launch(_longest_first, (1,), start, limit, order, n, size, total, block_n, n_bh, TILES=tiles, BLOCK=block,
           num_warps=_sort_warps(block), **LAUNCH_OPTIONS)
    return order


def tile_order(key_start: torch.Tensor, key_limit: torch.Tensor, rows: int, block_n: int, n_bh: int) -> torch.Tensor:
    """The Gluon forward's tiles over packed sequences, longest first: int32 (n_tiles,) tile numbers
    bh * n_tiles_m + m (tile m: rows [m * rows, (m + 1) * rows) of head bh), sorted by the K/V blocks their rows'
    bounds (`doc_bounds`) span, every head of one row block together, ties in row order. The kernel deals them
    out in a snake (`fa3_hopper._tile`)."""
    return _sorted_blocks(key_start, key_limit, rows, block_n, n_bh, tiles=True)


def block_order(query_start: torch.Tensor, query_limit: torch.Tensor, block_n: int) -> torch.Tensor:
    """The Gluon backward's key blocks over packed sequences, longest first: int32 block numbers sorted by the
    query rows that see them (`doc_bounds` from the keys' side), ties in key order."""
    return _sorted_blocks(query_start, query_limit, block_n, 1, 1, tiles=False)


def compile_for_sm90(kernel: str = "bounds", sort_block: int = SORT_MAX, tiles: bool = True):
    """Compile `_doc_bounds` (kernel="bounds") or `_longest_first` ("order", sorting `sort_block` keys, with the
    warps a launch gives that many) for sm_90 without a GPU; call it without TRITON_INTERPRET. Returns Triton's
    compiled kernel. ValueError for another `kernel`."""
    if kernel == "bounds":
        fn, num_warps = _doc_bounds, 4
        constexprs = dict(BEFORE=True, AFTER=True, BLOCK=BOUNDS_BLOCK)
        pointers = ("CU", "START", "LIMIT")
    elif kernel == "order":
        fn, num_warps = _longest_first, _sort_warps(sort_block)
        constexprs = dict(TILES=tiles, BLOCK=sort_block)
        pointers = ("START", "LIMIT", "ORDER")
    else:
        raise ValueError(f"kernel={kernel!r}: accepted 'bounds' and 'order'")
    return compile_sm90(fn, constexprs, lambda arg: "*i32" if arg in pointers else "i32", num_warps)
