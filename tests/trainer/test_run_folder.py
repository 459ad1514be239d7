"""Run folders: default names that do not collide, one live owner per folder, bad run.name / run.root.

Every test here starts real `python train.py` processes (the lock is per process)."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.checkpoint import list_checkpoints
from trainer.run_lock import RunFolderBusy, busy_owner, own_run_folder

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
DEFAULT_NAME = r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_[0-9a-f]{6}"


@pytest.fixture
def args(tiny_overrides, tmp_path):
    """tiny_overrides without run.*, for the CLI; run.root is tmp_path/runs."""
    return [a for a in tiny_overrides if not a.startswith("run.")] + [f"run.root={tmp_path / 'runs'}"]


def start(args, *extra, script="train.py"):
    return subprocess.Popen([sys.executable, script, *args, *extra], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def cli(args, *extra):
    return subprocess.run([sys.executable, "train.py", *args, *extra], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=300)


def wait_for(path: Path, proc, timeout=120):
    deadline = time.time() + timeout
    while not (path.exists() and path.stat().st_size > 0):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.2)


def test_runs_started_in_the_same_second_get_different_default_names(args, tmp_path):
    """Two default-named runs launched together write two folders, each with its own steps once."""
    procs = [start(args, "trainer.max_steps=2", f"optim.lr={lr}") for lr in (1e-3, 2e-3)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    folders = sorted((tmp_path / "runs").iterdir())
    assert len(folders) == 2 and all(re.fullmatch(DEFAULT_NAME, f.name) for f in folders), folders
    lrs = set()
    for f in folders:
        assert [json.loads(line)["step"] for line in (f / "metrics.jsonl").read_text().splitlines()] == [1, 2]
        lrs.add(re.search(r"lr: (\S+)", (f / ".hydra" / "config.yaml").read_text()).group(1))
    assert lrs == {"0.001", "0.002"}


def test_a_second_process_on_a_live_run_folder_is_refused(args, tmp_path):
    """While one run trains, a second one with the same run.name stops at once, naming the owner,
    and touches nothing of the first run; the first finishes normally."""
    first = start(args, "run.name=shared", "trainer.max_steps=100000", "ckpt.interval=0", "optim.lr=0.001")
    run_dir = tmp_path / "runs" / "shared"
    try:
        wait_for(run_dir / "metrics.jsonl", first)
        hydra_config = (run_dir / ".hydra" / "config.yaml").read_text()
        log_before = (run_dir / "train.log").read_text()
        second = cli(args, "run.name=shared", "trainer.max_steps=3", "optim.lr=0.002")
        out = second.stdout + second.stderr
        assert second.returncode == 1, out[-3000:]
        assert f"run folder {run_dir} is in use by PID {first.pid}" in out and "Traceback" not in out, out[-3000:]
        assert (run_dir / ".hydra" / "config.yaml").read_text() == hydra_config  # not rewritten
        assert (run_dir / "train.log").read_text().startswith(log_before) and "in use by" not in (
            run_dir / "train.log").read_text()
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        out = first.communicate(timeout=120)[0]
    assert first.returncode == 128 + signal.SIGTERM, out[-3000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1))  # each step once: only the first run wrote
    assert len(list_checkpoints(run_dir)) == 1
    assert (run_dir / ".lock").read_text() == ""  # released


def test_a_lock_left_by_a_killed_process_is_taken_over(args, tmp_path):
    """A run killed with SIGKILL leaves its lock file; the next run on that folder takes it over, with a warning."""
    run_dir = tmp_path / "runs" / "killed"
    holder = start(args, "run.name=killed", "trainer.max_steps=100000", "ckpt.interval=0")
    wait_for(run_dir / "metrics.jsonl", holder)
    holder.kill()
    holder.communicate(timeout=60)
    assert (run_dir / ".lock").read_text().split()[0] == str(holder.pid)
    again = cli(args, "run.name=killed", "trainer.max_steps=2", "resume=auto")
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    assert f"owned by PID {holder.pid}, which is no longer running; taking it over" in out
    assert (run_dir / ".lock").read_text() == ""


def test_single_process_multirun_jobs_each_own_their_folder(args, tmp_path):
    out = cli(["-m", *args, "run.name=sweep", "trainer.max_steps=1,2"])
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    for job in ("0", "1"):
        assert (tmp_path / "runs" / "sweep" / job / ".hydra" / "config.yaml").exists()
        assert (tmp_path / "runs" / "sweep" / job / ".lock").read_text() == ""
    # `run.name=sweep` alone would start a single run in the sweep's parent folder: the hint is the sweep's command.
    text = (tmp_path / "runs" / "sweep" / "1" / "train.log").read_text()
    hint = re.search(r"to continue these runs: (.*) trainer\.max_steps=<more than 2>", text).group(1)
    kept = [a for a in args if not a.startswith("trainer.max_steps=")]  # the hint's trainer.max_steps comes after it
    assert shlex.split(hint) == ["python", "train.py", "-m", *kept, "run.name=sweep"]


def test_a_sweep_under_the_default_run_name_is_continued_by_that_name(args, tmp_path):
    """A sweep without run.name runs under a launch-time name, new at every start: the hint adds it, and running
    the hint continues the same jobs."""
    out = cli(["-m", *args, "trainer.max_steps=1", "optim.lr=1e-3,2e-3"])
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    (sweep_dir,) = (tmp_path / "runs").iterdir()
    text = (sweep_dir / "1" / "train.log").read_text()
    hint = re.search(r"to continue these runs: (.*) trainer\.max_steps=<more than 1>", text).group(1)
    words = shlex.split(hint)
    assert words[:3] == ["python", "train.py", "-m"] and f"run.name={sweep_dir.name}" in words
    again = cli([*words[2:], "trainer.max_steps=2"])
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert list((tmp_path / "runs").iterdir()) == [sweep_dir]
    assert [p.name for p in list_checkpoints(sweep_dir / "1")][-1] == "step_00000002.pt"


def test_a_swept_run_name_numbers_the_jobs_in_each_folder(args, tmp_path):
    """`-m run.name=a,b trainer.max_steps=1,2`: each name's folder holds its own jobs, numbered from 0; without
    run.name the sweep's jobs share one default-named folder."""
    out = cli(["-m", *args, "run.name=a,b", "trainer.max_steps=1,2"])
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    for name in ("a", "b"):
        assert sorted(p.name for p in (tmp_path / "runs" / name).iterdir() if p.is_dir()) == ["0", "1"]
        jobs = [(tmp_path / "runs" / name / job / ".hydra" / "overrides.yaml").read_text() for job in ("0", "1")]
        assert f"run.name={name}" in jobs[0] and "trainer.max_steps=1" in jobs[0] and "trainer.max_steps=2" in jobs[1]
    out = cli(["-m", *[a for a in args if not a.startswith("run.root")], f"run.root={tmp_path / 'default'}",
               "trainer.max_steps=1,2"])
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    [folder] = (tmp_path / "default").iterdir()
    assert re.fullmatch(DEFAULT_NAME, folder.name) and sorted(p.name for p in folder.iterdir() if p.is_dir()) == [
        "0", "1"]


def test_every_line_of_a_refusal_is_a_log_record(args, tmp_path):
    """Two bad values in one run: the refusal names both, each on its own prefixed log line (a log filter or grep
    for [ERROR] sees every bad key), no traceback, no run folder."""
    out = cli(args, "run.name=bad", "trainer.batch_size=-1", "optim.lr=-1")
    text = out.stdout + out.stderr
    assert out.returncode == 1 and "Traceback" not in text, text[-3000:]
    errors = [line for line in text.splitlines() if "[ERROR]" in line]
    assert len(errors) == 3 and errors[0].endswith("- invalid config:"), text[-3000:]
    assert "trainer.batch_size=-1" in errors[1] + errors[2] and "optim.lr=-1" in errors[1] + errors[2]
    assert not [line for line in text.splitlines() if line.startswith("  ")]  # no unprefixed continuation lines
    assert not (tmp_path / "runs" / "bad").exists()


def test_a_sweep_checks_every_jobs_values_before_the_first_job(args, tmp_path):
    out = cli(args, "-m", "run.name=sweep", "trainer.max_steps=1", "trainer.batch_size=4,-1")
    text = out.stdout + out.stderr
    assert out.returncode == 1 and "Traceback" not in text, text[-3000:]
    assert text.startswith("error: job 2 of 2 (") and "trainer.batch_size=-1: must be a positive integer" in text
    assert not (tmp_path / "runs").exists()  # job 1 did not train


def test_a_refused_job_takes_away_the_folders_it_made(args, tmp_path):
    """A sweep whose first job train() refuses leaves no sweep folder; a refused run under a new, nested run.root
    leaves no run.root. A folder that was there before stays."""
    refused = ["attn=flex", "model.dropout=0.1"]  # flex has no attention dropout: refused in train()
    out = cli(args, "-m", "run.name=sweep", "trainer.max_steps=1,2", *refused)
    assert out.returncode == 1 and "attn=flex has no attention dropout" in out.stdout + out.stderr
    assert not (tmp_path / "runs").exists()
    nested = tmp_path / "new" / "root"
    out = cli(args, f"run.root={nested}", "run.name=x", *refused)
    assert out.returncode == 1 and not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()
    out = cli(args, f"run.root={tmp_path / 'kept'}", "run.name=x", *refused)
    assert out.returncode == 1 and list((tmp_path / "kept").iterdir()) == []


def test_an_unexpected_error_before_training_keeps_its_traceback_and_leaves_no_folder(args, tmp_path):
    """An error no check foresaw (here one raised where the token cache is prepared) shows its traceback; the run
    folder and the new run.root it made, holding only the lock, go."""
    inject = ("import runpy, sys; sys.path.insert(0, '.'); import trainer.loop as loop\n"
              "def boom(cfg): raise RuntimeError('unforeseen')\n"
              "loop.prepare_data = boom; sys.argv[0] = 'train.py'; runpy.run_path('train.py', run_name='__main__')")
    root = tmp_path / "new" / "root"
    out = subprocess.run([sys.executable, "-c", inject, *args, f"run.root={root}", "run.name=bug"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 1 and "Traceback" in text and "RuntimeError: unforeseen" in text, text[-3000:]
    assert not (tmp_path / "new").exists()


def test_a_run_refused_after_its_record_was_written_leaves_no_folder(args, tmp_path):
    """W&B failing to start (online, no login) refuses the run after train() accepted it and its record
    (.hydra/, train.log) was written, before the first step: the folder it made goes, one error line stays. A
    folder that was there before keeps what it held."""
    env = {**ENV, "WANDB_CONFIG_DIR": str(tmp_path / "no-login"), "NETRC": str(tmp_path / "no-netrc")}
    env.pop("WANDB_API_KEY", None)
    for name, before in (("new", None), ("old", "notes.txt")):
        if before:
            (tmp_path / "runs" / name).mkdir(parents=True)
            (tmp_path / "runs" / name / before).write_text("kept")
        out = subprocess.run([sys.executable, "train.py", *args, f"run.name={name}", "wandb.mode=online",
                              "trainer.max_steps=1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        text = out.stdout + out.stderr
        assert out.returncode == 1 and "W&B could not start" in text and "Traceback" not in text, text[-3000:]
        folder = tmp_path / "runs" / name
        assert not folder.exists() if before is None else (folder / before).read_text() == "kept"


@pytest.mark.parametrize("override, message", [
    ("run.name=" + "x" * 300, "run.name='xxx.*': must be a non-empty folder name of at most 128 characters"),
    ("run.name=${oc.env:HOME}", "run.name='/.*': must be a non-empty folder name"),  # an interpolation's path
    ("run.name=a/b", "run.name='a/b': must be a non-empty folder name"),
])
def test_bad_run_name_is_one_line(args, tmp_path, override, message):
    out = cli(args, override)
    text = out.stdout + out.stderr
    assert out.returncode == 1 and re.search(message, text) and "Traceback" not in text, text[-3000:]
    assert len(text.strip().splitlines()) == 1, text
    assert not (tmp_path / "runs").exists()


def test_unusable_run_root_is_one_line(args, tmp_path):
    """A run.root that cannot hold run folders (here a file where the folder should be; tests run as root,
    so permission bits would not stop them)."""
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    out = cli(args, f"run.root={blocker}", "run.name=x")
    text = out.stdout + out.stderr
    assert out.returncode == 1 and f"run.root='{blocker}': cannot create or write the run folder" in text, text
    assert "Traceback" not in text and len(text.strip().splitlines()) == 1, text


def test_a_file_where_the_run_folder_goes_names_run_name(args, tmp_path):
    """run.root is usable and a file has the run's name: the message names run.name, which the user can change."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "taken").write_text("x")
    out = cli(args, "run.name=taken")
    text = out.stdout + out.stderr
    assert out.returncode == 1 and "Traceback" not in text and len(text.strip().splitlines()) == 1, text
    assert f"run.name='taken': {tmp_path / 'runs' / 'taken'} is a file, not a run folder" in text, text
    assert (tmp_path / "runs" / "taken").read_text() == "x"
    (tmp_path / "runs" / "gone").symlink_to(tmp_path / "nowhere")
    out = cli(args, "run.name=gone")
    text = out.stdout + out.stderr
    assert out.returncode == 1 and "Traceback" not in text and len(text.strip().splitlines()) == 1, text
    assert f"run.name='gone': {tmp_path / 'runs' / 'gone'} is a link to nothing, not a run folder" in text, text


def test_a_checkpoints_path_that_cannot_take_checkpoints_is_refused_before_training(args, tmp_path):
    """A file where the run's checkpoints folder goes is refused at the start, not after the training (whose
    first save would fail)."""
    run_dir = tmp_path / "runs" / "ck"
    run_dir.mkdir(parents=True)
    (run_dir / "checkpoints").write_text("x")
    out = cli(args, "run.name=ck", "trainer.max_steps=2")
    text = out.stdout + out.stderr
    assert out.returncode == 1 and "Traceback" not in text, text[-3000:]
    assert f"{run_dir / 'checkpoints'}: the run's checkpoints are written there, but it is not a writable " \
           "folder" in text, text[-3000:]
    assert "step 1" not in text and "final val loss" not in text, text[-3000:]
    assert (run_dir / "checkpoints").read_text() == "x"


def test_lock_in_process(tmp_path, monkeypatch, caplog):
    """The lock is per open file: a second acquisition is refused even in the same process, naming its PID;
    on a file system without locks the run goes on with a warning."""
    with own_run_folder(tmp_path / "r"):
        with pytest.raises(RunFolderBusy, match=f"run folder {tmp_path / 'r'} is in use by PID {os.getpid()}"):
            with own_run_folder(tmp_path / "r"):
                pass
    with own_run_folder(tmp_path / "r"):  # released
        pass

    import fcntl

    def no_locks(fd, op):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with own_run_folder(tmp_path / "r"):
        pass
    assert "cannot lock run folder" in caplog.text and "No locks available" in caplog.text


def test_busy_owner_names_a_live_owner_only(tmp_path):
    """`busy_owner`: None for a folder without a lock file (and none is made) or with a free one; the owner while a
    process holds it."""
    folder = tmp_path / "r"
    assert busy_owner(folder) is None and not folder.exists()
    with own_run_folder(folder):
        assert busy_owner(folder) == f"PID {os.getpid()}"
    assert busy_owner(folder) is None
    with own_run_folder(folder):  # the instant busy_owner held it did not keep it
        pass


def test_a_sweep_is_refused_in_a_folder_a_single_run_is_using(args, tmp_path):
    """A sweep under the run.name of a single run still training (its lock held, here before any checkpoint) is
    refused before any job, naming the owner, and writes nothing there."""
    folder = tmp_path / "runs" / "busy"
    with own_run_folder(folder):
        out = cli(["-m", *args, "run.name=busy", "optim.lr=1e-3,2e-3", "trainer.max_steps=1"])
    text = out.stdout + out.stderr
    assert out.returncode == 1 and text.startswith(
        f"error: run.name=busy: {folder} is in use by a single run (PID {os.getpid()}); a sweep would put its jobs "
        "beside it"), text
    assert sorted(p.name for p in folder.iterdir()) == [".lock"]


def test_hydra_options_are_refused_naming_run_root_and_run_name(args, tmp_path):
    """train.py has no Hydra runtime: hydra.run.dir (which would put the run where run.root/run.name and the
    printed continue command do not point) and Hydra's flags are refused, in one line, before any folder."""
    for extra in (f"hydra.run.dir={tmp_path / 'hd'}", "--cfg"):
        out = cli(args, extra, "trainer.max_steps=1")
        text = out.stdout + out.stderr
        assert out.returncode == 1 and len(text.strip().splitlines()) == 1, text[-3000:]
        assert text.startswith(f"error: {extra}: train.py takes -m (--multirun), -h (--help) and config overrides; "
                               "the run folder is <run.root>/<run.name>"), text
    assert not (tmp_path / "hd").exists() and not (tmp_path / "runs").exists()


def test_a_refused_sweep_leaves_the_sweep_record_alone(args, tmp_path):
    """While a sweep's job 0 trains, the same sweep run again (to train longer) is refused (the folder is in use)
    and leaves the running sweep's multirun.yaml (and its job's .hydra/) as they were."""
    sweep = ["-m", *args, "run.name=cmp", "attn=sdpa,flex", "ckpt.interval=0"]
    first = start(sweep, "trainer.max_steps=100000")
    job = tmp_path / "runs" / "cmp" / "0"
    try:
        wait_for(job / "metrics.jsonl", first)
        record = {p: p.read_bytes() for p in (tmp_path / "runs" / "cmp").rglob("*.yaml")}
        assert job.parent / "multirun.yaml" in record and job / ".hydra" / "config.yaml" in record
        second = cli(sweep, "trainer.max_steps=3")
        out = second.stdout + second.stderr
        assert second.returncode == 1 and f"run folder {job} is in use by PID {first.pid}" in out, out[-3000:]
        assert {p: p.read_bytes() for p in (tmp_path / "runs" / "cmp").rglob("*.yaml")} == record
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)


def test_another_sweep_in_a_sweeps_folder_is_refused(args, tmp_path):
    """A sweep resumes its job folders by number: another sweep under the same run.name (other values, or the same
    values in another order) is refused before any job, naming the folder's sweep, and changes nothing there;
    the same sweep again with a larger trainer.max_steps continues its jobs; a damaged record is named."""
    folder = tmp_path / "runs" / "cmp"
    first = ["-m", *args, "run.name=cmp", "optim.lr=1e-3,2e-3", "ckpt.interval=1"]
    assert cli(first, "trainer.max_steps=1").returncode == 0
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file() and p.name != "train.log"}
    for other in (["optim.lr=3e-3"], ["optim.lr=2e-3,1e-3"], ["model.n_layer=1"]):
        out = cli(["-m", *args, "run.name=cmp", "ckpt.interval=1", "trainer.max_steps=2",
                   *(other if other[0].startswith("optim") else ["optim.lr=1e-3,2e-3", *other])])
        text = out.stdout + out.stderr
        assert out.returncode == 1 and text.startswith(f"error: run.name=cmp: {folder} holds another sweep ("), text
        assert "optim.lr=1e-3,2e-3" in text and "Traceback" not in text
        assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file() and p.name != "train.log"} == before
    again = cli(first, "trainer.max_steps=2")
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert list_checkpoints(folder / "1")[-1].name == "step_00000002.pt"
    (folder / "multirun.yaml").write_text("a: [1\n")
    out = cli(first, "trainer.max_steps=3")
    assert out.returncode == 1 and "multirun.yaml does not read as a sweep's command line" in out.stderr, out.stderr


def test_a_single_run_and_a_sweep_do_not_share_a_folder(args, tmp_path):
    """A single run under a sweep's run.name, or a sweep under a single run's, is refused before any job, naming the
    folder, and changes nothing there."""
    runs = tmp_path / "runs"
    assert cli(["-m", *args, "run.name=sw", "optim.lr=1e-3,2e-3", "trainer.max_steps=1"]).returncode == 0
    assert cli([*args, "run.name=one", "trainer.max_steps=1"]).returncode == 0
    for extra, folder, message in (
            (["run.name=sw"], runs / "sw", "holds a sweep (multirun.yaml); run that sweep again with -m"),
            (["-m", "run.name=one", "optim.lr=1e-3,2e-3"], runs / "one", "holds a single run (checkpoints/)")):
        before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        out = cli([*args, "trainer.max_steps=2", *extra])
        text = out.stdout + out.stderr
        assert out.returncode == 1 and text.startswith(f"error: run.name={folder.name}: {folder} {message}"), text
        assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


def test_a_run_folder_that_takes_no_file_is_one_line(args, tmp_path):
    """An existing run folder this process cannot write (read-only, or here: the write probe's name taken, as
    permission bits do not stop root) is refused at the start in one line, before training. A process of its own,
    whose pid names the probe: train.py's logging set-up stays out of the test process."""
    run_dir = tmp_path / "runs" / "ro"
    code = ("import sys; from pathlib import Path; import train; from utils.atomic import temp_path; "
            "temp_path(Path(sys.argv[1]) / '.write-check').mkdir(parents=True); sys.exit(train.main(sys.argv[2:]))")
    out = subprocess.run([sys.executable, "-c", code, str(run_dir), *args, "run.name=ro"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 1 and f"cannot create or write the run folder {run_dir}" in text, text[-3000:]
    assert "Traceback" not in text and len(text.strip().splitlines()) == 1, text
    assert not (run_dir / "checkpoints").exists()
