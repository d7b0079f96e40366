"""The router's HTTP/1.1 client for its two hot requests to the workers (decode stream, prefill).

Every generation makes two requests to workers (`POST /internal/decode`, read as an NDJSON stream,
and `POST /internal/prefill`). Through aiohttp's `ClientSession` each cost about 80 µs of the
router's CPU in Python (URL and header objects, timers, a writer task per request, a stream reader
per response), the largest share of the router's CPU per request after the socket calls
(`bench/router_overhead.py`, py-spy). This client does only what these requests need: one
keep-alive connection pool per worker address, the request head encoded once per worker and path,
one write per request, and httptools' C parser feeding the body straight into the response.

Errors are aiohttp's exception types (`ClientConnectorError` for a refused connect,
`ServerDisconnectedError` when the worker closes before answering, `ClientPayloadError` for a
broken body), so callers handle both clients alike and `stale_connection` applies unchanged.
The response's `content` offers the part of aiohttp's `StreamReader` that `NdjsonReader` uses.
"""
from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any, cast
from urllib.parse import urlsplit

import aiohttp
import httptools
from aiohttp.client_reqrep import ConnectionKey

# A response body buffered past this (a consumer slower than its worker) pauses reading the socket.
_HIGH_WATER = 1 * 2**20


class UpstreamResponse:
    """One response: status, headers and the body as it arrives.

    Also its own `content` (readany / read_nowait / set_exception), so that code written against
    aiohttp's `ClientResponse.content` reads it unchanged.
    """

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = 0
        self.headers: dict[str, str] = {}
        self._chunks: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._eof = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.content = self
        # A credited request's body stays open for acknowledgements until the response ends.
        self.body_open = False
        self.acked = 0

    # ---- fed by the connection (protocol callbacks) ----

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > _HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _finish(self, exc: BaseException | None = None) -> None:
        if exc is None:
            self._eof = True
        elif not self._eof and self._exc is None:
            self._exc = exc
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # ---- aiohttp StreamReader surface ----

    def read_nowait(self) -> bytes:
        """Whatever body has arrived (b"" when nothing); raises the stream's error once it broke."""
        if self._chunks:
            data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
            self._chunks.clear()
            if self._size > _HIGH_WATER:
                self._conn.resume()
            self._size = 0
            return data
        if self._exc is not None:
            raise self._exc
        return b""

    async def readany(self) -> bytes:
        """The next part of the body; b"" at its end."""
        while True:  # bounded by the caller's timeout; each pass waits for the connection's next event
            data = self.read_nowait()
            if data or self._eof:
                return data
            self._waiter = self._conn.loop.create_future()
            await self._waiter

    def set_exception(self, exc: BaseException) -> None:
        """Fail the pending and later reads with `exc` (the connection is not reused)."""
        self._exc = exc
        self._conn.discard()
        self._wake()

    # ---- credit (inference/server/credit.py) ----

    def ack(self, tokens: int) -> None:
        """Tell the worker that `tokens` tokens of this stream reached the client (cumulative)."""
        if self.body_open and tokens > self.acked:
            self.acked = tokens
            self._conn.write_chunk(b"%d\n" % tokens)

    def end_body(self) -> None:
        """End a credited request's body (its last chunk), once."""
        if self.body_open:
            self.body_open = False
            self._conn.write_chunk(b"")

    # ---- ClientResponse surface ----

    async def read(self) -> bytes:
        """The whole (rest of the) body."""
        parts: list[bytes] = []
        while True:  # bounded by the body's end or the caller's timeout
            data = await self.readany()
            if not data:
                return b"".join(parts)
            parts.append(data)

    def close(self) -> None:
        """Done with the response: a connection whose body was not read to the end is closed."""
        if not self._eof or self._exc is not None:
            self._conn.discard()

    release = close

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.close()


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a worker; one request at a time."""

    def __init__(self, pool: _HostPool) -> None:
        self._pool = pool
        # Made in its loop (create_connection's factory); asyncio.get_running_loop() per token was
        # a getpid() system call each time (CPython 3.11 checks the pid).
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.closed = False
        self.idle_since = 0.0
        self._header_name = b""
        self._headers_done: asyncio.Future[None] | None = None
        self._paused = False

    # ---- asyncio.Protocol ----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(aiohttp.ClientPayloadError(f"bad HTTP response from {self._pool.host}: {exc}"))
            self.discard()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(aiohttp.ServerDisconnectedError(f"worker {self._pool.host}:{self._pool.port} "
                                                   "closed the connection"))

    # ---- httptools callbacks ----

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None:
            self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self.response is not None:
            self.response.status = self._parser.get_status_code()
        done, self._headers_done = self._headers_done, None
        if done is not None and not done.done():
            done.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        response, self.response = self.response, None
        keep = self._parser.should_keep_alive()
        if response is not None:
            # Before the connection can carry the next request, this one's body must end.
            response.end_body()
            response._finish()
        if keep and not self.closed:
            self._pool.put_back(self)
        else:
            self.discard()

    # ---- used by the pool and the response ----

    def _fail(self, exc: BaseException) -> None:
        done, self._headers_done = self._headers_done, None
        if done is not None and not done.done():
            done.set_exception(exc)
        response, self.response = self.response, None
        if response is not None:
            response._finish(exc)

    async def request(self, head: bytes, body: bytes, credit: int = 0) -> UpstreamResponse:
        """Send one request and wait for its status line and headers. With `credit`, the body is
        chunked: `body` and a newline first, then acknowledgements (`UpstreamResponse.ack`)."""
        assert self.transport is not None
        response = UpstreamResponse(self)
        self.response = response
        # Local: a short answer completes within one read, and the connection may already serve the
        # next request (with its own future) by the time this one resumes.
        headers_done = self._headers_done = self.loop.create_future()
        if credit:
            response.body_open = True
            self.transport.write(head + b"Transfer-Encoding: chunked\r\nX-Stream-Credit: %d\r\n\r\n%x\r\n"
                                 % (credit, len(body) + 1) + body + b"\n\r\n")
        else:
            self.transport.write(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        try:
            await headers_done
        except BaseException:
            if self.response is response:
                self.discard()  # cancelled or failed mid-request: the connection's state is unknown
            raise
        return response

    def write_chunk(self, data: bytes) -> None:
        """One chunk of a chunked request body (b"": the last one)."""
        if not self.closed and self.transport is not None:
            self.transport.write(b"%x\r\n%s\r\n" % (len(data), data) if data else b"0\r\n\r\n")

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def discard(self) -> None:
        """Close for good (never reused)."""
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()


class _HostPool:
    """Idle keep-alive connections to one worker address."""

    def __init__(self, host: str, port: int, headers: bytes, keepalive_s: float) -> None:
        self.host = host
        self.port = port
        self.key = ConnectionKey(host, port, False, False, None, None, None)
        self.headers = headers
        self.keepalive_s = keepalive_s
        self.idle: collections.deque[_Connection] = collections.deque()
        self.heads: dict[str, bytes] = {}

    def head(self, path: str) -> bytes:
        """The request head of `path` up to its body's framing headers (encoded once per path)."""
        head = self.heads.get(path)
        if head is None:
            head = (f"POST {path} HTTP/1.1\r\nHost: {self.key.host}:{self.key.port}\r\n".encode("latin-1")
                    + b"Content-Type: application/json\r\nAccept: */*\r\n" + self.headers)
            self.heads[path] = head
        return head

    def take(self) -> tuple[_Connection | None, bool]:
        """A live idle connection (most recently used first) and whether it is reused."""
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn, True
            conn.discard()
        return None, False

    def put_back(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        self.idle.append(conn)

    def close(self) -> None:
        while self.idle:
            self.idle.pop().discard()


class UpstreamClient:
    """POSTs JSON to workers over pooled keep-alive connections (one event loop)."""

    def __init__(self, headers: Mapping[str, str] | None = None, keepalive_s: float = 3.0) -> None:
        """`headers` go with every request (e.g. the platform's shared secret); idle connections
        older than `keepalive_s` are not reused (below the workers' own keep-alive timeout)."""
        self._headers = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in (headers or {}).items())
        self._keepalive_s = keepalive_s
        self._pools: dict[tuple[str, int], _HostPool] = {}
        self.closed = False

    def _split(self, url: str) -> tuple[_HostPool, str]:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream URL must be http://host:port/path, got {url!r}")
        port = parts.port or 80
        pool = self._pools.get((parts.hostname, port))
        if pool is None:
            pool = _HostPool(parts.hostname, port, self._headers, self._keepalive_s)
            self._pools[(parts.hostname, port)] = pool
        target = parts.path or "/"
        return pool, f"{target}?{parts.query}" if parts.query else target

    async def post(self, url: str, body: bytes, *, connect_timeout_s: float, credit: int = 0) -> UpstreamResponse:
        """POST `body` (JSON) and return once the status and headers arrived. With `credit`, the
        request is a credited decode stream (inference/server/credit.py): acknowledge with `ack`.

        A pooled connection the worker closed just as it was reused (the request never reached
        the worker) is retried once on a fresh connection. Raises aiohttp's ClientConnectorError
        when the worker refuses the connection, ServerDisconnectedError when it closes a fresh one
        before answering.
        """
        pool, path = self._split(url)
        head = pool.head(path)
        conn, reused = pool.take()
        if conn is not None:
            try:
                return await conn.request(head, body, credit)
            except aiohttp.ServerDisconnectedError:
                if not reused:
                    raise
        conn = await self._connect(pool, connect_timeout_s)
        return await conn.request(head, body, credit)

    async def _connect(self, pool: _HostPool, timeout_s: float) -> _Connection:
        loop = asyncio.get_running_loop()
        key = pool.key
        try:
            async with asyncio.timeout(timeout_s):
                _, protocol = await loop.create_connection(lambda: _Connection(pool), pool.host, pool.port)
        except TimeoutError:
            raise aiohttp.ConnectionTimeoutError(
                f"connect to {pool.host}:{pool.port} timed out after {timeout_s:g}s") from None
        except OSError as exc:
            raise aiohttp.ClientConnectorError(key, exc) from exc
        return protocol

    def close(self) -> None:
        """Close every idle connection (streams in progress close with their responses)."""
        self.closed = True
        for pool in self._pools.values():
            pool.close()

    def stats(self) -> dict[str, Any]:
        """Idle connections per worker address (for tests and status pages)."""
        return {f"{h}:{p}": len(pool.idle) for (h, p), pool in self._pools.items()}
