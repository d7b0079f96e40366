"""The streaming handler learns at once that its client hung up (inference/gateway/client_link.py).

A real uvicorn server (uvloop and httptools, as the router runs) streams events to a raw socket
client that reads the first one and closes. The handler asks `client_gone_probe` after every send:
it must report the hang-up within a few sends, not go on writing into a closed connection (every
later send is dropped silently by uvicorn, and the router would credit its decode worker for them).
"""
from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import uvicorn

from inference.gateway.client_link import client_gone_probe
from tests.support.processes import NotReady

# Sends the handler may make at most (a bound for the test; each waits 2 ms).
_MAX_SENDS = 5000


class _Handler:
    """An ASGI app streaming numbered events until its probe says the client left."""

    def __init__(self) -> None:
        self.probe_is_live = False
        self.sends = 0
        self.first_sent = threading.Event()
        self.ended = threading.Event()
        self.gone_seen = False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        gone = client_gone_probe(send)
        self.probe_is_live = gone.__name__ == "gone"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        try:
            for _ in range(_MAX_SENDS):
                await send({"type": "http.response.body", "body": b"data: {\"n\": %d}\n\n" % self.sends,
                            "more_body": True})
                self.sends += 1
                self.first_sent.set()
                if gone():
                    self.gone_seen = True
                    return
                await asyncio.sleep(0.002)
        finally:
            self.ended.set()


def test_a_client_that_hangs_up_is_seen_gone_within_a_few_sends() -> None:
    handler = _Handler()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # connections queue until the server thread serves them
    port = listener.getsockname()[1]
    config = uvicorn.Config(handler, lifespan="off", loop="auto", http="auto", log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        client = socket.create_connection(("127.0.0.1", port), timeout=30)
        try:
            client.sendall(b"GET /stream HTTP/1.1\r\nHost: test\r\n\r\n")
            assert client.recv(4096).startswith(b"HTTP/1.1 200")
            assert handler.first_sent.wait(30)
        finally:
            client.close()  # unread events in its buffer: the kernel resets the connection
        closed_at = handler.sends
        if not handler.ended.wait(60):
            raise NotReady("the handler never ended")
        assert handler.probe_is_live, "the probe did not find uvicorn's request cycle behind `send`"
        assert handler.gone_seen, f"the handler sent {handler.sends} events without seeing the hang-up"
        # A few sends may race the close (written before the reset arrived); never hundreds.
        assert handler.sends - closed_at < 50
    finally:
        server.should_exit = True
        thread.join(30)
        listener.close()


def test_outside_uvicorn_the_probe_never_reports_a_client_gone() -> None:
    async def send(message: dict[str, Any]) -> None:
        del message

    assert client_gone_probe(send)() is False
