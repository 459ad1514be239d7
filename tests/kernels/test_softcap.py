"""Attention logit soft-capping in the FA2 kernels (`softcap`: each score s = softmax_scale * q.k becomes
softcap * tanh(s / softcap) before the mask and the softmax; Gemma 2, flash-attn's `softcap`) against the float64
reference of tests/kernels/test_attention.py with the cap, forward and backward: dense, windowed, GQA, packed qkv,
varlen (an empty sequence included), the split-K/V decode kernel; the front end's checks and its opt-in contract.

Same rules as test_attention.py: Triton's interpreter without a GPU, fresh random inputs, NaN-poisoned outputs.
q and k are drawn large (`SCALE`), so the scores reach several times the cap and the cap changes the result: each
case also checks that the uncapped reference is far from the kernel's output.
"""

import math
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from kernels import (
    fa1_attention, fa1_qkvpacked_attention, fa2, fa2_attention, fa2_decode, fa2_qkvpacked_attention,
    fa2_varlen_attention, frontend,
)
from kernels.common import tanh
from test_attention import DEVICE, TOLERANCE, check, poisoned_allocations, randn, reference, rel_err  # noqa: F401
from test_masks import check_varlen, cu_seqlens

SCALE = 3.0  # q, k ~ N(0, 9): scores s ~ N(0, 81) after 1/sqrt(head_dim), against caps of 2 to 10


@pytest.fixture(autouse=True)
def bfloat16_tolerance(monkeypatch):
    """bfloat16 with such logits: P and dS rounded to 8 bits before the matmuls put dq, dk ~1% off (the uncapped
    kernel on the same inputs: up to 1.9%; a CI run drew a dq 2.3% off; float32 agrees to 1e-6), past
    test_attention's 1e-2."""
    import test_attention

    monkeypatch.setitem(test_attention.TOLERANCE, torch.bfloat16, 3e-2)


# How far a capped result must lie from the uncapped one (relative): the cap must matter. Ten tolerances, bfloat16's
# at its 2e-2 of before the flake seen in CI.
CAPPED_APART = {**{dtype: 10 * tol for dtype, tol in TOLERANCE.items()}, torch.bfloat16: 0.2}


def big(*shape, dtype):
    return randn(*shape, dtype=dtype) * SCALE


def check_capped(attention, q, k, v, causal, softcap, **kwargs):
    """`check` with the cap, and proof that the cap mattered: the uncapped reference is far from the output."""
    o, _ = check(attention, q, k, v, causal, softcap=softcap, **kwargs)
    scale = kwargs.get("softmax_scale") or 1.0 / math.sqrt(q.shape[-1])
    o_plain, _ = reference(q, k, v, causal, scale, kwargs.get("window_size", (-1, -1)))
    assert rel_err(o, o_plain) > CAPPED_APART[q.dtype]


# (batch, n_heads, n_kv_heads, seqlen_q, seqlen_k, head_dim, causal, window_size, dtype, softcap)
CASES = [
    (1, 2, 2, 40, 40, 32, True, (-1, -1), torch.bfloat16, 5.0),
    (2, 2, 2, 33, 50, 32, False, (-1, -1), torch.float16, 10.0),
    (1, 4, 2, 48, 48, 32, True, (-1, -1), torch.bfloat16, 3.0),  # GQA
    (1, 4, 1, 40, 57, 16, False, (12, 6), torch.float16, 5.0),  # MQA, a window on both sides
    (1, 2, 2, 70, 70, 32, True, (20, -1), torch.bfloat16, 2.0),  # local attention: causal + left window
    (1, 2, 2, 50, 20, 32, True, (-1, -1), torch.float16, 5.0),  # q longer: the first rows see no key
    (1, 1, 1, 33, 33, 48, False, (-1, -1), torch.float32, 4.0),  # float32, head_dim not a power of two
]


@pytest.mark.parametrize("batch,n_heads,n_kv_heads,seqlen_q,seqlen_k,head_dim,causal,window_size,dtype,softcap", CASES)
def test_softcap_matches_reference(batch, n_heads, n_kv_heads, seqlen_q, seqlen_k, head_dim, causal, window_size,
                                   dtype, softcap):
    q = big(batch, n_heads, seqlen_q, head_dim, dtype=dtype)
    k = big(batch, n_kv_heads, seqlen_k, head_dim, dtype=dtype)
    v = randn(batch, n_kv_heads, seqlen_k, head_dim, dtype=dtype)
    check_capped(fa2_attention, q, k, v, causal, softcap, window_size=window_size)


@pytest.mark.parametrize("case", [CASES[0], CASES[3]])
def test_softcap_pointer_path(monkeypatch, case):
    """The same through pointer loads instead of TMA descriptors."""
    batch, n_heads, n_kv_heads, seqlen_q, seqlen_k, head_dim, causal, window_size, dtype, softcap = case
    monkeypatch.setattr(fa2, "DEFAULT_OPTIONS", fa2.Options(tma=False))
    q = big(batch, n_heads, seqlen_q, head_dim, dtype=dtype)
    k = big(batch, n_kv_heads, seqlen_k, head_dim, dtype=dtype)
    v = randn(batch, n_kv_heads, seqlen_k, head_dim, dtype=dtype)
    check_capped(fa2_attention, q, k, v, causal, softcap, window_size=window_size)


def test_softcap_with_a_custom_softmax_scale():
    """The cap applies to softmax_scale * q.k, not to q.k."""
    q, k = (big(1, 2, 37, 32, dtype=torch.float16) for _ in range(2))
    v = randn(1, 2, 37, 32, dtype=torch.float16)
    check_capped(fa2_attention, q, k, v, True, 3.0, softmax_scale=0.5)


def test_softcap_far_above_the_scores_is_no_cap():
    """A cap 1000x the largest score changes it by < 1e-6 relatively (tanh(x) ~ x - x^3 / 3): the kernel's tanh
    must keep its precision for tiny arguments, or softcap * tanh(s / softcap) would round to 0 or worse."""
    q, k, v = (randn(1, 2, 40, 32, dtype=torch.float32) for _ in range(3))
    softcap = 1000 * (q @ k.transpose(-1, -2)).abs().max().item() / math.sqrt(32)
    o = fa2_attention(q, k, v, causal=True, softcap=softcap)
    o_ref, _ = reference(q, k, v, True, 1 / math.sqrt(32))
    assert rel_err(o, o_ref) < 1e-5


def test_a_tiny_softcap_flattens_the_scores():
    """softcap -> 0: every score is within +-softcap, so each row averages the v it sees."""
    q, k, v = (big(1, 1, 24, 16, dtype=torch.float32) for _ in range(3))
    o = fa2_attention(q, k, v, causal=True, softcap=1e-6)
    mean = v.cumsum(2) / torch.arange(1, 25, dtype=torch.float32).view(1, 1, 24, 1)
    assert rel_err(o, mean) < 1e-4


def test_softcap_zero_is_the_uncapped_kernel():
    q, k, v = (randn(1, 2, 40, 32, dtype=torch.bfloat16) for _ in range(3))
    assert torch.equal(fa2_attention(q, k, v, causal=True, softcap=0.0), fa2_attention(q, k, v, causal=True))
    assert torch.equal(fa2_attention(q, k, v, causal=True, softcap=0), fa2_attention(q, k, v, causal=True))


@pytest.mark.parametrize("n_heads,n_kv_heads,causal,window_size", [(2, 2, True, (-1, -1)), (4, 2, True, (9, -1)),
                                                                   (2, 1, False, (-1, -1))])
def test_qkvpacked_softcap_matches_reference(n_heads, n_kv_heads, causal, window_size):
    """The packed form: its backward writes dq, dk, dv into one gradient shaped like qkv."""
    batch, seqlen, head_dim, softcap = 2, 37, 32, 4.0
    qkv = randn(batch, seqlen, n_heads + 2 * n_kv_heads, head_dim, dtype=torch.bfloat16)
    qkv[:, :, :n_heads + n_kv_heads] *= SCALE
    qkv.requires_grad_()
    o, lse = fa2_qkvpacked_attention(qkv, n_heads, causal=causal, window_size=window_size, return_lse=True,
                                     softcap=softcap)
    do = torch.randn_like(o)
    o.backward(do)
    qkv64 = qkv.detach().double().requires_grad_()
    q, k, v = (t.transpose(1, 2) for t in qkv64.split([n_heads, n_kv_heads, n_kv_heads], dim=2))
    o_ref, lse_ref = reference(q, k, v, causal, 1 / math.sqrt(head_dim), window_size, softcap)
    o_ref.transpose(1, 2).backward(do.double())
    assert rel_err(o, o_ref.transpose(1, 2)) < TOLERANCE[torch.bfloat16]
    assert rel_err(lse, lse_ref) < TOLERANCE[torch.bfloat16]
    assert rel_err(qkv.grad, qkv64.grad) < TOLERANCE[torch.bfloat16]
    o_plain, _ = reference(q, k, v, causal, 1 / math.sqrt(head_dim), window_size)
    assert rel_err(o, o_plain.transpose(1, 2)) > CAPPED_APART[torch.bfloat16]


# (lengths_q, lengths_k, n_heads, n_kv_heads, head_dim, causal, window_size, dtype, softcap)
VARLEN_CASES = [
    # empty sequences, and a sequence whose queries have no keys
    ([0, 12, 0, 35, 0], None, 2, 2, 16, True, (-1, -1), torch.bfloat16, 5.0),
    ([10, 5, 8], [0, 20, 3], 2, 2, 32, False, (-1, -1), torch.float16, 3.0),
    # GQA, a window, seqlen_q != seqlen_k per sequence
    ([50, 9, 33], [20, 40, 33], 4, 2, 32, False, (4, 11), torch.bfloat16, 2.0),
    ([5, 40, 17, 1, 30], None, 4, 2, 32, True, (6, -1), torch.float16, 10.0),
]


@pytest.mark.parametrize("lengths_q,lengths_k,n_heads,n_kv_heads,head_dim,causal,window_size,dtype,softcap",
                         VARLEN_CASES)
def test_varlen_softcap_matches_reference(lengths_q, lengths_k, n_heads, n_kv_heads, head_dim, causal, window_size,
                                          dtype, softcap):
    lengths_k = lengths_k or lengths_q
    o, inputs = check_varlen(lengths_q, lengths_k, n_heads, n_kv_heads, head_dim, causal, window_size, dtype,
                             softcap=softcap, input_scale=SCALE)
    uncapped = fa2_varlen_attention(*(t.detach() for t in inputs[:3]), *inputs[3:], max(lengths_q), max(lengths_k),
                                    causal=causal, window_size=window_size)
    assert rel_err(o, uncapped) > CAPPED_APART[dtype]


@pytest.mark.parametrize("grid", ["flat", "lpt", "padded"])
def test_varlen_softcap_backward_grids(monkeypatch, grid):
    """The varlen backward's grids (and, with flat / lpt, its own tiles) with the cap."""
    monkeypatch.setattr(fa2, "DEFAULT_OPTIONS", fa2.Options(varlen_bwd_grid=grid, varlen_bwd_tiles=grid != "padded"))
    check_varlen([0, 12, 33, 5], [0, 12, 33, 5], 4, 2, 32, True, (-1, -1), torch.bfloat16, softcap=4.0,
                 input_scale=SCALE)


def test_varlen_softcap_equals_dense_with_one_sequence():
    q, k, v = (big(1, 2, 45, 32, dtype=torch.float16) for _ in range(3))
    dense = fa2_attention(q, k, v, causal=True, window_size=(9, -1), softcap=6.0)
    packed = lambda t: t[0].transpose(0, 1)
    cu = cu_seqlens([45])
    varlen = fa2_varlen_attention(packed(q), packed(k), packed(v), cu, cu, 45, 45, causal=True, window_size=(9, -1),
                                  softcap=6.0)
    assert torch.equal(varlen, packed(dense))


@pytest.mark.parametrize("seqlen", [None, 70])
def test_decode_softcap_matches_reference(seqlen):
    """The split-K/V decode kernel (one query per head; seqlen: only the first keys of a longer cache count)."""
    q = big(2, 4, 1, 32, dtype=torch.bfloat16)
    k = big(2, 2, 100, 32, dtype=torch.bfloat16)
    v = randn(2, 2, 100, 32, dtype=torch.bfloat16)
    n = seqlen or 100
    kw = {} if seqlen is None else dict(seqlen=torch.tensor(seqlen, device=DEVICE))
    o = fa2_decode(q, k, v, num_splits=3, softcap=5.0, **kw)
    o_ref, _ = reference(q, k[:, :, :n], v[:, :, :n], False, 1 / math.sqrt(32), softcap=5.0)
    assert rel_err(o, o_ref) < TOLERANCE[torch.bfloat16]
    assert rel_err(o, reference(q, k[:, :, :n], v[:, :, :n], False, 1 / math.sqrt(32))[0]) > 0.05


def test_softcap_compiles_in_one_graph():
    q, k, v = (big(1, 2, 40, 16, dtype=torch.float16).requires_grad_() for _ in range(3))

    def f(q, k, v):
        return fa2_attention(q, k, v, causal=True, window_size=(8, -1), softcap=5.0).float().square().sum()

    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    torch.testing.assert_close(loss, f(q.detach(), k.detach(), v.detach()), rtol=1e-3, atol=1e-3)




@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run these kernels for real")
def test_softcap_kernels_compile_for_sm90():
    """The SOFTCAP variants of the three kernels compile for sm_90 without a GPU (the interpreter runs code the GPU
    compiler may reject), in a process without TRITON_INTERPRET."""
    code = ("from kernels import fa2; print(all('ld.global' in fa2.compile_for_sm90(k, softcap=True).asm['ptx'] "
            "for k in ('fwd', 'dkdv', 'dq')))")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "True"


# ------------------------------------------------------------------------------------------ bad input
BAD_SOFTCAP = [
    (-1.0, ValueError, r"softcap must be a finite number >= 0 and <= 1e\+38 \(0.0 = off\), got -1.0"),
    (float("nan"), ValueError, "softcap must be a finite number >= 0 .*, got nan"),
    (float("inf"), ValueError, "softcap must be a finite number >= 0 .*, got inf"),
    (10**400, ValueError, r"softcap must be a finite number >= 0 .*, got 100000000000\.\.\. \(401 characters\)$"),
    (1e38, ValueError, r"softcap=1e\+38 is too large for softmax_scale=0.17677.*: softmax_scale / softcap underflows"),
    (True, TypeError, r"softcap must be a number \(int or float; 0.0 = off\), got bool"),
    ("5", TypeError, "softcap must be a number .*, got str"),
    (None, TypeError, "softcap must be a number .*, got NoneType"),
]


@pytest.mark.parametrize("softcap,error,message", BAD_SOFTCAP)
def test_bad_softcap_is_rejected(softcap, error, message):
    q, k, v = (randn(1, 2, 16, 32, dtype=torch.float16) for _ in range(3))
    with pytest.raises(error, match=message):
        fa2_attention(q, k, v, softcap=softcap)
    with pytest.raises(error, match=message):
        fa2_qkvpacked_attention(torch.cat([q, k, v], 1).transpose(1, 2), softcap=softcap)
    packed = lambda t: t[0].transpose(0, 1)
    cu = cu_seqlens([16])
    with pytest.raises(error, match=message):
        fa2_varlen_attention(packed(q), packed(k), packed(v), cu, cu, 16, 16, softcap=softcap)
    with pytest.raises(error, match=message):
        fa2_decode(q[:, :, :1], k, v, softcap=softcap)


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning", "ignore:invalid value:RuntimeWarning")  # 1e38 * q.k
def test_the_largest_scales_are_accepted():
    """The bounds are inclusive: softmax_scale 1e38 runs, and a cap of 1e30, far above every score, changes none
    (softcap * tanh(s / softcap) = s to float32's precision: the float64 reference without a cap)."""
    q, k, v = (randn(1, 2, 16, 32, dtype=torch.float16) for _ in range(3))
    fa2_attention(q, k, v, softmax_scale=1e38)
    o = fa2_attention(q, k, v, softmax_scale=1.0, softcap=1e30)
    o_ref, _ = reference(q.double(), k.double(), v.double(), False, 1.0)
    assert rel_err(o, o_ref) < TOLERANCE[torch.float16]


def test_softcap_is_keyword_only():
    q, k, v = (randn(1, 2, 16, 32, dtype=torch.float16) for _ in range(3))
    with pytest.raises(TypeError):
        fa2_attention(q, k, v, True, None, False, (-1, -1), 5.0)


def test_fa1_refuses_softcap_and_names_the_kernels_with_it():
    q, k, v = (randn(1, 2, 16, 32, dtype=torch.float16) for _ in range(3))
    with pytest.raises(ValueError, match=r"fa1_attention has no logit soft-capping \(softcap=5.0\); the kernels "
                                         r"with it: fa2_attention"):
        fa1_attention(q, k, v, softcap=5.0)
    with pytest.raises(ValueError, match="fa1_qkvpacked_attention has no logit soft-capping .* "
                                         "fa2_qkvpacked_attention"):
        fa1_qkvpacked_attention(torch.cat([q, k, v], 1).transpose(1, 2), softcap=5.0)
    with pytest.raises(ValueError, match="fa1_attention has no logit soft-capping"):  # the op, called directly
        torch.ops.flashgpt.fa1_forward(q, k, v, True, 0.25, -1, -1, None, None, 0, 0, 5.0)
    fa1_attention(q, k, v, softcap=0.0)  # off: fine


# ------------------------------------------------------------------------------------------ the opt-in contract
def _launchers(with_softcap):
    """Stub launchers (o = v, lse = 0) that record the keywords they get."""
    seen = []

    def forward(q, k, v, causal, softmax_scale, **kwargs):
        seen.append(("forward", kwargs))
        return v.clone(), torch.zeros(q.shape[:3], dtype=torch.float32, device=q.device)

    def backward(do, q, k, v, o, lse, causal, softmax_scale, out=None, **kwargs):
        seen.append(("backward", kwargs))
        return torch.zeros_like(q), torch.zeros_like(k), do.clone()

    if with_softcap:
        fwd, bwd = forward, backward

        def forward(q, k, v, causal, softmax_scale, softcap=0.0):  # noqa: F811 (the opted-in signature)
            return fwd(q, k, v, causal, softmax_scale, softcap=softcap)

        def backward(do, q, k, v, o, lse, causal, softmax_scale, out=None, softcap=0.0):  # noqa: F811
            return bwd(do, q, k, v, o, lse, causal, softmax_scale, out=out, softcap=softcap)

    return forward, backward, seen


def test_a_kernel_opts_in_by_taking_the_softcap_keyword(monkeypatch):
    """make_attention reads the opt-in off the launchers' signatures: with the keyword they get the forward's softcap
    in both directions; without it they never see the keyword and softcap != 0 is refused naming the kernels with
    it. softcap=True with launchers that do not take it is a TypeError at registration."""
    monkeypatch.setattr(frontend, "SOFTCAP_KERNELS", ["fa2"])
    name = f"softcap_probe_{uuid.uuid4().hex[:8]}"
    forward, backward, seen = _launchers(with_softcap=True)
    attention, _ = frontend.make_attention(name, forward, backward, lse_log_base=2.0)
    assert frontend.SOFTCAP_KERNELS == ["fa2", name]
    q, k, v = (randn(1, 2, 16, 16, dtype=torch.float32).requires_grad_() for _ in range(3))
    attention(q, k, v, softcap=7.5).sum().backward()
    assert seen == [("forward", {"softcap": 7.5}), ("backward", {"softcap": 7.5})]

    forward, backward, seen = _launchers(with_softcap=False)
    plain, _ = frontend.make_attention(f"{name}_plain", forward, backward, lse_log_base=2.0)
    plain(q, k, v).sum().backward()
    assert seen == [("forward", {}), ("backward", {})]
    with pytest.raises(ValueError, match=f"{name}_plain_attention has no logit soft-capping .* the kernels with it: "
                                         f"fa2_attention or {name}_attention"):
        plain(q, k, v, softcap=1.0)
    with pytest.raises(TypeError, match="launchers must take a `softcap` keyword"):
        frontend.make_attention(f"{name}_forced", forward, backward, lse_log_base=2.0, softcap=True)


@triton.jit
def _tanh_probe(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, tanh(tl.load(X + offs)))


def test_kernel_tanh_keeps_float32_precision():
    """`common.tanh` (the kernels' tanh, from exp2) against torch's in float64, from 1e-30 to beyond where float32
    saturates, both signs: relative error within ~8 float32 ulps (the largest just above the Taylor branch, where
    1 - 2 / (e^2x + 1) cancels most)."""
    x = torch.cat([torch.logspace(-30, 3, 500, dtype=torch.float64), torch.tensor([0.125, 0.1249999, 1e30, 3e38])])
    x = torch.cat([x, -x, torch.zeros(1, dtype=torch.float64)])
    n = triton.next_power_of_2(x.numel())
    x32 = torch.zeros(n, dtype=torch.float32, device=DEVICE)
    x32[:x.numel()] = x.float()
    y = torch.empty_like(x32)
    _tanh_probe[(1,)](x32, y, n)
    expected = torch.tanh(x32.double())
    err = (y.double() - expected).abs() / expected.abs().clamp_min(1e-300)
    assert err[expected != 0].max() < 1e-6 and (y[expected == 0] == 0).all()
