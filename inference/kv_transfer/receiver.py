"""What the TCP and RDMA receivers share: the gated port, the pending-transfer registry, leases,
lease renewals and the checks that refuse a write before any byte lands.

A transport subclass says how one granted transfer's bytes arrive (`serve`: TCP receives them into
the KV tensor, RDMA grants one-sided writes over a queue pair); everything a decode worker must
refuse it refuses here, identically for both.
"""
from __future__ import annotations

import abc
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from inference.kv_transfer.base import (
    KVLayout,
    KVReceiver,
    KVTransferError,
    OnKVReceived,
    TransferDescriptor,
    TransferStats,
    block_runs,
)
from inference.kv_transfer.gate import ConnectionGate, shutdown
from inference.kv_transfer.lease import LEASE_MAX_MULTIPLE, Lease, answer_renewal, peer_address, same_secret
from inference.kv_transfer.wire import recv_frame, send_frame

logger = logging.getLogger(__name__)

_WILDCARDS = ("", "0.0.0.0", "::")


def kv_bind_host(host: str, advertise_host: str | None, secret: str) -> str:
    """Where a decode worker's KV port listens: `--host`, but in open mode (no shared secret) only
    the advertised address (`--kv-advertise-host`) when `--host` is every interface: without the
    secret the port takes writes from anyone who reaches it."""
    if not secret and advertise_host and host in _WILDCARDS:
        return advertise_host
    return host


@dataclass
class Pending:
    """A transfer the decode side expects; `conn` is set while a granted transfer is in flight."""

    block_ids: list[int]
    num_tokens: int
    token: str
    lease: Lease
    # Held while bytes may land in the blocks: cancel() waits on it before the blocks are freed.
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False
    conn: socket.socket | None = None


@dataclass(frozen=True)
class Grant:
    """A write header that passed every check: the pending transfer it targets and what it carries."""

    request_id: str
    pending: Pending
    runs: list[tuple[int, int]]
    first_token: int


class GatedReceiver(KVReceiver, abc.ABC):
    """Base of the decode-side receivers: a `ConnectionGate` port and the registry behind it."""

    transport: str

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
        max_connections_per_peer: int | None = None,
        handshake_timeout: float = 1.0,
        max_handshakes: int = 256,
        max_handshakes_per_peer: int = 64,
        max_lease_multiple: float = LEASE_MAX_MULTIPLE,
    ) -> None:
        self._kv = kv_data
        self._layout = layout
        self._on_received = on_received
        self._io_timeout = io_timeout
        self._max_lease_multiple = max_lease_multiple
        self._pending: dict[str, Pending] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.gate = ConnectionGate(
            self._serve_connection,
            bind_host=bind_host,
            port=port,
            secret=secret,
            name=f"kv-{self.transport}",
            max_connections=max_connections,
            max_connections_per_peer=max_connections_per_peer,
            handshake_timeout=handshake_timeout,
            max_handshakes=max_handshakes,
            max_handshakes_per_peer=max_handshakes_per_peer,
        )
        self.bytes_received = 0
        self.transfers_done = 0

    # ------------------------------------------------------------------ KVReceiver
    @property
    def port(self) -> int:
        """The bound KV port (known after start())."""
        return self.gate.port

    def start(self) -> None:
        """Bind the KV port and start accepting (authenticated) connections."""
        self.gate.start()
        if not self.gate.secret and self.gate.bind_host in _WILDCARDS:
            logger.warning(
                "KV port %d listens on every interface with no PLATFORM_SHARED_SECRET: anyone who "
                "reaches it can hold transfer slots, and a holder of a descriptor can write into its "
                "blocks. Set the secret, or --host / --kv-advertise-host to a private address "
                "(docs/security.md)", self.port,
            )

    def stop(self) -> None:
        """Stop accepting; transfers in flight finish or time out on their own."""
        self._stopped.set()
        self.gate.stop()

    def expect(
        self, request_id: str, block_ids: list[int], num_tokens: int, lease_s: float, host: str,
        first_block: int = 0,
    ) -> TransferDescriptor:
        """Register the reserved blocks of `request_id` and describe them for the prefill side."""
        token = secrets.token_hex(16)
        lease = Lease(lease_s, max_multiple=self._max_lease_multiple)
        now = time.time()
        with self._lock:
            self._pending[request_id] = Pending(list(block_ids), num_tokens, token, lease)
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
            rdma=self._descriptor_rdma(),
            lease_s=lease_s,
            lease_cap_at=now + (lease.cap_at - lease.granted_at),
            first_block=first_block,
        )

    def cancel(self, request_id: str) -> None:
        """Forget `request_id`; a transfer in flight is cut off before this returns, so the blocks
        can be freed: no byte for this request lands in them afterwards."""
        with self._lock:
            pending = self._pending.pop(request_id, None)
        if pending is None:
            return
        pending.cancelled = True
        conn = pending.conn  # read after setting `cancelled`: the serving thread does the reverse
        if conn is not None:
            shutdown(conn)
        with pending.lock:  # released once no write for this request can land any more
            pass

    def lease(self, request_id: str) -> Lease | None:
        """The lease of a transfer still expected (None once it arrived or was cancelled)."""
        pending = self._live(request_id)
        return None if pending is None else pending.lease

    # ------------------------------------------------------------------ for the transports
    def _descriptor_rdma(self) -> dict[str, Any] | None:
        """The descriptor's transport-specific section (RDMA: the pool's address and rkey)."""
        return None

    @abc.abstractmethod
    def _serve(self, conn: socket.socket, first: dict[str, Any]) -> None:
        """Serve an authenticated connection whose first frame (not a renewal) is `first`."""

    def _serve_connection(self, conn: socket.socket) -> None:
        """Gate callback: serve an authenticated connection until it closes or fails."""
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            first = self._next_frame(conn, self._io_timeout)
            if first is not None:
                self._serve(conn, first)
        except (OSError, KVTransferError) as exc:
            if not (self._stopped.is_set() or isinstance(exc, TimeoutError)):
                logger.warning("%s KV connection failed: %s", self.transport, exc)

    def _next_frame(self, conn: socket.socket, timeout: float) -> dict[str, Any] | None:
        """The next frame that is not a lease renewal (renewals are answered on the way); None
        when the peer closed or stayed silent for `timeout` between frames."""
        while not self._stopped.is_set():
            conn.settimeout(timeout)
            try:
                frame = recv_frame(conn)
            except (OSError, KVTransferError):
                return None
            conn.settimeout(self._io_timeout)
            if frame.get("op") != "renew":
                return frame
            send_frame(conn, answer_renewal(frame, self._find, peer_address(conn)))
        return None

    def _live(self, request_id: str) -> Pending | None:
        """The pending transfer of `request_id` unless it arrived or was cancelled."""
        with self._lock:
            pending = self._pending.get(request_id)
        return None if pending is None or pending.cancelled else pending

    def _find(self, request_id: str) -> tuple[str, Lease] | None:
        """(token, lease) of a transfer still expected, for a lease renewal."""
        pending = self._live(request_id)
        return None if pending is None else (pending.token, pending.lease)

    def _grant(self, header: dict[str, Any], *, op: str | None) -> Grant | str:
        """Check a write header against the registry; the grant, or the refusal's message.

        Refused: unknown, finished or cancelled request, wrong per-request token, expired lease,
        a malformed header (or not the `op` the transport expects), runs other than the reserved
        blocks'.
        """
        request_id = str(header.get("request_id", ""))
        pending = self._live(request_id)
        if pending is None:
            return f"unknown or expired request {request_id!r}"
        if not same_secret(header.get("token", ""), pending.token):
            return "bad transfer token"
        if pending.lease.expire():  # the decode worker is about to free the blocks (or has)
            return f"the lease of request {request_id!r} expired"
        try:
            if header.get("op") != op:
                raise ValueError(f"not a {op or 'transfer'} frame")
            runs = [(int(a), int(b)) for a, b in header.get("runs", [])]
            first_token = int(header["first_token"])
        except (TypeError, ValueError, KeyError, OverflowError):
            return "malformed transfer header"
        if runs != block_runs(pending.block_ids):
            return "runs do not match the reserved blocks"
        return Grant(request_id, pending, runs, first_token)

    def _arrived(self, grant: Grant) -> None:
        """The bytes are all in: the request is no longer pending (call under `pending.lock`)."""
        with self._lock:
            if self._pending.get(grant.request_id) is grant.pending:
                del self._pending[grant.request_id]

    def _deliver(self, conn: socket.socket, grant: Grant, nbytes: int, started: float) -> bool:
        """Hand the arrived KV to the worker and acknowledge it; False when the sender was refused."""
        stats = TransferStats(nbytes=nbytes, seconds=time.perf_counter() - started)
        self.bytes_received += nbytes
        self.transfers_done += 1
        try:
            self._on_received(grant.request_id, grant.first_token, stats)
        except Exception as exc:  # the engine refused (e.g. aborted meanwhile): tell the sender
            logger.warning("KV for %s arrived but could not be used: %s", grant.request_id, exc)
            send_frame(conn, {"ok": False, "error": f"decode could not continue: {exc}"})
            return False
        send_frame(conn, {"ok": True, "nbytes": nbytes})
        return True
