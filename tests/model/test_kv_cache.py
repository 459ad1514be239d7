"""KV cache: attention over a cached prefix, cached vs uncached generation, input validation."""

import warnings

import pytest
import torch

from model.backends import REGISTRY
from model.gpt import GPT, GPTConfig
from model.kv_cache import KVCache
from reference import reference_attention, windowed_greedy


@pytest.mark.parametrize("attn,Tq", [(attn, Tq) for attn in ("sdpa", "fa2", "fa1", "fa3", "flex") for Tq in (1, 3, 9)]
                         + [("sdpa_flash", 1), ("sdpa_flash", 9)])  # PyTorch's flash kernel takes no mask
def test_kv_attention_matches_reference(attn, Tq):
    B, Tk, hs = 2, 9, 16
    q = torch.randn(B, 4, Tq, hs)
    # k, v as the cache hands them out: a prefix view of a longer buffer
    k, v = (torch.randn(B, 2, 16, hs)[:, :, :Tk] for _ in range(2))
    o = REGISTRY[attn].load().kv_attention(q, k, v)
    assert o.shape == q.shape and o.dtype == q.dtype
    torch.testing.assert_close(o.double(), reference_attention(q, k, v), atol=1e-5, rtol=1e-5)


def tiny_gpt(attn="sdpa", block_size=16, n_kv_head=2):
    cfg = GPTConfig(block_size=block_size, vocab_size=50, n_layer=2, n_head=4, n_kv_head=n_kv_head,
                    n_embd=64, attn=attn)
    return GPT(cfg).eval()


@pytest.mark.parametrize("attn", ["sdpa", "fa2", "flex"])
def test_cached_greedy_matches_uncached(attn):
    """float32 on the CPU: within block_size the cached and uncached greedy tokens are the same."""
    model = tiny_gpt(attn)
    idx = torch.randint(0, 50, (2, 4))
    cached = model.generate(idx, 9, top_k=1, kv_cache=True)
    assert cached.shape == (2, 13) and torch.equal(cached[:, :4], idx)
    assert torch.equal(cached, model.generate(idx, 9, top_k=1, kv_cache=False))


@pytest.mark.parametrize("prompt_len", [3, 8, 13])
def test_cached_generation_past_block_size_re_prefills(prompt_len):
    """Past block_size (and for prompts longer than it) the cache restarts from the most recent half."""
    model = tiny_gpt(block_size=8, n_kv_head=None)
    idx = torch.randint(0, 50, (2, prompt_len))
    cached = model.generate(idx, 21, top_k=1, kv_cache=True)
    assert torch.equal(cached, windowed_greedy(model, idx, 21))


def test_cached_sampling_respects_options():
    model = tiny_gpt()
    idx = torch.randint(0, 50, (4, 2))
    gen = torch.Generator().manual_seed(0)
    out = model.generate(idx, 30, temperature=2.0, num_tokens=5, generator=gen, kv_cache=True)
    assert out.shape == (4, 32) and out[:, 2:].max() < 5
    assert torch.equal(model.generate(idx, 0, kv_cache=True), idx)


def test_compiled_decode_matches_uncached():
    model = tiny_gpt()
    idx = torch.randint(0, 50, (2, 3))
    compiled = model.generate(idx, 8, top_k=1, kv_cache=True, compile=True)
    assert torch.equal(compiled, model.generate(idx, 8, top_k=1))


def test_kv_cache_validation():
    model = tiny_gpt(block_size=8)
    cache = KVCache.for_model(model, batch=2)
    k = cache.layers[0].k
    assert k.shape == (2, 2, 8, 16) and k.dtype == torch.float32 and len(cache.layers) == 2
    model(torch.randint(0, 50, (2, 5)), kv_cache=cache, start_pos=0)
    with pytest.raises(ValueError, match="batch of 3"):
        model(torch.randint(0, 50, (3, 1)), kv_cache=cache, start_pos=5)
    with pytest.raises(ValueError, match="exceed block_size=8"):
        model(torch.randint(0, 50, (2, 4)), kv_cache=cache, start_pos=5)
    with pytest.raises(ValueError, match="inference"):
        model(torch.randint(0, 50, (2, 1)), torch.zeros(2, 1, dtype=torch.long), kv_cache=cache, start_pos=5)
    with pytest.raises(ValueError, match="do not fit a cache"):
        cache.layers[0].update(0, torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16))
    with pytest.raises(ValueError, match="batch must be >= 1"):
        KVCache.for_model(model, batch=0)
    with pytest.raises(ValueError, match="T >= 1"):
        model.generate(torch.zeros(2, 0, dtype=torch.long), 3, kv_cache=True)
    bf16 = tiny_gpt().to(torch.bfloat16)
    assert KVCache.for_model(bf16, 1).layers[1].v.dtype == torch.bfloat16


def test_sample_py_greedy_same_with_and_without_cache(make_cfg, capsys):
    """sample.py end to end: --top-k 1 gives the same text with and without the cache, for sdpa and fa2."""
    import sample
    from trainer import train

    s = train(make_cfg("run.name=kv", "trainer.max_steps=3", "model.n_head=2", "model.n_kv_head=1"))  # head_dim 16
    texts = {}
    for attn in ("sdpa", "fa2"):
        for cache in ("--kv-cache", "--no-kv-cache"):
            rc = sample.main(["--run", "kv", "--runs-root", str(s.run_dir.parent), "--prompt", "The king",
                              "--num-tokens", "12", "--top-k", "1", "--num-samples", "2", "--device", "cpu",
                              "--attn", attn, cache])
            assert rc == 0
            texts[attn, cache] = capsys.readouterr().out
    assert len(set(texts.values())) == 1
    first, second = texts["sdpa", "--kv-cache"].split("\n" + "-" * 40 + "\n")
    assert first.startswith("The king") and first.strip() == second.strip()  # greedy: the samples agree
    for bad, message in ((["--no-kv-cache", "--compile", "cudagraphs"], "--compile cudagraphs needs --kv-cache"),
                         (["--no-kv-cache", "--cuda-graph"], "--cuda-graph needs --kv-cache"),
                         (["--num-samples", "0"], "--num-samples=0 is out of range: must be >= 1"),
                         (["--temperature", "inf"], "--temperature=inf is out of range: must be > 0 and finite"),
                         (["--temperature", "0"], "--temperature=0.0 is out of range: must be > 0 and finite "
                                                  "(greedy: --top-k 1)")):
        with pytest.raises(SystemExit):
            sample.main(["--run", "kv", "--runs-root", str(s.run_dir.parent), "--device", "cpu", *bad])
        assert message in capsys.readouterr().err
    if not torch.cuda.is_available():  # FlexAttention does not compile on the CPU: one line, not Inductor's dump
        assert sample.main(["--run", "kv", "--runs-root", str(s.run_dir.parent), "--device", "cpu", "--attn", "flex",
                            "--compile"]) == 1
        err = capsys.readouterr().err
        assert "error: --compile: torch.compile cannot lower attn=flex on the CPU; run without --compile, or with " \
               "--attn sdpa" in err and "Traceback" not in err


@pytest.mark.parametrize("attn", ["sdpa", "fa2"])
def test_static_shape_decode_matches_dynamic(attn):
    """A tensor start_pos (fixed shapes for CUDA graphs) gives the logits of an int start_pos."""
    model = tiny_gpt(attn)
    idx = torch.randint(0, 50, (2, 6))
    dynamic, static = KVCache.for_model(model, 2), KVCache.for_model(model, 2)
    for cache in (dynamic, static):
        model(idx[:, :5], kv_cache=cache, start_pos=0)
    expected, _ = model(idx[:, 5:], kv_cache=dynamic, start_pos=5)
    logits, _ = model(idx[:, 5:], kv_cache=static, start_pos=torch.tensor(5))
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(static.layers[0].k[:, :, :6], dynamic.layers[0].k[:, :, :6])  # layer 0: same inputs


def fake_capture(captures):
    """capture_cuda_graph for the CPU: 'replaying' runs the step again (it reads the same fixed buffers)."""
    def capture(fn, device):
        captures.append(device)
        fn()  # the warm-up run of the real capture
        return fn
    return capture


@pytest.mark.parametrize("compile", [False, True])
def test_cuda_graph_generation_matches_uncached(monkeypatch, compile):
    """cuda_graph=True: the fixed-shape decode step, captured once at the first decode step, replayed per token from
    fixed token / position buffers (the capture replaced by re-running the step: no CUDA graphs on the CPU)."""
    import model.generate

    captures = []
    monkeypatch.setattr(model.generate, "capture_cuda_graph", fake_capture(captures))
    gpt = tiny_gpt()
    idx = torch.randint(0, 50, (2, 3))
    expected = gpt.generate(idx, 10, top_k=1)
    assert torch.equal(gpt.generate(idx, 10, top_k=1, kv_cache=True, compile=compile, cuda_graph=True), expected)
    assert len(captures) == 1
    # the next call with the same batch size and mode reuses the graph and its cache (another prompt: the cache is
    # prefilled again in place)
    idx2 = torch.randint(0, 50, (2, 5))
    assert torch.equal(gpt.generate(idx2, 10, top_k=1, kv_cache=True, compile=compile, cuda_graph=True),
                       gpt.generate(idx2, 10, top_k=1))
    assert len(captures) == 1
    # past block_size (re-prefills into the same cache) and with another batch size (a new graph)
    idx3 = torch.randint(0, 50, (3, 4))
    assert torch.equal(gpt.generate(idx3, 30, top_k=1, kv_cache=True, compile=compile, cuda_graph=True),
                       gpt.generate(idx3, 30, top_k=1, kv_cache=True))
    assert len(captures) == 2
    gpt.release_decode_graph()
    assert gpt._decode_graph is None


def test_cuda_graph_is_recaptured_when_the_parameters_move(monkeypatch):
    """A graph reads the parameters where they were at capture: a model moved (to float64 and back) gets a new one."""
    import model.generate

    captures = []
    monkeypatch.setattr(model.generate, "capture_cuda_graph", fake_capture(captures))
    gpt = tiny_gpt()
    idx = torch.randint(0, 50, (1, 3))
    first = gpt.generate(idx, 4, top_k=1, kv_cache=True, compile="cudagraphs")  # = compile=True, cuda_graph=True
    gpt.double().float()
    assert torch.equal(gpt.generate(idx, 4, top_k=1, kv_cache=True, compile="cudagraphs"), first)
    assert len(captures) == 2


def test_cuda_graph_refusals():
    model = tiny_gpt()
    idx = torch.randint(0, 50, (2, 3))
    with pytest.raises(ValueError, match="with kv_cache=True"):
        model.generate(idx, 2, compile="cudagraphs")
    with pytest.raises(ValueError, match="with kv_cache=True"):
        model.generate(idx, 2, cuda_graph=True)
    with pytest.raises(ValueError, match="compile must be"):
        model.generate(idx, 2, kv_cache=True, compile="max-autotune")
    with warnings.catch_warnings():  # the interpreter warning
        warnings.simplefilter("ignore")
        fa1 = tiny_gpt("fa1")
    with pytest.raises(ValueError, match="attn=fa1 has no static-shape decode"):
        fa1.generate(idx, 2, kv_cache=True, cuda_graph=True)
    with pytest.raises(ValueError, match=r"attn=fa1 has no static-shape decode \(CUDA graphs\); use sdpa, fa2 or fa3"):
        fa1(idx[:, :1], kv_cache=KVCache.for_model(fa1, 2), start_pos=torch.tensor(0))
    with pytest.raises(ValueError, match="need a CUDA device"):
        model.generate(idx, 2, kv_cache=True, cuda_graph=True)  # the real capture, on the CPU


def compiled_graphs():
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("attn", ["sdpa", "fa1"])
def test_compiled_decode_step_compiles_once(attn):
    """compile=True with the cache: one compiled graph for a whole generation and for the next one, not one for the
    first position and another for the rest (sdpa: the fixed-shape step; fa1, which has none: the int position
    compiled with dynamic shapes); every block runs through it (regional compilation). Tokens as without the cache."""
    torch._dynamo.reset()
    model = tiny_gpt(attn, block_size=32)
    idx = torch.randint(0, 50, (2, 3))
    before = compiled_graphs()
    out = model.generate(idx, 20, top_k=1, kv_cache=True, compile=True)
    assert compiled_graphs() - before == 1
    assert torch.equal(out, model.generate(idx, 20, top_k=1))
    model.generate(torch.randint(0, 50, (2, 5)), 6, top_k=1, kv_cache=True, compile=True)  # another prompt length
    assert compiled_graphs() - before == 1


def test_compiled_generation_without_cache_compiles_once():
    """compile=True without the cache: one graph (dynamic shapes) for every context length, up to and at block_size."""
    torch._dynamo.reset()
    model = tiny_gpt(block_size=16)
    idx = torch.randint(0, 50, (2, 3))
    before = compiled_graphs()
    out = model.generate(idx, 20, top_k=1, compile=True)
    assert compiled_graphs() - before == 1
    assert torch.equal(out, model.generate(idx, 20, top_k=1))


def test_kv_cache_refuses_a_sliding_window_and_generation_without_it_works():
    """The KV cache has no window: a windowed model says so (sample.py --no-kv-cache) instead of ignoring it."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=20, n_layer=2, n_head=2, n_embd=32, attn_window=[4, 0])).eval()
    idx = torch.randint(0, 20, (1, 5))
    with pytest.raises(ValueError, match="KV cache has no sliding window"):
        model.generate(idx, 3, kv_cache=True)
    assert model.generate(idx, 3, kv_cache=False).shape == (1, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("attn", ["sdpa", "fa2"])
def test_cuda_graph_decode_on_gpu(attn, compile):
    """The real capture: a replay gives the logits of the fixed-shape step run without a graph, the graph is kept for
    the next generation, and the compiled graph generates the compiled step's tokens."""
    torch.manual_seed(0)
    model = tiny_gpt(attn, block_size=64).cuda()
    idx = torch.randint(0, 50, (2, 6), device="cuda")
    tokens = model.generate(idx, 12, top_k=1, kv_cache=True, compile=compile, cuda_graph=True)
    graph = model._decode_graph[1]
    replay = graph.replay
    assert replay is not None and tokens.shape == (2, 18)
    if compile:  # the same compiled kernels without the graph
        assert torch.equal(tokens, model.generate(idx, 12, top_k=1, kv_cache=True, compile=True))
    again = model.generate(idx, 12, top_k=1, kv_cache=True, compile=compile, cuda_graph=True)
    assert torch.equal(again, tokens) and model._decode_graph[1].replay is replay  # not captured again
    reference = KVCache.for_model(model, 2)
    for cache in (reference, graph.cache):
        model(tokens[:, :16], kv_cache=cache, start_pos=0)
    logits = graph(tokens[:, 16:17], 16, None)  # a replay (the step is only needed for a capture)
    expected, _ = model(tokens[:, 16:17], kv_cache=reference, start_pos=torch.tensor(16, device="cuda"))
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_nbytes_for_is_what_for_model_allocates():
    """KVCache.nbytes_for (sample.py's memory check) equals the bytes of the cache for_model builds, GQA and bf16."""
    for model in (tiny_gpt(), tiny_gpt().to(torch.bfloat16)):
        for batch in (1, 3):
            cache = KVCache.for_model(model, batch)
            allocated = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.k, layer.v))
            assert KVCache.nbytes_for(model, batch) == allocated
