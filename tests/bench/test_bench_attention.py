"""bench.attention: its CPU-checkable parts (the dense shapes' timing needs a GPU; the decode shape runs on the CPU)."""

import pytest

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
