"""Chunked prefill: a prompt over `max_num_batched_tokens` is computed in chunks, with decode steps of
the running batch in between; outputs are unchanged."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from inference.engine import LLMEngine, SamplingParams
from inference.engine.async_engine import AsyncEngine
from inference.engine.step_log import ENV

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


def test_a_wave_of_whole_prompts_alternates_with_decode_steps(llama: TinyModel) -> None:
    """Prompts that each fit the budget but not together (a wave of admissions): every prefill step is
    followed by a decode step of the running batch, and the tokens are transformers'."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=64, max_num_batched_tokens=48)
    engine.add_request("first", llama.prompts[0], GREEDY)
    results: dict[str, Collected] = {}
    absorb(results, engine.step())  # the first prompt's prefill: it is running now
    for i in (1, 2, 3):  # 17 + 40 + 70 tokens: at least three prefill steps at 48 a step
        engine.add_request(f"r{i}", llama.prompts[i], GREEDY)
    plans = []
    while engine.scheduler.waiting:
        absorb(results, engine.step())
        plans.append(engine.scheduler.last_plan)
    prefills = [tokens for tokens, _, _ in plans if tokens]
    assert len(prefills) >= 3 and max(prefills) <= 48
    kinds = ["prefill" if tokens else "decode" for tokens, _, _ in plans]
    assert all(not (a == b == "prefill") for a, b in zip(kinds, kinds[1:], strict=False)), kinds
    assert all(n_decode >= 1 for tokens, _, n_decode in plans if not tokens)
    drain(engine, results)
    assert [results[f"r{i}"].token_ids for i in (1, 2, 3)] == llama.greedy[1:]
    assert results["first"].token_ids == llama.greedy[0]


def test_without_chunked_prefill_admissions_run_back_to_back(llama: TinyModel) -> None:
    """The interleaving belongs to chunked prefill: with it off, waiting prompts are prefilled before
    the running batch decodes again (the behaviour `--no-chunked-prefill` keeps)."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=64, max_num_batched_tokens=48,
                       enable_chunked_prefill=False)
    engine.add_request("first", llama.prompts[0], GREEDY)
    engine.step()
    for i in (1, 2, 3):
        engine.add_request(f"r{i}", llama.prompts[i], GREEDY)
    plans = []
    while engine.scheduler.waiting:
        engine.step()
        plans.append(engine.scheduler.last_plan)
    assert all(tokens for tokens, _, _ in plans)  # prefill steps only, until the queue is empty
    assert len(plans) >= 2


def test_step_log_records_each_step(llama: TinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENGINE_STEP_LOG: the engine thread writes one line per step with the scheduler's plan."""
    monkeypatch.setenv(ENV, str(tmp_path))
    engine = AsyncEngine(LLMEngine(llama.path, block_size=16, num_blocks=64, max_num_batched_tokens=48))

    async def run() -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate("a", llama.prompts[2], GREEDY):
            tokens.extend(out.new_token_ids)
        return tokens

    try:
        assert asyncio.run(run()) == llama.greedy[2]
    finally:
        engine.shutdown()
    (path,) = tmp_path.glob("steps-*.tsv")
    rows = [line.split("\t") for line in path.read_text().splitlines()]
    assert [(int(r[2]), int(r[3]), int(r[4])) for r in rows] == [(40, 1, 0)] + [(0, 0, 1)] * (NEW_TOKENS - 1)
    assert all(float(r[1]) >= 0 for r in rows)
