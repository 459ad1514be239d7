"""Decode-step attention alone: one query per (batch, head) against a KV cache prefix, per kernel.

    python -m bench.decode --out runs/bench_decode          # GPU: bf16, GPT-2 heads (12 x 64), N = 128..16k
    python -m bench.decode --out /tmp/dec --dtype fp32 --heads 2 --head-dim 16 --seqlens 16,70 --batch 1 \\
        --backends sdpa,fa2,fa2_splitkv                      # CPU smoke test (Triton interpreter)

Each backend is the function the model calls in a decode step (the backend's ``kv_attention``; `fa2_splitkv`
is fa2's ``split_kv_attention``, i.e. ``kernels.decode.fa2_decode``), on q (batch, heads, 1, head_dim) and k, v
views of the first N positions of a (batch, kv_heads, max N, head_dim) cache. Times are
``triton.testing.do_bench`` medians on a GPU (after a first call that autotunes), the mean of 3 calls on the
CPU. GB/s counts the K and V bytes read, the floor of a decode step's memory traffic. "vs fa2" is fa2's time
over the backend's. Writes decode.csv and decode.json to --out.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench import HelpFormatter
from bench.generate import DTYPES, csv_list, write_results

BACKENDS = ("sdpa", "fa2", "fa2_splitkv", "fa3", "fa1")
FIELDS = ["backend", "batch", "heads", "kv_heads", "head_dim", "seqlen_k", "us", "gb_per_s", "speedup_vs_fa2", "dtype"]


def attention_fn(backend: str):
    from model.backends import REGISTRY

    if backend == "fa2_splitkv":
        return REGISTRY["fa2"].load().split_kv_attention
    return REGISTRY[backend].load().kv_attention


def measure_us(fn) -> float:
    """Microseconds per call: do_bench's median on a GPU, the mean of 3 calls on the CPU."""
    fn()  # autotune / first-call work
    if torch.cuda.is_available():
        from triton.testing import do_bench

        return 1e3 * do_bench(fn, return_mode="median")
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    return 1e6 * (time.perf_counter() - t0) / 3


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--out", required=True, help="folder for decode.csv and decode.json")
    ap.add_argument("--backends", type=csv_list(str, BACKENDS), default="sdpa,fa2,fa2_splitkv,fa3",
                    help="comma-separated")
    ap.add_argument("--batch", type=csv_list(int), default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--seqlens", type=csv_list(int), default="128,512,1024,4096,16384", help="cached keys N")
    ap.add_argument("--heads", type=int, default=12, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    ap.add_argument("--head-dim", type=int, default=64, help="head dimension D")
    ap.add_argument("--dtype", choices=("auto", *DTYPES), default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    args = ap.parse_args(argv)
    kv_heads = args.kv_heads or args.heads
    if args.heads < 1 or args.head_dim < 1 or args.heads % kv_heads:
        ap.error("--heads and --head-dim must be >= 1, and --heads a multiple of --kv-heads")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype_name = ("bf16" if device == "cuda" else "fp32") if args.dtype == "auto" else args.dtype
    dtype = DTYPES[dtype_name]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    rows = []
    for batch in args.batch:
        cache = [torch.randn(batch, kv_heads, max(args.seqlens), args.head_dim, device=device, dtype=dtype)
                 for _ in range(2)]
        q = torch.randn(batch, args.heads, 1, args.head_dim, device=device, dtype=dtype)
        for n in args.seqlens:
            k, v = (c[:, :, :n] for c in cache)
            for backend in args.backends:
                fn = attention_fn(backend)
                us = measure_us(lambda: fn(q, k, v))
                rows.append(dict(backend=backend, batch=batch, heads=args.heads, kv_heads=kv_heads,
                                 head_dim=args.head_dim, seqlen_k=n, us=us,
                                 gb_per_s=2 * k.numel() * k.element_size() / (us * 1e3), speedup_vs_fa2=None,
                                 dtype=dtype_name))
    fa2 = {(r["batch"], r["seqlen_k"]): r["us"] for r in rows if r["backend"] == "fa2"}
    print(f"{'backend':<12} {'batch':>5} {'N':>6} {'us':>10} {'GB/s':>8} {'vs fa2':>6}")
    for r in rows:
        if (r["batch"], r["seqlen_k"]) in fa2:
            r["speedup_vs_fa2"] = fa2[r["batch"], r["seqlen_k"]] / r["us"]
        speedup = "-" if r["speedup_vs_fa2"] is None else f"{r['speedup_vs_fa2']:.2f}"
        print(f"{r['backend']:<12} {r['batch']:>5} {r['seqlen_k']:>6} {r['us']:>10.1f} {r['gb_per_s']:>8.1f} "
              f"{speedup:>6}")

    write_results(out / "decode", FIELDS, rows, device, args=vars(args))
    return rows


if __name__ == "__main__":
    main()
