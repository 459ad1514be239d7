"""Process-level runtime: rank/world size, device and dtype choice, autocast, seeding, RNG state.

``DistInfo`` reads torchrun's environment (multi-process DDP training, see trainer.distributed):
logging, W&B and checkpoint writes are done where ``is_main`` is true only.
"""

from __future__ import annotations

import contextlib
import os
import random
from dataclasses import dataclass

import numpy as np
import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NO_CUDA = "no CUDA GPU is available; use auto or cpu"  # the message for device 'cuda' without one (train.py, sample.py)


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int | None = None  # processes on this machine; None: world_size (one machine)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> "DistInfo":
        """Ranks and world sizes from torchrun's RANK / LOCAL_RANK / WORLD_SIZE / LOCAL_WORLD_SIZE (defaults: 0, 0,
        1, WORLD_SIZE)."""
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), world_size,
                   int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))


def select_device(name: str, dist: DistInfo = DistInfo()) -> torch.device:
    """'auto' -> cuda:<local_rank> if CUDA is available else cpu; 'cpu'; 'cuda' (errors without CUDA)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"trainer.device=cuda: {NO_CUDA}")
        device = torch.device("cuda", dist.local_rank)
        torch.cuda.set_device(device)
        return device
    if name == "cpu":
        return torch.device("cpu")
    raise ValueError(f"trainer.device={name!r}; accepted: auto, cpu, cuda")


def device_memory(device: torch.device) -> int | None:
    """Bytes of memory of ``device``: the GPU's total, or the machine's RAM for the CPU; None where unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf names on this system
        return None


def select_dtype(name: str, device: torch.device) -> torch.dtype:
    """Compute dtype for autocast: 'auto' = bf16 on CUDA (fp16 if the GPU has no bf16), fp32 on CPU."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return DTYPES[name]


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed-precision context: torch.autocast for bf16/fp16, nothing for fp32 (weights stay fp32)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def rng_state() -> dict:
    """Python, NumPy, torch CPU and CUDA generator states, in types torch.load(weights_only=True) reads."""
    np_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {**np_state, "state": {"key": np_state["state"]["key"].tolist(), "pos": np_state["state"]["pos"]}},
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_to_tuple(state["python"]))
    np_state = dict(state["numpy"])
    np_state["state"] = {"key": np.asarray(np_state["state"]["key"], dtype=np.uint32), "pos": np_state["state"]["pos"]}
    np.random.set_state(np_state)
    torch.set_rng_state(state["torch_cpu"])
    if state["torch_cuda"] and torch.cuda.is_available():
        if len(state["torch_cuda"]) != torch.cuda.device_count():
            # A different GPU count: restore what matches; exactness is then only per matching device.
            n = min(len(state["torch_cuda"]), torch.cuda.device_count())
            for i in range(n):
                torch.cuda.set_rng_state(state["torch_cuda"][i], i)
        else:
            torch.cuda.set_rng_state_all(state["torch_cuda"])


def _to_tuple(x):
    return tuple(_to_tuple(i) for i in x) if isinstance(x, (list, tuple)) else x
