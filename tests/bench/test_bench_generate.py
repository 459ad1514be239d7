"""bench.generate on the CPU: a tiny model and a few tokens (the real table needs a GPU)."""

import csv
import json

import pytest

from bench import generate


def test_generate_bench_smoke(tmp_path, capsys):
    out = tmp_path / "gen"
    rows = generate.main(["--out", str(out), "--model", "tiny", "--vocab-size", "64", "--device", "cpu",
                          "--backends", "sdpa,fa2,fa2_splitkv", "--batch", "1,2", "--prompt-len", "3",
                          "--new-tokens", "3", "--modes", "eager"])
    # batch sizes in the order given, then backends; per (batch, backend) no cache first (the split-K/V decode differs
    # from fa2 only with the cache)
    assert [(r["batch"], r["backend"], r["kv_cache"]) for r in rows] == [
        (n, b, c) for n in (1, 2) for b in ("sdpa", "fa2", "fa2_splitkv") for c in (False, True)
        if not (b == "fa2_splitkv" and not c)]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["tokens_per_s"] == pytest.approx(r["batch"] * 3 / r["seconds"])
        assert (r["speedup_vs_no_cache"] is not None) == r["kv_cache"]
        assert r["warmup_s"] > 0 and r["compiles"] == 0
    with open(out / "generate.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    meta = json.loads((out / "generate.json").read_text())
    assert meta["device"] == "CPU" and len(meta["rows"]) == len(rows) and len(meta["summary"]) == 6
    assert meta["skipped"] == [] and meta["errors"] == []
    printed = capsys.readouterr().out
    assert "tokens/s" in printed and "sdpa batch 2: cache" in printed and "fa2_splitkv batch 1: cache" in printed


def test_generate_bench_case_order():
    """The cache-against-no-cache comparison first (batch 8: cache on as an eager CUDA graph, cache off eager and
    compiled, cache on as a compiled CUDA graph); no graph modes without the cache or without a fixed-shape decode
    step (fa1); fa3 and fa2_splitkv take fa2's fixed-shape step, so they skip it."""
    todo = generate.cases(["sdpa", "fa1", "fa3", "fa2_splitkv"], [8, 1], ["on", "off"], list(generate.MODES))
    assert todo[:6] == [(8, "sdpa", "on", "eager-graph"), (8, "sdpa", "off", "eager"), (8, "sdpa", "off", "compiled"),
                        (8, "sdpa", "on", "compiled-graph"), (8, "sdpa", "on", "compiled"), (8, "sdpa", "on", "eager")]
    by = lambda backend: [(c, m) for b, be, c, m in todo if (b, be) == (8, backend)]
    assert by("fa1") == [("off", "eager"), ("off", "compiled"), ("on", "compiled"), ("on", "eager")]
    assert by("fa3") == [("off", "eager"), ("off", "compiled"), ("on", "eager")]
    assert by("fa2_splitkv") == [("on", "eager")]
    assert [t[0] for t in todo] == [8] * 14 + [1] * 14


def test_generate_bench_summary_uses_fa2s_static_step_for_fa3():
    row = lambda backend, cache, mode, tps: dict(backend=backend, batch=8, kv_cache=cache, mode=mode, tokens_per_s=tps)
    rows = [row("fa2", False, "eager", 100.0), row("fa2", True, "compiled-graph", 900.0),
            row("fa2", True, "eager", 120.0), row("fa3", False, "eager", 110.0), row("fa3", False, "compiled", 200.0),
            row("fa3", True, "eager", 130.0)]
    summary = generate.add_speedups(rows)
    assert summary == ["fa2 batch 8: cache 900 tokens/s (compiled-graph) vs no cache 100 (eager): 9.00x",
                       "fa3 batch 8: cache 900 tokens/s (compiled-graph, fa2's step) vs no cache 200 (compiled): 4.50x"]
    assert rows[1]["speedup_vs_no_cache"] is None  # no compiled no-cache row of fa2 to compare with
    assert rows[2]["speedup_vs_no_cache"] == pytest.approx(1.2)


def test_generate_bench_keeps_rows_of_a_killed_run_and_reports_failures(tmp_path, monkeypatch, capsys):
    """Each row reaches generate.csv as soon as it is measured, and Ctrl-C ends the run with one line and exit 130;
    a failing case is reported and the others still run."""
    calls = []

    def fake_time_case(model, batch, prompt_len, new_tokens, kv_cache, mode, repeats):
        calls.append((batch, kv_cache, mode))
        if len(calls) == 2:
            raise RuntimeError("no such kernel")
        if len(calls) == 4:
            # the third measured row is being timed: the two before it are already on disk
            with open(tmp_path / "generate.csv") as f:
                assert [r["mode"] for r in csv.DictReader(f)] == ["eager", "eager"]
            raise KeyboardInterrupt
        return 0.5, 1.0, 0

    monkeypatch.setattr(generate, "time_case", fake_time_case)
    args = ["--out", str(tmp_path), "--model", "tiny", "--vocab-size", "64", "--device", "cpu", "--backends", "sdpa",
            "--batch", "2,1", "--modes", "eager"]
    with pytest.raises(SystemExit) as e:
        generate.main(args)
    assert e.value.code == 130  # 128 + SIGINT, one line instead of a traceback
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"bench.generate: interrupted; the rows measured before the case in flight are in {tmp_path}/generate.csv")
    calls.clear()

    def fails_once(*args):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("no such kernel")
        return 0.5, 1.0, 0

    monkeypatch.setattr(generate, "time_case", fails_once)
    with pytest.raises(SystemExit) as e:
        generate.main(args)
    assert e.value.code == 1 and "no such kernel" in capsys.readouterr().err
    meta = json.loads((tmp_path / "generate.json").read_text())
    assert len(meta["rows"]) == 3 and len(meta["errors"]) == 1 and "cache off eager" in meta["errors"][0]


def test_generate_bench_time_budget(tmp_path):
    """--max-seconds: no case starts after it, and the one running then is interrupted; the files are written."""
    import time

    with pytest.raises(generate.BudgetExceeded):
        with generate.deadline(time.monotonic() + 0.2):
            time.sleep(5)
    rows = generate.main(["--out", str(tmp_path), "--model", "tiny", "--vocab-size", "64", "--device", "cpu",
                          "--backends", "sdpa", "--batch", "1", "--modes", "eager", "--max-seconds", "0.001"])
    meta = json.loads((tmp_path / "generate.json").read_text())
    assert rows == [] and len(meta["skipped"]) == 2


def test_generate_bench_rejects_bad_lists(tmp_path):
    for bad in (["--backends", "sdpa,flash"], ["--batch", "0"], ["--modes", "fast"], ["--new-tokens", "0"],
                ["--max-seconds", "-1"], ["--device", "cpu", "--modes", "eager-graph"],
                ["--device", "cpu", "--model", "gpt2"]):
        with pytest.raises(SystemExit):
            generate.main(["--out", str(tmp_path), *bad])


def test_generate_bench_refuses_gpu_sized_models_on_the_cpu(tmp_path, capsys):
    """The default model on a CPU would run for hours without a row: refused, naming the shapes that do not."""
    with pytest.raises(SystemExit):
        generate.main(["--out", str(tmp_path), "--device", "cpu"])
    assert "--model gpt2 on the CPU: its cases take hours" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
