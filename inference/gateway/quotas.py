"""Per-key limits: requests per minute, tokens per minute (prompt + completion), concurrent requests.

Counted in fixed one-minute windows (`<key>:<minute since the epoch>`) so that every router process
and host agrees on what "this minute" is and the admitted count of a window never passes the limit.
With REDIS_URL the counters live in Redis, shared by every router process and leased to each in small
blocks so that most requests cost no round trip (inference/gateway/quota_leases.py: permits 1 % of the
limit at a time, an ended request's slot reused, tokens paid every 0.1 s; what a dead router held comes
back after ROUTER_QUOTA_LEASE_S). Without Redis (the embedded default) the counters are this process's
own: with N router processes a key gets up to N times its limits (README says so).

A request past a limit is refused at once (429, Retry-After: the seconds to the next window, or 1 for
concurrency), never queued. Once a window's request or token budget is spent, the process remembers
it until the window ends, so a flood past the limit costs no Redis round trip per request, and
`known_refusal` answers from that memory alone, with no await (the gateway's early refusal,
inference/gateway/early_refusal.py, calls it before any consumer work). If Redis
cannot be reached the request is let through (logged): limits are about fairness, not security.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Protocol

from inference.gateway.api_keys import Tenant
from inference.gateway.quota_leases import DEFAULT_LEASE_S, WINDOW_S, LeasedCounters, window_of

logger = logging.getLogger(__name__)

LIMIT_NAMES = {1: "requests_per_minute", 2: "tokens_per_minute", 3: "max_concurrent"}


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused: the limit's name and value, and when to retry."""

    limit: str
    value: int
    retry_after_s: int

    def message(self, tenant: Tenant) -> str:
        """The 429 message, naming the limit."""
        what = {"requests_per_minute": "requests per minute", "tokens_per_minute": "tokens per minute",
                "max_concurrent": "concurrent requests"}[self.limit]
        return (f"API key {tenant.label}… is over its limit of {self.value} {what} ({self.limit}); "
                f"retry after {self.retry_after_s}s")


def _retry_after(code: int, now: float) -> int:
    if code == 3:
        return 1
    return max(1, math.ceil((window_of(now) + 1) * WINDOW_S - now))


def _refusal(tenant: Tenant, code: int, now: float) -> Refusal:
    value = {1: tenant.requests_per_minute, 2: tenant.tokens_per_minute, 3: tenant.max_concurrent}[code] or 0
    return Refusal(LIMIT_NAMES[code], value, _retry_after(code, now))


class QuotaCounters(Protocol):
    """Where the counters are kept (Redis, or this process)."""

    async def admit(self, tenant: Tenant, now: float) -> int:
        """Check and count one request; 0 or the code of the limit that refuses it."""

    async def finish(self, tenant: Tenant, tokens: int, now: float) -> None:
        """One of the tenant's requests ended: count its last `tokens`, free its concurrency slot."""

    async def add_tokens(self, tenant: Tenant, tokens: int, now: float) -> None:
        """Count `tokens` in the current window."""


class LocalCounters:
    """This process's counters (the embedded default: no Redis)."""

    def __init__(self) -> None:
        self.requests: dict[tuple[int, int], int] = {}
        self.tokens: dict[tuple[int, int], int] = {}
        self.concurrent: dict[int, int] = {}

    def _prune(self, window: int) -> None:
        for table in (self.requests, self.tokens):
            for key in [k for k in table if k[1] < window - 1]:
                del table[key]

    async def admit(self, tenant: Tenant, now: float) -> int:  # noqa: D102
        key_id = tenant.key_id or 0
        window = window_of(now)
        if len(self.requests) + len(self.tokens) > 10_000:
            self._prune(window)
        if tenant.max_concurrent and self.concurrent.get(key_id, 0) >= tenant.max_concurrent:
            return 3
        if tenant.tokens_per_minute and self.tokens.get((key_id, window), 0) >= tenant.tokens_per_minute:
            return 2
        if tenant.requests_per_minute:
            if self.requests.get((key_id, window), 0) >= tenant.requests_per_minute:
                return 1
            self.requests[(key_id, window)] = self.requests.get((key_id, window), 0) + 1
        if tenant.max_concurrent:
            self.concurrent[key_id] = self.concurrent.get(key_id, 0) + 1
        return 0

    async def finish(self, tenant: Tenant, tokens: int, now: float) -> None:  # noqa: D102
        key_id = tenant.key_id or 0
        if tokens > 0 and tenant.tokens_per_minute:
            await self.add_tokens(tenant, tokens, now)
        if tenant.max_concurrent and self.concurrent.get(key_id, 0) > 0:
            self.concurrent[key_id] -= 1

    async def add_tokens(self, tenant: Tenant, tokens: int, now: float) -> None:  # noqa: D102
        key = (tenant.key_id or 0, window_of(now))
        self.tokens[key] = self.tokens.get(key, 0) + tokens


class Quotas:
    """The limits of every key, enforced with `counters`; spent windows remembered in process."""

    def __init__(self, counters: QuotaCounters) -> None:
        self.counters = counters
        # (key id, window) -> refusal code, for request and token budgets spent this window.
        self._spent: dict[tuple[int, int], int] = {}
        self._warned_at = 0.0

    def _failed(self, what: str) -> None:
        now = time.monotonic()
        if now - self._warned_at > 10.0:  # at most one log line per 10 s while Redis is down
            self._warned_at = now
            logger.warning("quota counters unavailable (%s); requests pass unlimited", what, exc_info=True)

    def known_refusal(self, tenant: Tenant) -> Refusal | None:
        """The refusal of `tenant`'s next request if this process already knows it (a request or token
        budget spent this window), else None; no counter is touched."""
        if tenant.key_id is None or not tenant.limited:
            return None
        now = time.time()
        spent = self._spent.get((tenant.key_id, window_of(now)))
        return _refusal(tenant, spent, now) if spent is not None else None

    async def admit(self, tenant: Tenant) -> Refusal | None:
        """Count one request of `tenant`, or say which limit refuses it. Call `finish` when it ends
        (only when admitted)."""
        if not tenant.limited or tenant.key_id is None:
            return None
        now = time.time()
        window = window_of(now)
        spent = self._spent.get((tenant.key_id, window))
        if spent is not None:
            return _refusal(tenant, spent, now)
        try:
            code = await self.counters.admit(tenant, now)
        except Exception:  # noqa: BLE001  Redis down: serve rather than refuse everybody
            self._failed("admit")
            return None
        if code == 0:
            return None
        if code in (1, 2):
            if len(self._spent) > 10_000:
                self._spent = {k: v for k, v in self._spent.items() if k[1] >= window}
            self._spent[(tenant.key_id, window)] = code
        return _refusal(tenant, code, now)

    async def finish(self, tenant: Tenant, tokens: int) -> None:
        """An admitted request of `tenant` ended: its last `tokens` counted, its concurrency slot freed."""
        if tenant.key_id is None or not (tenant.max_concurrent or (tenant.tokens_per_minute and tokens > 0)):
            return
        try:
            await self.counters.finish(tenant, tokens, time.time())
        except Exception:  # noqa: BLE001
            self._failed("finish")

    async def add_tokens(self, tenant: Tenant, tokens: int) -> None:
        """Count prompt or completion tokens of `tenant` in the current window."""
        if not tenant.tokens_per_minute or tenant.key_id is None or tokens <= 0:
            return
        try:
            await self.counters.add_tokens(tenant, tokens, time.time())
        except Exception:  # noqa: BLE001
            self._failed("tokens")


_quotas: Quotas | None = None


def quotas() -> Quotas:
    """This process's quotas: in Redis when REDIS_URL is set, else per process."""
    global _quotas
    if _quotas is None:
        from django.conf import settings

        url = getattr(settings, "REDIS_URL", None)
        lease_s = float(getattr(settings, "ROUTER_QUOTA_LEASE_S", DEFAULT_LEASE_S))
        _quotas = Quotas(LeasedCounters(url, lease_s) if url else LocalCounters())
    return _quotas


def set_quotas(value: Quotas | None) -> None:
    """Replace (None: rebuild from settings on next use) this process's quotas; for tests."""
    global _quotas
    _quotas = value
