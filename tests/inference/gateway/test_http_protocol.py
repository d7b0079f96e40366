"""The router's HTTP protocol (inference/gateway/http_protocol.py) on a real uvicorn server: a lone
`GET /health` is answered by the protocol, without the ASGI app; anything else reaches the app.
"""
from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from inference.gateway import http_protocol


class _App:
    """Answers 'ok' and records the paths it saw."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.paths.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain"),
                                                                       (b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture()
def server() -> Iterator[tuple[int, _App]]:
    app = _App()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    config = uvicorn.Config(app, lifespan="off", loop="auto", http=http_protocol.RouterHttpProtocol,
                            log_level="warning")
    runner = uvicorn.Server(config)
    thread = threading.Thread(target=runner.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], app
    finally:
        runner.should_exit = True
        thread.join(30)
        listener.close()


def _answer(sock: socket.socket) -> bytes:
    """One whole response with a content-length (bounded by the socket's timeout)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_health_is_answered_by_the_protocol(server: tuple[int, _App], monkeypatch: pytest.MonkeyPatch) -> None:
    port, app = server
    monkeypatch.setattr(http_protocol, "health_report", lambda: {"status": "healthy", "ready": True})
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        first = _answer(sock)
        sock.sendall(b"GET /other HTTP/1.1\r\nHost: t\r\n\r\n")  # the same connection serves the next
        other = _answer(sock)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        last = _answer(sock)
        assert sock.recv(10) == b""  # closed after an answer that said so
    assert first.startswith(b"HTTP/1.1 200") and first.endswith(b'{"status":"healthy","ready":true}')
    assert b"connection: close" in last.lower() and last.endswith(b'"ready":true}')
    assert other.endswith(b"ok")
    assert app.paths == ["/other"]  # the probes never reached the app


def test_health_the_protocol_cannot_answer_goes_to_the_app(server: tuple[int, _App],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    port, app = server
    monkeypatch.setattr(http_protocol, "health_report", lambda: None)  # e.g. endpoints not checked yet
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert _answer(sock).endswith(b"ok")
        sock.sendall(b"GET /health?verbose=1 HTTP/1.1\r\nHost: t\r\n\r\n")
        assert _answer(sock).endswith(b"ok")
    assert app.paths == ["/health", "/health"]
