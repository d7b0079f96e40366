"""The router's policy + admission CPU per request, in process, by pool size and policy.

A request's choices are the calls `DisaggregatedClient` makes before it talks to any worker
(inference/router/pd_client.py): `pool.candidates("prefill")` (is any prefill worker left),
`Admission.acquire` (a decode endpoint with a free slot, chosen by the policy among the free ones),
`pool.endpoints("prefill")` and `pool.choose("prefill")` (the prefill worker), then on the way out
the releases and `record_success` of both. They are timed here on the real WorkerPool and
Admission with `pool_size` decode endpoints (+ a quarter as many prefill endpoints), each holding
the health answer of a simulated worker (so `batch_size` is read as in production) and a random
number of requests in flight (half its slots on average), with CPU time (`time.thread_time`) per
block of requests; the median block is reported. A cProfile of the largest pool shows where the
time goes.
"""
from __future__ import annotations

import asyncio
import cProfile
import io
import pstats
import random
import statistics
import time
from collections.abc import Collection
from typing import Any

from bench.sim.config import SimConfig
from bench.sim.worker import SimWorker
from inference.router import Admission, Endpoint, WorkerPool
from inference.router.admission import slots_for


async def _no_delivery(descriptor: dict[str, Any], first_token: int) -> int:
    raise RuntimeError("no KV is delivered in process")


def build_pool(decode: int, prefill: int, policy: str, seed: int = 0) -> tuple[WorkerPool, Admission]:
    """A pool of `decode` + `prefill` endpoints with simulated health answers and in-flight load."""
    pool = WorkerPool([f"http://127.0.0.1:{20000 + i}" for i in range(prefill)],
                      [f"http://127.0.0.1:{30000 + i}" for i in range(decode)], policy, health_interval_s=0)
    config = SimConfig()
    answers = {role: SimWorker(role, 0, config, _no_delivery).health() for role in ("prefill", "decode")}
    rng = random.Random(seed)
    slots = slots_for(config.batch_size)
    for endpoint in pool.all_endpoints():
        endpoint.record_health(True, dict(answers[endpoint.role]), None)
        if endpoint.role == "decode":
            endpoint.inflight = rng.randrange(0, slots)  # half its slots busy on average, never full
    return pool, Admission(pool)


async def _one_request(pool: WorkerPool, admission: Admission, deadline: float) -> None:
    """The policy and admission calls of one request, in pd_client's order."""
    pool.candidates("prefill", exclude=[])
    decode = await admission.acquire(deadline, exclude=[])
    assert decode is not None
    for _ in range(len(pool.endpoints("prefill"))):
        prefill = pool.choose("prefill", exclude=[])
        assert prefill is not None
        prefill.acquire()
        prefill.release()
        pool.record_success(prefill)
        break
    pool.record_success(decode)
    admission.release(decode)


async def _blocks(pool: WorkerPool, admission: Admission, block: int, blocks: int) -> list[float]:
    """CPU µs per request of each block of `block` requests."""
    deadline = time.monotonic() + 3600
    for _ in range(block):  # warm-up
        await _one_request(pool, admission, deadline)
    out = []
    for _ in range(blocks):
        t0 = time.thread_time_ns()
        for _ in range(block):
            await _one_request(pool, admission, deadline)
        out.append((time.thread_time_ns() - t0) / 1000 / block)
    return out


def measure(decode: int, policy: str, block: int, blocks: int) -> dict[str, Any]:
    """Policy + admission CPU per request with `decode` decode endpoints (and decode // 4 prefill)."""
    prefill = max(1, decode // 4)
    pool, admission = build_pool(decode, prefill, policy)
    per_block = asyncio.run(_blocks(pool, admission, block, blocks))
    return {"decode_endpoints": decode, "prefill_endpoints": prefill, "policy": policy,
            "requests": block * blocks, "cpu_us_per_request_median": statistics.median(per_block),
            "cpu_us_per_request_min": min(per_block), "cpu_us_per_request_max": max(per_block)}


def profile(decode: int, policy: str, requests: int, top: int = 12) -> list[dict[str, Any]]:
    """cProfile of `requests` requests' choices with `decode` endpoints: the functions with the most
    own time (µs per request, own and cumulative)."""
    pool, admission = build_pool(decode, max(1, decode // 4), policy)
    profiler = cProfile.Profile()
    deadline = time.monotonic() + 3600

    async def run() -> None:
        for _ in range(requests):
            await _one_request(pool, admission, deadline)

    profiler.enable()
    asyncio.run(run())
    profiler.disable()
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows = []
    for (filename, line, name), (_cc, calls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{'/'.join(filename.rsplit('/', 2)[-2:])}:{line}({name})",
                     "calls_per_request": calls / requests, "own_us_per_request": tottime * 1e6 / requests,
                     "cum_us_per_request": cumtime * 1e6 / requests})
    rows.sort(key=lambda r: r["own_us_per_request"], reverse=True)
    return rows[:top]


class CachedSlotsAdmission(Admission):
    """A prototype of the change proposed for inference/router/admission.py, measured beside the real
    one (not used by the router): each endpoint's slot count is computed once per health answer
    instead of on every request (`limit` → `batch_size` → `slots_for` per endpoint per request is
    most of the real cost at 256 endpoints), and the free-slot scan compares two attributes."""

    def __init__(self, pool: WorkerPool) -> None:
        super().__init__(pool)
        self._slots: dict[Endpoint, tuple[object, int]] = {}

    def limit(self, endpoint: Endpoint) -> int:
        """The endpoint's slots, recomputed only when its health answer changed."""
        cached = self._slots.get(endpoint)
        if cached is None or cached[0] is not endpoint.last_health:
            cached = (endpoint.last_health, super().limit(endpoint))
            self._slots[endpoint] = cached
        return cached[1]

    def _free(self, exclude: Collection[Endpoint]) -> list[Endpoint]:
        now = time.monotonic()
        slots = self._slots
        out = []
        for e in self.pool.candidates("decode", exclude):
            cached = slots.get(e)
            limit = cached[1] if cached is not None and cached[0] is e.last_health else self.limit(e)
            if e.inflight < limit and e.full_until <= now:
                out.append(e)
        return out


def measure_cached(decode: int, policy: str, block: int, blocks: int) -> dict[str, Any]:
    """`measure` with the CachedSlotsAdmission prototype in place of the router's Admission."""
    prefill = max(1, decode // 4)
    pool, _ = build_pool(decode, prefill, policy)
    per_block = asyncio.run(_blocks(pool, CachedSlotsAdmission(pool), block, blocks))
    return {"decode_endpoints": decode, "prefill_endpoints": prefill, "policy": policy,
            "variant": "prototype: slots cached per health answer", "requests": block * blocks,
            "cpu_us_per_request_median": statistics.median(per_block)}
