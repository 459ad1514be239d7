"""model.attn_softcap (GPTConfig.attn_softcap: attention logit soft-capping, Gemma 2) through the GPT: fa2 and flex
against the same model on an explicit float64 attention with the cap (logits, loss, every gradient), the KV-cache
paths (fa2's dense kernel, its split-K/V and static-shape decode), flex's score_mod with its block masks, the
backends that refuse it, attn=auto, and bad values.

On the CPU: fa2 under Triton's interpreter, flex through its eager implementation. The attention projections'
weights are scaled up so the scores reach several times the cap, and each comparison checks that the cap mattered.
"""

import copy
import warnings
from dataclasses import dataclass

import pytest
import torch

from model.backends import REGISTRY, Backend, backends_with, resolve_backend
from model.backends import flex_masks
from model.gpt import GPT, GPTConfig
from model.kv_cache import KVCache
from reference import reference_attention, windowed_greedy

SOFTCAP = 2.0
CFG = dict(block_size=24, vocab_size=40, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, attn_softcap=SOFTCAP)


@dataclass(frozen=True, eq=False, kw_only=True)
class ExplicitMath(Backend):
    """Causal attention written out in float64 (tests/reference.py), soft-capped: the reference backend."""
    supports_softcap: bool = True

    def attention(self, q, k, v, dropout_p=0.0, causal=True, window=0, docs=None, softcap=0.0):
        assert causal and window == 0 and docs is None
        return reference_attention(q, k, v, softcap).to(q.dtype)


MATH = ExplicitMath(name="math", description="float64 reference")


def capped_gpt(attn: str, **cfg) -> GPT:
    """The test GPT on `attn` with c_attn scaled so the scores (~N(0, 25)) go well past SOFTCAP."""
    with warnings.catch_warnings():  # the interpreter / eager-Flex warnings
        warnings.simplefilter("ignore")
        model = GPT(GPTConfig(**{**CFG, **cfg, "attn": attn})).eval()
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight.mul_(15.0)
    return model


def on_backend(model: GPT, backend: Backend, softcap: float | None = None) -> GPT:
    """A copy of model whose layers use `backend` (and `softcap`, if given)."""
    other = copy.deepcopy(model)
    for block in other.transformer.h:
        block.attn.backend = backend
        if softcap is not None:
            block.attn.softcap = softcap
    return other


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


@pytest.mark.parametrize("attn", ["fa2", "flex"])
def test_softcap_model_matches_explicit_math(attn):
    """Logits, loss and every parameter's gradient equal the explicit-math model's (fa2 through its packed-qkv
    kernel, flex through its score_mod), and differ from the uncapped model's."""
    model = capped_gpt(attn)
    ref = on_backend(model, MATH)
    idx = torch.randint(0, 40, (2, 24))
    logits, loss = quiet(model, idx, idx)
    logits_ref, loss_ref = ref(idx, idx)
    loss.backward()
    loss_ref.backward()
    torch.testing.assert_close(logits, logits_ref, atol=1e-4, rtol=1e-4)
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-5, rtol=1e-3, msg=name)
    uncapped = on_backend(model, MATH, softcap=0.0)
    assert (uncapped(idx, idx)[0] - logits).abs().max() > 100 * 1e-4


def test_fa2_cached_generation_with_softcap_matches_uncached():
    """Greedy tokens with the KV cache (prefill: fa2's dense kernel; decode steps: the split-K/V decode kernel,
    which caps too) equal those of the full forward over each growing context."""
    model = capped_gpt("fa2")
    model.use_split_kv_decode(True)
    idx = torch.randint(0, 40, (2, 5))
    cached = quiet(model.generate, idx, 4, top_k=1, kv_cache=True)
    assert torch.equal(cached, quiet(windowed_greedy, model, idx, 4))


@pytest.mark.parametrize("step", ["split_kv", "static"])
def test_fa2_decode_step_with_softcap(step):
    """A decode step after a prefill of the cache: through the split-K/V decode kernel (an int position), or the
    fixed-shape step (a tensor position: the whole cache, its unused part masked, fa2_decode with seqlen). Its
    logits are the capped explicit-math model's last ones, not the uncapped one's."""
    model = capped_gpt("fa2")
    model.use_split_kv_decode(step == "split_kv")
    idx = torch.randint(0, 40, (2, 7))
    cache = KVCache.for_model(model, 2)
    with torch.no_grad():
        quiet(model, idx[:, :6], kv_cache=cache, start_pos=0)
        logits, _ = quiet(model, idx[:, 6:], kv_cache=cache, start_pos=6 if step == "split_kv" else torch.tensor(6))
        capped, _ = on_backend(model, MATH)(idx)
        plain, _ = on_backend(model, MATH, softcap=0.0)(idx)
    torch.testing.assert_close(logits, capped, atol=1e-4, rtol=1e-4)
    assert (plain - capped).abs().max() > 100 * 1e-4


def test_flex_softcap_composes_with_its_block_masks():
    """flex's score_mod with the window and document block masks, forward and gradients, against fa2 (whose
    kernels test_softcap.py checks against float64), and not equal to the uncapped call."""
    B, H, H_kv, T, D = 2, 4, 2, 37, 16
    docs = torch.tensor([0, 10, 37, 50, 74], dtype=torch.int32)  # cu_seqlens of the flattened batch
    q = (torch.randn(B, H, T, D) * 3).requires_grad_()
    k = (torch.randn(B, H_kv, T, D) * 3).requires_grad_()
    v = torch.randn(B, H_kv, T, D).requires_grad_()
    flex = quiet(REGISTRY["flex"].load().attention, q, k, v, window=6, docs=docs, softcap=SOFTCAP)
    do = torch.randn_like(flex)
    grads = torch.autograd.grad(flex, (q, k, v), do)
    fa2 = quiet(REGISTRY["fa2"].load().attention, q, k, v, window=6, docs=docs, softcap=SOFTCAP)
    grads_fa2 = torch.autograd.grad(fa2, (q, k, v), do)
    torch.testing.assert_close(flex, fa2, atol=1e-4, rtol=1e-4)
    for g, g_ref in zip(grads, grads_fa2):
        torch.testing.assert_close(g, g_ref, atol=1e-4, rtol=1e-4)
    plain = quiet(flex_masks.attention, q.detach(), k.detach(), v.detach(), window=6, docs=docs)
    assert (plain - flex).abs().max() > 0.1
    assert flex_masks.softcap_score_mod(2.0) is flex_masks.softcap_score_mod(2.0)  # one function: no recompiles


def test_backends_without_softcap_are_refused_naming_those_with_it():
    assert backends_with("supports_softcap") == ["fa2", "flex", "fa3"]
    for name, entry in REGISTRY.items():
        if entry.supports_softcap:
            continue
        with pytest.raises(ValueError, match=rf"attn={name} has no attention logit soft-capping \(softcap=5.0: "
                                             r"model.attn_softcap\); use one of: fa2, flex, fa3"):
            GPT(GPTConfig(**{**CFG, "attn": name, "attn_softcap": 5.0}))
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="attn=sdpa has no attention logit soft-capping"):
        REGISTRY["sdpa"].kv_attention(q, q, q, softcap=1.0)


def test_auto_takes_a_backend_with_softcap(monkeypatch):
    """attn=auto with soft-capping: flex on the CPU (sdpa has none), fa3 on a GPU where its Gluon kernels run (they
    cap the logits too)."""
    from kernels import fa3

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_backend("auto", 16, softcap=True) is REGISTRY["flex"]
    assert resolve_backend("auto", 16) is REGISTRY["sdpa"]
    assert quiet(GPT, GPTConfig(**{**CFG, "attn": "auto"})).backend is REGISTRY["flex"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fa3, "gluon_device_reason", lambda device: None)
    assert resolve_backend("auto", 64) is REGISTRY["fa3"]
    assert resolve_backend("auto", 64, softcap=True) is REGISTRY["fa3"]


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), True, "5"])
def test_bad_attn_softcap_is_refused(value):
    with pytest.raises(ValueError, match=r"attn_softcap=.*: must be a finite number >= 0 \(0 = no soft-capping\)"):
        GPT(GPTConfig(**{**CFG, "attn": "flex", "attn_softcap": value}))


def test_explicit_math_reference_is_softcap_aware():
    """The reference itself: a cap far above the scores changes nothing, a cap at 1e-9 averages v."""
    q, k, v = (torch.randn(1, 2, 6, 8, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(reference_attention(q, k, v, 1e9), reference_attention(q, k, v))
    mean = v.cumsum(2) / torch.arange(1, 7, dtype=torch.float64).view(1, 1, 6, 1)
    torch.testing.assert_close(reference_attention(q, k, v, 1e-9), mean)


class _Layer(torch.nn.Module):
    """The softcap as the model holds it: a float attribute, which torch.compile(dynamic=True) reads as a symbolic
    float (the compiled generation steps do)."""

    def __init__(self, attn: str, softcap: float):
        super().__init__()
        self.backend, self.softcap = REGISTRY[attn].load(), softcap

    def forward(self, q, k, v):
        return self.backend.attention(q, k, v, softcap=self.softcap)


@pytest.mark.parametrize("attn", ["fa2", "flex"])
def test_softcap_compiles_as_a_symbolic_float_in_one_graph(attn):
    """fa2's front end checks the softcap with comparisons (math.isfinite would break the graph) and flex captures it
    as a tensor (a score_mod may not capture a symbolic float): one graph, the eager result."""
    torch._dynamo.reset()
    layer = quiet(_Layer, attn, SOFTCAP)
    q, k, v = (torch.randn(1, 2, 24, 16) * 3 for _ in range(3))
    compiled = torch.compile(lambda m, q, k, v: m(q, k, v), dynamic=True, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(quiet(compiled, layer, q, k, v), quiet(layer, q, k, v), atol=1e-5, rtol=1e-5)
