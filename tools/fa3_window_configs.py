"""Time the Gluon FA3 forward and backward with a sliding window, or over packed documents, under several tile
configs, beside FA2's and the Gluon full causal on the same inputs, in one process (an H100/H200).

    python -m tools.fa3_window_configs --window 128 --batch 2 --n-heads 128 --head-dim 64     # gpt-oss's layers
    python -m tools.fa3_window_configs --window 1024 --head-dim 128 --forward 2:128:2:0:1,2:64:4:0:1
    python -m tools.fa3_window_configs --median-doc 600                 # bench.masks' packed documents

Causal attention over (B, N, H, D)-ordered memory (the model's), each query seeing itself and the --window keys
before it (`window_size=(window, 0)`); with --median-doc, causal attention within documents of log-normal lengths
packed into the B contexts (`bench.masks`' varlen mode: one (B * N, H, D) packed sequence), FA2's being
`fa2_varlen_attention`'s kernels, and the Gluon kernels' per-row bounds and tile orders made once beforehand (as
a model's layers share them; their cost is printed apart). A forward variant is
NUM_CONSUMERS:BLOCK_N:NUM_STAGES:PINGPONG:PERSISTENT, a backward one NUM_STAGES[:SPLIT_DQ:...:SEPARATE_DQ] (as
`tools.fa3_variants`). Every variant's output is checked against FA2's window (relative error of o, and of dq, dk,
dv), then `triton.testing.do_bench` medians are printed (ms).
The kernels run with each variant passed in (`fa3.run_forward` / `fa3.run_backward`); nothing in `kernels` changes.
Also prints the backward's two passes around the Gluon kernel (delta with the dQ accumulator's zeroing; dQ's cast).
"""

import argparse

import torch

from bench import HelpFormatter
from kernels import fa2, fa3
from kernels.common import bwd_preprocess, empty_like_layout
from tools.fa3_variants import backward_config, check_backward_configs, forward_config, parse_variants, rel

FORWARD_VARIANTS = {64: "2:128:4:1:1,2:64:4:1:1,2:64:6:1:1,3:64:4:1:1,3:128:3:1:1,2:64:4:0:1",
                    96: "2:128:2:0:1,2:64:4:0:1", 128: "2:128:2:0:1,2:64:4:0:1,2:64:3:1:1,2:128:2:1:1"}
BACKWARD_VARIANTS = {64: "2:rows:128,2:rows:64:0:1:128,2:rows:64:0:1:128:1", 96: "2:cols:64,2:rows:64:0:1:128:1",
                     128: "2:cols:64,2:rows:64:0:1:128:1"}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--window", type=int, default=1024, help="keys before each query (window_size[0])")
    parser.add_argument("--median-doc", type=float, default=0,
                        help="packed documents of this median length instead of a window (0: a window)")
    parser.add_argument("--batch", type=int, default=2, help="B")
    parser.add_argument("--n-heads", type=int, default=16, help="H")
    parser.add_argument("--seqlen", type=int, default=8192, help="N")
    parser.add_argument("--head-dim", type=int, default=64, choices=fa3.BACKWARD_HEAD_DIMS,
                        help="D (the head dims of both Gluon kernels)")
    parser.add_argument("--forward", default=None, help="forward variants (default: a few per head_dim)")
    parser.add_argument("--backward", default=None, help="backward variants (default: a few per head_dim)")
    args = parser.parse_args(argv)
    if args.median_doc < 0:
        parser.error(f"--median-doc {args.median_doc}: give a number >= 0 (0: a window)")
    for name in ("window", "batch", "n_heads", "seqlen"):
        if getattr(args, name) < (0 if name == "window" else 1):
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: give a number >= "
                         f"{0 if name == 'window' else 1}")
    d = args.head_dim
    forward_text = FORWARD_VARIANTS[d] if args.forward is None else args.forward
    forward = [forward_config(v) for v in parse_variants(forward_text, forward_config)]
    backward_text = parse_variants(BACKWARD_VARIANTS[d] if args.backward is None else args.backward, backward_config)
    check_backward_configs(backward_text, [d])
    backward = [backward_config(v, fa3.BACKWARD_CONFIGS[d]) for v in backward_text]
    if not torch.cuda.is_available():
        raise SystemExit("tools.fa3_window_configs needs a CUDA GPU")
    import triton.testing

    def bench(fn):
        return triton.testing.do_bench(fn, return_mode="median")

    shape = (args.batch, args.seqlen, args.n_heads, d)
    q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(4))
    window, scale = (args.window, 0), d ** -0.5
    name = f"B={args.batch} H={args.n_heads} N={args.seqlen} D={d} window={args.window}"
    fa2_args = (window,)
    if args.median_doc:  # one packed sequence (B * N, H, D)
        from bench.masks import cu_seqlens, packed_documents

        documents = packed_documents(args.batch, args.seqlen, args.median_doc, 1.0, seed=0)
        cu, total = cu_seqlens(documents, "cuda"), args.batch * args.seqlen
        longest = max(map(max, documents))
        q, k, v, do = (t.transpose(1, 2).reshape(total, args.n_heads, d) for t in (q, k, v, do))
        name = f"B={args.batch} H={args.n_heads} N={args.seqlen} D={d} documents={sum(map(len, documents))}"
        fa2_args = ((-1, -1), cu, cu, longest, longest)
        made = lambda: (fa3.doc_bounds(cu, total, -1, 0), fa3.doc_bounds(cu, total, 0, -1))  # causal
        bounds = made()
        print(f"{name} per-row and per-key bounds (made once per offsets) {bench(made):.3f} ms")
    o_ref, lse_ref = fa2.forward(q, k, v, True, scale, *fa2_args)
    grads_ref = fa2.backward(do, q, k, v, o_ref, lse_ref, True, scale, *fa2_args)
    print(f"{name} fa2 fwd {bench(lambda: fa2.forward(q, k, v, True, scale, *fa2_args)):.3f} ms")
    print(f"{name} fa2 bwd {bench(lambda: fa2.backward(do, q, k, v, o_ref, lse_ref, True, scale, *fa2_args)):.3f} ms")
    if args.median_doc:  # the Gluon kernels on (1, H, B * N, D) views
        _packed(args, name, bench, q, k, v, do, scale, forward, backward, o_ref, grads_ref, *bounds, cu, longest)
        return
    full = fa3.FORWARD_CONFIGS[d, True]
    print(f"{name} fa3 full causal fwd {bench(lambda: fa3.run_forward(q, k, v, True, scale, full)):.3f} ms")
    o_full, lse_full = fa3.run_forward(q, k, v, True, scale, full)
    t = bench(lambda: fa3.run_backward(do, q, k, v, o_full, lse_full, True, scale, fa3.BACKWARD_CONFIGS[d]))
    print(f"{name} fa3 full causal bwd {t:.3f} ms", flush=True)
    for config in forward:
        o, lse = fa3.run_forward(q, k, v, True, scale, config, window)
        t = bench(lambda: fa3.run_forward(q, k, v, True, scale, config, window))
        print(f"{name} fa3 fwd {tuple(config)} {t:.3f} ms (o err {rel(o, o_ref):.1e})", flush=True)
    o, lse = fa3.run_forward(q, k, v, True, scale, fa3.FORWARD_CONFIGS[d, True], window)
    for config in backward:
        grads = fa3.run_backward(do, q, k, v, o, lse, True, scale, config, None, window)
        err = max(rel(g, r) for g, r in zip(grads, grads_ref))
        t = bench(lambda: fa3.run_backward(do, q, k, v, o, lse, True, scale, config, None, window))
        print(f"{name} fa3 bwd {tuple(config)} {t:.3f} ms (max grad err {err:.1e})", flush=True)
    acc = empty_like_layout(q, q.shape, torch.float32)
    dq = torch.empty_like(q)
    print(f"{name} backward passes: delta + zeroed dQ accumulator {bench(lambda: bwd_preprocess(o, do, acc)):.3f} "
          f"ms, dQ cast {bench(lambda: fa3.convert_dq(acc, scale, dq)):.3f} ms")


def _packed(args, name, bench, q, k, v, do, scale, forward, backward, o_ref, grads_ref, key_bounds, query_bounds, cu,
            longest):
    """--median-doc: the Gluon kernels on the packed sequence with each config, checked against FA2's varlen."""
    q, k, v, do = (fa3.packed_view(t) for t in (q, k, v, do))
    fa3_args = dict(key_bounds=key_bounds)
    bwd_args = dict(bounds=(*key_bounds, *query_bounds), cu_seqlens=cu, max_seqlen=longest)
    unpack = lambda t: t[0].transpose(0, 1)
    for config in forward:
        o, _ = fa3.run_forward(q, k, v, True, scale, config, **fa3_args)
        t = bench(lambda: fa3.run_forward(q, k, v, True, scale, config, **fa3_args))
        print(f"{name} fa3 fwd {tuple(config)} {t:.3f} ms (o err {rel(unpack(o), o_ref):.1e})", flush=True)
    o, lse = fa3.run_forward(q, k, v, True, scale, fa3.FORWARD_CONFIGS[args.head_dim, True], **fa3_args)
    for config in backward:
        grads = fa3.run_backward(do, q, k, v, o, lse, True, scale, config, **bwd_args)
        err = max(rel(unpack(g), r) for g, r in zip(grads, grads_ref))
        t = bench(lambda: fa3.run_backward(do, q, k, v, o, lse, True, scale, config, **bwd_args))
        print(f"{name} fa3 bwd {tuple(config)} {t:.3f} ms (max grad err {err:.1e})", flush=True)


if __name__ == "__main__":
    main()

