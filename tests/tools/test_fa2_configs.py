"""tools.fa2_configs: its CPU-checkable parts (timing needs a GPU)."""

import pytest


def test_fa2_configs_candidates_cover_tma_on_and_off_and_sets_one_config():
    """tools.fa2_configs: every candidate tile is measured with TMA loads on and off, and set_config makes it the
    kernel's only autotune config (so the timing is that config's)."""
    from kernels import fa2
    from tools import fa2_configs

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
    from tools import fa2_configs

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        fa2_configs.main(["--head-dims", "64"])


def test_fa2_configs_finds_what_it_imports_once_a_gpu_is_there(monkeypatch):
    """main's imports behind the GPU check resolve (the cuDNN reference comes from bench.attention's backends); the
    run is stopped where it would start compiling."""
    from tools import fa2_configs

    class Stop(Exception):
        pass

    def no_pool(method):
        raise Stop(method)

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(fa2_configs.mp, "get_context", no_pool)
    with pytest.raises(Stop, match="spawn"):
        fa2_configs.main(["--head-dims", "64", "--seqlens", "1024", "--causal", "true", "--kernels", "fwd"])
