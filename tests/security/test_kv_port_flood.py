"""Real processes in production mode (`secure_cluster`): 200 idle, unauthenticated sockets held on
the decode worker's KV port do not stop a single generation.

Before the KV port authenticated first, 70 such sockets took all 64 transfer slots for 30 s and every
generation failed with 502 "too many concurrent KV transfers"."""
from __future__ import annotations

import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.security.conftest import SecureCluster

pytestmark = pytest.mark.django_db(transaction=False, databases=[])

IDLE_SOCKETS = 200
GENERATIONS = 16


class Flood:
    """Keeps IDLE_SOCKETS connections open on a port, sending nothing; reopens any the peer closes."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.socks: list[socket.socket] = []
        self.opened = 0
        self.closed_by_peer = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _open(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        sock.setblocking(False)
        self.opened += 1
        return sock

    def _run(self) -> None:
        self.socks = [self._open() for _ in range(IDLE_SOCKETS)]
        while not self._stop.wait(0.05):
            readable, _, _ = select.select(self.socks, [], [], 0)
            for sock in readable:
                try:
                    gone = sock.recv(4096) == b""  # the challenge arrives first: read and ignore it
                except ConnectionResetError:
                    gone = True
                except BlockingIOError:
                    gone = False
                if gone:
                    self.closed_by_peer += 1
                    sock.close()
                    self.socks[self.socks.index(sock)] = self._open()

    def __enter__(self) -> Flood:
        self._thread.start()
        deadline = time.monotonic() + 10
        while len(self.socks) < IDLE_SOCKETS and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        for sock in self.socks:
            sock.close()


def generate(cluster: SecureCluster, i: int) -> httpx.Response:
    return httpx.post(cluster.router + "/generate", headers=cluster.auth, timeout=60,
                      json={"prompt": f"Request number {i} says", "max_tokens": 6, "temperature": 0})


def test_idle_unauthenticated_sockets_do_not_stop_generation(secure_cluster: SecureCluster) -> None:
    kv_port = httpx.get(secure_cluster.decode + "/info", timeout=10).json()["kv_port"]
    with Flood(kv_port) as flood:
        time.sleep(1.5)  # past the handshake timeout: the first sockets have been closed and reopened
        with ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(lambda i: generate(secure_cluster, i), range(GENERATIONS)))
        held = len(flood.socks)
    failures = [(r.status_code, r.text[:300]) for r in responses if r.status_code != 200]
    assert not failures, failures
    assert all(r.json()["kv_bytes"] > 0 for r in responses)
    assert held == IDLE_SOCKETS
    # The flood was real: the gate kept closing unauthenticated sockets and the flood kept replacing them.
    assert flood.closed_by_peer >= IDLE_SOCKETS and flood.opened > 2 * IDLE_SOCKETS
    decode = next(p for p in secure_cluster.procs if p.name == "secure-decode")
    assert "too many concurrent KV transfers" not in decode.log()
    # The router kept the prefill worker in rotation throughout.
    status = httpx.get(secure_cluster.router + "/health", timeout=10).json()
    assert status["ready"] and all(p["healthy"] for p in status["prefill"]), status
