"""Random-window batch sampler over a flat token array (nanoGPT's get_batch) with explicit state.

Each batch is ``batch_size`` windows of ``block_size + 1`` consecutive tokens at uniformly random
offsets: x = window[:-1], y = window[1:]. Offsets come from a ``torch.Generator`` seeded from
(seed, rank), so each stream index ``rank`` gives its own stream; ``state_dict`` /
``load_state_dict`` capture that generator, so a resumed run draws exactly the batches an
uninterrupted run would have.

With ``doc_starts`` (the token cache's document offsets, ``data.document_mask``) each batch also
carries the documents of its windows as ``cu_seqlens``: int32 offsets into the flattened
(batch_size * block_size) batch, from 0 to batch_size * block_size, one segment per piece of a
document in a window (flash-attn's varlen convention; the attention backends restrict each token
to its own segment), then empty segments at the end up to a power of two (a few shapes for CUDA
graphs to record).

``ShardedBatchSampler`` is what the trainer uses: one stream per micro-batch slot ("shard") of an
optimizer step, dealt out to the ranks of a multi-process job, so the data of a step does not
depend on the number of processes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from data.sources import DataError


def rank_seed(seed: int, rank: int, *purpose: int) -> int:
    """A well-mixed 32-bit seed per (seed, rank[, purpose]) (numpy SeedSequence); data streams use no purpose."""
    return int(np.random.SeedSequence([seed, rank, *purpose]).generate_state(1)[0])


class BatchSampler:
    def __init__(self, tokens: np.ndarray, block_size: int, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1, device: torch.device | str = "cpu",
                 doc_starts: np.ndarray | None = None, vocab_size: int | None = None, source: Path | None = None):
        """tokens: 1-D integer array (e.g. a uint16/uint32 memmap); yields int64 (batch_size, block_size).
        doc_starts: ascending offsets in tokens where documents start; batches then carry cu_seqlens.
        vocab_size: every drawn token id must be below it, else DataError naming ``source`` (the .bin file of
        the tokens): a damaged cache whose mtime was kept is caught here instead of in the embedding."""
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        if len(tokens) < block_size + 1:
            raise ValueError(f"{len(tokens)} tokens are too few for block_size={block_size} (need block_size + 1)")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self._rows = tokens.view(np.ndarray)  # slices of a np.memmap are memmaps, each several us to make
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.device = torch.device(device)
        self.doc_starts = None if doc_starts is None else np.asarray(doc_starts, dtype=np.int64)
        self.generator = torch.Generator().manual_seed(rank_seed(seed, rank))
        self.batches_drawn = 0
        self.vocab_size, self.source = vocab_size, source

    def _offsets(self) -> torch.Tensor:
        self.batches_drawn += 1
        return torch.randint(len(self.tokens) - self.block_size, (self.batch_size,), generator=self.generator)

    def skip_batch(self) -> None:
        """Advance the stream by one batch without reading it (another rank reads that batch)."""
        self._offsets()

    def next_batch(self) -> tuple[torch.Tensor, ...]:
        """(x, y), both int64 (batch_size, block_size) on ``device``; y is x shifted by one token.
        With doc_starts: (x, y, cu_seqlens), cu_seqlens int32 (see the module docstring)."""
        ix = self._offsets().tolist()
        T, pin = self.block_size, self.device.type == "cuda"
        windows = np.empty((len(ix), T + 1), dtype=np.int64)
        for b, i in enumerate(ix):  # row by row from a plain view: 2-4x less host time than np.stack + astype
            windows[b] = self._rows[i: i + T + 1]
        if self.vocab_size is not None and windows.max() >= self.vocab_size:  # a few us per batch
            self._refuse_token(windows, ix)
        w = torch.from_numpy(windows)
        # On CUDA x and y are written straight into pinned memory (no pageable copy first), then copied asynchronously.
        batch = [torch.empty((len(ix), T), dtype=torch.int64, pin_memory=pin).copy_(part)
                 for part in (w[:, :-1], w[:, 1:])]
        if self.doc_starts is not None:
            cu_seqlens = torch.from_numpy(self._cu_seqlens(ix))
            batch.append(cu_seqlens.pin_memory() if pin else cu_seqlens)
        if pin:
            batch = [t.to(self.device, non_blocking=True) for t in batch]
        return tuple(batch)

    def _refuse_token(self, windows: np.ndarray, offsets: list[int]) -> None:
        b, i = np.argwhere(windows >= self.vocab_size)[0]
        where = f"{self.source}" if self.source is not None else "the tokens"
        advice = f"; delete {self.source.parent} to rebuild it" if self.source is not None else ""
        raise DataError(f"token id {windows[b, i]} at offset {offsets[b] + i} of {where} is not below the vocabulary "
                        f"size {self.vocab_size}: the token cache is damaged (its checksum is read only when a "
                        f"file's mtime changed){advice}")

    def _cu_seqlens(self, offsets: list[int]) -> np.ndarray:
        T, starts = self.block_size, self.doc_starts
        cuts = [np.array([0])]
        for b, i in enumerate(offsets):  # documents starting strictly inside window b split it
            inside = starts[np.searchsorted(starts, i, side="right"): np.searchsorted(starts, i + T, side="left")]
            cuts.append(np.append(inside - i, T) + b * T)
        cu = np.concatenate(cuts)
        # Empty segments at the end up to a power of two: a batch's shape is then one of a few, so torch.compile's
        # CUDA graphs (trainer.compile_mode=reduce-overhead) record a few graphs, not one per segment count.
        padded = 1 << (len(cu) - 2).bit_length()  # segments
        return np.pad(cu, (0, padded + 1 - len(cu)), mode="edge").astype(np.int32)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "rank": self.rank, "world_size": self.world_size,
                "batches_drawn": self.batches_drawn, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if (state["rank"], state["world_size"]) != (self.rank, self.world_size):
            raise ValueError(f"sampler state is for rank {state['rank']} of {state['world_size']}, "
                             f"this sampler is rank {self.rank} of {self.world_size}")
        self.generator.set_state(state["generator"])
        self.seed, self.batches_drawn = state["seed"], state["batches_drawn"]


class ShardedBatchSampler:
    """The micro-batches of one optimizer step that one rank runs, such that the job's data does
    not depend on the number of ranks.

    A step uses ``num_shards`` micro-batches (the trainer passes ``trainer.grad_accum``). Micro-batch
    k of every step comes from shard stream k: a ``BatchSampler`` seeded from (seed, k). Rank r of
    ``world_size`` owns shards ``r*m .. r*m + m - 1`` (m = num_shards / world_size) and draws one
    batch from each, in that order, per step. So 1 process and N ranks with the same num_shards see
    the same batches, and the shard states gathered from all ranks (``merge_states``) can be loaded
    by any number of ranks that divides num_shards.
    """

    def __init__(self, tokens: np.ndarray, block_size: int, batch_size: int, seed: int, num_shards: int,
                 rank: int = 0, world_size: int = 1, device: torch.device | str = "cpu",
                 doc_starts: np.ndarray | None = None, vocab_size: int | None = None, source: Path | None = None):
        if num_shards < 1 or num_shards % world_size:
            raise ValueError(f"num_shards={num_shards} must be a positive multiple of world_size={world_size}")
        m = num_shards // world_size
        self.num_shards = num_shards
        self.shards = [BatchSampler(tokens, block_size, batch_size, seed, rank=k, world_size=num_shards, device=device,
                                    doc_starts=doc_starts, vocab_size=vocab_size, source=source)
                       for k in range(rank * m, rank * m + m)]

    def next_batches(self) -> list[tuple[torch.Tensor, ...]]:
        """This rank's micro-batches of the next step: [(x, y[, cu_seqlens]) of each owned shard], shard order."""
        return [shard.next_batch() for shard in self.shards]

    def state_dict(self) -> dict:
        """This rank's shards: {"num_shards": int, "shards": [BatchSampler.state_dict(), ...]}."""
        return {"num_shards": self.num_shards, "shards": [shard.state_dict() for shard in self.shards]}

    @staticmethod
    def merge_states(states: list[dict]) -> dict:
        """One state holding every shard, from the ``state_dict()`` of every rank."""
        shards = sorted((s for state in states for s in state["shards"]), key=lambda s: s["rank"])
        return {"num_shards": states[0]["num_shards"], "shards": shards}

    def load_state_dict(self, state: dict) -> list[int]:
        """Restore the owned shards found in ``state`` (a merged state, or this rank's own). Shards the
        state lacks (``num_shards`` grew) keep their fresh streams, unused so far; their indices are
        returned. Raises ValueError if ``state`` is not a sampler state."""
        if not isinstance(state, dict) or not isinstance(state.get("shards"), list):
            raise ValueError("not a ShardedBatchSampler state (expected a dict with a 'shards' list)")
        saved = {s["rank"]: s for s in state["shards"]}
        fresh = []
        for shard in self.shards:
            if shard.rank in saved:
                # A shard's stream depends on (seed, k) only, not on how many shards there are.
                shard.load_state_dict({**saved[shard.rank], "world_size": shard.world_size})
            else:
                fresh.append(shard.rank)
        return fresh
