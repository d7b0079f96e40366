"""Admission: how many requests each decode worker is given at once, and a queue for the rest.

A decode worker runs at most `--batch-size` sequences; more requests sent to it would only wait in
its queue holding KV blocks, or slow every stream by growing the batch. So the router admits to a
decode worker at most its batch size plus a little slack (enough to prefill the next requests while
the batch decodes) and keeps the rest in its own FIFO queue, where waiting costs nothing but a
future. A request that cannot be admitted within its queue deadline (`ROUTER_QUEUE_TIMEOUT_S`) gets
429 with Retry-After, as does one that finds the queue full (`max_queue`): overload is answered
fast, never by a timeout.

The capacity follows the deployment: each decode worker's batch size comes from its health answer
(`batch_size`), scale-outs add slots as their workers join the pool, and a worker that answered 429
(its KV pool is full) gets nothing new until one of its requests ends or a short back-off passes.

Per request, admission reads only what is already computed: each endpoint's slots (set when its
health answer arrives), the pool's kept list of decode endpoints in rotation, and the policy walks
that list with a test of the slot, the back-off and the request's tried workers instead of listing
the free ones first (policies.py `choose_where`).
"""
from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Collection

from inference.router.endpoint import Endpoint, slots_for
from inference.router.errors import RouterError
from inference.router.metrics import RouterMetrics
from inference.router.pool import WorkerPool

# Used when a worker's health answer does not report its batch size (older workers).
DEFAULT_BATCH_SIZE = 32
# How long a worker that answered 429 is passed over (unless one of its requests ends first).
FULL_BACKOFF_S = 0.25
# Waiters re-check at least this often: health changes and scale-outs add capacity without a release.
_RECHECK_S = 0.25


class Admission:
    """Decode slots of a pool, handed out first come, first served.

    Used from one event loop. `acquire` returns a decode endpoint with a slot taken (its `inflight`
    counts it); `release` gives the slot back and wakes the oldest waiter.
    """

    def __init__(
        self,
        pool: WorkerPool,
        *,
        queue_timeout_s: float = 30.0,
        max_queue: int = 1024,
        default_batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> None:
        if queue_timeout_s <= 0 or max_queue < 0:
            raise ValueError("queue_timeout_s must be > 0 and max_queue >= 0")
        self.pool = pool
        self.queue_timeout_s = queue_timeout_s
        self.max_queue = max_queue
        self.default_batch_size = default_batch_size  # also sets the default slots
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.rejected = 0  # 429s given by admission, for /router/status
        self.metrics: RouterMetrics | None = None  # set by the client that uses this admission

    def _reject(self, reason: str) -> None:
        self.rejected += 1
        if self.metrics is not None:
            self.metrics.rejected.labels(reason).inc()

    # ---------------------------------------------------------------------------------- capacity

    @property
    def default_batch_size(self) -> int:
        """The batch size assumed for a worker whose health answer reports none."""
        return self._default_batch_size

    @default_batch_size.setter
    def default_batch_size(self, value: int) -> None:
        if value < 1:
            raise ValueError("default_batch_size must be >= 1")
        self._default_batch_size = value
        self._default_slots = slots_for(value)

    def limit(self, endpoint: Endpoint) -> int:
        """Requests this router admits to `endpoint` at once."""
        return endpoint.slots or self._default_slots

    def capacity(self) -> int:
        """Slots of every decode endpoint in rotation (what the deployment can take right now)."""
        default = self._default_slots
        return sum(endpoint.slots or default for endpoint in self.pool.in_rotation("decode"))

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self._waiters)

    # ---------------------------------------------------------------------------------- slots

    async def acquire(self, deadline: float, exclude: Collection[Endpoint] = ()) -> Endpoint | None:
        """A decode endpoint with a slot taken for this request, waiting in FIFO order until `deadline`.

        Returns None when no decode endpoint is left to try (all in `exclude`). Raises RouterError
        429 when the queue is full or the deadline passes first, 503 when none is configured.
        """
        if not self.pool.endpoints("decode"):
            raise RouterError(503, "no decode endpoints configured")
        if not self._waiters:  # nobody queued: take a free slot now (no overtaking a queue)
            chosen = self._take(exclude)
            if chosen is not None or not self.pool.has_candidate("decode", exclude):
                return chosen
        if len(self._waiters) >= self.max_queue:
            self._reject("queue_full")
            raise RouterError(
                429,
                f"router queue is full ({self.max_queue} requests waiting for a decode slot; "
                "ROUTER_MAX_QUEUE); retry later",
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            while True:  # bounded by the deadline
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._reject("queue_timeout")
                    raise RouterError(
                        429,
                        f"no decode capacity within the {self.queue_timeout_s:g}s queue timeout "
                        f"({self.capacity()} slots busy, {len(self._waiters)} waiting; "
                        "ROUTER_QUEUE_TIMEOUT_S); retry later",
                    )
                if self._waiters[0] is waiter:
                    chosen = self._take(exclude)
                    if chosen is not None or not self.pool.has_candidate("decode", exclude):
                        return chosen
                try:
                    await asyncio.wait_for(asyncio.shield(waiter), timeout=min(remaining, _RECHECK_S))
                except TimeoutError:
                    pass
                if waiter.done():
                    waiter = self._renew(waiter)
        finally:
            self._forget(waiter)
            # A slot freed while this waiter was leaving belongs to the next one.
            self._wake_head()

    def release(self, endpoint: Endpoint) -> None:
        """Give `endpoint`'s slot back and let the oldest waiter try."""
        endpoint.release()
        self._wake_head()

    def mark_full(self, endpoint: Endpoint) -> None:
        """`endpoint` answered 429: pass it over for a moment (queue, do not hammer it)."""
        endpoint.full_until = time.monotonic() + FULL_BACKOFF_S

    # ---------------------------------------------------------------------------------- internals

    def _take(self, exclude: Collection[Endpoint]) -> Endpoint | None:
        """The policy's pick among the decode endpoints in rotation with a free slot, not backing off
        and not in `exclude`, its slot taken; None when there is none."""
        now = time.monotonic()
        default = self._default_slots
        if exclude:
            def free(e: Endpoint) -> bool:
                return e.inflight < (e.slots or default) and e.full_until <= now and e not in exclude
        else:
            def free(e: Endpoint) -> bool:
                return e.inflight < (e.slots or default) and e.full_until <= now
        chosen = self.pool.choose_where("decode", free)
        if chosen is not None:
            chosen.acquire()
        return chosen

    def _renew(self, waiter: asyncio.Future[None]) -> asyncio.Future[None]:
        """Replace a woken waiter with a fresh future in the same queue position."""
        fresh: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for i, queued in enumerate(self._waiters):
            if queued is waiter:
                self._waiters[i] = fresh
                break
        return fresh

    def _forget(self, waiter: asyncio.Future[None]) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass

    def _wake_head(self) -> None:
        if self._waiters and not self._waiters[0].done():
            self._waiters[0].set_result(None)
