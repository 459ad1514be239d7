"""Generation speed: tokens/s with and without the KV cache, eager, compiled and as CUDA graphs, per backend.

    python -m bench.generate --out runs/bench_generate                      # GPT-2 124M shape on the GPU
    python -m bench.generate --out runs/gen --backends sdpa --batch 8 --max-seconds 150   # the headline cells first
    python -m bench.generate --out /tmp/gen --model tiny --device cpu --backends sdpa \\
        --prompt-len 4 --new-tokens 8 --modes eager,compiled                 # CPU smoke test

The model is built from conf/model/<--model>.yaml (random weights: speed does not depend on them) in
--dtype. Every case (batch x backend x cache on/off x mode) generates --new-tokens greedy tokens after a random
prompt of --prompt-len tokens with ``GPT.generate``. Modes (``GPT.generate``'s compile / cuda_graph):
- eager: no compiler; with the cache each decode step attends over the filled prefix.
- compiled: torch.compile of the transformer blocks (regional: the blocks share one compiled graph, so the
  compile costs one block, once per batch size); with the cache the fixed-shape decode step (sdpa, fa2, fa3:
  the position a device tensor, the whole cache masked), fa1's step at an int position with dynamic shapes;
  without the cache the whole context, with dynamic shapes (one graph for every length).
- eager-graph (cache on; sdpa, fa2): the eager fixed-shape decode step captured as one CUDA graph
  (torch.cuda.CUDAGraph) and replayed per token: no compiler, so it warms up in a second.
- compiled-graph (cache on; sdpa, fa2): the compiled fixed-shape decode step captured as one CUDA graph.
The fixed-shape decode step of fa2, fa3 and fa2_splitkv is one and the same (kernels/decode.py's split-K/V
kernel over the whole cache), so fa3 and fa2_splitkv skip the compiled and graph modes with the cache (the
summary uses fa2's rows there). The extra backend `fa2_splitkv` is fa2 with eager decode steps through the
split-K/V kernel; it runs with the cache only and is compared with fa2's no-cache rows.

Order: batch sizes in the order given (default 8 first: the headline comparison is at batch 8), then backends;
per (batch, backend) the cases of the cache-against-no-cache comparison first (cache on as an eager CUDA graph,
cache off eager and compiled, cache on as a compiled CUDA graph), then cache on compiled and eager. Each case runs one
untimed generation of the same length first (compilation, CUDA graph capture, Triton autotuning of every
sequence-length bucket; its time is the row's warmup_s, and the graphs dynamo compiled in it are `compiles`),
then --repeats timed ones (the fastest counts). tokens/s = batch * new tokens / seconds, prefill included;
ms/step = seconds / new tokens. "x cache" is the speed-up of the cache over no cache for the same backend,
batch and mode (eager-graph and compiled-graph against eager and compiled); a summary line per (batch,
backend) compares each side in its fastest mode.

Every row is printed as soon as it is measured, and generate.csv and generate.json (device, versions, arguments,
summary, skipped cases and errors) in --out are rewritten then (atomically), so a killed run keeps its rows.
--max-seconds stops starting cases once that much time has passed, and interrupts the case running then
(SIGALRM), so the command ends, with its files written, shortly after. A case that fails is reported and
skipped (the exit status is then 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from bench import HelpFormatter, csv_list, exit_on_interrupt, results_folder
from bench.report import Column, Table, environment, write_csv, write_json
from model.backends import BACKENDS, REGISTRY

CONF = Path(__file__).resolve().parents[1] / "conf" / "model"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SPLIT_KV = "fa2_splitkv"  # fa2 + model.use_split_kv_decode()
# mode -> GPT.generate's (compile, cuda_graph)
MODES = {"eager": (False, False), "compiled": (True, False), "eager-graph": (False, True),
         "compiled-graph": (True, True)}
GRAPH_MODES = ("eager-graph", "compiled-graph")
STATIC_BACKENDS = ("sdpa", "fa2")  # their own fixed-shape decode step (fa3's and fa2_splitkv's is fa2's)
# (cache, mode) per (batch, backend), first to last: the cache-against-no-cache comparison (each side in its fastest
# mode) first, cheap cases before compiles, compiled-graph before compiled (they share the compiled graph).
ORDER = [("on", "eager-graph"), ("off", "eager"), ("off", "compiled"), ("on", "compiled-graph"),
         ("on", "compiled"), ("on", "eager")]
FIELDS = ["backend", "batch", "kv_cache", "mode", "prompt_len", "new_tokens", "seconds", "tokens_per_s",
          "ms_per_step", "speedup_vs_no_cache", "warmup_s", "compiles", "dtype", "device"]


def build_model(model: str, vocab_size: int, backend: str, dtype: torch.dtype, device: str):
    """A GPT of conf/model/<model>.yaml's shape with attention ``backend``, in eval mode, seeded weights."""
    from omegaconf import OmegaConf

    from model.gpt import GPT, GPTConfig

    conf = OmegaConf.to_container(OmegaConf.load(CONF / f"{model}.yaml"))
    torch.manual_seed(0)
    attn = "fa2" if backend == SPLIT_KV else backend
    fields = {f.name for f in dataclasses.fields(GPTConfig)} - {"vocab_size", "attn"}  # every block option too
    model = GPT(GPTConfig(**{k: v for k, v in conf.items() if k in fields}, vocab_size=vocab_size, attn=attn))
    if backend == SPLIT_KV:
        model.use_split_kv_decode()
    return model.to(device=device, dtype=dtype).eval()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def time_case(model, batch: int, prompt_len: int, new_tokens: int, kv_cache: bool, mode: str,
              repeats: int) -> tuple[float, float, int]:
    """(seconds of the fastest of ``repeats`` greedy generations, seconds of the untimed warm-up generation before
    them, graphs dynamo compiled during the case)."""
    device = next(model.parameters()).device.type
    compile, cuda_graph = MODES[mode]
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device=device)
    graphs = compiled_graphs()
    times = []
    for _ in range(repeats + 1):  # the first generation is the warm-up
        sync(device)
        t0 = time.perf_counter()
        model.generate(prompt, new_tokens, top_k=1, kv_cache=kv_cache, compile=compile, cuda_graph=cuda_graph)
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times[1:]), times[0], compiled_graphs() - graphs


def cases(backends: list[str], batches: list[int], caches: list[str], modes: list[str]) -> list[tuple]:
    """(batch, backend, cache, mode) in running order, without the cases that cannot run or repeat another."""
    out = []
    for batch in batches:
        for backend in backends:
            for cache, mode in ORDER:
                if cache not in caches or mode not in modes:
                    continue
                if cache == "off" and (backend == SPLIT_KV or mode in GRAPH_MODES):
                    continue  # the same as fa2 without the cache / CUDA graphs need the cache's fixed shapes
                if cache == "on" and mode in GRAPH_MODES and backend not in STATIC_BACKENDS:
                    continue  # fa1: no fixed-shape decode; fa3, fa2_splitkv: fa2's
                if cache == "on" and mode == "compiled" and backend in ("fa3", SPLIT_KV):
                    continue  # the compiled fixed-shape decode step is fa2's
                out.append((batch, backend, cache, mode))
    return out


def add_speedups(rows: list[dict]) -> list[str]:
    """Fill speedup_vs_no_cache per row; return one summary line per (backend, batch), fastest mode each."""
    # fa2_splitkv differs from fa2 only with the cache: compare it with fa2's no-cache rows
    base = lambda backend: "fa2" if backend == SPLIT_KV else backend
    plain = lambda mode: {"eager-graph": "eager", "compiled-graph": "compiled"}.get(mode, mode)
    uncached = {(base(r["backend"]), r["batch"], r["mode"]): r["tokens_per_s"] for r in rows if not r["kv_cache"]}
    for r in rows:
        k = (base(r["backend"]), r["batch"], plain(r["mode"]))
        r["speedup_vs_no_cache"] = r["tokens_per_s"] / uncached[k] if r["kv_cache"] and k in uncached else None
    fastest = lambda rs: max(rs, key=lambda r: r["tokens_per_s"], default=None)
    lines = []
    for batch, b in dict.fromkeys((r["batch"], r["backend"]) for r in rows):
        own = [r for r in rows if r["kv_cache"] and (r["backend"], r["batch"]) == (b, batch)]
        # fa3 and fa2_splitkv share fa2's fixed-shape decode step (compiled and graph modes)
        shared = [r for r in rows if r["kv_cache"] and r["backend"] == "fa2" and r["batch"] == batch
                  and r["mode"] != "eager"] if b in ("fa3", SPLIT_KV) else []
        on = fastest(own + shared)
        off = fastest([r for r in rows if not r["kv_cache"] and (base(r["backend"]), r["batch"]) == (base(b), batch)])
        if on and off:
            how = on["mode"] + (", fa2's step" if on["backend"] != b else "")
            lines.append(f"{b} batch {batch}: cache {on['tokens_per_s']:,.0f} tokens/s ({how}) vs no cache "
                         f"{off['tokens_per_s']:,.0f} ({off['mode']}): {on['tokens_per_s'] / off['tokens_per_s']:.2f}x")
    return lines


TABLE = Table([
    Column("backend", "backend", width=11, left=True), Column("batch", "batch"),
    Column("cache", lambda r: "on" if r["kv_cache"] else "off"), Column("mode", "mode", width=14),
    Column("seconds", "seconds", ".3f", 9), Column("tokens/s", "tokens_per_s", ",.1f", 11),
    Column("ms/step", "ms_per_step", ".3f", 8), Column("x cache", "speedup_vs_no_cache", ".2f"),
    Column("warmup_s", "warmup_s", ".1f"), Column("compiles", "compiles")])


def save(stem: Path, rows: list[dict], device: str, **meta) -> None:
    """rows to <stem>.csv, and with the device, versions, date and ``meta`` to <stem>.json (both atomically)."""
    write_csv(stem.with_suffix(".csv"), rows, FIELDS)
    write_json(stem.with_suffix(".json"), rows, **environment(device), **meta)


class BudgetExceeded(Exception):
    """--max-seconds ran out during a case."""


@contextmanager
def deadline(at: float | None):
    """Raise BudgetExceeded in the main thread at time.monotonic() == ``at`` (None: no limit)."""
    if at is None:
        yield
        return

    def expire(signum, frame):
        raise BudgetExceeded()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(at - time.monotonic(), 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)



CPU_MODELS = ("tiny", "baby")  # the shapes that generate in seconds to minutes on a CPU


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--out", required=True, help="folder for generate.csv and generate.json")
    ap.add_argument("--model", default="gpt2", choices=sorted(p.stem for p in CONF.glob("*.yaml")),
                    help="shape from conf/model/<name>.yaml")
    ap.add_argument("--vocab-size", type=int, default=50304, help="GPT-2's 50257 padded to a multiple of 64")
    ap.add_argument("--backends", type=csv_list(str, (*BACKENDS[1:], SPLIT_KV)), default="sdpa,fa2,fa3,fa1",
                    help="comma-separated; fa2_splitkv: fa2 with the split-K/V decode kernel")
    ap.add_argument("--batch", type=csv_list(int), default="8,1", help="batch sizes, run in this order")
    ap.add_argument("--cache", type=csv_list(str, ("on", "off")), default="on,off", help="KV cache on / off")
    ap.add_argument("--modes", type=csv_list(str, MODES), default=",".join(MODES),
                    help="eager, compiled, eager-graph / compiled-graph (the decode step as one CUDA graph; cache on, "
                         "sdpa, fa2)")
    ap.add_argument("--prompt-len", type=int, default=16, help="random prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=1000, help="greedy tokens generated per case")
    ap.add_argument("--repeats", type=int, default=1, help="timed generations per case (the fastest counts)")
    ap.add_argument("--max-seconds", type=float, default=0,
                    help="time budget: no case starts after it, the running one is interrupted (0 = none)")
    ap.add_argument("--dtype", choices=("auto", *DTYPES), default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA if available")
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options, checked (argparse's exit naming a bad one), with --device and --dtype resolved and the CUDA
    graph modes dropped on the CPU (with a note)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    for name in ("vocab_size", "prompt_len", "new_tokens", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.max_seconds < 0:
        ap.error(f"--max-seconds {args.max_seconds:g}: must be >= 0")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU")
    if args.device == "cpu" and any(m in GRAPH_MODES for m in args.modes) and "on" in args.cache:
        args.modes = [m for m in args.modes if m not in GRAPH_MODES]
        if not args.modes:
            ap.error("--modes eager-graph / compiled-graph: CUDA graphs need a GPU")
        print("note: CUDA graphs need a GPU: the eager-graph and compiled-graph modes are skipped on the CPU")
    uncompilable = [b for b in args.backends if b in REGISTRY and not REGISTRY[b].compiles_on_cpu]
    compiled = [m for m in args.modes if MODES[m][0]]
    if args.device == "cpu" and uncompilable and compiled:
        ap.error(f"--backends {','.join(uncompilable)} with --modes {','.join(compiled)}: torch.compile cannot lower "
                 "it on the CPU; give --modes eager there, or another backend")
    if args.dtype == "auto":
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    if args.device == "cpu" and args.model not in CPU_MODELS and not args.max_seconds:
        ap.error(f"--model {args.model} on the CPU: its cases take hours (fa1, fa2 and fa3 run under Triton's "
                 f"interpreter there); give --model {' or '.join(CPU_MODELS)} with small sizes (the CPU smoke test "
                 "at the top of --help), or --max-seconds to bound the run")
    return args


def run_case(models: dict, args, batch: int, backend: str, cache: str, mode: str) -> dict:
    """Time one case (building the backend's model first if ``models`` lacks it); its row."""
    if backend not in models:
        models[backend] = build_model(args.model, args.vocab_size, backend, DTYPES[args.dtype], args.device)
        if args.prompt_len + args.new_tokens > models[backend].config.block_size:
            print(f"note: {args.prompt_len} + {args.new_tokens} tokens exceed block_size="
                  f"{models[backend].config.block_size}: the cache re-prefills the most recent half when full, "
                  "the uncached path slides its window")
    s, warmup, compiles = time_case(models[backend], batch, args.prompt_len, args.new_tokens, cache == "on", mode,
                                    args.repeats)
    return dict(backend=backend, batch=batch, kv_cache=cache == "on", mode=mode, prompt_len=args.prompt_len,
                new_tokens=args.new_tokens, seconds=s, tokens_per_s=batch * args.new_tokens / s,
                ms_per_step=1e3 * s / args.new_tokens, speedup_vs_no_cache=None, warmup_s=warmup, compiles=compiles,
                dtype=args.dtype, device=args.device)


def run_cases(todo: list[tuple], args, stem: Path, at: float | None) -> tuple[list[dict], list[str], list[str]]:
    """(rows, skipped, errors) of the cases in ``todo``; the files are rewritten after every row."""
    rows, skipped, errors, models, group = [], [], [], {}, None
    save(stem, rows, args.device, args=vars(args), summary=[], skipped=skipped, errors=errors)
    print(TABLE.header(), flush=True)
    for batch, backend, cache, mode in todo:
        name = f"{backend} batch {batch} cache {cache} {mode}"
        if at is not None and time.monotonic() >= at:
            skipped.append(name)
            continue
        if group != (batch, backend):
            # Fresh compile caches per (batch, backend): nothing compiled for another one is reused, and each
            # model's code would otherwise count against dynamo's recompile limit.
            if group is not None:
                models[group[1]].release_decode_graph()
            torch._dynamo.reset()
            group = (batch, backend)
        try:
            with deadline(at):
                rows.append(run_case(models, args, batch, backend, cache, mode))
        except BudgetExceeded:
            skipped.append(name + " (interrupted: --max-seconds)")
            print(f"  {name}: interrupted at --max-seconds={args.max_seconds:g}", flush=True)
            continue
        except Exception as e:  # report, keep the rows measured so far, go on with the next case
            errors.append(f"{name}: {type(e).__name__}: {e}")
            print(f"  {name}: FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            continue
        save(stem, rows, args.device, args=vars(args), summary=add_speedups(rows), skipped=skipped, errors=errors)
        print(TABLE.line(rows[-1]), flush=True)
    return rows, skipped, errors


def main(argv: list[str] | None = None) -> list[dict]:
    t_start = time.monotonic()
    args = parse_args(argv)
    out = results_folder(args.out)
    stem = out / "generate"
    # One compiled graph per (batch, backend) and kind of step; room for a few more, and an error rather than a
    # silent eager fallback timed as "compiled" past the limit.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    todo = cases(args.backends, args.batch, args.cache, args.modes)
    print(f"{len(todo)} cases, in this order: " + "; ".join(f"{be} b{b} cache {c} {m}" for b, be, c, m in todo))
    with exit_on_interrupt("bench.generate", f"the rows measured before the case in flight are in {stem}.csv"):
        rows, skipped, errors = run_cases(todo, args, stem, t_start + args.max_seconds if args.max_seconds else None)
    summary = add_speedups(rows)
    print("\n" + TABLE.render(rows))
    print("\n".join(summary))
    if skipped:
        print(f"skipped ({len(skipped)}, --max-seconds={args.max_seconds:g}): " + "; ".join(skipped))
    save(stem, rows, args.device, args=vars(args), summary=summary, skipped=skipped, errors=errors,
         seconds=time.monotonic() - t_start)
    print(f"wrote {stem}.{{csv,json}}")
    if errors:
        print("errors:\n  " + "\n  ".join(errors), file=sys.stderr)
        sys.exit(1)
    return rows


if __name__ == "__main__":
    main()
