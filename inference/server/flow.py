"""Small send buffers on a worker's HTTP connections, so that a decode stream feels its reader.

uvicorn's `send` waits only once the connection's transport buffer passes its high-water mark
(asyncio's default: 64 KiB), and the kernel's send buffer takes more before that: a token line is
about 60 bytes, so a whole 200-token answer fits in the buffers of a reader that reads nothing. With
both kept small, a stream whose reader (the router) falls behind makes the worker's `send` wait, its
engine outputs pile up, and the engine pauses the sequence (`AsyncEngine` flow control) a few tokens
later instead of generating the whole answer for a client that may be gone.

Used as uvicorn's protocol class: `uvicorn.Config(app, http=bounded_http_protocol(...))`.
"""
from __future__ import annotations

import asyncio
import logging
import socket

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)

# Bytes the transport may hold before `send` waits (a few token lines; responses that are one JSON
# body are written whole regardless: the limit only decides when the *next* write waits).
DEFAULT_WRITE_HIGH_WATER = 1024
# SO_SNDBUF asked of the kernel (Linux doubles it and has a floor of about 4.5 KiB).
DEFAULT_SNDBUF = 4096


def bound_transport(transport: asyncio.BaseTransport, high_water: int, sndbuf: int) -> None:
    """Apply the write limits to one connection (best effort: a transport without a socket keeps its
    defaults)."""
    # Duck-typed: uvloop's transports (what uvicorn runs on when it is installed) implement
    # set_write_buffer_limits without subclassing asyncio.WriteTransport.
    limits = getattr(transport, "set_write_buffer_limits", None)
    if limits is not None and high_water > 0:
        limits(high=high_water, low=high_water // 2)
    sock = transport.get_extra_info("socket")
    if sock is not None and sndbuf > 0:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        except OSError as exc:  # not fatal: the stream still works, with the kernel's buffer
            logger.debug("SO_SNDBUF %d refused: %s", sndbuf, exc)


def bounded_http_protocol(
    high_water: int = DEFAULT_WRITE_HIGH_WATER, sndbuf: int = DEFAULT_SNDBUF
) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with `bound_transport` applied to every accepted connection."""

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        """HttpToolsProtocol whose connections have small send buffers."""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            """Accept as uvicorn does, then shrink the buffers before any response is written."""
            super().connection_made(transport)
            bound_transport(transport, high_water, sndbuf)

    return BoundedHttpToolsProtocol
