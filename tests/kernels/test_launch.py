"""`kernels.launch`: which launches take Triton's path and which the cached compiled kernel's launcher, and what
the launcher is given. CPU: a real `JITFunction` (and `triton.autotune` over it) whose Triton path is replaced by
a recorder returning a `CompiledKernel` stand-in, so no GPU is needed. The kernels' own GPU tests run their second
calls through the cached launchers (e.g. `test_fa3.py::test_gluon_relaunch_of_a_shape_reads_the_new_inputs`)."""

import pytest
import torch
import triton
import triton.language as tl
from triton.compiler import CompiledKernel
from triton.runtime.jit import JITFunction

from kernels import launch as launch_mod
from kernels.launch import launch


def _kernel(X, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    pass


class _Compiled(CompiledKernel):
    """Triton's compiled kernel as far as `launch` uses it: `compiled[grid](*args)` (grid read as 3 numbers)."""

    def __init__(self, calls):
        self.calls, self.module = calls, None

    def __getitem__(self, grid):
        return lambda *args: self.calls.append(("launcher", (grid[0], grid[1], grid[2]), args))


@pytest.fixture
def recorded(monkeypatch):
    """(JITFunction of `_kernel`, the calls made): Triton's path records (grid, args, kwargs) and returns the
    stand-in; the cache starts empty and the current device is 0."""
    monkeypatch.setattr(launch_mod, "_KERNELS", {})
    monkeypatch.setattr(launch_mod, "_current_device", lambda: 0)
    calls = []
    fn = JITFunction(_kernel)

    def run(*args, grid, warmup, **kwargs):
        calls.append(("triton", grid, args, kwargs))
        return _Compiled(calls)

    fn.run = run
    return fn, calls


def _paths(calls):
    return [c[0] for c in calls]


def test_second_launch_of_a_specialisation_takes_the_launcher_with_every_parameter_in_order(recorded):
    fn, calls = recorded
    x = torch.randn(64)
    launch(fn, (3,), x, 7, 0.5, BLOCK=64, num_warps=4)
    y = torch.randn(64)  # new data, another float and grid: the same compiled code
    launch(fn, (4, 2), y, 7, 0.25, BLOCK=64, num_warps=4)
    assert _paths(calls) == ["triton", "launcher"]
    assert calls[0][1:] == ((3,), (x, 7, 0.5), dict(BLOCK=64, num_warps=4))
    # the constexprs too, FLAG from its default; the grid padded to three dimensions
    assert calls[1] == ("launcher", (4, 2, 1), (y, 7, 0.25, 64, False))


@pytest.mark.parametrize("change", ["int", "dtype", "alignment", "constexpr", "default constexpr", "option"])
def test_anything_triton_specialises_on_takes_triton_path_again(recorded, change):
    fn, calls = recorded
    x = torch.randn(64)
    args, kwargs = [x, 7, 0.5], dict(BLOCK=64, num_warps=4)
    launch(fn, (1,), *args, **kwargs)
    if change == "int":
        args[1] = 8
    elif change == "dtype":
        args[0] = x.half()
    elif change == "alignment":
        args[0] = x[1:]  # 4 bytes past a 16-byte boundary
    elif change == "constexpr":
        kwargs["BLOCK"] = 32
    elif change == "default constexpr":
        kwargs["FLAG"] = True
    else:
        kwargs["num_warps"] = 8
    launch(fn, (1,), *args, **kwargs)
    launch(fn, (1,), *args, **kwargs)
    assert _paths(calls) == ["triton", "triton", "launcher"]


def test_caller_key_stands_for_unhashable_arguments(recorded):
    fn, calls = recorded
    desc = {"block": [64, 64]}  # unhashable, like a host-made TMA descriptor
    launch(fn, (1,), desc, 7, 0.5, BLOCK=64)
    launch(fn, (1,), desc, 7, 0.5, BLOCK=64)  # no key: Triton's path every time
    launch(fn, (1,), desc, 7, 0.5, key=("bf16", 64), BLOCK=64)
    launch(fn, (1,), desc, 9, 0.5, key=("bf16", 64), BLOCK=64)  # the caller's key decides alone
    launch(fn, (1,), desc, 9, 0.5, key=("bf16", 128), BLOCK=64)
    assert _paths(calls) == ["triton", "triton", "triton", "launcher", "triton"]
    assert calls[3][2] == (desc, 9, 0.5, 64, False)


def test_never_cached_without_a_compiled_kernel_a_parameter_or_room(recorded, monkeypatch):
    fn, calls = recorded
    launch(fn, (1,), torch.randn(4), 7, BLOCK=64)  # `scale` missing: Triton's error, never a cached order
    launch(fn, (1,), torch.randn(4), 7, BLOCK=64)
    monkeypatch.setattr(launch_mod, "CACHE_MAX", 0)
    launch(fn, (1,), torch.randn(4), 7, 0.5, BLOCK=64)
    launch(fn, (1,), torch.randn(4), 7, 0.5, BLOCK=64)
    assert _paths(calls) == ["triton"] * 4
    monkeypatch.setattr(launch_mod, "CACHE_MAX", 8)
    fn.run = lambda *args, grid, warmup, **kwargs: calls.append(("interpreted", grid)) or None
    launch(fn, (1,), torch.randn(4), 7, 0.5, BLOCK=64)  # what the interpreter's launches return
    launch(fn, (1,), torch.randn(4), 7, 0.5, BLOCK=64)
    assert _paths(calls)[4:] == ["interpreted", "interpreted"]
    assert launch_mod.cached(fn) == 0


def test_autotuned_kernel_keeps_its_config_for_the_launcher_and_the_grid(recorded):
    fn, calls = recorded
    tuned = triton.autotune(configs=[triton.Config({"BLOCK": 32}, num_warps=2)], key=["n"])(fn)
    grids = []
    grid = lambda meta: grids.append(meta["BLOCK"]) or (triton.cdiv(meta["n"], meta["BLOCK"]),)
    x = torch.randn(64)
    launch(tuned, grid, x, 100, 0.5)
    launch(tuned, grid, x, 100, 0.5)
    assert _paths(calls) == ["triton", "launcher"]
    assert calls[0][3]["BLOCK"] == 32 and calls[0][3]["num_warps"] == 2  # the config, through Triton's path
    assert calls[1] == ("launcher", (4, 1, 1), (x, 100, 0.5, 32, False))
    assert grids[-1] == 32


def test_prepared_launch_fills_its_slots_and_takes_the_launcher_after_the_first_call(recorded):
    """`Prepared`: the first call goes through Triton's path with the fixed and per-call arguments by name; later
    calls run the launcher with every parameter in order, the per-call ones (here X and scale) new each time, the
    grid padded to three dimensions."""
    fn, calls = recorded
    prepared = launch_mod.Prepared(fn, (3, 2), ("X", "scale"), key=("shape", 1), n=7, BLOCK=64, num_warps=4)
    x, y = torch.randn(64), torch.randn(64)
    prepared(x, 0.5)
    prepared(y, 0.25)
    prepared(x, 2.0)
    assert _paths(calls) == ["triton", "launcher", "launcher"]
    assert calls[0][1:] == ((3, 2), (), dict(n=7, BLOCK=64, num_warps=4, X=x, scale=0.5))
    assert calls[1] == ("launcher", (3, 2, 1), (y, 7, 0.25, 64, False))
    assert calls[2][2][0] is x and calls[2][2][2] == 2.0
    assert prepared.values == [None, 7, None, 64, False]  # no call's tensors kept


def test_prepared_launch_shares_launch_cache_and_sees_a_swapped_kernel(recorded):
    """A `Prepared` launch and `launch` with the same key run the same compiled kernel, and `swap_compiled`
    changes what both run next."""
    fn, calls = recorded
    x = torch.randn(64)
    launch(fn, (1,), x, 7, 0.5, key="k", BLOCK=64)
    prepared = launch_mod.Prepared(fn, (1,), ("X",), key="k", n=7, scale=0.5, BLOCK=64)
    prepared(x)  # through `launch`, which already keeps this key's launcher
    prepared(x)
    other = []
    launch_mod.swap_compiled(fn, "k", _Compiled(other))
    prepared(x)
    assert _paths(calls) == ["triton", "launcher", "launcher"]
    assert other == [("launcher", (1, 1, 1), (x, 7, 0.5, 64, False))]


def test_prepared_launch_takes_triton_path_while_nothing_is_cached(recorded, monkeypatch):
    """Where `launch` caches nothing (here no room; also the interpreter), every call of a `Prepared` launch goes
    through Triton's path with its arguments."""
    fn, calls = recorded
    monkeypatch.setattr(launch_mod, "CACHE_MAX", 0)
    prepared = launch_mod.Prepared(fn, (1,), ("X",), key="k", n=7, scale=0.5, BLOCK=64)
    x, y = torch.randn(64), torch.randn(64)
    prepared(x)
    prepared(y)
    assert _paths(calls) == ["triton", "triton"]
    assert calls[1][3]["X"] is y


def test_functions_that_are_not_jit_functions_always_take_triton_path(recorded):
    _, calls = recorded

    class Interpreted:  # what @triton.jit gives under TRITON_INTERPRET=1
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append(("interpreted", grid, args, kwargs))

    for _ in range(2):
        launch(Interpreted(), (2,), 1, BLOCK=4)
    assert calls == [("interpreted", (2,), (1,), dict(BLOCK=4))] * 2


def test_host_integer_helpers_match_triton():
    """`common.cdiv` / `next_power_of_2`, the launchers' plain-Python stand-ins for Triton's constexpr functions."""
    from kernels.common import cdiv, next_power_of_2

    for n in [*range(-3, 300), 1023, 1024, 1025, 2 ** 31 - 1, 2 ** 31, 2 ** 40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 64, 128, 1000):
            if n >= 0:
                assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
