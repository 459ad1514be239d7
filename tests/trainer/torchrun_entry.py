"""torchrun entry point for tests/trainer/test_distributed.py: train.py plus test-only fault injection.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/trainer/torchrun_entry.py <overrides>

Environment (read here only, never by the trainer):
    TEST_DELAY_RANK=r             rank r sleeps 1.5 s first, so the ranks' clocks read different seconds
    TEST_FAIL_RANK=r, TEST_FAIL_FORWARD=n, TEST_FAIL_KIND=raise|nan|interrupt
                                  rank r raises RuntimeError (raise), returns a NaN loss (nan) or raises
                                  KeyboardInterrupt as a second Ctrl-C does (interrupt) in its n-th training
                                  forward (a step has grad_accum / world_size of them)
    TEST_INTERRUPT_BUILD=r        rank r raises KeyboardInterrupt while the model is built, as a first Ctrl-C
                                  does before the training loop handles the signal; with TEST_INTERRUPT_SIGNAL=TERM
                                  it sends itself SIGTERM there instead
    TEST_INTERRUPT_CLOSE=r        rank r raises KeyboardInterrupt once the run has closed (after the training
                                  loop, checkpoints and W&B), as a Ctrl-C while W&B finishes would
Also usable for one process: RANK=0 python tests/trainer/torchrun_entry.py <overrides>.
"""

import os
import runpy
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
rank = int(os.environ["RANK"])

if os.environ.get("TEST_DELAY_RANK") == str(rank):
    time.sleep(1.5)

if os.environ.get("TEST_FAIL_RANK") == str(rank):
    from model.gpt import GPT

    fail_at, kind = int(os.environ["TEST_FAIL_FORWARD"]), os.environ.get("TEST_FAIL_KIND", "raise")
    real_forward = GPT.forward
    forwards = {"n": 0}

    def forward(self, idx, targets=None, **kwargs):
        logits, loss = real_forward(self, idx, targets, **kwargs)
        if targets is not None and self.training:
            forwards["n"] += 1
            if forwards["n"] == fail_at:
                if kind == "nan":
                    return logits, loss * float("nan")
                if kind == "interrupt":
                    raise KeyboardInterrupt
                raise RuntimeError(f"injected failure on rank {rank} in training forward {fail_at}")
        return logits, loss

    GPT.forward = forward

if os.environ.get("TEST_INTERRUPT_BUILD") == str(rank):
    from model.gpt import GPT

    def interrupted_build(self, *args, **kwargs):
        if os.environ.get("TEST_INTERRUPT_SIGNAL") == "TERM":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the handler runs here
            raise AssertionError("SIGTERM did not interrupt the model build")
        raise KeyboardInterrupt

    GPT.__init__ = interrupted_build

if os.environ.get("TEST_INTERRUPT_CLOSE") == str(rank):
    from trainer.loop import Trainer

    real_close = Trainer._close

    def interrupted_close(self, *args, **kwargs):
        real_close(self, *args, **kwargs)
        raise KeyboardInterrupt

    Trainer._close = interrupted_close

sys.argv[0] = str(ROOT / "train.py")
runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
