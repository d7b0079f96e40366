"""Load-balancing policies: which of the candidate workers gets the next request.

A policy only chooses; the pool decides who the candidates are (in rotation, not yet tried by this
request). Each pool role has its own policy instance, so round-robin cycles prefill and decode
independently.
"""
from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from inference.router.endpoint import Endpoint


class Policy(Protocol):
    """Chooses one endpoint among candidates (a non-empty sequence)."""

    name: str

    def choose(self, candidates: Sequence[Endpoint]) -> Endpoint:
        """Return one of `candidates`; raises ValueError when there are none."""
        ...


def _require(candidates: Sequence[Endpoint]) -> None:
    if not candidates:
        raise ValueError("no candidate endpoints to choose from")


class RoundRobin:
    """Cycles through the candidates in order."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0
        # Gunicorn's uvicorn workers are single threaded, but a lock keeps the counter exact if a
        # pool is ever shared with threads (tests, management commands).
        self._lock = threading.Lock()

    def choose(self, candidates: Sequence[Endpoint]) -> Endpoint:
        """The next candidate in turn."""
        _require(candidates)
        with self._lock:
            index = self._next % len(candidates)
            self._next += 1
        return candidates[index]


class LeastConnections:
    """The candidate with the fewest requests in flight; ties go round-robin so idle workers share."""

    name = "least-connections"

    def __init__(self) -> None:
        self._tiebreak = RoundRobin()

    def choose(self, candidates: Sequence[Endpoint]) -> Endpoint:
        """The least loaded candidate."""
        _require(candidates)
        fewest = min(endpoint.inflight for endpoint in candidates)
        return self._tiebreak.choose([e for e in candidates if e.inflight == fewest])


class PowerOfTwo:
    """Power of two choices: sample two candidates at random, the one with fewer in flight wins.

    Nearly as good as least-connections at spreading load, without herding every router process
    onto the same momentarily idle worker.
    """

    name = "power-of-two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Endpoint]) -> Endpoint:
        """The less loaded of two random candidates (the only one when there is one)."""
        _require(candidates)
        if len(candidates) == 1:
            return candidates[0]
        first, second = self._rng.sample(list(candidates), 2)
        return second if second.inflight < first.inflight else first


POLICIES: dict[str, Callable[[], Policy]] = {
    RoundRobin.name: RoundRobin,
    LeastConnections.name: LeastConnections,
    PowerOfTwo.name: PowerOfTwo,
}


def policy_names() -> list[str]:
    """The valid policy names, sorted."""
    return sorted(POLICIES)


def canonical_policy_name(name: str) -> str:
    """The registry name for `name` (case and `_`/`-` insensitive); ValueError listing valid names."""
    key = name.strip().lower().replace("_", "-")
    if key not in POLICIES:
        raise ValueError(
            f"unknown load-balancing policy {name!r}; valid policies: {', '.join(policy_names())}"
        )
    return key


def make_policy(name: str) -> Policy:
    """A new policy instance by name; ValueError listing the valid names for an unknown one."""
    return POLICIES[canonical_policy_name(name)]()
