"""Health checks of the router's workers, in a thread of their own.

A router that is busy serving hundreds of streams answers its own event loop late; if the health
checks ran on that loop, a late answer would look like a slow worker and the router would take
healthy workers out of rotation (measured before this module: all three healthy workers ejected for
4.5 s at concurrency 400). So the checks run in a dedicated thread with its own event loop and HTTP
session, and only evidence about the worker takes it out at once: a refused connection, an HTTP
error status, or its own non-healthy answer. A check that times out counts toward removal only
after `failure_threshold` timeouts in a row (a stopped or wedged process).

The thread checks with a lean client (`HealthClient`: one kept connection per endpoint, the request
bytes built once, httptools parsing the answer and orjson its body; about a quarter of aiohttp's CPU
per check, bench/sim/health_cost.py), and spreads the checks over the interval: each endpoint is
checked at one of eight fixed phases of it (from its URL), so a router with hundreds of endpoints
checks an eighth of them at a time instead of all in one burst per round (measured at 256 + 64
simulated endpoints: 1.6 % of the router process's core, 4 % before). A new endpoint is checked at
once, then at its phase.
"""
from __future__ import annotations

import asyncio
import heapq
import logging
import time
import zlib
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

import aiohttp
import httptools
import orjson

from inference.router.daemon import DaemonTask
from inference.router.endpoint import Endpoint

if TYPE_CHECKING:
    from inference.router.pool import WorkerPool

logger = logging.getLogger(__name__)


def describe_exception(exc: BaseException) -> str:
    """A short one-line description of a transport error, e.g. `ClientConnectorError: ...`."""
    text = str(exc).strip() or repr(exc)
    return f"{type(exc).__name__}: {text}"


# Below uvicorn's default keep-alive timeout (5 s) on the workers.
KEEPALIVE_S = 3.0


def new_session(headers: Mapping[str, str] | None = None) -> aiohttp.ClientSession:
    """An HTTP session for worker traffic (call inside the loop that will use it).

    No connection limit: streams hold a connection each and workers apply backpressure (429)
    themselves. Worker traffic is internal, so HTTP(S)_PROXY is never used (`trust_env=False`).
    """
    return aiohttp.ClientSession(
        headers=dict(headers or {}),
        # Idle connections are dropped before the workers' uvicorn drops them (5 s): a request
        # written into a connection the server is closing fails ("Can not write request body").
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=KEEPALIVE_S),
        trust_env=False,
        # Workers send small JSON and NDJSON lines; the router never needs response cookies.
        cookie_jar=aiohttp.DummyCookieJar(),
    )


async def check_endpoint(pool: WorkerPool, session: aiohttp.ClientSession, endpoint: Endpoint) -> bool:
    """`GET /health` on `endpoint` through aiohttp and apply the result; True when it answered healthy."""
    timeout = aiohttp.ClientTimeout(total=pool.health_timeout_s + pool.connect_timeout_s,
                                    sock_connect=pool.connect_timeout_s)

    async def fetch() -> tuple[int, bytes]:
        async with session.get(f"{endpoint.url}/health", timeout=timeout) as response:
            return response.status, await response.read()

    return await apply_check(pool, endpoint, fetch)


async def check_endpoint_lean(pool: WorkerPool, client: HealthClient, endpoint: Endpoint) -> bool:
    """`GET /health` on `endpoint` through the lean `client` and apply the result; True when healthy."""
    return await apply_check(pool, endpoint, lambda: client.get_health(endpoint.url, pool.connect_timeout_s))


async def apply_check(pool: WorkerPool, endpoint: Endpoint, fetch: Callable[[], Awaitable[tuple[int, bytes]]]) -> bool:
    """Run one health check (`fetch` gives the answer's status and body) and apply it to `endpoint`."""
    payload: dict[str, Any] | None = None
    error: str | None = None
    total_s = pool.health_timeout_s + pool.connect_timeout_s
    try:
        async with asyncio.timeout(total_s):
            status, raw = await fetch()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        if isinstance(body, dict):
            payload = body
        if status != 200:
            error = f"health check answered HTTP {status}"
        elif payload is None or payload.get("status") != "healthy":
            answered = payload.get("status") if payload else None
            error = f"health check status is {answered!r}, not 'healthy'"
    except TimeoutError:
        error = f"health check got no answer within {total_s:g}s"
        if endpoint.record_health_timeout(error, pool.failure_threshold):
            logger.warning("%s endpoint %s out of rotation: %d health checks in a row timed out",
                           endpoint.role, endpoint.url, endpoint.health_timeouts)
        return False
    except (aiohttp.ClientError, OSError, UnicodeError) as exc:
        error = f"health check failed: {describe_exception(exc)}"
    ok = error is None
    was_healthy = endpoint.healthy
    endpoint.record_health(ok, payload, error)
    if was_healthy != endpoint.healthy:
        if ok:
            logger.info("%s endpoint %s back in rotation", endpoint.role, endpoint.url)
        else:
            logger.warning("%s endpoint %s out of rotation: %s", endpoint.role, endpoint.url, error)
    return ok


class _HealthConnection(asyncio.Protocol):
    """One kept connection to a worker for its `GET /health`; one request at a time."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._body: list[bytes] = []
        self._answer: asyncio.Future[tuple[int, bytes]] | None = None
        self.closed = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(aiohttp.ClientPayloadError(f"bad HTTP response from {self.where}: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(aiohttp.ServerDisconnectedError(f"worker {self.where} closed the connection"))

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        answer, self._answer = self._answer, None
        body, self._body = b"".join(self._body), []
        if not self._parser.should_keep_alive():
            self.close()
        self.idle_since = time.monotonic()
        if answer is not None and not answer.done():
            answer.set_result((self._parser.get_status_code(), body))

    def _fail(self, exc: BaseException) -> None:
        answer, self._answer = self._answer, None
        if answer is not None and not answer.done():
            answer.set_exception(exc)

    async def get(self, request: bytes) -> tuple[int, bytes]:
        """Send `request` and wait for the whole answer: (status, body)."""
        assert self.transport is not None
        answer = self._answer = self.loop.create_future()
        self.transport.write(request)
        try:
            return await answer
        except BaseException:
            self.close()  # failed or cancelled mid-answer: the connection's state is unknown
            raise

    def close(self) -> None:
        """Close for good (never reused)."""
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()


class HealthClient:
    """`GET /health` on workers over one kept connection per worker (one event loop): the request's
    bytes are built once per worker, the answer is parsed by httptools (as the router's upstream
    client does, inference/router/upstream.py)."""

    def __init__(self, headers: Mapping[str, str] | None = None, keepalive_s: float = KEEPALIVE_S) -> None:
        self._headers = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in (headers or {}).items())
        self._keepalive_s = keepalive_s
        self._requests: dict[str, tuple[str, int, bytes]] = {}
        self._connections: dict[str, _HealthConnection] = {}

    def _request(self, url: str) -> tuple[str, int, bytes]:
        known = self._requests.get(url)
        if known is None:
            parts = urlsplit(url)
            host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
            if parts.scheme != "http" or not host:
                raise aiohttp.InvalidURL(url)  # the pool's URLs are validated; https needs aiohttp
            target = f"{parts.path.rstrip('/')}/health"
            known = (host, port, f"GET {target} HTTP/1.1\r\nHost: {host}:{port}\r\n".encode("latin-1")
                     + self._headers + b"\r\n")
            self._requests[url] = known
        return known

    async def get_health(self, url: str, connect_timeout_s: float) -> tuple[int, bytes]:
        """The status and body of `GET {url}/health`. A kept connection that the worker closed as it
        was reused is replaced once by a fresh one."""
        host, port, request = self._request(url)
        conn = self._connections.get(url)
        if conn is not None and not conn.closed and time.monotonic() - conn.idle_since < self._keepalive_s:
            try:
                return await conn.get(request)
            except aiohttp.ServerDisconnectedError:
                pass
        if conn is not None:
            conn.close()
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(connect_timeout_s):
            _, conn = await loop.create_connection(lambda: _HealthConnection(f"{host}:{port}"), host, port)
        self._connections[url] = conn
        return await conn.get(request)

    def forget(self, url: str) -> None:
        """Close the connection to an endpoint that left the pool."""
        conn = self._connections.pop(url, None)
        self._requests.pop(url, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Close every connection."""
        for url in list(self._connections):
            self.forget(url)


# Phases are whole eighths of the interval: checks due together share one wake of the thread, whose
# socket answers then arrive together too (one check per wake cost the router process 30 % more CPU
# than one burst per round, at 320 endpoints); eight groups still spread the load over the interval.
PHASE_GROUPS = 8


def phase_of(url: str, interval_s: float) -> float:
    """Where in each interval `url` is checked: one of `PHASE_GROUPS` fixed offsets, from the URL."""
    return zlib.crc32(url.encode()) * PHASE_GROUPS // 2**32 * interval_s / PHASE_GROUPS


def next_check_at(url: str, interval_s: float, now: float) -> float:
    """The first time after `now` at `url`'s phase of the interval (on the monotonic clock)."""
    phase = phase_of(url, interval_s)
    return (int((now - phase) // interval_s) + 1) * interval_s + phase


class HealthChecker(DaemonTask):
    """Checks every endpoint of a pool each `pool.health_interval_s`, in a daemon thread."""

    def __init__(self, pool: WorkerPool) -> None:
        super().__init__("router-health-checks")
        self.pool = pool
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Future[None] | None = None

    def wake(self) -> None:
        """Look at the pool's endpoints now (from any thread): new ones are checked at once."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._woken)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _woken(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _sleep(self, seconds: float) -> None:
        """Sleep `seconds` or until `wake` (a future and a timer: cheaper than wait_for on an Event)."""
        assert self._loop is not None
        wake = self._wake = self._loop.create_future()
        if self._stop.is_set():  # a stop that came before this future existed
            return
        timer = self._loop.call_later(seconds, self._woken)
        try:
            await wake
        finally:
            timer.cancel()

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        client = HealthClient(self.pool.headers)
        running: set[asyncio.Task[None]] = set()
        try:
            await self._schedule(client, running)
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            client.close()

    async def _schedule(self, client: HealthClient, running: set[asyncio.Task[None]]) -> None:
        """Check each endpoint at its phase of the interval (a new one at once) until stopped."""
        pool = self.pool
        due: list[tuple[float, int, Endpoint]] = []  # a heap: (when, tiebreak, endpoint)
        scheduled: dict[Endpoint, float] = {}
        checking: set[Endpoint] = set()
        version = -1
        order = 0
        while not self._stop.is_set():  # for the life of the router; every check is bounded
            now = time.monotonic()
            if version != pool.endpoints_version:  # endpoints replaced: schedule new ones, drop gone ones
                version = pool.endpoints_version
                current = set(pool.all_endpoints())
                for endpoint in current - scheduled.keys():
                    scheduled[endpoint] = now
                    order += 1
                    heapq.heappush(due, (now, order, endpoint))
                for endpoint in scheduled.keys() - current:
                    del scheduled[endpoint]
                    if not any(e.url == endpoint.url for e in current):
                        client.forget(endpoint.url)
            interval = pool.health_interval_s
            while due and due[0][0] <= now:
                _, _, endpoint = heapq.heappop(due)
                if endpoint not in scheduled:
                    continue  # left the pool
                when = next_check_at(endpoint.url, interval, now)
                scheduled[endpoint] = when
                order += 1
                heapq.heappush(due, (when, order, endpoint))
                if endpoint not in checking:  # a check still waiting for its answer is not doubled
                    checking.add(endpoint)
                    task = asyncio.create_task(self._check(client, endpoint, checking))
                    running.add(task)
                    task.add_done_callback(running.discard)
            sleep_s = min(interval, max(0.0, due[0][0] - time.monotonic())) if due else interval
            await self._sleep(sleep_s)

    async def _check(self, client: HealthClient, endpoint: Endpoint, checking: set[Endpoint]) -> None:
        try:
            await check_endpoint_lean(self.pool, client, endpoint)
        except Exception:  # noqa: BLE001  one bad check must not end the checks
            logger.exception("health check of %s failed", endpoint.url)
        finally:
            checking.discard(endpoint)
