"""Allocation of KV cache blocks, with ref counts and content hashes for prefix caching."""
from __future__ import annotations

import heapq
from collections import OrderedDict

from inference.wire.kv_events import block_hashes

from .kv_events import KVEventLog

__all__ = ["BlockManager", "KVEventLog", "NoFreeBlocks", "block_hashes"]


class NoFreeBlocks(RuntimeError):
    """Raised when the block pool cannot satisfy an allocation."""


class BlockManager:
    """Block ids with reference counts; full blocks can be registered under their content hash.

    A block is free when nobody references it. Free blocks whose content is registered stay cached
    (reusable by `lookup` + `share`) until an allocation needs them, oldest freed first. Allocation
    prefers never-cached blocks, lowest ids first (a min-heap): this keeps a sequence's blocks mostly
    consecutive, so the KV transfer sends few contiguous runs.
    """

    def __init__(self, num_blocks: int) -> None:
        """Start with every block in `range(num_blocks)` free."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._plain: list[int] = list(range(num_blocks))  # free, no cached content; sorted = a heap
        self._cached: OrderedDict[int, None] = OrderedDict()  # free, content registered; LRU order
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        # Where registrations and evictions are told (the worker's KV event stream); None: nobody.
        self.events: KVEventLog | None = None

    def watch(self, events: KVEventLog) -> None:
        """Tell `events` every hash registered or evicted from now on (snapshots read `held_hashes`)."""
        events.bind(self.held_hashes)
        self.events = events

    def held_hashes(self) -> list[bytes]:
        """Every content hash a block holds now (in use or cached)."""
        # list() of a dict's keys runs in C without releasing the GIL: safe from another thread.
        return list(self._block_of)

    @property
    def num_free(self) -> int:
        """Blocks nobody references (cached ones included: they are reclaimed on demand)."""
        return len(self._plain) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Free blocks still holding registered content."""
        return len(self._cached)

    def can_allocate(self, n: int) -> bool:
        """Whether `n` blocks are free now."""
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (never-cached ones first, lowest ids first, then the least recently
        freed cached ones, forgetting their content); raise `NoFreeBlocks` if fewer are free."""
        if n > self.num_free:
            raise NoFreeBlocks(f"need {n} KV blocks, {self.num_free} free of {self.num_blocks}")
        out = [heapq.heappop(self._plain) for _ in range(min(n, len(self._plain)))]
        while len(out) < n:
            block, _ = self._cached.popitem(last=False)
            evicted = self._hash_of.pop(block)
            del self._block_of[evicted]
            if self.events is not None:
                self.events.removed(evicted)
            out.append(block)
        for b in out:
            self._refs[b] = 1
        return out

    def free(self, ids: list[int]) -> None:
        """Drop one reference to each block; a block nobody references becomes free (and stays cached
        if its content is registered). Freeing an unreferenced or unknown block raises ValueError."""
        for b in ids:
            if not 0 <= b < self.num_blocks or self._refs[b] == 0:
                raise ValueError(f"block {b} is not allocated")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._cached[b] = None
                else:
                    heapq.heappush(self._plain, b)

    def register(self, block: int, content_hash: bytes) -> None:
        """Record that an allocated block holds the KV of the prefix `content_hash`. A hash already
        held by another block keeps that block (this one stays private)."""
        if self._refs[block] == 0:
            raise ValueError(f"block {block} is not allocated")
        if content_hash in self._block_of or block in self._hash_of:
            return
        self._hash_of[block] = content_hash
        self._block_of[content_hash] = block
        if self.events is not None:
            self.events.stored(content_hash)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (stops at the first miss)."""
        out: list[int] = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def num_free_among(self, ids: list[int]) -> int:
        """How many of `ids` are free (sharing them takes them out of the free pool)."""
        return sum(1 for b in ids if self._refs[b] == 0)

    def share(self, ids: list[int]) -> None:
        """Add a reference to each (registered) block, taking free ones out of the free pool."""
        for b in ids:
            if self._refs[b] == 0:
                del self._cached[b]
            self._refs[b] += 1

    def blocks_to_take(self, hits: list[int], n: int) -> int:
        """Free blocks that sharing the cached prefix `hits` and allocating `n` more would use up
        (a cached block nobody references counts: sharing takes it out of the free pool)."""
        return n + self.num_free_among(hits)

    def extend_prefix(self, hits: list[int], n: int) -> list[int]:
        """Share the cached prefix `hits` and allocate `n` blocks after it: `hits + new`. Raises
        `NoFreeBlocks`, taking nothing, when they do not fit."""
        take = self.blocks_to_take(hits, n)
        if take > self.num_free:
            raise NoFreeBlocks(f"need {take} KV blocks, {self.num_free} free of {self.num_blocks}")
        self.share(hits)
        return hits + self.allocate(n)

    def usage(self) -> float:
        """Fraction of blocks referenced, 0.0 to 1.0 (cached but unreferenced blocks count as free)."""
        return 1.0 - self.num_free / self.num_blocks
