"""A simulated worker's prefix cache: the block hashes of the prompts it served, as the engine's would be.

The real engine registers each full block of a prompt under its chained hash (inference/wire/kv_events.py
`block_hashes`) and keeps blocks cached after their request ends until it needs the room; its block
manager tells a `KVEventLog` every hash stored and evicted, which the worker streams at
`/internal/kv-events` (inference/server/kv_events.py `KVEventSource`). Here the pool is a
least-recently-used set of at most `capacity` hashes told to the same real log, so a router following
a simulated fleet reads the real stream (snapshot, batches, load lines, keepalives) at the real rate.
"""
from __future__ import annotations

from collections import OrderedDict

from inference.engine.kv_events import KVEventLog
from inference.wire.kv_events import block_hashes


class SimPrefixCache:
    """At most `capacity` block hashes, least recently used evicted first, every change told to `log`."""

    def __init__(self, capacity: int, block_size: int) -> None:
        if capacity < 1 or block_size < 1:
            raise ValueError("capacity and block_size must be >= 1")
        self.capacity = capacity
        self.block_size = block_size
        self._held: OrderedDict[bytes, None] = OrderedDict()
        self.log = KVEventLog()
        self.log.bind(lambda: list(self._held))

    def admit(self, prompt_ids: list[int]) -> int:
        """Register `prompt_ids`' full blocks (the last token left out, as the engine computes it);
        returns the tokens of the prompt that were cached already (its longest held prefix)."""
        usable = max(len(prompt_ids) - 1, 0)
        hashes = block_hashes(prompt_ids[: usable - usable % self.block_size], self.block_size)
        held, log = self._held, self.log
        cached = 0
        for i, h in enumerate(hashes):
            if h in held:
                if cached == i:  # still within the leading run
                    cached += 1
                held.move_to_end(h)
            else:
                held[h] = None
                log.stored(h)
        while len(held) > self.capacity:
            evicted, _ = held.popitem(last=False)
            log.removed(evicted)
        return cached * self.block_size

    def __len__(self) -> int:
        return len(self._held)
