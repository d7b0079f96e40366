"""Per-key limits: requests per minute, tokens per minute (prompt + completion), concurrent requests.

Counted in fixed one-minute windows (`<key>:<minute since the epoch>`) so that every router process
and host agrees on what "this minute" is and the admitted count of a window never passes the limit.
With REDIS_URL the counters live in Redis and one Lua script checks and counts a request atomically
(shared by every router process; each window's keys expire after two minutes, a concurrency counter
an hour after its last change, so a router killed mid-request cannot hold a slot for ever). Without
Redis (the embedded default) the counters are this process's own: with N router processes a key gets
up to N times its limits (README says so).

A request past a limit is refused at once (429, Retry-After: the seconds to the next window, or 1 for
concurrency), never queued. Once a window's request or token budget is spent, the process remembers
it until the window ends, so a flood past the limit costs no Redis round trip per request. If Redis
cannot be reached the request is let through (logged): limits are about fairness, not security.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Protocol

from inference.gateway.api_keys import Tenant
from inference.gateway.redis_batch import ScriptBatcher

logger = logging.getLogger(__name__)

WINDOW_S = 60
_WINDOW_TTL_S = 2 * WINDOW_S
_CONCURRENCY_TTL_S = 3600
_KEY_PREFIX = "quota"

# What a process owes for a key and pays with its next script call: its tokens counted (on the tokens
# key, expiring after ttl) and its ended requests taken off the concurrency key.
_PAY_OWED_LUA = """
local function pay_owed(tokens_key, concurrency_key, tokens, ttl, ends)
  if tokens > 0 then
    redis.call('INCRBY', tokens_key, tokens)
    redis.call('EXPIRE', tokens_key, ttl)
  end
  if ends > 0 then
    local held = tonumber(redis.call('GET', concurrency_key) or '0')
    if held > 0 then redis.call('DECRBY', concurrency_key, math.min(held, ends)) end
  end
end
"""
# Returns 0 (admitted and counted), 1 (requests/min spent), 2 (tokens/min spent), 3 (concurrency full).
# First pays what this process owes for the key: tokens (ARGV[6]) and ended requests (ARGV[7]).
_ADMIT_LUA = _PAY_OWED_LUA + """
local rpm, tpm, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
pay_owed(KEYS[2], KEYS[3], tonumber(ARGV[6]), ARGV[4], tonumber(ARGV[7]))
if conc > 0 and tonumber(redis.call('GET', KEYS[3]) or '0') >= conc then return 3 end
if tpm > 0 and tonumber(redis.call('GET', KEYS[2]) or '0') >= tpm then return 2 end
if rpm > 0 then
  if tonumber(redis.call('GET', KEYS[1]) or '0') >= rpm then return 1 end
  redis.call('INCR', KEYS[1])
  redis.call('EXPIRE', KEYS[1], ARGV[4])
end
if conc > 0 then
  redis.call('INCR', KEYS[3])
  redis.call('EXPIRE', KEYS[3], ARGV[5])
end
return 0
"""
# What a process owes for a key, paid without an admission: tokens (ARGV[1], expiring after ARGV[2])
# counted, ended requests (ARGV[3]) taken off the concurrency counter.
_SETTLE_LUA = _PAY_OWED_LUA + """
pay_owed(KEYS[1], KEYS[2], tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]))
return 0
"""
# How long a request's end (its concurrency slot, its last tokens) may wait to ride along with the key's
# next admission in this process before it is sent on its own.
SETTLE_AFTER_S = 0.1

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


def _window(now: float) -> int:
    return int(now // WINDOW_S)


def _retry_after(code: int, now: float) -> int:
    if code == 3:
        return 1
    return max(1, math.ceil((_window(now) + 1) * WINDOW_S - now))


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
        window = _window(now)
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
        key = (tenant.key_id or 0, _window(now))
        self.tokens[key] = self.tokens.get(key, 0) + tokens


class RedisCounters:
    """Counters in Redis, shared by every router process: one client per event loop, script calls
    batched per loop turn (redis_batch.py).

    A request's end costs no round trip of its own: its tokens and its concurrency slot are owed and
    paid by the key's next admission in this process (the admit script applies them first), or by a
    settle call at most SETTLE_AFTER_S later. So one Redis call per request; another process sees an
    ended request's slot free at most that much later.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self._batchers: dict[int, ScriptBatcher] = {}
        self._owed: dict[int, tuple[Tenant, int, int]] = {}  # key id -> (tenant, tokens, ended requests)
        self._settle_scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._warned_at = 0.0

    def _batcher(self) -> ScriptBatcher:
        import redis.asyncio as redis_asyncio

        loop_id = id(asyncio.get_running_loop())
        batcher = self._batchers.get(loop_id)
        if batcher is None:
            client = redis_asyncio.Redis.from_url(self.url, socket_timeout=1.0, socket_connect_timeout=1.0)
            batcher = ScriptBatcher(client)
            self._batchers = {loop_id: batcher}  # a new loop (tests) replaces the old one's client
        return batcher

    @staticmethod
    def _keys(tenant: Tenant, window: int) -> list[str]:
        base = f"{_KEY_PREFIX}:{tenant.key_id}"
        return [f"{base}:r:{window}", f"{base}:t:{window}", f"{base}:c"]

    async def admit(self, tenant: Tenant, now: float) -> int:  # noqa: D102
        key_id = tenant.key_id or 0
        _, tokens, ends = self._owed.pop(key_id, (tenant, 0, 0))
        args = [tenant.requests_per_minute or 0, tenant.tokens_per_minute or 0, tenant.max_concurrent or 0,
                _WINDOW_TTL_S, _CONCURRENCY_TTL_S, tokens, ends]
        try:
            return int(await self._batcher().call(_ADMIT_LUA, self._keys(tenant, _window(now)), args))
        except BaseException:
            self._owe(tenant, tokens, ends)  # not applied: still owed
            raise

    async def finish(self, tenant: Tenant, tokens: int, now: float) -> None:  # noqa: D102
        self._owe(tenant, tokens if tenant.tokens_per_minute else 0, 1 if tenant.max_concurrent else 0)

    async def add_tokens(self, tenant: Tenant, tokens: int, now: float) -> None:  # noqa: D102
        if tenant.tokens_per_minute and tokens > 0:
            self._owe(tenant, tokens, 0)

    def _owe(self, tenant: Tenant, tokens: int, ends: int) -> None:
        if tokens <= 0 and ends <= 0:
            return
        key_id = tenant.key_id or 0
        _, owed_tokens, owed_ends = self._owed.get(key_id, (tenant, 0, 0))
        self._owed[key_id] = (tenant, owed_tokens + tokens, owed_ends + ends)
        if not self._settle_scheduled:
            self._settle_scheduled = True
            asyncio.get_running_loop().call_later(SETTLE_AFTER_S, self._start_settle)

    def _start_settle(self) -> None:
        self._settle_scheduled = False
        owed, self._owed = self._owed, {}
        if owed:
            task = asyncio.get_running_loop().create_task(self.settle(owed))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def settle(self, owed: dict[int, tuple[Tenant, int, int]]) -> None:
        """Pay what is owed for each key (one pipeline); on failure it stays owed (logged)."""
        now = time.time()
        calls = []
        for tenant, tokens, ends in owed.values():
            _, token_key, concurrency_key = self._keys(tenant, _window(now))
            calls.append(self._batcher().call(_SETTLE_LUA, [token_key, concurrency_key], [tokens, _WINDOW_TTL_S, ends]))
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = [entry for entry, result in zip(owed.values(), results, strict=True) if isinstance(result, Exception)]
        if failed:
            if time.monotonic() - self._warned_at > 10.0:  # at most a line per 10 s while Redis is down
                self._warned_at = time.monotonic()
                logger.warning("quota settle failed for %d key(s); kept for the next one", len(failed))
            for tenant, tokens, ends in failed:
                self._owe(tenant, tokens, ends)


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

    async def admit(self, tenant: Tenant) -> Refusal | None:
        """Count one request of `tenant`, or say which limit refuses it. Call `finish` when it ends
        (only when admitted)."""
        if not tenant.limited or tenant.key_id is None:
            return None
        now = time.time()
        window = _window(now)
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
        _quotas = Quotas(RedisCounters(url) if url else LocalCounters())
    return _quotas


def set_quotas(value: Quotas | None) -> None:
    """Replace (None: rebuild from settings on next use) this process's quotas; for tests."""
    global _quotas
    _quotas = value
