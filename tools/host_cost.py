"""Host time of eager attention calls: microseconds of CPU per call, at a size where the GPU keeps up.

    python -m tools.host_cost                                   # head_dim 64, N 1024, causal
    python -m tools.host_cost --head-dim 128 --causal false --calls 400 --rounds 5
    python -m tools.host_cost --documents 4              # also the packed-sequence calls, as a document mask makes

Each row calls one function `--calls` times in a row on the same inputs (B 1, H 2, bf16: a few microseconds of
GPU work a call), after 20 warm-up calls, then synchronises; a row's figure is the best of `--rounds` rounds,
because the host is noisy at this level (the same call varies up to 2x between processes on the GPU machines).
Rows: the entry points the custom ops call (`kernels.fa3.forward` / `backward`, `kernels.fa2.forward` /
`backward`), the public `fa3_attention` forward and its backward through autograd (`retain_graph=True`), and
PyTorch's SDPA forward for scale. With --documents D > 0 also the packed-sequence entry points with the
arguments a model's document mask gives them (`fa3.forward(..., cu_seqlens, cu_seqlens, N, N)`, the rows cut into
D documents of about equal length; what the compiled training step's custom ops run). An eager call that costs
more host time than its kernels take leaves the GPU waiting: `bench.attention`'s short cells and a host-bound training step (docs/benchmarks.md, "Launches past
Triton's binder").

On a CPU the kernels run under Triton's interpreter: a smoke test at a small --seqlen, not a benchmark.

With --stub-launches (any machine, any --seqlen) the fa3 rows time fa3's Gluon path with no kernel run: Hopper
faked, every launch's compiled kernel replaced by a stand-in that does nothing, the helper kernels (delta, the
packed-sequence bounds and orders, FA2's dQ pass) by allocations of their outputs. A row is then the Python and
the allocations of a call: what a change to the host path moves, measurable without a GPU (the GPU machines'
hosts have run the same code about 2.2x slower).
"""

import argparse
import contextlib
import time
from unittest import mock

import torch
import torch.nn.functional as F

from bench import HelpFormatter
import model.backends  # noqa: F401 (first: it sets TRITON_INTERPRET without a GPU, which kernels reads on import)
from kernels import fa2, fa3, fa3_attention, launch as launch_mod

CPU_MAX_SEQLEN = 64
STUB_MAX_SEQLEN = 65536


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r}: expected true or false")


def per_call(fn, calls: int, rounds: int, sync) -> float:
    """Best of `rounds` rounds of `calls` calls of fn (after 20 warm-up calls): microseconds a call."""
    best = float("inf")
    for _ in range(rounds):
        for _ in range(20):
            fn()
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def packed_rows(q, k, v, do, causal: bool, scale: float, documents: int) -> dict:
    """The packed-sequence calls of the ops' entry points: (1, H, N, D) inputs as N packed rows in `documents`
    documents of about equal length."""
    n = q.shape[2]
    cu = torch.linspace(0, n, documents + 1, device=q.device).round().to(torch.int32)
    q, k, v, do = (t[0].transpose(0, 1) for t in (q, k, v, do))  # (N, H, D) views, as the model packs them
    mask = ((-1, -1), cu, cu, n, n)
    o3, lse3 = fa3.forward(q, k, v, causal, scale, *mask)
    o2, lse2 = fa2.forward(q, k, v, causal, scale, *mask)
    return {
        "fa3.forward (packed)": lambda: fa3.forward(q, k, v, causal, scale, *mask),
        "fa3.backward (packed)": lambda: fa3.backward(do, q, k, v, o3, lse3, causal, scale, *mask),
        "fa2.forward (packed)": lambda: fa2.forward(q, k, v, causal, scale, *mask),
        "fa2.backward (packed)": lambda: fa2.backward(do, q, k, v, o2, lse2, causal, scale, *mask),
    }


class _NoKernel:
    """A compiled kernel's stand-in: its launcher does nothing."""

    def __getitem__(self, grid):
        return lambda *args: None


@contextlib.contextmanager
def stubbed_launches():
    """fa3's Gluon path on any machine with no kernel run (see the module docstring); everything patched is put
    back on exit, and fa3's remembered call signatures are forgotten on entry and exit."""
    real_launch = launch_mod.launch

    def launch(kernel, grid, *args, key=None, **kwargs):
        entry = launch_mod._kernel(kernel)
        if entry is None:  # an interpreted Triton kernel: skipped
            return
        key = ("stub",) if key is None else key
        entry.launchers.setdefault((0, key), launch_mod._Launcher(_NoKernel(), {}))
        real_launch(kernel, grid, *args, key=key, **kwargs)

    new = lambda *shape, dtype=torch.float32: torch.empty(*shape, dtype=dtype)
    bounds = lambda cu_seqlens, total, *edges: (new(total, dtype=torch.int32), new(total, dtype=torch.int32))
    with mock.patch.multiple(fa3, gluon_device_reason=lambda device: None, _sm_count=lambda device: 132,
                             use_tma=lambda *tensors: True, doc_bounds=bounds,
                             bwd_preprocess=lambda o, do, dq_acc=None: new(o.shape[:3]),
                             tile_order=lambda *args: new(args[-1], dtype=torch.int32),
                             block_order=lambda *args: new(64, dtype=torch.int32)), \
            mock.patch.object(fa2, "backward_dq", lambda *args, **kwargs: None), \
            mock.patch.multiple(launch_mod, launch=launch, _current_device=lambda: 0, _KERNELS={}):
        fa3.clear_caches()
        try:
            yield
        finally:
            fa3.clear_caches()


def stubbed_rows(q, k, v, do, causal: bool, scale: float, documents: int) -> dict:
    """--stub-launches' rows: fa3's entry points, and with documents > 0 their packed-sequence calls."""
    o, lse = fa3.forward(q, k, v, causal, scale)
    rows = {"fa3.forward": lambda: fa3.forward(q, k, v, causal, scale),
            "fa3.backward": lambda: fa3.backward(do, q, k, v, o, lse, causal, scale)}
    if documents:
        packed = {name: fn for name, fn in packed_rows(q, k, v, do, causal, scale, documents).items()
                  if name.startswith("fa3")}
        rows.update(packed)
    return rows


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--head-dim", type=int, default=64, choices=(64, 96, 128), help="D")
    ap.add_argument("--seqlen", type=int, default=1024, help="N (queries and keys)")
    ap.add_argument("--causal", type=_bool, default=True, help="true or false")
    ap.add_argument("--calls", type=int, default=400, help="calls a round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds a row (its figure: the best)")
    ap.add_argument("--documents", type=int, default=0,
                    help="also time the packed-sequence calls over this many documents (0: not)")
    ap.add_argument("--stub-launches", action="store_true",
                    help="time only fa3's host path, no kernel run, on any machine (see above)")
    args = ap.parse_args(argv)
    if args.seqlen < 1 or args.calls < 1 or args.rounds < 1:
        ap.error(f"--seqlen {args.seqlen} --calls {args.calls} --rounds {args.rounds}: each must be >= 1")
    if not 0 <= args.documents <= args.seqlen:
        ap.error(f"--documents {args.documents}: accepted 0 (none) to --seqlen ({args.seqlen})")
    if args.stub_launches:
        if args.seqlen > STUB_MAX_SEQLEN:
            ap.error(f"--seqlen {args.seqlen}: with --stub-launches at most {STUB_MAX_SEQLEN} (the inputs and outputs "
                     "are allocated in this machine's memory on every call)")
        return _main_stubbed(args)
    cuda = torch.cuda.is_available()
    if not cuda and args.seqlen > CPU_MAX_SEQLEN:
        ap.error(f"--seqlen {args.seqlen}: without a CUDA GPU the kernels run under Triton's interpreter, a smoke "
                 f"test of at most {CPU_MAX_SEQLEN} positions (e.g. --seqlen 32 --calls 1 --rounds 1)")
    device = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    causal, scale = args.causal, args.head_dim ** -0.5
    q, k, v, do = (torch.randn(1, 2, args.seqlen, args.head_dim, device=device, dtype=torch.bfloat16)
                   for _ in range(4))
    o3, lse3 = fa3.forward(q, k, v, causal, scale)
    o2, lse2 = fa2.forward(q, k, v, causal, scale)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fa3_attention(*leaves, causal=causal)
    rows = {
        "fa3.forward": lambda: fa3.forward(q, k, v, causal, scale),
        "fa3.backward": lambda: fa3.backward(do, q, k, v, o3, lse3, causal, scale),
        "fa2.forward": lambda: fa2.forward(q, k, v, causal, scale),
        "fa2.backward": lambda: fa2.backward(do, q, k, v, o2, lse2, causal, scale),
        "fa3_attention forward": lambda: fa3_attention(*leaves, causal=causal),
        "fa3_attention backward (autograd)": lambda: out.backward(do, retain_graph=True),
        "sdpa forward": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    }
    if args.documents:
        rows.update(packed_rows(q, k, v, do, causal, scale, args.documents))
    name = torch.cuda.get_device_name() if cuda else "CPU (interpreter: not a benchmark)"
    docs = f", {args.documents} documents in the packed rows" if args.documents else ""
    print(f"host us per eager call: B 1, H 2, N {args.seqlen}, D {args.head_dim}, causal {causal}{docs}, bf16; {name}, "
          f"torch {torch.__version__}; best of {args.rounds} rounds of {args.calls} calls")
    return _time_rows(rows, args.calls, args.rounds, sync)


def _time_rows(rows: dict, calls: int, rounds: int, sync) -> dict[str, float]:
    times = {}
    for label, fn in rows.items():
        times[label] = per_call(fn, calls, rounds, sync)
        print(f"  {label:36s} {times[label]:9.1f}", flush=True)
    return times


def _main_stubbed(args) -> dict[str, float]:
    causal, scale = args.causal, args.head_dim ** -0.5
    q, k, v, do = (torch.randn(1, 2, args.seqlen, args.head_dim, dtype=torch.bfloat16) for _ in range(4))
    docs = f", {args.documents} documents in the packed rows" if args.documents else ""
    print(f"host us per fa3 call, launches stubbed (no kernel runs): B 1, H 2, N {args.seqlen}, D {args.head_dim}, "
          f"causal {causal}{docs}, bf16 on the CPU; torch {torch.__version__}; best of {args.rounds} rounds of "
          f"{args.calls} calls")
    with stubbed_launches():
        return _time_rows(stubbed_rows(q, k, v, do, causal, scale, args.documents), args.calls, args.rounds,
                          lambda: None)


if __name__ == "__main__":
    main()
