"""End to end with real processes on loopback: router + prefill worker + decode worker.

Checks the guide's health outputs, that disaggregated output equals single-process output token for
token, the public APIs (JSON, SSE, OpenAI client, WebSocket), errors (400 too long, 502 backend down,
retry on a dead decode), metrics, client-disconnect cleanup and load_test against the router.
"""
from __future__ import annotations

import asyncio
import csv
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from inference.engine import LLMEngine, SamplingParams
from tests.support.processes import free_port, start_prefill_and_decode, start_router

pytestmark = pytest.mark.django_db(transaction=False, databases=[])
CONTEXT = 256
PROMPTS = [
    "The quick brown fox",
    "Disaggregated inference separates prefill from decode so that",
    "Hello",
    "Paged attention stores keys and values in fixed size blocks, and a scheduler batches many "
    "requests together while new ones arrive",
]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, log_dir: Path):
    """One prefill, one decode and a router, all real processes."""
    procs = []
    try:
        common = ["--context-length", str(CONTEXT), "--block-size", "8"]
        (prefill, prefill_url), (decode, decode_url) = start_prefill_and_decode(
            tiny_model_dir, log_dir, common, CONTEXT)
        procs += [prefill, decode]
        router, router_url = start_router([prefill_url], [decode_url], log_dir)
        procs.append(router)
        yield {"prefill": prefill_url, "decode": decode_url, "router": router_url, "procs": procs}
    finally:
        for p in reversed(procs):
            p.stop()


@pytest.fixture(scope="module")
def reference_engine(tiny_model_dir: Path) -> LLMEngine:
    """The same checkpoint run in this one process (the colocated baseline)."""
    return LLMEngine(str(tiny_model_dir), block_size=8, max_model_len=CONTEXT)


def reference(engine: LLMEngine, prompt: str, params: SamplingParams) -> list[int]:
    assert engine.tokenizer is not None
    ids = engine.tokenizer.encode(prompt)
    return engine.generate([ids], params)[0].token_ids


def test_health_answers_as_the_guide_says(cluster) -> None:
    for role in ("prefill", "decode"):
        body = httpx.get(cluster[role] + "/health").json()
        assert body["status"] == "healthy"
        # CUDA_VISIBLE_DEVICES="" → a CPU worker reports cpu_utilization, as the guide's decode does.
        assert 0.0 <= body["cpu_utilization"] <= 1.0
        assert body["role"] == role
        assert {"queue_depth", "running", "kv_usage", "model"} <= body.keys()


def test_disaggregated_greedy_equals_single_process(cluster, reference_engine) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0)

    def call(prompt: str) -> dict:
        r = httpx.post(cluster["router"] + "/generate", json={"prompt": prompt, "max_tokens": 24,
                                                             "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    # Concurrent requests share the decode batch; each still equals its single-process run.
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(call, PROMPTS))
    for prompt, body in zip(PROMPTS, results, strict=True):
        assert body["tokens"] == reference(reference_engine, prompt, params)
        assert body["usage"]["completion_tokens"] == len(body["tokens"])
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + len(body["tokens"])
        assert body["timings"]["ttft_s"] > 0
        assert body["finish_reason"] in ("stop", "length")
        assert isinstance(body["text"], str)


def test_seeded_sampling_continues_across_processes(cluster, reference_engine) -> None:
    payload = {"prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0.9, "top_p": 0.95, "seed": 1234}
    body = httpx.post(cluster["router"] + "/generate", json=payload, timeout=120).json()
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    assert body["tokens"] == reference(reference_engine, PROMPTS[1], params)


def test_sse_stream_matches_the_whole_answer(cluster) -> None:
    payload = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}
    whole = httpx.post(cluster["router"] + "/api/generate", json=payload, timeout=60).json()
    tokens: list[int] = []
    text = ""
    final = None
    with httpx.stream("POST", cluster["router"] + "/generate", json={**payload, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            event = json.loads(data)
            tokens += event.get("token_ids", [])
            text += event.get("text", "")
            if event.get("finish_reason"):
                final = event
    assert tokens == whole["tokens"]
    assert text == whole["text"]
    assert final is not None and final["usage"]["completion_tokens"] == len(tokens)


def test_prompt_longer_than_context_is_a_clear_400(cluster) -> None:
    r = httpx.post(cluster["router"] + "/generate", json={"prompt": "word " * (CONTEXT * 2), "max_tokens": 4},
                   timeout=30)
    assert r.status_code == 400
    assert "context length" in r.json()["error"]["message"]


def test_bad_input_is_a_clear_400(cluster) -> None:
    for payload in ({"max_tokens": 4}, {"prompt": "x", "max_tokens": -1}, {"prompt": "x", "top_p": 7}):
        r = httpx.post(cluster["router"] + "/generate", json=payload, timeout=30)
        assert r.status_code == 400, (payload, r.text)
        assert r.json()["error"]["message"]
    r = httpx.post(cluster["router"] + "/generate", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400


def test_openai_client_completions_and_chat(cluster) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster["router"] + "/v1", api_key="unused", max_retries=0)
    models = client.models.list()
    model = models.data[0].id
    done = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert done.choices[0].text is not None
    assert done.usage.completion_tokens >= 1
    streamed = "".join(
        chunk.choices[0].text
        for chunk in client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                               stream=True)
        if chunk.choices
    )
    assert streamed == done.choices[0].text
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi there"}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi there"}],
                                                 max_tokens=8, temperature=0, stream=True))
    streamed_chat = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed_chat == chat.choices[0].message.content


def test_websocket_generate(cluster) -> None:
    websockets = pytest.importorskip("websockets.sync.client")
    ws_url = cluster["router"].replace("http://", "ws://") + "/ws/generate"
    whole = httpx.post(cluster["router"] + "/generate", json={"prompt": PROMPTS[2], "max_tokens": 6,
                                                              "temperature": 0}, timeout=60).json()
    tokens: list[int] = []
    with websockets.connect(ws_url, open_timeout=10) as ws:
        ws.send(json.dumps({"prompt": PROMPTS[2], "max_tokens": 6, "temperature": 0}))
        while True:
            msg = json.loads(ws.recv(timeout=30))
            if msg["type"] == "token":
                tokens += msg["token_ids"]
            else:
                assert msg["type"] == "done", msg
                break
    assert tokens == whole["tokens"]


def test_metrics_count_requests_and_kv_bytes(cluster) -> None:
    httpx.post(cluster["router"] + "/generate", json={"prompt": "metrics", "max_tokens": 3}, timeout=60)
    for role in ("prefill", "decode"):
        text = httpx.get(cluster[role] + "/metrics").text
        assert "worker_time_to_first_token_seconds_count" in text
        bytes_line = next(line for line in text.splitlines()
                          if line.startswith("worker_kv_transfer_bytes_total"))
        assert float(bytes_line.rsplit(" ", 1)[1]) > 0
        assert "worker_queue_depth" in text and "worker_kv_cache_usage_ratio" in text
    assert "worker_inter_token_latency_seconds_bucket" in httpx.get(cluster["decode"] + "/metrics").text


def test_decode_side_prefix_cache_sends_only_the_suffix(cluster, reference_engine) -> None:
    """Two requests sharing a long system prompt: the decode worker still holds the first one's
    prompt blocks, so the prefill worker sends only the blocks after them (fewer KV bytes over TCP),
    the decode worker's prefix-cache hit ratio rises, and both answers equal a single-process run."""
    system = "You are the operator's assistant for a disaggregated inference platform. " * 3
    prompts = [system + "Tell me how prefill works.", system + "Tell me how decode works."]
    bodies = []
    for prompt in prompts:
        r = httpx.post(cluster["router"] + "/generate", json={"prompt": prompt, "max_tokens": 8, "temperature": 0},
                       timeout=120)
        assert r.status_code == 200, r.text
        bodies.append(r.json())
    params = SamplingParams(max_tokens=8, temperature=0.0)
    for prompt, body in zip(prompts, bodies, strict=True):
        assert body["tokens"] == reference(reference_engine, prompt, params)
    first, second = (b["kv_bytes"] for b in bodies)
    assert 0 < second < first / 2  # the shared prefix is most of the prompt
    metrics = httpx.get(cluster["decode"] + "/metrics").text
    ratio = next(line for line in metrics.splitlines() if line.startswith("worker_prefix_cache_hit_ratio"))
    assert float(ratio.rsplit(" ", 1)[1]) > 0


def test_client_disconnect_frees_decode_blocks(cluster) -> None:
    payload = {"prompt": PROMPTS[3], "max_tokens": 200, "temperature": 0.8, "ignore_eos": True,
               "stream": True}
    with httpx.stream("POST", cluster["router"] + "/generate", json=payload, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # first token seen: hang up mid-generation
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        health = httpx.get(cluster["decode"] + "/health").json()
        if health["kv_usage"] == 0 and health["running"] == 0:
            break
        time.sleep(0.2)
    assert health["kv_usage"] == 0 and health["running"] == 0, health


def test_unreachable_backends_give_503_naming_them(log_dir: Path) -> None:
    """Workers that never answered: the router is not ready (issue 20 item 6): 503 with Retry-After after a
    bounded wait, naming every missing worker and why (a worker that dies later gives 502, as before)."""
    dead_p, dead_d = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    router, url = start_router([dead_p], [dead_d], log_dir)
    try:
        r = httpx.post(url + "/generate", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 503 and r.headers.get("retry-after")
        message = json.dumps(r.json())
        assert dead_d in message and dead_p in message and "not ready" in message
    finally:
        router.stop()


def test_dead_decode_is_skipped(cluster, log_dir: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    router, url = start_router([cluster["prefill"]], [dead, cluster["decode"]], log_dir)
    try:
        for _ in range(4):
            r = httpx.post(url + "/generate", json={"prompt": "retry me", "max_tokens": 3}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["decode"] == cluster["decode"]
    finally:
        router.stop()


def test_load_test_against_the_router(cluster, tmp_path: Path) -> None:
    csv_path = tmp_path / "benchmark.csv"
    result = subprocess.run(
        [sys.executable, "-m", "inference.tools.load_test", "--endpoint", cluster["router"] + "/generate",
         "--concurrency", "3", "--duration", "4s", "--max-tokens", "8", "--metrics-file", str(csv_path),
         "--no-progress"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = list(csv.DictReader(csv_path.open()))
    assert len(rows) >= 3
    assert all(row["status"] == "ok" for row in rows), rows[:3]
    assert "p99" in result.stdout
    assert csv_path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_engine_asyncio_not_blocked(cluster) -> None:
    """Many concurrent streams finish: the router and decode never serialise requests."""

    async def one(client: httpx.AsyncClient, i: int) -> int:
        r = await client.post(cluster["router"] + "/generate", json={"prompt": f"n{i}", "max_tokens": 4})
        return r.status_code

    async def main() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(12)))

    assert asyncio.run(main()) == [200] * 12
