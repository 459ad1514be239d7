"""bench.attention: its CPU-checkable parts (the dense shapes' timing needs a GPU; the decode shape runs on the CPU)."""

import pytest
import torch

from bench import attention


def test_unknown_backend_is_rejected_with_the_accepted_names():
    with pytest.raises(SystemExit, match=r"unknown backend\(s\) \['flash'\]; choose from .*sdpa_cudnn"):
        attention.backends(["fa2", "flash"])


def test_unknown_backend_is_rejected_before_the_gpu_check():
    with pytest.raises(SystemExit, match=r"unknown backend\(s\) \['nope'\]; choose from"):
        attention.main(["--backends", "fa2,nope"])


def test_flop_count_follows_the_flashattention_convention():
    forward = attention.flops(2, 16, 1024, 64, causal=False, direction="fwd")
    assert forward == 4 * 2 * 16 * 1024 * 1024 * 64
    assert attention.flops(2, 16, 1024, 64, causal=True, direction="fwd") == forward / 2
    assert attention.flops(2, 16, 1024, 64, causal=False, direction="bwd") == 2.5 * forward


def test_measure_times_a_compiled_backward_repeatedly(monkeypatch):
    """A compiled backend (flex on the GPU) has its backward timed by repeated retain_graph=True calls on one graph,
    which PyTorch refuses for a backward compiled with donated buffers; measure compiles without them."""
    import torch

    def do_bench(fn, grad_to_none=None, return_mode="median"):  # triton's needs a GPU; the calls are what matter
        for _ in range(3):
            fn()
        return 1.0

    monkeypatch.setattr("triton.testing.do_bench", do_bench)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2), -1) @ v, backend="aot_eager")
    fwd, bwd = attention.measure(lambda q, k, v, causal: compiled(q, k, v), 1, 2, 32, 16, True, torch.float32,
                                 device="cpu")
    assert (fwd, bwd) == (1.0, 1.0)


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_measure_times_eager_calls_or_cuda_graph_replays(monkeypatch, cuda_graph):
    """--cuda-graph: the forward, then forward + backward (the inputs' gradients reset) go through
    triton.testing.do_bench_cudagraph and the backward is their difference; else forward and backward alone go
    through do_bench; never both."""
    import torch

    used = []

    def fake(name):
        def bench(fn, grad_to_none=None, return_mode="mean", **kwargs):
            fn()
            used.append((name, return_mode, grad_to_none is not None))
            return 2.0 if len(used) == 1 else 5.0
        return bench

    monkeypatch.setattr("triton.testing.do_bench", fake("eager"))
    monkeypatch.setattr("triton.testing.do_bench_cudagraph", fake("graph"))
    attention_fn = lambda q, k, v, causal: torch.softmax(q @ k.transpose(-1, -2), -1) @ v
    fwd, bwd = attention.measure(attention_fn, 1, 2, 16, 8, True, torch.float32, device="cpu", cuda_graph=cuda_graph)
    name = "graph" if cuda_graph else "eager"
    assert used == [(name, "median", False), (name, "median", True)]
    # graph: 5.0 is forward + backward, so the backward alone is 3.0; eager: 5.0 is the backward alone
    assert (fwd, bwd) == ((2.0, 3.0) if cuda_graph else (2.0, 5.0))


def test_repeats_take_the_median_with_the_order_alternating():
    """--repeats: each backend's fwd and bwd medians over the repeats, the backends' order reversed every other one."""
    calls = []
    times = {"a": iter([(3.0, 30.0), (1.0, 10.0), (2.0, 20.0)]), "b": iter([(5.0, 50.0), (4.0, 40.0), (6.0, 60.0)])}
    def measure_one(name):
        calls.append(name)
        return next(times[name])
    result = attention.repeated(measure_one, {"a": "a", "b": "b"}, 3)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert result == {"a": (2.0, 20.0), "b": (5.0, 50.0)}


def test_repeats_skip_a_backend_that_refuses_the_shape():
    """A backend that refused a shape once ((None, None), e.g. an SDPA backend on the wrong GPU) is not asked again."""
    calls = []
    def measure_one(name):
        calls.append(name)
        return (None, None) if name == "no" else (1.0, 2.0)
    assert attention.repeated(measure_one, {"yes": "yes", "no": "no"}, 3) == {"yes": (1.0, 2.0), "no": (None, None)}
    assert calls.count("no") == 1 and calls.count("yes") == 3


def test_repeats_must_be_positive():
    with pytest.raises(SystemExit, match="--repeats 0"):
        attention.main(["--repeats", "0"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_decode_shape_on_the_cpu_needs_small_sizes(tmp_path):
    """The decode shape's GPU sizes under the interpreter would take hours: refused, naming the smoke test's."""
    with pytest.raises(SystemExit, match="--heads 2 --head-dims 16 --seqlens 16,70 --batch 1"):
        attention.main(["--shape", "decode", "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_the_cpu_smoke_command_runs_without_triton_interpret_set(tmp_path):
    """The smoke test --help gives, as a user runs it: a fresh process without TRITON_INTERPRET, which the backends
    set before the kernels are imported."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    out = subprocess.run([sys.executable, "-m", "bench.attention", "--shape", "decode", "--dtype", "float32",
                          "--heads", "2", "--head-dims", "16", "--seqlens", "16", "--batch", "1", "--backends",
                          "sdpa,fa2", "--out", str(tmp_path)], cwd=root, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert (tmp_path / "attention_decode.csv").is_file()


def test_decode_shape_smoke(tmp_path):
    """--shape decode on the CPU: every backend's decode-step function at two cache lengths."""
    import csv
    import json

    rows = attention.main(["--shape", "decode", "--out", str(tmp_path), "--dtype", "float32", "--heads", "2",
                           "--head-dims", "16", "--seqlens", "16,70", "--batch", "1",
                           "--backends", "sdpa,fa2,fa2_splitkv"])
    assert [(r["backend"], r["seqlen_k"]) for r in rows] == [
        (b, n) for n in (16, 70) for b in ("sdpa", "fa2", "fa2_splitkv")]
    assert all(r["us"] > 0 and r["speedup_vs_fa2"] > 0 for r in rows)
    with open(tmp_path / "attention_decode.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert json.loads((tmp_path / "attention_decode.json").read_text())["device"] == "CPU"
    assert (tmp_path / "attention_decode_b1.png").stat().st_size > 0


def test_ctrl_c_ends_with_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    """Ctrl-C during the cases: one line saying nothing was written (the files come at the end), exit 130."""
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(attention, "run_decode", interrupted)
    with pytest.raises(SystemExit) as e:
        attention.main(["--shape", "decode", "--out", str(tmp_path), "--dtype", "float32", "--heads", "2",
                        "--head-dims", "16", "--seqlens", "16", "--batch", "1", "--backends", "sdpa"])
    assert e.value.code == 130
    assert capsys.readouterr().err.strip() == ("bench.attention: interrupted; nothing was written (the files are "
                                               "written once every case has run)")
    assert list(tmp_path.iterdir()) == []


def test_decode_backends_compute_attention_over_the_cache():
    """The decode shape's functions: one query per (batch, head) against a strided cache prefix, grouped-query
    heads, each equal to a float64 softmax reference."""
    import torch

    batch, heads, kv_heads, n, d = 2, 4, 2, 37, 16
    cache = torch.randn(2, batch, kv_heads, 50, d)
    k, v = cache[0, :, :, :n], cache[1, :, :, :n]
    q = torch.randn(batch, heads, 1, d)
    kr, vr = (t.double().repeat_interleave(heads // kv_heads, 1) for t in (k, v))
    ref = torch.softmax(q.double() @ kr.transpose(-1, -2) / d ** 0.5, -1) @ vr
    for name, fn in attention.kv_backends(["sdpa", "fa2", "fa2_splitkv", "flex"]).items():
        torch.testing.assert_close(fn(q, k, v).double(), ref, atol=1e-4, rtol=1e-4, msg=name)


def grid_cells():
    """Today's default grid, written out: B * N = 16k, H * D = 2048, D 64 then 128, causal then not."""
    return [attention.Case(max(1, 16384 // n), 2048 // d, 2048 // d, n, d, causal)
            for d in (64, 128) for causal in (True, False) for n in (512, 1024, 2048, 4096, 8192, 16384)]


@pytest.mark.parametrize("argv,expected", [
    ([], grid_cells()),
    (["--shape", "grid"], grid_cells()),
    (["--shape", "llama"], [attention.Case(2, 64, 8, n, 128, causal) for causal in (True, False)
                            for n in (2048, 4096, 8192, 16384, 32768)]),
    (["--shape", "llama", "--seqlens", "4096", "--causal", "false"], [attention.Case(2, 64, 8, 4096, 128, False)]),
    (["--shape", "decode", "--batch", "8", "--seqlens", "128,1024"],
     [attention.Case(8, 12, 12, 128, 64, True), attention.Case(8, 12, 12, 1024, 64, True)]),
    (["--head-dims", "128", "--seqlens", "4096", "--causal", "TRUE"], [attention.Case(4, 16, 16, 4096, 128, True)]),
])
def test_shapes_yield_their_cells(argv, expected):
    assert attention.cases(attention.parse_args(argv)) == expected


def test_each_shape_has_its_default_backends():
    every = list(reversed(list(attention.REGISTRY)))
    assert attention.parse_args([]).backends == every
    assert attention.parse_args(["--shape", "llama"]).backends == every
    assert attention.parse_args(["--shape", "decode"]).backends == ["sdpa", "fa2", "fa2_splitkv", "fa3"]


@pytest.mark.parametrize("argv,message", [
    (["--shape", "llama", "--kv-heads", "3"], r"query heads \[64\] with key/value heads 3"),
    (["--heads", "0"], r"query heads \[0\]"),
    (["--shape", "decode", "--head-dims", "16,8"], r"--head-dims 8: the kernels take head dimensions 16 to 256"),
    (["--head-dims", "512"], r"--head-dims 512: the kernels take head dimensions 16 to 256"),
    (["--backends", "fa2_splitkv"], r"unknown backend\(s\) \['fa2_splitkv'\].*--shape decode only"),
])
def test_bad_shape_arguments_are_named(argv, message):
    with pytest.raises(SystemExit, match=message):
        attention.parse_args(argv)


@pytest.mark.parametrize("argv", [["--shape", "square"], ["--causal", "yes"], ["--seqlens", "0,512"],
                                  ["--head-dims", "sixty-four"]])
def test_bad_lists_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit):
        attention.parse_args(argv)
    assert argv[1] in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--shape", "llama"], [], ["--shape", "decode", "--cuda-graph"]])
def test_shapes_that_need_a_gpu_say_so(argv, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        attention.main(argv)


def test_dense_cells_pass_grouped_query_inputs_and_count_query_heads(monkeypatch, capsys):
    """A llama-like cell on the CPU (do_bench faked: timing needs a GPU): k and v have the key/value heads, the
    FLOPs count the query heads, one printed line per backend."""
    import torch

    seen = []
    monkeypatch.setattr("triton.testing.do_bench", lambda fn, grad_to_none=None, return_mode="median": 2.0)
    args = attention.parse_args(["--shape", "llama", "--heads", "4", "--kv-heads", "2", "--head-dims", "16",
                                 "--seqlens", "32", "--causal", "true", "--backends", "sdpa,fa2"])
    real = attention.backends
    monkeypatch.setattr(attention, "backends", lambda names: {
        n: (lambda q, k, v, causal, fn=fn: seen.append((q.shape[1], k.shape[1], v.shape[1])) or fn(q, k, v, causal))
        for n, fn in real(names).items()})
    rows = attention.run_dense(args, torch.float32, device="cpu")
    assert {s for s in seen} == {(4, 2, 2)}
    assert [(r["backend"], r["batch"], r["n_heads"], r["n_kv_heads"]) for r in rows] == [("sdpa", 2, 4, 2),
                                                                                          ("fa2", 2, 4, 2)]
    assert rows[0]["fwd_tflops"] == pytest.approx(attention.flops(2, 4, 32, 16, True, "fwd") / 2.0 / 1e9)
    assert capsys.readouterr().out.count("\nsdpa ") == 1


def test_fallback_rows_are_named():
    """fa3 without a Hopper GPU runs FA2's kernels; the note names it, the others run their own."""
    import torch

    notes = attention.fallback_notes(["sdpa", "fa2", "fa3"], "cpu", torch.float32, [64, 128])
    assert notes == ["fa3 at head_dim 64: runs FA2's Triton kernels (no CUDA GPU)",
                     "fa3 at head_dim 128: runs FA2's Triton kernels (no CUDA GPU)"]


def test_ratio_table_and_plots_of_dense_rows(tmp_path, capsys):
    """The first backend's speed-up over the others per cell (other time / first time, fwd / bwd), and one PNG per
    (head_dim, causal, direction) named as before the shapes existed."""
    import random

    def row(backend, seqlen, fwd, bwd):
        return dict(backend=backend, dtype="bfloat16", batch=16384 // seqlen, n_heads=32, n_kv_heads=32, seqlen=seqlen,
                    head_dim=64, causal=True, timing="eager", repeats=1, fwd_ms=fwd, bwd_ms=bwd,
                    fwd_tflops=fwd and 1 / fwd, bwd_tflops=bwd and 1 / bwd)

    fwd, bwd = random.uniform(0.1, 1), random.uniform(0.1, 1)
    rows = [row("fa3", 1024, fwd, bwd), row("sdpa", 1024, 2 * fwd, 3 * bwd), row("fa2", 1024, None, None),
            row("fa3", 2048, fwd, bwd), row("sdpa", 2048, 4 * fwd, None)]
    attention.print_ratios(rows)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "fa3 speed-up (other time / fa3 time), fwd / bwd"
    assert lines[2].split() == ["D", "causal", "N", "vs", "sdpa", "vs", "fa2"]
    assert lines[3].split() == ["64", "True", "1024", "2.00", "/", "3.00", "-", "/", "-"]
    assert lines[4].split() == ["64", "True", "2048", "4.00", "/", "-", "-", "/", "-"]
    paths = attention.plot_dense(rows, tmp_path / "attention")
    assert [p.name for p in paths] == ["attention_fwd_d64_causal.png", "attention_bwd_d64_causal.png"]
    assert all(p.stat().st_size > 0 for p in paths)


def _refused_out(target, message):
    """bench.attention and bench.generate with --out `target` (small CPU runs) each stop with `message`."""
    from bench import generate

    with pytest.raises(SystemExit, match=message):
        attention.main(["--shape", "decode", "--out", str(target), "--dtype", "float32", "--heads", "2",
                        "--head-dims", "16", "--seqlens", "16", "--batch", "1", "--backends", "sdpa"])
    with pytest.raises(SystemExit, match=message):
        generate.main(["--out", str(target), "--model", "tiny", "--device", "cpu", "--backends", "sdpa", "--modes",
                       "eager", "--batch", "1", "--new-tokens", "2"])


def test_out_naming_a_file_is_one_line(tmp_path):
    """--out naming an existing file: one line naming it, for bench.attention and bench.generate; the file kept."""
    target = tmp_path / "afile"
    target.write_text("kept")
    _refused_out(target, f"--out {target}: a file, not a folder")
    assert target.read_text() == "kept"


def test_out_that_cannot_be_made_is_one_line(tmp_path):
    """--out under a file (no folder can be made there): one line naming it and why, for every bench tool that
    writes results through `bench.results_folder`; the file kept."""
    from bench import results_folder

    blocker = tmp_path / "afile"
    blocker.write_text("kept")
    target = blocker / "results"
    _refused_out(target, f"--out {target}: cannot create or write this folder \\(Not a directory\\)")
    with pytest.raises(SystemExit, match=f"run.root {target}: cannot create or write this folder"):
        results_folder(str(target), "run.root")
    assert blocker.read_text() == "kept" and results_folder(str(tmp_path / "new" / "deep")).is_dir()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_generate_refuses_compiled_flex_on_the_cpu(capsys):
    from bench import generate

    with pytest.raises(SystemExit):
        generate.parse_args(["--out", "unused", "--model", "tiny", "--device", "cpu", "--backends", "sdpa,flex",
                             "--modes", "eager,compiled"])
    assert "--backends flex with --modes compiled: torch.compile cannot lower it on the CPU" in capsys.readouterr().err
    generate.parse_args(["--out", "unused", "--model", "tiny", "--device", "cpu", "--backends", "flex", "--modes",
                         "eager"])
