"""WorkerPool: endpoint replacement, failure counting, health checks (against stand-ins)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from inference.router.endpoint import Endpoint, normalize_url
from inference.router.pool import WorkerPool
from tests.inference.router.stand_ins import Cluster, dead_url

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_normalize_url() -> None:
    assert normalize_url(" http://host:30000/ ") == "http://host:30000"
    for bad in ("host:3000", "ftp://host", "http://", "http://h:99999", "http://h:1/?x=1", "http://u:p@h:1"):
        with pytest.raises(ValueError):
            normalize_url(bad)


def test_set_endpoints_replaces_and_keeps_state() -> None:
    pool = WorkerPool(["http://p:1"], ["http://a:1", "http://b:1/"], health_interval_s=0)
    a = pool.endpoints("decode")[0]
    a.inflight = 2
    pool.set_endpoints("decode", ["http://b:1", "http://a:1", "http://c:1", "http://c:1"])
    urls = [e.url for e in pool.endpoints("decode")]
    assert urls == ["http://b:1", "http://a:1", "http://c:1"]
    assert pool.endpoints("decode")[1] is a and a.inflight == 2
    with pytest.raises(ValueError):
        pool.set_endpoints("decode", ["http://ok:1", "not a url"])
    assert [e.url for e in pool.endpoints("decode")] == urls  # unchanged after a bad list
    with pytest.raises(ValueError):
        pool.set_endpoints("router", [])
    with pytest.raises(ValueError):
        WorkerPool([], [], policy="nope")


def test_consecutive_failures_take_an_endpoint_out() -> None:
    pool = WorkerPool([], ["http://a:1", "http://b:1"], health_interval_s=0)
    a, b = pool.endpoints("decode")
    pool.record_failure(a, "boom")
    pool.record_failure(a, "boom")
    assert a.healthy
    pool.record_success(a)  # a success ends the streak
    for _ in range(3):
        pool.record_failure(a, "boom")
    assert not a.healthy and a.last_error == "boom"
    assert pool.candidates("decode") == [b]
    assert pool.choose("decode", exclude=[b]) is None


def test_panic_mode_when_none_is_in_rotation() -> None:
    pool = WorkerPool([], ["http://a:1", "http://b:1"], health_interval_s=0)
    a, b = pool.endpoints("decode")
    a.healthy = b.healthy = False
    assert pool.candidates("decode") == [a, b]
    assert pool.candidates("decode", exclude=[a]) == [b]
    assert not pool.ready()


def test_health_checks_move_endpoints_in_and_out(stand_ins: Cluster) -> None:
    decode = stand_ins.decode[0]
    dead = dead_url()

    async def scenario() -> None:
        pool = WorkerPool([], [decode.url, dead], health_interval_s=0, health_timeout_s=5)
        live, gone = pool.endpoints("decode")
        assert await pool.check_health(live)
        assert live.last_health is not None and live.last_health["model"] == "stub-model"
        assert not await pool.check_health(gone)
        assert not gone.healthy and "health check failed" in (gone.last_error or "")

        decode.health = "unhealthy"
        assert not await pool.check_health(live)
        assert not live.healthy and "'unhealthy'" in (live.last_error or "")
        decode.health = "http500"
        assert not await pool.check_health(live)
        assert "HTTP 500" in (live.last_error or "")

        # Out after three failed requests, back when /health answers healthy.
        decode.health = "healthy"
        await pool.check_health(live)
        for _ in range(3):
            pool.record_failure(live, "connect error")
        assert not live.healthy
        assert await pool.check_health(live)
        assert live.healthy and live.consecutive_failures == 0
        await pool.aclose()

    run(scenario())


def test_background_health_task(stand_ins: Cluster) -> None:
    decode = stand_ins.decode[1]

    async def wait_until(endpoint: Endpoint, healthy: bool) -> None:
        deadline = time.monotonic() + 5
        while endpoint.healthy != healthy:
            assert time.monotonic() < deadline, f"endpoint never became healthy={healthy}"
            await asyncio.sleep(0.02)

    async def scenario() -> None:
        pool = WorkerPool([], [decode.url], health_interval_s=0.05, health_timeout_s=5)
        (endpoint,) = pool.endpoints("decode")
        pool.start_health_checks()
        pool.start_health_checks()  # idempotent
        assert pool.health_checks_running
        decode.health = "unhealthy"
        await wait_until(endpoint, healthy=False)
        decode.health = "healthy"
        await wait_until(endpoint, healthy=True)
        await pool.aclose()
        assert not pool.health_checks_running

    run(scenario())


def test_worker_info_is_cached(stand_ins: Cluster) -> None:
    async def scenario() -> None:
        pool = WorkerPool(stand_ins.prefill_urls, stand_ins.decode_urls, health_interval_s=0)
        infos = await pool.worker_info(max_age_s=60)
        assert sorted(i["url"] for i in infos) == sorted(stand_ins.prefill_urls + stand_ins.decode_urls)
        assert {i["model"] for i in infos} == {"stub-model"}
        assert await pool.worker_info(max_age_s=60) is infos
        await pool.aclose()

    run(scenario())
