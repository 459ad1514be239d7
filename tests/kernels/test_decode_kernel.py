"""kernels.decode.fa2_decode (split-K/V decode) against a float64 reference, and as the model's decode path."""

import pytest
import torch

from kernels.decode import fa2_decode
from model.gpt import GPT, GPTConfig
from reference import reference_attention


@pytest.fixture(autouse=True)
def _kernel_device():
    """The tests make their tensors and models on torch's default device: the CUDA GPU where there is one (the
    kernel needs it there), else the CPU, where Triton's interpreter runs the kernel."""
    if torch.cuda.is_available():
        with torch.device("cuda"):
            yield
    else:
        yield


@pytest.mark.parametrize("batch,n_heads,n_kv_heads,seqlen_k,head_dim,num_splits,dtype", [
    (2, 4, 2, 1, 16, None, torch.float32),      # one key
    (1, 6, 3, 200, 80, None, torch.float32),    # GQA, head_dim not a power of two, default splits
    (2, 4, 1, 130, 64, 3, torch.float16),       # MQA, the last split partly filled
    (1, 2, 2, 300, 32, 1, torch.bfloat16),      # one split: the plain FA2 loop
    (1, 2, 2, 100, 32, 50, torch.float32),      # more splits asked for than key blocks
])
def test_fa2_decode_matches_reference(batch, n_heads, n_kv_heads, seqlen_k, head_dim, num_splits, dtype):
    q = torch.randn(batch, n_heads, 1, head_dim, dtype=dtype)
    # k, v as a KV cache hands them out: the prefix of a longer buffer
    k, v = (torch.randn(batch, n_kv_heads, seqlen_k + 9, head_dim, dtype=dtype)[:, :, :seqlen_k] for _ in range(2))
    o = fa2_decode(q, k, v, num_splits=num_splits)
    assert o.shape == q.shape and o.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(o.double(), reference_attention(q, k, v), atol=tol, rtol=tol)


def test_fa2_decode_rejects_bad_input():
    q, k = torch.randn(1, 2, 2, 16), torch.randn(1, 2, 5, 16)
    with pytest.raises(ValueError, match="seqlen_q=2"):
        fa2_decode(q, k, k)
    with pytest.raises(ValueError, match="num_splits"):
        fa2_decode(q[:, :, :1], k, k, num_splits=0)
    for bad, name in ((2.5, "float"), ("2", "str"), (True, "bool")):
        with pytest.raises(TypeError, match=f"num_splits must be an int or None, got {name}$"):
            fa2_decode(q[:, :, :1], k, k, num_splits=bad)
    with pytest.raises(ValueError, match="head_dim differs"):
        fa2_decode(q[:, :, :1], torch.randn(1, 2, 5, 32), torch.randn(1, 2, 5, 32))


def test_fa2_decode_backward_says_it_has_none():
    """The forward runs with inputs that require grad (its result is the reference's); a backward through it
    raises naming fa2_decode, not torch.library's missing-formula error."""
    q, k, v = (torch.randn(1, 2, n, 16, requires_grad=True) for n in (1, 7, 7))
    o = fa2_decode(q, k, v)
    torch.testing.assert_close(o.detach().double(), reference_attention(q.detach(), k.detach(), v.detach()),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="fa2_decode is not differentiable"):
        o.sum().backward()
    with torch.no_grad():
        assert fa2_decode(q, k, v).grad_fn is None


def test_fa2_decode_opcheck():
    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 70, 16), torch.randn(1, 2, 70, 16)
    torch.library.opcheck(torch.ops.flashgpt.fa2_decode, (q, k, v, 0.25, 2),
                          test_utils=("test_schema", "test_faketensor"))


def test_split_kv_decode_in_the_model():
    model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, attn="fa2")).eval()
    idx = torch.randint(0, 50, (2, 4))
    model.use_split_kv_decode()
    assert torch.equal(model.generate(idx, 10, top_k=1, kv_cache=True), model.generate(idx, 10, top_k=1))
    with pytest.raises(ValueError, match="split_kv decode is for fa2 and fa3"):
        GPT(GPTConfig(block_size=8, vocab_size=10, n_layer=1, n_head=2, n_embd=32)).use_split_kv_decode()


@pytest.mark.parametrize("seqlen", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_fa2_decode_with_device_seqlen(seqlen, num_splits):
    """seqlen (a device tensor) limits the keys to a prefix of the whole buffer; splits past it do nothing."""
    q = torch.randn(2, 4, 1, 32, dtype=torch.float16)
    k, v = (torch.randn(2, 2, 200, 32, dtype=torch.float16) for _ in range(2))
    o = fa2_decode(q, k, v, num_splits=num_splits, seqlen=torch.tensor(seqlen))
    expected = reference_attention(q, k[:, :, :seqlen], v[:, :, :seqlen])
    torch.testing.assert_close(o.double(), expected, atol=2e-3, rtol=2e-3)
    for bad in (torch.tensor([1.0]), torch.tensor(True), torch.tensor(1 + 2j)):
        with pytest.raises(ValueError, match="one-element integer tensor"):
            fa2_decode(q, k, v, seqlen=bad)


def test_fa2_decode_seqlen_beyond_int32_counts_as_all_keys():
    """An int64 seqlen past int32's range is clamped to seqlen_k before it is narrowed (2**32 + 5 is not 5)."""
    q = torch.randn(1, 2, 1, 16, dtype=torch.float16)
    k, v = (torch.randn(1, 2, 70, 16, dtype=torch.float16) for _ in range(2))
    o = fa2_decode(q, k, v, seqlen=torch.tensor(2**32 + 5))
    torch.testing.assert_close(o.double(), reference_attention(q, k, v), atol=2e-3, rtol=2e-3)


def test_fa2_decode_is_public():
    import kernels

    assert kernels.fa2_decode is fa2_decode and "fa2_decode" in kernels.__all__
