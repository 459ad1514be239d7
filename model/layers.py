"""The parts a GPT block is built from beside GPT-2's: rotary position embeddings (RoPE), the norm and the MLP
variants, chosen by ``GPTConfig``'s ``pos_emb``, ``norm`` and ``mlp``.

- RoPE (Su et al. 2021, "RoFormer"), in the half-split layout of GPT-NeoX / Hugging Face Llama / nanochat: the
  pairs rotated together are (x[i], x[i + head_dim/2]), i < head_dim/2, by the angle pos * theta^(-2i/head_dim).
  The cos/sin tables are float32 buffers, not saved in checkpoints; the rotation runs in float32 and is cast back.
- ``make_norm``: ``torch.nn.LayerNorm`` (GPT-2) or ``torch.nn.RMSNorm`` (Zhang & Sennrich 2019; Llama).
- ``MLP``: GELU (GPT-2), SwiGLU (Shazeer 2020; Llama: silu(x W_gate) * (x W_up), hidden width as Llama rounds it)
  or ReLU² (So et al. 2021, "Primer"; nanochat, modded-nanogpt).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.backends.base import segment_ids


def rope_tables(head_dim: int, length: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (length, head_dim // 2) float32 of the angles pos * theta^(-2i/head_dim), pos < length, computed
    in float64 (float32 angles lose about 1e-3 rad at pos 1e4)."""
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float64, device=device), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, head_dim) rotated: the pair (x[..., i], x[..., i + head_dim/2]) as the complex number
    x[..., i] + 1j * x[..., i + head_dim/2] times exp(1j * angle). cos, sin: (T, 1, head_dim/2) or
    (B, T, 1, head_dim/2) (``Rotary``). Computed in float32 (float64 for float64 x); returns x's dtype."""
    x1, x2 = x.to(torch.promote_types(x.dtype, torch.float32)).chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


def document_positions(docs: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """(batch, seqlen) int64 position of each token within its document: docs are int32 cu_seqlens over the
    flattened batch * seqlen tokens (``model.backends.segment_ids``), so positions restart at 0 at every cut."""
    starts = docs[segment_ids(docs, batch, seqlen) - 1].long()
    return torch.arange(batch * seqlen, device=docs.device).view(batch, seqlen) - starts


class Rotary(nn.Module):
    """The RoPE tables of one model, shared by its layers: cos, sin (block_size, head_dim // 2) float32 buffers,
    non-persistent (checkpoints stay as they are; they are rebuilt from the config). A cast of the model to a
    lower precision (``model.to(torch.bfloat16)``) rebuilds them in float32 on the new device, as bf16 angles
    would be wrong by up to a radian at long positions."""

    def __init__(self, head_dim: int, block_size: int, theta: float):
        super().__init__()
        self.head_dim, self.block_size, self.theta = head_dim, block_size, theta
        cos, sin = rope_tables(head_dim, block_size, theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.cos.dtype not in (torch.float32, torch.float64):
            self.cos, self.sin = rope_tables(self.head_dim, self.block_size, self.theta, self.cos.device)
        return self

    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pos (T,) or (B, T) integer positions < block_size (not checked) -> cos, sin of shape pos.shape +
        (1, head_dim/2), broadcasting over the heads of a (B, T, H, head_dim) q or k (``apply_rope``)."""
        return self.cos[pos].unsqueeze(-2), self.sin[pos].unsqueeze(-2)


def make_norm(kind: str, dim: int, bias: bool, eps: float) -> nn.Module:
    """LayerNorm (with a bias if ``bias``) or RMSNorm (no bias) over the last dim, learnable weight (init 1)."""
    if kind == "rmsnorm":
        return nn.RMSNorm(dim, eps=eps)
    return nn.LayerNorm(dim, eps=eps, bias=bias)


def mlp_width(n_embd: int, mlp: str, hidden: int | None = None, multiple_of: int = 256) -> int:
    """The MLP's hidden width: ``hidden`` if given, else 4 * n_embd (gelu, relu2) or for swiglu Llama's
    int(2/3 * 4 * n_embd) rounded up to a multiple of ``multiple_of`` (the same parameter count as 4 * n_embd
    with two matrices, before rounding; Touvron et al. 2023, Meta's llama/model.py)."""
    if hidden is not None:
        return hidden
    if mlp != "swiglu":
        return 4 * n_embd
    width = 8 * n_embd // 3
    return -(-width // multiple_of) * multiple_of


class MLP(nn.Module):
    """x (B, T, n_embd) -> (B, T, n_embd): c_proj(act(c_fc(x))), then dropout. For swiglu c_fc holds the gate
    and the up projection in one matrix (n_embd -> 2 * hidden, gate first): one matmul instead of two."""

    def __init__(self, n_embd: int, kind: str, hidden: int, bias: bool, dropout: float):
        super().__init__()
        self.kind = kind
        self.c_fc = nn.Linear(n_embd, 2 * hidden if kind == "swiglu" else hidden, bias=bias)
        if kind == "gelu":
            self.gelu = nn.GELU()
        self.c_proj = nn.Linear(hidden, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        if self.kind == "gelu":
            h = self.gelu(h)
        elif self.kind == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:  # relu2
            h = F.relu(h).square()
        return self.dropout(self.c_proj(h))
