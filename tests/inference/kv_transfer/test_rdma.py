"""The RDMA KV transport: real receiver/sender logic over the real TCP control channel, fake verbs.

This host has no RDMA, so a fake verbs layer stands in for the HCA: `post_write` copies bytes between
the registered tensors by address (checking keys and bounds like an HCA would), completions can fail,
and a stalled write never completes. A last test runs the same path on real hardware when present.
"""
from __future__ import annotations

import collections
import ctypes
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from inference.kv_transfer import KVLayout, KVTransferError, TransferDescriptor, TransferStats
from inference.kv_transfer.auth import authenticate
from inference.kv_transfer.lease import LeaseLost, request_renewal
from inference.kv_transfer.rdma import RdmaKVReceiver, RdmaKVSender
from inference.kv_transfer.rdma_detect import rdma_available
from inference.kv_transfer.verbs import (
    WC_REM_ACCESS_ERR,
    WC_RETRY_EXC_ERR,
    WC_SUCCESS,
    Completion,
    MemoryRegion,
    PyverbsVerbs,
    QPInfo,
    VerbsError,
    random_psn,
    tensor_span,
)
from inference.kv_transfer.wire import recv_frame, send_frame

LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")  # 1 KiB blocks
REPO = Path(__file__).resolve().parents[3]


def make_kv(num_blocks: int, fill: float | None = None) -> torch.Tensor:
    shape = (num_blocks, LAYOUT.num_layers, 2, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    if fill is None:
        return torch.randn(shape)
    return torch.full(shape, fill)


# --------------------------------------------------------------------------- fake verbs
class FakeFabric:
    """An in-process RDMA network: devices, queue pairs by number, and injectable failures."""

    def __init__(self, *, max_message_bytes: int = 1536, send_queue_depth: int = 2) -> None:
        self.max_message_bytes = max_message_bytes  # < 2 blocks: multi-block runs are split
        self.send_queue_depth = send_queue_depth  # small: the sender must reap before posting more
        self.lock = threading.Lock()
        self.qps: dict[int, FakeQP] = {}
        self.next_qpn = 0x100
        self.qps_created = 0
        self.posted = 0
        self.posted_event = threading.Event()
        self.fail_status: int | None = None  # every write completes with this error status
        self.stall = False  # writes are accepted but never complete

    def open_device(self, name: str) -> FakeDevice:
        return FakeDevice(self, name)


class FakeDevice:
    """A device: registered regions (tensor and address range) and queue pairs."""

    def __init__(self, fabric: FakeFabric, name: str) -> None:
        self.fabric = fabric
        self.name = name
        self.max_message_bytes = fabric.max_message_bytes
        self.send_queue_depth = fabric.send_queue_depth
        self.regions: list[tuple[MemoryRegion, torch.Tensor]] = []
        self.closed = False

    def reg_mr(self, tensor: torch.Tensor) -> MemoryRegion:
        addr, nbytes = tensor_span(tensor)
        key = random_psn()
        region = MemoryRegion(addr=addr, length=nbytes, lkey=key, rkey=key ^ 0x5A5A5A)
        self.regions.append((region, tensor))
        return region

    def allows(self, key: str, value: int, addr: int, length: int) -> bool:
        return any(getattr(r, key) == value and r.contains(addr, length) for r, _ in self.regions)

    def create_qp(self) -> FakeQP:
        return FakeQP(self)

    def close(self) -> None:
        self.closed = True


class FakeQP:
    """An RC queue pair: writes copy bytes into the peer's registered memory by address."""

    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.fabric = device.fabric
        with self.fabric.lock:
            self.qp_num = self.fabric.next_qpn
            self.fabric.next_qpn += 1
            self.fabric.qps[self.qp_num] = self
            self.fabric.qps_created += 1
        self.psn = random_psn()
        self.peer: FakeQP | None = None
        self.closed = False
        self.completions: collections.deque[Completion] = collections.deque()
        self.stalled: list[int] = []
        self.cond = threading.Condition()

    def info(self) -> QPInfo:
        return QPInfo(
            qp_num=self.qp_num, lid=1, gid="fe80:0000:0000:0000:0000:0000:0000:0001", psn=self.psn, port=1, mtu=5
        )

    def connect(self, remote: QPInfo) -> None:
        peer = self.fabric.qps.get(remote.qp_num)
        if peer is None or peer.psn != remote.psn:
            raise VerbsError(f"no queue pair {remote.qp_num} to connect to")
        self.peer = peer

    def _complete(self, wr_id: int, status: int, message: str = "") -> None:
        with self.cond:
            self.completions.append(Completion(wr_id, status, message))
            self.cond.notify_all()

    def post_write(
        self, local_addr: int, lkey: int, length: int, remote_addr: int, rkey: int, *, wr_id: int, signaled: bool
    ) -> None:
        if self.closed or self.peer is None:
            raise VerbsError("queue pair is not connected")
        with self.fabric.lock:
            self.fabric.posted += 1
        self.fabric.posted_event.set()
        peer = self.peer
        if self.fabric.stall:
            self.stalled.append(wr_id)
        elif self.fabric.fail_status is not None:
            self._complete(wr_id, self.fabric.fail_status, "retry exceeded error")
        elif peer.closed:
            self._complete(wr_id, WC_RETRY_EXC_ERR, "retry exceeded error")
        elif not self.device.allows("lkey", lkey, local_addr, length):
            self._complete(wr_id, 4, "local protection error")
        elif not peer.device.allows("rkey", rkey, remote_addr, length):
            self._complete(wr_id, WC_REM_ACCESS_ERR, "remote access error")
        else:
            ctypes.memmove(remote_addr, local_addr, length)
            if signaled:
                self._complete(wr_id, WC_SUCCESS)

    def poll(self, max_entries: int, timeout: float) -> list[Completion]:
        with self.cond:
            self.cond.wait_for(lambda: bool(self.completions), timeout=timeout)
            out: list[Completion] = []
            while self.completions and len(out) < max_entries:
                out.append(self.completions.popleft())
            return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with self.fabric.lock:
            self.fabric.qps.pop(self.qp_num, None)
            others = [qp for qp in self.fabric.qps.values() if qp.peer is self]
        # Like an HCA: writes in flight towards a destroyed QP end in RETRY_EXC_ERR at the sender.
        for qp in others:
            stalled, qp.stalled = qp.stalled, []
            for wr_id in stalled:
                qp._complete(wr_id, WC_RETRY_EXC_ERR, "retry exceeded error")


# --------------------------------------------------------------------------- fixtures
class Received:
    """Records what the receiver reported, like the decode server does."""

    def __init__(self) -> None:
        self.items: list[tuple[str, int, TransferStats]] = []

    def __call__(self, request_id: str, first_token: int, stats: TransferStats) -> None:
        self.items.append((request_id, first_token, stats))


@dataclass
class Pair:
    decode_kv: torch.Tensor
    prefill_kv: torch.Tensor
    receiver: RdmaKVReceiver
    sender: RdmaKVSender
    received: Received
    fabric: FakeFabric


@pytest.fixture
def fabric() -> FakeFabric:
    return FakeFabric()


@pytest.fixture
def pair(fabric: FakeFabric):
    decode_kv = make_kv(16, fill=0.0)
    prefill_kv = make_kv(8)
    received = Received()
    receiver = RdmaKVReceiver(
        decode_kv,
        LAYOUT,
        received,
        device=fabric.open_device("fake_decode"),
        bind_host="127.0.0.1",
        secret="s3cret",
        io_timeout=10,
    )
    receiver.start()
    sender = RdmaKVSender(prefill_kv, LAYOUT, device=fabric.open_device("fake_prefill"), secret="s3cret")
    yield Pair(decode_kv, prefill_kv, receiver, sender, received, fabric)
    sender.close()
    receiver.stop()


def expect(p: Pair, request_id: str, dst: list[int]) -> TransferDescriptor:
    desc = p.receiver.expect(request_id, dst, num_tokens=len(dst) * LAYOUT.block_size, lease_s=10, host="127.0.0.1")
    return TransferDescriptor.from_dict(desc.to_dict())  # through JSON, as via the router


# --------------------------------------------------------------------------- data path
def test_transfer_writes_exactly_the_reserved_blocks(pair: Pair) -> None:
    dst = [5, 6, 11]  # two runs on the decode side
    desc = expect(pair, "req-1", dst)
    assert desc.transport == "rdma"
    assert desc.rdma is not None
    assert desc.rdma["addr"] == pair.decode_kv.data_ptr()
    assert desc.rdma["block_nbytes"] == LAYOUT.block_nbytes
    assert desc.rdma["num_blocks"] == 16
    before = pair.prefill_kv.clone()
    stats = pair.sender.send(desc, src_block_ids=[1, 2, 7], first_token=42, timeout=5)
    assert stats.nbytes == 3 * LAYOUT.block_nbytes
    for s, d in zip([1, 2, 7], dst, strict=True):
        assert torch.equal(pair.decode_kv[d], pair.prefill_kv[s])
    untouched = [b for b in range(16) if b not in dst]
    assert torch.count_nonzero(pair.decode_kv[untouched]) == 0
    assert torch.equal(pair.prefill_kv, before)
    assert pair.received.items[0][:2] == ("req-1", 42)
    assert pair.receiver.bytes_received == stats.nbytes
    # Two segments contiguous on both sides; the 2 KiB one is split at the 1.5 KiB message limit.
    assert pair.fabric.posted == 3


def test_non_contiguous_runs_on_either_side_map_block_by_block(pair: Pair) -> None:
    cases = [([3, 4, 5], [0, 2, 3]), ([0, 6, 2, 3], [8, 9, 10, 14])]
    for i, (src, dst) in enumerate(cases):
        desc = expect(pair, f"req-{i}", dst)
        pair.sender.send(desc, src_block_ids=src + [7], first_token=i, timeout=5)  # extra src blocks ignored
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(pair.decode_kv[d], pair.prefill_kv[s])
    written = {0, 2, 3, 8, 9, 10, 14}
    assert torch.count_nonzero(pair.decode_kv[[b for b in range(16) if b not in written]]) == 0
    assert [item[:2] for item in pair.received.items] == [("req-0", 0), ("req-1", 1)]


def test_connected_queue_pair_is_reused_per_peer(pair: Pair) -> None:
    for i in range(3):
        pair.sender.send(expect(pair, f"r{i}", [i]), [i], first_token=i, timeout=5)
    assert pair.sender.links_opened == 1
    assert pair.fabric.qps_created == 2  # one QP on each side for all three transfers


def test_link_dropped_by_decode_is_replaced_transparently(fabric: FakeFabric) -> None:
    decode_kv, prefill_kv = make_kv(4, 0.0), make_kv(4)
    received = Received()
    receiver = RdmaKVReceiver(
        decode_kv, LAYOUT, received, device=fabric.open_device("d"), bind_host="127.0.0.1", idle_timeout=0.2
    )
    receiver.start()
    sender = RdmaKVSender(prefill_kv, LAYOUT, device=fabric.open_device("p"))
    try:
        desc = receiver.expect("a", [0], num_tokens=2, lease_s=10, host="127.0.0.1")
        sender.send(desc, [1], first_token=1, timeout=5)
        time.sleep(0.6)  # decode closes the idle link (and destroys its QP)
        desc = receiver.expect("b", [2], num_tokens=2, lease_s=10, host="127.0.0.1")
        sender.send(desc, [3], first_token=2, timeout=5)
        assert torch.equal(decode_kv[2], prefill_kv[3])
        assert sender.links_opened == 2
    finally:
        sender.close()
        receiver.stop()


def test_lease_renewal_over_the_control_port_keeps_the_blocks(pair: Pair) -> None:
    """The RDMA control port answers renewals like the TCP KV port: same frames, same checks."""
    receiver = pair.receiver
    desc = receiver.expect("slow", [4, 5], num_tokens=8, lease_s=1.0, host="127.0.0.1")
    desc = TransferDescriptor.from_dict(desc.to_dict())
    assert desc.renewable() and desc.lease_s == 1.0
    for _ in range(3):  # 1.2 s in all: past the first lease
        time.sleep(0.4)
        assert request_renewal(desc, secret="s3cret", stage="computing", holder="p", timeout=2) > 0.8
    with pytest.raises(LeaseLost, match="bad shared secret"):
        request_renewal(desc, secret="nope", stage="computing", holder="p", timeout=2)
    lease = receiver.lease("slow")
    assert lease is not None and lease.renewals == 3 and not lease.expire()
    pair.sender.send(desc, [0, 1], first_token=9, timeout=5)
    assert torch.equal(pair.decode_kv[4:6], pair.prefill_kv[0:2])
    assert pair.fabric.qps_created == 2, "renewals set up no queue pair"
    with pytest.raises(LeaseLost, match="unknown or expired"):
        request_renewal(desc, secret="s3cret", stage="sending", holder="p", timeout=2)


def test_write_after_the_lease_expired_is_refused(pair: Pair) -> None:
    desc = expect(pair, "late", [0])
    lease = pair.receiver.lease("late")
    assert lease is not None
    lease._expires_at = time.monotonic() - 0.01  # noqa: SLF001  ran out; decode frees it next
    with pytest.raises(KVTransferError, match="lease of request 'late' expired"):
        pair.sender.send(desc, [0], first_token=1, timeout=5)
    assert torch.count_nonzero(pair.decode_kv) == 0


# --------------------------------------------------------------------------- refusals
def test_second_write_for_same_request_is_refused(pair: Pair) -> None:
    desc = expect(pair, "req-2", [0])
    pair.sender.send(desc, [0], first_token=1, timeout=5)
    with pytest.raises(KVTransferError, match="unknown or expired"):
        pair.sender.send(desc, [0], first_token=1, timeout=5)


def test_cancelled_request_and_bad_token_are_refused_before_any_write(pair: Pair) -> None:
    desc = expect(pair, "req-3", [1, 2])
    pair.receiver.cancel("req-3")
    with pytest.raises(KVTransferError, match="unknown or expired"):
        pair.sender.send(desc, [0, 1], first_token=1, timeout=5)
    desc = expect(pair, "req-4", [1, 2])
    desc.token = "forged"
    with pytest.raises(KVTransferError, match="bad transfer token"):
        pair.sender.send(desc, [0, 1], first_token=1, timeout=5)
    assert pair.fabric.posted == 0
    assert torch.count_nonzero(pair.decode_kv) == 0
    assert pair.received.items == []


def test_wrong_shared_secret_is_refused(pair: Pair) -> None:
    desc = expect(pair, "req-5", [1])
    intruder = RdmaKVSender(pair.prefill_kv, LAYOUT, device=pair.fabric.open_device("x"), secret="guess")
    with pytest.raises(KVTransferError, match="shared secret"):
        intruder.send(desc, [0], first_token=1, timeout=5)
    assert pair.fabric.posted == 0


def test_layout_mismatch_and_missing_rdma_section_are_clear_errors(pair: Pair) -> None:
    desc = expect(pair, "req-6", [1])
    other = KVLayout(num_layers=2, block_size=8, num_kv_heads=2, head_dim=8, dtype="float32")
    other_kv = torch.zeros(2, 2, 2, 8, 2, 8)
    with pytest.raises(KVTransferError, match="layout mismatch"):
        RdmaKVSender(other_kv, other, device=pair.fabric.open_device("y")).send(desc, [0], first_token=1, timeout=5)
    desc.rdma = None
    with pytest.raises(KVTransferError, match="no 'rdma' section"):
        pair.sender.send(desc, [0], first_token=1, timeout=5)
    with pytest.raises(KVTransferError, match="layout says"):
        RdmaKVSender(other_kv, LAYOUT, device=pair.fabric.open_device("z"))


def test_control_channel_rejects_malformed_peers(pair: Pair) -> None:
    def exchange(frame: dict[str, object]) -> dict[str, object]:
        with socket.create_connection(("127.0.0.1", pair.receiver.port), timeout=5) as sock:
            authenticate(sock, "s3cret")
            send_frame(sock, frame)
            return recv_frame(sock)

    reply = exchange({"op": "connect", "qp": {"qp_num": True}})
    assert not reply["ok"] and "malformed QP info" in str(reply["error"])
    # A TCP-transport header sent to an RDMA decode worker.
    reply = exchange({"request_id": "r", "token": "t", "runs": [[0, 1]], "first_token": 1})
    assert not reply["ok"] and "connect frame" in str(reply["error"])
    with pytest.raises(ValueError, match="gid"):
        QPInfo.from_dict({"qp_num": 5, "lid": 0, "gid": "nope", "psn": 1, "port": 1, "mtu": 3})


# --------------------------------------------------------------------------- failures
def test_completion_error_fails_the_transfer_and_a_retry_can_succeed(pair: Pair) -> None:
    desc = expect(pair, "req-7", [3, 4])
    pair.fabric.fail_status = WC_RETRY_EXC_ERR
    with pytest.raises(KVTransferError, match=r"RDMA write to 127\.0\.0\.1:\d+ failed: retry exceeded"):
        pair.sender.send(desc, [0, 1], first_token=1, timeout=5)
    assert pair.received.items == []
    pair.fabric.fail_status = None
    pair.sender.send(desc, [0, 1], first_token=1, timeout=5)  # the reservation survived: a new link works
    assert torch.equal(pair.decode_kv[3:5], pair.prefill_kv[0:2])
    assert pair.sender.links_opened == 2
    assert [item[0] for item in pair.received.items] == ["req-7"]


def test_write_that_never_completes_times_out_in_bounded_time(pair: Pair) -> None:
    desc = expect(pair, "req-8", [0, 1, 2])
    pair.fabric.stall = True
    started = time.monotonic()
    with pytest.raises(KVTransferError, match="timed out"):
        pair.sender.send(desc, [0, 1, 2], first_token=1, timeout=0.5)
    assert time.monotonic() - started < 3
    assert pair.received.items == []
    pair.fabric.stall = False
    pair.sender.send(desc, [0, 1, 2], first_token=1, timeout=5)
    assert torch.equal(pair.decode_kv[0:3], pair.prefill_kv[0:3])


def test_cancel_during_a_transfer_cuts_it_off_promptly(pair: Pair) -> None:
    desc = expect(pair, "req-9", [6, 7])
    pair.fabric.stall = True
    errors: list[Exception] = []

    def run() -> None:
        try:
            pair.sender.send(desc, [0, 1], first_token=1, timeout=10)
        except KVTransferError as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    assert pair.fabric.posted_event.wait(5)  # decode granted the write, bytes are "in flight"
    decode_qps = [qp for qp in pair.fabric.qps.values() if qp.device.name == "fake_decode"]
    started = time.monotonic()
    pair.receiver.cancel("req-9")
    assert time.monotonic() - started < 2  # far below io_timeout: the control link was cut
    assert decode_qps and all(qp.closed for qp in decode_qps)  # no late write can land any more
    thread.join(5)
    assert len(errors) == 1
    assert pair.received.items == []


def test_unreachable_decode_and_expired_lease_fail_fast(fabric: FakeFabric) -> None:
    sender = RdmaKVSender(make_kv(2), LAYOUT, device=fabric.open_device("p"), connect_timeout=1)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free_port = probe.getsockname()[1]
    rdma = {"addr": 4096, "rkey": 1, "block_nbytes": LAYOUT.block_nbytes, "num_blocks": 2}
    desc = TransferDescriptor("r", "rdma", "127.0.0.1", free_port, [0], 2, LAYOUT, time.time() + 10, "t", rdma)
    with pytest.raises(KVTransferError, match="cannot connect"):
        sender.send(desc, [0], first_token=1, timeout=2)
    desc.lease_expires_at = time.time() - 1
    with pytest.raises(KVTransferError, match="expired"):
        sender.send(desc, [0], first_token=1, timeout=2)


def test_silent_control_peer_times_out(fabric: FakeFabric) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)  # accepts the connection in the backlog but never answers
    try:
        port = listener.getsockname()[1]
        rdma = {"addr": 4096, "rkey": 1, "block_nbytes": LAYOUT.block_nbytes, "num_blocks": 2}
        desc = TransferDescriptor("r", "rdma", "127.0.0.1", port, [0], 2, LAYOUT, time.time() + 10, "t", rdma)
        started = time.monotonic()
        with pytest.raises(KVTransferError, match="timed out"):
            RdmaKVSender(make_kv(2), LAYOUT, device=fabric.open_device("p")).send(desc, [0], first_token=1, timeout=0.5)
        assert time.monotonic() - started < 3
    finally:
        listener.close()


# --------------------------------------------------------------------------- the worker and real verbs
RDMA_OK, RDMA_REASON, RDMA_DEVICES = rdma_available()


@pytest.mark.skipif(RDMA_OK, reason="this host has RDMA: the refusal path cannot be shown here")
def test_pyverbs_backend_reports_a_missing_device_clearly() -> None:
    with pytest.raises(VerbsError, match="mlx5_roce0"):
        PyverbsVerbs().open_device("mlx5_roce0")


@pytest.mark.skipif(RDMA_OK, reason="this host has RDMA: the refusal path cannot be shown here")
def test_worker_refuses_rdma_device_without_rdma(tiny_model_dir: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable, "-m", "inference.launch_server", "--model-path", str(tiny_model_dir),
            "--service-type", "prefill", "--rdma-device", "mlx5_roce0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith("error: --rdma-device mlx5_roce0: RDMA is not usable here (")
    for part in ("ibstat", "ibv_devices", "--kv-transport tcp"):
        assert part in message


def test_worker_builds_the_rdma_transport_on_an_available_device(
    tiny_model_dir: Path, fabric: FakeFabric, monkeypatch: pytest.MonkeyPatch
) -> None:
    from inference.kv_transfer import rdma_detect, verbs
    from inference.server.args import parse_args
    from inference.server.decode import DecodeWorker
    from inference.server.errors import StartupError
    from inference.server.prefill import PrefillWorker

    class FakeVerbs:
        @classmethod
        def from_env(cls) -> FakeVerbs:
            return cls()

        def open_device(self, name: str) -> FakeDevice:
            return fabric.open_device(name)

    monkeypatch.setattr(rdma_detect, "rdma_available", lambda: (True, "ok", ["mlx5_0"]))
    monkeypatch.setattr(verbs, "PyverbsVerbs", FakeVerbs)
    base = ["--model-path", str(tiny_model_dir), "--num-kv-blocks", "8", "--rdma-device"]
    with pytest.raises(StartupError, match=r"mlx5_roce0: no such device \(found \['mlx5_0'\]\).*ibv_devices"):
        PrefillWorker(parse_args([*base, "mlx5_roce0", "--service-type", "prefill"]))
    prefill = PrefillWorker(parse_args([*base, "mlx5_0", "--service-type", "prefill"]))
    decode = DecodeWorker(parse_args([*base, "mlx5_0", "--service-type", "decode", "--host", "127.0.0.1"]))
    try:
        assert isinstance(prefill.sender, RdmaKVSender)
        assert isinstance(decode.receiver, RdmaKVReceiver)
        decode.start()
        desc = decode.receiver.expect("w", [1], num_tokens=3, lease_s=10, host="127.0.0.1")
        assert desc.transport == "rdma" and desc.rdma and desc.rdma["device"] == "mlx5_0"
    finally:
        decode.stop()
        prefill.stop()


@pytest.mark.skipif(not RDMA_OK, reason=f"no RDMA here: {RDMA_REASON}")
def test_real_rdma_device_moves_blocks_exactly() -> None:
    name = os.environ.get("PLATFORM_TEST_RDMA_DEVICE") or RDMA_DEVICES[0]
    verbs_impl = PyverbsVerbs.from_env()
    decode_kv, prefill_kv = make_kv(16, 0.0), make_kv(8)
    received = Received()
    receiver = RdmaKVReceiver(
        decode_kv, LAYOUT, received, device=verbs_impl.open_device(name), bind_host="127.0.0.1", secret="s"
    )
    receiver.start()
    sender = RdmaKVSender(prefill_kv, LAYOUT, device=verbs_impl.open_device(name), secret="s")
    try:
        for i, (src, dst) in enumerate([([1, 2, 7], [5, 6, 11]), ([0, 3], [0, 1])]):
            desc = receiver.expect(f"hw{i}", dst, num_tokens=len(dst) * LAYOUT.block_size, lease_s=10, host="127.0.0.1")
            stats = sender.send(TransferDescriptor.from_dict(desc.to_dict()), src, first_token=i, timeout=10)
            assert stats.nbytes == len(dst) * LAYOUT.block_nbytes
            for s, d in zip(src, dst, strict=True):
                assert torch.equal(decode_kv[d], prefill_kv[s])
        assert sender.links_opened == 1
        assert [item[0] for item in received.items] == ["hw0", "hw1"]
    finally:
        sender.close()
        receiver.stop()
