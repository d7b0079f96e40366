"""What the router's acceptor answers itself and what it hands over (acceptor_protocol.classify),
the bytes of its answers, and the clean-up of dead acceptors' private directories."""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from inference.gateway.acceptor_process import remove_dead_dirs
from inference.gateway.acceptor_protocol import HEAD_LIMIT, Probe, Verdict, classify, response


@pytest.mark.parametrize("data", [b"G", b"GET /he", b"HEAD /health", b"GET /health HTTP/1.1\r\nHost: x\r\n"])
def test_the_start_of_a_probe_is_read_on(data: bytes) -> None:
    assert classify(data) == (Verdict.MORE, None)


@pytest.mark.parametrize(("data", "probe"), [
    (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", Probe(head_only=False, close=False)),
    (b"GET /health HTTP/1.1\r\n\r\n", Probe(head_only=False, close=False)),
    (b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n", Probe(head_only=False, close=True)),
    (b"HEAD /health HTTP/1.1\r\nconnection: Keep-Alive, close\r\n\r\n", Probe(head_only=True, close=True)),
    (b"GET /health HTTP/1.0\r\n\r\n", Probe(head_only=False, close=True)),
    (b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", Probe(head_only=False, close=False)),
])
def test_whole_probes_are_answered_here(data: bytes, probe: Probe) -> None:
    assert classify(data) == (Verdict.PROBE, probe)


@pytest.mark.parametrize("data", [
    b"POST /v1/completions HTTP/1.1\r\n",
    b"GET /healthz HTTP/1.1\r\n\r\n",
    b"GET /health?verbose=1 HTTP/1.1\r\n\r\n",
    b"GET /health HTTP/2.0\r\n\r\n",
    b"GET /health HTTP/1.1\r\nContent-Length: 2\r\n\r\n",
    b"GET /health HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"GET /health HTTP/1.1\r\nBadHeader\r\n\r\n",
    b"GET /health HTTP/1.1\r\n\r\nGET /health HTTP/1.1\r\n\r\n",  # pipelined: the router reads them
    b"GET /health HTTP/1.1\r\nX: " + b"a" * HEAD_LIMIT,  # a head too large to wait for
    b"\x16\x03\x01\x02\x00",  # a TLS hello
])
def test_everything_else_goes_to_a_router_process(data: bytes) -> None:
    assert classify(data) == (Verdict.OTHER, None)


def test_answers() -> None:
    ok = response(200, {"ready": True}, Probe(head_only=False, close=False), b"Fri, 04 Dec 2026 16:00:00 GMT")
    head, _, body = ok.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"content-length: %d" % len(body) in head
    assert b"connection" not in head and json.loads(body) == {"ready": True}
    down = response(503, {"ready": False}, Probe(head_only=True, close=True), b"d")
    head, _, body = down.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 Service Unavailable\r\n") and body == b""
    assert b"retry-after: 1" in head and b"connection: close" in head and b"content-length: 15" in head


def test_dead_acceptors_directories_are_removed(tmp_path: Path) -> None:
    live, dead = tmp_path / "disagg-router-live", tmp_path / "disagg-router-dead"
    for folder in (live, dead):
        folder.mkdir()
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listening.bind(str(live / "acceptor.sock"))
    listening.listen(1)
    gone = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    gone.bind(str(dead / "acceptor.sock"))  # bound, never listening: as after a SIGKILL
    gone.close()
    try:
        assert remove_dead_dirs(str(tmp_path)) == 0  # both fresh: a starting acceptor may not listen yet
        for folder in (live, dead):
            os.utime(folder, (time.time() - 120, time.time() - 120))
        assert remove_dead_dirs(str(tmp_path)) == 1
        assert live.exists() and not dead.exists()
    finally:
        listening.close()


def test_a_snapshot_too_large_for_one_record_goes_without_its_health() -> None:
    import json

    from inference.gateway.acceptor_protocol import SNAPSHOT, SNAPSHOT_LIMIT, snapshot_record

    small = {"pid": 7, "health": {"ready": True, "decode": [{"url": "http://w:1"}]}}
    assert snapshot_record(small) == SNAPSHOT + json.dumps(small).encode()
    endpoints = [{"url": f"http://10.0.{i // 256}.{i % 256}:30001", "healthy": True, "inflight": 0,
                  "last_error": None} for i in range(4000)]
    record = snapshot_record({"pid": 7, "health": {"ready": True, "decode": endpoints}})
    sent = json.loads(record[1:])
    assert len(record) <= SNAPSHOT_LIMIT and sent["health"] is None and sent["pid"] == 7
    assert sent["health_bytes"] > SNAPSHOT_LIMIT
