"""References shared by the test folders (tests/ is on sys.path through tests/conftest.py)."""

import math

import torch


def reference_attention(q, k, v, softcap=0.0):
    """Softmax attention in float64, causal mask aligned bottom-right (query i sees key j <= i + Tk - Tq);
    softcap > 0: each score s becomes softcap * tanh(s / softcap) first (Gemma 2's logit soft-capping)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = (q.double() @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    Tq, Tk = q.shape[2], k.shape[2]
    s = s.masked_fill(~torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq), float("-inf"))
    return s.softmax(-1) @ v


def windowed_greedy(model, idx, max_new_tokens):
    """Greedy decoding without a cache over the contexts the cached path uses: the prompt's last block_size
    tokens, growing by one per token; after a full block_size context, the most recent block_size // 2."""
    bs = model.config.block_size
    n = min(idx.size(1), bs)
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -n:])
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], 1)
        n = n + 1 if n < bs else bs // 2
    return idx
