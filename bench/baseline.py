"""The bare training loop that ``bench.throughput --baseline`` measures the trainer against.

Built from the trainer's own parts for a config (same GPT, initial weights, data streams, dtype/autocast,
torch.compile and its mode, FP8 layers, AdamW with the same parameter groups, fused on CUDA, same LR schedule), it does per
optimizer step only what nanoGPT's loop does: forward and backward of each micro-batch, gradient
clipping, optimizer step, zero_grad. The micro-batches are drawn beforehand and already on the device;
nothing is read back until the end. So the trainer's cost over this figure (metrics, DDP plumbing,
host work, memory) is the framework's own. One process (no DDP), no evaluation, no checkpoints.

Timing is the trainer's: a CUDA event (host time on the CPU) at the end of every step, and a step's time runs from
the previous step's end to its own, so the two loops' per-step times and their medians compare like for like.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable, Optional

import torch
from omegaconf import DictConfig

from data.prepare import prepare_data
from data.sampler import ShardedBatchSampler
from model.gpt import GPT
from trainer.compile import compile_model, convert_to_fp8
from trainer.config import config_backend, resolved_grad_accum, validate_against_data, validate_config
from trainer.loop import check_memory, model_config
from trainer.lr_schedule import lr_at
from trainer.metrics import StepTimer
from trainer.optim import build_optimizer
from trainer.runtime import autocast, seed_everything, select_device, select_dtype


def run_bare_loop(cfg: DictConfig, warmup: int, steps: int, on_step: Optional[Callable[[int], None]] = None) -> dict:
    """Train ``warmup`` untimed then ``steps`` timed optimizer steps of ``cfg``'s model (one process).

    on_step: called with the 0-based step index once each step is queued (e.g. ``torch.profiler``'s ``step``).
    Returns {"step_times_s": [seconds of each timed step, device time: end of the previous step to the end of
    this one (CUDA events, else host time)], "step_time_s": their median, "step_time_mean_s": their mean,
    "peak_mem_gib": max CUDA memory allocated since the model was built (None on CPU),
    "losses": [float train loss of every step], "tokens_per_step": int, "num_params": int,
    "flops_per_token": float}. Raises ConfigError for an invalid config or one that cannot fit the device's
    memory (the trainer's ``check_memory``), before any batch is made.
    """
    validate_config(cfg)
    device = select_device(cfg.trainer.device)
    dtype = select_dtype(cfg.trainer.dtype, device)
    data = prepare_data(cfg.data)
    validate_against_data(cfg, len(data.train), len(data.val), data.vocab_size)
    args = model_config(cfg, data.vocab_size, config_backend(cfg))
    check_memory(args, device, cfg.trainer.batch_size * args.block_size, dtype)
    grad_accum = resolved_grad_accum(cfg)
    sampler = ShardedBatchSampler(data.train, cfg.model.block_size, cfg.trainer.batch_size, cfg.seed, grad_accum,
                                  device=device, doc_starts=data.train_docs if cfg.data.document_mask else None)
    batches = [sampler.next_batches() for _ in range(warmup + steps)]  # on the device before timing
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    seed_everything(cfg.seed)
    model = GPT(args).to(device)
    if cfg.trainer.fp8:
        convert_to_fp8(model)
    optimizer = build_optimizer(model, cfg.optim, device)
    run_model = compile_model(model, cfg.trainer.compile_mode) if cfg.trainer.compile else model
    o = cfg.optim
    lrs = [lr_at(s, o.lr, o.warmup_steps, o.decay_steps, o.min_lr_ratio) for s in range(warmup + steps)]
    max_norm = o.grad_clip if o.grad_clip > 0 else math.inf
    timer, losses = StepTimer(device), []
    marks = [timer.mark()] if warmup == 0 else []  # the end of the step before each timed step, then each one's end
    for step, micro_batches in enumerate(batches):
        for group in optimizer.param_groups:
            group["lr"] = lrs[step]
        loss_sum = None
        for x, y, *docs in micro_batches:  # docs: [cu_seqlens] with data.document_mask
            with autocast(device, dtype):
                _, loss = run_model(x, y, return_logits=False, docs=docs[0] if docs else None, check_docs=False)
            if grad_accum > 1:  # as the trainer: no division by 1
                loss = loss / grad_accum
            loss.backward()
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss_sum)
        if step >= warmup - 1:
            marks.append(timer.mark())
        if on_step is not None:
            on_step(step)
    times = [timer.seconds(a, b) for a, b in zip(marks, marks[1:])]
    return {"step_times_s": times, "step_time_s": statistics.median(times), "step_time_mean_s": statistics.mean(times),
            "losses": torch.stack(losses).tolist(),
            "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            "tokens_per_step": cfg.trainer.batch_size * grad_accum * cfg.model.block_size,
            "num_params": model.num_params(), "flops_per_token": model.estimate_flops_per_token()}


if __name__ == "__main__":
    raise SystemExit("bench.baseline is the bare loop that `python -m bench.throughput --baseline` runs; it has no "
                     "command line of its own (see python -m bench.throughput --help)")
