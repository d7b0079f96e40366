"""Prefix caching: chained block hashes, ref-counted shared blocks, reuse across requests."""
from __future__ import annotations

import pytest

from inference.engine import BlockManager, LLMEngine, NoFreeBlocks, SamplingParams
from inference.engine.block_manager import block_hashes

from .conftest import NEW_TOKENS, TinyModel
from .helpers import Collected, absorb, drain, prefill_into
from .test_logits_parity import engine_logits, reference_logits

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def test_chained_hashes_identify_prefixes() -> None:
    a = block_hashes(list(range(40)), 8)
    b = block_hashes(list(range(24)) + [99] + list(range(25, 40)), 8)
    assert len(a) == 5 and a[:3] == b[:3] and a[3] != b[3] and a[4] != b[4]  # diverged: all later differ
    assert block_hashes(list(range(41)), 8, a[:2]) == a  # extending known hashes gives the same chain
    assert block_hashes([1, 2, 3], 8) == []  # no full block


def test_shared_blocks_are_ref_counted_and_cached_until_needed() -> None:
    bm = BlockManager(4)
    h = block_hashes(list(range(16)), 8)
    first = bm.allocate(2)
    bm.register(first[0], h[0])
    bm.register(first[1], h[1])
    assert bm.lookup(h) == first and bm.lookup([h[1]]) == [first[1]]
    bm.share(first)  # a second sequence with the same prefix
    bm.free(first)
    assert bm.num_free == 2 and bm.lookup(h) == first  # still held by the second sequence
    bm.free(first)
    assert bm.num_free == 4 and bm.num_cached == 2 and bm.usage() == 0.0
    assert bm.num_free_among(first) == 2
    bm.share(first[:1])  # reuse a cached free block
    assert bm.num_free == 3 and bm.num_cached == 1
    assert bm.allocate(2) == [2, 3]  # never-cached blocks go first...
    assert bm.allocate(1) == [first[1]] and bm.lookup([h[0], h[1]]) == [first[0]]  # ...then evict
    with pytest.raises(ValueError):
        bm.free([first[1], first[1]])


def test_extend_prefix_counts_cached_free_blocks_and_takes_nothing_when_short() -> None:
    bm = BlockManager(4)
    h = block_hashes(list(range(16)), 8)
    prefix = bm.allocate(2)
    for block, content in zip(prefix, h, strict=True):
        bm.register(block, content)
    bm.free(prefix)  # cached, free
    assert bm.blocks_to_take(prefix, 2) == 4
    with pytest.raises(NoFreeBlocks):
        bm.extend_prefix(prefix, 3)  # 2 shared + 3 new > 4
    assert bm.num_free == 4 and bm.num_cached == 2  # nothing was taken
    blocks = bm.extend_prefix(prefix, 2)
    assert blocks[:2] == prefix and bm.num_free == 0


def test_repeated_prompt_hits_and_matches(llama: TinyModel) -> None:
    """The second run of a 70-token prompt reuses its 4 full blocks (64 tokens) and computes only the
    rest; its tokens equal the first run and transformers' greedy."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=64)
    prompt = llama.prompts[3]
    assert len(prompt) == 70
    first = engine.generate([prompt], GREEDY)[0].token_ids
    assert engine.prefix_cache_hit_rate == 0.0
    second = engine.generate([prompt], GREEDY)[0].token_ids
    assert engine.scheduler.prefix_hit_tokens == 64 and engine.prefix_cache_hit_rate == pytest.approx(64 / 140)
    assert first == second == llama.greedy[3]
    assert engine.kv_usage() == 0.0 and engine.block_manager.num_cached > 0


def _shared_prefix_prompts(llama: TinyModel, prefix: int) -> tuple[list[list[int]], list[list[int]]]:
    """Three prompts sharing their first `prefix` tokens, and the greedy tokens of each from an engine
    without prefix caching."""
    system = llama.prompts[3][:prefix]
    prompts = [system + tail for tail in ([5, 6, 7], [8] * 20, [9, 10])]
    plain = LLMEngine(llama.path, block_size=16, num_blocks=64, enable_prefix_caching=False)
    return prompts, [r.token_ids for r in plain.generate(prompts, GREEDY)]


def test_shared_system_prompt_while_running(llama: TinyModel) -> None:
    """Requests sharing a 48-token prefix run together on shared blocks; outputs equal an engine
    without prefix caching, and every block is unreferenced at the end."""
    prompts, expected = _shared_prefix_prompts(llama, 48)
    engine = LLMEngine(llama.path, block_size=16, num_blocks=64)
    results: dict[str, Collected] = {}
    engine.add_request("warm", prompts[0], SamplingParams(max_tokens=1, temperature=0.0))
    drain(engine, results)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    absorb(results, engine.step())  # one prefill of the three, each reusing the 3 system blocks
    shared = engine.get_sequence("r1").block_ids[:3]  # type: ignore[union-attr]
    assert engine.get_sequence("r2").block_ids[:3] == shared  # type: ignore[union-attr]
    drain(engine, results)
    assert [results[f"r{i}"].token_ids for i in range(3)] == expected
    assert engine.scheduler.prefix_hit_tokens == 3 * 48
    assert engine.kv_usage() == 0.0


def test_prefix_hit_logits_match_transformers(llama: TinyModel) -> None:
    """The cached-prefix attention path (keys gathered from shared blocks, offset causal mask) gives
    transformers' logits, like the fresh path."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=64)
    engine.generate([llama.prompts[3][:40]], SamplingParams(max_tokens=1, temperature=0.0))
    prompts = [llama.prompts[3][:40] + [1, 2, 3], llama.prompts[3]]  # 2 and 2 cached blocks
    ours, tokens = engine_logits(engine, prompts, 3)
    assert engine.scheduler.prefix_hit_tokens == 64
    for i, prompt in enumerate(prompts):
        for t, ref in enumerate(reference_logits(llama.hf_model.float(), prompt, tokens[i], 3)):
            assert float((ours[t][i] - ref).abs().max()) < 1e-4


def test_small_pool_evicts_cached_blocks_and_preemption_reuses_them(llama: TinyModel) -> None:
    """8 blocks for four growing sequences: cached blocks are reclaimed when needed, preempted
    sequences recompute from their own cached blocks, and the tokens stay transformers'."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=8, max_num_seqs=8)
    for i, prompt in enumerate(llama.prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    results = drain(engine)
    assert engine.num_preemptions > 0 and engine.scheduler.prefix_hit_tokens > 0
    for i, ref in enumerate(llama.greedy):
        assert results[f"r{i}"].token_ids == ref
    assert engine.kv_usage() == 0.0
    assert engine.block_manager.num_free == 8


def test_decode_reservation_shares_a_cached_prefix(llama: TinyModel) -> None:
    """Decode side of the hop: a request whose prompt starts with blocks this engine already holds
    (an earlier request's) reserves them shared and gets only the rest from the prefill side
    (`reserved_hits`); its tokens equal a colocated run, and the pool ends with nothing held."""
    prefill = LLMEngine(llama.path, block_size=16, num_blocks=64)
    decode = LLMEngine(llama.path, block_size=16, num_blocks=64)
    prompt = llama.prompts[3]  # 70 tokens: 4 full blocks + 6
    other = prompt[:64] + [(t + 1) % 64 for t in prompt[64:]]  # same 4 blocks, another tail
    prefill_into(prefill, decode, "a", prompt, GREEDY)
    assert decode.reserved_hits("a") == 0
    first = drain(decode)["a"].token_ids
    blocks_a = decode.block_manager.lookup(block_hashes(prompt, 16)[:4])
    assert len(blocks_a) == 4  # still cached after "a" finished
    prefill_into(prefill, decode, "b", other, GREEDY)
    assert decode.reserved_hits("b") == 4
    assert decode.scheduler.prefix_hit_tokens == 64
    assert decode.prefix_cache_hit_rate == pytest.approx(64 / 140)
    second = drain(decode)["b"].token_ids
    colocated = LLMEngine(llama.path, block_size=16, num_blocks=64, enable_prefix_caching=False)
    assert first == colocated.generate([prompt], GREEDY)[0].token_ids
    assert second == colocated.generate([other], GREEDY)[0].token_ids
    assert decode.kv_usage() == 0.0


def test_decode_reservation_never_skips_the_last_block(llama: TinyModel) -> None:
    """A prompt whose every block is cached still gets its last block from the prefill side: the
    first token comes with it."""
    prefill = LLMEngine(llama.path, block_size=16, num_blocks=64)
    decode = LLMEngine(llama.path, block_size=16, num_blocks=64)
    prompt = llama.prompts[3][:64]  # exactly 4 full blocks
    prefill_into(prefill, decode, "a", prompt, GREEDY)
    drain(decode)
    prefill_into(prefill, decode, "b", prompt, GREEDY)
    assert decode.reserved_hits("b") == 3
    drain(decode)
    assert decode.kv_usage() == 0.0


def test_a_burst_sharing_a_system_prompt_computes_it_once(llama: TinyModel) -> None:
    """Three requests arriving together with the same 64-token system prompt: the first computes it, the
    others wait one step (their next blocks are being computed) and then find it cached; the tokens are
    those of an engine without prefix caching. A prompt sharing one block with them does not wait."""
    prompts, expected = _shared_prefix_prompts(llama, 64)
    system = prompts[0][:64]
    engine = LLMEngine(llama.path, block_size=16, num_blocks=64)
    results: dict[str, Collected] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    absorb(results, engine.step())
    assert engine.scheduler.last_plan[1] == 1 and engine.scheduler.shared_prefix_waits == 1  # only r0 prefilled
    drain(engine, results)
    assert [results[f"r{i}"].token_ids for i in range(3)] == expected
    assert engine.scheduler.prefix_hit_tokens == 2 * 64  # computed once, reused twice
    one_block = [system[:16] + [11] * 30, system[:16] + [12] * 30]
    other = LLMEngine(llama.path, block_size=16, num_blocks=64)
    for i, p in enumerate(one_block):
        other.add_request(f"s{i}", p, GREEDY)
    other.step()
    assert other.scheduler.last_plan[1] == 2 and other.scheduler.shared_prefix_waits == 0
