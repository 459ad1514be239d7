"""tools.fa3_cubins: the launch's specialization, one sm_90 build on the installed Triton, and the argument checks
(timing needs an sm_90 GPU)."""

import json
import os
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
    from tools.fa3_cubins import divisible_arguments

    config = fa3.FORWARD_CONFIGS[head_dim, causal]
    names = divisible_arguments(head_dim, causal, seqlen, config)
    n_tiles_m = -(-seqlen // (config.num_consumers * fa3.BLOCK_M))
    heads = 2048 // head_dim
    values = dict(n_heads=heads, seqlen_q=seqlen, seqlen_k=seqlen, window_left=0, window_right=0,
                  n_tiles_m=n_tiles_m, n_tiles=n_tiles_m * heads * (16384 // seqlen))
    for name, value in values.items():
        assert (name in names) == (value % 16 == 0), (name, value)
    assert {"LSE", "KEY_START", "KEY_LIMIT", "TILE_ORDER"} <= set(names)
    assert not {"qk_scale", "softcap_in", "GROUP"} & set(names)


@needs_gluon
def test_build_writes_a_cubin_and_what_built_it(tmp_path):
    """One build on the installed Triton (a fresh process without the interpreter: `compile_in_fresh_process`):
    an sm_90 ELF and its JSON (config, shared memory, the arguments compiled as multiples of 16, versions)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tools.fa3_cubins", "build", str(tmp_path), "--tag", "t",
                           "--seqlens", "2048"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    cubin = tmp_path / "d64c_t_n2048.cubin"
    assert cubin.read_bytes()[:4] == b"\x7fELF"
    meta = json.loads(cubin.with_suffix(".json").read_text())
    assert meta["config"] == fa3.FORWARD_CONFIGS[64, True]._asdict()
    assert meta["head_dim"] == 64 and meta["causal"] is True and meta["seqlen"] == 2048
    assert 0 < meta["shared"] <= 227 * 1024 and "n_tiles_m" in meta["divisible"]
    assert meta["triton"] == fa3.triton_version() and "cuda_" in meta["ptxas"]


@needs_gluon
def test_compile_for_sm90_names_a_wrong_divisible_argument():
    with pytest.raises(ValueError, match=r"divisible=\['qk_scale'\]: not integer or pointer arguments"):
        fa3.compile_for_sm90(torch.bfloat16, 64, True, divisible=["qk_scale"])


@pytest.mark.parametrize("argv,message", [
    (["build", "out", "--tag", "t", "--head-dims", "96"], "--head-dims 96: accepted 64, 128"),
    (["build", "out", "--tag", "t", "--seqlens", ","], "--seqlens: none"),
    (["time", "out", "--rounds", "0"], "--rounds 0: accepted 1 or more"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    from tools.fa3_cubins import main

    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_time_says_why_it_cannot_run_here(tmp_path):
    from tools.fa3_cubins import main

    with pytest.raises(SystemExit, match="cannot run here: no CUDA GPU"):
        main(["time", str(tmp_path)])
