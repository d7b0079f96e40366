"""Aborts that arrive before their request: remembered for a short while, applied on arrival.

The router sends `POST /internal/abort` to both workers when a client goes away, and that abort can
overtake the `/internal/decode` or `/internal/prefill` it cancels (separate connections, a request
still in a pooled connection's queue). Without a record the late request would reserve blocks or
compute a prompt for nobody. A tombstone per aborted id, kept `ttl_s` seconds and bounded in number,
lets the worker refuse it at once.
"""
from __future__ import annotations

import collections
import threading
import time

# Long enough for any request the router sent before its abort to have arrived (the router's own
# timeouts are tens of seconds), short enough that ids are never remembered for long.
TOMBSTONE_TTL_S = 60.0
# Bounds memory under an abort flood (an id is at most a few hundred bytes): oldest forgotten first.
MAX_TOMBSTONES = 100_000


class AbortTombstones:
    """Request ids aborted in the last `ttl_s` seconds; thread-safe (the KV receiver checks too)."""

    def __init__(self, ttl_s: float = TOMBSTONE_TTL_S, max_entries: int = MAX_TOMBSTONES) -> None:
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._entries: collections.OrderedDict[str, float] = collections.OrderedDict()  # id -> expiry
        self._lock = threading.Lock()

    def add(self, request_id: str) -> None:
        """Remember that `request_id` was aborted (again: its clock restarts)."""
        with self._lock:
            self._entries.pop(request_id, None)
            self._entries[request_id] = time.monotonic() + self._ttl_s
            self._prune()

    def __contains__(self, request_id: object) -> bool:
        """Whether `request_id` was aborted within the last `ttl_s` seconds."""
        with self._lock:
            self._prune()
            return request_id in self._entries

    def __len__(self) -> int:
        """Tombstones still alive."""
        with self._lock:
            self._prune()
            return len(self._entries)

    def _prune(self) -> None:
        """Drop expired entries (all share one ttl, so they expire in insertion order) and overflow."""
        now = time.monotonic()
        while self._entries:
            request_id, expires_at = next(iter(self._entries.items()))
            if expires_at > now and len(self._entries) <= self._max_entries:
                return
            del self._entries[request_id]
