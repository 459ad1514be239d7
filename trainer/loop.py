"""The training loop: ``train(cfg)`` and the ``Trainer`` it runs.

``train(cfg)`` is the in-process entry point used by ``train.py`` (and by benchmarks / multi-GPU
launchers): it validates the config, joins the torchrun job if any, and runs ``Trainer(...).fit()``,
which trains to ``trainer.max_steps`` and returns a ``TrainSummary`` with every per-step record it
produced. The ``Trainer`` owns a ``TrainState`` (model, optimizer, scaler, data streams, counters;
``trainer.state``) and has one method per job: ``train_step``, ``evaluate``, ``save``, ``resume``.
Under torchrun every rank runs it; the model is wrapped in DDP and the collectives are in
``trainer.distributed`` (no-ops for one process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel

from data.prepare import PreparedData, prepare_data
from data.sampler import BatchSampler, ShardedBatchSampler, rank_seed
from model.gpt import GPT, GPTConfig
from model.layers import mlp_width
from model.loss import CHUNK_TOKENS, resolve_loss
import trainer.checkpoint as checkpoint
from trainer.compile import compile_model, convert_to_fp8
from trainer.config import (ConfigError, config_backend, padded_vocab_size, resolved, resolved_grad_accum,
                            unused_data_keys, validate_against_data, validate_config)
from trainer.distributed import all_reduce_sum, barrier, broadcast_object, gather_objects, init_process_group
from trainer.lr_schedule import lr_at
from trainer.metrics import MetricsLogger, StepTimer, Throughput, peak_flops, step_record
from trainer.optim import build_optimizer
from trainer.resume import check_compatible, find_checkpoint
from trainer.runtime import DistInfo, autocast, device_memory, seed_everything, select_device, select_dtype
from trainer.state import TrainState
from trainer.stop import StopRequest, TrainingAborted

log = logging.getLogger(__name__)

VAL_SEED_OFFSET = 1_000_003  # val batches come from their own, fixed stream
DROPOUT_SEED_PURPOSE = 1     # under DDP: each rank's dropout seed, apart from the data streams' seeds


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or inf; the run stopped without saving that step."""


@dataclass
class TrainSummary:
    run_dir: Path
    attn_backend: str                 # resolved backend name (never 'auto')
    start_step: int                   # step the run started from (0, or the resumed checkpoint's)
    step: int                         # last completed optimizer step
    stop_reason: str                  # 'max_steps' or 'interrupted'
    stop_signal: Optional[int] = None  # the signal that interrupted the run (SIGINT/SIGTERM), if any
    records: list[dict] = field(default_factory=list)  # one per step of this invocation, as in metrics.jsonl
    final_val_loss: Optional[float] = None
    final_val_step: Optional[int] = None  # the step final_val_loss was measured at
    best_val_loss: Optional[float] = None
    checkpoint: Optional[Path] = None  # last checkpoint written
    wandb_run_id: Optional[str] = None
    num_params: int = 0
    tokens_per_step: int = 0


@dataclass
class QueuedStep:
    """A step queued on the device, its numbers not read yet: stats = [loss, (DDP: stop votes,) grad norm], a
    host tensor (on CUDA: pinned, filled by a copy queued right behind the step's work) valid once ``done`` is."""
    step: int
    tokens_seen: int
    lr: float
    stats: torch.Tensor
    done: object  # StepTimer mark: when the device finished it


def train(cfg: DictConfig, run_dir: Optional[Path] = None,
          on_step: Optional[Callable[[dict], None]] = None,
          on_accept: Optional[Callable[[], None]] = None) -> TrainSummary:
    """Train (or resume) the run described by ``cfg`` (the composed config, see conf/config.yaml).

    run_dir: the run folder; default ``<run.root>/<run.name>``. on_step: called with each per-step
    record. on_accept: called once the config, the data and any checkpoint to resume have passed every
    check, before anything is written into the run folder (train.py then writes the run's .hydra/ record and
    train.log). Raises ConfigError for invalid values (before any data or model work), CheckpointError
    for a missing/corrupt checkpoint or a failed checkpoint write, NonFiniteLossError for a NaN/inf
    loss (the previous checkpoint is left as the latest). Give ``run.name`` explicitly when calling
    this several times in one process: the default name is a timestamp resolved once per process.

    Under torchrun (WORLD_SIZE > 1) every rank calls this: it joins the process group (NCCL on
    CUDA, gloo on CPU) unless one exists, and leaves it up for later calls
    (``trainer.distributed.destroy_process_group`` ends it); takes rank 0's ``run.name`` and
    ``run_dir``; and trains with DDP, see README "Multi-GPU". Config errors are raised on every rank alike.
    """
    cfg = resolved(cfg)
    dist = DistInfo.from_env()
    validate_config(cfg, dist.world_size, dist.local_rank)
    backend = config_backend(cfg)
    device = select_device(cfg.trainer.device, dist)
    dtype = select_dtype(cfg.trainer.dtype, device)
    init_process_group(dist, device, cfg.trainer.dist_timeout_s)
    # One run folder for the job: rank 0's name (a default timestamp may differ per process).
    name, folder = broadcast_object((cfg.run.name, None if run_dir is None else str(run_dir)), dist)
    cfg.run.name = name
    run_dir = Path(folder) if folder is not None else Path(cfg.run.root) / cfg.run.name
    return Trainer(cfg, run_dir, dist, device, dtype, backend, on_step, on_accept).fit()


class Trainer:
    """One run: builds data, model, optimizer and logger from the config, resumes if asked, trains."""

    def __init__(self, cfg: DictConfig, run_dir: Path, dist: DistInfo, device: torch.device, dtype: torch.dtype,
                 backend: str, on_step: Optional[Callable[[dict], None]] = None,
                 on_accept: Optional[Callable[[], None]] = None):
        self.cfg, self.run_dir, self.dist, self.device, self.dtype = cfg, run_dir, dist, device, dtype
        self.on_step = on_step
        ckpt, ckpt_path = find_checkpoint(cfg.resume, run_dir)  # every rank reads it, onto the CPU
        self.data = _prepare_data(cfg, dist)
        validate_against_data(cfg, len(self.data.train), len(self.data.val), self.data.vocab_size)
        self.model_args = model_config(cfg, self.data.vocab_size, backend)
        check_memory(self.model_args, device, cfg.trainer.batch_size * self.model_args.block_size, dtype)
        if ckpt is not None:
            check_compatible(ckpt, self.model_args, self.data.meta, cfg, self.device.type)
        if on_accept is not None:
            on_accept()
        self.grad_accum = resolved_grad_accum(cfg, dist.world_size)
        self.micro_steps = self.grad_accum // dist.world_size  # micro-batches per step on this rank
        # Plain values for the per-step code: each OmegaConf lookup costs 10-20 us of host time.
        o = cfg.optim
        self.lr_args = (float(o.lr), int(o.warmup_steps), int(o.decay_steps), float(o.min_lr_ratio))
        self.max_norm = o.grad_clip if o.grad_clip > 0 else math.inf
        self.state = self._build_state()
        self.run_model, self.eval_model = self._wrap(self.state.model)
        self.throughput = self._throughput()
        self.timer = StepTimer(device)
        self.config_dict = OmegaConf.to_container(cfg, resolve=True)
        if dist.is_main:
            checkpoint.remove_orphans(run_dir)
        same_run = ckpt_path is not None and ckpt_path.resolve().parent == checkpoint.checkpoint_dir(run_dir).resolve()
        start_step = ckpt["step"] if ckpt is not None else 0
        self.logger = self._logger(ckpt["wandb_run_id"] if same_run else None, start_step)
        self.summary = TrainSummary(run_dir, backend, 0, 0, "max_steps", wandb_run_id=self.logger.wandb_id,
                                    num_params=self.state.model.num_params(),
                                    tokens_per_step=self.throughput.tokens_per_step)
        self.last_saved: Optional[int] = None
        self.folder_id = _folder_id(run_dir)  # made by _logger; see _check_folder
        if ckpt is not None:
            self.resume(ckpt)  # last: restores the RNG states, so nothing after it draws random numbers
        self.state.wandb_run_id = self.logger.wandb_id  # a branch (resume=<path>) is a new W&B run

    def _build_state(self) -> TrainState:
        cfg, dist, device = self.cfg, self.dist, self.device
        seed_everything(cfg.seed)
        model = GPT(self.model_args).to(device)  # the same initial weights on every rank
        if cfg.trainer.fp8:
            log.info("trainer.fp8: %d linear layers run their matmuls in FP8 (torchao)", convert_to_fp8(model))
        if dist.world_size > 1:
            # but each rank its own dropout masks, from a seed no data stream uses (so masks and batches are independent)
            seed_everything(rank_seed(cfg.seed, dist.rank, DROPOUT_SEED_PURPOSE))
        optimizer = build_optimizer(model, cfg.optim, device)
        scaler = torch.amp.GradScaler(device.type, enabled=self.dtype == torch.float16)
        sampler = ShardedBatchSampler(self.data.train, cfg.model.block_size, cfg.trainer.batch_size, cfg.seed,
                                      self.grad_accum, dist.rank, dist.world_size, device,
                                      doc_starts=self.data.train_docs if cfg.data.document_mask else None,
                                      vocab_size=self.data.vocab_size, source=self.data.dir / "train.bin")
        return TrainState(model, optimizer, scaler, sampler, dist)

    def _wrap(self, model: GPT) -> tuple[torch.nn.Module, torch.nn.Module]:
        """(training model: DDP and/or compiled, evaluation model). Evaluation runs outside DDP
        (ranks may do unequal numbers of val batches; no collectives in forward)."""
        ddp = model
        if self.dist.world_size > 1:
            ddp = DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        t = self.cfg.trainer
        compile_ = (lambda m: compile_model(m, t.compile_mode)) if t.compile else (lambda m: m)
        run_model = compile_(ddp)
        return run_model, run_model if self.dist.world_size == 1 else compile_(model)

    def _throughput(self) -> Throughput:
        peak = peak_flops(self.device, self.cfg.trainer.peak_flops)  # this GPU's
        peaks = gather_objects(peak, self.dist)  # every GPU's (on rank 0), for the job's MFU
        job_peak = broadcast_object(sum(peaks) if self.dist.is_main and None not in peaks else None, self.dist)
        tokens_per_step = self.cfg.trainer.batch_size * self.grad_accum * self.cfg.model.block_size  # whole job
        return Throughput(tokens_per_step, self.dist.world_size, self.state.model.estimate_flops_per_token(),
                          peak, job_peak)

    def _logger(self, wandb_id: Optional[str], start_step: int) -> MetricsLogger:
        cfg, dist, model = self.cfg, self.dist, self.state.model
        log.info("attention backend: %s (attn=%s) | device %s | dtype %s | %.2fM parameters | %d tokens/step",
                 self.model_args.attn, cfg.attn.backend, self.device, str(self.dtype).removeprefix("torch."),
                 model.num_params() / 1e6, self.throughput.tokens_per_step)
        for unused in unused_data_keys(cfg.data) if dist.is_main else []:
            log.warning("%s", unused)
        masks = [f"model.attn_window={self.model_args.attn_window}"] if self.model_args.attn_window else []
        masks += ["within each document (data.document_mask)"] if cfg.data.document_mask else []
        if masks:
            log.info("attention masks: causal, %s", ", ".join(masks))
            model.backend.warn_masks()
        if self.model_args.attn_softcap:
            log.info("attention logit soft-capping: %g (model.attn_softcap)", self.model_args.attn_softcap)
        loss = resolve_loss(self.model_args.loss, self.device.type)
        if self.model_args.loss == "fused" and self.device.type != "cuda":
            log.info("model.loss=fused without a CUDA GPU: the cross-entropy runs as torch ops (the same math); "
                     "its Triton kernel needs a GPU")
        elif self.model_args.loss == "auto":
            log.info("model.loss=auto: %s", loss)
        if dist.world_size > 1:
            log.info("DDP: %d processes (%s), %d micro-batch(es) of %d sequences per process per step",
                     dist.world_size, torch.distributed.get_backend(), self.micro_steps, cfg.trainer.batch_size)
        log.info("run folder: %s", self.run_dir.resolve())
        wandb_config = {**self.config_dict, "resolved": {
            "attn_backend": self.model_args.attn, "loss": loss,
            "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
            "vocab_size": self.model_args.vocab_size, "num_params": model.num_params(),
            "tokens_per_step": self.throughput.tokens_per_step,
            "grad_accum": self.grad_accum, "world_size": dist.world_size, "data_dir": str(self.data.dir)}}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        multirun_job = self.run_dir.resolve() != (Path(cfg.run.root) / cfg.run.name).resolve()  # runs/<name>/<job>
        wandb_name = f"{cfg.run.name}/{self.run_dir.name}" if multirun_job else cfg.run.name
        return MetricsLogger(self.run_dir, cfg.wandb, wandb_name, wandb_config, wandb_id, start_step,
                             cfg.trainer.max_steps, enabled=dist.is_main)

    def resume(self, ckpt: checkpoint.Checkpoint) -> None:
        """Continue from a loaded checkpoint (every rank, the same file)."""
        self.state.load_state_dict(ckpt)
        self.summary.start_step = self.summary.step = self.state.step
        self.summary.best_val_loss, self.summary.checkpoint = self.state.best_val_loss, ckpt.path
        self.last_saved = self.state.step
        log.info("resumed from %s at step %d", ckpt.path, self.state.step)

    def train_step(self, stop: StopRequest) -> QueuedStep:
        """Queue one optimizer step on the device (forward/backward of this rank's micro-batches, DDP
        all-reduce, clip, optimizer step); nothing waits for the device. Its numbers are read later."""
        state = self.state
        lr = lr_at(state.step, *self.lr_args)
        for group in state.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = None
        for i, (x, y, *docs) in enumerate(state.sampler.next_batches()):  # docs: [cu_seqlens] with document_mask
            # DDP all-reduces gradients in the backward of this rank's last micro-batch only.
            sync = self.dist.world_size == 1 or i == self.micro_steps - 1
            with contextlib.nullcontext() if sync else self.run_model.no_sync():
                with autocast(self.device, self.dtype):
                    # return_logits=False: no (B, T, vocab) logits kept alive
                    _, loss = self.run_model(x, y, return_logits=False, docs=docs[0] if docs else None,
                                              check_docs=False)  # the sampler's, valid
                # DDP averages over ranks, so the gradient is the mean over all grad_accum micro-batches.
                if self.micro_steps > 1:  # (/ 1 would only add a kernel to the forward and one to the backward)
                    loss = loss / self.micro_steps
                state.scaler.scale(loss).backward()
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        stats = [loss_sum]
        if self.dist.world_size > 1:  # mean loss over ranks, and whether any rank got Ctrl-C/SIGTERM
            stop_flag = torch.full((), float(stop.signum is not None), device=self.device)  # no host sync
            reduced = torch.stack([loss_sum, stop_flag])
            all_reduce_sum(reduced, self.dist)
            stats = [reduced[0] / self.dist.world_size, reduced[1]]
        state.scaler.unscale_(state.optimizer)  # the scaler's calls return at once unless fp16 enabled it
        # After DDP's all-reduce the gradients, hence the norm, are the same on every rank.
        grad_norm = torch.nn.utils.clip_grad_norm_(state.model.parameters(), self.max_norm)
        state.scaler.step(state.optimizer)
        state.scaler.update()
        state.optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.tokens_seen += self.throughput.tokens_per_step
        stats = self._to_host(torch.stack([*stats, grad_norm.float()]))
        return QueuedStep(state.step, state.tokens_seen, lr, stats, self.timer.mark())

    def _to_host(self, stats: torch.Tensor) -> torch.Tensor:
        """The step's stats on the host. On CUDA a non-blocking copy into pinned memory, queued now, right behind
        this step's work: reading it later waits for this step only. (``stats.tolist()`` at read time would queue
        its copy behind every step queued since, and wait for all of them: the device would then idle while the
        host reads, logs and queues the next step.)"""
        if self.device.type != "cuda":
            return stats
        return torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True).copy_(stats, non_blocking=True)

    def _nan_remedies(self) -> str:
        """What may keep the loss finite, given this run's settings: the dtype only where a wider one exists."""
        remedies = ["a lower optim.lr", "more optim.warmup_steps"]
        if not self.cfg.optim.grad_clip:
            remedies.append("optim.grad_clip=1.0")
        wider = {torch.float16: "trainer.dtype=bf16 or fp32", torch.bfloat16: "trainer.dtype=fp32"}.get(self.dtype)
        if wider:
            remedies.append(wider)
        return ", ".join(remedies[:-1]) + " or " + remedies[-1]

    def read(self, queued: QueuedStep, since) -> tuple[dict, bool]:
        """Wait for a queued step's numbers (the host sync) and build its record; also returns the DDP stop vote.
        Raises NonFiniteLossError (on every rank alike: the loss is the job's mean)."""
        step_time_s = self.timer.seconds(since, queued.done)  # waits for the step's end (its stats copy included)
        train_loss, *stop_votes, grad_norm = queued.stats.tolist()
        if not math.isfinite(train_loss):
            raise NonFiniteLossError(
                f"training loss is {train_loss} at step {queued.step}; stopped without saving this step. "
                f"Last good checkpoint: {self.summary.checkpoint or 'none'}. Try {self._nan_remedies()}.")
        record = step_record(queued.step, queued.tokens_seen, train_loss, queued.lr, grad_norm, step_time_s,
                             self.throughput, self.device)
        return record, bool(stop_votes and stop_votes[0] > 0)

    def publish(self, record: dict) -> None:
        self.logger.log(record)
        self.summary.records.append(record)
        self.summary.step = record["step"]
        if self.on_step is not None:
            self.on_step(record)

    @torch.no_grad()
    def evaluate(self, stop: Optional[StopRequest] = None) -> Optional[float]:
        """Val loss now (see ``evaluate``); updates the best and final val loss. With one process, a stop request
        (`stop`) cuts the evaluation short: None, nothing updated. Under torchrun it runs to the end (the ranks
        would not agree on the batch to stop at)."""
        stop = stop if self.dist.world_size == 1 else None
        val = evaluate(self.eval_model, self.data, self.cfg, self.device, self.dtype, self.dist, stop)
        if val is None:
            return None
        s = self.summary
        s.final_val_loss, s.final_val_step = val, self.state.step
        self.state.best_val_loss = val if self.state.best_val_loss is None else min(self.state.best_val_loss, val)
        s.best_val_loss = self.state.best_val_loss
        return val

    def save(self) -> Path:
        """Rank 0 writes the checkpoint of this step with every rank's RNG and data streams; all ranks
        wait until it is complete. Raises CheckpointWriteError (rank 0) if the write fails."""
        state = self.state.state_dict()  # collective
        path = checkpoint.checkpoint_path(self.run_dir, self.state.step)
        if self.dist.is_main:
            self._check_folder()
            self.logger.sync()  # metrics.jsonl holds every step up to a checkpoint (rows W&B may lose)
            run_info = {"config": self.config_dict, "model_args": dataclasses.asdict(self.model_args),
                        "data_meta": self.data.meta, "attn_backend": self.model_args.attn}
            path = checkpoint.save_checkpoint(checkpoint.pack(state, run_info), self.run_dir, self.state.step,
                                              self.cfg.ckpt.keep_last)
            log.info("saved checkpoint %s", path)
        barrier(self.dist)  # the file is complete before any rank moves on
        self.summary.checkpoint, self.last_saved = path, self.state.step
        return path

    def _save_before_eval_error(self, record: dict) -> None:
        """One process: this step's metrics and checkpoint, before an error in its evaluation ends the run, so the
        steps trained since the last checkpoint are kept (the weights are sound: evaluation does not touch them).
        Under torchrun nothing is saved: the save is collective, and the other ranks may not have failed."""
        if self.dist.world_size != 1 or self.last_saved == self.state.step:
            return
        self.publish(record)
        try:
            path = self.save()
        except Exception as e:  # the error that ends the run is the first one; this one is only logged
            log.error("step %d: its evaluation failed, and saving its checkpoint failed too (%s: %s)",
                      self.state.step, type(e).__name__, e)
            return
        log.error("step %d: its evaluation failed; saved the step's checkpoint %s first (resume from it once the "
                  "cause is fixed)", self.state.step, path)

    def _check_folder(self) -> None:
        """Warn once if the run folder was deleted or replaced (e.g. ``rm -rf``) since the run started: the save
        would make a new one silently."""
        if self.folder_id is not None and _folder_id(self.run_dir) != self.folder_id:
            self.folder_id = None
            log.warning("run folder %s was deleted or replaced while this run trained: its checkpoints now go to a "
                        "new folder without the run's metrics.jsonl, train.log, .hydra/, W&B files and lock (another "
                        "process could start in it); the metrics of the steps since are not kept", self.run_dir)

    def fit(self) -> TrainSummary:
        """Train to trainer.max_steps (or a stop request). A plain step's numbers are read one step late,
        after the next step is queued, so the device never waits for the host between steps; steps that
        evaluate, save or stop are read at once (they need the model as of that step). The step time runs
        from one step's end on the device to the next one's; evaluation and saving are not step time."""
        cfg, state, summary, single = self.cfg, self.state, self.summary, self.dist.world_size == 1
        max_steps, eval_every, save_every = cfg.trainer.max_steps, cfg.eval.interval, cfg.ckpt.interval
        exit_code, agreed_failure = 1, False
        try:
            with StopRequest() as stop:
                self.run_model.train()
                if state.step >= max_steps:
                    log.info("the run is at step %d >= trainer.max_steps=%d: nothing to train "
                             "(raise trainer.max_steps to continue it)", state.step, max_steps)
                pending: Optional[QueuedStep] = None
                last_done = self.timer.mark()
                while state.step < max_steps:
                    queued = self.train_step(stop)
                    stop_vote = False  # DDP: a stop vote taken in a step reaches the host one step later
                    if pending is not None:
                        record, stop_vote = self.read(pending, last_done)
                        self.publish(record)
                        last_done, pending = pending.done, None
                    stop_now = stop_vote or (single and stop.signum is not None)
                    last = state.step == max_steps
                    evaluate_now = cfg.eval.iters > 0 and (last or _every(eval_every, state.step))
                    save_now = _every(save_every, state.step)
                    if not (stop_now or evaluate_now or save_now or last):
                        pending = queued
                        continue
                    record, vote = self.read(queued, last_done)
                    try:
                        val = self.evaluate(stop) if evaluate_now else None
                    except Exception:
                        self._save_before_eval_error(record)
                        raise
                    if val is not None:
                        record["val/loss"] = val
                        log.info("step %d: train loss %.4f, val loss %.4f", state.step, record["train/loss"], val)
                    elif evaluate_now:  # a scheduler's grace period is short: save now, not after eval.iters batches
                        log.info("step %d: evaluation cut short by the stop request (no val loss for this step)",
                                 state.step)
                    self.publish(record)
                    if save_now:
                        self.save()
                    last_done = self.timer.mark()
                    # One process: a signal that came during this step's evaluation, on_step or save stops here.
                    stop_now = stop_now or vote or (single and stop.signum is not None)
                    if stop_now and state.step < max_steps:  # a stop on the last step is just the end
                        summary.stop_reason, summary.stop_signal = "interrupted", stop.signum or signal.SIGTERM
                        break
                if self.last_saved != state.step:
                    self.save()
            exit_code = 0
        except NonFiniteLossError:
            agreed_failure = True  # raised by every rank at the same step; its caller reports it (train.py logs it)
            raise
        except KeyboardInterrupt:  # in the loop it is a second Ctrl-C (StopRequest took the first)
            raise TrainingAborted from None
        finally:
            self._close(exit_code, agreed_failure)
        return summary

    def _close(self, exit_code: int, agreed_failure: bool) -> None:
        s = self.summary
        self.logger.summary({"final_val_loss": s.final_val_loss, "best_val_loss": s.best_val_loss})
        self.logger.close(exit_code)
        if agreed_failure:
            barrier(self.dist)  # rank 0 closes W&B before any rank exits and torchrun stops the others
        if exit_code != 0:
            return
        if s.final_val_loss is not None:  # "last": an interrupted run has more steps to go
            log.info("%s val loss %.4f (step %d)", "last" if s.stop_reason == "interrupted" else "final",
                     s.final_val_loss, s.final_val_step)


def model_config(cfg: DictConfig, data_vocab: int, backend: str) -> GPTConfig:
    """The GPT of ``cfg.model`` (every key that is a GPTConfig field) for a tokenizer of ``data_vocab`` tokens and a
    resolved backend."""
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    model = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if k in fields}  # attn_window: a plain list
    return GPTConfig(**{**model, "vocab_size": padded_vocab_size(cfg, data_vocab), "attn": backend})


TRAINING_BYTES_PER_PARAM = 16  # fp32 weight, gradient and AdamW's two moments


def min_params(args: GPTConfig) -> int:
    """The GPT's parameters without biases and layer norms (a lower bound of ``GPT(args)``'s count)."""
    E, L = args.n_embd, args.n_layer
    attn = E * E * (2 + 2 * args.kv_heads / args.n_head)  # q and output projections; k and v (GQA: fewer)
    mlp = (3 if args.mlp == "swiglu" else 2) * E * mlp_width(E, args.mlp, args.mlp_hidden, args.multiple_of)
    tables = args.vocab_size * (1 if args.tie_embeddings else 2) + (args.block_size if args.pos_emb == "learned" else 0)
    return int(E * tables + L * (attn + mlp))  # embeddings (and head), blocks


def kept_per_token(args: GPTConfig) -> int:
    """Values a token that one block keeps for its backward at least, whatever the backend and compile: its input
    (n_embd), q, k and v (n_embd + 2 * the k/v width), the attention output (n_embd; every attention backward reads
    it or recomputes more) and the MLP's up-projection output (its hidden width; SwiGLU's gate and up: twice).
    Matmul outputs are saved rather than recomputed; norms, activations and dropout masks are not counted."""
    kv_width = args.n_embd * args.kv_heads // args.n_head
    hidden = mlp_width(args.n_embd, args.mlp, args.mlp_hidden, args.multiple_of)
    return 3 * args.n_embd + 2 * kv_width + hidden * (2 if args.mlp == "swiglu" else 1)


def check_memory(args: GPTConfig, device: torch.device, tokens: int = 0,
                 dtype: torch.dtype = torch.bfloat16) -> None:
    """Refuse (ConfigError) a run whose parameters, with their gradients and AdamW state, plus the logits of one
    micro-batch of `tokens` tokens (two float32 copies: the log-softmax kept for the backward and its gradient; of
    one chunk with model.loss=chunked; one copy in the compute dtype with model.loss=fused), plus what each
    block keeps for the backward at least (``kept_per_token``, in the compute `dtype`, 2 bytes at least), need
    more than the device's memory
    (``trainer.runtime.device_memory``). All three are lower bounds (``min_params``; no other activations), so a run
    that fits is never refused. Catches e.g. a mistyped model.vocab_size or a batch far too large before an
    allocator error or the out-of-memory killer does."""
    params, memory = min_params(args), device_memory(device)
    per_value = max(torch.finfo(dtype).bits // 8, 2)
    # (rows, bytes a value) of the logits alive at once: for full and chunked the float32 log-softmax and its
    # gradient in the backward (one copy measured 3x short of a CPU run's peak), for fused one in the compute dtype
    loss = resolve_loss(args.loss, device.type)
    logit_rows, logit_bytes = {"full": (tokens, 8), "chunked": (min(tokens, CHUNK_TOKENS), 8),
                               "fused": (tokens, per_value)}[loss]
    weights, logits = params * TRAINING_BYTES_PER_PARAM, logit_rows * args.vocab_size * logit_bytes
    hidden = mlp_width(args.n_embd, args.mlp, args.mlp_hidden, args.multiple_of)
    per_token = args.n_layer * kept_per_token(args) * per_value  # activation bytes a token keeps, all layers
    activations = tokens * per_token
    if memory and weights + logits + activations > memory:
        gib = lambda n: f"{n / 2**30:,.3g}" if n < 10 * 2**30 else f"{n / 2**30:,.0f}"  # 0.0123, not 0.0
        # a mistyped model size and a batch far too large read differently: the model is the culprit when not even
        # one token's logits and activations fit beside it
        one_token = weights + args.vocab_size * logit_bytes + per_token
        culprit = ("the model is too large" if one_token > memory else
                   f"a micro-batch of {tokens:,} tokens (trainer.batch_size x model.block_size) is too large")
        raise ConfigError(
            f"{culprit} for {device}: {params:,} parameters (model.vocab_size={args.vocab_size}, "
            f"model.n_embd={args.n_embd}, model.n_layer={args.n_layer}, model.block_size={args.block_size}) need at "
            f"least {gib(weights)} GiB for weights, gradients and AdamW state ({TRAINING_BYTES_PER_PARAM} "
            f"bytes each), the logits of {logit_rows:,} tokens ({logit_bytes} bytes a value; model.loss={loss}; "
            f"a micro-batch is trainer.batch_size x block_size = {tokens:,}) {gib(logits)} GiB more, and what "
            f"each layer keeps for the backward (its input, q, k, v, the attention output and the MLP's hidden "
            f"layer, {hidden} wide) {gib(activations)} GiB more ({per_value} bytes a value), and it has "
            f"{gib(memory)} GiB; choose smaller values")


def _folder_id(folder: Path) -> Optional[tuple[int, int]]:
    try:
        st = folder.stat()
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _every(interval: int, step: int) -> bool:
    return bool(interval and step % interval == 0)


def _prepare_data(cfg: DictConfig, dist: DistInfo) -> PreparedData:
    """The token cache; under torchrun local rank 0 of each node builds it while the others wait."""
    data = prepare_data(cfg.data) if dist.local_rank == 0 else None
    barrier(dist)
    return data if data is not None else prepare_data(cfg.data)


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: PreparedData, cfg: DictConfig, device: torch.device,
             dtype: torch.dtype, dist: DistInfo = DistInfo(), stop: Optional[StopRequest] = None) -> Optional[float]:
    """Mean val loss over ``eval.iters`` batches from a fixed stream (the same batches at every
    evaluation, so values are comparable across steps and runs). Leaves global RNGs untouched.
    Under torchrun the batches are dealt out to the ranks (batch i to rank i % world_size) and the
    per-batch losses summed over ranks, so the value is the same for any number of processes.
    None, at the next batch, once ``stop`` holds a signal (one process only: no collective is skipped)."""
    sampler = BatchSampler(data.val, cfg.model.block_size, cfg.trainer.batch_size, cfg.seed + VAL_SEED_OFFSET,
                           device=device, doc_starts=data.val_docs if cfg.data.document_mask else None,
                           vocab_size=data.vocab_size, source=data.dir / "val.bin")
    model.eval()
    losses = torch.zeros(cfg.eval.iters, device=device)
    for i in range(cfg.eval.iters):
        if stop is not None and stop.signum is not None:
            model.train()
            return None
        if i % dist.world_size != dist.rank:
            sampler.skip_batch()
            continue
        x, y, *docs = sampler.next_batch()
        with autocast(device, dtype):
            _, loss = model(x, y, return_logits=False, docs=docs[0] if docs else None, check_docs=False)
        losses[i] = loss.float()
    model.train()
    all_reduce_sum(losses, dist)  # each entry is non-zero on one rank only: the sum is exact
    return losses.mean().item()
