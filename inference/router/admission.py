"""Admission: how many requests each decode worker is given at once, and a queue for the rest.

A decode worker runs at most `--batch-size` sequences; more requests sent to it would only wait in
its queue holding KV blocks, or slow every stream by growing the batch. So the router admits to a
decode worker at most its batch size plus a little slack (enough to prefill the next requests while
the batch decodes) and keeps the rest in its own queue, where waiting costs nothing but a future.
The queue serves priority classes in order and tenants (API keys) of a class in turn (fair_queue.py),
so one tenant's flood waits behind itself, not in front of everybody. A request that cannot be
admitted within its queue deadline (`ROUTER_QUEUE_TIMEOUT_S`) gets 429 with Retry-After, as does
one that finds the queue full (`max_queue`): overload is answered fast, never by a timeout.

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
import time
from collections.abc import Collection

from inference.router.endpoint import Endpoint, slots_for
from inference.router.errors import RouterError
from inference.router.fair_queue import FairQueue
from inference.router.metrics import RouterMetrics
from inference.router.pin import Pin
from inference.router.pool import WorkerPool

# Used when a worker's health answer does not report its batch size (older workers).
DEFAULT_BATCH_SIZE = 32
# How long a worker that answered 429 is passed over (unless one of its requests ends first).
FULL_BACKOFF_S = 0.25
# Waiters re-check at least this often: health changes and scale-outs add capacity without a release.
_RECHECK_S = 0.25


class _Waiter:
    """A queued request: its wake-up future (renewed after each wake), tenant and priority class."""

    __slots__ = ("future", "priority", "tenant")

    def __init__(self, future: asyncio.Future[None], tenant: str, priority: int) -> None:
        self.future = future
        self.tenant = tenant
        self.priority = priority


class Admission:
    """Decode slots of a pool, handed out by priority class, then in turn between tenants.

    Used from one event loop. `acquire` returns a decode endpoint with a slot taken (its `inflight`
    counts it); `release` gives the slot back and wakes the waiter whose turn it is.
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
        self._waiters: FairQueue[_Waiter] = FairQueue()
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

    async def acquire(
        self, deadline: float, exclude: Collection[Endpoint] = (), *, tenant: str = "", priority: int = 0,
        pin: Pin | None = None,
    ) -> Endpoint | None:
        """A decode endpoint with a slot taken for this request, waiting for its turn until `deadline`
        (by `priority` class, lower first, then in turn with the other tenants of the class). With a
        `pin` (a later choice of n > 1) its decode endpoint is taken when it can be, else the policy's.

        Returns None when no decode endpoint is left to try (all in `exclude`). Raises RouterError
        429 when the queue is full or the deadline passes first, 503 when none is configured.
        """
        if not self.pool.endpoints("decode"):
            raise RouterError(503, "no decode endpoints configured")
        if not self._waiters:  # nobody queued: take a free slot now (no overtaking a queue)
            chosen = self._take(exclude, pin)
            if chosen is not None or not self.pool.has_candidate("decode", exclude):
                return chosen
        if len(self._waiters) >= self.max_queue:
            self._reject("queue_full")
            raise RouterError(
                429,
                f"router queue is full ({self.max_queue} requests waiting for a decode slot; "
                "ROUTER_MAX_QUEUE); retry later",
            )
        waiter = _Waiter(asyncio.get_running_loop().create_future(), tenant, priority)
        self._waiters.push(waiter, tenant, priority)
        served = False
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
                if self._waiters.head() is waiter:
                    chosen = self._take(exclude, pin)
                    if chosen is not None or not self.pool.has_candidate("decode", exclude):
                        served = chosen is not None
                        return chosen
                try:
                    await asyncio.wait_for(asyncio.shield(waiter.future), timeout=min(remaining, _RECHECK_S))
                except TimeoutError:
                    pass
                if waiter.future.done():
                    waiter.future = asyncio.get_running_loop().create_future()
        finally:
            self._waiters.remove(waiter, waiter.tenant, waiter.priority, served=served)
            # A slot freed while this waiter was leaving belongs to the next one.
            self._wake_head()

    def release(self, endpoint: Endpoint) -> None:
        """Give `endpoint`'s slot back and let the waiter whose turn it is try."""
        endpoint.release()
        self._wake_head()

    def mark_full(self, endpoint: Endpoint) -> None:
        """`endpoint` answered 429: pass it over for a moment (queue, do not hammer it)."""
        endpoint.full_until = time.monotonic() + FULL_BACKOFF_S

    # ---------------------------------------------------------------------------------- internals

    def _take(self, exclude: Collection[Endpoint], pin: Pin | None = None) -> Endpoint | None:
        """The policy's pick (the pinned endpoint first, if any) among the decode endpoints in rotation
        with a free slot, not backing off and not in `exclude`, its slot taken; None when there is none."""
        now = time.monotonic()
        default = self._default_slots
        if exclude:
            def free(e: Endpoint) -> bool:
                return e.inflight < (e.slots or default) and e.full_until <= now and e not in exclude
        else:
            def free(e: Endpoint) -> bool:
                return e.inflight < (e.slots or default) and e.full_until <= now
        chosen = pin.decode_in(self.pool.in_rotation("decode"), free) if pin is not None else None
        if chosen is None:
            chosen = self.pool.choose_where("decode", free)
        if chosen is not None:
            chosen.acquire()
        return chosen

    def _wake_head(self) -> None:
        head = self._waiters.head()
        if head is not None and not head.future.done():
            head.future.set_result(None)
