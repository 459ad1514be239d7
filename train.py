"""Train a GPT: ``python train.py [group=option ...] [key=value ...]``.

Examples:
    python train.py                                   # tiny char-level GPT on Shakespeare (CPU ok)
    python train.py attn=fa2 model=gpt2 data=shakespeare_bpe trainer.compile=true
    python train.py run.name=exp1 trainer.max_steps=5000   # resumes runs/exp1 if it has checkpoints

Config: conf/config.yaml (+ groups model/, data/, attn/) on top of the typed defaults in
trainer/config.py. Everything of a run goes to runs/<run.name>/ (see README.md).
"""

import logging
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from data.sources import DataError
from model.attention import BackendUnavailableError
from trainer import ConfigError, NonFiniteLossError, register_configs, train
from trainer.checkpoint import CheckpointError

log = logging.getLogger("train")
register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    try:
        summary = train(cfg, run_dir=HydraConfig.get().runtime.output_dir)
    except (ConfigError, DataError, CheckpointError, BackendUnavailableError, NonFiniteLossError) as e:
        # Expected user-facing failures: one clear message, no traceback.
        log.error("%s", e)
        sys.exit(1)
    return summary.final_val_loss  # the value a Hydra sweeper would optimise


if __name__ == "__main__":
    main()
