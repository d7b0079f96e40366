"""Admission and the pool read kept state (each endpoint's slots, the list in rotation): every change
that should move a request elsewhere must reach them — a health answer, a health flip, a back-off,
`set_endpoints`, a new default batch size."""
from __future__ import annotations

import asyncio
import time

import pytest

from inference.router import Admission, Endpoint, RouterError, WorkerPool
from inference.router.admission import slots_for
from inference.router.policies import policy_names

DECODE = ["http://127.0.0.1:31001", "http://127.0.0.1:31002"]


def healthy_answer(batch_size: int | None = 4) -> dict[str, object]:
    answer: dict[str, object] = {"status": "healthy", "role": "decode"}
    if batch_size is not None:
        answer["batch_size"] = batch_size
    return answer


def pool_of(urls: list[str], policy: str = "round-robin", batch_size: int | None = 4) -> WorkerPool:
    pool = WorkerPool(["http://127.0.0.1:31000"], urls, policy, health_interval_s=0)
    for endpoint in pool.all_endpoints():
        endpoint.record_health(True, healthy_answer(batch_size), None)
    return pool


def take(admission: Admission, n: int, exclude: list[Endpoint] | None = None) -> list[Endpoint | None]:
    """`n` acquires in a row without releasing (a deadline 50 ms away: a full pool answers 429)."""

    async def run() -> list[Endpoint | None]:
        out: list[Endpoint | None] = []
        for _ in range(n):
            out.append(await admission.acquire(time.monotonic() + 0.05, exclude=exclude or []))
        return out

    return asyncio.run(run())


def test_slots_come_from_the_health_answer_and_follow_a_new_one() -> None:
    pool = pool_of(DECODE[:1], batch_size=4)
    admission = Admission(pool, queue_timeout_s=0.05)
    (endpoint,) = pool.endpoints("decode")
    assert endpoint.slots == slots_for(4) == 5
    assert admission.capacity() == 5
    assert take(admission, 5) == [endpoint] * 5
    with pytest.raises(RouterError) as info:
        take(admission, 1)
    assert info.value.status == 429
    endpoint.record_health(True, healthy_answer(8), None)  # the worker restarted with a larger batch
    assert endpoint.slots == 10 and admission.capacity() == 10
    assert take(admission, 5) == [endpoint] * 5


def test_the_default_batch_size_applies_until_a_worker_reports_one() -> None:
    pool = pool_of(DECODE[:1], batch_size=None)
    admission = Admission(pool, queue_timeout_s=0.05, default_batch_size=2)
    (endpoint,) = pool.endpoints("decode")
    assert endpoint.slots == 0 and endpoint.batch_size() is None
    assert admission.limit(endpoint) == slots_for(2) == 3
    admission.default_batch_size = 4
    assert admission.limit(endpoint) == 5 and admission.capacity() == 5
    with pytest.raises(ValueError):
        admission.default_batch_size = 0
    endpoint.record_health(True, healthy_answer(16), None)
    assert admission.limit(endpoint) == 20


@pytest.mark.parametrize("policy", policy_names())
def test_a_health_flip_moves_requests_at_once(policy: str) -> None:
    pool = pool_of(DECODE, policy)
    admission = Admission(pool, queue_timeout_s=0.05)
    a, b = pool.endpoints("decode")
    assert pool.in_rotation("decode") == [a, b]
    a.record_health(False, {"status": "unhealthy"}, "draining")
    assert pool.in_rotation("decode") == [b]
    picks = take(admission, 5)
    assert picks == [b] * 5
    for endpoint in picks:
        assert endpoint is not None
        admission.release(endpoint)
    a.record_health(True, healthy_answer(), None)
    assert pool.in_rotation("decode") == [a, b]
    assert a in take(admission, 10)


def test_request_failures_and_health_timeouts_take_an_endpoint_out_of_the_kept_list() -> None:
    pool = pool_of(DECODE)
    a, b = pool.endpoints("decode")
    assert pool.in_rotation("decode") == [a, b]
    for _ in range(pool.failure_threshold):
        pool.record_failure(a, "connection refused")
    assert pool.in_rotation("decode") == [b]
    a.record_health(True, healthy_answer(), None)
    for _ in range(pool.failure_threshold):
        b.record_health_timeout("no answer", pool.failure_threshold)
    assert pool.in_rotation("decode") == [a]
    a.healthy = False  # none in rotation: panic mode lists all of them
    assert pool.in_rotation("decode") == [a, b]


@pytest.mark.parametrize("policy", policy_names())
def test_a_back_off_passes_the_endpoint_over_until_a_release(policy: str) -> None:
    pool = pool_of(DECODE, policy)
    admission = Admission(pool, queue_timeout_s=0.05)
    a, b = pool.endpoints("decode")
    admission.mark_full(a)  # a answered 429
    assert take(admission, 5) == [b] * 5  # b's five slots; a is backing off
    with pytest.raises(RouterError):
        take(admission, 1)
    admission.release(a)  # one of a's requests ended: its back-off is over
    assert take(admission, 1) == [a]


@pytest.mark.parametrize("policy", policy_names())
def test_excluded_endpoints_are_never_chosen(policy: str) -> None:
    pool = pool_of(DECODE, policy)
    admission = Admission(pool, queue_timeout_s=0.05)
    a, b = pool.endpoints("decode")
    assert take(admission, 5, exclude=[a]) == [b] * 5
    assert take(admission, 1, exclude=[a, b]) == [None]  # nothing left to try
    assert pool.choose("decode", exclude=[b]) is a
    assert pool.choose("decode", exclude=[a, b]) is None


def test_set_endpoints_rebuilds_the_kept_list() -> None:
    pool = pool_of(DECODE)
    admission = Admission(pool, queue_timeout_s=0.05)
    a, b = pool.endpoints("decode")
    before = pool.in_rotation("decode")
    assert before == [a, b] and pool.in_rotation("decode") is before  # kept, not rebuilt
    pool.set_endpoints("decode", [DECODE[1], "http://127.0.0.1:31003"])
    kept, added = pool.endpoints("decode")
    assert kept is b
    assert pool.in_rotation("decode") == [b, added]
    picks = take(admission, 6)
    assert a not in picks and added in picks
    assert added.slots == 0 and admission.limit(added) == slots_for(admission.default_batch_size)
