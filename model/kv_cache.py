"""A key/value cache for autoregressive generation: one preallocated buffer pair per layer.

``GPT.forward(idx, kv_cache=cache, start_pos=p)`` writes the keys and values of tokens p .. p+T-1 into
every layer's buffers and attends over positions 0 .. p+T-1, so each new token costs one query row per
(batch, head) instead of a forward pass over the whole context.
"""

from __future__ import annotations

import torch


class LayerKVCache:
    """Keys and values of one attention layer: k, v (batch, n_kv_head, block_size, head_dim)."""

    def __init__(self, batch: int, n_kv_head: int, block_size: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (batch, n_kv_head, block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def update(self, start_pos: int | torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (batch, n_kv_head, T, head_dim) at positions start_pos .. start_pos+T-1.

        Returns the cached keys and values of positions 0 .. start_pos+T-1, as views
        (batch, n_kv_head, start_pos+T, head_dim) of the buffers, in k's dtype. Raises ValueError when
        the batch size or head layout differs from the cache's, or the positions run past block_size.

        start_pos may be a 0-dim integer tensor on the cache's device (static shapes, for CUDA graphs): then
        the whole buffers (batch, n_kv_head, block_size, head_dim) are returned, and the positions are not
        checked (that would wait for the device).
        """
        B, H, T, D = k.shape
        if (B, H, D) != (self.k.shape[0], self.k.shape[1], self.k.shape[3]):
            raise ValueError(f"k/v of shape {tuple(k.shape)} do not fit a cache of shape {tuple(self.k.shape)} "
                             "(batch, n_kv_head, block_size, head_dim): batch size and heads must match")
        if isinstance(start_pos, torch.Tensor):
            # one token (a decode step): the position itself, a view, no kernel (a CUDA graph replays each one)
            pos = start_pos.reshape(1) if T == 1 else start_pos + torch.arange(T, device=k.device)
            self.k.index_copy_(2, pos, k.to(self.k.dtype))
            self.v.index_copy_(2, pos, v.to(self.v.dtype))
            return self.k.to(k.dtype), self.v.to(k.dtype)
        end = start_pos + T
        if start_pos < 0 or end > self.k.shape[2]:
            raise ValueError(f"positions {start_pos}..{end - 1} are outside the cache's 0..{self.k.shape[2] - 1}")
        self.k[:, :, start_pos:end] = k
        self.v[:, :, start_pos:end] = v
        # Under autocast k may be lower precision than the cache; the attention kernels want one dtype.
        return self.k[:, :, :end].to(k.dtype), self.v[:, :, :end].to(k.dtype)


class KVCache:
    """One ``LayerKVCache`` per transformer block, preallocated for ``batch`` sequences of ``block_size``.

    ``KVCache.for_model(model, batch)`` sizes it from the model's config, dtype and device.
    Raises ValueError for a batch size < 1.
    """

    def __init__(self, n_layer: int, batch: int, n_kv_head: int, block_size: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self.batch, self.block_size = batch, block_size
        self.layers = [LayerKVCache(batch, n_kv_head, block_size, head_dim, dtype, device) for _ in range(n_layer)]

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch: int) -> "KVCache":
        c, p = model.config, next(model.parameters())
        return cls(c.n_layer, batch, c.kv_heads, c.block_size, c.head_dim, dtype=p.dtype, device=p.device)

    @staticmethod
    def nbytes_for(model: torch.nn.Module, batch: int) -> int:
        """Bytes ``for_model(model, batch)`` allocates (k and v of every layer), without allocating them."""
        c, p = model.config, next(model.parameters())
        return 2 * c.n_layer * batch * c.kv_heads * c.block_size * c.head_dim * p.element_size()
