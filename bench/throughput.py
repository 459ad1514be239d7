"""Training throughput per attention backend: one command, a table, CSV/JSON, a bar chart, W&B runs side by side.

    python -m bench.throughput model=gpt2 model.vocab_size=50304 data=shakespeare_char trainer.compile=true
    python -m bench.throughput --backends fa2,sdpa --sweep 1024,2048,4096,8192 model=gpt2 ...

Every backend trains the same model from the same seed (the trainer's `train()`, so every Hydra override of
train.py applies, except those of the keys each run's config sets, which are refused: `OWNED_KEYS`) for
`--warmup` + `--steps` optimizer steps; the warm-up steps, which include torch.compile and Triton autotuning, are
left out of the statistics. The runs go one after another, each in a fresh Python process (`bench.in_fresh_process`),
so that no run inherits another's compiled graphs, caches, allocator or kernel-launcher state, and each reads what it
would read alone; `--same-process` runs them all in this process instead (each process start costs a few seconds of
imports). A step's time is the device time from the end of the
previous step to the end of this one (CUDA events; host time on the CPU). Per backend it reports the median
step time (ms) and the mean, the spread (interquartile range of the step times over their median, %: rows above
10% are named under the table), tokens/s (tokens per step / median step time), median MFU, peak GPU memory, the
final train loss and the speed-up over `sdpa`. A backend that runs another's kernels here (fa3 without a Hopper
GPU: FA2's) is starred, and named under the table. On a CPU the table is a smoke test, not a benchmark: the
ratios between backends change from run to run, and fa1, fa2 and fa3 run under Triton's interpreter, seconds to
minutes a step at the default model (a quick check: `python -m bench.throughput --backends sdpa,fa2 --steps 2
--warmup 1 model.n_layer=1 model.block_size=16 trainer.batch_size=2`). Each backend is its own W&B run in one W&B group
(`wandb.group`), so the loss and step time curves overlay in the W&B UI. Files go to <run.root>/<name>/ (run.root:
runs unless an override sets it): throughput.csv, throughput.json, throughput.png, rewritten after every run (a
backend that crashes the process leaves the rows measured before it), and one run folder per backend (metrics, W&B
files; its checkpoints are deleted after the run). Ctrl-C or SIGTERM ends the comparison once the run in flight has
stopped (exit 128 + the signal): that run gets no row, as it timed fewer steps than asked, and no later run starts. A
run whose process fails (an exception, or a CUDA error that aborts it) ends the comparison with that error; the rows
before it stay in the files.

`--baseline` also runs, per backend, the bare training loop of `bench.baseline` (same
model, data, dtype, compile and optimizer; forward, backward, clip, step, zero_grad and nothing else), timed the
same way (per-step CUDA events, median), and reports the trainer's tokens/s and peak memory as ratios of the bare
loop's: the framework's own cost. The bare loop runs before and after the trainer (bare, trainer, bare; with
`--repeats N`: bare, then N times trainer, bare), so a drift of the GPU's speed over the run (clocks, power,
temperature) shows as a difference between the bare figures instead of hiding in the ratio. Each trainer row has
its ratio to the bare run just before it (`vs bare before`) and just after it (`vs bare after`); `vs bare tok/s`
and `vs bare mem` are the ratios to the mean of those two. Rows have `loop` = `bare` or `trainer` and `run` = 1, 2,
... in the order they ran per loop. The `--sweep` runs have no bare rows.

`--repeats N` (without `--baseline`) runs the backends N times in turn (fa3, fa2, fa3, fa2, ...), each run its own
row (`run` = 1..N), and prints a summary per backend and context: the median of the runs' tokens/s, their range, and
its ratio to sdpa's median. Where the host sets the pace (packed documents without CUDA graphs), one run's median
step time has moved by up to 20 % between runs of the same backend on one machine (docs/benchmarks.md, H100,
2026-12-07): there, compare backends by the summary of several runs in turn, not by one run each.

`--sweep` repeats the comparison for each context length at a fixed number of tokens per step
(`--sweep-tokens`; batch = tokens / context) into throughput_sweep.{csv,json,png}, to show where attention
starts to dominate the step.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

from bench import LOG_FORMAT, HelpFormatter, Interrupted, fallback, in_fresh_process, results_folder
from bench.report import Column, Table, bar_chart, environment, write_csv, write_json
from model.backends import BACKENDS

log = logging.getLogger("bench.throughput")
FIELDS = ["backend", "loop", "run", "block_size", "batch_size", "tokens_per_step", "step_time_ms",
          "step_time_mean_ms", "step_time_spread_pct", "tokens_per_s", "mfu", "peak_mem_gib", "final_train_loss",
          "speedup_vs_sdpa", "tokens_per_s_vs_bare", "tokens_per_s_vs_bare_before", "tokens_per_s_vs_bare_after",
          "peak_mem_vs_bare", "num_params", "fallback"]
RATIOS = dict(speedup_vs_sdpa=None, tokens_per_s_vs_bare=None, tokens_per_s_vs_bare_before=None,
              tokens_per_s_vs_bare_after=None, peak_mem_vs_bare=None)  # filled in by add_speedups
NOISY_PCT = 10  # a row whose step times spread more than this is named under the table
INTERPRETED = ("fa1", "fa2", "fa3")  # the project's Triton kernels: on a CPU, under Triton's interpreter
CPU_SMOKE_TEST = ("python -m bench.throughput --backends sdpa,fa2 --steps 2 --warmup 1 model.n_layer=1 "
                  "model.block_size=16 trainer.batch_size=2")
# train.py keys each run's config sets (`backend_config`), refused among the overrides with the flag that sets them
OWNED_KEYS = {"attn": "--backends", "trainer.max_steps": "--warmup and --steps", "run.name": "--name",
              "wandb.group": "--name", "resume": "nothing: each run starts afresh"}


def refused_override(overrides, flags: dict = OWNED_KEYS) -> str | None:
    """The message for the first override of a key `backend_config` sets, naming the flag that sets it (`flags`:
    OWNED_KEYS with another command's flags), or None."""
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        for owned, flag in flags.items():
            if key == owned or key.startswith(owned + "."):
                return f"{override}: the benchmark sets {owned} itself; give {flag} instead"
    return None


def backend_config(overrides, backend, out_dir, label, warmup, steps):
    """The train() config of one backend's run: out_dir/label, W&B group out_dir.name, no eval or periodic
    checkpoints (the trainer's final checkpoint is deleted after the run: ``run_backend``)."""
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


def run_device(cfg) -> torch.device:
    """The device a run of ``cfg`` trains on (trainer.device: auto, cpu or cuda)."""
    return torch.device("cuda" if torch.cuda.is_available() and cfg.trainer.device != "cpu" else "cpu")


def spread_pct(times) -> float | None:
    """The interquartile range of the step times over their median, in percent (None for fewer than 2 steps): how
    far apart the steps of one run are, a floor for the noise of a comparison between runs."""
    if len(times) < 2:
        return None
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return 100 * (q3 - q1) / statistics.median(times)


def kernels_used(cfg, backend) -> str | None:
    """``bench.fallback`` for a run of ``cfg``: the kernels ``backend`` runs instead of its own (None: its own)."""
    from trainer.runtime import select_dtype

    device = run_device(cfg)
    return fallback(backend, device, select_dtype(cfg.trainer.dtype, device), cfg.model.n_embd // cfg.model.n_head)


def run_bare(overrides, backend, out_dir, label, warmup, steps, run=1):
    """The bare loop (bench.baseline) on one backend's config; a row like run_backend's, loop='bare'."""
    from bench.baseline import run_bare_loop
    from trainer.metrics import peak_flops

    cfg = backend_config(overrides, backend, out_dir, label, warmup, steps)
    fresh_device()
    bare = run_bare_loop(cfg, warmup, steps)
    tokens_per_s = bare["tokens_per_step"] / bare["step_time_s"]
    peak = peak_flops(run_device(cfg), cfg.trainer.peak_flops)
    return dict(
        backend=backend, loop="bare", run=run, block_size=cfg.model.block_size, batch_size=cfg.trainer.batch_size,
        tokens_per_step=bare["tokens_per_step"], step_time_ms=bare["step_time_s"] * 1e3,
        step_time_mean_ms=bare["step_time_mean_s"] * 1e3, step_time_spread_pct=spread_pct(bare["step_times_s"]),
        tokens_per_s=tokens_per_s, mfu=bare["flops_per_token"] * tokens_per_s / peak if peak else None,
        peak_mem_gib=bare["peak_mem_gib"], final_train_loss=bare["losses"][-1], **RATIOS,
        num_params=bare["num_params"], fallback=kernels_used(cfg, backend),
    )


def run_backend(overrides, backend, out_dir, label, warmup, steps, run=1):
    """Train one backend into out_dir/label and summarise its timed steps (those after the warm-up). The run's
    checkpoints are deleted (the comparison never resumes, and a GPT-2 checkpoint is 1.4 GB). Raises Interrupted
    when Ctrl-C or SIGTERM stopped the run early."""
    from trainer import train
    from trainer.checkpoint import checkpoint_dir

    cfg = backend_config(overrides, backend, out_dir, label, warmup, steps)
    fresh_device()
    try:
        summary = train(cfg)
    finally:
        shutil.rmtree(checkpoint_dir(out_dir / label), ignore_errors=True)
    if summary.stop_reason == "interrupted":
        raise Interrupted(label, summary.step, warmup + steps, summary.stop_signal)
    timed = summary.records[warmup:]
    step_ms = [r["perf/step_time_ms"] for r in timed]
    mfus = [r["perf/mfu"] for r in timed if r["perf/mfu"] is not None]
    mems = [r["perf/peak_mem_gib"] for r in timed if r["perf/peak_mem_gib"] is not None]
    median_ms = statistics.median(step_ms)  # the bare loop's statistic too
    return dict(
        backend=backend, loop="trainer", run=run, block_size=cfg.model.block_size, batch_size=cfg.trainer.batch_size,
        tokens_per_step=summary.tokens_per_step, step_time_ms=median_ms, step_time_mean_ms=statistics.mean(step_ms),
        step_time_spread_pct=spread_pct(step_ms), tokens_per_s=summary.tokens_per_step / (median_ms / 1e3),
        mfu=statistics.median(mfus) if mfus else None, peak_mem_gib=max(mems) if mems else None,
        final_train_loss=summary.records[-1]["train/loss"], **RATIOS, num_params=summary.num_params,
        fallback=kernels_used(cfg, backend),
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


TABLE = Table([
    Column("backend", lambda r: r["backend"] + ("*" if r["fallback"] else ""), width=11, left=True),
    Column("loop, run", lambda r: f"{r['loop']} {r['run']}", width=9, left=True), Column("context", "block_size"),
    Column("batch", "batch_size"), Column("step ms", "step_time_ms", ".2f", 9),
    Column("mean ms", "step_time_mean_ms", ".2f", 9), Column("spread %", "step_time_spread_pct", ".1f"),
    Column("tokens/s", "tokens_per_s", ",.0f", 11), Column("MFU %", lambda r: r["mfu"] and 100 * r["mfu"], ".1f"),
    Column("mem GiB", "peak_mem_gib", ".2f"), Column("loss", "final_train_loss", ".4f", 7),
    Column("vs sdpa", "speedup_vs_sdpa", ".2f"), Column("vs bare tok/s", "tokens_per_s_vs_bare", ".3f"),
    Column("before", "tokens_per_s_vs_bare_before", ".3f", 7), Column("after", "tokens_per_s_vs_bare_after", ".3f", 7),
    Column("vs bare mem", "peak_mem_vs_bare", ".3f")])


def notes(rows, device: str) -> list[str]:
    """What a reader must know to read the table: backends that ran other kernels (starred), and the noise."""
    out = [f"{b}*: runs {f}" for b, f in dict.fromkeys((r["backend"], r["fallback"]) for r in rows if r["fallback"])]
    if device == "CPU":
        out.append("CPU: not a benchmark. Step times on a CPU (shared cores; fa1, fa2 and fa3 under Triton's "
                   "interpreter) change from run to run, and the ratios between backends with them")
    noisy = [f"{r['backend']} {r['loop']} {r['run']} at context {r['block_size']} ({r['step_time_spread_pct']:.0f}%)"
             for r in rows if (r["step_time_spread_pct"] or 0) > NOISY_PCT]
    if noisy:
        out.append(f"spread % (interquartile range of the timed steps over their median) above {NOISY_PCT}%: "
                   + ", ".join(noisy) + "; more --steps, or --repeats, tell how far the ratios hold")
    apart = [f"{s['backend']} at context {s['block_size']} ({run_range_pct(s):.0f}%)" for s in summary(rows)
             if s["runs"] > 1 and run_range_pct(s) > NOISY_PCT]
    if apart:
        out.append(f"runs of one backend more than {NOISY_PCT}% apart in tokens/s (range over median): "
                   + ", ".join(apart) + "; a ratio between backends that is smaller than this is not settled")
    return out


def run_range_pct(s: dict) -> float:
    """The range of a ``summary`` entry's runs over their median, in percent."""
    return 100 * (s["tokens_per_s_max"] - s["tokens_per_s_min"]) / s["tokens_per_s_median"]


def summary(rows) -> list[dict]:
    """Per backend and context over its trainer runs: runs, the median, min and max of their tokens/s, and the
    median's ratio to sdpa's median at that context (None without sdpa runs)."""
    groups = {}
    for r in rows:
        if r["loop"] == "trainer":
            groups.setdefault((r["backend"], r["block_size"]), []).append(r["tokens_per_s"])
    medians = {key: statistics.median(tps) for key, tps in groups.items()}
    return [dict(backend=b, block_size=c, runs=len(tps), tokens_per_s_median=medians[b, c], tokens_per_s_min=min(tps),
                 tokens_per_s_max=max(tps),
                 median_vs_sdpa=medians[b, c] / medians["sdpa", c] if ("sdpa", c) in medians else None)
            for (b, c), tps in groups.items()]


SUMMARY = Table([
    Column("backend", "backend", width=11, left=True), Column("context", "block_size"), Column("runs", "runs"),
    Column("median tokens/s", "tokens_per_s_median", ",.0f"), Column("min", "tokens_per_s_min", ",.0f", 11),
    Column("max", "tokens_per_s_max", ",.0f", 11), Column("median vs sdpa", "median_vs_sdpa", ".3f")])


def print_table(rows, device: str):
    """The rows as a table, then ``notes`` (``device``: the environment's device name, "CPU" without a GPU)."""
    print(TABLE.render(rows))
    if any(s["runs"] > 1 for s in summary(rows)):
        print("\nover the runs of each backend\n" + SUMMARY.render(summary(rows)))
    for note in notes(rows, device):
        print("note:", note)


def plot(rows, path, meta) -> list[str]:
    """A bar chart of tokens/s per backend (and bare loop, and run) and context; returns the bar labels."""
    def series(r):
        name = r["backend"] if r["loop"] == "trainer" else f"{r['backend']} (bare loop)"
        name = name if r["run"] == 1 else f"{name} #{r['run']}"
        return f"{name}, {r['fallback'].split(' (')[0]}" if r["fallback"] else name

    contexts = sorted({r["block_size"] for r in rows})
    names = list(dict.fromkeys(series(r) for r in rows))
    values = {name: [next((r["tokens_per_s"] for r in rows if series(r) == name and r["block_size"] == c), None)
                     for c in contexts] for name in names}
    return bar_chart(path, [f"context {c}" for c in contexts], values, ylabel="training tokens/s",
                     title=f"{meta['device']}: tokens/s per attention backend")


def write(rows, out_dir, stem, meta):
    write_csv(out_dir / f"{stem}.csv", rows, FIELDS)
    write_json(out_dir / f"{stem}.json", rows, **meta, summary=summary(rows), notes=notes(rows, meta["device"]))
    plot(rows, out_dir / f"{stem}.png", meta)


def parse_args(argv):
    """(parser, args) with --backends, --steps, --warmup, --repeats and --sweep checked (SystemExit naming them)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--backends", default="fa1,fa2,sdpa", help=f"comma-separated, from {', '.join(BACKENDS[1:])}")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per backend")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (compile, autotune)")
    parser.add_argument("--baseline", action="store_true",
                        help="also run the bare training loop (bench.baseline) per backend, before and after the "
                             "trainer; report ratios to it")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per backend, the backends in turn (with --baseline: trainer runs per backend, each "
                             "followed by a bare run)")
    parser.add_argument("--same-process", action="store_true",
                        help="run every backend in this process, one after another, instead of each run in a fresh "
                             "process (the runs then share its compiled graphs, caches and allocator)")
    parser.add_argument("--sweep", default="",
                        help="context lengths for a sweep, e.g. 1024,2048,4096,8192 (none by default)")
    parser.add_argument("--sweep-tokens", type=int, default=32768, help="tokens per step in the sweep")
    parser.add_argument("--name", default=f"throughput_{time.strftime('%Y-%m-%d_%H-%M-%S')}",
                        help="run group: <run.root>/<name>/<backend>, W&B group <name>")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for train.py, e.g. model=gpt2")
    args = parser.parse_intermixed_args(argv)  # Hydra overrides before, between or after the options
    args.backends = args.backends.split(",")
    bad = [b for b in args.backends if b not in BACKENDS or b == "auto"]
    if bad:
        parser.error(f"--backends: unknown {bad}; accepted {', '.join(BACKENDS[1:])}")
    twice = sorted({b for b in args.backends if args.backends.count(b) > 1})
    if twice:  # each backend's run has one folder, <name>/<backend>
        parser.error(f"--backends: {', '.join(twice)} given more than once; to time a backend again, give "
                     "--repeats N")
    for flag, value, least in (("--steps", args.steps, 1), ("--repeats", args.repeats, 1),
                               ("--warmup", args.warmup, 0)):
        if value < least:
            parser.error(f"{flag} {value}: must be >= {least}")
    refused = refused_override(args.overrides)
    if refused:
        parser.error(refused)
    try:
        args.sweep = [int(c) for c in args.sweep.split(",") if c]
    except ValueError:
        parser.error(f"--sweep {args.sweep}: give context lengths as integers separated by commas, e.g. 1024,2048")
    if any(c < 1 or args.sweep_tokens % c for c in args.sweep):
        parser.error(f"--sweep lengths must be positive divisors of --sweep-tokens={args.sweep_tokens}")
    return parser, args


def plan(parser, args):
    """(out_dir, jobs, sweep_jobs), each job (overrides, backend, label), once every run's config is valid and the
    comparison's folder new; parser.error naming the problem otherwise. Nothing is written."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from trainer import ConfigError, compose_config
    from trainer.config import RUN_NAME_RULE, override_error, valid_run_name, validate_config

    if not valid_run_name(args.name):
        parser.error(f"--name {args.name!r}: {RUN_NAME_RULE}")
    jobs = [(args.overrides, b, b) for b in args.backends]
    sweep_jobs = [(args.overrides + [f"model.block_size={context}",
                                     f"trainer.batch_size={args.sweep_tokens // context}", "trainer.grad_accum=1"],
                   b, f"{b}_ctx{context}") for context in args.sweep for b in args.backends]
    try:
        out_dir = Path(compose_config(args.overrides).run.root) / args.name
        for overrides, backend, label in jobs + sweep_jobs:
            validate_config(backend_config(overrides, backend, out_dir, label, args.warmup, args.steps))
    except HydraException as e:
        parser.error(override_error(e))
    except (ConfigError, OmegaConfBaseException) as e:
        parser.error(str(e))
    if out_dir.exists() and any(out_dir.iterdir()):
        parser.error(f"--name {args.name}: {out_dir} already holds a comparison; choose a new --name")
    return out_dir, jobs, sweep_jobs


def compare(jobs, args, out_dir, stem, meta, baseline) -> list[dict]:
    """Run the jobs in turn, ``args.repeats`` times (with ``baseline``: per job bare, then per repeat trainer and bare),
    each run in a fresh process unless ``args.same_process``, rewriting the stem's files after every run: a run that
    fails leaves the rows before it."""
    rows = []

    def keep(row):
        rows.append(row)
        add_speedups(rows)
        write(rows, out_dir, stem, meta)

    from trainer import REFUSALS as refusals

    def record(run, overrides, backend, label, k):
        run_args = (overrides, backend, out_dir, label, args.warmup, args.steps, k)
        if args.same_process:
            return keep(run(*run_args))
        try:  # a finished run is kept even when a signal came while its process ended
            in_fresh_process(run, *run_args, on_result=keep, quiet=refusals)
        except (Interrupted, KeyboardInterrupt):
            raise
        except refusals as e:  # the run refused its config or data: the message says why
            raise RunFailed(f"{label}'s run refused to start: {e}".split("\n")[0]) from None
        except Exception as e:  # its traceback is printed already, by its own process
            raise RunFailed(f"{label}'s run failed: {type(e).__name__}: {e}".split("\n")[0]) from None

    if not baseline:  # the backends in turn, so that a drift of the machine's speed falls on all of them
        for k in range(1, args.repeats + 1):
            for overrides, b, label in jobs:
                record(run_backend, overrides, b, label if k == 1 else f"{label}_{k}", k)
        return rows
    for overrides, b, label in jobs:
        record(run_bare, overrides, b, f"{label}_bare", 1)
        for k in range(1, args.repeats + 1):  # trainer, bare, trainer, bare, ...: order effects show in the bare runs
            record(run_backend, overrides, b, label if k == 1 else f"{label}_{k}", k)
            record(run_bare, overrides, b, f"{label}_bare", k + 1)
    return rows


class RunFailed(Exception):
    """A run in its own process failed (an exception there, whose traceback it printed, or a crash)."""


def kept_rows(out_dir: Path) -> str:
    """Where the rows measured so far are, or that there are none (and then the results folder, if empty, is
    removed: nothing in it to look at)."""
    if (out_dir / "throughput.csv").exists():
        return f"the rows measured before it are in {out_dir}"
    with contextlib.suppress(OSError):  # not empty (a run's own files), or already gone: kept as it is
        out_dir.rmdir()
    return "no run had finished, so no rows were written"


def main(argv=None):
    parser, args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    out_dir, jobs, sweep_jobs = plan(parser, args)
    results_folder(str(out_dir), "the results folder (run.root/--name)")
    env = environment("cuda" if torch.cuda.is_available() else "cpu")
    slow = [b for b in args.backends if b in INTERPRETED]
    if env["device"] == "CPU" and slow:
        log.warning("no CUDA GPU: %s run under Triton's interpreter here, seconds to minutes a step at the default "
                    "model; a quick check: %s", ", ".join(slow), CPU_SMOKE_TEST)
    meta = dict(**env, overrides=args.overrides, warmup=args.warmup, steps=args.steps)
    try:
        rows = compare(jobs, args, out_dir, "throughput", meta, args.baseline)
        print_table(rows, env["device"])
        if sweep_jobs:
            sweep_rows = compare(sweep_jobs, args, out_dir, "throughput_sweep",
                                 {**meta, "sweep_tokens": args.sweep_tokens}, baseline=False)
            print(f"\nsweep at {args.sweep_tokens} tokens per step")
            print_table(sweep_rows, env["device"])
    except (Interrupted, KeyboardInterrupt) as e:  # a second Ctrl-C, or one in the bare loop, is a KeyboardInterrupt
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        print(f"bench.throughput: {str(e) or 'interrupted'}; stopped there, with no row for that run and none after it "
              f"({kept_rows(out_dir)})", file=sys.stderr)
        raise SystemExit(128 + signum)
    except RunFailed as e:
        raise SystemExit(f"bench.throughput: {e}; no later run started ({kept_rows(out_dir)})")
    print(f"wrote {out_dir}/throughput.{{csv,json,png}}" + (" and throughput_sweep.*" if sweep_jobs else ""))
    return rows


if __name__ == "__main__":
    main()
