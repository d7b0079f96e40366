"""Per-key limits in Redis, leased to each router process in small blocks (most requests: no round trip).

What each process holds for a key, counted in Redis the moment it is handed out:
- **permits** of the requests-per-minute window: a block of `block_size(limit)` (1 % of the limit, at
  most MAX_BLOCK) is taken at once and spent locally; what is left is given back after IDLE_S without
  use. Redis counts a permit when it is leased, so the admitted count never passes the limit; what two
  routers can fall short of it is what they hold unused when the window ends (at most a block each:
  1 % of the limit). Limits under 200 per minute get blocks of one: a round trip per request, exact.
- **concurrency slots**: taken one per request from Redis (the count of slots in use is exact); when a
  request ends its slot is kept as a *spare* for SPARE_HOLD_S, and the key's next request in this
  process reuses it without a round trip; an unused spare goes back to Redis then (another process
  saw an ended request's slot free 0.1 s later before this change, too).
- **tokens** are counted locally and paid every TOKEN_PAY_S; each reply carries the window's total, so
  a tokens-per-minute check is local until the total (plus what this process owes) reaches the limit,
  then asked of Redis.

Each process's holdings are recorded per key in a Redis hash with an expiry (`lease_s`), renewed while
it holds anything; a router that dies stops renewing, and the next call of any process for that key
gives its slots and its unused permits (as last reported) back. Like Envoy's rate limit quota service
and Gubernator's GLOBAL behaviour, the many requests of a busy key cost a few calls; unlike Gubernator's
eventual consistency, a permit or a slot is counted before it is used, so no limit is exceeded.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass

from inference.gateway.api_keys import Tenant
from inference.gateway.redis_batch import ScriptBatcher

logger = logging.getLogger(__name__)

WINDOW_S = 60
WINDOW_TTL_S = 2 * WINDOW_S
_CONCURRENCY_TTL_S = 3600
KEY_PREFIX = "quota"
BLOCK_SHARE = 0.01
MAX_BLOCK = 64
IDLE_S = 1.0  # unused permits go back after this long without a request of the key here
SPARE_HOLD_S = 0.1  # an ended request's slot waits this long for the key's next request here
TOKEN_PAY_S = 0.1  # counted tokens are paid at least this often
TICK_S = 0.05
DEFAULT_LEASE_S = 10.0

# One call does everything a process has to say about a key, oldest first: give dead processes'
# holdings back, pay tokens, give back slots and permits, and (an admission) check and take.
# KEYS: requests window, tokens window, concurrency total, holdings hash.
# ARGV: rpm, tpm, conc, process, admit (0/1), want permits, want slot, tokens, slots back, permits back,
#       unused permits held, lease ms, window ttl, concurrency ttl, window, slots held (before any back).
# Returns {code (0 admitted, 1 rpm spent, 2 tpm spent, 3 concurrency full), permits granted, tokens used,
#          1 if this process's record was missing (taken for dead) though it held something}.
_SYNC_LUA = """
local rpm, tpm, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local me, admit = ARGV[4], tonumber(ARGV[5])
local want_permits, want_slot = tonumber(ARGV[6]), tonumber(ARGV[7])
local tokens, slots_back, permits_back = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local unused, lease_ms, window = tonumber(ARGV[11]), tonumber(ARGV[12]), ARGV[15]
local claimed = tonumber(ARGV[16])
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local function take(key, n)
  if n <= 0 then return end
  local have = tonumber(redis.call('GET', key) or '0')
  if have > 0 then redis.call('DECRBY', key, math.min(have, n)) end
end
local flat = redis.call('HGETALL', KEYS[4])
local held = {}
for i = 1, #flat, 2 do held[flat[i]] = flat[i + 1] end
for name, value in pairs(held) do
  local other = string.match(name, '^(.*)|e$')
  if other and other ~= me and tonumber(value) < now_ms then
    take(KEYS[3], tonumber(held[other .. '|c'] or '0'))
    if held[other .. '|w'] == window then take(KEYS[1], tonumber(held[other .. '|l'] or '0')) end
    redis.call('HDEL', KEYS[4], other .. '|e', other .. '|c', other .. '|l', other .. '|w')
  end
end
if tokens > 0 then
  redis.call('INCRBY', KEYS[2], tokens)
  redis.call('EXPIRE', KEYS[2], ARGV[13])
end
local mine = tonumber(held[me .. '|c'] or '0')
local lost = 0
if held[me .. '|e'] == nil and (claimed > 0 or unused > 0) then
  -- Taken for dead while alive (stalled past its lease): its slots are counted again, its unused
  -- permits (already given back) are dropped by the process.
  lost, unused = 1, 0
  redis.call('INCRBY', KEYS[3], claimed)
  redis.call('EXPIRE', KEYS[3], ARGV[14])
  mine = claimed
end
if slots_back > 0 then
  take(KEYS[3], math.min(mine, slots_back))
  mine = math.max(0, mine - slots_back)
end
if permits_back > 0 then take(KEYS[1], permits_back) end
local used_tokens = tonumber(redis.call('GET', KEYS[2]) or '0')
local code, granted = 0, 0
if admit > 0 then
  if want_slot > 0 and conc > 0 and tonumber(redis.call('GET', KEYS[3]) or '0') >= conc then code = 3
  elseif tpm > 0 and used_tokens >= tpm then code = 2
  elseif want_permits > 0 then
    granted = math.min(want_permits, rpm - tonumber(redis.call('GET', KEYS[1]) or '0'))
    if granted <= 0 then
      granted, code = 0, 1
    else
      redis.call('INCRBY', KEYS[1], granted)
      redis.call('EXPIRE', KEYS[1], ARGV[13])
    end
  end
  if code == 0 and want_slot > 0 then
    redis.call('INCR', KEYS[3])
    redis.call('EXPIRE', KEYS[3], ARGV[14])
    mine = mine + 1
  end
end
if code == 0 and want_permits > 0 then unused = unused + granted - 1 end
if mine > 0 or unused > 0 then
  redis.call('HSET', KEYS[4], me .. '|e', now_ms + lease_ms, me .. '|c', mine, me .. '|l', unused, me .. '|w', window)
  redis.call('EXPIRE', KEYS[4], ARGV[14])
else
  redis.call('HDEL', KEYS[4], me .. '|e', me .. '|c', me .. '|l', me .. '|w')
end
return {code, granted, used_tokens, lost}
"""


def block_size(requests_per_minute: int) -> int:
    """Permits leased at once for a requests-per-minute limit: 1 % of it (at least 1, at most MAX_BLOCK)."""
    return max(1, min(MAX_BLOCK, int(requests_per_minute * BLOCK_SHARE)))


def window_of(now: float) -> int:
    """The one-minute window (minutes since the epoch) of epoch time `now`."""
    return int(now // WINDOW_S)


@dataclass
class _Holding:
    """What this process holds and owes for one key."""

    tenant: Tenant
    window: int = -1
    permits: int = 0  # leased for `window`, not used yet
    spare: int = 0  # slots of ended requests, kept for the next request
    inflight: int = 0  # slots of running requests (keys with a concurrency limit)
    tokens_seen: int = 0  # the window's token total in Redis's last reply
    owed_tokens: int = 0
    last_request: float = 0.0  # monotonic
    spare_since: float = 0.0
    owed_since: float = 0.0
    synced_at: float = 0.0  # last call that renewed this process's record
    refill: asyncio.Future[None] | None = None

    def roll(self, window: int) -> None:
        """A new window: permits and token totals of the last one are worth nothing now."""
        if window != self.window:
            self.window, self.permits, self.tokens_seen = window, 0, 0

    def holds(self) -> bool:
        return bool(self.permits or self.spare or self.inflight or self.owed_tokens)


class LeasedCounters:
    """Counters in Redis shared by every router process, leased in blocks (module docstring)."""

    def __init__(self, url: str, lease_s: float = DEFAULT_LEASE_S) -> None:
        self.url = url
        self.lease_s = lease_s
        self.process = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._batchers: dict[int, ScriptBatcher] = {}
        self._holdings: dict[int, _Holding] = {}
        self._tick: asyncio.TimerHandle | None = None
        self._tick_loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._warned_at = 0.0
        self.calls = 0  # script calls made (tests and benchmarks count round trips with it)
        self.lost = 0  # times this process was taken for dead while it held something

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
    def keys(key_id: int, window: int) -> list[str]:
        """The Redis keys of a key's counters in `window`: requests, tokens, concurrency, holdings."""
        base = f"{KEY_PREFIX}:{key_id}"
        return [f"{base}:r:{window}", f"{base}:t:{window}", f"{base}:c", f"{base}:h"]

    def _holding(self, tenant: Tenant) -> _Holding:
        key_id = tenant.key_id or 0
        holding = self._holdings.get(key_id)
        if holding is None:
            holding = self._holdings[key_id] = _Holding(tenant)
        else:
            holding.tenant = tenant  # the snapshot's latest limits
        return holding

    async def _sync(self, h: _Holding, *, admit: bool = False, want_permits: int = 0, want_slot: int = 0,
                    slots_back: int = 0, permits_back: int = 0) -> tuple[int, int, bool]:
        """One script call for key `h`: pays its tokens; returns (code, permits granted, whether this process
        had been taken for dead). On failure what it carried is owed again."""
        tenant = h.tenant
        tokens, h.owed_tokens = h.owed_tokens, 0
        args = [tenant.requests_per_minute or 0, tenant.tokens_per_minute or 0, tenant.max_concurrent or 0,
                self.process, int(admit), want_permits, want_slot, tokens, slots_back, permits_back, h.permits,
                int(self.lease_s * 1000), WINDOW_TTL_S, _CONCURRENCY_TTL_S, h.window,
                h.inflight + h.spare + slots_back]
        self.calls += 1
        try:
            code, granted, used, lost = await self._batcher().call(_SYNC_LUA, self.keys(tenant.key_id or 0, h.window),
                                                                   args)
        except BaseException:
            h.owed_tokens += tokens
            h.spare += slots_back
            h.permits += permits_back
            raise
        h.synced_at = time.monotonic()
        h.tokens_seen = int(used)
        if lost:
            h.permits = 0  # given back by whoever took this process for dead
            self.lost += 1
        return int(code), int(granted), bool(lost)

    async def admit(self, tenant: Tenant, now: float) -> int:
        """Check and count one request: from what this process holds when it can, else one script call."""
        h = self._holding(tenant)
        h.roll(window_of(now))
        h.last_request = time.monotonic()
        rpm, tpm, conc = tenant.requests_per_minute or 0, tenant.tokens_per_minute or 0, tenant.max_concurrent or 0
        block = block_size(rpm) if rpm else 0
        for _ in range(3):  # bounded: wait for another request's refill at most twice
            if rpm and h.permits <= 0 and block > 1 and h.refill is not None:
                await asyncio.shield(h.refill)  # one block at a time per key: no burst of blocks
                h.roll(window_of(time.time()))
                continue
            break
        took_permit = bool(rpm and h.permits > 0)
        took_spare = bool(conc and h.spare > 0)
        tokens_ok = not tpm or h.tokens_seen + h.owed_tokens < tpm
        if (took_permit or not rpm) and (took_spare or not conc) and tokens_ok:
            h.permits -= int(took_permit)
            h.spare -= int(took_spare)
            h.inflight += int(bool(conc))
            return 0
        h.permits -= int(took_permit)
        h.spare -= int(took_spare)
        refill: asyncio.Future[None] | None = None
        if rpm and not took_permit and block > 1:
            refill = h.refill = asyncio.get_running_loop().create_future()
        try:
            want_permits = 0 if took_permit or not rpm else block
            code, granted, lost = await self._sync(h, admit=True, want_permits=want_permits,
                                                   want_slot=int(bool(conc) and not took_spare))
        except BaseException:
            h.permits += int(took_permit)
            h.spare += int(took_spare)
            raise
        finally:
            if refill is not None:
                h.refill = None
                refill.set_result(None)
        if code != 0:
            h.permits += int(took_permit and not lost)  # when lost, its permits went back already
            h.spare += int(took_spare)
            self._schedule()
            return code
        if granted:
            h.permits += granted - 1
        h.inflight += int(bool(conc))
        self._schedule()
        return 0

    async def finish(self, tenant: Tenant, tokens: int, now: float) -> None:
        """A request ended: its slot becomes a spare, its last tokens are owed."""
        h = self._holding(tenant)
        if tenant.max_concurrent and h.inflight > 0:
            h.inflight -= 1
            h.spare += 1
            h.spare_since = time.monotonic()
        await self.add_tokens(tenant, tokens, now)
        self._schedule()

    async def add_tokens(self, tenant: Tenant, tokens: int, now: float) -> None:
        """Owe `tokens` of the current window (paid within TOKEN_PAY_S)."""
        if tokens <= 0 or not tenant.tokens_per_minute:
            return
        h = self._holding(tenant)
        if not h.owed_tokens:
            h.owed_since = time.monotonic()
        h.owed_tokens += tokens
        self._schedule()

    def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        if self._tick is not None and self._tick_loop is loop:
            return
        self._tick_loop = loop
        self._tick = loop.call_later(TICK_S, self._on_tick)

    def _on_tick(self) -> None:
        """Give back idle spares and permits, pay owed tokens, renew held leases; again while anything is held."""
        self._tick = None
        now = time.monotonic()
        window = window_of(time.time())
        due: list[asyncio.Future[tuple[int, int, bool]]] = []
        for key_id, h in list(self._holdings.items()):
            h.roll(window)
            slots_back = h.spare if h.spare and now - h.spare_since >= SPARE_HOLD_S else 0
            permits_back = h.permits if h.permits and now - h.last_request >= IDLE_S else 0
            pay = h.owed_tokens and now - h.owed_since >= TOKEN_PAY_S
            renew = (h.inflight or h.spare or h.permits) and now - h.synced_at >= self.lease_s / 3
            if slots_back or permits_back or pay or renew:
                h.spare -= slots_back
                h.permits -= permits_back
                due.append(asyncio.ensure_future(self._sync(h, slots_back=slots_back, permits_back=permits_back)))
            elif not h.holds() and now - h.last_request > 2 * WINDOW_S:
                del self._holdings[key_id]
        if due:
            task = asyncio.ensure_future(self._settled(due))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if any(h.holds() for h in self._holdings.values()):
            self._schedule()

    async def _settled(self, calls: list[asyncio.Future[tuple[int, int, bool]]]) -> None:
        results = await asyncio.gather(*calls, return_exceptions=True)
        if any(isinstance(r, BaseException) for r in results) and time.monotonic() - self._warned_at > 10.0:
            self._warned_at = time.monotonic()  # at most a line per 10 s while Redis is down
            logger.warning("quota settle failed; what was owed is kept for the next call")
        if any(h.holds() for h in self._holdings.values()):
            self._schedule()

    def held(self, tenant: Tenant) -> tuple[int, int, int]:
        """(unused permits, spare slots, running requests) this process holds for `tenant` (tests)."""
        h = self._holdings.get(tenant.key_id or 0)
        return (h.permits, h.spare, h.inflight) if h is not None else (0, 0, 0)
