"""The Gluon API as the FA3 kernels use it, the same on every Triton release they support.

Gluon (`triton.experimental.gluon`) is experimental and renames things between releases. The kernels call the
names below and nothing release-specific, so a new release means a change here, not in the kernels:

| here               | Triton 3.6, 3.7                      | Triton 3.8                    | Triton 3.9               |
| ------------------ | ------------------------------------ | ----------------------------- | ------------------------ |
| `tma_load`         | `tma.async_copy_global_to_shared`    | `tma.async_load` (old: alias) | `tma.async_load` (old raises) |
| `tma_store`        | `tma.async_copy_shared_to_global`    | `tma.async_store`             | `tma.async_store`        |
| `tma_reduce_add`   | (builder op only; wrapped below)     | `tma.async_atomic_add`        | `tma.async_atomic_add`   |
| `cp_async_load`    | `async_copy.async_copy_global_to_shared` | `async_copy.async_load`   | `async_copy.async_load`  |
| `reinterpret`      | `smem._reinterpret`                  | `smem._reinterpret`           | `smem.reinterpret`       |
| `aggregate`        | `triton.language.core._aggregate`    | the same                      | `gl.aggregate`           |

Each entry prefers the newer name and falls back to the older one, so a release that keeps both works either
way. `constexpr_function` (the aggregates' constructors) and `as_4d` are the same on every release and live here
because both kernels need them. `kernels.fa3.GLUON_TRITON_VERSIONS` lists the releases whose sm_90 compile of both
kernels is checked (`tools/check_triton_versions.sh`; in CI on the installed release, tests/kernels/test_fa3.py).

Code generation differs too: `compiling()`, the context `kernels.fa3` compiles the kernels in, rewrites Triton
3.9's wgmma descriptors in the PTX (below, `PTX_REWRITES`); the other 3.9 difference found to cost time, the
head_dim-64 causal forward's schedule, is answered by a per-release config entry in `kernels.fa3`
(`_FORWARD_CONFIGS_FROM`: the late K release).
"""

import collections
import contextlib
import hashlib
import re
from typing import Callable

import triton
from triton import knobs
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import constexpr_function
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma
from triton.language import core as _tl_core

__all__ = ["aggregate", "as_4d", "compiling", "constexpr_function", "cp_async_load", "descriptor_maker", "reinterpret",
           "tma_load", "rewrite_ptx", "tensor_descriptor", "tma_reduce_add", "tma_store", "wgmma_descriptor_adds",
           "wgmma_descriptor_sink"]

tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
cp_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
aggregate = getattr(gl, "aggregate", None) or _tl_core._aggregate


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Global tile at `coord` += shared tile `src` (`cp.reduce.async.bulk.tensor.add`): Triton 3.6 and 3.7 have
    the op in Gluon's builder (`ttng.async_tma_reduce`) but no wrapper. Completion is awaited with
    `tma.store_wait`, as for a TMA store."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


tma_reduce_add = getattr(tma, "async_atomic_add", None) or _tma_reduce_add

_REINTERPRET = "reinterpret" if hasattr(gl.shared_memory_descriptor, "reinterpret") else "_reinterpret"


# Checked descriptors' fields by (dtype, box, id(layout)), with the layout itself (so its id stays its own); not
# their tensors: a kept tensor is memory never freed, and one made in the warm-up of torch.compile's CUDA graphs
# sits in their pool, which then refuses it.
_DESCRIPTOR_FIELDS: dict = {}
_PER_TENSOR = ("base", "shape", "strides")


def tensor_descriptor(base, block_shape: tuple, layout):
    """Gluon's host-made TMA descriptor (`TensorDescriptor`) over all of `base` (its shape and strides), in
    `block_shape` boxes with shared-memory `layout`. The first one per (dtype, box, layout) is built and checked by
    Gluon; later ones copy its fields and take the new base, shape and strides, which skips the checks (about 10 us
    a descriptor of Python on the GPU machines' hosts; a backward makes seven). What those checks would say
    of the new tensor (a 16-byte aligned base, 16-byte multiple strides, a unit last stride) is the caller's to
    ensure: `kernels.fa3` runs the kernels only on tensors `common.use_tma` accepts, and on outputs it allocates."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    key = (base.dtype, block_shape, id(layout))
    fields = _DESCRIPTOR_FIELDS.get(key)
    if fields is None:
        desc = TensorDescriptor(base, list(base.shape), list(base.stride()), list(block_shape), layout)
        _DESCRIPTOR_FIELDS[key] = {k: v for k, v in vars(desc).items() if k not in _PER_TENSOR}, layout
        return desc
    desc = object.__new__(TensorDescriptor)
    vars(desc).update(fields[0])
    desc.base, desc.shape, desc.strides = base, list(base.shape), list(base.stride())
    return desc


def descriptor_maker(like, block_shape: tuple, layout) -> Callable:
    """tensor -> `tensor_descriptor(tensor, block_shape, layout)` for tensors with `like`'s dtype, shape and
    strides (the caller's to ensure), all fields but the base made once: about 1 us a descriptor instead of 4-10.
    Keeps no tensor."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    fields = {k: v for k, v in vars(tensor_descriptor(like, block_shape, layout)).items() if k != "base"}
    new, set_fields = object.__new__, dict.update

    def make(tensor):
        desc = new(TensorDescriptor)
        set_fields(vars(desc), fields)
        desc.base = tensor
        return desc

    return make


@builtin
def reinterpret(smem, dtype, shape, layout, _semantic=None):
    """The shared-memory descriptor `smem` seen with another dtype, shape and layout (the same bytes)."""
    return getattr(smem, _REINTERPRET)(dtype, shape, layout, _semantic=_semantic)


@gluon.jit
def as_4d(tile, desc):
    """A (rows, HEAD_DIM) shared tile as the (1, 1, rows, HEAD_DIM) box a 4-D descriptor copies (same bytes and
    swizzle): the kernels keep 2-D tiles for wgmma and copy them through descriptors over (B, H, N, D) tensors."""
    return reinterpret(tile, desc.dtype, desc.block_type.shape, desc.layout)


# --- Triton 3.9's wgmma descriptors -------------------------------------------------------------------------------
# From 3.9 on (triton-lang/triton#11329), the PTX builds each wgmma's shared-memory descriptor as
# `zext(base + offset) | high word`, the offset added in 32 bits. From that, ptxas rebuilds one uniform register pair
# before every wgmma of a chain (`UIADD3` + `UMOV` between consecutive HGMMAs), where 3.6-3.8's 64-bit adds let it
# prepare the next descriptor in a second pair while the previous HGMMA issues. `wgmma_descriptor_adds` writes them
# back as 64-bit adds, the same values, before ptxas runs: the head_dim-64 causal forward 2-3 % faster under 3.9
# (docs/hopper-notes.md, "FA3 forward tiles under Triton 3.9").
# 3.9's PTX also builds a whole chain's descriptors before its first wgmma, and 3.9 assembles with
# `--regAllocOptLevel=2`: the values live across the chain, and the backward's consumers spill (32 bytes of stack at
# head_dim 128; none under 3.8). `wgmma_descriptor_sink` moves each descriptor's ops down to its wgmma, as 3.8 writes
# them: no spills there, and both kernels 0-4 % faster under 3.9 (docs/hopper-notes.md, "FA3 under Triton 3.9:
# descriptors built at their wgmma").

_BFE = re.compile(r"^\s*bfe\.u32\s+(%r\d+), %r\d+, \d+, (\d+);")
_ADD = re.compile(r"^\s*(add\.s32|or\.b32)\s+(%r\d+), (%r\d+), (\d+);")
_CVT = re.compile(r"^(\s*)cvt\.u64\.u32\s+(%rd\d+), (%r\d+);")
_OR = re.compile(r"^(\s*)or\.b64\s+(%rd\d+), (%rd\d+), (\d+);")
_BLOCK_LABEL = re.compile(r"^\$L__BB\d+_\d+:")


def _adds(op: str, c: int) -> bool:
    """Whether `op` (add.s32 or or.b32) of a 16-bit b and c is b + c, without wrapping in 32 bits."""
    return c < (1 << 32) - (1 << 16) if op == "add.s32" else c & 0xFFFF == 0


def wgmma_descriptor_adds(ptx: str) -> tuple[str, int]:
    """PTX with every descriptor `d = zext(b + c) | K` rewritten as `d = zext(b) + (K + c)` -> (PTX, how many).

    Matched only where that is the same value: b is a bit field of at most 16 bits (`bfe.u32`); c is added
    (`add.s32`, b + c < 2^32), or or-ed into bits above b's (`or.b32`), or absent; K's low 32 bits are 0, so nothing
    carries into its bits; b and b + c are each defined once and the zext's register is used once; and all of it is
    in one basic block (no `$L__BB` label between), so the zext reads the b the add read. Anything else is left.
    """
    lines = ptx.split("\n")
    block = 0  # basic-block number of each line
    blocks, bases, offsets, zexts = [], {}, {}, {}
    for i, line in enumerate(lines):
        block += bool(_BLOCK_LABEL.match(line))
        blocks.append(block)
        if m := _BFE.match(line):
            if int(m.group(2)) <= 16:
                bases[m.group(1)] = block
        elif (m := _ADD.match(line)) and bases.get(m.group(3)) == block and _adds(m.group(1), int(m.group(4))):
            offsets[m.group(2)] = (m.group(3), int(m.group(4)))
        elif m := _CVT.match(line):
            zexts[m.group(2)] = (i, m.group(3))
    defined = collections.Counter(re.findall(r"^\s*[a-z][\w.]*\s+(%r\d+),", ptx, re.M))
    uses = collections.Counter(re.findall(r"%rd\d+\b", ptx))
    done = 0
    for i, line in enumerate(lines):
        m = _OR.match(line)
        if not m or m.group(3) not in zexts or int(m.group(4)) & 0xFFFFFFFF or uses[m.group(3)] != 2:
            continue
        j, x = zexts[m.group(3)]
        base, offset = offsets.get(x, (x, 0))
        if bases.get(base) != blocks[i] or blocks[j] != blocks[i] or defined[base] != 1 or defined[x] != 1:
            continue
        lines[j] = f"{_CVT.match(lines[j]).group(1)}cvt.u64.u32 \t{m.group(3)}, {base};"
        lines[i] = f"{m.group(1)}add.s64 \t{m.group(2)}, {m.group(3)}, {int(m.group(4)) + offset};"
        done += 1
    return "\n".join(lines), done


_REGISTER = re.compile(r"%[a-z]+\d+\b")
# An instruction line: [@predicate] opcode operands;
_INSTRUCTION = re.compile(r"^\s*(@!?%p\d+\s+)?([a-z][\w.:]*)\s+([^;]*);\s*$")
_SINKABLE = ("add.s32", "or.b32", "cvt.u64.u32", "add.s64", "or.b64")  # what Triton 3.9 builds descriptors with


def _destinations(line: str) -> list[str]:
    """The registers an instruction line writes: its first operand, or every register of a leading `{...}`."""
    m = _INSTRUCTION.match(line)
    if not m:
        return []
    operands = m.group(3).lstrip()
    if operands.startswith("{"):
        return _REGISTER.findall(operands[:operands.find("}")])
    first = operands.split(",", 1)[0].strip()
    return [first] if _REGISTER.fullmatch(first) else []


def wgmma_descriptor_sink(ptx: str) -> tuple[str, int]:
    """PTX with each wgmma's descriptor computation moved down to just before that wgmma -> (PTX, how many wgmmas).

    Moved: the chain of integer ops (`_SINKABLE`, unpredicated) that builds a descriptor operand, each op's result
    written once and read once (by the next op of the chain or the wgmma), in the wgmma's basic block, and every
    register it reads written once in the whole PTX, so it reads the same value further down. Anything else stays.
    """
    lines = ptx.split("\n")
    block, blocks = 0, []
    writes, mentions = collections.defaultdict(list), collections.Counter()
    for i, line in enumerate(lines):
        block += bool(_BLOCK_LABEL.match(line))
        blocks.append(block)
        for register in _destinations(line):
            writes[register].append(i)
        mentions.update(_REGISTER.findall(line))
    sunk, moves = set(), {}  # moves: wgmma line -> the lines moved before it, in order

    def pull(register: str, wgmma: int, chain: list[int]) -> None:
        if len(writes[register]) != 1 or mentions[register] != 2:  # written once, read once
            return
        j = writes[register][0]
        m = _INSTRUCTION.match(lines[j])
        if j >= wgmma or j in sunk or blocks[j] != blocks[wgmma] or m.group(1) or m.group(2) not in _SINKABLE:
            return
        sources = _REGISTER.findall(m.group(3).split(",", 1)[1])
        if any(len(writes[source]) != 1 for source in sources):
            return
        for source in sources:
            pull(source, wgmma, chain)
        sunk.add(j)
        chain.append(j)

    for i, line in enumerate(lines):
        if "wgmma.mma_async" in line and "}" in line:
            chain = []
            for register in re.findall(r"%rd\d+\b", line[line.rfind("}"):]):  # the descriptor operands
                pull(register, i, chain)
            if chain and chain != list(range(i - len(chain), i)):  # not already right above the wgmma
                moves[i] = chain
            else:
                sunk.difference_update(chain)
    out = []
    for i, line in enumerate(lines):
        out.extend(lines[j] for j in moves.get(i, ()))
        if i not in sunk:
            out.append(line)
    return "\n".join(out), len(moves)


_TRITON_3_9_OR_LATER = tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 9)
# Per kernel, the rewrites of Triton 3.9's PTX (above), in order. The 64-bit adds cost the backward registers (it
# keeps its descriptors in per-thread registers), so it only has its descriptors sunk.
PTX_REWRITES = {"fa3_fwd_kernel": (wgmma_descriptor_sink, wgmma_descriptor_adds),
                "fa3_bwd_kernel": (wgmma_descriptor_sink,)}
with open(__file__, "rb") as _f:  # Triton's compile cache keys on this file: a change here recompiles
    _HOOK_KEY = "fa3-ptx-rewrites-" + hashlib.sha256(_f.read()).hexdigest()[:16]


def rewrite_ptx(name: str, ptx: str) -> tuple[str, int]:
    """Kernel `name`'s PTX with its `PTX_REWRITES` applied -> (PTX, how many places changed); other kernels' PTX
    unchanged."""
    changed = 0
    for rewrite in PTX_REWRITES.get(name, ()):
        ptx, done = rewrite(ptx)
        changed += done
    return ptx, changed


class _PtxRewrites:
    """A Triton `knobs.runtime.add_stages_inspection_hook`: called with no argument, the key it adds to the compile
    cache's; called by a backend's `add_stages`, it wraps the "ptx" stage with `rewrite_ptx` after running the
    hook it replaced, if any."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, *args):
        if not args:
            key, value = self.previous() if self.previous else ("", "")
            ours = "-".join([_HOOK_KEY, *(f"{name}:{'+'.join(f.__name__ for f in rewrites)}"
                                           for name, rewrites in sorted(PTX_REWRITES.items()))])
            return key + ours, f"{value}{ours}"
        if self.previous:
            self.previous(*args)
        stages = args[1]
        make_ptx = stages["ptx"]

        def ptx(src, metadata):
            ptx = make_ptx(src, metadata)  # names the kernel in metadata
            return rewrite_ptx(metadata["name"], ptx)[0]

        stages["ptx"] = ptx


@contextlib.contextmanager
def compiling():
    """Compile (or look up) the FA3 kernels inside this context: on Triton >= 3.9 it installs `_PtxRewrites`
    as Triton's stages hook for the context's duration, then puts back the hook that was there; on earlier
    releases it does nothing."""
    if not _TRITON_3_9_OR_LATER:
        yield
        return
    previous = knobs.runtime.add_stages_inspection_hook
    knobs.runtime.add_stages_inspection_hook = _PtxRewrites(previous)
    try:
        yield
    finally:
        knobs.runtime.add_stages_inspection_hook = previous
