"""Correctness of the Triton attention kernels (FA1, FA2, FA3; q, k, v apart and packed in one qkv) against a
float64 reference with explicit masks.

On a machine without CUDA these run through Triton's interpreter (tests/conftest.py switches it on), so the
shapes are small. Inputs are fresh random draws every run; kernel outputs are allocated poisoned (NaN), so an
element the kernel forgets to write fails the comparison.
"""

import math
import re

import pytest
import torch

from kernels import (
    fa1, fa1_attention, fa1_qkvpacked_attention, fa2, fa2_attention, fa2_qkvpacked_attention, fa3, fa3_attention,
    fa3_qkvpacked_attention,
)

KERNELS = [
    pytest.param(fa2_attention, id="fa2"),
    pytest.param(fa1_attention, id="fa1"),
    # Without a GPU fa3 is FA2 (tests/kernels/test_fa3.py checks that fallback); the whole matrix runs it on a GPU.
    pytest.param(fa3_attention, id="fa3", marks=pytest.mark.gpu),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32 inputs: exact float32 dots under the CPU interpreter; TF32 dots on the GPU, whose 10-bit mantissa is
# float16's (measured on the H200: dq 1.6e-3 relative error, above 1e-3)
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 5e-3 if DEVICE == "cuda" else 1e-3}


@pytest.fixture(autouse=True)
def poisoned_allocations(monkeypatch):
    """Make torch.empty / torch.empty_like return NaN-filled floating tensors while a test runs."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw)))


def reference(q, k, v, causal, softmax_scale, window_size=(-1, -1), softcap=0.0):
    """float64 attention with an explicit bottom-right mask: causal, and flash-attn's window (key j visible to
    query i iff i + d - left <= j <= i + d + right, d = seqlen_k - seqlen_q, -1 = no limit, causal sets right
    to 0); rows that see no key give 0 and lse -inf. softcap > 0: scores s -> softcap * tanh(s / softcap)
    before the mask (Gemma 2's logit soft-capping)."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = q @ k.transpose(-1, -2) * softmax_scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    left, right = window_size[0], 0 if causal else window_size[1]
    i = torch.arange(seqlen_q, device=q.device)[:, None] + seqlen_k - seqlen_q
    j = torch.arange(seqlen_k, device=q.device)[None, :]
    if right >= 0:
        s = s.masked_fill(j > i + right, float("-inf"))
    if left >= 0:
        s = s.masked_fill(j < i - left, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return p @ v, lse


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite values (NaN: an element left unwritten, or a masked row)"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def randn(*shape, dtype):
    return torch.randn(*shape, device=DEVICE, dtype=dtype)


def check(attention, q, k, v, causal, softmax_scale=None, window_size=None, softcap=None):
    """Run forward + backward and compare o, lse, dq, dk, dv with the float64 reference (softcap: passed to both
    where given)."""
    dtype = q.dtype
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    mask = {} if window_size is None else dict(window_size=window_size)
    cap = {} if softcap is None else dict(softcap=softcap)
    o, lse = attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True, **mask, **cap)
    do = torch.randn_like(o)
    o.backward(do)

    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o_ref, lse_ref = reference(q64, k64, v64, causal, scale, **mask, **cap)
    o_ref.backward(do.double())
    compare(o, lse, (q.grad, k.grad, v.grad), o_ref, lse_ref, (q64.grad, k64.grad, v64.grad), dtype)
    return o, (q.grad, k.grad, v.grad)


def compare(o, lse, grads, o_ref, lse_ref, grads_ref, dtype):
    """o, lse, (dq, dk, dv) against the float64 reference's; rows with lse_ref = -inf must give -inf."""
    tol = TOLERANCE[dtype]
    assert o.shape == o_ref.shape and o.dtype == dtype and lse.dtype == torch.float32
    assert rel_err(o, o_ref) < tol
    seen = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), seen) and (lse[~seen] == float("-inf")).all()
    if seen.any():
        assert rel_err(lse[seen], lse_ref[seen]) < tol
    for name, grad, grad_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        if grad_ref.abs().max() == 0:  # e.g. seqlen_k = 1: softmax is constant; allow rounding, relative to dv
            assert torch.isfinite(grad).all() and grad.double().norm() / grads_ref[2].norm() < tol, name
        else:
            assert rel_err(grad, grad_ref) < tol, name


# (batch, n_heads, n_kv_heads, seqlen_q, seqlen_k, head_dim, causal, dtype)
CASES = [
    # sequence lengths, equal q/k, both dtypes, causal and not
    (1, 2, 2, 1, 1, 64, True, torch.bfloat16),
    (1, 2, 2, 17, 17, 32, False, torch.float16),
    (2, 2, 2, 100, 100, 64, True, torch.bfloat16),
    (1, 2, 2, 129, 129, 64, False, torch.float16),
    (1, 1, 1, 257, 257, 64, True, torch.float16),
    (1, 1, 1, 257, 257, 32, False, torch.bfloat16),
    # seqlen_q != seqlen_k both ways; q longer than k leaves the first rows fully masked under causal
    (1, 2, 2, 100, 37, 64, True, torch.float16),
    (1, 2, 2, 37, 100, 64, True, torch.bfloat16),
    (1, 2, 2, 100, 37, 32, False, torch.bfloat16),
    (1, 2, 2, 1, 129, 64, True, torch.float16),
    # head dims, including non powers of two
    (1, 2, 2, 65, 65, 16, True, torch.float16),
    (1, 2, 2, 65, 65, 80, True, torch.bfloat16),
    (1, 1, 1, 65, 65, 128, False, torch.float16),
    (1, 1, 1, 65, 65, 128, True, torch.bfloat16),
    # GQA (8 query heads on 2 K/V heads) and MQA
    (1, 8, 2, 48, 48, 32, True, torch.bfloat16),
    (1, 4, 1, 50, 70, 64, False, torch.float16),
    # float32 inputs (TF32 matmuls on the GPU)
    (1, 2, 2, 40, 40, 32, True, torch.float32),
]


@pytest.mark.parametrize("attention", KERNELS)
@pytest.mark.parametrize("batch,n_heads,n_kv_heads,seqlen_q,seqlen_k,head_dim,causal,dtype", CASES)
def test_matches_float64_reference(attention, batch, n_heads, n_kv_heads, seqlen_q, seqlen_k, head_dim, causal, dtype):
    q = randn(batch, n_heads, seqlen_q, head_dim, dtype=dtype)
    k = randn(batch, n_kv_heads, seqlen_k, head_dim, dtype=dtype)
    v = randn(batch, n_kv_heads, seqlen_k, head_dim, dtype=dtype)
    check(attention, q, k, v, causal)


POINTER_PATH_CASES = [c for c in CASES if c[5] in (64, 80) or c[1] != c[2]][:6]


@pytest.mark.parametrize("batch,n_heads,n_kv_heads,seqlen_q,seqlen_k,head_dim,causal,dtype", POINTER_PATH_CASES)
def test_fa2_pointer_path_matches_reference(monkeypatch, batch, n_heads, n_kv_heads, seqlen_q, seqlen_k, head_dim,
                                            causal, dtype):
    """fa2 reads 16-bit inputs through TMA descriptors where it can; the pointer-load path must agree too."""
    from kernels import fa2

    monkeypatch.setattr(fa2, "DEFAULT_OPTIONS", fa2.Options(tma=False))
    q = randn(batch, n_heads, seqlen_q, head_dim, dtype=dtype)
    k = randn(batch, n_kv_heads, seqlen_k, head_dim, dtype=dtype)
    v = randn(batch, n_kv_heads, seqlen_k, head_dim, dtype=dtype)
    check(fa2_attention, q, k, v, causal)


def test_tma_needs_16_byte_alignment():
    from kernels.common import use_tma

    x = randn(1, 2, 40, 65, dtype=torch.bfloat16)
    assert use_tma(x[..., :64].contiguous())
    assert not use_tma(x[..., 1:])  # data 2 bytes past an aligned address
    assert not use_tma(x[..., :64])  # row stride 65 * 2 bytes
    assert not use_tma(x[..., :64].float())  # float32 takes the pointer path
    assert not use_tma(x[:, :1, :, :64].expand(1, 2, 40, 64))  # a broadcast (stride-0) dimension


@pytest.mark.parametrize("attention", KERNELS)
def test_misaligned_views_are_correct(attention):
    """Views TMA cannot address (odd row stride, data off a 16-byte boundary) take the pointer path."""
    base = randn(2, 3, 50, 41, dtype=torch.bfloat16)
    q, k, v = base[:, 0:1, :, 1:], base[:, 1:2, :, :40], base[:, 2:3, :, 1:]
    check(attention, q, k, v, causal=True)


@pytest.mark.parametrize("attention", KERNELS)
def test_custom_softmax_scale(attention):
    q, k, v = (randn(1, 2, 33, 32, dtype=torch.float16) for _ in range(3))
    check(attention, q, k, v, causal=True, softmax_scale=0.3)


@pytest.mark.parametrize("attention", KERNELS)
def test_strided_views_need_no_copy(attention, monkeypatch):
    """q, k, v as views of one fused (B, T, 3 * H * D) projection, the way the GPT produces them."""
    batch, seqlen, n_heads, head_dim = 2, 45, 2, 32
    qkv = randn(batch, seqlen, 3 * n_heads * head_dim, dtype=torch.bfloat16)
    q, k, v = (t.view(batch, seqlen, n_heads, head_dim).transpose(1, 2) for t in qkv.split(n_heads * head_dim, dim=2))
    assert not q.is_contiguous()

    def no_copy(self, *args, **kwargs):
        raise AssertionError("an input was copied")

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "contiguous", no_copy)
        out = attention(q, k, v, causal=True)
    o_ref, _ = reference(q, k, v, True, 1.0 / math.sqrt(head_dim))
    assert rel_err(out, o_ref) < TOLERANCE[torch.bfloat16]
    assert out.transpose(1, 2).is_contiguous(), "o should be stored like q, so the model's transpose is free"
    check(attention, q, k, v, causal=True)


@pytest.mark.parametrize("attention", KERNELS)
@pytest.mark.parametrize("expanded", ["batch", "heads", "seqlen"])
def test_broadcast_views_are_correct(attention, expanded):
    """Inputs expanded with a stride of 0 (same data in every batch, head or position) read correctly, and the
    outputs and gradients still come back with a contiguous head_dim."""
    shape = {"batch": (1, 2, 24, 32), "heads": (2, 1, 24, 32), "seqlen": (2, 2, 1, 32)}[expanded]
    q = randn(*shape, dtype=torch.float16).expand(2, 2, 24, 32)
    k, v = randn(2, 2, 24, 32, dtype=torch.float16), randn(2, 2, 24, 32, dtype=torch.float16)
    o, grads = check(attention, q, k, v, causal=True)
    assert o.stride(-1) == 1 and all(g.stride(-1) == 1 for g in grads)


@pytest.mark.parametrize("attention", KERNELS)
def test_non_unit_last_stride_is_copied_once(attention):
    q, k, v = (randn(1, 2, 32, 24, dtype=torch.float16).transpose(2, 3) for _ in range(3))  # last stride != 1
    check(attention, q, k, v, causal=False)


@pytest.mark.parametrize("attention", KERNELS)
def test_fully_masked_rows_give_zero_output_and_gradient(attention):
    q = randn(1, 2, 50, 32, dtype=torch.float16, ).requires_grad_()
    k = randn(1, 2, 20, 32, dtype=torch.float16).requires_grad_()
    v = randn(1, 2, 20, 32, dtype=torch.float16).requires_grad_()
    o, lse = attention(q, k, v, causal=True, return_lse=True)
    o.backward(torch.randn_like(o))
    blind = 50 - 20  # query i sees key j <= i - 30: the first 30 rows see nothing
    assert (o[:, :, :blind] == 0).all() and torch.isfinite(o).all()
    assert (lse[:, :, :blind] == float("-inf")).all() and torch.isfinite(lse[:, :, blind:]).all()
    assert (q.grad[:, :, :blind] == 0).all() and torch.isfinite(q.grad).all()
    assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()


@pytest.mark.parametrize("attention", KERNELS)
def test_backward_is_deterministic(attention):
    q = randn(1, 4, 70, 32, dtype=torch.bfloat16)
    k, v = randn(1, 2, 70, 32, dtype=torch.bfloat16), randn(1, 2, 70, 32, dtype=torch.bfloat16)
    do = randn(1, 4, 70, 32, dtype=torch.bfloat16)
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        attention(*leaves, causal=True).backward(do)
        grads.append([t.grad for t in leaves])
    for first, second in zip(*grads):
        assert torch.equal(first, second)


@pytest.mark.parametrize("attention", KERNELS)
def test_compiles_in_one_graph(attention):
    """The custom op traces under torch.compile(fullgraph=True) with its fake implementation and autograd."""
    q, k, v = (randn(1, 2, 24, 16, dtype=torch.float16).requires_grad_() for _ in range(3))

    def f(q, k, v):
        return attention(q, k, v, causal=True).float().square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    loss.backward()
    assert torch.isfinite(loss) and q.grad is not None and torch.isfinite(q.grad).all()
    torch.testing.assert_close(loss, f(q.detach(), k.detach(), v.detach()), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("attention", KERNELS)
def test_compiles_with_one_tensor_passed_twice(attention):
    """k is v (and q is k): fullgraph compile works and the gradients match eager (each summed over its uses)."""
    q, k = (randn(1, 2, 24, 16, dtype=torch.float32).requires_grad_() for _ in range(2))

    def f(q, k):
        return (attention(q, k, k, causal=True).square().sum() + attention(q, q, q, causal=False).square().sum())

    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k)
    grads = torch.autograd.grad(loss, (q, k))
    loss_ref = f(q, k)
    grads_ref = torch.autograd.grad(loss_ref, (q, k))
    torch.testing.assert_close(loss, loss_ref, rtol=1e-4, atol=1e-4)
    for got, ref in zip(grads, grads_ref):
        assert rel_err(got, ref) < 1e-4


@pytest.mark.parametrize("name", ["fa1", "fa2"])
def test_opcheck(name):
    """torch.library's own consistency check of schema, fake implementation and autograd registration."""
    op = getattr(torch.ops.flashgpt, f"{name}_forward")
    q, k, v = (randn(1, 2, 20, 16, dtype=torch.float16).requires_grad_() for _ in range(3))
    torch.library.opcheck(op, (q, k, v, True, 0.25), test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


# ------------------------------------------------------------------------------------------ packed qkv
QKVPACKED = [
    pytest.param(fa2_qkvpacked_attention, id="fa2"),
    pytest.param(fa1_qkvpacked_attention, id="fa1"),
    pytest.param(fa3_qkvpacked_attention, id="fa3", marks=pytest.mark.gpu),
]


def split_heads(qkv, n_heads):
    """q, k, v (batch, heads, seqlen, head_dim) views of a packed (batch, seqlen, heads, head_dim) qkv."""
    n_kv_heads = (qkv.shape[2] - n_heads) // 2
    return qkv.transpose(1, 2).split([n_heads, n_kv_heads, n_kv_heads], dim=1)


def check_qkvpacked(attention, qkv, n_heads, causal, window_size=None):
    """Forward + backward on a packed qkv against the float64 reference on its q, k, v heads."""
    qkv = qkv.detach().requires_grad_()
    mask = {} if window_size is None else dict(window_size=window_size)
    o, lse = attention(qkv, n_heads, causal=causal, return_lse=True, **mask)
    do = torch.randn_like(o)
    o.backward(do)
    assert o.is_contiguous() and qkv.grad.shape == qkv.shape
    heads = n_heads or qkv.shape[2] // 3
    qkv64 = qkv.detach().double().requires_grad_()
    o_ref, lse_ref = reference(*split_heads(qkv64, heads), causal, 1.0 / math.sqrt(qkv.shape[-1]), **mask)
    o_ref.backward(do.double().transpose(1, 2))
    compare(o.transpose(1, 2), lse, split_heads(qkv.grad, heads), o_ref, lse_ref, split_heads(qkv64.grad, heads),
            qkv.dtype)


# (batch, seqlen, n_heads, n_kv_heads, head_dim, causal, dtype)
QKVPACKED_CASES = [
    (2, 33, 4, 4, 32, True, torch.bfloat16),
    (1, 40, 4, 2, 64, False, torch.float16),  # GQA
    (1, 17, 8, 1, 16, True, torch.float32),  # MQA
]


@pytest.mark.parametrize("attention", QKVPACKED)
@pytest.mark.parametrize("batch,seqlen,n_heads,n_kv_heads,head_dim,causal,dtype", QKVPACKED_CASES)
def test_qkvpacked_matches_float64_reference(attention, batch, seqlen, n_heads, n_kv_heads, head_dim, causal, dtype):
    qkv = randn(batch, seqlen, n_heads + 2 * n_kv_heads, head_dim, dtype=dtype)
    check_qkvpacked(attention, qkv, n_heads, causal)


@pytest.mark.parametrize("attention", QKVPACKED)
def test_qkvpacked_takes_flash_attn_five_dim_layout(attention):
    """(batch, seqlen, 3, n_heads, head_dim), n_heads from the shape, and the 4-D form with n_heads=None."""
    qkv = randn(2, 24, 3, 2, 32, dtype=torch.float16)
    check_qkvpacked(attention, qkv.flatten(2, 3), None, True)
    qkv.requires_grad_()
    o = attention(qkv, causal=True)
    o.backward(torch.ones_like(o))
    assert o.shape == (2, 24, 2, 32) and qkv.grad.shape == qkv.shape
    torch.testing.assert_close(o, attention(qkv.detach().flatten(2, 3), 2, causal=True), rtol=0, atol=0)


def test_qkvpacked_window():
    check_qkvpacked(fa2_qkvpacked_attention, randn(1, 50, 6, 32, dtype=torch.bfloat16), 2, True, window_size=(8, 0))


@pytest.mark.parametrize("attention", QKVPACKED)
def test_qkvpacked_compiles_in_one_graph(attention):
    qkv = randn(1, 24, 6, 16, dtype=torch.float32).requires_grad_()
    f = lambda qkv: attention(qkv, 2, causal=True).square().sum()
    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(qkv)
    grad, = torch.autograd.grad(loss, qkv)
    loss_ref = f(qkv)
    grad_ref, = torch.autograd.grad(loss_ref, qkv)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-4, atol=1e-4)
    assert rel_err(grad, grad_ref) < 1e-4


@pytest.mark.parametrize("name", ["fa1", "fa2"])
def test_qkvpacked_opcheck(name):
    op = getattr(torch.ops.flashgpt, f"{name}_qkvpacked_forward")
    qkv = randn(1, 20, 6, 16, dtype=torch.float16).requires_grad_()
    torch.library.opcheck(op, (qkv, 2, True, 0.25),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("module", [fa2, fa1, fa3], ids=["fa2", "fa1", "fa3"])
def test_backward_writes_into_out(module):
    """The launchers' out=(dq, dk, dv): views into one NaN-filled packed gradient are returned as they are, every
    element written, equal to the gradients without out; an out that does not fit raises ValueError."""
    qkv = randn(1, 70, 4, 32, dtype=torch.bfloat16)
    q, k, v = split_heads(qkv, 2)
    o, lse = module.forward(q, k, v, True, 0.2)
    do = torch.randn_like(o)
    dqkv = torch.full_like(qkv, float("nan"))
    out = split_heads(dqkv, 2)
    grads = module.backward(do, q, k, v, o, lse, True, 0.2, out=out)
    assert all(g is b for g, b in zip(grads, out)) and torch.isfinite(dqkv).all()
    for got, ref in zip(grads, module.backward(do, q, k, v, o, lse, True, 0.2)):
        assert torch.equal(got, ref)
    with pytest.raises(ValueError, match="out's dk must be"):
        module.backward(do, q, k, v, o, lse, True, 0.2, out=(out[0], out[0], out[2]))


QKVPACKED_BAD = [
    (dict(qkv=[1.0]), TypeError, "qkv must be a torch.Tensor"),
    (dict(qkv=(1, 16, 6)), ValueError, r"qkv must be \(batch, seqlen"),
    (dict(n_heads=True), TypeError, "n_heads must be an int or None"),
    (dict(qkv=(1, 16, 7, 32), n_heads=None), ValueError, "multiple of 3"),
    (dict(n_heads=3), ValueError, r"n_heads \+ 2 \* n_kv_heads"),
    (dict(n_heads=6), ValueError, r"n_heads \+ 2 \* n_kv_heads"),
    (dict(qkv=(1, 16, 7, 32), n_heads=3), ValueError, "must be a multiple of n_kv_heads"),
    (dict(qkv=(1, 16, 3, 2, 32), n_heads=4), ValueError, "with n_heads=4"),
    (dict(qkv=(1, 16, 6, 300)), ValueError, "head_dim=300 is out of range"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(qkv=(1, 16, 0, 32), n_heads=None), ValueError, "multiple of 3"),
    (dict(qkv=(1, 16, 3, 0, 32), n_heads=None), ValueError, r"n_heads >= 1, head_dim\), got shape"),
    (dict(qkv=(1, 0, 6, 32)), ValueError, r"seqlen_q and seqlen_k must be >= 1.* views of qkv \(1, 0, 6, 32\)"),
]


@pytest.mark.parametrize("attention", QKVPACKED)
@pytest.mark.parametrize("overrides,error,message", QKVPACKED_BAD)
def test_qkvpacked_bad_input_is_rejected(attention, overrides, error, message):
    args = dict(qkv=(1, 16, 6, 32), n_heads=2, causal=True) | overrides
    if isinstance(args["qkv"], tuple):
        args["qkv"] = randn(*args["qkv"], dtype=torch.float16)
    with pytest.raises(error, match=message):
        attention(**args)


def test_qkvpacked_window_needs_fa2():
    with pytest.raises(ValueError, match="fa1_attention has no sliding window"):
        fa1_qkvpacked_attention(randn(1, 16, 6, 32, dtype=torch.float16), 2, causal=True, window_size=(4, 0))


# ------------------------------------------------------------------------------------------ bad input
def _qkv(**overrides):
    shapes = dict(q=(1, 4, 16, 32), k=(1, 2, 16, 32), v=(1, 2, 16, 32))
    tensors = {name: randn(*shape, dtype=torch.float16) for name, shape in shapes.items()}
    tensors.update(overrides)
    return tensors


BAD_INPUTS = [
    (dict(q=[[1.0]]), TypeError, "q must be a torch.Tensor"),
    (dict(q=randn(4, 16, 32, dtype=torch.float16)), ValueError, "q must have 4 dims"),
    (dict(k=randn(1, 2, 16, 32, 1, dtype=torch.float16)), ValueError, "k must have 4 dims"),
    (dict(q=randn(1, 4, 16, 32, dtype=torch.float64)), TypeError, "q has dtype torch.float64"),
    (dict(v=randn(1, 2, 16, 32, dtype=torch.bfloat16)), TypeError, "share one dtype"),
    (dict(k=randn(2, 2, 16, 32, dtype=torch.float16), v=randn(2, 2, 16, 32, dtype=torch.float16)), ValueError, "batch size differs"),
    (dict(k=randn(1, 2, 16, 64, dtype=torch.float16), v=randn(1, 2, 16, 64, dtype=torch.float16)), ValueError, "head_dim differs"),
    (dict(v=randn(1, 2, 17, 32, dtype=torch.float16)), ValueError, "k and v must have the same shape"),
    (dict(k=randn(1, 3, 16, 32, dtype=torch.float16), v=randn(1, 3, 16, 32, dtype=torch.float16)), ValueError, "multiple of n_kv_heads=3"),
    (dict(q=randn(1, 4, 16, 8, dtype=torch.float16), k=randn(1, 2, 16, 8, dtype=torch.float16), v=randn(1, 2, 16, 8, dtype=torch.float16)), ValueError, "head_dim=8 is out of range"),
    (dict(q=randn(1, 4, 16, 288, dtype=torch.float16), k=randn(1, 2, 16, 288, dtype=torch.float16), v=randn(1, 2, 16, 288, dtype=torch.float16)), ValueError, "head_dim=288 is out of range"),
    (dict(q=randn(1, 4, 0, 32, dtype=torch.float16)), ValueError, "must be >= 1"),
]


@pytest.mark.parametrize("attention", KERNELS)
@pytest.mark.parametrize("overrides,error,message", BAD_INPUTS)
def test_bad_input_is_rejected(attention, overrides, error, message):
    with pytest.raises(error, match=message):
        attention(**_qkv(**overrides))


@pytest.mark.parametrize("attention", KERNELS)
def test_bad_arguments_are_rejected(attention):
    with pytest.raises(TypeError, match="causal must be a bool"):
        attention(**_qkv(), causal="yes")
    with pytest.raises(ValueError, match="softmax_scale must be a finite number"):
        attention(**_qkv(), softmax_scale=float("nan"))
    # 10**400: an int no float holds, shown by its start and length
    for scale, shown in ((-0.5, "-0.5"), (float("inf"), "inf"), (1.01e38, "1.01e+38"),
                         (10**400, "100000000000... (401 characters)")):
        with pytest.raises(ValueError, match=rf"softmax_scale must be a finite number >= 0 and <= 1e\+38, or None; "
                                             rf"got {re.escape(shown)}$"):
            attention(**_qkv(), softmax_scale=scale)
    for scale in ("0.1", torch.tensor(0.1), True):
        with pytest.raises(TypeError, match="softmax_scale must be a number"):
            attention(**_qkv(), softmax_scale=scale)
    with pytest.raises(TypeError, match="return_lse must be a bool, got str"):
        attention(**_qkv(), return_lse="no")
    with pytest.raises(TypeError, match=r"causal must be a bool, got torch\.Tensor"):  # not "got Tensor"
        attention(**_qkv(), causal=torch.tensor(True))


@pytest.mark.parametrize("attention", KERNELS)
def test_double_backward_raises(attention):
    """The gradients are first-order: taken with create_graph=True they are right, and differentiating them again
    raises instead of silently leaving attention's second-order terms out."""
    q, k, v = (randn(1, 2, 16, 32, dtype=torch.float32).requires_grad_() for _ in range(3))
    o = attention(q, k, v, causal=True)
    g, = torch.autograd.grad((o ** 2).sum(), q, create_graph=True)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o64, _ = reference(q64, k64, v64, True, 1 / math.sqrt(32))
    g64, = torch.autograd.grad((o64 ** 2).sum(), q64)
    assert rel_err(g, g64) < TOLERANCE[torch.float32]
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (g ** 2).sum().backward()


@pytest.mark.parametrize("attention", KERNELS)
def test_cpu_tensors_without_interpreter_are_rejected(attention, monkeypatch):
    monkeypatch.setattr("kernels.frontend.INTERPRET", False)
    q, k, v = (torch.randn(1, 2, 16, 32, dtype=torch.float16) for _ in range(3))
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        attention(q, k, v)


@pytest.mark.gpu  # a CUDA tensor next to CPU ones
@pytest.mark.parametrize("attention", KERNELS)
def test_mixed_devices_are_rejected(attention):
    q = torch.randn(1, 2, 16, 32, dtype=torch.float16, device="cuda")
    k, v = (torch.randn(1, 2, 16, 32, dtype=torch.float16) for _ in range(2))
    with pytest.raises(ValueError, match="one device"):
        attention(q, k, v)


# ------------------------------------------------------------------------------------------ GPU, real sizes
GPU_CASES = [
    # (batch, n_heads, n_kv_heads, seqlen, head_dim, causal, dtype)
    (4, 16, 16, 1024, 64, True, torch.bfloat16),
    (2, 16, 16, 2048, 128, False, torch.float16),
    (1, 8, 2, 4096, 128, True, torch.bfloat16),
    (1, 4, 4, 8192, 64, True, torch.float16),
    (1, 2, 2, 16384, 64, True, torch.bfloat16),
    (1, 2, 2, 16384, 128, False, torch.bfloat16),
    (2, 4, 4, 1000, 80, True, torch.bfloat16),
    (2, 4, 4, 3001, 96, False, torch.float16),
]


def _reference_fp32(q, k, v, causal):
    """float32 reference on the GPU through SDPA's math backend (upcast inputs), for the large shapes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("attention", KERNELS)
@pytest.mark.parametrize("batch,n_heads,n_kv_heads,seqlen,head_dim,causal,dtype", GPU_CASES)
def test_gpu_real_sizes(attention, batch, n_heads, n_kv_heads, seqlen, head_dim, causal, dtype):
    if seqlen * seqlen * n_heads * batch > 2**30:  # keep the fp32 reference's score matrix in memory
        n_heads, n_kv_heads = 1, 1
    q = randn(batch, n_heads, seqlen, head_dim, dtype=dtype).requires_grad_()
    k = randn(batch, n_kv_heads, seqlen, head_dim, dtype=dtype).requires_grad_()
    v = randn(batch, n_kv_heads, seqlen, head_dim, dtype=dtype).requires_grad_()
    o = attention(q, k, v, causal=causal)
    do = torch.randn_like(o)
    o.backward(do)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    o_ref = _reference_fp32(q32, k32, v32, causal)
    o_ref.backward(do.float())
    tol = TOLERANCE[dtype]
    assert rel_err(o, o_ref) < tol
    for grad, grad_ref in ((q.grad, q32.grad), (k.grad, k32.grad), (v.grad, v32.grad)):
        assert rel_err(grad, grad_ref) < tol
