"""Multi-process training with torchrun and PyTorch DDP: the thin layer around ``torch.distributed``.

torchrun starts one process per GPU (or per CPU worker) and gives each RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT (read by ``trainer.runtime.DistInfo``). This module:

- ``torchrun_overrides``: run by train.py before the config is composed. Every rank gets the same default
  ``run.name`` (rank 0's default name, handed over through torchrun's TCPStore), so a job makes one run
  folder whatever the clocks say (rank 0 alone writes it).
- ``init_process_group``: joins the job's process group (NCCL on CUDA, gloo on CPU) with a finite
  collective timeout (``trainer.dist_timeout_s``).
- the few collectives the loop needs; each is the identity for a single process, so the
  single-process path runs no torch.distributed code at all.
"""

from __future__ import annotations

import datetime
from typing import Any, Optional

import torch
import torch.distributed as tdist

from trainer.config import default_run_name
from trainer.runtime import DistInfo

RUN_NAME_KEY = "flash_gpt/run_name"


def torchrun_overrides(args: list[str], dist: Optional[DistInfo] = None) -> list[str]:
    """Command-line overrides ``args`` plus ``run.name=<rank 0's default name>`` for a torchrun rank when
    ``args`` do not set ``run.name``; ``args`` unchanged for one process."""
    dist = dist or DistInfo.from_env()
    if dist.world_size == 1 or any(a.lstrip("+").startswith("run.name=") for a in args):
        return list(args)
    return list(args) + [f"run.name={shared_run_name(dist)}"]


def shared_run_name(dist: DistInfo) -> str:
    """Rank 0's default run name (``default_run_name``), the same string on every rank. Uses the c10d
    TCPStore of torchrun's rendezvous (MASTER_ADDR/MASTER_PORT), as init_process_group would."""
    store, _, _ = next(tdist.rendezvous("env://", rank=dist.rank, world_size=dist.world_size))
    if dist.is_main:
        store.set(RUN_NAME_KEY, default_run_name())
    return store.get(RUN_NAME_KEY).decode()  # waits for rank 0 (store timeout: 30 min)


def init_process_group(dist: DistInfo, device: torch.device, timeout_s: float) -> None:
    """Join the torchrun job's process group, unless there is one process or the group exists
    (an earlier ``train`` call in this process, or the caller's own). Backend: NCCL for CUDA
    devices, gloo for CPU. A collective that waits longer than ``timeout_s`` raises instead of
    hanging. The group stays up for later ``train`` calls (a sweep, ``train.py -m``, runs several jobs in one
    process); ``destroy_process_group`` ends it (train.py does at exit)."""
    if dist.world_size > 1 and not tdist.is_initialized():
        cuda = device.type == "cuda"
        tdist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s),
                                 device_id=device if cuda else None)


def destroy_process_group() -> None:
    """End the process group if there is one. Call after a normal finish only: after an error the
    process just exits non-zero and torchrun stops the other ranks."""
    if tdist.is_initialized():
        tdist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, dist: DistInfo) -> torch.Tensor:
    """Element-wise sum of ``t`` over all ranks, in place; returns ``t``."""
    if dist.world_size > 1:
        tdist.all_reduce(t, op=tdist.ReduceOp.SUM)
    return t


def broadcast_object(obj: Any, dist: DistInfo) -> Any:
    """Rank 0's ``obj`` (picklable), on every rank."""
    if dist.world_size == 1:
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj: Any, dist: DistInfo) -> Optional[list]:
    """[obj of rank 0, obj of rank 1, ...] on rank 0, None on the other ranks."""
    if dist.world_size == 1:
        return [obj]
    out = [None] * dist.world_size if dist.is_main else None
    tdist.gather_object(obj, out, dst=0)
    return out


def barrier(dist: DistInfo) -> None:
    """Wait until every rank got here (e.g. until rank 0 finished writing a file)."""
    if dist.world_size > 1:
        tdist.barrier()
