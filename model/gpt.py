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
from typing import Callable, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.attention import get_backend, get_kv_backend, get_qkvpacked_backend, get_static_kv_backend
from model.kv_cache import KVCache, LayerKVCache


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
        for name, value in (("n_embd", config.n_embd), ("n_head", config.n_head), ("n_kv_head", config.kv_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
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
        self.qkvpacked_attention = get_qkvpacked_backend(config.attn)  # the same on the fused qkv, or None
        self.kv_attention = get_kv_backend(config.attn)  # new queries against a KV cache (generation)
        self.static_kv_attention = get_static_kv_backend(config.attn)  # the same with fixed shapes, or None
        self.attn_name = config.attn

    def forward(self, x: torch.Tensor, kv_cache: Optional[LayerKVCache] = None,
                start_pos: int | torch.Tensor = 0, docs: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.c_attn(x)
        dropout_p = self.dropout if self.training else 0.0
        if kv_cache is None and docs is None and self.qkvpacked_attention is not None:
            # One tensor in: the backward writes qkv's gradient in place, not three that autograd concatenates.
            y = self.qkvpacked_attention(qkv.view(B, T, -1, self.head_dim), self.n_head, dropout_p, self.window)
            return self.resid_dropout(self.c_proj(y.view(B, T, C)))
        q, k, v = qkv.split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim], dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)      # (B, n_head, T, hs)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)   # (B, n_kv_head, T, hs)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if kv_cache is not None and isinstance(start_pos, torch.Tensor):  # fixed shapes: the whole cache, masked
            if self.static_kv_attention is None:
                raise ValueError(f"attn={self.attn_name} has no static-shape decode (CUDA graphs); "
                                 "use sdpa, fa2 or fa3")
            k, v = kv_cache.update(start_pos, k, v)
            y = self.static_kv_attention(q, k, v, start_pos + T)
        elif kv_cache is not None:  # attend over every cached position 0 .. start_pos+T-1
            k, v = kv_cache.update(start_pos, k, v)
            y = self.kv_attention(q, k, v, dropout_p=dropout_p)
        else:
            y = self.attention(q, k, v, dropout_p=dropout_p, window=self.window, docs=docs)
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

    def forward(self, x: torch.Tensor, kv_cache: Optional[LayerKVCache] = None,
                start_pos: int | torch.Tensor = 0, docs: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, start_pos, docs)
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

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None, return_logits: bool = True,
                kv_cache: Optional[KVCache] = None, start_pos: int | torch.Tensor = 0,
                docs: Optional[torch.Tensor] = None):
        """idx: (B, T) int64 token ids, T <= block_size; targets: (B, T) int64 or None; docs: the documents of
        the flattened batch as int32 cu_seqlens (0 .. B * T, every multiple of T among them; ``data.sampler``):
        attention stays within each document (not with ``kv_cache``).

        Returns (logits, loss):
        - with targets: the mean cross-entropy (float32 scalar; targets == -1 are ignored) and the
          logits (B, T, vocab_size), or None for them with ``return_logits=False``. Training and
          evaluation pass False: returned logits stay alive until the caller drops them (through
          the backward), which costs B * T * vocab_size activations of memory (6 GiB for GPT-2 at
          B=32, T=1024 in bf16+fp32).
        - without targets: the logits of the last position only, (B, 1, vocab_size), and None.

        With ``kv_cache`` (inference only, see ``_forward_cached``), idx holds the tokens at positions
        start_pos .. start_pos+T-1 and attention also sees the cached positions before them.
        """
        if kv_cache is not None:
            if targets is not None or docs is not None:
                raise ValueError("kv_cache is for inference: pass targets=None and docs=None")
            return self._forward_cached(idx, kv_cache, start_pos)
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x, docs=docs)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return (logits if return_logits else None), loss

    def use_split_kv_decode(self, enabled: bool = True) -> None:
        """Run decode steps (one query per head against the KV cache) through the split-K/V kernel
        ``kernels.decode.fa2_decode`` (flash-decoding) instead of the backend's forward kernel, or back.
        Raises ValueError unless the model's attention backend is fa2 or fa3 (``attn='auto'`` on a GPU included)."""
        kv_attention = get_kv_backend(self.config.attn, split_kv=enabled)
        for block in self.transformer.h:
            block.attn.kv_attention = kv_attention

    def _forward_cached(self, idx: torch.Tensor, kv_cache: KVCache, start_pos: int | torch.Tensor,
                        run_block: Optional[Callable] = None):
        """idx (B, T) int64 at positions start_pos .. start_pos+T-1 -> (logits (B, 1, vocab_size), None).

        Writes the tokens' keys and values into ``kv_cache`` and attends over positions 0 .. start_pos+T-1.
        Raises ValueError when the cache was made for another batch size or model, with model.attn_window, or when
        start_pos + T > block_size (there are no position embeddings beyond it).

        A 0-dim integer tensor start_pos (on the model's device) keeps every shape fixed from step to step,
        so a compiled step compiles once and a step can be a CUDA graph: attention reads the whole cache with the
        positions past start_pos+T-1 masked (sdpa, and fa2/fa3 for T = 1; others raise ValueError). Its range is
        not checked. ``run_block(block, x, layer_cache, start_pos)``, if given, runs each block (a compiled one).
        """
        if any(self.config.layer_window(layer) for layer in range(self.config.n_layer)):
            raise ValueError(f"the KV cache has no sliding window (model.attn_window={self.config.attn_window}); "
                             "generate with kv_cache=False (sample.py --no-kv-cache)")
        B, T = idx.shape
        if B != kv_cache.batch or len(kv_cache.layers) != self.config.n_layer:
            raise ValueError(f"kv_cache holds {kv_cache.batch} sequences for {len(kv_cache.layers)} layers; "
                             f"got a batch of {B} for {self.config.n_layer} layers")
        if isinstance(start_pos, torch.Tensor):
            pos = start_pos.reshape(1) if T == 1 else start_pos + torch.arange(T, dtype=torch.long, device=idx.device)
        elif start_pos < 0 or start_pos + T > self.config.block_size:
            raise ValueError(f"positions {start_pos}..{start_pos + T - 1} exceed block_size={self.config.block_size}")
        else:
            pos = torch.arange(start_pos, start_pos + T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block, layer_cache in zip(self.transformer.h, kv_cache.layers):
            x = block(x, layer_cache, start_pos) if run_block is None else run_block(block, x, layer_cache, start_pos)
        # a slice, not x[:, [-1], :]: a list index is a host tensor copied to the device at every call (not capturable)
        return self.lm_head(self.transformer.ln_f(x[:, -1:, :])), None

    def _last_logits(self, idx: torch.Tensor, run_block: Callable) -> torch.Tensor:
        """``self(idx)[0]`` (no cache: logits (B, 1, vocab_size) of the last position), each block run through
        ``run_block(block, x)``."""
        pos = torch.arange(idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = run_block(block, x)
        return self.lm_head(self.transformer.ln_f(x[:, -1:, :]))

    def release_decode_graph(self) -> None:
        """Free the CUDA graph (and its KV cache) that ``generate(..., cuda_graph=True)`` keeps for the next call."""
        self._decode_graph = None

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, generator: Optional[torch.Generator] = None,
                 num_tokens: Optional[int] = None, kv_cache: bool = False,
                 compile: bool | str = False, cuda_graph: bool = False) -> torch.Tensor:
        """Autoregressive sampling: idx (B, T) int64 -> (B, T + max_new_tokens).
        temperature > 0 divides the logits; top_k keeps only the k most likely tokens (top_k=1 is greedy,
        argmax); num_tokens (the tokenizer's vocabulary) excludes the padding ids >= num_tokens.

        kv_cache=False reruns the model over the last block_size tokens for every new token (nanoGPT).
        kv_cache=True prefills a ``KVCache`` with the prompt (its last block_size tokens) and then runs one
        token per step; when the cache is full it re-prefills the most recent block_size // 2 tokens.
        Prefills run eager.

        compile=True runs the transformer blocks of each step through ``torch.compile``, one block at a time
        (regional compilation: all blocks share one compiled graph, so compiling costs one block, once per batch
        size): with the cache, the fixed-shape decode step (the position a 0-dim device tensor, attention over
        the whole cache with the unused part masked; sdpa, fa2, fa3), or for backends without one (fa1) the
        decode step at an int position, compiled with dynamic shapes; without the cache, the whole context,
        compiled with dynamic shapes (one graph for every length).
        cuda_graph=True (with kv_cache; a CUDA device; sdpa, fa2, fa3) captures the fixed-shape decode step,
        eager or compiled, as one CUDA graph at the first decode step and replays it for every token: a decode
        step is launch-bound, and a replay is one launch. The graph and the cache it writes are kept on the
        model (``release_decode_graph`` frees them) and reused by the next call with the same batch size and
        mode, as long as the parameters stay where they are. compile="cudagraphs" is compile=True,
        cuda_graph=True.
        Raises ValueError for temperature <= 0, an empty prompt, max_new_tokens < 0, an unknown compile, or
        cuda_graph without kv_cache, a static-shape decode or a CUDA device.
        """
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if idx.dim() != 2 or idx.size(1) == 0:
            raise ValueError(f"idx must be (batch, T) token ids with T >= 1, got shape {tuple(idx.shape)}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if compile not in (False, True, "cudagraphs"):
            raise ValueError(f"compile must be False, True or 'cudagraphs' (with kv_cache=True), got {compile!r}")
        if compile == "cudagraphs":
            compile, cuda_graph = True, True
        if cuda_graph and not kv_cache:
            raise ValueError("CUDA graphs (cuda_graph=True or compile='cudagraphs') need the fixed shapes of the "
                             "decode step: use them with kv_cache=True")

        def pick(logits: torch.Tensor) -> torch.Tensor:  # (B, 1, vocab) -> (B, 1) next token ids
            logits = logits[:, -1, :num_tokens].float() / temperature
            if top_k == 1:
                return logits.argmax(-1, keepdim=True)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)

        if kv_cache:
            return self._generate_cached(idx, max_new_tokens, pick, bool(compile), cuda_graph)
        run_block = compiled_block("forward") if compile else None
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size:]
            logits = self(context)[0] if run_block is None else self._last_logits(context, run_block)
            idx = torch.cat((idx, pick(logits)), dim=1)
        return idx

    def _generate_cached(self, idx: torch.Tensor, max_new_tokens: int, pick: Callable[[torch.Tensor], torch.Tensor],
                         compile: bool, cuda_graph: bool) -> torch.Tensor:
        block_size = self.config.block_size
        # Fixed shapes (the position a device tensor, the whole cache masked) where the backend has them, for
        # compiled steps (one compile) and CUDA graphs; eager steps attend over the filled prefix only.
        static = (compile or cuda_graph) and self.transformer.h[0].attn.static_kv_attention is not None
        if cuda_graph and not static:
            raise ValueError(f"CUDA graphs: attn={self.config.attn} has no static-shape decode; use sdpa, fa2 or fa3")
        run_block = None if not compile else compiled_block("decode" if static else "decode_dynamic")
        graph = None
        if cuda_graph:
            graph = self._reusable_decode_graph(idx.size(0), compile, idx.device)
            cache = graph.cache
        else:
            cache = KVCache.for_model(self, idx.size(0))
        position = torch.zeros((), dtype=torch.long, device=idx.device) if static and graph is None else None

        def step(token: torch.Tensor, cache: KVCache, start_pos: int | torch.Tensor) -> torch.Tensor:
            return self._forward_cached(token, cache, start_pos, run_block)[0]

        context = idx[:, -block_size:]
        logits, _ = self(context, kv_cache=cache, start_pos=0)  # prefill
        pos = context.size(1)  # tokens in the cache
        for i in range(max_new_tokens):
            token = pick(logits)
            idx = torch.cat((idx, token), dim=1)
            if i == max_new_tokens - 1:
                break
            if pos < block_size:  # decode: one token against the cache
                if graph is not None:
                    logits = graph(token, pos, step)
                else:
                    logits = step(token, cache, pos if position is None else position.fill_(pos))
                pos += 1
            else:
                # The position embeddings are learned for 0..block_size-1 only, so the cache cannot slide:
                # keys cached at one position cannot be reused at another. Restart from the most recent half
                # of the context instead, at positions 0.., which leaves block_size // 2 cheap decode steps
                # before the next re-prefill (prefill work amortised over many tokens).
                context = idx[:, -max(1, block_size // 2):]
                logits, _ = self(context, kv_cache=cache, start_pos=0)
                pos = context.size(1)
        return idx

    def _reusable_decode_graph(self, batch: int, compiled: bool, device: torch.device) -> "DecodeGraph":
        """The kept ``DecodeGraph`` if it was made for this batch size, mode, device, dtype and parameter
        addresses (a graph reads the parameters where they were at capture), else a new one (replacing it)."""
        key = (batch, compiled, device, next(self.parameters()).dtype, tuple(p.data_ptr() for p in self.parameters()))
        kept = getattr(self, "_decode_graph", None)
        if kept is None or kept[0] != key:
            self._decode_graph = None  # free the old graph's memory first
            self._decode_graph = (key, DecodeGraph(KVCache.for_model(self, batch)))
        return self._decode_graph[1]


class DecodeGraph:
    """A decode step captured as one CUDA graph, with the buffers it reads at fixed addresses: the KV cache
    (prefills write into it in place), the token (B, 1) and the position (a 0-dim tensor). Captured on the first
    call; every call copies the token and the position in and replays."""

    def __init__(self, cache: KVCache):
        device = cache.layers[0].k.device
        self.cache = cache
        self.token = torch.zeros((cache.batch, 1), dtype=torch.long, device=device)
        self.position = torch.zeros((), dtype=torch.long, device=device)
        self.replay: Optional[Callable[[], torch.Tensor]] = None

    def __call__(self, token: torch.Tensor, pos: int, step: Callable) -> torch.Tensor:
        """logits (B, 1, vocab_size) of ``step(token, cache, position)`` at position ``pos``: a tensor of the
        graph, overwritten by the next call."""
        self.token.copy_(token)
        self.position.fill_(pos)
        if self.replay is None:
            self.replay = capture_cuda_graph(lambda: step(self.token, self.cache, self.position), self.token.device)
        return self.replay()


def capture_cuda_graph(fn: Callable[[], torch.Tensor], device: torch.device, warmup: int = 2
                       ) -> Callable[[], torch.Tensor]:
    """Capture ``fn()`` as a CUDA graph; returns ``replay() -> out``, where out is the tensor fn returned during
    the capture, overwritten by every replay. fn must read and write only tensors at fixed addresses, do the same
    work every time, and be safe to repeat: it runs ``warmup`` times first (on a side stream, as
    ``torch.cuda.graphs`` asks; compiling, autotuning and allocating happen there), then once in the capture,
    which records its kernels without running them. Raises ValueError on a non-CUDA device."""
    if torch.device(device).type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


# Regional compilation for generation: one transformer block is compiled, and every block runs through that one
# graph (the blocks share code and shapes, and their weights are inputs of the graph), so compiling costs one
# block, not n_layer of them. One function per kind of step, as dynamo's compile cache (and its recompile limit)
# is per function: the fixed-shape decode step (static shapes: one graph per batch size), the decode step at an
# int position (dynamic shapes from the first call: the position is symbolic, so it does not compile for the
# first position and again for the rest) and the uncached forward (dynamic shapes: one graph for every length).
def _decode_block(block: Block, x: torch.Tensor, cache: LayerKVCache, start_pos: torch.Tensor) -> torch.Tensor:
    return block(x, cache, start_pos)


def _decode_block_dynamic(block: Block, x: torch.Tensor, cache: LayerKVCache, start_pos: int) -> torch.Tensor:
    return block(x, cache, start_pos)


def _forward_block(block: Block, x: torch.Tensor) -> torch.Tensor:
    return block(x)


_COMPILED: dict[str, Callable] = {}


def compiled_block(kind: str) -> Callable:
    """The compiled block function of ``kind``: 'decode' (fixed shapes), 'decode_dynamic' (int position) or
    'forward' (no cache), made once per process."""
    if kind not in _COMPILED:
        fn, dynamic = {"decode": (_decode_block, False), "decode_dynamic": (_decode_block_dynamic, True),
                       "forward": (_forward_block, True)}[kind]
        _COMPILED[kind] = torch.compile(fn, dynamic=dynamic)
    return _COMPILED[kind]
