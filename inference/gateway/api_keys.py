"""The router's view of the API keys in the database: a snapshot, refreshed every few seconds.

A generation never queries the database for its key: the process keeps every non-revoked key (hash ->
`Tenant`) in memory and reloads them all when the snapshot is older than ROUTER_KEY_REFRESH_S (in the
background, the request goes on with the snapshot it has). A snapshot older than ROUTER_KEY_MAX_STALE_S
is reloaded before the request is answered, so a revocation is refused by every router process within
that bound even when it was idle. A key missing from the snapshot (perhaps created a moment ago, after
the snapshot's query) is looked up alone (one indexed query, as a DRF token costs on every request) and
joins the snapshot; a missing key is not looked up again for half a second, so retries of an unknown
key do not query per request. If the database cannot be read the old snapshot is kept (logged, and
retried after ROUTER_KEY_REFRESH_S): a database restart does not lock every client out.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections

from inference.actions.api_keys import hash_secret, looks_like_key
from inference.selectors import api_keys as key_selectors

logger = logging.getLogger(__name__)

# A key found in neither the snapshot nor the database is not looked up again for this long.
_MISS_RELOAD_S = 0.5
# At most this many unknown keys are remembered (a flood of random keys cannot grow it without bound).
_MISSES_KEPT = 10_000


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a request is from, as the router needs it: limits, priority class, scope.

    `key_id` is None for callers that are not database keys (ROUTER_API_KEYS, DRF tokens, open mode):
    they have no limits and the interactive class. `label` is what logs and the queue's fairness use.
    """

    key_id: int | None
    label: str
    priority: str = "interactive"
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    deployments: frozenset[str] = frozenset()
    expires_at: float | None = None  # epoch seconds

    @property
    def limited(self) -> bool:
        """Whether any per-key limit applies (the quota counters are skipped otherwise)."""
        return bool(self.requests_per_minute or self.tokens_per_minute or self.max_concurrent)

    def may_use(self, deployment: str | None) -> bool:
        """Whether this key's scope includes `deployment` (a static router, None, is in every scope
        only for unscoped keys)."""
        return not self.deployments or (deployment is not None and deployment in self.deployments)


ENV_TENANT = Tenant(key_id=None, label="env")
TOKEN_TENANT = Tenant(key_id=None, label="token")
OPEN_TENANT = Tenant(key_id=None, label="open")


def _load_snapshot(secret_hash: str | None = None) -> dict[str, Tenant]:
    """Every non-revoked key (or the one of `secret_hash`) by secret hash (two queries)."""
    close_old_connections()  # a long-lived router outlives its connection across a database restart
    rows = key_selectors.active_key_rows(secret_hash)
    scopes = key_selectors.key_scopes(None if secret_hash is None else [row[0] for row in rows])
    snapshot: dict[str, Tenant] = {}
    for key_id, prefix, digest, priority, rpm, tpm, concurrent, expires in rows:
        snapshot[digest] = Tenant(
            key_id=key_id, label=prefix, priority=priority, requests_per_minute=rpm, tokens_per_minute=tpm,
            max_concurrent=concurrent, deployments=frozenset(scopes.get(key_id, ())),
            expires_at=expires.timestamp() if expires is not None else None,
        )
    return snapshot


class KeyCache:
    """The process's key snapshot; `lookup` is called from the event loop, loads run in a thread."""

    def __init__(self, refresh_s: float, max_stale_s: float) -> None:
        self.refresh_s = refresh_s
        self.max_stale_s = max(max_stale_s, refresh_s)
        self._keys: dict[str, Tenant] = {}
        self.loaded_at = float("-inf")  # monotonic time of the last successful load
        self._retry_at = float("-inf")  # no load before this (after a failure)
        self._background: asyncio.Task[None] | None = None
        self._lock = threading.Lock()
        self._misses: dict[str, float] = {}  # unknown key hash -> when the database last said so

    def _look_up_missing(self, digest: str) -> None:
        """Look up one key missing from the snapshot and add it if it is active (thread side)."""
        try:
            found = _load_snapshot(digest)
        except Exception:  # noqa: BLE001  database down: the key stays unknown until it answers
            self._retry_at = time.monotonic() + self.refresh_s
            logger.warning("API key lookup failed", exc_info=True)
            return
        with self._lock:
            if found:
                self._keys = {**self._keys, **found}  # a new dict: lookups read the old one meanwhile
                self._misses.pop(digest, None)
            else:
                if len(self._misses) >= _MISSES_KEPT:
                    self._misses.clear()
                self._misses[digest] = time.monotonic()

    def _reload(self, min_age_s: float | None = None) -> None:
        """Load a snapshot unless another caller just did (thread side)."""
        with self._lock:
            if time.monotonic() - self.loaded_at < (self.refresh_s if min_age_s is None else min_age_s):
                return
            try:
                keys = _load_snapshot()
            except Exception:  # noqa: BLE001  database down: keep serving the old snapshot
                self._retry_at = time.monotonic() + self.refresh_s
                logger.warning("API key refresh failed; keeping the snapshot of %d keys", len(self._keys),
                               exc_info=True)
                return
            self._keys = keys
            self.loaded_at = time.monotonic()

    async def lookup(self, secret: str) -> Tenant | None:
        """The tenant of `secret` if it is an active key, else None."""
        if not looks_like_key(secret):
            return None
        now = time.monotonic()
        age = now - self.loaded_at
        if age > self.max_stale_s and now >= self._retry_at:
            await sync_to_async(self._reload, thread_sensitive=False)()
        elif age > self.refresh_s and now >= self._retry_at and (self._background is None or self._background.done()):
            self._background = asyncio.ensure_future(sync_to_async(self._reload, thread_sensitive=False)())
        digest = hash_secret(secret)
        tenant = self._keys.get(digest)
        now = time.monotonic()
        if tenant is None and now - self._misses.get(digest, float("-inf")) > _MISS_RELOAD_S and now >= self._retry_at:
            # Perhaps a key created after the snapshot's query: look it up alone.
            await sync_to_async(self._look_up_missing, thread_sensitive=False)(digest)
            tenant = self._keys.get(digest)
        if tenant is None or (tenant.expires_at is not None and tenant.expires_at <= time.time()):
            return None
        return tenant

    def peek(self, secret: str) -> Tenant | None:
        """The tenant of `secret` if the snapshot holds it as an active key, else None: no database, no
        await (the early refusal's lookup; anything it cannot say goes the usual way)."""
        if not looks_like_key(secret) or time.monotonic() - self.loaded_at > self.max_stale_s:
            return None
        tenant = self._keys.get(hash_secret(secret))
        if tenant is None or (tenant.expires_at is not None and tenant.expires_at <= time.time()):
            return None
        return tenant

    def invalidate(self) -> None:
        """Forget the snapshot: the next lookup loads a fresh one (tests, and after a local change)."""
        self.loaded_at = float("-inf")
        self._retry_at = float("-inf")


_cache: KeyCache | None = None
_cache_lock = threading.Lock()


def key_cache() -> KeyCache:
    """This process's key cache (built from settings on first use)."""
    global _cache
    with _cache_lock:
        if _cache is None:
            _cache = KeyCache(float(settings.ROUTER_KEY_REFRESH_S), float(settings.ROUTER_KEY_MAX_STALE_S))
        return _cache
