"""`kernels.gluon_compat`'s rewrites of Triton 3.9's wgmma descriptors (`wgmma_descriptor_adds`,
`wgmma_descriptor_sink`) and the compile context that applies them (`compiling`). CPU only: a rewrite is text in,
text out, checked by evaluating both versions of the PTX's integer arithmetic; the compiled kernels are checked as
`test_fa3`'s sm_90 compile is."""

import random
import re

import pytest

from kernels import fa3
from test_fa3 import SUPPORTED, compile_in_fresh_process

pytestmark = pytest.mark.skipif(not SUPPORTED, reason=f"triton {fa3.triton_version()} has no Gluon kernels to build")
if SUPPORTED:
    from triton import knobs

    from kernels import gluon_compat

MASK32, MASK64 = (1 << 32) - 1, (1 << 64) - 1


def evaluate(ptx: str, seed: int) -> list[tuple[str, int]]:
    """Run the PTX's integer ops that build descriptors (bfe.u32, add.s32, or.b32, cvt.u64.u32, or.b64, add.s64) in
    line order, every other register holding a random value drawn from `seed`. Returns, for each wgmma in order and
    each `%rd` operand of it, the operand and its value there."""
    rng = random.Random(seed)
    values: dict[str, int] = {}

    def value(token: str) -> int:
        if not token.startswith("%"):
            return int(token)
        if token not in values:
            values[token] = rng.getrandbits(64 if token.startswith("%rd") else 32)
        return values[token]

    seen = []
    for line in ptx.split("\n"):
        if "wgmma.mma_async" in line:
            seen += [(token, value(token)) for token in re.findall(r"%rd\d+\b", line)]
            continue
        m = re.match(r"^\s*([a-z][\w.]*)\s+(%\w+), ([%\w]+), ([%\w]+)(?:, (\d+))?;", line) or \
            re.match(r"^\s*(cvt\.u64\.u32)\s+(%\w+), (%\w+)();", line)
        if not m:
            continue
        op, dst, a = m.group(1), m.group(2), m.group(3)
        if op == "bfe.u32":
            pos, length = int(m.group(4)), int(m.group(5))
            values[dst] = (value(a) >> pos) & ((1 << length) - 1)
        elif op == "add.s32":
            values[dst] = (value(a) + value(m.group(4))) & MASK32
        elif op == "or.b32":
            values[dst] = value(a) | value(m.group(4))
        elif op == "cvt.u64.u32":
            values[dst] = value(a) & MASK32
        elif op == "or.b64":
            values[dst] = value(a) | value(m.group(4))
        elif op == "add.s64":
            values[dst] = (value(a) + value(m.group(4))) & MASK64
    return seen


def descriptors(rng: random.Random, count: int) -> str:
    """PTX in the shape Triton 3.9 writes: a 14-16-bit base from `bfe.u32`, then per descriptor an optional
    `add.s32` / `or.b32` of an offset, its `cvt.u64.u32`, and an `or.b64` with a constant whose low word is 0, used
    by a wgmma."""
    width = rng.choice((14, 15, 16))
    lines = [f"\tbfe.u32 \t%r1, %r0, {rng.choice((0, 4))}, {width};"]
    for i in range(count):
        x = "%r1"
        kind = rng.choice(("none", "add", "or"))
        if kind == "add":
            x = f"%r{100 + i}"
            lines.append(f"\tadd.s32 \t{x}, %r1, {rng.randrange((1 << 32) - (1 << 16))};")
        elif kind == "or":
            x = f"%r{100 + i}"
            lines.append(f"\tor.b32 \t{x}, %r1, {rng.getrandbits(16) << 16};")
        high = rng.getrandbits(31) << 32
        lines += [f"\tcvt.u64.u32 \t%rd{200 + i}, {x};", f"\tor.b64 \t%rd{300 + i}, %rd{200 + i}, {high};",
                  f"\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {{%r5}}, {{%r6}}, %rd{300 + i}, p, 1, 1, 1;"]
    return "\n".join(lines)


@pytest.mark.parametrize("seed", range(8))
def test_descriptor_adds_keep_every_value(seed):
    rng = random.Random(seed)
    count = rng.randint(1, 12)
    ptx = descriptors(rng, count)
    rewritten, done = gluon_compat.wgmma_descriptor_adds(ptx)
    assert done == count
    assert "or.b64" not in rewritten and rewritten.count("add.s64") == count
    for inputs in range(4):
        assert evaluate(rewritten, inputs) == evaluate(ptx, inputs)


SNIPPET = ("\tbfe.u32 \t%r1, %r0, 4, 14;\n\tadd.s32 \t%r2, %r1, 128;\n\tcvt.u64.u32 \t%rd1, %r2;\n"
           "\tor.b64 \t%rd2, %rd1, 4611686293305294848;\n"
           "\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r5}, {%r6}, %rd2, p, 1, 1, 1;")


@pytest.mark.parametrize("change", [
    ("4611686293305294848;", "4611686293305294849;"),  # K has low bits: a carry could reach them
    ("4, 14;", "4, 17;"),  # a base wider than 16 bits: b + c might wrap
    ("%r1, 128;", "%r1, 4294901761;"),  # c too large: b + c might wrap
    ("\tadd.s32 \t%r2, %r1, 128;", "\tor.b32 \t%r2, %r1, 128;"),  # or-ed into b's bits: not an add
    ("\tcvt.u64.u32", "$L__BB0_1:\n\tcvt.u64.u32"),  # another basic block
    ("\tcvt.u64.u32", "\tadd.s32 \t%r1, %r7, 1;\n\tcvt.u64.u32"),  # b redefined before the zext
    ("\tor.b64", "\tst.shared.u64 \t[%r9], %rd1;\n\tor.b64"),  # the zext's register used again
])
def test_descriptor_adds_leave_what_they_cannot_prove(change):
    ptx = SNIPPET.replace(*change)
    assert ptx != SNIPPET
    assert gluon_compat.wgmma_descriptor_adds(ptx) == (ptx, 0)
    assert gluon_compat.wgmma_descriptor_adds(SNIPPET)[1] == 1  # the unchanged snippet is rewritten


def test_compiled_forward_descriptors_keep_their_values(tmp_path):
    """The forward's PTX as the installed Triton writes it (the rewrite off), rewritten here: every wgmma reads the
    same descriptor values. On 3.9 and later the rewrite must find descriptors to rewrite (if a release stops
    writing them this way, the workaround is obsolete); before 3.9 there are none."""
    path = tmp_path / "fwd.ptx"
    compile_in_fresh_process("import torch; from kernels import fa3, gluon_compat\n"
                             "gluon_compat._TRITON_3_9_OR_LATER = False\n"
                             f"open({str(path)!r}, 'w').write("
                             "fa3.compile_for_sm90(torch.bfloat16, 64, True, 1, 'fwd').asm['ptx'])")
    ptx = path.read_text()
    rewritten, done = gluon_compat.wgmma_descriptor_adds(ptx)
    assert (done > 0) == gluon_compat._TRITON_3_9_OR_LATER
    seen = evaluate(ptx, 0)
    assert len(seen) >= 2 * 12  # the QK and PV chains' descriptors at least
    assert evaluate(rewritten, 0) == seen
    assert evaluate(gluon_compat.rewrite_ptx("fa3_fwd_kernel", ptx)[0], 0) == seen  # sunk, then the adds


def hoisted_descriptors(rng: random.Random, count: int) -> str:
    """PTX in the shape Triton 3.9 writes a backward's wgmma chain: every descriptor built (`add.s32`, `cvt.u64.u32`,
    `or.b64`) before the chain's first wgmma, with other work between."""
    lines = ["\tbfe.u32 \t%r1, %r0, 4, 14;"]
    for i in range(count):
        lines += [f"\tadd.s32 \t%r{100 + i}, %r1, {rng.randrange(1 << 12) * 2};",
                  f"\tcvt.u64.u32 \t%rd{200 + i}, %r{100 + i};",
                  f"\tor.b64 \t%rd{300 + i}, %rd{200 + i}, {rng.getrandbits(31) << 32};"]
    lines += ["\twgmma.fence.sync.aligned;", "\tadd.s32 \t%r3, %r2, 1;"]
    for i in range(count):
        lines += ["\t// begin inline asm",
                  f"\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {{%r5,%r6}}, %rd{400 + i}, %rd{300 + i}, "
                  "%p45, 1, 1, 0, 0;", "\t// end inline asm"]
    return "\n".join(lines)


@pytest.mark.parametrize("seed", range(4))
def test_descriptor_sink_keeps_every_value_and_moves_each_chain_to_its_wgmma(seed):
    rng = random.Random(seed)
    count = rng.randint(1, 8)
    ptx = hoisted_descriptors(rng, count)
    sunk, done = gluon_compat.wgmma_descriptor_sink(ptx)
    assert done == count and sorted(sunk.split("\n")) == sorted(ptx.split("\n"))  # the same lines, reordered
    lines = sunk.split("\n")
    for i in range(count):
        at = next(n for n, line in enumerate(lines) if f"%rd{300 + i}, %p45" in line)
        assert [line.split()[0] for line in lines[at - 3:at]] == ["add.s32", "cvt.u64.u32", "or.b64"]
        assert f"%r{100 + i}," in lines[at - 3] and f"%rd{300 + i}," in lines[at - 1]
    for inputs in range(4):
        assert evaluate(sunk, inputs) == evaluate(ptx, inputs)
    assert gluon_compat.wgmma_descriptor_sink(sunk) == (sunk, 0)  # nothing left to move


SINK_SNIPPET = ("\tbfe.u32 \t%r1, %r0, 4, 14;\n\tadd.s32 \t%r2, %r1, 128;\n\tcvt.u64.u32 \t%rd1, %r2;\n"
                "\tor.b64 \t%rd2, %rd1, 4611686293305294848;\n\twgmma.fence.sync.aligned;\n"
                "\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r5}, %rd9, %rd2, %p1, 1, 1, 0, 0;")


@pytest.mark.parametrize("change,moved", [
    (("\twgmma.fence", "\tst.shared.u64 \t[%r9], %rd2;\n\twgmma.fence"), []),  # the descriptor read again
    (("\twgmma.fence", "$L__BB0_1:\n\twgmma.fence"), []),  # the wgmma in another basic block
    (("\tor.b64", "\t@%p2 or.b64"), []),  # a predicated op
    (("\tor.b64 \t%rd2, %rd1,", "\tld.shared.u64 \t%rd2, [%rd1],"), []),  # not an op descriptors are built with
    (("\tbfe.u32", "\tmov.b32 \t%r1, 0;\n\tbfe.u32"), ["cvt.u64.u32", "or.b64"]),  # the add reads %r1, written twice
    ((";\n\tcvt.u64.u32", ";\n\tadd.s32 \t%r8, %r2, 1;\n\tcvt.u64.u32"), ["cvt.u64.u32", "or.b64"]),  # %r2 read twice
])
def test_descriptor_sink_leaves_what_it_cannot_prove(change, moved):
    """Each change keeps an op (and the ops it feeds from) where it is; the rest of the chain still moves."""
    ptx = SINK_SNIPPET.replace(*change)
    assert ptx != SINK_SNIPPET
    sunk, done = gluon_compat.wgmma_descriptor_sink(ptx)
    assert done == bool(moved)
    lines = sunk.split("\n")
    if moved:
        assert [line.split()[0] for line in lines[-1 - len(moved):-1]] == moved
    else:
        assert sunk == ptx
    assert evaluate(sunk, 0) == evaluate(ptx, 0)
    assert gluon_compat.wgmma_descriptor_sink(SINK_SNIPPET)[1] == 1  # the unchanged snippet is rewritten


def test_compiled_backward_descriptors_keep_their_values(tmp_path):
    """The backward's PTX as the installed Triton writes it (the rewrites off), sunk here: every wgmma reads the
    same descriptor values. On 3.9 and later there must be chains to move (if a release stops hoisting them, the
    workaround is obsolete)."""
    path = tmp_path / "bwd.ptx"
    compile_in_fresh_process("import torch; from kernels import fa3, gluon_compat\n"
                             "gluon_compat._TRITON_3_9_OR_LATER = False\n"
                             f"open({str(path)!r}, 'w').write("
                             "fa3.compile_for_sm90(torch.bfloat16, 128, False, 1, 'bwd').asm['ptx'])")
    ptx = path.read_text()
    sunk, done = gluon_compat.wgmma_descriptor_sink(ptx)
    if gluon_compat._TRITON_3_9_OR_LATER:
        assert done >= 2 * 16  # the S^T, dP^T, dV, dK and dQ chains' descriptors, in both consumers
    seen = evaluate(ptx, 0)
    assert len(seen) >= 2 * 2 * 16
    assert evaluate(sunk, 0) == seen


class RecordingHook:
    """A stages hook a user might have installed."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        if not args:
            return "user-key", "user-hash"
        self.calls.append(args)


def test_compiling_wraps_each_kernels_ptx_and_restores_the_previous_hook(monkeypatch):
    monkeypatch.setattr(gluon_compat, "_TRITON_3_9_OR_LATER", True)
    user = RecordingHook()
    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", user)
    with gluon_compat.compiling():
        hook = knobs.runtime.add_stages_inspection_hook
        assert hook is not user
        key, value = hook()
        assert key.startswith("user-key") and value.startswith("user-hash") and key != "user-key"

        def make_ptx(src, metadata):
            metadata["name"] = src
            return SINK_SNIPPET if src == "fa3_bwd_kernel" else SNIPPET

        stages = {"ptx": make_ptx}
        hook(None, stages, None, None, 90)
        assert len(user.calls) == 1  # the user's hook still runs
        forward = stages["ptx"]("fa3_fwd_kernel", {})
        assert forward == gluon_compat.wgmma_descriptor_adds(gluon_compat.wgmma_descriptor_sink(SNIPPET)[0])[0]
        assert forward != SNIPPET
        sunk = stages["ptx"]("fa3_bwd_kernel", {})
        assert sunk == gluon_compat.wgmma_descriptor_sink(SINK_SNIPPET)[0] != SINK_SNIPPET
        assert stages["ptx"]("another_kernel", {}) == SNIPPET  # only the FA3 kernels
    assert knobs.runtime.add_stages_inspection_hook is user
    with pytest.raises(KeyError), gluon_compat.compiling():
        raise KeyError("a failed compile")
    assert knobs.runtime.add_stages_inspection_hook is user


def test_compiling_does_nothing_before_triton_3_9(monkeypatch):
    monkeypatch.setattr(gluon_compat, "_TRITON_3_9_OR_LATER", False)
    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", None)
    with gluon_compat.compiling():
        assert knobs.runtime.add_stages_inspection_hook is None


def test_tensor_descriptor_copies_the_checked_fields_and_takes_the_new_tensor():
    """`tensor_descriptor`: the first descriptor per (dtype, box, layout) is Gluon's own, checked; later ones equal
    what Gluon would build for their tensor (every field), without its checks."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = fa3.shared_layouts(torch.bfloat16, 64, 128, rank=4)[1]
    first = torch.randn(2, 3, 256, 64, dtype=torch.bfloat16)
    second = torch.randn(1, 40, 4, 64, dtype=torch.bfloat16).transpose(1, 2)  # other shape and strides
    box = (1, 1, 128, 64)
    made = [gluon_compat.tensor_descriptor(t, box, layout) for t in (first, second)]
    for desc, t in zip(made, (first, second)):
        expected = TensorDescriptor(t, list(t.shape), list(t.stride()), list(box), layout)
        assert isinstance(desc, TensorDescriptor) and desc.base is t
        assert vars(desc).keys() == vars(expected).keys()
        assert all(getattr(desc, name) == getattr(expected, name) for name in vars(expected) if name != "base")
    with pytest.raises(AssertionError):  # a new (dtype, box, layout) is Gluon's, checked: a 16-row box is too short
        gluon_compat.tensor_descriptor(first, (1, 1, 128, 4), layout)


def test_tensor_descriptor_keeps_no_tensor_alive():
    """What `tensor_descriptor` keeps of the first (checked) descriptor per (dtype, box, layout) holds no tensor: a
    kept one is memory never freed, and one made in the warm-up of torch.compile's CUDA graphs sits in their pool,
    which refuses it. A key made afresh here (a box no other test uses) so that this call is the first."""
    import gc
    import weakref

    import torch

    layout = fa3.shared_layouts(torch.float16, 64, 64, rank=4)[1]
    box = (1, 1, 64, 64)
    first = torch.randn(1, 2, 64, 64, dtype=torch.float16)
    gluon_compat._DESCRIPTOR_FIELDS.pop((first.dtype, box, id(layout)), None)
    desc = gluon_compat.tensor_descriptor(first, box, layout)
    assert desc.base is first
    alive = weakref.ref(first)
    del first, desc
    gc.collect()
    assert alive() is None
    second = torch.randn(1, 2, 64, 64, dtype=torch.float16)  # the copied fields still make a whole descriptor
    assert gluon_compat.tensor_descriptor(second, box, layout).base is second


def test_descriptor_maker_gives_gluons_descriptor_of_each_new_tensor_and_keeps_none():
    """`descriptor_maker(like, ...)`: for tensors with like's shape and strides, each descriptor equals what Gluon
    builds for that tensor (every field) with the tensor as its base; the maker keeps neither like nor any
    tensor it was given."""
    import gc
    import weakref

    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = fa3.shared_layouts(torch.bfloat16, 64, 128, rank=4)[0]
    box = (1, 1, 64, 64)
    like = torch.randn(1, 30, 3, 64, dtype=torch.bfloat16).transpose(1, 2)  # (B, H, T, D) over (B, T, H, D)
    make = gluon_compat.descriptor_maker(like, box, layout)
    alive = weakref.ref(like)
    del like
    gc.collect()
    assert alive() is None
    tensors = [torch.randn(1, 30, 3, 64, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2)]
    made = [make(t) for t in tensors]
    for desc, t in zip(made, tensors):
        expected = TensorDescriptor(t, list(t.shape), list(t.stride()), list(box), layout)
        assert isinstance(desc, TensorDescriptor) and desc.base is t
        assert vars(desc).keys() == vars(expected).keys()
        assert all(getattr(desc, name) == getattr(expected, name) for name in vars(expected) if name != "base")
    alive = weakref.ref(tensors[0])
    del tensors, made
    gc.collect()
    assert alive() is None
