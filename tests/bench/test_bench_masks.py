"""bench.masks: its CPU-checkable parts (timing needs a GPU): the document draws, the visible-pair counts behind
its FLOPs, and that every backend of a mode computes the same masked attention."""

import random

import pytest
import torch

from bench import masks


def test_documents_fill_each_context_exactly():
    rng = random.Random()
    lengths = [n for _ in range(50) for n in masks.document_lengths(rng, 2048, median=600, sigma=1.0)]
    documents = masks.packed_documents(3, 2048, 600, 1.0, seed=rng.randrange(2**32))
    assert all(sum(context) == 2048 and min(context) >= 1 for context in documents)
    cu = masks.cu_seqlens(documents, "cpu")
    assert cu[0] == 0 and cu[-1] == 3 * 2048 and cu.dtype == torch.int32
    whole = sorted(lengths)[len(lengths) // 2]  # cut last documents pull the median down a little
    assert 250 < whole < 800


@pytest.mark.parametrize("seqlen,window", [(1, 0), (10, 3), (40, 40), (100, 7)])
def test_window_pairs_count_the_visible_pairs(seqlen, window):
    i, j = torch.arange(seqlen)[:, None], torch.arange(seqlen)[None, :]
    assert masks.window_pairs(seqlen, window) == ((j <= i) & (i - j <= window)).sum()


def test_document_pairs_count_the_visible_pairs():
    documents = masks.packed_documents(2, 50, 8, 1.0, seed=random.randrange(2**32))
    doc = masks.document_ids(documents, "cpu")
    i = torch.arange(len(doc))
    assert masks.document_pairs(documents) == ((i[None, :] <= i[:, None]) & (doc[:, None] == doc[None, :])).sum()


@pytest.mark.parametrize("mode", ["window", "varlen"])
def test_backends_of_a_mode_compute_the_same_attention(mode):
    """fa3 and fa2 (the interpreter; fa3 is FA2's kernels on the CPU), FlexAttention (eager) and SDPA with the dense
    mask agree; forward only (Flex has no CPU backward)."""
    if mode == "window":
        table, shape = masks.window_backends(48, 5, "cpu", compile_flex=False), (2, 48)
        for name in ("fa3_full", "fa2_full", "sdpa_cudnn"):  # not windowed; cuDNN needs a GPU
            del table[name]
    else:
        documents = masks.packed_documents(2, 40, 6, 1.0, seed=random.randrange(2**32))
        table, shape = masks.varlen_backends(documents, "cpu", compile_flex=False), (1, 80)
    q, k, v = (torch.randn(shape[0], 2, shape[1], 16) for _ in range(3))
    ref = table.pop("sdpa_dense")(q, k, v)
    for name, attention in table.items():
        torch.testing.assert_close(attention(q, k, v), ref, atol=1e-4, rtol=1e-4, msg=name)


def test_bench_masks_needs_a_gpu(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        masks.main(["--mode", "window"])


def test_unknown_backend_is_rejected_with_the_accepted_names(capsys):
    with pytest.raises(SystemExit):
        masks.main(["--backends", "fa2,flesh"])
    assert "--backends: unknown ['flesh']; choose from fa3_full, fa3, fa2_full, fa2, flex, sdpa_dense, sdpa_cudnn" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [(["--window", "-5"], "--window -5"), (["--seqlen", "0"], "--seqlen 0"),
                                          (["--sigma", "-1"], "--sigma -1.0: give a number >= 0"),
                                          (["--head-dim", "8"], "--head-dim 8: the kernels take 16 to 256")])
def test_bad_numbers_are_rejected_before_the_gpu(capsys, argv, message):
    with pytest.raises(SystemExit):
        masks.parse_args(argv)
    assert message in capsys.readouterr().err


def test_cuda_graph_and_determinism_are_off_unless_asked():
    default = masks.parse_args([])
    assert default.cuda_graph is False and default.deterministic is False
    asked = masks.parse_args(["--mode", "varlen", "--cuda-graph", "--deterministic"])
    assert asked.cuda_graph is True and asked.deterministic is True
