"""tools.fa3_variants: its CPU-checkable parts (the checks and timings need an sm_90 GPU)."""

import pytest


def test_fa3_variant_fields():
    from tools.fa3_variants import forward_config

    assert forward_config("3:128:2:1:1") == (3, 128, 2, True, True, False)  # SPLIT_LOOPS off by default
    assert forward_config("3:128:2:1:1:1") == (3, 128, 2, True, True, True)
    with pytest.raises(SystemExit, match="variant 3:128:2: give 5 or 6 fields"):
        forward_config("3:128:2")


def test_fa3_backward_variant_fields_default_to_the_head_dims_config():
    from tools.fa3_variants import backward_config

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
