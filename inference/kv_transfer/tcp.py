"""TCP KV transfer: the default transport, for any network (loopback, Ethernet, namespaces).

The decode worker listens on a KV port. A prefill worker connects, passes the port's handshake
(`auth.py`: an HMAC proof of the shared secret), sends a JSON header naming the request, its
per-request token and the destination block runs, then the raw block bytes, which the decode side
receives straight into its KV tensor (no intermediate copy, no pickle; a GPU cache goes through pinned
host buffers, see staging.py).
"""
from __future__ import annotations

import logging
import socket
import time
from typing import Any

import torch

from inference.kv_transfer.auth import connect_authenticated
from inference.kv_transfer.base import (
    KVLayout,
    KVSender,
    KVTransferError,
    TransferDescriptor,
    TransferStats,
    block_runs,
    send_bound,
)
from inference.kv_transfer.lease import same_secret
from inference.kv_transfer.receiver import GatedReceiver
from inference.kv_transfer.staging import HostStaging
from inference.kv_transfer.wire import recv_exact_into, recv_frame, send_frame

logger = logging.getLogger(__name__)


# Host buffers of the transport (pinned where CUDA is available); a CPU cache is used in place.
_STAGING = HostStaging()


def _receive_blocks(sock: socket.socket, kv_data: torch.Tensor, first: int, count: int) -> int:
    """Receive `count` blocks straight into the KV tensor (through pinned host buffers, chunk by chunk,
    for a GPU cache)."""
    return _STAGING.receive(kv_data[first : first + count], lambda view: recv_exact_into(sock, view))


def _same(given: object, expected: str) -> bool:
    """Constant-time comparison of a header field with a secret (kept for its regression test)."""
    return same_secret(given, expected)


class TcpKVReceiver(GatedReceiver):
    """Decode side of the TCP transport: the block bytes arrive on the (authenticated) connection."""

    transport = "tcp"

    def _serve(self, conn: socket.socket, first: dict[str, Any]) -> None:
        """Receive transfers until the connection closes (one connection may carry several)."""
        header: dict[str, Any] | None = first
        while header is not None and self._receive_one(conn, header):
            header = self._next_frame(conn, self._io_timeout)

    def _receive_one(self, conn: socket.socket, header: dict[str, Any]) -> bool:
        """Receive one transfer; False when the connection must be closed."""
        started = time.perf_counter()
        grant = self._grant(header, op=None)
        if isinstance(grant, str):
            send_frame(conn, {"ok": False, "error": grant})
            return False
        pending = grant.pending
        with pending.lock:
            pending.conn = conn  # set before checking `cancelled`: cancel() sets it, then reads conn
            try:
                if pending.cancelled:
                    send_frame(conn, {"ok": False, "error": f"request {grant.request_id!r} was aborted"})
                    return False
                nbytes = 0
                for first, count in grant.runs:
                    nbytes += _receive_blocks(conn, self._kv, first, count)
            except (OSError, KVTransferError):
                if pending.cancelled:  # cancel() cut the connection: the blocks are being freed
                    logger.info("TCP KV transfer of %s cut off (aborted)", grant.request_id)
                    return False
                raise
            finally:
                pending.conn = None
            self._arrived(grant)
        return self._deliver(conn, grant, nbytes, started)


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
        src = descriptor.source_blocks(src_block_ids)
        if descriptor.lease_remaining() <= 0:
            raise KVTransferError(f"lease of request {descriptor.request_id} already expired")
        deadline = time.monotonic() + send_bound(descriptor, timeout)
        started = time.perf_counter()
        runs = block_runs(dst)
        header = {
            "request_id": descriptor.request_id,
            "token": descriptor.token,
            "first_token": int(first_token),
            "num_tokens": descriptor.num_tokens,
            "runs": [list(r) for r in runs],
            "nbytes": len(dst) * self._layout.block_nbytes,
        }
        sock = connect_authenticated(
            descriptor.host, descriptor.port, self._secret, connect_timeout=self._connect_timeout, deadline=deadline
        )
        nbytes = 0
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            send_frame(sock, header)
            # Source blocks are sent run by run of consecutive ids: one sendall per contiguous range.
            for first, count in block_runs(src):
                for view in _STAGING.host_chunks(self._kv[first : first + count]):
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
