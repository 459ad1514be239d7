"""bench.throughput end to end on CPU: a tiny sdpa model and a micro fa2 model (Triton interpreter)."""

import csv
import json
import random
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import throughput

ROOT = Path(__file__).resolve().parents[2]


def check_outputs(out_dir, stem, rows, backends):
    assert (out_dir / f"{stem}.png").stat().st_size > 0
    with open(out_dir / f"{stem}.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["backend"] for r in table] == [r["backend"] for r in rows]
    assert json.loads((out_dir / f"{stem}.json").read_text())["rows"] == rows
    for r in rows:
        assert r["backend"] in backends and r["step_time_ms"] > 0 and r["tokens_per_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / (r["step_time_ms"] / 1e3))
        assert r["tokens_per_step"] == r["batch_size"] * r["block_size"]
        assert r["mfu"] is None and r["peak_mem_gib"] is None  # CPU: no peak FLOP/s, no CUDA memory
        assert r["final_train_loss"] > 0 and r["speedup_vs_sdpa"] > 0
        if r["backend"] == "sdpa":
            assert r["speedup_vs_sdpa"] == 1.0


def test_compares_backends_and_sweeps_context(tmp_path, tiny_overrides, capsys, monkeypatch):
    overrides = [o for o in tiny_overrides if not o.startswith(("run.", "attn=", "trainer.max_steps"))]
    overrides += [f"run.root={tmp_path}", "wandb.mode=offline", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
                  "model.block_size=16", "trainer.batch_size=2"]
    isolated = []

    def in_fresh_process(run, *args, **kwargs):  # each run in its own process: the real call, counted
        isolated.append((run.__name__, args[1], args[3]))
        return real_in_fresh_process(run, *args, **kwargs)

    real_in_fresh_process = throughput.in_fresh_process
    monkeypatch.setattr(throughput, "in_fresh_process", in_fresh_process)
    rows = throughput.main(["--backends", "sdpa,fa2", "--steps", "2", "--warmup", "1", "--sweep", "16,32",
                            "--sweep-tokens", "64", "--name", "cmp", *overrides])
    assert isolated == [("run_backend", b, label) for b, label in (
        ("sdpa", "sdpa"), ("fa2", "fa2"), ("sdpa", "sdpa_ctx16"), ("fa2", "fa2_ctx16"), ("sdpa", "sdpa_ctx32"),
        ("fa2", "fa2_ctx32"))]
    out_dir = tmp_path / "cmp"
    check_outputs(out_dir, "throughput", rows, {"sdpa", "fa2"})
    sweep = json.loads((out_dir / "throughput_sweep.json").read_text())["rows"]
    assert [(r["backend"], r["block_size"], r["batch_size"]) for r in sweep] == [
        ("sdpa", 16, 4), ("fa2", 16, 4), ("sdpa", 32, 2), ("fa2", 32, 2)]
    check_outputs(out_dir, "throughput_sweep", sweep, {"sdpa", "fa2"})
    # Same seed, same data, same model: the backends' losses agree (fp32 on CPU).
    assert rows[0]["final_train_loss"] == pytest.approx(rows[1]["final_train_loss"], rel=1e-3)
    # One run folder and one offline W&B run per backend and context, all in one W&B group.
    for label in ("sdpa", "fa2", "sdpa_ctx16", "fa2_ctx32"):
        runs = list((out_dir / label / "wandb").glob("offline-run-*"))
        assert len(runs) == 1
    printed = capsys.readouterr().out
    assert "tokens/s" in printed and "vs sdpa" in printed
    with pytest.raises(SystemExit):  # the same --name again: refused before anything runs
        throughput.main(["--backends", "sdpa", "--name", "cmp", *overrides])
    assert "already holds a comparison" in capsys.readouterr().err



def test_fallback_rows_and_noise_are_marked(tmp_path, tiny_overrides, capsys, caplog):
    """On a CPU: fa3 runs FA2's kernels and its row says so (starred, named under the table); every row has the
    spread of its step times; the table says a CPU is not a benchmark."""
    overrides = [o for o in tiny_overrides if not o.startswith(("run.", "attn=", "trainer.max_steps"))]
    overrides += [f"run.root={tmp_path}", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=16",
                  "trainer.batch_size=2"]
    rows = throughput.main(["--same-process", "--backends", "fa3,sdpa", "--steps", "3", "--warmup", "1", "--name", "fb",
                            *overrides])
    assert [(r["backend"], r["fallback"]) for r in rows] == [("fa3", "FA2's Triton kernels (no CUDA GPU)"),
                                                            ("sdpa", None)]
    if not torch.cuda.is_available():  # said before the runs, with a command that takes seconds
        assert "fa3 run under Triton's interpreter here, seconds to minutes a step" in caplog.text
        assert throughput.CPU_SMOKE_TEST in caplog.text and throughput.CPU_SMOKE_TEST in throughput.__doc__.replace(
            "\n", " ")
    assert all(r["step_time_spread_pct"] >= 0 for r in rows)
    printed = capsys.readouterr().out
    assert "\nfa3* " in printed and "note: fa3*: runs FA2's Triton kernels (no CUDA GPU)" in printed
    assert "note: CPU: not a benchmark" in printed and "spread %" in printed
    meta = json.loads((tmp_path / "fb" / "throughput.json").read_text())
    assert meta["rows"] == rows and any("not a benchmark" in n for n in meta["notes"])


def test_runs_leave_no_checkpoint(tmp_path, tiny_overrides):
    """A throughput run keeps its metrics and W&B files but not the trainer's final checkpoint (1.4 GB for GPT-2)."""
    overrides = [o for o in tiny_overrides if not o.startswith(("run.", "attn=", "trainer.max_steps"))]
    overrides += [f"run.root={tmp_path}", "model.n_layer=1", "model.block_size=16", "trainer.batch_size=2"]
    throughput.main(["--same-process", "--backends", "sdpa", "--steps", "1", "--warmup", "1", "--name", "nock",
                     *overrides])
    run_dir = tmp_path / "nock" / "sdpa"
    assert (run_dir / "metrics.jsonl").stat().st_size > 0 and not (run_dir / "checkpoints").exists()


def test_spread_is_the_interquartile_range_over_the_median():
    import numpy as np

    times = [random.uniform(1, 2) for _ in range(random.randint(2, 30))]
    q1, q3 = np.percentile(times, [25, 75])
    assert throughput.spread_pct(times) == pytest.approx(100 * (q3 - q1) / np.median(times))
    assert throughput.spread_pct([5.0]) is None


def test_notes_name_fallbacks_and_noisy_rows_only():
    row = lambda backend, spread, fb=None: dict(backend=backend, loop="trainer", run=1, block_size=1024,
                                                step_time_spread_pct=spread, fallback=fb, tokens_per_s=1.0)
    assert throughput.notes([row("fa2", 3.0), row("sdpa", None)], "NVIDIA H200") == []
    notes = throughput.notes([row("fa3", 25.0, "FA2's Triton kernels (GPU compute capability 8.0 is not 9.0 (Hopper))"),
                              row("sdpa", 4.0)], "NVIDIA A100-SXM4-80GB")
    assert notes[0] == "fa3*: runs FA2's Triton kernels (GPU compute capability 8.0 is not 9.0 (Hopper))"
    assert "fa3 trainer 1 at context 1024 (25%)" in notes[1] and "sdpa" not in notes[1]
    assert any("not a benchmark" in n for n in throughput.notes([row("sdpa", 1.0)], "CPU"))


def test_notes_name_backends_whose_runs_lie_far_apart():
    row = lambda backend, run, tps: dict(backend=backend, loop="trainer", run=run, block_size=8192,
                                         step_time_spread_pct=1.0, fallback=None, tokens_per_s=tps)
    close = [row("fa3", 1, 100.0), row("fa2", 1, 90.0), row("fa3", 2, 105.0), row("fa2", 2, 91.0)]
    assert throughput.notes(close, "NVIDIA H100 80GB HBM3") == []
    apart = [row("fa3", 1, 100.0), row("fa2", 1, 90.0), row("fa3", 2, 125.0), row("fa2", 2, 91.0),
             row("fa3", 3, 110.0)]
    notes = throughput.notes(apart, "NVIDIA H100 80GB HBM3")
    assert notes == ["runs of one backend more than 10% apart in tokens/s (range over median): fa3 at context 8192 "
                     "(23%); a ratio between backends that is smaller than this is not settled"]


def test_bar_labels_keep_small_values(tmp_path):
    """Bars of 23, 12 and 10 tokens/s read 23, 12 and 10 (not 0.0k); large ones are shortened."""
    row = lambda backend, context, tps: dict(backend=backend, loop="trainer", run=1, block_size=context,
                                             tokens_per_s=tps, fallback=None)
    rows = [row("flex", 16, 23.0), row("sdpa", 16, 12.4), row("fa2", 16, 10.0), row("fa2", 32, 123_456.0)]
    labels = throughput.plot(rows, tmp_path / "t.png", {"device": "CPU"})
    assert labels == ["23", "12", "10", "123k"] and (tmp_path / "t.png").stat().st_size > 0


def test_rows_measured_before_a_backend_fails_are_kept(tmp_path, tiny_overrides, monkeypatch):
    """A backend that ends the process (on the GPU a CUDA error aborts it) must not take the rows measured before
    it along: the files are rewritten after every run."""
    overrides = [o for o in tiny_overrides if not o.startswith(("run.", "attn=", "trainer.max_steps"))]
    overrides += [f"run.root={tmp_path}", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=16",
                  "trainer.batch_size=2"]
    real = throughput.run_backend

    def second_fails(overrides, backend, *args, **kwargs):
        if backend == "flex":
            raise RuntimeError("CUDA error: operation not supported on global/shared address space")
        return real(overrides, backend, *args, **kwargs)

    monkeypatch.setattr(throughput, "run_backend", second_fails)
    with pytest.raises(RuntimeError, match="CUDA error"):
        throughput.main(["--same-process", "--backends", "sdpa,flex", "--steps", "1", "--warmup", "1", "--name",
                         "crash", *overrides])
    rows = json.loads((tmp_path / "crash" / "throughput.json").read_text())["rows"]
    assert [r["backend"] for r in rows] == ["sdpa"] and rows[0]["tokens_per_s"] > 0

def test_repeats_run_the_backends_in_turn_and_summarise_each(tmp_path, tiny_overrides, capsys):
    """--repeats 2: sdpa, flex, sdpa, flex, each its own row and run folder; the summary gives each backend's median,
    range and ratio to sdpa's median over its runs."""
    overrides = [o for o in tiny_overrides if not o.startswith(("run.", "attn=", "trainer.max_steps"))]
    overrides += [f"run.root={tmp_path}", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=16",
                  "trainer.batch_size=2"]
    rows = throughput.main(["--same-process", "--backends", "sdpa,flex", "--repeats", "2", "--steps", "2",
                            "--warmup", "1", "--name", "turns", *overrides])
    assert [(r["backend"], r["run"]) for r in rows] == [("sdpa", 1), ("flex", 1), ("sdpa", 2), ("flex", 2)]
    for label in ("sdpa", "flex", "sdpa_2", "flex_2"):
        assert (tmp_path / "turns" / label / "metrics.jsonl").stat().st_size > 0
    meta = json.loads((tmp_path / "turns" / "throughput.json").read_text())
    by_backend = {s["backend"]: s for s in meta["summary"]}
    for backend in ("sdpa", "flex"):
        tps = [r["tokens_per_s"] for r in rows if r["backend"] == backend]
        s = by_backend[backend]
        assert (s["runs"], s["block_size"]) == (2, 16)
        assert s["tokens_per_s_median"] == pytest.approx(statistics.median(tps))
        assert (s["tokens_per_s_min"], s["tokens_per_s_max"]) == (min(tps), max(tps))
    assert by_backend["sdpa"]["median_vs_sdpa"] == 1.0
    assert by_backend["flex"]["median_vs_sdpa"] == pytest.approx(
        by_backend["flex"]["tokens_per_s_median"] / by_backend["sdpa"]["tokens_per_s_median"])
    printed = capsys.readouterr().out
    assert "over the runs of each backend" in printed and "median vs sdpa" in printed


def test_the_summary_needs_no_sdpa_and_skips_bare_rows():
    row = lambda backend, loop, tps, context=1024: dict(backend=backend, loop=loop, block_size=context,
                                                        tokens_per_s=tps)
    rows = [row("fa3", "trainer", 3.0), row("fa3", "bare", 100.0), row("fa3", "trainer", 1.0),
            row("fa3", "trainer", 2.0), row("fa2", "trainer", 5.0, 2048)]
    assert throughput.summary(rows) == [
        dict(backend="fa3", block_size=1024, runs=3, tokens_per_s_median=2.0, tokens_per_s_min=1.0,
             tokens_per_s_max=3.0, median_vs_sdpa=None),
        dict(backend="fa2", block_size=2048, runs=1, tokens_per_s_median=5.0, tokens_per_s_min=5.0,
             tokens_per_s_max=5.0, median_vs_sdpa=None)]


def test_a_run_that_refuses_its_config_in_its_process_is_one_line_naming_it(tmp_path, tiny_overrides, capfd):
    """A sweep context longer than the data is refused inside its run's process (the data is read there): one line
    naming the run and the reason, as train.py gives it, with no traceback from either process; the rows measured
    before it are kept."""
    overrides = [o for o in tiny_overrides if not o.startswith(("run.", "attn=", "trainer.max_steps"))]
    overrides += [f"run.root={tmp_path}", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=16",
                  "trainer.batch_size=2"]
    with pytest.raises(SystemExit) as exit_info:
        throughput.main(["--backends", "sdpa", "--steps", "1", "--warmup", "1", "--sweep", "1048576",
                         "--sweep-tokens", "1048576", "--name", "fails", *overrides])
    message = str(exit_info.value.code)
    assert re.fullmatch(r"bench.throughput: sdpa_ctx1048576's run refused to start: .+; no later run started "
                        rf"\(the rows measured before it are in {re.escape(str(tmp_path / 'fails'))}\)", message), message
    assert "Traceback" not in capfd.readouterr().err
    rows = json.loads((tmp_path / "fails" / "throughput.json").read_text())["rows"]
    assert [r["backend"] for r in rows] == ["sdpa"]


def test_kept_rows_says_when_there_are_none_and_drops_an_empty_folder(tmp_path):
    """No rows: said so, and the results folder goes if nothing is in it (a run's own files keep it)."""
    empty, partial, rows = tmp_path / "empty", tmp_path / "partial", tmp_path / "rows"
    for folder in (empty, partial, rows):
        folder.mkdir()
    (partial / "sdpa").mkdir()
    (rows / "throughput.csv").write_text("backend\n")
    for folder in (empty, partial):
        assert throughput.kept_rows(folder) == "no run had finished, so no rows were written"
    assert not empty.exists() and (partial / "sdpa").is_dir()
    assert throughput.kept_rows(rows) == f"the rows measured before it are in {rows}"


def test_document_masks_compare_fa2_flex_and_sdpa(tmp_path, tiny_overrides):
    """The document-mask comparison on a micro model: --backends fa2,flex,sdpa with data.document_mask=true, one row
    per backend, the same losses (the same masked model)."""
    overrides = [o for o in tiny_overrides if not o.startswith(("run.", "attn=", "trainer.max_steps"))]
    overrides += [f"run.root={tmp_path}", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=16",
                  "trainer.batch_size=2", "data.document_mask=true", "model.attn_window=6"]
    rows = throughput.main(["--same-process", "--backends", "fa2,flex,sdpa", "--steps", "1", "--warmup", "1",
                            "--name", "docs", *overrides])
    assert [r["backend"] for r in rows] == ["fa2", "flex", "sdpa"]
    for r in rows[:2]:
        assert r["final_train_loss"] == pytest.approx(rows[2]["final_train_loss"], rel=1e-4)


def test_the_long_context_document_comparison_validates_on_a_gpu(monkeypatch, tmp_path):
    """The README's GPT-2 context-8192 document-mask command: every backend's config passes validation on a GPU
    machine (a CUDA device is pretended; nothing runs)."""
    import trainer.config as tc
    from model.backends.triton import TritonBackend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(TritonBackend, "head_dim_limits", lambda self: (16, 256))  # no kernel import needed
    overrides = ["model=gpt2", "model.vocab_size=50304", "model.block_size=8192", "trainer.batch_size=2",
                 "data=shakespeare_scenes", "data.tokenizer=tiktoken", "data.document_mask=true", "trainer.compile=true"]
    for backend in ("fa2", "flex", "sdpa"):
        cfg = throughput.backend_config(overrides, backend, tmp_path / "long_docs", backend, 10, 20)
        tc.validate_config(cfg)
        assert cfg.model.block_size == 8192 and cfg.data.document_mask and cfg.attn.backend == backend


def test_overrides_may_stand_between_the_options():
    _, args = throughput.parse_args(["model=tiny", "--backends", "sdpa", "model.n_layer=1", "--steps", "2",
                                     "trainer.batch_size=2"])
    assert args.overrides == ["model=tiny", "model.n_layer=1", "trainer.batch_size=2"] and args.steps == 2


@pytest.mark.parametrize("argv,message", [
    (["--backends", "sdpa,flash"], "unknown"),
    (["--backends", "sdpa,fa2,sdpa"], "--backends: sdpa given more than once; to time a backend again, give "
                                      "--repeats N"),
    (["--steps", "0"], "--steps 0: must be >= 1"),
    (["--warmup", "-1"], "--warmup -1: must be >= 0"),
    (["--repeats", "0"], "--repeats 0: must be >= 1"),
    (["--backends", "sdpa", "attn=fa2"], "attn=fa2: the benchmark sets attn itself; give --backends instead"),
    (["attn.backend=fa1"], "attn.backend=fa1: the benchmark sets attn itself; give --backends instead"),
    (["trainer.max_steps=9"], "trainer.max_steps=9: the benchmark sets trainer.max_steps itself; give --warmup "
                              "and --steps instead"),
    (["+run.name=x"], "+run.name=x: the benchmark sets run.name itself; give --name instead"),
    (["--sweep", "100", "--sweep-tokens", "64"], "divisors"),
    (["--sweep", "8,abc"], "--sweep 8,abc: give context lengths as integers separated by commas"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        throughput.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags,bad,message", [
    (["--name", "../escape"], [], "path separators"),
    (["--backends", "sdpa"], ["trainer.batch_size=0"], "trainer.batch_size"),
    (["--backends", "sdpa"], ["data=tiny_missing"], "tiny_missing"),
    pytest.param(["--backends", "sdpa_cudnn"], [], "needs a CUDA GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")),
])
def test_bad_names_and_configs_are_refused_before_anything_is_written(flags, bad, message, tiny_overrides, tmp_path,
                                                                      capsys):
    overrides = [a for a in tiny_overrides if not a.startswith(("run.", "attn=", "trainer.max_steps"))]
    root = tmp_path / "runs"
    with pytest.raises(SystemExit) as exit_info:
        throughput.main([*flags, *overrides, f"run.root={root}", *bad])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not root.exists() and not (ROOT / "escape").exists()


def test_a_results_folder_that_cannot_be_made_is_one_line(tiny_overrides, tmp_path):
    """run.root under a file: one line naming the results folder and why, before any run; the file kept."""
    overrides = [a for a in tiny_overrides if not a.startswith(("run.", "attn=", "trainer.max_steps"))]
    blocker = tmp_path / "afile"
    blocker.write_text("kept")
    with pytest.raises(SystemExit, match=f"the results folder \\(run.root/--name\\) {blocker}/runs/cmp: cannot "
                                         "create or write this folder"):
        throughput.main(["--backends", "sdpa", "--name", "cmp", *overrides, f"run.root={blocker / 'runs'}"])
    assert blocker.read_text() == "kept"


def test_bare_loop_computes_what_the_trainer_computes(make_cfg):
    """Same model, data, optimizer and LR schedule: the bare loop's losses are the trainer's (fp32 CPU)."""
    from bench.baseline import run_bare_loop
    from trainer import train

    cfg = make_cfg("trainer.max_steps=4", "trainer.grad_accum=2", "eval.interval=0", "ckpt.interval=0",
                   "run.name=ref", "model.dropout=0.1")
    bare = run_bare_loop(cfg, warmup=1, steps=3)
    ref = train(cfg)
    assert bare["losses"] == [r["train/loss"] for r in ref.records]
    assert bare["step_time_s"] > 0 and bare["peak_mem_gib"] is None and bare["tokens_per_step"] == ref.tokens_per_step


def test_baseline_rows_and_ratios(tmp_path, tiny_overrides, capsys):
    """The bare loop runs before and after each trainer run; a trainer row has its ratio to both and to their mean."""
    overrides = [o for o in tiny_overrides if not o.startswith(("run.", "attn=", "trainer.max_steps"))]
    overrides += [f"run.root={tmp_path}", "model.n_layer=1", "model.block_size=16", "trainer.batch_size=2"]
    rows = throughput.main(["--backends", "sdpa", "--baseline", "--repeats", "2", "--steps", "3", "--warmup", "1",
                            "--name", "base", *overrides])
    assert [(r["loop"], r["run"]) for r in rows] == [("bare", 1), ("trainer", 1), ("bare", 2), ("trainer", 2),
                                                     ("bare", 3)]
    bare1, trainer1, bare2, trainer2, bare3 = rows
    for trainer, before, after in ((trainer1, bare1, bare2), (trainer2, bare2, bare3)):
        tps = trainer["tokens_per_s"]
        assert trainer["tokens_per_s_vs_bare_before"] == pytest.approx(tps / before["tokens_per_s"])
        assert trainer["tokens_per_s_vs_bare_after"] == pytest.approx(tps / after["tokens_per_s"])
        mean_bare = (before["tokens_per_s"] + after["tokens_per_s"]) / 2
        assert trainer["tokens_per_s_vs_bare"] == pytest.approx(tps / mean_bare)
        assert trainer["peak_mem_vs_bare"] is None  # CPU: no CUDA memory figures
        assert trainer["final_train_loss"] == before["final_train_loss"]  # the same computation
    for r in rows:  # both loops: the median of per-step times, the mean beside it
        assert r["step_time_ms"] > 0 and r["step_time_mean_ms"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / (r["step_time_ms"] / 1e3))
    assert all(r["tokens_per_s_vs_bare"] is None and r["speedup_vs_sdpa"] is None for r in (bare1, bare2, bare3))
    out = capsys.readouterr().out
    assert "vs bare tok/s" in out and "before" in out and "bare 3" in out
    table = json.loads((tmp_path / "base" / "throughput.json").read_text())["rows"]
    assert table == rows and (tmp_path / "base" / "throughput.png").stat().st_size > 0


def test_bare_loop_refuses_a_batch_the_device_cannot_hold_before_making_it(make_cfg, monkeypatch):
    """The bare loop checks memory as the trainer does (`check_memory`): a batch far too large is a ConfigError
    naming it, before any batch is drawn."""
    from bench import baseline
    from trainer import ConfigError

    drawn = []
    monkeypatch.setattr(baseline.ShardedBatchSampler, "next_batches", lambda self: drawn.append(1))
    with pytest.raises(ConfigError, match="too large"):
        baseline.run_bare_loop(make_cfg("trainer.batch_size=100000000"), warmup=1, steps=1)
    assert not drawn


def test_bare_loop_times_every_step_like_the_trainer(make_cfg):
    from bench.baseline import run_bare_loop

    steps_seen = []
    bare = run_bare_loop(make_cfg("trainer.max_steps=5", "eval.interval=0", "ckpt.interval=0"), warmup=2, steps=3,
                         on_step=steps_seen.append)
    assert steps_seen == [0, 1, 2, 3, 4] and len(bare["step_times_s"]) == 3 and len(bare["losses"]) == 5
    assert bare["step_time_s"] == statistics.median(bare["step_times_s"])
    assert bare["step_time_mean_s"] == pytest.approx(statistics.mean(bare["step_times_s"]))


def test_bench_help_shows_defaults():
    for module in ("throughput", "masks", "attention", "generate"):  # tools.profile_step: tests/tools
        out = subprocess.run([sys.executable, "-m", f"bench.{module}", "--help"], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0 and "(default: " in out.stdout, out.stderr[-2000:]
    out = subprocess.run([sys.executable, "sample.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "(default: 500)" in out.stdout and "(default: 1337)" in out.stdout


def test_the_baseline_library_says_it_has_no_command_line():
    out = subprocess.run([sys.executable, "-m", "bench.baseline", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and "bench.throughput --baseline" in out.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("compile_", ["false", "true"])
def test_trainer_peak_memory_is_within_5_percent_of_the_bare_loop(make_cfg, compile_):
    """The trainer's memory target (within 5% of the bare loop's peak) on a vocabulary-heavy small model (logits
    dominate), bf16 autocast."""
    from bench.baseline import run_bare_loop
    from trainer import train

    cfg = make_cfg("trainer.device=cuda", "trainer.dtype=bf16", f"trainer.compile={compile_}", "model.vocab_size=16384",
                   "model.block_size=256", "model.n_embd=128", "trainer.batch_size=16", "trainer.max_steps=4",
                   "eval.interval=0", "ckpt.interval=0", "run.name=mem")
    torch._dynamo.reset()
    bare = run_bare_loop(cfg, warmup=1, steps=3)
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    records = train(cfg).records
    peak = max(r["perf/peak_mem_gib"] for r in records)
    assert peak <= 1.05 * bare["peak_mem_gib"], (peak, bare["peak_mem_gib"])


def test_ctrl_c_ends_the_comparison_without_a_row_for_the_cut_run(tmp_path, tiny_overrides, monkeypatch, capsys):
    """Ctrl-C stops the run in flight (the trainer saves and returns); the bench must then stop too, with no row
    for that shortened run and no later backend run, and exit 130, not report a short run beside full ones."""
    import os
    import signal

    import trainer

    overrides = [o for o in tiny_overrides if not o.startswith(("run.", "attn=", "trainer.max_steps"))]
    overrides += [f"run.root={tmp_path}", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
                  "model.block_size=16", "trainer.batch_size=2"]
    real_train, started = trainer.train, []

    def ctrl_c_at_step_2(cfg):
        started.append(cfg.attn.backend)
        interrupt = cfg.attn.backend == "flex"
        return real_train(cfg, on_step=lambda r: interrupt and r["step"] == 2 and os.kill(os.getpid(), signal.SIGINT))

    monkeypatch.setattr(trainer, "train", ctrl_c_at_step_2)
    with pytest.raises(SystemExit) as exit_info:
        throughput.main(["--same-process", "--backends", "sdpa,flex,fa2", "--steps", "5", "--warmup", "1", "--name",
                         "cut", *overrides])
    assert exit_info.value.code == 128 + signal.SIGINT
    assert started == ["sdpa", "flex"]  # fa2 never started
    rows = json.loads((tmp_path / "cut" / "throughput.json").read_text())["rows"]
    assert [r["backend"] for r in rows] == ["sdpa"]
    # the trainer stops after the step in flight when the signal came (one step later: steps are read one late)
    assert re.search(r"flex was interrupted at step [23] of 6; stopped there", capsys.readouterr().err)


def test_a_fresh_process_prints_the_traceback_of_failures_but_not_of_quiet_errors(capsys):
    """`bench._child_main` (the child of `in_fresh_process`, called here in this process): an error of a `quiet`
    type is sent back without a traceback; any other is sent after its traceback."""
    import bench

    class Sent:
        def __init__(self):
            self.messages = []

        def send(self, message):
            self.messages.append(message)

        def close(self):
            pass

    def fail(kind):
        raise kind("the message")

    for kind, quiet, printed in ((ValueError, (ValueError,), False), (RuntimeError, (ValueError,), True)):
        sent = Sent()
        bench._child_main(sent, fail, (kind,), quiet)
        (status, error), = sent.messages
        assert status == "raised" and type(error) is kind
        assert ("Traceback" in capsys.readouterr().err) == printed
