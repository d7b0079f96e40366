"""Allocation of KV cache blocks."""
from __future__ import annotations

import heapq


class NoFreeBlocks(RuntimeError):
    """Raised when the block pool cannot satisfy an allocation."""


class BlockManager:
    """A free list of block ids.

    Allocation always hands out the lowest free ids (a min-heap): this keeps a sequence's blocks mostly
    consecutive, so the KV transfer sends few contiguous runs.
    """

    def __init__(self, num_blocks: int) -> None:
        """Start with every block in `range(num_blocks)` free."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks))  # sorted, hence already a valid heap
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        """Number of free blocks."""
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        """Whether `n` blocks are free now."""
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (lowest ids first); raise `NoFreeBlocks` if fewer are free."""
        if n > len(self._free):
            raise NoFreeBlocks(f"need {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        out = [heapq.heappop(self._free) for _ in range(n)]
        for b in out:
            self._is_free[b] = False
        return out

    def free(self, ids: list[int]) -> None:
        """Return blocks to the pool; freeing a free or unknown block is a bug and raises ValueError."""
        for b in ids:
            if not 0 <= b < self.num_blocks or self._is_free[b]:
                raise ValueError(f"block {b} is not allocated")
            self._is_free[b] = True
            heapq.heappush(self._free, b)

    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 to 1.0."""
        return 1.0 - len(self._free) / self.num_blocks
