"""Leases that follow progress: the decode-side Lease, renewals over the real KV control port, and
the prefill-side LeaseKeeper that renews while work goes on and stops the work once the lease is lost."""
from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from inference.kv_transfer import KVLayout, KVTransferError, TransferDescriptor, TransferStats
from inference.kv_transfer.keeper import LeaseKeeper
from inference.kv_transfer.lease import Lease, LeaseLost, request_renewal
from inference.kv_transfer.tcp import TcpKVReceiver, TcpKVSender

LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
SECRET = "s3cret"


def make_kv(num_blocks: int) -> torch.Tensor:
    shape = (num_blocks, LAYOUT.num_layers, 2, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.randn(shape)


def start_receiver(**kwargs: Any) -> tuple[TcpKVReceiver, list[tuple[str, int, TransferStats]]]:
    received: list[tuple[str, int, TransferStats]] = []
    receiver = TcpKVReceiver(
        torch.zeros_like(make_kv(8)), LAYOUT, lambda *item: received.append(item), bind_host="127.0.0.1",
        secret=SECRET, **kwargs,
    )
    receiver.start()
    return receiver, received


@pytest.fixture
def receiver() -> Iterator[TcpKVReceiver]:
    r, _ = start_receiver()
    yield r
    r.stop()


def reserve(receiver: TcpKVReceiver, request_id: str, lease_s: float) -> TransferDescriptor:
    desc = receiver.expect(request_id, [1, 2], num_tokens=8, lease_s=lease_s, host="127.0.0.1")
    return TransferDescriptor.from_dict(desc.to_dict())  # through JSON, as via the router


def renew(desc: TransferDescriptor, stage: str = "computing", secret: str = SECRET) -> float:
    return request_renewal(desc, secret=secret, stage=stage, holder="http://prefill:1", timeout=2)


# --------------------------------------------------------------------------- Lease
def test_lease_renewal_extends_from_now_up_to_the_cap() -> None:
    lease = Lease(0.6, max_multiple=2)  # cap: 1.2 s after the reservation
    assert lease.renewals == 0 and lease.last_progress is None
    time.sleep(0.3)
    assert lease.renew("computing", "p") == pytest.approx(0.6, abs=0.05)  # a full lease from now
    assert lease.last_progress is not None and lease.last_progress.stage == "computing"
    assert lease.silent_s() < 0.05
    time.sleep(0.3)
    lease.renew("nonsense", "p")
    assert lease.last_progress.stage == "unknown"  # only known stages are quoted back
    time.sleep(0.3)
    lease.renew("sending", "p")  # 0.9 s in: the cap cuts the extension short
    assert lease.remaining() == pytest.approx(lease.cap_remaining(), abs=0.01)
    assert lease.remaining() < 0.6 - 0.05
    time.sleep(max(lease.cap_remaining(), 0) + 0.05)
    with pytest.raises(LeaseLost, match="expired"):  # it ran out at the cap: no renewal revives it
        lease.renew("sending", "p")
    assert lease.expired and lease.renewals == 3


def test_lease_cap_refuses_renewal_even_while_alive() -> None:
    lease = Lease(10, max_multiple=1)  # cap == the lease itself
    lease._expires_at = lease.cap_at + 5  # noqa: SLF001  an expiry past the cap (cannot come from renew)
    lease.cap_at = time.monotonic() - 0.01
    with pytest.raises(LeaseLost, match="cap"):
        lease.renew("computing", "p")


def test_lease_expires_only_when_due_and_then_for_good() -> None:
    lease = Lease(0.2)
    assert not lease.expire()
    time.sleep(0.25)
    assert lease.expire() and lease.expired
    with pytest.raises(LeaseLost):
        lease.renew("computing", "p")
    facts = lease.describe()
    assert facts["renewals"] == 0 and facts["last_progress"] is None and facts["silent_s"] >= 0.2
    assert "no prefill worker reported progress" in lease.expiry_message()


def test_expiry_message_names_the_silent_prefill_and_its_last_progress() -> None:
    lease = Lease(0.2)
    lease.renew("prefilled", "http://10.0.0.7:30001")
    time.sleep(0.25)
    assert lease.expire()
    message = lease.expiry_message()
    assert re.match(r"prefill worker http://10\.0\.0\.7:30001 made no progress for \d+\.\ds \(lease 0\.2s;", message)
    assert "last progress: prefilled" in message and "1 renewal " in message
    assert lease.describe()["last_progress"]["stage"] == "prefilled"


# --------------------------------------------------------------------------- renewals over TCP
def test_descriptor_carries_the_lease_period_and_cap(receiver: TcpKVReceiver) -> None:
    desc = reserve(receiver, "d", 2.0)
    assert desc.renewable() and desc.lease_s == 2.0
    assert desc.lease_cap_remaining() == pytest.approx(2.0 * 20, abs=0.5)
    legacy = desc.to_dict()
    del legacy["lease_s"], legacy["lease_cap_at"]  # a decode worker from before renewals
    old = TransferDescriptor.from_dict(legacy)
    assert not old.renewable() and old.lease_cap_remaining() == pytest.approx(old.lease_remaining(), abs=0.01)
    for bad in ({"lease_s": "inf"}, {"lease_s": -1}, {"lease_cap_at": time.time() + 10**9}, {"lease_s": None}):
        with pytest.raises(ValueError, match="lease|malformed"):
            TransferDescriptor.from_dict({**desc.to_dict(), **bad})


def test_renewal_keeps_the_reservation_past_its_first_lease(receiver: TcpKVReceiver) -> None:
    desc = reserve(receiver, "r", 1.0)
    lease = receiver.lease("r")
    assert lease is not None
    for _ in range(4):  # 1.6 s in all: more than one and a half leases
        time.sleep(0.4)
        assert renew(desc) == pytest.approx(1.0, abs=0.1)
        assert desc.lease_remaining() == pytest.approx(1.0, abs=0.1)  # the descriptor follows
    assert not lease.expire() and lease.renewals == 4
    assert lease.last_progress is not None and lease.last_progress.holder == "http://prefill:1"
    # The blocks are still reserved for the holder: the KV lands.
    sender = TcpKVSender(make_kv(4), LAYOUT, secret=SECRET)
    assert sender.send(desc, [0, 1], first_token=5, timeout=5).nbytes == 2 * LAYOUT.block_nbytes
    assert receiver.lease("r") is None  # arrived: nothing left to renew
    with pytest.raises(LeaseLost, match="unknown or expired"):
        renew(desc)


def test_only_the_descriptor_holder_with_the_secret_can_renew(receiver: TcpKVReceiver) -> None:
    desc = reserve(receiver, "h", 5)
    forged = TransferDescriptor.from_dict({**desc.to_dict(), "token": "0" * 32})
    with pytest.raises(LeaseLost, match="bad transfer token"):
        renew(forged)
    with pytest.raises(LeaseLost, match="bad shared secret"):
        renew(desc, secret="wrong")
    with pytest.raises(LeaseLost, match="unknown or expired"):
        renew(TransferDescriptor.from_dict({**desc.to_dict(), "request_id": "other"}))
    lease = receiver.lease("h")
    assert lease is not None and lease.renewals == 0
    receiver.cancel("h")  # aborted: the lease is gone with it
    with pytest.raises(LeaseLost, match="unknown or expired"):
        renew(desc)


def test_renewal_after_expiry_is_refused_and_so_is_a_late_write(receiver: TcpKVReceiver) -> None:
    desc = reserve(receiver, "late", 0.2)
    time.sleep(0.3)
    with pytest.raises(LeaseLost, match="expired"):
        renew(desc)
    # A prefill host whose clock runs behind still thinks the lease is alive: decode refuses.
    desc.lease_expires_at = time.time() + 10
    sender = TcpKVSender(make_kv(4), LAYOUT, secret=SECRET)
    with pytest.raises(KVTransferError, match="lease of request 'late' expired"):
        sender.send(desc, [0, 1], first_token=5, timeout=5)


def test_renewing_an_unreachable_decode_is_a_transfer_error(receiver: TcpKVReceiver) -> None:
    desc = reserve(receiver, "u", 5)
    receiver.stop()
    time.sleep(0.6)  # the accept loop notices stop() within 0.5 s
    with pytest.raises(KVTransferError, match="cannot renew"):
        renew(desc)


# --------------------------------------------------------------------------- LeaseKeeper
def keeper_for(desc: TransferDescriptor, stages: list[str] | None = None) -> LeaseKeeper:
    stage_log = stages if stages is not None else []

    def stage() -> str:
        stage_log.append("computing")
        return "computing"

    return LeaseKeeper(desc, secret=SECRET, holder="http://prefill:2", stage=stage)


def test_keeper_keeps_a_slow_prefill_alive_and_a_fast_one_sends_nothing(receiver: TcpKVReceiver) -> None:
    slow, fast = reserve(receiver, "slow", 0.9), reserve(receiver, "fast", 0.9)

    async def guarded(desc: TransferDescriptor, seconds: float) -> float:
        keeper = keeper_for(desc)
        keeper.start()  # as the prefill worker does: from acceptance until the send has finished
        try:
            return await keeper.guard(asyncio.sleep(seconds, seconds))
        finally:
            keeper.stop()

    async def run() -> list[float]:
        return list(await asyncio.gather(guarded(slow, 3.0), guarded(fast, 0.05)))  # 3 s: over 3 leases

    slow_lease, fast_lease = receiver.lease("slow"), receiver.lease("fast")
    assert asyncio.run(run()) == [3.0, 0.05]
    assert slow_lease is not None and not slow_lease.expire()  # alive 3 s into a 0.9 s lease
    renewals = slow_lease.renewals
    assert renewals >= 5  # one per 0.3 s (a third of the lease)
    time.sleep(0.4)
    assert slow_lease.renewals == renewals, "a stopped keeper renews no more"
    assert slow_lease.last_progress is not None and slow_lease.last_progress.holder == "http://prefill:2"
    assert fast_lease is not None and fast_lease.renewals == 0  # a fast prefill costs no renewal


def test_keeper_stops_the_work_when_decode_gives_the_lease_up(receiver: TcpKVReceiver) -> None:
    desc = reserve(receiver, "gone", 0.6)
    cancelled = asyncio.Event()

    async def work() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    async def run() -> float:
        keeper = keeper_for(desc)
        keeper.start()
        started = time.monotonic()
        asyncio.get_running_loop().call_later(0.1, receiver.cancel, "gone")  # e.g. the router aborted
        try:
            with pytest.raises(LeaseLost, match="unknown or expired"):
                await keeper.guard(work())
        finally:
            keeper.stop()
        assert cancelled.is_set(), "the guarded work was cancelled"
        return time.monotonic() - started

    assert asyncio.run(run()) < 1.0  # at the first renewal (0.2 s), not at the end of the work


def test_keeper_gives_up_at_the_cap(receiver: TcpKVReceiver) -> None:
    capped, _ = start_receiver(max_lease_multiple=2)
    try:
        desc = reserve(capped, "cap", 0.3)

        async def run() -> float:
            keeper = keeper_for(desc)
            keeper.start()
            started = time.monotonic()
            try:
                with pytest.raises(LeaseLost):
                    await keeper.guard(asyncio.sleep(5))
            finally:
                keeper.stop()
            return time.monotonic() - started

        assert 0.5 < asyncio.run(run()) < 1.5  # the cap is 0.6 s after the reservation
    finally:
        capped.stop()


def test_keeper_loses_an_unreachable_decode_once_the_lease_has_run_out(receiver: TcpKVReceiver) -> None:
    desc = reserve(receiver, "far", 0.6)
    receiver.stop()
    time.sleep(0.55)  # the port is closed; 0.05 s of the lease left

    async def run() -> float:
        keeper = keeper_for(desc)
        keeper.start()
        started = time.monotonic()
        try:
            with pytest.raises(LeaseLost, match="could not renew"):
                await keeper.guard(asyncio.sleep(5))
        finally:
            keeper.stop()
        return time.monotonic() - started

    assert asyncio.run(run()) < 1.0


def test_keeper_leaves_a_descriptor_without_renewals_alone(receiver: TcpKVReceiver) -> None:
    legacy = reserve(receiver, "legacy", 0.3).to_dict()
    legacy.pop("lease_s")
    desc = TransferDescriptor.from_dict(legacy)

    async def run() -> str:
        keeper = keeper_for(desc)
        keeper.start()
        try:
            return await keeper.guard(asyncio.sleep(0.5, "done"))
        finally:
            keeper.stop()

    assert asyncio.run(run()) == "done"
    lease = receiver.lease("legacy")
    assert lease is not None and lease.renewals == 0 and lease.expire()
