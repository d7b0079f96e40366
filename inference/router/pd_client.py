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
lease on the reserved blocks runs out (the prefill stalled) ends the wait at once; a lost lease is
retried with a fresh reservation. After the first token a failure ends the stream with an error
event (generation is not migrated). Every wait is bounded.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from inference.router.endpoint import Endpoint
from inference.router.errors import RouterError
from inference.router.pool import WorkerPool, describe_exception

logger = logging.getLogger(__name__)

# How much of a worker's error body is quoted back to the client.
_MAX_ERROR_TEXT = 500


def new_request_id() -> str:
    """A fresh public request id."""
    return f"req-{uuid.uuid4().hex}"


@dataclass
class GenerateRequest:
    """One generation: the prompt (text, chat messages or token ids) and the sampling parameters.

    `sampling` is sent to the workers as is (the `SamplingParams.to_dict()` shape); the decode
    worker validates it and answers 400 on bad values, which the router passes through.
    """

    sampling: dict[str, Any]
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None
    request_id: str = field(default_factory=new_request_id)

    def decode_body(self, request_id: str) -> dict[str, Any]:
        """The JSON body of `POST /internal/decode`."""
        body: dict[str, Any] = {"request_id": request_id, "sampling": self.sampling}
        if self.input_ids is not None:
            body["input_ids"] = self.input_ids
        elif self.messages is not None:
            body["messages"] = self.messages
        else:
            body["prompt"] = self.prompt
        return body


@dataclass
class TokenEvent:
    """New output: the text delta and the token ids it came from."""

    text: str
    token_ids: list[int]
    type: Literal["token"] = "token"


@dataclass
class DoneEvent:
    """The request finished: why, token counts, timings, and which workers served it."""

    request_id: str
    finish_reason: str
    usage: dict[str, int]
    timings: dict[str, float | None]
    prefill: str
    decode: str
    kv_bytes: int | None = None
    retries: int = 0
    type: Literal["done"] = "done"


@dataclass
class ErrorEvent:
    """The stream broke after the first token; `status` is what a fresh request would have got."""

    message: str
    status: int = 502
    type: Literal["error"] = "error"


Event = TokenEvent | DoneEvent | ErrorEvent


class _BackendFailure(Exception):
    """A worker failed in a way that says nothing about the request: try another worker."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _Busy(Exception):
    """A worker answered 429: it is alive but full, so another one may take the request."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _LeaseExpired(Exception):
    """The decode worker's lease on the reserved blocks ran out before the KV arrived.

    The decode worker is fine (it freed the blocks as specified); the request needs a fresh
    reservation. `stalled` is the prefill worker that held the request when the lease ran out,
    if any: it did not deliver in time and is not tried again for this request.
    """

    def __init__(self, message: str, stalled: Endpoint | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.stalled = stalled


@dataclass(eq=False)
class _Attempt:
    """One decode worker's try at a request, with everything that must be closed or aborted."""

    request_id: str
    decode: Endpoint
    response: httpx.Response | None = None
    lines: AsyncIterator[str] | None = None
    prompt_tokens: int = 0
    prefill: Endpoint | None = None
    prefill_result: dict[str, Any] = field(default_factory=dict)
    holds_decode_slot: bool = False
    # True when the decode worker certainly holds nothing for this request (it could not be
    # reached, or it refused the request with an error status): no abort is sent to it.
    decode_untouched: bool = False


def _error_message(raw: bytes) -> tuple[str, str | None]:
    """The message and `type` of a worker's error body (`{"error": {...}}` or plain text)."""
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        body = json.loads(text)
    except ValueError:
        return (text[:_MAX_ERROR_TEXT] or "(empty body)"), None
    if isinstance(body, dict):
        error = body.get("error", body.get("detail"))
        if isinstance(error, dict) and "message" in error:
            kind = error.get("type")
            return str(error["message"])[:_MAX_ERROR_TEXT], kind if isinstance(kind, str) else None
        if isinstance(error, str):
            return error[:_MAX_ERROR_TEXT], None
    return text[:_MAX_ERROR_TEXT], None


def _raise_for_status(status: int, raw: bytes, role: str) -> None:
    """Classify a non-200 answer: passthrough (RouterError), busy (429), lost lease or worker failure."""
    message, kind = _error_message(raw)
    if status == 429:
        raise _Busy(message)
    if role == "prefill" and status == 409 and kind == "lease_expired":
        # Nobody's fault here (a previous prefill worker took the time): reserve again.
        raise _LeaseExpired(message)
    # The decode worker validates the request (prompt length, sampling values): its 4xx is the
    # client's error, except 401/403, which say the router's shared secret is wrong. A prefill
    # worker sees an already validated request, so only its 400 is the request's fault;
    # 401/404/409... mean that one worker is misconfigured.
    client_error = status == 400 or (role == "decode" and 400 <= status < 500 and status not in (401, 403))
    if client_error:
        raise RouterError(status, message, error_type=kind)
    raise _BackendFailure(f"HTTP {status}: {message}")


async def _read_json_line(lines: AsyncIterator[str]) -> dict[str, Any] | None:
    """The next JSON object of an NDJSON stream (blank lines skipped), None at its end."""
    while True:  # bounded by the caller's timeout
        try:
            line = await anext(lines)
        except StopAsyncIteration:
            return None
        if line.strip():
            break
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {line[:100]!r}")
    return obj


def _token_ids(line: dict[str, Any]) -> list[int]:
    ids = line.get("token_ids")
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
    `abort_timeout_s` for each best-effort abort.

    `max_inflight` (None: unlimited) caps the generations this client runs at once; one more is
    refused at once with 429 (the view adds Retry-After) instead of queueing without bound.
    """

    def __init__(
        self,
        pool: WorkerPool,
        *,
        request_timeout_s: float = 300.0,
        connect_timeout_s: float = 3.0,
        descriptor_timeout_s: float = 30.0,
        stall_timeout_s: float = 60.0,
        abort_timeout_s: float = 2.0,
        max_inflight: int | None = None,
    ) -> None:
        if max_inflight is not None and max_inflight < 1:
            raise ValueError("max_inflight must be >= 1 (or None for no limit)")
        self.pool = pool
        self.max_inflight = max_inflight
        self.inflight = 0
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.descriptor_timeout_s = descriptor_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.abort_timeout_s = abort_timeout_s
        # Abort posts that outlive a cancelled request; kept referenced so they are not collected.
        self._background: set[asyncio.Future[None]] = set()

    # ----------------------------------------------------------------------------------------
    # Public
    # ----------------------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[Event, None]:
        """Run `req` and yield TokenEvents, then one DoneEvent (or an ErrorEvent after a failure).

        Raises RouterError before the first event: 4xx from the decode worker (passed through),
        429 when every worker that answered was full, 502 when no worker could serve it (with
        `backends` naming each one tried), 503 when no endpoints are configured, 504 when the
        request timeout passed first, 429 when `max_inflight` generations already run. Closing or
        cancelling the generator closes the decode stream and posts `/internal/abort` to both
        workers.
        """
        if self.max_inflight is not None and self.inflight >= self.max_inflight:
            raise RouterError(
                429,
                f"router is at its limit of {self.max_inflight} requests in flight "
                "(ROUTER_MAX_INFLIGHT); retry later",
            )
        # One event loop per process: the check above and this increment cannot interleave.
        self.inflight += 1
        try:
            # aclosing: closing this generator must run the inner one's cleanup (the aborts) now.
            async with contextlib.aclosing(self._generate(req)) as events:
                async for event in events:
                    yield event
        finally:
            self.inflight -= 1

    async def _generate(self, req: GenerateRequest) -> AsyncGenerator[Event, None]:
        start = time.monotonic()
        deadline = start + self.request_timeout_s
        attempt, line, first_at, retries = await self._establish(req, deadline)
        finished = False
        completion_tokens = 0
        try:
            while True:  # bounded: every read below has a timeout and the request a deadline
                kind = line.get("type")
                if kind == "token":
                    ids = _token_ids(line)
                    completion_tokens += len(ids)
                    yield TokenEvent(text=str(line.get("text") or ""), token_ids=ids)
                elif kind == "done":
                    finished = True
                    yield self._done_event(req, attempt, line, start, first_at, completion_tokens, retries)
                    return
                elif kind == "error":
                    yield ErrorEvent(f"decode worker {attempt.decode.url} failed: {line.get('message')}")
                    return
                # Other line types are skipped: newer workers may add some.
                next_line, error = await self._next_line(attempt, deadline)
                if error is not None:
                    yield error
                    return
                assert next_line is not None
                line = next_line
        finally:
            await self._finish(attempt, abort=not finished)

    async def abort(self, urls: list[str], request_id: str) -> None:
        """Post `/internal/abort` for `request_id` to each URL; best effort, bounded, never raises."""

        async def post(url: str) -> None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.abort_timeout_s):
                    await self.pool.http_client().post(
                        f"{url}/internal/abort",
                        json={"request_id": request_id},
                        timeout=httpx.Timeout(self.abort_timeout_s),
                    )

        await asyncio.gather(*(post(url) for url in urls))

    # ----------------------------------------------------------------------------------------
    # Before the first token: choose, open, prefill, retry
    # ----------------------------------------------------------------------------------------

    async def _establish(
        self, req: GenerateRequest, deadline: float
    ) -> tuple[_Attempt, dict[str, Any], float, int]:
        """Open a decode stream, get its prompt prefilled and read the first output line.

        Returns the attempt (holding the open stream and a decode in-flight slot), the first
        token (or done) line, when it arrived, and how many attempts failed before.
        """
        pool = self.pool
        for role in ("decode", "prefill"):
            if not pool.endpoints(role):
                raise RouterError(503, f"no {role} endpoints configured")
        failures: list[dict[str, Any]] = []
        busy: list[dict[str, Any]] = []
        tried_decode: list[Endpoint] = []
        failed_prefill: list[Endpoint] = []
        # Bounded by the range: a failed pass normally excludes a decode endpoint (it failed or is
        # busy) or a prefill endpoint (it stalled until the lease ran out), so one pass per
        # endpoint of either role is enough; a lost lease keeps the decode worker a candidate.
        for attempt_no in range(len(pool.endpoints("decode")) + len(pool.endpoints("prefill"))):
            decode = pool.choose("decode", exclude=tried_decode)
            if decode is None:
                break
            if not pool.candidates("prefill", exclude=failed_prefill):
                break  # every prefill worker failed this request: no point in reserving again
            if time.monotonic() >= deadline:
                raise RouterError(
                    504, f"no first token within {self.request_timeout_s:g}s", backends=failures
                )
            request_id = req.request_id if attempt_no == 0 else f"{req.request_id}-r{attempt_no}"
            attempt = _Attempt(request_id=request_id, decode=decode)
            decode.acquire()
            attempt.holds_decode_slot = True
            try:
                descriptor_line = await self._open_decode(attempt, req, deadline)
                pool.record_success(decode)
                line = await self._prefill_and_first_output(
                    attempt, req, descriptor_line, deadline, failed_prefill, failures, busy
                )
                return attempt, line, time.monotonic(), attempt_no
            except _LeaseExpired as exc:
                # The decode worker freed the blocks itself; it stays a candidate for the retry.
                stalled = exc.stalled
                logger.warning("lease of %s on decode %s lost: %s", request_id, decode.url, exc.message)
                if stalled is not None:
                    pool.record_failure(stalled, exc.message)
                    failed_prefill.append(stalled)
                    failures.append({"url": stalled.url, "role": "prefill", "error": exc.message})
                else:
                    failures.append({"url": decode.url, "role": "decode", "error": exc.message})
                await self._finish(attempt, abort=True, wait_for_abort=False)
            except _BackendFailure as exc:
                tried_decode.append(decode)
                logger.warning("decode %s failed for %s: %s", decode.url, request_id, exc.message)
                pool.record_failure(decode, exc.message)
                failures.append({"url": decode.url, "role": "decode", "error": exc.message})
                # The next worker should not wait for a possibly dead one's abort.
                await self._finish(attempt, abort=True, wait_for_abort=False)
            except _Busy as exc:
                tried_decode.append(decode)
                busy.append({"url": decode.url, "role": "decode", "error": f"busy: {exc.message}"})
                await self._finish(attempt, abort=True, wait_for_abort=False)
            except BaseException:
                # RouterError (passthrough, prefill exhausted) or cancellation: clean up, re-raise.
                await self._finish(attempt, abort=True)
                raise
        raise self._exhausted(failures, busy)

    def _exhausted(self, failures: list[dict[str, Any]], busy: list[dict[str, Any]]) -> RouterError:
        """The error when no worker of a role could take the request."""
        if busy:
            names = ", ".join(f"{b['role']} {b['url']}" for b in busy)
            return RouterError(429, f"all workers that answered are busy: {names}", backends=busy + failures)
        if not failures:
            return RouterError(503, "no backend available")
        names = "; ".join(f"{f['role']} {f['url']} ({f['error']})" for f in failures)
        return RouterError(502, f"no backend reachable: {names}", backends=failures)

    def _remaining(self, deadline: float, bound: float | None = None) -> float:
        remaining = max(0.0, deadline - time.monotonic())
        return remaining if bound is None else min(bound, remaining)

    async def _open_decode(self, attempt: _Attempt, req: GenerateRequest, deadline: float) -> dict[str, Any]:
        """POST /internal/decode and read its descriptor line."""
        client = self.pool.http_client()
        url = f"{attempt.decode.url}/internal/decode"
        wait = self._remaining(deadline, self.descriptor_timeout_s)
        request = client.build_request(
            "POST",
            url,
            json=req.decode_body(attempt.request_id),
            # The read timeout is a backstop for each network read; the asyncio timeouts below and
            # in the streaming loop are the real bounds.
            timeout=httpx.Timeout(self.request_timeout_s, connect=self.connect_timeout_s),
        )
        try:
            async with asyncio.timeout(wait):
                response = await client.send(request, stream=True)
                attempt.response = response
                if response.status_code != 200:
                    attempt.decode_untouched = True
                    _raise_for_status(response.status_code, await response.aread(), "decode")
                attempt.lines = response.aiter_lines()
                line = await _read_json_line(attempt.lines)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            attempt.decode_untouched = True
            raise _BackendFailure(describe_exception(exc)) from exc
        except TimeoutError:
            raise _BackendFailure(f"no descriptor within {wait:.1f}s") from None
        except httpx.HTTPError as exc:
            raise _BackendFailure(describe_exception(exc)) from exc
        except ValueError as exc:
            raise _BackendFailure(f"bad descriptor line: {exc}") from exc
        if line is None:
            raise _BackendFailure("closed the stream before sending a descriptor")
        if line.get("type") == "error":
            raise _BackendFailure(f"error before the descriptor: {line.get('message')}")
        if line.get("type") != "descriptor" or not isinstance(line.get("descriptor"), dict):
            raise _BackendFailure(f"expected a descriptor line, got {str(line)[:200]}")
        ids = line.get("prompt_token_ids")
        if not isinstance(ids, list):
            raise _BackendFailure("descriptor line has no prompt_token_ids list")
        attempt.prompt_tokens = len(ids)
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
        early: a decode worker that dies (stream broken: `_BackendFailure`) or whose lease ran out
        because the prefill stalled (error line `reason: kv_timeout`: `_LeaseExpired` naming the
        prefill worker in flight) makes the prefill pointless, and waiting for a stalled prefill
        would otherwise last until the request timeout. Both tasks are gone when this returns.
        """
        reader = asyncio.ensure_future(self._first_output(attempt, deadline))
        prefiller = asyncio.ensure_future(
            self._prefill(attempt, req, descriptor_line, deadline, failed_prefill, failures, busy)
        )
        try:
            done, _pending = await asyncio.wait(
                {reader, prefiller}, timeout=self._remaining(deadline), return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                raise RouterError(504, f"no first token within {self.request_timeout_s:g}s", backends=failures)
            if prefiller in done:
                prefiller.result()  # RouterError (no prefill worker left, 400) or _LeaseExpired
                # The KV is acknowledged: the first token follows unless the decode worker stalls.
                wait = self._remaining(deadline, self.stall_timeout_s)
                try:
                    return await asyncio.wait_for(reader, timeout=wait)
                except TimeoutError:
                    raise _BackendFailure(f"no first token within {wait:.1f}s after the prefill") from None
            try:
                line = reader.result()
            except _LeaseExpired as exc:
                exc.stalled = attempt.prefill  # the worker that held the prefill did not deliver
                raise
            # The first token came before the prefill answer (the KV is in place, the answer is on
            # its way): give it a moment for its timings, but never fail the request over it.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(prefiller), timeout=self._remaining(deadline, 1.0))
            return line
        finally:
            for task in (reader, prefiller):
                task.cancel()
            # Bounded: both tasks only await network calls, which end promptly when cancelled.
            await asyncio.gather(reader, prefiller, return_exceptions=True)

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
        body = {
            "request_id": attempt.request_id,
            "prompt_token_ids": descriptor_line["prompt_token_ids"],
            "sampling": req.sampling,
            "descriptor": descriptor_line["descriptor"],  # reused as is by every retry
        }
        tried: list[Endpoint] = list(failed_prefill)
        for _ in range(len(pool.endpoints("prefill"))):  # each prefill endpoint at most once
            prefill = pool.choose("prefill", exclude=tried)
            if prefill is None:
                break
            if time.monotonic() >= deadline:
                raise RouterError(
                    504, f"no first token within {self.request_timeout_s:g}s", backends=failures
                )
            tried.append(prefill)
            attempt.prefill = prefill
            prefill.acquire()
            try:
                attempt.prefill_result = await self._post_prefill(prefill, body, deadline)
            except _BackendFailure as exc:
                logger.warning("prefill %s failed for %s: %s", prefill.url, attempt.request_id, exc.message)
                pool.record_failure(prefill, exc.message)
                failed_prefill.append(prefill)
                failures.append({"url": prefill.url, "role": "prefill", "error": exc.message})
                # A prefill that timed out may still be working: tell it to stop, in the background.
                self._spawn(self.abort([prefill.url], attempt.request_id))
                attempt.prefill = None
                continue
            except _Busy as exc:
                busy.append({"url": prefill.url, "role": "prefill", "error": f"busy: {exc.message}"})
                attempt.prefill = None
                continue
            except _LeaseExpired:
                # Not this worker's fault (it answered; an earlier one took the lease's time).
                pool.record_success(prefill)
                raise
            finally:
                prefill.release()
            pool.record_success(prefill)
            return
        raise self._exhausted(failures, busy)

    async def _post_prefill(self, prefill: Endpoint, body: dict[str, Any], deadline: float) -> dict[str, Any]:
        """POST /internal/prefill; the answer comes once the decode worker acknowledged the KV."""
        wait = self._remaining(deadline)
        try:
            async with asyncio.timeout(wait):
                response = await self.pool.http_client().post(
                    f"{prefill.url}/internal/prefill",
                    json=body,
                    timeout=httpx.Timeout(max(wait, 0.001), connect=self.connect_timeout_s),
                )
        except TimeoutError:
            raise _BackendFailure(f"no prefill answer within {wait:.1f}s") from None
        except httpx.HTTPError as exc:
            raise _BackendFailure(describe_exception(exc)) from exc
        if response.status_code != 200:
            _raise_for_status(response.status_code, response.content, "prefill")
        try:
            result = response.json()
        except ValueError:
            result = None
        if not isinstance(result, dict):
            raise _BackendFailure("prefill answer is not a JSON object")
        return result

    async def _first_output(self, attempt: _Attempt, deadline: float) -> dict[str, Any]:
        """The decode stream's first token (or done) line; read while the prefill runs.

        Bounded by the request deadline only: the decode worker's own lease ends a wait for KV
        that never comes, and `_prefill_and_first_output` applies the stall timeout once the
        prefill answered.
        """
        assert attempt.lines is not None
        wait = self._remaining(deadline)
        try:
            async with asyncio.timeout(wait):
                while True:  # bounded by the timeout
                    line = await _read_json_line(attempt.lines)
                    if line is None:
                        raise _BackendFailure("decode stream ended before the first token")
                    kind = line.get("type")
                    if kind in ("token", "done"):
                        return line
                    if kind == "error":
                        if line.get("reason") == "kv_timeout":
                            raise _LeaseExpired(f"no KV within the decode worker's lease: {line.get('message')}")
                        raise _BackendFailure(f"error before the first token: {line.get('message')}")
        except TimeoutError:
            raise _BackendFailure(f"no first token within {wait:.1f}s") from None
        except httpx.HTTPError as exc:
            raise _BackendFailure(describe_exception(exc)) from exc
        except ValueError as exc:
            raise _BackendFailure(f"bad line on the decode stream: {exc}") from exc

    # ----------------------------------------------------------------------------------------
    # After the first token
    # ----------------------------------------------------------------------------------------

    async def _next_line(
        self, attempt: _Attempt, deadline: float
    ) -> tuple[dict[str, Any] | None, ErrorEvent | None]:
        """The next decode line, or the ErrorEvent that ends the stream."""
        assert attempt.lines is not None
        decode = attempt.decode
        remaining = self._remaining(deadline)
        wait = min(self.stall_timeout_s, remaining)
        try:
            async with asyncio.timeout(wait):
                line = await _read_json_line(attempt.lines)
        except TimeoutError:
            if wait >= remaining:
                return None, ErrorEvent(f"request exceeded {self.request_timeout_s:g}s", status=504)
            self.pool.record_failure(decode, f"stream stalled for {wait:.1f}s")
            return None, ErrorEvent(f"decode worker {decode.url} sent nothing for {wait:.1f}s", status=504)
        except httpx.HTTPError as exc:
            self.pool.record_failure(decode, describe_exception(exc))
            return None, ErrorEvent(f"decode worker {decode.url} failed: {describe_exception(exc)}")
        except ValueError as exc:
            return None, ErrorEvent(f"decode worker {decode.url} sent a bad line: {exc}")
        if line is None:
            self.pool.record_failure(decode, "stream ended before done")
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
        kv_bytes = result.get("kv_bytes")
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
                "kv_transfer_s": _float_or_none(result.get("transfer_s")),
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
            if attempt.lines is not None:
                closer = getattr(attempt.lines, "aclose", None)
                attempt.lines = None
                if closer is not None:
                    with contextlib.suppress(Exception):
                        async with asyncio.timeout(self.abort_timeout_s):
                            await closer()
            if attempt.response is not None:
                response, attempt.response = attempt.response, None
                # Closing an unfinished stream drops the connection: the decode worker sees the
                # disconnect and frees the request even if the abort below gets lost.
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(self.abort_timeout_s):
                        await response.aclose()
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
                attempt.decode.release()

    def _spawn(self, coro: Any) -> asyncio.Future[None]:
        task: asyncio.Future[None] = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task
