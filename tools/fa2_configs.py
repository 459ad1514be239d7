"""Time every candidate tile config of each FA2 kernel on its own, per shape, next to SDPA's cuDNN kernel.

    python -m tools.fa2_configs --out runs/fa2_configs            # head_dim 64/128, causal and not, N 1k/4k/16k
    python -m tools.fa2_configs --head-dims 64 --seqlens 1024 --causal true

This is the tool behind the `_*_SHAPES` config lists in kernels/fa2.py and the variant table in
docs/hopper-notes.md. Autotune is bypassed: each candidate is made the kernel's only config, so its time is
its own. Every candidate runs with TMA tile loads on and off. A "dkdv" or "dq" candidate is timed as the
whole backward (preprocess, dK/dV, dQ) with the other kernel held at its first config, so rows of one kernel
differ only by that kernel. Each row's outputs are compared with the first config's (rel_err).

Shapes follow bench/attention.py (B * N = 16k tokens, H * D = 2048, bf16). Every config is compiled first in
parallel worker processes on a tiny problem (the same specialisation, so the timing run hits Triton's cache).
Times are `triton.testing.do_bench` medians. Writes configs.csv into --out, one row per measurement.
"""

import argparse
import csv
import itertools
import math
import multiprocessing as mp
import os
from pathlib import Path

import torch

from bench import HelpFormatter

# (BLOCK_M, BLOCK_N, num_warps, num_stages); the first of each list is the config the others are held at.
FWD = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 2),
       (128, 128, 8, 2), (128, 128, 8, 4), (128, 64, 8, 4), (128, 64, 4, 4), (128, 64, 4, 2), (64, 128, 4, 3),
       (64, 64, 4, 3), (64, 64, 4, 4), (128, 32, 4, 3), (256, 64, 8, 3), (256, 128, 8, 2)]
DKDV = [(64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 2), (32, 32, 4, 2),
        (64, 128, 8, 2), (64, 128, 8, 4), (32, 128, 4, 4), (32, 128, 8, 3), (64, 128, 4, 3), (128, 128, 8, 2),
        (64, 64, 4, 3), (32, 64, 4, 3), (16, 128, 4, 3)]
DQ = [(128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 2), (32, 32, 4, 2),
      (128, 64, 8, 2), (128, 64, 8, 4), (128, 32, 4, 4), (128, 32, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2),
      (64, 64, 4, 3), (64, 32, 4, 3), (128, 16, 4, 3)]
CANDIDATES = {"fwd": FWD, "dkdv": DKDV, "dq": DQ}
TOKENS, WIDTH = 16 * 1024, 2048


def variants(kernel):
    """(shape, tma) to measure for one kernel: every shape with TMA tile loads on and off."""
    return [(c, tma) for c in CANDIDATES[kernel] for tma in (True, False)]


def set_config(kernel, shape, tma):
    import triton

    from kernels import fa2

    block_m, block_n, warps, stages = shape
    tuner = {"fwd": fa2._fwd, "dkdv": fa2._bwd_dkdv, "dq": fa2._bwd_dq}[kernel]
    tuner.configs = [triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "TMA": tma}, num_warps=warps,
                                   num_stages=stages)]
    tuner.cache.clear()


def inputs(batch, n_heads, seqlen, head_dim, causal):
    from kernels import fa2

    q, k, v = (torch.randn(batch, n_heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = 1.0 / math.sqrt(head_dim)
    set_config("fwd", FWD[0], False)
    o, lse = fa2.forward(q, k, v, causal, scale)
    return q, k, v, o, lse, torch.randn_like(o), scale


def run_once(kernel, shape, tma, q, k, v, o, lse, do, causal, scale):
    """The launcher call that times `kernel` with one config: the forward, or the whole backward with the other
    backward kernel at its first config."""
    from kernels import fa2

    if kernel == "fwd":
        set_config("fwd", shape, tma)
        return lambda: fa2.forward(q, k, v, causal, scale)
    set_config("dkdv", DKDV[0], False)
    set_config("dq", DQ[0], False)
    set_config(kernel, shape, tma)
    return lambda: fa2.backward(do, q, k, v, o, lse, causal, scale)


def rel_err(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def _compile(job):
    """Worker: compile one (kernel, variant, head_dim, causal) on a tiny problem with the real specialisation."""
    kernel, (shape, tma), head_dim, causal = job
    try:
        q, k, v, o, lse, do, scale = inputs(1, WIDTH // head_dim, 256, head_dim, causal)
        run_once(kernel, shape, tma, q, k, v, o, lse, do, causal, scale)()
        torch.cuda.synchronize()
        return None
    except Exception as err:  # noqa: BLE001 - reported in the table
        return f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"


FIELDS = ["kernel", "block_m", "block_n", "warps", "stages", "tma", "head_dim", "causal", "seqlen", "ms", "tflops",
          "vs_cudnn", "rel_err", "error"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--head-dims", default="64,128", help="comma-separated head dimensions D")
    parser.add_argument("--seqlens", default="1024,4096,16384", help="comma-separated sequence lengths N")
    parser.add_argument("--causal", default="true,false", help="true, false or both")
    parser.add_argument("--kernels", default="fwd,dkdv,dq", help="FA2 kernels whose configs are timed")
    parser.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)),
                        help="processes compiling the configs first: CPU cores - 2, at most 14")
    parser.add_argument("--out", default="runs/fa2_configs", help="folder for configs.csv")
    args = parser.parse_args(argv)
    args.head_dims = [int(d) for d in args.head_dims.split(",")]
    args.causal = [c.strip().lower() == "true" for c in args.causal.split(",")]
    args.kernels = args.kernels.split(",")
    args.seqlens = [int(n) for n in args.seqlens.split(",")]
    return args


def time_kernel(kernel, tensors, reference, errors, cell, cudnn):
    """Rows of `kernel`'s candidates on one shape (`cell`: batch, n_heads, seqlen, head_dim, causal), each timed
    with `do_bench` and checked against `reference`, and the best (ms, shape, tma, TFLOP/s) or None."""
    from triton.testing import do_bench

    from bench.attention import flops

    batch, n_heads, seqlen, head_dim, causal = cell
    direction = "fwd" if kernel == "fwd" else "bwd"
    rows, best = [], None
    for shape, tma in variants(kernel):
        row = dict(kernel=kernel, block_m=shape[0], block_n=shape[1], warps=shape[2], stages=shape[3], tma=tma,
                   head_dim=head_dim, causal=causal, seqlen=seqlen)
        err = errors.get((kernel, (shape, tma), head_dim, causal))
        if err is None:
            try:
                q, k, v, o, lse, do, scale = tensors
                fn = run_once(kernel, shape, tma, q, k, v, o, lse, do, causal, scale)
                row["rel_err"] = max(rel_err(a, b) for a, b in zip(fn(), reference[kernel]))
                ms = do_bench(fn, return_mode="median")
                tflops = flops(batch, n_heads, seqlen, head_dim, causal, direction) / ms / 1e9
                row.update(ms=ms, tflops=tflops, vs_cudnn=cudnn[direction] / ms)
                if best is None or ms < best[0]:
                    best = (ms, shape, tma, tflops)
            except Exception as e:  # noqa: BLE001 - reported in the table
                err = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        row["error"] = err
        rows.append(row)
    return rows, best


def time_shape(args, errors, writer, head_dim, causal, seqlen):
    """Every requested kernel's candidates on one shape, next to cuDNN; rows written as they come."""
    from bench.attention import backends, flops, measure

    batch, n_heads = max(1, TOKENS // seqlen), WIDTH // head_dim
    cudnn = dict(zip(("fwd", "bwd"), measure(backends(["sdpa_cudnn"])["sdpa_cudnn"], batch, n_heads, seqlen,
                                             head_dim, causal, torch.bfloat16)))
    print(f"D={head_dim} causal={causal} N={seqlen}: cuDNN fwd "
          f"{flops(batch, n_heads, seqlen, head_dim, causal, 'fwd') / cudnn['fwd'] / 1e9:.0f} TFLOP/s, bwd "
          f"{flops(batch, n_heads, seqlen, head_dim, causal, 'bwd') / cudnn['bwd'] / 1e9:.0f}", flush=True)
    tensors = inputs(batch, n_heads, seqlen, head_dim, causal)
    # Every candidate's outputs are compared with the baseline's (first config, pointer loads).
    reference = {kern: run_once(kern, CANDIDATES[kern][0], False, *tensors[:6], causal, tensors[6])()
                 for kern in ("fwd", "dkdv")}
    reference["dq"] = reference["dkdv"]
    for kernel in args.kernels:
        rows, best = time_kernel(kernel, tensors, reference, errors, (batch, n_heads, seqlen, head_dim, causal),
                                 cudnn)
        writer.writerows(rows)
        if best:
            direction = "fwd" if kernel == "fwd" else "bwd"
            print(f"  {kernel:>5}: best {best[1]} tma={best[2]}: {best[0]:.3f} ms, "
                  f"{best[3]:.0f} TFLOP/s ({direction} {cudnn[direction] / best[0]:.2f}x cuDNN)", flush=True)
    del tensors
    torch.cuda.empty_cache()


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tools.fa2_configs needs a CUDA GPU")
    jobs = [(kern, var, d, c) for kern in args.kernels for var in variants(kern) for d in args.head_dims
            for c in args.causal]
    with mp.get_context("spawn").Pool(args.workers) as pool:
        errors = dict(zip(jobs, pool.map(_compile, jobs, chunksize=1)))
    print(f"compiled {len(jobs)} kernels, {sum(e is not None for e in errors.values())} failed", flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "configs.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for head_dim, causal, seqlen in itertools.product(args.head_dims, args.causal, args.seqlens):
            time_shape(args, errors, writer, head_dim, causal, seqlen)
            f.flush()
    print("wrote", out_dir / "configs.csv")


if __name__ == "__main__":
    main()
