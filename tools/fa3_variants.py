"""Check and time variants of the Gluon FA3 forward (or backward) side by side in one process (an H100/H200).

    python -m tools.fa3_variants --variants 2:128:2:1:1,2:128:2:1:0 --head-dims 128 --seqlens 4096,16384
    python -m tools.fa3_variants --backward --variants 2:cols,1:cols --head-dims 128 --seqlens 2048,8192

Backward: a variant is the first fields of
NUM_STAGES:SPLIT_DQ:BLOCK_M:SECTION_HEADS:NUM_CONSUMERS:MAXNREG:SEPARATE_DQ:LOCKSTEP:HEADS_PER_CTA
(a `kernels.fa3.BackwardConfig`, the fields left out as in `BACKWARD_CONFIGS[head_dim]`; SPLIT_DQ is cols or rows;
SECTION_HEADS the launch order, 0 for a wave's worth; NUM_CONSUMERS 1 or 2; MAXNREG registers a thread, 0 for
Triton's choice; SEPARATE_DQ 1 for FA2's dQ kernel after the Gluon one; LOCKSTEP 1 for the query blocks last to
first, the group's heads inner; HEADS_PER_CTA the most query heads of a GQA group a CTA takes, the largest divisor
of the group up to it, 0 for all of them); each is checked against float32 gradients
(dq, dk, dv by relative error) on the shapes below, then backward medians of the Gluon kernel are printed next to
FA2's backward and cuDNN's on the same inputs (forward excluded).
Forward: a variant is NUM_CONSUMERS:BLOCK_N:NUM_STAGES:PINGPONG:PERSISTENT[:LATE_K_RELEASE[:TAIL]] (a
`kernels.fa3.ForwardConfig`), run
for both values of causal. The kernels run with each variant's config passed in (`fa3.run_forward` /
`fa3.run_backward`); nothing in `kernels` is changed. Every variant is first checked against a
float32 reference (SDPA's math kernel on upcast inputs) on odd lengths, seqlen_q != seqlen_k both ways, GQA and
strided views, with NaN-poisoned outputs; then forward medians (`triton.testing.do_bench`) are printed next to FA2's
forward and SDPA's cuDNN kernel on the same inputs (B * N = 16k, H * D = 2048).
"""

import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench import HelpFormatter
from bench.attention import TOKENS, WIDTH, flops
from kernels import fa2, fa3

CHECKS = [  # (batch, n_heads, n_kv_heads, seqlen_q, seqlen_k, causal, strided)
    (2, 4, 4, 1000, 1000, True, False), (1, 4, 4, 3001, 3001, False, True), (1, 8, 2, 777, 777, True, True),
    (1, 2, 2, 300, 1000, True, False), (1, 2, 2, 1000, 300, True, False), (2, 2, 2, 5, 5, True, False),
    (1, 2, 2, 200, 70, False, False), (1, 16, 16, 4096, 4096, True, True),
]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check(head_dim, dtype, config):
    worst = 0.0
    for batch, n_heads, n_kv, seqlen_q, seqlen_k, causal, strided in CHECKS:
        if strided:  # the model's layout: (B, T, H, D) in memory, seen as (B, H, T, D)
            q = torch.randn(batch, seqlen_q, n_heads, head_dim, device="cuda", dtype=dtype).transpose(1, 2)
            k, v = (torch.randn(batch, seqlen_k, n_kv, head_dim, device="cuda", dtype=dtype).transpose(1, 2)
                    for _ in range(2))
        else:
            q = torch.randn(batch, n_heads, seqlen_q, head_dim, device="cuda", dtype=dtype)
            k, v = (torch.randn(batch, n_kv, seqlen_k, head_dim, device="cuda", dtype=dtype) for _ in range(2))
        reason = fa3.gluon_unsupported_reason(q, k, v)
        if reason:
            raise SystemExit(f"the Gluon kernels do not apply: {reason}")
        empty = torch.empty
        poison = lambda t: t.fill_(float("nan")) if t.is_floating_point() else t
        torch.empty = lambda *a, **kw: poison(empty(*a, **kw))  # poison o and lse
        try:
            o, lse = fa3.run_forward(q, k, v, causal, 1 / math.sqrt(head_dim), config)
        finally:
            torch.empty = empty
        group = n_heads // n_kv
        kr, vr = (t.repeat_interleave(group, 1).float() for t in (k, v))
        s = q.float() @ kr.transpose(-1, -2) / math.sqrt(head_dim)
        if causal:
            i = torch.arange(seqlen_q, device="cuda")[:, None]
            j = torch.arange(seqlen_k, device="cuda")[None, :]
            s = s.masked_fill(j > i + seqlen_k - seqlen_q, float("-inf"))
        lse_ref = torch.logsumexp(s, -1) / math.log(2)
        o_ref = torch.softmax(s, -1).nan_to_num(0.0) @ vr
        seen = torch.isfinite(lse_ref)
        assert torch.isfinite(o).all(), "NaN in o"
        assert torch.equal(lse[~seen], torch.full_like(lse[~seen], float("inf"))), "rows that see no key"
        err = max(rel(o, o_ref), rel(lse[seen], lse_ref[seen]))
        assert o.stride() == q.stride() or not strided, "o not in q's memory order"
        worst = max(worst, err)
        del s
    assert worst < 1e-2, worst
    return worst


def check_backward(head_dim, dtype, config):
    """Worst relative error of the Gluon backward's dq, dk, dv against float32 autograd over CHECKS."""
    worst = 0.0
    for batch, n_heads, n_kv, seqlen_q, seqlen_k, causal, strided in CHECKS:
        if seqlen_q * seqlen_k * n_heads * batch > 2**27:
            continue  # keep the float32 reference small
        def make(heads, seqlen):
            if strided:
                return torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=dtype).transpose(1, 2)
            return torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=dtype)
        q, k, v, do = make(n_heads, seqlen_q), make(n_kv, seqlen_k), make(n_kv, seqlen_k), make(n_heads, seqlen_q)
        scale = 1 / math.sqrt(head_dim)
        o, lse = fa2.forward(q, k, v, causal, scale)
        dq, dk, dv = fa3.run_backward(do, q, k, v, o, lse, causal, scale, config)
        leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
        group = n_heads // n_kv
        s = leaves[0] @ leaves[1].repeat_interleave(group, 1).transpose(-1, -2) * scale
        if causal:
            i = torch.arange(seqlen_q, device="cuda")[:, None]
            s = s.masked_fill(torch.arange(seqlen_k, device="cuda")[None, :] > i + seqlen_k - seqlen_q, float("-inf"))
        (torch.softmax(s, -1).nan_to_num(0.0) @ leaves[2].repeat_interleave(group, 1)).backward(do.float())
        for got, leaf in zip((dq, dk, dv), leaves):
            assert torch.isfinite(got).all(), "non-finite gradient"
            worst = max(worst, rel(got, leaf.grad))
    assert worst < 1e-2, worst
    return worst


def main_backward(args, dtype):
    from triton.testing import do_bench

    for head_dim in map(int, args.head_dims.split(",")):
        variants = {variant: backward_config(variant, fa3.BACKWARD_CONFIGS[head_dim]) for variant in args.variants}
        for variant, config in variants.items():
            try:
                print(f"D={head_dim} bwd {variant}: max rel err {check_backward(head_dim, dtype, config):.2e}",
                      flush=True)
            except Exception as e:
                print(f"D={head_dim} bwd {variant}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        for causal in (True, False):
            for seqlen in map(int, args.seqlens.split(",")):
                batch, n_heads = max(1, TOKENS // seqlen), WIDTH // head_dim
                q, do = (torch.randn(batch, n_heads, seqlen, head_dim, device="cuda", dtype=dtype) for _ in range(2))
                k, v = (torch.randn(batch, n_heads // args.group, seqlen, head_dim, device="cuda", dtype=dtype)
                        for _ in range(2))
                tf = lambda ms: flops(batch, n_heads, seqlen, head_dim, causal, "bwd") / ms / 1e9
                o, lse = fa2.forward(q, k, v, causal, 0.1)
                cells = {}
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=args.group > 1)
                cells["cudnn"] = do_bench(lambda: out.backward(do, retain_graph=True), grad_to_none=leaves,
                                          return_mode="median")
                cells["fa2"] = do_bench(lambda: fa2.backward(do, q, k, v, o, lse, causal, 0.1), return_mode="median")
                for variant, config in variants.items():
                    try:
                        cells[variant] = do_bench(
                            lambda: fa3.run_backward(do, q, k, v, o, lse, causal, 0.1, config), return_mode="median")
                    except Exception as e:
                        print(f"  {variant} failed: {type(e).__name__}: {str(e)[:200]}")
                line = " ".join(f"{name}={tf(ms):.0f}" for name, ms in cells.items())
                print(f"D={head_dim} causal={causal} N={seqlen} TFLOP/s bwd: {line} | /cudnn "
                      + " ".join(f"{name}={cells['cudnn'] / ms:.3f}" for name, ms in cells.items()), flush=True)


FORWARD_DEFAULT = "2:128:2:1:1,2:128:2:1:0"
BACKWARD_DEFAULT = "2,2:cols:64"  # each head_dim's config, and one that fits both head dims


def parse_variants(text, config):
    """'a:b:c,d:e:f' -> ['a:b:c', 'd:e:f'], each checked by `config` (forward_config or backward_config), which
    raises SystemExit naming a variant it cannot read."""
    variants = text.split(",")
    for variant in variants:
        if not variant:
            raise SystemExit(f"--variants {text!r}: an empty variant; give comma-separated variants (see --help)")
        config(variant)
    return variants


def _positive_ints(option, text, accepted=None):
    """'a,b' -> [a, b] for --head-dims / --seqlens: SystemExit naming `option` for anything but positive integers
    (or, with `accepted`, one of those)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or any(v < 1 or (accepted and v not in accepted) for v in values):
        wanted = f"one or more of {', '.join(map(str, accepted))}" if accepted else "positive integers"
        raise SystemExit(f"{option} {text!r}: give comma-separated {wanted}")
    return values


def _ints(variant, fields):
    try:
        return [int(x) for x in fields]
    except ValueError:
        raise SystemExit(f"variant {variant!r}: give colon-separated integers (see --help)") from None


def backward_config(variant, default=fa3.BackwardConfig(2, "cols", 64)):
    """The first fields of 'NUM_STAGES:SPLIT_DQ:BLOCK_M:SECTION_HEADS:NUM_CONSUMERS:MAXNREG:SEPARATE_DQ:LOCKSTEP:
    HEADS_PER_CTA' -> a `kernels.fa3.BackwardConfig`, the fields left out taken from `default`; SPLIT_DQ is cols or
    rows, BLOCK_M 64 or 128, SECTION_HEADS 0 or more, NUM_CONSUMERS 1 or 2, MAXNREG 0 (Triton's choice) or
    registers a thread, SEPARATE_DQ and LOCKSTEP 0 or 1, HEADS_PER_CTA 0 (the whole group) or more."""
    fields = variant.split(":")
    if not 1 <= len(fields) <= 9:
        raise SystemExit(f"backward variant {variant}: give 1 to 9 fields (see --help)")
    if len(fields) >= 2 and fields[1] not in ("cols", "rows"):
        raise SystemExit(f"backward variant {variant}: SPLIT_DQ {fields[1]!r}; accepted cols, rows")
    if len(fields) >= 3 and fields[2] not in ("64", "128"):
        raise SystemExit(f"backward variant {variant}: BLOCK_M {fields[2]}; accepted 64, 128")
    if len(fields) >= 4 and not fields[3].isdigit():
        raise SystemExit(f"backward variant {variant}: SECTION_HEADS {fields[3]}; give 0 or more")
    if len(fields) >= 5 and fields[4] not in ("1", "2"):
        raise SystemExit(f"backward variant {variant}: NUM_CONSUMERS {fields[4]}; accepted 1, 2")
    if len(fields) >= 6 and not fields[5].isdigit():
        raise SystemExit(f"backward variant {variant}: MAXNREG {fields[5]}; give 0 or more")
    for name, field in zip(("SEPARATE_DQ", "LOCKSTEP"), fields[6:8]):
        if field not in ("0", "1"):
            raise SystemExit(f"backward variant {variant}: {name} {field}; accepted 0, 1")
    if len(fields) >= 9 and not fields[8].isdigit():
        raise SystemExit(f"backward variant {variant}: HEADS_PER_CTA {fields[8]}; give an integer, 0 or more")
    try:
        num_stages = int(fields[0])
    except ValueError:
        raise SystemExit(f"backward variant {variant}: NUM_STAGES is an integer (see --help)") from None
    if num_stages < 1:
        raise SystemExit(f"backward variant {variant}: NUM_STAGES {num_stages}; give 1 or more")
    return default._replace(num_stages=num_stages, **dict(zip(
        ("split_dq", "block_m", "section_heads", "num_consumers", "maxnreg", "separate_dq", "lockstep",
         "heads_per_cta"),
        (*fields[1:2], *(int(x) for x in fields[2:6]), *(bool(int(x)) for x in fields[6:8]),
         *(int(x) for x in fields[8:])))))


def check_backward_configs(variants, head_dims, groups=(1,)):
    """SystemExit naming a backward variant the Gluon kernel cannot run at one of head_dims and GQA group sizes
    (`BackwardConfig.dq_box`'s and `reduces_kv`'s rules), before any GPU is looked for."""
    for head_dim in head_dims:
        if head_dim not in fa3.BACKWARD_CONFIGS:
            raise SystemExit(f"--head-dims {head_dim}: the Gluon backward takes "
                             f"{', '.join(map(str, fa3.BACKWARD_HEAD_DIMS))}")
        for variant in variants:
            try:
                config = backward_config(variant, fa3.BACKWARD_CONFIGS[head_dim])
                for group in groups:
                    config.reduces_kv(fa3.kernel_head_dim(head_dim), group)
            except ValueError as e:
                raise SystemExit(f"backward variant {variant} at head_dim {head_dim}: {e}") from None


def forward_config(variant):
    """'NUM_CONSUMERS:BLOCK_N:NUM_STAGES:PINGPONG:PERSISTENT[:LATE_K_RELEASE[:TAIL]]' (ints) -> a
    `kernels.fa3.ForwardConfig`."""
    fields = _ints(variant, variant.split(":"))
    if len(fields) not in (5, 6, 7):
        raise SystemExit(f"variant {variant}: give 5 to 7 fields (see --help)")
    return fa3.ForwardConfig(*fields[:3], *(bool(f) for f in fields[3:]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--variants", default=None,
                        help="comma-separated "
                             "NUM_CONSUMERS:BLOCK_N:NUM_STAGES:PINGPONG:PERSISTENT[:LATE_K_RELEASE[:TAIL]] (default "
                             f"{FORWARD_DEFAULT}); with --backward "
                             f"NUM_STAGES[:SPLIT_DQ:...:HEADS_PER_CTA] (default {BACKWARD_DEFAULT}; see above)")
    parser.add_argument("--head-dims", default="64,128", help="comma-separated head dimensions D")
    parser.add_argument("--seqlens", default="2048,8192", help="comma-separated sequence lengths N")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="input dtype")
    parser.add_argument("--backward", action="store_true", help="check and time the Gluon backward instead")
    parser.add_argument("--group", type=int, default=1,
                        help="query heads per key/value head (GQA) in the timed backward shapes (divides 2048 / D)")
    args = parser.parse_args(argv)
    # Checked before the GPU is looked for, so a typo is caught on any machine.
    default = BACKWARD_DEFAULT if args.backward else FORWARD_DEFAULT
    args.variants = parse_variants(default if args.variants is None else args.variants,
                                   backward_config if args.backward else forward_config)
    head_dims = _positive_ints("--head-dims", args.head_dims, fa3.HEAD_DIMS)
    _positive_ints("--seqlens", args.seqlens)
    for head_dim in head_dims:
        if args.group < 1 or (WIDTH // head_dim) % args.group:
            raise SystemExit(f"--group {args.group}: give a divisor of the {WIDTH // head_dim} heads at head_dim "
                             f"{head_dim}")
    if args.backward:
        # the timed group and the checked shapes' (`CHECKS`)
        groups = {args.group} | {n_heads // n_kv for _, n_heads, n_kv, *_ in CHECKS}
        check_backward_configs(args.variants, head_dims, sorted(groups))
    if not torch.cuda.is_available():
        raise SystemExit("tools.fa3_variants needs a CUDA GPU (an sm_90 one for the Gluon kernels)")
    from triton.testing import do_bench

    dtype = getattr(torch, args.dtype)
    if args.backward:
        return main_backward(args, dtype)
    for head_dim in map(int, args.head_dims.split(",")):
        variants = {variant: forward_config(variant) for variant in args.variants}
        for variant, config in variants.items():
            try:
                print(f"D={head_dim} variant {variant}: max rel err {check(head_dim, dtype, config):.2e}", flush=True)
            except Exception as e:  # report and keep going with the next variant
                print(f"D={head_dim} variant {variant}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        for causal in (True, False):
            for seqlen in map(int, args.seqlens.split(",")):
                batch, n_heads = max(1, TOKENS // seqlen), WIDTH // head_dim
                q, k, v = (torch.randn(batch, n_heads, seqlen, head_dim, device="cuda", dtype=dtype) for _ in range(3))
                tf = lambda ms: flops(batch, n_heads, seqlen, head_dim, causal, "fwd") / ms / 1e9
                cells = {}
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    cells["cudnn"] = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                              return_mode="median")
                cells["fa2"] = do_bench(lambda: fa2.forward(q, k, v, causal, 0.1), return_mode="median")
                for variant, config in variants.items():
                    try:
                        cells[variant] = do_bench(lambda: fa3.run_forward(q, k, v, causal, 0.1, config),
                                                  return_mode="median")
                    except Exception as e:
                        print(f"  {variant} failed: {type(e).__name__}: {str(e)[:200]}")
                line = " ".join(f"{name}={tf(ms):.0f}" for name, ms in cells.items())
                print(f"D={head_dim} causal={causal} N={seqlen} TFLOP/s fwd: {line} | fa3/cudnn "
                      + " ".join(f"{cells['cudnn'] / ms:.3f}" for name, ms in cells.items() if ":" in name), flush=True)


if __name__ == "__main__":
    main()
