"""The disaggregated request path: one decode worker and one prefill worker per request.

    router                      decode worker                     prefill worker
      | POST /internal/decode ->  | reserve KV blocks                  |
      | <- descriptor line        |                                    |
      | POST /internal/prefill (descriptor) ---------------------------> | run prompt,
      |                           | <========= KV blocks + first token | write KV
      | <- prefill answer (timings) ---------------------------------------|
      | <- token lines ... done   | decode steps                       |

Before the first token every failure of a worker (connect error, 5xx, timeout, broken stream) is
retried on another one: a prefill retry reuses the decode worker's descriptor, a decode retry starts
over. While the prefill runs the decode stream is watched too, so a decode worker that dies or whose
lease on the reserved blocks runs out (the prefill made no progress) ends the wait at once; a lost
lease is retried with a fresh reservation. A decode worker that fails after the first token hands
the stream to another one (migration.py), which is given prompt + the tokens sent so far as its
prompt, at most `max_migrations` times per request; past that the stream ends with an error event.
Every wait is bounded.

Decode workers are taken through `Admission` (admission.py): at most a worker's batch slots at
once, the rest wait in a FIFO queue until `ROUTER_QUEUE_TIMEOUT_S`, then 429. Worker calls use one
aiohttp session per event loop; token lines that arrived together go to the client as one event.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from inference.router.admission import Admission
from inference.router.endpoint import Endpoint
from inference.router.errors import RouterError
from inference.router.events import DoneEvent, ErrorEvent, Event, GenerateRequest, TokenEvent, new_request_id
from inference.router.failures import (
    BackendFailure,
    Busy,
    DecodePeerFailure,
    LeaseExpired,
    kv_timeout_message,
    raise_for_status,
)
from inference.router.health import describe_exception
from inference.router.metrics import RouterMetrics
from inference.router.migration import resumed_request
from inference.router.ndjson import NdjsonReader
from inference.router.pool import WorkerPool
from inference.router.upstream import UpstreamResponse

logger = logging.getLogger(__name__)

__all__ = [
    "DisaggregatedClient",
    "DoneEvent",
    "ErrorEvent",
    "Event",
    "GenerateRequest",
    "TokenEvent",
    "new_request_id",
]

# Transport errors of a worker call (aiohttp's, and the OS errors it lets through).
_TRANSPORT_ERRORS = (aiohttp.ClientError, OSError)
# How long a finished stream waits for a prefill answer still on its way (for the done event's timings).
_PREFILL_ANSWER_WAIT_S = 1.0


@dataclass(eq=False)
class _Attempt:
    """One decode worker's try at a request, with everything that must be closed or aborted."""

    request_id: str
    decode: Endpoint
    response: UpstreamResponse | None = None
    reader: NdjsonReader | None = None
    prompt_tokens: int = 0
    prompt_ids: list[int] = field(default_factory=list)
    prefill: Endpoint | None = None
    prefill_result: dict[str, Any] = field(default_factory=dict)
    holds_decode_slot: bool = False
    # The prefill call, still finishing in the background after the first token came before it.
    prefill_answer: asyncio.Future[None] | None = None
    # True when the decode worker certainly holds nothing for this request (it could not be
    # reached, or it refused the request with an error status): no abort is sent to it.
    decode_untouched: bool = False
    # Tokens of this attempt's stream handed to the client (what a credited stream acknowledges).
    relayed: int = 0


def _token_ids(line: dict[str, Any]) -> list[int]:
    ids = line.get("token_ids")
    if type(ids) is list and len(ids) == 1 and type(ids[0]) is int:  # the usual line: one token
        return ids
    if isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return ids
    return []


def _float_or_none(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class DisaggregatedClient:
    """Runs requests through a decode + prefill pair chosen from a `WorkerPool`.

    Timeouts: `connect_timeout_s` for every TCP connect; `descriptor_timeout_s` for the decode
    worker's first line; `stall_timeout_s` for any silence on the decode stream once the prefill
    answered; `request_timeout_s` for the whole request (it also bounds the prefill call);
    `abort_timeout_s` for each best-effort abort; `admission.queue_timeout_s` for the wait for a
    decode slot.

    `max_inflight` (None: unlimited) is a hard cap on the generations this client holds at once,
    queued ones included; one more is refused at once with 429 (the view adds Retry-After).
    """

    def __init__(
        self,
        pool: WorkerPool,
        *,
        admission: Admission | None = None,
        metrics: RouterMetrics | None = None,
        request_timeout_s: float = 300.0,
        connect_timeout_s: float = 3.0,
        descriptor_timeout_s: float = 30.0,
        stall_timeout_s: float = 60.0,
        abort_timeout_s: float = 2.0,
        max_inflight: int | None = None,
        max_migrations: int = 2,
        stream_credit: int = 0,
    ) -> None:
        if max_inflight is not None and max_inflight < 1:
            raise ValueError("max_inflight must be >= 1 (or None for no limit)")
        self.pool = pool
        self.admission = admission or Admission(pool)
        self.metrics = metrics or RouterMetrics()
        self.admission.metrics = self.metrics
        self.max_inflight = max_inflight
        self.max_migrations = max_migrations
        if stream_credit < 0 or stream_credit == 1:
            raise ValueError("stream_credit must be 0 (off) or at least 2")
        self.stream_credit = stream_credit
        # Acknowledge every half credit: a router that keeps up never stalls a stream.
        self._ack_every = max(1, stream_credit // 2)
        self.inflight = 0
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.descriptor_timeout_s = descriptor_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.abort_timeout_s = abort_timeout_s
        # Abort posts that outlive a cancelled request; kept referenced so they are not collected.
        self._background: set[asyncio.Future[None]] = set()
        self.metrics.bind_gauges(lambda: self.inflight, lambda: self.admission.queued, self.admission.capacity)

    # ----------------------------------------------------------------------------------------
    # Public
    # ----------------------------------------------------------------------------------------

    def generate(self, req: GenerateRequest, arrived: float | None = None) -> AsyncGenerator[Event, None]:
        """Run `req` and yield TokenEvents, then one DoneEvent (or an ErrorEvent after a failure).

        `arrived` (time.monotonic() when the client's request came in) starts the queue and
        request deadlines; default now. Raises RouterError before the first event: 4xx from the
        decode worker (passed through), 429 when no decode slot freed within the queue timeout or
        the queue or `max_inflight` is full, 502 when no worker could serve it (with `backends`
        naming each one tried), 503 when no endpoints are configured, 504 when the request
        timeout passed first. Closing or cancelling the generator closes the decode stream and
        posts `/internal/abort` to both workers.
        """
        # The stream is `_generate` itself, not a generator around it: every token event passes
        # one generator fewer (measured per streamed token).
        return self._generate(req, arrived if arrived is not None else time.monotonic())

    async def _generate(self, req: GenerateRequest, arrived: float) -> AsyncGenerator[Event, None]:
        if self.max_inflight is not None and self.inflight >= self.max_inflight:
            self.metrics.rejected.labels("inflight").inc()
            raise RouterError(
                429,
                f"router is at its limit of {self.max_inflight} requests in flight "
                "(ROUTER_MAX_INFLIGHT); retry later",
            )
        # One event loop per process: the check above and this increment cannot interleave.
        self.inflight += 1
        try:
            deadline = arrived + self.request_timeout_s
            attempt, line, first_at, retries = await self._establish(req, arrived, deadline)
            metrics = self.metrics
            metrics.ttft.observe(first_at - arrived)
            if retries:
                metrics.retries.inc(retries)
            prompt_ids = list(attempt.prompt_ids)
            emitted: list[int] = []  # every token id forwarded to the client, across migrations
            failed_decode: list[Endpoint] = []
            migrations = 0
            finished = False
            last_at = first_at
            try:
                while True:  # bounded: every read has a timeout, the request a deadline, migrations a cap
                    kind = line.get("type")
                    following: dict[str, Any] | None = None
                    failure: ErrorEvent | None = None
                    if kind == "token":
                        ids = _token_ids(line)
                        text = str(line.get("text") or "")
                        # Tokens that arrived in the same read go out as one event (one client write).
                        while (following := self._ready(attempt)) is not None and following.get("type") == "token":
                            ids = ids + _token_ids(following)
                            text += str(following.get("text") or "")
                        if ids:
                            now = time.monotonic()
                            if emitted:
                                metrics.itl.observe((now - last_at) / len(ids))
                            last_at = now
                            emitted.extend(ids)
                        yield TokenEvent(text=text, token_ids=ids)
                        # The client has it (the consumer asked for the next event): credit the worker.
                        attempt.relayed += len(ids)
                        response = attempt.response
                        if response is not None and attempt.relayed - response.acked >= self._ack_every:
                            response.ack(attempt.relayed)
                    elif kind == "done":
                        finished = True
                        answer = attempt.prefill_answer
                        if answer is not None and not answer.done():
                            # Its timings belong in the done event; never held up for long.
                            await asyncio.wait({answer}, timeout=_PREFILL_ANSWER_WAIT_S)
                        metrics.e2e.observe(time.monotonic() - arrived)
                        done = self._done_event(req, attempt, line, arrived, first_at, len(emitted), retries)
                        if migrations:
                            # The last worker saw prompt + earlier tokens as its prompt: report the client's view.
                            done.usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(emitted),
                                          "total_tokens": len(prompt_ids) + len(emitted)}
                            done.migrations = migrations
                        yield done
                        return
                    elif kind == "error":
                        failure = ErrorEvent(f"decode worker {attempt.decode.url} failed: {line.get('message')}")
                    # Other line types are skipped: newer workers may add some.
                    if failure is None and following is not None:
                        line = following
                        continue
                    if failure is None:
                        next_line, failure = await self._next_line(attempt, deadline)
                        if failure is None:
                            assert next_line is not None
                            line = next_line
                            continue
                    # The decode worker failed after the first token: move the stream, or end it cleanly.
                    moved = await self._migrate(req, attempt, prompt_ids, emitted, failed_decode, migrations,
                                                failure, deadline)
                    if isinstance(moved, ErrorEvent):
                        yield moved
                        return
                    attempt, line = moved
                    migrations += 1
            finally:
                metrics.tokens.inc(len(emitted))  # once per request, not per token
                await self._finish(attempt, abort=not finished)
        finally:
            self.inflight -= 1

    async def _migrate(
        self,
        req: GenerateRequest,
        attempt: _Attempt,
        prompt_ids: list[int],
        emitted: list[int],
        failed_decode: list[Endpoint],
        migrations: int,
        failure: ErrorEvent,
        deadline: float,
    ) -> tuple[_Attempt, dict[str, Any]] | ErrorEvent:
        """Continue the stream on another decode worker after `failure`; the new attempt and its first
        line, or the ErrorEvent that ends the stream (cap reached, deadline passed, nobody could take it).

        `attempt` is finished here (aborted on its workers, its slot released) when it is replaced.
        """
        resumed = resumed_request(req, prompt_ids, emitted, migrations + 1)
        if not failure.migratable or migrations >= self.max_migrations or resumed is None:
            if failure.migratable and migrations >= self.max_migrations:
                failure.message += f" (after {migrations} migrations; ROUTER_MAX_MIGRATIONS)"
            return failure
        logger.warning("%s: %s; moving the stream to another decode worker (%d tokens so far)",
                       req.request_id, failure.message, len(emitted))
        failed_decode.append(attempt.decode)
        await self._finish(attempt, abort=True, wait_for_abort=False)
        try:
            moved, line, _first_at, _retries = await self._establish(
                resumed, time.monotonic(), deadline, exclude_decode=failed_decode
            )
        except RouterError as exc:
            # The client learns what broke its stream; why it could not move is the detail.
            return ErrorEvent(f"{failure.message}; no other decode worker could take the stream: {exc.message}",
                              status=failure.status)
        self.metrics.migrations.inc()
        return moved, line

    async def abort(self, urls: list[str], request_id: str) -> None:
        """Post `/internal/abort` for `request_id` to each URL; best effort, bounded, never raises."""
        session = self.pool.session()
        timeout = aiohttp.ClientTimeout(total=self.abort_timeout_s)
        body = orjson.dumps({"request_id": request_id})

        async def post(url: str) -> None:
            with contextlib.suppress(Exception):
                async with session.post(f"{url}/internal/abort", data=body, timeout=timeout,
                                        headers={"Content-Type": "application/json"}) as response:
                    await response.read()

        await asyncio.gather(*(post(url) for url in urls))

    # ----------------------------------------------------------------------------------------
    # Before the first token: admit, open, prefill, retry
    # ----------------------------------------------------------------------------------------

    async def _establish(
        self, req: GenerateRequest, arrived: float, deadline: float, exclude_decode: list[Endpoint] | None = None
    ) -> tuple[_Attempt, dict[str, Any], float, int]:
        """Take a decode slot, open its stream, get the prompt prefilled and read the first line.

        Returns the attempt (holding the open stream and a decode slot), the first token (or done)
        line, when it arrived, and how many attempts failed before. `exclude_decode`: decode workers
        not to use (a migrated stream's failed ones).
        """
        pool = self.pool
        if not pool.endpoints("prefill"):
            raise RouterError(503, "no prefill endpoints configured")
        failures: list[dict[str, Any]] = []
        busy: list[dict[str, Any]] = []
        tried_decode: list[Endpoint] = list(exclude_decode or [])
        failed_prefill: list[Endpoint] = []
        queue_deadline = min(arrived + self.admission.queue_timeout_s, deadline)
        # Bounds: each worker failure excludes a decode endpoint or a prefill endpoint for the rest
        # of the request; lost leases are retried at most once per prefill endpoint; a full worker
        # (429) sends the request back to the queue, which ends at the queue deadline.
        lease_losses = 0
        attempt_no = 0
        while True:
            if not pool.candidates("prefill", exclude=failed_prefill):
                break  # every prefill worker failed this request: no point in reserving again
            if time.monotonic() >= deadline:
                raise RouterError(504, f"no first token within {self.request_timeout_s:g}s", backends=failures)
            waited_from = time.monotonic()
            # A retry after a worker failure still gets a moment in the queue even if the first
            # wait used the whole queue timeout.
            decode = await self.admission.acquire(
                queue_deadline if attempt_no == 0 else max(queue_deadline, min(deadline, waited_from + 1.0)),
                exclude=tried_decode,
            )
            if decode is None:
                break
            now = time.monotonic()
            if attempt_no == 0:
                self.metrics.queue_wait.observe(now - waited_from)
                self.metrics.dispatch.observe(waited_from - arrived)
            request_id = req.request_id if attempt_no == 0 else f"{req.request_id}-r{attempt_no}"
            attempt_no += 1
            attempt = _Attempt(request_id=request_id, decode=decode, holds_decode_slot=True)
            self.metrics.selections.labels("decode", decode.url).inc()
            try:
                descriptor_line = await self._open_decode(attempt, req, deadline)
                pool.record_success(decode)
                line = await self._prefill_and_first_output(
                    attempt, req, descriptor_line, deadline, failed_prefill, failures, busy
                )
                return attempt, line, time.monotonic(), attempt_no - 1
            except LeaseExpired as exc:
                # The decode worker freed the blocks itself; it stays a candidate for the retry.
                stalled = exc.stalled
                lease_losses += 1
                logger.warning("lease of %s on decode %s lost: %s", request_id, decode.url, exc.message)
                if stalled is not None:
                    self._record_failure(stalled, exc.message)
                    failed_prefill.append(stalled)
                    failures.append({"url": stalled.url, "role": "prefill", "error": exc.message, "lease": True})
                else:
                    failures.append({"url": decode.url, "role": "decode", "error": exc.message, "lease": True})
                await self._finish(attempt, abort=True, wait_for_abort=False)
                if lease_losses > len(pool.endpoints("prefill")):
                    break
            except BackendFailure as exc:
                tried_decode.append(decode)
                logger.warning("decode %s failed for %s: %s", decode.url, request_id, exc.message)
                self._record_failure(decode, exc.message)
                failures.append({"url": decode.url, "role": "decode", "error": exc.message})
                # The next worker should not wait for a possibly dead one's abort.
                await self._finish(attempt, abort=True, wait_for_abort=False)
            except Busy as exc:
                # Full (its KV pool, typically): back to the queue until a slot frees somewhere.
                busy.append({"url": decode.url, "role": "decode", "error": f"busy: {exc.message}"})
                await self._finish(attempt, abort=True, wait_for_abort=False)
                self.admission.mark_full(decode)  # after the release, which ends a back-off
                if time.monotonic() >= queue_deadline:
                    break
            except BaseException:
                # RouterError (passthrough, prefill exhausted) or cancellation: clean up, re-raise.
                await self._finish(attempt, abort=True)
                raise
        raise self._exhausted(failures, busy)

    def _record_failure(self, endpoint: Endpoint, message: str) -> None:
        self.pool.record_failure(endpoint, message)
        self.metrics.failures.labels(endpoint.role, endpoint.url).inc()

    def _exhausted(self, failures: list[dict[str, Any]], busy: list[dict[str, Any]]) -> RouterError:
        """The error when no worker of a role could take the request."""
        backends = [{k: v for k, v in f.items() if k != "lease"} for f in busy + failures]
        if busy and not failures:
            self.metrics.rejected.labels("busy").inc()
            names = ", ".join(f"{b['role']} {b['url']}" for b in busy)
            return RouterError(429, f"all workers that answered are busy: {names}", backends=backends)
        if not failures:
            return RouterError(503, "no backend available")
        names = "; ".join(f"{f['role']} {f['url']} ({f['error']})" for f in failures)
        if all(f.get("lease") for f in failures):
            # Every worker was reachable; the prefill side made no progress within the leases.
            return RouterError(504, f"no prefill progress: {names}", error_type="timeout_error", backends=backends)
        return RouterError(502, f"no backend reachable: {names}", backends=backends)

    def _remaining(self, deadline: float, bound: float | None = None) -> float:
        remaining = max(0.0, deadline - time.monotonic())
        return remaining if bound is None else min(bound, remaining)

    async def _open_decode(self, attempt: _Attempt, req: GenerateRequest, deadline: float) -> dict[str, Any]:
        """POST /internal/decode and read its descriptor line."""
        upstream = self.pool.upstream()
        wait = self._remaining(deadline, self.descriptor_timeout_s)
        body = orjson.dumps(req.decode_body(attempt.request_id))
        try:
            async with asyncio.timeout(wait):
                # The asyncio timeouts here and in the streaming loop are the real bounds; the
                # client's own covers only the connect.
                response = await upstream.post(f"{attempt.decode.url}/internal/decode", body,
                                               connect_timeout_s=self.connect_timeout_s,
                                               credit=self.stream_credit if attempt.decode.takes_credit() else 0)
                attempt.response = response
                if response.status != 200:
                    attempt.decode_untouched = True
                    raise_for_status(response.status, await response.read(), "decode")
                attempt.reader = NdjsonReader(response.content)
                line = await attempt.reader.next()
        except aiohttp.ClientConnectorError as exc:
            attempt.decode_untouched = True
            raise BackendFailure(describe_exception(exc)) from exc
        except TimeoutError:
            raise BackendFailure(f"no descriptor within {wait:.1f}s") from None
        except _TRANSPORT_ERRORS as exc:
            raise BackendFailure(describe_exception(exc)) from exc
        except ValueError as exc:
            raise BackendFailure(f"bad descriptor line: {exc}") from exc
        if line is None:
            raise BackendFailure("closed the stream before sending a descriptor")
        if line.get("type") == "error":
            raise BackendFailure(f"error before the descriptor: {line.get('message')}")
        if line.get("type") != "descriptor" or not isinstance(line.get("descriptor"), dict):
            raise BackendFailure(f"expected a descriptor line, got {str(line)[:200]}")
        ids = line.get("prompt_token_ids")
        if not isinstance(ids, list):
            raise BackendFailure("descriptor line has no prompt_token_ids list")
        attempt.prompt_tokens = len(ids)
        attempt.prompt_ids = [int(t) for t in ids if isinstance(t, int)]
        return line

    async def _prefill_and_first_output(
        self,
        attempt: _Attempt,
        req: GenerateRequest,
        descriptor_line: dict[str, Any],
        deadline: float,
        failed_prefill: list[Endpoint],
        failures: list[dict[str, Any]],
        busy: list[dict[str, Any]],
    ) -> dict[str, Any]:
        """Run the prefill while watching the decode stream; return the decode's first output line.

        The decode stream is read concurrently with the prefill call because it can end the wait
        early: a decode worker that dies (stream broken: `BackendFailure`) or whose lease ran out
        because the prefill made no progress (error line `reason: kv_timeout`: `LeaseExpired`
        naming the prefill worker in flight) makes the prefill pointless, and waiting for a
        stalled prefill would otherwise last until the request timeout. Both tasks are gone when
        this returns.
        """
        reader = asyncio.ensure_future(self._first_output(attempt, deadline))
        prefiller = asyncio.ensure_future(
            self._prefill(attempt, req, descriptor_line, deadline, failed_prefill, failures, busy)
        )
        kept = False  # the prefill answer was left to finish in the background
        try:
            done, _pending = await asyncio.wait(
                {reader, prefiller}, timeout=self._remaining(deadline), return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                raise RouterError(504, f"no first token within {self.request_timeout_s:g}s", backends=failures)
            if prefiller in done:
                prefiller.result()  # RouterError (no prefill worker left, 400) or LeaseExpired
                # The KV is acknowledged: the first token follows unless the decode worker stalls.
                wait = self._remaining(deadline, self.stall_timeout_s)
                try:
                    return await asyncio.wait_for(reader, timeout=wait)
                except TimeoutError:
                    raise BackendFailure(f"no first token within {wait:.1f}s after the prefill") from None
            try:
                line = reader.result()
            except LeaseExpired as exc:
                stalled = attempt.prefill  # the worker that held the prefill did not deliver
                exc.stalled = stalled
                if stalled is not None and exc.line is not None:
                    exc.message = kv_timeout_message(exc.line, stalled.url)
                raise
            # The first token came before the prefill answer (the KV is in place, the answer is on
            # its way): the token goes to the client now. Holding it for the answer cost up to a
            # second of TTFT on a busy prefill worker, while the decode worker generated on for a
            # client that could not yet see (or hang up on) its stream. The answer finishes in the
            # background (bounded by the request deadline); its timings fill the done event if in.
            if not prefiller.done():
                self._spawn(prefiller)
                attempt.prefill_answer = prefiller
                kept = True
            return line
        finally:
            tasks = [reader] if kept else [reader, prefiller]
            for task in tasks:
                task.cancel()
            # Bounded: both tasks only await network calls, which end promptly when cancelled.
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _prefill(
        self,
        attempt: _Attempt,
        req: GenerateRequest,
        descriptor_line: dict[str, Any],
        deadline: float,
        failed_prefill: list[Endpoint],
        failures: list[dict[str, Any]],
        busy: list[dict[str, Any]],
    ) -> None:
        """Get the prompt prefilled into the decode worker's blocks, trying each prefill worker once.

        Prefill workers that fail are remembered in `failed_prefill` for the rest of the request.
        When none is left this raises the final RouterError (a prefill failure says nothing about
        the decode worker, so there is no point in starting over with another one).
        """
        pool = self.pool
        body = orjson.dumps({
            "request_id": attempt.request_id,
            "prompt_token_ids": descriptor_line["prompt_token_ids"],
            # The decode worker's resolved parameters (its model's generation_config.json defaults
            # filled in), so that prefill samples the first token with the same values as decode.
            "sampling": resolved if isinstance(resolved := descriptor_line.get("sampling"), dict) else req.sampling,
            "descriptor": descriptor_line["descriptor"],  # reused as is by every retry
        })
        tried: list[Endpoint] = list(failed_prefill)
        for _ in range(len(pool.endpoints("prefill"))):  # each prefill endpoint at most once
            prefill = pool.choose("prefill", exclude=tried)
            if prefill is None:
                break
            if time.monotonic() >= deadline:
                raise RouterError(504, f"no first token within {self.request_timeout_s:g}s", backends=failures)
            tried.append(prefill)
            attempt.prefill = prefill
            self.metrics.selections.labels("prefill", prefill.url).inc()
            prefill.acquire()
            try:
                attempt.prefill_result = await self._post_prefill(prefill, body, deadline)
            except DecodePeerFailure:
                pool.record_success(prefill)
                raise  # the decode worker failed: `_establish` starts over with another one
            except BackendFailure as exc:
                logger.warning("prefill %s failed for %s: %s", prefill.url, attempt.request_id, exc.message)
                self._record_failure(prefill, exc.message)
                failed_prefill.append(prefill)
                failures.append({"url": prefill.url, "role": "prefill", "error": exc.message})
                # A prefill that timed out may still be working: tell it to stop, in the background.
                self._spawn(self.abort([prefill.url], attempt.request_id))
                attempt.prefill = None
                continue
            except Busy as exc:
                busy.append({"url": prefill.url, "role": "prefill", "error": f"busy: {exc.message}"})
                attempt.prefill = None
                continue
            except LeaseExpired as exc:
                # Not this worker's fault (it answered; an earlier one took the lease's time).
                pool.record_success(prefill)
                exc.message = f"prefill worker {prefill.url} found the decode lease expired: {exc.message}"
                raise
            finally:
                prefill.release()
            pool.record_success(prefill)
            return
        raise self._exhausted(failures, busy)

    async def _post_prefill(self, prefill: Endpoint, body: bytes, deadline: float) -> dict[str, Any]:
        """POST /internal/prefill; the answer comes once the decode worker acknowledged the KV."""
        wait = self._remaining(deadline)
        try:
            async with asyncio.timeout(wait):
                response = await self.pool.upstream().post(f"{prefill.url}/internal/prefill", body,
                                                           connect_timeout_s=self.connect_timeout_s)
                async with response:
                    raw = await response.read()
                    status = response.status
        except TimeoutError:
            raise BackendFailure(f"no prefill answer within {wait:.1f}s") from None
        except _TRANSPORT_ERRORS as exc:
            raise BackendFailure(describe_exception(exc)) from exc
        if status != 200:
            raise_for_status(status, raw, "prefill")
        try:
            result = orjson.loads(raw)
        except ValueError:
            result = None
        if not isinstance(result, dict):
            raise BackendFailure("prefill answer is not a JSON object")
        return result

    async def _first_output(self, attempt: _Attempt, deadline: float) -> dict[str, Any]:
        """The decode stream's first token (or done) line; read while the prefill runs.

        Bounded by the request deadline only: the decode worker's own lease ends a wait for KV
        that never comes, and `_prefill_and_first_output` applies the stall timeout once the
        prefill answered.
        """
        assert attempt.reader is not None
        wait = self._remaining(deadline)
        try:
            async with asyncio.timeout(wait):
                while True:  # bounded by the timeout
                    line = await attempt.reader.next()
                    if line is None:
                        raise BackendFailure("decode stream ended before the first token")
                    kind = line.get("type")
                    if kind in ("token", "done"):
                        return line
                    if kind == "error":
                        if line.get("reason") == "kv_timeout":
                            # The caller knows which prefill worker held it and names it.
                            raise LeaseExpired(kv_timeout_message(line, None), line=line)
                        raise BackendFailure(f"error before the first token: {line.get('message')}")
        except TimeoutError:
            raise BackendFailure(f"no first token within {wait:.1f}s") from None
        except _TRANSPORT_ERRORS as exc:
            raise BackendFailure(describe_exception(exc)) from exc
        except ValueError as exc:
            raise BackendFailure(f"bad line on the decode stream: {exc}") from exc

    # ----------------------------------------------------------------------------------------
    # After the first token
    # ----------------------------------------------------------------------------------------

    @staticmethod
    def _ready(attempt: _Attempt) -> dict[str, Any] | None:
        return attempt.reader.ready() if attempt.reader is not None else None

    async def _next_line(
        self, attempt: _Attempt, deadline: float
    ) -> tuple[dict[str, Any] | None, ErrorEvent | None]:
        """The next decode line, or the ErrorEvent that ends the stream."""
        assert attempt.reader is not None
        line = attempt.reader.ready()
        if line is not None:  # already received: no timer to arm (the common case under load)
            return line, None
        decode = attempt.decode
        remaining = self._remaining(deadline)
        wait = min(self.stall_timeout_s, remaining)
        try:
            line = await attempt.reader.next_within(wait)
        except TimeoutError:
            if wait >= remaining:
                return None, ErrorEvent(f"request exceeded {self.request_timeout_s:g}s", status=504, migratable=False)
            self._record_failure(decode, f"stream stalled for {wait:.1f}s")
            return None, ErrorEvent(f"decode worker {decode.url} sent nothing for {wait:.1f}s", status=504)
        except _TRANSPORT_ERRORS as exc:
            self._record_failure(decode, describe_exception(exc))
            return None, ErrorEvent(f"decode worker {decode.url} failed: {describe_exception(exc)}")
        except ValueError as exc:
            self._record_failure(decode, f"bad line: {exc}")
            return None, ErrorEvent(f"decode worker {decode.url} sent a bad line: {exc}")
        if line is None:
            self._record_failure(decode, "stream ended before done")
            return None, ErrorEvent(f"decode worker {decode.url} closed the stream before finishing")
        return line, None

    def _done_event(
        self,
        req: GenerateRequest,
        attempt: _Attempt,
        line: dict[str, Any],
        start: float,
        first_at: float,
        completion_tokens: int,
        retries: int,
    ) -> DoneEvent:
        raw_usage = line.get("usage")
        usage_in: dict[str, Any] = raw_usage if isinstance(raw_usage, dict) else {}
        prompt_tokens = usage_in.get("prompt_tokens", attempt.prompt_tokens)
        completion = usage_in.get("completion_tokens", completion_tokens)
        prompt_tokens = prompt_tokens if isinstance(prompt_tokens, int) else attempt.prompt_tokens
        completion = completion if isinstance(completion, int) else completion_tokens
        raw_timings = line.get("timings")
        decode_timings: dict[str, Any] = raw_timings if isinstance(raw_timings, dict) else {}
        result = attempt.prefill_result
        # The decode worker counts the KV it received too (when the prefill answer is not in).
        kv_bytes = result.get("kv_bytes", decode_timings.get("kv_bytes"))
        return DoneEvent(
            request_id=req.request_id,
            finish_reason=str(line.get("finish_reason") or "stop"),
            usage={
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
            },
            timings={
                "ttft_s": round(first_at - start, 6),
                "e2e_s": round(time.monotonic() - start, 6),
                "prefill_s": _float_or_none(result.get("prefill_s")),
                "kv_transfer_s": _float_or_none(result.get("transfer_s", decode_timings.get("kv_transfer_s"))),
                "kv_wait_s": _float_or_none(decode_timings.get("kv_wait_s")),
                "decode_s": _float_or_none(decode_timings.get("decode_s")),
            },
            prefill=attempt.prefill.url if attempt.prefill else "",
            decode=attempt.decode.url,
            kv_bytes=kv_bytes if isinstance(kv_bytes, int) else None,
            retries=retries,
        )

    # ----------------------------------------------------------------------------------------
    # Cleanup
    # ----------------------------------------------------------------------------------------

    async def _finish(self, attempt: _Attempt, *, abort: bool, wait_for_abort: bool = True) -> None:
        """Close the attempt's decode stream, abort it on both workers if asked, free its slot.

        With `wait_for_abort` the abort posts are awaited (each bounded by `abort_timeout_s`), so
        a cancelled request has told both workers before its handler ends; otherwise they run in
        the background.
        """
        try:
            if attempt.reader is not None:
                attempt.reader.close()
                attempt.reader = None
            if attempt.response is not None:
                response, attempt.response = attempt.response, None
                if abort:
                    # Closing an unfinished stream drops the connection: the decode worker sees the
                    # disconnect and frees the request even if the abort below gets lost.
                    response.close()
                else:
                    response.release()  # read to the end: the connection goes back to the pool
            urls = [] if attempt.decode_untouched else [attempt.decode.url]
            if attempt.prefill is not None:
                urls.append(attempt.prefill.url)
            if abort and urls:
                task = self._spawn(self.abort(urls, attempt.request_id))
                if wait_for_abort:
                    # Shielded: a second cancellation must not cut the abort short; it goes on alone.
                    await asyncio.shield(task)
        finally:
            if attempt.holds_decode_slot:
                attempt.holds_decode_slot = False
                self.admission.release(attempt.decode)

    def _spawn(self, work: Any) -> asyncio.Future[None]:
        """Run `work` (a coroutine, or a task already running) in the background, referenced until it
        ends; an error it ends with is logged, since nobody awaits it."""
        task: asyncio.Future[None] = asyncio.ensure_future(work)
        self._background.add(task)

        def done(t: asyncio.Future[None]) -> None:
            self._background.discard(t)
            if not t.cancelled() and (exc := t.exception()) is not None:
                logger.info("background router call failed: %s", exc)

        task.add_done_callback(done)
        return task
