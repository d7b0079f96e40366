"""The router's subscriptions to its workers' KV event streams, feeding its `KVIndex`.

One daemon thread with its own event loop (like the health checks: a saturated request loop must
not fall behind the workers' caches) holds one `GET /internal/kv-events` stream per endpoint of the
pool. A stream starts with the worker's snapshot, so a router that starts or reconnects is exact at
once; when a stream ends (the worker died, restarted or hung) the worker's entries leave the index
at once and the subscription is tried again after a short, growing pause. The stream's load lines go
to the pool's endpoint of that URL (`Endpoint.apply_load`), so that every router process weighs the
same load; a stream that ends leaves the endpoint to this router's own counts. Endpoints that leave the
pool are unsubscribed and forgotten; new ones are subscribed within `FOLLOW_S`.

A worker that does not serve the stream (404: an older worker, or a stand-in) is asked again only
every `NOT_SERVED_RETRY_S`, logged once: the index knows nothing of it, so the kv-aware cost sees
the whole prompt to compute there and goes by its load, and no request fails for it.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import aiohttp
import orjson

from inference.router.daemon import DaemonTask
from inference.router.health import describe_exception, new_session
from inference.router.kv_index import KVIndex
from inference.wire.kv_events import KVEventBatch, KVSnapshot, WorkerLoad, decode_line

if TYPE_CHECKING:
    from inference.router.pool import WorkerPool

logger = logging.getLogger(__name__)

# How often the thread looks for endpoints added to or removed from the pool.
FOLLOW_S = 0.5
# A worker sends a keepalive every 2 s of quiet: a stream silent this long is a dead link.
SILENCE_S = 10.0
# Pauses between tries to subscribe to a worker whose stream ended (doubling up to the last).
RETRY_S = (0.2, 0.5, 1.0, 2.0)
# A snapshot of a large KV pool is one long line; anything longer is a broken stream.
MAX_LINE_BYTES = 64 * 2**20
# A worker that answered 404 (it does not publish KV events) is asked again after this long.
NOT_SERVED_RETRY_S = 60.0


class NotServed(ValueError):
    """The worker does not serve `GET /internal/kv-events` (404)."""


class KVFeed(DaemonTask):
    """Keeps `index` in step with the KV event streams of every endpoint of `pool`, in a thread."""

    def __init__(self, pool: WorkerPool, index: KVIndex) -> None:
        super().__init__("router-kv-events")  # it looks at the stop flag every FOLLOW_S
        self.pool = pool
        self.index = index
        self.errors: dict[str, str] = {}  # the last reason each worker's stream ended, for /router/status

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        session = new_session(self.pool.headers)
        following: dict[str, asyncio.Task[None]] = {}
        try:
            while not self._stop.is_set():  # for the life of the router
                urls = {endpoint.url for endpoint in self.pool.all_endpoints()}
                for url in urls - following.keys():
                    following[url] = asyncio.ensure_future(self._follow(session, url))
                for url in following.keys() - urls:
                    following.pop(url).cancel()
                    self.index.drop(url)
                    self.pool.apply_load(url, None)
                await asyncio.sleep(FOLLOW_S)
        finally:
            for task in following.values():
                task.cancel()
            await asyncio.gather(*following.values(), return_exceptions=True)
            await session.close()

    async def _follow(self, session: aiohttp.ClientSession, url: str) -> None:
        """Subscribe to `url` again and again until cancelled; its entries leave the index whenever
        its stream ends."""
        tries = 0
        while not self._stop.is_set():  # until cancelled (the endpoint left) or the feed stops
            pause = RETRY_S[min(tries, len(RETRY_S) - 1)]
            try:
                if await self._stream(session, url):
                    tries = 0
                self.errors[url] = "stream ended"
            except NotServed as exc:
                if self.errors.get(url) != str(exc):  # once per worker, not every minute
                    logger.info("%s: %s; its requests are routed by load", url, exc)
                self.errors[url] = str(exc)
                pause = NOT_SERVED_RETRY_S
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                self.errors[url] = describe_exception(exc)
            finally:
                self.index.drop(url)
                self.pool.apply_load(url, None)  # back to this router's own counts
            await asyncio.sleep(pause)
            tries += 1

    async def _stream(self, session: aiohttp.ClientSession, url: str) -> bool:
        """Read one subscription to its end; True when it delivered a snapshot."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.pool.connect_timeout_s, sock_read=SILENCE_S)
        async with session.get(f"{url}/internal/kv-events", timeout=timeout) as response:
            if response.status == 404:
                raise NotServed("it does not serve GET /internal/kv-events (404)")
            if response.status != 200:
                raise ValueError(f"GET /internal/kv-events answered {response.status}")
            pending = b""
            snapshot = False
            async for chunk in response.content.iter_any():
                pending += chunk
                if b"\n" not in pending:
                    if len(pending) > MAX_LINE_BYTES:
                        raise ValueError(f"a KV event line over {MAX_LINE_BYTES} bytes")
                    continue
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    snapshot = self._apply(url, raw) or snapshot
            return snapshot

    def _apply(self, url: str, raw: bytes) -> bool:
        """Apply one line; True when it was a snapshot."""
        obj = orjson.loads(raw)
        if not isinstance(obj, dict):
            raise ValueError(f"expected a JSON object, got {raw[:100]!r}")
        message = decode_line(obj)
        if isinstance(message, KVSnapshot):
            self.index.apply_snapshot(url, message)
            self.errors.pop(url, None)
            return True
        if isinstance(message, KVEventBatch) and not self.index.apply_batch(url, message):
            raise ValueError("a KV event batch before the snapshot")
        if isinstance(message, WorkerLoad):
            self.pool.apply_load(url, message)
        return False
