"""The router's public API with API keys on, as deployed (real router, prefill and decode processes).

Keys over HTTP and the OpenAI client, ws/generate closing with 4401 without a key, /health open,
and the request size limits (HTTP body → 413 JSON, WebSocket message → error 413 and close 1009).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from tests.security.conftest import (
    API_KEY,
    OTHER_API_KEY,
    ROUTER_MAX_BODY_BYTES,
    ROUTER_MAX_WS_MESSAGE_BYTES,
    SecureCluster,
)

pytestmark = pytest.mark.django_db(transaction=False, databases=[])

GUARDED = [
    ("POST", "/generate", {"prompt": "hi", "max_tokens": 2}),
    ("POST", "/api/generate", {"prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/completions", {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions",
     {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("GET", "/router/status", None),
]
BAD_AUTH: list[dict[str, str]] = [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"Bearer {API_KEY}-"},
    {"Authorization": f"Basic {API_KEY}"},
    {"Authorization": "Bearer " + "a" * 40},  # shaped like a DRF token: looked up, none found
]


def assert_auth_error(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("method,path,body", GUARDED)
def test_generation_api_needs_a_key(secure_cluster: SecureCluster, method: str, path: str, body: object) -> None:
    url = secure_cluster.router + path
    for headers in BAD_AUTH:
        assert_auth_error(httpx.request(method, url, json=body, headers=headers, timeout=30))
    for key in (API_KEY, OTHER_API_KEY):
        ok = httpx.request(method, url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert ok.status_code == 200, ok.text


def test_health_is_open(secure_cluster: SecureCluster) -> None:
    assert httpx.get(secure_cluster.router + "/health", timeout=10).json()["status"] == "healthy"


def test_openai_client_api_key(secure_cluster: SecureCluster) -> None:
    client = openai.OpenAI(base_url=secure_cluster.router + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    chat = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
    )
    assert chat.choices[0].finish_reason in ("stop", "length")
    stream = client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=3, temperature=0, stream=True)
    assert len(list(stream)) >= 1
    wrong = openai.OpenAI(base_url=secure_cluster.router + "/v1", api_key="sk-wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="tiny-llama", prompt="Hello", max_tokens=3)


def ws_url(cluster: SecureCluster) -> str:
    return cluster.router.replace("http://", "ws://") + "/ws/generate"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}])
def test_websocket_without_a_key_is_closed_with_4401(secure_cluster: SecureCluster, headers: dict[str, str]) -> None:
    with ws_connect(ws_url(secure_cluster), additional_headers=headers, open_timeout=30) as ws:
        error = json.loads(ws.recv(timeout=30))
        assert error["type"] == "error" and error["status"] == 401
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=30)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4401


def test_websocket_with_a_key_generates(secure_cluster: SecureCluster) -> None:
    with ws_connect(ws_url(secure_cluster), additional_headers=secure_cluster.auth, open_timeout=30) as ws:
        ws.send(json.dumps({"prompt": "Hello", "max_tokens": 3, "temperature": 0}))
        messages: list[dict[str, Any]] = []
        while not messages or messages[-1]["type"] not in ("done", "error"):
            messages.append(json.loads(ws.recv(timeout=60)))
        assert messages[-1]["type"] == "done", messages


def test_websocket_message_size_limit(secure_cluster: SecureCluster) -> None:
    with ws_connect(ws_url(secure_cluster), additional_headers=secure_cluster.auth, open_timeout=30) as ws:
        ws.send(json.dumps({"prompt": "a" * ROUTER_MAX_WS_MESSAGE_BYTES}))
        error = json.loads(ws.recv(timeout=30))
        assert error["type"] == "error" and error["status"] == 413
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=30)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009


def test_http_body_limit(secure_cluster: SecureCluster) -> None:
    url = secure_cluster.router + "/generate"
    big = json.dumps({"prompt": "a" * ROUTER_MAX_BODY_BYTES}).encode()
    declared = httpx.post(url, content=big, headers={**secure_cluster.auth, "Content-Type": "application/json"},
                          timeout=30)
    assert declared.status_code == 413 and declared.json()["error"]["type"] == "invalid_request_error"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for start in range(0, len(big), 8192):
            yield big[start:start + 8192]

    chunked = httpx.post(url, content=chunks(), headers=secure_cluster.auth, timeout=30)
    assert chunked.status_code == 413 and chunked.json()["error"]["message"]
    # The REST API and the admin live behind the same limit.
    assert httpx.post(secure_cluster.router + "/api/models/", content=big, timeout=30).status_code == 413
    # Just under the limit is parsed (and judged on its content: a prompt far over the context).
    fits = json.dumps({"prompt": "word " * 100, "max_tokens": 2}).encode()
    assert httpx.post(url, content=fits, headers=secure_cluster.auth, timeout=60).status_code in (200, 400)
