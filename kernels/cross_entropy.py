"""Cross-entropy over a row of logits and its gradient in one kernel, the gradient written over the logits.

For each row r (a token) with target t: lse = logsumexp(logits[r]), loss[r] = lse - logits[r, t], and
logits[r] is overwritten by d loss[r] / d logits[r] = softmax(logits[r]) - onehot(t). A row whose target is
`ignore_index` gets loss 0 and gradient 0. This is the gradient-in-forward of Liger-Kernel's cross-entropy
(Hsu et al. 2024, "Liger Kernel", section 3.3): the loss is a graph's last node, so the gradient only needs scaling
by the scalar that arrives in the backward, and the (tokens, vocab) logits are read twice and written once in one
launch, against inductor's separate forward and backward reductions (GPT-2 at batch 32 x 1024: 3.3 GB of bf16
logits; docs/benchmarks.md measures both).

One program per row: pass 1 keeps a running max and sum (online softmax, Milakov & Gimelshein 2018), pass 2
walks the row backwards, so that the blocks pass 1 read last are read again first, while they are still in L2.
"""

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .common import INTERPRET, LAUNCH_OPTIONS, compile_sm90, next_power_of_2
from .launch import launch


class Config(NamedTuple):
    """The kernel's launch: logits per step of a row (a power of two) and warps per row."""
    block_v: int
    num_warps: int


# 16 logits a thread. H100, 32768 x 50304 bf16 (2026-12-06; python -m tools.cross_entropy_configs): 8192/16 warps
# 2.87 ms, 4096/8 warps 3.08 ms, 2048/8 warps 3.18 ms; inductor's forward + backward 4.56 ms (docs/benchmarks.md)
CONFIG = Config(block_v=8192, num_warps=16)
# CPU tensors take the torch path: the interpreter is ~100x slower. Tests switch this on to run the kernel there.
INTERPRET_ON_CPU = False
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def cross_entropy_kernel(logits_ptr, stride_row, targets_ptr, losses_ptr, V, ignore_index,
                         BLOCK_V: tl.constexpr, GRAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    target = tl.load(targets_ptr + row)
    cols = tl.arange(0, BLOCK_V)
    # Pass 1, in base 2: the running max m (a scalar, one reduction a block) and per lane the sum of 2^(x - m), so
    # that each logit costs one exp2.
    m = float("-inf")
    s = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, BLOCK_V):
        x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32) * LOG2E
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp2(m - m_new) + tl.exp2(x - m_new)
        m = m_new
    lse2 = m + tl.log2(tl.sum(s, 0))
    counted = target != ignore_index
    in_range = (target >= 0) & (target < V)
    picked = tl.load(base + tl.where(in_range, target, 0)).to(tl.float32) * LOG2E
    # A target outside [0, V) that is not ignore_index makes the row's loss nan: the trainer stops on it.
    loss = tl.where(in_range, (lse2 - picked) * LN2, float("nan"))
    tl.store(losses_ptr + row, tl.where(counted, loss, 0.0))
    if GRAD:
        keep = tl.where(counted, 1.0, 0.0)
        for i in range(0, tl.cdiv(V, BLOCK_V)):
            start = (tl.cdiv(V, BLOCK_V) - 1 - i) * BLOCK_V
            offs = start + cols
            x = tl.load(base + offs, mask=offs < V, other=0.0).to(tl.float32)
            p = tl.exp2(x * LOG2E - lse2)
            g = (tl.where(offs == target, p - 1.0, p)) * keep
            tl.store(base + offs, g.to(logits_ptr.dtype.element_ty), mask=offs < V)


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -1,
                       grad: bool = True, config: Optional[Config] = None) -> torch.Tensor:
    """Per-row cross-entropy of `logits` against `targets`; with `grad`, `logits` is overwritten by the gradient.

    logits: (N, V) float16/bfloat16/float32, rows contiguous in their last dimension; targets: (N,) int64 (or
    int32) in [0, V) or `ignore_index`. Returns float32 (N,) losses, 0 for ignored rows and nan for a target out
    of range. With grad=True, logits[r] becomes softmax(logits[r]) - onehot(targets[r]) in logits' dtype (zeros
    for ignored rows): the gradient of sum(losses), not of their mean. Runs the Triton kernel on a GPU (or under
    TRITON_INTERPRET=1 with INTERPRET_ON_CPU, as the tests do), the same math in torch ops on a CPU otherwise;
    `config` (None: CONFIG) is the kernel's launch. Raises ValueError for other shapes.
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1] or logits.stride(-1) != 1:
        raise ValueError(f"logits must be (N, V) with a contiguous last dimension and targets (N,); got logits "
                         f"{tuple(logits.shape)} (strides {logits.stride()}) and targets {tuple(targets.shape)}")
    n, vocab = logits.shape
    if logits.is_cuda or (INTERPRET and INTERPRET_ON_CPU):
        losses = torch.empty(n, dtype=torch.float32, device=logits.device)
        config = config or CONFIG
        if n:
            launch(cross_entropy_kernel, (n,), logits, logits.stride(0), targets, losses, vocab, ignore_index,
                   BLOCK_V=min(config.block_v, next_power_of_2(vocab)), GRAD=grad,
                   num_warps=config.num_warps, **LAUNCH_OPTIONS)
        return losses
    return _cross_entropy_rows_torch(logits, targets, ignore_index, grad)


def _cross_entropy_rows_torch(logits, targets, ignore_index, grad):
    """`cross_entropy_rows` on a CPU, in float32 torch ops."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    counted = targets != ignore_index
    in_range = (targets >= 0) & (targets < logits.shape[1])
    picked = x.gather(1, torch.where(in_range, targets, 0).unsqueeze(1)).squeeze(1)
    losses = torch.where(counted, torch.where(in_range, lse - picked, float("nan")), 0.0)
    if grad:
        g = torch.exp(x - lse.unsqueeze(1))
        g.scatter_add_(1, torch.where(in_range, targets, 0).unsqueeze(1),
                       torch.where(in_range, -1.0, 0.0).unsqueeze(1))
        logits.copy_(torch.where(counted.unsqueeze(1), g, 0.0))
    return losses


def compile_for_sm90(dtype: torch.dtype = torch.bfloat16, grad: bool = True, config: Optional[Config] = None):
    """Compile `cross_entropy_kernel` for sm_90 at `config` (None: CONFIG) without a GPU (what only the GPU compiler
    rejects, the interpreter runs); call it without TRITON_INTERPRET. Returns Triton's compiled kernel."""
    config = config or CONFIG
    element = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    types = dict(logits_ptr=f"*{element}", targets_ptr="*i64", losses_ptr="*fp32")
    return compile_sm90(cross_entropy_kernel, dict(BLOCK_V=config.block_v, GRAD=grad),
                        lambda arg: types.get(arg, "i32"), config.num_warps)
