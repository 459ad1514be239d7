"""The Gluon API as the FA3 kernels use it, the same on every Triton release they support.

Gluon (`triton.experimental.gluon`) is experimental and renames things between releases. The kernels call the
names below and nothing release-specific, so a new release means a change here, not in the kernels:

| here               | Triton 3.6, 3.7                      | Triton 3.8                    | Triton 3.9               |
| ------------------ | ------------------------------------ | ----------------------------- | ------------------------ |
| `tma_load`         | `tma.async_copy_global_to_shared`    | `tma.async_load` (old: alias) | `tma.async_load` (old raises) |
| `tma_store`        | `tma.async_copy_shared_to_global`    | `tma.async_store`             | `tma.async_store`        |
| `tma_reduce_add`   | (builder op only; wrapped below)     | `tma.async_atomic_add`        | `tma.async_atomic_add`   |
| `cp_async_load`    | `async_copy.async_copy_global_to_shared` | `async_copy.async_load`   | `async_copy.async_load`  |
| `reinterpret`      | `smem._reinterpret`                  | `smem._reinterpret`           | `smem.reinterpret`       |
| `aggregate`        | `triton.language.core._aggregate`    | the same                      | `gl.aggregate`           |

Each entry prefers the newer name and falls back to the older one, so a release that keeps both works either
way. `constexpr_function` (the aggregates' constructors) and `as_4d` are the same on every release and live here
because both kernels need them. `kernels.fa3.GLUON_TRITON_VERSIONS` lists the releases whose sm_90 compile of both
kernels is checked (`tools/check_triton_versions.sh`; in CI on the installed release, tests/kernels/test_fa3.py).
"""

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import constexpr_function
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma
from triton.language import core as _tl_core

__all__ = ["aggregate", "as_4d", "constexpr_function", "cp_async_load", "reinterpret", "tma_load", "tma_reduce_add",
           "tma_store"]

tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
cp_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
aggregate = getattr(gl, "aggregate", None) or _tl_core._aggregate


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Global tile at `coord` += shared tile `src` (`cp.reduce.async.bulk.tensor.add`): Triton 3.6 and 3.7 have
    the op in Gluon's builder (`ttng.async_tma_reduce`) but no wrapper. Completion is awaited with
    `tma.store_wait`, as for a TMA store."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


tma_reduce_add = getattr(tma, "async_atomic_add", None) or _tma_reduce_add

_REINTERPRET = "reinterpret" if hasattr(gl.shared_memory_descriptor, "reinterpret") else "_reinterpret"


@builtin
def reinterpret(smem, dtype, shape, layout, _semantic=None):
    """The shared-memory descriptor `smem` seen with another dtype, shape and layout (the same bytes)."""
    return getattr(smem, _REINTERPRET)(dtype, shape, layout, _semantic=_semantic)


@gluon.jit
def as_4d(tile, desc):
    """A (rows, HEAD_DIM) shared tile as the (1, 1, rows, HEAD_DIM) box a 4-D descriptor copies (same bytes and
    swizzle): the kernels keep 2-D tiles for wgmma and copy them through descriptors over (B, H, N, D) tensors."""
    return reinterpret(tile, desc.dtype, desc.block_type.shape, desc.layout)
