"""tools.fa3_variants: its CPU-checkable parts (the checks and timings need an sm_90 GPU)."""

import pytest


def test_fa3_variant_fields():
    from kernels.fa3 import ForwardConfig
    from tools.fa3_variants import forward_config

    assert forward_config("3:128:2:1:1") == ForwardConfig(3, 128, 2, True, True)
    assert forward_config("2:64:4:0:0") == ForwardConfig(2, 64, 4, False, False)
    assert forward_config("2:128:4:1:1:1") == ForwardConfig(2, 128, 4, True, True, late_k_release=True)
    with pytest.raises(SystemExit, match="variant 3:128:2: give 5 to 7 fields"):
        forward_config("3:128:2")
    assert forward_config("2:128:4:1:1:0:1") == ForwardConfig(2, 128, 4, True, True, tail=True)
    with pytest.raises(SystemExit, match="give 5 to 7 fields"):
        forward_config("2:128:4:1:1:1:1:1")


def test_fa3_backward_variant_fields_default_to_the_head_dims_config():
    from kernels.fa3 import BackwardConfig
    from tools.fa3_variants import backward_config

    assert backward_config("4", BackwardConfig(2, "cols", 64)) == BackwardConfig(4, "cols", 64)
    assert backward_config("3:rows", BackwardConfig(2, "cols", 128)) == BackwardConfig(3, "rows", 128)
    assert backward_config("2:rows:128", BackwardConfig(4, "cols", 64)) == BackwardConfig(2, "rows", 128)
    assert backward_config("2:rows:128:1", BackwardConfig(4, "cols", 64)) == BackwardConfig(2, "rows", 128, 1)
    assert backward_config("2:cols:64:0", BackwardConfig(4, "cols", 64, 8)) == BackwardConfig(2, "cols", 64, 0)
    assert backward_config("2:rows:64:0:1:128:1", BackwardConfig(4, "cols", 64)) == BackwardConfig(
        2, "rows", 64, 0, 1, 128, True)
    assert backward_config("2:rows:64:0:1", BackwardConfig(4, "cols", 64, 0, 2, 0, True)) == BackwardConfig(
        2, "rows", 64, 0, 1, 0, True)
    assert backward_config("2:cols:64:0:2:0:0:1", BackwardConfig(4, "cols", 64)) == BackwardConfig(
        2, "cols", 64, 0, 2, 0, False, True)
    assert backward_config("2:cols:64:0:2:0:0:0:2", BackwardConfig(4, "cols", 64, heads_per_cta=4)) == BackwardConfig(
        2, "cols", 64, 0, 2, 0, False, False, 2)
    assert backward_config("3", BackwardConfig(2, "cols", 64, heads_per_cta=2)).heads_per_cta == 2


@pytest.mark.parametrize("argv,message", [
    (["--variants", "foo"], "variant 'foo': give colon-separated integers"),
    (["--variants", "2:128:2"], "variant 2:128:2: give 5 to 7 fields"),
    (["--variants", "2:128:2:1:1:0:1:0"], "variant 2:128:2:1:1:0:1:0: give 5 to 7 fields"),
    (["--backward", "--variants", "2:rows:128:1:2:0:1:0:1:0"],
     "backward variant 2:rows:128:1:2:0:1:0:1:0: give 1 to 9 fields"),
    (["--backward", "--variants", "2:cols:64:0:2:0:0:0:x"], "HEADS_PER_CTA x; give an integer, 0 or more"),
    (["--backward", "--variants", "2,,2"], "--variants '2,,2': an empty variant"),
    (["--variants", ""], "--variants '': an empty variant"),
    (["--head-dims", "0"], "--head-dims '0': give comma-separated one or more of 64, 96, 128, 256"),
    (["--head-dims", "abc"], "--head-dims 'abc': give comma-separated one or more of"),
    (["--backward", "--head-dims", "80"], "--head-dims '80': give comma-separated one or more of"),
    (["--seqlens", "2048,-5"], "--seqlens '2048,-5': give comma-separated positive integers"),
    (["--seqlens", "abc"], "--seqlens 'abc': give comma-separated positive integers"),
    (["--backward", "--variants", "2:cols:64:0:2:0:0:0:-1", "--head-dims", "128"],
     "HEADS_PER_CTA -1; give an integer, 0 or more"),
    (["--backward", "--variants", "2:cols:128:0:2:0:0:0:1", "--group", "8", "--head-dims", "128"],
     "heads_per_cta=1 needs a dQ box of 64 rows"),
    (["--backward", "--variants", "2:cols:64:0:2:0:0:2"], "LOCKSTEP 2; accepted 0, 1"),
    (["--backward", "--variants", "2:rows:128:1:3"], "NUM_CONSUMERS 3; accepted 1, 2"),
    (["--backward", "--variants", "2:rows:64:0:1:128:2"], "SEPARATE_DQ 2; accepted 0, 1"),
    (["--backward", "--variants", "2:rows:128:1:2:-8"], "MAXNREG -8; give 0 or more"),
    (["--backward", "--variants", "2:rows:128:yes"], "SECTION_HEADS yes; give 0 or more"),
    (["--backward", "--group", "3", "--head-dims", "128"], "--group 3: give a divisor of the 16 heads"),
    (["--backward", "--variants", "2:none"], "SPLIT_DQ 'none'; accepted cols, rows"),
    (["--backward", "--variants", "2:rows:96"], "BLOCK_M 96; accepted 64, 128"),
    (["--backward", "--variants", "x"], "backward variant x: NUM_STAGES is an integer"),
    (["--backward", "--variants", "0"], "NUM_STAGES 0; give 1 or more"),
    (["--backward", "--variants", "2:rows:64"], "2:rows:64 at head_dim 64: .*block_m=64 with split_dq='rows'"),
    (["--backward", "--variants", "2:rows", "--head-dims", "128"],
     "2:rows at head_dim 128: .*block_m=64 with split_dq='rows'"),
    (["--backward", "--head-dims", "256"], "--head-dims 256: the Gluon backward takes 64, 96, 128"),
])
def test_fa3_variants_checks_its_variants_on_any_machine(monkeypatch, argv, message):
    """tools.fa3_variants parses --variants (in the --backward format with --backward) before it looks for a GPU,
    so a typo is named on a CPU-only machine too."""
    from tools import fa3_variants

    with pytest.raises(SystemExit, match=message):
        fa3_variants.main(argv)


@pytest.mark.parametrize("argv", [[], ["--backward"]])
def test_fa3_variants_default_variants_parse_in_both_modes(monkeypatch, argv):
    """Each mode's default --variants passes its own format's check; then, without CUDA, the GPU check refuses."""
    import torch
    from tools import fa3_variants

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        fa3_variants.main(argv)


def test_window_configs_tool_checks_its_variants_before_the_gpu(monkeypatch):
    """tools.fa3_window_configs: a variant it cannot read, or a backward the kernel cannot run, exits naming it;
    without a GPU it says so."""
    from tools import fa3_window_configs

    with pytest.raises(SystemExit, match="give 5 to 7 fields"):
        fa3_window_configs.main(["--forward", "2:128:4"])
    with pytest.raises(SystemExit, match="backward variant 2:rows:64 at head_dim 64"):
        fa3_window_configs.main(["--backward", "2:rows:64"])
    with pytest.raises(SystemExit, match="--variants '': an empty variant"):  # empty is not the defaults
        fa3_window_configs.main(["--forward", ""])
    with pytest.raises(SystemExit):
        fa3_window_configs.main(["--window", "-5"])
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        fa3_window_configs.main([])
