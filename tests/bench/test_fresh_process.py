"""bench.in_fresh_process: a call in a new interpreter, its result or exception here, crashes and signals."""

import os
import random
import signal
import threading
import time

import pytest

from bench import Interrupted, in_fresh_process

STATE = {}  # set in this process by a test; a fresh interpreter must not see it


def pid_and_state(x):
    return os.getpid(), dict(STATE), x * 2


def raise_value_error(text):
    raise ValueError(text)


def raise_interrupted(label, step):
    raise Interrupted(label, step, 10, signal.SIGTERM)


def exit_without_result(code):
    os._exit(code)


def kill_itself():
    os.kill(os.getpid(), signal.SIGKILL)


def ctrl_c():
    raise KeyboardInterrupt


def unpicklable_result():
    return lambda: None


def wait_for_sigterm(ready_file):
    got = []
    signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    open(ready_file, "w").close()
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    return got


def test_the_call_runs_in_a_new_interpreter_and_returns_its_result():
    x = random.randint(1, 10**6)
    STATE["set here"] = x
    pid, state, doubled = in_fresh_process(pid_and_state, x)
    assert pid != os.getpid() and state == {} and doubled == 2 * x


def test_an_exception_in_the_child_is_raised_here(capfd):
    text = f"bad value {random.random()}"
    with pytest.raises(ValueError, match=text) as info:
        in_fresh_process(raise_value_error, text)
    if hasattr(info.value, "add_note"):  # Python >= 3.11
        assert any("own process" in note for note in info.value.__notes__)
    assert "in raise_value_error" in capfd.readouterr().err  # the child printed its traceback


def test_an_interrupted_run_comes_back_with_its_fields(capfd):
    with pytest.raises(Interrupted) as info:
        in_fresh_process(raise_interrupted, "fa2", 7)
    e = info.value
    assert (e.label, e.step, e.steps, e.signum) == ("fa2", 7, 10, signal.SIGTERM)
    assert str(e) == "fa2 was interrupted at step 7 of 10"
    assert "Traceback" not in capfd.readouterr().err  # an expected stop prints no traceback


def test_ctrl_c_in_the_child_is_a_keyboard_interrupt_here():
    with pytest.raises(KeyboardInterrupt):
        in_fresh_process(ctrl_c)


@pytest.mark.parametrize("code", [1, 3])
def test_a_child_that_ends_without_a_result_names_its_exit_code(code):
    with pytest.raises(RuntimeError, match=f"exit_without_result: its process ended with exit code {code} before"):
        in_fresh_process(exit_without_result, code)


def test_a_child_killed_by_a_signal_names_the_signal():
    with pytest.raises(RuntimeError, match="kill_itself: its process was killed by SIGKILL"):
        in_fresh_process(kill_itself)


def test_a_result_that_does_not_pickle_is_an_error_not_a_hang():
    with pytest.raises(RuntimeError, match="not picklable"):
        in_fresh_process(unpicklable_result)


def exit_when_told(ready_file, go_file, code):
    open(ready_file, "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(go_file) and time.monotonic() < deadline:
        time.sleep(0.01)
    os._exit(code)


def test_a_finished_result_is_handed_over_before_a_signal_received_meanwhile(tmp_path):
    """Ctrl-C reaching this process just as the child finishes: the result goes to on_result, then the signal."""
    ready, go = tmp_path / "ready", tmp_path / "go"

    def ctrl_c_here_when_ready():
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)
        go.touch()

    kept = []
    threading.Thread(target=ctrl_c_here_when_ready, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        in_fresh_process(return_when_told, str(ready), str(go), "the row", on_result=kept.append)
    assert kept == ["the row"]
    assert in_fresh_process(pid_and_state, 2, on_result=kept.append)[2] == 4 and kept[-1][2] == 4


def return_when_told(ready_file, go_file, value):
    open(ready_file, "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(go_file) and time.monotonic() < deadline:
        time.sleep(0.01)
    return value


def test_ctrl_c_here_then_a_child_that_ends_without_a_result_is_a_keyboard_interrupt(tmp_path):
    """A second Ctrl-C aborts the trainer's process (exit 130): with the SIGINT this process got, that is a
    KeyboardInterrupt here, not an error about an exit code."""
    ready, go = tmp_path / "ready", tmp_path / "go"

    def ctrl_c_here_when_ready():
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)  # this process only: the child is not told
        go.touch()

    threading.Thread(target=ctrl_c_here_when_ready, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        in_fresh_process(exit_when_told, str(ready), str(go), 130)


def test_sigterm_is_forwarded_to_the_child_and_delivered_here_after_it(tmp_path):
    """SIGTERM to this process reaches the child (which stops its run); once the child has returned, this process
    gets the signal too, through the handler it had before the call."""
    ready = tmp_path / "ready"

    class Terminated(Exception):
        pass

    def raise_terminated(signum, frame):
        raise Terminated

    def send_sigterm_when_ready():
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        threading.Thread(target=send_sigterm_when_ready, daemon=True).start()
        with pytest.raises(Terminated):
            in_fresh_process(wait_for_sigterm, str(ready))
        assert signal.getsignal(signal.SIGTERM) is raise_terminated  # restored
        assert signal.getsignal(signal.SIGINT) is not None
    finally:
        signal.signal(signal.SIGTERM, previous)
