"""Chunked prefill: a prompt over `max_num_batched_tokens` is computed in chunks, with decode steps of
the running batch in between; outputs are unchanged."""
from __future__ import annotations

import pytest

from inference.engine import LLMEngine, SamplingParams

from .conftest import NEW_TOKENS, TinyModel
from .helpers import Collected, absorb, drain
from .test_batch_cap import prefill_into

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("budget", [16, 24, 50])
def test_chunked_greedy_matches_transformers(llama: TinyModel, budget: int) -> None:
    """Prompts of 3..70 tokens through a budget of `budget` tokens per step: transformers' tokens."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=64, max_num_batched_tokens=budget)
    for i, prompt in enumerate(llama.prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    results: dict[str, Collected] = {}
    chunks = 0
    while engine.has_work():
        absorb(results, engine.step())
        chunks += sum(1 for s in engine.scheduler.waiting if s.block_ids)  # a partial prompt waits
    assert chunks > 0
    for i, ref in enumerate(llama.greedy):
        assert results[f"r{i}"].token_ids == ref
    assert engine.kv_usage() == 0.0


def test_running_streams_advance_between_chunks(llama: TinyModel) -> None:
    """A 70-token prompt in 16-token chunks: the running request gets a token between every two
    chunks instead of waiting for the whole prompt."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=64, max_num_batched_tokens=16)
    engine.add_request("short", llama.prompts[0], GREEDY)
    results: dict[str, Collected] = {}
    absorb(results, engine.step())  # the short prompt's prefill: it is running now
    engine.add_request("long", llama.prompts[3], GREEDY)
    got = []
    while "long" not in results or not results["long"].token_ids:
        outs = engine.step()
        absorb(results, outs)
        got.append(any(o.request_id == "short" for o in outs))
    assert len(got) >= 9  # five chunks and the decode steps between them
    assert all(a or b for a, b in zip(got, got[1:], strict=False))  # never two steps without a token
    drain(engine, results)
    assert results["long"].token_ids == llama.greedy[3]
    assert results["short"].token_ids == llama.greedy[0]


def test_seeded_and_prefix_cached_chunks_match_unchunked(llama: TinyModel) -> None:
    """Seeded sampling and a cached prefix give the same tokens chunked or not."""
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)
    prompts = [llama.prompts[3], llama.prompts[3][:50] + [1, 2, 3]]
    whole = LLMEngine(llama.path, block_size=16, num_blocks=64, enable_chunked_prefill=False)
    chunked = LLMEngine(llama.path, block_size=16, num_blocks=64, max_num_batched_tokens=16)
    for engine in (whole, chunked):
        engine.generate(prompts[:1], params)  # caches the first prompt's blocks
    assert [r.token_ids for r in chunked.generate(prompts, [params, params])] == [
        r.token_ids for r in whole.generate(prompts, [params, params])
    ]
    assert chunked.scheduler.prefix_hit_tokens > 0


def test_chunked_prefill_on_the_prefill_side_then_decode(llama: TinyModel) -> None:
    """A prefill worker chunking its prompts, a decode worker whose pool forces preemption (its
    recomputation is chunked too): the colocated tokens."""
    expected = [r.token_ids for r in LLMEngine(llama.path, num_blocks=64).generate(llama.prompts, GREEDY)]
    prefill = LLMEngine(llama.path, num_blocks=32, max_num_batched_tokens=16)
    decode = LLMEngine(llama.path, num_blocks=12, max_num_batched_tokens=16, max_queued_kv_fraction=1.0)
    for i, prompt in enumerate(llama.prompts):
        prefill_into(prefill, decode, f"r{i}", prompt, GREEDY)
    results = drain(decode)
    assert decode.num_preemptions > 0
    assert [results[f"r{i}"].token_ids for i in range(4)] == expected
    assert decode.kv_usage() == 0.0 and prefill.kv_usage() == 0.0
