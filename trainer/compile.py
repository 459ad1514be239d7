"""How the training model runs fast: FP8 linear layers (torchao) and torch.compile, the same for the trainer and
for the bare loop it is measured against (``bench.baseline``).

- ``trainer.fp8``: torchao's float8 training (``torchao.float8.convert_to_float8_training``, tensorwise scaling:
  e4m3 weights and activations, e5m2 gradients, float32 master weights) on every ``nn.Linear`` whose two sizes are
  multiples of 16: the attention projections, the MLP and the output head. Needs a GPU of compute capability 8.9
  or newer (``torch._scaled_mm``) and torchao; without torch.compile its casts are slow. With ``model.loss``
  chunked or fused the head stays in the autocast dtype (that loss uses its weight directly).
- ``trainer.compile_mode``: torch.compile's ``mode`` (``default`` = none given).
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import torch

COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead")
FP8_MIN_CAPABILITY = (8, 9)  # Ada, Hopper and newer have FP8 tensor cores


def fp8_unavailable(on_cuda: bool) -> Optional[str]:
    """Why trainer.fp8 cannot run on the chosen device (``on_cuda``: the run uses a CUDA GPU): no CUDA GPU, no
    torchao, a GPU without FP8; or None."""
    if not on_cuda or not torch.cuda.is_available():
        return "needs a CUDA GPU with FP8 tensor cores (compute capability 8.9+)"
    if importlib.util.find_spec("torchao") is None:
        return "needs torchao (pip install torchao)"
    capability = torch.cuda.get_device_capability()
    if capability < FP8_MIN_CAPABILITY:
        return f"needs compute capability 8.9+ for FP8 matmuls; this GPU has {capability[0]}.{capability[1]}"
    return None


def fp8_eligible(module: torch.nn.Module, fqn: str = "") -> bool:
    """The linear layers trainer.fp8 converts: FP8 matmuls need both sizes to be multiples of 16."""
    return isinstance(module, torch.nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_to_fp8(model: torch.nn.Module) -> int:
    """Swap ``model``'s eligible linear layers for torchao's Float8Linear in place (their weight parameters, hence
    weight tying, optimizer state and checkpoints, stay as they are). Returns how many were swapped."""
    from torchao.float8 import convert_to_float8_training

    count = sum(fp8_eligible(m) for m in model.modules())
    convert_to_float8_training(model, module_filter_fn=fp8_eligible)
    return count


def compile_model(model: torch.nn.Module, mode: str = "default") -> torch.nn.Module:
    """``torch.compile(model)`` with ``mode`` (one of COMPILE_MODES; 'default' passes none)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r}; accepted: {', '.join(COMPILE_MODES)}")
    return torch.compile(model, mode=None if mode == "default" else mode)
