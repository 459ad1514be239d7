"""Random-window batch sampler over a flat token array (nanoGPT's get_batch) with explicit state.

Each batch is ``batch_size`` windows of ``block_size + 1`` consecutive tokens at uniformly random
offsets: x = window[:-1], y = window[1:]. Offsets come from a ``torch.Generator`` seeded from
(seed, rank), so every rank of a multi-process job draws its own stream; ``state_dict`` /
``load_state_dict`` capture that generator, so a resumed run draws exactly the batches an
uninterrupted run would have.
"""

from __future__ import annotations

import numpy as np
import torch


def rank_seed(seed: int, rank: int) -> int:
    """A well-mixed 32-bit seed per (seed, rank) (numpy SeedSequence)."""
    return int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])


class BatchSampler:
    def __init__(self, tokens: np.ndarray, block_size: int, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1, device: torch.device | str = "cpu"):
        """tokens: 1-D integer array (e.g. a uint16/uint32 memmap); yields int64 (batch_size, block_size)."""
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        if len(tokens) < block_size + 1:
            raise ValueError(f"{len(tokens)} tokens are too few for block_size={block_size} (need block_size + 1)")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.device = torch.device(device)
        self.generator = torch.Generator().manual_seed(rank_seed(seed, rank))
        self.batches_drawn = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), both int64 (batch_size, block_size) on ``device``; y is x shifted by one token."""
        ix = torch.randint(len(self.tokens) - self.block_size, (self.batch_size,), generator=self.generator)
        windows = np.stack([self.tokens[i: i + self.block_size + 1] for i in ix.tolist()]).astype(np.int64)
        w = torch.from_numpy(windows)
        x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()
        self.batches_drawn += 1
        if self.device.type == "cuda":
            x, y = x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x, y

    def state_dict(self) -> dict:
        return {"seed": self.seed, "rank": self.rank, "world_size": self.world_size,
                "batches_drawn": self.batches_drawn, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if (state["rank"], state["world_size"]) != (self.rank, self.world_size):
            raise ValueError(f"sampler state is for rank {state['rank']} of {state['world_size']}, "
                             f"this sampler is rank {self.rank} of {self.world_size}")
        self.generator.set_state(state["generator"])
        self.seed, self.batches_drawn = state["seed"], state["batches_drawn"]
