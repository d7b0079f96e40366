"""TCP KV transfer: the default transport, for any network (loopback, Ethernet, namespaces).

The decode worker listens on a KV port. A prefill worker connects, sends a JSON header naming the
request, its per-request token and the destination block runs, then the raw block bytes, which the
decode side receives straight into its KV tensor (no intermediate copy, no pickle).
"""
from __future__ import annotations

import hmac
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field

import torch

from inference.kv_transfer.base import (
    KVLayout,
    KVReceiver,
    KVSender,
    KVTransferError,
    OnKVReceived,
    TransferDescriptor,
    TransferStats,
    block_runs,
    send_bound,
)
from inference.kv_transfer.lease import LEASE_MAX_MULTIPLE, Lease, answer_renewal, peer_address
from inference.kv_transfer.wire import recv_exact_into, recv_frame, send_frame

logger = logging.getLogger(__name__)


def _block_bytes(kv_data: torch.Tensor, first: int, count: int) -> memoryview:
    """A byte view of `count` consecutive blocks starting at `first` (a host copy for a GPU cache)."""
    region = kv_data[first : first + count]
    if not region.is_contiguous():
        raise KVTransferError("KV tensor blocks are not contiguous")
    if region.device.type != "cpu":
        region = region.cpu()  # sockets need host memory; RDMA is the zero-copy path for GPUs
    # As bytes: numpy has no bfloat16, and the wire carries raw bytes whatever the KV dtype.
    array = region.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array).cast("B")  # type: ignore[arg-type]  # ndarray supports the buffer protocol


def _receive_blocks(sock: socket.socket, kv_data: torch.Tensor, first: int, count: int) -> int:
    """Receive `count` blocks straight into the KV tensor (through a host buffer for a GPU cache)."""
    if kv_data.device.type == "cpu":
        view = _block_bytes(kv_data, first, count)
        recv_exact_into(sock, view)
        return len(view)
    staging = torch.empty_like(kv_data[first : first + count], device="cpu")
    view = memoryview(staging.reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
    recv_exact_into(sock, view)
    kv_data[first : first + count].copy_(staging)
    return len(view)


def _same(given: object, expected: str) -> bool:
    """Constant-time comparison of a header field with a secret.

    As bytes: hmac.compare_digest raises TypeError for non-ASCII str, which would kill the receiving
    thread instead of refusing the peer.
    """
    text = given if isinstance(given, str) else str(given)
    return hmac.compare_digest(text.encode("utf-8", "surrogatepass"), expected.encode())


@dataclass
class _Pending:
    """A transfer the decode side expects: which blocks, guarded while bytes are being written."""

    block_ids: list[int]
    num_tokens: int
    token: str
    lease: Lease
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False


class TcpKVReceiver(KVReceiver):
    """Decode side of the TCP transport: a listening socket and one thread per incoming transfer."""

    transport = "tcp"

    def __init__(
        self,
        kv_data: torch.Tensor,
        layout: KVLayout,
        on_received: OnKVReceived,
        *,
        bind_host: str = "0.0.0.0",
        port: int = 0,
        secret: str = "",
        io_timeout: float = 30.0,
        max_connections: int = 64,
        max_lease_multiple: float = LEASE_MAX_MULTIPLE,
    ) -> None:
        self._kv = kv_data
        self._layout = layout
        self._on_received = on_received
        self._bind_host = bind_host
        self._requested_port = port
        self._secret = secret
        self._io_timeout = io_timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        self._max_lease_multiple = max_lease_multiple
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._stopped = threading.Event()
        self.bytes_received = 0
        self.transfers_done = 0

    @property
    def port(self) -> int:
        """The bound KV port (known after start())."""
        if self._sock is None:
            raise RuntimeError("receiver not started")
        return int(self._sock.getsockname()[1])

    def start(self) -> None:
        """Bind the KV port and start the accept thread."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self._bind_host, self._requested_port))
        except OSError as exc:
            sock.close()
            raise KVTransferError(
                f"cannot listen for KV transfers on {self._bind_host}:{self._requested_port}: {exc}"
            ) from exc
        sock.listen(128)
        sock.settimeout(0.5)  # lets the accept loop notice stop()
        self._sock = sock
        threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True).start()

    def stop(self) -> None:
        """Stop accepting; in-flight transfers finish or time out on their own."""
        self._stopped.set()
        if self._sock is not None:
            self._sock.close()

    def expect(
        self, request_id: str, block_ids: list[int], num_tokens: int, lease_s: float, host: str
    ) -> TransferDescriptor:
        """Register the reserved blocks of `request_id` and describe them for the prefill side."""
        token = secrets.token_hex(16)
        lease = Lease(lease_s, max_multiple=self._max_lease_multiple)
        now = time.time()
        with self._lock:
            self._pending[request_id] = _Pending(list(block_ids), num_tokens, token, lease)
        return TransferDescriptor(
            request_id=request_id,
            transport=self.transport,
            host=host,
            port=self.port,
            block_ids=list(block_ids),
            num_tokens=num_tokens,
            layout=self._layout,
            lease_expires_at=now + lease_s,
            token=token,
            lease_s=lease_s,
            lease_cap_at=now + (lease.cap_at - lease.granted_at),
        )

    def cancel(self, request_id: str) -> None:
        """Forget `request_id`; waits for a write in progress so its blocks can be freed safely."""
        with self._lock:
            pending = self._pending.pop(request_id, None)
        if pending is None:
            return
        pending.cancelled = True
        with pending.lock:  # a receive in progress holds it: after this no byte lands in the blocks
            pass

    def lease(self, request_id: str) -> Lease | None:
        """The lease of a transfer still expected (None once it arrived or was cancelled)."""
        with self._lock:
            pending = self._pending.get(request_id)
        return None if pending is None or pending.cancelled else pending.lease

    def _find(self, request_id: str) -> tuple[str, Lease] | None:
        """(token, lease) of a transfer still expected, for a lease renewal."""
        with self._lock:
            pending = self._pending.get(request_id)
        return None if pending is None or pending.cancelled else (pending.token, pending.lease)

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stopped.is_set():
            try:
                conn, _addr = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopped.is_set():
                    return
                logger.exception("KV accept failed")
                time.sleep(0.1)
                continue
            if not self._slots.acquire(blocking=False):
                self._refuse(conn, "too many concurrent KV transfers")
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kv-recv", daemon=True).start()

    @staticmethod
    def _refuse(conn: socket.socket, message: str) -> None:
        try:
            conn.settimeout(1.0)
            send_frame(conn, {"ok": False, "error": message})
        except OSError:
            pass
        finally:
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(self._io_timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # One connection may carry several transfers (or lease renewals) back to back.
            while not self._stopped.is_set():
                try:
                    header = recv_frame(conn)
                except KVTransferError:
                    return  # peer closed between transfers
                if header.get("op") == "renew":
                    send_frame(conn, answer_renewal(header, self._find, self._secret, peer_address(conn)))
                    continue
                if not self._receive_one(conn, header):
                    return
        except (OSError, KVTransferError) as exc:
            logger.warning("KV transfer connection failed: %s", exc)
        finally:
            conn.close()
            self._slots.release()

    def _receive_one(self, conn: socket.socket, header: dict[str, object]) -> bool:
        """Receive one transfer; False when the connection must be closed."""
        started = time.perf_counter()
        request_id = str(header.get("request_id", ""))
        if self._secret and not _same(header.get("secret", ""), self._secret):
            send_frame(conn, {"ok": False, "error": "bad shared secret"})
            return False
        with self._lock:
            pending = self._pending.get(request_id)
        if pending is None or pending.cancelled:
            send_frame(conn, {"ok": False, "error": f"unknown or expired request {request_id!r}"})
            return False
        if not _same(header.get("token", ""), pending.token):
            send_frame(conn, {"ok": False, "error": "bad transfer token"})
            return False
        if pending.lease.expire():  # the decode worker is about to free the blocks (or has)
            send_frame(conn, {"ok": False, "error": f"the lease of request {request_id!r} expired"})
            return False
        try:
            runs = [(int(a), int(b)) for a, b in header.get("runs", [])]  # type: ignore[attr-defined]
            first_token = int(header["first_token"])  # type: ignore[call-overload]
        except (TypeError, ValueError, KeyError):
            send_frame(conn, {"ok": False, "error": "malformed transfer header"})
            return False
        if runs != block_runs(pending.block_ids):
            send_frame(conn, {"ok": False, "error": "runs do not match the reserved blocks"})
            return False
        with pending.lock:
            if pending.cancelled:
                send_frame(conn, {"ok": False, "error": f"request {request_id!r} was aborted"})
                return False
            nbytes = 0
            for first, count in runs:
                nbytes += _receive_blocks(conn, self._kv, first, count)
            with self._lock:
                self._pending.pop(request_id, None)
        stats = TransferStats(nbytes=nbytes, seconds=time.perf_counter() - started)
        self.bytes_received += nbytes
        self.transfers_done += 1
        try:
            self._on_received(request_id, first_token, stats)
        except Exception as exc:  # the engine refused (e.g. aborted meanwhile): tell the sender
            logger.warning("KV for %s arrived but could not be used: %s", request_id, exc)
            send_frame(conn, {"ok": False, "error": f"decode could not continue: {exc}"})
            return False
        send_frame(conn, {"ok": True, "nbytes": nbytes})
        return True


class TcpKVSender(KVSender):
    """Prefill side of the TCP transport."""

    transport = "tcp"

    def __init__(
        self, kv_data: torch.Tensor, layout: KVLayout, *, secret: str = "", connect_timeout: float = 3.0
    ) -> None:
        self._kv = kv_data
        self._layout = layout
        self._secret = secret
        self._connect_timeout = connect_timeout

    def send(
        self,
        descriptor: TransferDescriptor,
        src_block_ids: list[int],
        first_token: int,
        timeout: float,
    ) -> TransferStats:
        """Write `src_block_ids` into the descriptor's blocks; raises KVTransferError on any failure."""
        if descriptor.layout != self._layout:
            raise KVTransferError(
                f"KV layout mismatch: decode has {descriptor.layout.to_dict()}, "
                f"prefill has {self._layout.to_dict()} (same model and --block-size on both?)"
            )
        dst = descriptor.block_ids
        if len(src_block_ids) < len(dst):
            raise KVTransferError(f"prefill holds {len(src_block_ids)} blocks, decode expects {len(dst)}")
        if descriptor.lease_remaining() <= 0:
            raise KVTransferError(f"lease of request {descriptor.request_id} already expired")
        deadline = time.monotonic() + send_bound(descriptor, timeout)
        started = time.perf_counter()
        runs = block_runs(dst)
        header = {
            "request_id": descriptor.request_id,
            "token": descriptor.token,
            "secret": self._secret,
            "first_token": int(first_token),
            "num_tokens": descriptor.num_tokens,
            "runs": [list(r) for r in runs],
            "nbytes": len(dst) * self._layout.block_nbytes,
        }
        try:
            sock = socket.create_connection(
                (descriptor.host, descriptor.port),
                timeout=min(self._connect_timeout, max(deadline - time.monotonic(), 0.01)),
            )
        except OSError as exc:
            raise KVTransferError(
                f"cannot connect to decode KV port {descriptor.host}:{descriptor.port}: {exc}"
            ) from exc
        nbytes = 0
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            send_frame(sock, header)
            # Source blocks are sent run by run of consecutive ids: one sendall per contiguous range.
            for first, count in block_runs(list(src_block_ids[: len(dst)])):
                view = _block_bytes(self._kv, first, count)
                sock.sendall(view)
                nbytes += len(view)
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            ack = recv_frame(sock)
        except TimeoutError as exc:
            raise KVTransferError(f"KV transfer to {descriptor.host}:{descriptor.port} timed out") from exc
        except OSError as exc:
            peer = f"{descriptor.host}:{descriptor.port}"
            raise KVTransferError(f"KV transfer to {peer} failed: {exc}") from exc
        finally:
            sock.close()
        if not ack.get("ok"):
            raise KVTransferError(f"decode refused the KV transfer: {ack.get('error', 'unknown error')}")
        return TransferStats(nbytes=nbytes, seconds=time.perf_counter() - started)
