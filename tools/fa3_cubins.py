"""Build the Gluon FA3 kernels' cubins with any Triton release on a CPU machine, then time them on an H100/H200
in one process against the cubins the installed release compiles itself.

    # once per Triton release, in that release's environment (no GPU needed):
    python -m tools.fa3_cubins build cubins --tag 3.9 --head-dims 64 --causal 1 --seqlens 2048,8192
    python -m tools.fa3_cubins build cubins --tag 3.9-early-k --head-dims 64 --causal 1 --variant 2:128:4:1:1:0
    python -m tools.fa3_cubins build cubins --tag 3.9 --kernel bwd --head-dims 128 --causal 0
    # on the GPU machine, with the installed release (its runtime launches every cubin):
    python -m tools.fa3_cubins time cubins --rounds 4

Why: two releases' kernels timed in two processes differ by the machine's drift as much as by their code, and a
release the GPU machine does not have cannot run there at all. A cubin built elsewhere can: `time` launches it
through the installed release's compiled kernel for the same shape (same arguments, grid and launcher; only the
machine code and its shared-memory size change), interleaved with the native one over --rounds rounds.

build: for each head_dim, causal and seqlen of the benchmark grid (B * N = 16k tokens, H * D = 2048, bf16, as
`bench.attention`), compiles the forward (--kernel fwd) or the backward (bwd) with the config given (--variant, a
`tools.fa3_variants` variant of that kernel; default the installed release's FORWARD_CONFIGS / BACKWARD_CONFIGS
entry), specialized as a launch of that shape on a 132-SM GPU specializes it (Triton marks integer and pointer
arguments that are multiples of 16, and compiles integers passed as 1 as constants: `specialized_arguments`).
Writes <out>/<kernel>_d<D><c|n>_<tag>_n<N>.cubin and a .json beside it (Triton and ptxas versions, config, shared
memory, the specialization).
time: the cubins of <dir>, shape by shape, against the native kernel on the same inputs: the forward's o and the
backward's dK and dV must be equal bit for bit, the backward's dQ (float32 reduce-adds in any order) within
DQ_TOLERANCE relative (another result is reported and not timed); then `triton.testing.do_bench` medians per
round, the median over rounds; prints each variant's time and native / variant (above 1: faster than the native
cubin), and for the forward cuDNN's.
"""

import argparse
import copy
import json
import os
import subprocess
from pathlib import Path
from unittest import mock

if __name__ == "__main__":
    # Compiled for sm_90 or run on the GPU, never interpreted: keep `model.backends` (imported with bench.attention)
    # from switching Triton's interpreter on, as it does for a machine without a GPU.
    os.environ["TRITON_INTERPRET"] = "0"

import torch

from bench import HelpFormatter
from bench.attention import TOKENS, WIDTH
from kernels import fa3, launch
from tools.fa3_variants import backward_config, forward_config

# dQ's float32 reduce-adds land in any order: the same kernel's dQ differs between runs by 1.2-2.6e-5 relative at
# head_dim 128, N = 2k-8k (H200); a wrong kernel's by far more.
DQ_TOLERANCE = 1e-4


def _batch(seqlen: int) -> int:
    """The benchmark grid's batch at `seqlen` (as bench.attention: TOKENS tokens, at least one sequence)."""
    return max(1, TOKENS // seqlen)


def _grid_inputs(head_dim: int, seqlen: int, device: str = "cpu", fill=torch.zeros):
    """q, k, v and dO of the benchmark grid's shape for (head_dim, seqlen), bf16."""
    return tuple(fill(_batch(seqlen), WIDTH // head_dim, seqlen, head_dim, device=device, dtype=torch.bfloat16)
                 for _ in range(4))


def specialized_arguments(kernel: str, head_dim: int, causal: bool, seqlen: int, config) -> tuple[list[str], list[str]]:
    """The integer and pointer arguments of the forward (kernel="fwd") or backward ("bwd") that a launch on the grid
    shape (head_dim, seqlen) specializes -> (divisible, ones): those it passes as multiples of 16, which Triton
    compiles as such, and the integers it passes as 1, which Triton compiles as the constant 1. From run_forward's
    or run_backward's arguments, built on the CPU (nothing launched, the backward's Triton passes stubbed), through
    the installed Triton's own specialization."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    captured = {}
    q, k, v, do = _grid_inputs(head_dim, seqlen)
    scale = head_dim ** -0.5
    def recording(kernel, key, grid, per_call, maxnreg=0, **args):
        return lambda *values: captured.update(args, **dict(zip(per_call, values)))

    fa3.clear_caches()  # so the launch is prepared again, and recorded
    with mock.patch.object(fa3, "_prepared", recording), \
            mock.patch.object(fa3, "_sm_count", lambda device: 132), \
            mock.patch.object(fa3, "bwd_preprocess", lambda o, do, dq_acc=None: torch.zeros(o.shape[:3])), \
            mock.patch.object(fa3, "_convert_dq_launch", lambda *args: lambda dq_acc, dq: None), \
            mock.patch.object(fa3.fa2, "backward_dq", lambda *args, **kwargs: None):
        try:
            if kernel == "fwd":
                fa3.run_forward(q, k, v, causal, scale, config)
            else:
                fa3.run_backward(do, q, k, v, q, torch.zeros(q.shape[:3]), causal, scale, config)
        finally:
            fa3.clear_caches()  # the recorder is not a launch
    divisible, ones = [], []
    for param in getattr(fa3.gluon_kernels(), {"fwd": "forward", "bwd": "backward"}[kernel]).params:
        value = captured[param.name]
        if param.is_constexpr or not (isinstance(value, (int, torch.Tensor)) and not isinstance(value, bool)):
            continue
        kind, key = native_specialize_impl(BaseBackend, value, False, not param.do_not_specialize,
                                           not param.do_not_specialize_on_alignment)
        if key == "D":
            divisible.append(param.name)
        elif kind == "constexpr":
            ones.append(param.name)
    return divisible, ones


def _ptxas_version() -> str:
    """The last line of `ptxas --version` for the assembler this Triton uses for sm_90."""
    from triton.backends.nvidia.compiler import get_ptxas
    return subprocess.run([get_ptxas(90).path, "--version"], capture_output=True, text=True).stdout.splitlines()[-1]


def _config(kernel: str, head_dim: int, causal: bool, variant: str | None):
    """The config to build or to time: `variant` parsed as tools.fa3_variants does, else the measured one;
    SystemExit naming what is wrong with a variant the kernel cannot take."""
    if kernel == "fwd":
        config = forward_config(variant) if variant else fa3.FORWARD_CONFIGS[head_dim, causal]
        if config.num_consumers not in (2, 3) or config.block_n not in (32, 64, 128) or config.num_stages < 1:
            raise SystemExit(f"forward variant {variant}: NUM_CONSUMERS 2 or 3, BLOCK_N 32, 64 or 128, NUM_STAGES 1 "
                             "or more")
        return config
    measured = fa3.BACKWARD_CONFIGS[head_dim]
    config = backward_config(variant, measured) if variant else measured
    try:
        config.dq_box(head_dim)
    except ValueError as error:
        raise SystemExit(f"backward variant {variant} at head_dim {head_dim}: {error}") from None
    return config


def build(out: Path, tag: str, kernel: str, head_dims, causals, seqlens, variant: str | None) -> list[Path]:
    """Compile and write the cubins (see the module docstring); returns their paths."""
    import triton
    reason = fa3.gluon_kernels()
    if isinstance(reason, str):
        raise SystemExit(reason)
    configs = {(head_dim, causal): _config(kernel, head_dim, causal, variant)
               for head_dim in head_dims for causal in causals}
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for (head_dim, causal), config in configs.items():
        for seqlen in seqlens:
            divisible, ones = specialized_arguments(kernel, head_dim, causal, seqlen, config)
            try:
                compiled = fa3.compile_for_sm90(torch.bfloat16, head_dim, causal, 1, kernel, config,
                                                divisible=divisible, ones=ones)
            except Exception as error:  # a config the kernel cannot be written for (a Triton compile error)
                raise SystemExit(f"{kernel} {config} at head_dim {head_dim}: does not compile: "
                                 f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[-1]}") from error
            if compiled.metadata.shared > fa3.SM90_SHARED_MEMORY:
                raise SystemExit(f"{kernel} {config} at head_dim {head_dim}: needs {compiled.metadata.shared} B "
                                 f"of shared memory; an sm_90 block may have {fa3.SM90_SHARED_MEMORY}")
            path = out / f"{kernel}_d{head_dim}{'c' if causal else 'n'}_{tag}_n{seqlen}.cubin"
            path.write_bytes(compiled.asm["cubin"])
            path.with_suffix(".json").write_text(json.dumps(dict(
                kernel=kernel, tag=tag, head_dim=head_dim, causal=causal, seqlen=seqlen, config=config._asdict(),
                shared=compiled.metadata.shared, divisible=divisible, ones=ones, triton=triton.__version__,
                ptxas=_ptxas_version()), indent=1) + "\n")
            print(f"wrote {path} (triton {triton.__version__}, {compiled.metadata.shared} B shared)")
            written.append(path)
    return written


def _swapped(compiled, cubin: bytes, shared: int):
    """A copy of Triton's compiled kernel `compiled` that launches `cubin` (with `shared` bytes of dynamic shared
    memory) through the same launcher."""
    from triton.compiler.compiler import make_backend

    swapped = copy.copy(compiled)
    swapped.kernel = cubin
    swapped.asm = {**compiled.asm, "cubin": cubin}
    swapped.metadata = compiled.metadata._replace(shared=shared)
    swapped.packed_metadata = make_backend(swapped.metadata.target).pack_metadata(swapped.metadata)
    swapped.module = swapped.function = swapped._run = None
    swapped._init_handles()
    return swapped


def _runner(kernel: str, head_dim: int, causal: bool, seqlen: int):
    """A function config -> outputs that runs the forward (o) or the backward (dq, dk, dv) on fixed random inputs
    of the grid shape, and cuDNN's forward on them (None for the backward)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, do = _grid_inputs(head_dim, seqlen, "cuda", torch.randn)
    scale = head_dim ** -0.5
    if kernel == "fwd":
        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return lambda config: (fa3.run_forward(q, k, v, causal, scale, config)[0],), cudnn
    o, lse = fa3.run_forward(q, k, v, causal, scale, fa3.FORWARD_CONFIGS[head_dim, causal])
    return lambda config: fa3.run_backward(do, q, k, v, o, lse, causal, scale, config), None


def _same(kernel: str, outputs, reference) -> str | None:
    """Why `outputs` do not count as the native kernel's (bit-equal o, dK, dV; dQ within DQ_TOLERANCE), or None."""
    for name, out, ref in zip(("o",) if kernel == "fwd" else ("dq", "dk", "dv"), outputs, reference):
        if name == "dq":
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            if err > DQ_TOLERANCE:
                return f"dq differs from the native kernel's by {err:.3g} relative"
        elif not torch.equal(out, ref):
            return f"{name} differs from the native kernel's by up to {(out.float() - ref.float()).abs().max():.3g}"
    return None


def time_cubins(folder: Path, rounds: int) -> None:
    """Time every cubin of `folder` against the native kernel (see the module docstring)."""
    import triton

    if not folder.is_dir():
        raise SystemExit(f"{folder}: not a folder (give the one `build` wrote)")
    groups = {}
    for path in sorted(folder.glob("*.cubin")):
        try:
            meta = json.loads(path.with_suffix(".json").read_text())
            key = meta["kernel"], meta["head_dim"], meta["causal"], meta["seqlen"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise SystemExit(f"{path}: no readable {path.with_suffix('.json').name} beside it ({error}); "
                             "`build` writes both") from None
        groups.setdefault(key, []).append((path, meta))
    if not groups:
        raise SystemExit(f"{folder}: no .cubin files (`build` writes them)")
    reason = "no CUDA GPU" if not torch.cuda.is_available() else fa3.gluon_device_reason(torch.device("cuda"))
    if reason:
        raise SystemExit(f"time runs the Gluon kernels, and they cannot run here: {reason}")
    print(f"triton {triton.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for (kernel, head_dim, causal, seqlen), cubins in sorted(groups.items()):
        run, cudnn = _runner(kernel, head_dim, causal, seqlen)
        natives = {}  # config -> ((kernel, its launch key), the installed release's compiled kernel, its outputs)

        def native(config):
            if config not in natives:
                keys = []
                gluon_prepared = fa3._prepared

                def recording(kernel, key, *args, **kwargs):
                    keys.append((kernel, key))
                    return gluon_prepared(kernel, key, *args, **kwargs)

                fa3.clear_caches()  # so the launches are prepared again, and recorded
                with mock.patch.object(fa3, "_prepared", recording):
                    outputs = run(config)
                # the timed kernel's launch is last
                natives[config] = keys[-1], launch.compiled_kernel(*keys[-1]), outputs
            return natives[config]

        measured = _config(kernel, head_dim, causal, None)
        key, compiled, _ = native(measured)
        variants = {f"native {triton.__version__}": (measured, key, compiled)}
        for path, meta in cubins:
            config = type(measured)(**meta["config"])
            key, compiled, reference = native(config)  # the same config compiled here: same launch, same result
            swapped = _swapped(compiled, path.read_bytes(), meta["shared"])
            launch.swap_compiled(*key, swapped)
            why = _same(kernel, run(config), reference)
            launch.swap_compiled(*key, compiled)
            if why:
                print(f"  {path.name}: {why}: skipped")
                continue
            variants[path.stem] = (config, key, swapped)
        times = {name: [] for name in [*variants, *(["cudnn"] if cudnn else [])]}
        try:
            for _ in range(rounds):
                for name, (config, key, compiled) in variants.items():
                    launch.swap_compiled(*key, compiled)
                    times[name].append(triton.testing.do_bench(lambda: run(config), warmup=25, rep=150))
                if cudnn:
                    times["cudnn"].append(triton.testing.do_bench(cudnn, warmup=25, rep=150))
        finally:
            for key, compiled, _ in natives.values():
                launch.swap_compiled(*key, compiled)
        median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
        base = median[f"native {triton.__version__}"]
        print(f"{kernel} D={head_dim} causal={causal} N={seqlen} (B={_batch(seqlen)}, H={WIDTH // head_dim}), "
              f"ms (native / variant):")
        for name, ms in median.items():
            print(f"  {name:40s} {ms:8.4f}  ({base / ms:.3f})")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("build", help="compile cubins with the installed Triton (no GPU needed)",
                               formatter_class=HelpFormatter)
    make.add_argument("out", type=Path, help="folder to write into (made if missing)")
    make.add_argument("--tag", required=True, help="names this build in the file names (e.g. the release)")
    make.add_argument("--kernel", choices=["fwd", "bwd"], default="fwd", help="the Gluon forward or backward")
    make.add_argument("--head-dims", default="64", help="comma-separated head dims")
    make.add_argument("--causal", default="1", help="comma-separated 1 (causal) / 0")
    make.add_argument("--seqlens", default="2048,4096,8192,16384", help="comma-separated N")
    make.add_argument("--variant", default=None,
                      help="the config, default the installed release's measured one: fwd "
                           "NUM_CONSUMERS:BLOCK_N:NUM_STAGES:PINGPONG:PERSISTENT[:LATE_K_RELEASE] (e.g. 2:128:4:1:1), "
                           "bwd NUM_STAGES[:SPLIT_DQ:...:SEPARATE_DQ] (e.g. 2:cols:64), "
                           "as tools.fa3_variants")
    run = commands.add_parser("time", help="time a folder's cubins on the GPU against the native ones",
                              formatter_class=HelpFormatter)
    run.add_argument("folder", type=Path, help="a folder `build` wrote (cubins and their .json)")
    run.add_argument("--rounds", type=int, default=4, help="interleaved rounds (the median is reported)")
    args = parser.parse_args(argv)
    if args.command == "build":
        def ints(text: str, name: str, accepted=None) -> list[int]:
            try:
                values = list(dict.fromkeys(int(x) for x in text.split(",") if x.strip()))  # in order, once each
            except ValueError:
                make.error(f"--{name} {text}: give comma-separated integers")
            if not values:
                make.error(f"--{name}: none")
            if accepted is not None and set(values) - set(accepted):
                make.error(f"--{name} {text}: accepted {', '.join(map(str, accepted))}")
            return values

        head_dims = ints(args.head_dims, "head-dims",
                         fa3.HEAD_DIMS if args.kernel == "fwd" else fa3.BACKWARD_HEAD_DIMS)
        causals = ints(args.causal, "causal", (1, 0))
        seqlens = ints(args.seqlens, "seqlens")
        if min(seqlens) < 1:
            make.error(f"--seqlens {args.seqlens}: give lengths of 1 or more")
        if not args.tag or set(args.tag) & set("/\\"):
            make.error(f"--tag {args.tag!r}: give a name without path separators")
        if args.out.exists() and not args.out.is_dir():
            make.error(f"{args.out}: exists and is not a folder")
        build(args.out, args.tag, args.kernel, head_dims, [bool(c) for c in causals], seqlens, args.variant)
    else:
        if args.rounds < 1:
            run.error(f"--rounds {args.rounds}: accepted 1 or more")
        time_cubins(args.folder, args.rounds)


if __name__ == "__main__":
    main()
