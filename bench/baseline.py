"""The bare training loop that ``bench.throughput --baseline`` measures the trainer against.

Built from the trainer's own parts for a config (same GPT, initial weights, data streams, dtype/autocast,
torch.compile, AdamW with the same parameter groups, fused on CUDA, same LR schedule), it does per
optimizer step only what nanoGPT's loop does: forward and backward of each micro-batch, gradient
clipping, optimizer step, zero_grad. The micro-batches are drawn beforehand and already on the device;
nothing is read back until the end. So the trainer's cost over this figure (metrics, DDP plumbing,
host work, memory) is the framework's own. One process (no DDP), no evaluation, no checkpoints.
"""

from __future__ import annotations

import math

import torch
from omegaconf import DictConfig

from data.prepare import prepare_data
from data.sampler import ShardedBatchSampler
from model.attention import resolve_backend
from model.gpt import GPT
from trainer.config import resolved_grad_accum, validate_against_data, validate_config
from trainer.loop import model_config
from trainer.lr_schedule import lr_at
from trainer.metrics import StepTimer
from trainer.optim import build_optimizer
from trainer.runtime import autocast, seed_everything, select_device, select_dtype


def run_bare_loop(cfg: DictConfig, warmup: int, steps: int) -> dict:
    """Train ``warmup`` untimed then ``steps`` timed optimizer steps of ``cfg``'s model (one process).

    Returns {"step_time_s": mean seconds per timed step (device time: CUDA events, else host time),
    "peak_mem_gib": max CUDA memory allocated since the model was built (None on CPU),
    "losses": [float train loss of every step], "tokens_per_step": int, "num_params": int,
    "flops_per_token": float}. Raises ConfigError for an invalid config.
    """
    validate_config(cfg)
    device = select_device(cfg.trainer.device)
    dtype = select_dtype(cfg.trainer.dtype, device)
    data = prepare_data(cfg.data)
    validate_against_data(cfg, len(data.train), len(data.val), data.vocab_size)
    grad_accum = resolved_grad_accum(cfg)
    sampler = ShardedBatchSampler(data.train, cfg.model.block_size, cfg.trainer.batch_size, cfg.seed, grad_accum,
                                  device=device, doc_starts=data.train_docs if cfg.data.document_mask else None)
    batches = [sampler.next_batches() for _ in range(warmup + steps)]  # on the device before timing
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    seed_everything(cfg.seed)
    model = GPT(model_config(cfg, data.vocab_size, resolve_backend(cfg.attn.backend))).to(device)
    optimizer = build_optimizer(model, cfg.optim, device)
    run_model = torch.compile(model) if cfg.trainer.compile else model
    o = cfg.optim
    lrs = [lr_at(s, o.lr, o.warmup_steps, o.decay_steps, o.min_lr_ratio) for s in range(warmup + steps)]
    max_norm = o.grad_clip if o.grad_clip > 0 else math.inf
    timer, losses, start = StepTimer(device), [], None
    for step, micro_batches in enumerate(batches):
        if step == warmup:
            start = timer.mark()
        for group in optimizer.param_groups:
            group["lr"] = lrs[step]
        loss_sum = 0.0
        for x, y, *docs in micro_batches:  # docs: [cu_seqlens] with data.document_mask
            with autocast(device, dtype):
                _, loss = run_model(x, y, return_logits=False, docs=docs[0] if docs else None)
            loss = loss / grad_accum
            loss.backward()
            loss_sum = loss_sum + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss_sum)
    end = timer.mark()
    return {"step_time_s": timer.seconds(start, end) / steps, "losses": torch.stack(losses).tolist(),
            "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            "tokens_per_step": cfg.trainer.batch_size * grad_accum * cfg.model.block_size,
            "num_params": model.num_params(), "flops_per_token": model.estimate_flops_per_token()}

