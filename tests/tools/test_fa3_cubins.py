"""tools.fa3_cubins: the launch's specialization, one sm_90 build on the installed Triton, and the argument checks
(timing needs an sm_90 GPU)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import fa3

ROOT = Path(__file__).resolve().parents[2]
SUPPORTED = not isinstance(fa3.gluon_kernels(), str)
needs_gluon = pytest.mark.skipif(not SUPPORTED, reason=f"triton {fa3.triton_version()} is not a release the Gluon "
                                                       "kernels support")


@needs_gluon
@pytest.mark.parametrize("head_dim,causal,seqlen", [(64, True, 2048), (64, False, 2048), (128, False, 4096)])
def test_divisible_arguments_follow_the_launch_values(head_dim, causal, seqlen):
    """Integer arguments are marked exactly when the value run_forward passes is a multiple of 16: the query blocks
    per head are cdiv(N, NUM_CONSUMERS * 64) (11 at N = 2048 with three consumers: not marked); the pointers (16-byte
    aligned allocations) always."""
    from tools.fa3_cubins import specialized_arguments

    config = fa3.FORWARD_CONFIGS[head_dim, causal]
    names, ones = specialized_arguments("fwd", head_dim, causal, seqlen, config)
    n_tiles_m = -(-seqlen // (config.num_consumers * fa3.BLOCK_M))
    heads = 2048 // head_dim
    values = dict(n_heads=heads, seqlen_q=seqlen, seqlen_k=seqlen, window_left=0, window_right=0,
                  n_tiles_m=n_tiles_m, n_tiles=n_tiles_m * heads * (16384 // seqlen))
    for name, value in values.items():
        assert (name in names) == (value % 16 == 0), (name, value)
    assert {"LSE", "KEY_START", "KEY_LIMIT", "TILE_ORDER"} <= set(names)
    assert not {"qk_scale", "softcap_in", "GROUP"} & set(names) and ones == []


@needs_gluon
@pytest.mark.parametrize("head_dim,seqlen,short", [(64, 2048, False), (128, 1024, False), (128, 16384, False),
                                                   (64, 1024, True)])
def test_backward_specialized_arguments_follow_the_launch_values(head_dim, seqlen, short):
    """The backward's launch: SECTION_HEADS is a wave's worth of (batch, kv head) pairs on 132 SMs, 132 // key
    blocks (8 at 2k keys: not marked; 16 at 1k: marked; 1 at 16k, which Triton compiles as the constant 1; with
    the short config's 64-key blocks 8 at 1k), the lengths and heads as passed."""
    from tools.fa3_cubins import specialized_arguments

    config = fa3.SHORT_BACKWARD_CONFIGS[64] if short else fa3.BACKWARD_CONFIGS[head_dim]
    names, ones = specialized_arguments("bwd", head_dim, True, seqlen, config)
    section_heads = 132 // (seqlen // config.block_n)
    values = dict(n_heads=2048 // head_dim, seqlen_q=seqlen, seqlen_k=seqlen, SECTION_HEADS=section_heads)
    for name, value in values.items():
        assert (name in names) == (value % 16 == 0), (name, value)
        assert (name in ones) == (value == 1), (name, value)
    assert {"LSE", "DELTA", "BLOCK_ORDER"} <= set(names) and "softmax_scale" not in names


def test_outputs_count_as_the_native_kernels_when_equal():
    """o, dK and dV bit for bit; dQ (float32 reduce-adds in any order) within DQ_TOLERANCE relative."""
    from tools.fa3_cubins import DQ_TOLERANCE, _same

    ref = [torch.randn(64, dtype=torch.float32) for _ in range(3)]
    assert _same("fwd", [ref[0].clone()], [ref[0]]) is None
    assert "o differs" in _same("fwd", [ref[0] + 1e-7], [ref[0]])
    assert _same("bwd", [ref[0] * (1 + DQ_TOLERANCE / 2), ref[1].clone(), ref[2].clone()], ref) is None
    assert "dq differs" in _same("bwd", [ref[0] * (1 + 2 * DQ_TOLERANCE), ref[1], ref[2]], ref)
    assert "dv differs" in _same("bwd", [ref[0], ref[1], ref[2].nextafter(ref[2] + 1)], ref)


@needs_gluon
@pytest.mark.parametrize("kernel,causal,head_dim,seqlen", [("fwd", True, 64, 2048), ("fwd", False, 64, 2048),
                                                           ("bwd", True, 128, 16384)])
def test_build_writes_a_cubin_and_what_built_it(tmp_path, kernel, causal, head_dim, seqlen):
    """One build on the installed Triton, in a fresh process on this GPU-less machine (where importing
    `model.backends` turns Triton's interpreter on; the tool turns it off again): an sm_90 ELF and its JSON
    (kernel, config, shared memory, the launch's specialization, versions). At 16k keys the backward's
    SECTION_HEADS is 1, which a launch compiles as a constant."""
    done = subprocess.run([sys.executable, "-m", "tools.fa3_cubins", "build", str(tmp_path), "--tag", "t",
                           "--kernel", kernel, "--causal", str(int(causal)), "--head-dims", str(head_dim),
                           "--seqlens", str(seqlen)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    cubin = tmp_path / f"{kernel}_d{head_dim}{'c' if causal else 'n'}_t_n{seqlen}.cubin"
    assert cubin.read_bytes()[:4] == b"\x7fELF"
    meta = json.loads(cubin.with_suffix(".json").read_text())
    config = fa3.FORWARD_CONFIGS[head_dim, causal] if kernel == "fwd" else fa3.BACKWARD_CONFIGS[head_dim]
    assert meta["config"] == config._asdict() and meta["kernel"] == kernel
    assert meta["ones"] == (["SECTION_HEADS"] if seqlen == 16384 else [])
    assert meta["head_dim"] == head_dim and meta["causal"] is causal and meta["seqlen"] == seqlen
    assert 0 < meta["shared"] <= fa3.SM90_SHARED_MEMORY and "seqlen_q" in meta["divisible"]
    assert meta["triton"] == fa3.triton_version() and "cuda_" in meta["ptxas"]


@needs_gluon
def test_compile_for_sm90_names_a_wrong_divisible_argument():
    with pytest.raises(ValueError, match=r"divisible=\['qk_scale'\]: not integer or pointer arguments"):
        fa3.compile_for_sm90(torch.bfloat16, 64, True, divisible=["qk_scale"])
    with pytest.raises(ValueError, match=r"ones=\['LSE'\]: not integer arguments of the bwd kernel"):
        fa3.compile_for_sm90(torch.bfloat16, 64, True, kernel="bwd", ones=["LSE"])


@pytest.mark.parametrize("argv,message", [
    (["build", "out", "--tag", "t", "--head-dims", "80"], "--head-dims 80: accepted 64, 96, 128, 256"),
    (["build", "out", "--tag", "t", "--kernel", "bwd", "--head-dims", "256"], "--head-dims 256: accepted 64, 96, 128"),
    (["build", "out", "--tag", "t", "--head-dims", "64,abc"], "--head-dims 64,abc: give comma-separated integers"),
    (["build", "out", "--tag", "t", "--seqlens", ","], "--seqlens: none"),
    (["build", "out", "--tag", "t", "--seqlens", "0"], "--seqlens 0: give lengths of 1 or more"),
    (["build", "out", "--tag", "t", "--causal", "2"], "--causal 2: accepted 1, 0"),
    (["build", "out", "--tag", "t", "--causal", "yes"], "--causal yes: give comma-separated integers"),
    (["build", "out", "--tag", "a/b"], "--tag 'a/b': give a name without path separators"),
    (["time", "out", "--rounds", "0"], "--rounds 0: accepted 1 or more"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    from tools.fa3_cubins import main

    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_build_refuses_an_output_path_that_is_a_file(tmp_path, capsys):
    from tools.fa3_cubins import main

    (tmp_path / "f").write_text("")
    with pytest.raises(SystemExit):
        main(["build", str(tmp_path / "f"), "--tag", "t"])
    assert "exists and is not a folder" in capsys.readouterr().err


@needs_gluon
@pytest.mark.parametrize("kernel,variant,message", [
    ("fwd", "2:100:4:1:1", "NUM_CONSUMERS 2 or 3, BLOCK_N 32, 64 or 128"),
    ("bwd", "2:rows:64", "accepted 64 or 128, and 128 for 'rows'"),
])
def test_build_names_a_variant_the_kernel_cannot_take(tmp_path, kernel, variant, message):
    """Refused before anything is compiled or written."""
    from tools.fa3_cubins import main

    with pytest.raises(SystemExit, match=message):
        main(["build", str(tmp_path / "out"), "--tag", "t", "--kernel", kernel, "--variant", variant])
    assert not (tmp_path / "out").exists()


@needs_gluon
def test_build_refuses_a_cubin_an_sm90_block_cannot_launch(tmp_path):
    """Head_dim 128 with a 4-deep ring of 128-key blocks needs more shared memory than an sm_90 block may have: no
    cubin is written (in a fresh process, as the build test above)."""
    done = subprocess.run([sys.executable, "-m", "tools.fa3_cubins", "build", str(tmp_path), "--tag", "t",
                           "--head-dims", "128", "--seqlens", "2048", "--variant", "2:128:4:1:1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode != 0 and "B of shared memory; an sm_90 block may have 232448" in done.stderr, \
        done.stderr[-3000:]
    assert not list(tmp_path.iterdir())


def test_time_checks_the_folder_before_the_gpu(tmp_path):
    from tools.fa3_cubins import main

    with pytest.raises(SystemExit, match="not a folder"):
        main(["time", str(tmp_path / "missing")])
    with pytest.raises(SystemExit, match="no .cubin files"):
        main(["time", str(tmp_path)])
    (tmp_path / "fwd_d64c_t_n2048.cubin").write_bytes(b"\x7fELF")
    with pytest.raises(SystemExit, match="no readable fwd_d64c_t_n2048.json beside it"):
        main(["time", str(tmp_path)])
    (tmp_path / "fwd_d64c_t_n2048.json").write_text("{not json")
    with pytest.raises(SystemExit, match="no readable fwd_d64c_t_n2048.json beside it"):
        main(["time", str(tmp_path)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_time_says_why_it_cannot_run_here(tmp_path):
    from tools.fa3_cubins import main

    (tmp_path / "fwd_d64c_t_n2048.cubin").write_bytes(b"\x7fELF")
    (tmp_path / "fwd_d64c_t_n2048.json").write_text(json.dumps(dict(kernel="fwd", head_dim=64, causal=True,
                                                                    seqlen=2048)))
    with pytest.raises(SystemExit, match="cannot run here: no CUDA GPU"):
        main(["time", str(tmp_path)])
