"""Per-step metrics: ``step_record`` builds the record of an optimizer step, ``StepTimer`` times steps on
the device, ``MetricsLogger`` sends records to W&B, ``metrics.jsonl`` and a tqdm bar.

Record keys (None where not measured; ``val/loss`` only at steps that evaluate, added by the trainer):
    step, tokens_seen (whole job), train/loss (mean over all micro-batches of all ranks),
    train/lr, train/grad_norm (after DDP's all-reduce, before clipping),
    perf/step_time_ms (from the end of the previous step to the end of this one on the device: CUDA events on a
    GPU, host time on the CPU; evaluation and checkpointing excluded; on rank 0),
    perf/tokens_per_s (whole job), perf/tokens_per_s_per_gpu (job / number of processes),
    perf/mfu (whole job: model FLOP/s over the summed peak of all its GPUs),
    perf/mfu_per_gpu (rank 0's GPU: its share of the FLOP/s over its peak; equals perf/mfu when
    all GPUs are the same kind, as every rank does the same work in the same synchronised step),
    perf/peak_mem_gib (rank 0's GPU; CUDA only), val/loss (steps with an evaluation).
MFU is None on CPU or an unknown GPU. It follows nanoGPT: FLOPs/token (6N + 12 L H Q T) * tokens/s
/ peak FLOP/s (dense bf16 tensor-core peak per GPU from ``PEAK_FLOPS``, or ``trainer.peak_flops``).
Only rank 0 writes records (``MetricsLogger(enabled=...)``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch
from tqdm.auto import tqdm

from utils.atomic import atomic_write_text

log = logging.getLogger(__name__)

# Dense (no sparsity) bf16 tensor-core peak FLOP/s per GPU from vendor data sheets (V100, T4: fp16),
# matched by substring of the CUDA device name; the first match wins, so specific names come first.
PEAK_FLOPS = (
    ("H100 PCIe", 756e12), ("H200", 989e12), ("H100", 989e12), ("H800", 989e12),
    ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12),
    ("L40S", 362e12), ("L40", 181e12), ("L4", 121e12),
    ("RTX A6000", 155e12), ("4090", 165e12), ("3090", 71e12), ("V100", 125e12), ("T4", 65e12),
)


def peak_flops(device: torch.device, override: Optional[float] = None) -> Optional[float]:
    """Peak FLOP/s used for MFU: ``override`` if given; None on CPU or for a GPU not in the table."""
    if override:
        return float(override)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_FLOPS:
        if key in name:
            return flops
    log.warning("no peak FLOP/s known for GPU %r: MFU is not reported (set trainer.peak_flops)", name)
    return None


@dataclass(frozen=True)
class Throughput:
    """What turns a step time into throughput and MFU: tokens_per_step (whole job), world_size,
    flops_per_token (model.estimate_flops_per_token()), peak (this GPU's FLOP/s) and job_peak (summed
    over all GPUs of the job); the peaks are None on CPU or an unknown GPU."""
    tokens_per_step: int
    world_size: int
    flops_per_token: float
    peak: Optional[float]
    job_peak: Optional[float]


def step_record(step: int, tokens_seen: int, loss: float, lr: float, grad_norm: float, step_time_s: float,
                tp: Throughput, device: torch.device) -> dict:
    """The record of one optimizer step (keys in the module docstring); step_time_s in seconds."""
    tokens_per_s = tp.tokens_per_step / step_time_s
    flops_per_s = tp.flops_per_token * tokens_per_s  # whole job
    return {
        "step": step, "tokens_seen": tokens_seen, "train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm,
        "perf/step_time_ms": step_time_s * 1e3, "perf/tokens_per_s": tokens_per_s,
        "perf/tokens_per_s_per_gpu": tokens_per_s / tp.world_size,
        "perf/mfu": flops_per_s / tp.job_peak if tp.job_peak else None,
        "perf/mfu_per_gpu": flops_per_s / tp.world_size / tp.peak if tp.peak else None,
        "perf/peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }


Mark = Union[float, "torch.cuda.Event"]


class StepTimer:
    """Marks when the device finishes the work queued so far: a CUDA event (no host sync), or the host
    time on CPU (CPU work is synchronous). ``seconds(a, b)`` waits for mark b on CUDA."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self) -> Mark:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Mark, end: Mark) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class MetricsLogger:
    """Writes records to W&B (``wandb.init(mode=..., dir=run_dir, resume="allow")``), appends them to
    ``run_dir/metrics.jsonl`` and shows a progress bar. Does nothing unless ``enabled`` (rank 0).

    Resuming the W&B run ``wandb_id`` at ``start_step``, it logs again the rows of metrics.jsonl up to that step
    that the W&B run may lack: W&B's client writes its rows to the run's .wandb file every 15 s and at finish, so
    a killed process (``kill -9``) loses the rows of its last seconds, and W&B offers no call that writes them at a
    checkpoint. metrics.jsonl has them: its rows are flushed at once and fsynced before each checkpoint
    (``sync``). Online, W&B's ``starting_step`` (the first step its server lacks) bounds what is sent again;
    offline it is 0, so the resumed run's offline folder holds every step from 1.
    """

    def __init__(self, run_dir: Path, wandb_cfg, run_name: str, config: dict, wandb_id: Optional[str],
                 start_step: int, max_steps: int, enabled: bool = True):
        self.enabled = enabled
        self.run = None
        self.wandb_id = wandb_id
        self.jsonl_path = Path(run_dir) / "metrics.jsonl"
        self._jsonl = None
        if not enabled:
            return
        if wandb_cfg.mode != "disabled":  # disabled: no W&B import at all (it need not be installed)
            self._init_wandb(wandb_cfg, run_name, config, run_dir)
        _truncate_jsonl(self.jsonl_path, start_step)
        if self.run is not None and wandb_id is not None:  # the W&B run of the checkpoint continues
            self._resend(start_step)
        self._jsonl = open(self.jsonl_path, "a")
        self.bar = tqdm(total=max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                        mininterval=0.1 if sys.stderr.isatty() else 30.0)  # redirected output: fewer lines

    def _init_wandb(self, wandb_cfg, run_name: str, config: dict, run_dir: Path) -> None:
        import wandb

        try:
            self.run = wandb.init(
                project=wandb_cfg.project, entity=wandb_cfg.entity, group=wandb_cfg.group,
                tags=list(wandb_cfg.tags) or None, name=run_name, mode=wandb_cfg.mode, dir=str(run_dir),
                id=self.wandb_id, resume="allow", config=config,
                settings=wandb.Settings(console="off", silent=True),
            )
        except (wandb.errors.UsageError, wandb.errors.CommError) as e:  # e.g. online without a login
            from trainer.config import ConfigError

            raise ConfigError(f"wandb.mode={wandb_cfg.mode!r}: W&B could not start ({e}); run `wandb login`, "
                              "or use wandb.mode=offline (default, upload later with `wandb sync`) or disabled") from e
        self.wandb_id = self.run.id
        if wandb_cfg.mode == "offline":
            folder = Path(self.run.dir).parent
            log.info("W&B offline run %s in %s (upload later: wandb sync %s)", self.run.id, folder, folder)
        elif wandb_cfg.mode == "online":
            log.info("W&B run %s: %s", self.run.id, self.run.url)

    def _resend(self, start_step: int) -> None:
        first = getattr(self.run, "starting_step", 0) or 0
        rows = [r for r in _read_jsonl(self.jsonl_path) if first <= r["step"] <= start_step]
        for record in rows:
            self._log_wandb(record)
        if rows:
            log.info("W&B run %s: logged steps %d-%d again from metrics.jsonl, as on every resume (a process "
                     "that was killed may not have sent them all)", self.run.id, rows[0]["step"], rows[-1]["step"])

    def _log_wandb(self, record: dict) -> None:
        self.run.log({k: v for k, v in record.items() if v is not None and k != "step"}, step=record["step"])

    def sync(self) -> None:
        """Make the rows written so far durable (called before a checkpoint is saved)."""
        if self._jsonl is not None:
            os.fsync(self._jsonl.fileno())

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self.run is not None:
            self._log_wandb(record)
        postfix = {"loss": f"{record['train/loss']:.4f}"}
        if record.get("perf/tokens_per_s"):
            postfix["tok/s"] = f"{record['perf/tokens_per_s']:.0f}"
        if record.get("val/loss") is not None:
            postfix["val"] = f"{record['val/loss']:.4f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)

    def summary(self, values: dict) -> None:
        if self.run is not None:
            for k, v in values.items():
                if v is not None:
                    self.run.summary[k] = v

    def close(self, exit_code: int = 0) -> None:
        if self._jsonl is None:  # disabled rank, or already closed
            return
        self.bar.close()
        self._jsonl.close()
        self._jsonl = None
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None


def _read_jsonl(path: Path) -> list[dict]:
    """The readable records of a metrics.jsonl, in file order ([] if it does not exist)."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if _record_step(line) != math.inf]


def _truncate_jsonl(path: Path, start_step: int) -> None:
    """On resume, drop records past the checkpoint's step (they belong to steps that will be redone)."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [ln for ln in lines if _record_step(ln) <= start_step]
    if len(kept) != len(lines):
        atomic_write_text(path, "".join(kept))


def _record_step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf  # an unreadable (e.g. half-written) line is dropped
