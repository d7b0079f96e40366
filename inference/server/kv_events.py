"""`GET /internal/kv-events`: the worker's prefix-cache changes as an NDJSON stream (inference/wire/kv_events.py).

The stream starts with a snapshot, then sends the changes since the last line every `POLL_S` when
there are any (coalesced into one batch), a keepalive line after `KEEPALIVE_S` of quiet, and a fresh
snapshot should the subscriber have fallen behind the log. It ends when the subscriber hangs up or
the worker stops. Polling a sequence number costs a few attribute reads per subscriber and tick,
where a wake per change from the engine thread would cost a loop call per block stored.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from inference.engine.kv_events import KVEventLog
from inference.wire.kv_events import KEEPALIVE_LINE, KVEventBatch, KVSnapshot

# How often a stream looks for new changes: well below the gap between a turn and the next one.
POLL_S = 0.02
KEEPALIVE_S = 2.0


class KVEventSource:
    """One worker's event log with what every snapshot names: role, block size, process epoch."""

    def __init__(self, log: KVEventLog, role: str, block_size: int) -> None:
        self.log = log
        self.role = role
        self.block_size = block_size
        self.epoch = uuid.uuid4().hex  # a restarted worker is a new epoch: its old entries are gone
        self.subscribers = 0

    def snapshot(self) -> tuple[int, bytes]:
        """The sequence number a snapshot was taken at and its line."""
        seq, hashes = self.log.snapshot()
        line = KVSnapshot(role=self.role, block_size=self.block_size, epoch=self.epoch, seq=seq, hashes=hashes)
        return seq, line.encode()

    async def lines(self) -> AsyncIterator[bytes]:
        """The stream: a snapshot, then batches and keepalives until the subscriber leaves."""
        self.subscribers += 1
        try:
            seq, line = self.snapshot()
            yield line
            quiet_since = time.monotonic()
            while True:  # ends when the subscriber hangs up (the response is cancelled) or the worker stops
                await asyncio.sleep(POLL_S)
                if self.log.seq == seq:
                    if time.monotonic() - quiet_since >= KEEPALIVE_S:
                        quiet_since = time.monotonic()
                        yield KEEPALIVE_LINE
                    continue
                changes = self.log.since(seq)
                if changes is None:
                    seq, line = self.snapshot()
                    yield line
                else:
                    seq, stored, removed = changes
                    yield KVEventBatch(seq=seq, stored=stored, removed=removed).encode()
                quiet_since = time.monotonic()
        finally:
            self.subscribers -= 1


def kv_events_handler(source: KVEventSource) -> Callable[[Request], Awaitable[Response]]:
    """The route's handler over `source`."""

    async def kv_events(request: Request) -> Response:
        return StreamingResponse(source.lines(), media_type="application/x-ndjson")

    return kv_events
