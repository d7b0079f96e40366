"""Readiness means ready (issue 20 item 6): a router that does not yet know its workers (no health
answer, so no model names and no slots) serves no generation. Its first requests, sent the moment its
port accepts connections, wait for the first health answers and are then checked against the served
model; a router whose workers never answer gives 503 with Retry-After and a JSON message.

Real processes: tiny-model prefill and decode workers and `python -m inference.launch_router` with
static endpoints, asked before anything touched its /health (which would check the workers first).
"""
from __future__ import annotations

import concurrent.futures
import socket
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httpx
import pytest

from tests.support.processes import Proc, free_port, start_parallel, start_worker


@pytest.fixture(scope="module")
def workers(tiny_model_dir: Path, log_dir: Path) -> Iterator[tuple[str, str, str]]:
    """(prefill URL, decode URL, the model name they report)."""
    started = start_parallel({
        "prefill": partial(start_worker, "prefill", tiny_model_dir, log_dir, name="ready-prefill"),
        "decode": partial(start_worker, "decode", tiny_model_dir, log_dir, name="ready-decode"),
    })
    (prefill, prefill_url), (decode, decode_url) = started["prefill"], started["decode"]
    try:
        model = httpx.get(f"{decode_url}/health", timeout=5).json()["model"]
        assert isinstance(model, str) and model
        yield prefill_url, decode_url, model
    finally:
        decode.stop()
        prefill.stop()


def started_router(prefill: list[str], decode: list[str], log_dir: Path, name: str) -> tuple[Proc, str]:
    """The router process, returned as soon as its port accepts a connection (its Django app may
    still be loading: a request sent now is its first, before any health check ran)."""
    port = free_port()
    args = [sys.executable, "-m", "inference.launch_router", "--listen-port", str(port), "--host", "127.0.0.1",
            "--log-level", "warning"]
    for url in prefill:
        args += ["--prefill-endpoint", url]
    for url in decode:
        args += ["--decode-endpoint", url]
    env = {"ROUTER_HEALTH_INTERVAL_S": "2", "ROUTER_CONNECT_TIMEOUT_S": "1"}
    proc = Proc(name, args, log_dir, env)
    deadline = time.monotonic() + 60
    while True:
        if not proc.alive():
            proc.stop()
            raise AssertionError(f"router exited:\n{proc.log()[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline:
                proc.stop()
                raise AssertionError(f"router port never opened:\n{proc.log()[-3000:]}") from None
            time.sleep(0.02)


def completion(base: str, model: str) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": "hello there", "max_tokens": 3,
                                                       "temperature": 0}, timeout=60)


def test_first_requests_wait_for_the_workers_health_and_a_wrong_model_is_never_served(
    workers: tuple[str, str, str], log_dir: Path,
) -> None:
    prefill_url, decode_url, model = workers
    proc, base = started_router([prefill_url], [decode_url], log_dir, "router-readiness")
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            wrong = pool.submit(completion, base, "no-such-model")
            right = pool.submit(completion, base, model)
            plain = pool.submit(lambda: httpx.post(f"{base}/generate", json={"prompt": "hi", "max_tokens": 2},
                                                   timeout=60))
            wrong_answer, right_answer, plain_answer = wrong.result(), right.result(), plain.result()
        assert wrong_answer.status_code in (404, 503), wrong_answer.text
        assert wrong_answer.json()["error"]["message"]
        if wrong_answer.status_code == 404:
            assert wrong_answer.json()["error"]["code"] == "model_not_found"
            assert model in wrong_answer.json()["error"]["message"]
        assert right_answer.status_code == 200, right_answer.text
        assert right_answer.json()["model"] == model and right_answer.json()["choices"][0]["text"] is not None
        assert plain_answer.status_code == 200, plain_answer.text
        assert len(plain_answer.json()["tokens"]) == 2
        health = httpx.get(f"{base}/health", timeout=10).json()
        assert health["ready"] is True
        again = completion(base, "no-such-model")  # known now: the plain 404
        assert again.status_code == 404 and again.json()["error"]["code"] == "model_not_found"
    finally:
        proc.stop()


def test_workers_that_never_answer_give_503_with_retry_after(log_dir: Path) -> None:
    nobody = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]  # nothing listens there
    proc, base = started_router(nobody[:1], nobody[1:], log_dir, "router-unready")
    try:
        started = time.monotonic()
        answer = completion(base, "anything")
        waited = time.monotonic() - started
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == "1"
        error = answer.json()["error"]
        assert error["type"] == "service_unavailable" and "not ready" in error["message"]
        assert waited < 30  # bounded: the first health round (1 s connect + 1 s answer) plus the start
        health = httpx.get(f"{base}/health", timeout=10).json()
        assert health["status"] == "healthy" and health["ready"] is False
    finally:
        proc.stop()
