"""Real worker processes (production mode, the shared `secure_cluster`): aborts that overtake their
request, callers that hang up mid-body, and oversized bodies answered readably to httpx."""
from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from inference.server.app import MAX_BODY_BYTES
from tests.security.conftest import SECRET, SecureCluster

pytestmark = pytest.mark.django_db(transaction=False, databases=[])

SAMPLING = {"max_tokens": 4, "temperature": 0.0}


def health(url: str) -> dict[str, object]:
    return httpx.get(url + "/health", timeout=10).json()


def abort(cluster: SecureCluster, url: str, request_id: str) -> None:
    response = httpx.post(url + "/internal/abort", json={"request_id": request_id}, headers=cluster.internal,
                          timeout=10)
    assert response.status_code == 200, response.text


def test_an_abort_that_overtakes_its_decode_request_is_applied_on_arrival(secure_cluster: SecureCluster) -> None:
    abort(secure_cluster, secure_cluster.decode, "overtaken-decode")
    response = httpx.post(secure_cluster.decode + "/internal/decode", headers=secure_cluster.internal, timeout=30,
                          json={"request_id": "overtaken-decode", "prompt": "Hello", "sampling": SAMPLING})
    assert response.status_code == 409, response.text
    assert response.json()["error"]["type"] == "aborted"
    after = health(secure_cluster.decode)
    assert after["reserved"] == 0 and after["kv_usage"] == 0  # nothing was reserved for it
    # Only that id is refused: another request is served as usual.
    with httpx.Client(timeout=30) as client, client.stream(
        "POST", secure_cluster.decode + "/internal/decode", headers=secure_cluster.internal,
        json={"request_id": "not-aborted", "prompt": "Hello", "sampling": SAMPLING},
    ) as stream:
        assert stream.status_code == 200
        assert json.loads(next(stream.iter_lines()))["type"] == "descriptor"
    # Closing that stream aborted it: its blocks are free again.
    deadline = time.monotonic() + 10
    while health(secure_cluster.decode)["reserved"] != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert health(secure_cluster.decode)["reserved"] == 0


def test_an_abort_that_overtakes_its_prefill_request_is_applied_on_arrival(secure_cluster: SecureCluster) -> None:
    abort(secure_cluster, secure_cluster.prefill, "overtaken-prefill")
    # The refusal comes before anything is parsed or computed: even the descriptor is not looked at.
    response = httpx.post(secure_cluster.prefill + "/internal/prefill", headers=secure_cluster.internal,
                          timeout=30, json={"request_id": "overtaken-prefill", "prompt_token_ids": [1, 2, 3],
                                            "sampling": SAMPLING, "descriptor": {}})
    assert response.status_code == 409, response.text
    assert response.json()["error"]["type"] == "aborted"
    assert health(secure_cluster.prefill)["running"] == 0


def _hang_up_mid_body(url: str) -> None:
    """Send headers promising a body, part of it, and close the connection."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(
            b"POST /internal/decode HTTP/1.1\r\nHost: worker\r\nContent-Type: application/json\r\n"
            + f"X-Platform-Secret: {SECRET}\r\nContent-Length: 100000\r\n\r\n".encode()
            + b'{"prompt": "'
        )
        time.sleep(0.05)  # let the worker start reading the body


def test_a_caller_hanging_up_mid_body_is_a_quiet_close(secure_cluster: SecureCluster) -> None:
    decode = next(p for p in secure_cluster.procs if p.name == "secure-decode")
    before = decode.log()
    for _ in range(10):
        _hang_up_mid_body(secure_cluster.decode)
    deadline = time.monotonic() + 10
    while decode.log().count("closed the connection while sending") - before.count(
            "closed the connection while sending") < 10 and time.monotonic() < deadline:
        time.sleep(0.1)
    new = decode.log()[len(before):]
    assert new.count("closed the connection while sending") == 10, new[-3000:]
    assert "Traceback" not in new and "ClientDisconnect" not in new, new[-3000:]
    assert health(secure_cluster.decode)["status"] == "healthy"


def test_an_oversized_body_gets_its_413_on_a_kept_alive_httpx_connection(secure_cluster: SecureCluster) -> None:
    big = b'{"prompt": "' + b"a" * (2 * MAX_BODY_BYTES) + b'"}'

    def chunks() -> Iterator[bytes]:  # no Content-Length
        for start in range(0, len(big), 1 << 20):
            yield big[start:start + (1 << 20)]

    # One client, one connection, several times over: the answer is read every time (no reset),
    # and the connection stays usable for the next request.
    with httpx.Client(timeout=60, headers=secure_cluster.internal) as client:
        for url in (secure_cluster.decode, secure_cluster.prefill):
            path = "/internal/decode" if url == secure_cluster.decode else "/internal/prefill"
            for _ in range(3):
                declared = client.post(url + path, content=big)
                assert declared.status_code == 413, declared.text
                assert declared.json()["error"]["type"] == "request_too_large"
                chunked = client.post(url + path, content=chunks())
                assert chunked.status_code == 413, chunked.text
            assert client.post(url + "/internal/abort", json={"request_id": "x"}).status_code == 200
    # Refused callers get their answer too: a 401 without the secret, the body read and dropped.
    for _ in range(3):
        refused = httpx.post(secure_cluster.decode + "/internal/decode", content=big, timeout=60)
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "unauthorized"
