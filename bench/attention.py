"""Kernel-level attention benchmark: TFLOP/s of every attention backend (ours and PyTorch's), forward and backward.

    python -m bench.attention                       # bf16, head_dim 64 and 128, N = 512..16k, causal and not
    python -m bench.attention --head-dims 128 --seqlens 4096 --backends fa2,sdpa_cudnn --out runs/bench

FLOPs (the convention of the FlashAttention papers and the Triton tutorial): forward 4 * B * H * N^2 * D,
halved when causal; backward 2.5x the forward. Tokens per call are fixed (B * N = 16k) and H * D = 2048, so
every row of the table moves the same amount of data. Times are `triton.testing.do_bench` medians (CUDA
events, after warm-up; the first call of each shape autotunes before timing; --repeats R: the median of R such
measurements per cell, the backends' order alternating) of eager calls, as user code makes them: where a kernel
takes less GPU time than its call takes on the host (Python, the custom-op layers, Triton's launcher: ~0.3 ms
forward and ~1.4 ms forward + backward for our backends on the H200's host, docs/benchmarks.md) that is what gets
timed. --cuda-graph times the same calls replayed from a CUDA graph
(`triton.testing.do_bench_cudagraph`, medians, calls back to back without an L2 flush): the GPU time alone; the
backward there is (forward + backward) - forward, both captured.
Writes a CSV, a JSON and one PNG per (head_dim, causal, direction) into --out: TFLOP/s against sequence length,
one line per backend.
"""

import argparse
import csv
import json
import statistics
from pathlib import Path

import torch
import torch._functorch.config  # the donated_buffer switch used in measure()

from bench import HelpFormatter
from model.backends import REGISTRY

TOKENS = 16 * 1024
WIDTH = 2048  # n_heads * head_dim


def check_names(names):
    """Refuse (SystemExit) names that are not backends of ``model.backends.REGISTRY``, listing the accepted ones."""
    unknown = set(names) - set(REGISTRY)
    if unknown:
        raise SystemExit(f"unknown backend(s) {sorted(unknown)}; choose from {sorted(REGISTRY)}")


def backends(names):
    """{name: attention(q, k, v, causal)} for backends of ``model.backends.REGISTRY``."""
    check_names(names)
    chosen = {}
    for name in names:
        fn = REGISTRY[name].load().attention
        chosen[name] = lambda q, k, v, causal, fn=fn: fn(q, k, v, causal=causal)
    return chosen


def flops(batch, n_heads, seqlen, head_dim, causal, direction):
    forward = 4 * batch * n_heads * seqlen * seqlen * head_dim / (2 if causal else 1)
    return forward if direction == "fwd" else 2.5 * forward


def measure(attention, batch, n_heads, seqlen, head_dim, causal, dtype, device="cuda", cuda_graph=False):
    """Median milliseconds of forward and of backward alone; None where the backend refuses the shape.
    Eager: the backward is timed by calling it repeatedly on one graph (retain_graph=True), compiled backends
    included. cuda_graph: the calls replayed from a CUDA graph (GPU time without the host's launch cost); a
    backward cannot be captured apart from its forward (autograd runs it on the forward's stream, which must be
    the capturing one), so the backward is the captured forward + backward minus the captured forward."""
    import triton.testing

    # A compiled backward may reuse ("donate") the buffers saved for it, which forbids retain_graph=True: off for
    # the graphs compiled in here.
    with torch._functorch.config.patch(donated_buffer=False):
        q, k, v = (torch.randn(batch, n_heads, seqlen, head_dim, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        try:
            o = attention(q, k, v, causal)
            do = torch.randn_like(o)
            o.backward(do)  # warm-up and autotuning of the backward kernels
        except RuntimeError as err:  # e.g. an SDPA backend that does not support this shape or GPU
            print(f"  skipped: {str(err).splitlines()[0][:100]}")
            return None, None
        if cuda_graph:
            # Autograd accumulates into q.grad on the stream that made q's AccumulateGrad node; the warm-up's
            # graph (kept alive by o) would pin it to this stream, not the capturing one.
            del o
            bench = lambda fn, **kw: triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median", **kw)
            fwd = bench(lambda: attention(q, k, v, causal))
            fwd_bwd = bench(lambda: attention(q, k, v, causal).backward(do), grad_to_none=[q, k, v])
            return fwd, fwd_bwd - fwd
        fwd = triton.testing.do_bench(lambda: attention(q, k, v, causal), return_mode="median")
        o = attention(q, k, v, causal)
        bwd = triton.testing.do_bench(lambda: o.backward(do, retain_graph=True), grad_to_none=[q, k, v],
                                      return_mode="median")
    return fwd, bwd


def repeated(measure_one, chosen, repeats):
    """{name: (fwd_ms, bwd_ms)}: the medians of `repeats` calls of measure_one(attention) per backend, the backends
    in `chosen`'s order on even repeats and reversed on odd ones, so a drift of the machine's clocks during the cell
    reaches every backend alike. A backend that refuses the shape ((None, None)) is not asked again."""
    times = {name: [] for name in chosen}
    for rep in range(repeats):
        for name in (list(chosen) if rep % 2 == 0 else list(reversed(chosen))):
            if times[name] and times[name][0] == (None, None):
                continue
            times[name].append(measure_one(chosen[name]))
    median = lambda xs: None if None in xs else statistics.median(xs)
    return {name: tuple(median([t[i] for t in ts]) for i in range(2)) for name, ts in times.items()}


def print_ratios(rows):
    """The first backend's speed over each other one, per configuration: time(other) / time(first), fwd and bwd."""
    by_key = {(r["backend"], r["head_dim"], r["causal"], r["seqlen"]): r for r in rows}
    first, *others = dict.fromkeys(r["backend"] for r in rows)
    if not others:
        return
    print(f"\n{first} speed-up (other time / {first} time), fwd / bwd")
    print(f"{'D':>4} {'causal':>6} {'N':>6} " + " ".join(f"{'vs ' + b:>17}" for b in others))
    for (backend, head_dim, causal, seqlen), r in by_key.items():
        if backend != first:
            continue
        cells = []
        for b in others:
            o = by_key.get((b, head_dim, causal, seqlen))
            ratio = lambda d: f"{o[d] / r[d]:.2f}" if o and o[d] and r[d] else "-"
            cells.append(f"{ratio('fwd_ms') + ' / ' + ratio('bwd_ms'):>17}")
        print(f"{head_dim:>4} {str(causal):>6} {seqlen:>6} " + " ".join(cells))


def plot(rows, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for head_dim in sorted({r["head_dim"] for r in rows}):
        for causal in (True, False):
            for direction in ("fwd", "bwd"):
                sel = [r for r in rows if r["head_dim"] == head_dim and r["causal"] == causal and r[f"{direction}_tflops"]]
                if not sel:
                    continue
                fig, ax = plt.subplots(figsize=(6, 4))
                for backend in dict.fromkeys(r["backend"] for r in sel):
                    pts = [(r["seqlen"], r[f"{direction}_tflops"]) for r in sel if r["backend"] == backend]
                    ax.plot(*zip(*pts), marker="o", label=backend)
                ax.set_xscale("log", base=2)
                ax.set_xlabel("sequence length N")
                ax.set_ylabel("TFLOP/s")
                ax.set_title(f"{direction}, head_dim={head_dim}, {'causal' if causal else 'non-causal'}, "
                             f"{rows[0]['dtype']}, {rows[0]['timing']} timing")
                ax.grid(True, alpha=0.3)
                ax.legend()
                path = out_dir / f"attention_{direction}_d{head_dim}_{'causal' if causal else 'full'}.png"
                fig.tight_layout()
                fig.savefig(path, dpi=110)
                plt.close(fig)
                paths.append(path)
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--backends", default=",".join(reversed(REGISTRY)),  # the ratios are against the first
                        help="comma-separated, from model.backends.REGISTRY; ratios are against the first")
    parser.add_argument("--head-dims", default="64,128", help="comma-separated head dimensions D")
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384", help="comma-separated sequence lengths N")
    parser.add_argument("--causal", default="true,false", help="comma-separated: true, false, or true,false for both")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="input dtype")
    parser.add_argument("--out", default="runs/bench_attention", help="folder for CSV, JSON and PNG files")
    parser.add_argument("--repeats", type=int, default=1,
                        help="measure each cell this many times, the backends' order alternating, and report the "
                             "median of the repeats (the machine's clock state drifts between measurements)")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="time calls replayed from a CUDA graph (GPU time alone) instead of eager calls")
    args = parser.parse_args(argv)
    check_names(args.backends.split(","))  # a typo is caught on any machine
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats}: give 1 or more")
    if not torch.cuda.is_available():
        raise SystemExit("bench.attention needs a CUDA GPU")

    dtype = getattr(torch, args.dtype)
    timing = "cuda_graph" if args.cuda_graph else "eager"
    chosen = backends(args.backends.split(","))
    # Compiled backends (flex) build one static-shape kernel per shape (model/backends/flex_masks.py): room for every case.
    cases = len(args.head_dims.split(",")) * len(args.causal.split(",")) * len(args.seqlens.split(","))
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, cases + 8)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"{'backend':<11} {'D':>4} {'causal':>6} {'N':>6} {'fwd ms':>8} {'fwd TF/s':>9} {'bwd ms':>8} {'bwd TF/s':>9}")
    for head_dim in map(int, args.head_dims.split(",")):
        for causal in [c.strip().lower() == "true" for c in args.causal.split(",")]:
            for seqlen in map(int, args.seqlens.split(",")):
                batch, n_heads = max(1, TOKENS // seqlen), WIDTH // head_dim
                times = repeated(lambda attention: measure(attention, batch, n_heads, seqlen, head_dim, causal,
                                                           dtype, cuda_graph=args.cuda_graph), chosen, args.repeats)
                for name, (fwd, bwd) in times.items():
                    row = dict(backend=name, dtype=args.dtype, batch=batch, n_heads=n_heads, seqlen=seqlen,
                               head_dim=head_dim, causal=causal, timing=timing, repeats=args.repeats, fwd_ms=fwd,
                               bwd_ms=bwd,
                               fwd_tflops=fwd and flops(batch, n_heads, seqlen, head_dim, causal, "fwd") / fwd / 1e9,
                               bwd_tflops=bwd and flops(batch, n_heads, seqlen, head_dim, causal, "bwd") / bwd / 1e9)
                    rows.append(row)
                    fmt = lambda x, f: format(x, f) if x else "-"
                    print(f"{name:<11} {head_dim:>4} {str(causal):>6} {seqlen:>6} {fmt(fwd, '8.3f')} "
                          f"{fmt(row['fwd_tflops'], '9.1f')} {fmt(bwd, '8.3f')} {fmt(row['bwd_tflops'], '9.1f')}", flush=True)
                torch.cuda.empty_cache()

    print_ratios(rows)
    with open(out_dir / "attention.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                triton=__import__("triton").__version__, rows=rows)
    (out_dir / "attention.json").write_text(json.dumps(meta, indent=1))
    for path in plot(rows, out_dir):
        print("wrote", path)
    print(f"wrote {out_dir / 'attention.csv'} and attention.json ({meta['gpu']}, torch {meta['torch']}, triton {meta['triton']})")


if __name__ == "__main__":
    main()
