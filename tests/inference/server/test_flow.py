"""Small send buffers (inference/server/flow.py): a reader that stops reading stops the writer soon."""
from __future__ import annotations

import asyncio
import socket
from typing import Any

import uvicorn

from inference.server.flow import bounded_http_protocol
from tests.support.processes import free_port

LINES = 5000
LINE = b'{"type":"token","token_ids":[1234],"text":" word"}\n'  # a decode stream's token line


class _Streamer:
    """An ASGI app streaming LINES lines, counting how many `send` calls returned."""

    def __init__(self) -> None:
        self.sent = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """One streamed response, whatever the request."""
        assert scope["type"] == "http"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/x-ndjson")]})
        for _ in range(LINES):
            await send({"type": "http.response.body", "body": LINE, "more_body": True})
            self.sent += 1
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _settled(app: _Streamer) -> int:
    """`app.sent` once it stopped moving (or reached the end); bounded."""
    last = -1
    for _ in range(100):
        await asyncio.sleep(0.1)
        if app.sent == last or app.sent == LINES:
            break
        last = app.sent
    return app.sent


def test_a_reader_that_stops_reading_stops_the_stream_within_a_few_kib() -> None:
    """The client sends its request and reads nothing: the server's `send` waits after a few KiB
    (not the whole 250 KiB answer); once the client reads, every line arrives."""
    app = _Streamer()
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning",
                            http=bounded_http_protocol())
    server = uvicorn.Server(config)

    async def main() -> tuple[int, int]:
        serving = asyncio.ensure_future(server.serve())
        for _ in range(100):
            if server.started:
                break
            await asyncio.sleep(0.05)
        client = socket.socket()
        # A small receive window, as the router's connections would have.
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        client.settimeout(10)
        try:
            await asyncio.to_thread(client.connect, ("127.0.0.1", port))
            await asyncio.to_thread(client.sendall, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            stalled = await _settled(app)

            def read_all() -> int:
                got = b""
                while not got.endswith(b"0\r\n\r\n"):
                    chunk = client.recv(65536)
                    if not chunk:
                        break
                    got += chunk
                return got.count(LINE)

            received = await asyncio.to_thread(read_all)
        finally:
            client.close()
            server.should_exit = True
            await serving
        return stalled, received

    stalled, received = asyncio.run(main())
    assert stalled < LINES // 10, f"{stalled} lines went out to a reader that read nothing"
    assert received == LINES


def test_limits_apply_to_uvloop_transports() -> None:
    """uvicorn runs on uvloop when it is installed, whose transports do not subclass asyncio's."""
    import uvloop

    from inference.server.flow import bound_transport

    async def scenario() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
        try:
            bound_transport(transport, 1024, 4096)
            return transport.get_write_buffer_limits()  # type: ignore[attr-defined, no-any-return]
        finally:
            transport.close()
            server.close()

    assert uvloop.run(scenario()) == (512, 1024)
