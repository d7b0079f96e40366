"""The KV port's handshake: a connection proves it holds the shared secret before anything else.

The decode side speaks first, the moment it accepts a connection (JSON frames from `wire.py`):

    decode  → {"op": "challenge", "v": 1, "nonce": server nonce}
    prefill → {"op": "auth", "nonce": client nonce, "mac": HMAC(secret, client proof)}
    decode  → {"ok": true, "mac": HMAC(secret, server proof)} | {"ok": false, "error": "..."}

Both proofs cover both nonces, so a recorded handshake is worth nothing on another connection, and
the secret itself never crosses the wire. The decode side answers only after the proof checked and
a transfer slot was free, so a refusal always reaches the sender as words (never a reset). Without
a secret (open mode) the proofs are keyed with the empty string and not checked: the handshake then
only bounds how long a connection may sit idle before it holds a slot.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import time
from typing import Any

from inference.kv_transfer.base import KVTransferError
from inference.kv_transfer.wire import recv_frame, send_frame

VERSION = 1
# The longest auth frame a peer may send before it has proven anything (a nonce and a MAC fit in 200).
MAX_AUTH_FRAME_BYTES = 512
# Attempts at connecting and authenticating when the decode side closed before a word was said
# (an unauthenticated flood from the same address evicted us, or every slot was busy): nothing was
# sent yet, so trying again is safe.
CONNECT_ATTEMPTS = 3
_RETRY_PAUSES_S = (0.02, 0.1)


class HandshakeRefused(KVTransferError):
    """The decode side refused the connection (`reason`); `retryable` unless it was the secret."""

    def __init__(self, reason: str, *, retryable: bool) -> None:
        super().__init__(f"decode refused the KV transfer: {reason}")
        self.reason = reason
        self.retryable = retryable


def new_nonce() -> str:
    """A fresh random nonce, as hex."""
    return secrets.token_hex(16)


def _mac(secret: str, role: str, server_nonce: str, client_nonce: str) -> str:
    """HMAC-SHA256 proof of the secret, bound to both nonces and to who proves it."""
    message = f"platform-kv-auth-v{VERSION}|{role}|{server_nonce}|{client_nonce}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def _same(given: object, expected: str) -> bool:
    """Constant-time comparison as bytes (compare_digest raises TypeError for non-ASCII str)."""
    text = given if isinstance(given, str) else str(given)
    return hmac.compare_digest(text.encode("utf-8", "surrogatepass"), expected.encode())


def challenge_frame(server_nonce: str) -> dict[str, Any]:
    """What the decode side sends first on every accepted connection."""
    return {"op": "challenge", "v": VERSION, "nonce": server_nonce}


def check_auth(frame: dict[str, Any], server_nonce: str, secret: str) -> tuple[dict[str, Any] | None, str]:
    """Decode side: judge the peer's auth frame; (the ok reply, "") or (None, why it is refused)."""
    if frame.get("op") != "auth":
        return None, "expected the KV authentication handshake first (a prefill worker of an older version?)"
    client_nonce = frame.get("nonce")
    if not isinstance(client_nonce, str) or not 16 <= len(client_nonce) <= 128:
        return None, "malformed authentication frame"
    if secret and not _same(frame.get("mac", ""), _mac(secret, "client", server_nonce, client_nonce)):
        return None, "bad shared secret"
    return {"ok": True, "mac": _mac(secret, "server", server_nonce, client_nonce)}, ""


def authenticate(sock: socket.socket, secret: str) -> None:
    """Prefill side: answer the decode side's challenge on a fresh connection and check its proof.

    Raises HandshakeRefused when the decode side says no, KVTransferError on a malformed exchange,
    OSError (TimeoutError included) or KVTransferError when the peer goes silent or away.
    """
    challenge = recv_frame(sock)
    server_nonce = challenge.get("nonce")
    if challenge.get("op") != "challenge" or not isinstance(server_nonce, str):
        if challenge.get("ok") is False:  # refused before any handshake
            raise HandshakeRefused(str(challenge.get("error", "refused")), retryable=True)
        raise KVTransferError("the KV port did not start the authentication handshake (an older decode worker?)")
    client_nonce = new_nonce()
    send_frame(sock, {"op": "auth", "nonce": client_nonce, "mac": _mac(secret, "client", server_nonce, client_nonce)})
    reply = recv_frame(sock)
    if not reply.get("ok"):
        error = str(reply.get("error", "unknown error"))
        raise HandshakeRefused(error, retryable=error != "bad shared secret")
    if secret and not _same(reply.get("mac", ""), _mac(secret, "server", server_nonce, client_nonce)):
        raise HandshakeRefused("the decode KV port could not prove the shared secret", retryable=False)


def connect_authenticated(
    host: str, port: int, secret: str, *, connect_timeout: float, deadline: float
) -> socket.socket:
    """Connect to a decode KV port and pass its handshake; the socket is left with TCP_NODELAY.

    `deadline` is a time.monotonic() bound on the whole call. A connection the decode side closed
    (or turned away as busy) before the handshake completed is tried again, at most
    CONNECT_ATTEMPTS times in all. Raises KVTransferError naming the peer ("cannot connect",
    "timed out", or the decode side's refusal).
    """
    where = f"{host}:{port}"
    for attempt in range(CONNECT_ATTEMPTS):
        remaining = max(deadline - time.monotonic(), 0.01)
        try:
            sock = socket.create_connection((host, port), timeout=min(connect_timeout, remaining))
        except OSError as exc:
            raise KVTransferError(f"cannot connect to decode KV port {where}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            authenticate(sock, secret)
            return sock
        except HandshakeRefused as exc:
            sock.close()
            if not exc.retryable or attempt + 1 == CONNECT_ATTEMPTS:
                raise
        except TimeoutError as exc:
            sock.close()
            raise KVTransferError(f"KV transfer to {where} timed out") from exc
        except (OSError, KVTransferError) as exc:
            sock.close()
            if attempt + 1 == CONNECT_ATTEMPTS:
                raise KVTransferError(f"KV transfer to {where} failed during the handshake: {exc}") from exc
        time.sleep(min(_RETRY_PAUSES_S[min(attempt, len(_RETRY_PAUSES_S) - 1)], max(deadline - time.monotonic(), 0)))
    raise AssertionError("unreachable")
