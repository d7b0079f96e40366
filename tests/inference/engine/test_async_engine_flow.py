"""AsyncEngine flow control: a consumer that stops reading pauses its sequence, not the others."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

import pytest

from inference.engine import AsyncEngine, LLMEngine, RequestOutput, SamplingParams

from .conftest import NEW_TOKENS, TinyModel

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
WINDOW = 4


def _generated(engine: LLMEngine, request_id: str) -> int:
    """Tokens the engine generated so far for a live request."""
    seq = engine.get_sequence(request_id)
    assert seq is not None, f"{request_id} is not live"
    return len(seq.output_token_ids)


async def _wait_until(cond: Callable[[], bool]) -> None:
    """Poll (on the loop) until `cond()` holds; the bound (30 s) only guards against a hang."""
    for _ in range(3000):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_a_stalled_consumer_pauses_its_sequence_while_others_decode(llama: TinyModel) -> None:
    """The slow request stops about a window past what its consumer took; the fast one runs to the
    end meanwhile; reading again resumes the slow one, and its tokens equal the greedy reference."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=64)
    aengine = AsyncEngine(engine, stream_window=WINDOW)
    steps = 0
    real_step = engine.step

    def counting_step() -> list[RequestOutput]:
        nonlocal steps
        steps += 1
        return real_step()

    engine.step = counting_step  # type: ignore[method-assign]

    async def main() -> tuple[list[int], list[int], int, int]:
        slow: AsyncGenerator[RequestOutput, None] = aengine.generate("slow", llama.prompts[0], GREEDY)
        first = await anext(slow)  # then stop reading
        fast = [t async for o in aengine.generate("fast", llama.prompts[1], GREEDY) for t in o.new_token_ids]
        held = _generated(engine, "slow")
        assert "slow" in aengine._paused
        # Only the paused sequence is left: the engine thread sleeps instead of stepping.
        before = steps
        await asyncio.sleep(0.3)
        idle_steps = steps - before
        assert _generated(engine, "slow") == held
        rest = [t async for o in slow for t in o.new_token_ids]
        return first.new_token_ids + rest, fast, held, idle_steps

    try:
        slow_tokens, fast, held, idle_steps = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert fast == llama.greedy[1]
    # WINDOW outputs handed over and not taken: paused there. The first output counts among them when
    # the consumer took it only after the next ones came (a loaded machine), and one step may be in flight.
    assert WINDOW <= held <= 2 + WINDOW
    assert idle_steps <= 2
    assert slow_tokens == llama.greedy[0]
    assert not aengine._paused
    assert engine.block_manager.num_free == 64


def test_leaving_a_paused_stream_aborts_it(llama: TinyModel) -> None:
    """A consumer that leaves while its sequence is paused: the abort frees the blocks and clears the
    pause (the hang-up case)."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=64)
    aengine = AsyncEngine(engine, stream_window=WINDOW)

    async def main() -> None:
        slow = aengine.generate("slow", llama.prompts[2], GREEDY)
        await anext(slow)
        await _wait_until(lambda: "slow" in aengine._paused)
        await slow.aclose()
        await _wait_until(lambda: engine.get_sequence("slow") is None)

    try:
        asyncio.run(main())
    finally:
        aengine.shutdown()
    assert not aengine._paused
    assert engine.block_manager.num_free == 64


def test_window_zero_turns_flow_control_off(llama: TinyModel) -> None:
    """Without a window a stalled consumer does not hold its sequence back (the old behaviour)."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=64)
    aengine = AsyncEngine(engine, stream_window=0)

    async def main() -> None:
        slow = aengine.generate("slow", llama.prompts[0], GREEDY)
        await anext(slow)
        await _wait_until(lambda: engine.get_sequence("slow") is None)  # ran to the end unread
        rest = [o async for o in slow]
        assert rest[-1].finished and rest[-1].finish_reason == "length"

    try:
        asyncio.run(main())
    finally:
        aengine.shutdown()


def test_window_of_one_is_refused(llama: TinyModel) -> None:
    """A window of 1 would never batch two steps of a stream: refused at construction."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=8)
    with pytest.raises(ValueError, match="stream_window"):
        AsyncEngine(engine, stream_window=1)


def test_a_reserved_request_can_carry_its_own_window(llama: TinyModel) -> None:
    """Decode side with the engine's window off: a request reserved with a window of its own pauses
    when its consumer stops reading (the router-credit case), and resumes to the greedy reference."""
    prefill = LLMEngine(llama.path, block_size=16, num_blocks=16)
    prompt = llama.prompts[0]
    prefill.add_request("p", prompt, GREEDY, prefill_only=True)
    outputs: list[RequestOutput] = []
    while prefill.has_work():
        outputs += prefill.step()
    src = outputs[-1].block_ids
    assert src is not None
    engine = LLMEngine(llama.path, block_size=16, num_blocks=16)
    aengine = AsyncEngine(engine, stream_window=0)

    async def main() -> tuple[list[int], int]:
        dst = await asyncio.to_thread(aengine.reserve, "p", prompt, GREEDY, WINDOW)
        engine.kv_cache.data[dst] = prefill.kv_cache.data[src]
        await asyncio.to_thread(aengine.kv_received, "p", outputs[-1].new_token_ids[0])
        stream = aengine.stream("p")
        first = await anext(stream)
        await _wait_until(lambda: "p" in aengine._paused)
        await asyncio.sleep(0.2)
        held = _generated(engine, "p")
        rest = [t async for o in stream for t in o.new_token_ids]
        return first.new_token_ids + rest, held

    try:
        tokens, held = asyncio.run(main())
        with pytest.raises(ValueError, match="stream_window"):
            aengine.reserve("q", prompt, GREEDY, 1)
    finally:
        aengine.shutdown()
    assert held <= 2 + WINDOW < NEW_TOKENS
    assert tokens == llama.greedy[0]
