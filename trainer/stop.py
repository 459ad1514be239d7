"""Ctrl-C / SIGTERM handling of a training run: the first signal asks to stop after the current step."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Optional

log = logging.getLogger("trainer.loop")


class TrainingAborted(KeyboardInterrupt):
    """Ctrl-C while training, after the first one asked to stop: the step in flight was not saved. (A
    KeyboardInterrupt outside the training loop is a first Ctrl-C: nothing was trained.)"""


class StopRequest:
    """First Ctrl-C / SIGTERM: finish the current step, save, exit cleanly (``signum`` is set).
    Second Ctrl-C (SIGINT): raise KeyboardInterrupt at once. A second SIGTERM changes nothing: launchers pass a
    scheduler's SIGTERM on to processes that got it already (torchrun's agent under Slurm's scancel), and that must not
    cost the checkpoint; SIGINT is the abort. Handlers are installed in the main thread only.

    Python runs a signal handler only between bytecodes, so inside one long operation (a CPU attention over a very
    long context) the first signal's message and the second Ctrl-C would wait for the operation to end. A watcher
    thread reads the signals as they arrive (``signal.set_wakeup_fd``): it logs the first one's message at once
    (once: whichever of it and the handler comes first), and when the main thread has not taken a second Ctrl-C
    within ``ABORT_GRACE_S``, it ends the process with 130 and the same words as the abort, the step in flight not
    saved (checkpoints are written atomically: the last complete one stays). Not installed where another wakeup fd
    is set."""

    ABORT_GRACE_S = 2.0

    def __init__(self):
        self.signum: Optional[int] = None
        self._previous: dict = {}
        self._aborting = threading.Event()
        self._announced = threading.Lock()  # taken by whoever logs the first signal's message
        self._wakeup: Optional[tuple[int, int]] = None  # the pipe the interpreter writes signal numbers into

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
            self._start_watcher()
        return self

    def __exit__(self, *exc) -> bool:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._wakeup is not None:
            signal.set_wakeup_fd(-1)
            os.close(self._wakeup[1])  # the watcher's read returns empty: it ends and closes its end
            self._wakeup = None
        return False

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            self._aborting.set()
            raise KeyboardInterrupt
        self.signum = signum
        self._announce(signum)

    def _announce(self, signum: int) -> None:
        """Log the first signal's message, once, from the handler or the watcher."""
        if self._announced.acquire(blocking=False):
            log.warning("received %s: stopping after this step and saving a checkpoint (%s)",
                        signal.Signals(signum).name, "Ctrl-C again to abort" if signum == signal.SIGINT
                        else "Ctrl-C or SIGINT to abort; another SIGTERM does not")

    def _start_watcher(self) -> None:
        read, write = os.pipe()
        os.set_blocking(write, False)
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        if previous != -1:  # someone else listens (an event loop): leave it theirs
            signal.set_wakeup_fd(previous)
            os.close(read), os.close(write)
            return
        self._wakeup = (read, write)
        threading.Thread(target=self._watch, args=(read,), name="stop-watcher", daemon=True).start()

    def _watch(self, read: int) -> None:
        seen = 0  # SIGINT / SIGTERM so far
        try:
            while data := os.read(read, 64):
                for signum in data:
                    if signum == signal.SIGINT and seen and not self._aborting.wait(self.ABORT_GRACE_S):
                        log.error("aborted by a second Ctrl-C during a long operation; this step was not saved "
                                  "(a resume continues from the last checkpoint)")
                        os._exit(128 + signal.SIGINT)  # the log handlers flush every record
                    if signum in (signal.SIGINT, signal.SIGTERM):
                        if not seen:
                            self._announce(signum)
                        seen += 1
        finally:
            os.close(read)
