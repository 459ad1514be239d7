"""Train a GPT: ``python train.py [-m] [group=option ...] [key=value ...]``.

    python train.py                                   # tiny char-level GPT on Shakespeare (CPU ok)
    python train.py attn=fa2 model=gpt2 data=shakespeare_bpe trainer.compile=true
    python train.py run.name=exp1 trainer.max_steps=5000   # resumes runs/exp1 if it has checkpoints
    python train.py -m attn=sdpa,fa2 run.name=cmp     # a sweep: one job per value, runs/cmp/0 and runs/cmp/1
    torchrun --standalone --nproc_per_node=8 train.py attn=fa2 model=gpt2 trainer.grad_accum=8   # DDP

The config is conf/config.yaml on the typed defaults of trainer/config.py, composed with Hydra's compose API
(``compose_config``). A run folder, ``<run.root>/<run.name>[/<job number in that folder>]``, is written only once
``train()`` accepted the run: ``.hydra/`` (config.yaml, overrides.yaml; a sweep's multirun.yaml one level up) and
``train.log`` (with the lines held until then). A refused run leaves the folder as it was. Under torchrun every
rank runs this file: the ranks share rank 0's default run.name, rank 0 alone locks and writes the folder, the
others log warnings and errors to stderr, and an unexpected error goes to torchrun's report (``record``).
"""

import contextlib
import itertools
import logging
import logging.handlers
import os
import shutil
import signal
import sys
import warnings
from pathlib import Path

NOT_STARTED = "interrupted before training started; nothing to save"


class Terminated(KeyboardInterrupt):
    """SIGTERM before the training loop takes the signal over (loading, the model build, W&B's start): the same
    way out as a Ctrl-C there, with SIGTERM's exit code (``signum``)."""
    signum = signal.SIGTERM


def _raise_terminated(signum, frame) -> None:
    raise Terminated


def exit_not_started(e: KeyboardInterrupt) -> None:
    """A Ctrl-C or SIGTERM before any job handles its own (loading torch and Hydra, composing the config): one
    line, exit 128 + the signal."""
    print(NOT_STARTED, file=sys.stderr)
    sys.exit(128 + getattr(e, "signum", signal.SIGINT))


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _raise_terminated)

try:  # torch, hydra and the rest take seconds to load
    from hydra.errors import HydraException
    from omegaconf import DictConfig, OmegaConf
    from torch.distributed.elastic.multiprocessing.errors import record
    from tqdm.contrib.logging import logging_redirect_tqdm

    from data.prepare import PreparationInterrupted
    from trainer import REFUSALS, ConfigError, NonFiniteLossError, train
    from trainer.checkpoint import checkpoint_dir, latest_checkpoint
    from trainer.config import (CONF_DIR, RUN_NAME_RULE, Config, compose_config, continue_command, override_error,
                                override_key, resolved, valid_run_name, validate_config)
    from trainer.config_help import help_text
    from trainer.distributed import destroy_process_group, torchrun_overrides
    from trainer.resume import refusal
    from trainer.run_lock import RunFolderBusy, busy_owner, own_run_folder
    from trainer.runtime import DistInfo
    from trainer.stop import TrainingAborted
    from utils.atomic import atomic_write_text, check_writable
except KeyboardInterrupt as e:  # not the import machinery's traceback
    if __name__ != "__main__":
        raise
    exit_not_started(e)

log = logging.getLogger("train")
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's
EXPECTED = (*REFUSALS, NonFiniteLossError)
MULTIRUN, HELP = ("-m", "--multirun"), ("-h", "--help")
SWEEP_RECORD = "multirun.yaml"  # a sweep's command line, in the sweep's folder
# what running a sweep again to continue it may change or add (run.name: the name of the folder compared, which a
# sweep under the default name is continued by)
RESWEEP_FREE = ("trainer.max_steps", "resume", "run.name")


@record  # under torchrun: an uncaught error goes to torchrun's failure report (root cause, traceback)
def main(argv: list[str]) -> int:
    """Run ``python train.py <argv>``; returns the exit code (0, 1, or 128 + the signal that stopped a run)."""
    dist = DistInfo.from_env()
    args = torchrun_overrides(argv, dist)
    flags, overrides = [a for a in args if a.startswith("-")], [a for a in args if not a.startswith("-")]
    unknown = [f for f in flags if f not in MULTIRUN + HELP]
    hydra_keys = [o for o in overrides if o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    if unknown or hydra_keys:
        return error(f"{(unknown or hydra_keys)[0]}: train.py takes -m (--multirun), -h (--help) and config "
                     "overrides; the run folder is <run.root>/<run.name> (run.root=..., run.name=...)")
    multirun = any(f in MULTIRUN for f in flags)
    try:  # every job composed first: a bad override stops a sweep before its first job
        jobs = [(job, compose_config(job)) for job in (sweep(overrides) if multirun else [overrides])]
    except HydraException as e:  # an unknown key or group, a wrong type, an override that does not parse
        return error(override_error(e))
    if any(f in HELP for f in flags):
        try:
            print(help_text(jobs[0][1], Config, CONF_DIR), flush=True)
        except BrokenPipeError:  # `| head`: the reader has gone; say nothing more to it
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    bad = next((cfg.run.name for _, cfg in jobs if not valid_run_name(str(cfg.run.name))), None)
    if bad is not None:
        return error(f"run.name={bad!r}: {RUN_NAME_RULE}")
    for num, (job, cfg) in enumerate(jobs if multirun else []):  # a bad value stops a sweep before its first job
        try:
            validate_config(resolved(cfg), dist.world_size, dist.local_rank)
        except ConfigError as e:
            return error(f"job {num + 1} of {len(jobs)} ({' '.join(job)}): {e}")
    conflict = kind_conflict(jobs, multirun) or (sweep_conflict(jobs, overrides) if multirun else None)
    if conflict:
        return error(conflict)
    set_up_logging(dist)
    for num, ((job, cfg), run_dir) in enumerate(zip(jobs, run_dirs(jobs, multirun))):
        if multirun:
            log.info("job %d of %d (%s): %s", num + 1, len(jobs), run_dir, " ".join(job))
        code = run_job(cfg, job, run_dir, overrides if multirun else None, dist)
        if code:
            return code
    destroy_process_group()  # torchrun: after every job of the sweep
    return 0


def run_dirs(jobs: list[tuple[list[str], DictConfig]], multirun: bool) -> list[Path]:
    """Each job's run folder: ``<run.root>/<run.name>``, and in a sweep ``<run.root>/<run.name>/<n>``, n counting
    the sweep's jobs in that folder from 0 (``-m run.name=a,b``: a/0 and b/0)."""
    folders = [Path(cfg.run.root) / cfg.run.name for _, cfg in jobs]
    if not multirun:
        return folders
    return [folder / str(folders[:num].count(folder)) for num, folder in enumerate(folders)]


def kind_conflict(jobs: list[tuple[list[str], DictConfig]], multirun: bool) -> str | None:
    """Why the jobs may not start (None when they may): a single run's folder that holds a sweep (``SWEEP_RECORD``),
    or a sweep's that holds a single run's checkpoints or is in use by a running single run (its lock held, perhaps
    before its first checkpoint). Either would put the other's files beside them, and sample.py would pick one kind
    from the folder without naming the other."""
    for folder in dict.fromkeys(Path(cfg.run.root) / cfg.run.name for _, cfg in jobs):
        if not multirun and (folder / SWEEP_RECORD).is_file():
            return (f"run.name={folder.name}: {folder} holds a sweep ({SWEEP_RECORD}); run that sweep again with -m "
                    "to continue its jobs, or use another run.name")
        if multirun and latest_checkpoint(folder) is not None:
            return (f"run.name={folder.name}: {folder} holds a single run (checkpoints/); a sweep would put its "
                    "jobs beside it: use another run.name")
        owner = busy_owner(folder) if multirun else None
        if owner:
            return (f"run.name={folder.name}: {folder} is in use by a single run ({owner}); a sweep would put its "
                    "jobs beside it: use another run.name")
    return None


def sweep_conflict(jobs: list[tuple[list[str], DictConfig]], overrides: list[str]) -> str | None:
    """Why the sweep of ``overrides`` may not start (None when it may): a folder of it holds another sweep's record
    (``SWEEP_RECORD``), whose job folders this one would resume by number with other settings. The two sweeps'
    jobs are compared in order, each as its set of overrides without ``RESWEEP_FREE``."""
    settings = lambda job_list: [sorted(o for o in job if override_key(o) not in RESWEEP_FREE) for job in job_list]
    for folder in dict.fromkeys(Path(cfg.run.root) / cfg.run.name for _, cfg in jobs):
        record = folder / SWEEP_RECORD
        if not record.is_file():
            continue
        try:
            stored = [str(o) for o in OmegaConf.to_container(OmegaConf.load(record))]
            theirs = settings(sweep(stored))
        except Exception as e:  # noqa: BLE001 (a damaged record: YAML, not a list, an override that does not parse)
            return (f"run.name={folder.name}: {record} does not read as a sweep's command line ({type(e).__name__}); "
                    "use another run.name, or delete that file if the folder's runs are not a sweep")
        if theirs != settings([job for job, _ in jobs]):
            return (f"run.name={folder.name}: {folder} holds another sweep ({' '.join(stored)}; {record.name}), "
                    "whose jobs this one would resume by number with other settings; use another run.name, or run "
                    "that sweep again (with trainer.max_steps=... to train longer)")
    return None


def error(message: str) -> int:
    """A refusal before any run folder is touched: one line on stderr; exit code 1."""
    print(f"error: {message}", file=sys.stderr)
    return 1


def sweep(overrides: list[str]) -> list[list[str]]:
    """The jobs of ``-m <overrides>``: one per combination of the comma-separated values (Hydra's sweep syntax,
    range() and choice() included), the first override's values outermost, as Hydra's basic sweeper orders them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices = []
    for o in OverridesParser.create().parse_overrides(overrides):
        key = o.get_key_element()
        values = o.sweep_string_iterator() if o.is_sweep_override() else [o.get_value_element_as_str()]
        choices.append([f"{key}={v}" for v in values])
    return [list(job) for job in itertools.product(*choices)]


def set_up_logging(dist: DistInfo) -> None:
    """Rank 0: INFO and up to stdout in Hydra's format (and to train.log, see ``run_log``); other ranks: warnings
    and errors to stderr, prefixed with their rank. A Python warning is logged as its message alone (its display
    would add the source line of whatever code triggered it, which tells a user nothing)."""
    if dist.is_main:
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stdout, force=True)
    else:
        logging.basicConfig(level=logging.WARNING, format=f"[rank {dist.rank}] %(levelname)s [%(name)s] %(message)s",
                            force=True)
    warnings.showwarning = log_warning


def log_warning(message, category, filename, lineno, file=None, line=None) -> None:
    logging.getLogger("py.warnings").warning("%s", message)


def run_job(cfg: DictConfig, overrides: list[str], run_dir: Path, sweep_args: list[str] | None,
            dist: DistInfo) -> int:
    """Train one job in ``run_dir``; returns its exit code. Rank 0 locks the folder and writes it once train()
    accepted the run (``accept``); expected failures are one line, without a traceback."""
    reason = refusal(str(cfg.resume), run_dir)  # from file names only: before the folder is touched
    if reason:
        return error(reason)
    made = new_folders(run_dir)  # made for this job: a refused job takes them away again
    with contextlib.ExitStack() as stack:
        accept = stack.enter_context(run_log(run_dir, cfg, overrides, sweep_args, dist.is_main))
        stack.enter_context(logging_redirect_tqdm())  # a warning during training gets its own line, not the bar's
        if dist.is_main:
            try:
                stack.enter_context(own_run_folder(run_dir))
                check_writable(run_dir)  # e.g. a read-only folder resumed: refused here, not at the first write
            except RunFolderBusy as e:
                log.error("%s", e)
                return 1
            except OSError as e:
                dangling = run_dir.is_symlink() and not run_dir.exists()
                if dangling or (run_dir.exists() and not run_dir.is_dir()):
                    what = "a link to nothing" if dangling else "a file"
                    return error(f"run.name={cfg.run.name!r}: {run_dir} is {what}, not a run folder; choose another "
                                 "run.name or move it")
                return error(f"run.root={cfg.run.root!r}: cannot create or write the run folder {run_dir} "
                             f"({e.strerror or e})")
            checkpoints = checkpoint_dir(run_dir)
            try:  # where the checkpoints go: refused now, not after the training before the first save
                if checkpoints.exists() or checkpoints.is_symlink():
                    check_writable(checkpoints)
            except OSError as e:
                return error(f"{checkpoints}: the run's checkpoints are written there, but it is not a writable "
                             f"folder ({e.strerror or e}); move it away or choose another run.name")
        try:
            summary = train(cfg, run_dir=run_dir, on_accept=accept)
        except (*EXPECTED, PreparationInterrupted, KeyboardInterrupt) as e:
            return failed(e, run_dir, made, dist)
        except BaseException:  # a bug: its traceback, and no folder of this job's left holding only the lock
            if dist.is_main:
                discard_unused_folders(run_dir, made)
            raise
        if summary.stop_reason == "interrupted":  # saved and resumable, but not finished: say so to the caller
            if sweep_args is not None:  # `run.name=X` alone would start a run in the sweep's folder
                log.info("interrupted at step %d; to resume these runs: %s", summary.step,
                         continue_command(cfg.run, dist.world_size, sweep_args, sweep=True,
                                          local_world_size=dist.local_world_size))
            else:
                log.info("interrupted at step %d; to resume: %s", summary.step,
                         continue_command(cfg.run, dist.world_size, overrides,
                                          local_world_size=dist.local_world_size))
            return 128 + summary.stop_signal
        if sweep_args is not None:
            log.info("finished at step %d; to continue these runs: %s trainer.max_steps=<more than %d>", summary.step,
                     continue_command(cfg.run, dist.world_size, sweep_args, drop=["trainer.max_steps"], sweep=True,
                                      local_world_size=dist.local_world_size), summary.step)
        else:
            log.info("finished at step %d; to continue this run: %s trainer.max_steps=<more than %d>", summary.step,
                     continue_command(cfg.run, dist.world_size, overrides, drop=["trainer.max_steps"],
                                      local_world_size=dist.local_world_size), summary.step)
    return 0


def failed(e: BaseException, run_dir: Path, made: list[Path], dist: DistInfo) -> int:
    """The exit code of a job that ``train`` ended with ``e`` (an expected failure or an interrupt), after one
    line that says why; the folders this job made (``new_folders``) go away if they hold nothing but the lock, or,
    after a Ctrl-C or SIGTERM before training started or a refusal before its first step (e.g. W&B could not
    start), nothing but this job's record (a new folder has no checkpoint yet). A run that trained keeps its
    folder, whatever ended it (an interrupt while W&B closes, after the last step); one that diverged keeps its
    log."""
    code = _report(e, run_dir)
    if dist.is_main and made:
        interrupted = isinstance(e, KeyboardInterrupt) and not isinstance(e, TrainingAborted)
        refused = isinstance(e, EXPECTED) and not isinstance(e, NonFiniteLossError)
        if (interrupted or refused) and not_trained(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)
        discard_unused_folders(run_dir, made)
    return code


def new_folders(run_dir: Path) -> list[Path]:
    """``run_dir`` and those of its parents that do not exist yet, innermost first."""
    made = []
    while not run_dir.exists() and run_dir != run_dir.parent:
        made.append(run_dir)
        run_dir = run_dir.parent
    return made


def _report(e: BaseException, run_dir: Path) -> int:
    if isinstance(e, PreparationInterrupted):  # Ctrl-C or SIGTERM while the token cache was written
        log.error("%s", e)
        return 128 + e.signum
    if isinstance(e, TrainingAborted):  # a second Ctrl-C: no save; the last checkpoint stays the latest
        last = latest_checkpoint(run_dir)
        log.error("aborted by a second Ctrl-C; this step was not saved (%s)",
                  f"resume continues from {last.name}" if last else "no checkpoint was saved yet")
        return 128 + signal.SIGINT
    if isinstance(e, KeyboardInterrupt):  # outside the training loop: before it (model build, W&B's start) or after
        if not_trained(run_dir):
            log.error(NOT_STARTED)
        else:
            last = latest_checkpoint(run_dir)
            log.error("interrupted after the training loop (while the run was closing); the run folder is kept (%s)",
                      f"resume continues from {last.name}" if last else "no checkpoint was saved")
        return 128 + getattr(e, "signum", signal.SIGINT)
    for line in str(e).splitlines():  # a record per line (e.g. one per bad config value), each with its prefix
        log.error("%s", line)
    return 1


def not_trained(run_dir: Path) -> bool:
    """Whether no step of the run in ``run_dir`` was logged or saved: no checkpoint and no metrics.jsonl record."""
    metrics = run_dir / "metrics.jsonl"
    return latest_checkpoint(run_dir) is None and (not metrics.exists() or metrics.stat().st_size == 0)


def discard_unused_folders(run_dir: Path, made: list[Path]) -> None:
    """Remove the folders a failed job made (``made``, from ``new_folders``): ``run_dir`` when it holds nothing but
    the lock (rank 0 still holds it), so a typo on the command line leaves no folder, under a default name or a new
    run.name; then its new parents (a sweep's folder, a new run.root) while empty. A folder that was there before
    the job is kept as it was."""
    if not made:
        return
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {".lock"}:
        shutil.rmtree(run_dir, ignore_errors=True)
    for folder in made[1:]:  # empty unless another job wrote there
        try:
            folder.rmdir()
        except OSError:
            break


@contextlib.contextmanager
def run_log(run_dir: Path, cfg: DictConfig, overrides: list[str], sweep_args: list[str] | None, enabled: bool):
    """Yields the job's ``accept()``. Until it is called (train() accepted the run) the job's log lines are held
    back; then the run's record is written (``.hydra/``, a sweep's multirun.yaml) and the lines go to
    ``run_dir/train.log`` (appended), the held ones first, to the end of the block. A job refused before
    ``accept()`` writes nothing there, its error included (the console has it)."""
    root = logging.getLogger()
    held = logging.handlers.MemoryHandler(capacity=sys.maxsize, flushLevel=logging.CRITICAL + 1, flushOnClose=False)
    handlers = [held] if enabled else []
    for handler in handlers:
        root.addHandler(handler)

    def accept() -> None:
        if not enabled:
            return
        write_record(run_dir, cfg, overrides, sweep_args)
        file = logging.FileHandler(run_dir / "train.log")
        file.setFormatter(logging.Formatter(LOG_FORMAT))
        held.setTarget(file)
        held.flush()
        root.removeHandler(held)
        root.addHandler(file)
        handlers.append(file)

    try:
        yield accept
    finally:
        for handler in handlers:
            root.removeHandler(handler)
            handler.close()


def write_record(run_dir: Path, cfg: DictConfig, overrides: list[str], sweep_args: list[str] | None) -> None:
    """``.hydra/config.yaml`` (the composed config, resolved) and ``.hydra/overrides.yaml`` (this job's command
    line), and for a sweep's job the sweep's command line in ``<sweep folder>/multirun.yaml``."""
    folder = run_dir / ".hydra"
    folder.mkdir(exist_ok=True)
    atomic_write_text(folder / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    atomic_write_text(folder / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(overrides)))
    if sweep_args is not None:
        atomic_write_text(run_dir.parent / SWEEP_RECORD, OmegaConf.to_yaml(OmegaConf.create(sweep_args)))


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt as e:
        exit_not_started(e)
