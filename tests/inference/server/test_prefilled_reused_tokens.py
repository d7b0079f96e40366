"""The hit a worker reports is what its engine reused, counted when the prefill was scheduled.

A burst of prompts sharing a system prompt finds nothing cached at receipt (none has been computed yet),
yet the engine computes the shared blocks once and the other prompts of the burst reuse them
(scheduler.SHARED_PREFIX_WAIT_TOKENS). `worker_prefilled_reused_tokens_total` counts that reuse, on a
prefill worker and on a worker that prefills locally (`--service-type both`, real processes);
`worker_prefilled_cached_tokens_total` stays the prediction at receipt.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from inference.engine import SamplingParams
from inference.server.prefill import PrefillRun, PrefillWorker
from tests.support.processes import Proc, post_json, start_router, start_worker
from tests.support.worker_flags import running_prefill_worker

BURST = 4
PREFIX = 64  # tokens shared by the burst: SHARED_PREFIX_WAIT_TOKENS, whole blocks of 16 and of 8
HTTP_TIMEOUT = httpx.Timeout(60.0, connect=10.0)


@pytest.fixture
def prefill_worker(tiny_model_dir: Path) -> Iterator[PrefillWorker]:
    with running_prefill_worker(tiny_model_dir, "--num-kv-blocks", "64", "--block-size", "16") as worker:
        yield worker


def _burst(rng: random.Random, own: int) -> list[list[int]]:
    """`BURST` prompts: the same `PREFIX` tokens, then `own` tokens of their own."""
    prefix = [rng.randrange(3, 200) for _ in range(PREFIX)]
    return [prefix + [rng.randrange(3, 200) for _ in range(own)] for _ in range(BURST)]


def test_a_burst_on_a_prefill_worker_counts_the_shared_prefix_reused_by_all_but_the_first(
        prefill_worker: PrefillWorker) -> None:
    prompts = _burst(random.Random(3), 16)

    async def prefill(request_id: str, ids: list[int]) -> int:
        run = PrefillRun(request_id, ids, SamplingParams(max_tokens=1, temperature=0.0), None,  # type: ignore[arg-type]
                         time.perf_counter())
        await prefill_worker._compute_prompt(run)
        return run.cached_tokens  # what the worker's answer reports to the router

    async def burst() -> list[int]:
        return await asyncio.gather(*(prefill(f"b{i}", ids) for i, ids in enumerate(prompts)))

    answered = asyncio.run(burst())
    for i in range(BURST):
        prefill_worker.engine.release(f"b{i}")
    metrics = prefill_worker.metrics
    assert metrics.prefilled_prompt_tokens._value.get() == BURST * (PREFIX + 16)
    # The first prompt computed the shared prefix; every other one reused it, whenever it arrived.
    assert metrics.prefilled_reused_tokens._value.get() == (BURST - 1) * PREFIX
    assert sorted(answered) == [0] + [PREFIX] * (BURST - 1)
    # At receipt the burst's prompts found at most that (nothing, when all came before the first step).
    assert metrics.prefilled_cached_tokens._value.get() <= (BURST - 1) * PREFIX


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=HTTP_TIMEOUT).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{url}/metrics has no {name}")


@pytest.mark.django_db(transaction=False, databases=[])
def test_a_burst_prefilled_locally_counts_the_shared_prefix_reused_in_the_workers_metrics(
        tiny_model_dir: Path, log_dir: Path) -> None:
    procs: list[Proc] = []
    try:
        worker, worker_url = start_worker("both", tiny_model_dir, log_dir, name="reused-both",
                                          extra=["--block-size", "8", "--context-length", "512"])
        procs.append(worker)
        router, router_url = start_router([], [worker_url], log_dir, env={"ROUTER_REQUEST_TIMEOUT_S": "60"})
        procs.append(router)
        prompts = _burst(random.Random(5), 8)
        body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(BURST) as pool:  # all at once: none is computed when the others arrive
            answers = list(pool.map(lambda ids: post_json(router_url + "/generate", {"input_ids": ids, **body},
                                                          HTTP_TIMEOUT), prompts))
        assert all(len(a["tokens"]) == 4 for a in answers), answers
        assert _metric(worker_url, "worker_prefilled_prompt_tokens_total") == BURST * (PREFIX + 8)
        reused = _metric(worker_url, "worker_prefilled_reused_tokens_total")
        assert reused == (BURST - 1) * PREFIX
        # Each answer tells its client what was not computed for it (OpenAI's usage field).
        cached = sorted(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)
        assert cached == [0] + [PREFIX] * (BURST - 1), answers
        status = httpx.get(router_url + "/router/status", timeout=HTTP_TIMEOUT).text
        metrics = httpx.get(router_url + "/metrics", timeout=HTTP_TIMEOUT).text
        assert f'router_kv_reported_cached_tokens{{role="decode"}} {float(reused)}' in metrics, status
        assert _metric(worker_url, "worker_prefilled_cached_tokens_total") <= reused
    finally:
        for proc in reversed(procs):
            proc.stop()
