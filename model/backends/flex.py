"""``attn=flex``: PyTorch FlexAttention (``torch.nn.attention.flex_attention``) with block masks for the causal
mask, windows and documents: the peer that fa2's sliding windows and packed documents are compared against; logit
soft-capping (``softcap``) through a ``score_mod`` beside the block mask.

Compiled on CUDA; on the CPU PyTorch's eager (unfused, slow) implementation, and no torch.compile of the model
for training (Inductor has no CPU Flex backward). No attention dropout. The masks and the call are in
``model/backends/flex_masks.py``, imported when the backend is loaded (importing it compiles).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Optional

import torch

from model.backends.base import Backend, BackendUnavailableError


@dataclass(frozen=True, eq=False, kw_only=True)
class FlexBackend(Backend):
    supports_window: bool = True
    supports_docs: bool = True
    supports_softcap: bool = True
    compiles_on_cpu: bool = False

    @cached_property
    def flex(self) -> Callable:
        if not torch.cuda.is_available():
            warnings.warn("attn=flex: no CUDA GPU, running FlexAttention's unfused eager implementation (it "
                          "materializes the scores); slow, meant for testing only", RuntimeWarning, stacklevel=4)
        try:
            from model.backends.flex_masks import attention
        except ImportError as e:  # torch < 2.5 has no torch.nn.attention.flex_attention
            raise BackendUnavailableError(f"attn=flex is not available with torch {torch.__version__} "
                                          f"({type(e).__name__}: {e}); it needs torch >= 2.5") from e
        return attention

    def load(self) -> "FlexBackend":
        self.flex  # noqa: B018 (imports it once; the call forms then read the cached function)
        return self

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                  causal: bool = True, window: int = 0, docs: Optional[torch.Tensor] = None,
                  softcap: float = 0.0) -> torch.Tensor:
        self.refuse_dropout(dropout_p)
        return self.flex(q, k, v, causal, window, docs, softcap)
