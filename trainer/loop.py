"""The training loop: orchestrates config checks, data, model, optimizer, checkpoints and metrics.

``train(cfg)`` is the in-process entry point used by ``train.py`` (and by benchmarks / multi-GPU
launchers): it validates the config, prepares the data, builds or resumes the model, trains to
``trainer.max_steps`` and returns a ``TrainSummary`` with every per-step record it produced.
Under torchrun each rank runs it; the model is wrapped in DDP and the collectives are in
``trainer.distributed`` (no-ops for one process).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel

from data.prepare import PreparedData, prepare_data
from data.sampler import BatchSampler, ShardedBatchSampler, rank_seed
from model.attention import resolve_backend
from model.gpt import GPT, GPTConfig
from trainer.checkpoint import (checkpoint_dir, checkpoint_path, clean_state_dict, latest_checkpoint,
                                list_checkpoints, load_checkpoint, save_checkpoint, step_of, unwrap_model)
from trainer.config import ConfigError, padded_vocab_size, validate_against_data, validate_config
from trainer.distributed import all_reduce_sum, barrier, broadcast_object, gather_objects, init_process_group
from trainer.lr_schedule import lr_at
from trainer.metrics import MetricsLogger, peak_flops
from trainer.optim import build_optimizer
from trainer.runtime import DistInfo, autocast, rng_state, seed_everything, select_device, select_dtype, set_rng_state

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


class _StopRequest:
    """First Ctrl-C / SIGTERM: finish the current step, save, exit cleanly. Second Ctrl-C: abort now."""

    def __init__(self):
        self.signum: Optional[int] = None
        self._previous: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        log.warning("received %s: stopping after this step and saving a checkpoint (Ctrl-C again to abort)",
                    signal.Signals(signum).name)


def train(cfg: DictConfig, run_dir: Optional[Path] = None,
          on_step: Optional[Callable[[dict], None]] = None) -> TrainSummary:
    """Train (or resume) the run described by ``cfg`` (the composed config, see conf/config.yaml).

    run_dir: the run folder; default ``<run.root>/<run.name>``. on_step: called with each per-step
    record. Raises ConfigError for invalid values (before any data or model work), CheckpointError
    for a missing/corrupt checkpoint, NonFiniteLossError for a NaN/inf loss (the previous checkpoint
    is left as the latest). Give ``run.name`` explicitly when calling this several times in one
    process: the default name is a timestamp resolved once per process.

    Under torchrun (WORLD_SIZE > 1) every rank calls this: it joins the process group (NCCL on
    CUDA, gloo on CPU) unless one exists, and leaves it up for later calls
    (``trainer.distributed.destroy_process_group`` ends it); takes rank 0's ``run.name`` and
    ``run_dir``; and trains with DDP, see README "Multi-GPU". Config errors are raised on every rank alike.
    """
    cfg = copy.deepcopy(cfg)
    OmegaConf.resolve(cfg)  # freeze interpolations (e.g. the timestamped run.name) once
    dist = DistInfo.from_env()
    validate_config(cfg, dist.world_size, dist.local_rank)
    backend = resolve_backend(cfg.attn.backend)
    device = select_device(cfg.trainer.device, dist)
    dtype = select_dtype(cfg.trainer.dtype, device)
    init_process_group(dist, device, cfg.trainer.dist_timeout_s)
    # One run folder for the job: rank 0's name (a default timestamp may differ per process).
    name, folder = broadcast_object((cfg.run.name, None if run_dir is None else str(run_dir)), dist)
    cfg.run.name = name
    run_dir = Path(folder) if folder is not None else Path(cfg.run.root) / cfg.run.name
    return _train(cfg, run_dir, on_step, dist, device, dtype, backend)


def _train(cfg: DictConfig, run_dir: Path, on_step: Optional[Callable[[dict], None]], dist: DistInfo,
           device: torch.device, dtype: torch.dtype, backend: str) -> TrainSummary:
    ckpt, ckpt_path = _resume_checkpoint(cfg, run_dir)  # every rank reads it, onto the CPU
    data = _prepare_data(cfg, dist)
    validate_against_data(cfg, len(data.train), len(data.val), data.vocab_size)
    model_args = GPTConfig(
        block_size=cfg.model.block_size, vocab_size=padded_vocab_size(cfg, data.vocab_size),
        n_layer=cfg.model.n_layer, n_head=cfg.model.n_head, n_kv_head=cfg.model.n_kv_head,
        n_embd=cfg.model.n_embd, dropout=cfg.model.dropout, bias=cfg.model.bias, attn=backend,
        attn_window=OmegaConf.to_container(cfg.model)["attn_window"])  # an int or a plain list
    if ckpt is not None:
        _check_resume_compatible(ckpt, ckpt_path, model_args, data, cfg)

    seed_everything(cfg.seed)
    model = GPT(model_args).to(device)  # the same initial weights on every rank
    if dist.world_size > 1:
        # but each rank its own dropout masks, from a seed no data stream uses (so masks and batches are independent)
        seed_everything(rank_seed(cfg.seed, dist.rank, DROPOUT_SEED_PURPOSE))
    optimizer = build_optimizer(model, cfg.optim, device)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    grad_accum = cfg.trainer.grad_accum
    micro_steps = grad_accum // dist.world_size  # micro-batches per step on this rank
    sampler = ShardedBatchSampler(data.train, cfg.model.block_size, cfg.trainer.batch_size, cfg.seed,
                                  grad_accum, dist.rank, dist.world_size, device,
                                  doc_starts=data.train_docs if cfg.data.document_mask else None)
    step, tokens_seen, best_val, wandb_id = 0, 0, None, None
    if ckpt is not None:
        model.load_state_dict(clean_state_dict(ckpt["model"]))
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        fresh = sampler.load_state_dict(ckpt["sampler"])
        if fresh:
            log.warning("trainer.grad_accum changed on resume (%d -> %d): micro-batch streams %s start new",
                        ckpt["sampler"]["num_shards"], grad_accum, fresh)
        step, tokens_seen = ckpt["step"], ckpt["tokens_seen"]
        best_val = ckpt.get("best_val_loss")
        if ckpt_path.resolve().parent == checkpoint_dir(run_dir).resolve():  # same run: continue its W&B run
            wandb_id = ckpt.get("wandb_run_id")
        log.info("resumed from %s at step %d", ckpt_path, step)
        if ckpt["world_size"] != dist.world_size:
            log.warning("checkpoint of a %d-process job, resumed with %d processes: the data stream continues "
                        "exactly; per-process random streams (dropout) do not", ckpt["world_size"], dist.world_size)

    tokens_per_step = cfg.trainer.batch_size * grad_accum * cfg.model.block_size  # whole job
    flops_per_token = model.estimate_flops_per_token()
    peak = peak_flops(device, cfg.trainer.peak_flops)  # this GPU's
    peaks = gather_objects(peak, dist)  # every GPU's (on rank 0), for the job's MFU
    job_peak = broadcast_object(sum(peaks) if dist.is_main and None not in peaks else None, dist)
    log.info("attention backend: %s (attn=%s) | device %s | dtype %s | %.2fM parameters | %d tokens/step",
             backend, cfg.attn.backend, device, str(dtype).removeprefix("torch."), model.num_params() / 1e6,
             tokens_per_step)
    if dist.world_size > 1:
        log.info("DDP: %d processes (%s), %d micro-batch(es) of %d sequences per process per step",
                 dist.world_size, torch.distributed.get_backend(), micro_steps, cfg.trainer.batch_size)
    log.info("run folder: %s", run_dir.resolve())
    ddp_model = model
    if dist.world_size > 1:
        ddp_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    run_model = torch.compile(ddp_model) if cfg.trainer.compile else ddp_model
    # Evaluation runs outside DDP (ranks may do unequal numbers of val batches; no collectives in forward).
    eval_model = run_model if dist.world_size == 1 else torch.compile(model) if cfg.trainer.compile else model

    config_dict = OmegaConf.to_container(cfg, resolve=True)
    wandb_config = {**config_dict, "resolved": {
        "attn_backend": backend, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        "vocab_size": model_args.vocab_size, "num_params": model.num_params(), "tokens_per_step": tokens_per_step,
        "world_size": dist.world_size, "data_dir": str(data.dir)}}
    run_dir.mkdir(parents=True, exist_ok=True)
    default_dir = Path(cfg.run.root) / cfg.run.name
    multirun_job = run_dir.resolve() != default_dir.resolve()  # e.g. runs/<name>/<job number>
    wandb_name = f"{cfg.run.name}/{run_dir.name}" if multirun_job else cfg.run.name
    logger = MetricsLogger(run_dir, cfg.wandb, wandb_name, wandb_config, wandb_id, step,
                           cfg.trainer.max_steps, enabled=dist.is_main)
    summary = TrainSummary(run_dir, backend, step, step, "max_steps", best_val_loss=best_val,
                           wandb_run_id=logger.wandb_id, num_params=model.num_params(),
                           tokens_per_step=tokens_per_step, checkpoint=ckpt_path)

    def save() -> Path:
        """Rank 0 writes the checkpoint with every rank's RNG and sampler state; all ranks wait for it."""
        per_rank = gather_objects({"rng": rng_state(), "sampler": sampler.state_dict()}, dist)
        path = checkpoint_path(run_dir, step)
        if dist.is_main:
            state = {
                "model": clean_state_dict(unwrap_model(model).state_dict()),
                "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                "step": step, "tokens_seen": tokens_seen, "best_val_loss": best_val,
                "world_size": dist.world_size, "rng": [r["rng"] for r in per_rank],  # index = rank
                "sampler": ShardedBatchSampler.merge_states([r["sampler"] for r in per_rank]),
                "config": config_dict, "model_args": dataclasses.asdict(model_args), "data_meta": data.meta,
                "attn_backend": backend, "wandb_run_id": logger.wandb_id, "torch_version": str(torch.__version__),
            }
            path = save_checkpoint(state, run_dir, step, cfg.ckpt.keep_last)
            log.info("saved checkpoint %s", path)
        barrier(dist)  # the file is complete before any rank moves on
        return path

    if ckpt is not None:
        rngs = ckpt["rng"]
        if dist.rank < len(rngs):  # last, so nothing above consumes random numbers after the restore
            set_rng_state(rngs[dist.rank])
        del ckpt
    last_saved = step if ckpt_path is not None else None

    def mark():
        """When the device finishes the work queued so far: a CUDA event, or the time now (CPU work is synchronous)."""
        if device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(start, end) -> float:
        if device.type != "cuda":
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def run_step(lr: float, stop: "_StopRequest") -> torch.Tensor:
        """Queue one optimizer step on the device; returns its numbers, (loss, [stop vote,] grad norm), unread."""
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        for i, (x, y, *docs) in enumerate(sampler.next_batches()):  # docs: [cu_seqlens] with data.document_mask
            # DDP all-reduces gradients in the backward of this rank's last micro-batch only.
            sync = dist.world_size == 1 or i == micro_steps - 1
            with contextlib.nullcontext() if sync else ddp_model.no_sync():
                with autocast(device, dtype):
                    _, loss = run_model(x, y, *docs)
                # DDP averages over ranks, so the gradient is the mean over all grad_accum micro-batches.
                loss = loss / micro_steps
                scaler.scale(loss).backward()
            loss_sum += loss.detach()
        stats = [loss_sum]
        if dist.world_size > 1:  # mean loss over ranks, and whether any rank got Ctrl-C/SIGTERM
            stop_flag = torch.full((), float(stop.signum is not None), device=device)  # no host sync
            reduced = torch.stack([loss_sum, stop_flag])
            all_reduce_sum(reduced, dist)
            stats = [reduced[0] / dist.world_size, reduced[1]]
        scaler.unscale_(optimizer)
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
        # After DDP's all-reduce the gradients, hence the norm, are the same on every rank.
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return torch.stack([*stats, grad_norm.float()])

    def read(queued: tuple, since) -> tuple[dict, bool]:
        """Wait for a queued step's numbers (the host sync) and build its record; also returns the stop vote."""
        done_step, done_tokens, lr, stats, done = queued
        train_loss, *stop_votes, grad_norm = stats.tolist()
        if not math.isfinite(train_loss):  # the same value on every rank: all stop together
            raise NonFiniteLossError(
                f"training loss is {train_loss} at step {done_step}; stopped without saving this step. "
                f"Last good checkpoint: {summary.checkpoint or 'none'}. Try a lower optim.lr, "
                "more optim.warmup_steps, optim.grad_clip, or trainer.dtype=bf16/fp32.")
        dt = seconds(since, done)
        record = {"step": done_step, "tokens_seen": done_tokens, "train/loss": train_loss, "train/lr": lr,
                  "train/grad_norm": grad_norm, "perf/step_time_ms": dt * 1e3,
                  "perf/tokens_per_s": tokens_per_step / dt,
                  "perf/tokens_per_s_per_gpu": tokens_per_step / dt / dist.world_size,
                  "perf/mfu": flops_per_token * tokens_per_step / dt / job_peak if job_peak else None,
                  "perf/mfu_per_gpu": flops_per_token * tokens_per_step / dist.world_size / dt / peak
                  if peak else None,
                  "perf/peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30
                  if device.type == "cuda" else None}
        return record, bool(stop_votes and stop_votes[0] > 0)

    def publish(record: dict) -> None:
        logger.log(record)
        summary.records.append(record)
        summary.step = record["step"]
        if on_step is not None:
            on_step(record)

    exit_code, agreed_failure = 1, False
    try:
        with _StopRequest() as stop:
            run_model.train()
            if step >= cfg.trainer.max_steps:
                log.info("the run is already at step %d = trainer.max_steps: nothing to train "
                         "(raise trainer.max_steps to continue it)", step)
            # A plain step's numbers are read one step late, after the next step is queued, so the device never
            # waits for the host between steps. Steps that evaluate, save or stop are read at once (they need the
            # model as of that step). The step time runs from one step's end on the device to the next one's.
            pending: Optional[tuple] = None
            last_done = mark()
            while step < cfg.trainer.max_steps:
                lr = lr_at(step, cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.decay_steps, cfg.optim.min_lr_ratio)
                stats = run_step(lr, stop)
                step += 1
                tokens_seen += tokens_per_step
                queued = (step, tokens_seen, lr, stats, mark())
                # DDP: a stop vote taken in a step reaches the host one step later, on every rank alike.
                stop_vote = False
                if pending is not None:
                    record, stop_vote = read(pending, last_done)
                    last_done = pending[-1]
                    pending = None
                    publish(record)
                stop_now = stop_vote or (dist.world_size == 1 and stop.signum is not None)
                evaluate_now = step == cfg.trainer.max_steps or bool(cfg.eval.interval and step % cfg.eval.interval == 0)
                save_now = bool(cfg.ckpt.interval and step % cfg.ckpt.interval == 0)
                if not (stop_now or evaluate_now or save_now):
                    pending = queued
                    continue
                record, vote = read(queued, last_done)
                stop_now = stop_now or vote
                if evaluate_now:
                    val = evaluate(eval_model, data, cfg, device, dtype, dist)
                    record["val/loss"] = val
                    summary.final_val_loss, summary.final_val_step = val, step
                    best_val = val if best_val is None else min(best_val, val)
                    summary.best_val_loss = best_val
                    log.info("step %d: train loss %.4f, val loss %.4f", step, record["train/loss"], val)
                publish(record)
                if save_now:
                    summary.checkpoint, last_saved = save(), step
                last_done = mark()  # evaluation and saving are not step time
                # One process: a signal that came during this step's evaluation, on_step or save stops here.
                stop_now = stop_now or (dist.world_size == 1 and stop.signum is not None)
                if stop_now and step < cfg.trainer.max_steps:  # a stop on the last step is just the end
                    summary.stop_reason = "interrupted"
                    summary.stop_signal = stop.signum or signal.SIGTERM
                    break
            if last_saved != step:
                summary.checkpoint, last_saved = save(), step
        exit_code = 0
    except NonFiniteLossError as e:
        log.error("%s", e)
        agreed_failure = True  # raised by every rank at the same step
        raise
    finally:
        logger.summary({"final_val_loss": summary.final_val_loss, "best_val_loss": summary.best_val_loss})
        logger.close(exit_code)
        if agreed_failure:
            barrier(dist)  # rank 0 closes W&B before any rank exits and torchrun stops the others
    if summary.final_val_loss is not None:
        log.info("final val loss %.4f (step %d)", summary.final_val_loss, summary.final_val_step)
    if summary.stop_reason == "interrupted":
        log.info("interrupted at step %d; resume with the same run.name=%s", step, cfg.run.name)
    return summary


def _prepare_data(cfg: DictConfig, dist: DistInfo) -> PreparedData:
    """The token cache; under torchrun local rank 0 of each node builds it while the others wait."""
    data = prepare_data(cfg.data) if dist.local_rank == 0 else None
    barrier(dist)
    return data if data is not None else prepare_data(cfg.data)


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: PreparedData, cfg: DictConfig, device: torch.device,
             dtype: torch.dtype, dist: DistInfo = DistInfo()) -> float:
    """Mean val loss over ``eval.iters`` batches from a fixed stream (the same batches at every
    evaluation, so values are comparable across steps and runs). Leaves global RNGs untouched.
    Under torchrun the batches are dealt out to the ranks (batch i to rank i % world_size) and the
    per-batch losses summed over ranks, so the value is the same for any number of processes."""
    sampler = BatchSampler(data.val, cfg.model.block_size, cfg.trainer.batch_size, cfg.seed + VAL_SEED_OFFSET,
                           device=device, doc_starts=data.val_docs if cfg.data.document_mask else None)
    model.eval()
    losses = torch.zeros(cfg.eval.iters, device=device)
    for i in range(cfg.eval.iters):
        if i % dist.world_size != dist.rank:
            sampler.skip_batch()
            continue
        x, y, *docs = sampler.next_batch()
        with autocast(device, dtype):
            _, loss = model(x, y, *docs)
        losses[i] = loss.float()
    model.train()
    all_reduce_sum(losses, dist)  # each entry is non-zero on one rank only: the sum is exact
    return losses.mean().item()


def _resume_checkpoint(cfg: DictConfig, run_dir: Path) -> tuple[Optional[dict], Optional[Path]]:
    """Apply the ``resume`` policy: auto (latest in the run folder, if any), never, or a file path."""
    existing = list_checkpoints(run_dir)
    if cfg.resume == "never":
        if existing:
            raise ConfigError(f"resume=never: run folder {run_dir} already has checkpoints ({existing[-1].name}); "
                              "use a new run.name, or resume=auto to continue it")
        return None, None
    if cfg.resume == "auto":
        path = latest_checkpoint(run_dir)
        return (load_checkpoint(path), path) if path is not None else (None, None)
    path = Path(cfg.resume)
    ckpt = load_checkpoint(path)
    newer = [p for p in existing if p.resolve() != path.resolve() and step_of(p) > ckpt["step"]]
    if newer:
        raise ConfigError(f"resume={path}: run folder {run_dir} has newer checkpoints ({newer[-1].name}) that "
                          "resuming an older step would mix with; use a new run.name")
    return ckpt, path


def _check_resume_compatible(ckpt: dict, path: Path, model_args: GPTConfig, data: PreparedData,
                             cfg: DictConfig) -> None:
    # A key an older checkpoint lacks (e.g. attn_window) had the default value then.
    old = {k: v for k, v in {**dataclasses.asdict(GPTConfig()), **ckpt["model_args"]}.items() if k != "attn"}
    new = {k: v for k, v in dataclasses.asdict(model_args).items() if k != "attn"}
    diffs = [f"model.{k}: checkpoint {old.get(k)!r}, config {new[k]!r}" for k in new if old.get(k) != new[k]]
    old_meta = ckpt.get("data_meta", {})
    for k in ("tokenizer", "encoding", "chars", "vocab_size"):
        if old_meta.get(k) != data.meta.get(k):
            diffs.append(f"data tokenizer {k}: checkpoint {old_meta.get(k)!r}, config {data.meta.get(k)!r}")
    if diffs:
        raise ConfigError(f"cannot resume from {path}: the model or tokenizer differs:\n  " + "\n  ".join(diffs))
    changed = _changed_settings(ckpt["config"], OmegaConf.to_container(cfg, resolve=True))
    if changed:
        log.info("resuming with changed settings: %s", "; ".join(changed))
    if ckpt.get("attn_backend") != model_args.attn:
        log.info("attention backend changed on resume: %s -> %s", ckpt.get("attn_backend"), model_args.attn)


def _changed_settings(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changed_settings(a, b, f"{prefix}{k}.")
        elif a != b and f"{prefix}{k}" not in ("resume",):
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out
