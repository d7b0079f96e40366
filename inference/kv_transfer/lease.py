"""KV leases that follow progress: the decode side's lease and the wire form of a renewal.

A decode worker holds a request's reserved blocks under a lease of `lease_s` seconds. The prefill
worker that holds the descriptor renews it over the decode worker's KV control port while it works
(accepted, queued, computing, prefilled, sending), so a prompt of any valid length completes however
slow the prefill, and a lease runs out only when the prefill side falls silent (dead, stopped,
unreachable) for one whole lease. Every renewal is bounded by a hard cap fixed at reservation time.

Renewal exchange, one short TCP connection to the descriptor's host/port (the TCP transport's KV
port, the RDMA transport's control port), after the port's handshake (`auth.py`: only a holder of
the shared secret gets this far), JSON frames from `wire.py`:

    prefill → {"op": "renew", "request_id", "token", "stage", "holder"}
    decode  → {"ok": true, "expires_in": s, "cap_in": s} | {"ok": false, "error": "..."}

`token` is the descriptor's per-request transfer token: only a holder of the descriptor can renew.
"""
from __future__ import annotations

import hmac
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inference.kv_transfer.auth import HandshakeRefused, connect_authenticated
from inference.kv_transfer.base import KVTransferError, TransferDescriptor
from inference.kv_transfer.wire import recv_frame, send_frame

# Hard cap on one reservation, as a multiple of the lease: renewals never extend a lease past
# `lease_s * LEASE_MAX_MULTIPLE` seconds after the reservation (30 s leases → 10 minutes).
LEASE_MAX_MULTIPLE = 20.0

# The stages a prefill worker reports; anything else is recorded as "unknown".
STAGES = ("accepted", "queued", "computing", "prefilled", "sending")

# A renewal is due once this fraction of the lease has passed since the last grant, so two can be
# lost before the lease runs out, and a prefill faster than this fraction sends none at all.
RENEW_FRACTION = 1.0 / 3.0


class LeaseLost(Exception):
    """The decode worker no longer holds the blocks for this request (expired, aborted, capped)."""


def same_secret(given: object, expected: str) -> bool:
    """Constant-time comparison as bytes (compare_digest raises TypeError for non-ASCII str)."""
    text = given if isinstance(given, str) else str(given)
    return hmac.compare_digest(text.encode("utf-8", "surrogatepass"), expected.encode())


def peer_address(conn: socket.socket) -> str:
    """The remote address of a connection, naming a renewing prefill worker that names none."""
    try:
        return str(conn.getpeername()[0])
    except OSError:
        return "unknown"


@dataclass(frozen=True)
class Progress:
    """The last progress a prefill worker reported for a lease."""

    stage: str
    holder: str
    at: float  # time.monotonic() on the decode side


class Lease:
    """Decode side: how long a reservation's blocks stay held; thread-safe.

    Renewed from the receiver's connection threads, checked from the worker's event loop; `expire()`
    and `renew()` decide under one lock, so a renewal racing with the expiry either wins (and the
    wait goes on) or fails (and the prefill worker learns the blocks are gone).
    """

    def __init__(self, lease_s: float, *, max_multiple: float = LEASE_MAX_MULTIPLE) -> None:
        now = time.monotonic()
        self.lease_s = lease_s
        self.granted_at = now
        self.cap_at = now + lease_s * max(max_multiple, 1.0)
        self._expires_at = now + lease_s
        self._lock = threading.Lock()
        self._expired = False
        self.renewals = 0
        self.last_progress: Progress | None = None

    @property
    def expired(self) -> bool:
        """Whether the lease was declared expired (no renewal is accepted after that)."""
        return self._expired

    def remaining(self) -> float:
        """Seconds until the lease runs out (negative once it has)."""
        return self._expires_at - time.monotonic()

    def cap_remaining(self) -> float:
        """Seconds until the hard cap, beyond which no renewal extends the lease."""
        return self.cap_at - time.monotonic()

    def silent_s(self) -> float:
        """Seconds since the last progress report (or since the reservation when none came)."""
        since = self.last_progress.at if self.last_progress is not None else self.granted_at
        return time.monotonic() - since

    def renew(self, stage: str, holder: str) -> float:
        """Extend the lease by `lease_s` from now (capped); returns seconds until the new expiry.

        Raises LeaseLost when the lease already ran out or the cap is reached.
        """
        with self._lock:
            now = time.monotonic()
            if self._expired or now >= self._expires_at:
                self._expired = True
                raise LeaseLost(f"the lease expired {now - self._expires_at:.1f}s ago")
            if now >= self.cap_at:
                raise LeaseLost(
                    f"the lease reached its cap of {self.cap_at - self.granted_at:g}s "
                    f"({LEASE_MAX_MULTIPLE:g}x the {self.lease_s:g}s lease)"
                )
            self._expires_at = max(self._expires_at, min(now + self.lease_s, self.cap_at))
            self.renewals += 1
            self.last_progress = Progress(stage if stage in STAGES else "unknown", holder, now)
            return self._expires_at - now

    def expire(self) -> bool:
        """Declare the lease expired if its time is up; True when it is (from now on) expired."""
        with self._lock:
            if not self._expired and time.monotonic() >= self._expires_at:
                self._expired = True
            return self._expired

    def describe(self) -> dict[str, Any]:
        """JSON-safe facts for an expiry message: silence, last progress, renewals."""
        last = self.last_progress
        now = time.monotonic()
        return {
            "lease_s": self.lease_s,
            "silent_s": round(self.silent_s(), 3),
            "waited_s": round(now - self.granted_at, 3),
            "renewals": self.renewals,
            "last_progress": None
            if last is None
            else {"stage": last.stage, "prefill": last.holder, "ago_s": round(now - last.at, 3)},
        }

    def expiry_message(self) -> str:
        """One sentence saying who went silent, for how long, and what they last reported."""
        facts = self.describe()
        last = facts["last_progress"]
        if last is None:
            return (
                f"no prefill worker reported progress for {facts['silent_s']:.1f}s since the "
                f"reservation (lease {self.lease_s:g}s): prefill worker down, stalled or unreachable"
            )
        return (
            f"prefill worker {last['prefill']} made no progress for {facts['silent_s']:.1f}s "
            f"(lease {self.lease_s:g}s; last progress: {last['stage']}, after {self.renewals} "
            f"renewal{'s' if self.renewals != 1 else ''} over {facts['waited_s']:.1f}s)"
        )


def answer_renewal(
    header: dict[str, Any], find: Callable[[str], tuple[str, Lease] | None], peer: str
) -> dict[str, Any]:
    """Decode side: check and apply one renewal frame (on an authenticated connection); the reply.

    `find` gives the (transfer token, lease) of a transfer still expected, None for an unknown,
    finished or cancelled one. `peer` is the connection's address, used when the frame names no holder.
    """
    request_id = str(header.get("request_id", ""))
    entry = find(request_id)
    if entry is None:
        return {"ok": False, "error": f"unknown or expired request {request_id!r}"}
    token, lease = entry
    if not same_secret(header.get("token", ""), token):
        return {"ok": False, "error": "bad transfer token"}
    holder = str(header.get("holder") or peer)[:200]
    try:
        expires_in = lease.renew(str(header.get("stage", "")), holder)
    except LeaseLost as exc:
        return {"ok": False, "error": str(exc)}
    return {"ok": True, "expires_in": round(expires_in, 3), "cap_in": round(lease.cap_remaining(), 3)}


def request_renewal(
    descriptor: TransferDescriptor, *, secret: str, stage: str, holder: str, timeout: float
) -> float:
    """Prefill side: renew the descriptor's lease once; returns the seconds it now has left.

    Updates `descriptor.lease_expires_at` from the decode worker's relative answer (so clock skew
    between hosts does not matter after the first renewal). Raises LeaseLost when the decode worker
    refused (the blocks are gone) and KVTransferError when it could not be reached.
    """
    where = f"{descriptor.host}:{descriptor.port}"
    frame = {
        "op": "renew",
        "request_id": descriptor.request_id,
        "token": descriptor.token,
        "stage": stage,
        "holder": holder,
    }
    asked_at = time.time()
    deadline = time.monotonic() + timeout
    try:
        sock = connect_authenticated(
            descriptor.host, descriptor.port, secret, connect_timeout=timeout, deadline=deadline
        )
    except HandshakeRefused as exc:
        if not exc.retryable:  # the secret itself: no renewal will ever pass
            raise LeaseLost(f"decode {where} refused the lease renewal: {exc.reason}") from exc
        raise KVTransferError(f"cannot renew the lease at {where}: {exc}") from exc
    except KVTransferError as exc:
        raise KVTransferError(f"cannot renew the lease at {where}: {exc}") from exc
    try:
        with sock:
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            send_frame(sock, frame)
            reply = recv_frame(sock)
    except (OSError, KVTransferError) as exc:
        raise KVTransferError(f"cannot renew the lease at {where}: {exc}") from exc
    if not reply.get("ok"):
        raise LeaseLost(f"decode {where} refused the lease renewal: {reply.get('error', 'unknown error')}")
    try:
        expires_in = float(reply["expires_in"])
    except (KeyError, TypeError, ValueError) as exc:
        raise KVTransferError(f"malformed lease renewal answer from {where}: {reply!r}") from exc
    # Measured from when we asked: the round trip only makes our view of the lease shorter.
    descriptor.lease_expires_at = asked_at + expires_in
    return expires_in
