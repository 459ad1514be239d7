"""The front end shared by the FA1, FA2 and FA3 kernels: input validation, layout handling, and registration as a
differentiable `torch.library` custom op (so `torch.compile(..., fullgraph=True)` keeps it in one graph).

A kernel module provides two launchers:

    forward(q, k, v, causal, softmax_scale, *mask) -> (o, lse_internal)
    backward(do, q, k, v, o, lse_internal, causal, softmax_scale, *mask) -> (dq, dk, dv)

`lse_internal` is float32 (batch, n_heads, seqlen_q) in the kernel's own log base (2 for FA2, e for FA1),
with +inf for query rows that see no key, so the backward's `exp(s - lse)` is exactly 0 there.
`mask` = (window_size, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), flash-attn's sliding window and
packed variable-length sequences, is passed only to kernels registered with `masks=True` (FA2, FA3); for packed
sequences q is (total_q, n_heads, head_dim) and lse_internal (n_heads, total_q).
`backward` also takes `out=(dq, dk, dv)`, buffers to write the gradients into (`common.grad_buffers`).
Logit soft-capping (softcap * tanh(s / softcap) on every score s = softmax_scale * q.k; Gemma 2, flash-attn's
`softcap`) is opt-in: a kernel module has it when both its launchers accept a `softcap=` keyword (a float > 0;
0.0 = off, which must cost nothing), and `make_attention` then passes the public functions' `softcap` to them as
that keyword, the backward getting the forward's value (it recomputes the capped scores). `make_attention` reads the
keyword off the launchers' signatures (or takes `softcap=True/False`); kernels without it refuse softcap != 0 with a
ValueError naming the kernels that have it (`SOFTCAP_KERNELS`), and their launchers never see the keyword.
`make_attention` turns the pair into the public functions `fa*_attention(q, k, v, causal, softmax_scale,
return_lse, window_size, *, softcap)` and `fa*_qkvpacked_attention(qkv, n_heads, ...)` (one packed qkv tensor,
whose gradient the backward writes in place), `make_varlen_attention` into `fa*_varlen_attention`. Everything that
differs between the kernels lives in their Triton kernels.
"""

import functools
import inspect
import math
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .common import INTERPRET

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
# softmax_scale and softcap at most this: the kernels fold them, times log2(e), into float32 constants (max 3.4e38)
MAX_LOGIT_SCALE = 1e38

ForwardLauncher = Callable[..., tuple[Tensor, Tensor]]
BackwardLauncher = Callable[..., tuple[Tensor, Tensor, Tensor]]
SOFTCAP_KERNELS: list[str] = []  # the names `make_attention` registered with logit soft-capping, in order
# name -> the launchers with the ops' arguments, which eager calls of `make_varlen_attention`'s functions run
# through `EagerAttention` (kernels registered with masks=True): ((run_forward, run_backward, 3) over q, k, v,
# (run_forward, run_backward, 1) over one packed qkv)
EAGER_MASKED: dict[str, tuple] = {}


def type_name(x) -> str:
    """x's type as a message names it: `bool`, or `numpy.bool` (numpy 2 also calls its bool type "bool")."""
    t = type(x)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def validate(q, k, v, causal, softmax_scale, packed=False) -> None:
    """Raise TypeError/ValueError naming the offending argument; see `make_attention` for the contract.
    packed: q, k, v hold sequences back to back, (total, heads, head_dim) (`make_varlen_attention`)."""
    ndim, dims = (3, "(total, heads, head_dim)") if packed else (4, "(batch, heads, seqlen, head_dim)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type_name(t)}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dims {dims}, got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type_name(causal)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}")
    if q.device.type == "cpu" and not INTERPRET:
        raise ValueError(
            "q, k, v are CPU tensors, but the Triton kernels run on a CUDA GPU: move them to a CUDA device, "
            "or set TRITON_INTERPRET=1 before importing `kernels` to run them (slowly) through Triton's interpreter"
        )
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q, k, v are on {q.device}; supported: CUDA (or CPU under TRITON_INTERPRET=1)")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k={tuple(k.shape)}, v={tuple(v.shape)}")
    (batch, n_heads, seqlen_q, head_dim), (batch_k, n_kv_heads, seqlen_k, head_dim_k) = (
        ((1, t.shape[1], t.shape[0], t.shape[2]) for t in (q, k)) if packed else (q.shape, k.shape))
    if batch_k != batch:
        raise ValueError(f"batch size differs: q has {batch}, k/v have {batch_k}")
    if head_dim_k != head_dim:
        raise ValueError(f"head_dim differs: q has {head_dim}, k/v have {head_dim_k}")
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim={head_dim} is out of range; supported: {MIN_HEAD_DIM} to {MAX_HEAD_DIM}")
    if n_kv_heads == 0 or n_heads % n_kv_heads != 0:
        raise ValueError(f"n_heads={n_heads} (q) must be a multiple of n_kv_heads={n_kv_heads} (k, v)")
    if seqlen_q == 0 or seqlen_k == 0 or batch == 0:
        sizes = "total_q and total_k (the packed rows)" if packed else "batch, seqlen_q and seqlen_k"
        raise ValueError(f"{sizes} must be >= 1, got q={tuple(q.shape)}, k={tuple(k.shape)}")
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))):
        raise TypeError(f"softmax_scale must be a number (int or float) or None, got {type_name(softmax_scale)}")
    # >= 0: the kernels take a row's largest scaled score as max(q k^T) * softmax_scale (FlashAttention's shortcut).
    # Comparisons, not math.isfinite: an int too large for a float is refused, not an OverflowError.
    if softmax_scale is not None and not 0 <= softmax_scale <= MAX_LOGIT_SCALE:
        raise ValueError(f"softmax_scale must be a finite number >= 0 and <= {MAX_LOGIT_SCALE:g}, or None; "
                         f"got {short_repr(softmax_scale)}")


def short_repr(value, limit: int = 40) -> str:
    """repr(value), or for a longer one (an int of hundreds of digits) its start and its length."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:12]}... ({len(text)} characters)"


def check_return_lse(return_lse) -> None:
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type_name(return_lse)}")


# A window edge past this many keys reaches past any sequence (int32 offsets): it means no limit, -1. The ops take
# int64 arguments, which a wider edge would overflow.
WIDEST_WINDOW = 2**31 - 1


def check_window(window_size, name: str, supported: bool) -> tuple[int, int]:
    """window_size as (left, right) ints, an edge past WIDEST_WINDOW as -1; raise TypeError/ValueError naming what
    is wrong."""
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    for i, w in enumerate(window_size):
        if w < -1:
            raise ValueError(f"window_size[{i}] = {w} is below -1; accepted: -1 (no limit) or a number of keys >= 0")
    window_size = tuple(-1 if w > WIDEST_WINDOW else w for w in window_size)
    if not supported and window_size != (-1, -1):
        raise ValueError(f"{name}_attention has no sliding window (window_size={window_size}); "
                         "use fa2_attention or fa3_attention")
    return window_size[0], window_size[1]


def check_softcap(softcap, name: str, supported: bool, form: str = "attention") -> float:
    """softcap as a float (0.0 = off); TypeError for a bool or a non-number, ValueError for a value that is not
    finite or below 0, or for softcap != 0 when `name`'s kernels have no soft-capping (`supported`: they have);
    form: the public function's suffix ("attention", "qkvpacked_attention", "varlen_attention")."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a number (int or float; 0.0 = off), got {type_name(softcap)}")
    if not 0 <= softcap <= MAX_LOGIT_SCALE:  # comparisons: torch.compile traces them on a symbolic float
        raise ValueError(f"softcap must be a finite number >= 0 and <= {MAX_LOGIT_SCALE:g} (0.0 = off), "
                         f"got {short_repr(softcap)}")
    if softcap and not supported:
        have = " or ".join(f"{k}_{form}" for k in SOFTCAP_KERNELS) or "none"
        raise ValueError(f"{name}_{form} has no logit soft-capping (softcap={softcap!r}); "
                         f"the kernels with it: {have}")
    return float(softcap)


def max_softcap(softmax_scale: float) -> float:
    """The largest softcap for `softmax_scale` > 0: above it softmax_scale / softcap, which the kernels multiply q.k
    by before the tanh, falls below float32's smallest normal number (it would flush to 0 and make every score 0;
    Flex's score_mod would overflow the cap instead). Such a cap changes no score."""
    return softmax_scale / torch.finfo(torch.float32).tiny


def check_softcap_scale(softmax_scale: float, softcap: float) -> None:
    """ValueError when softcap > 0 is above `max_softcap(softmax_scale)` (softmax_scale > 0)."""
    if softcap > 0 and softmax_scale > 0 and softcap > max_softcap(softmax_scale):
        raise ValueError(f"softcap={softcap!r} is too large for softmax_scale={softmax_scale!r}: softmax_scale / "
                         f"softcap underflows float32 (a cap that large changes no score; use softcap=0.0)")


def accepts_softcap(*launchers: Callable) -> bool:
    """Whether every launcher takes a `softcap` keyword (the module docstring's opt-in)."""
    def takes(fn):
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):  # no signature to read: not opted in
            return False
        return "softcap" in params and params["softcap"].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                                   inspect.Parameter.KEYWORD_ONLY)

    return all(takes(fn) for fn in launchers)


def check_cu_seqlens_args(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sides=("_q", "_k")) -> None:
    """The static part of the varlen contract (types, dtypes, shapes), which torch.compile can trace; the offsets'
    values are checked by `check_cu_seqlens_values`. sides: the arguments' suffixes; ("",): one set of offsets
    (cu_seqlens, max_seqlen: the packed-qkv form) passed as both, checked once."""
    for name, cu in zip((f"cu_seqlens{side}" for side in sides), (cu_seqlens_q, cu_seqlens_k)):
        if not isinstance(cu, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type_name(cu)}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} has dtype {cu.dtype}; accepted: torch.int32 (as flash-attn)")
        if cu.dim() != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name} must have shape (batch + 1,) with batch >= 1, got shape {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on {'q' if sides[0] else 'qkv'}'s device {q.device}, got {cu.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    for name, n in zip((f"max_seqlen{side}" for side in sides), (max_seqlen_q, max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, (int, torch.SymInt)):
            raise TypeError(f"{name} must be an int, got {type_name(n)}")
        if n < 0:
            raise ValueError(f"{name} must be >= 0, got {n}")


def check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k,
                            sides=("_q", "_k")) -> None:
    """The offsets' values: start at 0, non-decreasing, end at the row count, no sequence above max_seqlen_*.
    Costs a device-to-host copy of the offsets (a host sync on a GPU). sides: as `check_cu_seqlens_args`."""
    for side, cu, total, longest in zip(sides, (cu_seqlens_q, cu_seqlens_k), (total_q, total_k),
                                        (max_seqlen_q, max_seqlen_k)):
        name, offsets = f"cu_seqlens{side}", cu.tolist()
        if offsets[0] != 0:
            raise ValueError(f"{name}[0] must be 0, got {offsets[0]}")
        lengths = [b - a for a, b in zip(offsets, offsets[1:])]
        if min(lengths) < 0:
            i = lengths.index(min(lengths))
            raise ValueError(f"{name} must be non-decreasing, but {name}[{i + 1}] = {offsets[i + 1]} < "
                             f"{name}[{i}] = {offsets[i]}")
        rows = f"total{side} = {total}, the rows of {side[1:] or 'qkv'}"
        if offsets[-1] != total:
            raise ValueError(f"{name}[-1] = {offsets[-1]} must equal {rows}")
        if max(lengths) > longest:
            raise ValueError(f"max_seqlen{side} = {longest} is less than the longest sequence's length "
                             f"{max(lengths)} in {name}")


def last_dim_contiguous(t: Tensor) -> Tensor:
    """Views with a unit-stride last dim (e.g. x.view(B, T, H, D).transpose(1, 2)) pass as they are."""
    return t if t.stride(-1) == 1 else t.contiguous()


def make_attention(name: str, forward: ForwardLauncher, backward: BackwardLauncher, lse_log_base: float,
                   masks: bool = False, softcap: Optional[bool] = None):
    """Register `forward`/`backward` as the custom ops `flashgpt::{name}_forward` and
    `flashgpt::{name}_qkvpacked_forward` with autograd, and return the public functions (`{name}_attention`,
    `{name}_qkvpacked_attention`). `lse_log_base` is the base of the kernels' internal LSE (2 or e). masks: the
    launchers take the window and varlen arguments (see the module docstring); otherwise they are refused.
    softcap: the launchers take `softcap=` (logit soft-capping, see the module docstring); None: whether both
    accept that keyword; otherwise softcap != 0 is refused. TypeError for softcap=True with launchers that do not
    take the keyword."""
    if softcap is None:
        softcap = accepts_softcap(forward, backward)
    elif softcap and not accepts_softcap(forward, backward):
        raise TypeError(f"make_attention({name!r}, softcap=True): the forward and backward launchers must take a "
                        "`softcap` keyword")
    has_softcap = bool(softcap)
    if has_softcap and name not in SOFTCAP_KERNELS:
        SOFTCAP_KERNELS.append(name)

    def mask_args(window_left=-1, window_right=-1, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
                  max_seqlen_k=0):
        if masks:
            return (window_left, window_right), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
        if (window_left, window_right) != (-1, -1) or cu_seqlens_q is not None:
            raise ValueError(f"{name} has no sliding window or variable-length sequences; use fa2")
        return ()

    def softcap_kwargs(softcap):  # the launchers' keyword, only for kernels that opted in
        if has_softcap:
            return {"softcap": softcap}
        if softcap:
            check_softcap(softcap, name, False)
        return {}

    # The launchers with the ops' arguments: the ops' bodies, and what eager calls run without the ops' dispatch.
    def run_forward(q, k, v, causal, softmax_scale, window_left=-1, window_right=-1, cu_seqlens_q=None,
                    cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, softcap=0.0):
        mask = mask_args(window_left, window_right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        return forward(q, k, v, causal, softmax_scale, *mask, **softcap_kwargs(softcap))

    def run_backward(do, q, k, v, o, lse, causal, softmax_scale, window_left=-1, window_right=-1, cu_seqlens_q=None,
                     cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, softcap=0.0):
        mask = mask_args(window_left, window_right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        return backward(last_dim_contiguous(do), q, k, v, o, lse, causal, softmax_scale, *mask,
                        **softcap_kwargs(softcap))

    # One op for every mask: the window and the packed sequences only change the kernels' per-row key ranges.
    @torch.library.custom_op(f"flashgpt::{name}_forward", mutates_args=())
    def forward_op(
        q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float, window_left: int = -1,
        window_right: int = -1, cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
        max_seqlen_q: int = 0, max_seqlen_k: int = 0, softcap: float = 0.0,
    ) -> tuple[Tensor, Tensor]:
        return run_forward(q, k, v, causal, softmax_scale, window_left, window_right, cu_seqlens_q, cu_seqlens_k,
                           max_seqlen_q, max_seqlen_k, softcap)

    @forward_op.register_fake
    def _(q, k, v, causal, softmax_scale, window_left=-1, window_right=-1, cu_seqlens_q=None, *varlen):
        lse_shape = (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else q.shape[:3]
        return torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32)

    @torch.library.custom_op(f"flashgpt::{name}_backward", mutates_args=())
    def backward_op(
        do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool, softmax_scale: float,
        window_left: int = -1, window_right: int = -1, cu_seqlens_q: Optional[Tensor] = None,
        cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: int = 0, max_seqlen_k: int = 0, softcap: float = 0.0,
    ) -> tuple[Tensor, Tensor, Tensor]:
        return run_backward(do, q, k, v, o, lse, causal, softmax_scale, window_left, window_right, cu_seqlens_q,
                            cu_seqlens_k, max_seqlen_q, max_seqlen_k, softcap)

    @backward_op.register_fake
    def _(do, q, k, v, o, lse, *args):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    forward_op.register_autograd(functools.partial(_gradients, backward_fn=backward_op),
                                 setup_context=functools.partial(_save, n_tensors=3))
    to_natural = math.log(lse_log_base)
    eager = (run_forward, run_backward, 3)

    def attention(q, k, v, causal=False, softmax_scale=None, return_lse=False, window_size=(-1, -1), *, softcap=0.0):
        validate(q, k, v, causal, softmax_scale)
        check_return_lse(return_lse)
        window = check_window(window_size, name, masks)
        softcap = check_softcap(softcap, name, has_softcap)
        softmax_scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
        check_softcap_scale(softmax_scale, softcap)
        q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
        args = (q, k, v, causal, float(softmax_scale), *window, None, None, 0, 0, softcap)
        # dynamo refuses an autograd.Function given one tensor twice (k is v): compiled code calls the op.
        o, lse = forward_op(*args) if torch.compiler.is_compiling() else EagerAttention.apply(eager, *args)
        return natural_lse(o, lse, to_natural) if return_lse else o

    # The same over one packed (batch, seqlen, n_heads + 2 * n_kv_heads, head_dim) qkv: the backward writes dq, dk,
    # dv into one tensor shaped like qkv (the launchers' `out`), the gradient of a fused qkv projection, instead of
    # returning three that autograd then concatenates (a copy of the whole gradient).
    def run_packed_forward(qkv, n_heads, causal, softmax_scale, window_left=-1, window_right=-1, softcap=0.0):
        o, lse = run_forward(*split_qkv(qkv, n_heads), causal, softmax_scale, window_left, window_right,
                             softcap=softcap)
        return o.transpose(1, 2).contiguous(), lse  # no copy: o is in q's memory order, (batch, seqlen, heads, D)

    def run_packed_backward(do, qkv, o, lse, n_heads, causal, softmax_scale, window_left=-1, window_right=-1,
                            softcap=0.0):
        dqkv = torch.empty_like(qkv)
        backward(last_dim_contiguous(do).transpose(1, 2), *split_qkv(qkv, n_heads), o.transpose(1, 2), lse, causal,
                 softmax_scale, *mask_args(window_left, window_right), out=split_qkv(dqkv, n_heads),
                 **softcap_kwargs(softcap))
        return dqkv

    @torch.library.custom_op(f"flashgpt::{name}_qkvpacked_forward", mutates_args=())
    def packed_forward_op(qkv: Tensor, n_heads: int, causal: bool, softmax_scale: float, window_left: int = -1,
                          window_right: int = -1, softcap: float = 0.0) -> tuple[Tensor, Tensor]:
        return run_packed_forward(qkv, n_heads, causal, softmax_scale, window_left, window_right, softcap)

    @packed_forward_op.register_fake
    def _(qkv, n_heads, *args):
        batch, seqlen, _, head_dim = qkv.shape
        return (qkv.new_empty((batch, seqlen, n_heads, head_dim)),
                qkv.new_empty((batch, n_heads, seqlen), dtype=torch.float32))

    @torch.library.custom_op(f"flashgpt::{name}_qkvpacked_backward", mutates_args=())
    def packed_backward_op(do: Tensor, qkv: Tensor, o: Tensor, lse: Tensor, n_heads: int, causal: bool,
                           softmax_scale: float, window_left: int = -1, window_right: int = -1,
                           softcap: float = 0.0) -> Tensor:
        return run_packed_backward(do, qkv, o, lse, n_heads, causal, softmax_scale, window_left, window_right,
                                   softcap)

    @packed_backward_op.register_fake
    def _(do, qkv, *args):
        return torch.empty_like(qkv)

    packed_forward_op.register_autograd(functools.partial(_gradients, backward_fn=packed_backward_op),
                                        setup_context=functools.partial(_save, n_tensors=1))
    packed_eager = (run_packed_forward, run_packed_backward, 1)
    if masks:
        EAGER_MASKED[name] = eager, _varlen_packed_ops(name, run_forward, backward, softcap_kwargs)

    def qkvpacked_attention(qkv, n_heads=None, causal=False, softmax_scale=None, return_lse=False,
                            window_size=(-1, -1), *, softcap=0.0):
        qkv, n_heads = check_qkvpacked(qkv, n_heads)
        try:
            validate(*split_qkv(qkv, n_heads), causal, softmax_scale)
        except (TypeError, ValueError) as e:  # its messages name q, k, v: say what they are here
            raise type(e)(f"{e} (q, k, v: the (batch, heads, seqlen, head_dim) views of qkv {tuple(qkv.shape)} "
                          f"{qkv.dtype} on {qkv.device} with n_heads={n_heads})") from None
        check_return_lse(return_lse)
        window = check_window(window_size, name, masks)
        softcap = check_softcap(softcap, name, has_softcap, "qkvpacked_attention")
        softmax_scale = 1.0 / math.sqrt(qkv.shape[-1]) if softmax_scale is None else softmax_scale
        check_softcap_scale(softmax_scale, softcap)
        args = (last_dim_contiguous(qkv), n_heads, causal, float(softmax_scale), *window, softcap)
        compiling = torch.compiler.is_compiling()
        o, lse = packed_forward_op(*args) if compiling else EagerAttention.apply(packed_eager, *args)
        return natural_lse(o, lse, to_natural) if return_lse else o

    for fn, public in ((attention, f"{name}_attention"), (qkvpacked_attention, f"{name}_qkvpacked_attention")):
        fn.__name__ = fn.__qualname__ = public  # what a TypeError for a wrong call names
    return attention, qkvpacked_attention


def _save(ctx, inputs, output, n_tensors):
    """setup_context of the ops' autograd: the first n_tensors inputs are the differentiable tensors."""
    o, lse = output
    ctx.save_for_backward(*inputs[:n_tensors], o, lse)
    ctx.args = tuple(inputs[n_tensors:])


def _gradients(ctx, do, dlse, backward_fn):
    """The ops' autograd formula: backward_fn(do, *tensors, o, lse, *args) -> the tensors' gradients (one tensor or
    a tuple). The LSE output is returned detached (as in flash-attn); only o carries a gradient."""
    *tensors, o, lse = ctx.saved_tensors
    grads = backward_fn(do, *tensors, o, lse, *ctx.args)
    return *(grads if len(tensors) > 1 else (grads,)), *(None for _ in ctx.args)


class EagerAttention(torch.autograd.Function):
    """The ops' autograd for eager calls, with the launchers called directly: custom_op's own autograd wrapper
    costs ~70 us of Python per eager call (it re-fills the schema's defaults every call) and its dispatch still
    ~15-30 us each way (measured on the CPU with stub kernels; docs/hopper-notes.md).
    torch.compile traces the ops' registration instead (no per-call cost there, and it takes one tensor passed
    twice, which dynamo refuses for an autograd.Function). `impl`: (run_forward, run_backward, n_tensors) as the
    op's body, backward body and count of differentiable leading inputs."""

    @staticmethod
    def forward(ctx, impl, *inputs):
        run_forward, ctx.run_backward, n_tensors = impl
        o, lse = run_forward(*inputs)
        _save(ctx, inputs, (o, lse), n_tensors)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    @once_differentiable  # the kernels' backward has no backward: differentiating its gradients raises
    def backward(ctx, do, dlse):
        return None, *_gradients(ctx, do, dlse, ctx.run_backward)


def split_qkv(qkv: Tensor, n_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """q (batch, n_heads, seqlen, head_dim) and k, v (batch, n_kv_heads, seqlen, head_dim): views of a packed
    (batch, seqlen, n_heads + 2 * n_kv_heads, head_dim) qkv."""
    n_kv_heads = (qkv.shape[2] - n_heads) // 2
    return qkv.transpose(1, 2).split([n_heads, n_kv_heads, n_kv_heads], dim=1)


def split_varlen_qkv(qkv: Tensor, n_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """q (total, n_heads, head_dim) and k, v (total, n_kv_heads, head_dim): views of a packed
    (total, n_heads + 2 * n_kv_heads, head_dim) qkv of packed sequences."""
    n_kv_heads = (qkv.shape[1] - n_heads) // 2
    return qkv.split([n_heads, n_kv_heads, n_kv_heads], dim=1)


def _varlen_packed_ops(name: str, run_forward, backward, softcap_kwargs) -> tuple:
    """Register `flashgpt::{name}_varlen_qkvpacked_forward` / `_backward` (packed sequences over one packed qkv:
    packed self-attention, one set of offsets) with autograd, over the kernel module's launchers; returns the
    launchers with the ops' arguments, for eager calls (`EagerAttention`)."""

    def run_varlen_packed_forward(qkv, n_heads, cu_seqlens, max_seqlen, causal, softmax_scale, window_left=-1,
                                  window_right=-1, softcap=0.0):
        o, lse = run_forward(*split_varlen_qkv(qkv, n_heads), causal, softmax_scale, window_left, window_right,
                             cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softcap)
        return o.contiguous(), lse  # no copy unless qkv's rows are not its outer dim: o is in q's memory order

    def run_varlen_packed_backward(do, qkv, o, lse, n_heads, cu_seqlens, max_seqlen, causal, softmax_scale,
                                   window_left=-1, window_right=-1, softcap=0.0):
        dqkv = torch.empty_like(qkv)
        backward(last_dim_contiguous(do), *split_varlen_qkv(qkv, n_heads), o, lse, causal, softmax_scale,
                 (window_left, window_right), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                 out=split_varlen_qkv(dqkv, n_heads), **softcap_kwargs(softcap))
        return dqkv

    @torch.library.custom_op(f"flashgpt::{name}_varlen_qkvpacked_forward", mutates_args=())
    def forward_op(qkv: Tensor, n_heads: int, cu_seqlens: Tensor, max_seqlen: int, causal: bool,
                   softmax_scale: float, window_left: int = -1, window_right: int = -1,
                   softcap: float = 0.0) -> tuple[Tensor, Tensor]:
        return run_varlen_packed_forward(qkv, n_heads, cu_seqlens, max_seqlen, causal, softmax_scale, window_left,
                                         window_right, softcap)

    @forward_op.register_fake
    def _(qkv, n_heads, *args):
        total, _, head_dim = qkv.shape
        return qkv.new_empty((total, n_heads, head_dim)), qkv.new_empty((n_heads, total), dtype=torch.float32)

    @torch.library.custom_op(f"flashgpt::{name}_varlen_qkvpacked_backward", mutates_args=())
    def backward_op(do: Tensor, qkv: Tensor, o: Tensor, lse: Tensor, n_heads: int, cu_seqlens: Tensor,
                    max_seqlen: int, causal: bool, softmax_scale: float, window_left: int = -1,
                    window_right: int = -1, softcap: float = 0.0) -> Tensor:
        return run_varlen_packed_backward(do, qkv, o, lse, n_heads, cu_seqlens, max_seqlen, causal, softmax_scale,
                                          window_left, window_right, softcap)

    @backward_op.register_fake
    def _(do, qkv, *args):
        return torch.empty_like(qkv)

    forward_op.register_autograd(functools.partial(_gradients, backward_fn=backward_op),
                                 setup_context=functools.partial(_save, n_tensors=1))
    return run_varlen_packed_forward, run_varlen_packed_backward, 1


def check_qkvpacked(qkv, n_heads, varlen: bool = False) -> tuple[Tensor, int]:
    """(qkv as (batch, seqlen, n_heads + 2 * n_kv_heads, head_dim), n_heads); see QKVPACKED_DOC for what is taken.
    varlen: packed sequences, (total, ...) in place of (batch, seqlen, ...) (VARLEN_QKVPACKED_DOC).
    Raises TypeError/ValueError naming the argument."""
    lead, dims = (1, "total") if varlen else (2, "batch, seqlen")
    if not isinstance(qkv, Tensor):
        raise TypeError(f"qkv must be a torch.Tensor, got {type_name(qkv)}")
    if n_heads is not None and (isinstance(n_heads, bool) or not isinstance(n_heads, int)):
        raise TypeError(f"n_heads must be an int or None, got {type_name(n_heads)}")
    if qkv.dim() == lead + 3 and qkv.shape[lead] == 3 and 0 < qkv.shape[lead + 1] and n_heads in (None, qkv.shape[-2]):
        return qkv.flatten(lead, lead + 1), qkv.shape[-2]
    if qkv.dim() != lead + 2:
        raise ValueError(f"qkv must be ({dims}, n_heads + 2 * n_kv_heads, head_dim) or ({dims}, 3, "
                         f"n_heads >= 1, head_dim), got shape {tuple(qkv.shape)}" + (
                             f" with n_heads={n_heads}" if qkv.dim() == lead + 3 else ""))
    heads = qkv.shape[lead]
    if n_heads is None and heads % 3 == 0 and heads > 0:
        return qkv, heads // 3
    if n_heads is None or not 0 < n_heads < heads or (heads - n_heads) % 2:
        raise ValueError(f"qkv has {heads} heads (dim {lead}), which must be n_heads + 2 * n_kv_heads with n_heads, "
                         f"n_kv_heads >= 1; got n_heads={n_heads}" + (
                             " (None: n_heads = n_kv_heads, so a multiple of 3)" if n_heads is None else ""))
    return qkv, n_heads


def natural_lse(o: Tensor, lse: Tensor, to_natural: float) -> tuple[Tensor, Tensor]:
    """(o, lse in natural log, detached). Internal +inf marks rows that see no key; the log-sum-exp of an empty
    set is -inf."""
    return o, torch.where(torch.isinf(lse), float("-inf"), lse * to_natural).detach()


def make_varlen_attention(name: str, lse_log_base: float):
    """The public packed-sequence functions `{name}_varlen_attention` and `{name}_varlen_qkvpacked_attention`:
    compiled code calls the ops that `make_attention(name, ..., masks=True)` registered, eager calls their launchers
    through `EagerAttention`, as the dense functions do."""
    op, packed_op = (getattr(torch.ops.flashgpt, f"{name}_{form}forward") for form in ("", "varlen_qkvpacked_"))
    eager, packed_eager = EAGER_MASKED[name]
    to_natural = math.log(lse_log_base)

    def check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_size,
              return_lse, softcap, check_offsets, form, sides=("_q", "_k")):
        """The checks both forms share (sides: as `check_cu_seqlens_args`); returns (window, softmax_scale,
        softcap, max_seqlen_q, max_seqlen_k) as the ops take them."""
        check_return_lse(return_lse)
        if not isinstance(check_offsets, bool):
            raise TypeError(f"check_offsets must be a bool, got {type_name(check_offsets)}")
        check_cu_seqlens_args(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sides)
        # Reading the offsets' values syncs with the GPU, and torch.compile cannot trace it: eager calls only.
        if check_offsets and not torch.compiler.is_compiling():
            check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k,
                                    sides)
        window = check_window(window_size, name, True)
        softcap = check_softcap(softcap, name, name in SOFTCAP_KERNELS, form)
        softmax_scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
        check_softcap_scale(softmax_scale, softcap)
        # No sequence is longer than all the rows: a larger bound (flash-attn accepts one) would only add empty
        # programs to the grid, or overflow the op's int64 argument.
        return (window, float(softmax_scale), softcap, torch.sym_min(max_seqlen_q, q.shape[0]),
                torch.sym_min(max_seqlen_k, k.shape[0]))

    def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                         softmax_scale=None, window_size=(-1, -1), return_lse=False, *, softcap=0.0,
                         check_offsets=True):
        validate(q, k, v, causal, softmax_scale, packed=True)
        window, softmax_scale, softcap, max_seqlen_q, max_seqlen_k = check(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_size,
            return_lse, softcap, check_offsets, "varlen_attention")
        q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
        args = (q, k, v, causal, softmax_scale, *window, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(),
                max_seqlen_q, max_seqlen_k, softcap)
        o, lse = op(*args) if torch.compiler.is_compiling() else EagerAttention.apply(eager, *args)
        return natural_lse(o, lse, to_natural) if return_lse else o

    def varlen_qkvpacked_attention(qkv, cu_seqlens, max_seqlen, n_heads=None, causal=False, softmax_scale=None,
                                   window_size=(-1, -1), return_lse=False, *, softcap=0.0, check_offsets=True):
        qkv, n_heads = check_qkvpacked(qkv, n_heads, varlen=True)
        q, k, v = split_varlen_qkv(qkv, n_heads)
        try:
            validate(q, k, v, causal, softmax_scale, packed=True)
        except (TypeError, ValueError) as e:  # its messages name q, k, v: say what they are here
            raise type(e)(f"{e} (q, k, v: the (total, heads, head_dim) views of qkv {tuple(qkv.shape)} "
                          f"{qkv.dtype} on {qkv.device} with n_heads={n_heads})") from None
        window, softmax_scale, softcap, max_seqlen, _ = check(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal, softmax_scale, window_size, return_lse,
            softcap, check_offsets, "varlen_qkvpacked_attention", sides=("",))
        args = (last_dim_contiguous(qkv), n_heads, cu_seqlens.contiguous(), max_seqlen, causal, softmax_scale,
                *window, softcap)
        o, lse = packed_op(*args) if torch.compiler.is_compiling() else EagerAttention.apply(packed_eager, *args)
        return natural_lse(o, lse, to_natural) if return_lse else o

    for fn, public in ((varlen_attention, f"{name}_varlen_attention"),
                       (varlen_qkvpacked_attention, f"{name}_varlen_qkvpacked_attention")):
        fn.__name__ = fn.__qualname__ = public
    return varlen_attention, varlen_qkvpacked_attention


DETERMINISTIC_GRADIENTS = "gradients are deterministic (no atomics)."
PUBLIC_DOC = """{title}

    Computes o = softmax(cap(q k^T * softmax_scale) [+ mask]) v for every (batch, head), without materialising
    the (seqlen_q, seqlen_k) score matrix (cap: the identity, or logit soft-capping with softcap > 0).
    Source: {source}

    Args:
        q: (batch, n_heads, seqlen_q, head_dim), float16, bfloat16 or float32 (float32 runs the matmuls in
           TF32 on the GPU), on a CUDA device (or the CPU under TRITON_INTERPRET=1).
        k, v: (batch, n_kv_heads, seqlen_k, head_dim), same dtype and device as q. n_heads must be a multiple of
           n_kv_heads (GQA/MQA): query head h reads K/V head h // (n_heads // n_kv_heads), with no copy.
           head_dim is any value from 16 to 256 (e.g. 80, 96); seqlen_q, seqlen_k >= 1, any value.
           Strided views whose last dim is contiguous (e.g. x.view(B, T, H, D).transpose(1, 2)) are used
           without a copy; other layouts are copied once.
        causal: if True, query i sees key j only when j <= i + seqlen_k - seqlen_q (the mask is aligned to the
           bottom-right corner, as in FlashAttention >= 2.1; for seqlen_q == seqlen_k this is j <= i). A query
           row that sees no key (possible when seqlen_q > seqlen_k) gets 0 output, 0 gradient and lse = -inf.
        softmax_scale: multiplier of q k^T, 0 to 1e38; default 1 / sqrt(head_dim). The scores are float32: a row
           whose |q.k| * softmax_scale exceeds float32's range (3.4e38) gets NaN, as in torch's sdpa.
        return_lse: also return the log-sum-exp of each query row's scaled scores.
        window_size: (left, right) ints, flash-attn's sliding window (fa2 and fa3; fa1 raises ValueError for
           anything but (-1, -1)): query i sees key j only when
           i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; -1 = no limit on that side;
           causal=True sets right to 0. Key blocks outside every row's window are skipped, so the cost scales
           with the visible (query, key) pairs.
        softcap: keyword only; a float from 0 to 1e38, 0.0 = off (the default, no cost). With softcap > 0 each score
           s = softmax_scale * q.k becomes softcap * tanh(s / softcap), so |s| < softcap, before the mask and the
           softmax; lse and the gradients are those of the capped scores. fa2 and fa3 (fa1 raises ValueError for
           anything but 0). Source: Gemma Team 2024, "Gemma 2" (attention logit soft-capping,
           softcap 50), in flash-attn's convention (`flash_attn_func(..., softcap=0.0)`).

    Returns:
        o: like q in shape, dtype and device; or (o, lse) with lse (batch, n_heads, seqlen_q), float32, natural
        log (returned without gradient). Differentiable w.r.t. q, k and v, once: the backward has no derivative
        of its own, so gradients taken with create_graph=True leave attention's second-order terms out, and
        backpropagating through them where they depend on o (a loss on the gradients) raises RuntimeError;
        {gradients}

    Raises:
        TypeError: a non-tensor input, unsupported or mismatched dtypes, a non-bool causal or return_lse, a
            softmax_scale or softcap that is not a number (a bool included), a window_size that is not a pair of
            ints.
        ValueError: a window_size value below -1 (or any window for fa1), a softcap outside 0..1e38 (or above 0
            for fa1) or so large that softmax_scale / softcap underflows float32, wrong rank, mismatched batch /
            head_dim / device / k-v shapes, n_heads not a multiple of n_kv_heads, head_dim outside 16..256, an
            empty dimension, a softmax_scale outside 0..1e38 (NaN and inf included), or CPU tensors when Triton's
            interpreter is off (use a CUDA GPU or set TRITON_INTERPRET=1 before importing kernels).
    """


VARLEN_DOC = """{title}

    Attention over variable-length sequences packed back to back (flash-attn's `flash_attn_varlen_func`
    convention): sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and rows
    cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k and v, and no query sees another sequence's keys. The causal mask
    and the window are aligned bottom-right per sequence (as in `fa2_attention` with that sequence's seqlen_q,
    seqlen_k). Key blocks outside a row block's sequence or window are never visited. Source: {source}

    Args:
        q: (total_q, n_heads, head_dim), float16, bfloat16 or float32, on a CUDA device (or the CPU under
           TRITON_INTERPRET=1).
        k, v: (total_k, n_kv_heads, head_dim), same dtype and device; n_heads a multiple of n_kv_heads (GQA).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) on q's device: 0, then the cumulative sequence lengths,
           ending at total_q / total_k. Empty sequences (equal neighbours) are allowed.
        max_seqlen_q, max_seqlen_k: ints >= the longest sequence's length (they size the launch grid; a value
           above total_q / total_k is taken as total_q / total_k).
        causal, softmax_scale, window_size: as in `fa2_attention`, per sequence.
        return_lse: also return the log-sum-exp of each query row's scaled (and capped) scores.
        softcap: keyword only; logit soft-capping as in `fa2_attention`: a float >= 0, 0.0 = off; with
           softcap > 0 each score s becomes softcap * tanh(s / softcap) (Gemma 2; flash-attn's `softcap`).
        check_offsets: check the values of cu_seqlens (below). That reads them on the host, a sync on a GPU;
           pass False for offsets valid by construction (e.g. from data.sampler). Never done under
           torch.compile, which cannot trace it. Unchecked offsets that break the contract make the kernels read
           and write outside q, k, v and o: wrong results, a crash or corrupted memory (on a GPU, an illegal
           memory access).

    Returns:
        o: (total_q, n_heads, head_dim), like q; or (o, lse) with lse (n_heads, total_q), float32, natural log,
        -inf for rows that see no key (their o and gradients are 0). Differentiable w.r.t. q, k and v, once
        (as `fa2_attention`);
        {gradients}

    Raises:
        TypeError: non-tensor inputs, unsupported or mismatched dtypes, cu_seqlens not int32, a non-int
            max_seqlen, a non-bool causal or return_lse, a softmax_scale or softcap that is not a number (a bool
            included), a window_size that is not a pair of ints.
        ValueError: wrong ranks or shapes (as in `fa2_attention`), cu_seqlens not 1-D with >= 2 entries or of
            different lengths or on another device, not starting at 0, decreasing, or not ending at total_q /
            total_k, a sequence longer than max_seqlen_*, a window_size value below -1, a softmax_scale or
            softcap out of range (as in `fa2_attention`; softcap > 0 for kernels without soft-capping). The
            offsets' values are checked only with check_offsets and outside torch.compile.
    """


QKVPACKED_DOC = """{title}

    `{name}_attention` over one packed qkv tensor, the output of a fused q, k, v projection (flash-attn's
    `flash_attn_qkvpacked_func`; FlashAttention-3's `num_heads_q` form for GQA). The backward writes dq, dk, dv
    straight into one gradient shaped like qkv, so the projection's backward reads it as it is; with separate q, k,
    v (`{name}_attention` on views of the projection), autograd concatenates three gradients into it, a copy of the
    whole gradient (torch.compile too: ~0.8 ms a GPT-2 124M step at batch 32, context 1024, on the H200).

    Args:
        qkv: (batch, seqlen, n_heads + 2 * n_kv_heads, head_dim): the n_heads query heads, then the key heads, then
           the value heads; or (batch, seqlen, 3, n_heads, head_dim) (n_kv_heads = n_heads). float16, bfloat16 or
           float32, on a CUDA device (or the CPU under TRITON_INTERPRET=1); any strides with a contiguous last dim
           (other layouts are copied once).
        n_heads: the number of query heads; None: qkv's heads split in three equal parts (no GQA).
        causal, softmax_scale, return_lse, window_size: as in `{name}_attention` (seqlen_q = seqlen_k = seqlen).
        softcap: keyword only; logit soft-capping as in `{name}_attention` (a float >= 0, 0.0 = off; each score s
           becomes softcap * tanh(s / softcap); Gemma 2, flash-attn's `softcap`; fa2 and fa3).

    Returns:
        o: (batch, seqlen, n_heads, head_dim), contiguous, qkv's dtype; or (o, lse) with lse (batch, n_heads,
        seqlen), float32, natural log (without gradient). Differentiable w.r.t. qkv, once (the gradient is shaped
        like qkv); {gradients}

    Raises:
        TypeError: qkv not a tensor, n_heads not an int or None, and as `{name}_attention`.
        ValueError: qkv not 4-D or (batch, seqlen, 3, n_heads, head_dim); heads that do not split into n_heads + 2 *
            n_kv_heads with both >= 1 (n_heads=None: not a multiple of 3); and as `{name}_attention` (head_dim,
            n_heads a multiple of n_kv_heads, empty dims, softmax_scale, window_size, softcap, device).
    """


VARLEN_QKVPACKED_DOC = """{title}

    `{name}_varlen_attention` over one packed qkv tensor of packed sequences, the fused q, k, v projection of a
    batch of documents packed back to back (flash-attn's `flash_attn_varlen_qkvpacked_func`): packed
    self-attention, one set of offsets for queries and keys. The backward writes dq, dk, dv into one gradient
    shaped like qkv, as `{name}_qkvpacked_attention` does, instead of returning three that autograd concatenates
    (a copy of the whole gradient).

    Args:
        qkv: (total, n_heads + 2 * n_kv_heads, head_dim): the n_heads query heads, then the key heads, then the
           value heads; or (total, 3, n_heads, head_dim) (n_kv_heads = n_heads). float16, bfloat16 or float32, on
           a CUDA device (or the CPU under TRITON_INTERPRET=1); any strides with a contiguous last dim (other
           layouts are copied once).
        cu_seqlens: int32 (batch + 1,) on qkv's device: 0, then the cumulative sequence lengths, ending at total.
           Empty sequences (equal neighbours) are allowed.
        max_seqlen: an int >= the longest sequence's length (a value above total is taken as total).
        n_heads: the number of query heads; None: qkv's heads split in three equal parts (no GQA).
        causal, softmax_scale, window_size, return_lse, softcap, check_offsets: as in `{name}_varlen_attention`.

    Returns:
        o: (total, n_heads, head_dim), contiguous, qkv's dtype; or (o, lse) with lse (n_heads, total), float32,
        natural log, -inf for rows that see no key (without gradient). Differentiable w.r.t. qkv, once (the
        gradient is shaped like qkv); {gradients}

    Raises:
        TypeError: qkv not a tensor, n_heads not an int or None, cu_seqlens not an int32 tensor, max_seqlen not an
            int, and as `{name}_attention`.
        ValueError: qkv not 3-D or (total, 3, n_heads, head_dim); heads that do not split into n_heads + 2 *
            n_kv_heads with both >= 1; cu_seqlens and max_seqlen as cu_seqlens_q and max_seqlen_q in
            `{name}_varlen_attention`; and as `{name}_attention` (head_dim, empty dims, softmax_scale,
            window_size, softcap, device).
    """
