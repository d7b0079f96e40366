"""Per-key limits leased from Redis in blocks (db 3 of the test machine, or REDIS_URL): round trips per
request, the bound across processes, permits and slots given back when idle or when their holder dies."""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import pytest
import redis

from inference.gateway.api_keys import Tenant
from inference.gateway.quota_leases import IDLE_S, MAX_BLOCK, TICK_S, LeasedCounters, block_size, window_of
from inference.gateway.quotas import Quotas

REDIS_URL = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/3"
_ids = iter(range(3 * 10**9, 4 * 10**9))


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    """A plain client of the test Redis; this module's counters are deleted afterwards."""
    plain = redis.Redis.from_url(REDIS_URL)
    yield plain
    stale = list(plain.scan_iter("quota:3*", count=1000))
    if stale:
        plain.delete(*stale)


def tenant(**limits: int) -> Tenant:
    """A database key with the given limits and an id no other test uses."""
    return Tenant(key_id=next(_ids), label="dpk-lease123", **limits)  # type: ignore[arg-type]


def _room_in_window(seconds: float) -> None:
    left = 60 - time.time() % 60
    if left < seconds:
        time.sleep(left + 0.05)


def _count(client: redis.Redis, key: Tenant, kind: str) -> int:
    suffix = f":{window_of(time.time())}" if kind in ("r", "t") else ""
    return int(client.get(f"quota:{key.key_id}:{kind}{suffix}") or 0)


def test_block_sizes() -> None:
    assert [block_size(n) for n in (1, 60, 199, 200, 1000, 10**8)] == [1, 1, 1, 2, 10, MAX_BLOCK]


def test_a_busy_key_costs_a_call_per_block_not_per_request(client: redis.Redis) -> None:
    counters = LeasedCounters(REDIS_URL)
    quotas = Quotas(counters)
    key = tenant(requests_per_minute=10_000, tokens_per_minute=10**8, max_concurrent=8)
    _room_in_window(10)

    async def one_client() -> None:
        for _ in range(50):
            assert await quotas.admit(key) is None
            await asyncio.sleep(0)  # a request's life: other clients run meanwhile
            await quotas.finish(key, 3)

    async def run() -> None:
        await asyncio.gather(*(one_client() for _ in range(8)))
        permits, spare, running = counters.held(key)
        assert running == 0 and 1 <= spare <= 8
        # Every admitted request and every permit held is counted in Redis; the slots held are the spares.
        assert _count(client, key, "r") == 400 + permits
        assert _count(client, key, "c") == spare
        await asyncio.sleep(0.3)  # tokens paid, spares given back
        assert _count(client, key, "t") == 3 * 400 and _count(client, key, "c") == 0

    asyncio.run(run())
    # 400 requests: a block of 64 per call at most 7 times, the first requests' slots, a few token payments.
    assert counters.calls <= 40, counters.calls


def test_a_small_limit_costs_one_exact_call_per_request(client: redis.Redis) -> None:
    counters = LeasedCounters(REDIS_URL)
    quotas = Quotas(counters)
    key = tenant(requests_per_minute=150)
    _room_in_window(5)

    async def run() -> None:
        assert all([await quotas.admit(key) is None for _ in range(10)])
        assert counters.held(key)[0] == 0 and _count(client, key, "r") == 10

    asyncio.run(run())
    assert counters.calls == 10


def test_idle_permits_and_spare_slots_go_back(client: redis.Redis) -> None:
    counters = LeasedCounters(REDIS_URL)
    quotas = Quotas(counters)
    key = tenant(requests_per_minute=1000, max_concurrent=4)  # blocks of 10
    _room_in_window(5)

    async def run() -> None:
        assert await quotas.admit(key) is None
        assert _count(client, key, "r") == 10 and _count(client, key, "c") == 1
        await quotas.finish(key, 0)
        await asyncio.sleep(IDLE_S + 4 * TICK_S)
        assert counters.held(key) == (0, 0, 0)
        assert _count(client, key, "r") == 1 and _count(client, key, "c") == 0
        assert not client.exists(f"quota:{key.key_id}:h")  # nothing held: no record

    asyncio.run(run())


def test_two_processes_admit_the_limit_and_never_more(client: redis.Redis) -> None:
    a, b = LeasedCounters(REDIS_URL), LeasedCounters(REDIS_URL)
    qa, qb = Quotas(a), Quotas(b)
    key = tenant(requests_per_minute=500)  # blocks of 5
    _room_in_window(10)

    async def send(quotas: Quotas, n: int) -> int:
        admitted = 0
        for _ in range(n):
            admitted += await quotas.admit(key) is None
            await asyncio.sleep(0)
        return admitted

    async def run() -> tuple[int, int]:
        return tuple(await asyncio.gather(send(qa, 450), send(qb, 300)))  # type: ignore[return-value]

    from_a, from_b = asyncio.run(run())
    assert from_a + from_b == 500 and _count(client, key, "r") == 500
    assert a.calls + b.calls <= 500 // 5 + 10  # a block per call, one refused call each, a few more


def test_a_dead_process_holdings_come_back_after_its_lease(client: redis.Redis) -> None:
    dead, alive = LeasedCounters(REDIS_URL, lease_s=0.3), LeasedCounters(REDIS_URL, lease_s=0.3)
    key = tenant(requests_per_minute=1000, max_concurrent=1)
    _room_in_window(5)

    async def run() -> None:
        assert await dead.admit(key, time.time()) == 0  # holds the only slot and 9 permits
        assert dead._tick is not None
        dead._tick.cancel()  # it dies: no renewal, nothing given back
        assert await alive.admit(key, time.time()) == 3  # the slot is still taken
        await asyncio.sleep(0.4)
        assert await alive.admit(key, time.time()) == 0  # the dead one's slot came back
        # Its 9 unused permits came back too: 1 used by it, a block of 10 leased by the live one.
        assert _count(client, key, "r") == 1 + 10 and _count(client, key, "c") == 1
        # It was only stalled: its next call finds its record gone, counts its running request's slot
        # again (two running: the count stays exact) and drops the permits it had (given back already).
        assert await dead.admit(key, time.time()) == 3
        assert dead.lost == 1 and dead.held(key) == (0, 0, 1) and _count(client, key, "c") == 2

    asyncio.run(run())
