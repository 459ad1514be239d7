"""FlashAttention-3 for Hopper: the Gluon forward (`kernels/fa3_hopper.py`) and backward
(`kernels/fa3_hopper_bwd.py`), and when FA2's Triton kernels run instead.

Every call asks `plan(direction, q, k, v, causal, ...)`, which reads one ordered table of rules (`RULES`) over the
call's facts (`Facts`): first eligibility (an sm_90 GPU, a Triton whose Gluon API the kernels are written for,
float16/bfloat16, head_dim 64, 96, 128 or 256 (the backward 64, 96 or 128), packed variable-length sequences only with
one set of offsets (packed self-attention: cu_seqlens_k equal to cu_seqlens_q), inputs TMA can address), whose misses
fall back to FA2 with a one-time RuntimeWarning naming the reason; then performance (the backward below
`BACKWARD_MIN_SEQLEN_K` keys, where FA2's measured faster); then determinism (the Gluon backward adds dQ up in
float32 through TMA reduce-adds, as FA3 does, so it is not bit-reproducible: under
`torch.use_deterministic_algorithms(True)` FA2's backward runs, except where the backward's config has
`separate_dq` (narrow sliding windows, wider ones on unpacked sequences at 96 and 128, short keys at 64), whose dQ
comes from FA2's kernel without atomics). The last two
are choices, not fallbacks: no warning.
The forward and the backward decide the same way but at head_dim 256, where the Gluon forward runs and FA2's backward
(with the warning: the Gluon backward's dK and dV do not fit the registers at 256).

head_dim 96 runs the 128-wide kernels (`KERNEL_HEAD_DIMS`) on the 96-wide tensors, at 128's cost: TMA zero-fills
the columns past 96 on loads and clips them on stores.

The tile configs are data: `ForwardConfig` per (head_dim, causal) and `BackwardConfig` per head_dim, measured with
`python -m tools.fa3_variants` and `tools.fa3_window_configs` (docs/hopper-notes.md; on the H200, most entries for
short keys, narrow windows and packed documents on an H100), picked by `decide`. `run_forward` /
`run_backward` launch the Gluon kernels with any config (the tuning tools pass theirs).
"""

import functools
import os
import sys
import warnings
import weakref
from typing import Callable, NamedTuple, Optional

import torch
import triton
import triton.language as tl

from . import fa2
from .common import (
    INTERPRET, LAUNCH_OPTIONS, bwd_preprocess, cdiv, empty_like_layout, grad_buffers, next_power_of_2, use_tma,
)
from .launch import Prepared
from .fa3_schedule import block_order, doc_bounds, tile_order

# Triton releases (major.minor) whose Gluon Hopper API the kernels are written for: `kernels/gluon_compat.py` maps
# their differences; `tools/check_triton_versions.sh` compiles both kernels on each.
GLUON_TRITON_VERSIONS = ("3.6", "3.7", "3.8", "3.9")
# The head_dims the Gluon forward takes, each with the tile width (the kernels' HEAD_DIM) it runs at: 96 runs the
# 128-wide kernels, at 128's cost. The descriptors keep the tensors' own 96-wide shape, so TMA zero-fills columns
# 96-127 on loads (q k^T and dO v^T add 0, o and the gradients get zero columns there) and clips them on stores and
# dQ's reduce-adds.
KERNEL_HEAD_DIMS = {64: 64, 96: 128, 128: 128, 256: 256}
HEAD_DIMS = tuple(KERNEL_HEAD_DIMS)  # the Gluon forward's
DTYPES = (torch.float16, torch.bfloat16)
BLOCK_M = 64  # the forward's query rows per consumer warpgroup (a wgmma's M)
SM90_SHARED_MEMORY = 227 * 1024  # bytes of shared memory an sm_90 block may have (a larger kernel fails at launch)


class ForwardConfig(NamedTuple):
    """The Gluon forward's tiles and schedule (`kernels/fa3_hopper.py`)."""
    num_consumers: int  # consumer warpgroups, BLOCK_M query rows each (2 or 3)
    block_n: int  # keys per K/V block
    num_stages: int  # depth of the K/V shared-memory ring
    pingpong: bool  # consumers take turns issuing their GEMMs (FA3 Section 3.1)
    persistent: bool  # one CTA per SM looping over tiles, else one CTA per tile
    late_k_release: bool = False  # a consumer gives K_j's ring slot back after block j's softmax, not once S_j is done
    # Causal: the last rounds' long-short pairs run as single tiles, longest first (`tail_start`), so that the
    # CTAs finish together.
    tail: bool = False


class BackwardConfig(NamedTuple):
    """The Gluon backward's tiles (`kernels/fa3_hopper_bwd.py`): num_consumers x 64 keys per CTA."""
    num_stages: int  # depth of the (Q_i, dO_i) ring
    split_dq: str  # "cols" / "rows": each warpgroup computes a share of dQ_i's columns / rows over all the keys
    block_m: int  # query rows per step (64 or 128; with "rows", 64 per consumer)
    # (batch, kv head) pairs launched together, key block by key block (`_cta_block`): every pair's first (under
    # a causal mask the longest) key block starts before any second one, and the CTAs in flight share these pairs'
    # Q, dO and dQ in L2. 0: a wave's worth (SMs // key blocks); 1: one pair's key blocks after another's.
    section_heads: int = 0
    num_consumers: int = 2  # consumer warpgroups, 64 keys each (1 or 2)
    # registers a thread at launch (Triton's `maxnreg`), 0 for Triton's choice (all of an SM's for one CTA). One
    # consumer with 128: 8 warps x 128 fit two CTAs an SM, the consumer taking the producer's unused share.
    maxnreg: int = 0
    # dQ from FA2's query-major kernel (`fa2.backward_dq`) after the Gluon dK/dV kernel, instead of float32
    # reduce-adds into an accumulator that is zeroed before and cast after (FA2's recompute of S and dP for dQ
    # against 2 of the accumulator's 4 bytes an element in each of three passes): faster where the key blocks
    # are few per query block (short keys, narrow windows, short documents).
    separate_dq: bool = False
    # Query blocks from the last to the first, every query head of the group at each block, instead of head after
    # head from the diagonal on: under a causal mask the CTAs in flight then read the same Q and dO rows together.
    # Off in every config: measured against the current order it gained at GQA 8 causal 2k only, not at 8k where
    # L2 reuse would have shown, and lost 3 % non-causal (docs/hopper-notes.md, "FA3 backward variant 17").
    lockstep: bool = False
    # Query heads a CTA loops over, of its GQA group: the largest divisor of the group up to this many (`cta_heads`:
    # 2 at a group of 3 runs 1); 0, or the group or more: all of them, dK and dV stored once, bit-reproducible.
    # Fewer (FA3's one): the group's CTAs for the same keys reduce-add their dK and dV into float32 accumulators,
    # then cast, so the CTAs in flight read fewer heads' Q and dO. Needs a (64, head_dim or head_dim / 2) dQ box,
    # whose float32 staging tile carries the reduce-adds.
    heads_per_cta: int = 0

    def cta_heads(self, group: int) -> int:
        """The query heads one CTA takes at GQA group size `group` (1 without GQA): the largest divisor of the
        group not above heads_per_cta, the whole group for 0. ValueError for a negative heads_per_cta."""
        if self.heads_per_cta < 0:
            raise ValueError(f"BackwardConfig.heads_per_cta={self.heads_per_cta!r}; accepted 0 (the whole GQA group) "
                             "or more")
        limit = self.heads_per_cta or group
        return max(d for d in range(1, min(limit, group) + 1) if group % d == 0)

    def reduces_kv(self, head_dim: int, group: int) -> bool:
        """Whether the group's CTAs reduce-add dK and dV (`cta_heads` < group); ValueError for a config the kernel
        cannot run (`dq_box`), or whose dQ box cannot stage them (it must be 64 rows of head_dim or head_dim / 2
        columns)."""
        rows, cols = self.dq_box(head_dim)
        if self.cta_heads(group) == group:
            return False
        if rows != 64 or head_dim // cols not in (1, 2):
            raise ValueError(f"BackwardConfig.heads_per_cta={self.heads_per_cta} needs a dQ box of 64 rows and "
                             f"{head_dim} or {head_dim // 2} columns to stage dK and dV; this config's is "
                             f"({rows}, {cols})")
        return True

    def constexprs(self, head_dim: int, group: int) -> dict:
        """The backward kernel's tile constexprs (not its layouts) at kernel head_dim `head_dim` (`kernel_head_dim`)
        and GQA group size `group`, for `run_backward` and `compile_for_sm90` alike; ValueError for a config the
        kernel cannot run there (`dq_box`, `reduces_kv`)."""
        self.reduces_kv(head_dim, group)
        return dict(GROUP=group, HEADS=self.cta_heads(group), NUM_CONSUMERS=self.num_consumers, HEAD_DIM=head_dim,
                    BLOCK_M=self.block_m, NUM_STAGES=self.num_stages, SPLIT_DQ=self.split_dq,
                    SEPARATE_DQ=self.separate_dq, LOCKSTEP=self.lockstep)

    @property
    def block_n(self) -> int:
        """Keys per CTA."""
        return self.num_consumers * 64

    def dq_box(self, head_dim: int) -> tuple[int, int]:
        """(rows, columns) of one warpgroup's share of a query block's dQ; ValueError for a config the kernel
        cannot run."""
        if self.split_dq not in ("cols", "rows"):
            raise ValueError(f"BackwardConfig.split_dq={self.split_dq!r}; accepted 'cols', 'rows'")
        if self.num_consumers not in (1, 2):
            raise ValueError(f"BackwardConfig.num_consumers={self.num_consumers!r}; accepted 1, 2")
        rows_block = 64 * self.num_consumers
        if self.block_m not in (64, 128) or (self.split_dq == "rows" and self.block_m != rows_block):
            raise ValueError(f"BackwardConfig.block_m={self.block_m!r} with split_dq={self.split_dq!r} and "
                             f"num_consumers={self.num_consumers}; accepted 64 or 128, and {rows_block} for 'rows' "
                             "(64 rows a warpgroup: a wgmma's M)")
        if self.section_heads < 0:
            raise ValueError(f"BackwardConfig.section_heads={self.section_heads!r}; accepted 0 (a wave's worth) "
                             "or more")
        if self.maxnreg and not (self.maxnreg % 8 == 0 and 64 <= self.maxnreg <= 256):
            raise ValueError(f"BackwardConfig.maxnreg={self.maxnreg!r}; accepted 0 (Triton's choice) or a "
                             "multiple of 8 from 64 to 256")
        if self.split_dq == "rows":
            return self.block_m // self.num_consumers, head_dim
        return self.block_m, head_dim // self.num_consumers


# Measured on the H200 (docs/hopper-notes.md): at 64, two consumers for causal and three for non-causal, a 4-deep
# ring for causal; ping-pong everywhere but causal 128. NUM_CONSUMERS x 64 x D Q and O tiles plus the K and V rings
# must fit the 227 KiB of shared memory (an overflow is only caught at launch). 96 takes 128's (`forward_configs`).
# At 256 (not measured; what fits): the Q and O tiles take 128 KB, so 32-key blocks in a 3-deep ring (96 KB):
# 229,832 B in all (64-key blocks fit only a 1-deep ring); the 64 x 256 float32 O accumulator is 128 of a consumer's
# 240 registers, no spills (sm_90 compile, Triton 3.8).
_FORWARD_256 = ForwardConfig(2, 32, 3, True, True)
# The causal tail (`tail`) at 128 only: there it measured 2-3 % faster at 8k-16k and level at 2k-4k; at 64 the
# kernel with its code ran 7-9 % slower even with the tail unused, 4-6 % with it (H100, Triton 3.6,
# docs/hopper-notes.md "FA3 forward variant 30"). At 256 not measured.
_FORWARD_CONFIGS = {
    (64, True): ForwardConfig(2, 128, 4, True, True), (64, False): ForwardConfig(3, 128, 3, True, True),
    (128, True): ForwardConfig(2, 128, 2, False, True, tail=True), (128, False): ForwardConfig(2, 128, 2, True, True),
    (256, True): _FORWARD_256, (256, False): _FORWARD_256,
}
# Per Triton release (major, minor), from that release on. Triton 3.9's code for the head_dim-64 causal forward
# runs 5-7 % behind 3.6's with the same config; releasing each K slot after the softmax (its arrive is a warpgroup
# barrier, which then no longer sits between S_j and the softmax) brings it within 1-3 % (H200, both releases'
# cubins in one process). Under 3.6 the late release measured 0-2.6 % slower, and with the 2- and 3-deep rings of
# the other configs up to 30 % slower under either release: the producer waits for the slot.
_FORWARD_CONFIGS_FROM = {(3, 9): {(64, True): ForwardConfig(2, 128, 4, True, True, late_k_release=True)}}


def forward_configs(version: str) -> dict[tuple[int, bool], ForwardConfig]:
    """The forward's config per (head_dim, causal) for Triton `version` ("3.9.0"); head_dim 96 runs the 128-wide
    kernel (`KERNEL_HEAD_DIMS`) with 128's config."""
    release = tuple(int(part) for part in version.split(".")[:2])
    configs = dict(_FORWARD_CONFIGS)
    for since, changes in sorted(_FORWARD_CONFIGS_FROM.items()):
        if release >= since:
            configs.update(changes)
    configs.update({(96, causal): configs[128, causal] for causal in (True, False)})
    return configs


FORWARD_CONFIGS = forward_configs(triton.__version__)
# Packed documents without a sliding window at 64: three consumers on 64-key blocks. Documents of median 600
# (bench.masks' varlen shape, D 64): 0.184 ms against the causal config's 0.193 (H200), 0.183 against 0.195 (H100).
# Long documents (median 2000-6000) run within 2 % of the causal configs either way, and GPT-2 on Shakespeare's
# scenes trains at the same speed with both (H100, benchmarks.md). With a window too it is not measured apart.
PACKED_FORWARD_CONFIGS = {64: ForwardConfig(3, 64, 3, True, True)}
# Narrow sliding windows (both edges within NARROW_WINDOW, `narrow_band`): 64-key blocks waste less of the band
# than 128-key ones. Measured at window 128 (docs/hopper-notes.md, "FA3 variant 20"; docs/benchmarks.md, "Narrow
# windows"): gpt-oss's layers (B 2, H 128, N 8192, D 64) 0.535 ms against 0.686 (H200); B 2, H 64, N 8192, D 128
# 0.386 against 0.443 (H100). 96 runs the 128-wide kernel. Wider windows keep the causal config (at window 1024
# 64-key blocks measured 3-9 % slower).
NARROW_WINDOW = 128
_NARROW_FORWARD_128 = ForwardConfig(2, 64, 4, False, True)
NARROW_WINDOW_FORWARD_CONFIGS = {64: ForwardConfig(2, 64, 4, True, True), 96: _NARROW_FORWARD_128,
                                 128: _NARROW_FORWARD_128}
# At 64, 128 query rows with dQ split by rows measured 3-9 % faster than 64 rows; at 128, BLOCK_M 128 fits neither
# the registers nor the shared memory. Shared memory: 199 KB at 64, 198 KB at 128 (and 96, the same kernel). At 256
# none fits (`BACKWARD_HEAD_DIMS`): 64 x 256 float32 dK and dV are 256 registers a thread (1040 B of stack spilled)
# and the K, V, Q and dO tiles 361,872 B of shared memory with a 2-deep ring, 295,824 B with a 1-deep one (sm_90
# compile, Triton 3.8). With GQA a CTA takes two query heads of its group at 128 (one head 0.99x, two 1.05x, four
# 1.00x, all eight 0.75x cuDNN at group 8, causal, 2k; non-causal 0.95-1.06x for all) and the whole group at 64
# (group 8, causal 2k: 1.16x against four heads' 1.11x and two's 1.08x; H100, docs/hopper-notes.md, "FA3 backward
# variant 18").
BACKWARD_CONFIGS = {64: BackwardConfig(2, "rows", 128),
                    96: BackwardConfig(2, "cols", 64, heads_per_cta=2),
                    128: BackwardConfig(2, "cols", 64, heads_per_cta=2)}
BACKWARD_HEAD_DIMS = tuple(BACKWARD_CONFIGS)  # the Gluon backward's: at 256 its dK and dV overflow the registers
# Where few key blocks meet each query block (a window within NARROW_WINDOW on each side; at 64 also keys up to
# SHORT_BACKWARD_SEQLEN_K, FA2's backward running below BACKWARD_MIN_SEQLEN_K): one consumer warpgroup (64-key
# CTAs, 50 KB of shared memory at 64 and 100 KB at 128, 128 registers a thread at launch, so two CTAs an SM), dQ
# from FA2's query-major kernel (no float32 accumulator passes). Measured on an H100 (docs/hopper-notes.md, "FA3
# backward variant 15" and "16"): gpt-oss's window 128 2.03 -> 1.54 ms, window 128 at D 128 (B 2, H 64, N 8192)
# 1.83 -> 1.33 ms, the causal 1k backward at 64 1.07x -> 1.18x cuDNN; slower than BACKWARD_CONFIGS from 2k keys
# non-causal, at 8k causal and at window 1024.
_ONE_CONSUMER_SEPARATE_DQ = BackwardConfig(2, "rows", 64, 0, 1, 128, True)
NARROW_WINDOW_BACKWARD_CONFIGS = {d: _ONE_CONSUMER_SEPARATE_DQ for d in (64, 96, 128)}
# Under torch.use_deterministic_algorithms(True), wider windows on unpacked sequences at 96 and 128 take the same
# bit-reproducible config instead of FA2's backward. At window 1024 (B 2, H 16, N 8192; H100, benchmarks.md):
# through `fa3_attention` under deterministic algorithms 0.987 ms against FA2's 1.208 at D 128, but 0.681 against
# 0.652 at D 64, so 64 keeps FA2's (96 runs the 128-wide kernel, as FA2's pads 96 to 128; not measured apart).
# Full attention and packed documents keep FA2's: not measured apart.
DETERMINISTIC_WINDOW_BACKWARD_CONFIGS = {d: _ONE_CONSUMER_SEPARATE_DQ for d in (96, 128)}
SHORT_BACKWARD_CONFIGS = {64: _ONE_CONSUMER_SEPARATE_DQ}
SHORT_BACKWARD_SEQLEN_K = 1024
# Packed documents at 64 take the one-consumer kernel with the float32 dQ accumulator: FA2's varlen dQ kernel
# measured slower there (documents of median 600: 0.675 ms against 0.550, H100).
PACKED_BACKWARD_CONFIGS = {64: BackwardConfig(2, "rows", 64, 0, 1, 128)}
# The Gluon backward from this many keys (seqlen_k) on, FA2's below: at 128 faster everywhere measured (96 runs the
# same kernel, as FA2's pads 96 to 128 too); at 64 from 1k keys (GPT-2's context, the shortest measured: 0.98-0.99x
# cuDNN causal against FA2's 0.955x).
BACKWARD_MIN_SEQLEN_K = {64: 1024, 96: 1, 128: 1}


class Facts(NamedTuple):
    """What `plan` decides from: the call's direction and inputs, and the machine."""
    direction: str  # "forward" or "backward"
    environment: Optional[str]  # why the Gluon kernels cannot run here at all (`gluon_device_reason`), or None
    dtype: torch.dtype
    head_dim: int
    seqlen_k: int
    causal: bool  # a causal mask, a sliding window or packed sequences: the tile configs measured for causal
    window_left: int  # the sliding window's left edge (`fa2.window_edges`), -1 for none
    window_right: int  # its right edge (0 under a causal mask), -1 for none
    varlen: bool  # packed variable-length sequences (cu_seqlens)
    shared_offsets: bool  # cu_seqlens_k equals cu_seqlens_q (packed self-attention); True without varlen
    tma_ok: bool  # every tensor the kernel reads or writes through TMA meets `common.use_tma`
    deterministic: bool  # torch.are_deterministic_algorithms_enabled()


class Plan(NamedTuple):
    """`plan`'s answer: which kernel runs, why FA2's when it does, and the Gluon kernel's config."""
    kernel: str  # "gluon" or "fa2"
    reason: Optional[str] = None  # why FA2's kernel runs
    warn: bool = False  # the reason is a fallback the caller is warned about once, not a measured choice
    config: Optional[ForwardConfig | BackwardConfig] = None


def narrow_band(f: Facts) -> bool:
    """Whether each query sees at most NARROW_WINDOW keys on either side: a sliding window with both edges."""
    return 0 <= f.window_left <= NARROW_WINDOW and 0 <= f.window_right <= NARROW_WINDOW


def pick_backward_config(f: Facts) -> BackwardConfig:
    """The Gluon backward's config for `f`: PACKED_BACKWARD_CONFIGS for packed sequences,
    DETERMINISTIC_WINDOW_BACKWARD_CONFIGS for a sliding window on unpacked sequences under deterministic algorithms,
    NARROW_WINDOW_BACKWARD_CONFIGS for a narrow band, SHORT_BACKWARD_CONFIGS up to SHORT_BACKWARD_SEQLEN_K keys,
    else BACKWARD_CONFIGS (each at f.head_dim where it has an entry). KeyError for a head_dim outside
    BACKWARD_HEAD_DIMS (`RULES` sends those to FA2 first)."""
    if f.varlen and f.head_dim in PACKED_BACKWARD_CONFIGS:
        return PACKED_BACKWARD_CONFIGS[f.head_dim]
    if (f.deterministic and not f.varlen and f.window_left >= 0
            and f.head_dim in DETERMINISTIC_WINDOW_BACKWARD_CONFIGS):
        return DETERMINISTIC_WINDOW_BACKWARD_CONFIGS[f.head_dim]
    if narrow_band(f) and f.head_dim in NARROW_WINDOW_BACKWARD_CONFIGS:
        return NARROW_WINDOW_BACKWARD_CONFIGS[f.head_dim]
    if f.head_dim in SHORT_BACKWARD_CONFIGS and f.seqlen_k <= SHORT_BACKWARD_SEQLEN_K:
        return SHORT_BACKWARD_CONFIGS[f.head_dim]
    return BACKWARD_CONFIGS[f.head_dim]


def _reproducible(config: BackwardConfig) -> bool:
    """Whether the Gluon backward with `config` is bit-reproducible: no dQ reduce-adds (separate_dq) and no dK/dV
    ones (each CTA takes its whole GQA group)."""
    return config.separate_dq and config.heads_per_cta == 0


def _backward_only(rule: Callable[[Facts], Optional[str]]) -> Callable[[Facts], Optional[str]]:
    return lambda f: rule(f) if f.direction == "backward" else None


# (warn, rule): in order, the first rule that names a reason sends the call to FA2's kernels.
RULES: tuple[tuple[bool, Callable[[Facts], Optional[str]]], ...] = (
    # eligibility: a fallback, warned about once per reason
    (True, lambda f: f.environment),
    (True, lambda f: None if f.dtype in DTYPES else f"dtype {f.dtype} (the Gluon kernel takes float16 and bfloat16)"),
    (True, lambda f: None if f.head_dim in HEAD_DIMS else
        f"head_dim {f.head_dim} (the Gluon kernels take {', '.join(map(str, HEAD_DIMS))})"),
    (True, _backward_only(lambda f: None if f.head_dim in BACKWARD_HEAD_DIMS else
        f"head_dim {f.head_dim} in the backward (the Gluon backward takes {', '.join(map(str, BACKWARD_HEAD_DIMS))}: "
        f"at {f.head_dim} its float32 dK and dV accumulators do not fit a warpgroup's registers, nor its tiles the "
        "shared memory)")),
    (True, lambda f: "packed sequences whose cu_seqlens_k differs from cu_seqlens_q (the Gluon kernels take one "
        "set of offsets: packed self-attention)" if f.varlen and not f.shared_offsets else None),
    (True, lambda f: None if f.tma_ok else
        "inputs TMA cannot address (16-byte aligned data and 16-byte multiple strides needed)"),
    # performance: FA2's backward measured faster on short keys
    (False, _backward_only(lambda f: None if f.seqlen_k >= BACKWARD_MIN_SEQLEN_K[f.head_dim] else
        f"seqlen_k {f.seqlen_k} < {BACKWARD_MIN_SEQLEN_K[f.head_dim]} at head_dim {f.head_dim}: FA2's backward "
        "measured faster")),
    # determinism: the Gluon backward's dQ and dK/dV reduce-adds are not bit-reproducible (`_reproducible`)
    (False, _backward_only(lambda f: "deterministic algorithms: FA2's atomic-free backward"
        if f.deterministic and not _reproducible(pick_backward_config(f)) else None)),
)


def decide(facts: Facts) -> Plan:
    """The kernel `RULES` pick for `facts`; the Gluon kernel's config: FORWARD_CONFIGS, or PACKED_FORWARD_CONFIGS
    for packed sequences without a window and NARROW_WINDOW_FORWARD_CONFIGS for a narrow band, forward;
    `pick_backward_config` backward."""
    if facts.direction not in ("forward", "backward"):
        raise ValueError(f"direction={facts.direction!r}; accepted 'forward', 'backward'")
    for warn, rule in RULES:
        reason = rule(facts)
        if reason is not None:
            return Plan("fa2", reason, warn)
    if facts.direction == "forward":
        if facts.varlen and facts.window_left < 0 and facts.head_dim in PACKED_FORWARD_CONFIGS:
            return Plan("gluon", config=PACKED_FORWARD_CONFIGS[facts.head_dim])
        if narrow_band(facts) and facts.head_dim in NARROW_WINDOW_FORWARD_CONFIGS:
            return Plan("gluon", config=NARROW_WINDOW_FORWARD_CONFIGS[facts.head_dim])
        return Plan("gluon", config=FORWARD_CONFIGS[facts.head_dim, facts.causal])
    return Plan("gluon", config=pick_backward_config(facts))


def plan(direction: str, q, k, v, causal: bool, *more, varlen: bool = False, shared_offsets: bool = True,
         window_left: int = -1, window_right: int = -1) -> Plan:
    """Which kernel runs this call, from the tensors (q, k, v (batch, heads, seqlen, head_dim) and `more`, other
    tensors the kernel moves through TMA: the backward's dO and gradient buffers) and the machine (`decide`).
    causal: a causal mask, a sliding window or packed sequences; varlen: packed sequences (q, k, v and `more` are
    then (total, heads, head_dim)), shared_offsets: with one set of offsets (`same_offsets`); window_left,
    window_right: the window's edges as the kernels apply them (`fa2.window_edges`), -1 for none."""
    # (total >= 1, heads, head_dim) passes `use_tma` exactly when its `packed_view` does (the view's extra stride is
    # total rows): no views made here
    return decide(Facts(
        direction=direction, environment=gluon_device_reason(q.device), dtype=q.dtype, head_dim=q.shape[-1],
        seqlen_k=k.shape[0] if varlen else k.shape[2], causal=causal, window_left=window_left,
        window_right=window_right, varlen=varlen, shared_offsets=shared_offsets, tma_ok=use_tma(q, k, v, *more),
        deterministic=torch.are_deterministic_algorithms_enabled()))


def kernel_head_dim(head_dim: int) -> int:
    """The tile width (the kernels' HEAD_DIM constexpr) the Gluon kernels run `head_dim` at: 128 for 96, else
    head_dim itself. ValueError for a head_dim outside HEAD_DIMS."""
    if head_dim not in KERNEL_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim}: the Gluon kernels take {', '.join(map(str, HEAD_DIMS))}")
    return KERNEL_HEAD_DIMS[head_dim]


def packed_view(t: torch.Tensor) -> torch.Tensor:
    """(total, heads, head_dim) packed sequences as the kernels' (1, heads, total, head_dim), a view."""
    return t.unsqueeze(0).transpose(1, 2)


def same_offsets(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> bool:
    """Whether the two offset tensors hold the same values: the same memory (as the model passes them) costs
    nothing; otherwise the values are compared, a host sync."""
    if cu_seqlens_q.data_ptr() == cu_seqlens_k.data_ptr() and cu_seqlens_q.shape == cu_seqlens_k.shape:
        return True
    return bool(torch.equal(cu_seqlens_q, cu_seqlens_k))


def triton_version() -> str:
    return triton.__version__


class GluonKernels(NamedTuple):
    forward: Callable  # fa3_hopper.fa3_fwd_kernel
    backward: Callable  # fa3_hopper_bwd.fa3_bwd_kernel
    compiling: Callable  # gluon_compat.compiling: the context every compile of the two runs in
    descriptor_maker: Callable  # gluon_compat.descriptor_maker: their host-made TMA descriptors


@functools.lru_cache(maxsize=None)
def gluon_kernels(version: Optional[str] = None) -> GluonKernels | str:
    """The Gluon kernels, or the reason Triton `version` (default: the installed one) cannot build them (a string).
    Imported on first use: their modules need Gluon's Hopper API, which a release outside GLUON_TRITON_VERSIONS may
    lack or have renamed."""
    version = version or triton_version()
    if not any(version == v or version.startswith(v + ".") for v in GLUON_TRITON_VERSIONS):
        return (f"triton {version} is not a version the Gluon kernels support "
                f"({', '.join(v + '.x' for v in GLUON_TRITON_VERSIONS)})")
    try:
        from .fa3_hopper import fa3_fwd_kernel
        from .fa3_hopper_bwd import fa3_bwd_kernel
        from .gluon_compat import compiling, descriptor_maker
    except ImportError as e:  # a build of Triton without Gluon's Hopper API
        return f"triton {version} has no usable Gluon Hopper API ({e})"
    return GluonKernels(fa3_fwd_kernel, fa3_bwd_kernel, compiling, descriptor_maker)


def gluon_device_reason(device: torch.device) -> str | None:
    """Why the Gluon kernels cannot run on `device`, whatever the inputs (a short phrase naming the first missing
    condition: a CUDA GPU, an sm_90 one, a Triton whose Gluon API they are written for), or None when they can."""
    if INTERPRET or device.type != "cuda":
        return "no CUDA GPU (the Gluon kernels do not run under Triton's interpreter)"
    capability = _capability(device)
    if capability != (9, 0):
        return f"GPU compute capability {capability[0]}.{capability[1]} is not 9.0 (Hopper)"
    kernels = gluon_kernels()
    return kernels if isinstance(kernels, str) else None


def gluon_unsupported_reason(q, k, v, *more) -> str | None:
    """Why the Gluon kernels cannot run these inputs (`plan`'s eligibility rules; a short phrase), or None."""
    result = plan("forward", q, k, v, False, *more)
    return result.reason if result.warn else None


_WARNED: set[str] = set()

def launch_options(maxnreg: int = 0) -> dict:
    """Triton's launch and compile options for the Gluon kernels, with `maxnreg` registers a thread if nonzero."""
    return {**LAUNCH_OPTIONS, "maxnreg": maxnreg} if maxnreg else dict(LAUNCH_OPTIONS)


def _prepared(kernel, key, grid, per_call: tuple[str, ...], maxnreg: int = 0, **args) -> Prepared:
    """The launch of the Gluon `kernel` (a gluon.jit function) on `grid` with `args` (every parameter but the
    `per_call` ones, by name), with 4 warps and `maxnreg` registers a thread (0: Triton's choice), through
    `launch.Prepared`. `key` stands for what the compiled code depends on (host-made TMA descriptors cannot be
    keyed from their values): its config (maxnreg included) and constexprs, the dtype and head_dim (which fix the
    descriptors' blocks and layouts), the ints' values (the shapes) and the raw pointers' 16-byte alignment; the
    data pointers go through the descriptors, made every call."""
    return Prepared(kernel, grid, per_call, key=key, compiling=gluon_kernels().compiling, num_warps=4,
                    **launch_options(maxnreg), **args)


# Calls of one signature (shapes, strides, dtype, device, mask, scales, config) share what `run_forward` and
# `run_backward` derive from it: the launch's arguments, grid and key and the descriptors' fields
# (`_ForwardLaunch`, `_BackwardLaunch`). A training step calls every layer with the same signature, and deriving
# it cost more host time than the launch (docs/hopper-notes.md, "host variant 29"). Emptied when full.
_LAUNCHES: dict[tuple, tuple] = {}
LAUNCHES_MAX = 1024


def _remember(cache: dict, signature: tuple, made):
    if len(cache) >= LAUNCHES_MAX:
        cache.clear()
    cache[signature] = made
    return made


def clear_caches() -> None:
    """Forget the derived call signatures (`plan`'s answers and the launches): for code that changes the tables
    or functions they derive from (tests, tuning tools)."""
    _LAUNCHES.clear()
    _PLANS.clear()


def _warn_fallback(reason: str) -> None:
    if reason in _WARNED:
        return
    _WARNED.add(reason)
    warnings.warn(f"fa3: running FA2's Triton kernels instead of the Gluon FA3 kernels: {reason}",
                  RuntimeWarning, stacklevel=_caller_stacklevel())


_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (sys.modules[__package__], torch))


def _caller_stacklevel() -> int:
    """The `warnings.warn` stacklevel, seen from `_warn_fallback`, of the first frame outside this package and
    torch: the caller's line (the eager call, the model, or the training step that ran the backward)."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 1


class _ForwardLaunch(NamedTuple):
    """What the Gluon forward calls of one signature share (`_forward_launch`)."""
    launch: Prepared  # per call: the q, k, v, o descriptors, LSE, KEY_START, KEY_LIMIT, TILE_ORDER
    descriptors: tuple  # makers of the q, k, v and o descriptors
    tiles: Optional[tuple]  # packed sequences: `tile_order`'s (rows, block_n, batch * heads)


def run_forward(q, k, v, causal: bool, softmax_scale: float, config: ForwardConfig, window_size=(-1, -1),
                softcap: float = 0.0, key_bounds=None):
    """The Gluon forward with `config` (no checks: `plan` decides where it applies) -> (o, base-2 LSE).
    window_size: flash-attn's (left, right), -1 = unlimited (`fa2.window_edges`); softcap: flash-attn's logit cap
    (0 = off). key_bounds: packed sequences (batch 1): each row's keys [start, limit) (`doc_bounds`), which then
    replace causal and window_size."""
    docs = key_bounds is not None
    signature = ("forward", q.device, q.dtype, q.shape, q.stride(), k.shape, k.stride(), v.stride(), causal,
                 tuple(window_size), softmax_scale, softcap, config, docs)
    call = _LAUNCHES.get(signature) or _remember(_LAUNCHES, signature, _forward_launch(
        q, k, v, causal, softmax_scale, config, window_size, softcap, docs))
    o = empty_like_layout(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    if docs:
        key_start, key_limit = key_bounds
        order = _made_once(key_start, call.tiles, lambda: tile_order(key_start, key_limit, *call.tiles))
    else:  # never read (DOCS is off): any int32 tensor
        key_start = key_limit = order = lse.view(torch.int32)
    q_desc, k_desc, v_desc, o_desc = call.descriptors
    call.launch(q_desc(q), k_desc(k), v_desc(v), o_desc(o), lse, key_start, key_limit, order)
    return o, lse


def _forward_launch(q, k, v, causal, softmax_scale, config: ForwardConfig, window_size, softcap,
                    docs: bool) -> _ForwardLaunch:
    """`run_forward`'s launch for calls like this one."""
    kernels = gluon_kernels()
    batch, n_heads, seqlen_q, head_dim = q.shape
    tile_dim = kernel_head_dim(head_dim)
    n_kv_heads, seqlen_k = k.shape[1], k.shape[2]
    num_consumers, block_n, num_stages, pingpong, persistent, late_k_release, _ = config
    left, right = (0, 0) if docs else fa2.window_edges(causal, window_size, seqlen_q, seqlen_k)  # docs: per row
    q_layout, kv_layout = shared_layouts(q.dtype, tile_dim, block_n)
    # 4-D descriptors over the tensors as they are (any strides TMA takes), one (1, 1, rows, tile_dim) box each:
    # columns past head_dim (at 96) read as 0 and are not written
    q_box, kv_box = shared_layouts(q.dtype, tile_dim, block_n, rank=4)
    desc = lambda t, rows, layout: kernels.descriptor_maker(t, (1, 1, rows, tile_dim), layout)
    n_tiles_m = cdiv(seqlen_q, num_consumers * BLOCK_M)
    n_tiles = n_tiles_m * batch * n_heads
    if not persistent:
        grid = (n_tiles,)
    elif left >= 0 or right >= 0:  # tiles of unequal cost: the kernel orders them (`fa3_hopper._tile`)
        grid = (min(n_tiles, _sm_count(q.device)),)
    else:
        grid = (persistent_grid(n_tiles_m, batch * n_heads, seqlen_q, num_consumers, _sm_count(q.device)),)
    tail = _tail_on(config, right >= 0 > left, docs)
    pairs_before_tail = (tail_start(n_tiles_m, batch * n_heads, grid[0], seqlen_q, seqlen_k, num_consumers * BLOCK_M,
                                    block_n) if tail else 0)
    key = (config, q.dtype, q.device, q.shape, k.shape, left, right, docs, softcap > 0)
    prepared = _prepared(
        kernels.forward, key, grid, ("q_desc", "k_desc", "v_desc", "o_desc", "LSE", "KEY_START", "KEY_LIMIT",
                                     "TILE_ORDER"),
        n_heads=n_heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k, window_left=max(left, 0),
        window_right=max(right, 0), **_logits(softmax_scale, softcap), n_tiles_m=n_tiles_m, n_tiles=n_tiles,
        tail_start=pairs_before_tail, GROUP=n_heads // n_kv_heads, LEFT=left >= 0, RIGHT=right >= 0, DOCS=docs,
        TAIL=tail,
        PINGPONG=pingpong, LATE_K_RELEASE=late_k_release, NUM_CONSUMERS=num_consumers,
        HEAD_DIM=tile_dim, BLOCK_M=BLOCK_M, BLOCK_N=block_n, NUM_STAGES=num_stages, Q_LAYOUT=q_layout,
        KV_LAYOUT=kv_layout)
    o = empty_like_layout(q)
    return _ForwardLaunch(
        prepared, (desc(q, BLOCK_M, q_box), desc(k, block_n, kv_box), desc(v, block_n, kv_box),
                   desc(o, BLOCK_M, q_box)),
        (num_consumers * BLOCK_M, block_n, batch * n_heads) if docs else None)


def _logits(softmax_scale: float, softcap: float) -> dict:
    """The kernels' score arguments: base-2 logits are s * qk_scale, or with softcap > 0
    tanh(s * softcap_in) * qk_scale = softcap * tanh(softmax_scale * s / softcap) * log2(e)."""
    if softcap > 0:
        return dict(qk_scale=softcap * fa2.LOG2E, softcap_in=softmax_scale / softcap, SOFTCAP=True)
    return dict(qk_scale=softmax_scale * fa2.LOG2E, softcap_in=0.0, SOFTCAP=False)


@functools.lru_cache(maxsize=1024)  # a pure function of the shape, ~0.1-1 ms of Python
def persistent_grid(n_tiles_m: int, n_bh: int, seqlen_q: int, num_consumers: int, sm_count: int) -> int:
    """CTAs of the persistent non-causal forward, which runs tiles t = pid, pid + grid, ... in (head, query block)
    order, each tile NUM_CONSUMERS x BLOCK_M query rows against all keys. With sm_count CTAs the heads' last,
    partial tiles (seqlen_q not a multiple of the tile height, e.g. 192-row tiles at N = 2048) can all fall to the
    same CTAs (when sm_count is a multiple of n_tiles_m: 132 = 12 x 11), which then run one tile more than needed.
    Returns the grid from sm_count - 16 to sm_count (n_tiles at most) whose busiest CTA has the least work, a tile
    costing its share of busy warpgroups; the largest such grid on ties. Predicted for head_dim 64 (three
    consumers), B * N = 16k: 21.3 instead of 24 / 22 / 22 tile-times at N = 1k / 2k / 4k, unchanged from 8k;
    measured on the H200 +1.5-2.5 % at 2k and 4k, 1k unchanged (docs/hopper-notes.md)."""
    n_tiles = n_tiles_m * n_bh
    if n_tiles <= sm_count:
        return n_tiles
    last_rows = seqlen_q - (n_tiles_m - 1) * num_consumers * BLOCK_M
    last_cost = cdiv(last_rows, BLOCK_M) / num_consumers
    if last_cost == 1:  # every tile costs the same: any grid has the same busiest CTA
        return sm_count

    def busiest(grid: int) -> float:
        loads = [float((n_tiles - pid + grid - 1) // grid) for pid in range(grid)]  # tiles per CTA
        for bh in range(n_bh):  # the partial tiles, cheaper
            loads[(bh * n_tiles_m + n_tiles_m - 1) % grid] -= 1 - last_cost
        return max(loads)

    return min(range(max(sm_count - 16, 1), sm_count + 1), key=lambda grid: (busiest(grid), -grid))


def _tail_on(config: ForwardConfig, paired: bool, docs: bool) -> bool:
    """Whether the forward runs `config`'s causal tail: only in the persistent schedule of long-short pairs
    (`fa3_hopper._paired`: a right edge only), not with packed sequences (their own tile order)."""
    return config.tail and config.persistent and paired and not docs


@functools.lru_cache(maxsize=1024)  # a pure function of the shape
def tail_start(n_tiles_m: int, n_bh: int, grid: int, seqlen_q: int, seqlen_k: int, rows: int, block_n: int) -> int:
    """Where the causal forward's single tiles start (`ForwardConfig.tail`), in pairs: the pairs before it run as
    `fa3_hopper._tile` pairs them, pairs p, p + grid, ... on CTA p, and the tiles of the rest longest first in rounds
    of grid, every other round in reverse (`fa3_hopper._tail_tile`). Equal pairs alone leave the last round part
    empty (2048 pairs on 132 CTAs: 16 rounds for 15.5 rounds' work); single tiles fill it.
    Returns the start among whole rounds of pairs, 0 to 3 rounds before the last, or all the pairs (always for an
    odd n_tiles_m, whose pairs span two heads): the latest whose busiest CTA has at most 0.5 % more work than the
    least, in a simulation of the schedule (a tile costs its K/V blocks + 1, as in docs/hopper-notes.md's FA3
    forward variant 8). The later the start, the fewer heads' K/V the tail's tiles read at once (it runs every
    query block of its heads longest first)."""
    n_tiles = n_tiles_m * n_bh
    n_pairs = cdiv(n_tiles, 2)
    if n_tiles_m % 2 or grid < 1:
        return n_pairs
    diag = seqlen_k - seqlen_q
    cost = [max(cdiv(min((m + 1) * rows + diag, seqlen_k), block_n), 1) + 1 for m in range(n_tiles_m)]
    half = n_tiles_m // 2
    pair_cost = [cost[n_tiles_m - 1 - u] + cost[u] for u in range(half)]

    def busiest(start: int) -> int:
        loads = [0] * grid
        for q in range(start):
            loads[q % grid] += pair_cost[q % half]
        h0, u0 = divmod(start, half)
        tail = [cost[m] for m in range(n_tiles_m - 1, -1, -1)
                for h in range(h0, n_bh) if h > h0 or u0 <= m < n_tiles_m - u0]
        for j, c in enumerate(tail):
            r, place = divmod(j, grid)
            loads[place if r % 2 == 0 else grid - 1 - place] += c
        return max(loads)

    starts = sorted({n_pairs} | {max(n_pairs // grid - rounds, 0) * grid for rounds in range(4)}, reverse=True)
    work = [busiest(start) for start in starts]
    return next(start for start, w in zip(starts, work) if w <= 1.005 * min(work))


@functools.lru_cache(maxsize=None)  # asked on every call
def _capability(device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def _sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)  # pure, and ~15 us of Python per call: made once per shape
def shared_layouts(dtype, head_dim: int, block_n: int, rank: int = 2):
    """NVMMA shared-memory layouts (what TMA and wgmma read) of the Q/O tiles and of the K/V tiles; rank 4 gives
    the layouts of the descriptors' (1, 1, rows, head_dim) boxes, which have the same swizzle."""
    from triton.experimental.gluon import language as gl

    gl_dtype = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}[dtype]
    lead = [1] * (rank - 2)
    return (gl.NVMMASharedLayout.get_default_for(lead + [BLOCK_M, head_dim], gl_dtype),
            gl.NVMMASharedLayout.get_default_for(lead + [block_n, head_dim], gl_dtype))


def _band(q, k, causal: bool, window_size, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> tuple:
    """`plan`'s band arguments: whether there is a causal mask, a window or packed sequences, and as keywords the
    window's edges and for packed sequences whether both sides share their offsets."""
    varlen = cu_seqlens_q is not None
    seqlens = (max_seqlen_q, max_seqlen_k) if varlen else (q.shape[2], k.shape[2])
    left, right = fa2.window_edges(causal, window_size, *seqlens)
    # compared only where the Gluon kernels could run: distinct tensors cost a host sync
    shared = (not varlen or gluon_device_reason(q.device) is not None
              or same_offsets(cu_seqlens_q, cu_seqlens_k))
    return causal or varlen or tuple(window_size) != (-1, -1), dict(
        window_left=left, window_right=right, varlen=varlen, shared_offsets=shared)


# `_band`'s and `plan`'s answers by what they read of a call: the tensors' dtypes, shapes, strides and 16-byte
# alignment, the device, the mask and the deterministic-algorithms flag. Not for packed sequences with two offset
# tensors: whether their values match is read anew each call. Emptied when full.
_PLANS: dict[tuple, tuple] = {}


def _planned(direction: str, q, k, v, causal, window_size, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
             more: tuple = ()) -> tuple:
    """(banded, band, plan) of a call (`_band`, then `plan` with the tensors `more`), remembered by signature.
    A remembered plan skips `use_tma`, which also installs Triton's scratch allocator in the calling thread: the
    Gluon kernels need no global scratch (checked by the sm_90 compile tests), and FA2's launches install it."""
    varlen = cu_seqlens_q is not None
    signature = None
    if not varlen or cu_seqlens_q is cu_seqlens_k:
        tensors = (q, k, v, *more)
        signature = (direction, q.device, not any(t.data_ptr() % 16 for t in tensors),
                     torch.are_deterministic_algorithms_enabled(), causal, tuple(window_size), varlen, max_seqlen_q,
                     max_seqlen_k, *[(t.dtype, t.shape, t.stride()) for t in tensors])
        made = _PLANS.get(signature)
        if made is not None:
            return made
    banded, band = _band(q, k, causal, window_size, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    made = banded, band, plan(direction, q, k, v, banded, *more, **band)
    return made if signature is None else _remember(_PLANS, signature, made)


# What packed sequences' calls derive from their offsets (`doc_bounds`, then the tile orders), made once per tensor:
# a model passes one cu_seqlens to every layer, forward and backward. id(tensor) -> (a weak reference to it, its
# version, {key: what was made}): the reference says the entry is still this tensor's (an id is reused once its
# object is gone) and its callback drops the entry with the tensor; the version makes them again after an in-place
# write. A plain dict: torch's WeakTensorKeyDictionary cost 4-5 us a lookup, and a call makes two.
_MADE: dict[int, tuple] = {}


def _forget(ref: weakref.ref, key: int, made: dict = _MADE) -> None:  # bound: module globals may be gone at exit
    if made.get(key, (None,))[0] is ref:  # not a newer tensor's entry at the same id
        del made[key]


def _made_once(tensor: torch.Tensor, key, make: Callable):
    """make(), once per (tensor, its version, key); afresh where a CUDA graph's memory pool takes new tensors
    (`graph_pool_active`)."""
    if tensor.is_cuda and graph_pool_active(tensor.device):
        return make()
    entry = _MADE.get(id(tensor))
    if entry is None or entry[0]() is not tensor or entry[1] != tensor._version:
        ref = weakref.ref(tensor, functools.partial(_forget, key=id(tensor)))
        entry = _MADE[id(tensor)] = ref, tensor._version, {}
    made = entry[2]
    if key not in made:
        made[key] = make()
    return made[key]


def graph_pool_active(device: torch.device) -> bool:
    """Whether new tensors on `device` go to a CUDA graph's private memory pool: while a graph is captured (a replay
    must then recompute from the inputs it is given), and while torch.compile's CUDA graphs (mode="reduce-overhead")
    run a function's warm-up, whose pool refuses live tensors that are not the function's outputs
    (`torch._inductor.cudagraph_trees.check_memory_pool`), so `_made_once` must not keep them. The warm-up is read
    from inductor's CUDA-graph tree manager; a torch without the attributes read here counts as in the pool (made
    afresh: slower, never refused)."""
    if torch.cuda.is_current_stream_capturing():
        return True
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:  # torch.compile's CUDA graphs never ran in this process
        return False
    try:
        manager = trees.get_manager(device.index, create_if_none_exists=False)
        return manager is not None and manager.in_warmup
    except (AttributeError, TypeError):
        return True


def _packed_bounds(causal, window_size, cu_seqlens, total, max_seqlen, keys: bool = False):
    """`doc_bounds` of packed self-attention: each row's keys, or with `keys` each key's rows."""
    left, right = fa2.window_edges(causal, window_size, max_seqlen, max_seqlen)
    before, after = (right, left) if keys else (left, right)
    return _made_once(cu_seqlens, (total, before, after), lambda: doc_bounds(cu_seqlens, total, before, after))


def forward(q, k, v, causal, softmax_scale, window_size=(-1, -1), cu_seqlens_q=None, cu_seqlens_k=None,
            max_seqlen_q=0, max_seqlen_k=0, softcap=0.0):
    """Same contract as `fa2.forward`: o (like q, in q's memory order) and the base-2 LSE, float32
    (batch, n_heads, seqlen_q) or for packed sequences (n_heads, total_q), +inf for rows that see no key;
    sliding windows, packed sequences and softcap as there. The Gluon kernel where `plan` says, else FA2's."""
    banded, band, choice = _planned("forward", q, k, v, causal, window_size, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k)
    if choice.kernel == "gluon" and band["varlen"]:
        bounds = _packed_bounds(causal, window_size, cu_seqlens_q, q.shape[0], max(max_seqlen_q, max_seqlen_k))
        o, lse = run_forward(packed_view(q), packed_view(k), packed_view(v), causal, softmax_scale, choice.config,
                             softcap=softcap, key_bounds=bounds)
        return o.squeeze(0).transpose(0, 1), lse.squeeze(0)
    if choice.kernel == "gluon":
        return run_forward(q, k, v, causal, softmax_scale, choice.config, window_size, softcap)
    if choice.warn:
        _warn_fallback(choice.reason)
    return fa2.forward(q, k, v, causal, softmax_scale, window_size, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                       max_seqlen_k, softcap=softcap)


class _BackwardLaunch(NamedTuple):
    """What the Gluon backward calls of one signature share (`_backward_launch`)."""
    launch: Prepared  # per call: the q, k, v, dO, dK, dV, dQ descriptors, LSE, DELTA, the bounds, BLOCK_ORDER
    descriptors: tuple  # makers of the q, k, v, dO, dK, dV and dQ-accumulator descriptors
    dq_acc_shape: tuple  # (batch, heads, whole blocks of rows, head_dim), or separate_dq: the descriptor's box
    reduce_kv: bool  # dK and dV reduce-added into a float32 accumulator, then cast
    convert_dq: Optional[Prepared]  # `convert_dq`'s launch (per call: dq_acc, dq); None with separate_dq


def run_backward(do, q, k, v, o, lse, causal: bool, softmax_scale: float, config: BackwardConfig, out=None,
                 window_size=(-1, -1), softcap: float = 0.0, bounds=None, cu_seqlens=None, max_seqlen: int = 0):
    """The Gluon backward with `config` (no checks: `plan` decides where it applies) -> (dq, dk, dv), into `out`
    when given (`common.grad_buffers`). window_size and softcap as in `run_forward`; bounds: packed sequences, each
    row's keys [start, limit) and each key's rows [start, limit) (`doc_bounds`, four tensors), with the offsets
    and longest length they came from (cu_seqlens, max_seqlen) for a config with separate_dq. ValueError for a
    config the kernel cannot run."""
    docs = bounds is not None
    if docs and config.separate_dq and cu_seqlens is None:
        raise ValueError("BackwardConfig.separate_dq with packed sequences needs their cu_seqlens")
    lse = lse.contiguous()
    signature = ("backward", q.device, q.dtype, q.shape, q.stride(), k.shape, k.stride(), v.stride(), do.stride(),
                 None if out is None else (*(g.stride() for g in out), out[0].data_ptr() % 16 == 0),
                 lse.data_ptr() % 16 == 0, causal, tuple(window_size), softmax_scale, softcap, config, docs)
    call = _LAUNCHES.get(signature) or _remember(_LAUNCHES, signature, _backward_launch(
        do, q, k, v, lse, causal, softmax_scale, config, out, window_size, softcap, docs))
    dq, dk, dv = grad_buffers(q, k, v, out)
    dq_acc, dk_out, dv_out = _accumulators(q, k, dk, dv, call.dq_acc_shape, config.separate_dq, call.reduce_kv)
    delta = bwd_preprocess(o, do, None if config.separate_dq else dq_acc)  # also zeroes dq_acc
    if docs:  # the key blocks longest first
        query_start, query_limit = bounds[2:]
        order = _made_once(query_start, config.block_n, lambda: block_order(query_start, query_limit, config.block_n))
    else:  # never read (DOCS is off): any int32 tensor
        order = delta.view(torch.int32)
        bounds = (order,) * 4
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc = call.descriptors
    call.launch(q_desc(q), k_desc(k), v_desc(v), do_desc(do), dk_desc(dk_out), dv_desc(dv_out), dq_desc(dq_acc), lse,
                delta, *bounds, order)
    if config.separate_dq:
        fa2.backward_dq(do, q, k, v, lse, delta, dq, causal, softmax_scale, window_size, softcap,
                        cu_seqlens if docs else None, max_seqlen)
    else:
        call.convert_dq(dq_acc, dq)
    if call.reduce_kv:
        dk.copy_(dk_out)
        dv.copy_(dv_out)
    return dq, dk, dv


def _backward_launch(do, q, k, v, lse, causal, softmax_scale, config: BackwardConfig, out, window_size, softcap,
                     docs: bool) -> _BackwardLaunch:
    """`run_backward`'s launch for calls like this one."""
    kernels = gluon_kernels()
    batch, n_heads, seqlen_q, head_dim = q.shape
    tile_dim = kernel_head_dim(head_dim)
    dq_rows, dq_cols = config.dq_box(tile_dim)  # checks the config
    n_kv_heads, seqlen_k = k.shape[1], k.shape[2]
    constexprs = config.constexprs(tile_dim, n_heads // n_kv_heads)
    block_m, block_n = config.block_m, config.block_n
    reduce_kv = constexprs["HEADS"] < constexprs["GROUP"]
    left, right = (0, 0) if docs else fa2.window_edges(causal, window_size, seqlen_q, seqlen_k)  # docs: per row
    q_layout, kv_layout, _, ds_layout, dq_layout = _bwd_layouts(q.dtype, tile_dim, block_m, block_n,
                                                                 (dq_rows, dq_cols))
    q_box, k_box, v_box, _, dq_box = _bwd_layouts(q.dtype, tile_dim, block_m, block_n, (dq_rows, dq_cols), rank=4)
    desc = lambda t, rows, layout, cols=tile_dim: kernels.descriptor_maker(t, (1, 1, rows, cols), layout)
    # whole blocks of rows: the reduce-adds; separate_dq: the descriptor's box
    dq_acc_shape = ((1, 1, dq_rows, dq_cols) if config.separate_dq else
                    (batch, n_heads, cdiv(seqlen_q, block_m) * block_m, head_dim))
    # buffers like the calls', for the descriptors' fields
    dq, dk, dv = grad_buffers(q, k, v, out)
    dq_acc, dk_out, dv_out = _accumulators(q, k, dk, dv, dq_acc_shape, config.separate_dq, reduce_kv)
    if reduce_kv:
        dk_desc, dv_desc = desc(dk_out, 64, dq_box, dq_cols), desc(dv_out, 64, dq_box, dq_cols)
    else:
        dk_desc, dv_desc = desc(dk, 64, v_box), desc(dv, 64, v_box)
    n_blocks = cdiv(seqlen_k, block_n)
    key = (config, q.dtype, q.device, q.shape, k.shape, left, right, docs, softcap > 0, lse.data_ptr() % 16 == 0)
    prepared = _prepared(
        kernels.backward, key, (n_blocks * batch * n_heads // constexprs["HEADS"],),
        ("q_desc", "k_desc", "v_desc", "do_desc", "dk_desc", "dv_desc", "dq_desc", "LSE", "DELTA", "KEY_START",
         "KEY_LIMIT", "QUERY_START", "QUERY_LIMIT", "BLOCK_ORDER"), maxnreg=config.maxnreg,
        n_heads=n_heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k, window_left=max(left, 0), window_right=max(right, 0),
        SECTION_HEADS=config.section_heads or max(1, _sm_count(q.device) // n_blocks),
        **_logits(softmax_scale, softcap), softmax_scale=softmax_scale, LEFT=left >= 0, RIGHT=right >= 0,
        DOCS=docs, **constexprs, Q_LAYOUT=q_layout, KV_LAYOUT=kv_layout, DS_LAYOUT=ds_layout, DQ_LAYOUT=dq_layout)
    return _BackwardLaunch(
        prepared, (desc(q, block_m, q_box), desc(k, block_n, k_box), desc(v, 64, v_box), desc(do, block_m, q_box),
                   dk_desc, dv_desc, desc(dq_acc, dq_rows, dq_box, dq_cols)), dq_acc_shape, reduce_kv,
        None if config.separate_dq else _convert_dq_launch(dq_acc, softmax_scale, dq))


def _accumulators(q, k, dk, dv, dq_acc_shape, separate_dq: bool, reduce_kv: bool) -> tuple:
    """The backward's float32 accumulators -> (dq_acc, dk_out, dv_out).

    dq_acc: dQ's, in q's memory order as dq, so that `convert_dq` is a plain contiguous pass (a (B, H, T, D)
    accumulator for the model's (B, T, H, D) q made it a transposing copy: 110 us of GPT-2's 1k backward, cuDNN's
    46); head_dim wide (at 96 the reduce-adds clip the 128-wide tiles' zero columns); with separate_dq the
    descriptor's stand-in, never written. dk_out, dv_out: dk and dv, or with reduce_kv (a GQA group's CTAs add into
    them, dK already scaled, cast into dk and dv at the end) halves of one zeroed buffer shaped like k."""
    if separate_dq:
        dq_acc = torch.empty(dq_acc_shape, device=q.device, dtype=torch.float32)
    else:
        dq_acc = empty_like_layout(q, dq_acc_shape, torch.float32)
    if reduce_kv:
        kv_acc = empty_like_layout(k, (*k.shape[:3], 2 * k.shape[3]), torch.float32).zero_()
        dk, dv = kv_acc.split(k.shape[3], dim=3)
    return dq_acc, dk, dv


@triton.jit
def _convert_dq(DQ_ACC, DQ, softmax_scale, stride_ab, stride_ah, stride_am, stride_b, stride_h, stride_m, n_heads,
                seqlen_q, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    # FA3's last backward step (Shah et al. 2024, Appendix B.1): dQ = softmax_scale * the float32 accumulator, cast.
    off_bh = tl.program_id(1)
    off_b, off_h = (off_bh // n_heads).to(tl.int64), (off_bh % n_heads).to(tl.int64)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = rows < seqlen_q
    if BLOCK_D != HEAD_DIM:  # 96: a power-of-two block
        mask = mask & (cols < HEAD_DIM)
    acc = tl.load(DQ_ACC + off_b * stride_ab + off_h * stride_ah + rows * stride_am + cols, mask=mask)
    tl.store(DQ + off_b * stride_b + off_h * stride_h + rows * stride_m + cols,
             (acc * softmax_scale).to(DQ.dtype.element_ty), mask=mask)


CONVERT_DQ_BLOCK_M = 64


def convert_dq(dq_acc, softmax_scale: float, dq) -> None:
    """dq = (softmax_scale * dq_acc[:, :, :seqlen_q]).to(dq.dtype), one pass: dq_acc float32 (batch, n_heads,
    seqlen_q_pad >= seqlen_q, head_dim), dq (batch, n_heads, seqlen_q, head_dim) float16/bfloat16, both with a unit
    last stride and any other strides (e.g. dq a view into a packed qkv gradient, where torch.mul's strided path
    measured 89 us a GPT-2 1k call against 54 into contiguous memory on the H200).
    Any head_dim (96: a 128-wide block, masked). ValueError for anything else."""
    _convert_dq_launch(dq_acc, softmax_scale, dq)(dq_acc, dq)


def _convert_dq_launch(dq_acc, softmax_scale: float, dq) -> Prepared:
    """`convert_dq`'s launch for tensors like these (checked here), called with (dq_acc, dq)."""
    batch, n_heads, seqlen_q, head_dim = dq.shape
    if (dq_acc.dtype != torch.float32 or dq_acc.dim() != 4 or dq_acc.shape[:2] != dq.shape[:2]
            or dq_acc.shape[2] < seqlen_q or dq_acc.shape[3] != head_dim or dq_acc.stride(3) != 1
            or dq.stride(3) != 1):
        raise ValueError(f"convert_dq: dq_acc must be float32 ({batch}, {n_heads}, >= {seqlen_q}, {head_dim}) like dq, "
                         f"both with a unit last stride; got dq_acc {dq_acc.dtype} {tuple(dq_acc.shape)} strides "
                         f"{tuple(dq_acc.stride())}, dq {tuple(dq.shape)} strides {tuple(dq.stride())}")
    strides = dict(zip(("stride_ab", "stride_ah", "stride_am", "stride_b", "stride_h", "stride_m"),
                       (*dq_acc.stride()[:3], *dq.stride()[:3])))
    key = (dq.dtype, dq_acc.data_ptr() % 16 == 0, dq.data_ptr() % 16 == 0, *strides.values(), n_heads, seqlen_q,
           head_dim)
    return Prepared(_convert_dq, (cdiv(seqlen_q, CONVERT_DQ_BLOCK_M), batch * n_heads), ("DQ_ACC", "DQ"), key=key,
                    softmax_scale=softmax_scale, **strides, n_heads=n_heads, seqlen_q=seqlen_q, HEAD_DIM=head_dim,
                    BLOCK_D=next_power_of_2(head_dim), BLOCK_M=CONVERT_DQ_BLOCK_M, **LAUNCH_OPTIONS)


@functools.lru_cache(maxsize=None)  # pure, and made on every backward call
def _bwd_layouts(dtype, head_dim: int, block_m: int, block_n: int, dq_box: tuple[int, int], rank: int = 2):
    """NVMMA shared layouts of the backward's tiles: (block_m, head_dim) Q/dO, (block_n, head_dim) K, (64, head_dim)
    V/dK/dV, (64, block_m) dS^T and float32 dQ (`dq_box`, from `_dq_box`); rank 4: those of the descriptors'
    (1, 1, ...) boxes."""
    from triton.experimental.gluon import language as gl

    gl_dtype = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}[dtype]
    lead = [1] * (rank - 2)
    nvmma = lambda shape, dt=gl_dtype: gl.NVMMASharedLayout.get_default_for(lead + list(shape), dt)
    return (nvmma([block_m, head_dim]), nvmma([block_n, head_dim]), nvmma([64, head_dim]),
            nvmma([64, block_m]), nvmma(dq_box, gl.float32))


def backward(do, q, k, v, o, lse, causal, softmax_scale, window_size=(-1, -1), cu_seqlens_q=None, cu_seqlens_k=None,
             max_seqlen_q=0, max_seqlen_k=0, out=None, softcap=0.0):
    """Same contract as `fa2.backward`: dq, dk, dv like q, k, v, written into `out` when given
    (`common.grad_buffers`; TMA writes dk, dv, so they must meet `use_tma` or FA2's backward runs). `lse` is the
    forward's base-2 LSE. The Gluon backward where `plan` says, else FA2's."""
    banded, band, choice = _planned("backward", q, k, v, causal, window_size, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, (do, *(out or ())[1:]))
    if choice.kernel == "gluon" and band["varlen"]:
        total, longest = q.shape[0], max(max_seqlen_q, max_seqlen_k)
        bounds = (*_packed_bounds(causal, window_size, cu_seqlens_q, total, longest),
                  *_packed_bounds(causal, window_size, cu_seqlens_q, total, longest, keys=True))
        packed_out = None if out is None else (packed_view(out[0]), packed_view(out[1]), packed_view(out[2]))
        dq, dk, dv = run_backward(packed_view(do), packed_view(q), packed_view(k), packed_view(v), packed_view(o),
                                  lse.unsqueeze(0), causal, softmax_scale, choice.config, packed_out, window_size,
                                  softcap, bounds, cu_seqlens_q, longest)
        return dq.squeeze(0).transpose(0, 1), dk.squeeze(0).transpose(0, 1), dv.squeeze(0).transpose(0, 1)
    if choice.kernel == "gluon":
        return run_backward(do, q, k, v, o, lse, causal, softmax_scale, choice.config, out, window_size, softcap)
    if choice.warn:
        _warn_fallback(choice.reason)
    return fa2.backward(do, q, k, v, o, lse, causal, softmax_scale, window_size, cu_seqlens_q, cu_seqlens_k,
                        max_seqlen_q, max_seqlen_k, out=out, softcap=softcap)


def compile_for_sm90(dtype=torch.bfloat16, head_dim=128, causal=True, group=1, kernel="fwd", config=None,
                     window=False, softcap=False, docs=False, divisible=(), ones=()):
    """Compile the Gluon forward (kernel="fwd") or backward ("bwd") for sm_90 without a GPU (catches Gluon API
    breaks on CPU-only machines), with `config` (a ForwardConfig / BackwardConfig; default the measured one).
    causal: the band's right edge (RIGHT); window: its left edge (LEFT, a sliding window); softcap: the logit cap;
    docs: packed sequences (DOCS, per-row bounds: both edges). divisible: names of integer and pointer arguments
    to compile as multiples of 16 (`tt.divisibility`), as a launch specializes the ones whose values are; ones:
    names of integer arguments to compile as the constant 1, as a launch specializes an integer passed as 1; by
    default neither, so the kernel is valid for any values. head_dim 96 compiles the 128-wide kernels, as a launch
    at 96 does (`KERNEL_HEAD_DIMS`).

    Returns Triton's compiled kernel (`.asm` holds ttgir, ptx and cubin). Raises RuntimeError naming the
    reason when this Triton is not one the kernels support, ValueError for another `kernel`, a head_dim outside
    HEAD_DIMS, or the backward at one outside BACKWARD_HEAD_DIMS without a `config`.
    """
    if kernel not in ("fwd", "bwd"):
        raise ValueError(f"kernel={kernel!r}: accepted 'fwd' and 'bwd'")
    tile_dim = kernel_head_dim(head_dim)
    if kernel == "bwd" and config is None and head_dim not in BACKWARD_CONFIGS:
        raise ValueError(f"head_dim {head_dim}: the Gluon backward takes {', '.join(map(str, BACKWARD_HEAD_DIMS))} "
                         "(a config compiles it anyway)")
    kernels = gluon_kernels()
    if isinstance(kernels, str):
        raise RuntimeError(kernels)
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    tensordesc = lambda rows, layout: f"tensordesc<{name}[1, 1, {rows}, {tile_dim}],{layout!r}>"
    if kernel == "fwd":
        if docs:
            causal = window = True
        config = config or FORWARD_CONFIGS[head_dim, causal or window]
        num_consumers, block_n, num_stages, pingpong, _, late_k_release, _ = config
        maxnreg = 0
        q_layout, kv_layout = shared_layouts(dtype, tile_dim, block_n)
        q_box, kv_box = shared_layouts(dtype, tile_dim, block_n, rank=4)
        fn = kernels.forward
        descs = dict(q_desc=tensordesc(BLOCK_M, q_box), o_desc=tensordesc(BLOCK_M, q_box),
                     k_desc=tensordesc(block_n, kv_box), v_desc=tensordesc(block_n, kv_box), LSE="*fp32",
                     KEY_START="*i32", KEY_LIMIT="*i32", TILE_ORDER="*i32", qk_scale="fp32", softcap_in="fp32")
        constexprs = dict(GROUP=group, LEFT=window, RIGHT=causal, DOCS=docs,
                          TAIL=_tail_on(config, causal and not window, docs), SOFTCAP=softcap,
                          PINGPONG=pingpong, LATE_K_RELEASE=late_k_release, NUM_CONSUMERS=num_consumers,
                          HEAD_DIM=tile_dim, BLOCK_M=BLOCK_M, BLOCK_N=block_n, NUM_STAGES=num_stages,
                          Q_LAYOUT=q_layout, KV_LAYOUT=kv_layout)
    else:
        config = config or BACKWARD_CONFIGS[head_dim]
        tiles = config.constexprs(tile_dim, group)
        block_m, block_n, maxnreg = config.block_m, config.block_n, config.maxnreg
        dq_rows, dq_cols = config.dq_box(tile_dim)
        reduce_kv = tiles["HEADS"] < group
        q_layout, kv_layout, _, ds_layout, dq_layout = _bwd_layouts(dtype, tile_dim, block_m, block_n,
                                                                    (dq_rows, dq_cols))
        q_box, k_box, v_box, _, dq_box = _bwd_layouts(dtype, tile_dim, block_m, block_n, (dq_rows, dq_cols), rank=4)
        dq_box = f"tensordesc<fp32[1, 1, {dq_rows}, {dq_cols}],{dq_box!r}>"
        q_box, k_box, v_box = (tensordesc(block_m, q_box), tensordesc(block_n, k_box),
                               tensordesc(64, v_box))
        fn = kernels.backward
        kv_box = dq_box if reduce_kv else v_box  # float32 accumulators in 64-row dQ boxes, or dK and dV
        descs = dict(q_desc=q_box, k_desc=k_box, v_desc=v_box, do_desc=q_box, dk_desc=kv_box, dv_desc=kv_box,
                     dq_desc=dq_box, LSE="*fp32", DELTA="*fp32", KEY_START="*i32", KEY_LIMIT="*i32",
                     QUERY_START="*i32", QUERY_LIMIT="*i32", BLOCK_ORDER="*i32", SECTION_HEADS="i32",
                     qk_scale="fp32", softcap_in="fp32", softmax_scale="fp32")
        if docs:
            causal = window = True
        constexprs = dict(LEFT=window, RIGHT=causal, DOCS=docs, SOFTCAP=softcap, **tiles, Q_LAYOUT=q_layout,
                          KV_LAYOUT=kv_layout, DS_LAYOUT=ds_layout, DQ_LAYOUT=dq_layout)
    signature = {arg: "i32" for arg in fn.arg_names}
    signature.update(descs)
    signature.update({arg: "constexpr" for arg in constexprs})
    unknown = set(divisible) - {arg for arg, kind in signature.items() if kind == "i32" or kind.startswith("*")}
    if unknown:
        raise ValueError(f"divisible={sorted(unknown)}: not integer or pointer arguments of the {kernel} kernel")
    unknown = set(ones) - {arg for arg, kind in signature.items() if kind == "i32"}
    if unknown:
        raise ValueError(f"ones={sorted(unknown)}: not integer arguments of the {kernel} kernel")
    attrs = {(fn.arg_names.index(arg),): [["tt.divisibility", 16]] for arg in divisible}
    signature.update({arg: "constexpr" for arg in ones})
    constexprs.update({arg: 1 for arg in ones})
    source = GluonASTSource(fn, signature, constexprs, attrs)
    with kernels.compiling():
        return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, **launch_options(maxnreg)})
