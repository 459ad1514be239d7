"""Every Triton kernel launch in `kernels` passes `common.LAUNCH_OPTIONS`, so no Triton release's default decides
them (Triton 3.9 warns that its FMA-contraction default changes in 3.10). Under the interpreter the launches are
recorded; the Gluon kernels' launch and sm_90 compile pass the same dict (`kernels/fa3.py`)."""

import pytest
import torch

from kernels import common, decode, fa1, fa2

interpreter = pytest.importorskip("triton.runtime.interpreter")
pytestmark = pytest.mark.skipif(not common.INTERPRET, reason="records launches through Triton's interpreter")


@pytest.fixture
def launches(monkeypatch):
    """(kernel name, launch keyword arguments) of every interpreted launch."""
    seen = []
    run = interpreter.InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        seen.append((self.fn.__name__, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", recording)
    return seen


def _qkv(seqlen=20, heads=2, head_dim=16):
    return [torch.randn(1, heads, seqlen, head_dim) for _ in range(3)]


def test_launch_options_fix_fp_fusion():
    assert common.LAUNCH_OPTIONS == {"enable_fp_fusion": True}


@pytest.mark.parametrize("module", [fa1, fa2])
def test_forward_and_backward_launches_pass_the_options(launches, module):
    q, k, v = _qkv()
    o, lse = module.forward(q, k, v, True, 0.25)
    module.backward(torch.randn_like(o), q, k, v, o, lse, True, 0.25)
    names = {name for name, _ in launches}
    assert {"_fwd", "_bwd_preprocess", "_bwd_dkdv", "_bwd_dq"} <= names, names
    for name, kwargs in launches:
        assert kwargs.get("enable_fp_fusion") is True, f"{module.__name__}.{name} launched without LAUNCH_OPTIONS"


def test_decode_launches_pass_the_options(launches):
    q = torch.randn(1, 2, 1, 16)
    k, v = (torch.randn(1, 2, 40, 16) for _ in range(2))
    decode.fa2_decode(q, k, v, num_splits=2)
    assert {name for name, _ in launches} == {"_split", "_combine"}
    for name, kwargs in launches:
        assert kwargs.get("enable_fp_fusion") is True, f"decode.{name} launched without LAUNCH_OPTIONS"
