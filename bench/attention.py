"""Kernel-level attention benchmark: TFLOP/s of every attention backend (ours and PyTorch's), forward and backward,
and the decode step's time against a KV cache.

    python -m bench.attention                       # bf16, head_dim 64 and 128, N = 512..16k, causal and not
    python -m bench.attention --shape llama         # B=2, Hq=64, Hkv=8, D=128, N = 2k..32k, causal and not
    python -m bench.attention --shape decode        # one query per (batch, head) against N = 128..16k cached keys
    python -m bench.attention --head-dims 128 --seqlens 4096 --backends fa2,sdpa_cudnn --out runs/bench
    python -m bench.attention --shape decode --dtype float32 --heads 2 --head-dims 16 --seqlens 16,70 --batch 1 \\
        --backends sdpa,fa2,fa2_splitkv --out /tmp/dec          # CPU smoke test of the decode step (Triton interpreter)

Shapes (--batch, --heads, --kv-heads, --head-dims, --seqlens and --causal replace a shape's own values):
- grid (default): B * N = 16k tokens and H * D = 2048 (B = 16k / N, H = 2048 / D), so every row moves the same
  amount of data.
- llama: NVIDIA's published H200 attention shape, so our ratios compare with its table: B = 2, 64 query heads,
  8 key/value heads (grouped-query attention), D = 128, N = 2k, 4k, 8k, 16k, 32k, causal and not.
- decode: the attention of one decode step, forward only: q (B, H, 1, D) against k, v views of the first N
  positions of a (B, Hkv, max N, D) cache, through the function the model calls (the backend's
  ``kv_attention``; `fa2_splitkv` is fa2's ``split_kv_attention``, i.e. ``kernels.decode.fa2_decode``). Defaults:
  GPT-2's heads (12 x 64), B = 1 and 8. GB/s counts the K and V bytes read, the floor of a decode step's memory
  traffic; "vs fa2" is fa2's time over the backend's. The only shape that runs without a GPU (float32, the mean of
  3 calls under Triton's interpreter: a smoke test, not a benchmark).

FLOPs (the convention of the FlashAttention papers and the Triton tutorial): forward 4 * B * H * N^2 * D (H: query
heads), halved when causal; backward 2.5x the forward. Times are `triton.testing.do_bench` medians (CUDA events,
after warm-up; the first call of each shape autotunes before timing; --repeats R: the median of R such
measurements per cell, the backends' order alternating) of eager calls, as user code makes them: where a kernel
takes less GPU time than its call takes on the host (Python, the custom-op layers, Triton's launcher: ~0.3 ms
forward and ~1.4 ms forward + backward for our backends on the H200's host, docs/benchmarks.md) that is what gets
timed. --cuda-graph times the same calls replayed from a CUDA graph (`triton.testing.do_bench_cudagraph`,
medians, calls back to back without an L2 flush): the GPU time alone; the backward there is the captured forward
and backward minus the captured forward. A backend that runs another's kernels here (fa3 off Hopper: FA2's) is
named under the table.
Writes into --out a CSV and a JSON (attention.* for grid, attention_<shape>.* otherwise) and PNGs: TFLOP/s
against N per (head_dim, causal, direction), or decode GB/s against N per batch size; one line per backend.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import NamedTuple

import torch
import torch._functorch.config  # the donated_buffer switch used in measure()

from bench import HelpFormatter, csv_list, exit_on_interrupt, fallback, results_folder
from bench.report import Column, Table, environment, line_plot, write_csv, write_json
from model.backends import REGISTRY  # first: it sets TRITON_INTERPRET without a GPU, which kernels reads on import
from kernels.frontend import MAX_HEAD_DIM, MIN_HEAD_DIM

TOKENS = 16 * 1024
WIDTH = 2048  # n_heads * head_dim
SPLIT_KV = "fa2_splitkv"  # decode only: fa2 with the split-K/V decode kernel
# Each shape's values of the options left out; batch / heads None: the grid's B = TOKENS / N, H = WIDTH / D.
SHAPES = {
    "grid": dict(backends=list(reversed(REGISTRY)), head_dims=[64, 128],
                 seqlens=[512, 1024, 2048, 4096, 8192, 16384], causal=[True, False], batch=None, heads=None,
                 kv_heads=None),
    "llama": dict(backends=list(reversed(REGISTRY)), head_dims=[128], seqlens=[2048, 4096, 8192, 16384, 32768],
                  causal=[True, False], batch=[2], heads=64, kv_heads=8),
    "decode": dict(backends=["sdpa", "fa2", SPLIT_KV, "fa3"], head_dims=[64], seqlens=[128, 512, 1024, 4096, 16384],
                   causal=[True], batch=[1, 8], heads=12, kv_heads=None),
}


class Case(NamedTuple):
    """One cell: q (batch, n_heads, seqlen, head_dim) and k, v (batch, n_kv_heads, seqlen, head_dim); decode: one
    query against seqlen keys."""
    batch: int
    n_heads: int
    n_kv_heads: int
    seqlen: int
    head_dim: int
    causal: bool


def check_names(names, extra=()):
    """Refuse (SystemExit) names that are not backends of ``model.backends.REGISTRY`` (or ``extra``), listing the
    accepted ones."""
    unknown = set(names) - set(REGISTRY) - set(extra)
    if unknown:
        hint = f" ({SPLIT_KV}: --shape decode only)" if SPLIT_KV in unknown else ""
        raise SystemExit(f"unknown backend(s) {sorted(unknown)}; choose from {sorted(REGISTRY) + list(extra)}{hint}")


def backends(names):
    """{name: attention(q, k, v, causal)} for backends of ``model.backends.REGISTRY``."""
    check_names(names)
    chosen = {}
    for name in names:
        fn = REGISTRY[name].load().attention
        chosen[name] = lambda q, k, v, causal, fn=fn: fn(q, k, v, causal=causal)
    return chosen


def kv_backends(names):
    """{name: attention(q, k, v)} the model's decode-step functions (each backend's ``kv_attention``) of
    ``REGISTRY``'s backends, and fa2_splitkv (fa2's ``split_kv_attention``)."""
    check_names(names, extra=(SPLIT_KV,))
    return {name: REGISTRY["fa2"].load().split_kv_attention if name == SPLIT_KV else REGISTRY[name].load().kv_attention
            for name in names}


def flops(batch, n_heads, seqlen, head_dim, causal, direction):
    forward = 4 * batch * n_heads * seqlen * seqlen * head_dim / (2 if causal else 1)
    return forward if direction == "fwd" else 2.5 * forward


def measure(attention, batch, n_heads, seqlen, head_dim, causal, dtype, device="cuda", cuda_graph=False,
            n_kv_heads=None):
    """Median milliseconds of forward and of backward alone; None where the backend refuses the shape.
    n_kv_heads: k and v's heads (default n_heads). Eager: the backward is timed by calling it repeatedly on one
    graph (retain_graph=True), compiled backends included. cuda_graph: the calls replayed from a CUDA graph (GPU
    time without the host's launch cost); a backward cannot be captured apart from its forward (autograd runs it
    on the forward's stream, which must be the capturing one), so the backward is the captured forward + backward
    minus the captured forward."""
    import triton.testing

    # A compiled backward may reuse ("donate") the buffers saved for it, which forbids retain_graph=True: off for
    # the graphs compiled in here.
    with torch._functorch.config.patch(donated_buffer=False):
        q = torch.randn(batch, n_heads, seqlen, head_dim, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(batch, n_kv_heads or n_heads, seqlen, head_dim, device=device, dtype=dtype,
                            requires_grad=True) for _ in range(2))
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


def measure_decode(attention, q, k, v, cuda_graph=False):
    """Milliseconds of one call attention(q, k, v): do_bench's median on a GPU (do_bench_cudagraph's with
    cuda_graph), the mean of 3 calls after a first one on the CPU; None where the backend refuses the inputs."""
    try:
        attention(q, k, v)  # autotuning / first-call work
    except RuntimeError as err:
        print(f"  skipped: {str(err).splitlines()[0][:100]}")
        return None
    if q.is_cuda:
        import triton.testing

        bench = triton.testing.do_bench_cudagraph if cuda_graph else triton.testing.do_bench
        return bench(lambda: attention(q, k, v), return_mode="median")
    import time

    t0 = time.perf_counter()
    for _ in range(3):
        attention(q, k, v)
    return 1e3 * (time.perf_counter() - t0) / 3


def repeated(measure_one, chosen, repeats):
    """{name: tuple of medians}: the medians of `repeats` calls of measure_one(attention) per backend (each call a
    tuple of times, e.g. (fwd_ms, bwd_ms)), the backends in `chosen`'s order on even repeats and reversed on odd
    ones, so a drift of the machine's clocks during the cell reaches every backend alike. A backend that refuses
    the shape (all None) is not asked again."""
    times = {name: [] for name in chosen}
    for rep in range(repeats):
        for name in (list(chosen) if rep % 2 == 0 else list(reversed(chosen))):
            if times[name] and all(t is None for t in times[name][0]):
                continue
            times[name].append(measure_one(chosen[name]))
    median = lambda xs: None if None in xs else statistics.median(xs)
    return {name: tuple(median([t[i] for t in ts]) for i in range(len(ts[0]))) for name, ts in times.items()}


def cases(args) -> list[Case]:
    """The cells of ``args`` (parse_args' namespace) in running order: head_dim, causal, N, batch."""
    out = []
    for head_dim in args.head_dims:
        heads = WIDTH // head_dim if args.heads is None else args.heads
        kv_heads = heads if args.kv_heads is None else args.kv_heads
        for causal in args.causal:
            for seqlen in args.seqlens:
                for batch in args.batch or [max(1, TOKENS // seqlen)]:
                    out.append(Case(batch, heads, kv_heads, seqlen, head_dim, causal))
    return out


DENSE_TABLE = Table([
    Column("backend", "backend", width=11, left=True), Column("B", "batch", width=3),
    Column("H", "n_heads", width=3), Column("Hkv", "n_kv_heads"), Column("D", "head_dim", width=4),
    Column("causal", "causal"), Column("N", "seqlen", width=6), Column("fwd ms", "fwd_ms", ".3f", 8),
    Column("fwd TF/s", "fwd_tflops", ".1f"), Column("bwd ms", "bwd_ms", ".3f", 8),
    Column("bwd TF/s", "bwd_tflops", ".1f")])
DECODE_TABLE = Table([
    Column("backend", "backend", width=12, left=True), Column("B", "batch", width=5),
    Column("H", "heads", width=3), Column("Hkv", "kv_heads"), Column("D", "head_dim", width=4),
    Column("N", "seqlen_k", width=6), Column("us", "us", ".1f", 10), Column("GB/s", "gb_per_s", ".1f", 8),
    Column("vs fa2", "speedup_vs_fa2", ".2f")])


def run_dense(args, dtype, device="cuda") -> list[dict]:
    """Forward and backward of every backend on every cell; prints each row as it is measured."""
    chosen, rows = backends(args.backends), []
    print(DENSE_TABLE.header())
    for c in cases(args):
        times = repeated(lambda attention: measure(attention, c.batch, c.n_heads, c.seqlen, c.head_dim, c.causal,
                                                   dtype, device, args.cuda_graph, c.n_kv_heads),
                         chosen, args.repeats)
        for name, (fwd, bwd) in times.items():
            tflops = lambda ms, direction: ms and flops(c.batch, c.n_heads, c.seqlen, c.head_dim, c.causal,
                                                        direction) / ms / 1e9
            rows.append(dict(backend=name, dtype=str(dtype).removeprefix("torch."), batch=c.batch, n_heads=c.n_heads,
                             n_kv_heads=c.n_kv_heads, seqlen=c.seqlen, head_dim=c.head_dim, causal=c.causal,
                             timing=args.timing, repeats=args.repeats, fwd_ms=fwd, bwd_ms=bwd,
                             fwd_tflops=tflops(fwd, "fwd"), bwd_tflops=tflops(bwd, "bwd")))
            print(DENSE_TABLE.line(rows[-1]), flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def run_decode(args, dtype, device) -> list[dict]:
    """One decode step of every backend on every cell; prints each row as it is measured."""
    chosen, rows = kv_backends(args.backends), []
    print(DECODE_TABLE.header())
    for c in cases(args):
        cache = [torch.randn(c.batch, c.n_kv_heads, max(args.seqlens), c.head_dim, device=device, dtype=dtype)
                 for _ in range(2)]
        q = torch.randn(c.batch, c.n_heads, 1, c.head_dim, device=device, dtype=dtype)
        k, v = (t[:, :, :c.seqlen] for t in cache)  # the model's cache: a prefix of a preallocated buffer
        times = repeated(lambda attention: (measure_decode(attention, q, k, v, args.cuda_graph),), chosen,
                         args.repeats)
        fa2 = times.get("fa2", (None,))[0]
        for name, (ms,) in times.items():
            rows.append(dict(backend=name, batch=c.batch, heads=c.n_heads, kv_heads=c.n_kv_heads,
                             head_dim=c.head_dim, seqlen_k=c.seqlen, us=ms and 1e3 * ms,
                             gb_per_s=ms and 2 * k.numel() * k.element_size() / (ms * 1e6),
                             speedup_vs_fa2=fa2 / ms if fa2 and ms else None,
                             dtype=str(dtype).removeprefix("torch."), timing=args.timing, repeats=args.repeats))
            print(DECODE_TABLE.line(rows[-1]), flush=True)
    return rows


def print_ratios(rows):
    """The first backend's speed over each other one, per cell: time(other) / time(first), fwd and bwd."""
    key = lambda r: (r["head_dim"], r["causal"], r["seqlen"], r["batch"], r["n_heads"], r["n_kv_heads"])
    by_key = {(r["backend"], *key(r)): r for r in rows}
    first, *others = dict.fromkeys(r["backend"] for r in rows)
    if not others:
        return

    def ratios(row, other):
        o = by_key.get((other, *key(row)))
        ratio = lambda d: f"{o[d] / row[d]:.2f}" if o and o[d] and row[d] else "-"
        return f"{ratio('fwd_ms')} / {ratio('bwd_ms')}"

    table = Table([Column("D", "head_dim", width=4), Column("causal", "causal"), Column("N", "seqlen", width=6),
                   *(Column(f"vs {b}", lambda r, b=b: ratios(r, b), width=17) for b in others)])
    print(f"\n{first} speed-up (other time / {first} time), fwd / bwd")
    print(table.render([r for r in rows if r["backend"] == first]))


def fallback_notes(names, device, dtype, head_dims) -> list[str]:
    """One line per (backend, head_dim) that runs another backend's kernels here (``bench.fallback``)."""
    notes = []
    for name in names:
        for head_dim in head_dims:
            runs = fallback(name.removesuffix("_splitkv"), torch.device(device), dtype, head_dim)
            if runs:
                notes.append(f"{name} at head_dim {head_dim}: runs {runs}")
    return notes


def plot_dense(rows, stem: Path) -> list[Path]:
    paths = []
    for head_dim in sorted({r["head_dim"] for r in rows}):
        for causal in (True, False):
            for direction in ("fwd", "bwd"):
                sel = [r for r in rows if r["head_dim"] == head_dim and r["causal"] == causal
                       and r[f"{direction}_tflops"]]
                if not sel:
                    continue
                series = {b: tuple(zip(*[(r["seqlen"], r[f"{direction}_tflops"]) for r in sel if r["backend"] == b]))
                          for b in dict.fromkeys(r["backend"] for r in sel)}
                heads = f"H={sel[0]['n_heads']}/{sel[0]['n_kv_heads']}"
                title = (f"{direction}, head_dim={head_dim}, {heads}, {'causal' if causal else 'non-causal'}, "
                         f"{sel[0]['dtype']}, {sel[0]['timing']} timing")
                path = Path(f"{stem}_{direction}_d{head_dim}_{'causal' if causal else 'full'}.png")
                paths.append(line_plot(path, series, xlabel="sequence length N", ylabel="TFLOP/s", title=title,
                                       log2_x=True))
    return paths


def plot_decode(rows, stem: Path) -> list[Path]:
    paths = []
    for batch in dict.fromkeys(r["batch"] for r in rows):
        sel = [r for r in rows if r["batch"] == batch and r["gb_per_s"]]
        series = {b: tuple(zip(*[(r["seqlen_k"], r["gb_per_s"]) for r in sel if r["backend"] == b]))
                  for b in dict.fromkeys(r["backend"] for r in sel)}
        if series:
            title = f"decode step, B={batch}, H={sel[0]['heads']}/{sel[0]['kv_heads']}, D={sel[0]['head_dim']}"
            paths.append(line_plot(Path(f"{stem}_b{batch}.png"), series, xlabel="cached keys N",
                                   ylabel="K and V GB/s", title=title, log2_x=True))
    return paths


def shape_values(name: str) -> str:
    """Each shape's value of option ``name``, for --help: "grid: 64,128; llama: 128; decode: 64"."""
    def text(value):
        if value is None:
            return "-"
        return ",".join(map(str, value)).lower() if isinstance(value, list) else str(value)

    return "; ".join(f"{shape}: {text(values[name])}" for shape, values in SHAPES.items())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--shape", choices=SHAPES, default="grid", help="which cells (see above)")
    p.add_argument("--backends", type=csv_list(str),
                   help="comma-separated, from model.backends.REGISTRY (decode: also fa2_splitkv); dense shapes "
                        "print ratios against the first, decode a 'vs fa2' column (- without fa2). Default: every "
                        "backend (decode: sdpa,fa2,fa2_splitkv,fa3)")
    p.add_argument("--head-dims", type=csv_list(int),
                   help=f"comma-separated head dimensions D ({shape_values('head_dims')})")
    p.add_argument("--seqlens", type=csv_list(int),
                   help=f"comma-separated sequence lengths N, decode: cached keys ({shape_values('seqlens')})")
    p.add_argument("--causal", type=csv_list(lambda s: s.strip().lower(), ("true", "false")),
                   help=f"comma-separated: true, false, or true,false for both ({shape_values('causal')})")
    p.add_argument("--batch", type=csv_list(int),
                   help=f"comma-separated batch sizes B ({shape_values('batch')}; -: 16k / N)")
    p.add_argument("--heads", type=int, help=f"query heads H ({shape_values('heads')}; -: 2048 / D)")
    p.add_argument("--kv-heads", type=int, help=f"key/value heads ({shape_values('kv_heads')}; -: --heads)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="input dtype; auto: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--out", default="runs/bench_attention", help="folder for CSV, JSON and PNG files")
    p.add_argument("--repeats", type=int, default=1,
                   help="measure each cell this many times, the backends' order alternating, and report the "
                        "median of the repeats (the machine's clock state drifts between measurements, and a "
                        "single reading can come out 10-15%% slow: use an odd count of 3 or more to compare "
                        "kernels, since the median of an even count averages the middle two)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="time calls replayed from a CUDA graph (GPU time alone) instead of eager calls")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The options with the shape's values filled in; SystemExit naming a bad value (checked before any GPU)."""
    args = build_parser().parse_args(argv)
    args.sizes_given = any(getattr(args, name) is not None for name in ("batch", "heads", "head_dims", "seqlens"))
    for name, value in SHAPES[args.shape].items():
        if getattr(args, name) is None:
            setattr(args, name, list(value) if isinstance(value, list) else value)
    args.causal = [c in (True, "true") for c in args.causal]
    check_names(args.backends, extra=(SPLIT_KV,) if args.shape == "decode" else ())
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats}: give 1 or more")
    bad = [d for d in args.head_dims if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM]
    if bad:
        raise SystemExit(f"--head-dims {bad[0]}: the kernels take head dimensions {MIN_HEAD_DIM} to {MAX_HEAD_DIM}")
    heads = [WIDTH // d for d in args.head_dims] if args.heads is None else [args.heads]
    kv_heads = args.kv_heads
    if any(h < 1 or (kv_heads is not None and (kv_heads < 1 or h % kv_heads)) for h in heads):
        raise SystemExit(f"query heads {heads} with key/value heads {args.kv_heads} (--heads, --kv-heads): give "
                         "positive head counts, the query heads a multiple of the key/value heads")
    args.timing = "cuda_graph" if args.cuda_graph else "eager"
    return args


def main(argv=None):
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and (args.shape != "decode" or args.cuda_graph):
        raise SystemExit(f"bench.attention --shape {args.shape}{' --cuda-graph' * args.cuda_graph} needs a CUDA GPU "
                         "(--shape decode runs on the CPU too, as a smoke test)")
    if device == "cpu" and not args.sizes_given:
        raise SystemExit("bench.attention --shape decode on the CPU runs the kernels under Triton's interpreter, where "
                         "the GPU sizes take hours: give small ones, e.g. --dtype float32 --heads 2 --head-dims 16 "
                         "--seqlens 16,70 --batch 1 (--help's smoke test)")
    dtype = getattr(torch, {"cuda": "bfloat16", "cpu": "float32"}[device] if args.dtype == "auto" else args.dtype)
    # Compiled backends (flex) build one static-shape kernel per shape (model/backends/flex_masks.py): room for every case.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(cases(args)) + 8)
    out_dir = results_folder(args.out)
    stem = out_dir / ("attention" if args.shape == "grid" else f"attention_{args.shape}")
    with exit_on_interrupt("bench.attention", "nothing was written (the files are written once every case has run)"):
        rows = run_decode(args, dtype, device) if args.shape == "decode" else run_dense(args, dtype)
    if args.shape != "decode":
        print_ratios(rows)
    notes = fallback_notes(args.backends, device, dtype, args.head_dims)
    print("".join(f"note: {n}\n" for n in notes), end="")
    env = environment(device)
    write_csv(stem.with_suffix(".csv"), rows)
    write_json(stem.with_suffix(".json"), rows, **env, shape=args.shape, notes=notes, args=vars(args))
    for path in (plot_decode if args.shape == "decode" else plot_dense)(rows, stem):
        print("wrote", path)
    print(f"wrote {stem}.csv and {stem.name}.json ({env['device']}, torch {env['torch']}, triton {env['triton']})")
    return rows


if __name__ == "__main__":
    main()
