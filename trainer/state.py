"""``TrainState``: everything a checkpoint restores, in the style of torchtitan's ``Stateful``.

    state = TrainState(model, optimizer, scaler, sampler, dist)
    sd = state.state_dict()        # collective under DDP: gathers every rank's RNG and data streams
    state.load_state_dict(sd)      # every rank, from the same (merged) dict

The dict's entries are the training part of the checkpoint format (``trainer.checkpoint`` adds the
run's description and the version): model, optimizer, scaler, step, tokens_seen, best_val_loss,
wandb_run_id, world_size, rng (one ``rng_state()`` per rank), sampler (all micro-batch streams).
"""

from __future__ import annotations

import logging
from typing import Mapping, Optional

import torch

from data.sampler import ShardedBatchSampler
from trainer.checkpoint import clean_state_dict, unwrap_model
from trainer.distributed import gather_objects
from trainer.runtime import DistInfo, rng_state, set_rng_state

log = logging.getLogger(__name__)


class TrainState:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                 sampler: ShardedBatchSampler, dist: DistInfo = DistInfo()):
        self.model, self.optimizer, self.scaler, self.sampler, self.dist = model, optimizer, scaler, sampler, dist
        self.step = 0                 # optimizer steps done
        self.tokens_seen = 0          # whole job
        self.best_val_loss: Optional[float] = None
        self.wandb_run_id: Optional[str] = None

    def state_dict(self) -> dict:
        """The full state on rank 0 (other ranks: their own RNG and streams only). Every rank must call it."""
        per_rank = gather_objects({"rng": rng_state(), "sampler": self.sampler.state_dict()}, self.dist)
        if not self.dist.is_main:
            return {}
        return {
            "model": clean_state_dict(unwrap_model(self.model).state_dict()),
            "optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict(),
            "step": self.step, "tokens_seen": self.tokens_seen, "best_val_loss": self.best_val_loss,
            "wandb_run_id": self.wandb_run_id, "world_size": self.dist.world_size,
            "rng": [r["rng"] for r in per_rank],  # index = rank
            "sampler": ShardedBatchSampler.merge_states([r["sampler"] for r in per_rank]),
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore from a ``state_dict()`` (or a ``trainer.checkpoint.Checkpoint``, whose lookups name a
        missing key). This rank's RNG state is restored last, so nothing after it draws random numbers
        before training resumes."""
        unwrap_model(self.model).load_state_dict(clean_state_dict(state["model"]))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.sampler.load_state_dict(state["sampler"])
        # Told once, by the main process (whose log is train.log); the micro-batch count is the job's, not a rank's.
        before, after = state["sampler"]["num_shards"], self.sampler.num_shards
        if before != after and self.dist.is_main:
            first, last = min(before, after), max(before, after) - 1
            verb = "start" if after > before else "stop"
            change = (f"micro-batch {first}'s stream {verb}s" if first == last
                      else f"the streams of micro-batches {first}-{last} {verb}")
            log.warning("trainer.grad_accum changed on resume (%d -> %d micro-batches a step, so the global batch "
                        "changes with it): %s%s", before, after, change,
                        "; give trainer.grad_accum=%d to continue exactly" % before
                        if before % self.dist.world_size == 0 else "")
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.best_val_loss, self.wandb_run_id = state["best_val_loss"], state["wandb_run_id"]
        if state["world_size"] != self.dist.world_size and self.dist.is_main:
            log.warning("checkpoint of a %d-process job, resumed with %d processes: %sper-process random streams "
                        "(dropout) do not continue", state["world_size"], self.dist.world_size,
                        "the data stream continues exactly; " if before == after else "")
        rngs = state["rng"]
        if self.dist.rank < len(rngs):
            set_rng_state(rngs[self.dist.rank])
