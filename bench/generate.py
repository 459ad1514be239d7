"""Generation speed: tokens/s with and without the KV cache, eager and compiled, per attention backend.

    python -m bench.generate --out runs/bench_generate                      # GPT-2 124M shape on the GPU
    python -m bench.generate --out /tmp/gen --model tiny --device cpu --backends sdpa \\
        --prompt-len 4 --new-tokens 8 --modes eager                          # CPU smoke test

The model is built from conf/model/<--model>.yaml (random weights: speed does not depend on them) in
--dtype. Every case (backend x batch x cache on/off x mode) generates --new-tokens greedy tokens after a random
prompt of --prompt-len tokens with ``GPT.generate``. Modes: eager; compiled (torch.compile of the per-token
step: the decode step with the cache, the whole forward without); cudagraphs (cache on only; sdpa, fa2: the
decode step with fixed shapes, compiled with mode="reduce-overhead", so each step replays a CUDA graph; fa3's
would be fa2's, as both decode through kernels/decode.py there).
Each case runs one untimed generation of the same length first (compilation, CUDA graph capture, Triton
autotuning of every sequence-length bucket), then --repeats timed ones (the fastest counts).
tokens/s = batch * new tokens / seconds, prefill included; ms/step = seconds / new tokens. "x cache" is the
speed-up of the cache over no cache for the same backend, batch and mode; a summary line per (backend, batch)
compares each side in its fastest mode. The extra backend `fa2_splitkv` is fa2 with decode steps through the
split-K/V kernel (kernels/decode.py); it runs with the cache only and is compared with fa2's no-cache rows.
Writes generate.csv and generate.json (rows + device, versions, arguments) to --out.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

import torch

from bench import HelpFormatter
from model.attention import BACKENDS

CONF = Path(__file__).resolve().parents[1] / "conf" / "model"
SHAPE_KEYS = ("n_layer", "n_head", "n_kv_head", "n_embd", "block_size", "bias")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SPLIT_KV = "fa2_splitkv"  # fa2 + model.use_split_kv_decode()
MODES = {"eager": False, "compiled": True, "cudagraphs": "cudagraphs"}  # GPT.generate's compile argument
FIELDS = ["backend", "batch", "kv_cache", "mode", "prompt_len", "new_tokens", "seconds", "tokens_per_s",
          "ms_per_step", "speedup_vs_no_cache", "dtype", "device"]


def build_model(model: str, vocab_size: int, backend: str, dtype: torch.dtype, device: str):
    """A GPT of conf/model/<model>.yaml's shape with attention ``backend``, in eval mode, seeded weights."""
    from omegaconf import OmegaConf

    from model.gpt import GPT, GPTConfig

    conf = OmegaConf.to_container(OmegaConf.load(CONF / f"{model}.yaml"))
    torch.manual_seed(0)
    attn = "fa2" if backend == SPLIT_KV else backend
    model = GPT(GPTConfig(**{k: conf[k] for k in SHAPE_KEYS if k in conf}, vocab_size=vocab_size, attn=attn))
    if backend == SPLIT_KV:
        model.use_split_kv_decode()
    return model.to(device=device, dtype=dtype).eval()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_case(model, batch: int, prompt_len: int, new_tokens: int, kv_cache: bool, compile: bool | str,
              repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` greedy generations, after one untimed warm-up generation."""
    device = next(model.parameters()).device.type
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device=device)
    best = float("inf")
    for i in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        model.generate(prompt, new_tokens, top_k=1, kv_cache=kv_cache, compile=compile)
        sync(device)
        if i:  # the first generation is the warm-up
            best = min(best, time.perf_counter() - t0)
    return best


def add_speedups(rows: list[dict]) -> list[str]:
    """Fill speedup_vs_no_cache per row; return one summary line per (backend, batch), fastest mode each."""
    # fa2_splitkv differs from fa2 only with the cache: compare it with fa2's no-cache rows
    base = lambda backend: "fa2" if backend == SPLIT_KV else backend
    uncached = {(base(r["backend"]), r["batch"], r["mode"]): r["tokens_per_s"] for r in rows if not r["kv_cache"]}
    for r in rows:
        k = (base(r["backend"]), r["batch"], r["mode"])
        if r["kv_cache"] and k in uncached:
            r["speedup_vs_no_cache"] = r["tokens_per_s"] / uncached[k]
    fastest = lambda rs: max(rs, key=lambda r: r["tokens_per_s"], default=None)
    lines = []
    for b, batch in dict.fromkeys((r["backend"], r["batch"]) for r in rows if r["kv_cache"]):
        on = fastest([r for r in rows if r["kv_cache"] and (r["backend"], r["batch"]) == (b, batch)])
        off = fastest([r for r in rows if not r["kv_cache"] and (base(r["backend"]), r["batch"]) == (base(b), batch)])
        if off:
            lines.append(f"{b} batch {batch}: cache {on['tokens_per_s']:,.0f} tokens/s ({on['mode']}) vs no cache "
                         f"{off['tokens_per_s']:,.0f} ({off['mode']}): {on['tokens_per_s'] / off['tokens_per_s']:.2f}x")
    return lines


def print_table(rows: list[dict]) -> None:
    print(f"{'backend':<11} {'batch':>5} {'cache':>5} {'mode':>8} {'seconds':>9} {'tokens/s':>11} "
          f"{'ms/step':>8} {'x cache':>7}")
    for r in rows:
        speedup = "-" if r["speedup_vs_no_cache"] is None else f"{r['speedup_vs_no_cache']:.2f}"
        print(f"{r['backend']:<11} {r['batch']:>5} {'on' if r['kv_cache'] else 'off':>5} {r['mode']:>8} "
              f"{r['seconds']:>9.3f} {r['tokens_per_s']:>11,.1f} {r['ms_per_step']:>8.3f} {speedup:>7}")


def write_results(stem: Path, fields: list[str], rows: list[dict], device: str, **meta) -> None:
    """rows to <stem>.csv, and with the device, versions, date and ``meta`` to <stem>.json."""
    meta = dict(device=torch.cuda.get_device_name() if device == "cuda" else "CPU", torch=torch.__version__,
                triton=__import__("triton").__version__, date=time.strftime("%Y-%m-%d"), **meta)
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    stem.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    print(f"wrote {stem}.{{csv,json}}")


def csv_list(kind, choices=None):
    def parse(text: str) -> list:
        items = [kind(x) for x in text.split(",") if x]
        bad = [x for x in items if (choices is not None and x not in choices) or (kind is int and x < 1)]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of "
                                             + (", ".join(map(str, choices)) if choices else "positive integers"))
        return items
    return parse


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--out", required=True, help="folder for generate.csv and generate.json")
    ap.add_argument("--model", default="gpt2", choices=sorted(p.stem for p in CONF.glob("*.yaml")),
                    help="shape from conf/model/<name>.yaml")
    ap.add_argument("--vocab-size", type=int, default=50304, help="GPT-2's 50257 padded to a multiple of 64")
    ap.add_argument("--backends", type=csv_list(str, (*BACKENDS[1:], SPLIT_KV)), default="sdpa,fa2,fa3,fa1",
                    help="comma-separated; fa2_splitkv: fa2 with the split-K/V decode kernel")
    ap.add_argument("--batch", type=csv_list(int), default="1,8", help="batch sizes")
    ap.add_argument("--cache", type=csv_list(str, ("on", "off")), default="on,off", help="KV cache on / off")
    ap.add_argument("--modes", type=csv_list(str, MODES), default=",".join(MODES),
                    help="cudagraphs: the fixed-shape decode step as CUDA graphs (cache on; sdpa, fa2)")
    ap.add_argument("--prompt-len", type=int, default=16, help="random prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=1000, help="greedy tokens generated per case")
    ap.add_argument("--repeats", type=int, default=1, help="timed generations per case (the fastest counts)")
    ap.add_argument("--dtype", choices=("auto", *DTYPES), default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA if available")
    args = ap.parse_args(argv)
    for name in ("vocab_size", "prompt_len", "new_tokens", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU")
    dtype_name = ("bf16" if device == "cuda" else "fp32") if args.dtype == "auto" else args.dtype
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # Each batch size and mode compiles the step again (a few graphs per backend): room for them, and an error
    # rather than a silent eager fallback timed as "compiled" past the limit.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    rows = []
    for backend in args.backends:
        # Fresh compile caches per backend: each model's code would otherwise count against dynamo's recompile
        # limit, past which the compiled cases would silently run eager.
        torch._dynamo.reset()
        model = build_model(args.model, args.vocab_size, backend, DTYPES[dtype_name], device)
        if args.prompt_len + args.new_tokens > model.config.block_size:
            print(f"note: {args.prompt_len} + {args.new_tokens} tokens exceed block_size={model.config.block_size}: "
                  "the cache re-prefills the most recent half when full, the uncached path slides its window")
        for batch in args.batch:
            for mode in args.modes:
                for cache in args.cache:
                    if cache == "off" and (backend == SPLIT_KV or mode == "cudagraphs"):
                        continue  # same as fa2 without the cache / CUDA graphs need the cache's fixed shapes
                    if mode == "cudagraphs" and backend not in ("sdpa", "fa2"):
                        continue  # no fixed-shape decode for this backend (fa2_splitkv's and fa3's are fa2's)
                    s = time_case(model, batch, args.prompt_len, args.new_tokens, cache == "on", MODES[mode],
                                  args.repeats)
                    rows.append(dict(backend=backend, batch=batch, kv_cache=cache == "on", mode=mode,
                                     prompt_len=args.prompt_len, new_tokens=args.new_tokens, seconds=s,
                                     tokens_per_s=batch * args.new_tokens / s, ms_per_step=1e3 * s / args.new_tokens,
                                     speedup_vs_no_cache=None, dtype=dtype_name, device=device))
                    print(f"  {backend} batch {batch} {mode} cache {cache}: {rows[-1]['tokens_per_s']:,.1f} tokens/s",
                          flush=True)
    summary = add_speedups(rows)
    print_table(rows)
    print("\n".join(summary))

    write_results(out / "generate", FIELDS, rows, device, args=vars(args), summary=summary)
    return rows


if __name__ == "__main__":
    main()
