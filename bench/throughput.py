"""Training throughput per attention backend: one command, a table, CSV/JSON, a bar chart, W&B runs side by side.

    python -m bench.throughput model=gpt2 model.vocab_size=50304 data=shakespeare_char trainer.compile=true
    python -m bench.throughput --backends fa2,sdpa --sweep 1024,2048,4096,8192 model=gpt2 ...

Every backend trains the same model from the same seed (`train()` in-process, so every Hydra override of
train.py applies) for `--warmup` + `--steps` optimizer steps; the warm-up steps, which include torch.compile
and Triton autotuning, are left out of the statistics. A step's time is the device time from the end of the
previous step to the end of this one (CUDA events; host time on the CPU). Per backend it reports the median
step time (ms) and the mean, tokens/s (tokens per step / median step time), median MFU, peak GPU memory, the
final train loss and the speed-up over `sdpa`. Each backend is its own W&B run in one W&B group (`wandb.group`),
so the loss and step time curves overlay in the W&B UI. Files go to runs/<name>/: throughput.csv,
throughput.json, throughput.png, rewritten after every run (a backend that crashes the process leaves the rows
measured before it).

`--baseline` also runs, per backend and in the same process, the bare training loop of `bench.baseline` (same
model, data, dtype, compile and optimizer; forward, backward, clip, step, zero_grad and nothing else), timed the
same way (per-step CUDA events, median), and reports the trainer's tokens/s and peak memory as ratios of the bare
loop's: the framework's own cost. The bare loop runs before and after the trainer (bare, trainer, bare; with
`--repeats N`: bare, then N times trainer, bare), so a drift of the GPU's speed over the run (clocks, power,
temperature) shows as a difference between the bare figures instead of hiding in the ratio. Each trainer row has
its ratio to the bare run just before it (`vs bare before`) and just after it (`vs bare after`); `vs bare tok/s`
and `vs bare mem` are the ratios to the mean of those two. Rows have `loop` = `bare` or `trainer` and `run` = 1, 2,
... in the order they ran per loop. The `--sweep` runs have no bare rows.

`--sweep` repeats the comparison for each context length at a fixed number of tokens per step
(`--sweep-tokens`; batch = tokens / context) into throughput_sweep.{csv,json,png}, to show where attention
starts to dominate the step.
"""

import argparse
import csv
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from bench import HelpFormatter
from model.backends import BACKENDS

log = logging.getLogger("bench.throughput")
FIELDS = ["backend", "loop", "run", "block_size", "batch_size", "tokens_per_step", "step_time_ms",
          "step_time_mean_ms", "tokens_per_s", "mfu", "peak_mem_gib", "final_train_loss", "speedup_vs_sdpa",
          "tokens_per_s_vs_bare", "tokens_per_s_vs_bare_before", "tokens_per_s_vs_bare_after", "peak_mem_vs_bare",
          "num_params"]
RATIOS = dict(speedup_vs_sdpa=None, tokens_per_s_vs_bare=None, tokens_per_s_vs_bare_before=None,
              tokens_per_s_vs_bare_after=None, peak_mem_vs_bare=None)  # filled in by add_speedups


def backend_config(overrides, backend, out_dir, label, warmup, steps):
    """The train() config of one backend's run: out_dir/label, W&B group out_dir.name, no eval or checkpoints."""
    from trainer import compose_config

    return compose_config([
        *overrides, f"attn={backend}", f"run.root={out_dir}", f"run.name={label}", f"wandb.group={out_dir.name}",
        "resume=never",
        f"trainer.max_steps={warmup + steps}", "eval.iters=0", "ckpt.interval=0",
    ])


def fresh_device():
    """Forget compiled graphs (each run compiles its own model; dynamo's recompile limit is per code object)
    and CUDA memory statistics, so runs in one process do not influence each other's figures."""
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_bare(overrides, backend, out_dir, label, warmup, steps, run=1):
    """The bare loop (bench.baseline) on one backend's config; a row like run_backend's, loop='bare'."""
    from bench.baseline import run_bare_loop
    from trainer.metrics import peak_flops

    cfg = backend_config(overrides, backend, out_dir, label, warmup, steps)
    fresh_device()
    bare = run_bare_loop(cfg, warmup, steps)
    tokens_per_s = bare["tokens_per_step"] / bare["step_time_s"]
    peak = peak_flops(torch.device("cuda" if torch.cuda.is_available() and cfg.trainer.device != "cpu" else "cpu"),
                      cfg.trainer.peak_flops)
    return dict(
        backend=backend, loop="bare", run=run, block_size=cfg.model.block_size, batch_size=cfg.trainer.batch_size,
        tokens_per_step=bare["tokens_per_step"], step_time_ms=bare["step_time_s"] * 1e3,
        step_time_mean_ms=bare["step_time_mean_s"] * 1e3, tokens_per_s=tokens_per_s,
        mfu=bare["flops_per_token"] * tokens_per_s / peak if peak else None, peak_mem_gib=bare["peak_mem_gib"],
        final_train_loss=bare["losses"][-1], **RATIOS, num_params=bare["num_params"],
    )


def run_backend(overrides, backend, out_dir, label, warmup, steps, run=1):
    """Train one backend into out_dir/label and summarise its timed steps (those after the warm-up)."""
    from trainer import train

    cfg = backend_config(overrides, backend, out_dir, label, warmup, steps)
    fresh_device()
    summary = train(cfg)
    timed = summary.records[warmup:]
    step_ms = statistics.median(r["perf/step_time_ms"] for r in timed)  # the bare loop's statistic too
    mfus = [r["perf/mfu"] for r in timed if r["perf/mfu"] is not None]
    mems = [r["perf/peak_mem_gib"] for r in timed if r["perf/peak_mem_gib"] is not None]
    return dict(
        backend=backend, loop="trainer", run=run, block_size=cfg.model.block_size, batch_size=cfg.trainer.batch_size,
        tokens_per_step=summary.tokens_per_step, step_time_ms=step_ms,
        step_time_mean_ms=statistics.mean(r["perf/step_time_ms"] for r in timed),
        tokens_per_s=summary.tokens_per_step / (step_ms / 1e3),
        mfu=statistics.median(mfus) if mfus else None, peak_mem_gib=max(mems) if mems else None,
        final_train_loss=summary.records[-1]["train/loss"], **RATIOS, num_params=summary.num_params,
    )


def add_speedups(rows):
    """speedup_vs_sdpa of trainer rows (over the mean tokens/s of the sdpa trainer runs at that context); for
    trainer rows with bare runs of the same backend and context, tokens/s and peak memory as ratios of the bare
    run just before and just after it (in row order), and of the mean of those two."""
    trainer = [r for r in rows if r["loop"] == "trainer"]
    sdpa = {}
    for r in trainer:
        if r["backend"] == "sdpa":
            sdpa.setdefault(r["block_size"], []).append(r["tokens_per_s"])
    for i, r in enumerate(rows):
        if r["loop"] != "trainer":
            continue
        if r["block_size"] in sdpa:
            r["speedup_vs_sdpa"] = r["tokens_per_s"] / statistics.mean(sdpa[r["block_size"]])
        key = (r["backend"], r["block_size"])
        bare = [j for j, b in enumerate(rows) if b["loop"] == "bare" and (b["backend"], b["block_size"]) == key]
        before = next((rows[j] for j in reversed(bare) if j < i), None)
        after = next((rows[j] for j in bare if j > i), None)
        bares = [b for b in (before, after) if b is not None]
        if not bares:
            continue
        r["tokens_per_s_vs_bare_before"] = before and r["tokens_per_s"] / before["tokens_per_s"]
        r["tokens_per_s_vs_bare_after"] = after and r["tokens_per_s"] / after["tokens_per_s"]
        r["tokens_per_s_vs_bare"] = r["tokens_per_s"] / statistics.mean(b["tokens_per_s"] for b in bares)
        if r["peak_mem_gib"] and all(b["peak_mem_gib"] for b in bares):
            r["peak_mem_vs_bare"] = r["peak_mem_gib"] / statistics.mean(b["peak_mem_gib"] for b in bares)


def print_table(rows):
    cell = lambda x, f, width: format("-" if x is None else format(x, f), f">{width}")  # noqa: E731
    print(f"{'backend':<11} {'loop':<9} {'context':>7} {'batch':>5} {'step ms':>9} {'mean ms':>9} {'tokens/s':>11} "
          f"{'MFU %':>6} {'mem GiB':>8} {'loss':>7} {'vs sdpa':>7} {'vs bare tok/s':>13} {'before':>7} {'after':>7} "
          f"{'vs bare mem':>11}")
    for r in rows:
        loop = f"{r['loop']} {r['run']}"
        print(f"{r['backend']:<11} {loop:<9} {r['block_size']:>7} {r['batch_size']:>5} {r['step_time_ms']:>9.2f} "
              f"{r['step_time_mean_ms']:>9.2f} {r['tokens_per_s']:>11,.0f} "
              f"{cell(r['mfu'] and 100 * r['mfu'], '.1f', 6)} "
              f"{cell(r['peak_mem_gib'], '.2f', 8)} {r['final_train_loss']:>7.4f} {cell(r['speedup_vs_sdpa'], '.2f', 7)} "
              f"{cell(r['tokens_per_s_vs_bare'], '.3f', 13)} {cell(r['tokens_per_s_vs_bare_before'], '.3f', 7)} "
              f"{cell(r['tokens_per_s_vs_bare_after'], '.3f', 7)} {cell(r['peak_mem_vs_bare'], '.3f', 11)}")


def write(rows, out_dir, stem, meta):
    with open(out_dir / f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    (out_dir / f"{stem}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    plot(rows, out_dir / f"{stem}.png", meta)


def plot(rows, path, meta):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["block_size"] for r in rows})
    def series(r):
        name = r["backend"] if r["loop"] == "trainer" else f"{r['backend']} (bare loop)"
        return name if r["run"] == 1 else f"{name} #{r['run']}"

    backends = list(dict.fromkeys(series(r) for r in rows))
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(contexts) * len(backends) / 2), 4))
    width = 0.8 / len(backends)
    for i, backend in enumerate(backends):
        xs, ys = [], []
        for j, context in enumerate(contexts):
            r = next((r for r in rows if series(r) == backend and r["block_size"] == context), None)
            if r:
                xs.append(j + (i - (len(backends) - 1) / 2) * width)
                ys.append(r["tokens_per_s"])
        bars = ax.bar(xs, ys, width, label=backend)
        ax.bar_label(bars, labels=[f"{y / 1e3:,.1f}k" for y in ys], fontsize=7)
    ax.set_xticks(range(len(contexts)), [f"context {c}" for c in contexts])
    ax.set_ylabel("training tokens/s")
    ax.set_title(f"{meta['device']}: tokens/s per attention backend", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--backends", default="fa1,fa2,sdpa", help=f"comma-separated, from {', '.join(BACKENDS[1:])}")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per backend")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (compile, autotune)")
    parser.add_argument("--baseline", action="store_true",
                        help="also run the bare training loop (bench.baseline) per backend, before and after the "
                             "trainer; report ratios to it")
    parser.add_argument("--repeats", type=int, default=1,
                        help="with --baseline: trainer runs per backend, each followed by a bare run")
    parser.add_argument("--sweep", default="",
                        help="context lengths for a sweep, e.g. 1024,2048,4096,8192 (none by default)")
    parser.add_argument("--sweep-tokens", type=int, default=32768, help="tokens per step in the sweep")
    parser.add_argument("--name", default=f"throughput_{time.strftime('%Y-%m-%d_%H-%M-%S')}",
                        help="run group: runs/<name>/<backend>, W&B group <name>")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for train.py, e.g. model=gpt2")
    args = parser.parse_args(argv)

    backends = args.backends.split(",")
    bad = [b for b in backends if b not in BACKENDS or b == "auto"]
    if bad or args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error(f"--backends: unknown {bad}; accepted {', '.join(BACKENDS[1:])}" if bad
                     else "--steps and --repeats must be >= 1 and --warmup >= 0")
    sweep = [int(c) for c in args.sweep.split(",") if c]
    if any(c < 1 or args.sweep_tokens % c for c in sweep):
        parser.error(f"--sweep lengths must be positive divisors of --sweep-tokens={args.sweep_tokens}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from trainer import ConfigError, compose_config
    from trainer.config import RUN_NAME_RULE, valid_run_name, validate_config

    if not valid_run_name(args.name):
        parser.error(f"--name {args.name!r}: {RUN_NAME_RULE}")
    jobs = [(args.overrides, b, b) for b in backends]
    sweep_jobs = [(args.overrides + [f"model.block_size={context}", f"trainer.batch_size={args.sweep_tokens // context}",
                   "trainer.grad_accum=1"], b, f"{b}_ctx{context}")
                  for context in sweep for b in backends]
    try:  # every run's config is checked before anything is written
        root = Path(compose_config(args.overrides).run.root)
        out_dir = root / args.name
        for overrides, backend, label in jobs + sweep_jobs:
            validate_config(backend_config(overrides, backend, out_dir, label, args.warmup, args.steps))
    except (ConfigError, HydraException, OmegaConfBaseException) as e:
        parser.error(str(e))
    if out_dir.exists() and any(out_dir.iterdir()):
        parser.error(f"--name {args.name}: {out_dir} already holds a comparison; choose a new --name")
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
                torch=torch.__version__, triton=__import__("triton").__version__,
                date=time.strftime("%Y-%m-%d"), overrides=args.overrides, warmup=args.warmup, steps=args.steps)

    rows, sweep_rows, sweep_meta = [], [], {**meta, "sweep_tokens": args.sweep_tokens}

    def record(row, into=rows, stem="throughput", meta=meta):
        # The files are rewritten after every run: a backend that takes the process down (a CUDA error aborts it)
        # leaves the rows measured before it.
        into.append(row)
        add_speedups(into)
        write(into, out_dir, stem, meta)

    for overrides, b, label in jobs:
        if not args.baseline:
            record(run_backend(overrides, b, out_dir, label, args.warmup, args.steps))
            continue
        record(run_bare(overrides, b, out_dir, f"{label}_bare", args.warmup, args.steps, run=1))
        for k in range(1, args.repeats + 1):  # trainer, bare, trainer, bare, ...: order effects show in the bare runs
            record(run_backend(overrides, b, out_dir, label if k == 1 else f"{label}_{k}", args.warmup,
                               args.steps, run=k))
            record(run_bare(overrides, b, out_dir, f"{label}_bare", args.warmup, args.steps, run=k + 1))
    print_table(rows)

    if sweep:
        for overrides, b, label in sweep_jobs:
            record(run_backend(overrides, b, out_dir, label, args.warmup, args.steps), sweep_rows, "throughput_sweep",
                   sweep_meta)
        print(f"\nsweep at {args.sweep_tokens} tokens per step")
        print_table(sweep_rows)
    print(f"wrote {out_dir}/throughput.{{csv,json,png}}" + (" and throughput_sweep.*" if sweep else ""))
    return rows


if __name__ == "__main__":
    main()
