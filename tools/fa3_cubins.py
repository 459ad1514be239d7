"""Build the Gluon FA3 forward's cubins with any Triton release on a CPU machine, then time them on an H100/H200
in one process against the cubin the installed release compiles itself.

    # once per Triton release, in that release's environment (no GPU needed):
    python -m tools.fa3_cubins build cubins --tag 3.9 --head-dims 64 --causal 1 --seqlens 2048,8192
    python -m tools.fa3_cubins build cubins --tag 3.9-late --head-dims 64 --causal 1 --variant 2:128:4:1:1:1
    # on the GPU machine, with the installed release (its runtime launches every cubin):
    python -m tools.fa3_cubins time cubins --rounds 4

Why: two releases' kernels timed in two processes differ by the machine's drift as much as by their code, and a
release the GPU machine does not have cannot run there at all. A cubin built elsewhere can: `time` launches it
through the installed release's compiled kernel for the same shape (same arguments, grid and launcher; only the
machine code and its shared-memory size change), interleaved with the native one over --rounds rounds.

build: for each head_dim, causal and seqlen of the benchmark grid (B * N = 16k tokens, H * D = 2048, bf16, as
`bench.attention`), compiles the forward with the config given (--variant, a `tools.fa3_variants` forward variant;
default the installed release's FORWARD_CONFIGS entry), specialized as a launch of that shape specializes it
(Triton marks integer and pointer arguments that are multiples of 16: `divisible_arguments`). Writes
<out>/d<D><c|n>_<tag>_n<N>.cubin and a .json beside it (Triton and ptxas versions, config, shared memory).
time: the cubins of <dir>, shape by shape: their o must equal the native kernel's bit for bit (same arithmetic in
another order would differ; that is reported, not timed), then `triton.testing.do_bench` medians per round and the
median over rounds; prints each variant's time and native / variant (above 1: faster than the native cubin), and
cuDNN's.
"""

import argparse
import copy
import json
import subprocess
from pathlib import Path
from unittest import mock

import torch

from bench import HelpFormatter
from kernels import fa3
from tools.fa3_variants import forward_config

TOKENS, WIDTH = 16384, 2048  # bench.attention's grid: B * N and H * D


def divisible_arguments(head_dim: int, causal: bool, seqlen: int, config: fa3.ForwardConfig) -> list[str]:
    """The forward's integer and pointer arguments that a launch on the grid shape (head_dim, seqlen) passes as
    multiples of 16, which Triton then compiles as such: run_forward's arguments, built on the CPU (no launch),
    through the installed Triton's own specialization."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    captured = {}
    q, k, v = (torch.zeros(TOKENS // seqlen, WIDTH // head_dim, seqlen, head_dim, dtype=torch.bfloat16)
               for _ in range(3))
    with mock.patch.object(fa3, "_run", lambda kernel, key, grid, **args: captured.update(args)), \
            mock.patch.object(fa3, "_sm_count", lambda device: 132):
        fa3.run_forward(q, k, v, causal, head_dim ** -0.5, config)
    kernel = fa3.gluon_kernels().forward
    names = []
    for param in kernel.params:
        value = captured[param.name]
        if param.is_constexpr or not (isinstance(value, (int, torch.Tensor)) and not isinstance(value, bool)):
            continue
        _, key = native_specialize_impl(BaseBackend, value, False, not param.do_not_specialize,
                                        not param.do_not_specialize_on_alignment)
        if key == "D":
            names.append(param.name)
    return names


def _ptxas_version() -> str:
    """The last line of `ptxas --version` for the assembler this Triton uses for sm_90."""
    from triton.backends.nvidia.compiler import get_ptxas
    return subprocess.run([get_ptxas(90).path, "--version"], capture_output=True, text=True).stdout.splitlines()[-1]


def build(out: Path, tag: str, head_dims, causals, seqlens, variant: str | None) -> list[Path]:
    """Compile and write the cubins (see the module docstring); returns their paths."""
    import triton
    reason = fa3.gluon_kernels()
    if isinstance(reason, str):
        raise SystemExit(reason)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for head_dim in head_dims:
        for causal in causals:
            config = forward_config(variant) if variant else fa3.FORWARD_CONFIGS[head_dim, causal]
            for seqlen in seqlens:
                divisible = divisible_arguments(head_dim, causal, seqlen, config)
                compiled = fa3.compile_for_sm90(torch.bfloat16, head_dim, causal, 1, "fwd", config,
                                                divisible=divisible)
                path = out / f"d{head_dim}{'c' if causal else 'n'}_{tag}_n{seqlen}.cubin"
                path.write_bytes(compiled.asm["cubin"])
                path.with_suffix(".json").write_text(json.dumps(dict(
                    tag=tag, head_dim=head_dim, causal=causal, seqlen=seqlen, config=config._asdict(),
                    shared=compiled.metadata.shared, divisible=divisible, triton=triton.__version__,
                    ptxas=_ptxas_version()), indent=1) + "\n")
                print(f"wrote {path} (triton {triton.__version__}, {compiled.metadata.shared} B shared)")
                written.append(path)
    return written


def _swapped(compiled, cubin: bytes, shared: int):
    """A copy of Triton's compiled kernel `compiled` that launches `cubin` (with `shared` bytes of dynamic shared
    memory) through the same launcher."""
    swapped = copy.copy(compiled)
    swapped.kernel = cubin
    swapped.asm = {**compiled.asm, "cubin": cubin}
    swapped.metadata = compiled.metadata._replace(shared=shared)
    swapped.packed_metadata = (compiled.metadata.num_warps, compiled.metadata.num_ctas, shared)
    swapped.module = swapped.function = swapped._run = None
    swapped._init_handles()
    return swapped


def time_cubins(folder: Path, rounds: int) -> None:
    """Time every cubin of `folder` against the native kernel (see the module docstring)."""
    import triton
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    reason = fa3.gluon_device_reason(torch.device("cuda"))
    if reason:
        raise SystemExit(f"time runs the Gluon kernels, and they cannot run here: {reason}")
    groups = {}
    for path in sorted(folder.glob("*.cubin")):
        meta = json.loads(path.with_suffix(".json").read_text())
        groups.setdefault((meta["head_dim"], meta["causal"], meta["seqlen"]), []).append((path, meta))
    print(f"triton {triton.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for (head_dim, causal, seqlen), cubins in sorted(groups.items()):
        config = fa3.FORWARD_CONFIGS[head_dim, causal]
        q, k, v = (torch.randn(TOKENS // seqlen, WIDTH // head_dim, seqlen, head_dim, device="cuda",
                               dtype=torch.bfloat16) for _ in range(3))
        scale = head_dim ** -0.5
        before = set(fa3._COMPILED)
        o_native, _ = fa3.run_forward(q, k, v, causal, scale, config)
        [key] = set(fa3._COMPILED) - before
        native = fa3._COMPILED[key]
        variants = {f"native {triton.__version__}": native}
        for path, meta in cubins:
            if meta["config"]["num_consumers"] != config.num_consumers or meta["config"]["block_n"] != config.block_n:
                print(f"  {path.name}: another tile shape than the native {config} (grid differs): skipped")
                continue
            swapped = _swapped(native, path.read_bytes(), meta["shared"])
            fa3._COMPILED[key] = swapped
            o, _ = fa3.run_forward(q, k, v, causal, scale, config)
            if not torch.equal(o, o_native):
                print(f"  {path.name}: o differs from the native kernel's by up to "
                      f"{(o.float() - o_native.float()).abs().max().item():.3g}: skipped")
                continue
            variants[path.stem] = swapped

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        times = {name: [] for name in [*variants, "cudnn"]}
        try:
            for _ in range(rounds):
                for name, compiled in variants.items():
                    fa3._COMPILED[key] = compiled
                    times[name].append(triton.testing.do_bench(
                        lambda: fa3.run_forward(q, k, v, causal, scale, config), warmup=25, rep=150))
                times["cudnn"].append(triton.testing.do_bench(cudnn, warmup=25, rep=150))
        finally:
            fa3._COMPILED[key] = native
        median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
        base = median[f"native {triton.__version__}"]
        print(f"D={head_dim} causal={causal} N={seqlen} (B={TOKENS // seqlen}, H={WIDTH // head_dim}), "
              f"ms (native / variant):")
        for name, ms in median.items():
            print(f"  {name:40s} {ms:8.4f}  ({base / ms:.3f})")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("build", help="compile cubins with the installed Triton (no GPU needed)")
    make.add_argument("out", type=Path, help="folder to write into")
    make.add_argument("--tag", required=True, help="names this build in the file names (e.g. the release)")
    make.add_argument("--head-dims", default="64", help="comma-separated head dims")
    make.add_argument("--causal", default="1", help="comma-separated 1 (causal) / 0")
    make.add_argument("--seqlens", default="2048,4096,8192,16384", help="comma-separated N")
    make.add_argument("--variant", default=None, help="a tools.fa3_variants forward variant; default the "
                                                      "installed release's measured config")
    run = commands.add_parser("time", help="time a folder's cubins on the GPU against the native ones")
    run.add_argument("folder", type=Path)
    run.add_argument("--rounds", type=int, default=4, help="interleaved rounds (the median is reported)")
    args = parser.parse_args(argv)
    if args.command == "build":
        ints = lambda text, name: [int(x) for x in text.split(",") if x.strip()] or parser.error(f"--{name}: none")
        head_dims = ints(args.head_dims, "head-dims")
        if set(head_dims) - set(fa3.HEAD_DIMS):
            parser.error(f"--head-dims {args.head_dims}: accepted {', '.join(map(str, fa3.HEAD_DIMS))}")
        build(args.out, args.tag, head_dims, [bool(c) for c in ints(args.causal, "causal")],
              ints(args.seqlens, "seqlens"), args.variant)
    else:
        if args.rounds < 1:
            parser.error(f"--rounds {args.rounds}: accepted 1 or more")
        time_cubins(args.folder, args.rounds)


if __name__ == "__main__":
    main()
