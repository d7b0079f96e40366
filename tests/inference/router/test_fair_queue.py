"""The admission queue's order: priority classes first, tenants of a class in turn, FIFO per tenant;
and Admission serving a flood and a normal tenant from one decode slot."""
from __future__ import annotations

import asyncio
import time

from inference.router import Admission, WorkerPool
from inference.router.fair_queue import FairQueue


def drain(queue: FairQueue[str], where: dict[str, tuple[str, int]]) -> list[str]:
    """Serve the queue to its end, the way Admission does (head, then removed as served)."""
    order: list[str] = []
    for _ in range(len(queue)):
        item = queue.head()
        assert item is not None
        tenant, priority = where[item]
        assert queue.remove(item, tenant, priority, served=True)
        order.append(item)
    assert queue.head() is None and len(queue) == 0
    return order


def test_tenants_of_a_class_take_turns_and_each_keeps_its_order() -> None:
    queue: FairQueue[str] = FairQueue()
    where: dict[str, tuple[str, int]] = {}
    for i in range(6):  # the flood arrives first
        where[f"flood{i}"] = ("flood", 0)
        queue.push(f"flood{i}", "flood", 0)
    for i in range(2):
        where[f"calm{i}"] = ("calm", 0)
        queue.push(f"calm{i}", "calm", 0)
    assert drain(queue, where) == ["flood0", "calm0", "flood1", "calm1", "flood2", "flood3", "flood4", "flood5"]


def test_a_higher_class_is_served_first_whatever_arrived_before() -> None:
    queue: FairQueue[str] = FairQueue()
    where = {"b0": ("batch", 1), "b1": ("batch", 1), "i0": ("web", 0), "i1": ("app", 0)}
    for item, (tenant, priority) in where.items():
        queue.push(item, tenant, priority)
    assert queue.tenants() == {0: {"web": 1, "app": 1}, 1: {"batch": 2}}
    assert drain(queue, where) == ["i0", "i1", "b0", "b1"]


def test_a_waiter_that_leaves_does_not_end_its_tenants_turn() -> None:
    queue: FairQueue[str] = FairQueue()
    for item, tenant in [("a0", "a"), ("a1", "a"), ("b0", "b")]:
        queue.push(item, tenant)
    assert queue.remove("a0", "a")  # timed out, not served: "a" keeps its turn
    assert queue.head() == "a1"
    assert not queue.remove("a0", "a")  # gone already
    assert not queue.remove("x", "nobody", 3)
    assert len(queue) == 2


def test_admission_gives_a_calm_tenant_the_next_slot_behind_a_flood() -> None:
    """One decode slot, a tenant with 8 queued requests, then another tenant's one request: the second
    tenant is served second, not ninth."""
    pool = WorkerPool(["http://127.0.0.1:31000"], ["http://127.0.0.1:31001"], "round-robin", health_interval_s=0)
    for endpoint in pool.all_endpoints():
        endpoint.record_health(True, {"status": "healthy", "role": "decode", "batch_size": 1}, None)
    (decode,) = pool.endpoints("decode")
    decode.slots = 1
    admission = Admission(pool, queue_timeout_s=10)
    served: list[str] = []

    async def request(name: str, tenant: str, priority: int = 0) -> None:
        endpoint = await admission.acquire(time.monotonic() + 10, tenant=tenant, priority=priority)
        assert endpoint is decode
        served.append(name)
        await asyncio.sleep(0)  # hold the slot for a moment
        admission.release(endpoint)

    async def run() -> None:
        holder = await admission.acquire(time.monotonic() + 1, tenant="flood")
        assert holder is decode
        tasks = [asyncio.create_task(request(f"flood{i}", "flood")) for i in range(8)]
        await asyncio.sleep(0.01)
        tasks.append(asyncio.create_task(request("calm", "calm")))
        tasks.append(asyncio.create_task(request("batch", "nightly", priority=1)))
        await asyncio.sleep(0.01)
        assert admission.queued == 10
        admission.release(holder)
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)

    asyncio.run(run())
    assert served[:2] == ["flood0", "calm"]
    assert served[-1] == "batch"  # the batch class waits for the interactive one
    assert sorted(served[2:-1]) == [f"flood{i}" for i in range(1, 8)]
