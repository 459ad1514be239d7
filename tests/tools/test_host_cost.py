"""tools.host_cost: every row timed (CPU: the interpreter, a smoke test; GPU: the real figures), and its options."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tools import host_cost

ROWS = ["fa3.forward", "fa3.backward", "fa2.forward", "fa2.backward", "fa3_attention forward",
        "fa3_attention backward (autograd)", "sdpa forward"]


def test_every_row_is_timed(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fa3's fallback warning on a CPU
        times = host_cost.main(["--seqlen", "16", "--calls", "1", "--rounds", "1", "--causal", "false"])
    assert list(times) == ROWS and all(t > 0 for t in times.values())
    out = capsys.readouterr().out
    assert "N 16, D 64, causal False" in out and all(label in out for label in ROWS)


def test_best_of_rounds(monkeypatch):
    """The figure is the fastest round's time per call."""
    clock = iter([0.0, 3.0, 10.0, 11.0, 20.0, 22.0])  # rounds of 2 calls taking 3 s, 1 s, 2 s
    monkeypatch.setattr(host_cost.time, "perf_counter", lambda: next(clock))
    assert host_cost.per_call(lambda: None, calls=2, rounds=3, sync=lambda: None) == 0.5e6


def test_packed_rows_are_timed(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        times = host_cost.main(["--seqlen", "16", "--calls", "1", "--rounds", "1", "--documents", "3"])
    packed = [f"{name} (packed)" for name in ROWS[:4]]
    assert list(times) == ROWS + packed and all(t > 0 for t in times.values())
    assert "3 documents in the packed rows" in capsys.readouterr().out


def test_stubbed_launches_time_the_gluon_host_path_anywhere(capsys):
    """--stub-launches: the fa3 rows at a GPU size on any machine, through the Gluon path (a prepared launch per
    signature, no FA2 fallback), with everything patched put back afterwards."""
    kernels, launch = host_cost.launch_mod._KERNELS, host_cost.launch_mod.launch
    times = host_cost.main(["--stub-launches", "--calls", "3", "--rounds", "1", "--documents", "4"])
    assert list(times) == ["fa3.forward", "fa3.backward", "fa3.forward (packed)", "fa3.backward (packed)"]
    assert all(t > 0 for t in times.values())
    assert "launches stubbed (no kernel runs): B 1, H 2, N 1024" in capsys.readouterr().out
    q, k, v = (torch.randn(1, 2, 1024, 64, dtype=torch.bfloat16) for _ in range(3))
    with host_cost.stubbed_launches():
        o, lse = host_cost.fa3.forward(q, k, v, True, 0.125)
        assert len(host_cost.fa3._LAUNCHES) == 1  # the Gluon path's launch, prepared once
    assert o.shape == q.shape and lse.shape == (1, 2, 1024)
    assert not host_cost.fa3._LAUNCHES
    assert host_cost.launch_mod._KERNELS is kernels and host_cost.launch_mod.launch is launch
    if not torch.cuda.is_available():
        assert host_cost.fa3.gluon_device_reason(q.device) is not None  # the real check is back


@pytest.mark.parametrize("args, message", [
    (["--calls", "0"], "--calls 0 --rounds 3: each must be >= 1"),
    (["--causal", "maybe"], "'maybe': expected true or false"),
    (["--head-dim", "80"], "invalid choice: 80"),
    (["--seqlen", "16", "--documents", "17"], "--documents 17: accepted 0 (none) to --seqlen (16)"),
    (["--documents", "-1"], "--documents -1: accepted 0"),
    (["--stub-launches", "--seqlen", "100000000"], "--seqlen 100000000: with --stub-launches at most 65536"),
])
def test_bad_options_are_refused(capsys, args, message):
    with pytest.raises(SystemExit):
        host_cost.main(args)
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is for machines without a GPU")
def test_the_interpreter_is_on_without_a_gpu():
    """Run as `python -m tools.host_cost` on a CPU, without TRITON_INTERPRET set: the kernels it imports run under
    Triton's interpreter (model.backends turns it on first), not into CUDA calls."""
    code = "import tools.host_cost, kernels.common; print(kernels.common.INTERPRET)"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "True"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's size limit")
def test_gpu_sizes_are_refused_on_the_cpu(capsys):
    with pytest.raises(SystemExit):
        host_cost.main([])
    assert "--seqlen 1024: without a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_runs_on_the_gpu(capsys):
    times = host_cost.main(["--calls", "20", "--rounds", "1", "--documents", "4"])
    assert list(times) == ROWS + [f"{name} (packed)" for name in ROWS[:4]]
    assert all(0 < t < 1e5 for t in times.values())
