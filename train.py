"""Train a GPT: ``python train.py [group=option ...] [key=value ...]``.

Examples:
    python train.py                                   # tiny char-level GPT on Shakespeare (CPU ok)
    python train.py attn=fa2 model=gpt2 data=shakespeare_bpe trainer.compile=true
    python train.py run.name=exp1 trainer.max_steps=5000   # resumes runs/exp1 if it has checkpoints
    torchrun --standalone --nproc_per_node=8 train.py attn=fa2 model=gpt2 trainer.grad_accum=8   # DDP

Config: conf/config.yaml (+ groups model/, data/, attn/) on top of the typed defaults in
trainer/config.py. Everything of a run goes to runs/<run.name>/ (see README.md).

Under torchrun every rank runs this file: ranks agree on run.name before Hydra makes the run
folder, only rank 0 writes Hydra's files and log, the other ranks log warnings and errors to
stderr (prefixed with their rank), and an unexpected error is recorded for torchrun's report
(torch.distributed.elastic's ``record``), which then stops the other ranks.
"""

import contextlib
import logging
import logging.handlers
import shutil
import signal
import sys
import warnings
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from data.prepare import PreparationInterrupted
from data.sources import DataError
from model.backends import BackendUnavailableError
from trainer import ConfigError, NonFiniteLossError, register_configs, train
from trainer.checkpoint import CheckpointError, latest_checkpoint
from trainer.config import compose_config, continue_command
from trainer.distributed import destroy_process_group, torchrun_overrides
from trainer.resume import refusal_for_overrides
from trainer.run_lock import RunFolderBusy, own_run_folder
from trainer.runtime import DistInfo
from trainer.stop import TrainingAborted

log = logging.getLogger("train")


def log_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` for train.py: a warning (e.g. a kernel fallback) reaches the console and train.log
    once, through logging, as its message alone (Python's display adds the warning's source line, which is some
    caller's code and tells a user nothing)."""
    logging.getLogger("py.warnings").warning("%s", message)


warnings.showwarning = log_warning
register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    return run(cfg)


@record  # under torchrun: an uncaught error goes to torchrun's failure report (root cause, traceback)
def run(cfg: DictConfig) -> float | None:
    dist = DistInfo.from_env()
    if not dist.is_main:  # Hydra logging is off on these ranks (torchrun_overrides)
        logging.basicConfig(level=logging.WARNING, format=f"[rank {dist.rank}] %(levelname)s [%(name)s] %(message)s")
    run_dir = HydraConfig.get().runtime.output_dir
    held: HeldRunLog | None = None
    try:
        # The job's rank 0 owns the run folder; its other ranks write nothing there.
        with own_run_folder(run_dir) if dist.is_main else contextlib.nullcontext():
            # Hydra's record of the run and its train.log lines are written only once train() accepted it: a
            # refused run (bad value, incompatible resume) leaves an existing run's .hydra/ and train.log as they were.
            held = HeldRunLog() if dist.is_main else None
            on_accept = (lambda: (save_hydra_files(cfg, run_dir), held.accept())) if dist.is_main else None
            summary = train(cfg, run_dir=run_dir, on_accept=on_accept)
    except RunFolderBusy as e:
        detach_log_files()  # the owner's train.log is not ours to write
        log.error("%s", e)
        sys.exit(1)
    except (ConfigError, DataError, CheckpointError, BackendUnavailableError, NonFiniteLossError) as e:
        # Expected user-facing failures: one clear message, no traceback.
        refused(held)
        log.error("%s", e)
        if dist.is_main:
            discard_unused_default_folder(run_dir)
        sys.exit(1)
    except PreparationInterrupted as e:  # Ctrl-C or SIGTERM while the token cache was written
        refused(held)
        log.error("%s", e)
        sys.exit(128 + e.signum)
    except TrainingAborted:  # a second Ctrl-C: abort now, without saving; the last checkpoint stays the latest
        refused(held)
        last = latest_checkpoint(Path(run_dir))
        log.error("aborted by a second Ctrl-C; this step was not saved (%s)",
                  f"resume continues from {last.name}" if last else "no checkpoint was saved yet")
        sys.exit(128 + signal.SIGINT)
    except KeyboardInterrupt:  # Ctrl-C before the training loop took over the signal (model build, W&B start)
        refused(held)
        log.error("interrupted before training started; nothing to save")
        sys.exit(128 + signal.SIGINT)
    if summary.stop_reason == "interrupted":  # saved and resumable, but not finished: say so to the caller
        sys.exit(128 + summary.stop_signal)
    if Path(run_dir).resolve() != (Path(cfg.run.root) / cfg.run.name).resolve() and \
            HydraConfig.get().mode != RunMode.MULTIRUN:
        log.warning("hydra.run.dir put this run in %s, not in run.root/run.name: to continue it, give the same "
                    "hydra.run.dir; run.root and run.name choose the run folder without it", run_dir)
    if HydraConfig.get().mode == RunMode.MULTIRUN:  # `run.name=X` alone would start a run in the sweep's folder
        log.info("finished at step %d; to continue these runs: the same `python train.py -m ...` command with "
                 "trainer.max_steps=<more than %d>", summary.step, summary.step)
    else:
        log.info("finished at step %d; to continue this run: %s trainer.max_steps=<more than %d> "
                 "(with the same settings, and resume=auto, the default, in place of any resume=<file>)",
                 summary.step, continue_command(cfg.run, dist.world_size), summary.step)
    return summary.final_val_loss  # the value a Hydra sweeper would optimise


def save_hydra_files(cfg: DictConfig, run_dir: str) -> None:
    """Hydra's .hydra/ files, written once the run folder is ours (conf/config.yaml tells Hydra not
    to write them itself, before the lock, over another run's)."""
    hydra_cfg = HydraConfig.get()
    folder = Path(run_dir) / ".hydra"
    folder.mkdir(exist_ok=True)
    for name, node in (("config.yaml", cfg), ("hydra.yaml", OmegaConf.create({"hydra": hydra_cfg})),
                       ("overrides.yaml", hydra_cfg.overrides.task)):
        (folder / name).write_text(OmegaConf.to_yaml(node))


def discard_unused_default_folder(run_dir: str) -> None:
    """Remove the folder of a refused run that holds nothing but its log and lock, when its name is the default
    (timestamp + random suffix: no other process can use it), so a typo on the command line leaves no folder.
    A folder named with run.name= is kept, whatever it holds; so is a torchrun job's (its ranks share rank 0's
    default name as a run.name override, and a late rank's Hydra start would make the folder again)."""
    if any(o.split("=", 1)[0].lstrip("+~") == "run.name" for o in HydraConfig.get().overrides.task):
        return
    folder = Path(run_dir)
    if folder.is_dir() and {p.name for p in folder.iterdir()} <= {"train.log", ".lock"}:
        detach_log_files()
        shutil.rmtree(folder, ignore_errors=True)


class HeldRunLog:
    """Holds back the lines meant for the run folder's train.log (Hydra's file handler) until ``accept``: train()
    accepted the run, and they are written in order. A run refused before that (``refused``) writes nothing
    there, its error included (it still reaches the console), so an existing run's train.log stays as it was."""

    def __init__(self):
        self.root, self.accepted, self.pairs = logging.getLogger(), False, []
        for handler in [h for h in self.root.handlers if isinstance(h, logging.FileHandler)]:
            held = logging.handlers.MemoryHandler(capacity=sys.maxsize, flushLevel=logging.CRITICAL + 1,
                                                  target=handler, flushOnClose=False)
            held.setLevel(handler.level)
            self.root.removeHandler(handler)
            self.root.addHandler(held)
            self.pairs.append((held, handler))

    def accept(self) -> None:
        for held, handler in self.pairs:
            held.flush()
            self.root.removeHandler(held)
            self.root.addHandler(handler)
            held.close()
        self.accepted = True

    def drop(self) -> None:
        """Forget the held lines and close train.log."""
        for held, handler in self.pairs:
            self.root.removeHandler(held)
            held.buffer.clear()
            held.close()
            handler.close()


def refused(held: "HeldRunLog | None") -> None:
    """A failure before train() accepted the run: nothing of it goes to train.log."""
    if held is not None and not held.accepted:
        held.drop()


def detach_log_files() -> None:
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
        root.removeHandler(handler)
        handler.close()


def refuse_before_hydra(argv: list[str]) -> None:
    """Exit if the resume policy refuses the run, before Hydra writes train.log into its folder."""
    reason = refusal_for_overrides(argv)
    if reason:
        sys.exit(f"error: {reason}")


def refuse_bad_help_overrides(argv: list[str]) -> None:
    """``--help`` composes the config outside Hydra's error handling, so a bad override there ends in a
    traceback: compose it first and exit with Hydra's message."""
    if not {"--help", "-h"} & set(argv):
        return
    from hydra.errors import HydraException

    try:
        compose_config([a for a in argv if not a.startswith("-")])
    except HydraException as e:  # an unknown key or group, a wrong type, an override that does not parse
        sys.exit(f"error: {e}" + (f"\n{e.__cause__}" if e.__cause__ else ""))


if __name__ == "__main__":
    sys.argv[1:] = torchrun_overrides(sys.argv[1:])  # unchanged for one process
    refuse_bad_help_overrides(sys.argv[1:])
    refuse_before_hydra(sys.argv[1:])
    main()
    destroy_process_group()  # torchrun: after every job of the process (Hydra multirun) finished
