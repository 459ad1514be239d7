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

import logging
import signal
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from torch.distributed.elastic.multiprocessing.errors import record

from data.sources import DataError
from model.attention import BackendUnavailableError
from trainer import ConfigError, NonFiniteLossError, register_configs, train
from trainer.checkpoint import CheckpointError
from trainer.config import RUN_NAME_RULE, valid_run_name
from trainer.distributed import destroy_process_group, torchrun_overrides
from trainer.resume import refusal_for_overrides
from trainer.runtime import DistInfo

log = logging.getLogger("train")
register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    return run(cfg)


@record  # under torchrun: an uncaught error goes to torchrun's failure report (root cause, traceback)
def run(cfg: DictConfig) -> float | None:
    dist = DistInfo.from_env()
    if not dist.is_main:  # Hydra logging is off on these ranks (torchrun_overrides)
        logging.basicConfig(level=logging.WARNING, format=f"[rank {dist.rank}] %(levelname)s [%(name)s] %(message)s")
    try:
        summary = train(cfg, run_dir=HydraConfig.get().runtime.output_dir)
    except (ConfigError, DataError, CheckpointError, BackendUnavailableError, NonFiniteLossError) as e:
        # Expected user-facing failures: one clear message, no traceback.
        log.error("%s", e)
        sys.exit(1)
    except KeyboardInterrupt:  # a second Ctrl-C: abort now, without saving; the last checkpoint stays the latest
        log.error("aborted by a second Ctrl-C; this step was not saved (resume continues from the last checkpoint)")
        sys.exit(128 + signal.SIGINT)
    if summary.stop_reason == "interrupted":  # saved and resumable, but not finished: say so to the caller
        sys.exit(128 + summary.stop_signal)
    return summary.final_val_loss  # the value a Hydra sweeper would optimise


def check_run_name(argv: list[str]) -> None:
    """Reject a bad run.name before Hydra creates its folder (the run_dir resolver is the backstop)."""
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.lstrip("+") == "run.name" and "," not in value and not valid_run_name(value):
            sys.exit(f"error: run.name={value!r}: {RUN_NAME_RULE}")


def refuse_before_hydra(argv: list[str]) -> None:
    """Exit if the resume policy refuses the run, before Hydra writes .hydra/ and train.log into its folder."""
    reason = refusal_for_overrides(argv)
    if reason:
        sys.exit(f"error: {reason}")


if __name__ == "__main__":
    check_run_name(sys.argv[1:])
    sys.argv[1:] = torchrun_overrides(sys.argv[1:])  # unchanged for one process
    refuse_before_hydra(sys.argv[1:])
    main()
    destroy_process_group()  # torchrun: after every job of the process (Hydra multirun) finished
