"""A prefill worker's reported queue counts the prompt tokens it will compute, not those its cache holds: the
kv-aware router adds its own prefills sent since the report as predicted uncached tokens, so a whole-prompt
count made a worker holding long conversation histories look several times as busy as it was."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from inference.engine import SamplingParams
from inference.server.load import LoadSignals
from inference.server.prefill import PrefillRun, PrefillWorker
from tests.support.worker_flags import running_prefill_worker


class RecordingSignals(LoadSignals):
    """The worker's real load signals, remembering what each prefill added to and took from the queue."""

    def __init__(self) -> None:
        super().__init__()
        self.started: list[int] = []
        self.finished: list[int] = []

    def prefill_started(self, tokens: int) -> None:
        self.started.append(tokens)
        super().prefill_started(tokens)

    def prefill_finished(self, tokens: int, *, computed: bool) -> None:
        self.finished.append(tokens)
        super().prefill_finished(tokens, computed=computed)


@pytest.fixture
def prefill_worker(tiny_model_dir: Path) -> Iterator[PrefillWorker]:
    with running_prefill_worker(tiny_model_dir, "--num-kv-blocks", "32") as worker:
        yield worker


def test_queued_tokens_are_the_uncached_ones(prefill_worker: PrefillWorker) -> None:
    signals = RecordingSignals()
    prefill_worker.signals = signals
    first = list(range(10, 74))  # 64 tokens: 4 blocks of 16
    follow_up = [*first, *range(200, 216)]  # the same history and 16 more tokens

    async def prefill(request_id: str, ids: list[int]) -> None:
        run = PrefillRun(request_id, ids, SamplingParams(max_tokens=1, temperature=0.0), None,  # type: ignore[arg-type]
                         time.perf_counter())
        await prefill_worker._compute_prompt(run)
        prefill_worker.engine.release(request_id)

    asyncio.run(prefill("r1", first))
    asyncio.run(prefill("r2", follow_up))
    # The follow-up's 64 cached tokens were not queued work; every prefill left as much as it added.
    assert signals.started == [64, 16]
    assert signals.finished == signals.started
    assert signals.prefill_queue()[0] == 0
