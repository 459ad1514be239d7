"""Ctrl-C / SIGTERM handling of a training run: the first signal asks to stop after the current step."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Optional

log = logging.getLogger("trainer.loop")


class TrainingAborted(KeyboardInterrupt):
    """Ctrl-C while training, after the first one asked to stop: the step in flight was not saved. (A
    KeyboardInterrupt outside the training loop is a first Ctrl-C: nothing was trained.)"""


class StopRequest:
    """First Ctrl-C / SIGTERM: finish the current step, save, exit cleanly (``signum`` is set).
    Second Ctrl-C: raise KeyboardInterrupt at once. Handlers are installed in the main thread only."""

    def __init__(self):
        self.signum: Optional[int] = None
        self._previous: dict = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> bool:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        log.warning("received %s: stopping after this step and saving a checkpoint (Ctrl-C %sto abort)",
                    signal.Signals(signum).name, "again " if signum == signal.SIGINT else "")
