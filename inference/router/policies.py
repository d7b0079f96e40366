"""Load-balancing policies: which of the candidate workers gets the next request.

A policy only chooses; the pool decides who the candidates are (in rotation, not yet tried by this
request). Each pool role has its own policy instance, so round-robin cycles prefill and decode
independently.

`choose` picks among a list of candidates; `choose_where` picks among the endpoints of a list that
pass a test (a free decode slot, not yet tried), without building the list of those that pass:
round-robin walks on from its cursor, power-of-two samples and re-samples a bounded number of times.
The router calls it per request on the pool's cached list of endpoints in rotation, so the common
case touches a few endpoints however many there are.
"""
from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from inference.router.endpoint import Endpoint
from inference.router.kv_index import CURRENT_PROMPT, PREDICTED_UNCACHED, KVIndex

# A test an endpoint must pass to be chosen (a free slot, not yet tried by the request).
Accept = Callable[[Endpoint], bool]
# Random draws power-of-two makes among all endpoints before it lists the accepted ones instead.
_SAMPLE_TRIES = 8


class Policy(Protocol):
    """Chooses one endpoint among candidates (a non-empty sequence)."""

    name: str

    def choose(self, candidates: Sequence[Endpoint]) -> Endpoint:
        """Return one of `candidates`; raises ValueError when there are none."""
        ...

    def choose_where(self, endpoints: Sequence[Endpoint], accept: Accept) -> Endpoint | None:
        """What `choose` would return among the `endpoints` that `accept` takes; None when it takes none."""
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

    def choose_where(self, endpoints: Sequence[Endpoint], accept: Accept) -> Endpoint | None:
        """The first accepted endpoint from the cursor on; the cursor moves past it."""
        n = len(endpoints)
        with self._lock:
            start = self._next
            for step in range(n):
                index = (start + step) % n
                endpoint = endpoints[index]
                if accept(endpoint):
                    self._next = index + 1
                    return endpoint
        return None


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

    def choose_where(self, endpoints: Sequence[Endpoint], accept: Accept) -> Endpoint | None:
        """The least loaded accepted endpoint (one pass over all of them: least needs every count)."""
        fewest: list[Endpoint] = []
        least = -1
        for endpoint in endpoints:
            inflight = endpoint.inflight
            if (least < 0 or inflight <= least) and accept(endpoint):
                if inflight != least:
                    fewest, least = [], inflight
                fewest.append(endpoint)
        return self._tiebreak.choose(fewest) if fewest else None


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
        n = len(candidates)
        if n == 1:
            return candidates[0]
        first, second = self._two_indexes(n)
        return self._better(candidates[first], candidates[second])

    def choose_where(self, endpoints: Sequence[Endpoint], accept: Accept) -> Endpoint | None:
        """The less loaded of two accepted endpoints drawn at random (uniformly, as `choose` among the
        accepted ones would): draws among all of them first, a list of the accepted ones only when a
        few draws in a row found none (a pool that is mostly full or tried)."""
        n = len(endpoints)
        rng = self._rng
        picked: list[Endpoint] = []
        for _ in range(_SAMPLE_TRIES):
            if n == 0:
                return None
            endpoint = endpoints[rng.randrange(n)]
            if (not picked or endpoint is not picked[0]) and accept(endpoint):
                picked.append(endpoint)
                if len(picked) == 2:
                    return self._better(picked[0], picked[1])
        accepted = [e for e in endpoints if accept(e)]
        if not accepted:
            return None
        if picked and len(accepted) > 1:  # one accepted draw already: its partner, uniformly
            others = [e for e in accepted if e is not picked[0]]
            return self._better(picked[0], others[rng.randrange(len(others))])
        return self.choose(accepted)

    def _two_indexes(self, n: int) -> tuple[int, int]:
        """Two distinct indexes below `n` (>= 2), uniformly."""
        first = self._rng.randrange(n)
        second = self._rng.randrange(n - 1)
        return first, second + 1 if second >= first else second

    @staticmethod
    def _better(first: Endpoint, second: Endpoint) -> Endpoint:
        return second if second.inflight < first.inflight else first


# A request in flight on a worker costs as much as computing this many prompt tokens there (default).
DEFAULT_KV_LOAD_WEIGHT = 64.0
# The decode choice's share of the token weight when prompts are prefilled remotely: a decode worker's
# cached prefix then saves only the KV transfer of those blocks, not their computation (SmolLM2 fp32:
# ~90 KB a token, tens of ms per 1,000 tokens over loopback TCP against most of a second of prefill).
DEFAULT_REMOTE_DECODE_SHARE = 1 / 16


class KVAware:
    """The worker with the least work ahead for this prompt: cost = `token_weight` x (the prompt's
    tokens the worker would still have to compute, from the KV index, + the prompt tokens it still
    prefills, `Endpoint.queued_tokens`) + `load_weight` x (its requests, `Endpoint.load`); the
    cheapest wins, ties at random (as Dynamo's KV router scores: prefill blocks, cached ones credited,
    plus the worker's active load). The load and queued tokens are what the worker itself reports on
    its KV event stream (every router process sees the same) plus what this router sent since the
    report; without a report, this router's own requests in flight.

    The prompt is the one the request being routed set (`kv_index.CURRENT_PROMPT`); without one, or
    with an index that knows nothing of the candidates (empty, stale, a worker's stream down), every
    candidate has the whole prompt to compute and the choice is by load alone. A stale entry costs
    nothing but a recomputation on the worker: the index only ever steers, never fails a request.
    """

    name = "kv-aware"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self.index = KVIndex()
        self.token_weight = 1.0
        self.load_weight = DEFAULT_KV_LOAD_WEIGHT
        # Called per choice: what a cached token saves on this role now, as a share of its computation
        # (the pool's decode policy: 1 when decode workers prefill, the transfer's share otherwise).
        self.token_share: Callable[[], float] | None = None
        # What the choices predicted, for /router/status and /metrics: prompt tokens routed and those
        # the chosen workers held the KV of.
        self.prompt_tokens = 0
        self.predicted_cached_tokens = 0

    def configure(self, index: KVIndex, token_weight: float, load_weight: float) -> None:
        """Read `index`, with these weights (both >= 0)."""
        if token_weight < 0 or load_weight < 0:
            raise ValueError("kv-aware weights must be >= 0")
        self.index, self.token_weight, self.load_weight = index, token_weight, load_weight

    def choose(self, candidates: Sequence[Endpoint]) -> Endpoint:
        """The cheapest candidate."""
        _require(candidates)
        chosen = self.choose_where(candidates, _any)
        assert chosen is not None
        return chosen

    def choose_where(self, endpoints: Sequence[Endpoint], accept: Accept) -> Endpoint | None:
        """The cheapest accepted endpoint (one pass over all of them)."""
        prompt = CURRENT_PROMPT.get()
        index, token_weight, load_weight = self.index, self.token_weight, self.load_weight
        if self.token_share is not None:
            token_weight *= self.token_share()
        total = prompt.total_tokens if prompt is not None else 0
        # Every worker's cached prefix of the prompt, from one walk over its blocks (the index is inverted).
        match = index.match(prompt) if prompt is not None else None
        held = match.get if match else None
        # The prompt's own tokens cost every worker the same before cached ones are taken off: left out.
        reach = token_weight * total  # the most a cached prefix takes off
        best: list[Endpoint] = []
        best_cost = 0.0
        for endpoint in endpoints:
            if not accept(endpoint):
                continue
            cost = token_weight * endpoint.queued_tokens() + load_weight * endpoint.load()
            if held is not None:
                # A worker that cannot reach the best cost even holding the whole prompt needs no lookup
                # (most of a large pool in use).
                if best and cost - reach > best_cost:
                    continue
                cost -= token_weight * held(endpoint.url, 0)
            if not best or cost < best_cost:
                best, best_cost = [endpoint], cost
            elif cost == best_cost:
                best.append(endpoint)
        if not best:
            return None
        chosen = best[0] if len(best) == 1 else best[self._rng.randrange(len(best))]
        if prompt is not None and match is not None:
            cached = match.get(chosen.url, 0)
            self.prompt_tokens += total
            self.predicted_cached_tokens += cached
            PREDICTED_UNCACHED.set(total - cached)
        return chosen


def _any(endpoint: Endpoint) -> bool:
    return True


POLICIES: dict[str, Callable[[], Policy]] = {
    RoundRobin.name: RoundRobin,
    LeastConnections.name: LeastConnections,
    PowerOfTwo.name: PowerOfTwo,
    KVAware.name: KVAware,
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
