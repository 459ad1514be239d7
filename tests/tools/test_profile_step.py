"""tools.profile_step: the trace analysis on a hand-made GPU trace, and a short CPU run of both loops."""

import gzip
import json

import pytest

from tools import profile_step


def span(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def gpu_trace():
    """Two host steps (us): step 1 launches kernels A (runs 50-80) and B (90-110); step 2 launches C (150-190),
    whose launch sits in an aten::mm, and a D2H memcpy (195-200), then waits in cudaStreamSynchronize."""
    return [
        span("user_annotation", "ProfilerStep#1", 0, 100), span("user_annotation", "ProfilerStep#2", 100, 100),
        span("gpu_user_annotation", "ProfilerStep#1", 50, 60),  # the GPU-side copy of a range: not a host step
        span("cpu_op", "aten::add", 5, 20), span("cpu_op", "aten::mm", 105, 10), span("cpu_op", "aten::copy_", 118, 5),
        span("cuda_runtime", "cudaLaunchKernel", 10, 2, correlation=1),
        span("cuda_driver", "cuLaunchKernel", 20, 2, correlation=2),
        span("cuda_runtime", "cudaLaunchKernel", 110, 2, correlation=3),
        span("cuda_runtime", "cudaMemcpyAsync", 120, 2, correlation=4),
        span("cuda_runtime", "cudaStreamSynchronize", 130, 50, correlation=5),
        span("kernel", "A", 50, 30, correlation=1), span("kernel", "B", 90, 20, correlation=2),
        span("kernel", "C", 150, 40, correlation=3),
        span("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 195, 5, correlation=4),
        span("kernel", "unattributed", 300, 10, correlation=99),  # launched outside the profiled steps
    ]


def test_analysis_of_a_gpu_trace():
    s = profile_step.analyze(gpu_trace())
    assert s["steps"] == 2 and s["host_ms"] == pytest.approx(0.1)
    first, second = s["per_step"]
    assert first["kernels"] == 2 and first["busy_ms"] == pytest.approx(0.050)
    assert first["idle_within_ms"] == pytest.approx(0.010) and first["idle_before_ms"] is None
    assert second["kernels"] == 1 and second["memcpys"] == {"Memcpy DtoH (Device -> Pinned)": 1}
    assert second["busy_ms"] == pytest.approx(0.045) and second["idle_within_ms"] == pytest.approx(0.005)
    assert second["idle_before_ms"] == pytest.approx(0.040)  # B ends at 110, C starts at 150
    assert second["syncs"] == {"cudaStreamSynchronize": 1} and second["sync_ms"] == pytest.approx(0.05)
    assert first["ops"] == {"aten::add": 1} and second["ops"] == {"aten::mm": 1, "aten::copy_": 1}
    g = s["gpu"]
    assert g["busy_ms"] == pytest.approx(0.0475) and g["idle_before_ms"] == pytest.approx(0.040)
    assert g["idle_ms"] == pytest.approx(0.0075 + 0.040)
    top = s["gaps"][0]  # the memcpy -> unattributed (100 us) is longest, then B -> C (40 us)
    assert top["before"] == "unattributed" and top["gap_ms"] == pytest.approx(0.100)
    assert s["gaps"][1] == {"gap_ms": pytest.approx(0.040), "after": "B", "before": "C", "launched_by": "aten::mm"}
    text = profile_step.format_summary("trainer", s, "(table)")
    assert "GPU idle before the step" in text and "cudaStreamSynchronize" in text and "'aten::mm'" in text
    bare = profile_step.analyze([e for e in gpu_trace() if e["name"] not in ("aten::copy_",)])
    cmp = profile_step.compare({"bare": bare, "trainer": s})
    assert "aten::copy_ +0.5" in cmp  # a median over the two steps: 0 and 1


def test_profile_both_loops_on_cpu(tmp_path, tiny_overrides, capsys):
    overrides = [o for o in tiny_overrides if not o.startswith(("run.", "attn=", "trainer.max_steps"))]
    overrides += ["model.n_layer=1", "model.block_size=16", "trainer.batch_size=2"]
    out = tmp_path / "prof"
    result = profile_step.main(["--warmup", "1", "--steps", "2", "--out", str(out), *overrides])
    for loop in ("bare", "trainer"):
        with gzip.open(out / f"trace_{loop}.json.gz", "rt") as f:
            assert any(e.get("name", "").startswith("ProfilerStep#") for e in json.load(f)["traceEvents"])
        s = result["loops"][loop]
        assert s["steps"] == 2 and s["host_ms"] > 0 and s["gpu"] is None  # CPU: host figures only
        assert all(r["ops"] for r in s["per_step"])
        assert "host time of the loop iteration" in (out / f"summary_{loop}.txt").read_text()
    # The sampler draws the trainer's batches inside its steps; the bare loop's are drawn beforehand.
    assert "aten::randint +1" in result["comparison"]
    assert json.loads((out / "summary.json").read_text())["comparison"] == result["comparison"]
    assert sorted(p.name for p in out.iterdir()) == ["comparison.txt", "summary.json", "summary_bare.txt",
                                                     "summary_trainer.txt", "trace_bare.json.gz",
                                                     "trace_trainer.json.gz"]  # no run folder or checkpoint
    profile_step.main(["--analyze", str(out / "trace_trainer.json.gz")])
    assert "2 profiled steps" in capsys.readouterr().out


def test_help_shows_defaults():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "tools.profile_step", "--help"], cwd=root, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "(default: " in out.stdout, out.stderr[-2000:]


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--warmup", "-1"], ["--loops", "bare,train"]])
def test_bad_arguments_are_named(argv, capsys):
    with pytest.raises(SystemExit):
        profile_step.main(argv)
    assert f"{argv[0]} {argv[1]}" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--backend", "fa9"], "--backend fa9: accepted auto, "),
    (["trainer.max_stepz=3"], "trainer.max_stepz"),
    (["model=nope"], "nope"),
    (["trainer.batch_size=0"], "trainer.batch_size"),
    (["attn=fa2"], "attn=fa2: the benchmark sets attn itself; give --backend instead"),
])
def test_bad_backend_and_overrides_are_refused_before_anything_is_written(argv, message, tmp_path, capsys):
    out = tmp_path / "prof"
    with pytest.raises(SystemExit) as exit_info:
        profile_step.main(["--out", str(out), "wandb.mode=disabled", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and "Traceback" not in err
    assert not out.exists()


def test_data_refused_inside_the_run_is_one_line_and_leaves_no_folder(tmp_path, capsys):
    """Missing data files are found only when the run reads its data: one line naming them, no traceback, and the
    results folder, empty, removed."""
    out = tmp_path / "prof"
    with pytest.raises(SystemExit) as exit_info:
        profile_step.main(["--out", str(out), "--steps", "1", "--warmup", "0", "wandb.mode=disabled", "data=local_text",
                           f"data.files={tmp_path}/missing/*.txt"])
    assert str(exit_info.value.code).startswith("tools.profile_step: ") and "missing" in str(exit_info.value.code)
    assert "Traceback" not in capsys.readouterr().err and not out.exists()


def test_an_out_folder_that_cannot_be_made_is_one_line(tmp_path):
    """--out under a file: one line naming it, before anything runs; the file kept."""
    blocker = tmp_path / "afile"
    blocker.write_text("kept")
    with pytest.raises(SystemExit, match=f"--out {blocker / 'prof'}: cannot create or write this folder"):
        profile_step.main(["--out", str(blocker / "prof"), "--steps", "1", "--warmup", "0", "wandb.mode=disabled"])
    assert blocker.read_text() == "kept"


def test_unreadable_traces_are_named(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    for path in (tmp_path / "missing.json.gz", tmp_path / "notes.txt", tmp_path / "list.json"):
        with pytest.raises(SystemExit) as exit_info:
            profile_step.main(["--analyze", str(path)])
        assert exit_info.value.code == 2
        assert f"--analyze {path}: not a readable trace of this tool" in capsys.readouterr().err
