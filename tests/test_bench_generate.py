"""bench.generate on the CPU: a tiny model and a few tokens (the real table needs a GPU)."""

import csv
import json

import pytest

from bench import generate


def test_generate_bench_smoke(tmp_path, capsys):
    out = tmp_path / "gen"
    rows = generate.main(["--out", str(out), "--model", "tiny", "--vocab-size", "64", "--device", "cpu",
                          "--backends", "sdpa,fa2,fa2_splitkv", "--batch", "1,2", "--prompt-len", "3",
                          "--new-tokens", "3",
                          "--modes", "eager"])
    assert [(r["backend"], r["batch"], r["kv_cache"]) for r in rows] == [
        (b, n, c) for b in ("sdpa", "fa2") for n in (1, 2) for c in (True, False)] + [
        ("fa2_splitkv", n, True) for n in (1, 2)]  # the split-K/V decode differs from fa2 only with the cache
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["tokens_per_s"] == pytest.approx(r["batch"] * 3 / r["seconds"])
        assert (r["speedup_vs_no_cache"] is not None) == r["kv_cache"]
    with open(out / "generate.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    meta = json.loads((out / "generate.json").read_text())
    assert meta["device"] == "CPU" and len(meta["rows"]) == len(rows) and len(meta["summary"]) == 6
    printed = capsys.readouterr().out
    assert "tokens/s" in printed and "sdpa batch 2: cache" in printed and "fa2_splitkv batch 1: cache" in printed


def test_generate_bench_rejects_bad_lists(tmp_path):
    for bad in (["--backends", "sdpa,flash"], ["--batch", "0"], ["--modes", "fast"], ["--new-tokens", "0"]):
        with pytest.raises(SystemExit):
            generate.main(["--out", str(tmp_path), *bad])


def test_decode_bench_smoke(tmp_path):
    """bench.decode on the CPU: every backend's decode-step function at two cache lengths."""
    import csv as csv_module

    from bench import decode

    rows = decode.main(["--out", str(tmp_path), "--dtype", "fp32", "--heads", "2", "--head-dim", "16",
                        "--seqlens", "16,70", "--batch", "1", "--backends", "sdpa,fa2,fa2_splitkv"])
    assert [(r["backend"], r["seqlen_k"]) for r in rows] == [
        (b, n) for n in (16, 70) for b in ("sdpa", "fa2", "fa2_splitkv")]
    assert all(r["us"] > 0 and r["speedup_vs_fa2"] > 0 for r in rows)
    with open(tmp_path / "decode.csv") as f:
        assert len(list(csv_module.DictReader(f))) == len(rows)
    assert json.loads((tmp_path / "decode.json").read_text())["device"] == "CPU"
