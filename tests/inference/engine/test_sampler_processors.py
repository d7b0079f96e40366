"""Penalties, logit_bias and min_tokens in the vectorized sampler equal a row-by-row reference."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from inference.engine import SamplingParams
from inference.engine.logits_processors import apply_processors
from inference.engine.sampler import sample

VOCAB = 64


@dataclass
class History:
    """A request's tokens as the sampler reads them (the engine passes its Sequences)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    stop_ids: frozenset[int] | None = None


def reference(logits: torch.Tensor, params: SamplingParams, history: History) -> torch.Tensor:
    """One row, written out plainly: min_tokens mask, logit_bias, repetition, frequency, presence."""
    x = logits.double().clone()
    generated_so_far = params.seed_offset + len(history.output_token_ids)
    if generated_so_far < params.min_tokens:
        for token in history.stop_ids if history.stop_ids is not None else params.stop_token_ids:
            x[token] = float("-inf")
    for token, bias in params.logit_bias.items():
        x[token] += bias
    for token in set(history.prompt_token_ids + history.output_token_ids):
        if params.repetition_penalty != 1.0:
            x[token] = x[token] / params.repetition_penalty if x[token] > 0 else x[token] * params.repetition_penalty
    offset = params.seed_offset
    generated = (history.prompt_token_ids[-offset:] if offset else []) + history.output_token_ids
    for token in set(generated):
        count = generated.count(token)
        x[token] -= params.frequency_penalty * count + params.presence_penalty
    return x


def _batch() -> tuple[torch.Tensor, list[SamplingParams], list[History]]:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(7, VOCAB, generator=gen) * 4
    params = [
        SamplingParams(temperature=0),  # no processor: untouched
        SamplingParams(frequency_penalty=0.7, presence_penalty=-0.3),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(temperature=0, repetition_penalty=0.8, frequency_penalty=-1.5, logit_bias={5: 20.0, 9: -3.5}),
        SamplingParams(top_p=0.5),  # no processor: untouched
        SamplingParams(min_tokens=4, presence_penalty=2.0, seed_offset=2),  # a migrated stream
        SamplingParams(min_tokens=2, stop_token_ids=[11], logit_bias={0: 100.0}),
    ]
    histories = [
        History([1, 2, 3], [4, 4, 5]),
        History([1, 2, 3, 3], [7, 7, 7, 8, 1]),
        History([10, 12, 12], [13, 10]),
        History([5, 6, 9], [9, 9, 20, 5]),
        History([1, 2], [3]),
        History([30, 31, 32, 33], [33], stop_ids=frozenset({2, 63})),  # last 2 prompt tokens generated
        History([1], [2], stop_ids=frozenset({11, 63})),
    ]
    return logits, params, histories


def test_processed_logits_equal_the_reference_and_rows_without_processors_are_untouched() -> None:
    logits, params, histories = _batch()
    processed = apply_processors(logits, params, histories)
    assert processed.dtype == torch.float32
    for row, (p, h) in enumerate(zip(params, histories, strict=True)):
        expected = reference(logits[row], p, h).float()
        assert torch.equal(torch.isinf(processed[row]), torch.isinf(expected)), row
        finite = torch.isfinite(expected)
        torch.testing.assert_close(processed[row][finite], expected[finite], rtol=1e-6, atol=1e-5)
    for row in (0, 4):
        assert torch.equal(processed[row], logits[row])
    assert processed[5, 2] == float("-inf") and processed[5, 63] == float("-inf")  # 2 + 1 < min_tokens 4
    assert processed[6, 11] == float("-inf")  # one generated < min_tokens 2
    assert processed[1, 7] != logits[1, 7]


def test_the_callers_logits_are_not_written() -> None:
    logits, params, histories = _batch()
    before = logits.clone()
    apply_processors(logits, params, histories)
    apply_processors(logits[1:4], params[1:4], histories[1:4])  # every row processed
    assert torch.equal(logits, before)


def test_a_batch_without_processors_passes_through() -> None:
    logits = torch.randn(3, VOCAB)
    params = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(top_k=3)]
    assert apply_processors(logits, params, [History([1])] * 3) is logits


def test_greedy_rows_take_the_argmax_of_the_processed_logits() -> None:
    logits, params, histories = _batch()
    greedy = [SamplingParams(**{**p.to_dict(), "temperature": 0.0, "logit_bias": p.logit_bias}) for p in params]
    tokens = sample(logits, greedy, [0] * len(greedy), histories)
    rows = enumerate(zip(greedy, histories, strict=True))
    expected = [int(reference(logits[r], p, h).argmax()) for r, (p, h) in rows]
    assert tokens == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_logit_bias_forces_its_token_whatever_the_sampling(dtype: torch.dtype) -> None:
    logits = (torch.randn(64, VOCAB) * 3).to(dtype)
    params = [SamplingParams(temperature=1.0, top_k=5, logit_bias={17: 100.0})] * 32
    params += [SamplingParams(temperature=0.0, logit_bias={42: 100.0})] * 32
    tokens = sample(logits, params, list(range(64)), [History([1, 2])] * 64)
    assert tokens == [17] * 32 + [42] * 32


def test_min_tokens_suppresses_eos_until_reached() -> None:
    eos = 3
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, eos] = 10.0  # the model wants to stop at once
    params = SamplingParams(temperature=0.0, min_tokens=3)
    history = History([1, 2], [], stop_ids=frozenset({eos}))
    picked = []
    for _ in range(5):
        token = sample(logits, [params], [len(history.output_token_ids)], [history])[0]
        picked.append(token)
        history.output_token_ids.append(token)
    assert picked[:3] != [eos] * 3 and eos not in picked[:3]
    assert picked[3:] == [eos, eos]
    # Sampled rows too: a masked stop token has probability 0.
    sampled = SamplingParams(temperature=1.5, min_tokens=1)
    draws = sample(logits.repeat(500, 1), [sampled] * 500, list(range(500)), [History([1], [], frozenset({eos}))] * 500)
    assert eos not in draws


def test_penalties_change_sampled_draws_as_the_processed_distribution() -> None:
    logits = torch.tensor([[2.0, 1.9, -1.0, -2.0]])
    n = 20_000
    params = SamplingParams(temperature=1.0, frequency_penalty=1.0, seed=None)
    history = History([3], [0, 0])  # token 0 generated twice: 2.0 - 2 = 0.0
    draws = sample(logits.repeat(n, 1), [params] * n, [0] * n, [history] * n)
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / n
    expected = torch.softmax(torch.tensor([0.0, 1.9, -1.0, -2.0]), -1)
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)


def test_a_seeded_row_with_penalties_draws_the_same_in_any_batch() -> None:
    logits, params, histories = _batch()
    seeded = SamplingParams(temperature=0.7, seed=11, frequency_penalty=0.4, repetition_penalty=1.2,
                            logit_bias={3: 2.0})
    history = History([1, 2, 3], [3, 3, 8])
    alone = [sample(logits[1:2], [seeded], [step], [history])[0] for step in range(20)]
    mixed = [sample(logits[:3], [params[0], seeded, params[2]], [0, step, 0], [histories[0], history, histories[2]])[1]
             for step in range(20)]
    assert alone == mixed
