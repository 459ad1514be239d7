"""tools.sass_stats: the SASS opcode count, its argument checks, and one sm_90 compile on the installed Triton."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import fa3
from tools.sass_stats import main, opcodes

ROOT = Path(__file__).resolve().parents[2]
SASS = """
        .headerflags    @"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
.L_x_60:
        /*4340*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR26+0x28110], R25 ;   /* 0x0000 */
        /*4390*/              @!P0 BRA `(.L_x_11) ;
        /*43b0*/                   UIADD3 UR26, UP1, UR22, 0x2, URZ ;
        /*43e0*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR20], RZ, !UPT ;
        /*4460*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR24], R24 ;
        /*46b0*/              @!UP1 SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR14+0x281b0], RZ ;
        /*46c0*/               @P1 UIADD3 UR18, UR26, 0x10000, URZ ;
"""


def test_opcodes_count_instruction_lines_without_modifiers():
    assert opcodes(SASS) == {"SYNCS": 2, "BRA": 1, "UIADD3": 2, "HGMMA": 2}
    assert opcodes("") == {}


@pytest.mark.parametrize("argv,message", [
    (["--config", "2:128"], "variant 2:128: give 5 to 7 fields"),
    (["--kernel", "bwd", "--config", "2:none"], "SPLIT_DQ 'none'; accepted cols, rows"),
])
def test_bad_configs_are_named_before_compiling(argv, message):
    with pytest.raises(SystemExit, match=message):
        main(argv)


@pytest.mark.skipif(isinstance(fa3.gluon_kernels(), str), reason="the installed Triton cannot build the kernels")
def test_counts_the_compiled_forward():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}  # a real sm_90 compile
    done = subprocess.run([sys.executable, "-m", "tools.sass_stats", "--kernel", "fwd", "--head-dim", "64",
                           "--top", "40"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    summary, ops = [line for line in done.stdout.splitlines() if line][:2]
    assert f"triton {fa3.triton_version()} | ptxas " in summary and "fwd D=64 causal=True bfloat16" in summary
    count = int(summary.split(" instructions")[0].rsplit("| ", 1)[1])
    assert count > 1000 and "registers " in summary
    counts = dict(item.split("=") for item in ops.split())
    assert int(counts["HGMMA"]) > 0 and sum(map(int, counts.values())) <= count
