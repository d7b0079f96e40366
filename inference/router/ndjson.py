"""Reading a worker's NDJSON stream: one JSON object per line, parsed with orjson.

`next()` waits for the next line; `ready()` returns a line that has already arrived without
waiting, so the router can forward every token that came in one network read as one chunk to the
client (fewer writes per token under load) instead of one write per line.

Only complete lines are lines: a line is complete when its newline arrived, and a stream that ends
with bytes after its last newline was cut inside a line (the worker died while writing it, or its
connection broke there). That is `TornLine`, a broken body like any other (an aiohttp
`ClientPayloadError`), never a line: the caller treats it as the worker's death, and no byte of
the torn line reaches a client (issue 26).

`next_within(seconds)` bounds a wait without a timer per line: one loop timer per stream, armed at
the first wait and moved lazily (when it fires early it re-arms at the newest deadline). A token
stream waits once per token, and `asyncio.timeout` per wait was a timer-heap insert and cancel
per token (measured: a sizeable share of the router's CPU per streamed token).
"""
from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import aiohttp
import orjson

Line = TypeVar("Line")

# A worker's line is a token or a small control object; anything this long is a broken stream.
MAX_LINE_BYTES = 4 * 2**20


def parse_line(raw: bytes) -> dict[str, Any]:
    """One NDJSON line as a dict; ValueError when it is not a JSON object."""
    obj = orjson.loads(raw)
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {raw[:100]!r}")
    return obj


class TornLine(aiohttp.ClientPayloadError):
    """The stream ended inside a line: its last bytes had no newline."""

    def __init__(self, partial: bytes) -> None:
        super().__init__(f"the stream ended inside a line ({len(partial)} bytes without a newline)")
        self.partial = partial


class BodyStream(Protocol):
    """What a response body must offer (aiohttp's StreamReader and upstream.UpstreamResponse do)."""

    async def readany(self) -> bytes:
        """The next part of the body; b"" at its end."""

    def read_nowait(self) -> bytes:
        """What has arrived, without waiting (b"" when nothing)."""

    def set_exception(self, exc: BaseException) -> None:
        """Fail pending and later reads."""


class NdjsonReader(Generic[Line]):
    """Lines of a response body, each parsed by `parse` (default: a dict per line)."""

    def __init__(self, content: BodyStream, parse: Callable[[bytes], Line] = parse_line) -> None:  # type: ignore[assignment]
        self._parse = parse
        self._content = content
        self._partial = b""
        self._lines: collections.deque[bytes] = collections.deque()
        self._deadline = 0.0  # loop time by which the wait in progress must end
        self._waiting = False
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _feed(self, data: bytes) -> None:
        *complete, self._partial = (self._partial + data).split(b"\n")
        self._lines.extend(line for line in complete if line.strip())
        if len(self._partial) > MAX_LINE_BYTES:
            raise ValueError(f"a line longer than {MAX_LINE_BYTES} bytes")

    async def next(self) -> Line | None:
        """The next line (blank lines skipped), None at the end of the stream.

        Raises ValueError for a line that is not a JSON object, aiohttp.ClientError when the
        connection breaks, `TornLine` (a ClientError too) when it ends inside a line. Bounded by
        the caller's timeout.
        """
        while not self._lines:
            try:
                data = await self._content.readany()
            except BaseException:
                self._partial = b""  # a line cut by a broken connection is never parsed
                raise
            if not data:  # end of stream: bytes after the last newline are a torn line
                rest, self._partial = self._partial, b""
                if rest.strip():
                    raise TornLine(rest)
                return None
            self._feed(data)
        return self._parse(self._lines.popleft())

    async def next_within(self, seconds: float) -> Line | None:
        """`next()`, or TimeoutError when no line completes within `seconds`.

        After a TimeoutError the stream is unusable (its reader holds the error): the caller
        abandons it, as it would any stalled stream.
        """
        if self._lines:
            return self._parse(self._lines.popleft())
        loop = self._loop
        if loop is None:  # once per stream: get_running_loop() is a getpid() system call in 3.11
            loop = self._loop = asyncio.get_running_loop()
        self._deadline = loop.time() + seconds
        if self._timer is None:
            self._timer = loop.call_at(self._deadline, self._expire)
        self._waiting = True
        try:
            return await self.next()
        finally:
            self._waiting = False

    def _expire(self) -> None:
        """The stream timer fired: end a wait past its deadline, else re-arm (or rest until the next wait)."""
        self._timer = None
        if not self._waiting:
            return  # the next wait arms a fresh timer
        loop = self._loop or asyncio.get_running_loop()
        if loop.time() < self._deadline:
            self._timer = loop.call_at(self._deadline, self._expire)
            return
        # Wakes the pending read with the error; the stream is abandoned after a timeout anyway.
        self._content.set_exception(TimeoutError("no complete line within the timeout"))

    def close(self) -> None:
        """Drop the stream timer (the stream is finished or abandoned)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def ready(self) -> Line | None:
        """A complete line that has already arrived, or None; never waits and never raises.

        A line that does not parse is left for `next()`, which reports it.
        """
        if not self._lines:
            try:
                data = self._content.read_nowait()
            except Exception:  # noqa: BLE001  a broken stream is reported by next()
                return None
            if data:
                try:
                    self._feed(data)
                except ValueError:
                    return None
        if not self._lines:
            return None
        try:
            line = self._parse(self._lines[0])
        except ValueError:
            return None
        self._lines.popleft()
        return line
