"""model.loss: the chunked head + cross-entropy against a float64 reference, and in the model."""

import pytest
import torch

import model.loss as loss_module
from model.gpt import GPT, GPTConfig
from model.loss import IGNORE_INDEX, head_loss


def reference(x, weight, targets):
    """float64: mean over counted targets of logsumexp(logits) - logits[target]."""
    logits = x.double() @ weight.double().t()
    counted = targets != IGNORE_INDEX
    rows = logits[counted]
    return (torch.logsumexp(rows, -1) - rows.gather(1, targets[counted].unsqueeze(1)).squeeze(1)).mean()


@pytest.mark.parametrize("n, chunk", [(300, 64), (64, 64), (5, 64)])  # several chunks, exactly one, a short one
def test_chunked_matches_float64_loss_and_gradients(monkeypatch, n, chunk):
    monkeypatch.setattr(loss_module, "CHUNK_TOKENS", chunk)
    x = torch.randn(n, 24, requires_grad=True)
    weight = torch.randn(97, 24, requires_grad=True)
    targets = torch.randint(0, 97, (n,))
    targets[torch.rand(n) < 0.3] = IGNORE_INDEX
    targets[0] = 3  # at least one counted target
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = reference(x64, w64, targets)
    (ref * 2.5).backward()  # a scale, as grad accumulation and the fp16 grad scaler give
    out = head_loss(x, weight, targets, "chunked")
    (out * 2.5).backward()
    assert out.dtype == torch.float32 and x.grad.dtype == x.dtype and weight.grad.dtype == weight.dtype
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-4, atol=1e-6)


def test_chunked_without_gradients_and_all_ignored():
    x, weight = torch.randn(10, 8), torch.randn(16, 8)
    targets = torch.randint(0, 16, (10,))
    with torch.no_grad():
        torch.testing.assert_close(head_loss(x, weight, targets, "chunked").double(), reference(x, weight, targets))
    ignored = torch.full((10,), IGNORE_INDEX)
    assert torch.isnan(head_loss(x, weight, ignored, "chunked"))  # as F.cross_entropy: 0 / 0
    assert torch.isnan(head_loss(x, weight, ignored, "full"))


def test_unknown_loss_is_refused():
    with pytest.raises(ValueError, match="loss='fused'; accepted: full, chunked"):
        head_loss(torch.randn(2, 4), torch.randn(3, 4), torch.zeros(2, dtype=torch.long), "fused")
    with pytest.raises(ValueError, match="loss='fused': accepted: full, chunked"):
        GPT(GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=16, loss="fused"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_loss_chunked_equals_full(monkeypatch, dtype):
    """The same model, weights and batch: model.loss=chunked gives full's loss and gradients (bf16 autocast too)."""
    monkeypatch.setattr(loss_module, "CHUNK_TOKENS", 16)
    idx, targets = torch.randint(0, 64, (3, 12)), torch.randint(0, 64, (3, 12))
    results = []
    for loss in ("full", "chunked"):
        torch.manual_seed(0)
        m = GPT(GPTConfig(block_size=12, vocab_size=64, n_layer=2, n_head=2, n_embd=32, loss=loss))
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            logits, value = m(idx, targets, return_logits=False)
        value.backward()
        assert logits is None
        results.append((value, [p.grad for p in m.parameters()]))
    (a, grads_a), (b, grads_b) = results
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(b, a, **tol)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(gb, ga, **tol)
