"""Router credit for a decode stream: generate at most a window of tokens past what the router relayed.

Socket buffers cannot bound how far a decode worker runs ahead of a client that hung up: on
loopback a few KiB of kernel buffer hold a whole answer of one-token NDJSON lines, and the client's
own receive buffer is out of the server's reach. So the router says what it relayed. A decode
request sent with `X-Stream-Credit: W` and a chunked body carries the JSON request as its first
line; every further body line is the cumulative number of tokens of this stream the router has
handed to its client. The worker takes the engine's next output only while it has sent fewer than
`acked + W` tokens, and the engine pauses the sequence (its per-request window) once outputs pile
up untaken. When the client leaves, the router stops acknowledging and aborts; at most about
`W` + the engine window of tokens are generated for nobody, however late the abort lands.

The router acknowledges every `W / 2` tokens (one small chunk), so a router that keeps up never
stalls a stream.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

HEADER = "x-stream-credit"
# Longest acknowledgement line accepted (a decimal count); longer means a broken peer.
_MAX_LINE = 32
# Credits a worker accepts: below 2 a stream could never batch; above, the bound would mean nothing.
MIN_CREDIT = 2
MAX_CREDIT = 1 << 20


def parse_credit(value: str) -> int:
    """The window of an `X-Stream-Credit` header; ValueError unless an integer in range."""
    credit = int(value.strip())
    if not MIN_CREDIT <= credit <= MAX_CREDIT:
        raise ValueError(f"{HEADER} must be between {MIN_CREDIT} and {MAX_CREDIT}, got {credit}")
    return credit


class StreamCredit:
    """How many tokens one decode stream may send: the router's last acknowledgement + `window`.

    Fed with the request body's bytes after the first line (`feed`), on the worker's event loop.
    `close()` (the router ended its body, or the connection went) lifts the bound: nobody will
    acknowledge any more, and a stream waiting for credit must not hang on it.
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self.acked = 0
        self.closed = False
        self._partial = b""
        self._waiter: asyncio.Future[None] | None = None

    def allows(self, sent: int) -> bool:
        """Whether a stream that has sent `sent` tokens may send more now."""
        return self.closed or sent < self.acked + self.window

    async def wait(self, sent: int) -> None:
        """Return once `sent` tokens are within the credit (the caller bounds the wait)."""
        while not self.allows(sent):  # each pass waits for an acknowledgement or the close
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter

    def feed(self, data: bytes) -> None:
        """Take acknowledgement lines (cumulative counts; a line may arrive in pieces)."""
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        if len(self._partial) > _MAX_LINE:
            logger.warning("credit line over %d bytes from the router: flow control off for this stream", _MAX_LINE)
            self.close()
            return
        for line in lines:
            if not line.strip():
                continue
            try:
                count = int(line)
            except ValueError:
                logger.warning("bad credit line %r from the router: flow control off for this stream", line[:_MAX_LINE])
                self.close()
                return
            if count > self.acked:
                self.acked = count
        self._wake()

    def close(self) -> None:
        """No more acknowledgements will come: stop bounding the stream."""
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


async def read_first_line(receive: Receive, limit: int) -> tuple[bytes, bytes, bool]:
    """Read a credited request's body up to its first newline: (the line, what followed it, whether
    the body ended). ValueError past `limit` bytes; ClientDisconnect when the caller leaves."""
    raw = bytearray()
    while True:  # bounded by `limit` and by the connection: each pass takes one body message
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        raw += message.get("body", b"")
        more = bool(message.get("more_body", False))
        end = raw.find(b"\n")
        if end >= 0:
            return bytes(raw[:end]), bytes(raw[end + 1:]), not more
        if len(raw) > limit:
            raise ValueError(f"first line over {limit} bytes")
        if not more:
            return bytes(raw), b"", True


class CreditedStreamResponse(StreamingResponse):
    """An NDJSON stream whose request body keeps coming: acknowledgements for `credit`.

    Starlette's StreamingResponse reads the request (to notice a disconnect) and would swallow
    them; here one listener feeds every body message to `credit` and cancels the stream when the
    router leaves, which ends the decode request (its generator aborts it).
    """

    def __init__(self, content: AsyncIterator[bytes], credit: StreamCredit, media_type: str) -> None:
        super().__init__(content, media_type=media_type)
        self.credit = credit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        state = {"gone": False, "done": False}

        async def listen() -> None:
            while True:  # ends at the connection's end (or when the response is done)
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.credit.close()
                    if not state["done"]:
                        state["gone"] = True
                        task.cancel()
                    return
                self.credit.feed(message.get("body", b""))
                if not message.get("more_body", False):
                    self.credit.close()  # the router's body ended; keep listening for the close

        listener = asyncio.ensure_future(listen())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            state["done"] = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not state["gone"] or task.uncancel() > 0:
                raise
            # The router closed the connection: the stream ended with it (aborted by its generator).
        finally:
            listener.cancel()
