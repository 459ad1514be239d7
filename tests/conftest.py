"""Shared pytest set-up.

Without a CUDA GPU the Triton kernels run through Triton's interpreter, which must be switched on before
anything imports triton (Triton reads TRITON_INTERPRET when triton.language and the kernels are decorated).

A test that needs a CUDA GPU is marked `gpu` and nothing else: the marker skips it without CUDA (below) and
`python -m pytest -m gpu` selects every such test.

Trainer tests: no network, every generated file in a temporary folder, tiny configs. The environment
variables below are set at import, before wandb / datasets are imported by any test.
"""

import functools
import os
import random
import sys
import tempfile
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tests"):  # the project's packages; tests/reference.py
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

_TMP = Path(tempfile.mkdtemp(prefix="gpt-tests-"))
for var, value in {
    "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": _TMP / "wandb",
    "WANDB_CACHE_DIR": _TMP / "wandb-cache", "WANDB_CONFIG_DIR": _TMP / "wandb-config",
    "WANDB_DATA_DIR": _TMP / "wandb-data", "HF_DATASETS_CACHE": _TMP / "hf-datasets",
    "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ[var] = str(value)
for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
    os.environ.pop(var, None)


# `slow`: whole training runs, torchrun jobs, subprocesses that compile for sm_90 or build token caches, and the
# largest interpreter matrices (over ~1 s each on the 2-core CI machine). `pytest -m "not slow"` is the inner loop.
SLOW_MODULES = {"test_train.py", "test_distributed.py", "test_run_folder.py", "test_throughput.py",
                "test_bench_generate.py"}
SLOW_TESTS = {
    "test_varlen_backward_variants", "test_varlen_matches_reference",
    "test_varlen_flat_grid_random_lengths_gqa_pointer_path",
    "test_matches_float64_reference", "test_masked_kernels_compile_for_sm90", "test_gluon_kernels_compile_for_sm90",
    "test_split_kv_decode_in_the_model", "test_backward_is_deterministic", "test_fa2_pointer_path_matches_reference",
    "test_qkvpacked_matches_float64_reference", "test_cli_signal_while_the_cache_is_written",
    "test_compiled_decode_step_compiles_once", "test_cached_greedy_matches_uncached",
    "test_help_lists_every_key_with_its_meaning", "test_sdpa_then_fa2_in_one_process_without_gpu",
    "test_document_mask_and_window_compile_in_one_graph", "test_sample_py_greedy_same_with_and_without_cache",
    "test_document_mask_matches_sdpa_and_isolates_documents",
    "test_fused_qkv_goes_to_the_packed_kernel_and_matches_sdpa", "test_softcap_kernels_compile_for_sm90",
    "test_packed_sequence_kernels_compile_for_sm90", "test_counts_the_compiled_forward",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: a whole training run, a subprocess or a large interpreter matrix")


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        if item.path.name in SLOW_MODULES or getattr(item, "originalname", item.name) in SLOW_TESTS:
            item.add_marker(slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


WORDS = ("the king queen lord love death night day sword crown blood heart fair foul sweet "
         "speak hear come go thou thee thy my mine what why where when now never ever").split()


def random_text(rng: random.Random, n_lines: int) -> str:
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 9))]
        lines.append(" ".join(words).capitalize() + rng.choice(".,;!?"))
    return "\n".join(lines) + "\n"


@functools.cache  # made once per pytest run
def _corpus() -> Path:
    rng = random.Random()  # fresh inputs every run
    folder = _TMP / "corpus"
    folder.mkdir(exist_ok=True)
    for i in range(3):
        (folder / f"part{i}.txt").write_text(random_text(rng, 400))
    return folder


@pytest.fixture(autouse=True)
def fresh_kernel_caches():
    """`kernels.fa3` remembers its dispatch and launches per call signature, derived from module tables and
    functions that tests patch: every test starts and ends without them."""
    fa3 = sys.modules.get("kernels.fa3")
    if fa3 is not None:
        fa3.clear_caches()
    yield
    fa3 = sys.modules.get("kernels.fa3")
    if fa3 is not None:
        fa3.clear_caches()


@pytest.fixture(scope="module")  # module-scoped fixtures use it
def corpus_dir() -> Path:
    """Three text files of random English-like lines (new every pytest run, shared by its tests), ~60 KB in all."""
    return _corpus()


@pytest.fixture(scope="module")
def cache_dir() -> Path:
    """Token cache shared by every test of a pytest run (prepared once per data config)."""
    return _TMP / "cache"


@pytest.fixture
def tiny_overrides(tmp_path, corpus_dir, cache_dir) -> list[str]:
    """Overrides for a seconds-long CPU run: 2 layers, GQA (4 q / 2 kv heads), 32 wide, context 32."""
    return [
        "model=tiny", "model.n_layer=2", "model.n_head=4", "model.n_kv_head=2", "model.n_embd=32",
        "model.block_size=32", "data=local_text", f"data.files={corpus_dir}/*.txt",
        f"data.cache_dir={cache_dir}", "attn=sdpa", "trainer.device=cpu", "trainer.batch_size=4",
        "trainer.max_steps=6", "optim.warmup_steps=2", "optim.decay_steps=20", "eval.interval=3",
        "eval.iters=2", "ckpt.interval=3", "ckpt.keep_last=2", "wandb.mode=disabled",
        f"run.root={tmp_path / 'runs'}", "run.name=test",
    ]


@pytest.fixture
def make_cfg(tiny_overrides):
    """make_cfg('key=value', ...) -> the composed config for the tiny run plus extra overrides."""
    from trainer.config import compose_config

    def make(*extra: str):
        return compose_config(tiny_overrides + list(extra))

    return make
