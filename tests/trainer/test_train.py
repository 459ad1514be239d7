"""End-to-end training on a tiny model: files of a run, exact resume, interrupts, NaN, bad input, CLI."""

import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from model.gpt import GPT
from trainer import ConfigError, NonFiniteLossError, train
from trainer.checkpoint import CheckpointError, latest_checkpoint, list_checkpoints, load_checkpoint

ROOT = Path(__file__).resolve().parents[2]
RECORD_KEYS = {"step", "tokens_seen", "train/loss", "train/lr", "train/grad_norm", "perf/step_time_ms",
               "perf/tokens_per_s", "perf/tokens_per_s_per_gpu", "perf/mfu", "perf/mfu_per_gpu", "perf/peak_mem_gib"}


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_short_run_writes_checkpoints_metrics_and_offline_wandb(make_cfg):
    cfg = make_cfg("wandb.mode=offline", "trainer.max_steps=7")
    s = train(cfg)
    run_dir = Path(cfg.run.root) / "test"
    assert s.run_dir == run_dir and s.step == 7 and s.stop_reason == "max_steps" and s.attn_backend == "sdpa"
    # Checkpoints at 3 and 6 (interval), 7 (end); keep_last=2.
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_00000006.pt", "step_00000007.pt"]
    assert s.checkpoint == run_dir / "checkpoints" / "step_00000007.pt"
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert records == s.records and [r["step"] for r in records] == list(range(1, 8))
    for r in records:
        assert RECORD_KEYS <= set(r) and math.isfinite(r["train/loss"]) and r["perf/step_time_ms"] > 0
        assert r["perf/tokens_per_s"] == pytest.approx(s.tokens_per_step / (r["perf/step_time_ms"] / 1e3))
        assert r["perf/tokens_per_s_per_gpu"] == r["perf/tokens_per_s"]  # one process
        assert r["perf/mfu"] is None and r["perf/mfu_per_gpu"] is None and r["perf/peak_mem_gib"] is None  # CPU
    # Every step is charged its own time, evaluation steps (3, 6, 7) included: none near zero. A step charged
    # nothing reads microseconds; a real step of this model (forward, backward and AdamW, hundreds of CPU ops)
    # takes milliseconds. An absolute floor: on a loaded 2-core machine single steps stretch 30x and more, which
    # makes any bound relative to the other steps flaky.
    assert all(r["perf/step_time_ms"] > 0.5 for r in records), [r["perf/step_time_ms"] for r in records]
    assert [r["step"] for r in records if "val/loss" in r] == [3, 6, 7]
    assert s.final_val_loss == records[-1]["val/loss"] and s.tokens_per_step == 4 * 32
    assert records[-1]["tokens_seen"] == 7 * 4 * 32
    # Offline W&B run inside the run folder, id recorded in the checkpoint.
    offline = list((run_dir / "wandb").glob(f"offline-run-*-{s.wandb_run_id}"))
    assert len(offline) == 1 and any(offline[0].glob("*.wandb"))
    ckpt = load_checkpoint(s.checkpoint)
    assert ckpt["wandb_run_id"] == s.wandb_run_id and ckpt["attn_backend"] == "sdpa" and ckpt["step"] == 7
    assert ckpt["tokens_seen"] == 7 * 128 and ckpt["best_val_loss"] == min(r["val/loss"] for r in records if "val/loss" in r)
    assert ckpt["config"]["model"]["n_kv_head"] == 2 and ckpt["config"]["run"]["name"] == "test"
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in ckpt["model"])
    assert ckpt["world_size"] == 1 and len(ckpt["rng"]) == 1  # one RNG state per rank
    assert {"python", "numpy", "torch_cpu", "torch_cuda"} <= set(ckpt["rng"][0])
    assert ckpt["sampler"]["num_shards"] == 1 and "generator" in ckpt["sampler"]["shards"][0]
    assert "scaler" in ckpt and "optimizer" in ckpt and ckpt["model_args"]["vocab_size"] % 64 == 0



def test_eval_iters_zero_turns_evaluation_off(make_cfg):
    s = train(make_cfg("trainer.max_steps=4", "eval.interval=2", "eval.iters=0"))
    assert s.step == 4 and len(s.records) == 4
    assert not any("val/loss" in r for r in s.records)
    assert s.final_val_loss is None and s.best_val_loss is None

# A Llama-style block (RoPE restarting per document, RMSNorm, SwiGLU, QK-norm, an untied head) for the tiny run.
LLAMA_STYLE = ("model.pos_emb=rope", "model.rope_theta=500000", "model.norm=rmsnorm", "model.mlp=swiglu",
               "model.multiple_of=16", "model.qk_norm=true", "model.tie_embeddings=false", "data.document_mask=true")


@pytest.mark.parametrize("block", [(), LLAMA_STYLE], ids=["gpt2", "llama_style"])
def test_resume_is_bit_exact(make_cfg, block):
    """20 straight steps == 10 steps + resume + 10 steps, with dropout and grad accumulation on."""
    common = ("model.dropout=0.1", "trainer.grad_accum=2", "eval.interval=4", "ckpt.interval=0",
              "optim.decay_steps=30", "optim.warmup_steps=3", *block)
    straight = train(make_cfg(*common, "run.name=straight", "trainer.max_steps=20"))
    first = train(make_cfg(*common, "run.name=resumed", "trainer.max_steps=10", "wandb.mode=offline"))
    second = train(make_cfg(*common, "run.name=resumed", "trainer.max_steps=20", "wandb.mode=offline"))
    assert first.step == 10 and second.start_step == 10 and second.step == 20
    losses = lambda recs: [(r["step"], r["train/loss"], r["train/grad_norm"], r["train/lr"]) for r in recs]  # noqa: E731
    assert losses(second.records) == losses(straight.records[10:])  # bit-identical floats
    assert [r.get("val/loss") for r in second.records] == [r.get("val/loss") for r in straight.records[10:]]
    assert second.wandb_run_id == first.wandb_run_id  # the W&B run continues
    a, b = load_checkpoint(straight.checkpoint)["model"], load_checkpoint(second.checkpoint)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    import sample  # the checkpoint rebuilds its model: the block options travel in model_args

    model, _, _ = sample.load_model(second.checkpoint)
    tied = model.lm_head.weight is model.transformer.wte.weight
    assert (model.config.mlp, tied) == (("swiglu", False) if block else ("gelu", True))
    jsonl = read_jsonl(second.run_dir / "metrics.jsonl")
    assert [r["step"] for r in jsonl] == list(range(1, 21))


def test_resume_never_and_resume_path(make_cfg, tmp_path):
    done = train(make_cfg("run.name=orig", "trainer.max_steps=3", "wandb.mode=offline"))
    with pytest.raises(ConfigError, match="resume=never: run folder .*orig already has checkpoints"):
        train(make_cfg("run.name=orig", "resume=never"))
    assert [p.name for p in list_checkpoints(done.run_dir)] == ["step_00000003.pt"]
    branch = train(make_cfg("run.name=branch", f"resume={done.checkpoint}", "trainer.max_steps=5", "wandb.mode=offline"))
    assert branch.start_step == 3 and branch.step == 5
    assert None != branch.wandb_run_id != done.wandb_run_id  # a branch is a new W&B run
    with pytest.raises(CheckpointError, match="nope.pt does not exist"):
        train(make_cfg("run.name=other", f"resume={tmp_path / 'nope.pt'}"))
    with pytest.raises(CheckpointError, match=r"sometimes does not exist \(resume= takes auto, never or a checkpoint"):
        train(make_cfg("run.name=other", "resume=sometimes"))  # a mistyped policy names the accepted values
    with pytest.raises(CheckpointError, match="is a folder; give a checkpoint file"):
        train(make_cfg("run.name=other", f"resume={done.run_dir}"))
    # A branch into a folder holding another run's checkpoints, older ones too, would mix the two runs there.
    short = train(make_cfg("run.name=short", "trainer.max_steps=2"))
    kept = sorted(short.run_dir.rglob("*"))
    with pytest.raises(ConfigError, match=f"resume={done.checkpoint}: run folder .*short holds another run's "
                                          r"checkpoints \(step_00000002.pt\) that a branch from this checkpoint "
                                          "would mix with; use a new run.name"):
        train(make_cfg("run.name=short", f"resume={done.checkpoint}", "trainer.max_steps=5"))
    assert sorted(short.run_dir.rglob("*")) == kept


def test_resume_rejects_a_different_model(make_cfg):
    train(make_cfg("run.name=shape", "trainer.max_steps=3"))
    with pytest.raises(ConfigError, match="model.n_layer: checkpoint 2, config 3"):
        train(make_cfg("run.name=shape", "model.n_layer=3", "trainer.max_steps=4"))
    with pytest.raises(ConfigError, match="model.pos_emb: checkpoint 'learned', config 'rope'"):
        train(make_cfg("run.name=shape", "model.pos_emb=rope", "trainer.max_steps=4"))


def test_corrupt_latest_checkpoint_is_reported_and_kept(make_cfg):
    s = train(make_cfg("run.name=corrupt", "trainer.max_steps=3"))
    content = s.checkpoint.read_bytes()[:1000]
    s.checkpoint.write_bytes(content)
    with pytest.raises(CheckpointError, match="step_00000003.pt is corrupt.*this run's only checkpoint: start a new "
                                              "run.name, or move it out of the checkpoints folder"):
        train(make_cfg("run.name=corrupt", "trainer.max_steps=6"))
    assert s.checkpoint.read_bytes() == content and list_checkpoints(s.run_dir) == [s.checkpoint]
    s.checkpoint.rename(s.run_dir / "corrupt.pt")  # as the message says: the run then trains again from step 0
    again = train(make_cfg("run.name=corrupt", "trainer.max_steps=3"))
    assert again.step == 3 and list_checkpoints(again.run_dir) == [again.checkpoint]
    # With an older checkpoint beside it, the message names the one a resume would fall back to.
    s = train(make_cfg("run.name=corrupt2", "trainer.max_steps=3", "ckpt.interval=2", "ckpt.keep_last=2"))
    assert [p.name for p in list_checkpoints(s.run_dir)] == ["step_00000002.pt", "step_00000003.pt"]
    s.checkpoint.write_bytes(s.checkpoint.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"step_00000003.pt is corrupt.*move it out of the checkpoints folder to "
                                              r"resume from the one before \(step_00000002.pt\)"):
        train(make_cfg("run.name=corrupt2", "trainer.max_steps=6"))


def test_an_unreadable_checkpoint_named_otherwise_points_to_the_runs_others(tmp_path):
    """resume=<run>/checkpoints/odd.pt that is not a checkpoint: the advice names the run's checkpoint to use, and
    building it does not trip over the file's name (no step in it)."""
    from trainer.resume import _load

    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    (ckpts / "step_00000002.pt").write_bytes(b"x")
    (ckpts / "odd.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"odd.pt .*resume from the one before \(step_00000002.pt\)"):
        _load(ckpts / "odd.pt")


def test_a_file_that_is_not_a_checkpoint_is_named_so_and_advice_is_for_run_folders(make_cfg, tmp_path, capsys):
    """resume=<random bytes>: 'not a checkpoint file', without advice about a checkpoints folder it is not in;
    sample.py on a corrupt checkpoint of a run names it, with no advice about resuming (it resumes nothing)."""
    import sample

    noise = tmp_path / "random.pt"
    noise.write_bytes(os.urandom(8192))
    with pytest.raises(CheckpointError) as e:
        train(make_cfg("run.name=noise", f"resume={noise}"))
    assert str(e.value) == f"not a checkpoint file: {noise} (not a file torch.save writes)"
    s = train(make_cfg("run.name=cut", "trainer.max_steps=1"))
    s.checkpoint.write_bytes(s.checkpoint.read_bytes()[:1000])
    assert sample.main(["--run", str(s.run_dir), "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert f"checkpoint {s.checkpoint} is corrupt or unreadable" in err and "checkpoints folder" not in err
    assert "resume" not in err and "run.name" not in err


def test_weights_that_do_not_fit_the_model_are_named_before_the_run_folder(make_cfg, tmp_path, capsys):
    """A checkpoint whose weights lack a key or have another shape than its model_args give (edited by hand, or
    written by other code): resume and sample.py both name the file and the first mismatches, before train.py
    makes a run folder or load_state_dict raises its traceback."""
    import sample

    s = train(make_cfg("run.name=fit", "trainer.max_steps=1"))
    data = torch.load(s.checkpoint, map_location="cpu", weights_only=False)
    weights = data["model"]
    name = next(k for k in weights if k.endswith("lm_head.weight") or k.endswith("wte.weight"))
    for case, edit in (("missing", lambda w: w.pop(name)), ("shape", lambda w: w.__setitem__(name, w[name][:, 1:]))):
        edited = tmp_path / f"{case}.pt"
        changed = dict(weights)
        edit(changed)
        torch.save({**data, "model": changed}, edited)
        expected = f"missing {name}" if case == "missing" else f"{name} is "
        with pytest.raises(CheckpointError, match=f"{edited.name} is corrupt or unreadable: its weights do not fit"
                                                  f".*{re.escape(expected)}"):
            train(make_cfg(f"run.name=fit_{case}", f"resume={edited}"))
        assert not (s.run_dir.parent / f"fit_{case}").exists()
        assert sample.main(["--run", str(edited), "--device", "cpu", "--num-tokens", "2"]) == 1
        assert "its weights do not fit the model" in capsys.readouterr().err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_and_stops_then_resume_finishes(make_cfg, sig):
    def on_step(record):
        if record["step"] == 2:
            os.kill(os.getpid(), sig)

    s = train(make_cfg("run.name=sig", "trainer.max_steps=6", "ckpt.interval=0"), on_step=on_step)
    # Step 2's record is published after step 3 is queued (numbers are read one step late): the step in flight
    # when the signal comes is finished and saved.
    assert s.stop_reason == "interrupted" and s.stop_signal == sig and s.step == 3
    assert [r["step"] for r in s.records] == [1, 2, 3]
    assert [p.name for p in list_checkpoints(s.run_dir)] == ["step_00000003.pt"]
    assert signal.getsignal(sig) in (signal.default_int_handler, signal.SIG_DFL)  # handlers restored
    rest = train(make_cfg("run.name=sig", "trainer.max_steps=6", "ckpt.interval=0"))
    assert rest.start_step == 3 and rest.step == 6 and rest.stop_reason == "max_steps" and rest.stop_signal is None
    again = train(make_cfg("run.name=sig", "trainer.max_steps=6", "ckpt.interval=0"))  # finished: nothing to do
    assert again.start_step == again.step == 6 and again.records == []


def test_signal_during_an_evaluation_step_stops_at_that_step(make_cfg):
    """A signal that arrives while a step evaluates or saves (nothing else in flight) stops right there."""
    def on_step(record):
        if record["step"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    s = train(make_cfg("run.name=sig_eval", "trainer.max_steps=6", "ckpt.interval=3", "eval.interval=3"),
              on_step=on_step)
    assert s.stop_reason == "interrupted" and s.step == 3
    assert [p.name for p in list_checkpoints(s.run_dir)] == ["step_00000003.pt"]


def test_a_signal_during_a_long_evaluation_cuts_it_short_and_saves(make_cfg, monkeypatch, caplog):
    """SIGTERM at the 5th of eval.iters=1000 validation batches: no more are drawn, the step has no val/loss,
    and the run saves that step and stops, as a scheduler's grace period needs."""
    import trainer.loop as loop

    drawn = []

    class Sampler(loop.BatchSampler):  # the validation batches (training draws from ShardedBatchSampler)
        def next_batch(self):
            drawn.append(1)
            if len(drawn) == 5:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().next_batch()

    monkeypatch.setattr(loop, "BatchSampler", Sampler)
    caplog.set_level("INFO", logger="trainer.loop")
    s = train(make_cfg("run.name=sig_long_eval", "trainer.max_steps=6", "eval.interval=3", "eval.iters=1000"))
    assert s.stop_reason == "interrupted" and s.stop_signal == signal.SIGTERM and s.step == 3 and len(drawn) == 5
    assert [p.name for p in list_checkpoints(s.run_dir)] == ["step_00000003.pt"]
    assert "val/loss" not in s.records[-1] and s.final_val_loss is None
    assert "step 3: evaluation cut short by the stop request" in caplog.text


def test_an_evaluation_error_keeps_the_steps_trained_since_the_last_checkpoint(make_cfg, monkeypatch, caplog):
    """A data error found by evaluation (e.g. a damaged val split) still ends the run with that error, but the
    step's metrics and checkpoint are written first: resuming continues from there."""
    import trainer.loop as loop
    from data.sources import DataError

    calls = []

    def evaluate(*args, **kwargs):
        calls.append(1)
        raise DataError("token id 32767 in the val split is not below the vocabulary size 80")

    monkeypatch.setattr(loop, "evaluate", evaluate)
    with pytest.raises(DataError, match="token id 32767"):
        train(make_cfg("run.name=eval_error", "ckpt.interval=4"))
    run_dir = Path(make_cfg("run.name=eval_error").run.root) / "eval_error"
    assert len(calls) == 1 and [p.name for p in list_checkpoints(run_dir)] == ["step_00000003.pt"]
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]
    assert "step 3: its evaluation failed; saved the step's checkpoint" in caplog.text
    monkeypatch.undo()
    resumed = train(make_cfg("run.name=eval_error", "ckpt.interval=4"))
    assert resumed.start_step == 3 and resumed.step == 6


def test_cli_exit_code_after_sigterm_is_143(tiny_overrides, tmp_path):
    """An interrupted run saves, then exits 128 + signal, so a scheduler can tell it from a finished one."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [a for a in tiny_overrides if not a.startswith(("run.", "trainer.max_steps"))] + [
        f"run.root={tmp_path}", "run.name=term", "trainer.max_steps=100000", "ckpt.interval=0"]
    proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "term" / "metrics.jsonl"
    deadline = time.time() + 120  # until a step with a val loss (eval.interval=3) is recorded
    while not (metrics.exists() and "val/loss" in metrics.read_text()) and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert len(list_checkpoints(tmp_path / "term")) == 1 and "interrupted at step" in out
    # The command repeats the run's own overrides, one shell word each, so it runs as printed.
    command = re.search(r"interrupted at step \d+; to resume: (.*)", out).group(1)
    words = shlex.split(command)
    assert words[:4] == ["python", "train.py", "run.name=term", f"run.root={tmp_path}"]
    last = {a.split("=")[0]: a for a in args}  # ckpt.interval is given twice: the value the run used
    assert words[4:] == [a for a in args if not a.startswith("run.") and last[a.split("=")[0]] == a]
    assert ("received SIGTERM: stopping after this step and saving a checkpoint (Ctrl-C or SIGINT to abort; another "
            "SIGTERM does not)") in out
    assert "last val loss" in out and "final val loss" not in out  # an interrupted run has steps to go


@pytest.mark.parametrize("forward,kept,says", [(3, ["step_00000002.pt"], "resume continues from step_00000002.pt"),
                                               (1, [], "no checkpoint was saved yet")])
def test_cli_second_ctrl_c_aborts_with_130_and_no_traceback(tiny_overrides, tmp_path, forward, kept, says):
    """A second Ctrl-C (KeyboardInterrupt mid-step, injected in the given forward) aborts without saving that step:
    exit code 130 and one line, no traceback, naming the checkpoint a resume continues from (step 2's), if any."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": "0", "TEST_FAIL_RANK": "0", "TEST_FAIL_FORWARD": str(forward),
           "TEST_FAIL_KIND": "interrupt"}
    args = [a for a in tiny_overrides if not a.startswith(("run.", "trainer.max_steps"))] + [
        f"run.root={tmp_path}", "run.name=abort", "trainer.max_steps=5", "ckpt.interval=2"]
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "trainer" / "torchrun_entry.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 128 + signal.SIGINT, out[-3000:]
    assert "Traceback" not in out and f"aborted by a second Ctrl-C; this step was not saved ({says})" in out, \
        out[-3000:]
    assert [p.name for p in list_checkpoints(tmp_path / "abort")] == kept


@pytest.mark.parametrize("module,signum", [("torch", signal.SIGINT), ("hydra.errors", signal.SIGINT),
                                           ("torch", signal.SIGTERM)])
def test_cli_ctrl_c_while_loading_is_one_line(module, signum):
    """Ctrl-C or SIGTERM in the seconds `python train.py` spends importing torch and Hydra: exit 128 + the signal
    and one line, no traceback through the import machinery (the signal sent, or Ctrl-C's KeyboardInterrupt raised,
    where `module` is imported)."""
    interrupt = ("raise KeyboardInterrupt" if signum == signal.SIGINT else
                 f"os.kill(os.getpid(), {int(signum)}); time.sleep(30)")
    code = ("import importlib.abc, os, runpy, sys, time\n"
            "class Interrupt(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            f"        if name == {module!r}: {interrupt}\n"
            "sys.meta_path.insert(0, Interrupt())\n"
            "sys.argv = ['train.py']\n"
            "runpy.run_path('train.py', run_name='__main__')\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 128 + signum, proc.stderr[-3000:]
    assert proc.stderr == "interrupted before training started; nothing to save\n" and proc.stdout == ""


def _faulty_run(args, **faults):
    """(exit code, output) of one train.py process run through tests/trainer/torchrun_entry.py with its fault
    injection (`faults`: its environment variables, e.g. TEST_INTERRUPT_BUILD="0")."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": "0", **faults}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "trainer" / "torchrun_entry.py"), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def test_cli_ctrl_c_before_training_says_nothing_was_trained(tiny_overrides, tmp_path):
    """A (first) Ctrl-C while the model is built, before the training loop handles signals: exit 130, one line
    saying nothing was trained, not the second Ctrl-C's message, and the run folder it had made is gone again; a
    folder that was there before (a resume) stays, with its checkpoints."""
    args = [a for a in tiny_overrides if not a.startswith("run.")] + [f"run.root={tmp_path}", "run.name=early"]
    code, out = _faulty_run(args, TEST_INTERRUPT_BUILD="0")
    assert code == 128 + signal.SIGINT, out[-3000:]
    assert "interrupted before training started; nothing to save" in out and "Traceback" not in out, out[-3000:]
    assert "second Ctrl-C" not in out and not (tmp_path / "early").exists()
    kept = tmp_path / "kept"
    args[-1] = "run.name=kept"
    done = subprocess.run([sys.executable, "train.py", *args, "trainer.max_steps=3"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and list_checkpoints(kept), (done.stdout + done.stderr)[-3000:]
    before = sorted(p.name for p in kept.rglob("*"))
    code, out = _faulty_run([*args, "trainer.max_steps=6"], TEST_INTERRUPT_BUILD="0")
    assert code == 128 + signal.SIGINT, out[-3000:]
    assert set(before) <= {p.name for p in kept.rglob("*")}  # nothing of the earlier run removed


def test_cli_sigterm_before_training_leaves_no_folder(tiny_overrides, tmp_path):
    """SIGTERM while the model is built, before the training loop handles signals: as a Ctrl-C there (one line, the
    new run folder gone again), with exit 143."""
    args = [a for a in tiny_overrides if not a.startswith("run.")] + [f"run.root={tmp_path}", "run.name=early"]
    code, out = _faulty_run(args, TEST_INTERRUPT_BUILD="0", TEST_INTERRUPT_SIGNAL="TERM")
    assert code == 128 + signal.SIGTERM, out[-3000:]
    assert "interrupted before training started; nothing to save" in out and "Traceback" not in out, out[-3000:]
    assert not (tmp_path / "early").exists() and list(tmp_path.iterdir()) == []


def test_cli_interrupt_while_closing_keeps_the_trained_run(tiny_overrides, tmp_path):
    """A Ctrl-C after the training loop (while W&B finishes) in a new run's folder: exit 130 and one line naming the
    checkpoint to resume from; the folder and its checkpoints stay."""
    args = [a for a in tiny_overrides if not a.startswith("run.")] + [f"run.root={tmp_path}", "run.name=closing",
                                                                        "trainer.max_steps=3"]
    code, out = _faulty_run(args, TEST_INTERRUPT_CLOSE="0")
    assert code == 128 + signal.SIGINT, out[-3000:]
    assert ("interrupted after the training loop (while the run was closing); the run folder is kept (resume "
            "continues from step_00000003.pt)") in out and "Traceback" not in out, out[-3000:]
    assert [p.name for p in list_checkpoints(tmp_path / "closing")] == ["step_00000003.pt"]


def test_nan_loss_stops_and_keeps_last_good_checkpoint(make_cfg, monkeypatch):
    real_forward = GPT.forward
    calls = {"n": 0}

    def forward(self, idx, targets=None, **kwargs):
        logits, loss = real_forward(self, idx, targets, **kwargs)
        if targets is not None and self.training:
            calls["n"] += 1
            if calls["n"] == 5:  # the 5th training forward = step 5
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", forward)
    cfg = make_cfg("run.name=nan", "trainer.max_steps=8", "ckpt.interval=3")
    # fp32 on the CPU with the default clipping: no wider dtype or clipping to suggest
    with pytest.raises(NonFiniteLossError, match=r"loss is nan at step 5.*step_00000003.pt\. Try a lower optim.lr or "
                                                 r"more optim.warmup_steps\.$"):
        train(cfg)
    run_dir = Path(cfg.run.root) / "nan"
    assert latest_checkpoint(run_dir).name == "step_00000003.pt"
    ckpt = load_checkpoint(latest_checkpoint(run_dir))
    assert ckpt["step"] == 3 and all(torch.isfinite(v).all() for v in ckpt["model"].values())
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]


@pytest.mark.parametrize("dtype,grad_clip,expected", [
    (torch.float16, 1.0, "a lower optim.lr, more optim.warmup_steps or trainer.dtype=bf16 or fp32"),
    (torch.bfloat16, 0.0, "a lower optim.lr, more optim.warmup_steps, optim.grad_clip=1.0 or trainer.dtype=fp32"),
    (torch.float32, 0.0, "a lower optim.lr, more optim.warmup_steps or optim.grad_clip=1.0"),
])
def test_nan_remedies_suggest_only_what_the_run_does_not_use(dtype, grad_clip, expected):
    from trainer.loop import Trainer

    run = SimpleNamespace(cfg=SimpleNamespace(optim=SimpleNamespace(grad_clip=grad_clip)), dtype=dtype)
    assert Trainer._nan_remedies(run) == expected


def test_context_longer_than_data_is_rejected_before_training(make_cfg, tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("to be or not to be, that is the question\n" * 4)
    cfg = make_cfg(f"data.files={small}", "data.name=small", "model.block_size=64")
    with pytest.raises(ConfigError, match="model.block_size=64: longer than the data allows"):
        train(cfg)
    assert not (Path(cfg.run.root) / "test").exists()
    with pytest.raises(ConfigError, match="model.vocab_size=8: smaller than the tokenizer's vocabulary"):
        train(make_cfg("model.vocab_size=8"))


def test_a_val_split_shorter_than_a_context_is_needed_only_with_evaluation(make_cfg, tmp_path):
    """A val split shorter than block_size + 1 is refused with evaluation on (naming eval.iters=0 as the way out), and
    trains without it."""
    small = tmp_path / "small.txt"
    small.write_text("abcdefghijklmnopqrstuvwxyz" * 2)  # 52 characters: 46 train, 6 val tokens
    overrides = (f"data.files={small}", "data.name=small52", "model.block_size=8", "trainer.max_steps=2",
                 "eval.interval=1", "ckpt.interval=0")
    with pytest.raises(ConfigError, match="model.block_size=8: longer than the data allows; .* eval.iters=0 trains "
                                          "without the val split"):
        train(make_cfg(*overrides))
    summary = train(make_cfg(*overrides, "eval.iters=0"))
    assert summary.step == 2 and summary.final_val_loss is None


def test_a_val_fraction_that_starves_the_train_split_is_blamed(make_cfg):
    """Enough tokens overall, but data.val_fraction leaves train shorter than a context: name data.val_fraction."""
    with pytest.raises(ConfigError, match=r"data.val_fraction=0.99999: leaves a split too short"):
        train(make_cfg("data.val_fraction=0.99999"))


def test_sample_generates_text(make_cfg, capsys, monkeypatch):
    import sample

    s = train(make_cfg("run.name=sampled", "trainer.max_steps=3"))
    rc = sample.main(["--run", "sampled", "--runs-root", str(s.run_dir.parent), "--prompt", "The king",
                      "--num-tokens", "40", "--top-k", "5", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("The king") and len(out.rstrip("\n")) == len("The king") + 40
    assert sample.main(["--run", str(s.run_dir / "missing"), "--device", "cpu"]) == 1
    assert "is not a checkpoint file" in capsys.readouterr().err
    # The weights alone (model, model_args, data_meta: a checkpoint stripped for sharing) sample the same text.
    full = torch.load(s.checkpoint, weights_only=True)
    weights = s.run_dir.parent / "weights.pt"
    torch.save({k: full[k] for k in ("model", "model_args", "data_meta")}, weights)
    same = ["--prompt", "The king", "--num-tokens", "12", "--top-k", "5", "--device", "cpu"]
    assert sample.main(["--run", str(s.checkpoint), *same]) == 0
    from_full = capsys.readouterr()
    assert sample.main(["--run", str(weights), *same]) == 0
    from_weights = capsys.readouterr()
    assert from_weights.out == from_full.out and from_weights.err.startswith(f"# {weights}\n")
    torch.save({k: full[k] for k in ("model", "model_args")}, weights)
    assert sample.main(["--run", str(weights), *same]) == 1
    assert "missing data_meta" in capsys.readouterr().err
    # A batch of samples that cannot fit is refused before anything is allocated, naming --num-samples.
    model, _, _ = sample.load_model(sample.find_checkpoint("sampled", str(s.run_dir.parent)), "cpu", "sdpa")
    c = model.config
    cache = 2 * c.n_layer * 1000 * c.block_size * c.kv_heads * c.head_dim * 4  # float32 weights on the CPU
    assert sample.memory_needed(model, 1000, 41, kv_cache=True)["KV cache"] == cache
    assert "KV cache" not in sample.memory_needed(model, 1000, 41, kv_cache=False)
    monkeypatch.setattr(sample, "device_memory", lambda device: cache)
    args = ["--run", "sampled", "--runs-root", str(s.run_dir.parent), "--num-tokens", "40", "--device", "cpu"]
    assert sample.main([*args, "--num-samples", "1000"]) == 1
    err = capsys.readouterr().err
    assert "error: --num-samples=1000: generating needs at least" in err and "choose a smaller --num-samples" in err
    assert sample.main([*args, "--num-samples", "1000", "--no-kv-cache"]) == 0  # no cache: it fits
    capsys.readouterr()

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sample, "sample", ctrl_c)  # Ctrl-C while generating: one line and 130, no traceback
    assert sample.main(args) == 130
    assert capsys.readouterr().err.endswith("interrupted: no sample printed\n")


def test_an_empty_prompt_starts_from_a_token_of_the_vocabulary():
    """The document separator (BPE), else a newline, else (a corpus without newlines) the first character."""
    import sample
    from data.tokenizers import CharTokenizer

    assert sample.start_ids(CharTokenizer("\n ab")) == [0]
    assert sample.start_ids(CharTokenizer(" ab\n")) == [3]
    assert sample.start_ids(CharTokenizer("ba")) == [0]


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_sample_refuses_a_seed_train_py_would_refuse(seed, capsys):
    import sample

    with pytest.raises(SystemExit) as exit_info:
        sample.main(["--run", "any", "--seed", seed])
    assert exit_info.value.code == 2
    assert f"--seed={seed} is out of range: must be in [0, 2**32)" in capsys.readouterr().err


def test_cli_entry_point(tiny_overrides, tmp_path):
    """`python train.py ...` end to end: .hydra/ and train.log in the run folder, clean error for bad input."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [a for a in tiny_overrides if not a.startswith("run.")] + [
        f"run.root={tmp_path}", "run.name=cli", "trainer.max_steps=2"]
    ok = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    run_dir = tmp_path / "cli"
    assert (run_dir / ".hydra" / "config.yaml").exists() and (run_dir / "train.log").exists()
    log = (run_dir / "train.log").read_text()
    assert "attention backend: sdpa" in log and "final val loss" in log
    # A finished run says how to continue it, as an interrupted one does.
    # run.root is not the default: the command names it; the other overrides follow, trainer.max_steps last.
    rest = " ".join(shlex.quote(a) for a in args if not a.startswith(("run.", "trainer.max_steps")))
    assert f"finished at step 2; to continue this run: python train.py run.name=cli run.root={tmp_path} {rest} " \
           "trainer.max_steps=<more than 2>" in log
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_00000002.pt"]
    record = {p.name: p.read_text() for p in (run_dir / ".hydra").iterdir()}
    bad = subprocess.run([sys.executable, "train.py", *args, "model.n_embd=30"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "model.n_embd=30: must be divisible by model.n_head=4" in bad.stdout + bad.stderr
    assert "Traceback" not in bad.stdout + bad.stderr
    # The refused run left the record of the run that made the checkpoints as it was.
    assert {p.name: p.read_text() for p in (run_dir / ".hydra").iterdir()} == record
    # A refused run under a default name leaves no folder behind (a typo would otherwise add one per try).
    unnamed = [a for a in args if not a.startswith("run.name=")] + ["optim.lr=-1"]
    bad = subprocess.run([sys.executable, "train.py", *unnamed], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 1 and "optim.lr=-1.0: must be > 0" in bad.stdout + bad.stderr
    for name in ("..", "a/b"):  # rejected before any folder is made
        bad = subprocess.run([sys.executable, "train.py", *args, f"run.name={name}"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
        assert bad.returncode == 1 and f"run.name={name!r}: must be a non-empty folder name" in bad.stderr
    # So does a refused run under a new run.name; a folder that was there before is kept.
    bad = subprocess.run([sys.executable, "train.py", *args, "run.name=typo", "optim.lr=-1"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "optim.lr=-1.0: must be > 0" in bad.stdout + bad.stderr
    (tmp_path / "empty").mkdir()
    bad = subprocess.run([sys.executable, "train.py", *args, "run.name=empty", "optim.lr=-1"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and (tmp_path / "empty").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cli", "empty"]


def test_fa2_backend_trains_like_sdpa(make_cfg):
    """The Triton FA2 kernel (interpreter on CPU) gives the same losses as SDPA on a micro model."""
    micro = ("model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.n_kv_head=1", "model.block_size=16",
             "trainer.batch_size=2", "trainer.max_steps=3", "eval.iters=1", "ckpt.interval=0")
    ref = train(make_cfg(*micro, "attn=sdpa", "run.name=ref"))
    fa2 = train(make_cfg(*micro, "attn=fa2", "run.name=fa2"))
    assert fa2.attn_backend == "fa2" and load_checkpoint(fa2.checkpoint)["attn_backend"] == "fa2"
    for a, b in zip(ref.records, fa2.records):
        assert b["train/loss"] == pytest.approx(a["train/loss"], abs=1e-4)


def test_cli_warnings_are_their_message_alone(tiny_overrides, tmp_path):
    """attn=fa2 on the CPU warns that it runs under Triton's interpreter: the warning is one log record, its
    message alone, without the source line of whatever code triggered it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    micro = ("model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.n_kv_head=1", "model.block_size=16",
             "trainer.batch_size=2", "trainer.max_steps=1", "eval.iters=1", "attn=fa2")
    args = [a for a in tiny_overrides if not a.startswith("run.")] + [f"run.root={tmp_path}", "run.name=warn", *micro]
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for text in (proc.stdout, (tmp_path / "warn" / "train.log").read_text()):
        lines = text.splitlines()
        at = [i for i, line in enumerate(lines) if "running the Triton kernels under the Triton interpreter" in line]
        assert len(at) == 1, text[-3000:]
        assert lines[at[0]].endswith("][py.warnings][WARNING] - attn=fa2: no CUDA GPU, running the Triton kernels "
                                     "under the Triton interpreter (TRITON_INTERPRET=1); this is very slow and meant "
                                     "for testing only")
        assert lines[at[0] + 1].startswith("[20"), lines[at[0] + 1]  # the next log record, not a source line


def test_cli_fa3_without_a_gpu_names_the_gpu_as_the_reason(tiny_overrides, tmp_path):
    """attn=fa3 on the CPU runs FA2's kernels; the warning names the first missing condition, the GPU, and not
    the Triton version (no Triton version makes the Gluon kernel run without a Hopper GPU)."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU: the CPU's reason does not apply")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    micro = ("model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.n_kv_head=1", "model.block_size=16",
             "trainer.batch_size=2", "trainer.max_steps=1", "eval.iters=1", "attn=fa3")
    args = [a for a in tiny_overrides if not a.startswith("run.")] + [f"run.root={tmp_path}", "run.name=fa3", *micro]
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fallback = [line for line in proc.stdout.splitlines() if "instead of the Gluon FA3 kernels" in line]
    assert fallback and all(line.split("instead of the Gluon FA3 kernels: ")[1].startswith("no CUDA GPU")
                            for line in fallback), fallback


def test_wandb_disabled_needs_no_wandb_package(make_cfg, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    s = train(make_cfg("wandb.mode=disabled", "trainer.max_steps=2"))
    assert s.step == 2 and s.wandb_run_id is None and len(read_jsonl(s.run_dir / "metrics.jsonl")) == 2


def test_wandb_online_without_login_is_a_clear_error(make_cfg, monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "no-login"))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    with pytest.raises(ConfigError, match="wandb.mode='online': W&B could not start.*wandb login"):
        train(make_cfg("wandb.mode=online", "trainer.max_steps=1"))


@pytest.mark.parametrize("attn", ["fa2", "flex"])
def test_attn_window_trains_like_sdpa_and_belongs_to_the_model(make_cfg, attn, capsys):
    """model.attn_window (here local then global layer) through fa2's kernel (flex: its block mask) and SDPA's dense
    mask gives the same losses; it is saved with the model, and resuming with another window is refused."""
    micro = ("model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.n_kv_head=1", "model.block_size=16",
             "model.attn_window=[4,0]", "trainer.batch_size=2", "trainer.max_steps=3", "eval.iters=1",
             "ckpt.interval=0")
    ref = train(make_cfg(*micro, "attn=sdpa", "run.name=window_ref"))
    masked = train(make_cfg(*micro, f"attn={attn}", f"run.name=window_{attn}"))
    for a, b in zip(ref.records, masked.records):
        assert b["train/loss"] == pytest.approx(a["train/loss"], abs=1e-4)
    assert load_checkpoint(masked.checkpoint)["model_args"]["attn_window"] == [4, 0]
    with pytest.raises(ConfigError, match=r"model.attn_window: checkpoint \[4, 0\], config 4"):
        train(make_cfg(*micro, "attn=sdpa", "run.name=window_ref", "model.attn_window=4", "trainer.max_steps=4"))
    if attn == "flex":
        return
    import sample

    # sample.py generates from a windowed model without the KV cache (which has no window) unless told to use it
    run = ["--run", str(ref.run_dir), "--device", "cpu", "--num-tokens", "3", "--prompt", "a"]
    assert sample.main(run) == 0
    assert "generating without the KV cache" in capsys.readouterr().err
    assert sample.main([*run, "--kv-cache"]) == 1
    assert "the KV cache has no sliding window" in capsys.readouterr().err


def test_fused_loss_trains_like_full_and_says_how_it_runs_on_the_cpu(make_cfg, caplog):
    """model.loss=fused through the trainer (its CPU path: torch ops) gives full's losses step by step, and the start
    lines say that the Triton kernel needs a GPU; full's run says nothing of it; the default, auto, runs full here
    (the same losses) and says so."""
    caplog.set_level("INFO", logger="trainer.loop")
    micro = ("model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=16", "trainer.batch_size=2",
             "trainer.max_steps=4", "eval.iters=1", "ckpt.interval=0")
    full = train(make_cfg(*micro, "model.loss=full", "run.name=loss_full"))
    assert "model.loss" not in caplog.text
    fused = train(make_cfg(*micro, "model.loss=fused", "run.name=loss_fused"))
    assert "model.loss=fused without a CUDA GPU: the cross-entropy runs as torch ops" in caplog.text
    caplog.clear()
    auto = train(make_cfg(*micro, "run.name=loss_auto"))  # the default: full without a GPU, and it says so
    assert "model.loss=auto: full" in caplog.text and "without a CUDA GPU" not in caplog.text
    assert len(fused.records) == len(full.records) == len(auto.records) == 4
    for a, b, c in zip(full.records, fused.records, auto.records):
        assert b["train/loss"] == pytest.approx(a["train/loss"], abs=1e-4) and c["train/loss"] == a["train/loss"]


def test_softcap_trains_alike_on_fa2_and_flex(make_cfg, caplog):
    """model.attn_softcap through fa2's kernels and flex's score_mod gives the same losses, which differ from the
    uncapped run's (with qk_norm the scores of a fresh model are ~N(0, 1), which a cap of 0.3 flattens); the
    checkpoint records it, and resuming with another value is a warning naming the key, not a refusal."""
    caplog.set_level("INFO", logger="trainer.loop")
    micro = ("model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.n_kv_head=1", "model.block_size=16",
             "model.qk_norm=true", "trainer.batch_size=2", "trainer.max_steps=3", "eval.iters=1", "ckpt.interval=0")
    fa2 = train(make_cfg(*micro, "attn=fa2", "model.attn_softcap=0.3", "run.name=softcap_fa2"))
    assert "attention logit soft-capping: 0.3 (model.attn_softcap)" in caplog.text
    flex = train(make_cfg(*micro, "attn=flex", "model.attn_softcap=0.3", "run.name=softcap_flex"))
    plain = train(make_cfg(*micro, "attn=sdpa", "run.name=softcap_plain"))
    for a, b in zip(fa2.records, flex.records):
        assert b["train/loss"] == pytest.approx(a["train/loss"], abs=1e-4)
    assert [r["train/loss"] for r in plain.records] != pytest.approx([r["train/loss"] for r in fa2.records], abs=1e-4)
    assert load_checkpoint(fa2.checkpoint)["model_args"]["attn_softcap"] == 0.3
    import sample

    # sample.py's default --attn picks a backend with soft-capping (sdpa has none, and refuses the model)
    assert sample.main(["--run", str(fa2.run_dir), "--device", "cpu", "--num-tokens", "4", "--prompt", "a"]) == 0
    assert sample.main(["--run", str(fa2.run_dir), "--device", "cpu", "--num-tokens", "4", "--attn", "sdpa"]) == 1
    caplog.clear()
    train(make_cfg(*micro, "attn=fa2", "model.attn_softcap=0.5", "run.name=softcap_fa2", "trainer.max_steps=4"))
    warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "with changed settings" in warnings and "model.attn_softcap: 0.3 -> 0.5" in warnings


@pytest.mark.parametrize("attn", ["fa2", "flex"])
def test_document_mask_trains_like_sdpa(make_cfg, tmp_path, attn):
    """data.document_mask on a corpus of many short documents (one per file): fa2's varlen kernel (flex: its block
    mask) and SDPA's dense mask give the same losses, which differ from the unmasked run's (documents of 1-2 words,
    at most 12 characters, so every window of 16 crosses one)."""
    import random

    from conftest import WORDS

    rng = random.Random()
    for i in range(80):
        (tmp_path / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 2))) + "\n")
    micro = ("model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.n_kv_head=1", "model.block_size=16",
             "trainer.batch_size=2", "trainer.max_steps=3", "eval.iters=1", "ckpt.interval=0",
             f"data.files={tmp_path}/*.txt", "data.name=short_docs")
    masked = ("data.document_mask=true",)
    ref = train(make_cfg(*micro, *masked, "attn=sdpa", "run.name=docs_ref"))
    run = train(make_cfg(*micro, *masked, f"attn={attn}", f"run.name=docs_{attn}"))
    plain = train(make_cfg(*micro, "attn=sdpa", "run.name=docs_plain"))
    for a, b in zip(ref.records, run.records):
        assert b["train/loss"] == pytest.approx(a["train/loss"], abs=1e-4)
    assert [r["train/loss"] for r in plain.records] != [r["train/loss"] for r in ref.records]
    with pytest.raises(ConfigError, match="data.document_mask=true: attn=fa1 has no document masks"):
        train(make_cfg(*micro, *masked, "attn=fa1", "run.name=docs_fa1"))


def test_flex_with_documents_and_a_window_resumes_exactly(make_cfg, caplog):
    """attn=flex with data.document_mask and model.attn_window on the CPU: 4 straight steps == 2 + resume + 2,
    bit for bit (GQA, an evaluation in between). The start of the run names the masks."""
    caplog.set_level("INFO", logger="trainer.loop")
    common = ("attn=flex", "data.document_mask=true", "model.n_layer=1", "model.attn_window=8", "eval.interval=3",
              "eval.iters=1", "ckpt.interval=0", "optim.decay_steps=30")
    straight = train(make_cfg(*common, "run.name=flex_straight", "trainer.max_steps=4"))
    assert "attention masks: causal, model.attn_window=8, within each document (data.document_mask)" in caplog.text
    first = train(make_cfg(*common, "run.name=flex_resumed", "trainer.max_steps=2"))
    second = train(make_cfg(*common, "run.name=flex_resumed", "trainer.max_steps=4"))
    assert straight.attn_backend == "flex" and first.step == 2 and second.start_step == 2
    same = lambda recs: [(r["step"], r["train/loss"], r["train/grad_norm"], r.get("val/loss"))  # noqa: E731
                         for r in recs]
    assert same(second.records) == same(straight.records[2:]) and "val/loss" in second.records[1]
    a, b = load_checkpoint(straight.checkpoint)["model"], load_checkpoint(second.checkpoint)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


# Keys of the checkpoints written before the format had a version (format 0, until 2026-12-01).
FORMAT_0_KEYS = {"model", "optimizer", "scaler", "step", "tokens_seen", "best_val_loss", "world_size", "rng", "sampler",
                 "config", "model_args", "data_meta", "attn_backend", "wandb_run_id", "torch_version"}


def test_a_checkpoint_of_the_version_less_format_resumes_exactly(make_cfg):
    """Today's files have no format_version: rewritten so, a checkpoint still resumes bit-exactly."""
    common = ("eval.interval=0", "ckpt.interval=0", "model.dropout=0.1")
    straight = train(make_cfg(*common, "run.name=straight", "trainer.max_steps=6"))
    first = train(make_cfg(*common, "run.name=old", "trainer.max_steps=3"))
    state = torch.load(first.checkpoint, weights_only=True)
    assert state.pop("format_version") == 1 and set(state) == FORMAT_0_KEYS
    torch.save(state, first.checkpoint)
    assert load_checkpoint(first.checkpoint).version == 0
    second = train(make_cfg(*common, "run.name=old", "trainer.max_steps=6"))
    assert second.start_step == 3
    same = lambda recs: [(r["step"], r["train/loss"], r["train/grad_norm"]) for r in recs]  # noqa: E731
    assert same(second.records) == same(straight.records[3:])


def test_changed_settings_on_resume_are_a_warning_listing_the_keys(make_cfg, caplog):
    train(make_cfg("run.name=mixed", "trainer.max_steps=3"))
    caplog.clear()
    train(make_cfg("run.name=mixed", "trainer.max_steps=4", "attn=sdpa_flash", "optim.lr=0.001"))
    warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "resuming" in warnings and "with changed settings" in warnings
    assert "optim.lr: 0.002 -> 0.001" in warnings and "attention backend (resolved): sdpa -> sdpa_flash" in warnings
    assert "trainer.max_steps" not in warnings  # meant to change on resume


def test_resuming_with_the_backend_auto_resolved_to_is_no_change(make_cfg, caplog):
    """attn=auto resolves to sdpa without a GPU: resuming its run with attn=sdpa, and back, runs the same backend,
    so no changed-settings warning names attn.backend."""
    train(make_cfg("run.name=auto", "trainer.max_steps=2", "attn=auto"))
    caplog.clear()
    train(make_cfg("run.name=auto", "trainer.max_steps=3", "attn=sdpa"))
    train(make_cfg("run.name=auto", "trainer.max_steps=4", "attn=auto"))
    assert "changed settings" not in caplog.text


def test_resuming_past_max_steps_says_so(make_cfg, caplog):
    caplog.set_level("INFO", logger="trainer.loop")
    train(make_cfg("run.name=long", "trainer.max_steps=6"))
    again = train(make_cfg("run.name=long", "trainer.max_steps=3"))
    assert again.start_step == again.step == 6 and again.records == []
    assert "the run is at step 6 >= trainer.max_steps=3: nothing to train" in caplog.text


def test_a_failed_checkpoint_write_is_one_line_without_traceback(tiny_overrides, make_cfg, tmp_path):
    """A file-size limit (`ulimit -f`) below a checkpoint's size: exit 1, one line naming the path and the
    cause, no traceback, and no partial file left (older checkpoints: tests/trainer/test_checkpoint.py)."""
    import resource

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [a for a in tiny_overrides if not a.startswith(("run.", "trainer.max_steps"))] + [
        f"run.root={tmp_path}", "run.name=full", "trainer.max_steps=2", "ckpt.interval=1"]
    limit = 64 * 1024  # the tiny model's checkpoint is larger; logs and the token cache are smaller

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    train(make_cfg("run.name=cache", "trainer.max_steps=1"))  # the token cache, prepared without the limit
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, preexec_fn=small_files)
    out = proc.stdout + proc.stderr
    path = tmp_path / "full" / "checkpoints" / "step_00000001.pt"
    assert proc.returncode == 1, out[-3000:]
    assert f"could not write checkpoint {path}: [Errno 27] File too large" in out and "Traceback" not in out
    assert list((tmp_path / "full" / "checkpoints").iterdir()) == []


def test_a_refused_run_leaves_the_run_folder_untouched(tiny_overrides, tmp_path):
    """resume=never on a folder with checkpoints (and resume=<older step> into it) exits before train.py touches
    the folder: not even its lock file changes. A run train() refuses (a bad value, another
    model shape than the checkpoint's) writes nothing into train.log either; only the lock file names the new PID."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [a for a in tiny_overrides if not a.startswith(("run.", "trainer.max_steps"))] + [
        f"run.root={tmp_path}", "run.name=kept", "ckpt.interval=1", "ckpt.keep_last=3"]
    ok = subprocess.run([sys.executable, "train.py", *args, "trainer.max_steps=2"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-3000:]
    run_dir = tmp_path / "kept"
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.rglob("*") if p.is_file()}
    older = run_dir / "checkpoints" / "step_00000001.pt"
    for extra, message in ((["resume=never"], "resume=never: run folder"),
                           ([f"resume={older}"], "has newer checkpoints (step_00000002.pt)")):
        bad = subprocess.run([sys.executable, "train.py", *args, "trainer.max_steps=5", *extra], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
        assert bad.returncode == 1 and message in bad.stderr, bad.stderr[-3000:]
        assert "Traceback" not in bad.stderr
        assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.rglob("*") if p.is_file()} == before
    before = {p: v for p, v in before.items() if p.name != ".lock"}
    for extra, message in ((["optim.lr=-1"], "optim.lr=-1.0: must be > 0"),
                           (["model.n_layer=3"], "the model or tokenizer differs")):
        bad = subprocess.run([sys.executable, "train.py", *args, "trainer.max_steps=5", *extra], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
        out = bad.stdout + bad.stderr
        assert bad.returncode == 1 and message in out and "Traceback" not in out, out[-3000:]
        assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.rglob("*")
                if p.is_file() and p.name != ".lock"} == before


def test_orphans_of_a_killed_save_are_removed_when_the_run_starts(make_cfg, caplog):
    first = train(make_cfg("run.name=orphans", "trainer.max_steps=3"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = first.checkpoint.with_name(f"step_00000004.pt.tmp-{dead.pid}")  # as `kill -9` mid-save leaves it
    orphan.write_bytes(b"\x80\x02half a pickle")
    second = train(make_cfg("run.name=orphans", "trainer.max_steps=4"))
    assert second.start_step == 3 and not orphan.exists()
    assert f"removed 1 unfinished checkpoint file(s) of a killed earlier save: {orphan}" in caplog.text
    assert sorted(p.name for p in orphan.parent.iterdir()) == ["step_00000003.pt", "step_00000004.pt"]


BLOCK_KEYS = ("pos_emb", "rope_theta", "norm", "norm_eps", "mlp", "mlp_hidden", "multiple_of", "qk_norm",
              "tie_embeddings")


def test_a_checkpoint_from_before_the_attention_window_resumes(make_cfg, caplog):
    """model_args without attn_window or the block options (model.pos_emb ...) and a config without them or
    data.document_mask / data.split_scenes (checkpoints written before them) resume as the GPT-2 they hold, with
    their defaults, without a warning."""
    first = train(make_cfg("run.name=prewindow", "trainer.max_steps=2", "ckpt.interval=0"))
    state = torch.load(first.checkpoint, weights_only=True)
    for key in ("attn_window", *BLOCK_KEYS):
        del state["model_args"][key], state["config"]["model"][key]
    del state["config"]["data"]["document_mask"], state["config"]["data"]["split_scenes"]
    torch.save(state, first.checkpoint)
    model_args = load_checkpoint(first.checkpoint)["model_args"]
    assert model_args["attn_window"] == 0 and (model_args["pos_emb"], model_args["norm"]) == ("learned", "layernorm")
    caplog.clear()
    second = train(make_cfg("run.name=prewindow", "trainer.max_steps=3", "ckpt.interval=0"))
    assert second.start_step == 2 and "changed settings" not in caplog.text


def test_resume_compares_the_model_a_setting_makes_not_the_setting(make_cfg, caplog):
    """A setting the model does not use (rope_theta with learned positions, multiple_of with a GELU MLP) or an
    mlp_hidden equal to the rule's width resumes, with the usual warning; another MLP width is refused."""
    first = train(make_cfg("run.name=same", "trainer.max_steps=1", "ckpt.interval=0"))
    width = 4 * load_checkpoint(first.checkpoint)["model_args"]["n_embd"]
    for step, extra in enumerate(("model.rope_theta=500", "model.multiple_of=128", f"model.mlp_hidden={width}"), 2):
        caplog.clear()
        again = train(make_cfg("run.name=same", f"trainer.max_steps={step}", "ckpt.interval=0", extra))
        assert again.start_step == step - 1 and again.step == step
        assert f"{extra.split('=')[0]}: " in caplog.text and "with changed settings" in caplog.text
    with pytest.raises(ConfigError, match=rf"the MLP's hidden width \(model.mlp_hidden, or model.mlp's rule\): "
                                          rf"checkpoint {width}, config {width + 64}"):
        train(make_cfg("run.name=same", "trainer.max_steps=9", f"model.mlp_hidden={width + 64}"))


def test_resuming_with_another_dropout_is_a_warning(make_cfg, caplog):
    """model.dropout shapes no weight: resuming with another value warns, listing it, as other settings do."""
    train(make_cfg("run.name=drop", "trainer.max_steps=2", "ckpt.interval=0"))
    caplog.clear()
    again = train(make_cfg("run.name=drop", "trainer.max_steps=3", "ckpt.interval=0", "model.dropout=0.1"))
    assert again.start_step == 2 and again.step == 3
    warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "with changed settings" in warnings and "model.dropout: 0.0 -> 0.1" in warnings


def test_resume_compares_model_loss_as_it_runs(make_cfg, caplog):
    """model.loss full -> auto on a CPU runs the same way (auto is full here): no warning; -> chunked warns."""
    train(make_cfg("run.name=lossres", "trainer.max_steps=1", "ckpt.interval=0", "model.loss=full"))
    caplog.clear()
    again = train(make_cfg("run.name=lossres", "trainer.max_steps=2", "ckpt.interval=0"))
    assert again.start_step == 1 and "changed settings" not in caplog.text
    again = train(make_cfg("run.name=lossres", "trainer.max_steps=3", "ckpt.interval=0", "model.loss=chunked"))
    warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert again.start_step == 2 and "model.loss (as it runs here): full -> chunked" in warnings


def test_resuming_on_changed_data_warns_with_both_token_counts_and_checksums(make_cfg, tmp_path, corpus_dir, caplog):
    """A glob that matches one more file since the checkpoint: a new token cache, whose val split is other text.
    The warning names each split's token count and sha256, the checkpoint's and the cache's."""
    import random
    import shutil

    from conftest import random_text

    grow = tmp_path / "grow"
    shutil.copytree(corpus_dir, grow)
    common = (f"data.files={grow}/*.txt", "data.name=grow", "run.name=grow", "ckpt.interval=0")
    first = train(make_cfg(*common, "trainer.max_steps=2"))
    old = load_checkpoint(first.checkpoint)["data_meta"]
    (grow / "more.txt").write_text(random_text(random.Random(), 100))
    caplog.clear()
    second = train(make_cfg(*common, "trainer.max_steps=3"))
    new = load_checkpoint(second.checkpoint)["data_meta"]
    assert second.start_step == 2 and new["train_tokens"] > old["train_tokens"]
    warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "on other data than it was trained on" in warnings, warnings
    for split in ("train", "val"):
        a, b = old, new
        assert (f"{split}.bin: {a[f'{split}_tokens']} tokens, sha256 {a['files'][f'{split}.bin']['sha256']} -> "
                f"{b[f'{split}_tokens']} tokens, sha256 {b['files'][f'{split}.bin']['sha256']}") in warnings
    caplog.clear()
    train(make_cfg(*common, "trainer.max_steps=4"))  # the same data as the last checkpoint: no warning
    assert "other data" not in caplog.text


def test_a_model_larger_than_the_memory_is_one_error_naming_its_size(make_cfg, monkeypatch):
    """model.vocab_size=10**12: a clear error with the parameter count and memory, not an allocator failure."""
    with pytest.raises(ConfigError, match=r"the model is too large for cpu: 32,000,\d{3},\d{3},\d{3} parameters "
                                          r"\(model.vocab_size=1000000000000, model.n_embd=32.*GiB"):
        train(make_cfg("model.vocab_size=1000000000000", "run.name=huge"))
    from trainer.loop import check_memory, min_params, model_config

    args = model_config(make_cfg("model.bias=true"), 65, "sdpa")
    check_memory(args, torch.device("cpu"), 4 * 32, torch.float32)  # the tiny model fits
    # bytes a token in bf16: each layer's input, q and attention output (3 x n_embd), k and v (2 x n_embd / 2: 4 q and
    # 2 k/v heads) and MLP hidden (4 x n_embd)
    kept = args.n_layer * 8 * args.n_embd * 2
    memory = kept * 2**30 * 3 // 2  # 1.5 x what the layers keep of 2**30 tokens in bf16
    monkeypatch.setattr("trainer.loop.device_memory", lambda device: memory)
    with pytest.raises(ConfigError, match=r"^a micro-batch of 1,073,741,824 tokens \(trainer.batch_size x "
                                          r"model.block_size\) is too large for cpu: .* need at least 0.000412 GiB for "
                                          r"weights.*, the logits of 1,073,741,824 tokens \(8 bytes a value; "
                                          r"model.loss=full"):
        check_memory(args, torch.device("cpu"), 2**30)  # weights and activations fit; one micro-batch's logits do not
    # The full loss keeps two float32 copies of the logits in the backward (the log-softmax and its gradient): memory
    # for weights, activations and one copy is refused.
    from trainer.loop import TRAINING_BYTES_PER_PARAM
    tokens = 4096
    rest = min_params(args) * TRAINING_BYTES_PER_PARAM + args.n_layer * tokens * 8 * args.n_embd * 4
    monkeypatch.setattr("trainer.loop.device_memory", lambda device: rest + tokens * args.vocab_size * 4 * 3 // 2)
    with pytest.raises(ConfigError, match=r"^a micro-batch of 4,096 tokens .* \(8 bytes a value; model.loss=full"):
        check_memory(args, torch.device("cpu"), tokens, torch.float32)
    monkeypatch.setattr("trainer.loop.device_memory", lambda device: memory)
    chunked = model_config(make_cfg("model.bias=true", "model.loss=chunked"), 65, "sdpa")
    check_memory(chunked, torch.device("cpu"), 2**30)  # one chunk's logits at a time: it fits
    fused = model_config(make_cfg("model.bias=true", "model.loss=fused"), 65, "sdpa")
    check_memory(fused, torch.device("cpu"), 2**30)  # every logit once, in bf16: a quarter of full's, it fits
    with pytest.raises(ConfigError, match=r"the logits of 1,073,741,824 tokens \(4 bytes a value; model.loss=fused"):
        check_memory(fused, torch.device("cpu"), 2**30, torch.float32)
    with pytest.raises(ConfigError, match=rf"the MLP's hidden layer, 128 wide\) {2 * kept:,} GiB more "
                                          r"\(2 bytes a value\)"):
        check_memory(chunked, torch.device("cpu"), 2**31)  # a batch far too large: the activations alone do not fit
    with pytest.raises(ConfigError, match=rf"128 wide\) {2 * kept:,} GiB more \(4 bytes a value\)"):
        check_memory(chunked, torch.device("cpu"), 2**30, torch.float32)  # float32 on the CPU: twice the bytes
    from trainer.config import compose_config
    from trainer.loop import kept_per_token
    llama = model_config(compose_config(["model=llama_small"]), 100288, "sdpa")  # 1024 wide, 2 of 8 heads k/v, SwiGLU
    assert kept_per_token(llama) == 3 * 1024 + 2 * 256 + 2 * 2816
    for shape in (args, model_config(make_cfg("model.n_kv_head=4", "model.n_layer=3"), 1000, "sdpa")):
        matrices = [p for p in GPT(shape).parameters() if p.dim() == 2]  # the tied embedding once
        assert min_params(shape) == sum(p.numel() for p in matrices)  # exact: only biases and layer norms left out


def test_a_run_folder_deleted_while_training_is_a_warning(make_cfg, caplog):
    """`rm -rf` of the run folder mid-run: the next save warns (once) that the folder was deleted, naming it."""
    import shutil

    def on_step(record):
        if record["step"] == 2:
            shutil.rmtree(run_dir)

    cfg = make_cfg("run.name=vanished", "trainer.max_steps=5", "ckpt.interval=3")
    run_dir = Path(cfg.run.root) / "vanished"
    s = train(cfg, on_step=on_step)
    assert s.step == 5 and list_checkpoints(run_dir)  # the run went on; its checkpoints are in a new folder
    warned = [r.getMessage() for r in caplog.records if "was deleted or replaced" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(f"run folder {run_dir} was deleted or replaced"), warned
    caplog.clear()
    train(make_cfg("run.name=vanished", "trainer.max_steps=6", "ckpt.interval=3"))  # nothing deleted: no warning
    assert "was deleted" not in caplog.text


def wandb_history_steps(path: Path) -> list[int]:
    """The steps of the history rows in a W&B .wandb file: a 7-byte header, then LevelDB log records (32 KiB
    blocks; 7-byte headers: CRC-32C, length, type FULL/FIRST/MIDDLE/LAST) holding wandb_internal_pb2.Record's."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, steps, parts = path.read_bytes(), 7, [], b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's trailer
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding up to the block's end
            pos += left
            continue
        parts, pos = (b"" if kind in (1, 2) else parts) + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = pb.Record.FromString(parts)
            if record.WhichOneof("record_type") == "history":
                steps.append(record.history.step.num)
    return steps


def test_wandb_holds_every_step_up_to_the_checkpoint_after_kill_9(tiny_overrides, tmp_path):
    """kill -9 right after a checkpoint, then the same command: W&B's client had written none or few of the killed
    process's rows (it writes its .wandb file every 15 s), so the resumed run logs the rows up to the checkpoint
    again from metrics.jsonl: its offline folder holds every step, once, in order."""
    # Each process its own W&B service, as from a shell (an in-process W&B run of this test process set
    # WANDB_SERVICE, which would make both share this process's service, where the killed run's id stays in use).
    env = {**{k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}, "PYTHONPATH": str(ROOT)}
    args = [a for a in tiny_overrides if not a.startswith(("run.", "trainer.max_steps", "wandb.", "ckpt.", "eval."))]
    args += [f"run.root={tmp_path}", "run.name=wbk", "wandb.mode=offline", "ckpt.interval=5", "eval.interval=5",
             "trainer.max_steps=12"]
    proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    first = tmp_path / "wbk" / "checkpoints" / "step_00000005.pt"
    deadline = time.time() + 120
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    assert first.exists() and not (tmp_path / "wbk" / "checkpoints" / "step_00000010.pt").exists()
    again = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    folders = sorted((tmp_path / "wbk" / "wandb").glob("offline-run-*"))
    assert len(folders) == 2
    assert wandb_history_steps(next(folders[-1].glob("*.wandb"))) == list(range(1, 13))
    assert "logged steps 1-5 again from metrics.jsonl" in again.stdout
    assert [r["step"] for r in read_jsonl(tmp_path / "wbk" / "metrics.jsonl")] == list(range(1, 13))


def test_sample_finds_the_latest_checkpoint_from_a_run_or_its_checkpoints_folder(tmp_path):
    import sample

    ckpts = tmp_path / "runs" / "r" / "checkpoints"
    ckpts.mkdir(parents=True)
    with pytest.raises(CheckpointError, match=f"run folder {tmp_path / 'runs' / 'r'} has no checkpoints"):
        sample.find_checkpoint(str(ckpts))
    for step in (1, 3, 2):
        (ckpts / f"step_{step:08d}.pt").write_bytes(b"")
    latest = ckpts / "step_00000003.pt"
    assert sample.find_checkpoint(str(ckpts)) == sample.find_checkpoint(str(ckpts.parent)) == latest
    assert sample.find_checkpoint("r", str(tmp_path / "runs")) == latest
    assert sample.find_checkpoint(str(ckpts / "step_00000001.pt")) == ckpts / "step_00000001.pt"
    with pytest.raises(CheckpointError, match=rf"is not a checkpoint file, a run folder or a run under {tmp_path}"):
        sample.find_checkpoint("nowhere", str(tmp_path / "runs"))
    with pytest.raises(CheckpointError, match=r"is not a checkpoint file or a run folder$"):  # absolute: no runs/
        sample.find_checkpoint(str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointError, match=r"'/dev/null' is not a checkpoint file or a run folder$"):
        sample.find_checkpoint("/dev/null")
    # A sweep's folder (or a runs root): its runs are named, and the one saved last is suggested.
    with pytest.raises(CheckpointError, match=rf"it holds the runs r: give --run {tmp_path / 'runs' / 'r'} \(saved"):
        sample.find_checkpoint(str(tmp_path / "runs"))
    older = tmp_path / "runs" / "q" / "checkpoints" / "step_00000001.pt"
    older.parent.mkdir(parents=True)
    older.write_bytes(b"")
    os.utime(older, (0, 0))
    with pytest.raises(CheckpointError, match=rf"the runs q, r: give --run {tmp_path / 'runs' / 'r'} \(saved last\)$"):
        sample.find_checkpoint(str(tmp_path / "runs"))
    # A later checkpoint name that is a broken link: refused, as resume=auto refuses it, not passed over.
    gone = ckpts / "step_00000009.pt"
    gone.symlink_to(tmp_path / "gone.pt")
    with pytest.raises(CheckpointError, match=f"^checkpoint {gone} is not a file .*; it was left as is: move it out "
                                              "of the checkpoints folder to use the one before, or give that "
                                              "checkpoint's path as --run$"):
        sample.find_checkpoint(str(ckpts.parent))
    assert sample.find_checkpoint(str(latest)) == latest
    gone.unlink()
    named = tmp_path / "runs" / "checkpoints" / "checkpoints"  # a run named "checkpoints"
    named.mkdir(parents=True)
    (named / "step_00000005.pt").write_bytes(b"")
    assert sample.find_checkpoint("checkpoints", str(tmp_path / "runs")) == named / "step_00000005.pt"


def test_sample_finds_a_run_named_like_a_folder_of_the_working_directory(tmp_path, monkeypatch):
    """A run named like a folder without checkpoints where sample.py runs (the repository's model/, data/, ...)
    is still found under the runs root; with no such run the folder is named."""
    import sample

    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "gpt.py").write_text("")
    with pytest.raises(CheckpointError, match=r"^run folder model has no checkpoints \(checkpoints/step_\*\.pt\)$"):
        sample.find_checkpoint("model", "runs")
    ckpts = tmp_path / "runs" / "model" / "checkpoints"
    ckpts.mkdir(parents=True)
    (ckpts / "step_00000004.pt").write_bytes(b"")
    assert sample.find_checkpoint("model", "runs") == Path("runs") / "model" / "checkpoints" / "step_00000004.pt"


def test_sample_py_prints_a_warning_as_one_line(capsys):
    """sample.py's command line shows a Python warning as its category and message alone, not the source line."""
    import sample

    sample.show_warning(UserWarning("attn=sdpa with a window: slow"), UserWarning, "/x/model/gpt.py", 163)
    assert capsys.readouterr().err == "UserWarning: attn=sdpa with a window: slow\n"


def test_sdpas_dense_mask_is_warned_once_before_training(make_cfg, monkeypatch):
    """attn=sdpa with documents: the dense-mask warning comes once, from the trainer before the first step (the
    model's own is skipped inside a compiled step, where it would break the graph)."""
    from model.backends import sdpa

    monkeypatch.setattr(sdpa, "_WARNED_DENSE_MASK", [])
    with pytest.warns(RuntimeWarning, match=r"dense \(T, T\) mask") as record:
        train(make_cfg("data.document_mask=true", "trainer.max_steps=1", "run.name=dense", "eval.iters=0"))
    assert sum("dense (T, T) mask" in str(w.message) for w in record) == 1
    events = []
    real_warn, real_forward = sdpa.SdpaBackend.warn_masks, GPT.forward
    monkeypatch.setattr(sdpa.SdpaBackend, "warn_masks", lambda self: (events.append("warn"), real_warn(self))[1])
    monkeypatch.setattr(GPT, "forward", lambda self, *a, **k: (events.append("forward"), real_forward(self, *a, **k))[1])
    train(make_cfg("data.document_mask=true", "trainer.max_steps=1", "run.name=dense2", "eval.iters=0"))
    assert events[:2] == ["warn", "forward"] and events.count("warn") == 1
