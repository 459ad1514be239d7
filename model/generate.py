"""Generation for ``model.gpt.GPT``: sampling, the KV-cache decode loop, compiled decode blocks and CUDA graphs.

The model is in ``model/gpt.py`` (its ``forward`` and ``forward_cached``, with a ``KVCache`` from
``model/kv_cache.py``); this module runs it token by token. ``GPT.generate`` calls ``generate``.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.kv_cache import KVCache, LayerKVCache


@torch.no_grad()
def generate(model: nn.Module, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: Optional[int] = None, generator: Optional[torch.Generator] = None,
             num_tokens: Optional[int] = None, kv_cache: bool = False,
             compile: bool | str = False, cuda_graph: bool = False) -> torch.Tensor:
    """Autoregressive sampling from ``model`` (a ``model.gpt.GPT``): idx (B, T) int64 -> (B, T + max_new_tokens).
    temperature (finite, > 0) divides the logits; top_k keeps only the k most likely tokens (top_k=1 is greedy,
    argmax; None or 0: all, as sample.py's --top-k 0);
    num_tokens (the tokenizer's vocabulary) excludes the padding ids >= num_tokens.

    kv_cache=False reruns the model over the last block_size tokens for every new token (nanoGPT).
    kv_cache=True prefills a ``KVCache`` with the prompt (its last block_size tokens) and then runs one token per
    step; when the cache is full it re-prefills the most recent block_size // 2 tokens. Prefills run eager.

    compile=True runs the transformer blocks of each step through ``torch.compile``, one block at a time
    (regional compilation: all blocks share one compiled graph, so compiling costs one block, once per batch
    size): with the cache, the fixed-shape decode step (the position a 0-dim device tensor, attention over the
    whole cache with the unused part masked; backends with ``static_decode``: sdpa, fa2, fa3), or for backends
    without one (fa1) the decode step at an int position, compiled with dynamic shapes; without the cache, the
    whole context, compiled with dynamic shapes (one graph for every length).
    cuda_graph=True (with kv_cache; a CUDA device; a backend with ``static_decode``) captures the fixed-shape
    decode step, eager or compiled, as one CUDA graph at the first decode step and replays it for every token: a
    decode step is launch-bound, and a replay is one launch. The graph and the cache it writes are kept on the
    model (``GPT.release_decode_graph`` frees them) and reused by the next call with the same batch size and
    mode, as long as the parameters stay where they are. compile="cudagraphs" is compile=True, cuda_graph=True.
    Raises ValueError for a temperature that is not a finite number > 0, a top_k that is not None or an int >= 0,
    an empty prompt, max_new_tokens < 0, an unknown compile, or cuda_graph without kv_cache, a static-shape decode
    or a CUDA device.
    """
    compile, cuda_graph = _check_options(idx, max_new_tokens, temperature, top_k, kv_cache, compile, cuda_graph)
    pick = partial(sample_next, temperature=temperature, top_k=top_k or None, num_tokens=num_tokens,
                   generator=generator)
    if kv_cache:
        return _generate_cached(model, idx, max_new_tokens, pick, compile, cuda_graph)
    run_block = compiled_block("forward") if compile else None
    for _ in range(max_new_tokens):
        context = idx[:, -model.config.block_size:]
        logits = model(context)[0] if run_block is None else _last_logits(model, context, run_block)
        idx = torch.cat((idx, pick(logits)), dim=1)
    return idx


def _check_options(idx: torch.Tensor, max_new_tokens: int, temperature: float, top_k: Optional[int],
                   kv_cache: bool, compile: bool | str, cuda_graph: bool) -> tuple[bool, bool]:
    """(compile, cuda_graph) with compile='cudagraphs' spelled out; raises ValueError as ``generate`` says."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"top_k must be None or an int >= 0 (0 or None: every token; 1: greedy), got {top_k!r}")
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
    return bool(compile), bool(cuda_graph)


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                num_tokens: Optional[int] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next token ids (B, 1) int64 from logits (B, T, vocab_size) of the last position: the first num_tokens ids
    (all if None), divided by temperature, the top_k most likely (top_k=1: argmax), sampled with generator."""
    logits = logits[:, -1, :num_tokens].float()
    # shifted to a maximum of 0 first (softmax is shift-invariant), and a temperature below float32's smallest
    # normal taken as that: a tiny one then sends the others to -inf, not every logit to +-inf or 0 / 0 (NaN)
    logits = (logits - logits.amax(-1, keepdim=True)) / max(temperature, torch.finfo(torch.float32).tiny)
    if top_k == 1:
        return logits.argmax(-1, keepdim=True)
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits[logits < v[:, [-1]]] = -float("inf")
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)


def _last_logits(model: nn.Module, idx: torch.Tensor, run_block: Callable) -> torch.Tensor:
    """``model(idx)[0]`` (no cache: logits (B, 1, vocab_size) of the last position), each block run through
    ``run_block(block, x, rope)``."""
    pos = torch.arange(idx.size(1), dtype=torch.long, device=idx.device)
    x, rope = model.embed(idx, pos), model.rope(pos)
    for block in model.transformer.h:
        x = run_block(block, x, rope)
    return model.lm_head(model.transformer.ln_f(x[:, -1:, :]))


def _generate_cached(model: nn.Module, idx: torch.Tensor, max_new_tokens: int,
                     pick: Callable[[torch.Tensor], torch.Tensor], compile: bool, cuda_graph: bool) -> torch.Tensor:
    block_size = model.config.block_size
    # Fixed shapes (the position a device tensor, the whole cache masked) where the backend has them, for
    # compiled steps (one compile) and CUDA graphs; eager steps attend over the filled prefix only.
    static = (compile or cuda_graph) and model.backend.static_decode
    if cuda_graph and not static:
        raise ValueError(f"CUDA graphs: {model.backend.lacks('static_decode')}")
    run_block = None if not compile else compiled_block("decode" if static else "decode_dynamic")
    graph = reusable_decode_graph(model, idx.size(0), compile, idx.device) if cuda_graph else None
    cache = graph.cache if graph is not None else KVCache.for_model(model, idx.size(0))
    position = torch.zeros((), dtype=torch.long, device=idx.device) if static and graph is None else None

    def step(token: torch.Tensor, cache: KVCache, start_pos: int | torch.Tensor) -> torch.Tensor:
        return model.forward_cached(token, cache, start_pos, run_block)[0]

    context = idx[:, -block_size:]
    logits, _ = model(context, kv_cache=cache, start_pos=0)  # prefill
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
            # The position embeddings (and RoPE tables) cover 0..block_size-1 only, so the cache cannot slide:
            # keys cached at one position cannot be reused at another. Restart from the most recent half
            # of the context instead, at positions 0.., which leaves block_size // 2 cheap decode steps
            # before the next re-prefill (prefill work amortised over many tokens).
            context = idx[:, -max(1, block_size // 2):]
            logits, _ = model(context, kv_cache=cache, start_pos=0)
            pos = context.size(1)
    return idx


def reusable_decode_graph(model: nn.Module, batch: int, compiled: bool, device: torch.device) -> "DecodeGraph":
    """The ``DecodeGraph`` kept on the model (``model._decode_graph``) if it was made for this batch size, mode,
    device, dtype and parameter addresses (a graph reads the parameters where they were at capture), else a new
    one (replacing it)."""
    params = list(model.parameters())
    key = (batch, compiled, device, params[0].dtype, tuple(p.data_ptr() for p in params))
    kept = model._decode_graph
    if kept is None or kept[0] != key:
        model._decode_graph = None  # free the old graph's memory first
        model._decode_graph = (key, DecodeGraph(KVCache.for_model(model, batch)))
    return model._decode_graph[1]


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
# rope: the cos, sin of the step's positions (``GPT.rope``), or None for learned position embeddings.
Rope = Optional[tuple[torch.Tensor, torch.Tensor]]


def _decode_block(block: nn.Module, x: torch.Tensor, cache: LayerKVCache, start_pos: torch.Tensor,
                  rope: Rope = None) -> torch.Tensor:
    return block(x, cache, start_pos, rope=rope)


def _decode_block_dynamic(block: nn.Module, x: torch.Tensor, cache: LayerKVCache, start_pos: int,
                          rope: Rope = None) -> torch.Tensor:
    return block(x, cache, start_pos, rope=rope)


def _forward_block(block: nn.Module, x: torch.Tensor, rope: Rope = None) -> torch.Tensor:
    return block(x, rope=rope)


_COMPILED: dict[str, Callable] = {}


def compiled_block(kind: str) -> Callable:
    """The compiled block function of ``kind``: 'decode' (fixed shapes), 'decode_dynamic' (int position) or
    'forward' (no cache), made once per process."""
    if kind not in _COMPILED:
        fn, dynamic = {"decode": (_decode_block, False), "decode_dynamic": (_decode_block_dynamic, True),
                       "forward": (_forward_block, True)}[kind]
        _COMPILED[kind] = torch.compile(fn, dynamic=dynamic)
    return _COMPILED[kind]
