"""Training components (one job per module) and the loop that orchestrates them.

config       structured Hydra configs (ConfigStore) and validation
config_help  the option table of `python train.py --help`, from config's dataclasses
run_lock     one live process per run folder (lock file naming the owner)
lr_schedule  linear warm-up + cosine decay
optim        AdamW parameter groups
runtime      rank/world size, device, dtype/autocast, seeding, RNG state
distributed  torchrun / DDP: process group, shared run name, collectives (no-ops for one process)
checkpoint   the checkpoint format (versioned): atomic save, keep-last, latest lookup, checked load
resume       the resume policy (auto / never / <path>) and compatibility checks
state        TrainState: what a checkpoint restores (state_dict / load_state_dict)
metrics      step records, step timing -> W&B, metrics.jsonl, progress bar; MFU peak table
stop         Ctrl-C / SIGTERM: stop after the current step
loop         train(cfg) -> Trainer(...).fit() -> TrainSummary
"""

from data.sources import DataError
from model.backends import BackendUnavailableError
from trainer.checkpoint import CheckpointError
from trainer.config import Config, ConfigError, compose_config, register_configs
from trainer.loop import NonFiniteLossError, TrainSummary, train

# What a run raises when it refuses its config, data, checkpoint or attention backend: a message that says it all,
# given as one line (train.py, bench.throughput, tools.profile_step), never a traceback.
REFUSALS = (ConfigError, DataError, CheckpointError, BackendUnavailableError)

__all__ = ["Config", "ConfigError", "NonFiniteLossError", "REFUSALS", "TrainSummary", "compose_config",
           "register_configs", "train"]
