"""GPT shapes, GQA, initialisation, FLOP count and the attention backends (model.backends)."""

import copy
import math
import warnings
from pathlib import Path

import pytest
import torch

from model.backends import REGISTRY, BackendUnavailableError, resolve_backend
from model.backends.triton import TritonBackend
from model.gpt import GPT, GPTConfig


ROOT = Path(__file__).resolve().parents[2]


def reference_attention(q, k, v):
    """Causal softmax attention written out, GQA by repeating k/v heads (float64)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    T = q.shape[2]
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return (s.softmax(-1) @ v.double()).to(q.dtype)


@pytest.mark.parametrize("n_head,n_kv_head", [(4, 4), (4, 2), (6, 1)])
def test_sdpa_backend_matches_reference(n_head, n_kv_head):
    B, T, hs = 2, 17, 8
    q = torch.randn(B, n_head, T, hs)
    k, v = torch.randn(B, n_kv_head, T, hs), torch.randn(B, n_kv_head, T, hs)
    o = REGISTRY["sdpa"].attention(q, k, v)
    assert o.shape == q.shape and o.dtype == q.dtype
    torch.testing.assert_close(o, reference_attention(q, k, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_kv_head", [None, 2, 1])
def test_gpt_shapes_and_loss(n_kv_head):
    cfg = GPTConfig(block_size=16, vocab_size=50, n_layer=2, n_head=4, n_kv_head=n_kv_head, n_embd=32)
    model = GPT(cfg)
    kv = n_kv_head or 4
    assert model.transformer.h[0].attn.c_attn.out_features == (4 + 2 * kv) * 8
    idx = torch.randint(0, 50, (3, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 16, 50) and loss.shape == () and loss.dtype == torch.float32
    assert abs(loss.item() - math.log(50)) < 0.5  # small init: near-uniform predictions
    logits, loss = model(idx[:, :5])
    assert logits.shape == (3, 1, 50) and loss is None
    loss_full = model(idx, idx)[1]
    loss_full.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("attn", ["fa2", "fa1"])
def test_fused_qkv_goes_to_the_packed_kernel_and_matches_sdpa(attn, monkeypatch):
    """With a kernel backend the training forward hands the fused projection's output to the backend's qkvpacked
    function (once per layer), and the loss and every parameter's gradient match attn=sdpa's with the same weights
    (GQA; SDPA takes separate q, k, v and has no packed function)."""
    cfg = dict(block_size=24, vocab_size=40, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
    sdpa = GPT(GPTConfig(**cfg))
    with warnings.catch_warnings():  # the interpreter warning
        warnings.simplefilter("ignore")
        model = GPT(GPTConfig(**cfg, attn=attn))
    model.load_state_dict(sdpa.state_dict())
    assert not REGISTRY["sdpa"].qkvpacked and all(block.attn.backend is REGISTRY[attn] for block in model.transformer.h)
    calls = []
    packed = TritonBackend.qkvpacked_attention
    monkeypatch.setattr(TritonBackend, "qkvpacked_attention",
                        lambda self, *args, **kwargs: calls.append(args[0].shape) or packed(self, *args, **kwargs))
    idx = torch.randint(0, 40, (2, 24))
    loss, loss_ref = model(idx, idx)[1], sdpa(idx, idx)[1]
    loss.backward()
    loss_ref.backward()
    assert calls == [(2, 24, 8, 16)] * 2
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-5)
    for (name, p), p_ref in zip(model.named_parameters(), sdpa.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_gpt_is_causal():
    model = GPT(GPTConfig(block_size=16, vocab_size=30, n_layer=2, n_head=2, n_embd=16)).eval()
    idx = torch.randint(0, 30, (1, 16))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 30
    a, _ = model(idx, idx)
    b, _ = model(changed, changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_tied_head_scaled_init_and_counts():
    cfg = GPTConfig(block_size=64, vocab_size=128, n_layer=4, n_head=4, n_embd=256, bias=True)
    model = GPT(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    c_proj = torch.cat([b.attn.c_proj.weight.flatten() for b in model.transformer.h])
    assert abs(c_proj.std().item() - 0.02 / math.sqrt(2 * 4)) < 0.001
    assert abs(model.transformer.h[0].mlp.c_fc.weight.std().item() - 0.02) < 0.001
    per_block = (2 * 2 * 256                                  # two LayerNorms (weight + bias)
                 + 256 * 3 * 256 + 3 * 256 + 256 * 256 + 256  # attention
                 + 256 * 1024 + 1024 + 1024 * 256 + 256)      # MLP
    total = 128 * 256 + 64 * 256 + 4 * per_block + 2 * 256
    assert model.num_params(non_embedding=False) == total
    assert model.num_params() == total - 64 * 256
    assert model.estimate_flops_per_token() == 6 * (total - 64 * 256) + 12 * 4 * 4 * 64 * 64


def test_gpt_rejects_bad_shapes():
    with pytest.raises(ValueError, match="n_embd=30 must be a multiple of n_head=4"):
        GPT(GPTConfig(block_size=8, vocab_size=10, n_layer=1, n_head=4, n_embd=30))
    with pytest.raises(ValueError, match="n_kv_head=3"):
        GPT(GPTConfig(block_size=8, vocab_size=10, n_layer=1, n_head=4, n_kv_head=3, n_embd=32))
    for bad, message in ((dict(n_kv_head=0), "n_kv_head=0 must be an int >= 1"),
                         (dict(n_head=0), "n_head=0 must be an int >= 1"),
                         (dict(n_kv_head=-2), "n_kv_head=-2 must be"), (dict(n_kv_head=2.0), "n_kv_head=2.0 must be")):
        with pytest.raises(ValueError, match=message):
            GPT(GPTConfig(**dict(block_size=8, vocab_size=10, n_layer=1, n_head=4, n_embd=32) | bad))
    model = GPT(GPTConfig(block_size=8, vocab_size=10, n_layer=1, n_head=2, n_embd=16))
    with pytest.raises(ValueError, match="exceeds block_size=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_generate():
    model = GPT(GPTConfig(block_size=8, vocab_size=20, n_layer=1, n_head=2, n_embd=16)).eval()
    idx = torch.randint(0, 20, (2, 3))
    out = model.generate(idx, 12, top_k=1)  # longer than block_size: the context is cropped
    assert out.shape == (2, 15) and torch.equal(out[:, :3], idx)
    greedy = idx
    for _ in range(12):
        greedy = torch.cat([greedy, model(greedy[:, -8:])[0][:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, greedy)
    limited = model.generate(idx, 30, temperature=2.0, num_tokens=5)
    assert limited[:, 3:].max() < 5
    with pytest.raises(ValueError, match="temperature"):
        model.generate(idx, 1, temperature=0.0)


def test_generate_top_k_zero_is_every_token_and_bad_options_are_named():
    """top_k=0 keeps every token (as sample.py's --top-k 0), the same draws as top_k=None; a negative or non-int
    top_k and a non-finite temperature are refused before any step, naming the option."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=64, n_layer=2, n_head=2, n_embd=32)).eval()
    idx = torch.randint(0, 64, (2, 3))
    draws = [model.generate(idx, 5, top_k=k, generator=torch.Generator().manual_seed(7)) for k in (0, None)]
    assert torch.equal(draws[0], draws[1]) and draws[0].shape == (2, 8)
    for kwargs, message in (({"top_k": -1}, "top_k must be None or an int >= 0.*got -1"),
                            ({"top_k": 2.5}, "top_k must be None or an int >= 0.*got 2.5"),
                            ({"top_k": True}, "top_k must be None or an int >= 0.*got True"),
                            ({"temperature": float("nan")}, "temperature must be a finite number > 0, got nan"),
                            ({"temperature": float("inf")}, "temperature must be a finite number > 0, got inf"),
                            ({"temperature": -1.0}, "temperature must be a finite number > 0, got -1.0")):
        with pytest.raises(ValueError, match=message):
            model.generate(idx, 2, **kwargs)


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-3])
def test_a_tiny_temperature_samples_the_most_likely_token(temperature):
    """Any temperature > 0 gives valid probabilities: a tiny one (float32 overflows 1 / 1e-40) is greedy."""
    from model.generate import sample_next

    logits = torch.randn(3, 2, 50) * 5
    logits[1, -1, 7] = 1e4  # one far ahead
    ids = sample_next(logits, temperature, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ids, logits[:, -1].argmax(-1, keepdim=True))


def test_resolve_backend(monkeypatch):
    from kernels import fa3

    def resolved(*args, **kwargs):
        return resolve_backend(*args, **kwargs).name

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_backend("auto") is REGISTRY["sdpa"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # A CUDA GPU where the Gluon kernels do not run (this machine: no GPU, or another Triton): fa2.
    assert fa3.gluon_device_reason(torch.device("cpu")) is not None
    monkeypatch.setattr(fa3, "gluon_device_reason", lambda device: "GPU compute capability 8.0 is not 9.0 (Hopper)")
    assert resolved("auto") == resolved("auto", 64) == "fa2"
    # Where they do (a Hopper GPU, a supported Triton): fa3 at the head dims it takes, document masks included.
    monkeypatch.setattr(fa3, "gluon_device_reason", lambda device: None)
    assert resolved("auto") == resolved("auto", 64) == resolved("auto", 96) == resolved("auto", 128) == "fa3"
    assert resolved("auto", 64, docs=True) == resolved("auto", 128, docs=True) == "fa3"
    # 256: the Gluon forward only, so cuDNN through sdpa (fa3 for soft-capping, fa2 for documents); 80: neither
    assert resolved("auto", 256) == "sdpa" and resolved("auto", 256, softcap=True) == "fa3"
    assert resolved("auto", 256, docs=True) == resolved("auto", 80) == "fa2"
    assert resolved("fa1") == "fa1" and resolved("sdpa") == "sdpa"
    with pytest.raises(ValueError, match="attn=.flash.*auto, sdpa, sdpa_flash, sdpa_cudnn, fa1, fa2"):
        resolve_backend("flash")


def test_the_backend_is_resolved_once_per_model_and_shared_by_its_layers(monkeypatch):
    """GPT resolves config.attn once (auto: with the model's head_dim) and hands that one object to every layer; a
    model with a window on a Hopper GPU gets fa3 (its Gluon kernels take windows), as config validation resolves
    it."""
    import model.gpt
    from kernels import fa3

    calls = []
    monkeypatch.setattr(model.gpt, "resolve_backend",
                        lambda *args, **kwargs: calls.append(args) or resolve_backend(*args, **kwargs))
    cfg = dict(block_size=8, vocab_size=10, n_layer=3, n_head=2, n_embd=128)  # head_dim 64: one fa3 takes
    gpt = GPT(GPTConfig(**cfg, attn="sdpa"))
    assert calls == [("sdpa", 64)] and gpt.backend is REGISTRY["sdpa"]
    assert all(block.attn.backend is gpt.backend for block in gpt.transformer.h)
    assert copy.deepcopy(gpt).transformer.h[1].attn.backend is gpt.backend  # one object per backend
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fa3, "gluon_device_reason", lambda device: None)
    with warnings.catch_warnings():  # the interpreter warning
        warnings.simplefilter("ignore")
        assert GPT(GPTConfig(**cfg, attn="auto")).backend is REGISTRY["fa3"]
        windowed = GPT(GPTConfig(**cfg, attn="auto", attn_window=[4, 0, 4]))
    assert windowed.backend is REGISTRY["fa3"] and calls[-1] == ("auto", 64)


def test_triton_backend_warns_and_reports_missing_kernels(monkeypatch):
    import dataclasses
    import sys

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "kernels", None)  # `import kernels` raises ImportError
    fa2 = dataclasses.replace(REGISTRY["fa2"])  # a fresh object: nothing loaded yet
    with pytest.warns(RuntimeWarning, match="interpreter"):
        with pytest.raises(BackendUnavailableError, match="attn=fa2 is not available.*kernels.fa2_attention"):
            fa2.load()
    import model.gpt  # the model loads its backend when it is built: the error comes before any forward

    monkeypatch.setattr(model.gpt, "resolve_backend", lambda *args, **kwargs: fa2)
    with pytest.raises(BackendUnavailableError, match="attn=fa2 is not available"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        GPT(GPTConfig(block_size=8, vocab_size=10, n_layer=1, n_head=2, n_embd=32, attn="fa2"))


def test_sdpa_then_fa2_in_one_process_without_gpu(tmp_path):
    """Torch imports triton early (e.g. for the optimizer); the interpreter must be on before that happens."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "from trainer import compose_config, train\n"
        f"common = ['model.n_layer=1', 'model.n_embd=32', 'model.n_head=2', 'model.block_size=16', "
        f"'trainer.batch_size=2', 'trainer.max_steps=1', 'eval.iters=1', 'wandb.mode=disabled', "
        f"'trainer.device=cpu', 'run.root={tmp_path}']\n"
        "for attn in ('sdpa', 'fa2'):\n"
        "    print(attn, train(compose_config(common + [f'attn={attn}', f'run.name={attn}'])).step)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "sdpa 1" in out.stdout and "fa2 1" in out.stdout


def test_triton_backend_rejects_dropout():
    import dataclasses

    from model.backends.triton import Kernels

    fake = dataclasses.replace(REGISTRY["fa1"], load_kernels=lambda: Kernels(lambda q, k, v, causal: q, None))
    if torch.cuda.is_available():
        fn = fake.load().attention
    else:
        with pytest.warns(RuntimeWarning):
            fn = fake.load().attention
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match="no attention dropout"):
        fn(q, q, q, dropout_p=0.1)


@pytest.mark.parametrize("attn", ["fa2", "flex"])
@pytest.mark.parametrize("window", [7, [5, 0]])
def test_attn_window_matches_sdpa_mask(attn, window):
    """model.attn_window through fa2's window_size (flex: its block mask) and through SDPA's dense mask give the same
    model, and the window changes the output (rows past the window differ from full attention)."""
    cfg = dict(block_size=40, vocab_size=50, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
    sdpa = GPT(GPTConfig(**cfg, attn_window=window)).eval()
    with warnings.catch_warnings():  # the interpreter (fa2), eager Flex on the CPU and the dense mask (sdpa) warn
        warnings.simplefilter("ignore")
        fa2 = GPT(GPTConfig(**cfg, attn=attn, attn_window=window)).eval()
    full = GPT(GPTConfig(**cfg)).eval()
    fa2.load_state_dict(sdpa.state_dict())
    full.load_state_dict(sdpa.state_dict())
    idx = torch.randint(0, 50, (2, 37))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logits, _ = fa2(idx, idx)
        logits_sdpa, _ = sdpa(idx, idx)
    torch.testing.assert_close(logits, logits_sdpa, atol=1e-4, rtol=1e-4)
    logits_full, _ = full(idx, idx)
    torch.testing.assert_close(logits[:, :5], logits_full[:, :5], atol=1e-4, rtol=1e-4)  # inside every window
    assert not torch.allclose(logits[:, 10:], logits_full[:, 10:], atol=1e-3)


def test_attn_window_needs_a_backend_that_has_it():
    with pytest.raises(ValueError, match="list of n_layer=2"):
        GPT(GPTConfig(block_size=8, vocab_size=10, n_layer=2, n_head=2, n_embd=32, attn_window=[4]))
    model = GPT(GPTConfig(block_size=8, vocab_size=10, n_layer=1, n_head=2, n_embd=32, attn="fa1", attn_window=4))
    with pytest.raises(ValueError, match="attn=fa1 has no sliding-window attention"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(torch.randint(0, 10, (1, 8)))


@pytest.mark.parametrize("attn", ["fa2", "flex"])
@pytest.mark.parametrize("window", [0, 6])
def test_document_mask_matches_sdpa_and_isolates_documents(attn, window):
    """docs (cu_seqlens of the flattened batch) through fa2's varlen kernel (flex: its block mask) and SDPA's dense
    mask give the same model; changing one document's tokens changes no other document's logits."""
    cfg = dict(block_size=40, vocab_size=50, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, attn_window=window)
    sdpa = GPT(GPTConfig(**cfg)).eval()
    with warnings.catch_warnings():  # the interpreter (fa2), eager Flex on the CPU and the dense mask (sdpa) warn
        warnings.simplefilter("ignore")
        fa2 = GPT(GPTConfig(**cfg, attn=attn)).eval()
    fa2.load_state_dict(sdpa.state_dict())
    idx = torch.randint(0, 50, (3, 37))
    docs = torch.tensor([0, 5, 20, 37, 38, 74, 104, 111], dtype=torch.int32)  # a one-token document at 37
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logits, _ = fa2(idx, idx, docs=docs)
        logits_sdpa, _ = sdpa(idx, idx, docs=docs)
        changed = idx.clone()
        changed[0, 5:20] = (changed[0, 5:20] + 1) % 50
        logits_changed, _ = fa2(changed, changed, docs=docs)
    torch.testing.assert_close(logits, logits_sdpa, atol=1e-4, rtol=1e-4)
    assert torch.equal(logits_changed[0, :5], logits[0, :5]) and torch.equal(logits_changed[0, 20:], logits[0, 20:])
    assert torch.equal(logits_changed[1:], logits[1:]) and not torch.allclose(logits_changed[0, 5:20], logits[0, 5:20])


def test_documents_take_the_packed_qkv_form(monkeypatch):
    """With documents, fa2 gets the fused projection as one packed qkv (``fa2_varlen_qkvpacked_attention``, whose
    backward writes qkv's gradient in place): the form over separate q, k, v is never called, and the packed call
    sees the batch as one sequence of B * T rows cut at docs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=1, n_head=4, n_kv_head=2, n_embd=64, attn="fa2"))
    backend = model.transformer.h[0].attn.backend
    kernels, calls = backend.kernels, []

    def packed(qkv, cu_seqlens, max_seqlen, n_heads, **kwargs):
        calls.append((tuple(qkv.shape), cu_seqlens.tolist(), max_seqlen, n_heads))
        return kernels.varlen_qkvpacked(qkv, cu_seqlens, max_seqlen, n_heads, **kwargs)

    def separate(*args, **kwargs):
        raise AssertionError("the documents went through the separate-q/k/v varlen form")

    monkeypatch.setitem(backend.__dict__, "kernels", kernels._replace(varlen=separate, varlen_qkvpacked=packed))
    idx, docs = torch.randint(0, 50, (2, 16)), torch.tensor([0, 5, 16, 30, 32], dtype=torch.int32)
    _, loss = model(idx, idx, docs=docs)
    loss.backward()
    assert calls == [((32, 8, 16), [0, 5, 16, 30, 32], 16, 4)]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("docs, error, message", [
    ([0, 16, 40], ValueError, r"run from 0 to B \* T = 2 \* 16 = 32, got 0 \.\. 40"),
    ([0, 16, 30], ValueError, r"run from 0 to B \* T = 2 \* 16 = 32, got 0 \.\. 30"),
    ([1, 16, 32], ValueError, r"got 1 \.\. 32"),
    ([0, 16, 8, 32], ValueError, r"non-decreasing, but docs\[2\] = 8 < docs\[1\] = 16"),
    ([0, 20, 32], ValueError, r"every multiple of T = 16 .* 16 is missing"),
    ([0, 10, 20, 32], ValueError, r"16 is missing"),
    ("int64", ValueError, r"1-D int32 tensor .* got torch.int64"),
    ("2d", ValueError, r"of shape \(1, 3\)"),
    ("list", TypeError, r"docs must be an int32 torch.Tensor of cu_seqlens, got list"),
])
def test_bad_documents_are_refused_naming_docs(docs, error, message):
    """GPT.forward checks docs before any kernel reads them: offsets outside the batch would read and write outside
    its memory, and a document across two rows would mix them. check_docs=False (the trainer's sampler) skips it."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=32, attn="sdpa"))
    idx = torch.randint(0, 64, (2, 16))
    good = torch.tensor([0, 5, 16, 16, 32, 32], dtype=torch.int32)  # empty segments, as the sampler pads them
    _, loss = model(idx, idx, docs=good)
    assert torch.isfinite(loss)
    if isinstance(docs, str):
        bad = {"int64": good.long(), "2d": good[None, :3], "list": [0, 16, 32]}[docs]
    else:
        bad = torch.tensor(docs, dtype=torch.int32)
    with pytest.raises(error, match=message):
        model(idx, idx, docs=bad)
    with pytest.raises(ValueError, match="kv_cache is for inference"):
        model(idx, docs=good, kv_cache=object())
    _, unchecked = model(idx, idx, docs=torch.tensor([0, 8, 16, 32], dtype=torch.int32), check_docs=False)
    assert torch.isfinite(unchecked)


def test_document_mask_needs_a_backend_that_has_it():
    model = GPT(GPTConfig(block_size=8, vocab_size=10, n_layer=1, n_head=2, n_embd=32, attn="fa1"))
    docs = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="attn=fa1 has no document masks"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(torch.randint(0, 10, (1, 8)), docs=docs)


@pytest.mark.parametrize("attn", ["sdpa", "fa2", "flex"])
def test_document_mask_and_window_compile_in_one_graph(attn):
    """trainer.compile with data.document_mask: the model with docs traces in one graph (also when the number of
    documents changes between batches) and matches eager."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPT(GPTConfig(block_size=32, vocab_size=50, n_layer=1, n_head=2, n_embd=32, attn=attn,
                              attn_window=[5]))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for cuts in ([0, 5, 32, 40, 64], [0, 32, 33, 64]):
            idx, docs = torch.randint(0, 50, (2, 32)), torch.tensor(cuts, dtype=torch.int32)
            _, loss = compiled(idx, idx, docs=docs)
            loss.backward()
            torch.testing.assert_close(loss, model(idx, idx, docs=docs)[1], atol=1e-4, rtol=1e-4)


def test_training_forward_can_skip_the_logits():
    """return_logits=False: the same loss and gradients, and no (B, T, vocab) tensor handed back."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=2, n_head=4, n_embd=32))
    idx = torch.randint(0, 50, (3, 16))
    logits, loss = model(idx, idx)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    none, loss_only = model(idx, idx, return_logits=False)
    loss_only.backward()
    assert none is None and logits.shape == (3, 16, 50) and torch.equal(loss, loss_only)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))
    last, no_loss = model(idx, return_logits=False)  # generation: always the last position's logits
    assert last.shape == (3, 1, 50) and no_loss is None


@pytest.mark.parametrize("name", ["fa1", "sdpa_flash"])
def test_backends_without_windows_refuse_them_by_their_registry_entry(name):
    """The backends without supports_window / supports_docs: a clear ValueError."""
    assert not REGISTRY[name].supports_window and not REGISTRY[name].supports_docs
    q = torch.randn(1, 2, 8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fn = REGISTRY[name].load().attention
        refusal = (rf"attn={name} has no sliding-window attention \(a layer has a window of 4 tokens: "
                   r"model.attn_window\); use one of: sdpa, fa2")
        with pytest.raises(ValueError, match=refusal):
            fn(q, q, q, window=4)
        with pytest.raises(ValueError, match=f"attn={name} has no document masks"):
            fn(q, q, q, docs=torch.tensor([0, 3, 8], dtype=torch.int32))


def test_qkvpacked_backend_refuses_dropout_and_windows_it_lacks():
    """The registry's packed functions refuse what their backend cannot do, as the separate-tensor ones."""
    with warnings.catch_warnings():  # the interpreter warning
        warnings.simplefilter("ignore")
        fa2, fa1 = REGISTRY["fa2"].load().qkvpacked_attention, REGISTRY["fa1"].load().qkvpacked_attention
    qkv = torch.randn(1, 8, 6, 16)
    with pytest.raises(ValueError, match="attn=fa2 has no attention dropout"):
        fa2(qkv, 2, dropout_p=0.1)
    with pytest.raises(ValueError, match="attn=fa1 has no sliding-window attention"):
        fa1(qkv, 2, window=4)
