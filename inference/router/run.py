"""One request's run through the disaggregated path, from its first token to its last event.

`RequestRun` holds what a request accumulates: its deadline, the decode workers that failed it
(a migrated stream never goes back to them), every token forwarded to the client, the migrations.
Its steps: `establish` (establish.py: admit, open the decode stream, prefill, first token),
`relay` (token lines to client events, credit to the worker), `migrate` (a decode worker that fails
after the first token hands the stream to another one, given prompt + tokens so far as its prompt,
at most `max_migrations` times), and the done event.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from inference.router.attempt import Attempt
from inference.router.endpoint import Endpoint
from inference.router.errors import RouterError
from inference.router.establish import Establishment
from inference.router.events import DoneEvent, ErrorEvent, Event, GenerateRequest, TokenEvent
from inference.router.failures import TRANSPORT_ERRORS
from inference.router.health import describe_exception
from inference.router.migration import resumed_request
from inference.wire import delivery_trace
from inference.wire.logprobs import Logprob
from inference.wire.stream import DecodeLine, DoneLine, ErrorLine, TokenLine

if TYPE_CHECKING:
    from inference.router.pd_client import DisaggregatedClient

logger = logging.getLogger(__name__)

# How long a finished stream waits for a prefill answer still on its way (for the done event's timings).
PREFILL_ANSWER_WAIT_S = 1.0


class RequestRun:
    """One request's state across its attempts: deadline, failed decode workers, tokens, migrations."""

    def __init__(self, client: DisaggregatedClient, req: GenerateRequest, arrived: float) -> None:
        self.client = client
        self.req = req
        self.arrived = arrived
        self.deadline = arrived + client.request_timeout_s
        self.failed_decode: list[Endpoint] = []
        self.emitted: list[int] = []  # every token id forwarded to the client, across migrations
        self.prompt_ids: list[int] = []  # the client's prompt, as the first decode worker tokenized it
        self.migrations = 0
        self.retries = 0  # attempts that failed before the first token
        self.first_at = arrived
        self.last_at = arrived
        # Log-probabilities asked for: each token's (the first token of every attempt is the prefill
        # worker's, from its answer), and the prompt's once (echo), from the first attempt's answer.
        sampling = req.sampling
        self.wants_logprobs = sampling.logprobs is not None
        self.prompt_logprobs_due = sampling.prompt_logprobs is not None

    async def establish(self) -> tuple[Attempt, TokenLine | DoneLine]:
        """The first attempt that produced a first token (or done) line."""
        establishment = Establishment(self.client, self.req, self.arrived, self.deadline)
        attempt, line = await establishment.run()
        if self.req.pin is not None:
            self.req.pin.record(attempt)  # choice 0 of n > 1: where the other choices go (pin.py)
        self.first_at = self.last_at = time.monotonic()
        self.retries = establishment.attempts - 1
        self.prompt_ids = list(attempt.prompt_ids)
        await self.answer_in(attempt)
        metrics = self.client.metrics
        metrics.ttft.observe(self.first_at - self.arrived)
        if self.retries:
            metrics.retries.inc(self.retries)
        return attempt, line

    async def events(self) -> AsyncGenerator[Event, None]:
        """TokenEvents, then one DoneEvent or ErrorEvent; the attempt in use is finished however it ends.

        The per-token loop: tokens that arrived in one read go out as one event, and the worker is
        credited once the client took them (the consumer asked for the next event).
        """
        client, metrics, emitted = self.client, self.client.metrics, self.emitted
        client.take_inflight()  # 429 past ROUTER_MAX_INFLIGHT
        line: DecodeLine
        try:
            attempt, line = await self.establish()
        except BaseException:
            client.inflight -= 1
            raise
        ack_every = client.ack_every
        trace = delivery_trace.TRACE  # DELIVERY_TRACE: each token line as it is taken (off by default)
        finished = False
        try:
            while True:  # bounded: every read has a timeout, the request a deadline, migrations a cap
                stream = attempt.stream
                assert stream is not None
                following: DecodeLine | None = None
                if type(line) is TokenLine:
                    ids, text = line.token_ids, line.text
                    positions = self.positions(attempt, line) if self.wants_logprobs else None
                    if trace is not None:
                        trace.mark("router_in", attempt.request_id, len(ids))
                    while (following := stream.ready()) is not None and type(following) is TokenLine:
                        if trace is not None:
                            trace.mark("router_in", attempt.request_id, len(following.token_ids))
                        ids = ids + following.token_ids
                        text += following.text
                        if positions is not None:
                            positions = positions + self.positions(attempt, following)
                    if ids:
                        now = time.monotonic()
                        if emitted:
                            metrics.itl.observe((now - self.last_at) / len(ids))
                        self.last_at = now
                        emitted.extend(ids)
                    if positions is None and not self.prompt_logprobs_due:
                        yield TokenEvent(text=text, token_ids=ids)
                    else:
                        yield TokenEvent(text=text, token_ids=ids, logprobs=positions,
                                         prompt_logprobs=self.take_prompt_logprobs(attempt))
                    attempt.relayed += len(ids)
                    response = attempt.response
                    if response is not None and attempt.relayed - response.acked >= ack_every:
                        response.ack(attempt.relayed)
                elif type(line) is DoneLine:
                    finished = True
                    yield await self.done_event(attempt, line)
                    return
                # Other line types are skipped: newer workers may add some.
                failure = self._error_of(attempt, line)
                if failure is None:
                    if following is not None:
                        line = following
                        continue
                    line, failure = await self.next_line(attempt)
                    if failure is None:
                        continue
                moved = await self.migrate(attempt, failure)
                if isinstance(moved, ErrorEvent):
                    yield moved
                    return
                attempt, line = moved
        finally:
            metrics.tokens.inc(len(emitted))  # once per request, not per token
            if trace is not None:  # gunicorn's router processes end by a signal, without atexit hooks
                trace.flush()
            try:
                await client.finish(attempt, abort=not finished)
            finally:
                client.inflight -= 1

    async def answer_in(self, attempt: Attempt) -> None:
        """With log-probabilities asked for, wait (bounded) for the attempt's prefill answer: the first
        token's (and the prompt's) come with it, and it may trail the first token by a moment."""
        if (self.wants_logprobs or self.prompt_logprobs_due) and attempt.pending_answer is not None:
            await asyncio.wait({attempt.pending_answer}, timeout=PREFILL_ANSWER_WAIT_S)

    @staticmethod
    def positions(attempt: Attempt, line: TokenLine) -> list[Logprob | None]:
        """One position per token of `line`: the decode worker's, and in front of them, for the
        attempt's first token (sampled by the prefill worker, which the decode worker never saw the
        logits of), the prefill answer's. None for a token no worker reported."""
        got: list[Logprob | None] = list(line.logprobs or ())
        missing = len(line.token_ids) - len(got)
        if missing > 0 and not attempt.first_logprobs_taken:
            attempt.first_logprobs_taken = True
            got.insert(0, attempt.prefill_answer.first_logprobs)
            missing -= 1
        unknown: list[Logprob | None] = [None] * missing
        return unknown + got if missing > 0 else got

    def take_prompt_logprobs(self, attempt: Attempt) -> list[Logprob | None] | None:
        """The prompt's log-probabilities, on the stream's first event only."""
        if not self.prompt_logprobs_due:
            return None
        self.prompt_logprobs_due = False
        return attempt.prefill_answer.prompt_logprobs

    @staticmethod
    def _error_of(attempt: Attempt, line: DecodeLine) -> ErrorEvent | None:
        if type(line) is ErrorLine:
            return ErrorEvent(f"decode worker {attempt.decode.url} failed: {line.message}")
        return None

    async def next_line(self, attempt: Attempt) -> tuple[DecodeLine, ErrorEvent | None]:
        """The next decode line, or the ErrorEvent that ends (or moves) the stream."""
        stream = attempt.stream
        assert stream is not None
        line = stream.ready()
        if line is not None:  # already received: no timer to arm (the common case under load)
            return line, None
        client, decode = self.client, attempt.decode
        remaining = client.remaining(self.deadline)
        wait = min(client.stall_timeout_s, remaining)
        try:
            line = await stream.next_within(wait)
        except TimeoutError:
            if wait >= remaining:
                failure = ErrorEvent(f"request exceeded {client.request_timeout_s:g}s", status=504, migratable=False)
                return _NO_LINE, failure
            client.record_failure(decode, f"stream stalled for {wait:.1f}s")
            return _NO_LINE, ErrorEvent(f"decode worker {decode.url} sent nothing for {wait:.1f}s", status=504)
        except TRANSPORT_ERRORS as exc:  # a torn last line too (ndjson.TornLine): the worker died writing it
            client.record_failure(decode, describe_exception(exc))
            return _NO_LINE, ErrorEvent(f"decode worker {decode.url} failed: {describe_exception(exc)}")
        except ValueError as exc:
            client.record_failure(decode, f"bad line: {exc}")
            return _NO_LINE, ErrorEvent(f"decode worker {decode.url} sent a bad line: {exc}")
        if line is None:
            client.record_failure(decode, "stream ended before done")
            return _NO_LINE, ErrorEvent(f"decode worker {decode.url} closed the stream before finishing")
        return line, None

    async def migrate(self, attempt: Attempt, failure: ErrorEvent) -> tuple[Attempt, TokenLine | DoneLine] | ErrorEvent:
        """Continue the stream on another decode worker after `failure`: the new attempt and its first
        line, or the ErrorEvent that ends the stream (cap reached, deadline passed, nobody could take
        it). `attempt` is finished here (aborted on its workers, its slot released) when replaced."""
        client, emitted = self.client, self.emitted
        resumed = resumed_request(self.req, self.prompt_ids, emitted, self.migrations + 1)
        if not failure.migratable or self.migrations >= client.max_migrations or resumed is None:
            if failure.migratable and self.migrations >= client.max_migrations:
                failure.message += f" (after {self.migrations} migrations; ROUTER_MAX_MIGRATIONS)"
            return failure
        logger.warning("%s: %s; moving the stream to another decode worker (%d tokens so far)",
                       self.req.request_id, failure.message, len(emitted))
        self.failed_decode.append(attempt.decode)
        await client.finish(attempt, abort=True, wait_for_abort=False)
        try:
            moved = await Establishment(client, resumed, time.monotonic(), self.deadline,
                                        exclude_decode=self.failed_decode).run()
        except RouterError as exc:
            # The client learns what broke its stream; why it could not move is the detail.
            return ErrorEvent(f"{failure.message}; no other decode worker could take the stream: {exc.message}",
                              status=failure.status)
        client.metrics.migrations.inc()
        self.migrations += 1
        await self.answer_in(moved[0])
        return moved

    async def done_event(self, attempt: Attempt, line: DoneLine) -> DoneEvent:
        """The last event: usage as the client sees it, timings, the workers that served it."""
        pending = attempt.pending_answer
        if pending is not None and not pending.done():
            # Its timings belong in the done event; never held up for long.
            await asyncio.wait({pending}, timeout=PREFILL_ANSWER_WAIT_S)
        now = time.monotonic()
        self.client.metrics.e2e.observe(now - self.arrived)
        usage, answer = line.usage, attempt.prefill_answer
        prompt_tokens = _int_or(usage.get("prompt_tokens"), len(attempt.prompt_ids))
        completion = _int_or(usage.get("completion_tokens"), len(self.emitted))
        if self.migrations:
            # The last worker saw prompt + earlier tokens as its prompt: report the client's view.
            prompt_tokens, completion = len(self.prompt_ids), len(self.emitted)
        timings = line.timings
        usage_out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                                     "total_tokens": prompt_tokens + completion}
        cached = self._cached_tokens(attempt, usage)
        self.client.metrics.prompt_tokens.inc(prompt_tokens)
        if cached is not None:
            usage_out["prompt_tokens_details"] = {"cached_tokens": min(cached, prompt_tokens)}
            self.client.metrics.cached_prompt_tokens.inc(min(cached, prompt_tokens))
        # The decode worker counts the KV it received too (when the prefill answer is not in).
        kv_bytes = answer.kv_bytes if answer.kv_bytes is not None else timings.get("kv_bytes")
        return DoneEvent(
            request_id=self.req.request_id,
            finish_reason=line.finish_reason,
            usage=usage_out,
            timings={
                "ttft_s": round(self.first_at - self.arrived, 6),
                "e2e_s": round(now - self.arrived, 6),
                "prefill_s": answer.prefill_s,
                "kv_transfer_s": answer.transfer_s if answer.transfer_s is not None
                else _float_or_none(timings.get("kv_transfer_s")),
                "kv_wait_s": _float_or_none(timings.get("kv_wait_s")),
                "decode_s": _float_or_none(timings.get("decode_s")),
            },
            prefill=attempt.prefill.url if attempt.prefill else "",
            decode=attempt.decode.url,
            kv_bytes=kv_bytes if isinstance(kv_bytes, int) and not isinstance(kv_bytes, bool) else None,
            retries=self.retries,
            migrations=self.migrations,
        )

    def _cached_tokens(self, attempt: Attempt, usage: dict[str, Any]) -> int | None:
        """The prompt tokens that were not computed for this request (OpenAI's `cached_tokens`): the
        prefill worker's reuse when it prefilled remotely, else the decode worker's own; each worker's
        report is counted for its role. None when no worker reported one (an older worker)."""
        pool = self.client.pool
        held = usage.get("cached_tokens")
        held = held if isinstance(held, int) and not isinstance(held, bool) and held >= 0 else None
        if held is not None:
            pool.report_cached_tokens("decode", held)
        if attempt.prefill is None:
            return held
        reused = attempt.prefill_answer.cached_tokens
        if reused is not None:
            pool.report_cached_tokens("prefill", reused)
        return reused


# Stands for "no line" beside a failure (the loop reads the failure first).
_NO_LINE = ErrorLine("")


def _int_or(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _float_or_none(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
