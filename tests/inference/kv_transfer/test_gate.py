"""The KV port authenticates first and allocates later: real receivers, real sockets, real handshakes."""
from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator

import pytest
import torch

from inference.kv_transfer import KVLayout, KVTransferError, TransferStats
from inference.kv_transfer.auth import HandshakeRefused, authenticate
from inference.kv_transfer.lease import LeaseLost, request_renewal
from inference.kv_transfer.receiver import kv_bind_host
from inference.kv_transfer.tcp import TcpKVReceiver, TcpKVSender
from inference.kv_transfer.wire import recv_frame, send_frame

LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
SECRET = "gate-s3cret"


def make_kv(num_blocks: int) -> torch.Tensor:
    return torch.randn(num_blocks, LAYOUT.num_layers, 2, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)


def start(secret: str = SECRET, **options: float) -> tuple[TcpKVReceiver, list[tuple[str, int, TransferStats]]]:
    received: list[tuple[str, int, TransferStats]] = []
    receiver = TcpKVReceiver(
        torch.zeros_like(make_kv(8)), LAYOUT, lambda *item: received.append(item), bind_host="127.0.0.1",
        secret=secret, **options,  # type: ignore[arg-type]
    )
    receiver.start()
    return receiver, received


@pytest.fixture
def receiver() -> Iterator[TcpKVReceiver]:
    r, _ = start(max_connections=2, handshake_timeout=0.5, max_handshakes_per_peer=8)
    yield r
    r.stop()


def transfer(receiver: TcpKVReceiver, request_id: str, secret: str = SECRET) -> TransferStats:
    desc = receiver.expect(request_id, [1, 2], num_tokens=8, lease_s=10, host="127.0.0.1")
    return TcpKVSender(make_kv(4), LAYOUT, secret=secret).send(desc, [0, 1], first_token=3, timeout=5)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def closed_by_peer(sock: socket.socket, within: float) -> bool:
    """Whether the peer closes `sock` within `within` seconds (whatever it sent first is skipped)."""
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return True


def wait_for(condition, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_a_wrong_secret_is_refused_in_the_handshake_and_holds_no_slot(receiver: TcpKVReceiver) -> None:
    for wrong in ("", "guess", SECRET + "x", "s\u00e9cret-\u2603"):
        with pytest.raises(HandshakeRefused, match="bad shared secret") as refused:
            transfer(receiver, f"r-{wrong!r}", secret=wrong)
        assert not refused.value.retryable
    assert receiver.gate.stats.bad_secret == 4
    assert receiver.gate.active == 0
    assert transfer(receiver, "ok").nbytes == 2 * LAYOUT.block_nbytes  # the port still serves


def test_idle_connections_never_hold_a_slot_and_are_closed_after_the_handshake_timeout(
    receiver: TcpKVReceiver,
) -> None:
    # Twice as many silent connections as the gate keeps per peer, and far more than its 2 slots.
    idle = [connect(receiver.port) for _ in range(16)]
    try:
        assert wait_for(lambda: receiver.gate.handshaking == 8)
        assert receiver.gate.active == 0
        # Real transfers get through while the silent ones sit there (they evict the oldest).
        for i in range(3):
            assert transfer(receiver, f"busy-{i}").nbytes > 0
        started = time.monotonic()
        assert all(closed_by_peer(sock, within=2.0) for sock in idle)
        assert time.monotonic() - started < 1.5  # handshake_timeout 0.5 s, not the 30 s I/O timeout
        assert receiver.gate.stats.timed_out >= 1 and receiver.gate.stats.evicted >= 8
        assert receiver.gate.handshaking == 0
    finally:
        for sock in idle:
            sock.close()


def test_a_handshake_completed_too_late_is_not_accepted(receiver: TcpKVReceiver) -> None:
    with connect(receiver.port) as sock:
        challenge = recv_frame(sock)
        assert challenge["op"] == "challenge" and len(challenge["nonce"]) == 32
        time.sleep(0.8)  # past handshake_timeout (0.5 s)
        with pytest.raises((KVTransferError, OSError)):
            # The challenge is answered correctly, but the gate has already closed the connection.
            send_frame(sock, {"op": "auth", "nonce": "0" * 32, "mac": "0" * 64})
            recv_frame(sock)
    with connect(receiver.port) as slow:  # trickling the frame one byte at a time does not help
        recv_frame(slow)
        slow.sendall(struct.pack("!I", 100)[:2])
        assert closed_by_peer(slow, within=1.5)


def test_per_peer_slot_limit_and_total_slots() -> None:
    receiver, _ = start(max_connections=3, max_connections_per_peer=2)
    held: list[socket.socket] = []
    try:
        for _ in range(2):  # authenticated and then silent: each holds a slot
            sock = connect(receiver.port)
            authenticate(sock, SECRET)
            held.append(sock)
        assert wait_for(lambda: receiver.gate.active == 2)
        with connect(receiver.port) as third:
            with pytest.raises(HandshakeRefused, match="too many concurrent KV transfers from 127.0.0.1") as busy:
                authenticate(third, SECRET)
            assert busy.value.retryable
        assert receiver.gate.stats.busy == 1
        held.pop().close()  # a slot comes back when its connection ends
        assert wait_for(lambda: receiver.gate.active == 1)
        assert transfer(receiver, "after").nbytes > 0
    finally:
        for sock in held:
            sock.close()
        receiver.stop()


def test_malformed_and_old_protocol_peers_are_refused_with_words(receiver: TcpKVReceiver) -> None:
    with connect(receiver.port) as sock:
        recv_frame(sock)
        sock.sendall(struct.pack("!I", 1 << 20))  # a length no auth frame has
        assert recv_frame(sock) == {"ok": False, "error": "malformed authentication frame"}
    with connect(receiver.port) as sock:
        recv_frame(sock)
        send_frame(sock, {"request_id": "r", "token": "t", "secret": SECRET, "runs": [[1, 2]], "first_token": 1})
        reply = recv_frame(sock)
        assert not reply["ok"] and "authentication handshake first" in reply["error"]
    assert receiver.gate.stats.malformed == 2 and receiver.gate.active == 0


def test_renewals_pass_the_same_handshake(receiver: TcpKVReceiver) -> None:
    desc = receiver.expect("lease", [3], num_tokens=2, lease_s=5, host="127.0.0.1")
    assert request_renewal(desc, secret=SECRET, stage="computing", holder="p", timeout=2) > 4
    with pytest.raises(LeaseLost, match="bad shared secret"):
        request_renewal(desc, secret="guess", stage="computing", holder="p", timeout=2)


def test_open_mode_checks_no_proof_but_still_bounds_idle_connections() -> None:
    receiver, received = start(secret="", handshake_timeout=0.3)
    try:
        assert transfer(receiver, "open", secret="").nbytes > 0
        assert received[0][0] == "open"
        # A prefill worker holding a secret does not trust a decode port that cannot prove it.
        with pytest.raises(HandshakeRefused, match="could not prove the shared secret"):
            transfer(receiver, "mutual", secret=SECRET)
        with connect(receiver.port) as idle:
            assert closed_by_peer(idle, within=1.5)
    finally:
        receiver.stop()


def test_stop_closes_the_port() -> None:
    receiver, _ = start()
    port = receiver.port
    receiver.stop()
    with pytest.raises(OSError):
        connect(port).close()


def test_open_mode_binds_the_kv_port_to_the_advertised_address_only() -> None:
    assert kv_bind_host("0.0.0.0", "10.0.0.5", secret="") == "10.0.0.5"
    assert kv_bind_host("0.0.0.0", None, secret="") == "0.0.0.0"  # nothing advertised: a warning at start
    assert kv_bind_host("10.0.0.7", "10.0.0.5", secret="") == "10.0.0.7"  # an explicit --host is kept
    assert kv_bind_host("0.0.0.0", "10.0.0.5", secret="s") == "0.0.0.0"  # the handshake guards the port
