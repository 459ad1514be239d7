"""nanoGPT-style GPT (Karpathy's nanoGPT model.py, itself GPT-2 as in Radford et al. 2019).

Token + learned position embeddings, ``n_layer`` pre-LayerNorm blocks (causal self-attention,
GELU MLP), final LayerNorm and an output head tied to the token embedding. Residual output
projections are initialised with std 0.02 / sqrt(2 * n_layer) (GPT-2 paper). Attention is done
by a backend from ``model.attention`` chosen by name (``GPTConfig.attn``), with optional
grouped-query attention (``n_kv_head`` k/v heads shared by ``n_head`` q heads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.attention import get_backend


@dataclass
class GPTConfig:
    block_size: int = 256        # context length T (tokens)
    vocab_size: int = 50304      # GPT-2's 50257 padded to a multiple of 64
    n_layer: int = 12
    n_head: int = 12             # q heads
    n_kv_head: Optional[int] = None  # k/v heads; None = n_head (multi-head attention)
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = False           # bias in Linear and LayerNorm layers
    attn: str = "sdpa"           # attention backend name, see model.attention
    # Sliding-window attention: each token sees itself and the attn_window - 1 tokens before it; 0 = full causal.
    # A list gives one value per layer (e.g. [128, 0] * 6: local and global layers alternate).
    attn_window: Union[int, list[int]] = 0

    def layer_window(self, layer: int) -> int:
        return self.attn_window if isinstance(self.attn_window, int) else self.attn_window[layer]

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        if config.n_embd % config.n_head or config.n_head % config.kv_heads:
            raise ValueError(f"n_embd={config.n_embd} must be a multiple of n_head={config.n_head}, "
                             f"and n_head a multiple of n_kv_head={config.kv_heads}")
        windows = [config.attn_window] if isinstance(config.attn_window, int) else config.attn_window
        if len(windows) != (1 if isinstance(config.attn_window, int) else config.n_layer) or min(windows) < 0:
            raise ValueError(f"attn_window={config.attn_window!r} must be an int >= 0 (0 = full attention) or a "
                             f"list of n_layer={config.n_layer} of them")
        self.window = config.layer_window(layer)
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, config.head_dim
        # q, k, v in one matmul: n_head q heads then n_kv_head k and v heads.
        self.c_attn = nn.Linear(config.n_embd, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.dropout = config.dropout
        self.attention = get_backend(config.attn)

    def forward(self, x: torch.Tensor, docs: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim], dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)      # (B, n_head, T, hs)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)   # (B, n_kv_head, T, hs)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        y = self.attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, window=self.window, docs=docs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, docs: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), docs)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, layer) for layer in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # residual projections, GPT-2 scaled init
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; with non_embedding, position embeddings are left out (the token
        embedding is counted because it is tied to, and used as, the output head)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def estimate_flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward), nanoGPT / PaLM appendix B:
        6 N + 12 L H Q T, N non-embedding params, L layers, H q heads, Q head dim, T context; a layer with a
        sliding window w counts min(w, T) keys instead of T."""
        c = self.config
        keys = sum(min(w, c.block_size) if (w := c.layer_window(layer)) else c.block_size for layer in range(c.n_layer))
        return 6 * self.num_params() + 12 * c.n_head * c.head_dim * keys

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None, docs: Optional[torch.Tensor] = None):
        """idx: (B, T) int64 token ids, T <= block_size; targets: (B, T) int64 or None; docs: the documents of
        the flattened batch as int32 cu_seqlens (0 .. B * T, every multiple of T among them; ``data.sampler``):
        attention stays within each document.

        Returns (logits, loss): with targets, logits (B, T, vocab_size) and the mean
        cross-entropy (float32 scalar; targets == -1 are ignored); without, logits of the last
        position only, (B, 1, vocab_size), and loss None.
        """
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x, docs)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, generator: Optional[torch.Generator] = None,
                 num_tokens: Optional[int] = None) -> torch.Tensor:
        """Autoregressive sampling: idx (B, T) int64 -> (B, T + max_new_tokens).
        temperature > 0 divides the logits; top_k keeps only the k most likely tokens;
        num_tokens (the tokenizer's vocabulary) excludes the padding ids >= num_tokens."""
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :num_tokens].float() / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, 1, generator=generator)), dim=1)
        return idx
