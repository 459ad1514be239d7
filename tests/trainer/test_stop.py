"""trainer.stop.StopRequest: the first Ctrl-C is acknowledged and a second one aborts even while the main thread is
inside one long operation.

Each case runs in a fresh process (signals, handlers and the wakeup fd are per process)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainer.stop import StopRequest

ROOT = Path(__file__).resolve().parents[2]
PRELUDE = ("import logging, os, signal, sys, threading, time\n"
           "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(message)s')\n"
           "from trainer.stop import StopRequest\n")


def run(code: str, timeout: float = 60) -> tuple[int, str, float]:
    start = time.time()
    done = subprocess.run([sys.executable, "-c", PRELUDE + code], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return done.returncode, done.stdout + done.stderr, time.time() - start


def test_second_ctrl_c_inside_a_long_operation_ends_the_process():
    """The main thread sits in one 30-second call that Python cannot interrupt (SIGINT blocked for it: its
    handler would only run when the call returns, as inside a long torch op); the second Ctrl-C arrives during
    it: exit 130 after the grace period, with the abort's words, long before the call would end."""
    code = ("with StopRequest():\n"
            "    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
            "    time.sleep(30)\n"
            "print('the call ended')\n")
    code_, out, seconds = run(code)
    assert code_ == 130, out[-3000:]
    assert "aborted by a second Ctrl-C during a long operation; this step was not saved" in out
    assert "the call ended" not in out and seconds < 20, (seconds, out[-3000:])


def test_first_ctrl_c_is_acknowledged_inside_a_long_operation_and_only_once():
    """The first Ctrl-C arrives while the main thread is in a 4-second call it cannot leave: its message is logged
    during the call (before the call's own line), and once, though the handler runs when the call returns."""
    code = ("with StopRequest() as stop:\n"
            "    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(4)\n"
            "    logging.info('the call ended')\n"
            "    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})\n"
            "    while stop.signum is None: time.sleep(0.01)\n"
            "print('signum', stop.signum)\n")
    code_, out, _ = run(code)
    assert code_ == 0 and f"signum {int(signal.SIGINT)}" in out, out[-3000:]
    message = "received SIGINT: stopping after this step and saving a checkpoint (Ctrl-C again to abort)"
    assert out.count(message) == 1, out[-3000:]
    assert out.index(message) < out.index("the call ended"), out[-3000:]


def test_second_ctrl_c_between_operations_is_the_main_threads():
    """Short operations: the main thread takes the second Ctrl-C itself (KeyboardInterrupt, the trainer's abort
    path), and the watcher, acknowledged, does not end the process."""
    code = ("try:\n"
            "    with StopRequest() as stop:\n"
            "        os.kill(os.getpid(), signal.SIGINT)\n"
            "        while stop.signum is None: time.sleep(0.01)\n"
            "        os.kill(os.getpid(), signal.SIGINT)\n"
            "        for _ in range(500): time.sleep(0.01)\n"
            "except KeyboardInterrupt:\n"
            "    print('main thread took it')\n"
            f"time.sleep({StopRequest.ABORT_GRACE_S + 1})\n"
            "print('still running', signal.set_wakeup_fd(-1),\n"
            "      signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n")
    code_, out, _ = run(code)
    assert code_ == 0, out[-3000:]
    assert "main thread took it" in out and "still running -1 True" in out and "aborted" not in out


def test_another_wakeup_fd_is_left_alone():
    """Where a wakeup fd is already set (an event loop's), StopRequest keeps it and adds no watcher; the first
    Ctrl-C still asks to stop."""
    code = ("r, w = os.pipe(); os.set_blocking(w, False); signal.set_wakeup_fd(w)\n"
            "with StopRequest() as stop:\n"
            "    assert signal.set_wakeup_fd(w) == w\n"
            "    assert not [t for t in threading.enumerate() if t.name == 'stop-watcher']\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    while stop.signum is None: time.sleep(0.01)\n"
            "print('ok', signal.set_wakeup_fd(-1) == w)\n")
    code_, out, _ = run(code)
    assert code_ == 0 and "ok True" in out, out[-3000:]



def test_a_second_sigterm_does_not_abort_and_sigint_after_it_does():
    """A SIGTERM passed on twice (a launcher forwarding the scheduler's) leaves the stop graceful, logged once; a
    SIGINT after it aborts (KeyboardInterrupt, the trainer's abort path)."""
    code = ("with StopRequest() as stop:\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    while stop.signum is None: time.sleep(0.01)\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            f"    time.sleep({StopRequest.ABORT_GRACE_S + 1})\n"
            "    print('still stopping', stop.signum == signal.SIGTERM)\n"
            "    try:\n"
            "        os.kill(os.getpid(), signal.SIGINT)\n"
            "        for _ in range(500): time.sleep(0.01)\n"
            "    except KeyboardInterrupt:\n"
            "        print('aborted by SIGINT')\n")
    code_, out, _ = run(code)
    assert code_ == 0, out[-3000:]
    assert "still stopping True" in out and "aborted by SIGINT" in out, out[-3000:]
    assert out.count("received SIGTERM: stopping after this step") == 1, out[-3000:]
