"""Kernel benchmark of the attention masks: sliding windows and packed documents, fa3 and fa2 against FlexAttention
and SDPA with a dense boolean mask (PyTorch's pick, and pinned to cuDNN), forward and backward.

    python -m bench.masks                                   # both modes, bf16, head_dim 64, N = 8192
    python -m bench.masks --mode window --seqlen 8192 --window 1024
    python -m bench.masks --mode varlen --seqlen 8192 --median-doc 600 --out runs/bench_masks
    python -m bench.masks --mode window --batch 2 --n-heads 128 --seqlen 8192 --window 128   # gpt-oss's layers
    python -m bench.masks --mode varlen --cuda-graph        # GPU time without the host's launch cost
    python -m bench.masks --mode varlen --deterministic     # the bit-reproducible backwards' cost

window: causal attention of B = --batch sequences of N = --seqlen tokens, in full (`fa3_full`, `fa2_full`) and
with each query seeing itself and the --window keys before it: fa3 / fa2 `window_size=(window, 0)`, Flex a
sliding-window block mask, SDPA a dense mask (`sdpa_dense`: PyTorch picks the kernel; `sdpa_cudnn`: pinned to
cuDNN, whose sliding-window support torch's SDPA does not expose). The windows are built to run >= 3x faster
than the full causal at N = 8192, window 1024.
varlen: documents with log-normal lengths (median --median-doc tokens, sigma --sigma, like web text) packed
back to back into B contexts of N tokens (the last document of a context is cut at its end, as a packing
loader does); causal attention within each document: fa3_varlen_attention and fa2_varlen_attention, Flex with
a document block mask, SDPA with a dense mask. The B contexts are one sequence of B * N tokens for every backend (no document
crosses a context's end, so the mask is the same), which the packed (total, H, D) layout of fa2 views
without a copy. fa2 is built to be >= 1.2x Flex here.

FLOPs are counted over the visible (query, key) pairs only (fa2_full: all causal pairs): 4 * H * D per pair
forward, 2.5x that backward (the FlashAttention papers' convention, as bench.attention). Times are
`triton.testing.do_bench` medians (bench.attention.measure). Prints a table and writes masks.csv and masks.json
into --out.
"""

import argparse
import math
import os
import random

import torch
import torch.nn.functional as F

from bench import HelpFormatter, exit_on_interrupt, results_folder
from bench.attention import measure
from bench.report import Column, Table, environment, write_csv, write_json


# ---------------------------------------------------------------------------------------------- masks
def document_lengths(rng: random.Random, seqlen: int, median: float, sigma: float) -> list[int]:
    """Lengths of the documents packed into one context of seqlen tokens: log-normal draws (at least 1 token),
    the last one cut so that they sum to seqlen."""
    lengths = []
    while sum(lengths) < seqlen:
        lengths.append(max(1, round(rng.lognormvariate(math.log(median), sigma))))
    lengths[-1] -= sum(lengths) - seqlen
    return lengths


def packed_documents(batch: int, seqlen: int, median: float, sigma: float, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [document_lengths(rng, seqlen, median, sigma) for _ in range(batch)]


def cu_seqlens(documents: list[list[int]], device) -> torch.Tensor:
    """int32 offsets of every document in the flattened (batch * seqlen) tokens (flash-attn's varlen layout)."""
    lengths = [n for context in documents for n in context]
    return torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)


def document_ids(documents: list[list[int]], device) -> torch.Tensor:
    """(batch * seqlen,) index of the document each token of the concatenated contexts belongs to."""
    lengths = torch.tensor([n for context in documents for n in context], device=device)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)


def window_pairs(seqlen: int, window: int) -> int:
    """Visible (query, key) pairs of causal attention with a left window: query i sees min(i, window) + 1 keys."""
    full = min(seqlen, window + 1)
    return full * (full + 1) // 2 + (seqlen - full) * (window + 1)


def document_pairs(documents: list[list[int]]) -> int:
    return sum(n * (n + 1) // 2 for context in documents for n in context)


# ---------------------------------------------------------------------------------------------- backends
def window_backends(seqlen: int, window: int, device, compile_flex: bool = True) -> dict:
    """name -> attention(q, k, v) over (B, H, N, D) tensors, causal, each query seeing window keys back."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels import fa2_attention, fa3_attention

    def in_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= window)

    block_mask = create_block_mask(in_window, B=None, H=None, Q_LEN=seqlen, KV_LEN=seqlen, device=device)
    flex = torch.compile(flex_attention, dynamic=False) if compile_flex else flex_attention  # see model/backends/flex_masks.py
    i = torch.arange(seqlen, device=device)[:, None]
    dense = in_window(None, None, i, torch.arange(seqlen, device=device)[None, :])

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=dense)

    return {
        "fa3_full": lambda q, k, v: fa3_attention(q, k, v, causal=True),
        "fa3": lambda q, k, v: fa3_attention(q, k, v, causal=True, window_size=(window, 0)),
        "fa2_full": lambda q, k, v: fa2_attention(q, k, v, causal=True),
        "fa2": lambda q, k, v: fa2_attention(q, k, v, causal=True, window_size=(window, 0)),
        "flex": lambda q, k, v: flex(q, k, v, block_mask=block_mask),
        "sdpa_dense": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
        "sdpa_cudnn": cudnn,
    }


def varlen_backends(documents: list[list[int]], device, compile_flex: bool = True) -> dict:
    """name -> attention(q, k, v) over (1, H, total, D) tensors (the contexts concatenated), causal within each
    document."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from kernels import fa2_varlen_attention, fa3_varlen_attention

    doc = document_ids(documents, device)
    total = len(doc)
    cu = cu_seqlens(documents, device)
    longest = max(n for context in documents for n in context)

    def same_document(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc[q_idx] == doc[kv_idx])

    block_mask = create_block_mask(same_document, B=None, H=None, Q_LEN=total, KV_LEN=total, device=device)
    flex = torch.compile(flex_attention, dynamic=False) if compile_flex else flex_attention  # see model/backends/flex_masks.py
    i = torch.arange(total, device=device)
    dense = same_document(None, None, i[:, None], i[None, :])

    def packed(varlen_attention):
        def attention(q, k, v):
            # (total, H, D) views, no copy; squeeze, not t[0]: the gradient of a select is a zero-filled copy
            o = varlen_attention(*(t.squeeze(0).transpose(0, 1) for t in (q, k, v)), cu, cu, longest, longest,
                                 causal=True, check_offsets=False)
            return o.transpose(0, 1).unsqueeze(0)
        return attention

    return {
        "fa3": packed(fa3_varlen_attention),
        "fa2": packed(fa2_varlen_attention),
        "flex": lambda q, k, v: flex(q, k, v, block_mask=block_mask),
        "sdpa_dense": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
    }


# ---------------------------------------------------------------------------------------------- main
def run(mode, names, args, dtype) -> list[dict]:
    if mode == "window":
        table, pairs = window_backends(args.seqlen, args.window, "cuda"), window_pairs(args.seqlen, args.window)
        pairs *= args.batch
        shape, setting = (args.batch, args.seqlen), {"window": args.window}
    else:
        documents = packed_documents(args.batch, args.seqlen, args.median_doc, args.sigma, args.seed)
        table, pairs = varlen_backends(documents, "cuda"), document_pairs(documents)
        shape = (1, args.batch * args.seqlen)
        setting = {"median_doc": args.median_doc, "sigma": args.sigma, "documents": sum(map(len, documents))}
    rows = []
    for name in [n for n in names if n in table]:
        print(f"{mode} {name} ...", flush=True)
        attention = table[name]
        fwd, bwd = measure(lambda q, k, v, causal: attention(q, k, v), shape[0], args.n_heads, shape[1],
                           args.head_dim, True, dtype, cuda_graph=args.cuda_graph)
        visible = args.batch * window_pairs(args.seqlen, args.seqlen - 1) if name.endswith("_full") else pairs
        flop = 4 * args.n_heads * args.head_dim * visible
        rows.append({"mode": mode, "backend": name, "batch": args.batch, "n_heads": args.n_heads,
                     "seqlen": args.seqlen, "head_dim": args.head_dim, "dtype": str(dtype),
                     "cuda_graph": args.cuda_graph, "deterministic": args.deterministic, **setting,
                     "visible_pairs": visible, "fwd_ms": fwd, "bwd_ms": bwd,
                     "fwd_tflops": fwd and flop / fwd / 1e9, "bwd_tflops": bwd and 2.5 * flop / bwd / 1e9})
    return rows


# *_full (full causal, for the ratio) and sdpa_cudnn: window mode only
BACKENDS = ("fa3_full", "fa3", "fa2_full", "fa2", "flex", "sdpa_dense", "sdpa_cudnn")
TABLE = Table([Column("mode", "mode", width=7, left=True), Column("backend", "backend", width=11, left=True),
               Column("fwd ms", "fwd_ms", ".3f", 8), Column("fwd TF/s", "fwd_tflops", ".1f"),
               Column("bwd ms", "bwd_ms", ".3f", 8), Column("bwd TF/s", "bwd_tflops", ".1f")])


def parse_args(argv=None) -> argparse.Namespace:
    """The options; argparse's exit naming an unknown backend (checked before the GPU, so on any machine)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--mode", choices=("window", "varlen", "both"), default="both", help="which benchmark")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated, from " + ", ".join(BACKENDS))
    p.add_argument("--batch", type=int, default=2, help="B contexts")
    p.add_argument("--n-heads", type=int, default=16, help="heads H")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension D")
    p.add_argument("--seqlen", type=int, default=8192, help="tokens N per context")
    p.add_argument("--window", type=int, default=1024, help="window mode: keys before each query")
    p.add_argument("--median-doc", type=float, default=600, help="varlen mode: median document length")
    p.add_argument("--sigma", type=float, default=1.0, help="varlen mode: sigma of the log-normal lengths")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs and document lengths")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="input dtype")
    p.add_argument("--cuda-graph", action="store_true",
                   help="replay the calls from a CUDA graph (bench.attention's --cuda-graph: GPU time alone)")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms(True): fa3 and fa2 run their atomic-free backwards")
    p.add_argument("--out", default="runs/bench_masks", help="folder for masks.csv and masks.json")
    args = p.parse_args(argv)
    args.backends = args.backends.split(",")
    unknown = sorted(set(args.backends) - set(BACKENDS))
    if unknown:
        p.error(f"--backends: unknown {unknown}; choose from {', '.join(BACKENDS)}")
    for name in ("batch", "n_heads", "head_dim", "seqlen", "median_doc"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: give a number >= 1")
    for name in ("window", "sigma"):
        if getattr(args, name) < 0:
            p.error(f"--{name} {getattr(args, name)}: give a number >= 0")
    from kernels.frontend import MAX_HEAD_DIM, MIN_HEAD_DIM  # the kernels' import waits for a run

    if not MIN_HEAD_DIM <= args.head_dim <= MAX_HEAD_DIM:
        p.error(f"--head-dim {args.head_dim}: the kernels take {MIN_HEAD_DIM} to {MAX_HEAD_DIM}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.masks needs a CUDA GPU")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what deterministic cuBLAS needs
        torch.use_deterministic_algorithms(True)
    out = results_folder(args.out)
    with exit_on_interrupt("bench.masks", "nothing was written (the files are written once every case has run)"):
        rows = [r for mode in (("window", "varlen") if args.mode == "both" else (args.mode,))
                for r in run(mode, args.backends, args, dtype)]
    print(TABLE.render(rows))
    write_csv(out / "masks.csv", rows, list(dict.fromkeys(k for r in rows for k in r)))  # window and varlen keys
    write_json(out / "masks.json", rows, **environment("cuda"), args=vars(args))
    print(f"wrote {out / 'masks.csv'} and masks.json")
    return rows


if __name__ == "__main__":
    main()
