"""AsyncEngine: background stepping thread, asyncio streams, aborts and error containment."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from inference.engine import AsyncEngine, LLMEngine, RequestOutput, SamplingParams

from .conftest import NEW_TOKENS, TinyModel
from .helpers import drain

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)


async def collect(agen: Any) -> list[RequestOutput]:
    """All outputs of one request stream."""
    return [out async for out in agen]


def tokens(outs: list[RequestOutput]) -> list[int]:
    """Concatenated token ids."""
    return [t for o in outs for t in o.new_token_ids]


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll until `cond()` holds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


def test_concurrent_generate_matches_greedy(llama: TinyModel) -> None:
    """Requests submitted concurrently (and later) all stream the greedy tokens."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=64)
    aengine = AsyncEngine(engine)

    async def main() -> list[list[RequestOutput]]:
        first = [asyncio.create_task(collect(aengine.generate(f"r{i}", p, GREEDY))) for i, p in
                 enumerate(llama.prompts[:3])]
        await asyncio.sleep(0.05)
        late = asyncio.create_task(collect(aengine.generate("r3", llama.prompts[3], GREEDY)))
        return [*await asyncio.gather(*first), await late]

    try:
        results = asyncio.run(main())
    finally:
        aengine.shutdown()
    for outs, ref in zip(results, llama.greedy, strict=True):
        assert tokens(outs) == ref
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert not any(o.finished for o in outs[:-1])
    assert engine.block_manager.num_free == 64


def test_reserve_stream_and_kv_received(llama: TinyModel) -> None:
    """Decode-side flow through AsyncEngine: reserve, KV copied in, kv_received, stream."""
    prefill = LLMEngine(llama.path, block_size=16, num_blocks=16)
    prompt = llama.prompts[2]
    prefill.add_request("p", prompt, GREEDY, prefill_only=True)
    pre = drain(prefill)["p"]
    src = pre.outputs[-1].block_ids
    assert src is not None

    engine = LLMEngine(llama.path, block_size=16, num_blocks=16)
    aengine = AsyncEngine(engine)

    async def main() -> list[RequestOutput]:
        dst = await asyncio.to_thread(aengine.reserve, "p", prompt, GREEDY)
        engine.kv_cache.data[dst] = prefill.kv_cache.data[src]
        # kv_received before anyone listens: the outputs are buffered for stream().
        await asyncio.to_thread(aengine.kv_received, "p", pre.token_ids[0])
        return await collect(aengine.stream("p"))

    try:
        outs = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert tokens(outs) == llama.greedy[2]
    wait_for(lambda: engine.block_manager.num_free == 16)


def test_leaving_early_aborts_and_frees_blocks(llama: TinyModel) -> None:
    """Closing the stream aborts the request; explicit abort ends a stream with "abort"."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=32)
    aengine = AsyncEngine(engine)
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def main() -> list[RequestOutput]:
        agen = aengine.generate("a", llama.prompts[3], long)
        async for out in agen:
            if out.new_token_ids:
                break
        await agen.aclose()
        outs: list[RequestOutput] = []
        async for out in aengine.generate("b", llama.prompts[1], long):
            outs.append(out)
            if len(outs) == 3:
                aengine.abort("b")
        return outs

    try:
        outs = asyncio.run(main())
        assert outs[-1].finish_reason == "abort" and outs[-1].finished
        wait_for(lambda: engine.block_manager.num_free == 32 and not engine.has_work())
    finally:
        aengine.shutdown()


def test_invalid_requests_raise_before_streaming(llama: TinyModel) -> None:
    """Bad params or prompts raise ValueError from generate(); duplicate ids too."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=8)
    aengine = AsyncEngine(engine)

    async def main() -> None:
        with pytest.raises(ValueError, match="top_p"):
            await collect(aengine.generate("x", [1, 2], SamplingParams(top_p=2.0)))
        with pytest.raises(ValueError, match="KV blocks"):
            await collect(aengine.generate("x", [1] * 200, GREEDY))
        aengine.reserve("dup", [1, 2], GREEDY)
        with pytest.raises(ValueError, match="already exists"):
            await collect(aengine.generate("dup", [1, 2], GREEDY))
        with pytest.raises(KeyError):
            await collect(aengine.stream("never-reserved"))

    try:
        asyncio.run(main())
    finally:
        aengine.shutdown()


def test_engine_errors_fail_requests_not_the_thread(llama: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing forward pass ends the affected requests with finish_reason "error"; the thread lives on."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=16)
    aengine = AsyncEngine(engine)
    real_forward = engine.model.forward
    calls = {"n": 0}

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", flaky)

    async def main() -> tuple[list[RequestOutput], list[RequestOutput]]:
        failed = await collect(aengine.generate("bad", llama.prompts[0], GREEDY))
        ok = await collect(aengine.generate("good", llama.prompts[0], GREEDY))
        return failed, ok

    try:
        failed, ok = asyncio.run(main())
        assert failed[-1].finish_reason == "error" and "boom" in (failed[-1].error or "")
        assert tokens(ok) == llama.greedy[0]
        assert aengine.is_running
        wait_for(lambda: engine.block_manager.num_free == 16)
    finally:
        aengine.shutdown()
    assert not aengine.is_running
