"""One decode request's NDJSON stream: descriptor, then (once its KV arrived) tokens, then done.

The lines are the wire's (`inference.wire.stream`): descriptor first, a token line per engine
output, then done, or an error line (`reason: kv_timeout` when the lease ran out). The state
of the request's run (outcome, timings, tokens sent) lives in a `DecodeStream`, so each step of it is a
short method; the worker (decode.py) reserves, waits for the KV and aborts.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from inference.engine import RequestOutput
from inference.kv_transfer import TransferDescriptor, TransferStats
from inference.server.credit import StreamCredit
from inference.wire import delivery_trace
from inference.wire.logprobs import encode_positions
from inference.wire.stream import descriptor_line, done_line, error_line, token_line

if TYPE_CHECKING:
    from inference.server.decode import DecodeWorker

# How long a decode stream waits for the next engine output (or router credit) before giving up.
OUTPUT_TIMEOUT_S = 120.0

# One encoded NDJSON line.
Event = bytes


@dataclass
class KVWaiter:
    """A decode request waiting for its KV: the event is set from the receiver thread."""

    loop: asyncio.AbstractEventLoop
    event: asyncio.Event = field(default_factory=asyncio.Event)
    stats: TransferStats | None = None
    # Set (with the event) by an abort, so the stream ends now instead of at the end of the lease.
    aborted: bool = False


@dataclass
class DecodeStream:
    """A reserved decode request from its descriptor to its last line.

    `sampling`: the parameters resolved on this worker (model defaults filled in), which the router
    hands to the prefill worker so that the first token is sampled exactly as the rest.
    """

    worker: DecodeWorker
    request_id: str
    prompt_token_ids: list[int]
    descriptor: TransferDescriptor
    waiter: KVWaiter
    received_at: float
    sampling: dict[str, Any]
    credit: StreamCredit | None = None
    # The prompt tokens whose KV this worker held already (the prefill side sent only the blocks after).
    cached_tokens: int = 0
    outcome: str = "aborted"
    finished: bool = False
    completion_tokens: int = 0
    last_token_at: float | None = None
    kv_wait_s: float = 0.0
    decode_started: float = 0.0

    async def events(self) -> AsyncIterator[Event]:
        """The stream's lines; however it ends, the outcome is counted and an unfinished request aborted."""
        try:
            yield descriptor_line(self.descriptor.to_dict(), self.prompt_token_ids, self.sampling)
            expiry = await self.worker.wait_for_kv(self.request_id, self.waiter)
            if expiry is not None:
                self.outcome = "kv_timeout"
                # `reason` lets the router tell a lease that ran out (the prefill side went silent:
                # it retries with a fresh reservation) from a failing decode worker.
                yield error_line(str(expiry.pop("message")), "kv_timeout", **expiry)
                return
            if self.waiter.aborted:
                return
            async for event in self._generated():
                yield event
        except TimeoutError:
            self.outcome = "error"
            yield error_line(f"no output from the engine for {OUTPUT_TIMEOUT_S:.0f}s")
        finally:
            await self.worker.decode_ended(self.request_id, self.outcome, self.finished)

    async def _generated(self) -> AsyncIterator[Event]:
        """Token lines within the router's credit, then the final line."""
        self.kv_wait_s = time.perf_counter() - self.received_at
        self.decode_started = time.perf_counter()
        stream = self.worker.engine.stream(self.request_id)
        while True:
            if not await self._credit_allows():
                self.outcome = "error"
                yield error_line(f"no credit from the router for {OUTPUT_TIMEOUT_S:.0f}s")
                return
            try:
                # asyncio.timeout arms a timer; wait_for would also wrap each token's wait in a task
                # of its own (once per generated token, on the loop that also handles aborts).
                async with asyncio.timeout(OUTPUT_TIMEOUT_S):
                    out = await anext(stream)
            except StopAsyncIteration:
                break
            event = self._token_line(out)
            if event is not None:
                yield event
            if out.finished:
                yield self._final_line(out)
                return
        self.outcome = "error"
        yield error_line("engine stream ended without finishing")

    async def _credit_allows(self) -> bool:
        """Wait until the credit covers the next token; False when the router gave none for too long.

        Outputs wait in the engine's channel meanwhile; past its window the sequence pauses. Bounded:
        a router that stopped acknowledging has closed or aborted."""
        credit = self.credit
        if credit is None or credit.allows(self.completion_tokens):
            return True
        try:
            async with asyncio.timeout(OUTPUT_TIMEOUT_S):
                await credit.wait(self.completion_tokens)
        except TimeoutError:
            return False
        return True

    def _token_line(self, out: RequestOutput) -> Event | None:
        """The token line of an output (None when it carries neither tokens nor text); TTFT, ITL."""
        n = len(out.new_token_ids)
        if not n:
            return token_line([], out.new_text) if out.new_text else None
        now = time.perf_counter()
        metrics, signals = self.worker.metrics, self.worker.signals
        if self.last_token_at is None:
            metrics.ttft.observe(now - self.received_at)
            signals.observe("ttft", now - self.received_at)
        else:
            metrics.itl.observe((now - self.last_token_at) / n)
            signals.observe("itl", (now - self.last_token_at) / n)
        self.last_token_at = now
        self.completion_tokens += n
        metrics.generation_tokens.inc(n)
        if delivery_trace.TRACE is not None:  # the HTTP server writes the line as soon as it is yielded
            delivery_trace.TRACE.mark("worker", self.request_id, n)
        logprobs = None
        if out.logprobs:
            logprobs = encode_positions(self.worker.logprob_texts.positions(out.logprobs))  # type: ignore[arg-type]
        return token_line(out.new_token_ids, out.new_text, logprobs)

    def _final_line(self, out: RequestOutput) -> Event:
        """The last line of a finished request: `done` with usage and timings, or the error."""
        self.finished = True
        if out.finish_reason in ("abort", "error"):
            # One label for every abort, whichever way it reached the stream.
            self.outcome = "aborted" if out.finish_reason == "abort" else "error"
            return error_line(f"request ended: {out.finish_reason}")
        self.outcome = "ok"
        self.worker.metrics.e2e.observe(time.perf_counter() - self.received_at)
        stats = self.waiter.stats
        return done_line(
            str(out.finish_reason),
            {"prompt_tokens": len(self.prompt_token_ids), "completion_tokens": self.completion_tokens,
             "cached_tokens": self.cached_tokens},
            {
                "kv_wait_s": round(self.kv_wait_s, 6),
                "decode_s": round(time.perf_counter() - self.decode_started, 6),
                "kv_transfer_s": round(stats.seconds, 6) if stats else None,
                "kv_bytes": stats.nbytes if stats else 0,
            },
        )
