"""bench.report: the shared table, CSV/JSON and plot helpers."""

import csv
import json
import random

import pytest

from bench import report


def test_table_lines_up_rows_printed_one_by_one():
    table = report.Table([report.Column("backend", "backend", width=8, left=True),
                          report.Column("ms", "ms", ".2f", 7), report.Column("x2", lambda r: r["ms"] and 2 * r["ms"])])
    rows = [{"backend": "fa2", "ms": random.uniform(0, 1000)}, {"backend": "sdpa_cudnn", "ms": None}]
    lines = table.render(rows).splitlines()
    assert lines[0] == "backend       ms x2" and lines[1:] == [table.line(r) for r in rows]
    assert lines[1] == f"fa2      {rows[0]['ms']:7.2f} {2 * rows[0]['ms']}"
    assert lines[2] == "sdpa_cudnn       -  -"  # a value wider than its column widens the line, None prints "-"


@pytest.mark.parametrize("value,label", [(23, "23"), (12.4, "12"), (10, "10"), (999, "999"), (1234, "1.23k"),
                                         (12_345, "12.3k"), (123_456, "123k"), (1_234_567, "1.23M"),
                                         (2.5e9, "2.5G"), (0.5, "0.5"), (0, "0")])
def test_short_numbers_keep_small_values(value, label):
    assert report.short_number(value) == label


def test_csv_and_json_round_trip_without_temporary_files(tmp_path):
    rows = [{"backend": b, "tokens_per_s": random.uniform(1, 1e6), "mfu": None} for b in ("fa2", "sdpa")]
    report.write_csv(tmp_path / "t.csv", rows)
    report.write_json(tmp_path / "t.json", rows, device="CPU", args={"steps": 3})
    with open(tmp_path / "t.csv") as f:
        table = list(csv.DictReader(f))
    assert [(r["backend"], float(r["tokens_per_s"]), r["mfu"]) for r in table] == [
        (r["backend"], r["tokens_per_s"], "") for r in rows]
    assert json.loads((tmp_path / "t.json").read_text()) == {"device": "CPU", "args": {"steps": 3}, "rows": rows}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.csv", "t.json"]
    with pytest.raises(ValueError):
        report.write_csv(tmp_path / "u.csv", rows, fields=["backend"])  # a key outside the fields
    assert not (tmp_path / "u.csv").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["t.csv", "t.json"]


def test_environment_names_the_versions():
    import torch
    import triton

    env = report.environment("cpu")
    assert env["device"] == "CPU" and env["torch"] == torch.__version__ and env["triton"] == triton.__version__
    assert len(env["date"]) == 10


def test_plots_are_written(tmp_path):
    path = report.line_plot(tmp_path / "l.png", {"fa2": ([512, 1024], [10.0, 20.0]), "sdpa": ([512], [5.0])},
                            xlabel="N", ylabel="TFLOP/s", title="t", log2_x=True)
    assert path.stat().st_size > 0
    labels = report.bar_chart(tmp_path / "b.png", ["a", "b"], {"x": [23.0, None], "y": [1500.0, 2.0]},
                              ylabel="tokens/s", title="t")
    assert labels == ["23", "1.5k", "2"] and (tmp_path / "b.png").stat().st_size > 0


@pytest.mark.parametrize("module", ["bench.report", "bench.baseline"])
def test_helper_modules_say_they_are_no_script(module):
    """`python -m bench.report --help` (or bench.baseline) names what the module is instead of doing nothing."""
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "has no command line of its own" in out.stderr, out
