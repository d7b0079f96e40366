"""The router's public API, served the way it is deployed.

`python -m inference.launch_router` runs as a real subprocess (gunicorn + uvicorn worker + Django/
Channels) in front of stand-in prefill and decode workers that follow docs/internals.md; the tests
talk to it over HTTP, with the OpenAI client and over a WebSocket.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from websockets.sync.client import connect as ws_connect

from tests.inference.router.stand_ins import Cluster, StandIn, free_port

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def router(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The router process in front of the cluster; yields its base URL."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("router") / "router.log"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "PLATFORM_VAR_DIR": str(log_path.parent),
        "ROUTER_HEALTH_INTERVAL_S": "0.3",
        "ROUTER_CONNECT_TIMEOUT_S": "3",
        "ROUTER_GRACEFUL_TIMEOUT_S": "2",
        "ROUTER_MODEL_ALIASES": "gpt-4o-mini=stub-model",
    }
    cmd = [sys.executable, "-m", "inference.launch_router", "--host", "127.0.0.1", "--listen-port", str(port),
           "--load-balance-strategy", "round-robin", "--log-level", "warning"]
    for url in cluster.prefill_urls:
        cmd += ["--prefill-endpoint", url]
    for url in cluster.decode_urls:
        cmd += ["--decode-endpoint", url]
    with log_path.open("wb") as log:
        process = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 45
        while True:
            if process.poll() is not None:
                pytest.fail(f"router exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"router did not start:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


@pytest.fixture
def fresh(cluster: Cluster, router: str) -> Cluster:
    """Well-behaved stand-ins, and a router that sees every one of them in rotation again."""
    cluster.reset()
    deadline = time.monotonic() + 15
    while True:
        status = httpx.get(f"{router}/router/status", timeout=2).json()
        endpoints = status["prefill"] + status["decode"]
        if all(e["healthy"] and e["consecutive_failures"] == 0 and e["inflight"] == 0 for e in endpoints):
            return cluster
        assert time.monotonic() < deadline, f"router never saw the stand-ins healthy: {status}"
        time.sleep(0.05)


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing on the way."""
    text = response.read().decode()
    assert text.endswith("\n\n")
    blocks = text.split("\n\n")[:-1]
    assert all(block.startswith("data: ") and "\n" not in block for block in blocks)
    return [block[len("data: "):] for block in blocks]


def served_by(stand_ins: list[StandIn]) -> tuple[StandIn, str]:
    """The stand-in that got a request, and the request id it got."""
    for stand_in in stand_ins:
        if stand_in.requests:
            return stand_in, stand_in.requests[0]["request_id"]
    raise AssertionError("no stand-in got the request")


# --------------------------------------------------------------------------------------------


def test_health_and_status(router: str, fresh: Cluster) -> None:
    health = httpx.get(f"{router}/health").json()
    assert health["status"] == "healthy" and health["ready"] is True
    assert [e["url"] for e in health["decode"]] == fresh.decode_urls
    status = httpx.get(f"{router}/router/status").json()
    assert status["policy"] == "round-robin" and status["health_checks_running"]
    assert [e["url"] for e in status["prefill"]] == fresh.prefill_urls
    assert all(e["last_health"]["status"] == "healthy" for e in status["prefill"] + status["decode"])


@pytest.mark.parametrize("path", ["/generate", "/api/generate"])
def test_generate(router: str, fresh: Cluster, path: str) -> None:
    response = httpx.post(f"{router}{path}", json={"prompt": "tell me", "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["text"] == " t0 t1 t2 t3" and body["tokens"] == [42, 101, 102, 103]
    assert body["finish_reason"] == "length" and body["id"].startswith("req-")
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    assert {"ttft_s", "e2e_s", "prefill_s", "kv_transfer_s"} <= set(body["timings"])
    assert body["prefill"] in fresh.prefill_urls and body["decode"] in fresh.decode_urls


def test_generate_round_robin(router: str, fresh: Cluster) -> None:
    decodes = [httpx.post(f"{router}/generate", json={"prompt": "x", "max_tokens": 1}).json()["decode"]
               for _ in range(4)]
    assert decodes[0] != decodes[1] and decodes[:2] == decodes[2:]


def test_generate_sse(router: str, fresh: Cluster) -> None:
    with httpx.stream("POST", f"{router}/generate", json={"prompt": "a b c", "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        payloads = sse_events(r)
    assert payloads[-1] == "[DONE]"
    events = [json.loads(p) for p in payloads[:-1]]
    *tokens, final = events
    # Tokens that arrived together are sent as one event: the concatenation is what counts.
    assert tokens[0]["token_ids"][0] == 42 and tokens[0]["text"].startswith(" t0")
    assert "".join(t["text"] for t in tokens) == " t0 t1 t2"
    assert [i for t in tokens for i in t["token_ids"]] == [42, 101, 102]
    assert final["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 3
    assert final["timings"]["ttft_s"] > 0


def test_bad_requests(router: str, fresh: Cluster) -> None:
    def error(response: httpx.Response, status: int) -> str:
        assert response.status_code == status, response.text
        body = response.json()["error"]
        assert body["type"] == "invalid_request_error"
        return str(body["message"])

    assert "not valid JSON" in error(httpx.post(f"{router}/generate", content=b"{nope"), 400)
    assert "max_tokens" in error(httpx.post(f"{router}/generate", json={"prompt": "x", "max_tokens": -1}), 400)
    assert "prompt" in error(httpx.post(f"{router}/generate", json={"max_tokens": 3}), 400)
    assert "tokens_max" in error(httpx.post(f"{router}/generate", json={"prompt": "x", "tokens_max": 3}), 400)
    assert "larger than" in error(httpx.post(f"{router}/generate", content=b" " * 1_200_000), 413)
    assert "POST" in error(httpx.get(f"{router}/generate"), 405)
    assert "messages" in error(httpx.post(f"{router}/v1/chat/completions", json={"model": "m"}), 400)
    assert not any(s.requests for s in fresh.all())  # nothing reached a worker


def test_decode_400_is_passed_through(router: str, fresh: Cluster) -> None:
    for stand_in in fresh.decode:
        stand_in.behavior = "http400"
    for stream in (False, True):
        response = httpx.post(f"{router}/generate", json={"prompt": "x" * 50, "stream": stream})
        assert response.status_code == 400
        assert response.headers["content-type"] == "application/json"
        assert "longer than the context length" in response.json()["error"]["message"]


def test_all_decode_failing_is_502_naming_both(router: str, fresh: Cluster) -> None:
    for stand_in in fresh.decode:
        stand_in.behavior = "http500"
    response = httpx.post(f"{router}/generate", json={"prompt": "x"})
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["message"].startswith("no backend reachable")
    assert all(url in error["message"] for url in fresh.decode_urls)
    assert sorted(b["url"] for b in error["backends"]) == sorted(fresh.decode_urls)


def test_client_disconnect_aborts_both_workers(router: str, fresh: Cluster) -> None:
    for stand_in in fresh.decode:
        stand_in.token_delay_s = 0.05
    with httpx.stream("POST", f"{router}/generate", json={"prompt": "x", "max_tokens": 200, "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    # Leaving the block closed the connection mid-stream.
    decode, request_id = served_by(fresh.decode)
    prefill, _ = served_by(fresh.prefill)
    assert decode.wait_for("aborts") == [request_id]
    assert prefill.wait_for("aborts") == [request_id]
    assert decode.wait_for("closed_early") == [request_id]


def test_non_streaming_client_disconnect_aborts_both_workers(router: str, fresh: Cluster) -> None:
    for stand_in in fresh.decode:
        stand_in.token_delay_s = 0.05
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{router}/generate", json={"prompt": "x", "max_tokens": 200}, timeout=httpx.Timeout(5, read=0.5))
    decode, request_id = served_by(fresh.decode)
    prefill, _ = served_by(fresh.prefill)
    assert decode.wait_for("aborts") == [request_id]
    assert prefill.wait_for("aborts") == [request_id]


def test_openai_completions(router: str, fresh: Cluster) -> None:
    client = openai.OpenAI(base_url=f"{router}/v1", api_key="x", max_retries=0, timeout=20)
    completion = client.completions.create(model="stub-model", prompt="Once upon", max_tokens=3, temperature=0)
    assert completion.choices[0].text == " t0 t1 t2"
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 3
    chunks = list(client.completions.create(model="stub-model", prompt="Once upon", max_tokens=3, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " t0 t1 t2"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 5
    assert [m.id for m in client.models.list()][0] == "stub-model"


def test_openai_unknown_model_is_404_and_aliases_work(router: str, fresh: Cluster) -> None:
    client = openai.OpenAI(base_url=f"{router}/v1", api_key="x", max_retries=0, timeout=20)
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    error = missing.value.body
    assert isinstance(error, dict) and error["code"] == "model_not_found" and error["param"] == "model"
    assert "stub-model" in error["message"] and not any(s.requests for s in fresh.decode)  # never sent on
    completion = client.completions.create(model="gpt-4o-mini", prompt="hi", max_tokens=2)
    assert completion.model == "gpt-4o-mini" and completion.choices[0].text == " t0 t1"
    assert {m.id for m in client.models.list()} == {"stub-model", "gpt-4o-mini"}
    # The seed's /generate ignores `model`, as documented.
    assert httpx.post(f"{router}/generate", json={"prompt": "x", "max_tokens": 1, "model": "zzz"}).status_code == 200


def test_openai_chat(router: str, fresh: Cluster) -> None:
    client = openai.OpenAI(base_url=f"{router}/v1", api_key="x", max_retries=0, timeout=20)
    messages: Any = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model="stub-model", messages=messages, max_tokens=2)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content == " t0 t1"
    assert chat.model == "stub-model" and chat.usage is not None
    stream = client.chat.completions.create(model="stub-model", messages=messages, max_tokens=2, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == " t0 t1"
    assert chunks[-1].choices[0].finish_reason == "length"
    # The decode worker got the messages and applies the chat template itself.
    bodies = [body for stand_in in fresh.decode for body in stand_in.requests]
    assert all(body["messages"] == messages and "prompt" not in body for body in bodies) and len(bodies) == 2
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="stub-model", messages=messages, n=17)  # n is at most 16


def test_websocket_generate(router: str, fresh: Cluster) -> None:
    ws_url = router.replace("http://", "ws://") + "/ws/generate"
    with ws_connect(ws_url, open_timeout=5, close_timeout=2) as ws:
        ws.send(json.dumps({"prompt": "hi there", "max_tokens": 3}))
        messages = [json.loads(ws.recv(timeout=5))]
        while messages[-1]["type"] == "token" and len(messages) < 10:
            messages.append(json.loads(ws.recv(timeout=5)))
        # Tokens that arrive together may come as one message: count token ids, not messages.
        assert {m["type"] for m in messages[:-1]} == {"token"} and messages[-1]["type"] == "done"
        assert [t for m in messages[:-1] for t in m["token_ids"]][:1] == [42]
        assert messages[-1]["text"] == " t0 t1 t2"
        assert messages[-1]["usage"]["total_tokens"] == 5 and messages[-1]["finish_reason"] == "length"
        ws.send(json.dumps({"prompt": "x", "top_p": 5}))
        error = json.loads(ws.recv(timeout=5))
        assert error["type"] == "error" and error["status"] == 400 and "top_p" in error["message"]
        ws.send("not json")
        assert json.loads(ws.recv(timeout=5))["status"] == 400


def test_websocket_disconnect_aborts(router: str, fresh: Cluster) -> None:
    for stand_in in fresh.decode:
        stand_in.token_delay_s = 0.05
    ws_url = router.replace("http://", "ws://") + "/ws/generate"
    with ws_connect(ws_url, open_timeout=5, close_timeout=2) as ws:
        ws.send(json.dumps({"prompt": "x", "max_tokens": 200}))
        assert json.loads(ws.recv(timeout=5))["type"] == "token"
    decode, request_id = served_by(fresh.decode)
    prefill, _ = served_by(fresh.prefill)
    assert decode.wait_for("aborts") == [request_id]
    assert prefill.wait_for("aborts") == [request_id]
