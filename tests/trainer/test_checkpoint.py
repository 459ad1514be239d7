"""Checkpoint files: atomic replacement, pruning, corrupt/missing files, unwrapped weights, RNG state."""

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from model.gpt import GPT, GPTConfig
from trainer.checkpoint import (CheckpointError, clean_state_dict, latest_checkpoint, list_checkpoints,
                                load_checkpoint, save_checkpoint, unwrap_model)
from trainer.runtime import rng_state, set_rng_state


def fake_state(step):
    return {"model": {"w": torch.randn(64, 64)}, "optimizer": {}, "step": step, "tokens_seen": step * 10,
            "rng": {}, "sampler": {}, "config": {}, "model_args": {}}


def test_interrupted_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    first = fake_state(1)
    save_checkpoint(first, tmp_path, 1, keep_last=1)
    real_save = torch.save

    def save_half_then_fail(obj, f):
        import io
        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        raise OSError("simulated crash: disk full half-way through the save")

    monkeypatch.setattr("trainer.checkpoint.torch.save", save_half_then_fail)
    with pytest.raises(OSError, match="half-way"):
        save_checkpoint(fake_state(2), tmp_path, 2, keep_last=1)  # keep_last=1 must not prune step 1
    files = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert files == ["step_00000001.pt"]  # no half file, no leftover temporary
    assert torch.equal(load_checkpoint(latest_checkpoint(tmp_path))["model"]["w"], first["model"]["w"])


def test_killed_save_leaves_only_an_ignored_temporary(tmp_path):
    save_checkpoint(fake_state(1), tmp_path, 1, keep_last=3)
    (tmp_path / "checkpoints" / "step_00000002.pt.tmp-12345").write_bytes(b"\x80\x02half a pickle")
    assert latest_checkpoint(tmp_path).name == "step_00000001.pt"
    assert load_checkpoint(latest_checkpoint(tmp_path))["step"] == 1


def test_replacing_a_checkpoint_is_atomic(tmp_path, monkeypatch):
    save_checkpoint(fake_state(5), tmp_path, 5, keep_last=3)
    replaced = []
    import trainer.checkpoint as ck
    real_replace = ck.os.replace

    def spy(src, dst):
        # At the moment of the rename the old file is still complete and the new one fully written.
        assert load_checkpoint(dst)["step"] == 5 and torch.load(src, weights_only=True)["tokens_seen"] == 999
        replaced.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(ck.os, "replace", spy)
    save_checkpoint({**fake_state(5), "tokens_seen": 999}, tmp_path, 5, keep_last=3)
    assert replaced and load_checkpoint(latest_checkpoint(tmp_path))["tokens_seen"] == 999


def test_keep_last(tmp_path):
    for step in (3, 6, 9, 12):
        save_checkpoint(fake_state(step), tmp_path, step, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000009.pt", "step_00000012.pt"]


def test_missing_and_corrupt_files_are_reported_by_path(tmp_path):
    missing = tmp_path / "nope.pt"
    with pytest.raises(CheckpointError, match=f"{missing} does not exist"):
        load_checkpoint(missing)
    with pytest.raises(CheckpointError, match="^checkpoint /dev/null is not a regular file"):
        load_checkpoint(Path("/dev/null"))
    bad = tmp_path / "bad.pt"
    content = bytes(random.randrange(256) for _ in range(1000))
    bad.write_bytes(content)
    bad.write_bytes(b"PK\x03\x04" + content)  # a zip file's start, then garbage: a damaged torch.save file
    with pytest.raises(CheckpointError, match=f"{bad} is corrupt"):
        load_checkpoint(bad)
    assert bad.read_bytes() == b"PK\x03\x04" + content
    good = save_checkpoint(fake_state(1), tmp_path, 1, keep_last=1)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"truncated.pt is corrupt or unreadable \(cut short or damaged"):
        load_checkpoint(truncated)
    empty = tmp_path / "empty.pt"  # torch raises an EOFError with no message for it
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"empty.pt is corrupt or unreadable \(EOFError: the file ends early"):
        load_checkpoint(empty)
    flipped = tmp_path / "flipped.pt"  # whole and readable, but bytes changed inside the weights
    content = bytearray(good.read_bytes())
    middle = len(content) // 2
    content[middle: middle + 64] = bytes(b ^ 0xFF for b in content[middle: middle + 64])
    flipped.write_bytes(content)
    with pytest.raises(CheckpointError, match="flipped.pt is corrupt .*fails its CRC-32 check"):
        load_checkpoint(flipped)
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(1)}, other)
    with pytest.raises(CheckpointError, match="not a trainer checkpoint"):
        load_checkpoint(other)


@pytest.mark.parametrize("kind", ["folder", "broken link"])
def test_resume_auto_refuses_a_newer_checkpoint_name_that_is_not_a_file(tmp_path, kind):
    """resume=auto does not fall back past step_N.pt when that name is a folder or a broken link; older ones of
    those are skipped."""
    from trainer.resume import find_checkpoint

    for step in (5, 10):
        save_checkpoint(fake_state(step), tmp_path, step, keep_last=3)
    older = tmp_path / "checkpoints" / "step_00000001.pt"
    older.mkdir()
    assert find_checkpoint("auto", tmp_path)[1].name == "step_00000010.pt"
    newer = tmp_path / "checkpoints" / "step_00000020.pt"
    newer.mkdir() if kind == "folder" else newer.symlink_to(tmp_path / "gone.pt")
    with pytest.raises(CheckpointError, match=f"^checkpoint {newer} is (a folder|not a file .*); it was left as "
                                              "is: move it out of the checkpoints folder"):
        find_checkpoint("auto", tmp_path)
    assert newer.is_dir() if kind == "folder" else newer.is_symlink()


def test_unwrapped_weights_have_no_wrapper_prefixes():
    model = GPT(GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=16))
    compiled = torch.compile(model)  # wrapping is lazy: nothing is compiled here
    assert any(k.startswith("_orig_mod.") for k in compiled.state_dict())
    assert unwrap_model(compiled) is model
    sd = clean_state_dict({f"module._orig_mod.{k}": v for k, v in model.state_dict().items()})
    assert set(sd) == set(model.state_dict())
    fresh = GPT(GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=16))
    fresh.load_state_dict(sd)


def test_rng_state_survives_a_checkpoint(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(1)
    save_checkpoint({**fake_state(1), "rng": rng_state()}, tmp_path, 1, keep_last=1)
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(load_checkpoint(latest_checkpoint(tmp_path))["rng"])
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_a_failed_write_is_one_error_naming_the_path(tmp_path, monkeypatch):
    from trainer.checkpoint import CheckpointWriteError

    save_checkpoint(fake_state(1), tmp_path, 1, keep_last=1)

    def too_large(obj, f):
        raise OSError(27, "File too large")

    monkeypatch.setattr("trainer.checkpoint.torch.save", too_large)
    with pytest.raises(CheckpointWriteError) as e:
        save_checkpoint(fake_state(2), tmp_path, 2, keep_last=1)
    path = tmp_path / "checkpoints" / "step_00000002.pt"
    assert str(e.value) == f"could not write checkpoint {path}: [Errno 27] File too large; the older checkpoints are intact"
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000001.pt"]


def test_a_failed_first_write_does_not_speak_of_older_checkpoints(tmp_path, monkeypatch):
    from trainer.checkpoint import CheckpointWriteError

    def too_large(obj, f):
        raise OSError(27, "File too large")

    monkeypatch.setattr("trainer.checkpoint.torch.save", too_large)
    with pytest.raises(CheckpointWriteError, match="File too large; no checkpoint was saved$"):
        save_checkpoint(fake_state(1), tmp_path, 1, keep_last=1)
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_a_failed_write_in_a_folder_that_cannot_be_listed_is_still_one_error(tmp_path, monkeypatch):
    from trainer.checkpoint import CheckpointWriteError

    def too_large(obj, f):
        raise OSError(27, "File too large")

    def unreadable(run_dir):
        raise OSError(107, "Transport endpoint is not connected")

    monkeypatch.setattr("trainer.checkpoint.torch.save", too_large)
    monkeypatch.setattr("trainer.checkpoint.list_checkpoints", unreadable)
    with pytest.raises(CheckpointWriteError, match="File too large; the older checkpoints were not touched$"):
        save_checkpoint(fake_state(1), tmp_path, 1, keep_last=1)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_checkpoint_folder_is_one_error(tmp_path):
    save_checkpoint(fake_state(1), tmp_path, 1, keep_last=1)
    folder = tmp_path / "checkpoints"
    folder.chmod(0o555)
    try:
        with pytest.raises(CheckpointError, match=r"could not write checkpoint .*step_00000002.pt: \[Errno 13\]"):
            save_checkpoint(fake_state(2), tmp_path, 2, keep_last=1)
    finally:
        folder.chmod(0o755)
    assert [p.name for p in folder.iterdir()] == ["step_00000001.pt"]


def test_orphan_temporaries_of_killed_saves_are_removed_with_a_warning(tmp_path, caplog):
    import subprocess
    import sys

    from trainer.checkpoint import remove_orphans

    save_checkpoint(fake_state(1), tmp_path, 1, keep_last=3)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    orphan = tmp_path / "checkpoints" / f"step_00000002.pt.tmp-{proc.pid}"
    orphan.write_bytes(b"\x80\x02half a pickle")
    assert remove_orphans(tmp_path) == [orphan] and not orphan.exists()
    assert f"removed 1 unfinished checkpoint file(s) of a killed earlier save: {orphan}" in caplog.text
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001.pt"]


def test_files_that_are_not_checkpoints_say_so(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("ROMEO: but soft\n")
    pickled = tmp_path / "model.pt"
    torch.save(torch.nn.Linear(2, 2), pickled)  # a whole module: not loadable with weights_only
    noise = tmp_path / "random.pt"  # random bytes named like a checkpoint
    noise.write_bytes(os.urandom(4096))
    for path in (text, pickled, noise):
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(path)
        assert str(e.value).startswith(f"not a checkpoint file: {path}")
        assert "weights_only" not in str(e.value) and "issue" not in str(e.value) and "Weights only" not in str(e.value)
        assert "checkpoints folder" not in str(e.value)  # the resume advice is train.py's, for a run's own files


def test_a_missing_or_malformed_key_names_file_and_key(tmp_path):
    path = save_checkpoint({k: v for k, v in fake_state(1).items()}, tmp_path, 1, keep_last=1)
    ckpt = load_checkpoint(path)
    assert ckpt.version == 1 or ckpt.version == 0
    with pytest.raises(CheckpointError, match=f"checkpoint {path} has no 'scaler' entry"):
        ckpt["scaler"]
    bad = save_checkpoint({**fake_state(2), "step": "2"}, tmp_path, 2, keep_last=2)
    with pytest.raises(CheckpointError, match=f"checkpoint {bad}: 'step' is a str, expected int"):
        load_checkpoint(bad)["step"]
    newer = save_checkpoint({**fake_state(3), "format_version": 99}, tmp_path, 3, keep_last=3)
    with pytest.raises(CheckpointError, match="format version 99; this code reads up to 1"):
        load_checkpoint(newer)


def test_checkpoints_without_attn_softcap_load_it_as_off(tmp_path):
    """model.attn_softcap came later: a file written before it reads 0.0 (off) in model_args and the config, and a
    file with it keeps its value; a resumed run may change it (a warning, not a refusal: it shapes no weight)."""
    from trainer.resume import NOT_SHAPE

    old = save_checkpoint({**fake_state(1), "model_args": {"n_layer": 2}, "config": {"model": {"n_layer": 2}}},
                          tmp_path, 1, keep_last=2)
    ckpt = load_checkpoint(old)
    assert ckpt["model_args"]["attn_softcap"] == 0.0 and ckpt["config"]["model"]["attn_softcap"] == 0.0
    new = save_checkpoint({**fake_state(2), "model_args": {"attn_softcap": 30.0}}, tmp_path, 2, keep_last=2)
    assert load_checkpoint(new)["model_args"]["attn_softcap"] == 30.0
    assert "attn_softcap" in NOT_SHAPE
    GPT(GPTConfig(**{**dict(block_size=8, vocab_size=10, n_layer=1, n_head=2, n_embd=32),
                     **{k: v for k, v in ckpt["model_args"].items() if k == "attn_softcap"}}))


def test_another_tokenizer_is_refused_naming_each_field(tmp_path):
    """Resuming with another tokenizer: one line per differing data field, 'data tokenizer: ...' for the kind."""
    import dataclasses

    from omegaconf import OmegaConf

    from trainer.config import ConfigError
    from trainer.resume import check_compatible

    args = GPTConfig(block_size=8, vocab_size=10, n_layer=1, n_head=2, n_embd=32)
    meta = {"tokenizer": "char", "chars": "abcdefghij", "vocab_size": 10}
    path = save_checkpoint({**fake_state(1), "model_args": dataclasses.asdict(args), "data_meta": meta}, tmp_path, 1,
                           keep_last=1)
    new = {"tokenizer": "tiktoken", "encoding": "gpt2", "vocab_size": 10}
    with pytest.raises(ConfigError) as e:
        check_compatible(load_checkpoint(path), args, new, OmegaConf.create({}))
    text = str(e.value)
    assert "data tokenizer: checkpoint 'char', config 'tiktoken'" in text and "tokenizer tokenizer" not in text
    assert "data tokenizer encoding: checkpoint None, config 'gpt2'" in text


def _check_resume(tmp_path, old, new, refused_key=None):
    """A checkpoint of GPT(old) resumed with the GPTConfig `new` (same tokenizer): passes, or with `refused_key`
    is refused naming model.<refused_key>."""
    import dataclasses

    from omegaconf import OmegaConf

    from trainer.config import ConfigError
    from trainer.resume import check_compatible

    meta = {"tokenizer": "char", "chars": "abcdefghij", "vocab_size": 10}
    path = save_checkpoint({**fake_state(1), "model": GPT(old).state_dict(), "model_args": dataclasses.asdict(old),
                            "data_meta": meta, "attn_backend": old.attn, "config": {}}, tmp_path, 1, keep_last=1)
    if refused_key is None:
        check_compatible(load_checkpoint(path), new, meta, OmegaConf.create({}))
    else:
        with pytest.raises(ConfigError, match=rf"model\.{refused_key}: checkpoint"):
            check_compatible(load_checkpoint(path), new, meta, OmegaConf.create({}))


@pytest.mark.parametrize("saved, given, same", [
    (8, [8, 8], True), ([8, 8], 8, True), (0, [0, 0], True), ([4, 8], [4, 8], True),
    (8, [8, 4], False), ([8, 8], 4, False), (0, [8, 8], False),
])
def test_a_per_layer_window_of_one_value_is_that_value(tmp_path, saved, given, same):
    """model.attn_window=[w, w, ...] (one per layer) builds the model that model.attn_window=w does: resuming one
    from the other is allowed; another window in any layer is refused, naming model.attn_window."""
    base = dict(block_size=8, vocab_size=10, n_layer=2, n_head=2, n_embd=32)
    _check_resume(tmp_path, GPTConfig(**base, attn_window=saved), GPTConfig(**base, attn_window=given),
                  None if same else "attn_window")


@pytest.mark.parametrize("saved, given, same", [(None, 4, True), (4, None, True), (None, None, True), (4, 4, True),
                                                (None, 2, False), (2, None, False)])
def test_n_kv_head_null_is_n_head(tmp_path, saved, given, same):
    """model.n_kv_head=null builds the model that n_kv_head=n_head does: resuming one from the other is allowed;
    another k/v head count is refused, naming model.n_kv_head."""
    base = dict(block_size=8, vocab_size=10, n_layer=1, n_head=4, n_embd=64)
    _check_resume(tmp_path, GPTConfig(**base, n_kv_head=saved), GPTConfig(**base, n_kv_head=given),
                  None if same else "n_kv_head")
