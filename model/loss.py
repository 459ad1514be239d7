"""The output head and the cross-entropy loss: ``GPTConfig.loss`` picks how they run.

- ``full``: logits = x W^T for every token, then ``F.cross_entropy`` on them in float32 (nanoGPT). The (tokens,
  vocab) logits and their gradient pass through memory: for GPT-2 at batch 32 x 1024, 3.3 GB each in bf16.
- ``chunked``: the head and the loss over ``CHUNK_TOKENS`` tokens at a time, the gradients of x and W computed in
  the same pass (the loss is the graph's last node, so its gradient is a scalar that the backward only scales), as
  Liger-Kernel's fused linear cross-entropy does (Hsu et al. 2024, "Liger Kernel", section 3.3). At most one
  chunk's logits exist at a time; the matmuls are the same three as ``full``'s. Measured on the H200 for GPT-2
  124M compiled (docs/benchmarks.md, "Whole-step options"): 3.4% slower than ``full`` and no lower peak memory.
- ``fused``: the head for every token, then one Triton kernel (``kernels/cross_entropy.py``) that computes each
  row's loss and writes its gradient over the logits (in the matmul dtype), and the head's two gradient matmuls, all
  in the forward; the backward scales the two gradients. The logits pass through memory once forward and once as
  their gradient, and are freed before the backward. On GPT-2 124M (H100, 2026-12-06) it trains at 1.02-1.03x
  ``full``'s tokens/s, its loss over 300 steps within full's run-to-run spread (five runs of each;
  docs/benchmarks.md). Without a CUDA GPU the same math runs as torch ops.
- ``auto`` (the default): ``fused`` on a CUDA GPU, ``full`` elsewhere (``resolve_loss``), decided per call from the
  device of the activations.

Both compute the mean over the targets that are not ``IGNORE_INDEX``, in float32, with the matmuls in the
autocast dtype (else x's dtype), as ``F.cross_entropy(logits.float(), targets, ignore_index=-1)`` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.cross_entropy import cross_entropy_rows

LOSSES = ("full", "chunked", "fused")  # how the head and the loss can run
LOSS_CHOICES = ("auto", *LOSSES)  # the values of GPTConfig.loss (model.loss): auto picks one of LOSSES per device
CHUNK_TOKENS = 8192  # chunked: tokens per chunk; GPT-2's 50304-wide logits of a chunk are 1.6 GB in float32
IGNORE_INDEX = -1


def resolve_loss(loss: str, device_type: str) -> str:
    """How GPTConfig.loss runs on a device of `device_type` ("cuda", "cpu", ...): "auto" is "fused" on CUDA (its
    Triton kernel; the fastest measured, its loss within full's run-to-run spread) and "full" elsewhere; the others
    as given.
    Raises ValueError for a value outside LOSS_CHOICES."""
    if loss == "auto":
        return "fused" if device_type == "cuda" else "full"
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r}; accepted: {', '.join(LOSS_CHOICES)}")
    return loss


def head_loss(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, loss: str = "full") -> torch.Tensor:
    """Mean cross-entropy of the logits x @ weight.T against targets.

    x: (N, C) float, the final norm's output; weight: (V, C) float, the output head; targets: (N,) int64 in
    [0, V) or IGNORE_INDEX. Returns a float32 scalar (nan when every target is ignored, as F.cross_entropy).
    Raises ValueError for an unknown ``loss``.
    """
    if loss == "full":
        return F.cross_entropy(F.linear(x, weight).float(), targets, ignore_index=IGNORE_INDEX)
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r}; accepted: {', '.join(LOSSES)}")
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    x, weight = x.to(dtype), weight.to(dtype)  # the casts autocast would make (their backward casts back)
    if loss == "chunked":
        return ChunkedLinearCrossEntropy.apply(x, weight, targets, CHUNK_TOKENS)
    with_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    total, count, _, _ = linear_cross_entropy(x, weight, targets, with_grad)
    return total / count


@torch.library.custom_op("flashgpt::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(x: Tensor, weight: Tensor, targets: Tensor, with_grad: bool
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``fused``: sum of CE(x @ weight.T, targets) over counted rows, their count, and (with_grad) the gradients
    of that sum with respect to x and weight, from the gradient the kernel writes over the logits.

    x: (N, C), weight: (V, C), one float dtype; targets: (N,) int64. Returns (total float32 (), count float32 (),
    grad_x (N, C), grad_weight (V, C)) in `_grad_dtype(x.dtype)`; the gradients are empty (0 rows) without
    with_grad.
    """
    with torch.autocast(x.device.type, enabled=False):
        logits = x @ weight.t()
        total = cross_entropy_rows(logits, targets, IGNORE_INDEX, grad=with_grad).sum()
        count = (targets != IGNORE_INDEX).sum().float()
        dtype = _grad_dtype(x.dtype)
        if not with_grad:
            return total, count, x.new_empty(0, x.shape[1], dtype=dtype), weight.new_empty(0, weight.shape[1],
                                                                                           dtype=dtype)
        return total, count, (logits @ weight).to(dtype), logits.to(dtype).t() @ x.to(dtype)


def _grad_dtype(dtype: torch.dtype) -> torch.dtype:
    # float16's range cannot hold dW unscaled (a frequent token's column sums thousands of x rows); the grad
    # scaler's factor only arrives in the backward.
    return torch.float32 if dtype == torch.float16 else dtype


@linear_cross_entropy.register_fake
def _(x, weight, targets, with_grad):
    scalar = x.new_empty((), dtype=torch.float32)
    rows = (x.shape[0], weight.shape[0]) if with_grad else (0, 0)
    dtype = _grad_dtype(x.dtype)
    return (scalar, scalar.clone(), x.new_empty(rows[0], x.shape[1], dtype=dtype),
            weight.new_empty(rows[1], weight.shape[1], dtype=dtype))


def _setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(output[2], output[3])
    ctx.dtypes = inputs[0].dtype, inputs[1].dtype


def _backward(ctx, grad_total, grad_count, grad_x_grad, grad_weight_grad):
    # The gradients were computed for a total with weight 1; scale them by the one that arrived, in float32 (with
    # fp16 and a grad scaler that weight is large and the unscaled gradients are small).
    grad_x, grad_weight = ctx.saved_tensors
    x_dtype, w_dtype = ctx.dtypes
    dx = (grad_x.float() * grad_total).to(x_dtype) if ctx.needs_input_grad[0] else None
    dw = (grad_weight.float() * grad_total).to(w_dtype) if ctx.needs_input_grad[1] else None
    return dx, dw, None, None


linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """mean CE(x @ weight.T, targets) chunk by chunk; forward also computes d loss / d x and d loss / d weight.

    Per chunk (rows c): logits = x_c W^T (x's dtype, float32 afterwards), lse = logsumexp(logits),
    loss_c = sum(lse - logits[target]); g = softmax(logits) - onehot(target) (0 on ignored rows), then
    dx_c = g W and dW += g^T x_c, divided by the number of counted targets. Gradients are kept in float32 and cast
    only after the backward scaled them (fp16 with a grad scaler would flush unscaled ones to zero).
    """

    @staticmethod
    def forward(ctx, x, weight, targets, chunk):
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        count = (targets != IGNORE_INDEX).sum()
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        grad_x = torch.empty(x.shape, dtype=torch.float32, device=x.device) if need_x else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if need_w else None
        with torch.autocast(x.device.type, enabled=False):
            for start in range(0, x.shape[0], chunk):
                xc, tc = x[start:start + chunk], targets[start:start + chunk]
                logits = (xc @ weight.t()).float()
                lse = torch.logsumexp(logits, dim=-1)
                counted = tc != IGNORE_INDEX
                picked = tc.clamp(min=0).unsqueeze(1)
                total += torch.where(counted, lse - logits.gather(1, picked).squeeze(1), 0.0).sum()
                if need_x or need_w:
                    g = torch.exp(logits - lse.unsqueeze(1))
                    g.scatter_add_(1, picked, torch.full_like(lse, -1.0).unsqueeze(1))
                    g = torch.where(counted.unsqueeze(1), g, 0.0).to(x.dtype)
                    if need_x:
                        grad_x[start:start + chunk] = (g @ weight).float()
                    if need_w:
                        grad_w += (g.t() @ xc).float()
        scale = 1.0 / count.float()
        if need_x:
            grad_x *= scale
        if need_w:
            grad_w *= scale
        ctx.save_for_backward(grad_x, grad_w)
        ctx.dtypes = x.dtype, weight.dtype
        return total * scale

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        dx = (grad_x * grad_loss).to(x_dtype) if grad_x is not None else None
        dw = (grad_w * grad_loss).to(w_dtype) if grad_w is not None else None
        return dx, dw, None, None
