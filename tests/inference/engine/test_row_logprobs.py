"""The C++ reductions of raw log-probabilities (csrc/row_logprobs.cpp): each row's log-sum-exp and top-k
logits equal torch's (fp64 log-sum-exp within 1e-5, torch.topk's values and indices), for fp32 and bf16
logits, vocabularies that are not a multiple of the 64-value chunk, k wider than the chunk count, a
crowded top, rows with a stride; and `token_logprobs`, which uses it on a CPU, equals a log-softmax."""
from __future__ import annotations

import pytest
import torch

from inference.engine import logprobs
from inference.engine.cpu_kernels import load_kernels
from inference.engine.logprobs import token_logprobs

ops = load_kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="the CPU kernels do not build here (no compiler/ninja)")


def check(x: torch.Tensor, k: int) -> None:
    lse, values, indices = ops.row_lse_topk(x, k)
    ref_lse = torch.logsumexp(x.double(), dim=-1)
    assert (lse.double() - ref_lse).abs().max().item() < 1e-5
    assert values.shape == indices.shape == (x.shape[0], k)
    ref = torch.topk(x.float(), k, dim=-1)
    assert torch.equal(values, ref.values)
    assert torch.equal(indices, ref.indices)


@pytest.mark.parametrize(("vocab", "k"), [(49152, 5), (49157, 20), (500, 3), (128, 5), (64, 64), (1000, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lse_and_top_k_equal_torch(vocab: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(vocab + k)
    # Distinct values (a permutation scaled), so torch.topk's order is the only right one.
    x = torch.stack([torch.randperm(vocab, generator=g) for _ in range(6)]).float() * (8.0 / vocab) - 4.0
    x[1, 64:70] += 50.0  # the top values crowded into one chunk
    x[2] *= 20.0  # a sharp row: most exp() terms underflow
    x = x.to(dtype)
    if dtype == torch.bfloat16 and vocab > 256:
        # bf16 rounds the permutation into ties: compare values, and that each index holds its value.
        lse, values, indices = ops.row_lse_topk(x, k)
        assert (lse.double() - torch.logsumexp(x.double(), -1)).abs().max().item() < 1e-5
        assert torch.equal(values, torch.topk(x.float(), k, dim=-1).values)
        assert torch.equal(x.float().gather(1, indices), values)
        return
    check(x, k)


def test_rows_with_a_stride() -> None:
    x = torch.randn(8, 3000, generator=torch.Generator().manual_seed(3)) * 5
    check(x[::2], 7)  # every other row: stride(0) is twice the vocabulary


def test_only_cpu_fp32_bf16_rows_take_the_kernel() -> None:
    assert logprobs._row_kernel(torch.randn(2, 64)) is not None
    assert logprobs._row_kernel(torch.randn(2, 64, dtype=torch.float64)) is None
    assert logprobs._row_kernel(torch.randn(64, 2).t()) is None  # last dim not contiguous


def test_refuses_what_it_cannot_read() -> None:
    with pytest.raises(RuntimeError, match="contiguous last dim"):
        ops.row_lse_topk(torch.randn(4, 8).t(), 2)
    with pytest.raises(RuntimeError, match="float32 and bfloat16"):
        ops.row_lse_topk(torch.randn(2, 8, dtype=torch.float64), 2)
    with pytest.raises(RuntimeError, match=r"k must be in \[0, vocab\]"):
        ops.row_lse_topk(torch.randn(2, 8), 9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_equal_a_log_softmax(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    logits = (torch.randn(5, 49152, generator=torch.Generator().manual_seed(9)) * 3).to(dtype)
    tokens = [0, 17, 49151, 300, 12345]
    assert logprobs._row_kernel(logits) is not None  # the kernels are loaded (above): it is used
    found = token_logprobs(logits, tokens, [5, 0, 3, 1, 5])
    monkeypatch.setattr(logprobs, "_row_kernel", lambda _: None)
    torch_path = token_logprobs(logits, tokens, [5, 0, 3, 1, 5])
    for ours, theirs in zip(found, torch_path, strict=True):
        assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]
        assert abs(ours.logprob - theirs.logprob) < 1e-5
    ref = torch.log_softmax(logits.double(), dim=-1)
    for i, (entry, token) in enumerate(zip(found, tokens, strict=True)):
        assert abs(entry.logprob - float(ref[i, token])) < 1e-5
        top = torch.topk(ref[i], len(entry.top))
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert all(abs(lp - float(v)) < 1e-5 for (_, lp), v in zip(entry.top, top.values, strict=True))
