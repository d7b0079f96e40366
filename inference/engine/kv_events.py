"""The log of a block manager's prefix-cache changes: block hashes stored and removed, numbered.

The engine thread appends (the block manager's hooks, under the engine's lock); the worker's event
stream (inference/server/kv_events.py) reads from the event loop. Appends and reads share a lock
held for a few list operations only. The log keeps the last `capacity` changes: a reader that fell
further behind starts over from a snapshot.

A snapshot is exact without stopping the engine: the reader takes the sequence number first, then
the set of held hashes, and applies every change after that number on top. A change made between
the two is then in both, and applying it again leaves the same state (stores and removals are set
operations), so the result is the state after the last change either way.
"""
from __future__ import annotations

import collections
import threading
from collections.abc import Callable


class KVEventLog:
    """Numbered prefix-cache changes (`True`: stored, `False`: removed) with their block hashes."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._changes: collections.deque[tuple[bool, bytes]] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.seq = 0  # number of the last change; the first is 1
        self._held: Callable[[], list[bytes]] = list

    def bind(self, held: Callable[[], list[bytes]]) -> None:
        """Where snapshots read the held hashes from (the block manager's registered hashes)."""
        self._held = held

    def stored(self, content_hash: bytes) -> None:
        """A block's content was registered under `content_hash`."""
        with self._lock:
            self._changes.append((True, content_hash))
            self.seq += 1

    def removed(self, content_hash: bytes) -> None:
        """The block holding `content_hash` was reclaimed for other content."""
        with self._lock:
            self._changes.append((False, content_hash))
            self.seq += 1

    def snapshot(self) -> tuple[int, list[bytes]]:
        """The sequence number, then every hash held now (see the module docstring for why in that order)."""
        seq = self.seq
        return seq, self._held()

    def since(self, seq: int) -> tuple[int, list[bytes], list[bytes]] | None:
        """The changes after `seq`, coalesced: (the last change's number, hashes stored, hashes removed),
        each hash in the list of the state it ended in. None when the log no longer reaches back to
        `seq` (the reader needs a snapshot)."""
        with self._lock:
            last = self.seq
            if last == seq:
                return last, [], []
            missing = last - seq
            if missing > len(self._changes) or missing < 0:
                return None
            changes = list(self._changes)[-missing:] if missing < len(self._changes) else list(self._changes)
        final: dict[bytes, bool] = {}
        for stored, content_hash in changes:
            final[content_hash] = stored
        return (last, [h for h, s in final.items() if s], [h for h, s in final.items() if not s])
