"""Our FlashAttention kernels: `fa3_attention` (FlashAttention-3 in Gluon for Hopper, forward and backward),
`fa2_attention` / `fa2_varlen_attention` (FlashAttention-2 in Triton, with sliding windows, packed
variable-length sequences and logit soft-capping; fa3 has all three too, packed sequences in
`fa3_varlen_attention`), `fa1_attention` (the FA1 baseline) and `fa2_decode` (split-K/V decode: one query per
(batch, head) against a KV cache). `fa*_qkvpacked_attention` and `fa*_varlen_qkvpacked_attention` take one packed
qkv tensor (a fused projection's output) and write its gradient in place.

    frontend.py        validation, layouts, the torch.library ops and autograd shared by every kernel
    common.py          Triton helpers the kernels share: tile loads/stores, masks, TMA checks, the backward's preprocess
    launch.py          kernel launches: a specialisation's later launches skip Triton's binder and autotuner
    fa1.py             FlashAttention-1 (Triton): forward and backward launchers
    fa2.py             FlashAttention-2 (Triton): forward, three-kernel backward, sliding windows, varlen, softcap
    fa3.py             FlashAttention-3: `plan()` (Gluon kernel or FA2, from one table of rules), configs, launchers
    fa3_hopper.py      the Gluon forward (warp-specialised, ping-pong, persistent)
    fa3_hopper_bwd.py  the Gluon backward (dQ through TMA reduce-adds)
    fa3_schedule.py    packed sequences' per-row key bounds and longest-first tile orders, for both
    gluon_compat.py    what differs between Triton 3.6 and 3.9 (Gluon names, a PTX fix), in one place
    decode.py          split-K/V decode kernel (softcap too)
    cross_entropy.py   the loss of model.loss=fused: each row's cross-entropy, its gradient written over the logits

To run them without a GPU, set TRITON_INTERPRET=1 before importing this package (slow; for tests).
"""

import math

from . import fa1, fa2, fa3
from .decode import fa2_decode
from .frontend import (
    DETERMINISTIC_GRADIENTS, PUBLIC_DOC, QKVPACKED_DOC, VARLEN_DOC, VARLEN_QKVPACKED_DOC, make_attention,
    make_varlen_attention,
)

fa2_attention, fa2_qkvpacked_attention = make_attention("fa2", fa2.forward, fa2.backward, lse_log_base=2.0,
                                                        masks=True, softcap=True)
fa2_attention.__doc__ = PUBLIC_DOC.format(
    title="FlashAttention-2 (Triton): exact scaled dot-product attention, forward and backward.",
    source="Dao 2023, FlashAttention-2, Algorithm 1 (forward) and 2 (backward); see kernels/fa2.py.",
    gradients=DETERMINISTIC_GRADIENTS,
)
fa2_qkvpacked_attention.__doc__ = QKVPACKED_DOC.format(
    title="FlashAttention-2 (Triton) over a packed qkv: forward and backward.", name="fa2",
    gradients=DETERMINISTIC_GRADIENTS)
fa2_varlen_attention, fa2_varlen_qkvpacked_attention = make_varlen_attention("fa2", lse_log_base=2.0)
fa2_varlen_attention.__doc__ = VARLEN_DOC.format(
    title="FlashAttention-2 (Triton) over packed variable-length sequences: forward and backward.",
    source="Dao 2023, FlashAttention-2, with flash-attn's varlen and window conventions; see kernels/fa2.py.",
    gradients=DETERMINISTIC_GRADIENTS,
)
fa2_varlen_qkvpacked_attention.__doc__ = VARLEN_QKVPACKED_DOC.format(
    title="FlashAttention-2 (Triton) over a packed qkv of packed variable-length sequences: forward and backward.",
    name="fa2", gradients=DETERMINISTIC_GRADIENTS)
fa1_attention, fa1_qkvpacked_attention = make_attention("fa1", fa1.forward, fa1.backward, lse_log_base=math.e)
fa1_attention.__doc__ = PUBLIC_DOC.format(
    title="FlashAttention-1 baseline (Triton): exact scaled dot-product attention, forward and backward.",
    source="Dao et al. 2022, FlashAttention, Algorithm 1 (forward) and 4 (backward); see kernels/fa1.py.",
    gradients=DETERMINISTIC_GRADIENTS,
)
fa1_qkvpacked_attention.__doc__ = QKVPACKED_DOC.format(
    title="FlashAttention-1 baseline (Triton) over a packed qkv: forward and backward.", name="fa1",
    gradients=DETERMINISTIC_GRADIENTS)

FA3_GRADIENTS = ("the Gluon backward adds dQ up through TMA reduce-adds, whose order varies, so dq is not "
                 "bit-reproducible, except on unpacked sequences with a window of at most 128 keys on each side, or at "
                 "head_dim 64 with 1024 keys, where FA2's dQ kernel follows the Gluon dK/dV kernel "
                 "(kernels.fa3.NARROW_WINDOW_BACKWARD_CONFIGS, SHORT_BACKWARD_CONFIGS); under "
                 "torch.use_deterministic_algorithms(True) those run, and that kernel pair for any sliding window on "
                 "unpacked sequences at head_dim 96 and 128 (DETERMINISTIC_WINDOW_BACKWARD_CONFIGS), FA2's "
                 "atomic-free backward everywhere else: deterministic.")
fa3_attention, fa3_qkvpacked_attention = make_attention("fa3", fa3.forward, fa3.backward, lse_log_base=2.0,
                                                        masks=True, softcap=True)
fa3_attention.__doc__ = PUBLIC_DOC.format(
    title="FlashAttention-3 (Gluon, Hopper): exact scaled dot-product attention, forward and backward.",
    source="Shah et al. 2024, FlashAttention-3, Section 3.1 and Algorithm 2 (forward), Appendix B.1 (backward: dQ "
           "through TMA reduce-add; FA2's Algorithm 2 where it measured faster: kernels.fa3.BACKWARD_MIN_SEQLEN_K, "
           "and FA2's dQ kernel after the Gluon dK/dV kernel: kernels.fa3.NARROW_WINDOW_BACKWARD_CONFIGS, "
           "SHORT_BACKWARD_CONFIGS); "
           "see kernels/fa3.py. Sliding windows in the Gluon kernels (key blocks outside the band never visited). Where "
           "the Gluon kernels do not apply (not an sm_90 GPU, head_dim other than 64/96/128/256, the backward at 256, "
           "float32, inputs TMA cannot address, a Triton outside 3.6-3.9) FA2's kernels run, with a one-time "
           "RuntimeWarning naming the reason.",
    gradients=FA3_GRADIENTS,
)
fa3_qkvpacked_attention.__doc__ = QKVPACKED_DOC.format(
    title="FlashAttention-3 (Gluon, Hopper) over a packed qkv: forward and backward, FA2's where the Gluon kernels "
          "do not apply (as fa3_attention).", name="fa3", gradients=FA3_GRADIENTS)
fa3_varlen_attention, fa3_varlen_qkvpacked_attention = make_varlen_attention("fa3", lse_log_base=2.0)
fa3_varlen_attention.__doc__ = VARLEN_DOC.format(
    title="FlashAttention-3 (Gluon, Hopper) over packed variable-length sequences: packed self-attention (one set "
          "of offsets: cu_seqlens_k with cu_seqlens_q's values, the same tensor costing no check) runs the Gluon "
          "kernels, each row seeing its own sequence's keys through per-row bounds; two different sets of offsets, "
          "and whatever fa3_attention sends to FA2, run FA2's varlen kernels with the one-time RuntimeWarning naming "
          "the reason.",
    source="Shah et al. 2024, FlashAttention-3, with flash-attn's varlen and window conventions; see kernels/fa3.py "
           "(`RULES`, `doc_bounds`).",
    gradients=FA3_GRADIENTS,
)

fa3_varlen_qkvpacked_attention.__doc__ = VARLEN_QKVPACKED_DOC.format(
    title="FlashAttention-3 (Gluon, Hopper) over a packed qkv of packed variable-length sequences: forward and "
          "backward, on the Gluon kernels as fa3_varlen_attention's packed self-attention, FA2's where they do not "
          "apply.", name="fa3", gradients=FA3_GRADIENTS)

__all__ = ["fa1_attention", "fa1_qkvpacked_attention", "fa2_attention", "fa2_decode", "fa2_qkvpacked_attention",
           "fa2_varlen_attention", "fa2_varlen_qkvpacked_attention", "fa3_attention", "fa3_qkvpacked_attention",
           "fa3_varlen_attention", "fa3_varlen_qkvpacked_attention"]
