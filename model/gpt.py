"""nanoGPT-style GPT (Karpathy's nanoGPT model.py, itself GPT-2 as in Radford et al. 2019), with the options of
newer blocks.

By default GPT-2: token + learned position embeddings, ``n_layer`` pre-LayerNorm blocks (causal self-attention,
GELU MLP), final LayerNorm and an output head tied to the token embedding. Residual output projections are
initialised with std 0.02 / sqrt(2 * n_layer) (GPT-2 paper). ``GPTConfig``'s ``pos_emb`` (rope: rotary q and k),
``norm`` (RMSNorm), ``mlp`` (SwiGLU, ReLU²), ``qk_norm``, ``bias`` and ``tie_embeddings`` give a Llama-3-style
block (conf/model/llama_small.yaml, llama_1b.yaml); the layers are in ``model/layers.py``. At their defaults the
model, its parameter names and its initialisation (the same random draws) are GPT-2's.

Attention is done by a backend of ``model.backends`` named by ``GPTConfig.attn`` (resolved once per model, e.g.
'auto' to fa3, and handed to every layer), with optional grouped-query attention (``n_kv_head`` k/v heads shared
by ``n_head`` q heads) and optional attention logit soft-capping (``attn_softcap``: each score s becomes
softcap * tanh(s / softcap) before the softmax; Gemma 2, Gemma Team 2024) on backends with it (``supports_softcap``).
Generation (sampling, the KV-cache decode loop, CUDA graphs) is in ``model/generate.py``; ``GPT.generate`` calls it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.backends import Backend, resolve_backend
from model.generate import generate as generate_tokens
from model.kv_cache import KVCache, LayerKVCache
from model.layers import MLP, Rotary, apply_rope, document_positions, make_norm, mlp_width
from model.loss import LOSS_CHOICES, head_loss, resolve_loss

POS_EMBS = ("learned", "rope")        # the values of GPTConfig.pos_emb (model.pos_emb)
NORMS = ("layernorm", "rmsnorm")      # GPTConfig.norm
MLPS = ("gelu", "swiglu", "relu2")    # GPTConfig.mlp


@dataclass
class GPTConfig:
    block_size: int = 256        # context length T (tokens)
    vocab_size: int = 50304      # GPT-2's 50257 padded to a multiple of 64
    n_layer: int = 12
    n_head: int = 12             # q heads
    n_kv_head: Optional[int] = None  # k/v heads; None = n_head (multi-head attention)
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = False           # bias in Linear and LayerNorm layers (RMSNorm has none)
    attn: str = "sdpa"           # attention backend name, see model.backends
    # Sliding-window attention: each token sees itself and the attn_window - 1 tokens before it; 0 = full causal.
    # A list gives one value per layer (e.g. [128, 0] * 6: local and global layers alternate).
    attn_window: Union[int, list[int]] = 0
    # Attention logit soft-capping (Gemma 2): each scaled score s becomes attn_softcap * tanh(s / attn_softcap);
    # 0.0 = off. Needs a backend with supports_softcap (fa3, fa2, flex).
    attn_softcap: float = 0.0
    pos_emb: str = "learned"     # learned position embeddings (wpe) | rope: rotary q and k, no wpe
    rope_theta: float = 10000.0  # RoPE base: angles pos * rope_theta^(-2i/head_dim) (Llama 3: 500000)
    norm: str = "layernorm"      # layernorm | rmsnorm (ln_1, ln_2, ln_f and qk_norm's)
    norm_eps: float = 1e-5       # eps of every norm
    mlp: str = "gelu"            # gelu | swiglu | relu2
    mlp_hidden: Optional[int] = None  # MLP hidden width; None = 4 * n_embd, swiglu: model.layers.mlp_width
    multiple_of: int = 256       # swiglu's hidden width (mlp_hidden None) is rounded up to a multiple of this
    qk_norm: bool = False        # RMSNorm over head_dim on q and k before RoPE and attention
    tie_embeddings: bool = True  # the output head is the token embedding matrix
    loss: str = "auto"           # how the head and cross-entropy run: auto | full | chunked | fused (model/loss.py)

    def layer_window(self, layer: int) -> int:
        return self.attn_window if isinstance(self.attn_window, int) else self.attn_window[layer]

    @property
    def windowed(self) -> bool:
        """Some layer has a sliding window."""
        return any(self.layer_window(layer) for layer in range(self.n_layer))

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


def _is_non_negative(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf


def block_option_errors(c) -> list[tuple[str, str]]:
    """(key, what is accepted) for each bad block option of ``c``: a GPTConfig or the ``model`` config section
    (the same field names), so the model and config validation (``trainer.config``) refuse the same values."""
    errors = [(key, f"accepted: {', '.join(values)}")
              for key, values in (("pos_emb", POS_EMBS), ("norm", NORMS), ("mlp", MLPS), ("loss", LOSS_CHOICES))
              if getattr(c, key) not in values]
    for key in ("rope_theta", "norm_eps"):
        if not _is_positive(getattr(c, key)):
            errors.append((key, "must be a finite number > 0"))
    if not _is_non_negative(c.attn_softcap):
        errors.append(("attn_softcap", "must be a finite number >= 0 (0 = no soft-capping)"))
    if not (_is_int(c.multiple_of) and c.multiple_of >= 1):
        errors.append(("multiple_of", "must be an int >= 1"))
    if c.mlp_hidden is not None and not (_is_int(c.mlp_hidden) and c.mlp_hidden >= 1):
        errors.append(("mlp_hidden", "must be an int >= 1 or null (= the rule of model.mlp)"))
    errors += [(key, "must be true or false") for key in ("bias", "qk_norm", "tie_embeddings")
               if not isinstance(getattr(c, key), bool)]
    divides = _is_int(c.n_head) and c.n_head >= 1 and _is_int(c.n_embd) and c.n_embd >= 1 and c.n_embd % c.n_head == 0
    head_dim = c.n_embd // c.n_head if divides else 0
    from kernels.frontend import max_softcap  # the kernels' rule, at the model's softmax_scale 1 / sqrt(head_dim)

    softcap_limit = max_softcap(head_dim ** -0.5) if head_dim else math.inf
    if _is_non_negative(c.attn_softcap) and c.attn_softcap > softcap_limit:
        errors.append(("attn_softcap", f"must be at most {softcap_limit:.3g} at head_dim {head_dim} (1 / "
                                       "sqrt(head_dim) / attn_softcap must stay a normal float32: a cap that large "
                                       "changes no score; 0 = no soft-capping)"))
    if c.pos_emb == "rope" and head_dim % 2:
        errors.append(("pos_emb", f"rope rotates pairs of dims: head_dim = n_embd / n_head = {head_dim} "
                                  "must be even"))
    return errors


def check_shapes(config: GPTConfig) -> None:
    """Raises ValueError for heads or widths that are not ints >= 1 or do not divide, a bad attn_window, or a
    block option outside its accepted values (``block_option_errors``, attn_softcap included)."""
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
    errors = block_option_errors(config)
    if errors:
        raise ValueError("; ".join(f"{key}={getattr(config, key)!r}: {msg}" for key, msg in errors))


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, backend: Backend, layer: int = 0):
        super().__init__()
        self.window = config.layer_window(layer)
        self.softcap = float(config.attn_softcap)
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, config.head_dim
        # q, k, v in one matmul: n_head q heads then n_kv_head k and v heads.
        self.c_attn = nn.Linear(config.n_embd, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.dropout = config.dropout
        if config.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps)
        self.qk_norm = config.qk_norm
        self.backend = backend  # one object shared by every layer of the model
        self.split_kv_decode = False  # decode steps through backend.split_kv_attention (GPT.use_split_kv_decode)

    def forward(self, x: torch.Tensor, kv_cache: Optional[LayerKVCache] = None,
                start_pos: int | torch.Tensor = 0, docs: Optional[torch.Tensor] = None,
                rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """x (B, T, n_embd) -> (B, T, n_embd). rope: cos, sin of the tokens' positions (``GPT.rope``) or None."""
        B, T, C = x.shape
        qkv = self.c_attn(x)
        dropout_p = self.dropout if self.training else 0.0
        packed = kv_cache is None and self.backend.qkvpacked
        transformed = self.qk_norm or rope is not None
        if transformed:  # q and k normed and rotated here, where torch.compile fuses it with the projection
            q, k, v = self.heads(qkv, rope)
            if packed:  # one new packed tensor: the kernel still writes qkv's gradient in place
                qkv = torch.cat((q, k, v), dim=2)
        if packed:
            # One tensor in: the backward writes qkv's gradient in place, not three that autograd concatenates.
            y = self.backend.qkvpacked_attention(qkv.view(B, T, -1, self.head_dim), self.n_head, dropout_p, self.window,
                                                 softcap=self.softcap, docs=docs)
            return self.resid_dropout(self.c_proj(y.view(B, T, C)))
        if not transformed:
            q, k, v = qkv.split(
                [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim], dim=2)
            q = q.view(B, T, self.n_head, self.head_dim)
            k, v = (t.view(B, T, self.n_kv_head, self.head_dim) for t in (k, v))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, hs)
        if kv_cache is None:
            y = self.backend.attention(q, k, v, dropout_p=dropout_p, window=self.window, docs=docs,
                                       softcap=self.softcap)
        elif isinstance(start_pos, torch.Tensor):  # fixed shapes: the whole cache, masked
            k, v = kv_cache.update(start_pos, k, v)
            y = self.backend.static_kv_attention(q, k, v, start_pos + T, softcap=self.softcap)
        else:  # attend over every cached position 0 .. start_pos+T-1
            k, v = kv_cache.update(start_pos, k, v)
            attention = self.backend.split_kv_attention if self.split_kv_decode else self.backend.kv_attention
            y = attention(q, k, v, dropout_p=dropout_p, softcap=self.softcap)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def heads(self, qkv: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection (B, T, (n_head + 2 * n_kv_head) * head_dim) as q (B, T, n_head, head_dim) and
        k, v (B, T, n_kv_head, head_dim); q and k RMS-normed over head_dim (qk_norm), then rotated (rope)."""
        B, T, _ = qkv.shape
        q, k, v = qkv.view(B, T, -1, self.head_dim).split([self.n_head, self.n_kv_head, self.n_kv_head], dim=2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k, v


class Block(nn.Module):
    def __init__(self, config: GPTConfig, backend: Backend, layer: int = 0):
        super().__init__()
        self.ln_1 = make_norm(config.norm, config.n_embd, config.bias, config.norm_eps)
        self.attn = CausalSelfAttention(config, backend, layer)
        self.ln_2 = make_norm(config.norm, config.n_embd, config.bias, config.norm_eps)
        hidden = mlp_width(config.n_embd, config.mlp, config.mlp_hidden, config.multiple_of)
        self.mlp = MLP(config.n_embd, config.mlp, hidden, config.bias, config.dropout)

    def forward(self, x: torch.Tensor, kv_cache: Optional[LayerKVCache] = None,
                start_pos: int | torch.Tensor = 0, docs: Optional[torch.Tensor] = None,
                rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, start_pos, docs, rope)
        return x + self.mlp(self.ln_2(x))


def check_documents(docs, batch: int, seqlen: int, device: torch.device) -> None:
    """``GPT.forward``'s docs for a (batch, seqlen) idx on `device`: an int32 1-D tensor there of cu_seqlens over
    the batch * seqlen flattened tokens, starting at 0, ending at batch * seqlen, non-decreasing, with every
    multiple of seqlen among them (no document crosses a row). Reads the values (a host sync on a GPU).
    TypeError or ValueError naming docs."""
    if not isinstance(docs, torch.Tensor):
        raise TypeError(f"docs must be an int32 torch.Tensor of cu_seqlens, got {type(docs).__name__}")
    if docs.dtype != torch.int32 or docs.dim() != 1 or docs.numel() < 2:
        raise ValueError(f"docs must be a 1-D int32 tensor of at least 2 offsets (cu_seqlens), got {docs.dtype} "
                         f"of shape {tuple(docs.shape)}")
    if docs.device != device:
        raise ValueError(f"docs must be on idx's device {device}, got {docs.device}")
    offsets, total = docs.tolist(), batch * seqlen
    if offsets[0] != 0 or offsets[-1] != total:
        raise ValueError(f"docs must run from 0 to B * T = {batch} * {seqlen} = {total}, got {offsets[0]} .. "
                         f"{offsets[-1]}")
    for i, (a, b) in enumerate(zip(offsets, offsets[1:])):
        if b < a:
            raise ValueError(f"docs must be non-decreasing, but docs[{i + 1}] = {b} < docs[{i}] = {a}")
    missing = sorted(set(range(0, total + 1, seqlen)) - set(offsets))
    if missing:
        raise ValueError(f"docs must hold every multiple of T = {seqlen} (a document cannot cross a row of the "
                         f"batch); {missing[0]} is missing")


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        """Raises ValueError for a bad shape, an unknown ``config.attn`` or ``attn_softcap`` > 0 on a backend without
        soft-capping, BackendUnavailableError when the backend's kernels cannot be loaded (``model.backends``)."""
        super().__init__()
        check_shapes(config)
        backend = resolve_backend(config.attn, config.head_dim, softcap=config.attn_softcap > 0)
        backend.refuse_softcap(config.attn_softcap)
        self.backend = backend.load()
        self.config = config
        learned = config.pos_emb == "learned"
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            **(dict(wpe=nn.Embedding(config.block_size, config.n_embd)) if learned else {}),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, self.backend, layer) for layer in range(config.n_layer)]),
            ln_f=make_norm(config.norm, config.n_embd, config.bias, config.norm_eps),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.rotary = None if learned else Rotary(config.head_dim, config.block_size, config.rope_theta)
        self._decode_graph = None  # (key, DecodeGraph) that model.generate keeps for the next generation
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
        """Parameter count; with non_embedding, the embedding look-ups are left out: the position embeddings,
        and the token embedding unless it is tied to, and used as, the output head (tie_embeddings)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            lookups = [self.transformer[name] for name in ("wpe", "wte") if name in self.transformer]
            n -= sum(m.weight.numel() for m in lookups if m.weight is not self.lm_head.weight)
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
                docs: Optional[torch.Tensor] = None, check_docs: bool = True):
        """idx: (B, T) int64 token ids, T <= block_size; targets: (B, T) int64 or None; docs: the documents of
        the flattened batch as int32 cu_seqlens (0 .. B * T, non-decreasing, every multiple of T among them; empty
        segments allowed, as ``data.sampler`` pads them):
        attention stays within each document (not with ``kv_cache``), and with pos_emb=rope each document's
        positions start at 0 (learned position embeddings keep the window's positions 0 .. T-1). docs are checked
        (``check_documents``: a host sync) unless check_docs=False or under torch.compile; the kernels trust
        them, and offsets outside the batch read and write outside its memory. The trainer passes False: its
        sampler's offsets hold by construction.

        Returns (logits, loss):
        - with targets: the mean cross-entropy (float32 scalar; targets == -1 are ignored) and the
          logits (B, T, vocab_size), or None for them with ``return_logits=False``. Training and
          evaluation pass False: returned logits stay alive until the caller drops them (through
          the backward), which costs B * T * vocab_size activations of memory (6 GiB for GPT-2 at
          B=32, T=1024 in bf16+fp32). With return_logits=False, ``config.loss`` (``model.loss``) says how
          the head and the loss run: ``full`` materialises the logits, ``chunked`` one chunk of them at a time,
          ``fused`` one kernel, ``auto`` fused on a CUDA GPU and full elsewhere (``model.loss``).
        - without targets: the logits of the last position only, (B, 1, vocab_size), and None.

        With ``kv_cache`` (inference only, see ``forward_cached``), idx holds the tokens at positions
        start_pos .. start_pos+T-1 and attention also sees the cached positions before them.
        """
        if kv_cache is not None:
            if targets is not None or docs is not None:
                raise ValueError("kv_cache is for inference: pass targets=None and docs=None")
            return self.forward_cached(idx, kv_cache, start_pos)
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}")
        if docs is not None and check_docs and not torch.compiler.is_compiling():
            check_documents(docs, B, T, idx.device)
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.embed(idx, pos)
        rope = self.rope(pos if docs is None or self.rotary is None else document_positions(docs, B, T))
        for block in self.transformer.h:
            x = block(x, docs=docs, rope=rope)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        how = resolve_loss(self.config.loss, x.device.type)
        if return_logits or how == "full":
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
            return (logits if return_logits else None), loss
        # the head's weight, not the module: with trainer.fp8 lm_head is a Float8Linear, which these do not call
        return None, head_loss(x.flatten(0, 1), self.lm_head.weight, targets.flatten(), how)

    def embed(self, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Token + position embeddings (then dropout) of idx (B, T) int64 at positions pos (T,) -> (B, T, n_embd);
        with pos_emb=rope the token embeddings only (the positions enter through ``rope``)."""
        if self.rotary is not None:
            return self.transformer.drop(self.transformer.wte(idx))
        return self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))

    def rope(self, pos: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """cos, sin (pos.shape + (1, head_dim/2), float32) of integer positions pos, (T,) or (B, T), each
        < block_size, for every layer's q and k (``model.layers.apply_rope``); None with learned positions."""
        return None if self.rotary is None else self.rotary(pos)

    def use_split_kv_decode(self, enabled: bool = True) -> None:
        """Run decode steps (one query per head against the KV cache) through the split-K/V kernel
        ``kernels.fa2_decode`` (flash-decoding) instead of the backend's forward kernel, or back.
        Raises ValueError unless the model's backend has it (``Backend.split_kv``: fa2, fa3)."""
        if enabled and not self.backend.split_kv:
            raise ValueError(self.backend.lacks("split_kv"))
        for block in self.transformer.h:
            block.attn.split_kv_decode = enabled

    def forward_cached(self, idx: torch.Tensor, kv_cache: KVCache, start_pos: int | torch.Tensor,
                       run_block: Optional[Callable] = None):
        """idx (B, T) int64 at positions start_pos .. start_pos+T-1 -> (logits (B, 1, vocab_size), None).

        Writes the tokens' keys and values into ``kv_cache`` and attends over positions 0 .. start_pos+T-1.
        Raises ValueError when the cache was made for another batch size or model, with model.attn_window, or when
        start_pos + T > block_size (there are no position embeddings or RoPE tables beyond it).

        A 0-dim integer tensor start_pos (on the model's device) keeps every shape fixed from step to step,
        so a compiled step compiles once and a step can be a CUDA graph: attention reads the whole cache with the
        positions past start_pos+T-1 masked (``Backend.static_decode``; others raise ValueError). Its range is
        not checked. ``run_block(block, x, layer_cache, start_pos, rope)``, if given, runs each block (a compiled
        one; rope: ``GPT.rope`` of the positions).
        """
        if self.config.windowed:
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
        x, rope = self.embed(idx, pos), self.rope(pos)  # the new tokens' positions follow the cached ones
        for block, layer_cache in zip(self.transformer.h, kv_cache.layers):
            if run_block is None:
                x = block(x, layer_cache, start_pos, rope=rope)
            else:
                x = run_block(block, x, layer_cache, start_pos, rope)
        # a slice, not x[:, [-1], :]: a list index is a host tensor copied to the device at every call (not capturable)
        return self.lm_head(self.transformer.ln_f(x[:, -1:, :])), None

    def release_decode_graph(self) -> None:
        """Free the CUDA graph (and its KV cache) that ``generate(..., cuda_graph=True)`` keeps for the next call."""
        self._decode_graph = None

    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, generator: Optional[torch.Generator] = None,
                 num_tokens: Optional[int] = None, kv_cache: bool = False,
                 compile: bool | str = False, cuda_graph: bool = False) -> torch.Tensor:
        """Autoregressive sampling: idx (B, T) int64 -> (B, T + max_new_tokens); ``model.generate.generate``
        documents the options and errors."""
        return generate_tokens(self, idx, max_new_tokens, temperature, top_k, generator, num_tokens, kv_cache,
                               compile, cuda_graph)
