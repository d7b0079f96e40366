"""Before the first token: admit, open a decode stream, get the prompt prefilled, read the first line.

`Establishment` is one request's way to its first token: the decode workers it tried, the prefill
workers that failed it, and the typed failures its error would name. Every failure of a worker is
retried on another one (a prefill retry reuses the decode worker's descriptor, a decode retry
starts over); a lost lease is retried with a fresh reservation. While the prefill runs the decode
stream is watched too, so a decode worker that dies or whose lease runs out ends the wait at once
(the prefill call itself: prefill_call.py).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import aiohttp

from inference.router.attempt import Attempt
from inference.router.decode_stream import as_descriptor, first_output, open_stream
from inference.router.endpoint import Endpoint
from inference.router.errors import RouterError
from inference.router.events import GenerateRequest
from inference.router.failures import (
    TRANSPORT_ERRORS,
    BackendFailure,
    Busy,
    LeaseExpired,
    WorkerFailure,
    backends,
    kv_timeout_message,
    raise_for_status,
)
from inference.router.health import describe_exception
from inference.router.prefill_call import prefill
from inference.wire.stream import DescriptorLine, DoneLine, TokenLine

if TYPE_CHECKING:
    from inference.router.pd_client import DisaggregatedClient

logger = logging.getLogger(__name__)


class Establishment:
    """One request's way to its first token (`run`), with what it tried and what failed."""

    def __init__(self, client: DisaggregatedClient, req: GenerateRequest, arrived: float, deadline: float,
                 exclude_decode: list[Endpoint] | None = None) -> None:
        self.client = client
        self.req = req
        self.arrived = arrived
        self.deadline = deadline
        self.failures: list[WorkerFailure] = []
        self.busy: list[WorkerFailure] = []
        self.tried_decode: list[Endpoint] = list(exclude_decode or [])
        self.failed_prefill: list[Endpoint] = []
        self.queue_deadline = min(arrived + client.admission.queue_timeout_s, deadline)
        self.lease_losses = 0
        self.attempts = 0

    def timeout_error(self) -> RouterError:
        """The 504 of a request whose deadline passed before its first token."""
        return RouterError(504, f"no first token within {self.client.request_timeout_s:g}s",
                           backends=backends(self.failures))

    async def run(self) -> tuple[Attempt, TokenLine | DoneLine]:
        """The attempt that holds an open stream and a decode slot, and its first token (or done) line.

        Bounds: each worker failure excludes a decode or a prefill endpoint for the rest of the
        request; lost leases are retried at most once per prefill endpoint; a full worker (429)
        sends the request back to the queue, which ends at the queue deadline.
        """
        client = self.client
        # A colocated pool (no prefill endpoints) prefills on the decode workers: only they are tried.
        while client.pool.colocated or client.pool.candidates("prefill", exclude=self.failed_prefill):
            if time.monotonic() >= self.deadline:
                raise self.timeout_error()
            decode = await self._admit()
            if decode is None:
                break
            attempt = Attempt(request_id=self._next_request_id(), decode=decode, holds_decode_slot=True)
            client.metrics.selections.labels("decode", decode.url).inc()
            try:
                return attempt, await self._try(attempt)
            except (LeaseExpired, BackendFailure, Busy) as exc:
                # The next worker should not wait for a possibly dead one's abort.
                await client.finish(attempt, abort=True, wait_for_abort=False)
                if not self._go_on_after(attempt.decode, exc):
                    break
            except BaseException:
                # RouterError (passthrough, prefill exhausted) or cancellation: clean up, re-raise.
                await client.finish(attempt, abort=True)
                raise
        raise self.exhausted()

    async def _admit(self) -> Endpoint | None:
        """A decode slot, waited for in the admission queue (None when none freed in time)."""
        waited_from = time.monotonic()
        # A retry after a worker failure still gets a moment in the queue even if the first wait
        # used the whole queue timeout.
        until = self.queue_deadline if self.attempts == 0 else max(
            self.queue_deadline, min(self.deadline, waited_from + 1.0))
        decode = await self.client.admission.acquire(
            until, exclude=self.tried_decode, tenant=self.req.tenant, priority=self.req.priority, pin=self.req.pin
        )
        if decode is not None and self.attempts == 0:
            metrics = self.client.metrics
            metrics.queue_wait.observe(time.monotonic() - waited_from)
            metrics.dispatch.observe(waited_from - self.arrived)
        return decode

    def _next_request_id(self) -> str:
        n, self.attempts = self.attempts, self.attempts + 1
        return self.req.request_id if n == 0 else f"{self.req.request_id}-r{n}"

    async def _try(self, attempt: Attempt) -> TokenLine | DoneLine:
        descriptor = await self._open_decode(attempt)
        self.client.pool.record_success(attempt.decode)
        if descriptor.descriptor.get("local") is True:
            # The decode worker held nearly all of the prompt and prefilled it itself (pd_client's
            # `local_prefill_tokens`): no prefill call, the first token comes on the stream.
            self.client.metrics.prefill_where.labels("local").inc()
            return await self._first_output(attempt)
        self.client.metrics.prefill_where.labels("remote").inc()
        return await self._prefill_and_first_output(attempt, descriptor)

    def _go_on_after(self, decode: Endpoint, exc: LeaseExpired | BackendFailure | Busy) -> bool:
        """Record why the attempt on `decode` failed; False when no further attempt can help."""
        client = self.client
        if isinstance(exc, LeaseExpired):
            # The decode worker freed the blocks itself; it stays a candidate for the retry.
            self.lease_losses += 1
            logger.warning("lease of %s on decode %s lost: %s", self.req.request_id, decode.url, exc.message)
            stalled = exc.stalled
            if stalled is not None:
                client.record_failure(stalled, exc.message)
                self.failed_prefill.append(stalled)
                self.failures.append(WorkerFailure(stalled.url, "prefill", exc.message, lease=True))
            else:
                self.failures.append(WorkerFailure(decode.url, "decode", exc.message, lease=True))
            return self.lease_losses <= len(client.pool.endpoints("prefill"))
        if isinstance(exc, BackendFailure):
            self.tried_decode.append(decode)
            logger.warning("decode %s failed for %s: %s", decode.url, self.req.request_id, exc.message)
            client.record_failure(decode, exc.message)
            self.failures.append(WorkerFailure(decode.url, "decode", exc.message))
            return True
        # Full (its KV pool, typically): back to the queue until a slot frees somewhere.
        self.busy.append(WorkerFailure(decode.url, "decode", f"busy: {exc.message}"))
        client.admission.mark_full(decode)  # after the release, which ends a back-off
        return time.monotonic() < self.queue_deadline

    def exhausted(self) -> RouterError:
        """The error when no worker of a role could take the request."""
        failures, busy = self.failures, self.busy
        named = backends(busy + failures)
        if busy and not failures:
            self.client.metrics.rejected.labels("busy").inc()
            names = ", ".join(f"{b.role} {b.url}" for b in busy)
            return RouterError(429, f"all workers that answered are busy: {names}", backends=named)
        if not failures:
            return RouterError(503, "no backend available")
        names = "; ".join(f"{f.role} {f.url} ({f.error})" for f in failures)
        if all(f.lease for f in failures):
            # Every worker was reachable; the prefill side made no progress within the leases.
            return RouterError(504, f"no prefill progress: {names}", error_type="timeout_error", backends=named)
        return RouterError(502, f"no backend reachable: {names}", backends=named)

    # ---- the decode stream ----

    async def _open_decode(self, attempt: Attempt) -> DescriptorLine:
        """POST /internal/decode and read its descriptor line."""
        client = self.client
        wait = client.remaining(self.deadline, client.descriptor_timeout_s)
        body = client.encode_decode_body(self.req, attempt.request_id)
        # Until its descriptor says where it prefills, the prompt may join the prefill pool's queue: the
        # decisions of the requests sent meanwhile count it (a burst must not all see an empty queue).
        deciding = client.deciding_tokens(self.req)
        pool = client.pool
        pool.prefill_deciding_tokens += deciding
        try:
            async with asyncio.timeout(wait):
                # The asyncio timeouts here and in the streaming loop are the real bounds; the
                # client's own covers only the connect.
                response = await client.pool.upstream().post(
                    f"{attempt.decode.url}/internal/decode", body, connect_timeout_s=client.connect_timeout_s,
                    credit=client.stream_credit if attempt.decode.takes_credit() else 0)
                attempt.response = response
                if response.status != 200:
                    attempt.decode_untouched = True
                    raise_for_status(response.status, await response.read(), "decode")
                attempt.stream = open_stream(response.content)
                line = await attempt.stream.next()
        except aiohttp.ClientConnectorError as exc:
            attempt.decode_untouched = True
            raise BackendFailure(describe_exception(exc)) from exc
        except TimeoutError:
            raise BackendFailure(f"no descriptor within {wait:.1f}s") from None
        except TRANSPORT_ERRORS as exc:
            raise BackendFailure(describe_exception(exc)) from exc
        except ValueError as exc:
            raise BackendFailure(f"bad descriptor line: {exc}") from exc
        finally:
            pool.prefill_deciding_tokens -= deciding
        descriptor = as_descriptor(line)
        attempt.prompt_ids = descriptor.prompt_token_ids
        return descriptor

    async def _first_output(self, attempt: Attempt) -> TokenLine | DoneLine:
        """The decode stream's first output, read while the prefill runs (bounded by the deadline
        only: the decode worker's lease ends a wait for KV that never comes)."""
        assert attempt.stream is not None
        wait = self.client.remaining(self.deadline)
        try:
            async with asyncio.timeout(wait):
                return await first_output(attempt.stream)
        except TimeoutError:
            raise BackendFailure(f"no first token within {wait:.1f}s") from None
        except TRANSPORT_ERRORS as exc:
            raise BackendFailure(describe_exception(exc)) from exc
        except ValueError as exc:
            raise BackendFailure(f"bad line on the decode stream: {exc}") from exc

    # ---- the prefill, watched from the decode stream ----

    async def _prefill_and_first_output(self, attempt: Attempt, descriptor: DescriptorLine) -> TokenLine | DoneLine:
        """Run the prefill while watching the decode stream; return the decode's first output line.

        A decode worker that dies (`BackendFailure`) or whose lease ran out because the prefill made
        no progress (`LeaseExpired` naming the prefill worker in flight) makes the prefill pointless,
        and waiting for a stalled prefill would otherwise last until the request timeout. Both
        tasks are gone when this returns, but a prefill answer still on its way after the first
        token: it finishes in the background (`attempt.pending_answer`).
        """
        reader = asyncio.ensure_future(self._first_output(attempt))
        prefiller = asyncio.ensure_future(prefill(self, attempt, descriptor))
        kept = False  # the prefill answer was left to finish in the background
        try:
            done, _pending = await asyncio.wait({reader, prefiller}, timeout=self.client.remaining(self.deadline),
                                                return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise self.timeout_error()
            if prefiller in done:
                prefiller.result()  # RouterError (no prefill worker left, 400) or LeaseExpired
                return await self._first_output_after_prefill(reader)
            line = self._first_output_before_prefill(attempt, reader)
            # The first token came before the prefill answer (the KV is in place, the answer is on
            # its way): the token goes to the client now rather than up to a second later on a busy
            # prefill worker. The answer's timings fill the done event if they come in time.
            if not prefiller.done():
                attempt.pending_answer = self.client.spawn(prefiller)
                kept = True
            return line
        finally:
            tasks = [reader] if kept else [reader, prefiller]
            for task in tasks:
                task.cancel()
            # Bounded: both tasks only await network calls, which end promptly when cancelled.
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _first_output_after_prefill(self, reader: asyncio.Future[TokenLine | DoneLine]) -> TokenLine | DoneLine:
        # The KV is acknowledged: the first token follows unless the decode worker stalls.
        wait = self.client.remaining(self.deadline, self.client.stall_timeout_s)
        try:
            return await asyncio.wait_for(reader, timeout=wait)
        except TimeoutError:
            raise BackendFailure(f"no first token within {wait:.1f}s after the prefill") from None

    @staticmethod
    def _first_output_before_prefill(attempt: Attempt, reader: asyncio.Future[TokenLine | DoneLine]
                                     ) -> TokenLine | DoneLine:
        try:
            return reader.result()
        except LeaseExpired as exc:
            stalled = attempt.prefill  # the worker that held the prefill did not deliver
            exc.stalled = stalled
            if stalled is not None and exc.line is not None:
                exc.message = kv_timeout_message(exc.line, stalled.url)
            raise
