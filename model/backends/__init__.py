"""The attention backends: one object per backend, in one table.

``REGISTRY`` maps each concrete backend's name to its ``Backend`` object (``base.py``), which carries what the
rest of the code asks about it (needs CUDA, dropout, windows, documents, logit soft-capping, head_dim range,
torch.compile on the CPU, packed qkv, split-K/V and static-shape decode) and its call forms (``attention``,
``qkvpacked_attention``, ``kv_attention``, ``split_kv_attention``, ``static_kv_attention``; contracts in
``Backend``'s docstring). Config validation, ``sample.py --attn``, the benchmarks and the tests derive their lists
from it. ``attn=auto`` is resolved once per model by ``resolve_backend``, and the model hands the object to its
layers.

Backends:
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``, PyTorch picks its kernel; every call form,
  dropout; windows and documents as a dense mask (slow); no logit soft-capping (SDPA has no score function).
- ``sdpa_flash`` / ``sdpa_cudnn``: SDPA pinned to PyTorch's FlashAttention-2 or cuDNN kernel (cuDNN: CUDA only).
- ``fa1`` / ``fa2`` / ``fa3``: the project's Triton FlashAttention-1 / -2 and Gluon FlashAttention-3 kernels
  (``kernels/``); no dropout; fa2 and fa3 do windows, documents and logit soft-capping in the kernel. Without a CUDA GPU they run under Triton's interpreter (very slow).
- ``flex``: PyTorch FlexAttention with block masks for windows and documents, a score_mod for soft-capping.

Modules:
base        the Backend base class, BackendUnavailableError, segment_ids, capability look-ups (a leaf)
sdpa        sdpa, sdpa_flash, sdpa_cudnn
triton      fa1, fa2, fa3: every use of the kernels package (their functions, head_dim range, fa3's device check)
flex        flex; flex_masks: its block masks and call (imported when it is loaded)

A new backend = a ``Backend`` subclass or instance, one entry in ``REGISTRY`` and a ``conf/attn/<name>.yaml``
(``backend: <name>``).
"""

import os

import torch
from torch.nn.attention import SDPBackend

from model.backends.base import Backend, BackendUnavailableError, backends_with, register, segment_ids
from model.backends.flex import FlexBackend
from model.backends.sdpa import PinnedSdpaBackend, SdpaBackend
from model.backends.triton import TritonBackend, fa1_kernels, fa2_kernels, fa3_kernels, fa3_runs

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels only run under Triton's interpreter, which Triton switches on when
    # `triton.language` is first imported; torch imports it too (building an optimizer does), possibly long
    # before fa1/fa2 is chosen (e.g. an sdpa job, then an fa2 job in one process). So set it now.
    os.environ.setdefault("TRITON_INTERPRET", "1")

REGISTRY: dict[str, Backend] = register(
    SdpaBackend(name="sdpa", description="PyTorch SDPA, PyTorch picks the kernel"),
    PinnedSdpaBackend(name="sdpa_flash", description="PyTorch SDPA pinned to its FlashAttention-2 kernel",
                      kernel=SDPBackend.FLASH_ATTENTION, cpu_dropout=False),  # PyTorch's CPU flash kernel: no dropout
    PinnedSdpaBackend(name="sdpa_cudnn", description="PyTorch SDPA pinned to cuDNN attention",
                      kernel=SDPBackend.CUDNN_ATTENTION, needs_cuda=True),
    TritonBackend(name="fa1", description="our Triton FlashAttention-1 kernel", load_kernels=fa1_kernels),
    TritonBackend(name="fa2", description="our Triton FlashAttention-2 kernel", load_kernels=fa2_kernels,
                  supports_window=True, supports_docs=True, supports_softcap=True, split_kv=True, static_decode=True),
    FlexBackend(name="flex", description="PyTorch FlexAttention with block masks (compiled on CUDA)"),
    TritonBackend(name="fa3", description="our FlashAttention-3 kernels (Gluon, Hopper); FA2's where they do not apply",
                  load_kernels=fa3_kernels, supports_window=True, supports_docs=True, supports_softcap=True, split_kv=True,
                  static_decode=True),
)
BACKENDS = ("auto", *REGISTRY)  # the values of attn.backend


def resolve_backend(name: str, head_dim: int | None = None, docs: bool = False, softcap: bool = False) -> Backend:
    """The backend object of ``name``. 'auto': without CUDA sdpa, or flex for logit soft-capping (``softcap``: sdpa
    has none, and flex runs on the CPU without Triton's interpreter). With CUDA:
    - fa3 where its Gluon kernels run forward and backward (``triton.fa3_runs``: an sm_90 GPU, a Triton they
      support, the model's head_dim one they take; None: not known), with or without document masks (``docs``);
    - at a head_dim where only the Gluon forward runs (256) and no document masks are needed: sdpa, whose cuDNN
      backward there is 2.0-2.6x FA2's that fa3 runs (H100, 2026-12-06); fa3 for soft-capping (sdpa has none;
      its Gluon forward is 1.1-1.4x fa2's);
    - else fa2 (with document masks at 256 too: sdpa would need a dense mask).
    fa3's kernels measured faster than fa2's in every dense cell, and in training GPT-2's blocks at context 8192
    with document masks 1.08-1.10x fa2's tokens/s on H100s (2026-12-06) and 1.17x on an H200 (2026-12-03). That
    training step waits for the host, so the host decides it: on an H200 whose host was slower (2026-12-06) fa3
    ran 0.83x fa2 and 0.78x Flex, its custom ops costing more host time a call (docs/benchmarks.md). Nothing is
    loaded (``Backend.load``).

    Raises ValueError for a name outside ``BACKENDS``.
    """
    if name not in BACKENDS:
        raise ValueError(f"attn={name!r} is not a known attention backend; accepted: {', '.join(BACKENDS)}")
    if name == "auto":
        if not torch.cuda.is_available():
            return REGISTRY["flex" if softcap else "sdpa"]
        if fa3_runs(head_dim):
            return REGISTRY["fa3"]
        if not docs and fa3_runs(head_dim, backward=False):
            return REGISTRY["fa3" if softcap else "sdpa"]
        return REGISTRY["fa2"]
    return REGISTRY[name]


def mask_backends(kind: str) -> list[str]:
    """The backends with ``supports_window`` (kind 'window') or ``supports_docs`` (kind 'docs')."""
    return backends_with(f"supports_{kind}")


__all__ = ["BACKENDS", "REGISTRY", "Backend", "BackendUnavailableError", "backends_with", "mask_backends",
           "resolve_backend", "segment_ids"]
