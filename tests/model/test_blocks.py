"""The block options beside GPT-2's (model.layers, GPTConfig.pos_emb / norm / mlp / qk_norm / tie_embeddings):
each against a written-out float64 reference, RoPE on every backend, with documents and with the KV cache, the
refusals of bad values and the conf/model presets."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from model.backends import REGISTRY
from model.backends.triton import TritonBackend
from model.gpt import GPT, GPTConfig
from model.kv_cache import KVCache
from model.layers import Rotary, apply_rope, document_positions, make_norm, mlp_width
from reference import windowed_greedy

# A tiny Llama-style model: RoPE (a small base, so 32 positions turn the slow pairs too), RMSNorm, SwiGLU, QK-norm,
# GQA (head_dim 16), no biases, an untied head.
LLAMA = dict(block_size=32, vocab_size=50, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, pos_emb="rope",
             rope_theta=100.0, norm="rmsnorm", mlp="swiglu", multiple_of=32, qk_norm=True, tie_embeddings=False)


def quiet_gpt(**cfg) -> GPT:
    """GPT(GPTConfig(**cfg)) in eval mode, its norm weights random (init 1 would hide a weight applied wrongly);
    the interpreter / eager-Flex warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPT(GPTConfig(**cfg)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
    return model


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def complex_rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x (B, T, H, D) rotated in float64 as complex numbers: pair i is x[..., i] + 1j * x[..., i + D/2], times
    exp(1j * pos * theta^(-2i/D)) (Su et al. 2021; the half-split pairing of GPT-NeoX / Hugging Face Llama)."""
    D = x.shape[-1]
    z = torch.view_as_complex(torch.stack(x.double().chunk(2, dim=-1), dim=-1).contiguous())
    freqs = theta ** -(torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = pos.double()[..., None] * freqs  # pos.shape + (D/2,)
    rotated = z * torch.polar(torch.ones_like(angles), angles).unsqueeze(-2)  # broadcast over the heads
    return torch.cat(torch.view_as_real(rotated).unbind(-1), dim=-1)


@pytest.mark.parametrize("pos_shape", ["shared", "per_row"])
def test_rope_matches_a_complex_rotation(pos_shape):
    B, T, H, D, theta = 3, 11, 2, 16, float(torch.randint(10, 100000, ()).item())
    x = torch.randn(B, T, H, D, dtype=torch.float64)
    pos = torch.randint(0, 64, (T,) if pos_shape == "shared" else (B, T))
    rotary = Rotary(D, 64, theta)
    out = apply_rope(x, *rotary(pos))
    assert out.dtype == torch.float64 and out.shape == x.shape
    torch.testing.assert_close(out, complex_rope(x, pos, theta), atol=1e-6, rtol=1e-6)  # float32 tables
    x32 = x.float()
    torch.testing.assert_close(apply_rope(x32, *rotary(pos)), complex_rope(x, pos, theta).float(),
                               atol=1e-5, rtol=1e-5)
    assert apply_rope(x.bfloat16(), *rotary(pos)).dtype == torch.bfloat16


def test_rope_scores_depend_on_the_distance_only():
    """q . k after rotation at positions (m, n) equals the same at (m + s, n + s): why cached keys stay valid."""
    D = 32
    rotary = Rotary(D, 256, 10000.0)
    q, k = torch.randn(1, 1, 1, D, dtype=torch.float64), torch.randn(1, 1, 1, D, dtype=torch.float64)
    m, n, s = 40, 7, int(torch.randint(1, 200, ()).item())

    def score(i: int, j: int) -> torch.Tensor:
        return (apply_rope(q, *rotary(torch.tensor([i]))) * apply_rope(k, *rotary(torch.tensor([j])))).sum()

    torch.testing.assert_close(score(m, n), score(m + s, n + s), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(score(m, n), score(m, n + 1), atol=1e-3)


def test_rope_tables_are_buffers_outside_the_checkpoint_and_stay_float32():
    model = GPT(GPTConfig(**LLAMA))
    assert not any("cos" in k or "sin" in k or "wpe" in k for k in model.state_dict())
    assert {name for name, _ in model.named_buffers()} == {"rotary.cos", "rotary.sin"}
    assert model.rotary.cos.shape == (32, 8) and model.rotary.cos.dtype == torch.float32
    bf16 = model.to(torch.bfloat16)  # a cast to bf16 rebuilds the tables in float32, not rounded ones
    assert bf16.rotary.cos.dtype == torch.float32
    torch.testing.assert_close(bf16.rotary.sin, Rotary(16, 32, 100.0).sin, atol=0, rtol=0)


def test_document_positions_restart_at_every_cut():
    B, T = 3, 10
    cuts = sorted({0, B * T, 10, 20, *torch.randint(1, B * T, (5,)).tolist()})
    docs = torch.tensor(cuts, dtype=torch.int32)
    expected = [t - max(c for c in cuts if c <= t) for t in range(B * T)]
    pos = document_positions(docs, B, T)
    assert pos.dtype == torch.int64 and pos.flatten().tolist() == expected


def test_rmsnorm_matches_the_formula():
    """norm=rmsnorm: torch.nn.RMSNorm at model.norm_eps, x / sqrt(mean(x^2) + eps) * weight, no bias."""
    norm = make_norm("rmsnorm", 48, bias=True, eps=1e-3)
    assert isinstance(norm, torch.nn.RMSNorm) and not any("bias" in n for n, _ in norm.named_parameters())
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 5, 48) * 3
    xd = x.double()
    expected = xd / torch.sqrt(xd.square().mean(-1, keepdim=True) + 1e-3) * norm.weight.double()
    torch.testing.assert_close(norm(x).double(), expected, atol=1e-5, rtol=1e-5)
    model = GPT(GPTConfig(**LLAMA | dict(norm_eps=1e-3)))
    norms = [m for m in model.modules() if isinstance(m, (torch.nn.RMSNorm, torch.nn.LayerNorm))]
    assert len(norms) == 2 * 2 + 1 + 2 * 2 and all(isinstance(m, torch.nn.RMSNorm) and m.eps == 1e-3 for m in norms)


def test_layernorm_keeps_gpt2s_bias_and_eps():
    norm = make_norm("layernorm", 8, bias=True, eps=1e-5)
    assert isinstance(norm, torch.nn.LayerNorm) and norm.bias is not None and norm.eps == 1e-5
    assert make_norm("layernorm", 8, bias=False, eps=1e-5).bias is None


@pytest.mark.parametrize("n_embd,multiple_of,hidden,expected", [
    (768, 256, None, 2048),    # 8/3 * 768 = 2048 exactly
    (1024, 256, None, 2816),   # 2730 -> 2816
    (2048, 256, None, 5632),   # Llama's rule without ffn_dim_multiplier: 5461 -> 5632
    (64, 32, None, 192),       # 170 -> 192
    (64, 1, None, 170),
    (2048, 256, 8192, 8192),   # Llama-3.2-1B: given explicitly
])
def test_swiglu_hidden_width_is_rounded_as_llama_does(n_embd, multiple_of, hidden, expected):
    assert mlp_width(n_embd, "swiglu", hidden, multiple_of) == expected
    assert mlp_width(n_embd, "gelu", None, multiple_of) == mlp_width(n_embd, "relu2", None, multiple_of) == 4 * n_embd


@pytest.mark.parametrize("kind", ["swiglu", "relu2", "gelu"])
def test_mlp_variants_match_their_formulas(kind):
    model = GPT(GPTConfig(**LLAMA | dict(mlp=kind, bias=True)))
    mlp = model.transformer.h[1].mlp
    hidden = 192 if kind == "swiglu" else 256
    assert mlp.c_fc.weight.shape == ((2 if kind == "swiglu" else 1) * hidden, 64)
    assert mlp.c_proj.weight.shape == (64, hidden)
    x = torch.randn(2, 7, 64)
    h = F.linear(x.double(), mlp.c_fc.weight.double(), mlp.c_fc.bias.double())
    if kind == "swiglu":  # gate first, then up
        h = F.silu(h[..., :hidden]) * h[..., hidden:]
    elif kind == "relu2":
        h = torch.relu(h) ** 2
    else:
        h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
    expected = F.linear(h, mlp.c_proj.weight.double(), mlp.c_proj.bias.double())
    torch.testing.assert_close(mlp(x).double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_makes_attention_blind_to_the_scale_of_q_and_k(qk_norm):
    """Scaling the q (or k) rows of the fused projection changes nothing with qk_norm (RMSNorm is scale-free),
    and changes the logits without it."""
    model = quiet_gpt(**LLAMA | dict(qk_norm=qk_norm, norm_eps=1e-12))  # eps would not scale
    idx = torch.randint(0, 50, (2, 20))
    before = model(idx, idx)[0]
    assert hasattr(model.transformer.h[0].attn, "q_norm") == qk_norm
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight[:64] *= 5.0           # q rows
            block.attn.c_attn.weight[64:96] *= 0.3         # k rows
    after = model(idx, idx)[0]
    if qk_norm:
        torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    else:
        assert not torch.allclose(after, before, atol=1e-3)


def test_untied_head_and_counts():
    model = GPT(GPTConfig(**LLAMA))
    assert model.lm_head.weight is not model.transformer.wte.weight
    assert "transformer.wpe.weight" not in model.state_dict()  # rope: no position embeddings
    total = sum(p.numel() for p in model.parameters())
    assert model.num_params(non_embedding=False) == total
    assert model.num_params() == total - 50 * 64  # the token look-up; the head stays
    assert model.estimate_flops_per_token() == 6 * (total - 50 * 64) + 12 * 2 * 4 * 16 * 32
    tied = GPT(GPTConfig(**LLAMA | dict(tie_embeddings=True)))
    assert tied.lm_head.weight is tied.transformer.wte.weight
    assert tied.num_params() == tied.num_params(non_embedding=False) == total - 50 * 64


@pytest.mark.parametrize("bad,message", [
    (dict(pos_emb="rotary"), "pos_emb='rotary': accepted: learned, rope"),
    (dict(norm="rms"), "norm='rms': accepted: layernorm, rmsnorm"),
    (dict(mlp="swish"), "mlp='swish': accepted: gelu, swiglu, relu2"),
    (dict(rope_theta=0.0), "rope_theta=0.0: must be a finite number > 0"),
    (dict(norm_eps=float("nan")), "norm_eps=nan: must be a finite number > 0"),
    (dict(multiple_of=0), "multiple_of=0: must be an int >= 1"),
    (dict(mlp_hidden=-3), "mlp_hidden=-3: must be an int >= 1 or null"),
    (dict(qk_norm="yes"), "qk_norm='yes': must be true or false"),
    (dict(n_embd=60, n_head=4, n_kv_head=2), "head_dim = n_embd / n_head = 15 must be even"),
])
def test_bad_block_options_are_refused_by_name(bad, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("*", r"\*")):
        GPT(GPTConfig(**LLAMA | bad))


def test_config_validation_names_the_bad_model_keys():
    from trainer.config import ConfigError, compose_config, validate_config

    cfg = compose_config(["model.pos_emb=alibi", "model.norm=batchnorm", "model.mlp=geglu", "model.rope_theta=-1",
                          "model.norm_eps=0", "model.multiple_of=0", "model.mlp_hidden=0", "trainer.device=cpu"])
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    for line in ("model.pos_emb='alibi': accepted: learned, rope", "model.norm='batchnorm': accepted: layernorm, "
                 "rmsnorm", "model.mlp='geglu': accepted: gelu, swiglu, relu2",
                 "model.rope_theta=-1.0: must be a finite number > 0", "model.norm_eps=0.0: must be a finite number",
                 "model.multiple_of=0: must be an int >= 1", "model.mlp_hidden=0: must be an int >= 1 or null"):
        assert line in str(err.value)
    odd = compose_config(["model.pos_emb=rope", "model.n_embd=120", "model.n_head=8", "trainer.device=cpu"])
    with pytest.raises(ConfigError, match=r"model.pos_emb='rope': rope rotates pairs of dims: head_dim = .* = 15"):
        validate_config(odd)
    validate_config(compose_config(["model=llama_small", "trainer.device=cpu", "attn=sdpa"]))


@pytest.mark.parametrize("preset,vocab,params", [("llama_small", 50257, 130_432_000),
                                                 ("llama_1b", 128000, 1_235_814_400)])
def test_presets_build_their_shapes(preset, vocab, params):
    """conf/model presets through the trainer's model_config (on the meta device: no memory): head_dim, GQA and the
    parameter count (llama_1b: Llama-3.2-1B's 1,235,814,400)."""
    from trainer.config import compose_config, validate_config
    from trainer.loop import min_params, model_config

    cfg = compose_config([f"model={preset}", "trainer.device=cpu", "attn=sdpa"])
    validate_config(cfg)
    args = model_config(cfg, vocab, "sdpa")
    with torch.device("meta"):
        model = GPT(args)
    assert (args.pos_emb, args.norm, args.mlp, args.bias, args.tie_embeddings) == ("rope", "rmsnorm", "swiglu",
                                                                                    False, True)
    assert args.n_head == 4 * args.kv_heads and args.rope_theta == 500000.0
    assert args.head_dim == (128 if preset == "llama_small" else 64)
    assert model.num_params(non_embedding=False) == params and min_params(args) <= params


@pytest.mark.parametrize("attn", ["fa1", "fa2", "fa3", "flex", "sdpa_flash"])
def test_rope_on_every_backend_matches_sdpa(attn, monkeypatch):
    """The Llama-style model on each backend gives sdpa's logits, loss and gradients (float32); fa1/fa2/fa3 get the
    rotated q, k and v as one packed tensor (their packed kernel, once per layer)."""
    sdpa = quiet_gpt(**LLAMA)
    other = quiet_gpt(**LLAMA | dict(attn=attn))
    other.load_state_dict(sdpa.state_dict())
    calls = []
    packed = TritonBackend.qkvpacked_attention
    monkeypatch.setattr(TritonBackend, "qkvpacked_attention",
                        lambda self, *args, **kwargs: calls.append(args[0].shape) or packed(self, *args, **kwargs))
    idx = torch.randint(0, 50, (2, 29))
    (logits, loss), (logits_ref, loss_ref) = quiet(other, idx, idx), sdpa(idx, idx)
    loss.backward()
    loss_ref.backward()
    assert calls == ([(2, 29, 8, 16)] * 2 if REGISTRY[attn].qkvpacked else [])
    torch.testing.assert_close(logits, logits_ref, atol=1e-4, rtol=1e-4)
    for (name, p), p_ref in zip(other.named_parameters(), sdpa.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("attn", ["sdpa", pytest.param("fa2", marks=pytest.mark.slow), "flex"])
def test_rope_positions_restart_in_each_document(attn, monkeypatch):
    """With docs q and k are rotated at each token's position within its document, and every document's logits
    are those of the document run alone from position 0. (Within a document RoPE scores depend on distances only,
    so the logits alone would not show a missing restart: the positions handed to the tables are checked too.)"""
    model = quiet_gpt(**LLAMA | dict(attn=attn))
    idx = torch.randint(0, 50, (2, 32))
    docs = torch.tensor([0, 9, 25, 32, 33, 64], dtype=torch.int32)
    seen, tables = [], model.rotary.forward
    monkeypatch.setattr(model.rotary, "forward", lambda pos: seen.append(pos) or tables(pos))
    logits, _ = quiet(model, idx, idx, docs=docs)
    assert seen[0].tolist() == [[*range(9), *range(16), *range(7)], [0, *range(31)]]
    for row, start, end in ((0, 0, 9), (0, 9, 25), (0, 25, 32), (1, 0, 1), (1, 1, 32)):
        alone, _ = quiet(model, idx[row:row + 1, start:end], idx[row:row + 1, start:end])
        torch.testing.assert_close(logits[row, start:end], alone[0], atol=1e-4, rtol=1e-4)


def test_learned_positions_do_not_restart_in_documents():
    """GPT-2 (learned positions) keeps its behaviour: with docs a document still sits at its window positions."""
    model = quiet_gpt(**LLAMA | dict(pos_emb="learned"))
    idx = torch.randint(0, 50, (1, 32))
    logits, _ = quiet(model, idx, idx, docs=torch.tensor([0, 9, 32], dtype=torch.int32))
    alone, _ = model(idx[:, 9:], idx[:, 9:])
    assert not torch.allclose(logits[0, 9:], alone[0], atol=1e-3)


@pytest.mark.parametrize("attn", ["sdpa", pytest.param("fa2", marks=pytest.mark.slow)])
def test_cached_greedy_with_rope_matches_uncached(attn):
    """The cached keys were rotated at their positions and each new token continues from the cache's length: the
    same greedy tokens as without the cache, within block_size and past it (re-prefills)."""
    model = quiet_gpt(**LLAMA | dict(attn=attn, block_size=16))
    idx = torch.randint(0, 50, (2, 5))
    cached = quiet(model.generate, idx, 10, top_k=1, kv_cache=True)
    assert torch.equal(cached, quiet(model.generate, idx, 10, top_k=1, kv_cache=False))
    if attn == "sdpa":
        assert torch.equal(model.generate(idx, 25, top_k=1, kv_cache=True), windowed_greedy(model, idx, 25))


def test_static_shape_decode_with_rope_matches_dynamic():
    """A tensor start_pos (the fixed-shape step of compiled / CUDA-graph decoding) rotates at the same positions."""
    model = quiet_gpt(**LLAMA)
    idx = torch.randint(0, 50, (2, 9))
    dynamic, static = KVCache.for_model(model, 2), KVCache.for_model(model, 2)
    for cache in (dynamic, static):
        model(idx[:, :7], kv_cache=cache, start_pos=0)
    for p in (7, 8):
        expected, _ = model(idx[:, p:p + 1], kv_cache=dynamic, start_pos=p)
        logits, _ = model(idx[:, p:p + 1], kv_cache=static, start_pos=torch.tensor(p))
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    full, _ = model(idx, idx)
    torch.testing.assert_close(expected[:, 0], full[:, 8], atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # compiles
def test_compiled_generation_with_rope_matches_eager():
    """compile=True (regional compilation of the blocks, the rope tables an input): the eager tokens, with the
    fixed-shape cached step and without the cache."""
    torch._dynamo.reset()
    model = quiet_gpt(**LLAMA | dict(block_size=16))
    idx = torch.randint(0, 50, (2, 3))
    expected = model.generate(idx, 8, top_k=1)
    assert torch.equal(model.generate(idx, 8, top_k=1, kv_cache=True, compile=True), expected)
    assert torch.equal(model.generate(idx, 8, top_k=1, compile=True), expected)


@pytest.mark.slow  # compiles
def test_rope_with_documents_compiles_in_one_graph():
    """trainer.compile with data.document_mask and rope: one graph (document positions included), eager's loss."""
    model = quiet_gpt(**LLAMA).train()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for cuts in ([0, 5, 32, 40, 64], [0, 32, 33, 64]):
        idx, docs = torch.randint(0, 50, (2, 32)), torch.tensor(cuts, dtype=torch.int32)
        _, loss = quiet(compiled, idx, idx, docs=docs)
        loss.backward()
        torch.testing.assert_close(loss, quiet(model, idx, idx, docs=docs)[1], atol=1e-5, rtol=1e-5)
