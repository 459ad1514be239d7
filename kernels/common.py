"""Triton building blocks shared by the FA1 and FA2 kernels: tile loads/stores, the matmul, the backward's
preprocess kernel (delta = rowsum(dO * O)) and the autotune length bucket.

Every attention tile is (rows, HEAD_DIM) with a contiguous last dimension. HEAD_DIM need not be a power
of two (80, 96, ...): tiles are BLOCK_D = next_power_of_2(HEAD_DIM) wide and the extra columns are masked.
Which masks a load needs is decided at compile time (`tl.constexpr`), so the common case (full row block,
HEAD_DIM a power of two) compiles to unmasked, vectorised loads.
"""

import functools
import os

import torch
import triton
import triton.language as tl

from .launch import launch

# Read once, the same way Triton decides at decoration time whether `@triton.jit` functions are interpreted.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Passed to every kernel launch here: FMA contraction on, as every measurement in docs/ ran. Left unset, Triton 3.9
# warns at each process's first launch that its default turns it off in 3.10 (TRITON_DEFAULT_FP_FUSION).
LAUNCH_OPTIONS = {"enable_fp_fusion": True}


@triton.jit
def head_ptr(base, off_b, stride_b, off_h, stride_h):
    """Pointer to the (batch off_b, head off_h) slice; 64-bit offsets, so huge batches cannot overflow."""
    return base + off_b.to(tl.int64) * stride_b + off_h.to(tl.int64) * stride_h


@triton.jit
def load_tile(base, rows, stride_row, n_rows, cols, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              CHECK_ROWS: tl.constexpr):
    """Load rows `rows` of a (n_rows, HEAD_DIM) matrix at `base` as a (len(rows), BLOCK_D) tile.

    Out-of-range rows (only checked when CHECK_ROWS) and the padding columns past HEAD_DIM read as 0.
    """
    ptrs = base + rows[:, None] * stride_row + cols[None, :]
    if CHECK_ROWS:
        if BLOCK_D == HEAD_DIM:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM), other=0.0)
    else:
        if BLOCK_D == HEAD_DIM:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=cols[None, :] < HEAD_DIM, other=0.0)
    return x


@triton.jit
def tile_source(base, n_rows, stride_row, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                TMA: tl.constexpr):
    """What `load_rows` reads a (n_rows, HEAD_DIM) matrix at `base` through: with TMA a tensor descriptor for
    (BLOCK_ROWS, BLOCK_D) tiles (Hopper's tensor memory accelerator copies the tile to shared memory; rows and
    columns out of range read as 0), else the pointer itself."""
    if TMA:
        return tl.make_tensor_descriptor(base, shape=[n_rows, HEAD_DIM], strides=[stride_row, 1],
                                         block_shape=[BLOCK_ROWS, BLOCK_D])
    else:
        return base


@triton.jit
def load_rows(src, start, rows, stride_row, n_rows, cols, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              CHECK_ROWS: tl.constexpr, TMA: tl.constexpr):
    """Rows `rows` = start + arange(len(rows)) of the matrix behind `src` (see `tile_source`), as a tile."""
    if TMA:
        return src.load([start, 0])
    else:
        return load_tile(src, rows, stride_row, n_rows, cols, HEAD_DIM, BLOCK_D, CHECK_ROWS)


@triton.jit
def store_tile(base, x, rows, stride_row, n_rows, cols, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store a (len(rows), BLOCK_D) tile into rows `rows` of a (n_rows, HEAD_DIM) matrix at `base`."""
    ptrs = base + rows[:, None] * stride_row + cols[None, :]
    if BLOCK_D == HEAD_DIM:
        tl.store(ptrs, x, mask=rows[:, None] < n_rows)
    else:
        tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM))


@triton.jit
def visible_mask(rows, cols, seqlen_k, diag_offset, window_left, window_right, LEFT: tl.constexpr,
                 RIGHT: tl.constexpr):
    """Mask of visible scores for broadcastable query-row and key indices (rows[:, None] and cols[None, :] for an
    S tile, rows[None, :] and cols[:, None] for S^T). Key j is visible to query i iff j < seqlen_k and

        i + diag_offset - window_left <= j <= i + diag_offset + window_right,

    each side checked only where it is limited (LEFT / RIGHT constexprs). diag_offset = seqlen_k - seqlen_q aligns
    the window bottom-right, as flash-attn does; causal is RIGHT with window_right = 0.
    """
    visible = cols < seqlen_k
    if RIGHT:
        visible = visible & (cols <= rows + (diag_offset + window_right))
    if LEFT:
        visible = visible & (cols >= rows + (diag_offset - window_left))
    return visible


@triton.jit
def tanh(x):
    """tanh of a float32 tile, to float32 precision everywhere. Built from exp2: libdevice's tanh does not run
    under Triton's interpreter. Small |x| take the Taylor series, where 1 - 2 / (e^2x + 1) would cancel (its error
    is ~1e-7 absolute, which a large softcap would scale up into the scores). |x| >= 10 is +-1 in float32: clamped
    there, so exp2 cannot overflow."""
    x = tl.clamp(x, -10.0, 10.0)
    big = 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)  # 2 * log2(e)
    x2 = x * x
    small = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397)))
    return tl.where(tl.abs(x) < 0.125, small, big)


def softcap_args(softmax_scale: float, softcap: float, log2e: float) -> tuple[float, float]:
    """The kernels' (qk_scale, softcap_scale): the score in the kernels' log base (`log2e`: log2(e) for base-2
    kernels) is q.k * qk_scale, or with logit soft-capping (softcap > 0; s -> softcap * tanh(s / softcap),
    s = softmax_scale * q.k) t * qk_scale with t = tanh(q.k * softcap_scale). Without softcap, softcap_scale is
    0.0 (unused). Clamped to float32's range, so an extreme softcap saturates instead of giving inf * 0."""
    if not softcap > 0:
        return softmax_scale * log2e, 0.0
    f32_max = torch.finfo(torch.float32).max
    return min(softcap * log2e, f32_max), min(softmax_scale / softcap, f32_max)


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr):
    """tl.dot(a, b, acc): a @ b accumulated into acc (float32) in place, as one fused multiply-add.

    UPCAST is set only under Triton's interpreter for bfloat16 operands: the interpreter of triton 3.9
    multiplies bfloat16 tiles as raw 16-bit integers. Upcasting the (already bf16-rounded) values to
    float32 gives the product the GPU computes.
    """
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc)


def upcast_dot(dtype) -> bool:
    """Whether `mma` must upcast operands of this torch dtype (bf16 under the interpreter)."""
    return INTERPRET and dtype == torch.bfloat16


@functools.lru_cache(maxsize=None)
def _has_tma(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def _tma_scratch(size: int, alignment: int, stream):
    # Kernels that build TMA descriptors on the device write them to global scratch memory.
    return torch.empty(size, device="cuda", dtype=torch.int8)


def use_tma(*tensors: torch.Tensor) -> bool:
    """Whether the kernels may read these (batch, heads, seqlen, head_dim) tensors through TMA descriptors:
    16-bit floats on a Hopper-or-newer GPU (or under the interpreter) with 16-byte aligned data and non-zero
    16-byte multiple strides, as TMA requires. Other inputs take the pointer path. Also installs Triton's scratch allocator, which is
    per thread (a ContextVar) and autograd runs the backward in its own thread."""
    t = tensors[0]
    if t.dtype not in (torch.float16, torch.bfloat16):
        return False
    if not INTERPRET and not (t.is_cuda and _has_tma(t.device)):
        return False
    def addressable(x: torch.Tensor) -> bool:  # TMA strides: non-zero 16-byte multiples
        return x.data_ptr() % 16 == 0 and all(s > 0 and s * x.element_size() % 16 == 0 for s in x.stride()[:-1])

    if not all(addressable(x) for x in tensors):
        return False
    if not INTERPRET:
        triton.set_allocator(_tma_scratch)
    return True


def empty_like_layout(t: torch.Tensor, shape=None, dtype=None) -> torch.Tensor:
    """An uninitialised tensor shaped like `t` (batch, heads, seqlen, head_dim) with a contiguous last dim and the
    other dims in memory in t's order, even when t has gaps (e.g. q sliced from a fused (B, T, 3, H, D)
    projection: the result is (B, H, T, D) stored as (B, T, H, D)). torch.empty_like falls back to a
    contiguous (B, H, T, D) there, which makes the model's o.transpose(1, 2).contiguous() a real copy.
    Broadcast views (a stride of 0, e.g. from expand) get a contiguous tensor. `shape` / `dtype`: another shape
    of the same rank (e.g. a padded seqlen) or dtype, the dims still in t's memory order."""
    shape = t.shape if shape is None else shape
    dtype = t.dtype if dtype is None else dtype
    order, inverse = _memory_order(t.shape, t.stride())
    if order is None:
        return torch.empty(shape, device=t.device, dtype=dtype)
    return torch.empty([shape[d] for d in order], device=t.device, dtype=dtype).permute(inverse)


@functools.lru_cache(maxsize=1024)  # asked several times a call; ~10 us of Python on the GPU machines' hosts
def _memory_order(shape: tuple, strides: tuple) -> tuple:
    """`empty_like_layout`'s (dims outermost first with the last one last, the permutation back), or (None, None)
    for a broadcast view (a stride of 0 over more than one element) or dims already in that order."""
    if any(s == 0 for s, n in zip(strides, shape) if n > 1):
        return None, None
    order = sorted(range(len(shape) - 1), key=lambda d: (-strides[d], d)) + [len(shape) - 1]
    if order == list(range(len(shape))):
        return None, None
    return order, [order.index(d) for d in range(len(shape))]


def grad_buffers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out=None) -> tuple:
    """The backward's dq, dk, dv: `out` when given (three tensors shaped like q, k, v with q's dtype and device
    and a unit last stride, any other strides: e.g. views into the (batch, seqlen, heads, head_dim) gradient of a
    fused qkv projection, which the kernels then write in place), else new tensors in q, k, v's memory order.
    Raises ValueError naming the buffer that does not fit."""
    if out is None:
        return empty_like_layout(q), empty_like_layout(k), empty_like_layout(v)
    if not (isinstance(out, (tuple, list)) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out)):
        raise ValueError(f"out must be three tensors (dq, dk, dv), got {out!r}")
    for name, g, t in zip(("dq", "dk", "dv"), out, (q, k, v)):
        if g.shape != t.shape or g.dtype != t.dtype or g.device != t.device or g.stride(-1) != 1:
            raise ValueError(f"out's {name} must be {t.dtype} {tuple(t.shape)} on {t.device} with a unit last "
                             f"stride (like {name[1]}), got {g.dtype} {tuple(g.shape)} on {g.device} with strides "
                             f"{tuple(g.stride())}")
    return tuple(out)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, as `triton.cdiv`, in plain Python: Triton's is a constexpr function that unwraps
    its arguments (~4 us a call on the GPU machines' hosts, and a launch asks several)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0), as `triton.next_power_of_2`, in plain Python."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def block_d(head_dim: int) -> int:
    """Tile width for a head dimension: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, next_power_of_2(head_dim))


def compile_sm90(fn, constexprs: dict, types, num_warps: int, **options):
    """Compile the @triton.jit function `fn` for sm_90 without a GPU (what only the GPU compiler rejects, the
    interpreter runs; call it without TRITON_INTERPRET): `constexprs` by name, `types(arg)` the Triton type of each
    other argument ("*bf16", "i32", ...), with `num_warps`, LAUNCH_OPTIONS and `options`. Returns Triton's compiled
    kernel (`.asm` holds ttgir, ptx and cubin)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {arg: "constexpr" if arg in constexprs else types(arg) for arg in fn.arg_names}
    source = ASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, **options, **LAUNCH_OPTIONS})


def bucket(n: int) -> int:
    """Autotune key for a sequence length: the next power of two, capped at 2048 (the best tiles stop
    changing there), so a run with varying lengths tunes a handful of times, not once per length."""
    return min(next_power_of_2(n), 2048)


def check_grid(batch: int, n_heads: int) -> None:
    # (batch * n_heads) is the grid's second axis, which CUDA limits to 65535.
    if batch * n_heads > 65535:
        raise ValueError(f"batch * n_heads = {batch * n_heads} exceeds 65535; split the batch into smaller calls")


@triton.jit
def _bwd_preprocess(
    O, DO, DELTA, DQ_ACC,
    stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom, stride_dqb, stride_dqh, stride_dqm,
    n_heads, seqlen_q, seqlen_q_pad,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, ZERO_DQ: tl.constexpr,
):
    # Backward step 1 of 3 (FA2 paper, Algorithm 2 line 4): delta_i = rowsum(dO_i * O_i), float32.
    # ZERO_DQ: also zero these rows of a float32 (batch, n_heads, seqlen_q_pad, HEAD_DIM) dQ accumulator with a
    # unit last stride (FA3's preprocess does the same), which saves a separate memset launch.
    off_bh = tl.program_id(1)
    off_b, off_h = off_bh // n_heads, off_bh % n_heads
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o_ptrs = head_ptr(O, off_b, stride_ob, off_h, stride_oh)
    do_ptrs = head_ptr(DO, off_b, stride_dob, off_h, stride_doh)
    o = load_tile(o_ptrs, offs_m, stride_om, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, True)
    do = load_tile(do_ptrs, offs_m, stride_dom, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + off_bh.to(tl.int64) * seqlen_q + offs_m, delta, mask=offs_m < seqlen_q)
    if ZERO_DQ:
        dq_ptrs = (head_ptr(DQ_ACC, off_b, stride_dqb, off_h, stride_dqh) + offs_m[:, None] * stride_dqm
                   + offs_d[None, :])
        tl.store(dq_ptrs, tl.zeros([BLOCK_M, BLOCK_D], tl.float32),
                 mask=(offs_m[:, None] < seqlen_q_pad) & (offs_d[None, :] < HEAD_DIM))


PREPROCESS_BLOCK_M = 64


def bwd_preprocess(o, do, dq_acc=None):
    """delta = rowsum(do * o): float32 (batch, n_heads, seqlen_q). o, do: (batch, n_heads, seqlen_q, head_dim).

    dq_acc: optional float32 (batch, n_heads, seqlen_q_pad, head_dim) with seqlen_q_pad >= seqlen_q (the Gluon
    backward pads to whole query blocks) and a unit last stride, any other strides (the Gluon backward keeps it in
    q's memory order); zeroed in the same kernel. ValueError if it is not that."""
    batch, n_heads, seqlen_q, head_dim = o.shape
    seqlen_q_pad = seqlen_q
    if dq_acc is not None:
        seqlen_q_pad = dq_acc.shape[2] if dq_acc.dim() == 4 else -1
        if (tuple(dq_acc.shape) != (batch, n_heads, seqlen_q_pad, head_dim) or seqlen_q_pad < seqlen_q
                or dq_acc.dtype != torch.float32 or dq_acc.stride(3) != 1):
            raise ValueError(f"dq_acc must be a float32 (batch, n_heads, seqlen_q_pad, head_dim) = "
                             f"({batch}, {n_heads}, >= {seqlen_q}, {head_dim}) tensor with a unit last stride; got "
                             f"{dq_acc.dtype} {tuple(dq_acc.shape)} with strides {tuple(dq_acc.stride())}")
    grid = (cdiv(seqlen_q_pad, PREPROCESS_BLOCK_M), batch * n_heads)
    delta = torch.empty((batch, n_heads, seqlen_q), device=o.device, dtype=torch.float32)
    launch(
        _bwd_preprocess, grid,
        o, do, delta, delta if dq_acc is None else dq_acc, *o.stride()[:3], *do.stride()[:3],
        *(dq_acc.stride()[:3] if dq_acc is not None else (0, 0, 0)), n_heads, seqlen_q,
        seqlen_q_pad, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=PREPROCESS_BLOCK_M,
        ZERO_DQ=dq_acc is not None, **LAUNCH_OPTIONS,
    )
    return delta
