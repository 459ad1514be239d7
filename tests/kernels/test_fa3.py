"""fa3's dispatch (`fa3.plan` / `fa3.decide`): where the Gluon kernels run, where FA2 stands in (with one warning
naming the reason); an sm_90 compile of both Gluon kernels on a CPU-only machine on the installed Triton; and, on
an H200/H100, the Gluon kernels against float64.

The numerical matrix for fa3 (odd lengths, seqlen_q != seqlen_k, GQA, strided views, fully masked rows,
determinism) is tests/kernels/test_attention.py's, which runs fa3 on a CUDA GPU.
"""

import gc
import inspect
import os
import random
import re
import subprocess
import sys
import types
import warnings
import weakref
from pathlib import Path

import pytest
import torch

from kernels import (
    fa2, fa2_attention, fa2_varlen_attention, fa3, fa3_attention, fa3_qkvpacked_attention, fa3_varlen_attention,
    fa3_varlen_qkvpacked_attention,
)
from kernels import fa3_schedule, launch as launch_mod
from kernels.common import grad_buffers
from test_attention import reference

ROOT = Path(__file__).resolve().parents[2]
SUPPORTED = not isinstance(fa3.gluon_kernels(), str)  # the installed Triton is one the kernels support
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def compile_in_fresh_process(code: str, timeout: int = 900) -> list[list[str]]:
    """Run `code` (it compiles Gluon kernels for sm_90 and prints a line each) in a fresh process without
    TRITON_INTERPRET: under the interpreter Triton's own jitted helpers (the reductions' combine functions) are
    interpreted objects a compiled kernel cannot reference. Returns its lines, split into words."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return [line.split() for line in done.stdout.splitlines()]


def gluon_on_hopper(test):
    """Marks a test that runs the Gluon kernels: `gpu`, skipped without an sm_90 GPU or a supported Triton."""
    test = pytest.mark.skipif(not SUPPORTED, reason="the installed Triton is not one the Gluon kernels support")(test)
    test = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")(test)
    return pytest.mark.gpu(test)


@pytest.fixture
def fresh_dispatch(monkeypatch):
    """Forget the warnings already given, so each test sees its own."""
    monkeypatch.setattr(fa3, "_WARNED", set())


def _qkv(dtype=torch.bfloat16, head_dim=64, device="cuda" if torch.cuda.is_available() else "cpu"):
    return [torch.randn(1, 2, 24, head_dim, dtype=dtype, device=device) for _ in range(3)]


def _facts(**changes) -> fa3.Facts:
    """The facts of a call the Gluon forward takes on an H200, with `changes`."""
    facts = fa3.Facts(direction="forward", environment=None, dtype=torch.bfloat16, head_dim=64, seqlen_k=4096,
                      causal=True, window_left=-1, window_right=-1, varlen=False, shared_offsets=True, tma_ok=True,
                      deterministic=False)
    return facts._replace(**changes)


def test_other_triton_versions_are_named():
    assert "triton 9.1.0 is not a version the Gluon kernels support" in fa3.gluon_kernels("9.1.0")
    for version in fa3.GLUON_TRITON_VERSIONS:  # each supported release is accepted by its version
        assert fa3.gluon_kernels(version + ".0") == fa3.gluon_kernels() or not SUPPORTED


def test_a_fallback_warns_once_from_the_callers_line(fresh_dispatch):
    """head_dim 80: FA2 runs everywhere (on the CPU for want of a GPU, on an H200 for the head_dim), with one
    warning naming the reason, at the caller's line, and FA2's result."""
    q, k, v = _qkv(head_dim=80)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o = fa3_attention(q, k, v, causal=True)
        fa3_attention(q, k, v, causal=True)
    fallback = [w for w in caught if "fa3: running FA2's" in str(w.message)]
    assert len(fallback) == 1 and fa3.gluon_unsupported_reason(q, k, v) in str(fallback[0].message)
    assert fallback[0].filename == __file__  # the warning names the caller's line, not a library frame
    torch.testing.assert_close(o, fa2_attention(q, k, v, causal=True), rtol=0, atol=0)


@pytest.mark.parametrize("changes,reason", [
    (dict(dtype=torch.float32), "dtype torch.float32"),
    (dict(head_dim=80), "head_dim 80"),
    (dict(head_dim=512, dtype=torch.float16), "head_dim 512"),
    (dict(tma_ok=False), "inputs TMA cannot address"),
    (dict(varlen=True, shared_offsets=False), "cu_seqlens_k differs from cu_seqlens_q"),
    (dict(environment="no CUDA GPU (x)", head_dim=80), "no CUDA GPU"),  # the machine is named first
])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_inputs_the_kernel_does_not_cover_fall_back_with_a_warning(direction, changes, reason):
    """The forward and the backward decide eligibility alike: FA2 with a warning naming the first reason."""
    choice = fa3.decide(_facts(direction=direction, **changes))
    assert choice.kernel == "fa2" and choice.warn and reason in choice.reason


@pytest.mark.parametrize("seqlen_k", [8, 4096])
def test_head_dim_256_runs_the_gluon_forward_and_fa2s_backward_with_a_warning(seqlen_k):
    """At 256 the Gluon backward does not fit (its dK and dV accumulators take the registers): the forward runs
    Gluon with the 256 config, the backward FA2's with a warning naming why, at any length."""
    assert fa3.decide(_facts(head_dim=256, seqlen_k=seqlen_k)) == fa3.Plan(
        "gluon", config=fa3.FORWARD_CONFIGS[256, True])
    choice = fa3.decide(_facts(direction="backward", head_dim=256, seqlen_k=seqlen_k))
    assert choice.kernel == "fa2" and choice.warn
    assert "head_dim 256 in the backward" in choice.reason and "dK and dV" in choice.reason
    assert 256 in fa3.HEAD_DIMS and 256 not in fa3.BACKWARD_HEAD_DIMS and 256 not in fa3.BACKWARD_CONFIGS


@pytest.mark.parametrize("head_dim", [96, 256])
def test_plan_on_a_faked_hopper_runs_gluon_at_96_and_256(monkeypatch, head_dim):
    """`plan` from the tensors on a machine faked as an sm_90 one with a supported Triton: the 96 forward and
    backward take 128's configs (the 128-wide kernels, `KERNEL_HEAD_DIMS`); the 256 forward its own, its backward
    FA2's."""
    monkeypatch.setattr(fa3, "gluon_device_reason", lambda device: None)
    monkeypatch.setattr(fa3, "use_tma", lambda *tensors: True)
    q, k, v = (torch.randn(1, 2, 2048, head_dim, dtype=torch.bfloat16) for _ in range(3))
    width = fa3.kernel_head_dim(head_dim)
    assert width == (128 if head_dim == 96 else head_dim)
    for causal in (True, False):
        assert fa3.plan("forward", q, k, v, causal) == fa3.Plan("gluon", config=fa3.FORWARD_CONFIGS[width, causal])
    backward = fa3.plan("backward", q, k, v, True, q)
    if head_dim == 96:
        assert backward == fa3.Plan("gluon", config=fa3.BACKWARD_CONFIGS[128])
    else:
        assert backward.kernel == "fa2" and backward.warn and "head_dim 256 in the backward" in backward.reason
    with pytest.raises(ValueError, match="head_dim 80: the Gluon kernels take 64, 96, 128, 256"):
        fa3.kernel_head_dim(80)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_no_gpu_is_named_before_the_inputs():
    assert "no CUDA GPU" in fa3.gluon_device_reason(torch.device("cpu"))
    assert "no CUDA GPU" in fa3.gluon_unsupported_reason(*_qkv(torch.float32, 80))
    assert fa3.plan("forward", *_qkv(), True).kernel == "fa2"


@pytest.mark.skipif(not SUPPORTED, reason=f"triton {fa3.triton_version()} is not a release the Gluon kernels support")
@pytest.mark.parametrize("kernel", ["fwd", "bwd"])
def test_gluon_kernels_compile_for_sm90(kernel):
    """No GPU needed: Triton compiles for a named target, on whatever release is installed (CI's is the one
    `pip install -r requirements.txt` gives). Every head_dim the kernel takes (96: the 128-wide kernels), causal or
    not, with a sliding window's left edge or not, bfloat16 and float16, with GQA in some: the compile must succeed,
    not fall back. Catches Gluon API breaks before a user's GPU does (in a fresh process: `compile_in_fresh_process`).
    """
    head_dims = "HEAD_DIMS" if kernel == "fwd" else "BACKWARD_HEAD_DIMS"
    code = (f"import itertools, torch, warnings; from kernels import fa3, gluon_compat\n"
            "warnings.filterwarnings('error', category=UserWarning, module='triton')\n"  # e.g. an unset default
            f"for d, c, w, t in itertools.product(fa3.{head_dims}, (True, False), (True, False),"
            f" (torch.bfloat16, torch.float16)):\n"
            f"    k = fa3.compile_for_sm90(t, d, c, 1 if c else 4, {kernel!r}, window=w); ptx = k.asm['ptx']\n"
            "    print(d, c, w, t, k.metadata.shared, k.metadata.enable_fp_fusion, k.metadata.global_scratch_size,"
            " all(s in ptx for s in ('wgmma.mma_async', 'setmaxnreg', 'cp.async.bulk.tensor')),"
            " gluon_compat.rewrite_ptx(k.metadata.name, ptx)[1] if gluon_compat._TRITON_3_9_OR_LATER else 0)")
    lines = compile_in_fresh_process(code)
    assert len(lines) == 2 * 2 * len(getattr(fa3, head_dims)) * 2
    assert {int(line[0]) for line in lines} == set(getattr(fa3, head_dims))
    for *combination, shared, fp_fusion, scratch, has_hopper_instructions, descriptors_left in lines:
        assert has_hopper_instructions == "True", f"{combination}: wgmma, setmaxnreg and TMA copies expected"
        # compile_for_sm90 compiles as a launch does, with gluon_compat.compiling(): nothing left to rewrite
        assert descriptors_left == "0", f"{combination}: descriptors left for gluon_compat.PTX_REWRITES"
        assert fp_fusion == "True", f"{combination}: compiled without LAUNCH_OPTIONS"
        assert int(shared) <= fa3.SM90_SHARED_MEMORY, f"{combination}: more shared memory than an sm_90 block may have"
        # a remembered plan skips `use_tma`, which installs Triton's scratch allocator: these kernels need none
        assert scratch == "0", f"{combination}: global scratch memory needs Triton's allocator on every call's thread"


def test_forward_configs_per_triton_release():
    """From Triton 3.9 on the head_dim-64 causal forward releases K slots after the softmax (measured faster
    there, slower on 3.6-3.8); every other config is the same on every release, and the installed release's table
    is FORWARD_CONFIGS."""
    before = fa3.forward_configs("3.8.0")
    for version in ("3.9.0", "3.9.1", "3.10.0"):
        after = fa3.forward_configs(version)
        assert after[64, True] == before[64, True]._replace(late_k_release=True)
        assert {key: c for key, c in after.items() if key != (64, True)} == {
            key: c for key, c in before.items() if key != (64, True)}
    for version in ("3.6.0", "3.7.1", "3.8.0"):
        assert not any(c.late_k_release for c in fa3.forward_configs(version).values())
    assert fa3.FORWARD_CONFIGS == fa3.forward_configs(fa3.triton_version())


@pytest.mark.skipif(not SUPPORTED, reason=f"triton {fa3.triton_version()} is not a release the Gluon kernels support")
def test_late_k_release_moves_the_slot_arrive_after_the_softmax():
    """In the compiled K/V loop, between S_j's wait (`wgmma.wait_group 1`) and the softmax's first exp2, the K
    slot's arrive is there with the early release and gone with the late one."""
    code = ("import torch; from kernels import fa3\n"
            "for late in (False, True):\n"
            "    c = fa3.FORWARD_CONFIGS[64, True]._replace(late_k_release=late)\n"
            "    ptx = fa3.compile_for_sm90(torch.bfloat16, 64, True, 1, 'fwd', c).asm['ptx']\n"
            "    after_s = ptx[ptx.index('wgmma.wait_group.sync.aligned 1;'):]\n"
            "    print(late, 'mbarrier.arrive' in after_s[:after_s.index('ex2.approx')])")
    assert compile_in_fresh_process(code, timeout=600) == [["False", "True"], ["True", "False"]]


@pytest.mark.skipif(SUPPORTED, reason="the installed Triton is supported: the compile test runs instead")
def test_unsupported_triton_takes_the_fallback(fresh_dispatch):
    reason = fa3.gluon_kernels()
    assert reason.startswith(f"triton {fa3.triton_version()}")
    with pytest.raises(RuntimeError, match="not a version the Gluon kernels support"):
        fa3.compile_for_sm90()


@gluon_on_hopper
def test_gluon_kernel_runs_on_hopper(fresh_dispatch):
    q, k, v = (torch.randn(2, 4, 300, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    assert fa3.gluon_unsupported_reason(q, k, v) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        o = fa3_attention(q, k, v, causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert ((o.float() - ref).norm() / ref.norm()).item() < 1e-2


def _poisoned_outputs(monkeypatch):
    """The kernels' outputs (o, the dQ accumulator) allocated NaN, so an element left unwritten shows."""
    empty_like_layout = fa3.empty_like_layout
    monkeypatch.setattr(fa3, "empty_like_layout", lambda *a, **kw: empty_like_layout(*a, **kw).fill_(float("nan")))


@gluon_on_hopper
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_gluon_forward_matches_float64(fresh_dispatch, monkeypatch, head_dim, causal):
    """The Gluon forward with seqlen_q != seqlen_k (the bottom-right causal diagonal mid-block), lengths off the
    block sizes and GQA, o allocated NaN: at 96 the 128-wide kernel writes every one of the 96 columns, and the
    default softmax_scale is 1/sqrt(96)."""
    _poisoned_outputs(monkeypatch)
    q = torch.randn(2, 4, 333, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 717, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the Gluon kernel ran
        o, lse = fa3.forward(q, k, v, causal, head_dim ** -0.5)
        o_default = fa3_attention(q, k, v, causal=causal)
    o_ref, _ = _reference_grads(q, k, v, torch.randn_like(q), causal)
    assert o.shape == q.shape and torch.isfinite(o).all() and torch.isfinite(lse).all()
    assert ((o.double() - o_ref).norm() / o_ref.norm()).item() < 1e-2
    assert torch.equal(o_default, o)


@gluon_on_hopper
@pytest.mark.parametrize("late_k_release", [True, False])
@pytest.mark.parametrize("head_dim,causal", [(64, True), (64, False), (128, True)])
def test_gluon_forward_k_release_points_match_float64(fresh_dispatch, head_dim, causal, late_k_release):
    """Both points where a consumer can give a K slot back (`ForwardConfig.late_k_release`), whichever one the
    installed release's config uses: o and the LSE against float64 over several tiles per CTA, outputs poisoned."""
    config = fa3.FORWARD_CONFIGS[head_dim, causal]._replace(late_k_release=late_k_release)
    q, k, v = (torch.randn(2, 9, 1500, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    poison = torch.full((2 * 9 * 1500 * (head_dim + 2),), float("nan"), device="cuda")
    del poison
    o, lse = fa3.run_forward(q, k, v, causal, head_dim ** -0.5, config)
    o_ref, _ = _reference_grads(q, k, v, torch.randn_like(q), causal)
    s = (q.double() @ k.double().transpose(-1, -2)) * head_dim ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(1500, 1500, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    lse_ref = torch.logsumexp(s, dim=-1) / torch.log(torch.tensor(2.0, dtype=torch.float64))
    assert ((o.double() - o_ref).norm() / o_ref.norm()).item() < 1e-2
    assert ((lse.double() - lse_ref).norm() / lse_ref.norm()).item() < 1e-3


@gluon_on_hopper
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("head_dim,n_heads,seqlen", [(64, 13, 1000), (128, 16, 1100), (128, 5, 1024)])
def test_gluon_forward_persistent_order_covers_every_tile(fresh_dispatch, head_dim, n_heads, seqlen, causal):
    """More tiles than CTAs (each CTA runs several, in `_tile`'s order: causal pairs, an odd number of query blocks
    per head, odd head counts), against float64: every row of o and the LSE written once and right. The output
    memory is poisoned through the caching allocator first."""
    q, k, v = (torch.randn(3, n_heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(2):
        poison = torch.full((3 * n_heads * seqlen * (head_dim + 2),), float("nan"), device="cuda")
        del poison
        o, lse = fa3.forward(q, k, v, causal, head_dim ** -0.5)
    o_ref, _ = _reference_grads(q, k, v, torch.randn_like(q), causal)
    s = (q.double() @ k.double().transpose(-1, -2)) * head_dim ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(seqlen, seqlen, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    lse_ref = torch.logsumexp(s, dim=-1) / torch.log(torch.tensor(2.0, dtype=torch.float64))
    assert ((o.double() - o_ref).norm() / o_ref.norm()).item() < 1e-2
    assert ((lse.double() - lse_ref).norm() / lse_ref.norm()).item() < 1e-3


@gluon_on_hopper
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("start", ["round", "mid_head", "none_paired"])
def test_gluon_causal_tail_runs_every_tile_once(fresh_dispatch, monkeypatch, head_dim, start):
    """The causal forward with a tail (`ForwardConfig.tail`) where `fa3.tail_start` puts it: after a whole round of
    pairs, within a head and not after a whole round (u0 > 0, the CTAs' pair counts unequal), and with no pairs at
    all: o and the LSE against float64, the output memory poisoned first."""
    batch, n_heads, seqlen = 1, 16, 4096  # 32 query blocks a head, 512 tiles: more than one per CTA
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    forced = {"round": sm_count, "mid_head": 100, "none_paired": 0}[start]
    monkeypatch.setattr(fa3, "tail_start", lambda *shape: forced)
    config = fa3.FORWARD_CONFIGS[head_dim, True]._replace(tail=True)
    q, k, v = (torch.randn(batch, n_heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    poison = torch.full((batch * n_heads * seqlen * (head_dim + 2),), float("nan"), device="cuda")
    del poison
    o, lse = fa3.run_forward(q, k, v, True, head_dim ** -0.5, config)
    o_ref, _ = _reference_grads(q, k, v, torch.randn_like(q), True)
    s = (q.double() @ k.double().transpose(-1, -2)) * head_dim ** -0.5
    s = s.masked_fill(torch.ones(seqlen, seqlen, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    lse_ref = torch.logsumexp(s, dim=-1) / torch.log(torch.tensor(2.0, dtype=torch.float64))
    assert ((o.double() - o_ref).norm() / o_ref.norm()).item() < 1e-2
    assert ((lse.double() - lse_ref).norm() / lse_ref.norm()).item() < 1e-3


@gluon_on_hopper
@pytest.mark.parametrize("head_dim,causal", [(64, True), (128, False)])
def test_gluon_relaunch_of_a_shape_reads_the_new_inputs(fresh_dispatch, monkeypatch, head_dim, causal):
    """The second call of a shape goes through the compiled kernels' launchers kept from the first (`kernels.launch`:
    Triton's binder skipped): new data, other strides (a (B, T, H, D) view) and another softmax_scale must all be
    read anew. Checked against float64, forward and backward, with the outputs' memory poisoned before each call."""
    monkeypatch.setattr(launch_mod, "_KERNELS", {})
    shape = (2, 3, 1030, head_dim)  # past BACKWARD_MIN_SEQLEN_K: the Gluon backward runs
    for call in range(2):
        if call == 0:
            q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        else:  # same shape, (B, T, H, D) memory
            q, k, v, do = (torch.randn(2, 1030, 3, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                           for _ in range(4))
        scale = head_dim ** -0.5 * (1 + call)
        poison = torch.full((16 * 2 * 3 * 1030 * head_dim,), float("nan"), device="cuda")
        del poison
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback warning: the Gluon kernels ran
            fa3_attention(*leaves, causal=causal, softmax_scale=scale).backward(do)
            o = fa3_attention(q, k, v, causal=causal, softmax_scale=scale)
        gluon = fa3.gluon_kernels()
        # one forward and one backward key, made by the first call
        assert launch_mod.cached(gluon.forward) == 1 and launch_mod.cached(gluon.backward) == 1
        ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        o_ref = torch.nn.functional.scaled_dot_product_attention(*ref_leaves, is_causal=causal, scale=scale)
        o_ref.backward(do.double())
        assert ((o.double() - o_ref).norm() / o_ref.norm()).item() < 1e-2
        for leaf, ref in zip(leaves, ref_leaves):
            err = ((leaf.grad.double() - ref.grad).norm() / ref.grad.norm()).item()
            assert torch.isfinite(leaf.grad).all() and err < 1e-2, (call, err)


def _busiest_cta(grid, num_consumers, n_bh, seqlen_q):
    """Work of the busiest CTA of the non-causal persistent forward on `grid` CTAs, simulated tile by tile: CTA pid
    runs tiles pid, pid + grid, ... in (head, query block) order; a head's last tile costs its share of busy
    warpgroups."""
    rows = num_consumers * fa3.BLOCK_M
    n_tiles_m = -(-seqlen_q // rows)
    last_cost = -(-(seqlen_q - (n_tiles_m - 1) * rows) // fa3.BLOCK_M) / num_consumers
    loads = [0.0] * grid
    for t in range(n_tiles_m * n_bh):
        loads[t % grid] += last_cost if t % n_tiles_m == n_tiles_m - 1 else 1.0
    return max(loads)


@pytest.mark.parametrize("seed", range(4))
def test_persistent_grid_gives_the_busiest_cta_the_least_work(seed):
    """`fa3.persistent_grid` against a simulation over every grid it may pick, on random shapes."""
    rng = random.Random(seed)
    for _ in range(6):
        num_consumers, n_bh, seqlen_q = rng.choice([2, 3]), rng.randint(1, 300), rng.randint(1, 5000)
        sm_count = rng.choice([132, 114, 20])
        n_tiles_m = -(-seqlen_q // (num_consumers * fa3.BLOCK_M))
        grid = fa3.persistent_grid(n_tiles_m, n_bh, seqlen_q, num_consumers, sm_count)
        if n_tiles_m * n_bh <= sm_count:
            assert grid == n_tiles_m * n_bh
            continue
        assert sm_count - 16 <= grid <= sm_count
        best = min(_busiest_cta(g, num_consumers, n_bh, seqlen_q) for g in range(sm_count - 16, sm_count + 1))
        assert _busiest_cta(grid, num_consumers, n_bh, seqlen_q) == pytest.approx(best)


def test_persistent_grid_spreads_the_partial_tiles_at_2k():
    """The benchmark's head_dim-64 non-causal shape at N = 2k (192-row tiles, 11 a head, 256 heads): with 132 CTAs
    (12 x 11) every partial tile goes to the same 12 CTAs and some others run 22 full tiles; the chosen grid's
    busiest CTA runs 21 1/3 tiles' work."""
    grid = fa3.persistent_grid(11, 256, 2048, 3, 132)
    assert _busiest_cta(132, 3, 256, 2048) == 22
    assert _busiest_cta(grid, 3, 256, 2048) == pytest.approx(21 + 1 / 3)


def _causal_schedule(n_tiles_m, n_bh, grid, tail_start):
    """Each CTA's tiles (batch * heads + head, query block) in order, by the arithmetic of `fa3_hopper`'s
    `_n_tiles_of_cta`, `_tile` and `_tail_tile` under a causal mask with TAIL, written out in Python."""
    n_tiles = n_tiles_m * n_bh
    cdiv = lambda a, b: -(-a // b)

    def paired_count(n, pid):
        return cdiv(max(n - 2 * pid, 0), 2 * grid) + cdiv(max(n - 2 * pid - 1, 0), 2 * grid)

    def snake_count(n, pid):
        rounds = n // grid
        place = pid if rounds % 2 == 0 else grid - 1 - pid
        return rounds + (1 if place < n - rounds * grid else 0)

    def tail_tile(j):
        half = n_tiles_m // 2
        h0, u0 = divmod(tail_start, half)
        partial = 1 if u0 > 0 else 0
        whole = n_bh - h0 - partial
        top, middle, per_top = u0 * whole, (n_tiles_m - 2 * u0) * (whole + partial), max(whole, 1)
        if j < top:
            return h0 + partial + j % per_top, n_tiles_m - 1 - j // per_top
        if j < top + middle:
            jm = j - top
            return h0 + jm % (whole + partial), n_tiles_m - 1 - u0 - jm // (whole + partial)
        jb = j - top - middle
        return h0 + partial + jb % per_top, u0 - 1 - jb // per_top

    schedule = []
    for pid in range(grid):
        paired = min(n_tiles, 2 * tail_start)
        count = paired_count(paired, pid) + snake_count(n_tiles - paired, pid)
        tiles = []
        for i in range(count):
            s = 2 * (pid + (i // 2) * grid) + i % 2
            bh, u = divmod(s, n_tiles_m)
            if n_tiles_m % 2 == 1 and bh % 2 == 1:
                u = n_tiles_m - 1 - u
            pid_m = n_tiles_m - 1 - u // 2 if u % 2 == 0 else u // 2
            if i >= paired_count(paired, pid):
                r = i - paired_count(paired, pid)
                bh, pid_m = tail_tile(r * grid + (pid if r % 2 == 0 else grid - 1 - pid))
            tiles.append((bh, pid_m))
        schedule.append(tiles)
    return schedule


@pytest.mark.parametrize("seed", range(3))
def test_causal_tail_runs_every_tile_once_and_evens_the_ctas(seed):
    """`fa3.tail_start` and the causal forward's schedule with a tail (`ForwardConfig.tail`): on random shapes and
    grids every tile runs exactly once, the tail's tiles come longest first, and the busiest CTA has no more work
    than without the tail (a tile costing its K/V blocks + 1)."""
    rng = random.Random(seed)
    shapes = [(16, 128, 132, 2048, 2048), (8, 256, 132, 1024, 1024), (32, 64, 132, 4096, 4096)]  # bench's grid
    shapes += [(2 * rng.randint(1, 40), rng.randint(1, 200), rng.choice([132, 114, 7]), 0, 0) for _ in range(8)]
    for n_tiles_m, n_bh, grid, seqlen_q, seqlen_k in shapes:
        seqlen_q = seqlen_q or n_tiles_m * 128 - rng.randint(0, 127)
        seqlen_k = seqlen_k or max(seqlen_q + rng.randint(-200, 400), 1)
        grid = min(grid, n_tiles_m * n_bh)
        cost = [max(-(-min((m + 1) * 128 + seqlen_k - seqlen_q, seqlen_k) // 128), 1) + 1 for m in range(n_tiles_m)]
        busiest = {}
        for start in {fa3.tail_start(n_tiles_m, n_bh, grid, seqlen_q, seqlen_k, 128, 128), n_tiles_m * n_bh // 2}:
            schedule = _causal_schedule(n_tiles_m, n_bh, grid, start)
            ran = sorted(t for tiles in schedule for t in tiles)
            assert ran == [(bh, m) for bh in range(n_bh) for m in range(n_tiles_m)], (n_tiles_m, n_bh, grid, start)
            if start % grid == 0:  # whole rounds of pairs, then the tail: longest tiles first
                for tiles in schedule:
                    tail = [cost[m] for _, m in tiles[2 * start // grid:]]
                    assert tail == sorted(tail, reverse=True)
            busiest[start] = max(sum(cost[m] for _, m in tiles) for tiles in schedule)
        chosen = busiest[fa3.tail_start(n_tiles_m, n_bh, grid, seqlen_q, seqlen_k, 128, 128)]
        assert chosen <= 1.005 * min(busiest.values())
    # bench.attention's head_dim-64 causal shape at 4k: 2048 equal pairs on 132 CTAs take 16 pairs' time; with
    # the tail under 15.75
    schedule = _causal_schedule(32, 128, 132, fa3.tail_start(32, 128, 132, 4096, 4096, 128, 128))
    assert max(sum(m + 2 for _, m in tiles) for tiles in schedule) < 15.75 * 35


def test_causal_tail_start_without_a_tail_for_odd_query_blocks():
    """Pairs span two heads when a head has an odd number of query blocks: no tail, all pairs."""
    assert fa3.tail_start(7, 40, 132, 7 * 128, 7 * 128, 128, 128) == 140
    assert fa3.tail_start(7, 41, 132, 7 * 128, 7 * 128, 128, 128) == 144


def _reference_grads(q, k, v, do, causal):
    """float64 o and (dq, dk, dv) at softmax_scale head_dim ** -0.5: `test_attention.reference` (a bottom-right
    causal mask, GQA by head index) under autograd; rows that see no key give 0 and no gradient."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    o, _ = reference(q, k, v, causal, q.shape[-1] ** -0.5)
    o.backward(do.double())
    return o, (q.grad, k.grad, v.grad)


@gluon_on_hopper
@pytest.mark.parametrize("head_dim,causal,n_heads,n_kv_heads,seqlen_q,seqlen_k", [
    (128, True, 4, 4, 333, 333), (64, True, 8, 2, 200, 455), (128, False, 2, 1, 517, 130), (64, False, 4, 4, 64, 64),
    (64, True, 4, 4, 455, 200), (64, False, 2, 1, 129, 300),  # 128-row query blocks at 64: partial last blocks
    (96, True, 4, 4, 333, 333), (96, True, 8, 2, 200, 455), (96, False, 2, 1, 517, 130),  # the 128-wide kernel
])
def test_gluon_backward_matches_float64(fresh_dispatch, monkeypatch, head_dim, causal, n_heads, n_kv_heads, seqlen_q,
                                        seqlen_k):
    """The Gluon backward (dQ through float32 TMA reduce-adds, run directly: the shapes are shorter than
    BACKWARD_MIN_SEQLEN_K) against float64, in the model's (B, T, H, D) memory order, at every head dim it covers,
    its outputs and the dQ accumulator poisoned first; under torch.use_deterministic_algorithms fa3_attention's
    backward (FA2's) repeats bit for bit."""
    _poisoned_outputs(monkeypatch)

    def bthd(heads, seqlen):  # (B, H, T, D) views of (B, T, H, D) memory, as the model passes them
        return torch.randn(2, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)

    q, k, v = bthd(n_heads, seqlen_q), bthd(n_kv_heads, seqlen_k), bthd(n_kv_heads, seqlen_k)
    do = bthd(n_heads, seqlen_q)
    assert fa3.gluon_unsupported_reason(q, k, v, do) is None
    o_ref, grads_ref = _reference_grads(q, k, v, do, causal)
    scale = head_dim ** -0.5
    o, lse = fa3.run_forward(q, k, v, causal, scale, fa3.FORWARD_CONFIGS[head_dim, causal])
    out = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    grads = fa3.run_backward(do, q, k, v, o, lse, causal, scale, fa3.BACKWARD_CONFIGS[head_dim], out)
    for grad, buffer, ref in zip(grads, out, grads_ref):
        err = ((grad.double() - ref).norm() / ref.norm()).item()
        assert grad is buffer and torch.isfinite(grad).all() and err < 1e-2, err
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(2):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            fa3_attention(*leaves, causal=causal).backward(do)
            runs.append([t.grad for t in leaves])
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@gluon_on_hopper
@pytest.mark.parametrize("causal", [True, False])
def test_head_dim_256_trains_with_the_gluon_forward_and_fa2s_backward(fresh_dispatch, monkeypatch, causal):
    """fa3_attention at head_dim 256: the Gluon forward (o allocated NaN), FA2's backward with one warning naming
    why, against float64 with GQA and seqlen_q != seqlen_k, in the model's (B, T, H, D) memory order."""
    _poisoned_outputs(monkeypatch)
    q = torch.randn(2, 333, 4, 256, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(2, 717, 2, 256, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    do = torch.randn_like(q)
    o_ref, grads_ref = _reference_grads(q, k, v, do, causal)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o = fa3_attention(*leaves, causal=causal)
        assert not [w for w in caught if "fa3: running FA2's" in str(w.message)]  # the forward ran Gluon
        o.backward(do)
    fallback = [str(w.message) for w in caught if "fa3: running FA2's" in str(w.message)]
    assert len(fallback) == 1 and "head_dim 256 in the backward" in fallback[0]
    assert torch.isfinite(o).all() and ((o.double() - o_ref).norm() / o_ref.norm()).item() < 1e-2
    for leaf, ref in zip(leaves, grads_ref):
        err = ((leaf.grad.double() - ref).norm() / ref.norm()).item()
        assert torch.isfinite(leaf.grad).all() and err < 1e-2, err


@gluon_on_hopper
@pytest.mark.parametrize("head_dim,causal,window_size,softcap", [
    (256, True, (300, -1), 0.0), (256, False, (33, 70), 0.0), (256, True, (-1, -1), 30.0),
])
def test_gluon_forward_256_window_and_softcap_match_float64(fresh_dispatch, head_dim, causal, window_size, softcap):
    """The head_dim-256 forward (32-key blocks) with sliding windows and softcap, GQA, seqlen_q != seqlen_k,
    against float64: o and lse."""
    q = torch.randn(2, 517, 8, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    q = q * (4.0 if softcap else 1.0)
    k, v = (torch.randn(2, 300, 2, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    scale = head_dim ** -0.5
    o_ref, lse_ref = reference(*(t.double() for t in (q, k, v)), causal, scale, window_size, softcap)
    banded = causal or window_size != (-1, -1)
    o, lse = fa3.run_forward(q, k, v, causal, scale, fa3.FORWARD_CONFIGS[head_dim, banded], window_size, softcap)
    seen = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), seen)
    assert (lse[seen].double() / fa2.LOG2E - lse_ref[seen]).abs().max() < 1e-2
    assert torch.isfinite(o).all()
    assert ((o.double() - o_ref).norm() / o_ref.norm().clamp_min(o_ref.numel() ** 0.5)).item() < 1e-2


@gluon_on_hopper
@pytest.mark.parametrize("head_dim,causal,n_heads,n_kv_heads,seqlen_q,seqlen_k,heads_per_cta", [
    (64, True, 8, 2, 200, 455, 1), (64, False, 8, 2, 455, 200, 2), (128, True, 8, 1, 333, 333, 1),
    (128, False, 4, 2, 517, 130, 1), (96, True, 8, 2, 200, 455, 2), (128, True, 8, 1, 1000, 1000, 4),
])
def test_gluon_backward_heads_per_cta_match_float64(fresh_dispatch, monkeypatch, head_dim, causal, n_heads,
                                                    n_kv_heads, seqlen_q, seqlen_k, heads_per_cta):
    """A GQA group's query heads over several CTAs (`BackwardConfig.heads_per_cta`): their dK and dV reduce-added
    into float32 accumulators (NaN-poisoned when made, so they must be zeroed) match float64, partial key blocks
    and head_dim 96's clipped columns included."""
    _poisoned_outputs(monkeypatch)
    q, do = (torch.randn(2, n_heads, seqlen_q, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, n_kv_heads, seqlen_k, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    _, grads_ref = _reference_grads(q, k, v, do, causal)
    scale = head_dim ** -0.5  # the reference's
    o, lse = fa3.run_forward(q, k, v, causal, scale, fa3.FORWARD_CONFIGS[head_dim, causal])
    out = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    config = fa3.BACKWARD_CONFIGS[head_dim]._replace(heads_per_cta=heads_per_cta)
    assert config.reduces_kv(fa3.kernel_head_dim(head_dim), n_heads // n_kv_heads)
    grads = fa3.run_backward(do, q, k, v, o, lse, causal, scale, config, out)
    for grad, buffer, ref in zip(grads, out, grads_ref):
        err = ((grad.double() - ref).norm() / ref.norm()).item()
        assert grad is buffer and torch.isfinite(grad).all() and err < 1e-2, err


@gluon_on_hopper
@pytest.mark.parametrize("section_heads", [1, 2, 4, 0, 9, 20])
def test_gluon_backward_launch_orders_cover_every_key_block(fresh_dispatch, section_heads):
    """Every launch order of the backward's CTAs (sections of `section_heads` (batch, kv head) pairs, key-major
    within each; 0: a wave's worth) visits each key block of each of the 9 pairs once, partial last sections
    included: the gradients match float64, written into NaN-filled buffers."""
    q = torch.randn(3, 6, 1000, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(3, 3, 1000, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    _, grads_ref = _reference_grads(q, k, v, do, True)
    o, lse = fa3.run_forward(q, k, v, True, 0.125, fa3.FORWARD_CONFIGS[64, True])
    out = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    config = fa3.BACKWARD_CONFIGS[64]._replace(section_heads=section_heads)
    for grad, ref in zip(fa3.run_backward(do, q, k, v, o, lse, True, 0.125, config, out), grads_ref):
        err = ((grad.double() - ref).norm() / ref.norm()).item()
        assert torch.isfinite(grad).all() and err < 1e-2, err


@gluon_on_hopper
@pytest.mark.parametrize("head_dim,causal,n_heads,n_kv_heads,seqlen", [
    (64, True, 4, 4, 1100), (64, False, 4, 2, 1030), (128, True, 4, 2, 300), (128, False, 2, 2, 517),
    (96, True, 4, 2, 300), (96, False, 2, 2, 517),
])
def test_gluon_qkvpacked_matches_float64(fresh_dispatch, monkeypatch, head_dim, causal, n_heads, n_kv_heads, seqlen):
    """fa3_qkvpacked_attention with the Gluon forward and backward (dk, dv stored by TMA and dq by the cast pass
    straight into the packed gradient, allocated NaN) against float64; after fa3_attention on the same shape with
    separate tensors, so the compiled-launch cache (`kernels.launch`) meets the packed strides second."""
    monkeypatch.setattr(launch_mod, "_KERNELS", {})
    empty_like = torch.empty_like  # the packed gradient is allocated by it: NaN, so an unwritten element shows
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: empty_like(*a, **kw).fill_(float("nan")))
    heads = n_heads + 2 * n_kv_heads
    qkv = torch.randn(2, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(2, seqlen, n_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.transpose(1, 2).split([n_heads, n_kv_heads, n_kv_heads], dim=1)
    o_ref, grads_ref = _reference_grads(q, k, v, do.transpose(1, 2), causal)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the Gluon kernels ran
        fa3_attention(*(t.contiguous().requires_grad_() for t in (q, k, v)), causal=causal).backward(
            do.transpose(1, 2))
        leaf = qkv.clone().requires_grad_()
        o = fa3_qkvpacked_attention(leaf, n_heads, causal=causal)
        o.backward(do)
    assert o.shape == (2, seqlen, n_heads, head_dim) and leaf.grad.shape == qkv.shape
    assert ((o.double().transpose(1, 2) - o_ref).norm() / o_ref.norm()).item() < 1e-2
    grads = leaf.grad.transpose(1, 2).split([n_heads, n_kv_heads, n_kv_heads], dim=1)
    for grad, ref in zip(grads, grads_ref):
        err = ((grad.double() - ref).norm() / ref.norm()).item()
        assert torch.isfinite(grad).all() and err < 1e-2, err


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_forward_plan_runs_gluon_with_the_measured_config(head_dim, causal):
    """An eligible forward runs the Gluon kernel at every length, with FORWARD_CONFIGS' entry (at 96 128's), and no
    warning."""
    for seqlen_k in (1, 1024, 32768):
        choice = fa3.decide(_facts(head_dim=head_dim, causal=causal, seqlen_k=seqlen_k))
        assert choice == fa3.Plan("gluon", config=fa3.FORWARD_CONFIGS[head_dim, causal])
    assert fa3.FORWARD_CONFIGS[96, causal] == fa3.FORWARD_CONFIGS[128, causal]


@pytest.mark.parametrize("head_dim,seqlen_k,deterministic,expected", [
    (128, 8, False, "gluon"), (64, 8, False, "fa2"), (64, 1023, False, "fa2"), (64, 1024, False, "gluon short"),
    (64, 1025, False, "gluon"), (64, 4096, False, "gluon"), (128, 1024, False, "gluon"),
    (128, 8, True, "fa2"), (64, 1024, True, "gluon short"), (64, 4096, True, "fa2"), (96, 8, False, "gluon"),
    (96, 4096, False, "gluon"),
    (96, 4096, True, "fa2"), (80, 4096, False, "fa2"), (256, 4096, False, "fa2"),
])
def test_backward_plan(head_dim, seqlen_k, deterministic, expected):
    """The Gluon backward from BACKWARD_MIN_SEQLEN_K keys on (FA2's measured faster below), at 64 with the short
    config up to SHORT_BACKWARD_SEQLEN_K keys, and under deterministic algorithms only with that config (the other
    configs' dQ reduce-adds are not bit-reproducible); only an ineligible input warns."""
    choice = fa3.decide(_facts(direction="backward", head_dim=head_dim, seqlen_k=seqlen_k,
                               deterministic=deterministic))
    assert choice.kernel == expected.split()[0]
    if expected == "gluon short":
        assert choice.config == fa3.SHORT_BACKWARD_CONFIGS[64] and choice.reason is None
    elif expected == "gluon":
        assert choice.config == fa3.BACKWARD_CONFIGS[head_dim] and choice.reason is None
    else:
        assert choice.reason and choice.warn == (head_dim not in fa3.BACKWARD_HEAD_DIMS)
    assert fa3.decide(_facts(seqlen_k=seqlen_k, deterministic=deterministic, head_dim=head_dim)).kernel == (
        "gluon" if head_dim in fa3.HEAD_DIMS else "fa2")  # the forward: neither length nor determinism matter


@pytest.mark.parametrize("head_dim,deterministic,expected", [
    (64, False, "packed"), (128, False, "default"), (96, False, "default"), (64, True, "fa2")])
def test_packed_sequences_take_their_measured_configs(head_dim, deterministic, expected):
    """Packed sequences at 64 run PACKED_FORWARD_CONFIGS (without a window) and PACKED_BACKWARD_CONFIGS (one consumer, dQ
    reduce-adds: not bit-reproducible, so FA2's under deterministic algorithms), here 16k packed keys; other head
    dims the causal configs."""
    forward = fa3.decide(_facts(head_dim=head_dim, varlen=True, seqlen_k=16384, deterministic=deterministic))
    assert forward == fa3.Plan("gluon", config=fa3.PACKED_FORWARD_CONFIGS[64] if head_dim == 64 else
                               fa3.FORWARD_CONFIGS[head_dim, True])
    windowed = fa3.decide(_facts(head_dim=head_dim, varlen=True, seqlen_k=16384, window_left=1023, window_right=0))
    assert windowed == fa3.Plan("gluon", config=fa3.FORWARD_CONFIGS[head_dim, True])  # not measured apart
    facts = _facts(direction="backward", head_dim=head_dim, varlen=True, seqlen_k=16384, deterministic=deterministic)
    choice = fa3.decide(facts)
    if expected == "fa2":
        assert choice.kernel == "fa2" and not choice.warn
    else:
        config = fa3.PACKED_BACKWARD_CONFIGS[64] if expected == "packed" else fa3.BACKWARD_CONFIGS[head_dim]
        assert choice == fa3.Plan("gluon", config=config)
    assert fa3.PACKED_BACKWARD_CONFIGS[64].num_consumers == 1 and not fa3.PACKED_BACKWARD_CONFIGS[64].separate_dq


def test_plan_refuses_an_unknown_direction():
    with pytest.raises(ValueError, match="direction='sideways'; accepted 'forward', 'backward'"):
        fa3.decide(_facts(direction="sideways"))


@pytest.mark.parametrize("deterministic", [False, True])
def test_fallback_backward_gets_the_gradient_buffers(fresh_dispatch, deterministic):
    """Where FA2's backward runs (here: the CPU), it writes into `out`, as the Gluon one does."""
    q, k, v, do = (torch.randn(1, 2, 24, 64) for _ in range(4))
    out = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    torch.use_deterministic_algorithms(deterministic)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fallback's warning on a machine without an H200
            o, lse = fa3.forward(q, k, v, True, 0.125)
            grads = fa3.backward(do, q, k, v, o, lse, True, 0.125, out=out)
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(g is b and torch.isfinite(g).all() for g, b in zip(grads, out))
    torch.testing.assert_close(grads[0], fa2.backward(do, q, k, v, o, lse, True, 0.125)[0], rtol=0, atol=0)


@pytest.mark.parametrize("head_dim,seqlen_q,block_m", [(64, 40, 64), (80, 64, 64), (128, 7, 64), (64, 130, 128),
                                                     (96, 70, 64)])
def test_bwd_preprocess_zeroes_the_dq_accumulator(head_dim, seqlen_q, block_m):
    """The Gluon backward's preprocess: delta = rowsum(dO * O) against float64, and the float32 dQ accumulator
    (padded to whole block_m-row query blocks) zeroed in the same kernel, padding rows included."""
    from kernels.common import bwd_preprocess

    device = "cuda" if torch.cuda.is_available() else "cpu"
    o, do = (torch.randn(2, 3, seqlen_q, head_dim, dtype=torch.bfloat16, device=device) for _ in range(2))
    seqlen_q_pad = -(-seqlen_q // block_m) * block_m
    for dq_acc in (torch.full((2, 3, seqlen_q_pad, head_dim), float("nan"), device=device),  # and (B, T, H, D) order
                   torch.full((2, seqlen_q_pad, 3, head_dim), float("nan"), device=device).transpose(1, 2)):
        delta = bwd_preprocess(o, do.transpose(1, 2).contiguous().transpose(1, 2), dq_acc)
        reference = (o.double() * do.double()).sum(-1)
        assert ((delta.double() - reference).norm() / reference.norm()).item() < 1e-6
        assert (dq_acc == 0).all()


@pytest.mark.parametrize("dtype,head_dim,seqlen_q,pad", [(torch.bfloat16, 64, 130, 126), (torch.float16, 128, 64, 0),
                                                       (torch.bfloat16, 96, 70, 58), (torch.float16, 96, 64, 0)])
def test_convert_dq_scales_and_casts_into_any_layout(dtype, head_dim, seqlen_q, pad):
    """fa3.convert_dq (the Gluon backward's last pass): a float32 accumulator in (B, T, H, D) memory with padded rows,
    into dq views of a NaN-filled packed qkv gradient and into a (B, H, T, D) tensor, bit for bit what torch.mul in
    float32 then the cast gives (on the GPU; Triton's interpreter rounds bfloat16 toward zero, one ulp); the padding
    rows are not read into dq; head_dim 96 through a masked 128-wide block. Wrong shapes, dtypes and head dims raise."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n_heads = 3
    acc = torch.randn(2, seqlen_q + pad, n_heads, head_dim, device=device).transpose(1, 2)
    expected = (acc[:, :, :seqlen_q] * 0.125).to(dtype)
    packed = torch.full((2, seqlen_q, 3 * n_heads, head_dim), float("nan"), device=device, dtype=dtype)
    for dq in (packed.transpose(1, 2)[:, :n_heads], torch.full_like(expected, float("nan")).contiguous()):
        fa3.convert_dq(acc, 0.125, dq)
        if device == "cpu" and dtype == torch.bfloat16:  # the interpreter's bfloat16 cast truncates: one ulp
            torch.testing.assert_close(dq, expected, rtol=2 ** -7, atol=0)
        else:
            assert torch.equal(dq, expected)
    assert packed[:, :, n_heads:].isnan().all()  # k and v's parts untouched
    dq = torch.empty_like(expected)
    bad = ((acc.half(), dq), (acc[:, :, :seqlen_q - 1], dq), (acc[:, :2], dq), (acc[..., :48], dq))
    for bad_acc, bad_dq in bad:
        with pytest.raises(ValueError, match="convert_dq: dq_acc must be float32"):
            fa3.convert_dq(bad_acc, 0.125, bad_dq)


def test_empty_like_layout_keeps_the_memory_order_with_another_shape_and_dtype():
    """The Gluon backward's float32 dQ accumulator: q's (B, T, H, D) memory order (here with gaps, as sliced from a
    fused projection), a padded seqlen and float32; the final scale-and-cast pass then reads and writes alike."""
    from kernels.common import empty_like_layout

    q = torch.randn(2, 40, 3, 4, 16, dtype=torch.bfloat16)[:, :, 0].transpose(1, 2)  # (B, H, T, D) over (B, T, 3, H, D)
    acc = empty_like_layout(q, (2, 4, 64, 16), torch.float32)
    assert acc.shape == (2, 4, 64, 16) and acc.dtype == torch.float32
    assert acc.stride() == (64 * 4 * 16, 16, 4 * 16, 1)  # dense (B, T_pad, H, D)
    assert empty_like_layout(q).stride() == (40 * 4 * 16, 16, 4 * 16, 1) and empty_like_layout(q).dtype == q.dtype


@pytest.mark.parametrize("config,message", [
    (fa3.BackwardConfig(2, "row", 128), "split_dq='row'; accepted 'cols', 'rows'"),
    (fa3.BackwardConfig(2, "none", 64), "split_dq='none'; accepted 'cols', 'rows'"),
    (fa3.BackwardConfig(2, "rows", 64), "block_m=64 with split_dq='rows'"),
    (fa3.BackwardConfig(2, "cols", 96), "block_m=96 with split_dq='cols'"),
    (fa3.BackwardConfig(2, "cols", 64, -1), "section_heads=-1; accepted 0"),
    (fa3.BackwardConfig(2, "rows", 128, 0, 1), "block_m=128 with split_dq='rows' and num_consumers=1"),
    (fa3.BackwardConfig(2, "rows", 64, 0, 3), "num_consumers=3; accepted 1, 2"),
    (fa3.BackwardConfig(2, "rows", 64, 0, 1, 100), "maxnreg=100; accepted 0 (Triton's choice) or a multiple of 8"),
])
def test_backward_configs_are_checked(config, message):
    """A BackwardConfig the Gluon backward cannot run (e.g. one typed into tools.fa3_variants) is named before
    anything is compiled."""
    with pytest.raises(ValueError, match=re.escape(message)):
        config.dq_box(64)
    assert fa3.BACKWARD_CONFIGS[64].dq_box(64) == (64, 64) and fa3.BACKWARD_CONFIGS[128].dq_box(128) == (64, 64)


@pytest.mark.parametrize("config,head_dim,group,message", [
    (fa3.BackwardConfig(2, "cols", 64, heads_per_cta=-1), 128, 1, "heads_per_cta=-1; accepted 0 (the whole GQA"),
    (fa3.BackwardConfig(2, "cols", 128, heads_per_cta=1), 128, 4, "needs a dQ box of 64 rows"),
])
def test_heads_per_cta_is_checked(config, head_dim, group, message):
    """heads_per_cta is 0 or more, and a split group needs a dQ box that can stage dK and dV."""
    with pytest.raises(ValueError, match=re.escape(message)):
        config.reduces_kv(head_dim, group)


@pytest.mark.parametrize("heads_per_cta,group,heads,reduces", [
    (0, 1, 1, False), (0, 8, 8, False), (1, 1, 1, False), (1, 8, 1, True), (2, 8, 2, True), (4, 4, 4, False),
    (16, 4, 4, False), (2, 6, 2, True), (2, 3, 1, True), (4, 6, 3, True), (3, 8, 2, True), (5, 5, 5, False),
    (2, 5, 1, True),
])
def test_heads_per_cta_of_a_group(heads_per_cta, group, heads, reduces):
    """The query heads a CTA takes: the largest divisor of the group up to heads_per_cta (0: the group), so every
    group size runs (a model with 12 heads on 4 kv heads, group 3, with a config of 2); only a split group
    reduces."""
    config = fa3.BackwardConfig(2, "cols", 64, heads_per_cta=heads_per_cta)
    assert config.cta_heads(group) == heads and config.reduces_kv(128, group) == reduces


def test_a_split_group_is_not_reproducible():
    """Under deterministic algorithms a config whose group's CTAs reduce-add dK and dV sends the backward to FA2,
    as one with dQ reduce-adds does; a separate-dQ config with whole groups stays on the Gluon kernel."""
    split = fa3.DETERMINISTIC_WINDOW_BACKWARD_CONFIGS[128]._replace(heads_per_cta=1)
    assert fa3._reproducible(fa3.DETERMINISTIC_WINDOW_BACKWARD_CONFIGS[128]) and not fa3._reproducible(split)
    assert not any(fa3._reproducible(c) for c in fa3.BACKWARD_CONFIGS.values())


def test_bwd_preprocess_refuses_a_wrong_dq_accumulator():
    from kernels.common import bwd_preprocess

    o = torch.randn(1, 2, 40, 64, dtype=torch.bfloat16)
    for bad in (torch.zeros(1, 2, 64, 64, dtype=torch.bfloat16), torch.zeros(2, 2, 64, 64),
                torch.zeros(1, 2, 64, 64).transpose(2, 3), torch.zeros(1, 2, 32, 64), torch.zeros(2, 64, 64)):
        with pytest.raises(ValueError, match="dq_acc must be a float32 .* with a unit last stride"):
            bwd_preprocess(o, o, bad)


# (head_dim, causal, window_size, n_heads, n_kv_heads, seqlen_q, seqlen_k)
WINDOW_CASES = [
    (64, True, (127, -1), 4, 4, 1000, 1000),  # gpt-oss's 128-token window: the band crosses every tile
    (128, True, (1023, -1), 2, 2, 2100, 2100),  # a 1k window over 2k: tiles with and without the left edge
    (64, False, (0, 0), 2, 2, 333, 333),  # each row sees its own key only
    (64, False, (-1, 5), 4, 2, 300, 517),  # a right edge without causal, seqlen_q < seqlen_k
    (128, False, (33, 70), 8, 2, 517, 300),  # both edges, GQA, seqlen_q > seqlen_k
    (64, True, (5000, -1), 2, 2, 700, 700),  # wider than the sequence: plain causal
    (64, True, (40, -1), 2, 1, 455, 200),  # the first rows see no key
    (128, False, (3, 2), 2, 2, 129, 1100),  # a band narrower than a block, far right of the keys
    (96, True, (127, -1), 4, 4, 1000, 1000),  # the 128-wide kernels on 96 columns
    (96, False, (33, 70), 8, 2, 517, 300),
]


def _window_run(head_dim, causal, window_size, n_heads, n_kv_heads, seqlen_q, seqlen_k, k_poison=None, softcap=0.0,
                q_scale=1.0, backward_config=None):
    """The Gluon forward and backward (run directly: `plan`'s length rule aside) on (B, T, H, D)-ordered views,
    outputs poisoned, against the float64 reference; k_poison: key rows set to NaN first (never to be read);
    q_scale: q's size (large logits for softcap)."""
    def bthd(heads, seqlen):  # (B, H, T, D) views of (B, T, H, D) memory, as the model passes them
        return torch.randn(2, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)

    q, k, v, do = bthd(n_heads, seqlen_q), bthd(n_kv_heads, seqlen_k), bthd(n_kv_heads, seqlen_k), bthd(n_heads, seqlen_q)
    q = q * q_scale
    if k_poison is not None:
        k[:, :, k_poison], v[:, :, k_poison] = float("nan"), float("nan")
    scale = head_dim ** -0.5
    q64, k64, v64 = (t.detach().double().nan_to_num(0.0).requires_grad_() for t in (q, k, v))
    o_ref, lse_ref = reference(q64, k64, v64, causal, scale, window_size, softcap)
    o_ref.backward(do.double())
    banded = causal or window_size != (-1, -1)
    o, lse = fa3.run_forward(q, k, v, causal, scale, fa3.FORWARD_CONFIGS[head_dim, banded], window_size, softcap)
    out = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    grads = fa3.run_backward(do, q, k, v, o, lse, causal, scale, backward_config or fa3.BACKWARD_CONFIGS[head_dim],
                             out, window_size, softcap)
    seen = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), seen)  # rows that see no key: +inf inside, 0 output
    assert (lse[seen].double() / fa2.LOG2E - lse_ref[seen]).abs().max() < 1e-2
    for got, ref in ((o, o_ref), *zip(grads, (q64.grad, k64.grad, v64.grad))):
        assert torch.isfinite(got).all()
        # relative, but to an rms of 1 at least: with window (0, 0) dq and dk are 0 (a row's softmax of one key)
        err = ((got.double() - ref).norm() / ref.norm().clamp_min(ref.numel() ** 0.5)).item()
        assert err < 1e-2, err
    return o, grads


@gluon_on_hopper
@pytest.mark.parametrize("head_dim,causal,window_size,n_heads,n_kv_heads,seqlen_q,seqlen_k", WINDOW_CASES)
def test_gluon_window_matches_float64(fresh_dispatch, head_dim, causal, window_size, n_heads, n_kv_heads, seqlen_q,
                                      seqlen_k):
    """Sliding windows in the Gluon forward and backward, flash-attn's convention (bottom-right, -1 unlimited,
    causal sets right to 0, rows that see no key give 0), against float64: o, lse, dq, dk, dv."""
    _window_run(head_dim, causal, window_size, n_heads, n_kv_heads, seqlen_q, seqlen_k)


# Cases for the one-consumer, separate-dQ configs (SHORT_BACKWARD_CONFIGS, NARROW_WINDOW_BACKWARD_CONFIGS): every
# WINDOW_CASES entry and unwindowed ones at 64 (GQA, seqlen_q != seqlen_k)
SHORT_CASES = WINDOW_CASES + [
    (64, True, (-1, -1), 4, 2, 1000, 1000), (64, False, (-1, -1), 2, 2, 455, 700), (64, True, (-1, -1), 2, 1, 700, 455)]


@gluon_on_hopper
@pytest.mark.parametrize("head_dim,causal,window_size,n_heads,n_kv_heads,seqlen_q,seqlen_k", SHORT_CASES)
def test_short_backward_config_matches_float64(fresh_dispatch, head_dim, causal, window_size, n_heads, n_kv_heads,
                                               seqlen_q, seqlen_k):
    """The one-consumer dK/dV kernel with dQ from FA2's kernel, against float64, outputs poisoned; with softcap
    (large logits) once."""
    config = fa3.NARROW_WINDOW_BACKWARD_CONFIGS[head_dim]
    assert config.num_consumers == 1 and config.separate_dq
    _window_run(head_dim, causal, window_size, n_heads, n_kv_heads, seqlen_q, seqlen_k, backward_config=config)
    if window_size == (127, -1) and head_dim == 64:
        _window_run(head_dim, causal, window_size, n_heads, n_kv_heads, seqlen_q, seqlen_k, softcap=30.0,
                    q_scale=8.0, backward_config=config)


@gluon_on_hopper
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gluon_window_never_reads_keys_outside_the_band(fresh_dispatch, head_dim):
    """128 queries at the end of 1024 keys, window (100, 0): keys 0..767 (whole 128-key blocks) are NaN. A visit
    would spread NaN through a GEMM, so finite, correct results prove the forward and the backward skip them; their
    dK and dV come back exactly 0."""
    _, (dq, dk, dv) = _window_run(head_dim, True, (100, -1), 2, 2, 128, 1024, k_poison=slice(0, 768))
    assert (dk[:, :, :768] == 0).all() and (dv[:, :, :768] == 0).all()


@gluon_on_hopper
def test_fa3_attention_runs_windows_on_gluon(fresh_dispatch):
    """fa3_attention with a window takes the Gluon kernels both ways (no fallback warning) and matches FA2."""
    q, k, v = (torch.randn(2, 4, 2048, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    assert fa3.plan("backward", q, k, v, True).kernel == "gluon"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o = fa3_attention(q, k, v, causal=True, window_size=(255, -1))
        o.backward(torch.ones_like(o))
    grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    o2 = fa2_attention(q, k, v, causal=True, window_size=(255, -1))
    o2.backward(torch.ones_like(o2))
    assert (o - o2).abs().max() < 2e-2
    for got, ref in zip(grads, (q.grad, k.grad, v.grad)):
        assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


def test_windows_and_packed_sequences_run_fa2_where_gluon_does_not(fresh_dispatch):
    """fa3_attention(window_size=..., softcap=...) and fa3_varlen_attention give FA2's results wherever FA2's kernels
    run (every call on a machine without an H200; packed sequences with two sets of offsets everywhere, with one
    warning naming them)."""
    q, k, v = _qkv()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o = fa3_attention(q, k, v, causal=True, window_size=(5, -1), softcap=2.0)
    if not HOPPER or not SUPPORTED:
        ref = fa2_attention(q, k, v, causal=True, window_size=(5, -1), softcap=2.0)
        torch.testing.assert_close(o, ref, rtol=0, atol=0)
    packed = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]  # (total, heads, head_dim)
    cu_q = torch.tensor([0, 7, 7, 24], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, 10, 14, 24], dtype=torch.int32, device=q.device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o = fa3_varlen_attention(*packed, cu_q, cu_k, 17, 10, causal=True, window_size=(3, -1))
    assert any("cu_seqlens_k differs from cu_seqlens_q" in str(w.message) for w in caught) or not HOPPER
    ref = fa2_varlen_attention(*packed, cu_q, cu_k, 17, 10, causal=True, window_size=(3, -1))
    torch.testing.assert_close(o, ref, rtol=0, atol=0)


@gluon_on_hopper
@pytest.mark.parametrize("head_dim,causal,window_size,softcap", [
    (64, True, (-1, -1), 30.0), (128, False, (-1, -1), 50.0), (64, True, (127, -1), 20.0), (128, True, (300, -1), 5.0),
    (96, True, (-1, -1), 30.0),
])
def test_gluon_softcap_matches_float64(fresh_dispatch, head_dim, causal, window_size, softcap):
    """Gemma 2's logit cap in the Gluon forward and backward (flash-attn's softcap) with logits far past the cap
    (q scaled up 8x: scores of ~100 against caps of 5-50), against float64: o, lse, dq, dk, dv."""
    _window_run(head_dim, causal, window_size, 4, 2, 1100, 1100, softcap=softcap, q_scale=8.0)


@pytest.mark.parametrize("head_dim,window_left,window_right,narrow", [
    (64, 0, 0, True), (64, 127, 0, True), (64, 128, 0, True), (64, 100, 128, True), (64, 129, 0, False),
    (64, 1023, 0, False), (64, 100, -1, False), (64, 100, 129, False), (128, 127, 0, True), (128, 129, 0, False),
    (96, 3, 2, True), (96, 1023, 0, False)])
def test_narrow_windows_take_their_measured_configs(head_dim, window_left, window_right, narrow):
    """A window whose edges are both within NARROW_WINDOW keys runs 64-key blocks forward and the one-consumer,
    separate-dQ backward; wider ones (an unlimited right side too: each query then meets most key blocks) the causal
    configs."""
    facts = _facts(head_dim=head_dim, window_left=window_left, window_right=window_right, seqlen_k=8192)
    expected = fa3.NARROW_WINDOW_FORWARD_CONFIGS[head_dim] if narrow else fa3.FORWARD_CONFIGS[head_dim, True]
    assert fa3.decide(facts) == fa3.Plan("gluon", config=expected)
    assert not narrow or expected.block_n == 64
    expected = fa3.NARROW_WINDOW_BACKWARD_CONFIGS[head_dim] if narrow else fa3.BACKWARD_CONFIGS[head_dim]
    assert fa3.decide(facts._replace(direction="backward")).config == expected
    assert not narrow or (expected.num_consumers == 1 and expected.separate_dq)
    # no dQ reduce-adds in a narrow band's backward, so it stays on the Gluon kernel under deterministic algorithms,
    # and wider windows take the same config there
    deterministic = fa3.decide(facts._replace(direction="backward", deterministic=True))
    if narrow or head_dim in fa3.DETERMINISTIC_WINDOW_BACKWARD_CONFIGS:
        assert deterministic == fa3.Plan("gluon", config=fa3.NARROW_WINDOW_BACKWARD_CONFIGS[head_dim] if narrow else
                                         fa3.DETERMINISTIC_WINDOW_BACKWARD_CONFIGS[head_dim])
    else:
        assert deterministic.kernel == "fa2"


@pytest.mark.parametrize("window_left,varlen,head_dim,expected", [
    (1023, False, 96, "window"), (1023, False, 128, "window"), (4095, False, 128, "window"), (0, False, 64, "narrow"),
    (1023, False, 64, "fa2"), (-1, False, 64, "fa2"), (-1, False, 128, "fa2"), (1023, True, 64, "fa2"),
    (1023, True, 128, "fa2"), (-1, True, 64, "fa2")])
def test_deterministic_backward_plan(window_left, varlen, head_dim, expected):
    """Under deterministic algorithms a sliding window on unpacked sequences runs the bit-reproducible separate-dQ
    config on the Gluon kernel at head_dim 96 and 128 (and a narrow one at every head_dim); wide windows at 64, full
    attention and packed documents run FA2's atomic-free backward (a choice: no warning). Without deterministic
    algorithms the same windows keep their usual configs."""
    facts = _facts(direction="backward", head_dim=head_dim, seqlen_k=8192, window_left=window_left, window_right=0,
                   varlen=varlen, deterministic=True)
    choice = fa3.decide(facts)
    if expected == "fa2":
        assert choice.kernel == "fa2" and not choice.warn and "deterministic" in choice.reason
    else:
        tables = {"window": fa3.DETERMINISTIC_WINDOW_BACKWARD_CONFIGS, "narrow": fa3.NARROW_WINDOW_BACKWARD_CONFIGS}
        assert choice == fa3.Plan("gluon", config=tables[expected][head_dim])
        assert choice.config.separate_dq
    usual = fa3.decide(facts._replace(deterministic=False))
    assert usual.kernel == "gluon" and (window_left == 0 or not usual.config.separate_dq)


@pytest.mark.skipif(not SUPPORTED, reason=f"triton {fa3.triton_version()} is not a release the Gluon kernels support")
def test_narrow_window_and_packed_forward_configs_compile_for_sm90():
    """The 64-key forwards that narrow windows and packed documents take, compiled as
    `test_gluon_kernels_compile_for_sm90` does."""
    code = ("import torch; from kernels import fa3\n"
            "for d, c, kw in ((64, fa3.NARROW_WINDOW_FORWARD_CONFIGS[64], {'window': True}),"
            " (128, fa3.NARROW_WINDOW_FORWARD_CONFIGS[128], {'window': True}),"
            " (64, fa3.PACKED_FORWARD_CONFIGS[64], {'docs': True})):\n"
            "    k = fa3.compile_for_sm90(torch.bfloat16, d, True, 2, 'fwd', c, **kw)\n"
            "    print(k.metadata.shared, 'wgmma.mma_async' in k.asm['ptx'])")
    rows = compile_in_fresh_process(code, timeout=600)
    assert len(rows) == 3
    for shared, wgmma in rows:
        assert wgmma == "True" and int(shared) <= fa3.SM90_SHARED_MEMORY


@pytest.mark.skipif(not SUPPORTED, reason=f"triton {fa3.triton_version()} is not a release the Gluon kernels support")
def test_short_and_packed_backward_configs_compile_for_sm90_at_two_ctas_an_sm():
    """The one-consumer dK/dV kernels that short keys and narrow windows (dQ left to FA2's kernel) and packed
    documents (dQ reduce-adds) take, compiled for sm_90 as they run: wgmma, 128 registers a thread at launch and at
    most half of an SM's shared memory, so two CTAs fit an SM; TMA reduce-adds only with the accumulator."""
    code = ("import torch; from kernels import fa3\n"
            "for c, kw in ((fa3.SHORT_BACKWARD_CONFIGS[64], {}), (fa3.SHORT_BACKWARD_CONFIGS[64], {'window': True}),"
            " (fa3.PACKED_BACKWARD_CONFIGS[64], {'docs': True})) + ((fa3.NARROW_WINDOW_BACKWARD_CONFIGS[128],"
            " {'window': True, 'head_dim': 128}),):\n"
            "    kw.setdefault('head_dim', 64)\n"
            "    k = fa3.compile_for_sm90(torch.bfloat16, causal=True, group=1, kernel='bwd', config=c, **kw)\n"
            "    ptx = k.asm['ptx']\n"
            "    print(k.metadata.shared, 'wgmma.mma_async' in ptx, 'cp.reduce.async.bulk' in ptx, "
            "'.maxnreg 128' in ptx, '.reqntid 256' in ptx, c.separate_dq)")
    rows = compile_in_fresh_process(code, timeout=600)
    assert len(rows) == 4
    for shared, wgmma, reduce, maxnreg, threads, separate_dq in rows:  # 256 threads x 128 registers: half an SM's
        assert (wgmma, maxnreg, threads) == ("True", "True", "True") and reduce != separate_dq
        assert 2 * int(shared) <= fa3.SM90_SHARED_MEMORY


def _compile_backward_variants(field, values, cases):
    """The Gluon backward compiled for sm_90 (GQA group 4, in a fresh process) at each (head_dim, causal) of
    `cases` with BACKWARD_CONFIGS[head_dim]'s `field` set to each of `values`: per case, per value, (shared memory
    bytes, TMA reduce-adds in the PTX, the PTX's hash)."""
    code = ("import hashlib, torch; from kernels import fa3\n"
            f"for d, causal in {cases!r}:\n"
            f"    for value in {values!r}:\n"
            f"        c = fa3.BACKWARD_CONFIGS[d]._replace({field}=value)\n"
            "        k = fa3.compile_for_sm90(torch.bfloat16, d, causal, 4, 'bwd', c); ptx = k.asm['ptx']\n"
            "        print(k.metadata.shared, ptx.count('cp.reduce.async.bulk.tensor'),"
            " hashlib.sha1(ptx.encode()).hexdigest())")
    rows = compile_in_fresh_process(code, timeout=900)
    assert len(rows) == len(cases) * len(values)
    return [[(int(shared), int(reduces), digest) for shared, reduces, digest in rows[i:i + len(values)]]
            for i in range(0, len(rows), len(values))]


@pytest.mark.skipif(not SUPPORTED, reason=f"triton {fa3.triton_version()} is not a release the Gluon kernels support")
def test_split_group_backward_compiles_for_sm90():
    """heads_per_cta below the group compiles for sm_90 at head_dim 64 (per consumer one 64-column reduce-add each
    for dK and dV) and 128 (two each: the accumulator's column halves), with the same shared memory as a whole
    group's."""
    for (whole, split), extra in zip(_compile_backward_variants("heads_per_cta", (0, 1), ((64, True), (128, True))),
                                     (2 * 2, 2 * 4)):
        assert whole[0] == split[0] and split[1] == whole[1] + extra


@pytest.mark.skipif(not SUPPORTED, reason=f"triton {fa3.triton_version()} is not a release the Gluon kernels support")
def test_lockstep_backward_order_compiles_for_sm90():
    """BackwardConfig.lockstep (the query blocks last to first, the group's heads inner) compiles for sm_90 with
    GQA under a causal mask and without, at head_dim 64 and 128: the same shared memory and TMA reduce-adds as the
    head-after-head order, other code (the step's head and rows)."""
    cases = ((64, True), (64, False), (128, True), (128, False))
    for before, after in _compile_backward_variants("lockstep", (False, True), cases):
        assert before[:2] == after[:2] and after[1] > 0 and before[2] != after[2]


# ------------------------------------------------------------------------------------------ packed sequences
def _doc_bounds_loop(lengths, before, after):
    """`fa3.doc_bounds` written out position by position."""
    starts, limits, first = [], [], 0
    for n in lengths:
        for i in range(first, first + n):
            starts.append(first if before < 0 else max(first, i - before))
            limits.append(first + n if after < 0 else min(first + n, i + after + 1))
        first += n
    return starts, limits


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("before,after", [(-1, 0), (-1, -1), (5, 0), (0, 0), (3, 7)])
def test_doc_bounds_match_a_loop(seed, before, after):
    """Each position's [start, limit) within its own sequence, over random lengths with empty and one-token
    sequences; both non-decreasing (the Gluon kernels' tile ranges rely on it)."""
    rng = random.Random(seed)
    lengths = [rng.choice([0, 1, rng.randint(2, 40)]) for _ in range(rng.randint(1, 9))] + [rng.randint(1, 9)]
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    start, limit = fa3.doc_bounds(cu, sum(lengths), before, after)
    assert start.dtype == limit.dtype == torch.int32
    assert (start.tolist(), limit.tolist()) == _doc_bounds_loop(lengths, before, after)
    assert (start.diff() >= 0).all() and (limit.diff() >= 0).all()


def test_doc_bounds_over_many_sequences_and_programs(monkeypatch):
    """Many offsets (a binary search of 7 steps) and more positions than one program takes (the masked tail
    included), into outputs poisoned beforehand: every position written, as the loop gives; no positions, no
    launch."""
    rng = random.Random(7)
    lengths = [rng.choice([0, 1, rng.randint(2, 20)]) for _ in range(100)] + [5]
    total = sum(lengths)
    assert total > fa3_schedule.BOUNDS_BLOCK and total % fa3_schedule.BOUNDS_BLOCK
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    poisoned = lambda *shape, **kw: torch.full(shape, -7, dtype=kw["dtype"], device=kw["device"])
    monkeypatch.setattr(fa3_schedule.torch, "empty", poisoned)
    for before, after in ((-1, 0), (4, 2)):
        start, limit = fa3.doc_bounds(cu, total, before, after)
        assert (start.tolist(), limit.tolist()) == _doc_bounds_loop(lengths, before, after)
    start, limit = fa3.doc_bounds(torch.zeros(3, dtype=torch.int32), 0, -1, 0)
    assert start.shape == limit.shape == (0,)


def test_schedule_kernels_compile_for_sm90():
    """The bounds kernel, and the one-program sort at its smallest and largest block, compiled for sm_90 without
    a GPU (what only the GPU compiler rejects, the interpreter runs)."""
    code = ("from kernels import fa3_schedule as s\n"
            "for args in (('bounds',), ('order', 16, True), ('order', s.SORT_MAX, False)):\n"
            "    k = s.compile_for_sm90(*args)\n"
            "    print(k.metadata.num_warps, 'st.global' in k.asm['ptx'])")
    assert compile_in_fresh_process(code) == [["4", "True"], ["4", "True"], ["8", "True"]]
    with pytest.raises(ValueError, match="accepted 'bounds' and 'order'"):
        fa3_schedule.compile_for_sm90("sort")


def _longest_first_reference(start, limit, size, block_n, n_bh, tiles):
    """A stable descending sort of the blocks of `size` positions by their extent, written out."""
    total = len(start)
    n = -(-total // size)
    def extent(m):
        lo, hi = int(start[m * size]), int(limit[min((m + 1) * size, total) - 1])
        return -(-hi // block_n) - lo // block_n if tiles else hi - lo
    order = sorted(range(n), key=lambda m: (-extent(m), m))
    return [m + bh * n for m in order for bh in range(n_bh)]


@pytest.mark.parametrize("sort_max", [None, 4])
def test_tile_and_block_orders_match_a_stable_sort(monkeypatch, sort_max):
    """Ties in row order, in one program's sort and in torch's argsort past `SORT_MAX` blocks alike."""
    if sort_max is not None:
        monkeypatch.setattr(fa3_schedule, "SORT_MAX", sort_max)
    rng = random.Random(3)
    lengths = [rng.choice([1, 64, rng.randint(2, 300)]) for _ in range(15)]
    total = sum(lengths)
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    key_start, key_limit = fa3.doc_bounds(cu, total, -1, 0)
    for rows, block_n, n_bh in ((128, 64, 3), (192, 128, 1)):
        order = fa3.tile_order(key_start, key_limit, rows, block_n, n_bh)
        assert order.dtype == torch.int32
        assert order.tolist() == _longest_first_reference(key_start, key_limit, rows, block_n, n_bh, True)
    query_start, query_limit = fa3.doc_bounds(cu, total, 0, -1)
    blocks = fa3.block_order(query_start, query_limit, 64)
    assert blocks.tolist() == _longest_first_reference(query_start, query_limit, 64, 1, 1, False)


def test_packed_sequences_run_gluon_with_one_set_of_offsets():
    """Packed self-attention (one set of offsets) takes the Gluon kernels with the packed or causal configs; two
    different sets of offsets fall back to FA2, warned."""
    facts = _facts(varlen=True, causal=True, seqlen_k=8192)  # `fa3._band`: packed sequences are a band
    for head_dim in fa3.HEAD_DIMS:
        assert fa3.decide(facts._replace(head_dim=head_dim)) == fa3.Plan(
            "gluon", config=fa3.PACKED_FORWARD_CONFIGS.get(head_dim, fa3.FORWARD_CONFIGS[head_dim, True]))
    assert fa3.decide(facts._replace(direction="backward")).kernel == "gluon"
    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    assert fa3.same_offsets(cu, cu) and fa3.same_offsets(cu, cu.clone())
    assert not fa3.same_offsets(cu, torch.tensor([0, 4, 4, 10], dtype=torch.int32))


@pytest.mark.skipif(not SUPPORTED, reason=f"triton {fa3.triton_version()} is not a release the Gluon kernels support")
def test_packed_sequence_kernels_compile_for_sm90():
    """The DOCS forward and backward (per-row bounds), compiled for sm_90 as `test_gluon_kernels_compile_for_sm90`
    does: every head_dim each kernel takes, with GQA."""
    code = ("import torch; from kernels import fa3\n"
            "for kernel in ('fwd', 'bwd'):\n"
            "    for d in (fa3.HEAD_DIMS if kernel == 'fwd' else fa3.BACKWARD_HEAD_DIMS):\n"
            "        k = fa3.compile_for_sm90(torch.bfloat16, d, True, 2, kernel, docs=True)\n"
            "        print(k.metadata.shared, 'wgmma.mma_async' in k.asm['ptx'] and 'ld.global' in k.asm['ptx'])")
    lines = compile_in_fresh_process(code)
    assert len(lines) == len(fa3.HEAD_DIMS) + len(fa3.BACKWARD_HEAD_DIMS)
    assert all(ok == "True" and int(shared) <= fa3.SM90_SHARED_MEMORY for shared, ok in lines), lines


def _varlen_reference(q, k, v, do, cu, causal, window_size, softcap):
    """float64 per-sequence reference of packed (total, heads, head_dim) inputs: o, natural lse (heads, total),
    and dq, dk, dv for the output gradient do."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    as_batch = lambda t: t.transpose(0, 1)[None]
    outs, lses = [], []
    for b in range(len(cu) - 1):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        if rows.stop == rows.start:
            continue
        o_b, lse_b = reference(as_batch(q64[rows]), as_batch(k64[rows]), as_batch(v64[rows]), causal,
                               q.shape[-1] ** -0.5, window_size, softcap)
        outs.append(o_b[0].transpose(0, 1))
        lses.append(lse_b[0])
    o_ref = torch.cat(outs)
    o_ref.backward(do.double())
    return o_ref, torch.cat(lses, dim=1), (q64.grad, k64.grad, v64.grad)


# (head_dim, causal, window_size, softcap, n_heads, n_kv_heads, lengths)
VARLEN_CASES = [
    (64, True, (-1, -1), 0.0, 4, 4, [600, 1, 0, 77, 1500, 130, 0, 2, 300]),  # ends inside tiles, empty, one-token
    (128, True, (-1, -1), 0.0, 4, 2, [1000, 3, 900, 192, 64]),  # GQA, a document exactly one tile
    (64, False, (-1, -1), 0.0, 2, 1, [257, 700, 5, 1100]),  # not causal
    (128, False, (-1, -1), 0.0, 2, 2, [1, 1, 1, 400, 1, 1200]),
    (64, True, (100, -1), 0.0, 4, 2, [900, 40, 1300]),  # a window narrower than the documents
    (128, True, (300, -1), 20.0, 2, 2, [700, 1400, 33]),  # window and softcap
    (96, True, (-1, -1), 0.0, 4, 2, [1000, 3, 900, 192, 64]),  # the 128-wide kernels on 96 columns
]


@gluon_on_hopper
@pytest.mark.parametrize("head_dim,causal,window_size,softcap,n_heads,n_kv_heads,lengths", VARLEN_CASES)
def test_gluon_varlen_matches_float64(fresh_dispatch, head_dim, causal, window_size, softcap, n_heads, n_kv_heads,
                                      lengths):
    """Packed sequences on the Gluon kernels (no fallback warning), forward and backward, against float64 per
    sequence: o, lse, dq, dk, dv, the gradients written into NaN-filled buffers."""
    total = sum(lengths)
    q, k, v, do = (torch.randn(total, h, head_dim, device="cuda", dtype=torch.bfloat16)
                   for h in (n_heads, n_kv_heads, n_kv_heads, n_heads))
    q = q * (4.0 if softcap else 1.0)
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    longest, scale = max(lengths), head_dim ** -0.5
    o_ref, lse_ref, grads_ref = _varlen_reference(q, k, v, do, cu, causal, window_size, softcap)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o, lse = fa3.forward(q, k, v, causal, scale, window_size, cu, cu, longest, longest, softcap)
        out = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
        grads = fa3.backward(do, q, k, v, o, lse, causal, scale, window_size, cu, cu, longest, longest, out=out,
                             softcap=softcap)
    assert lse.shape == (n_heads, total) and o.shape == q.shape
    assert (lse.double() / fa2.LOG2E - lse_ref).abs().max() < 1e-2
    for got, ref in ((o, o_ref), *zip(grads, grads_ref)):
        assert torch.isfinite(got).all()
        err = ((got.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, err


@gluon_on_hopper
def test_fa3_varlen_attention_runs_on_gluon_and_matches_fa2(fresh_dispatch):
    """The public fa3_varlen_attention with one offsets tensor: no fallback warning, FA2's result."""
    lengths = [700, 1, 2000, 0, 349]
    q, k, v = (torch.randn(sum(lengths), 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o = fa3_varlen_attention(q, k, v, cu, cu, 2000, 2000, causal=True)
        o.backward(torch.ones_like(o))
    grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    o2 = fa2_varlen_attention(q, k, v, cu, cu, 2000, 2000, causal=True)
    o2.backward(torch.ones_like(o2))
    assert (o - o2).abs().max() < 2e-2
    for got, ref in zip(grads, (q.grad, k.grad, v.grad)):
        assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


@gluon_on_hopper
@pytest.mark.parametrize("head_dim,n_heads,n_kv_heads,window_size", [(64, 4, 4, (-1, -1)), (128, 4, 2, (300, -1))])
def test_gluon_varlen_qkvpacked_matches_float64(fresh_dispatch, head_dim, n_heads, n_kv_heads, window_size):
    """fa3_varlen_qkvpacked_attention (the model's documents) on the Gluon kernels, no fallback warning: o, lse
    and the gradient written into one tensor shaped like qkv, against float64 per sequence."""
    lengths = [600, 1, 0, 77, 1500, 130, 2]
    total, heads = sum(lengths), n_heads + 2 * n_kv_heads
    qkv = torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(total, n_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o, lse = fa3_varlen_qkvpacked_attention(qkv, cu, max(lengths), n_heads, causal=True,
                                                window_size=window_size, return_lse=True)
        (grad,) = torch.autograd.grad(o, qkv, do)
    q, k, v = qkv.detach().split([n_heads, n_kv_heads, n_kv_heads], dim=1)
    o_ref, lse_ref, grads_ref = _varlen_reference(q, k, v, do, cu, True, window_size, 0.0)
    assert o.shape == (total, n_heads, head_dim) and grad.shape == qkv.shape
    assert (lse.double() - lse_ref).abs().max() < 1e-2
    for got, ref in ((o, o_ref), *zip(grad.split([n_heads, n_kv_heads, n_kv_heads], dim=1), grads_ref)):
        assert torch.isfinite(got).all()
        err = ((got.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, err


def test_packed_bounds_are_made_once_per_offsets_and_remade_after_a_write():
    """The bounds of one offsets tensor are reused across calls (a model's layers), and made again once the
    offsets are written in place."""
    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    first = fa3._packed_bounds(True, (-1, -1), cu, 10, 7)
    assert fa3._packed_bounds(True, (-1, -1), cu, 10, 7) is first
    cu[1] = 2
    again = fa3._packed_bounds(True, (-1, -1), cu, 10, 7)
    assert again[0].tolist() == _doc_bounds_loop([2, 1, 7], -1, 0)[0]
    keys = fa3._packed_bounds(True, (2, -1), cu, 10, 7, keys=True)  # each key's rows: the window seen from keys
    assert [t.tolist() for t in keys] == list(_doc_bounds_loop([2, 1, 7], 0, 2))


def test_graph_pool_active_reads_the_cuda_graph_warm_up(monkeypatch):
    """Outside CUDA graphs the per-batch bounds are kept; during the warm-up of torch.compile's CUDA graphs (whose
    pool refuses kept tensors) they are not; a torch whose tree manager lacks what is read counts as in the pool.
    The attributes read exist in the installed torch."""
    import torch._inductor.cudagraph_trees as trees
    from torch._inductor.cudagraph_trees import CUDAGraphTreeManager

    assert isinstance(CUDAGraphTreeManager.in_warmup, property)
    assert "create_if_none_exists" in inspect.signature(trees.get_manager).parameters
    device = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    for manager, active in ((None, False), (types.SimpleNamespace(in_warmup=False), False),
                            (types.SimpleNamespace(in_warmup=True), True), (types.SimpleNamespace(), True)):
        monkeypatch.setattr(trees, "get_manager", lambda index, create_if_none_exists=True: manager)
        assert fa3.graph_pool_active(device) is active, manager
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert fa3.graph_pool_active(device) is True


@pytest.mark.parametrize("given_out", [False, True])
def test_packed_calls_hand_the_kernels_views_of_their_own_buffers(monkeypatch, given_out):
    """Packed sequences on the Gluon path (here with the kernels replaced by recorders, on any machine): the forward
    and backward give the kernels (1, heads, total, head_dim) views of the (total, heads, head_dim) inputs, the
    backward's gradient buffers among them (`out` when given), and return what the kernels wrote there as
    (total, heads, head_dim)."""
    monkeypatch.setattr(fa3, "gluon_device_reason", lambda device: None)
    monkeypatch.setattr(fa3, "use_tma", lambda *tensors: True)
    monkeypatch.setattr(fa3, "BACKWARD_MIN_SEQLEN_K", dict.fromkeys(fa3.BACKWARD_MIN_SEQLEN_K, 1))
    total, n_heads, head_dim = 10, 2, 64
    q, k, v, do, o = (torch.randn(total, n_heads, head_dim, dtype=torch.float16) for _ in range(5))
    lse = torch.randn(n_heads, total)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    # what a kernel writes at (head h, position t): 100 h + t, plus 500 per gradient (all exact in float16)
    marks = torch.arange(n_heads)[:, None] * 100.0 + torch.arange(total)[None, :]

    def run_forward(q4, k4, v4, *args, key_bounds, **kwargs):
        for t, name in ((q4, "q"), (k4, "k"), (v4, "v")):
            assert t.shape == (1, n_heads, total, head_dim), name
        assert q4.data_ptr() == q.data_ptr() and key_bounds is not None
        return marks[None, :, :, None].expand(1, n_heads, total, head_dim).half(), marks[None].clone()

    def run_backward(do4, q4, k4, v4, o4, lse4, causal, scale, config, out4, *args):
        assert [t.data_ptr() for t in (do4, q4, k4, v4, o4)] == [t.data_ptr() for t in (do, q, k, v, o)]
        assert lse4.shape == (1, n_heads, total)
        out4 = grad_buffers(q4, k4, v4, out4)
        for i, g in enumerate(out4):
            assert g.shape == (1, n_heads, total, head_dim)
            g.copy_((marks + 500 * i)[None, :, :, None].expand_as(g))
        return out4

    monkeypatch.setattr(fa3, "run_forward", run_forward)
    monkeypatch.setattr(fa3, "run_backward", run_backward)
    out_o, out_lse = fa3.forward(q, k, v, True, 0.125, (-1, -1), cu, cu, 7, 7)
    assert torch.equal(out_o[:, :, 0].float(), marks.T) and torch.equal(out_lse, marks)
    out = tuple(torch.full_like(q, float("nan")) for _ in range(3)) if given_out else None
    grads = fa3.backward(do, q, k, v, o, lse, True, 0.125, (-1, -1), cu, cu, 7, 7, out=out)
    for i, g in enumerate(grads):
        assert g.shape == (total, n_heads, head_dim)
        assert torch.equal(g.float(), (marks.T + 500 * i)[:, :, None].expand(total, n_heads, head_dim))
        if given_out:
            assert g.data_ptr() == out[i].data_ptr() and g.stride() == out[i].stride()


@pytest.fixture
def recorded_gluon(monkeypatch):
    """The Gluon path on any machine, its launches recorded: a list of (key, [{per-call argument: value}, ...])
    per prepared launch (`fa3._prepared`), the launch's fixed arguments left out."""
    monkeypatch.setattr(fa3, "gluon_device_reason", lambda device: None)
    monkeypatch.setattr(fa3, "use_tma", lambda *tensors: True)
    monkeypatch.setattr(fa3, "BACKWARD_MIN_SEQLEN_K", dict.fromkeys(fa3.BACKWARD_MIN_SEQLEN_K, 1))
    monkeypatch.setattr(fa3, "_sm_count", lambda device: 132)
    monkeypatch.setattr(fa3, "bwd_preprocess", lambda o, do, dq_acc=None: torch.zeros(o.shape[:3]))
    monkeypatch.setattr(fa3, "_convert_dq_launch", lambda *args: lambda dq_acc, dq: None)
    prepared = []

    def recorder(kernel, key, grid, per_call, maxnreg=0, **fixed):
        calls = []
        prepared.append((key, calls))
        return lambda *values: calls.append(dict(zip(per_call, values)))

    monkeypatch.setattr(fa3, "_prepared", recorder)
    return prepared


def test_calls_of_one_signature_share_their_launch_and_pass_their_own_tensors(recorded_gluon):
    """Forward calls with the same shapes, strides, dtype, mask and scale reuse one prepared launch; each passes
    descriptors of its own q, k, v and o with their shapes and strides, and its own LSE. Another softmax_scale or
    other strides (a (B, T, H, D) view) prepare another launch."""
    shape = (2, 3, 40, 64)
    calls = [[torch.randn(shape, dtype=torch.bfloat16) for _ in range(3)] for _ in range(2)]
    view = [torch.randn(2, 40, 3, 64, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3)]
    outputs = [fa3.forward(q, k, v, True, 0.125) for q, k, v in calls]
    assert len(recorded_gluon) == 1
    launches = recorded_gluon[0][1]
    assert len(launches) == 2
    for (q, k, v), (o, lse), args in zip(calls, outputs, launches):
        for name, t in (("q_desc", q), ("k_desc", k), ("v_desc", v), ("o_desc", o)):
            desc = args[name]
            assert desc.base is t and list(desc.shape) == list(t.shape) and list(desc.strides) == list(t.stride())
        assert args["LSE"] is lse and lse.shape == shape[:3]
    fa3.forward(*calls[0], True, 0.25)
    fa3.forward(*view, True, 0.125)
    assert len(recorded_gluon) == 3
    desc = recorded_gluon[2][1][0]["q_desc"]
    assert desc.base is view[0] and list(desc.strides) == list(view[0].stride())


def test_backward_calls_of_one_signature_share_their_launch_and_plan(recorded_gluon):
    """Backward calls with the same signature reuse one prepared launch, each with descriptors of its own inputs
    and gradient buffers; turning deterministic algorithms on changes the plan (FA2's atomic-free backward)
    although the tensors are the same."""
    shape = (1, 2, fa3.SHORT_BACKWARD_SEQLEN_K + 8, 64)  # the default config: dQ reduce-added, not reproducible
    q, k, v, o, do = (torch.randn(shape, dtype=torch.bfloat16) for _ in range(5))
    lse = torch.randn(shape[:3])
    grads = [fa3.backward(do, q, k, v, o, lse, True, 0.125) for _ in range(2)]
    assert len(recorded_gluon) == 1 and len(recorded_gluon[0][1]) == 2
    for (dq, dk, dv), args in zip(grads, recorded_gluon[0][1]):
        assert args["q_desc"].base is q and args["do_desc"].base is do and args["LSE"] is lse
        assert args["dk_desc"].base is dk and args["dv_desc"].base is dv
    assert grads[0][1].data_ptr() != grads[1][1].data_ptr()  # new buffers each call
    assert fa3._planned("backward", q, k, v, True, (-1, -1), None, None, 0, 0, (do,))[2].kernel == "gluon"
    torch.use_deterministic_algorithms(True)
    try:
        choice = fa3._planned("backward", q, k, v, True, (-1, -1), None, None, 0, 0, (do,))[2]
    finally:
        torch.use_deterministic_algorithms(False)
    assert (choice.kernel, choice.reason) == ("fa2", "deterministic algorithms: FA2's atomic-free backward")


def test_packed_calls_with_two_offset_tensors_are_planned_every_call(recorded_gluon, monkeypatch):
    """Packed sequences whose cu_seqlens_q and cu_seqlens_k are different tensors: whether their values match is
    read on every call (a call with other values falls back to FA2), never remembered."""
    monkeypatch.setattr(fa3.fa2, "forward", lambda *args, **kwargs: "fa2")
    q, k, v = (torch.randn(10, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    cu_q = torch.tensor([0, 3, 10], dtype=torch.int32)
    assert fa3.forward(q, k, v, True, 0.125, (-1, -1), cu_q, cu_q.clone(), 7, 7) != "fa2"
    with pytest.warns(RuntimeWarning, match="cu_seqlens_k differs"):
        assert fa3.forward(q, k, v, True, 0.125, (-1, -1), cu_q, torch.tensor([0, 5, 10], dtype=torch.int32), 7,
                           7) == "fa2"
    assert not fa3._PLANS


def test_what_is_made_from_offsets_goes_with_them():
    """What is made from an offsets tensor does not outlive it, and a new tensor (perhaps at the freed one's address)
    gets its own."""
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    made = weakref.ref(fa3._packed_bounds(True, (-1, -1), cu, 10, 7)[0])
    gc.collect()
    assert made() is not None
    del cu
    gc.collect()
    assert made() is None
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    assert fa3._packed_bounds(True, (-1, -1), cu, 10, 7)[0].tolist() == _doc_bounds_loop([5, 5], -1, 0)[0]


def test_what_is_made_from_offsets_survives_a_stale_callback():
    """The entry of a tensor whose id an earlier, freed tensor had is not dropped by that tensor's late callback."""
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    made = fa3._packed_bounds(True, (-1, -1), cu, 10, 7)
    stale = weakref.ref(torch.empty(0))  # already dead: stands for the freed tensor's reference
    fa3._forget(stale, id(cu))
    assert fa3._packed_bounds(True, (-1, -1), cu, 10, 7) is made


@gluon_on_hopper
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("window_left,head_dim", [(255, 64), (127, 64), (255, 128)])
def test_window_and_packed_backwards_are_bit_reproducible_when_deterministic(fresh_dispatch, monkeypatch, packed,
                                                                             window_left, head_dim):
    """Under torch.use_deterministic_algorithms(True) the windowed and the packed-sequence backwards run atomic-free
    kernels (the Gluon dK/dV kernel with FA2's dQ for windows on unpacked sequences up to NARROW_WINDOW, and wider
    ones at head_dim 128; FA2's elsewhere): two runs give the same bits."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    lengths = [900, 1, 0, 1200, 300]
    total = sum(lengths)
    q, k, v, do = (torch.randn(total, 4, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    mask = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1200, max_seqlen_k=1200) if packed else {}
    if not packed:
        q, k, v, do = (fa3.packed_view(t) for t in (q, k, v, do))
    window = (window_left, -1)
    torch.use_deterministic_algorithms(True)
    try:
        banded, band = fa3._band(q, k, True, window, mask.get("cu_seqlens_q"), mask.get("cu_seqlens_k"),
                                 mask.get("max_seqlen_q", 0), mask.get("max_seqlen_k", 0))
        gluon = window_left <= fa3.NARROW_WINDOW or head_dim in fa3.DETERMINISTIC_WINDOW_BACKWARD_CONFIGS
        expected = "gluon" if gluon and not packed else "fa2"
        assert fa3.plan("backward", q, k, v, banded, do, **band).kernel == expected
        o, lse = fa3.forward(q, k, v, True, 0.125, window, **mask)
        runs = [fa3.backward(do, q, k, v, o, lse, True, 0.125, window, **mask) for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(False)
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def test_tile_and_block_orders_put_the_longest_first():
    """Over random packed sequences: the forward's tile order is every tile of every head once, longest (most
    K/V blocks) first with the heads of a row block together; the backward's block order is every key block once,
    the blocks seen by the most query rows first."""
    rng = random.Random(0)
    lengths = [rng.choice([1, rng.randint(2, 700)]) for _ in range(12)]
    total, rows, block_n, n_bh = sum(lengths), 128, 64, 3
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    key_start, key_limit = fa3.doc_bounds(cu, total, -1, 0)
    order = fa3.tile_order(key_start, key_limit, rows, block_n, n_bh).tolist()
    n_tiles_m = -(-total // rows)
    assert sorted(order) == list(range(n_tiles_m * n_bh))
    cost = lambda m: (-(-int(key_limit[min((m + 1) * rows, total) - 1]) // block_n)
                      - int(key_start[m * rows]) // block_n)
    costs = [cost(t % n_tiles_m) for t in order]
    assert costs == sorted(costs, reverse=True)
    assert all(len({t % n_tiles_m for t in order[i:i + n_bh]}) == 1 for i in range(0, len(order), n_bh))
    query_start, query_limit = fa3.doc_bounds(cu, total, 0, -1)
    blocks = fa3.block_order(query_start, query_limit, 128).tolist()
    assert sorted(blocks) == list(range(-(-total // 128)))
    seen = [int(query_limit[min((b + 1) * 128, total) - 1]) - int(query_start[b * 128]) for b in blocks]
    assert seen == sorted(seen, reverse=True)
