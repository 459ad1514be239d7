"""Multi-process training: `torchrun --standalone --nproc_per_node=2` with the gloo backend on a tiny model.

Each torchrun job is a subprocess (tests/trainer/torchrun_entry.py = train.py plus test-only fault injection);
the single-process references run in-process. Global batch everywhere: batch_size 4 x grad_accum 4,
so each of the 2 ranks runs 2 micro-batches per step (no_sync on the first).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data.sampler import ShardedBatchSampler
from trainer import ConfigError, compose_config, train
from trainer.checkpoint import list_checkpoints, load_checkpoint
from trainer.config import validate_config
from trainer.distributed import torchrun_overrides
from trainer.runtime import DistInfo

ROOT = Path(__file__).resolve().parents[2]
STEPS = 10


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def base(corpus_dir, cache_dir):
    """Tiny-run overrides shared by the torchrun jobs and their single-process references."""
    return [
        "model=tiny", "model.n_layer=2", "model.n_head=4", "model.n_kv_head=2", "model.n_embd=32",
        "model.block_size=32", "data=local_text", f"data.files={corpus_dir}/*.txt", f"data.cache_dir={cache_dir}",
        "attn=sdpa", "trainer.device=cpu", "trainer.batch_size=4", "trainer.grad_accum=4",
        f"trainer.max_steps={STEPS}", "optim.warmup_steps=2", "optim.decay_steps=20", "eval.interval=5",
        "eval.iters=3", "ckpt.interval=5", "ckpt.keep_last=2", "wandb.mode=offline",
    ]


def torchrun(args, timeout=120, **env):
    """Run a 2-process torchrun job; returns the CompletedProcess (stdout and stderr merged)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "trainer" / "torchrun_entry.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def single(base, tmp_path_factory):
    """Single-process reference run (in-process), same global batch."""
    root = tmp_path_factory.mktemp("single")
    return train(compose_config(base + [f"run.root={root}", "run.name=single", "wandb.mode=disabled"]))


@pytest.fixture(scope="module")
def ddp(base, tmp_path_factory):
    """2-rank job with the default (timestamp) run.name; rank 1 starts 1.5 s late, so the ranks' own
    clocks would name different folders."""
    root = tmp_path_factory.mktemp("ddp")
    out = torchrun(base + [f"run.root={root / 'runs'}"], TEST_DELAY_RANK="1")
    assert out.returncode == 0, out.stdout[-5000:]
    return root, out.stdout


def test_torchrun_matches_single_process(single, ddp):
    root, _ = ddp
    (run_dir,) = (root / "runs").iterdir()
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for a, b in zip(single.records, records):
        assert b["train/loss"] == pytest.approx(a["train/loss"], abs=1e-5, rel=0)
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-4)
        assert b["train/lr"] == a["train/lr"] and b["tokens_seen"] == a["tokens_seen"] == b["step"] * 4 * 4 * 32
        assert (a.get("val/loss") is None) == (b.get("val/loss") is None)
        if a.get("val/loss") is not None:
            assert b["val/loss"] == pytest.approx(a["val/loss"], abs=1e-5, rel=0)
        # Job and per-GPU throughput (CPU: no MFU).
        assert b["perf/tokens_per_s_per_gpu"] == pytest.approx(b["perf/tokens_per_s"] / 2)
        assert b["perf/tokens_per_s"] == pytest.approx(4 * 4 * 32 / (b["perf/step_time_ms"] / 1e3))
        assert b["perf/mfu"] is None and b["perf/mfu_per_gpu"] is None
    assert [r["step"] for r in records if "val/loss" in r] == [5, 10]


def test_torchrun_writes_one_run_folder_checkpoint_set_and_wandb_run(ddp):
    root, stdout = ddp
    folders = list((root / "runs").iterdir())
    assert len(folders) == 1 and re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_[0-9a-f]{6}", folders[0].name), folders
    run_dir = folders[0]
    assert (run_dir / ".lock").read_text() == ""  # rank 0 owned the folder (the ranks did not refuse each other)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000005.pt", "step_00000010.pt"]
    assert [p.parent for p in root.rglob(".hydra")] == [run_dir]
    log = (run_dir / "train.log").read_text()
    assert "DDP: 2 processes (gloo), 2 micro-batch(es) of 4 sequences per process per step" in log
    assert log.count("saved checkpoint") == 2 and "[rank 1]" not in log  # rank 0's log only
    assert (f"to continue this run: torchrun --standalone --nproc_per_node=2 train.py run.name={run_dir.name} "
            f"run.root={root / 'runs'} ") in log
    assert log.count("run.name=") == 1 and "trainer.max_steps=<more than 10>" in log  # rank 0's shared name once
    wandb_runs = list(root.rglob("offline-run-*"))
    ckpt = load_checkpoint(run_dir / "checkpoints" / "step_00000010.pt")
    assert len(wandb_runs) == 1 and wandb_runs[0].name.endswith(ckpt["wandb_run_id"])
    assert ckpt["world_size"] == 2 and ckpt["step"] == 10 and ckpt["config"]["run"]["name"] == run_dir.name
    # Every rank's RNG state (each rank has its own stream) and every micro-batch stream.
    assert len(ckpt["rng"]) == 2 and not torch.equal(ckpt["rng"][0]["torch_cpu"], ckpt["rng"][1]["torch_cpu"])
    shards = ckpt["sampler"]["shards"]
    assert ckpt["sampler"]["num_shards"] == 4 and [s["rank"] for s in shards] == [0, 1, 2, 3]
    assert all(s["batches_drawn"] == STEPS for s in shards)
    assert "Traceback" not in stdout


def test_torchrun_stop_and_resume_is_bit_identical(base, tmp_path):
    """With dropout on (per-rank RNG streams matter): 10 straight steps == 6 steps, stop, resume to 10."""
    common = base + [f"run.root={tmp_path}", "model.dropout=0.1"]
    straight = torchrun(common + ["run.name=straight"])
    first = torchrun(common + ["run.name=resumed", "trainer.max_steps=6"])
    second = torchrun(common + ["run.name=resumed"])
    for out in (straight, first, second):
        assert out.returncode == 0, out.stdout[-5000:]
    assert "resumed from" in second.stdout and "step_00000006.pt at step 6" in second.stdout
    keys = ("step", "train/loss", "train/grad_norm", "train/lr", "val/loss", "tokens_seen")
    a, b = (read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("straight", "resumed"))
    assert b[5].pop("val/loss") is not None  # the first job's final evaluation, at step 6
    assert [[r.get(k) for k in keys] for r in b] == [[r.get(k) for k in keys] for r in a]  # bit-identical
    assert len(b) == STEPS
    wa = load_checkpoint(tmp_path / "straight" / "checkpoints" / "step_00000010.pt")
    wb = load_checkpoint(tmp_path / "resumed" / "checkpoints" / "step_00000010.pt")
    assert all(torch.equal(wa["model"][k], wb["model"][k]) for k in wa["model"])
    assert {p.name.rsplit("-", 1)[1] for p in (tmp_path / "resumed" / "wandb").glob("offline-run-*")} == \
        {wb["wandb_run_id"]}  # one W&B run, continued


def test_resume_with_a_different_world_size(base, single, ddp, tmp_path):
    """2 ranks -> 1 process and 1 process -> 2 ranks continue the same data stream (no dropout: same losses)."""
    root, _ = ddp
    (run_dir,) = (root / "runs").iterdir()
    one = train(compose_config(base + [f"run.root={tmp_path}", "run.name=from2", "wandb.mode=disabled",
                                       f"resume={run_dir / 'checkpoints' / 'step_00000005.pt'}"]))
    two = torchrun(base + [f"run.root={tmp_path}", "run.name=from1", "wandb.mode=disabled",
                           f"resume={single.run_dir / 'checkpoints' / 'step_00000005.pt'}"])
    assert two.returncode == 0, two.stdout[-5000:]
    assert "checkpoint of a 1-process job, resumed with 2 processes" in two.stdout
    for records in (one.records, read_jsonl(tmp_path / "from1" / "metrics.jsonl")):
        resumed = [r for r in records if r["step"] > 5]
        assert [r["step"] for r in resumed] == list(range(6, STEPS + 1))
        for a, b in zip(single.records[5:], resumed):
            assert b["train/loss"] == pytest.approx(a["train/loss"], abs=1e-5, rel=0)


def test_error_on_one_rank_ends_the_job_with_its_message(base, tmp_path):
    out = torchrun(base + [f"run.root={tmp_path}", "run.name=crash"], timeout=120,
                   TEST_FAIL_RANK="1", TEST_FAIL_FORWARD="5", TEST_FAIL_KIND="raise")  # step 3
    assert out.returncode != 0
    assert "Root Cause" in out.stdout and "RuntimeError: injected failure on rank 1 in training forward 5" in out.stdout
    assert list_checkpoints(tmp_path / "crash") == []


def test_torchrun_job_on_a_folder_another_process_owns_is_refused(base, tmp_path):
    """Under torchrun, rank 0 takes the run folder's lock for the job, so a folder owned by another
    process (here this test) stops the job with the owner's PID, and nothing is written there."""
    from trainer.run_lock import own_run_folder

    with own_run_folder(tmp_path / "owned"):
        out = torchrun(base + [f"run.root={tmp_path}", "run.name=owned"], timeout=120)
    assert out.returncode != 0
    assert f"run folder {tmp_path / 'owned'} is in use by PID {os.getpid()}" in out.stdout, out.stdout[-3000:]
    assert [p.name for p in (tmp_path / "owned").iterdir()] == [".lock"]  # nothing written there


def test_nan_on_one_rank_stops_every_rank_at_that_step(base, tmp_path):
    out = torchrun(base + [f"run.root={tmp_path}", "run.name=nan"], timeout=120,
                   TEST_FAIL_RANK="1", TEST_FAIL_FORWARD="13", TEST_FAIL_KIND="nan")  # step 7, 2 forwards a step
    assert out.returncode == 1
    msg = "training loss is nan at step 7; stopped without saving this step"
    assert out.stdout.count(f"[rank 1] ERROR [train] {msg}") == 1  # the injected rank, once
    assert len(re.findall(rf"\]\[train\]\[ERROR\] - {msg}", out.stdout)) == 1  # rank 0 (Hydra log format), once
    assert out.stdout.count(msg) == 2
    assert [p.name for p in list_checkpoints(tmp_path / "nan")] == ["step_00000005.pt"]
    assert [r["step"] for r in read_jsonl(tmp_path / "nan" / "metrics.jsonl")] == list(range(1, 7))


def test_grad_accum_must_be_a_multiple_of_the_world_size(base):
    cfg = compose_config(base + ["trainer.grad_accum=6"])
    validate_config(cfg, world_size=2)
    validate_config(cfg, world_size=3)
    with pytest.raises(ConfigError, match=r"trainer.grad_accum=6: must be a multiple of the number of processes \(4"):
        validate_config(cfg, world_size=4)


def test_torchrun_overrides():
    args = ["model=tiny", "run.name=x"]
    assert torchrun_overrides(args, DistInfo()) == args  # one process: unchanged
    assert torchrun_overrides(args, DistInfo(rank=0, local_rank=0, world_size=2)) == args
    assert torchrun_overrides(args, DistInfo(rank=3, local_rank=1, world_size=4)) == args


def test_sharded_sampler_state_moves_between_world_sizes():
    """The merged state of 2 ranks, loaded by 1 or 4 ranks, continues the same batches."""
    import numpy as np

    tokens = np.random.default_rng().integers(0, 500, 5000).astype(np.uint16)
    seed = int(np.random.default_rng().integers(2**32))

    def ranks(world_size):
        return [ShardedBatchSampler(tokens, 16, 3, seed, 4, r, world_size) for r in range(world_size)]

    def step(samplers):  # the job's micro-batches of one step, in shard order
        return [x for s in samplers for x, _ in s.next_batches()]

    one, two = ranks(1), ranks(2)
    for _ in range(3):  # 1 process and 2 ranks draw the same micro-batches, a different one per slot
        a, b = step(one), step(two)
        assert all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) == len(b) == 4
        assert not any(torch.equal(a[i], a[j]) for i in range(4) for j in range(i))
    state = ShardedBatchSampler.merge_states([s.state_dict() for s in two])
    expected = step(two)
    for world_size in (1, 4):
        other = ranks(world_size)
        assert all(s.load_state_dict(state) == [] for s in other)
        got = step(other)
        assert all(torch.equal(a, b) for a, b in zip(expected, got)) and len(got) == 4
    grown = ShardedBatchSampler(tokens, 16, 3, seed, 6)
    assert grown.load_state_dict(state) == [4, 5]  # new micro-batch slots start new streams
    with pytest.raises(ValueError, match="num_shards=4 must be a positive multiple of world_size=3"):
        ShardedBatchSampler(tokens, 16, 3, seed, 4, 0, 3)


@pytest.mark.parametrize("saved,now,world_size,message", [
    (1, 4, 1, "trainer.grad_accum changed on resume (1 -> 4 micro-batches a step, so the global batch changes with "
              "it): the streams of micro-batches 1-3 start; give trainer.grad_accum=1 to continue exactly"),
    (2, 1, 1, "trainer.grad_accum changed on resume (2 -> 1 micro-batches a step, so the global batch changes with "
              "it): micro-batch 1's stream stops; give trainer.grad_accum=2 to continue exactly"),
    (1, 2, 2, "trainer.grad_accum changed on resume (1 -> 2 micro-batches a step, so the global batch changes with "
              "it): micro-batch 1's stream starts"),
])
def test_resume_warns_once_when_the_micro_batch_count_changes(caplog, saved, now, world_size, message):
    """A 2-process checkpoint resumed by 1 process under grad_accum=auto (and the other way round): the main process
    names the change of the global batch, and no longer says the data continues exactly; other ranks say nothing."""
    import logging

    import numpy as np

    from model.gpt import GPT, GPTConfig
    from trainer.runtime import DistInfo
    from trainer.state import TrainState

    tokens = np.random.default_rng().integers(0, 60, 2000).astype(np.uint16)
    model = GPT(GPTConfig(block_size=8, vocab_size=64, n_layer=1, n_head=2, n_embd=16))
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    old = TrainState(model, optimizer, scaler, ShardedBatchSampler(tokens, 8, 2, 0, saved))
    state = {**old.state_dict(), "world_size": 3 - world_size}
    for rank in range(world_size):
        dist = DistInfo(rank=rank, local_rank=rank, world_size=world_size)
        new = TrainState(model, optimizer, scaler, ShardedBatchSampler(tokens, 8, 2, 0, now, rank, world_size), dist)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="trainer.state"):
            new.load_state_dict(state)
        if rank == 0:
            assert [r.getMessage() for r in caplog.records] == [
                message, f"checkpoint of a {3 - world_size}-process job, resumed with {world_size} processes: "
                         "per-process random streams (dropout) do not continue"]
        else:
            assert caplog.records == []


def test_hydra_multirun_under_torchrun(base, tmp_path):
    """Several jobs in one torchrun job: the process group is reused, not re-created."""
    out = torchrun(["-m", *base, f"run.root={tmp_path}", "run.name=sweep", "trainer.max_steps=2,3",
                    "wandb.mode=disabled"], timeout=120)
    assert out.returncode == 0, out.stdout[-5000:]
    for job, steps in (("0", 2), ("1", 3)):
        assert [r["step"] for r in read_jsonl(tmp_path / "sweep" / job / "metrics.jsonl")] == list(range(1, steps + 1))
    assert sorted(p.parent.name for p in (tmp_path / "sweep").rglob(".hydra")) == ["0", "1"]


def test_torchrun_needs_no_grad_accum_flag(base, tmp_path):
    """`torchrun --nproc_per_node=2 train.py trainer.device=cpu` with the default trainer.grad_accum=auto:
    one micro-batch per process, so the global batch is 2 x batch_size."""
    args = [a for a in base if not a.startswith(("trainer.grad_accum", "trainer.max_steps"))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "train.py"),
           *args, f"run.root={tmp_path}", "run.name=auto", "trainer.max_steps=2", "wandb.mode=disabled"]
    out = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-5000:]
    records = read_jsonl(tmp_path / "auto" / "metrics.jsonl")
    assert [r["tokens_seen"] for r in records] == [2 * 4 * 32, 2 * 2 * 4 * 32]
    assert "DDP: 2 processes (gloo), 1 micro-batch(es) of 4 sequences per process per step" in \
        (tmp_path / "auto" / "train.log").read_text()
