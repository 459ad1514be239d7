"""Shared pytest set-up.

Without a CUDA GPU the Triton kernels run through Triton's interpreter, which must be switched on before
`kernels` is first imported (Triton reads TRITON_INTERPRET when it decorates the kernels).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
