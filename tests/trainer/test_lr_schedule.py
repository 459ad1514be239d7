import math
import random

import pytest

from trainer.lr_schedule import lr_at


def test_warmup_cosine_floor():
    lr, warm, decay, ratio = random.uniform(1e-4, 1e-2), 10, 100, 0.1
    f = lambda s: lr_at(s, lr, warm, decay, ratio)  # noqa: E731
    assert [f(s) for s in range(warm)] == pytest.approx([lr * (s + 1) / warm for s in range(warm)])
    assert f(warm) == pytest.approx(lr)                                   # decay starts at the peak
    assert f(warm + decay // 2) == pytest.approx(lr * ratio + 0.5 * (lr - lr * ratio))  # cosine midpoint
    assert f(warm + decay) == pytest.approx(lr * ratio) == f(warm + 10 * decay)         # then constant
    values = [f(s) for s in range(warm, warm + decay + 1)]
    assert all(a >= b for a, b in zip(values, values[1:]))                # monotone decay
    mid = warm + 30
    assert f(mid) == pytest.approx(lr * ratio + 0.5 * (1 + math.cos(math.pi * 30 / decay)) * (lr - lr * ratio))


def test_no_warmup_no_decay():
    assert lr_at(0, 1.0, 0, 0, 0.1) == 1.0 and lr_at(50, 1.0, 0, 0, 0.1) == 1.0
    assert lr_at(0, 1.0, 0, 10, 0.0) == 1.0 and lr_at(10, 1.0, 0, 10, 0.0) == 0.0


def test_negative_step():
    with pytest.raises(ValueError, match="step"):
        lr_at(-1, 1.0, 1, 1, 0.1)
