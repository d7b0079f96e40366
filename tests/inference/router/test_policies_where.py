"""`choose_where`: each policy picks among the endpoints a test accepts, as `choose` would among a list
of just those, without the list."""
from __future__ import annotations

import collections
import random

import pytest

from inference.router.endpoint import Endpoint
from inference.router.policies import LeastConnections, PowerOfTwo, RoundRobin, make_policy, policy_names


def endpoints(n: int) -> list[Endpoint]:
    return [Endpoint(url=f"http://10.0.1.{i}:8000", role="decode") for i in range(1, n + 1)]


def test_round_robin_walks_on_from_its_cursor_past_refused_ones() -> None:
    eps = endpoints(5)
    refused = {eps[1], eps[2]}
    policy = RoundRobin()
    picks = [policy.choose_where(eps, lambda e: e not in refused) for _ in range(6)]
    assert picks == [eps[0], eps[3], eps[4]] * 2


def test_least_connections_takes_the_least_loaded_accepted_one_and_spreads_ties() -> None:
    eps = endpoints(4)
    for endpoint, inflight in zip(eps, [0, 1, 1, 3], strict=True):
        endpoint.inflight = inflight
    policy = LeastConnections()
    picks = {policy.choose_where(eps, lambda e: e is not eps[0]) for _ in range(4)}
    assert picks == {eps[1], eps[2]}  # eps[0] is idler but refused; the two with 1 share


def test_power_of_two_never_picks_a_refused_or_the_most_loaded_accepted_one() -> None:
    eps = endpoints(6)
    for i, endpoint in enumerate(eps):
        endpoint.inflight = i
    refused = {eps[0], eps[1]}
    policy = PowerOfTwo(random.Random(3))
    picks = collections.Counter(policy.choose_where(eps, lambda e: e not in refused) for _ in range(400))
    assert set(picks) <= {eps[2], eps[3], eps[4]}
    # The least loaded accepted one wins every pair it is drawn in: 3 of the 6 pairs of 4 endpoints.
    assert 0.35 < picks[eps[2]] / 400 < 0.65


def test_power_of_two_finds_the_only_accepted_ones_of_a_mostly_refused_list() -> None:
    eps = endpoints(64)
    policy = PowerOfTwo(random.Random(5))
    assert all(policy.choose_where(eps, lambda e: e is eps[40]) is eps[40] for _ in range(20))
    eps[7].inflight, eps[50].inflight = 2, 1
    assert all(policy.choose_where(eps, lambda e: e in (eps[7], eps[50])) is eps[50] for _ in range(20))


@pytest.mark.parametrize("name", policy_names())
def test_none_when_nothing_is_accepted(name: str) -> None:
    policy = make_policy(name)
    assert policy.choose_where(endpoints(3), lambda e: False) is None
    assert policy.choose_where([], lambda e: True) is None
