"""A decode worker offered local prefill counts a queued local prefill's leading blocks as cached for the
next prompt: the engine computes them once and the prompt reuses them, so a burst's cold prompts that
share a system prompt have only their own tokens to compute and go local when those are few."""
from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from inference.server.args import parse_args
from inference.server.decode import DecodeWorker
from inference.server.local_prefill import open_local
from inference.server.pending_prefix import PendingPrefixes
from inference.server.worker import create_worker
from tests.support.worker_flags import worker_argv

PREFIX = 64  # SHARED_PREFIX_WAIT_TOKENS: the engine waits for blocks this long that a prompt ahead computes


def test_pending_blocks_count_from_the_start_and_only_when_the_engine_would_wait_for_them() -> None:
    pending = PendingPrefixes(block_size=8)
    rng = random.Random(1)
    prefix = [rng.randrange(3, 200) for _ in range(PREFIX)]
    first = pending.hashes([*prefix, 1, 2, 3, 4, 5, 6, 7, 8, 9])  # 73 tokens: 9 usable blocks
    assert len(first) == 9
    pending.add("a", first)
    assert pending.shared_tokens(pending.hashes([*prefix, 9, 9, 9])) == PREFIX
    assert pending.shared_tokens(pending.hashes([*prefix[:56], 7, *prefix[57:], 9])) == 0  # 56 < 64: computed
    assert pending.shared_tokens(pending.hashes([5, *prefix])) == 0  # a different first block: nothing shared
    pending.add("b", pending.hashes([*prefix, 9]))
    pending.remove("a")
    assert pending.shared_tokens(first) == PREFIX  # "b" still computes the prefix
    pending.remove("b")
    pending.remove("b")  # a second end of the same stream is harmless
    assert pending.shared_tokens(first) == 0 and len(pending) == 0
    off = PendingPrefixes(block_size=8, enabled=False)
    off.add("a", first)
    assert off.shared_tokens(first) == 0


@pytest.fixture
def decode_worker(tiny_model_dir: Path) -> Iterator[DecodeWorker]:
    argv = worker_argv(tiny_model_dir, "decode", "--num-kv-blocks", "64", "--block-size", "8", "--host", "127.0.0.1",
                       "--kv-port", "0")
    worker = create_worker(parse_args(argv))
    assert isinstance(worker, DecodeWorker)
    worker.start()
    try:
        yield worker
    finally:
        worker.stop()


def _body(request_id: str, ids: list[int], limit: int) -> dict[str, object]:
    return {"request_id": request_id, "input_ids": ids, "local_prefill_max_tokens": limit,
            "sampling": {"max_tokens": 2, "temperature": 0, "ignore_eos": True}}


async def _drain(lines: AsyncIterator[bytes]) -> list[bytes]:
    return [line async for line in lines]


@pytest.mark.parametrize("credit", [True, False])
def test_a_prompt_sharing_a_queued_local_prefills_prefix_is_prefilled_locally(
        decode_worker: DecodeWorker, credit: bool) -> None:
    decode_worker.pending_prefixes.enabled = credit
    rng = random.Random(2)
    prefix = [rng.randrange(3, 200) for _ in range(PREFIX)]
    first, second = ([*prefix, *(rng.randrange(3, 200) for _ in range(16))] for _ in range(2))

    async def burst() -> tuple[bool, list[bytes], list[bytes]]:
        # The first is offered a limit its 80 cold tokens fit, the second one they do not (48).
        a = await open_local(decode_worker, _body("a", first, 128), None)
        assert a is not None
        b = await open_local(decode_worker, _body("b", second, 48), None)
        lines_a = await _drain(a)
        lines_b = await _drain(b) if b is not None else []
        return b is not None, lines_a, lines_b

    local, lines_a, lines_b = asyncio.run(burst())
    assert b'"done"' in lines_a[-1]
    metrics = decode_worker.metrics
    assert len(decode_worker.pending_prefixes) == 0  # every local prefill left the pending set
    if credit:
        # 80 tokens of which 64 the queued first prompt computes: 16 to compute, under 48, so local; and the
        # engine reused those 64 indeed.
        assert local and b'"done"' in lines_b[-1]
        assert metrics.prefilled_prompt_tokens._value.get() == 160
        assert metrics.prefilled_reused_tokens._value.get() == PREFIX
        assert metrics.prefilled_cached_tokens._value.get() == 0  # nothing was cached at receipt
    else:  # counted at receipt: 80 cold tokens, over 48, and no remote queue told: the remote path
        assert not local
        assert metrics.prefilled_prompt_tokens._value.get() == 80
