"""The vectorized sampler draws from the filtered distribution, row by row independent of the batch."""
from __future__ import annotations

import pytest
import torch

from inference.engine import SamplingParams
from inference.engine.sampler import row_argmax, sample

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def frequencies(params: SamplingParams, n: int = 40_000) -> torch.Tensor:
    """Empirical token frequencies of `n` rows of LOGITS sampled in one batch."""
    tokens = sample(LOGITS.repeat(n, 1), [params] * n, [0] * n)
    return torch.bincount(torch.tensor(tokens), minlength=LOGITS.numel()).float() / n


def expected(keep: list[int], temperature: float = 1.0) -> torch.Tensor:
    """softmax(LOGITS / T) renormalised over the kept tokens."""
    p = torch.softmax(LOGITS / temperature, -1)
    mask = torch.zeros_like(p, dtype=torch.bool)
    mask[keep] = True
    p = torch.where(mask, p, torch.zeros_like(p))
    return p / p.sum()


@pytest.mark.parametrize(
    ("params", "keep"),
    [
        (SamplingParams(temperature=1.0), [0, 1, 2, 3, 4, 5]),
        (SamplingParams(temperature=0.7), [0, 1, 2, 3, 4, 5]),
        (SamplingParams(temperature=1.0, top_k=3), [0, 1, 2]),
        # softmax(LOGITS) ≈ [.53, .20, .12, .07, .03, .003]: tokens above 0.8 cumulated stay (0, 1, 2).
        (SamplingParams(temperature=1.0, top_p=0.8), [0, 1, 2]),
        (SamplingParams(temperature=1.0, min_p=0.2), [0, 1, 2]),  # p >= 0.2 * 0.53
        (SamplingParams(temperature=1.0, top_k=4, top_p=0.95, min_p=0.1), [0, 1, 2, 3]),
    ],
)
def test_batched_draws_follow_the_filtered_distribution(params: SamplingParams, keep: list[int]) -> None:
    freq = frequencies(params)
    want = expected(keep, params.temperature)
    assert torch.all(freq[[i for i in range(LOGITS.numel()) if i not in keep]] == 0)
    # 40k draws: the standard error of each frequency is below 0.0025; allow four of them.
    assert torch.allclose(freq, want, atol=0.01), (freq, want)


def test_rows_are_independent_of_the_batch_they_are_in() -> None:
    """Seeded rows give the same token alone or mixed with greedy, unseeded and other seeded rows."""
    torch.manual_seed(0)
    logits = torch.randn(8, 300) * 3
    params = [
        SamplingParams(temperature=0.9, seed=11),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=50, seed=12),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05, seed=13),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1e-38, seed=14),  # overflows: falls back to greedy
        SamplingParams(temperature=0.5, seed=15),
    ]
    steps = [3, 0, 7, 1, 2, 5, 4, 9]
    together = sample(logits, params, steps)
    for i, p in enumerate(params):
        if p.seed is not None or p.greedy:
            assert sample(logits[i : i + 1], [p], [steps[i]]) == [together[i]], i
    assert together[1] == int(logits[1].argmax()) and together[6] == int(logits[6].argmax())
    # Another output index of the same request draws fresh noise.
    draws = {sample(logits[:1], params[:1], [s])[0] for s in range(40)}
    assert len(draws) > 1


def test_all_greedy_batch_is_argmax() -> None:
    logits = torch.randn(5, 50)
    assert sample(logits, [SamplingParams(temperature=0.0)] * 5, [0] * 5) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_is_argmax_with_first_index_on_ties(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 5000).to(dtype)
    x[3, 10] = x[3, 4000] = 100.0  # a tie: the first index wins, as with torch.argmax
    x[7, :] = 0.0  # a row of equal values
    assert torch.equal(row_argmax(x), torch.argmax(x, dim=-1))
    assert row_argmax(x)[3] == 10 and row_argmax(x)[7] == 0
