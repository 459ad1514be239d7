"""tools.cross_entropy_configs on the CPU: the kernel under the interpreter against the eager reference."""

import pytest
import torch

from kernels import cross_entropy as ce
from tools import cross_entropy_configs


def test_each_config_matches_the_reference(capsys):
    rows = cross_entropy_configs.main(["--rows", "6", "--vocab", "97", "--configs", "32:4,128:2"])
    assert [(r["impl"], r["block_v"], r["num_warps"]) for r in rows] == [
        ("torch (eager)", None, None), ("kernel", 32, 4), ("kernel", 128, 2)]
    assert all(r["matches"] for r in rows) and all(r["ms"] > 0 for r in rows)
    assert "not a benchmark" in capsys.readouterr().out
    assert ce.INTERPRET_ON_CPU is False  # restored


def test_a_wrong_gradient_does_not_match(monkeypatch):
    """The matches column can say False: here the kernel's gradient pass is skipped."""
    rows_of = ce.cross_entropy_rows
    monkeypatch.setattr(ce, "cross_entropy_rows", lambda *a, **kw: rows_of(*a, **{**kw, "grad": False}))
    rows = cross_entropy_configs.main(["--rows", "4", "--vocab", "33", "--configs", "32:4"])
    assert rows[1]["matches"] is False


@pytest.mark.parametrize("args, message", [
    (["--configs", "100:4"], "'100:4': expected BLOCK_V:num_warps"),
    (["--configs", "64:3"], "'64:3': expected BLOCK_V:num_warps"),
    (["--configs", "64"], "'64': expected BLOCK_V:num_warps"),
    (["--rows", "0"], "--rows 0 --vocab 50304: both must be >= 1"),
])
def test_bad_options_are_refused(capsys, args, message):
    with pytest.raises(SystemExit):
        cross_entropy_configs.main(args)
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's size limit")
def test_gpu_sizes_are_refused_on_the_cpu(capsys):
    with pytest.raises(SystemExit):
        cross_entropy_configs.main([])
    assert "a smoke test of at most 100,000 logits (e.g. --rows 8 --vocab 97)" in capsys.readouterr().err
