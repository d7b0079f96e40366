"""Mixed prefill: one forward carries the running batch's decode rows and prompt tokens (vLLM's
chunked prefill); outputs equal the engine's separate steps and transformers'."""
from __future__ import annotations

import pytest

from inference.engine import LLMEngine, SamplingParams

from .conftest import NEW_TOKENS, TinyModel
from .helpers import Collected, absorb, drain
from .test_model_families import family  # noqa: F401  (the fixture, one tiny checkpoint per family)

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _staggered(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, Collected]:
    """Start the first prompt, then add one more prompt after every step, so that each later prompt
    is prefilled while the earlier ones decode; run everything to the end. `engine.mixed_steps` counts
    the steps that planned prefill and decode sequences together."""
    results: dict[str, Collected] = {}
    mixed = 0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
        absorb(results, engine.step())
        mixed += all(engine.scheduler.last_plan[1:])
    while engine.has_work():
        absorb(results, engine.step())
        mixed += all(engine.scheduler.last_plan[1:])
    engine.mixed_steps = mixed  # type: ignore[attr-defined]
    return results


def test_streams_get_a_token_every_step_while_a_prompt_is_prefilled(llama: TinyModel) -> None:
    """A 70-token prompt in chunks while another request decodes: every step is one forward with both
    (the scheduler's plan), the running request gets a token in each of them, and both end with
    transformers' tokens."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=64, max_num_batched_tokens=20,
                       enable_mixed_prefill=True)
    assert engine.scheduler.enable_mixed_prefill
    engine.scheduler.mixed_queue_scale = 1  # chunks of the budget, however deep the queue
    engine.add_request("short", llama.prompts[0], GREEDY)
    results: dict[str, Collected] = {}
    absorb(results, engine.step())  # the short prompt's prefill: it is running now
    engine.add_request("long", llama.prompts[3], GREEDY)
    plans = []
    while "long" not in results or not results["long"].token_ids:
        outs = engine.step()
        absorb(results, outs)
        plans.append(engine.scheduler.last_plan)
        assert any(o.request_id == "short" for o in outs)  # a token in every step
    # 70 tokens, 20 a step beside the decode row: 4 steps, each with one prefill and one decode sequence.
    assert [(seqs, dec) for _, seqs, dec in plans] == [(1, 1)] * 4
    assert [tokens for tokens, _, _ in plans] == [20, 20, 20, 10]
    drain(engine, results)
    assert results["long"].token_ids == llama.greedy[3]
    assert results["short"].token_ids == llama.greedy[0]
    assert engine.kv_usage() == 0.0


def test_decode_rows_do_not_take_the_prompt_budget(llama: TinyModel) -> None:
    """With more running streams than the budget has tokens, a prompt still gets the whole budget of
    prompt tokens each step beside all the decode rows (the rows once counted against it: a prompt then
    got one block a step, or none), and every request ends with transformers' tokens."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=64, max_num_batched_tokens=16,
                       enable_mixed_prefill=True)
    engine.scheduler.mixed_queue_scale = 1
    results: dict[str, Collected] = {}
    for i in range(3):  # 3 short prompts decoding: 3 rows beside a 16-token budget
        engine.add_request(f"s{i}", llama.prompts[0], GREEDY)
    absorb(results, engine.step())
    assert engine.scheduler.last_plan == (9, 3, 0)
    engine.add_request("long", llama.prompts[3], GREEDY)
    plans = []
    while "long" not in results or not results["long"].token_ids:
        absorb(results, engine.step())
        plans.append(engine.scheduler.last_plan)
    assert plans == [(16, 1, 3)] * 4 + [(6, 1, 3)]
    drain(engine, results)
    assert results["long"].token_ids == llama.greedy[3]
    assert all(results[f"s{i}"].token_ids == llama.greedy[0] for i in range(3))
    assert engine.kv_usage() == 0.0


def test_a_deep_queue_takes_bigger_mixed_steps(llama: TinyModel) -> None:
    """A burst on an idle engine takes up to 8 budgets of prompt tokens in one step; a prompt arriving
    while more streams run than its tokens fill budgets keeps the budget a step; outputs unchanged."""
    # No prefix caching: the late prompt repeats one of the burst's and must be computed in full.
    engine = LLMEngine(llama.path, block_size=16, num_blocks=64, max_num_batched_tokens=16,
                       enable_mixed_prefill=True, enable_prefix_caching=False)
    engine.scheduler.mixed_burst_tokens = 0  # the queue scale alone (test_mixed_burst: with the burst rule)
    results: dict[str, Collected] = {}
    for i in range(4):  # 3 + 17 + 40 + 70 = 130 prompt tokens, no stream running yet
        engine.add_request(f"b{i}", llama.prompts[i], GREEDY)
    absorb(results, engine.step())
    assert engine.scheduler.last_plan == (128, 4, 0)  # 8 budgets: the last prompt's first 68 tokens
    absorb(results, engine.step())
    assert engine.scheduler.last_plan == (2, 1, 3)
    engine.add_request("late", llama.prompts[2], GREEDY)  # 40 tokens beside 4 streams: 10 per stream
    plans = []
    while "late" not in results or not results["late"].token_ids:
        absorb(results, engine.step())
        plans.append(engine.scheduler.last_plan)
    assert plans == [(16, 1, 4), (16, 1, 4), (8, 1, 4)]
    drain(engine, results)
    assert [results[f"b{i}"].token_ids for i in range(4)] == llama.greedy
    assert results["late"].token_ids == llama.greedy[2]
    assert engine.kv_usage() == 0.0


def test_the_queue_counts_only_uncached_prompt_tokens(llama: TinyModel) -> None:
    """A waiting prompt whose prefix is cached adds only its uncached tokens to the queue that sizes a
    mixed step: 6 + 40 queued tokens beside 2 streams give 23 a step (counted whole, 110: all 46)."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=64, max_num_batched_tokens=16,
                       enable_mixed_prefill=True)
    results: dict[str, Collected] = {}
    engine.add_request("first", llama.prompts[3], GREEDY)  # 70 tokens: 4 blocks cached when it is done
    drain(engine, results)
    for i in range(2):
        engine.add_request(f"s{i}", llama.prompts[i], GREEDY)
    absorb(results, engine.step())
    engine.add_request("again", llama.prompts[3], GREEDY)  # 64 cached, 6 to compute
    engine.add_request("fresh", llama.prompts[2], GREEDY)
    absorb(results, engine.step())
    assert engine.scheduler.last_plan == (23, 2, 2)
    drain(engine, results)
    assert results["again"].token_ids == results["first"].token_ids == llama.greedy[3]
    assert results["fresh"].token_ids == llama.greedy[2]


@pytest.mark.parametrize("budget", [16, 40])
def test_greedy_and_seeded_outputs_equal_separate_steps(llama: TinyModel, budget: int) -> None:
    """Prompts arriving while others decode: greedy tokens equal transformers', seeded sampling with
    log-probabilities equals the engine without mixing (same tokens, same log-probabilities)."""
    mixed = LLMEngine(llama.path, block_size=16, num_blocks=64, max_num_batched_tokens=budget,
                      enable_mixed_prefill=True)
    got = _staggered(mixed, llama.prompts, GREEDY)
    assert [got[f"r{i}"].token_ids for i in range(4)] == llama.greedy
    assert mixed.mixed_steps >= 3  # type: ignore[attr-defined]
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True, logprobs=2)
    plain = LLMEngine(llama.path, block_size=16, num_blocks=64, max_num_batched_tokens=budget)
    want = _staggered(plain, llama.prompts, params)
    got = _staggered(mixed, llama.prompts, params)
    for i in range(4):
        assert got[f"r{i}"].token_ids == want[f"r{i}"].token_ids
        ours = [e.logprob for o in got[f"r{i}"].outputs for e in o.logprobs or []]
        theirs = [e.logprob for o in want[f"r{i}"].outputs for e in o.logprobs or []]
        assert len(ours) == 12 and ours == pytest.approx(theirs, abs=1e-4)
    assert mixed.kv_usage() == 0.0


def test_families_match_transformers_with_mixed_steps(family: TinyModel) -> None:  # noqa: F811
    """Every family (sliding windows cut through a mixed step's decode slots and prefill groups; Gemma
    runs its steps apart: no decode kernel in its forward) gives transformers' greedy tokens."""
    engine = LLMEngine(family.path, block_size=16, num_blocks=64, max_num_batched_tokens=24,
                       enable_mixed_prefill=True)
    got = _staggered(engine, family.prompts, GREEDY)
    assert [got[f"r{i}"].token_ids for i in range(4)] == family.greedy
    assert engine.scheduler.enable_mixed_prefill == engine.runner.can_mix
    assert (engine.mixed_steps > 0) == engine.runner.can_mix  # type: ignore[attr-defined]
