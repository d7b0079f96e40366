"""The admission queue's order: priority classes first, then a fair share between tenants of a class.

A class with a lower number (0: interactive) is always served before a higher one (1: batch). Inside a
class, tenants (API keys) take turns, one request each: deficit round robin with a quantum of one
request, since every request costs the same here (one decode slot). A tenant that sends a flood
therefore waits behind its own requests only: another tenant's request is at most one turn away.
Within a tenant, first come first served.
"""
from __future__ import annotations

import collections
from typing import Generic, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    """Waiting items by (priority, tenant); `head` is the one to serve next. Not thread safe."""

    def __init__(self) -> None:
        self._classes: dict[int, collections.OrderedDict[str, collections.deque[T]]] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push(self, item: T, tenant: str = "", priority: int = 0) -> None:
        """Queue `item` last among its tenant's items; a tenant new to the class takes the last turn."""
        tenants = self._classes.setdefault(priority, collections.OrderedDict())
        queue = tenants.get(tenant)
        if queue is None:
            queue = tenants[tenant] = collections.deque()
        queue.append(item)
        self._size += 1

    def head(self) -> T | None:
        """The item to serve next: the highest class's tenant whose turn it is, its oldest item."""
        if not self._size:
            return None
        for priority in sorted(self._classes):
            tenants = self._classes[priority]
            if tenants:
                return next(iter(tenants.values()))[0]
        return None  # pragma: no cover - _size says there is one

    def remove(self, item: T, tenant: str = "", priority: int = 0, *, served: bool = False) -> bool:
        """Take `item` out of the queue; with `served`, its tenant's turn ends (it goes to the back of
        its class). Returns whether the item was queued."""
        tenants = self._classes.get(priority)
        queue = tenants.get(tenant) if tenants is not None else None
        if tenants is None or queue is None:
            return False
        try:
            queue.remove(item)
        except ValueError:
            return False
        self._size -= 1
        if not queue:
            del tenants[tenant]
            if not tenants:
                del self._classes[priority]
        elif served:
            tenants.move_to_end(tenant)
        return True

    def tenants(self) -> dict[int, dict[str, int]]:
        """Waiting items per class and tenant (for status pages and tests)."""
        return {p: {t: len(q) for t, q in tenants.items()} for p, tenants in sorted(self._classes.items())}
