"""`GET /internal/kv-events`: the worker's prefix-cache changes as an NDJSON stream (inference/wire/kv_events.py).

The stream starts with a snapshot, then sends the changes since the last line every `POLL_S` when
there are any (coalesced into one batch), the worker's load (`load` lines: running, waiting, prompt
tokens still to prefill, prefill rate, KV usage) at most every LOAD_POLLS polls when it changed, a
keepalive line after `KEEPALIVE_S` of quiet, and a fresh
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
from inference.wire.kv_events import KEEPALIVE_LINE, KVEventBatch, KVSnapshot, WorkerLoad

# How often a stream looks for new changes: well below the gap between a turn and the next one.
POLL_S = 0.02
KEEPALIVE_S = 2.0
# A load line goes out at most every LOAD_POLLS polls (100 ms), when the load changed: often enough that
# a burst of requests reaches every router process within a tenth of a second, rarely enough that a
# worker whose decode batch changes every step sends ten short lines a second per subscriber.
LOAD_POLLS = 5


class KVEventSource:
    """One worker's event log with what every snapshot names: role, block size, process epoch."""

    def __init__(self, log: KVEventLog, role: str, block_size: int,
                 load: Callable[[], WorkerLoad] | None = None) -> None:
        self.log = log
        self.role = role
        self.block_size = block_size
        self.load = load  # what the worker has ahead of it now, for the stream's load lines
        self.epoch = uuid.uuid4().hex  # a restarted worker is a new epoch: its old entries are gone
        self.subscribers = 0

    def snapshot(self) -> tuple[int, bytes]:
        """The sequence number a snapshot was taken at and its line."""
        seq, hashes = self.log.snapshot()
        line = KVSnapshot(role=self.role, block_size=self.block_size, epoch=self.epoch, seq=seq, hashes=hashes)
        return seq, line.encode()

    async def lines(self) -> AsyncIterator[bytes]:
        """The stream: a snapshot, then batches, load lines and keepalives until the subscriber leaves."""
        self.subscribers += 1
        try:
            seq, line = self.snapshot()
            yield line
            sent_load: WorkerLoad | None = None
            polls = 0
            quiet_since = time.monotonic()
            while True:  # ends when the subscriber hangs up (the response is cancelled) or the worker stops
                if self.load is not None and polls % LOAD_POLLS == 0:
                    load = self.load()
                    if load != sent_load:
                        sent_load = load
                        quiet_since = time.monotonic()
                        yield load.encode()
                polls += 1
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
