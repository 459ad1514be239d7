"""AdamW with nanoGPT's parameter groups: weight decay on matrices (dim >= 2), none on biases,
LayerNorm weights; the tied embedding/head matrix counts once."""

from __future__ import annotations

import torch


def build_optimizer(model: torch.nn.Module, cfg, device: torch.device) -> torch.optim.AdamW:
    """cfg: the ``optim`` config section. Uses PyTorch's fused AdamW kernel on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]  # parameters() de-duplicates tied weights
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=device.type == "cuda")
