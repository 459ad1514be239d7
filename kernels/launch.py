"""Kernel launches without Triton's per-call Python: `launch(kernel, grid, *args, **kwargs)` is
`kernel[grid](*args, **kwargs)` for a `@triton.jit`, `@gluon.jit` or `@triton.autotune` kernel.

A launch through `kernel[grid]` binds the arguments, computes Triton's specialisation key, looks up the compiled
kernel (for an autotuned kernel: its config first) and only then calls the compiled kernel's launcher. On the
H100 and H200 machines' hosts that path measured 50-150 us a launch against 16-19 us for the launcher alone
(docs/hopper-notes.md, "host variants 14 and 24"), and an eager backward makes three launches. So the first launch of a
specialisation goes through Triton, which compiles (and autotunes), and later ones call the compiled kernel's
launcher directly, found by a key that holds everything Triton specialises the code on: the kernel, the current
device, every constexpr's value and launch option, each tensor's dtype and 16-byte alignment, each int's value
(a superset of Triton's ==1, %16 and 32/64-bit classes) and each float's type, or a key the caller gives. An
autotuned kernel's chosen config is kept with it (its constexprs, which a callable grid reads).

Under Triton's interpreter (TRITON_INTERPRET=1), for kernels with hooks, or past `CACHE_MAX` specialisations,
every launch takes Triton's path. Kernels whose int arguments change on every call (the decode step's positions,
`kernels.decode`) launch through Triton directly: each call would be a new specialisation here.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable, NamedTuple

import torch
from triton.compiler import CompiledKernel
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction

CACHE_MAX = 4096  # specialisations kept per kernel (one per distinct shape and config); later ones take Triton's path
_FLOAT, _MISSING = object(), object()
_current_device = torch.cuda.current_device  # what Triton's path picks its compiled kernels by


class _Launcher(NamedTuple):
    compiled: CompiledKernel
    config: dict  # an autotuned kernel's chosen constexprs ({} otherwise)


class _Kernel:
    """A kernel's parameters in order (names, which are constexprs, defaults: _MISSING for none) and its cached
    launchers. Kept by id(kernel), not by the kernel: a JITFunction hashes its source key under a lock, which cost
    more than the rest of a launch; the entry holds the kernel, so the id stays its own."""
    __slots__ = ("kernel", "autotuned", "names", "constexpr", "defaults", "params", "launchers")

    def __init__(self, kernel, autotuned: bool, fn: JITFunction):
        self.kernel, self.autotuned = kernel, autotuned
        self.names = tuple(p.name for p in fn.params)
        self.constexpr = tuple(bool(p.is_constexpr) for p in fn.params)
        self.defaults = tuple(_MISSING if p.default is inspect.Parameter.empty else p.default for p in fn.params)
        self.params = frozenset(self.names)
        self.launchers: dict = {}


_KERNELS: dict[int, _Kernel] = {}


def _kernel(kernel) -> _Kernel | None:
    """The kernel's entry, made on its first launch; None for what is not a JIT function (the interpreter's
    functions, @triton.heuristics), which takes Triton's path."""
    entry = _KERNELS.get(id(kernel))
    if entry is None:
        autotuned = isinstance(kernel, Autotuner)
        fn = kernel.fn if autotuned else kernel
        if not isinstance(fn, JITFunction) or getattr(fn, "pre_run_hooks", None):
            return None
        entry = _KERNELS[id(kernel)] = _Kernel(kernel, autotuned, fn)
    return entry


def _spec(value, constexpr: bool):
    """What Triton's compiled code depends on in one argument's value (see the module docstring)."""
    if constexpr:
        return value
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, float):
        return _FLOAT
    return value  # ints (by value), bools, None; an unhashable value (e.g. a TMA descriptor) needs `key`


def launch(kernel, grid, *args, key=None, compiling: Callable = contextlib.nullcontext, **kwargs) -> None:
    """Run kernel[grid](*args, **kwargs).

    key: the caller's own key for what the compiled code depends on, in place of the one computed from the
    arguments and launch options (needed for arguments this module cannot key, e.g. host-made TMA descriptors:
    then it must hold their dtypes, blocks and layouts, and every launch option that varies); compiling: a
    context manager around Triton's path (the launch that may compile). Errors are Triton's, raised on its path:
    a cached launcher only runs what ran before."""
    entry = _kernel(kernel)
    if entry is None:
        kernel[grid](*args, **kwargs)
        return
    if args:
        named = dict(zip(entry.names, args))
        named.update(kwargs)
    else:
        named = kwargs  # a fresh dict per call
    try:
        if key is None:
            extra = kwargs.keys() - entry.params  # launch options (num_warps, ...)
            key = (tuple(map(_spec, map(named.get, entry.names, entry.defaults), entry.constexpr)),
                   tuple(sorted((name, kwargs[name]) for name in extra)))
        key = (_current_device(), key)
        hit = entry.launchers.get(key)
    except TypeError:  # an unhashable argument: Triton's path every time
        key, hit = None, None
    if hit is not None:
        if hit.config:
            named.update(hit.config)
        values = list(map(named.get, entry.names, entry.defaults))
        grid = grid(named) if callable(grid) else grid
        hit.compiled[(*grid, 1, 1)[:3]](*values)  # the launcher takes a 3-D grid (Triton's path pads it)
        return
    with compiling():
        compiled = kernel[grid](*args, **kwargs)
    if key is None or not isinstance(compiled, CompiledKernel) or len(entry.launchers) >= CACHE_MAX:
        return
    config = {}
    if entry.autotuned:
        if kernel.best_config.pre_hook is not None:
            return
        config = dict(kernel.best_config.kwargs)
    if any(default is _MISSING and name not in named and name not in config
           for name, default in zip(entry.names, entry.defaults)):
        return
    entry.launchers[key] = _Launcher(compiled, config)


class Prepared:
    """`launch(kernel, grid, key=key, compiling=compiling, **fixed, **dict(zip(names, values)))` as
    `prepared(*values)`, for calls that differ only in the `names` arguments (per-call tensors and descriptors):
    the arguments are put in the kernel's order once, with slots for `names`. The first call goes through `launch`
    (which may compile); once `launch` keeps a launcher for `key`, calls fill the slots and run that launcher, looked
    up on every call (so `swap_compiled` applies). `grid` is fixed (a tuple); `key` as in `launch`, required and
    hashable."""
    __slots__ = ("kernel", "grid", "names", "key", "compiling", "fixed", "values", "slots", "launchers")

    def __init__(self, kernel, grid: tuple, names: tuple[str, ...], *, key,
                 compiling: Callable = contextlib.nullcontext, **fixed):
        self.kernel, self.grid, self.names, self.key, self.compiling = kernel, tuple(grid), tuple(names), key, compiling
        self.fixed = fixed
        self.values = self.slots = self.launchers = None

    def __call__(self, *values) -> None:
        if self.launchers is not None:
            hit = self.launchers.get((_current_device(), self.key))
            if hit is not None:
                args = self.values.copy()
                for slot, value in zip(self.slots, values):
                    args[slot] = value
                hit.compiled[self.grid](*args)
                return
        named = dict(zip(self.names, values))
        launch(self.kernel, self.grid, key=self.key, compiling=self.compiling, **self.fixed, **named)
        entry = _kernel(self.kernel)
        hit = None if entry is None else entry.launchers.get((_current_device(), self.key))
        if hit is None or hit.config:  # not cached, or autotuned (whose config may change the grid)
            return
        named.update(self.fixed)
        self.values = list(map(named.get, entry.names, entry.defaults))
        self.slots = tuple(entry.names.index(name) for name in self.names)
        for slot in self.slots:  # keep no call's tensors (memory, and CUDA graphs' pools refuse kept ones)
            self.values[slot] = None
        self.grid = (*self.grid, 1, 1)[:3]
        self.launchers = entry.launchers


def compiled_kernel(kernel, key) -> CompiledKernel:
    """The compiled kernel that launches of `kernel` with the caller's `key` run (KeyError if none has run)."""
    launchers = _KERNELS[id(kernel)].launchers
    return launchers[_full_key(launchers, key)].compiled


def swap_compiled(kernel, key, compiled: CompiledKernel) -> None:
    """Make launches of `kernel` with the caller's `key` run `compiled` (another build of the same kernel, with the
    same parameters: `tools.fa3_cubins` times other Triton releases' cubins this way)."""
    launchers = _KERNELS[id(kernel)].launchers
    full = _full_key(launchers, key)
    launchers[full] = launchers[full]._replace(compiled=compiled)


def cached(kernel) -> int:
    """How many specialisations of `kernel` launch through their compiled kernel's launcher."""
    entry = _KERNELS.get(id(kernel))
    return 0 if entry is None else len(entry.launchers)


def _full_key(launchers: dict, key):
    for full in launchers:
        if full[1] == key:
            return full
    raise KeyError(f"no cached launch with key {key!r}")
