"""Count the sm_90 SASS of a Gluon FA3 kernel, compiled on the installed Triton without a GPU.

    python -m tools.sass_stats --kernel fwd --head-dim 64 --causal
    TRITON_PTXAS_BLACKWELL_PATH=/path/to/ptxas python -m tools.sass_stats --top 20     # another assembler

Compiles the kernel (`kernels.fa3.compile_for_sm90`, the measured config unless --config), disassembles its cubin
with the `nvdisasm` Triton ships and prints one summary line (Triton version, the `ptxas` that assembled it,
instruction count, and registers / stack / spills from `cuobjdump -res-usage`) and the most frequent opcodes.
Run it from each Triton's environment to compare releases' code (docs/hopper-notes.md, "FA3 forward tiles under
Triton 3.9"). Exits with the reason when the installed Triton cannot build the kernels.
"""

import argparse
import collections
import os
import re
import subprocess
import tempfile

import torch

from bench import HelpFormatter
from kernels import fa3
from tools.fa3_variants import backward_config, forward_config

# One SASS instruction line of `nvdisasm -c`: /*offset*/ [@predicate] OPCODE[.modifiers] operands ;
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def _tool(name: str) -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def opcodes(sass: str) -> collections.Counter:
    """Opcode (without modifiers) -> count over the instruction lines of `nvdisasm -c` output."""
    return collections.Counter(m.group(1) for m in map(_INSTRUCTION.match, sass.splitlines()) if m)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--kernel", choices=["fwd", "bwd"], default="fwd", help="the Gluon forward or backward")
    parser.add_argument("--head-dim", type=int, choices=fa3.HEAD_DIMS, default=64, help="head_dim D")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal mask")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16", help="q, k, v dtype")
    parser.add_argument("--config", default=None,
                        help="a tools.fa3_variants variant (forward NUM_CONSUMERS:BLOCK_N:NUM_STAGES:PINGPONG:"
                             "PERSISTENT[:LATE_K_RELEASE], backward NUM_STAGES[:SPLIT_DQ:...:SEPARATE_DQ]); "
                             "default the measured one")
    parser.add_argument("--top", type=int, default=12, help="how many opcodes to list, most frequent first")
    args = parser.parse_args(argv)
    config = None
    if args.config:
        # the backward at a head_dim it does not take (256) from 128's fields: its registers and shared memory
        config = (forward_config(args.config) if args.kernel == "fwd"
                  else backward_config(args.config, fa3.BACKWARD_CONFIGS.get(args.head_dim, fa3.BACKWARD_CONFIGS[128])))
    elif args.kernel == "bwd" and args.head_dim not in fa3.BACKWARD_CONFIGS:
        raise SystemExit(f"--head-dim {args.head_dim}: the Gluon backward takes "
                         f"{', '.join(map(str, fa3.BACKWARD_HEAD_DIMS))}; give a --config to compile it anyway")
    reason = fa3.gluon_kernels()
    if isinstance(reason, str):
        raise SystemExit(reason)
    compiled = fa3.compile_for_sm90(getattr(torch, args.dtype), args.head_dim, args.causal, 1, args.kernel, config)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
    import triton
    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(90).path
    version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    resources = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", usage))
    counts = opcodes(sass)
    print(f"triton {triton.__version__} | ptxas {version} | {args.kernel} D={args.head_dim} causal={args.causal} "
          f"{args.dtype} | {sum(counts.values())} instructions | registers {resources.get('REG')} | stack "
          f"{resources.get('STACK')} B | local {resources.get('LOCAL')} B")
    print(" ".join(f"{op}={n}" for op, n in counts.most_common(args.top)))


if __name__ == "__main__":
    main()
