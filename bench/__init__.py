"""User benchmarks, one command each (``python -m bench.<name> --help``):

    attention   kernel TFLOP/s of every attention backend, forward and backward; --shape grid (default), llama
                (NVIDIA's published H200 shape) or decode (one query against a KV cache)
    masks       sliding windows and packed documents: fa3 and fa2 against FlexAttention, cuDNN and SDPA's dense mask
    throughput  training tokens/s, MFU and memory per backend through the trainer (--baseline: the bare loop too)
    baseline    the bare training loop that throughput --baseline measures the trainer against
    generate    generation tokens/s with and without the KV cache, eager, compiled and as CUDA graphs
    report      the shared table, CSV/JSON and plot helpers

Developer tools (kernel tuning, profiling) are in tools/.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` of the bench scripts: the module docstring as written, and each option's default (none shown
    for flags, whose default is off, and options whose default is None or empty)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == "":
            return action.help
        return super()._get_help_string(action)


def csv_list(kind: Callable, choices=None) -> Callable[[str], list]:
    """An argparse ``type``: a comma-separated list of ``kind`` values, each from ``choices`` (when given) and, for
    ints, >= 1. Raises argparse.ArgumentTypeError naming the text and what is accepted."""
    def parse(text: str) -> list:
        try:
            items = [kind(x) for x in text.split(",") if x]
        except ValueError:
            items = []
        bad = [x for x in items if (choices is not None and x not in choices) or (kind is int and x < 1)]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of "
                                             + (", ".join(map(str, choices)) if choices else "positive integers"))
        return items
    return parse


def fallback(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> Optional[str]:
    """The kernels ``backend`` runs instead of its own on ``device`` for attention inputs of ``dtype`` and
    ``head_dim`` (a phrase with the reason, e.g. "FA2's Triton kernels (no CUDA GPU)", or for the backward alone
    "FA2's Triton kernels in the backward (...)"), or None when it runs its own. Today only fa3 has a fallback:
    FA2's kernels where its Gluon kernels do not apply (``kernels.fa3``)."""
    if backend != "fa3":
        return None
    if device.type != "cuda":  # named first: on a CPU no Triton version would help
        reason = "no CUDA GPU"
    else:
        from kernels import fa3

        q = torch.empty(1, 1, 128, head_dim, device=device, dtype=dtype)  # the kernels' own rules decide
        reason = fa3.gluon_unsupported_reason(q, q, q)
        backward = fa3.plan("backward", q, q, q, False, q)
        if reason is None and backward.warn:  # head_dim 256: the Gluon forward, FA2's backward
            return f"FA2's Triton kernels in the backward ({backward.reason})"
    return None if reason is None else f"FA2's Triton kernels ({reason})"


@contextlib.contextmanager
def exit_on_interrupt(tool: str, kept: str):
    """Ctrl-C inside the block ends the benchmark with one line on stderr, "<tool>: interrupted; <kept>" (`kept`:
    what is on disk), and exit status 130 (128 + SIGINT), instead of a traceback through torch.compile."""
    try:
        yield
    except KeyboardInterrupt:
        print(f"{tool}: interrupted; {kept}", file=sys.stderr)
        raise SystemExit(128 + signal.SIGINT) from None


def results_folder(out: str, option: str = "--out") -> Path:
    """`out` (the value of `option`) as a folder for results, made if missing; SystemExit naming it when it is a
    file (left as it is), or when it cannot be made or written (permissions, a read-only file system)."""
    from utils.atomic import check_writable

    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise SystemExit(f"{option} {folder}: a file, not a folder; give a folder for the results")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        check_writable(folder)
    except OSError as e:
        raise SystemExit(f"{option} {folder}: cannot create or write this folder ({e.strerror or e}); give another "
                         "one") from None
    return folder


LOG_FORMAT = "%(asctime)s %(name)s: %(message)s"


class Interrupted(Exception):
    """Ctrl-C or SIGTERM stopped a benchmark's run before its last step: a row for it would time fewer steps than
    asked. ``signum``: the signal."""

    def __init__(self, label: str, step: int, steps: int, signum: int):
        super().__init__(f"{label} was interrupted at step {step} of {steps}")
        self.label, self.step, self.steps, self.signum = label, step, steps, signum

    def __reduce__(self):  # pickled with its own arguments (in_fresh_process sends it between processes)
        return Interrupted, (self.label, self.step, self.steps, self.signum)


def in_fresh_process(fn: Callable, *args, on_result: Optional[Callable] = None, quiet: tuple = ()):
    """``fn(*args)`` in a new Python interpreter (multiprocessing's ``spawn``), its return value here, or its exception
    raised here. The child starts with no CUDA context, no compiled graphs, no allocator or Triton launcher state and
    no memory of an earlier run: a benchmark run in it reads what a run alone in a process reads. ``fn`` and its
    arguments must be picklable (``fn`` a module-level function), and so must its result.

    - An exception in the child is raised here; the child prints its traceback first, other than for Ctrl-C and for
      the exception types in ``quiet`` (errors whose message says it all, e.g. a refused config).
    - A child that ends without a result (a CUDA error aborts the process; a crash; ``os._exit``) raises
      RuntimeError naming its exit code or signal.
    - Signals: Ctrl-C at a terminal reaches both processes (one process group), so SIGINT is not forwarded; SIGTERM
      sent to this process is forwarded to the child. A signal this process got while the child ran is delivered
      again here once the child has ended, unless the child raised (e.g. its run stopped on that signal): a result
      is then handed to ``on_result`` first (if given; else it is dropped), and a child that ended without one (a
      second Ctrl-C aborts a run) is a KeyboardInterrupt."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_main, args=(send, fn, args, quiet))  # not daemonic: inductor may start workers
    received = []

    def on_signal(signum, frame):
        received.append(signum)
        if signum == signal.SIGTERM and child.pid is not None:
            os.kill(child.pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        child.start()
        send.close()  # the child holds the only writer: a child that dies ends recv() with EOFError
        try:
            status, value = receive.recv()
        except EOFError:
            status, value = None, None
        child.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        receive.close()
    if status == "raised":  # the child's own reading of a signal (Interrupted, KeyboardInterrupt) included
        raise value
    if status == "returned" and on_result is not None:
        on_result(value)
    if received:
        signal.raise_signal(received[0])
    if status is None:
        code = child.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else \
            f"ended with exit code {code}"
        raise RuntimeError(f"{getattr(fn, '__name__', fn)}: its process {how} before returning a result")
    return value


def _child_main(send, fn, args, quiet=()):
    """The child of ``in_fresh_process``: run ``fn(*args)`` and send ("returned", result) or ("raised", exception),
    printing the exception's traceback first unless it is Ctrl-C, an exit or one of ``quiet``."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    try:
        message = ("returned", fn(*args))
    except BaseException as e:  # noqa: B902 -- Ctrl-C and SystemExit are results too
        if not isinstance(e, (KeyboardInterrupt, SystemExit, Interrupted, *quiet)):
            traceback.print_exc()
            if hasattr(e, "add_note"):
                e.add_note("(raised in the run's own process; its traceback is printed above)")
        message = ("raised", e)
    try:
        send.send(message)
    except Exception as e:  # an exception or result that does not pickle
        send.send(("raised", RuntimeError(f"{type(message[1]).__name__}: {message[1]} (not picklable: {e})")))
    send.close()
