"""Internal worker endpoints and the KV port accept only the platform's shared secret (real processes).

Uses the shared `secure_cluster` (conftest.py): prefill and decode workers started with
PLATFORM_SHARED_SECRET, and a router holding the same secret.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from inference.kv_transfer import KVTransferError, TransferDescriptor
from inference.kv_transfer.tcp import TcpKVSender
from tests.security.conftest import MAX_TOKENS_LIMIT, SECRET, SecureCluster
from tests.support.processes import ROOT, start_router

pytestmark = pytest.mark.django_db(transaction=False, databases=[])

WRONG_HEADERS: list[dict[str, str] | None] = [
    None,
    {"X-Platform-Secret": ""},
    {"X-Platform-Secret": "wrong"},
    {"X-Platform-Secret": SECRET + "x"},
    {"X-Platform-Secret": SECRET.upper()},
]


def post_raw(url: str, body: bytes, headers: dict[str, str] | list[tuple[bytes, bytes]] | None) -> httpx.Response:
    return httpx.post(url, content=body, headers=headers, timeout=30)


@pytest.mark.parametrize("role,path", [("decode", "/internal/decode"), ("decode", "/internal/abort"),
                                       ("prefill", "/internal/prefill"), ("prefill", "/internal/abort")])
def test_internal_endpoints_need_the_secret(secure_cluster: SecureCluster, role: str, path: str) -> None:
    url = getattr(secure_cluster, role) + path
    body = json.dumps({"request_id": "r1", "prompt": "hi"}).encode()
    for headers in WRONG_HEADERS:
        response = post_raw(url, body, headers)
        assert response.status_code == 401, (headers, response.text)
        assert response.json()["error"]["type"] == "unauthorized"
    # A non-ASCII header value is refused too (it used to be a 500: compare_digest on non-ASCII str).
    response = post_raw(url, body, [(b"x-platform-secret", b"s\xe9cret\xff")])
    assert response.status_code == 401, response.text
    # With the secret the request gets past the check (it is then judged on its body).
    assert post_raw(url, b"[]", secure_cluster.internal).status_code == 400


def test_public_worker_endpoints_stay_readable(secure_cluster: SecureCluster) -> None:
    for base in (secure_cluster.prefill, secure_cluster.decode):
        assert httpx.get(base + "/health", timeout=10).status_code == 200
        assert httpx.get(base + "/info", timeout=10).status_code == 200


def _kv_sender_for(descriptor: TransferDescriptor, secret: str) -> tuple[TcpKVSender, list[int]]:
    """A prefill-side sender with a zero KV tensor of the descriptor's layout, and its source blocks."""
    layout = descriptor.layout
    n = len(descriptor.block_ids)
    kv = torch.zeros((n, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim))
    return TcpKVSender(kv, layout, secret=secret), list(range(n))


@pytest.fixture
def open_decode(secure_cluster: SecureCluster) -> Iterator[tuple[TransferDescriptor, Iterator[str]]]:
    """A legitimate decode request (through the secret) waiting for its KV: descriptor + NDJSON lines."""
    body = {"request_id": "kv-secret-test", "prompt": "Hello there",
            "sampling": {"max_tokens": 3, "temperature": 0.0}}
    with httpx.Client(timeout=30) as client, client.stream(
        "POST", secure_cluster.decode + "/internal/decode", json=body, headers=secure_cluster.internal
    ) as response:
        assert response.status_code == 200, response.read()
        lines = response.iter_lines()
        first = json.loads(next(lines))
        assert first["type"] == "descriptor"
        yield TransferDescriptor.from_dict(first["descriptor"]), lines


def test_kv_port_refuses_a_wrong_secret(
    secure_cluster: SecureCluster, open_decode: tuple[TransferDescriptor, Iterator[str]]
) -> None:
    descriptor, lines = open_decode
    info = httpx.get(secure_cluster.decode + "/info", timeout=10).json()
    assert descriptor.port == info["kv_port"]
    for wrong in ("", "wrong-secret", "s\u00e9cret-\u2603"):  # the last one used to kill the receiving thread
        sender, blocks = _kv_sender_for(descriptor, wrong)
        with pytest.raises(KVTransferError) as refused:
            sender.send(descriptor, blocks, first_token=1, timeout=10)
        # Normally the decode worker says why; if it closed first the sender sees a reset instead.
        message = str(refused.value)
        assert "bad shared secret" in message or "failed" in message, message
    # The same descriptor with the right secret still works: it was the secret that was refused,
    # and the request (blocks, lease) survived the attempts.
    sender, blocks = _kv_sender_for(descriptor, SECRET)
    stats = sender.send(descriptor, blocks, first_token=1, timeout=10)
    assert stats.nbytes == len(descriptor.block_ids) * descriptor.layout.block_nbytes
    events = [json.loads(line) for line in lines if line]
    assert events[-1]["type"] == "done", events
    assert sum(len(e.get("token_ids", [])) for e in events if e["type"] == "token") >= 1


def test_router_with_the_secret_works_end_to_end(secure_cluster: SecureCluster) -> None:
    response = httpx.post(secure_cluster.router + "/generate", headers=secure_cluster.auth, timeout=60,
                          json={"prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] >= 1 and body["kv_bytes"] > 0


def test_router_without_the_secret_is_refused_by_the_workers(secure_cluster: SecureCluster, log_dir: Path) -> None:
    env = {"PLATFORM_SHARED_SECRET": "", "ROUTER_CONNECT_TIMEOUT_S": "2"}
    router, url = start_router([secure_cluster.prefill], [secure_cluster.decode], log_dir, env=env)
    try:
        response = httpx.post(url + "/generate", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        # The workers answer 401; the router counts that as a failed backend, never as success.
        assert response.status_code == 502, response.text
        assert "401" in response.text
    finally:
        router.stop()


def test_max_tokens_over_the_worker_limit_is_400(secure_cluster: SecureCluster) -> None:
    over = MAX_TOKENS_LIMIT + 1
    direct = httpx.post(secure_cluster.decode + "/internal/decode", headers=secure_cluster.internal, timeout=30,
                        json={"prompt": "hi", "sampling": {"max_tokens": over}})
    assert direct.status_code == 400 and "max_tokens" in direct.json()["error"]["message"]
    routed = httpx.post(secure_cluster.router + "/generate", headers=secure_cluster.auth, timeout=30,
                        json={"prompt": "hi", "max_tokens": over})
    assert routed.status_code == 400 and "max_tokens" in routed.json()["error"]["message"]
    ok = httpx.post(secure_cluster.router + "/generate", headers=secure_cluster.auth, timeout=60,
                    json={"prompt": "hi", "max_tokens": MAX_TOKENS_LIMIT, "temperature": 0})
    assert ok.status_code == 200, ok.text


def test_worker_body_limit(secure_cluster: SecureCluster) -> None:
    from inference.server.app import MAX_BODY_BYTES

    url = secure_cluster.decode + "/internal/decode"
    big = b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    declared = httpx.post(url, content=big, headers=secure_cluster.internal, timeout=60)
    assert declared.status_code == 413 and declared.json()["error"]["type"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the worker must count while reading
        for start in range(0, len(big), 1 << 20):
            yield big[start:start + (1 << 20)]

    chunked = httpx.post(url, content=chunks(), headers=secure_cluster.internal, timeout=60)
    assert chunked.status_code == 413
    # Without the secret nothing is read at all: 401 first.
    assert httpx.post(url, content=big, timeout=60).status_code == 401


def test_production_worker_refuses_to_start_without_a_secret(tiny_model_dir: Path) -> None:
    env: dict[str, Any] = {k: v for k, v in os.environ.items() if k != "PLATFORM_SHARED_SECRET"}
    env.update(PLATFORM_PRODUCTION="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "inference.launch_server", "--model-path", str(tiny_model_dir),
           "--service-type", "decode", "--port", "1", "--host", "127.0.0.1"]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "PLATFORM_SHARED_SECRET" in result.stderr and "PLATFORM_PRODUCTION" in result.stderr
