"""The decode side runs at most `max_num_seqs` sequences, counting those whose KV came from a prefill
worker; the rest wait in a FIFO ready queue, and queued reservations cannot take the whole pool."""
from __future__ import annotations

import pytest

from inference.engine import LLMEngine, NoFreeBlocks, SamplingParams, SequenceStatus

from .conftest import TinyModel
from .helpers import Collected, absorb, prefill_into

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def drain_capped(engine: LLMEngine, cap: int, results: dict[str, Collected]) -> list[str]:
    """Step to the end, checking the cap every step; returns request ids in the order they first ran."""
    started: list[str] = []
    for _ in range(5000):
        if not engine.has_work():
            return started
        absorb(results, engine.step())
        assert engine.num_running <= cap
        for seq in engine.scheduler.running:
            if seq.request_id not in started:
                started.append(seq.request_id)
    raise AssertionError("engine did not finish")


def test_kv_received_sequences_wait_for_a_slot_in_arrival_order(llama: TinyModel) -> None:
    """Five transferred requests on a batch of 2: never more than 2 run, the others are queued (FIFO),
    every output equals the colocated run, and the pool is empty afterwards."""
    prompts = [llama.prompts[i % len(llama.prompts)] for i in range(5)]
    expected = [r.token_ids for r in LLMEngine(llama.path, num_blocks=64).generate(prompts, GREEDY)]
    prefill = LLMEngine(llama.path, num_blocks=32)
    decode = LLMEngine(llama.path, num_blocks=64, max_num_seqs=2)
    ids = [f"r{i}" for i in range(5)]
    for rid, prompt in zip(ids, prompts, strict=True):
        prefill_into(prefill, decode, rid, prompt, GREEDY)
    assert decode.num_ready == 5 and decode.num_queued == 5 and decode.num_running == 0
    assert all(decode.get_sequence(r).status == SequenceStatus.READY for r in ids)  # type: ignore[union-attr]

    results: dict[str, Collected] = {}
    absorb(results, decode.step())
    assert decode.num_running == 2 and decode.num_queued == 3
    # Every request already streamed its first token (sampled by the prefill side), queued or not.
    assert all(len(results[r].token_ids) >= 1 for r in ids)
    started = ["r0", "r1"] + drain_capped(decode, 2, results)[2:]
    assert started == ids
    assert [results[r].token_ids for r in ids] == expected
    assert decode.block_manager.num_free == 64 and decode.num_queued == 0


def test_aborting_a_queued_request_frees_its_blocks(llama: TinyModel) -> None:
    """A ready request aborted before it got a slot ends with "abort" and leaks nothing; the queue
    moves on without it."""
    prefill = LLMEngine(llama.path, num_blocks=32)
    decode = LLMEngine(llama.path, num_blocks=40, max_num_seqs=1)
    for i in range(3):
        prefill_into(prefill, decode, f"r{i}", llama.prompts[1], GREEDY)
    results: dict[str, Collected] = {}
    absorb(results, decode.step())
    assert decode.num_running == 1 and decode.num_ready == 2
    held = decode.block_manager.num_free
    decode.abort("r1")
    # A 17-token prompt holds two 16-token blocks; the first is r0's, shared (prefix caching).
    assert decode.reserved_hits("r2") == 1
    assert decode.block_manager.num_free == held + 1
    assert decode.num_ready == 1 and decode.queued_blocks == 2
    started = drain_capped(decode, 1, results)
    assert results["r1"].finish_reason == "abort"
    assert results["r0"].finish_reason == results["r2"].finish_reason == "length"
    assert "r1" not in started
    assert decode.block_manager.num_free == 40


def test_queued_reservations_leave_headroom_for_the_running_batch(llama: TinyModel) -> None:
    """Reserved + ready requests may hold at most `max_queued_kv_fraction` of the pool; blocks of a
    sequence that started running no longer count, and one request alone is bound only by the pool."""
    params = SamplingParams(max_tokens=4, temperature=0.0)
    engine = LLMEngine(llama.path, num_blocks=10, max_num_seqs=4, max_queued_kv_fraction=0.5)
    assert engine.max_queued_blocks == 5
    engine.reserve("a", [1] * 48, params)  # 3 blocks
    engine.reserve("b", [1] * 32, params)  # 2 blocks: 5 queued, the bound
    with pytest.raises(NoFreeBlocks, match="not running yet"):
        engine.reserve("c", [1] * 5, params)
    assert engine.block_manager.num_free == 5 and engine.get_sequence("c") is None
    engine.kv_received("a", 3)
    engine.kv_received("b", 3)
    with pytest.raises(NoFreeBlocks):
        engine.reserve("c", [1] * 5, params)  # ready but not running still counts
    engine.step()  # a and b start running
    assert engine.num_running == 2 and engine.queued_blocks == 0
    assert len(engine.reserve("c", [1] * 5, params)) == 1
    engine.abort("c")

    alone = LLMEngine(llama.path, num_blocks=10, max_queued_kv_fraction=0.5)
    assert len(alone.reserve("big", [1] * 150, params)) == 10  # over the bound, but nothing else queued


def test_preemption_with_a_full_ready_queue_does_not_deadlock(llama: TinyModel) -> None:
    """A pool so small that running sequences preempt each other while ready ones hold blocks: the
    preempted sequence (older) is recomputed once blocks free up, ready ones take free slots meanwhile,
    everything finishes with the colocated tokens and the pool ends empty."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [llama.prompts[1]] * 6  # 17 tokens: 2 blocks each, 4 blocks after 40 more tokens
    expected = LLMEngine(llama.path, num_blocks=64).generate(prompts[:1], params)[0].token_ids
    prefill = LLMEngine(llama.path, num_blocks=32)
    # Prefix caching off: six equal prompts would share their first block and the pool would not run dry.
    decode = LLMEngine(llama.path, num_blocks=16, max_num_seqs=3, max_queued_kv_fraction=1.0,
                       enable_prefix_caching=False)
    for i, prompt in enumerate(prompts):
        prefill_into(prefill, decode, f"r{i}", prompt, params)
    results: dict[str, Collected] = {}
    drain_capped(decode, 3, results)
    assert decode.num_preemptions > 0
    assert all(results[f"r{i}"].token_ids == expected for i in range(6))
    assert decode.block_manager.num_free == 16


@pytest.mark.parametrize(("max_seqs", "max_tokens", "per_step"), [(2, 4096, 2), (8, 40, 2), (8, 4096, 5)])
def test_prefill_batches_honour_seq_and_token_caps(
    llama: TinyModel, max_seqs: int, max_tokens: int, per_step: int
) -> None:
    """A prefill worker batches at most `max_num_seqs` prompts and `max_num_batched_tokens` tokens
    (17-token prompts: 40 tokens fit two) per forward pass."""
    # Prefix caching off: the same prompt five times would otherwise cost one token after the first.
    engine = LLMEngine(llama.path, num_blocks=64, max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens,
                       enable_prefix_caching=False)
    for i in range(5):
        engine.add_request(f"p{i}", llama.prompts[1], GREEDY, prefill_only=True)
    sizes: list[int] = []
    while engine.has_work():
        sizes.append(sum(1 for out in engine.step() if out.finish_reason == "prefilled"))
    assert sizes[0] == per_step and max(sizes) == per_step and sum(sizes) == 5
