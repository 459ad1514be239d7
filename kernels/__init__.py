"""Our Triton FlashAttention kernels: `fa2_attention` (FlashAttention-2) and `fa1_attention` (the FA1 baseline).

To run them without a GPU, set TRITON_INTERPRET=1 before importing this package (slow; for tests).
"""

import math

from . import fa1, fa2
from .frontend import PUBLIC_DOC, make_attention

fa2_attention = make_attention("fa2", fa2.forward, fa2.backward, lse_log_base=2.0)
fa2_attention.__doc__ = PUBLIC_DOC.format(
    title="FlashAttention-2 (Triton): exact scaled dot-product attention, forward and backward.",
    source="Dao 2023, FlashAttention-2, Algorithm 1 (forward) and 2 (backward); see kernels/fa2.py.",
)
fa1_attention = make_attention("fa1", fa1.forward, fa1.backward, lse_log_base=math.e)
fa1_attention.__doc__ = PUBLIC_DOC.format(
    title="FlashAttention-1 baseline (Triton): exact scaled dot-product attention, forward and backward.",
    source="Dao et al. 2022, FlashAttention, Algorithm 1 (forward) and 4 (backward); see kernels/fa1.py.",
)

__all__ = ["fa1_attention", "fa2_attention"]
