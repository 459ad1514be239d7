"""float64 references shared by the test folders (tests/ is on sys.path through tests/conftest.py)."""

import math

import torch


def reference_attention(q, k, v):
    """Softmax attention in float64, causal mask aligned bottom-right (query i sees key j <= i + Tk - Tq)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = (q.double() @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    Tq, Tk = q.shape[2], k.shape[2]
    s = s.masked_fill(~torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq), float("-inf"))
    return s.softmax(-1) @ v
