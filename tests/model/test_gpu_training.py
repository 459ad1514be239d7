"""GPU-only checks of the model with our kernels (skipped without CUDA; run on the device)."""

import pytest
import torch

from model.gpt import GPT, GPTConfig

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("attn", ["fa2", "fa1", "flex"])
def test_fullgraph_compile_matches_eager(attn):
    """torch.compile(model, fullgraph=True) keeps the kernel in one graph and gives eager's loss and grads."""
    torch.manual_seed(0)
    config = GPTConfig(block_size=256, vocab_size=512, n_layer=2, n_head=6, n_kv_head=2, n_embd=384, attn=attn)
    model = GPT(config).cuda()
    x = torch.randint(0, 512, (8, 256), device="cuda")
    y = torch.randint(0, 512, (8, 256), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss_eager = model(x, y)
    loss_eager.backward()
    grads_eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    compiled = torch.compile(model, fullgraph=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = compiled(x, y)
    loss.backward()
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, loss_eager, rtol=2e-2, atol=2e-2)
    for p, g in zip(model.parameters(), grads_eager):
        assert ((p.grad - g).norm() / g.norm().clamp_min(1e-12)).item() < 5e-2


def test_reading_a_step_waits_for_that_step_only(make_cfg):
    """The one-step-late read: a step's numbers reach the host once that step is done, whatever was queued after it.
    (Read with .tolist(), their copy was queued behind the next step, so the read waited for that one too and the
    GPU idled while the host logged and queued the step after: ~0.9 ms a step of GPT-2 on the H200.)"""
    import math
    import time
    from pathlib import Path

    from trainer.loop import Trainer
    from trainer.runtime import DistInfo
    from trainer.stop import StopRequest

    cfg = make_cfg("trainer.device=cuda", "trainer.dtype=bf16", "run.name=late_read")
    trainer = Trainer(cfg, Path(cfg.run.root) / "late_read", DistInfo(), torch.device("cuda"), torch.bfloat16, "sdpa")
    try:
        start = trainer.timer.mark()
        queued = trainer.train_step(StopRequest())
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time, queued after the step
        t0 = time.perf_counter()
        record, _ = trainer.read(queued, start)
        waited = time.perf_counter() - t0
        torch.cuda.synchronize()
        assert waited < 0.3 and math.isfinite(record["train/loss"]), waited
    finally:
        trainer.logger.close()


def random_docs(batch: int, seqlen: int, cuts: int) -> torch.Tensor:
    """cu_seqlens over batch * seqlen tokens: every row's edges and `cuts` more random document ends (a fixed count,
    so the shape stays the same from step to step)."""
    inside = torch.arange(1, batch * seqlen)
    inside = inside[inside % seqlen != 0]
    edges = torch.arange(0, batch * seqlen + 1, seqlen)
    return torch.cat([edges, inside[torch.randperm(len(inside))[:cuts]]]).sort().values.to(torch.int32)


@pytest.mark.parametrize("attn, docs, loss", [
    ("fa3", False, "full"), ("fa3", True, "full"), ("fa2", False, "full"), ("fa2", True, "full"),
    ("fa3", False, "fused")])
def test_cuda_graph_compile_trains_like_eager(attn, docs, loss):
    """torch.compile(mode="reduce-overhead") (trainer.compile_mode=reduce-overhead: CUDA graphs of the forward and
    the backward) runs our kernels: its warm-up refuses any tensor a kernel wrapper keeps alive in the graphs' memory
    pool, and each replay must give eager's loss and gradients for fresh inputs (model.loss=fused: the loss kernel's
    custom op too)."""
    torch.manual_seed(0)
    # head_dim 128: fa3's Gluon backward runs at this length too
    config = GPTConfig(block_size=256, vocab_size=512, n_layer=2, n_head=4, n_embd=512, attn=attn, loss=loss)
    model = GPT(config).cuda()
    compiled = torch.compile(model, mode="reduce-overhead")
    for step in range(4):  # warm-up, recording, then replays
        x, y = (torch.randint(0, 512, (8, 256), device="cuda") for _ in range(2))
        cu_seqlens = random_docs(8, 256, 6).cuda() if docs else None
        # the compiled step first, as in the trainer: the graphs' warm-up is where fa3 first meets a batch's offsets
        model.zero_grad(set_to_none=True)
        torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = compiled(x, y, return_logits=False, docs=cu_seqlens)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss_eager = model(x, y, docs=cu_seqlens)
        loss_eager.backward()
        torch.testing.assert_close(loss, loss_eager, rtol=2e-2, atol=2e-2, msg=f"step {step}")
        for g, p in zip(grads, model.parameters()):
            assert ((g - p.grad).norm() / p.grad.norm().clamp_min(1e-12)).item() < 5e-2, step
