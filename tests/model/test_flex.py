"""attn=flex (model/backends/flex.py and flex_masks.py): FlexAttention with block masks against a float64
reference with an explicit dense mask (causal, sliding window, documents, GQA, fewer queries than keys), forward and
gradients; the block-mask caches; what the registry and config validation say about it. Fresh random inputs every
run.

On the CPU Flex runs PyTorch's eager implementation (its autograd through the eager operator, see
model/backends/flex_masks.py); the `gpu` test runs the compiled kernels.
"""

import math
import random
import warnings

import pytest
import torch

from model.backends import REGISTRY, BackendUnavailableError
from model.backends import flex_masks as flex
from model.gpt import GPT, GPTConfig


@pytest.fixture(scope="module")
def attention():
    with warnings.catch_warnings():  # the CPU warning
        warnings.simplefilter("ignore")
        return REGISTRY["flex"].load().attention


def reference(q, k, v, window=0, docs=None):
    """float64 attention over a dense mask written from the definitions: key j visible to query i iff
    j <= i + T_k - T_q, i + T_k - T_q - j < window (window > 0), and i, j in one document of docs (cu_seqlens of
    the flattened batch; T_q = T_k)."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    B, Tq, Tk = q.shape[0], q.shape[2], k.shape[2]
    i = torch.arange(Tq, device=q.device)[:, None] + Tk - Tq
    j = torch.arange(Tk, device=q.device)[None, :]
    visible = (j <= i) & ((i - j < window) if window else True)
    visible = visible.expand(B, Tq, Tk)
    if docs is not None:
        lengths = (docs[1:] - docs[:-1]).long().cpu()
        doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(q.device).view(B, Tq)
        visible = visible & (doc[:, :, None] == doc[:, None, :])
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~visible[:, None], float("-inf"))
    return s.softmax(-1) @ v


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def random_docs(batch, seqlen, n_cuts):
    """cu_seqlens of the flattened batch: every context boundary plus n_cuts random cuts inside contexts."""
    inside = random.sample([c for c in range(1, batch * seqlen) if c % seqlen], n_cuts)
    return torch.tensor(sorted({0, *range(seqlen, batch * seqlen + 1, seqlen), *inside}), dtype=torch.int32)


# (batch, n_heads, n_kv_heads, seqlen_q, seqlen_k, head_dim, window, docs: None or number of random cuts)
CASES = [
    (2, 4, 4, 37, 37, 16, 0, None),      # causal
    (1, 8, 2, 50, 50, 32, 0, None),      # GQA
    (2, 4, 1, 45, 45, 16, 7, None),      # sliding window, MQA
    (1, 2, 2, 20, 20, 16, 1, None),      # a window of one: each token sees itself only
    (1, 2, 2, 20, 20, 16, 100, None),    # a window wider than the context limits nothing
    (3, 4, 2, 37, 37, 16, 0, 5),         # documents
    (3, 4, 2, 37, 37, 16, 4, 5),         # documents and a window
    (1, 2, 1, 300, 300, 16, 50, 6),      # several 128-token blocks: full, partial and empty blocks
    (2, 4, 2, 3, 9, 16, 0, None),        # fewer queries than keys (KV cache): causal aligned bottom-right
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch,n_heads,n_kv_heads,seqlen_q,seqlen_k,head_dim,window,n_cuts", CASES)
def test_matches_float64_reference(attention, dtype, batch, n_heads, n_kv_heads, seqlen_q, seqlen_k, head_dim,
                                   window, n_cuts):
    docs = None if n_cuts is None else random_docs(batch, seqlen_q, n_cuts)
    q = torch.randn(batch, n_heads, seqlen_q, head_dim, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(batch, n_kv_heads, seqlen_k, head_dim, dtype=dtype, requires_grad=True) for _ in range(2))
    o = attention(q, k, v, window=window, docs=docs)
    do = torch.randn_like(o)
    o.backward(do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o_ref = reference(q64, k64, v64, window, docs)
    o_ref.backward(do.double())
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert o.shape == q.shape and o.dtype == dtype and rel_err(o, o_ref) < tol
    for name, grad, grad_ref in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), (q64.grad, k64.grad, v64.grad)):
        if grad_ref.abs().max() == 0:  # window 1: softmax over one key is constant; rounding only, relative to dv
            assert grad.double().norm() / v64.grad.norm() < tol, name
        else:
            assert rel_err(grad, grad_ref) < tol, name
    with torch.no_grad():  # inference: PyTorch's own flex_attention entry point
        assert rel_err(attention(*(t.detach() for t in (q, k, v)), window=window, docs=docs), o_ref) < tol


def test_no_causal_mask_and_a_decode_step_need_no_block_mask():
    q, k = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 9, 16)
    assert flex.block_mask(q, k, causal=True, window=0, docs=None) is None  # one query sees every cached key
    assert flex.block_mask(k, k, causal=False, window=0, docs=None) is None
    assert flex.block_mask(k, k, causal=True, window=0, docs=None) is not None


def test_block_masks_are_built_once_per_batch(monkeypatch):
    """A forward builds the document masks of its docs once per window (not once per layer); the next batch's
    docs get new ones; causal / window masks are cached across calls."""
    built = []
    original = flex.document_block_mask
    monkeypatch.setattr(flex, "document_block_mask", lambda *a: built.append(a[1:]) or original(*a))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPT(GPTConfig(block_size=16, vocab_size=20, n_layer=4, n_head=2, n_embd=32, attn="flex",
                              attn_window=[5, 0, 5, 0]))
    idx = torch.randint(0, 20, (2, 16))
    for cuts in ([0, 3, 16, 20, 32], [0, 16, 32]):
        model(idx, idx, docs=torch.tensor(cuts, dtype=torch.int32))
    assert built == [(2, 16, 5), (2, 16, 0)] * 2
    flex._static_block_mask.cache_clear()
    model(idx, idx)
    model(idx, idx)
    assert flex._static_block_mask.cache_info().misses == 2  # windows 5 and 0, built once


def test_registry_entry_and_refusals(attention):
    from trainer.config import ConfigError, compose_config, validate_config

    entry = REGISTRY["flex"]
    assert entry.supports_window and entry.supports_docs and not entry.supports_dropout and not entry.needs_cuda
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="attn=flex has no attention dropout"):
        attention(q, q, q, dropout_p=0.1)
    cpu = ["attn=flex", "trainer.device=cpu"]
    validate_config(compose_config([*cpu, "model.attn_window=8", "data.document_mask=true"]))
    with pytest.raises(ConfigError, match="model.dropout=0.1: attn=flex has no attention dropout"):
        validate_config(compose_config([*cpu, "model.dropout=0.1"]))
    with pytest.raises(ConfigError, match="trainer.compile=true: attn=flex cannot train under torch.compile"):
        validate_config(compose_config([*cpu, "trainer.compile=true"]))


def test_cpu_training_without_the_eager_operator_is_a_clear_error(attention, monkeypatch):
    """The CPU backward goes through a private PyTorch operator: where it is missing, one error that says so."""
    import sys

    monkeypatch.delattr(sys.modules["torch._higher_order_ops.flex_attention"], "flex_attention")
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    with pytest.raises(BackendUnavailableError, match="attn=flex cannot train on the CPU with torch .*use attn=sdpa"):
        attention(q, q, q)


@pytest.mark.gpu
@pytest.mark.parametrize("window,n_cuts", [(0, None), (200, None), (0, 12), (200, 12)])
def test_compiled_flex_on_the_gpu(attention, window, n_cuts):
    """The compiled kernels (bf16, GQA, several blocks) against a float32 reference, forward and gradients."""
    batch, seqlen = 2, 1000
    docs = None if n_cuts is None else random_docs(batch, seqlen, n_cuts).cuda()
    q = torch.randn(batch, 8, seqlen, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, 2, seqlen, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    o = attention(q, k, v, window=window, docs=docs)
    do = torch.randn_like(o)
    o.backward(do)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    o_ref = reference(q32, k32, v32, window, docs)
    o_ref.backward(do.double())
    assert rel_err(o, o_ref) < 1e-2
    for grad, grad_ref in zip((q.grad, k.grad, v.grad), (q32.grad, k32.grad, v32.grad)):
        assert rel_err(grad, grad_ref.double()) < 2e-2
