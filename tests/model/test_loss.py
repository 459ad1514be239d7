"""model.loss: the chunked and fused head + cross-entropy against a float64 reference, and in the model; the
cross-entropy kernel (kernels/cross_entropy.py) under the Triton interpreter."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels.cross_entropy as ce_module
import model.loss as loss_module
from kernels.cross_entropy import cross_entropy_rows
from model.gpt import GPT, GPTConfig
from model.loss import IGNORE_INDEX, head_loss, resolve_loss

ROOT = Path(__file__).resolve().parents[2]


def reference(x, weight, targets):
    """float64: mean over counted targets of logsumexp(logits) - logits[target]."""
    logits = x.double() @ weight.double().t()
    counted = targets != IGNORE_INDEX
    rows = logits[counted]
    return (torch.logsumexp(rows, -1) - rows.gather(1, targets[counted].unsqueeze(1)).squeeze(1)).mean()


@pytest.mark.parametrize("loss, n, chunk", [("chunked", 300, 64), ("chunked", 64, 64), ("chunked", 5, 64),
                                            ("fused", 300, 0), ("fused", 5, 0)])  # chunks: several, one, a short one
def test_matches_float64_loss_and_gradients(monkeypatch, loss, n, chunk):
    monkeypatch.setattr(loss_module, "CHUNK_TOKENS", chunk)
    monkeypatch.setattr(ce_module, "CONFIG", ce_module.Config(32, 4))  # a row of 97 in four blocks, the last partial
    monkeypatch.setattr(ce_module, "INTERPRET_ON_CPU", True)
    x = torch.randn(n, 24, requires_grad=True)
    weight = torch.randn(97, 24, requires_grad=True)
    targets = torch.randint(0, 97, (n,))
    targets[torch.rand(n) < 0.3] = IGNORE_INDEX
    targets[0] = 3  # at least one counted target
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = reference(x64, w64, targets)
    (ref * 2.5).backward()  # a scale, as grad accumulation and the fp16 grad scaler give
    out = head_loss(x, weight, targets, loss)
    (out * 2.5).backward()
    assert out.dtype == torch.float32 and x.grad.dtype == x.dtype and weight.grad.dtype == weight.dtype
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss", ["chunked", "fused"])
def test_without_gradients_and_all_ignored(loss):
    x, weight = torch.randn(10, 8), torch.randn(16, 8)
    targets = torch.randint(0, 16, (10,))
    with torch.no_grad():
        torch.testing.assert_close(head_loss(x, weight, targets, loss).double(), reference(x, weight, targets))
    ignored = torch.full((10,), IGNORE_INDEX)
    assert torch.isnan(head_loss(x, weight, ignored, loss))  # as F.cross_entropy: 0 / 0
    assert torch.isnan(head_loss(x, weight, ignored, "full"))


@pytest.mark.parametrize("impl", ["triton", "torch"])  # the kernel (interpreted here), the CPU path without it
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab, block", [(97, 32), (50, 64), (1, 16)])  # several blocks; one, padded; one column
def test_kernel_rows_and_gradient_in_place(monkeypatch, impl, dtype, vocab, block):
    """Each row's loss and its gradient written over the logits, against float64; ignored rows give 0 and 0."""
    monkeypatch.setattr(ce_module, "INTERPRET_ON_CPU", impl == "triton")
    n = 7
    logits = (torch.randn(n, vocab, dtype=torch.float64) * 6).to(dtype)  # large logits: the max matters
    targets = torch.randint(0, vocab, (n,))
    targets[2] = IGNORE_INDEX
    x = logits.double()
    ref_loss = torch.logsumexp(x, -1) - x.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    ref_grad = torch.softmax(x, -1) - torch.nn.functional.one_hot(targets.clamp(min=0), vocab)
    ref_loss[2], ref_grad[2] = 0.0, 0.0
    buffer = logits.clone()
    config = ce_module.Config(block, 4)
    losses = cross_entropy_rows(buffer, targets, IGNORE_INDEX, grad=True, config=config)
    assert losses.dtype == torch.float32 and buffer.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(losses.double(), ref_loss, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(buffer.double(), ref_grad, **tol)
    untouched = logits.clone()
    torch.testing.assert_close(cross_entropy_rows(untouched, targets, IGNORE_INDEX, grad=False, config=config), losses)
    assert torch.equal(untouched, logits)  # without grad the logits are only read


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_kernel_bad_inputs(monkeypatch, impl):
    """A target out of range (not ignore_index) gives that row nan, which the trainer stops on; bad shapes are
    refused."""
    monkeypatch.setattr(ce_module, "INTERPRET_ON_CPU", impl == "triton")
    logits, targets = torch.randn(3, 10), torch.tensor([1, 10, -5])
    losses = cross_entropy_rows(logits.clone(), targets, IGNORE_INDEX)
    assert torch.isfinite(losses[0]) and torch.isnan(losses[1:]).all()
    with pytest.raises(ValueError, match=r"logits must be \(N, V\)"):
        cross_entropy_rows(torch.randn(2, 3, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="targets"):
        cross_entropy_rows(torch.randn(4, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="contiguous"):
        cross_entropy_rows(torch.randn(3, 4).t(), torch.zeros(4, dtype=torch.long))


def test_fused_float16_weight_gradient_does_not_overflow():
    """In float16 the unscaled dW of a target that 4,096 rows share, each x = 20, is about -82,000: past float16's
    65,504. fused keeps it in float32 until the backward's scale (1 / 4,096) brings it to -20."""
    x = torch.full((4096, 8), 20.0, dtype=torch.float16, requires_grad=True)
    weight = torch.zeros(16, 8, dtype=torch.float16, requires_grad=True)
    head_loss(x, weight, torch.zeros(4096, dtype=torch.long), "fused").backward()
    assert torch.isfinite(weight.grad).all()
    torch.testing.assert_close(weight.grad[0].float(), torch.full((8,), -20.0 * 15 / 16))


def test_kernel_compiles_for_sm90():
    """The kernel as the GPU compiler sees it (the interpreter accepts more), in a fresh process without
    TRITON_INTERPRET, for each dtype and with and without the gradient pass."""
    code = ("import torch; from kernels import cross_entropy as ce\n"
            "for t in (torch.bfloat16, torch.float16, torch.float32):\n"
            "    for g in (True, False):\n"
            "        k = ce.compile_for_sm90(t, g); print(t, g, 'ld.global' in k.asm['ptx'], ('st.global' in k.asm['ptx']))")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    assert len(lines) == 6 and all(line[2:] == ["True", "True"] for line in lines), lines


def test_unknown_loss_is_refused():
    with pytest.raises(ValueError, match="loss='liger'; accepted: full, chunked, fused"):
        head_loss(torch.randn(2, 4), torch.randn(3, 4), torch.zeros(2, dtype=torch.long), "liger")
    with pytest.raises(ValueError, match="loss='liger': accepted: auto, full, chunked, fused"):
        GPT(GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=16, loss="liger"))
    with pytest.raises(ValueError, match="loss='liger'; accepted: auto, full, chunked, fused"):
        resolve_loss("liger", "cuda")


def test_auto_loss_is_fused_on_cuda_and_full_elsewhere():
    assert GPTConfig().loss == "auto"
    assert resolve_loss("auto", "cuda") == "fused"
    assert resolve_loss("auto", "cpu") == resolve_loss("auto", "mps") == "full"
    assert [resolve_loss(loss, "cuda") for loss in ("full", "chunked", "fused")] == ["full", "chunked", "fused"]


@pytest.mark.parametrize("loss", ["chunked", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_model_loss_equals_full(monkeypatch, dtype, loss):
    """The same model, weights and batch: model.loss=chunked / fused give full's loss and gradients (bf16 autocast
    too)."""
    monkeypatch.setattr(loss_module, "CHUNK_TOKENS", 16)
    idx, targets = torch.randint(0, 64, (3, 12)), torch.randint(0, 64, (3, 12))
    results = []
    for name in ("full", loss):
        torch.manual_seed(0)
        m = GPT(GPTConfig(block_size=12, vocab_size=64, n_layer=2, n_head=2, n_embd=32, loss=name))
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


def test_fused_under_torch_compile():
    """torch.compile(fullgraph=True) keeps the fused loss's op in the graph, with eager's loss and gradients."""
    idx, targets = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        m = GPT(GPTConfig(block_size=8, vocab_size=64, n_layer=1, n_head=2, n_embd=32, loss="fused"))
        run = torch.compile(m, backend="aot_eager", fullgraph=True) if compiled else m
        _, value = run(idx, targets, return_logits=False)
        (value * 3.0).backward()
        results.append((value, [p.grad for p in m.parameters()]))
    (a, grads_a), (b, grads_b) = results
    torch.testing.assert_close(b, a)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(gb, ga)


@pytest.mark.gpu
def test_kernel_on_gpu_at_gpt2_vocab():
    """The compiled kernel at GPT-2's padded vocabulary in bf16, against float64; the buffer's rows poisoned with
    nan past what the kernel must write are left alone."""
    n, vocab = 64, 50304
    storage = torch.full((n, vocab + 8), float("nan"), dtype=torch.bfloat16, device="cuda")
    logits = storage[:, :vocab]
    logits.copy_(torch.randn(n, vocab, device="cuda") * 4)
    targets = torch.randint(0, vocab, (n,), device="cuda")
    targets[5] = IGNORE_INDEX
    x = logits.double()
    ref_loss = torch.logsumexp(x, -1) - x.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    ref_grad = torch.softmax(x, -1) - torch.nn.functional.one_hot(targets.clamp(min=0), vocab)
    ref_loss[5], ref_grad[5] = 0.0, 0.0
    losses = cross_entropy_rows(logits, targets, IGNORE_INDEX, grad=True)
    torch.testing.assert_close(losses.double(), ref_loss, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(logits.double(), ref_grad, rtol=2e-2, atol=1e-4)
    assert torch.isnan(storage[:, vocab:]).all()


@pytest.mark.gpu
def test_fused_equals_full_compiled_on_gpu():
    """model.loss=fused against full, both compiled by inductor on the GPU under bf16 autocast."""
    idx = torch.randint(0, 50304, (4, 256), device="cuda")
    targets = torch.randint(0, 50304, (4, 256), device="cuda")
    results = []
    for name in ("full", "fused"):
        torch.manual_seed(0)
        m = GPT(GPTConfig(block_size=256, vocab_size=50304, n_layer=2, n_head=4, n_embd=256, loss=name)).cuda()
        run = torch.compile(m, fullgraph=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, value = run(idx, targets, return_logits=False)
        value.backward()
        results.append((value, [p.grad for p in m.parameters()]))
    (a, grads_a), (b, grads_b) = results
    torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-3)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(gb, ga, rtol=3e-2, atol=1e-4)
