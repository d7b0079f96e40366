"""Health checks of the router's workers, in a thread of their own.

A router that is busy serving hundreds of streams answers its own event loop late; if the health
checks ran on that loop, a late answer would look like a slow worker and the router would take
healthy workers out of rotation (measured before this module: all three healthy workers ejected for
4.5 s at concurrency 400). So the checks run in a dedicated thread with its own event loop and HTTP
session, and only evidence about the worker takes it out at once: a refused connection, an HTTP
error status, or its own non-healthy answer. A check that times out counts toward removal only
after `failure_threshold` timeouts in a row (a stopped or wedged process).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import aiohttp

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
    """`GET /health` on `endpoint` and apply the result to it; True when it answered healthy."""
    payload: dict[str, Any] | None = None
    error: str | None = None
    timeout = aiohttp.ClientTimeout(total=pool.health_timeout_s + pool.connect_timeout_s,
                                    sock_connect=pool.connect_timeout_s)
    try:
        async with session.get(f"{endpoint.url}/health", timeout=timeout) as response:
            try:
                body = await response.json(content_type=None)
            except ValueError:
                body = None
            if isinstance(body, dict):
                payload = body
            if response.status != 200:
                error = f"health check answered HTTP {response.status}"
            elif payload is None or payload.get("status") != "healthy":
                status = payload.get("status") if payload else None
                error = f"health check status is {status!r}, not 'healthy'"
    except TimeoutError:
        error = f"health check got no answer within {pool.health_timeout_s + pool.connect_timeout_s:g}s"
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


class HealthChecker:
    """Checks every endpoint of a pool each `pool.health_interval_s`, in a daemon thread."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="router-health-checks", daemon=True)

    @property
    def running(self) -> bool:
        """Whether the thread is alive and not asked to stop."""
        return self._thread.is_alive() and not self._stop.is_set()

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the thread to stop and wait for it (bounded)."""
        self._stop.set()
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop closed meanwhile
                pass
        self._thread.join(timeout_s)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        session = new_session(self.pool.headers)
        try:
            while not self._stop.is_set():  # for the life of the router; every check is bounded
                endpoints = self.pool.all_endpoints()
                try:
                    await asyncio.gather(*(check_endpoint(self.pool, session, e) for e in endpoints))
                except Exception:  # noqa: BLE001  one bad round must not end the checks
                    logger.exception("health-check round failed")
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=self.pool.health_interval_s)
                except TimeoutError:
                    pass
        finally:
            await session.close()
