"""tools/check_triton_versions.sh's own arguments: --help prints its usage, a word that is no release is refused,
both before any venv is made."""

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "check_triton_versions.sh"


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_usage(flag):
    out = subprocess.run(["bash", str(SCRIPT), flag], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out
    assert out.stdout.startswith("Compile both Gluon FA3 kernels and the packed-sequence schedule's Triton kernels")
    assert "bash tools/check_triton_versions.sh 3.9.0 3.10.0" in out.stdout and "triton" not in out.stderr


def test_a_word_that_is_no_release_is_refused():
    out = subprocess.run(["bash", str(SCRIPT), "3.9.0", "--verbose"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and out.stdout == "", out
    assert "--verbose: expected Triton release numbers such as 3.9.0 (or --help)" in out.stderr
