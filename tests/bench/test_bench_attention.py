"""bench.attention, bench.fa2_configs and bench.fa3_variants: their CPU-checkable parts (timing needs a GPU)."""

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


def test_fa2_configs_candidates_cover_tma_on_and_off_and_sets_one_config():
    """bench.fa2_configs: every candidate tile is measured with TMA loads on and off, and set_config makes it the
    kernel's only autotune config (so the timing is that config's)."""
    from bench import fa2_configs
    from kernels import fa2

    for kernel, candidates in fa2_configs.CANDIDATES.items():
        assert fa2_configs.variants(kernel) == [(c, t) for c in candidates for t in (True, False)]
    saved = list(fa2._fwd.configs)
    try:
        fa2_configs.set_config("fwd", (64, 32, 4, 2), tma=False)
        (config,) = fa2._fwd.configs
        assert config.kwargs == {"BLOCK_M": 64, "BLOCK_N": 32, "TMA": False}
        assert (config.num_warps, config.num_stages) == (4, 2)
    finally:
        fa2._fwd.configs = saved
        fa2._fwd.cache.clear()


def test_fa2_configs_needs_a_gpu(monkeypatch):
    from bench import fa2_configs

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        fa2_configs.main(["--head-dims", "64"])


def test_fa3_variant_fields():
    from bench.fa3_variants import forward_config

    assert forward_config("3:128:2:1:1") == (3, 128, 2, True, True, False)  # SPLIT_LOOPS off by default
    assert forward_config("3:128:2:1:1:1") == (3, 128, 2, True, True, True)
    with pytest.raises(SystemExit, match="variant 3:128:2: give 5 or 6 fields"):
        forward_config("3:128:2")


def test_fa3_backward_variant_fields_default_to_the_head_dims_config():
    from bench.fa3_variants import backward_config

    assert backward_config("4", (2, False, "cols", 64)) == (4, False, "cols", 64)
    assert backward_config("3:1:none", (2, False, "cols", 64)) == (3, True, "none", 64)
    assert backward_config("2:0:rows:128", (4, False, "none", 64)) == (2, False, "rows", 128)


@pytest.mark.parametrize("argv,message", [
    (["--variants", "foo"], "variant 'foo': give colon-separated integers"),
    (["--variants", "2:128:2"], "variant 2:128:2: give 5 or 6 fields"),
    (["--backward", "--variants", "2:128:2:1:1"], "backward variant 2:128:2:1:1: give 1 to 4 fields"),
    (["--backward", "--variants", "2:0:1"], "SPLIT_DQ '1'; accepted none, cols, rows"),
    (["--backward", "--variants", "2:0:rows:96"], "BLOCK_M 96; accepted 64, 128"),
    (["--backward", "--variants", "x:0"], "backward variant x:0: NUM_STAGES and DQ_FIRST are integers"),
    (["--backward", "--variants", "0:0"], "NUM_STAGES 0; give 1 or more"),
    (["--backward", "--variants", "2:0:rows:64"], "2:0:rows:64 at head_dim 64: .*BLOCK_M=64 with SPLIT_DQ='rows'"),
    (["--backward", "--variants", "2:0:rows", "--head-dims", "128"],
     "2:0:rows at head_dim 128: .*BLOCK_M=64 with SPLIT_DQ='rows'"),
    (["--backward", "--head-dims", "96"], "--head-dims 96: the Gluon backward takes 64, 128"),
])
def test_fa3_variants_checks_its_variants_on_any_machine(monkeypatch, argv, message):
    """bench.fa3_variants parses --variants (in the --backward format with --backward) before it looks for a GPU,
    so a typo is named on a CPU-only machine too."""
    from bench import fa3_variants

    with pytest.raises(SystemExit, match=message):
        fa3_variants.main(argv)


@pytest.mark.parametrize("argv", [[], ["--backward"]])
def test_fa3_variants_default_variants_parse_in_both_modes(monkeypatch, argv):
    """Each mode's default --variants passes its own format's check; then, without CUDA, the GPU check refuses."""
    import torch
    from bench import fa3_variants

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        fa3_variants.main(argv)


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
