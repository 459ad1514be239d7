"""Time the cross-entropy kernel's launch configs against inductor's cross-entropy, forward and backward.

    python -m tools.cross_entropy_configs                       # GPT-2 at batch 32 x 1024: 32768 x 50304 bf16
    python -m tools.cross_entropy_configs --configs 8192:16,4096:8 --rows 8192 --vocab 128256

This is the measurement behind `kernels.cross_entropy.CONFIG`. Each config runs `cross_entropy_rows` (the loss of
every row, its gradient written over the logits) on the same logits; the reference is
`torch.compile(F.cross_entropy(logits.float(), targets))` forward and backward, what `model.loss=full` runs. A
config's row says whether its mean loss and its gradient (divided by the rows) match the reference's. Times are
`triton.testing.do_bench` medians (warm-up 10, rep 200). On a CPU the kernel runs under Triton's interpreter and
the reference eagerly: a smoke test at small --rows and --vocab, not a benchmark.
"""

import argparse
import time

import torch
import torch.nn.functional as F

from bench import HelpFormatter, csv_list
from bench.report import Column, Table
from kernels import cross_entropy as ce

CPU_MAX_LOGITS = 100_000
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_config(text: str) -> ce.Config:
    """'BLOCK_V:num_warps', e.g. '8192:16'; BLOCK_V a power of two. Raises argparse.ArgumentTypeError."""
    try:
        block_v, num_warps = (int(x) for x in text.split(":"))
    except ValueError:
        block_v = num_warps = 0
    if block_v < 1 or block_v & (block_v - 1) or num_warps not in (1, 2, 4, 8, 16, 32):
        raise argparse.ArgumentTypeError(f"{text!r}: expected BLOCK_V:num_warps, BLOCK_V a power of two and "
                                         "num_warps one of 1, 2, 4, 8, 16, 32 (e.g. 8192:16)")
    return ce.Config(block_v, num_warps)


def timer(device: torch.device):
    """Milliseconds of fn(): do_bench's median on a GPU, one call's wall time on a CPU."""
    if device.type == "cuda":
        import triton

        return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=200, return_mode="median")

    def once(fn):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return once


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--rows", type=int, default=32768, help="tokens (rows of logits)")
    ap.add_argument("--vocab", type=int, default=50304, help="vocabulary (columns of logits)")
    ap.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    ap.add_argument("--configs", type=csv_list(parse_config), default="8192:16,4096:8,2048:8,8192:8,4096:16",
                    help="comma-separated BLOCK_V:num_warps, the first kernels.cross_entropy.CONFIG")
    args = ap.parse_args(argv)
    if args.rows < 1 or args.vocab < 1:
        ap.error(f"--rows {args.rows} --vocab {args.vocab}: both must be >= 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and args.rows * args.vocab > CPU_MAX_LOGITS:
        ap.error(f"--rows {args.rows} --vocab {args.vocab}: without a CUDA GPU the kernel runs under Triton's "
                 f"interpreter, a smoke test of at most {CPU_MAX_LOGITS:,} logits (e.g. --rows 8 --vocab 97)")
    interpret, ce.INTERPRET_ON_CPU = ce.INTERPRET_ON_CPU, True  # on a CPU the kernel itself, not its torch stand-in
    try:
        return measure(args, device)
    finally:
        ce.INTERPRET_ON_CPU = interpret


def measure(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """The reference's row, then one per config; prints them as a table."""
    bench = timer(device)
    logits = (torch.randn(args.rows, args.vocab, device=device) * 2).to(DTYPES[args.dtype])
    targets = torch.randint(0, args.vocab, (args.rows,), device=device)
    leaf = logits.clone().requires_grad_()
    loss_fn = lambda x: F.cross_entropy(x.float(), targets)  # noqa: E731
    reference = torch.compile(loss_fn) if device.type == "cuda" else loss_fn

    def run_reference():
        leaf.grad = None
        reference(leaf).backward()
    ms_reference = bench(run_reference)
    ref_loss = reference(leaf).item()
    rows = [dict(impl="inductor" if device.type == "cuda" else "torch (eager)", block_v=None, num_warps=None,
                 ms=ms_reference, speedup=None, matches=True)]
    buffer = logits.clone()
    for config in args.configs:
        buffer.copy_(logits)
        loss = (ce.cross_entropy_rows(buffer, targets, config=config).sum() / args.rows).item()
        matches = abs(loss - ref_loss) < 1e-3 * max(1.0, abs(ref_loss)) and torch.allclose(
            buffer.float() / args.rows, leaf.grad.float(), atol=2e-3 / args.rows, rtol=2e-2)
        ms = bench(lambda: ce.cross_entropy_rows(buffer, targets, config=config))  # gradient over gradient: same work
        rows.append(dict(impl="kernel", block_v=config.block_v, num_warps=config.num_warps, ms=ms,
                         speedup=ms_reference / ms if device.type == "cuda" else None, matches=matches))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (interpreter: not a benchmark)"
    print(f"{args.rows} x {args.vocab} {args.dtype} logits, {name}, torch {torch.__version__}")
    print(Table([Column("impl", "impl", width=14, left=True), Column("BLOCK_V", "block_v"),
                 Column("warps", "num_warps"), Column("ms", "ms", ".3f", width=8), Column("x ref", "speedup", ".2f"),
                 Column("matches", "matches")]).render(rows))
    return rows


if __name__ == "__main__":
    main()
