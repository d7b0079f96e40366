"""The health-check thread's lean client and schedule: one kept connection per worker, answers and
failures applied as aiohttp's checks apply them, each endpoint checked at its own phase of the
interval (a new one at once), endpoints that leave the pool no longer checked."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import orjson

from inference.router import Endpoint, WorkerPool
from inference.router.health import PHASE_GROUPS, HealthClient, check_endpoint_lean, next_check_at, phase_of
from tests.inference.router.stand_ins import Cluster, dead_url


class HealthServer:
    """A worker's /health over plain asyncio: counts connections and requests; `mode` is how it
    answers: healthy, unhealthy (503), close (answers, then closes the connection), silent."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests = 0
        self.mode = "healthy"
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:  # bounded by the client closing the connection
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"GET /health HTTP/1.1\r\n"), head
                self.requests += 1
                if self.mode == "silent":
                    await asyncio.sleep(30)
                healthy = self.mode != "unhealthy"
                body = orjson.dumps({"status": "healthy" if healthy else "unhealthy", "batch_size": 8,
                                     "model": "m"})
                status = b"200 OK" if healthy else b"503 Service Unavailable"
                writer.write(b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (status, len(body), body))
                await writer.drain()
                if self.mode == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[HealthServer]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        try:
            yield self
        finally:
            server.close()


def test_checks_keep_one_connection_and_apply_every_kind_of_answer() -> None:
    async def scenario() -> None:
        async with HealthServer().running() as server:
            pool = WorkerPool([], [server.url, dead_url()], health_interval_s=0, connect_timeout_s=1,
                              health_timeout_s=0.5)
            live, gone = pool.endpoints("decode")
            client = HealthClient()
            for _ in range(3):
                assert await check_endpoint_lean(pool, client, live)
            assert server.requests == 3 and server.connections == 1  # kept
            assert live.healthy and live.slots == 10 and live.last_health == {
                "status": "healthy", "batch_size": 8, "model": "m"}

            server.mode = "unhealthy"
            assert not await check_endpoint_lean(pool, client, live)
            assert not live.healthy and "HTTP 503" in (live.last_error or "")
            server.mode = "close"  # the worker closes after answering: the next check reconnects
            assert await check_endpoint_lean(pool, client, live) and live.healthy
            server.mode = "healthy"
            assert await check_endpoint_lean(pool, client, live)
            assert server.connections == 2

            server.mode = "silent"  # timeouts count toward removal, one is not enough
            assert not await check_endpoint_lean(pool, client, live)
            assert live.healthy and live.health_timeouts == 1 and "no answer within 1.5s" in (live.last_error or "")
            server.mode = "healthy"
            assert await check_endpoint_lean(pool, client, live) and live.health_timeouts == 0

            assert not await check_endpoint_lean(pool, client, gone)
            assert not gone.healthy and "health check failed" in (gone.last_error or "")
            client.close()

    asyncio.run(scenario())


def test_each_endpoint_has_a_fixed_phase_and_the_phases_spread() -> None:
    interval = 2.0
    urls = [f"http://10.0.0.{i}:8100" for i in range(64)]
    phases = [phase_of(url, interval) for url in urls]
    assert all(0 <= p < interval for p in phases)
    groups = {round(p / interval * PHASE_GROUPS, 9) for p in phases}
    assert all(g == int(g) for g in groups)  # whole fractions: a group's checks share one wake
    assert len(groups) >= PHASE_GROUPS - 1  # not one burst
    for url, now in [(urls[0], 100.0), (urls[1], 101.37), (urls[2], 5.0)]:
        at = next_check_at(url, interval, now)
        assert now < at <= now + interval
        assert abs((at - phase_of(url, interval)) / interval - round((at - phase_of(url, interval)) / interval)) < 1e-9
        assert next_check_at(url, interval, at) == at + interval


def test_the_thread_checks_new_endpoints_at_once_and_drops_gone_ones(stand_ins: Cluster) -> None:
    first, second = stand_ins.decode[0], stand_ins.decode[1]

    def wait_until(condition: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.01)

    async def scenario() -> None:
        # A long interval: anything checked within a second was checked because it was new.
        pool = WorkerPool([], [first.url], health_interval_s=30, health_timeout_s=5)
        (a,) = pool.endpoints("decode")
        pool.start_health_checks()
        await asyncio.to_thread(wait_until, lambda: a.last_health is not None, "first endpoint never checked")
        pool.set_endpoints("decode", [second.url])
        (b,) = pool.endpoints("decode")
        await asyncio.to_thread(wait_until, lambda: b.last_health is not None, "new endpoint not checked at once")
        # No prefill endpoint: a colocated pool (its decode workers prefill), ready on its decode worker.
        assert isinstance(b, Endpoint) and b.healthy and pool.ready() is True
        calls = first.health_calls
        await asyncio.sleep(0.3)
        assert first.health_calls == calls  # gone from the pool: not checked
        await pool.aclose()
        assert not pool.health_checks_running

    stand_ins.reset()
    asyncio.run(scenario())
