"""Sliding windows and packed variable-length sequences in the FA2 kernels (`fa2_attention(window_size=...)`,
`fa2_varlen_attention`) against the float64 reference of tests/kernels/test_attention.py with explicit masks.

Same rules as there: Triton's interpreter without a GPU, fresh random inputs, NaN-poisoned outputs. Under the
interpreter the tiles are 32x16 (forward, dQ) and 16x32 (dK/dV), so lengths and windows of a few dozen cross
block edges in every way.
"""

import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from kernels import fa1_attention, fa2, fa2_attention, fa2_varlen_attention, fa2_varlen_qkvpacked_attention
from test_attention import DEVICE, check, compare, poisoned_allocations, randn, reference  # noqa: F401 (fixture)

# (batch, n_heads, n_kv_heads, seqlen_q, seqlen_k, head_dim, causal, window_size, dtype)
WINDOW_CASES = [
    # windows smaller than a block, on both sides and one side
    (1, 2, 2, 70, 70, 32, False, (5, 3), torch.float16),
    (1, 2, 2, 70, 70, 32, False, (0, 0), torch.bfloat16),
    (1, 2, 2, 40, 77, 32, False, (-1, 9), torch.float16),
    # the usual local attention: causal with a left window, one wider than a block
    (2, 2, 2, 100, 100, 32, True, (20, -1), torch.bfloat16),
    (1, 1, 1, 65, 65, 64, True, (40, 40), torch.float16),  # causal overrides the right side
    # window + causal + seqlen_q != seqlen_k, both ways (q longer: the first rows see no key)
    (1, 2, 2, 50, 90, 32, True, (10, -1), torch.float16),
    (1, 2, 2, 90, 50, 32, True, (7, 5), torch.bfloat16),
    (1, 1, 1, 60, 20, 32, False, (3, 2), torch.float16),
    # GQA and MQA
    (1, 4, 2, 48, 48, 32, True, (15, -1), torch.bfloat16),
    (1, 4, 1, 33, 57, 16, False, (12, 6), torch.float16),
    # windows wider than the sequences limit nothing; float32
    (1, 1, 1, 33, 33, 32, True, (1000, 10**9), torch.float32),
    (1, 2, 2, 45, 45, 32, False, (-1, 0), torch.float32),  # = causal
]


@pytest.mark.parametrize("batch,n_heads,n_kv_heads,seqlen_q,seqlen_k,head_dim,causal,window_size,dtype", WINDOW_CASES)
def test_window_matches_reference(batch, n_heads, n_kv_heads, seqlen_q, seqlen_k, head_dim, causal, window_size,
                                  dtype):
    q = randn(batch, n_heads, seqlen_q, head_dim, dtype=dtype)
    k = randn(batch, n_kv_heads, seqlen_k, head_dim, dtype=dtype)
    v = randn(batch, n_kv_heads, seqlen_k, head_dim, dtype=dtype)
    check(fa2_attention, q, k, v, causal, window_size=window_size)


@pytest.mark.parametrize("case", [WINDOW_CASES[0], WINDOW_CASES[6], WINDOW_CASES[8]])
def test_window_pointer_path(monkeypatch, case):
    """The same masks through pointer loads instead of TMA descriptors."""
    batch, n_heads, n_kv_heads, seqlen_q, seqlen_k, head_dim, causal, window_size, dtype = case
    monkeypatch.setattr(fa2, "DEFAULT_OPTIONS", fa2.Options(tma=False))
    q = randn(batch, n_heads, seqlen_q, head_dim, dtype=dtype)
    k, v = (randn(batch, n_kv_heads, seqlen_k, head_dim, dtype=dtype) for _ in range(2))
    check(fa2_attention, q, k, v, causal, window_size=window_size)


def test_key_blocks_outside_the_window_are_never_read():
    """32 query rows with window (16, 0) see keys 80..127 of 128. Keys 0..63 (whole blocks for every kernel) are
    NaN: any visit would spread NaN through a matmul (0 * NaN), so finite, correct results prove they are
    skipped, in the forward, dQ and dK/dV; and their dK/dV come back exactly 0."""
    q = randn(1, 2, 32, 32, dtype=torch.float16)
    k, v = (randn(1, 2, 128, 32, dtype=torch.float16) for _ in range(2))
    k[:, :, :64], v[:, :, :64] = float("nan"), float("nan")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = fa2_attention(q, k, v, causal=True, window_size=(16, -1))
    do = torch.randn_like(o)
    o.backward(do)
    assert (k.grad[:, :, :64] == 0).all() and (v.grad[:, :, :64] == 0).all()
    o_ref, _ = reference(q.detach(), k.detach()[:, :, 64:], v.detach()[:, :, 64:], True, 32**-0.5, (16, -1))
    assert torch.isfinite(o).all() and torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    assert (o.double() - o_ref).abs().max() < 1e-2


def test_query_blocks_that_see_no_key_are_skipped_in_the_backward():
    """128 query rows, 32 keys, window (2, 0): rows 0..95 see nothing. Their dO is NaN; dK/dV stay finite (the
    dK/dV kernel's query loop starts at row 96) and their dQ is exactly 0."""
    q = randn(1, 2, 128, 32, dtype=torch.bfloat16).requires_grad_()
    k, v = (randn(1, 2, 32, 32, dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    o = fa2_attention(q, k, v, window_size=(2, 0))
    assert (o[:, :, :96] == 0).all()
    do = torch.randn_like(o)
    do[:, :, :96] = float("nan")
    o.backward(do)
    assert (q.grad[:, :, :96] == 0).all() and torch.isfinite(q.grad).all()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    reference(q64, k64, v64, False, 32**-0.5, (2, 0))[0].backward(do.double().nan_to_num(0.0))
    for grad, grad_ref in ((k.grad, k64.grad), (v.grad, v64.grad)):
        assert torch.isfinite(grad).all() and (grad.double() - grad_ref).norm() / grad_ref.norm() < 1e-2


@triton.jit
def _stages_probe(OUT, offset, before, after, n_inner, BEFORE: tl.constexpr, AFTER: tl.constexpr,
                  BLOCK_OUTER: tl.constexpr, BLOCK_INNER: tl.constexpr):
    pid = tl.program_id(0)
    lo, lo_free, hi_free, hi = fa2._stages(pid * BLOCK_OUTER, offset, before, after, n_inner, BEFORE, AFTER,
                                           BLOCK_OUTER, BLOCK_INNER)
    tl.store(OUT + pid * 4, lo)
    tl.store(OUT + pid * 4 + 1, lo_free)
    tl.store(OUT + pid * 4 + 2, hi_free)
    tl.store(OUT + pid * 4 + 3, hi)


def test_stages_visit_exactly_the_needed_blocks():
    """The kernels' block ranges (`fa2._stages`, used by all three kernels) against brute force, for random
    lengths, windows and tile shapes: the visited inner blocks are exactly those holding a visible pair of some
    row of the outer block, and the unmasked ones exactly those every row sees whole."""
    rng = random.Random()
    for _ in range(40):
        block_outer, block_inner = rng.choice([16, 32]), rng.choice([16, 32])
        n_outer, n_inner = rng.randint(1, 100), rng.randint(1, 100)
        before, after = rng.choice([-1, 0, 3, 17, 40]), rng.choice([-1, 0, 5, 33])
        offset = n_inner - n_outer  # bottom-right alignment, in both directions (forward and dK/dV)
        n_blocks = triton.cdiv(n_outer, block_outer)
        out = torch.empty(n_blocks * 4, dtype=torch.int32, device=DEVICE)
        _stages_probe[(n_blocks,)](out, offset, max(before, 0), max(after, 0), n_inner, before >= 0, after >= 0,
                                   block_outer, block_inner)
        for block, (lo, lo_free, hi_free, hi) in enumerate(out.view(-1, 4).tolist()):
            rows = range(block * block_outer, (block + 1) * block_outer)  # rows past n_outer too: the kernel's too
            sees = lambda x, y: (0 <= y < n_inner and (before < 0 or y >= x + offset - before)
                                 and (after < 0 or y <= x + offset + after))
            blocks = range(0, n_inner, block_inner)
            needed = {b for b in blocks if any(sees(x, y) for x in rows for y in range(b, b + block_inner))}
            whole = {b for b in blocks if all(sees(x, y) for x in rows for y in range(b, b + block_inner))}
            case = (block_outer, block_inner, n_outer, n_inner, before, after, block, (lo, lo_free, hi_free, hi))
            assert lo <= lo_free <= hi_free and all(v % block_inner == 0 for v in (lo, lo_free, hi_free)), case
            assert set(range(lo, max(hi, lo), block_inner)) == needed, case
            assert set(range(lo_free, hi_free, block_inner)) == whole, case


# ------------------------------------------------------------------------------------------ varlen
def cu_seqlens(lengths):
    return torch.tensor([0] + lengths, device=DEVICE).cumsum(0).to(torch.int32)


def check_varlen(lengths_q, lengths_k, n_heads, n_kv_heads, head_dim, causal, window_size, dtype, max_extra=0,
                 softcap=0.0, input_scale=1.0):
    """fa2_varlen_attention forward + backward against the reference run on each sequence on its own. softcap:
    passed to both; input_scale: q and k drawn that much larger (logits large enough for the cap to matter).
    Returns o and the inputs (q, k, v, cu_seqlens_q, cu_seqlens_k)."""
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q = (randn(total_q, n_heads, head_dim, dtype=dtype) * input_scale).requires_grad_()
    k = (randn(total_k, n_kv_heads, head_dim, dtype=dtype) * input_scale).requires_grad_()
    v = randn(total_k, n_kv_heads, head_dim, dtype=dtype).requires_grad_()
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    o, lse = fa2_varlen_attention(q, k, v, cu_q, cu_k, max(lengths_q) + max_extra, max(lengths_k) + max_extra,
                                  causal=causal, window_size=window_size, return_lse=True, softcap=softcap)
    assert lse.shape == (n_heads, total_q)
    do = torch.randn_like(o)
    o.backward(do)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o_ref, lse_ref = varlen_reference(q64, k64, v64, cu_q, cu_k, causal, window_size, softcap)
    o_ref.backward(do.double())
    compare(o, lse, (q.grad, k.grad, v.grad), o_ref, lse_ref, (q64.grad, k64.grad, v64.grad), dtype)
    return o, (q, k, v, cu_q, cu_k)


def varlen_reference(q64, k64, v64, cu_q, cu_k, causal, window_size, softcap=0.0):
    """The float64 reference run on each packed (total, heads, head_dim) sequence on its own: o (total_q, n_heads,
    head_dim) and the natural lse (n_heads, total_q), differentiable w.r.t. q64, k64, v64."""
    as_batch = lambda t: t.transpose(0, 1)[None]  # (len, heads, head_dim) -> (1, heads, len, head_dim)
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o_b, lse_b = reference(as_batch(q64[rows_q]), as_batch(k64[rows_k]), as_batch(v64[rows_k]), causal,
                               1 / math.sqrt(q64.shape[-1]), window_size, softcap)
        outs.append(o_b[0].transpose(0, 1))
        lses.append(lse_b[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


# (lengths_q, lengths_k, n_heads, n_kv_heads, head_dim, causal, window_size, dtype)
VARLEN_CASES = [
    # documents that end inside a block, and a one-token document
    ([5, 40, 17, 1, 30], None, 2, 2, 32, True, (-1, -1), torch.bfloat16),
    ([5, 40, 17, 1, 30], None, 2, 2, 32, False, (-1, -1), torch.float16),
    # many one-token documents
    ([1, 1, 1, 1, 20, 1], None, 2, 1, 32, True, (-1, -1), torch.float16),
    # empty sequences, and queries whose sequence has no keys (0 output, lse -inf)
    ([0, 12, 0, 35, 0], None, 2, 2, 16, True, (-1, -1), torch.bfloat16),
    ([10, 5, 8], [0, 20, 3], 2, 2, 32, False, (-1, -1), torch.float16),
    # seqlen_q != seqlen_k per sequence: bottom-right causal alignment in each
    ([3, 20, 7, 40], [10, 20, 30, 2], 2, 2, 32, True, (-1, -1), torch.bfloat16),
    # windows (smaller than a block) with causal, and without
    ([50, 9, 33], None, 2, 2, 32, True, (6, -1), torch.float16),
    ([50, 9, 33], [20, 40, 33], 4, 2, 32, False, (4, 11), torch.bfloat16),
    # GQA, float32, head_dim not a power of two
    ([37, 26], None, 4, 2, 48, True, (-1, -1), torch.float32),
]


@pytest.mark.parametrize("lengths_q,lengths_k,n_heads,n_kv_heads,head_dim,causal,window_size,dtype", VARLEN_CASES)
def test_varlen_matches_reference(lengths_q, lengths_k, n_heads, n_kv_heads, head_dim, causal, window_size, dtype):
    check_varlen(lengths_q, lengths_k or lengths_q, n_heads, n_kv_heads, head_dim, causal, window_size, dtype)


def test_varlen_pointer_path_and_loose_max_seqlen(monkeypatch):
    """Pointer loads instead of TMA descriptors; max_seqlen above the longest sequence only adds idle programs."""
    monkeypatch.setattr(fa2, "DEFAULT_OPTIONS", fa2.Options(tma=False))
    check_varlen([5, 40, 17, 1], [9, 40, 2, 30], 2, 1, 32, True, (8, -1), torch.float16, max_extra=20)


def test_varlen_max_seqlen_above_the_rows():
    """A max_seqlen beyond int64 (flash-attn accepts any upper bound) runs as total_q / total_k: no grid of 2**70
    programs, no overflow in the op's int argument."""
    check_varlen([5, 40, 17], [9, 40, 2], 2, 1, 32, True, (-1, -1), torch.bfloat16, max_extra=2**70)


def test_varlen_one_sequence_equals_dense():
    q, k, v = (randn(1, 2, 45, 32, dtype=torch.float16) for _ in range(3))
    dense = fa2_attention(q, k, v, causal=True, window_size=(9, -1))
    packed = lambda t: t[0].transpose(0, 1)
    cu = cu_seqlens([45])
    varlen = fa2_varlen_attention(packed(q), packed(k), packed(v), cu, cu, 45, 45, causal=True, window_size=(9, -1))
    assert torch.equal(varlen, packed(dense))


def test_varlen_eager_calls_equal_the_op():
    """An eager fa2_varlen_attention call runs the launchers through the frontend's EagerAttention (custom_op's own
    autograd wrapper costs more host time a call than the launch); its output and gradients are the op's, bit for
    bit (the same kernels)."""
    lengths = [5, 40, 17]
    q, k, v = (randn(sum(lengths), 2, 32, dtype=torch.float16).requires_grad_() for _ in range(3))
    cu = cu_seqlens(lengths)
    o = fa2_varlen_attention(q, k, v, cu, cu, 40, 40, causal=True, window_size=(8, -1))
    assert type(o.grad_fn).__name__ == "EagerAttentionBackward"
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    o_op, _ = torch.ops.flashgpt.fa2_forward(q, k, v, True, 1 / math.sqrt(32), 8, -1, cu, cu, 40, 40, 0.0)
    grads_op = torch.autograd.grad(o_op, (q, k, v), do)
    assert torch.equal(o, o_op)
    for got, expected in zip(grads, grads_op):
        assert torch.equal(got, expected)


# ------------------------------------------------------------------------------------------ varlen, packed qkv
# (lengths, n_heads, n_kv_heads, head_dim, window_size, softcap, five_dim, dtype); causal, one set of offsets
VARLEN_QKVPACKED_CASES = [
    ([5, 40, 17, 1, 30], 2, 2, 32, (-1, -1), 0.0, False, torch.bfloat16),  # documents ending inside a block
    ([0, 12, 0, 35, 0], 2, 2, 16, (-1, -1), 0.0, True, torch.float16),  # empty sequences; (total, 3, H, D)
    ([50, 9, 33], 4, 2, 32, (6, -1), 0.0, False, torch.bfloat16),  # GQA, a window smaller than a block
    ([37, 26], 2, 1, 48, (-1, -1), 4.0, False, torch.float32),  # MQA, softcap, head_dim not a power of two
]


@pytest.mark.parametrize("lengths,n_heads,n_kv_heads,head_dim,window_size,softcap,five_dim,dtype",
                         VARLEN_QKVPACKED_CASES)
def test_varlen_qkvpacked_matches_reference(lengths, n_heads, n_kv_heads, head_dim, window_size, softcap, five_dim,
                                            dtype):
    """fa2_varlen_qkvpacked_attention: o, lse and the gradient (shaped like qkv) against the float64 reference run
    on each sequence on its own."""
    total, heads = sum(lengths), n_heads + 2 * n_kv_heads
    scale = 4.0 if softcap else 1.0  # logits large enough for the cap to matter
    qkv = randn(total, heads, head_dim, dtype=dtype)
    qkv[:, :n_heads + n_kv_heads] *= scale
    qkv = (qkv.view(total, 3, n_heads, head_dim) if five_dim else qkv).requires_grad_()
    cu = cu_seqlens(lengths)
    o, lse = fa2_varlen_qkvpacked_attention(qkv, cu, max(lengths), None if five_dim else n_heads, causal=True,
                                            window_size=window_size, return_lse=True, softcap=softcap)
    assert o.shape == (total, n_heads, head_dim) and o.is_contiguous() and lse.shape == (n_heads, total)
    do = torch.randn_like(o)
    o.backward(do)
    assert qkv.grad.shape == qkv.shape

    qkv64 = qkv.detach().double().reshape(total, heads, head_dim).requires_grad_()
    q64, k64, v64 = qkv64.split([n_heads, n_kv_heads, n_kv_heads], dim=1)
    o_ref, lse_ref = varlen_reference(q64, k64, v64, cu, cu, True, window_size, softcap)
    o_ref.backward(do.double())
    grad = qkv.grad.reshape(total, heads, head_dim)
    split = lambda t: t.split([n_heads, n_kv_heads, n_kv_heads], dim=1)
    compare(o, lse, split(grad), o_ref, lse_ref, split(qkv64.grad), dtype)


def test_varlen_qkvpacked_equals_varlen_on_views():
    """The packed form runs the kernels of fa2_varlen_attention on qkv's views: the same o, lse and gradients, bit
    for bit, its gradient written in one tensor instead of three."""
    lengths, n_heads, n_kv_heads, head_dim = [5, 40, 17], 4, 2, 32
    cu = cu_seqlens(lengths)
    qkv = randn(sum(lengths), n_heads + 2 * n_kv_heads, head_dim, dtype=torch.float16).requires_grad_()
    o, lse = fa2_varlen_qkvpacked_attention(qkv, cu, 40, n_heads, causal=True, window_size=(8, -1), return_lse=True)
    q, k, v = (t.detach().requires_grad_() for t in qkv.detach().split([n_heads, n_kv_heads, n_kv_heads], dim=1))
    o_views, lse_views = fa2_varlen_attention(q, k, v, cu, cu, 40, 40, causal=True, window_size=(8, -1),
                                              return_lse=True)
    do = torch.randn_like(o)
    (grad,) = torch.autograd.grad(o, qkv, do)
    grads = torch.autograd.grad(o_views, (q, k, v), do)
    assert torch.equal(o, o_views) and torch.equal(lse, lse_views)
    assert torch.equal(grad, torch.cat(grads, dim=1))


def test_varlen_qkvpacked_output_is_contiguous_for_any_qkv_layout():
    """o is (total, n_heads, head_dim) contiguous, as the op's fake says, also when qkv's rows are not its outer dim
    (a heads-first tensor seen through a transpose): torch.compile relies on the fake's strides."""
    cu = cu_seqlens([5, 0, 3, 7])
    heads_first = randn(4, 15, 16, dtype=torch.float16).transpose(0, 1)
    o = fa2_varlen_qkvpacked_attention(heads_first, cu, 7, 2, causal=True)
    assert o.shape == (15, 2, 16) and o.is_contiguous()
    assert torch.equal(o, fa2_varlen_qkvpacked_attention(heads_first.contiguous(), cu, 7, 2, causal=True))
    torch.library.opcheck(torch.ops.flashgpt.fa2_varlen_qkvpacked_forward, (heads_first, 2, cu, 7, True, 0.25),
                          test_utils=("test_schema", "test_faketensor"))


def test_varlen_qkvpacked_compiles_in_one_graph():
    """Under torch.compile the packed form is one op (flashgpt::fa2_varlen_qkvpacked_forward), no graph break, with
    the eager call's result."""
    cu = cu_seqlens([7, 0, 33])
    qkv = randn(40, 6, 16, dtype=torch.float16).requires_grad_()
    f = lambda qkv: fa2_varlen_qkvpacked_attention(qkv, cu, 33, 2, causal=True).float().square().sum()
    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(qkv)
    (grad,) = torch.autograd.grad(loss, qkv)
    eager = f(qkv.detach().requires_grad_())
    torch.testing.assert_close(loss, eager, rtol=1e-3, atol=1e-3)
    assert torch.isfinite(grad).all() and grad.shape == qkv.shape


def test_opcheck_varlen_qkvpacked():
    qkv = randn(20, 6, 16, dtype=torch.float16).requires_grad_()
    torch.library.opcheck(torch.ops.flashgpt.fa2_varlen_qkvpacked_forward,
                          (qkv, 2, cu_seqlens([3, 17]), 17, True, 0.25, 4, 0, 5.0),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


BAD_VARLEN_QKVPACKED = [
    (dict(qkv=randn(2, 10, 6, 32, dtype=torch.float16)), ValueError,
     r"qkv must be \(total, n_heads \+ 2 \* n_kv_heads, head_dim\) or \(total, 3, n_heads >= 1, head_dim\)"),
    (dict(n_heads=3), ValueError, r"qkv has 6 heads \(dim 1\), which must be n_heads \+ 2 \* n_kv_heads"),
    (dict(n_heads=2.0), TypeError, "n_heads must be an int or None"),
    (dict(cu_seqlens=cu_seqlens([4, 6]).long()), TypeError, "cu_seqlens has dtype torch.int64; accepted: torch.int32"),
    (dict(cu_seqlens=torch.tensor([0, 4, 9], dtype=torch.int32, device=DEVICE)), ValueError,
     r"cu_seqlens\[-1\] = 9 must equal total = 10, the rows of qkv"),
    (dict(max_seqlen=5), ValueError, "max_seqlen = 5 is less than the longest sequence's length 6 in cu_seqlens"),
    (dict(max_seqlen=6.0), TypeError, "max_seqlen must be an int"),
    (dict(qkv=randn(10, 6, 8, dtype=torch.float16)), ValueError,
     r"head_dim=8 is out of range.*views of qkv \(10, 6, 8\)"),
    (dict(softcap=-1.0), ValueError, "softcap must be a finite number >= 0"),
    (dict(cu_seqlens=cu_seqlens([4, 6]).to("meta")), ValueError, "cu_seqlens must be on qkv's device"),
]


@pytest.mark.parametrize("overrides,error,message", BAD_VARLEN_QKVPACKED)
def test_bad_varlen_qkvpacked_input_is_rejected(overrides, error, message):
    args = dict(qkv=randn(10, 6, 32, dtype=torch.float16), cu_seqlens=cu_seqlens([4, 6]), max_seqlen=6, n_heads=2,
                causal=True)
    args.update(overrides)
    with pytest.raises(error, match=message):
        fa2_varlen_qkvpacked_attention(**args)


@pytest.mark.parametrize("packed,batch,n_heads,n_kv_heads,seqlen_q,seqlen_k,causal,window_size,softcap,dtype", [
    (False, 2, 2, 2, 70, 70, True, (20, -1), 0.0, torch.bfloat16),  # a narrow causal window, two sequences
    (False, 1, 4, 2, 50, 90, True, (-1, -1), 0.0, torch.float16),  # GQA, seqlen_q < seqlen_k
    (False, 2, 2, 1, 60, 33, False, (7, 5), 0.0, torch.float32),  # both edges, rows that see no key
    (False, 2, 2, 2, 40, 40, True, (-1, -1), 2.0, torch.float32),  # softcap, large logits
    (True, 1, 4, 2, None, None, True, (-1, -1), 0.0, torch.bfloat16),  # packed documents, GQA
    (True, 1, 2, 2, None, None, True, (6, -1), 0.0, torch.float16),  # packed documents with a window
])
def test_backward_dq_alone_matches_reference(packed, batch, n_heads, n_kv_heads, seqlen_q, seqlen_k, causal,
                                             window_size, softcap, dtype):
    """`fa2.backward_dq` (the dQ kernel on its own, as the Gluon backward's separate_dq configs run it) writes every
    element of a NaN-filled dq, equal to the float64 reference's dq."""
    from kernels.common import bwd_preprocess
    from test_attention import rel_err, TOLERANCE

    head_dim = 32
    lengths = [5, 40, 17, 1, 30] if packed else None
    seqlen_q, seqlen_k = (sum(lengths),) * 2 if packed else (seqlen_q, seqlen_k)
    q = randn(batch, n_heads, seqlen_q, head_dim, dtype=dtype) * (4.0 if softcap else 1.0)
    k, v = (randn(batch, n_kv_heads, seqlen_k, head_dim, dtype=dtype) for _ in range(2))
    do = randn(batch, n_heads, seqlen_q, head_dim, dtype=dtype)
    scale = head_dim ** -0.5
    var = dict(cu_seqlens=cu_seqlens(lengths), max_seqlen=max(lengths)) if packed else {}
    mask = ((var["cu_seqlens"],) * 2 + (var["max_seqlen"],) * 2) if packed else ()
    rows = lambda t: t[0].transpose(0, 1)  # the (1, heads, total, head_dim) view as (total, heads, head_dim)
    o, lse = fa2.forward(*((rows(t) for t in (q, k, v)) if packed else (q, k, v)), causal, scale, window_size, *mask,
                         softcap=softcap)
    if packed:
        o, lse = o.transpose(0, 1)[None], lse[None]
    dq = torch.full_like(q, float("nan"))
    fa2.backward_dq(do, q, k, v, lse, bwd_preprocess(o, do), dq, causal, scale, window_size, softcap, **var)

    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    bounds = torch.tensor([0] + lengths).cumsum(0).tolist() if packed else [0, seqlen_q]
    for start, end in zip(bounds, bounds[1:]):  # each document on its own (dense: the one sequence)
        part = lambda t: t[:, :, start:end] if packed else t
        o_ref, _ = reference(part(q64), part(k64), part(v64), causal, scale, window_size, softcap)
        o_ref.backward(part(do).double())
    assert rel_err(dq, q64.grad) < TOLERANCE[dtype]


def test_backward_dq_alone_refuses_bad_input():
    q = randn(1, 2, 20, 32, dtype=torch.float16)
    lse = torch.zeros(1, 2, 20, device=DEVICE)
    cases = [
        (dict(dq=torch.empty(1, 2, 20, 16, device=DEVICE, dtype=torch.float16)), "dq must have q's shape"),
        (dict(dq=torch.empty(1, 2, 32, 20, device=DEVICE, dtype=torch.float16).transpose(2, 3)), "unit last stride"),
        (dict(lse=lse[..., :10]), "lse must be a contiguous float32 (1, 2, 20)"),
        (dict(delta=lse.double()), "delta must be a contiguous float32"),
        (dict(cu_seqlens=cu_seqlens([20]), max_seqlen=0), "max_seqlen >= 1"),
        (dict(cu_seqlens=cu_seqlens([20]).long(), max_seqlen=20), "int32 1-D cu_seqlens"),
    ]
    for change, message in cases:
        args = dict(do=q, q=q, k=q, v=q, lse=lse, delta=lse, dq=torch.empty_like(q), causal=True,
                    softmax_scale=0.125) | change
        with pytest.raises(ValueError, match=re.escape(message)):
            fa2.backward_dq(**args)


@pytest.mark.parametrize("grid,tiles", [("flat", False), ("lpt", False), ("lpt", True), ("padded", True),
                                        ("padded", False)])
@pytest.mark.parametrize("case", VARLEN_CASES[:4] + VARLEN_CASES[5:])
def test_varlen_backward_variants(monkeypatch, grid, tiles, case):
    """The varlen backward's grids (padded, or only the real blocks) and its own tiles (under the interpreter 16x16
    for dK/dV, 16x32 for dQ), against the reference (the tiles switch is part of the autotune key)."""
    monkeypatch.setattr(fa2, "DEFAULT_OPTIONS", fa2.Options(varlen_bwd_grid=grid, varlen_bwd_tiles=tiles))
    lengths_q, lengths_k, *rest = case
    check_varlen(lengths_q, lengths_k or lengths_q, *rest)


@pytest.mark.parametrize("grid", ["flat", "lpt"])
def test_varlen_flat_grid_random_lengths_gqa_pointer_path(monkeypatch, grid):
    monkeypatch.setattr(fa2, "DEFAULT_OPTIONS", fa2.Options(tma=False, varlen_bwd_grid=grid))
    lengths = [random.randint(0, 70) for _ in range(6)] + [16, 32]  # documents ending on a block edge too
    check_varlen(lengths, lengths, 4, 2, 32, True, (-1, -1), torch.bfloat16)


@triton.jit
def _flat_block_table(CU, n_seqs, OUT, BLOCK: tl.constexpr, SEQS: tl.constexpr, LPT: tl.constexpr):
    pid = tl.program_id(0)
    seq, level, n_blocks = fa2._flat_block(CU, n_seqs, pid, BLOCK, SEQS, LPT)
    tl.store(OUT + 3 * pid, seq)
    tl.store(OUT + 3 * pid + 1, level)
    tl.store(OUT + 3 * pid + 2, n_blocks)


@pytest.mark.parametrize("lpt", [False, True])
def test_flat_grid_visits_every_block_once(lpt):
    """`_flat_block` over the upper-bound grid: each (sequence, level < its block count) exactly once, the rest past
    the end; LPT: levels from the highest down; document order: sequences in order."""
    block = 8
    lengths = [random.choice([0, 1, 7, 8, 9, random.randint(1, 90)]) for _ in range(random.randint(1, 13))]
    n_programs = triton.cdiv(sum(lengths), block) + len(lengths)
    out = torch.full((n_programs, 3), -7, dtype=torch.int32, device=DEVICE)
    _flat_block_table[(n_programs,)](cu_seqlens(lengths), len(lengths), out, BLOCK=block,
                                     SEQS=triton.next_power_of_2(len(lengths)), LPT=lpt)
    real = [tuple(row) for row in out.tolist() if row[0] < len(lengths)]
    counts = [triton.cdiv(n, block) for n in lengths]
    expected = {(s, level, count) for s, count in enumerate(counts) for level in range(count)}
    assert len(real) == len(expected) and set(real) == expected
    assert all(row[0] == len(lengths) for row in out.tolist()[len(real):])  # the real ones come first
    order = [level for _, level, _ in real] if lpt else [s for s, _, _ in real]
    assert order == sorted(order, reverse=lpt)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run these kernels for real")
def test_masked_kernels_compile_for_sm90():
    """The interpreter runs code the GPU compiler may reject (early returns, integer types of the ranges): compile
    the three kernels with every mask on for sm_90 (the backward's varlen variants too), without a GPU, in a
    process without TRITON_INTERPRET."""
    code = ("from kernels import fa2; "
            "print(all('ld.global' in fa2.compile_for_sm90(k).asm['ptx'] for k in ('fwd', 'dkdv', 'dq')) and "
            "all('ld.global' in fa2.compile_for_sm90(k, grid=g).asm['ptx'] "
            "for k in ('dkdv', 'dq') for g in ('flat', 'lpt')))")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "True"


# ------------------------------------------------------------------------------------------ torch.compile
def test_window_and_varlen_compile_in_one_graph():
    q, k, v = (randn(1, 2, 40, 16, dtype=torch.float16).requires_grad_() for _ in range(3))
    cu = cu_seqlens([7, 0, 33])
    packed = lambda t: t[0].transpose(0, 1)

    def f(q, k, v):
        dense = fa2_attention(q, k, v, causal=True, window_size=(8, -1))
        varlen = fa2_varlen_attention(packed(q), packed(k), packed(v), cu, cu, 33, 33, causal=True,
                                      window_size=(5, -1))
        return dense.float().square().sum() + varlen.float().square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    torch.testing.assert_close(loss, f(q.detach(), k.detach(), v.detach()), rtol=1e-3, atol=1e-3)


def test_window_wider_than_any_sequence_is_no_limit_also_under_compile():
    """A window edge past 2**31 - 1 keys (more than int32 offsets reach) is "no limit" (-1), also where
    torch.compile hands it to the op's int64 argument, which it would overflow: the output of (-1, -1)."""
    q, k, v = (randn(1, 2, 24, 16, dtype=torch.float16) for _ in range(3))
    expected = fa2_attention(q, k, v, causal=True, window_size=(-1, -1))
    for window in ((2**63, -1), (2**31, 2**70)):
        f = lambda q, k, v: fa2_attention(q, k, v, causal=True, window_size=window)  # noqa: E731
        torch.testing.assert_close(f(q, k, v), expected, rtol=0, atol=0)
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(q, k, v), expected, rtol=0, atol=0)


@pytest.mark.parametrize("softcap", [(), (5.0,)], ids=["masks", "masks_and_softcap"])
def test_opcheck_with_masks(softcap):
    op = torch.ops.flashgpt.fa2_forward
    q, k, v = (randn(20, 2, 16, dtype=torch.float16).requires_grad_() for _ in range(3))
    cu = cu_seqlens([3, 17])
    torch.library.opcheck(op, (q, k, v, True, 0.25, 4, 0, cu, cu, 17, 17, *softcap),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


# ------------------------------------------------------------------------------------------ bad input
def _varlen_args(**overrides):
    args = dict(q=randn(10, 4, 32, dtype=torch.float16), k=randn(12, 2, 32, dtype=torch.float16),
                v=randn(12, 2, 32, dtype=torch.float16), cu_seqlens_q=cu_seqlens([4, 6]),
                cu_seqlens_k=cu_seqlens([5, 7]), max_seqlen_q=6, max_seqlen_k=7)
    args.update(overrides)
    return args


def _int32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


BAD_VARLEN = [
    (dict(cu_seqlens_q=cu_seqlens([4, 6]).long()), TypeError,
     "cu_seqlens_q has dtype torch.int64; accepted: torch.int32"),
    (dict(cu_seqlens_k=[0, 5, 12]), TypeError, "cu_seqlens_k must be a torch.Tensor"),
    (dict(cu_seqlens_q=_int32([[0, 4, 10]])), ValueError, r"cu_seqlens_q must have shape \(batch \+ 1,\)"),
    (dict(cu_seqlens_q=_int32([0])), ValueError, r"cu_seqlens_q must have shape \(batch \+ 1,\)"),
    (dict(cu_seqlens_q=_int32([0, 10])), ValueError, "must have the same length"),
    (dict(cu_seqlens_q=_int32([0, 11, 10]), max_seqlen_q=11), ValueError,
     r"cu_seqlens_q must be non-decreasing, but cu_seqlens_q\[2\] = 10 < cu_seqlens_q\[1\] = 11"),
    (dict(cu_seqlens_k=_int32([0, 9, 5])), ValueError, r"cu_seqlens_k must be non-decreasing"),
    (dict(cu_seqlens_q=_int32([1, 4, 10])), ValueError, r"cu_seqlens_q\[0\] must be 0, got 1"),
    (dict(cu_seqlens_q=_int32([0, 4, 9])), ValueError, r"cu_seqlens_q\[-1\] = 9 must equal total_q = 10"),
    (dict(cu_seqlens_k=_int32([0, 5, 13])), ValueError, r"cu_seqlens_k\[-1\] = 13 must equal total_k = 12"),
    (dict(max_seqlen_k=6), ValueError, "max_seqlen_k = 6 is less than the longest sequence's length 7"),
    (dict(max_seqlen_q=6.0), TypeError, "max_seqlen_q must be an int"),
    (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q must be >= 0"),
    (dict(q=randn(1, 10, 4, 32, dtype=torch.float16)), ValueError, r"q must have 3 dims \(total, heads, head_dim\)"),
    (dict(window_size=(-2, 0)), ValueError, r"window_size\[0\] = -2 is below -1"),
    (dict(return_lse=1), TypeError, "return_lse must be a bool, got int"),
    (dict(check_offsets=None), TypeError, "check_offsets must be a bool, got None"),
    (dict(softmax_scale="0.1"), TypeError, "softmax_scale must be a number"),
    (dict(softmax_scale=10**400), ValueError, r"softmax_scale must be a finite number >= 0 and <= 1e\+38"),
    (dict(softcap=1e38), ValueError, r"softcap=1e\+38 is too large for softmax_scale=0.176"),
    (dict(q=randn(0, 4, 32, dtype=torch.float16), cu_seqlens_q=_int32([0, 0, 0])), ValueError,
     r"total_q and total_k \(the packed rows\) must be >= 1"),
]


@pytest.mark.parametrize("overrides,error,message", BAD_VARLEN)
def test_bad_varlen_input_is_rejected(overrides, error, message):
    with pytest.raises(error, match=message):
        fa2_varlen_attention(**_varlen_args(**overrides))


@pytest.mark.parametrize("window_size,error,message", [
    ((-2, 0), ValueError, r"window_size\[0\] = -2 is below -1; accepted: -1 \(no limit\) or a number of keys >= 0"),
    ((4, -5), ValueError, r"window_size\[1\] = -5 is below -1"),
    ((4,), TypeError, r"window_size must be a pair of ints \(left, right\)"),
    ((4.0, 0), TypeError, "window_size must be a pair of ints"),
    (4, TypeError, "window_size must be a pair of ints"),
])
def test_bad_window_is_rejected(window_size, error, message):
    q, k, v = (randn(1, 2, 16, 32, dtype=torch.float16) for _ in range(3))
    with pytest.raises(error, match=message):
        fa2_attention(q, k, v, window_size=window_size)


def test_fa1_refuses_a_window():
    q, k, v = (randn(1, 2, 16, 32, dtype=torch.float16) for _ in range(3))
    with pytest.raises(ValueError, match="fa1_attention has no sliding window"):
        fa1_attention(q, k, v, window_size=(4, 0))
