"""bench.attention's CPU-checkable parts: backend names and the FLOP count (timing itself needs a GPU)."""

import pytest

from bench import attention


def test_unknown_backend_is_rejected_with_the_accepted_names():
    with pytest.raises(SystemExit, match=r"unknown backend\(s\) \['flash'\]; choose from .*sdpa_cudnn"):
        attention.backends(["fa2", "flash"])


def test_flop_count_follows_the_flashattention_convention():
    forward = attention.flops(2, 16, 1024, 64, causal=False, direction="fwd")
    assert forward == 4 * 2 * 16 * 1024 * 1024 * 64
    assert attention.flops(2, 16, 1024, 64, causal=True, direction="fwd") == forward / 2
    assert attention.flops(2, 16, 1024, 64, causal=False, direction="bwd") == 2.5 * forward
