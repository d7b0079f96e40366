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

This module keeps what outlives a request (configuration, the worker pool, admission, metrics,
background aborts); one request's state and steps are a `RequestRun` (run.py: relay, migrate) and
its `Establishment` (establish.py: admit, open the decode stream, prefill, first token).

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
from typing import Any

import aiohttp
import orjson

from inference.router.admission import Admission
from inference.router.attempt import Attempt
from inference.router.endpoint import Endpoint
from inference.router.errors import RouterError
from inference.router.events import DoneEvent, ErrorEvent, Event, GenerateRequest, TokenEvent, new_request_id
from inference.router.kv_index import set_prompt
from inference.router.metrics import RouterMetrics
from inference.router.pool import WorkerPool
from inference.router.run import RequestRun

logger = logging.getLogger(__name__)

# The local prefill offer of a pool without prefill workers: more tokens than any prompt has.
EVERY_PROMPT = 2**31 - 1

__all__ = [
    "DisaggregatedClient",
    "DoneEvent",
    "ErrorEvent",
    "Event",
    "GenerateRequest",
    "TokenEvent",
    "new_request_id",
]


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
        local_prefill_tokens: int = 0,
    ) -> None:
        if max_inflight is not None and max_inflight < 1:
            raise ValueError("max_inflight must be >= 1 (or None for no limit)")
        if stream_credit < 0 or stream_credit == 1:
            raise ValueError("stream_credit must be 0 (off) or at least 2")
        self.pool = pool
        self.admission = admission or Admission(pool)
        self.metrics = metrics or RouterMetrics()
        self.admission.metrics = self.metrics
        self.max_inflight = max_inflight
        self.max_migrations = max_migrations
        self.stream_credit = stream_credit
        if local_prefill_tokens < 0:
            raise ValueError("local_prefill_tokens must be >= 0")
        # Per-request disaggregation: a decode worker that would have at most this many prompt tokens
        # left to compute (its prefix cache holds the rest) prefills the prompt itself; 0: always remote.
        self.local_prefill_tokens = local_prefill_tokens
        pool.default_local_prefill_tokens = local_prefill_tokens  # the decode choice weighs cached tokens by it
        # Acknowledge every half credit: a router that keeps up never stalls a stream.
        self.ack_every = max(1, stream_credit // 2)
        self.inflight = 0
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.descriptor_timeout_s = descriptor_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.abort_timeout_s = abort_timeout_s
        # Abort posts that outlive a cancelled request; kept referenced so they are not collected.
        self._background: set[asyncio.Future[None]] = set()
        self.metrics.bind_gauges(lambda: self.inflight, lambda: self.admission.queued, self.admission.capacity)
        self.metrics.bind_kv(pool.kv_counts, ("prefill", "decode"))

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
        # The caller's task runs the request: its decode choice sees the prompt (a kv-aware policy),
        # tokenized here when the client sent text or chat (and the router has the workers' tokenizer).
        # A text prompt is tokenized only as far as some decode worker holds its blocks (text_prefix.py).
        if req.input_ids is None and req.token_ids is None and (tokenizer := self.pool.prompt_tokenizer()):
            watch = self.pool.kv_index.prefix_watch(self.pool.in_rotation("decode"))
            set_prompt(req, tokenizer.request_prompt(req, watch))
        else:
            set_prompt(req)
        # The stream is the run's own generator, not one around it: every token event passes one
        # generator fewer (measured per streamed token).
        return RequestRun(self, req, arrived if arrived is not None else time.monotonic()).events()

    def take_inflight(self) -> None:
        """Count one more generation in flight; 429 when `max_inflight` are already."""
        if self.max_inflight is not None and self.inflight >= self.max_inflight:
            self.metrics.rejected.labels("inflight").inc()
            raise RouterError(
                429,
                f"router is at its limit of {self.max_inflight} requests in flight "
                "(ROUTER_MAX_INFLIGHT); retry later",
            )
        if not self.pool.endpoints("prefill") and not self.pool.colocated:
            raise RouterError(503, "no prefill or decode endpoints configured")
        # One event loop per process: the check above and this increment cannot interleave.
        self.inflight += 1

    def encode_decode_body(self, req: GenerateRequest, request_id: str) -> bytes:
        """The JSON body of `POST /internal/decode` for one attempt at `req`."""
        body = req.decode_body(request_id)
        if self.pool.colocated:
            # No prefill pool: the decode worker prefills every prompt (`both` workers do anyway).
            body["local_prefill_max_tokens"] = EVERY_PROMPT
        else:
            limit = self.pool.local_prefill_tokens  # a managed router: its deployment's setting
            limit = self.local_prefill_tokens if limit is None else limit
            if limit:
                body["local_prefill_max_tokens"] = limit
                # Over the threshold, the decode worker still prefills the prompt itself when the
                # prefill pool's queue would make the remote path slower (local_prefill.py).
                queue = self.pool.remote_prefill_queue()
                if queue is not None:
                    body["remote_prefill"] = queue
        return orjson.dumps(body)

    def deciding_tokens(self, req: GenerateRequest) -> int:
        """The prompt tokens `req` may add to the prefill pool's queue once its decode worker, offered
        local prefill, decides (0: not offered, or the prompt's length not known here)."""
        ids = req.prompt_ids
        if ids is None or self.pool.colocated:
            return 0
        limit = self.pool.local_prefill_tokens
        limit = self.local_prefill_tokens if limit is None else limit
        return len(ids) if limit else 0

    def remaining(self, deadline: float, bound: float | None = None) -> float:
        """Seconds left until `deadline` (at most `bound`), never negative."""
        remaining = max(0.0, deadline - time.monotonic())
        return remaining if bound is None else min(bound, remaining)

    def record_failure(self, endpoint: Endpoint, message: str) -> None:
        """Count a worker's failure in the pool (rotation) and the metrics."""
        self.pool.record_failure(endpoint, message)
        self.metrics.failures.labels(endpoint.role, endpoint.url).inc()

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

    async def finish(self, attempt: Attempt, *, abort: bool, wait_for_abort: bool = True) -> None:
        """Close the attempt's decode stream, abort it on both workers if asked, free its slot.

        With `wait_for_abort` the abort posts are awaited (each bounded by `abort_timeout_s`), so
        a cancelled request has told both workers before its handler ends; otherwise they run in
        the background.
        """
        try:
            if attempt.stream is not None:
                attempt.stream.close()
                attempt.stream = None
            if attempt.response is not None:
                response, attempt.response = attempt.response, None
                if abort:
                    # Closing an unfinished stream drops the connection: the decode worker sees the
                    # disconnect and frees the request even if the abort below gets lost.
                    response.close()
                else:
                    response.release()  # read to the end: the connection goes back to the pool
            urls = attempt.abort_urls()
            if abort and urls:
                task = self.spawn(self.abort(urls, attempt.request_id))
                if wait_for_abort:
                    # Shielded: a second cancellation must not cut the abort short; it goes on alone.
                    await asyncio.shield(task)
        finally:
            if attempt.holds_decode_slot:
                attempt.holds_decode_slot = False
                self.admission.release(attempt.decode)

    def spawn(self, work: Any) -> asyncio.Future[None]:
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
