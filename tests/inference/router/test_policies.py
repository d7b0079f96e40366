"""Load-balancing policies and their registry."""
from __future__ import annotations

import random

import pytest

from inference.router.endpoint import Endpoint
from inference.router.policies import (
    LeastConnections,
    PowerOfTwo,
    RoundRobin,
    canonical_policy_name,
    make_policy,
    policy_names,
)


def endpoints(n: int) -> list[Endpoint]:
    return [Endpoint(url=f"http://10.0.0.{i}:8000", role="decode") for i in range(1, n + 1)]


def test_round_robin_alternates() -> None:
    a, b = endpoints(2)
    policy = RoundRobin()
    assert [policy.choose([a, b]) for _ in range(4)] == [a, b, a, b]


def test_round_robin_cycles_three() -> None:
    eps = endpoints(3)
    policy = RoundRobin()
    assert [policy.choose(eps).url for _ in range(6)] == [e.url for e in eps] * 2


def test_least_connections_prefers_the_idle_one() -> None:
    busy, idle = endpoints(2)
    busy.inflight = 1
    policy = LeastConnections()
    assert all(policy.choose([busy, idle]) is idle for _ in range(5))


def test_least_connections_spreads_ties() -> None:
    a, b = endpoints(2)
    policy = LeastConnections()
    assert {policy.choose([a, b]).url for _ in range(4)} == {a.url, b.url}


def test_power_of_two_picks_the_less_loaded_of_two() -> None:
    a, b = endpoints(2)
    a.inflight, b.inflight = 5, 2
    policy = PowerOfTwo(random.Random(7))
    assert all(policy.choose([a, b]) is b for _ in range(10))


def test_power_of_two_never_picks_the_most_loaded_of_many() -> None:
    eps = endpoints(4)
    for i, endpoint in enumerate(eps):
        endpoint.inflight = i
    policy = PowerOfTwo(random.Random(1))
    picks = [policy.choose(eps) for _ in range(50)]
    assert eps[3] not in picks  # it loses against whichever other one is sampled
    assert eps[0] in picks


def test_single_candidate_and_empty() -> None:
    (only,) = endpoints(1)
    for name in policy_names():
        policy = make_policy(name)
        assert policy.choose([only]) is only
        with pytest.raises(ValueError):
            policy.choose([])


def test_registry_names_and_aliases() -> None:
    assert policy_names() == ["kv-aware", "least-connections", "power-of-two", "round-robin"]
    assert canonical_policy_name("Least_Connections") == "least-connections"
    assert isinstance(make_policy("power-of-two"), PowerOfTwo)


def test_unknown_policy_lists_valid_names() -> None:
    with pytest.raises(ValueError) as info:
        make_policy("random")
    message = str(info.value)
    assert "'random'" in message
    for name in policy_names():
        assert name in message
