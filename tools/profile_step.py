"""Where a training step's time goes: the trainer's steps and the bare loop's under torch.profiler, side by side.

    python -m tools.profile_step --out runs/profile model=gpt2 model.vocab_size=50304 data=shakespeare_char \\
        wandb.mode=disabled trainer.compile=true trainer.batch_size=32        # GPT-2 at context 1024, attn=sdpa
    python -m tools.profile_step --analyze runs/profile/trace_trainer.json.gz   # summarise a trace again (no GPU)

Each loop trains the config of `bench.throughput` for `--backend` (the same overrides, model, data, compile):
the bare loop of `bench.baseline`, then the trainer (`train()`, whose fit loop is what runs). `--warmup` steps
run unprofiled (compile, autotune), then one profiler warm-up step, then `--steps` profiled steps (CPU and, on a
GPU, CUDA activity; no shapes or stacks, to keep the profiler's own host cost low), then the device is
synchronised and the profiler stopped, so every kernel launched in the profiled steps is in the trace.
A profiled step is one iteration of the loop on the host (a `ProfilerStep#N` range: between two of the trainer's
`on_step` calls, or two steps of the bare loop); the GPU work of a step is what was launched in that range.
The trainer's run folder is a temporary folder, deleted at the end (no checkpoint is kept).

Writes to --out: trace_<loop>.json.gz (chrome trace: https://ui.perfetto.dev or chrome://tracing),
summary_<loop>.txt, summary.json; prints both summaries and a comparison. Per loop, per profiled step (medians):
  host ms         wall time of the loop iteration on the host (profiler overhead included)
  GPU busy ms     union of the intervals of the kernels, memcpys and memsets launched in the step
  GPU idle ms     gaps between them inside the step's GPU span, plus the gap from the previous step's last one to
                  this step's first (a device that waits for the host shows here)
  kernels, memcpys (by direction), memsets launched per step
  syncs           host calls that wait for the device (cudaStreamSynchronize, cudaEventSynchronize,
                  cudaDeviceSynchronize, blocking cudaMemcpy): count and host time per step
and the largest GPU idle gaps of the window (the kernel before and after each, and the host op that launched the
one after), the ops each loop runs per step more or fewer times than the other, and the top ops by self device
time (self CPU time without a GPU), totals over the profiled steps. Runs on the CPU too (host figures only).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import collections
import gzip
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench import HelpFormatter, results_folder
from utils.atomic import atomic_write_text

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
              "cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize", "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2")
LOOPS = ("bare", "trainer")


def make_profiler(warmup: int, steps: int, trace_path: Path) -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities, schedule=torch.profiler.schedule(wait=warmup, warmup=1, active=steps, repeat=1),
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(trace_path)))


def step_hook(prof: torch.profiler.profile, warmup: int, steps: int):
    """A callback for each finished loop iteration: synchronises the device before the call that ends the profiled
    window (so the kernels of its last steps have run), then advances the profiler."""
    calls = {"n": 0}

    def hook(*_):
        calls["n"] += 1
        if calls["n"] == warmup + 1 + steps and torch.cuda.is_available():
            torch.cuda.synchronize()
        prof.step()

    return hook


def profile_loop(loop: str, cfg, warmup: int, steps: int, out_dir: Path) -> torch.profiler.profile:
    """Run one loop (cfg.trainer.max_steps = warmup + 1 + steps + 2 optimizer steps); the profiler records loop
    iterations warmup + 2 .. warmup + 1 + steps."""
    from bench.baseline import run_bare_loop
    from bench.throughput import fresh_device
    from trainer import train

    fresh_device()
    prof = make_profiler(warmup, steps, out_dir / f"trace_{loop}.json.gz")
    with prof:
        hook = step_hook(prof, warmup, steps)
        if loop == "bare":
            run_bare_loop(cfg, warmup=0, steps=cfg.trainer.max_steps, on_step=hook)
        else:
            train(cfg, on_step=hook)
    return prof


# ------------------------------------------------------------------------------------------- trace analysis


def load_trace(path: Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -float("inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _steps(events: list[dict]) -> list[dict]:
    steps = [e for e in events
             if e.get("name", "").startswith("ProfilerStep#") and e.get("cat") != "gpu_user_annotation"]
    return sorted(steps, key=lambda e: e["ts"])


def _step_of(ts: float, starts: list[float], steps: list[dict]) -> int | None:
    i = bisect.bisect_right(starts, ts) - 1
    return i if i >= 0 and ts <= steps[i]["ts"] + steps[i]["dur"] else None


def analyze(events: list[dict]) -> dict:
    """Per-step figures of one loop's trace (see the module docstring); times in ms."""
    steps = _steps(events)
    if not steps:
        raise ValueError("no ProfilerStep# ranges in the trace")
    starts = [s["ts"] for s in steps]
    n = len(steps)
    per_step = [{"ops": collections.Counter(), "gpu": [], "syncs": collections.Counter(), "sync_us": 0.0}
                for _ in range(n)]
    launch_step, launch_ts = {}, {}
    for e in events:
        cat = e.get("cat")
        k = _step_of(e["ts"], starts, steps) if cat in ("cpu_op", *RUNTIME_CATS) else None
        if cat == "cpu_op" and k is not None:
            per_step[k]["ops"][e["name"]] += 1
        elif cat in RUNTIME_CATS:
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                launch_ts[corr] = e["ts"]
                if k is not None:
                    launch_step[corr] = k
            if k is not None and e["name"] in SYNC_CALLS:
                per_step[k]["syncs"][e["name"]] += 1
                per_step[k]["sync_us"] += e["dur"]
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    for e in gpu:
        k = launch_step.get(e.get("args", {}).get("correlation"))
        if k is not None:
            per_step[k]["gpu"].append(e)
    return _summarise(steps, per_step, gpu, launch_ts, events)


def _summarise(steps, per_step, gpu, launch_ts, events) -> dict:
    host_ms = [s["dur"] / 1e3 for s in steps]
    rows, prev_end = [], None
    for s in per_step:
        acts = s["gpu"]
        row = {"kernels": sum(e["cat"] == "kernel" for e in acts),
               "memsets": sum(e["cat"] == "gpu_memset" for e in acts),
               "memcpys": collections.Counter(e["name"] for e in acts if e["cat"] == "gpu_memcpy"),
               "kernel_names": collections.Counter(e["name"] for e in acts if e["cat"] == "kernel"),
               "syncs": s["syncs"], "sync_ms": s["sync_us"] / 1e3, "ops": s["ops"]}
        if acts:
            spans = [(e["ts"], e["ts"] + e["dur"]) for e in acts]
            first, last = min(a for a, _ in spans), max(b for _, b in spans)
            row["busy_ms"] = _union(spans) / 1e3
            row["idle_within_ms"] = (last - first) / 1e3 - row["busy_ms"]
            row["idle_before_ms"] = None if prev_end is None else max(0.0, first - prev_end) / 1e3
            prev_end = last
        rows.append(row)
    return {"steps": len(steps), "host_ms": statistics.median(host_ms), "per_step": rows,
            "gpu": _gpu_medians(rows), "gaps": _largest_gaps(gpu, launch_ts, events)}


def _gpu_medians(rows: list[dict]) -> dict | None:
    with_gpu = [r for r in rows if "busy_ms" in r]
    if not with_gpu:
        return None
    med = lambda key: statistics.median(r[key] for r in with_gpu if r.get(key) is not None)  # noqa: E731
    before = [r["idle_before_ms"] for r in with_gpu if r["idle_before_ms"] is not None]
    out = {"busy_ms": med("busy_ms"), "idle_within_ms": med("idle_within_ms"),
           "idle_before_ms": statistics.median(before) if before else None,
           "kernels": med("kernels"), "memsets": med("memsets")}
    out["idle_ms"] = out["idle_within_ms"] + (out["idle_before_ms"] or 0.0)
    return out


def _largest_gaps(gpu: list[dict], launch_ts: dict, events: list[dict], count: int = 8) -> list[dict]:
    """The longest idle stretches between consecutive GPU activities of the trace, with the host op (innermost
    cpu_op) that launched the activity after each."""
    gaps, last = [], None  # last: the activity that ended latest so far (others may overlap it on other streams)
    for b in gpu:
        if last is not None and b["ts"] > last["ts"] + last["dur"]:
            gaps.append((b["ts"] - last["ts"] - last["dur"], last, b))
        if last is None or b["ts"] + b["dur"] > last["ts"] + last["dur"]:
            last = b
    gaps = sorted(gaps, key=lambda g: -g[0])[:count]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    out = []
    for gap, a, b in gaps:
        ts = launch_ts.get(b.get("args", {}).get("correlation"))
        around = [e for e in ops if ts is not None and e["ts"] <= ts <= e["ts"] + e["dur"]]
        launcher = min(around, key=lambda e: e["dur"])["name"] if around else None
        out.append({"gap_ms": gap / 1e3, "after": a["name"], "before": b["name"], "launched_by": launcher})
    return out


# ----------------------------------------------------------------------------------------------- reporting


def per_step_counts(summary: dict, key: str) -> dict[str, float]:
    """Median count per step of each op name (key='ops') or memcpy kind (key='memcpys')."""
    names = set().union(*(r[key] for r in summary["per_step"]))
    return {name: statistics.median(r[key].get(name, 0) for r in summary["per_step"]) for name in sorted(names)}


def format_summary(loop: str, s: dict, table: str) -> str:
    fmt = lambda x, f=".3f": "-" if x is None else format(x, f)  # noqa: E731
    g = s["gpu"] or {}
    syncs = collections.Counter()
    for r in s["per_step"]:
        syncs.update(r["syncs"])
    lines = [f"loop: {loop}, {s['steps']} profiled steps; per step (median):",
             f"  host time of the loop iteration   {fmt(s['host_ms'])} ms",
             f"  GPU busy                          {fmt(g.get('busy_ms'))} ms",
             f"  GPU idle inside the step          {fmt(g.get('idle_within_ms'))} ms",
             f"  GPU idle before the step          {fmt(g.get('idle_before_ms'))} ms (since the previous step's end)",
             f"  kernels / memsets                 {fmt(g.get('kernels'), 'g')} / {fmt(g.get('memsets'), 'g')}",
             f"  memcpys                           {per_step_counts(s, 'memcpys') or 'none'}",
             f"  host waits for the device         {fmt(statistics.median(r['sync_ms'] for r in s['per_step']))} ms; "
             f"calls over all profiled steps: {dict(syncs) or 'none'}"]
    if s["gaps"]:
        lines.append("largest GPU idle gaps (whole profiled window):")
        lines += [f"  {gap['gap_ms']:8.3f} ms  after {gap['after'][:60]!r}, before {gap['before'][:60]!r} "
                  f"(launched in {gap['launched_by']!r})" for gap in s["gaps"]]
    lines += ["top ops (totals over the profiled steps):", table]
    return "\n".join(lines)


def compare(summaries: dict[str, dict]) -> str:
    """A side-by-side table of the two loops and the ops whose per-step counts differ."""
    bare, trainer = summaries["bare"], summaries["trainer"]
    rows = [("host ms / step", bare["host_ms"], trainer["host_ms"])]
    for key, label in (("busy_ms", "GPU busy ms / step"), ("idle_ms", "GPU idle ms / step"),
                       ("kernels", "kernels / step")):
        rows.append((label, (bare["gpu"] or {}).get(key), (trainer["gpu"] or {}).get(key)))
    rows.append(("host waits ms / step", statistics.median(r["sync_ms"] for r in bare["per_step"]),
                 statistics.median(r["sync_ms"] for r in trainer["per_step"])))
    out = [f"{'':<22} {'bare':>10} {'trainer':>10} {'difference':>10}"]
    for label, b, t in rows:
        cells = ["-" if x is None else f"{x:.3f}" for x in (b, t, None if b is None or t is None else t - b)]
        out.append(f"{label:<22} {cells[0]:>10} {cells[1]:>10} {cells[2]:>10}")
    for key, what in (("ops", "host ops, all levels"), ("kernel_names", "GPU kernels"), ("memcpys", "memcpys")):
        b, t = per_step_counts(bare, key), per_step_counts(trainer, key)
        diff = {n: t.get(n, 0) - b.get(n, 0) for n in sorted(set(b) | set(t))}
        diff = {n: d for n, d in diff.items() if d}
        out.append(f"{what} per step, trainer minus bare: "
                   + (", ".join(f"{n[:80]} {d:+g}" for n, d in diff.items()) if diff else "none"))
    return "\n".join(out)


def op_table(prof: torch.profiler.profile) -> str:
    sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=20, max_name_column_width=70)


def jsonable(summary: dict) -> dict:
    return {**summary, "per_step": [{k: dict(v) if isinstance(v, collections.Counter) else v for k, v in r.items()}
                                    for r in summary["per_step"]]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--backend", default="sdpa", help="attention backend (attn=...) of both loops")
    parser.add_argument("--warmup", type=int, default=6, help="unprofiled steps first (compile, autotune)")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps per loop")
    parser.add_argument("--loops", default="bare,trainer", help="which loops to profile, in this order")
    parser.add_argument("--out", default=f"runs/profile_{time.strftime('%Y-%m-%d_%H-%M-%S')}",
                        help="folder for the traces and summaries")
    parser.add_argument("--analyze", nargs="+", metavar="TRACE", help="only summarise these trace files")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for train.py, e.g. model=gpt2")
    args = parser.parse_args(argv)
    if args.analyze:
        for path in args.analyze:
            try:
                trace = load_trace(Path(path))
            except (OSError, ValueError, KeyError, TypeError) as e:  # missing, not gzip or JSON, not a trace
                parser.error(f"--analyze {path}: not a readable trace of this tool ({type(e).__name__}: {e})")
            print(format_summary(path, analyze(trace), "(op table: only when profiled)"))
        return None
    loops = args.loops.split(",")
    if args.steps < 1 or args.warmup < 0 or not set(loops) <= set(LOOPS):
        parser.error(f"--steps {args.steps} --warmup {args.warmup} --loops {args.loops}: give --steps >= 1, "
                     f"--warmup >= 0 and --loops from {', '.join(LOOPS)}")
    check_config(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from trainer import REFUSALS

    try:
        return run(args, loops)
    except REFUSALS as e:  # the data, the device's memory or the backend refused the run: one line
        with contextlib.suppress(OSError):  # the results folder, if nothing was written to it
            Path(args.out).rmdir()
        raise SystemExit(f"tools.profile_step: {e}") from None


def check_config(parser, args) -> None:
    """parser.error naming the problem when --backend or an override would not make a valid training config; run
    before anything is written."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from bench.throughput import OWNED_KEYS, backend_config, refused_override
    from model.backends import BACKENDS
    from trainer import ConfigError
    from trainer.config import override_error, validate_config

    if args.backend not in BACKENDS:
        parser.error(f"--backend {args.backend}: accepted {', '.join(BACKENDS)}")
    refused = refused_override(args.overrides, {**OWNED_KEYS, "attn": "--backend", "run.name": "--out",
                                                 "wandb.group": "--out"})
    if refused:
        parser.error(refused)
    try:
        validate_config(backend_config(args.overrides, args.backend, Path(tempfile.gettempdir()), "trainer",
                                       args.warmup + 1, args.steps + 2))
    except HydraException as e:
        parser.error(override_error(e))
    except (ConfigError, OmegaConfBaseException) as e:
        parser.error(str(e))


def run(args, loops: list[str]) -> dict:
    from bench.throughput import backend_config

    out_dir = results_folder(args.out)
    summaries, tables = {}, {}
    with tempfile.TemporaryDirectory(prefix="profile_step_") as runs:
        # warmup + 1 (profiler warm-up) + steps + 2, so the final step's evaluation and checkpoint are outside
        cfg = backend_config(args.overrides, args.backend, Path(runs), "trainer", args.warmup + 1, args.steps + 2)
        for loop in loops:
            prof = profile_loop(loop, cfg, args.warmup, args.steps, out_dir)
            summaries[loop] = analyze(load_trace(out_dir / f"trace_{loop}.json.gz"))
            tables[loop] = op_table(prof)
            text = format_summary(loop, summaries[loop], tables[loop])
            atomic_write_text(out_dir / f"summary_{loop}.txt", text + "\n")
            print(text)
    meta = dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU", torch=torch.__version__,
                backend=args.backend, overrides=args.overrides, warmup=args.warmup, steps=args.steps)
    result = {**meta, "loops": {k: jsonable(v) for k, v in summaries.items()}}
    if set(summaries) == set(LOOPS):
        result["comparison"] = compare(summaries)
        print(result["comparison"])
        atomic_write_text(out_dir / "comparison.txt", result["comparison"] + "\n")
    atomic_write_text(out_dir / "summary.json", json.dumps(result, indent=1, default=str))
    print(f"wrote {out_dir}/trace_<loop>.json.gz, summary_<loop>.txt, summary.json")
    return result


if __name__ == "__main__":
    main()
