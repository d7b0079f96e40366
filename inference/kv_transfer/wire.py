"""Framing for the TCP KV protocol: a 4-byte big-endian length and a JSON header, never pickle."""
from __future__ import annotations

import json
import socket
import struct
from typing import Any

from inference.kv_transfer.base import KVTransferError

MAX_HEADER_BYTES = 1 << 20


def send_frame(sock: socket.socket, header: dict[str, Any]) -> None:
    """Send one JSON header frame."""
    payload = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(struct.pack("!I", len(payload)) + payload)


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` completely from the socket (raises KVTransferError if the peer closes early)."""
    got = 0
    total = len(view)
    while got < total:
        n = sock.recv_into(view[got:], total - got)
        if n == 0:
            raise KVTransferError(f"peer closed after {got} of {total} bytes")
        got += n


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    """Receive one JSON header frame; oversize or malformed frames are a KVTransferError."""
    size_buf = bytearray(4)
    recv_exact_into(sock, memoryview(size_buf))
    (size,) = struct.unpack("!I", size_buf)
    if size > MAX_HEADER_BYTES:
        raise KVTransferError(f"header of {size} bytes exceeds {MAX_HEADER_BYTES}")
    payload = bytearray(size)
    recv_exact_into(sock, memoryview(payload))
    try:
        header = json.loads(payload)
    except ValueError as exc:
        raise KVTransferError(f"malformed header: {exc}") from exc
    if not isinstance(header, dict):
        raise KVTransferError("header must be a JSON object")
    return header
