"""A pinned choice (n > 1) takes choice 0's decode and prefill workers when it can, and is routed as any
request when the pinned worker is full, backing off, tried already, out of rotation or gone."""
from __future__ import annotations

import asyncio
import time

from inference.router import Admission, Endpoint, WorkerPool
from inference.router.attempt import Attempt
from inference.router.pin import Pin

PREFILL = ["http://127.0.0.1:31100", "http://127.0.0.1:31101"]
DECODE = ["http://127.0.0.1:31001", "http://127.0.0.1:31002"]


def pool_of() -> WorkerPool:
    pool = WorkerPool(PREFILL, DECODE, "round-robin", health_interval_s=0)
    for endpoint in pool.all_endpoints():
        endpoint.record_health(True, {"status": "healthy", "batch_size": 2}, None)
    return pool


def acquire(admission: Admission, pin: Pin | None, exclude: list[Endpoint] | None = None) -> Endpoint | None:
    return asyncio.run(admission.acquire(time.monotonic() + 0.05, exclude=exclude or [], pin=pin))


def pinned_to_second(pool: WorkerPool) -> Pin:
    pin = Pin()
    pin.record(Attempt(request_id="r", decode=pool.endpoints("decode")[1], prefill=pool.endpoints("prefill")[1]))
    return pin


def test_record_keeps_the_first_attempt() -> None:
    pool = pool_of()
    pin = pinned_to_second(pool)
    pin.record(Attempt(request_id="r2", decode=pool.endpoints("decode")[0]))
    assert pin.decode is pool.endpoints("decode")[1] and pin.prefill is pool.endpoints("prefill")[1]


def test_admission_takes_the_pinned_decode_worker_while_it_has_a_slot() -> None:
    pool = pool_of()
    admission = Admission(pool, queue_timeout_s=0.05)
    first, second = pool.endpoints("decode")
    pin = pinned_to_second(pool)
    slots = second.slots
    assert slots is not None
    # Round-robin would alternate; the pin keeps every choice on the second worker while it has room.
    assert [acquire(admission, pin) for _ in range(slots)] == [second] * slots
    assert second.inflight == slots
    assert acquire(admission, pin) is first  # full: the usual routing
    admission.release(second)
    assert acquire(admission, pin) is second
    assert acquire(admission, pin, exclude=[second]) is first  # it failed this choice already


def test_a_pinned_worker_out_of_rotation_or_gone_is_passed_over() -> None:
    pool = pool_of()
    admission = Admission(pool, queue_timeout_s=0.05)
    first, second = pool.endpoints("decode")
    pin = pinned_to_second(pool)
    second.record_health(False, None, "connection refused")
    assert acquire(admission, pin) is first
    second.record_health(True, {"status": "healthy", "batch_size": 2}, None)
    assert acquire(admission, pin) is second
    admission.release(second)
    pool.set_endpoints("decode", [DECODE[0]])  # scaled in: the pinned object is no longer in the pool
    assert acquire(admission, pin) is pool.endpoints("decode")[0]


def test_prefill_pick_follows_the_pin_unless_tried() -> None:
    pool = pool_of()
    pin = pinned_to_second(pool)
    rotation = pool.in_rotation("prefill")
    assert pin.prefill_in(rotation, lambda e: True) is pool.endpoints("prefill")[1]
    assert pin.prefill_in(rotation, lambda e: e is not pool.endpoints("prefill")[1]) is None
    assert Pin().prefill_in(rotation, lambda e: True) is None  # nothing recorded: no preference
