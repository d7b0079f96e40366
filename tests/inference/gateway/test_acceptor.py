"""The router's acceptor (inference/gateway/acceptor.py) with real processes: tiny-model prefill and
decode workers and `python -m inference.launch_router` (acceptor → gunicorn → router processes).

- generation through handed-over connections (streamed and not, keep-alive) works, also on a
  connection whose first requests were probes the acceptor answered;
- `/health` is answered by the acceptor while the router process is SIGSTOPped: what the last
  snapshot said, then 503 not-ready once it is stale, then ready again after SIGCONT;
- silent and slow clients never delay a probe;
- a killed router process: 503 while none serves, then gunicorn's new one serves;
- two router processes share new connections; a killed acceptor leaves no router process;
- with 250 endpoints (a /health body past one 16 KB control record) the acceptor still trusts the
  router process's snapshots: it answers probes and hands connections over.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support.processes import Proc, start_parallel, start_router, start_worker, wait_until

STALE_S = 1.5


@pytest.fixture(scope="module")
def workers(tiny_model_dir: Path, log_dir: Path) -> Iterator[tuple[str, str]]:
    """(prefill URL, decode URL)."""
    common = ["--block-size", "8", "--context-length", "512"]
    started = start_parallel({
        "prefill": partial(start_worker, "prefill", tiny_model_dir, log_dir, extra=common, name="acceptor-prefill"),
        "decode": partial(start_worker, "decode", tiny_model_dir, log_dir, extra=common, name="acceptor-decode"),
    })
    (prefill, prefill_url), (decode, decode_url) = started["prefill"], started["decode"]
    try:
        yield prefill_url, decode_url
    finally:
        decode.stop()
        prefill.stop()


@pytest.fixture()
def router(workers: tuple[str, str], log_dir: Path) -> Iterator[tuple[Proc, str]]:
    proc, url = start_router([workers[0]], [workers[1]], log_dir, env={"ROUTER_HEALTH_STALE_S": str(STALE_S)})
    try:
        yield proc, url
    finally:
        proc.stop()


def probe(base: str, request: bytes | None = None, timeout: float = 5.0) -> tuple[int, dict[str, object], float]:
    """One `GET /health` on a fresh raw connection: (status, body ({} for HEAD), seconds)."""
    host, port = base.removeprefix("http://").split(":")
    started = time.perf_counter()
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(request or b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body) if body else {}, time.perf_counter() - started


def stale(base: str) -> tuple[int, dict[str, object], float] | None:
    """The probe's answer if it says 503."""
    answer = probe(base)
    return answer if answer[0] == 503 else None


def router_pid(base: str) -> int:
    """The pid of the router process that serves a new connection."""
    return int(httpx.get(f"{base}/router/status", timeout=10).json()["pid"])


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def test_generation_through_handed_over_connections(router: tuple[Proc, str]) -> None:
    _, base = router
    with httpx.Client(base_url=base, timeout=60) as client:
        pids = set()
        for _ in range(3):  # one keep-alive connection: three requests, then a stream
            answer = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0})
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["finish_reason"] == "length"
        with client.stream("POST", "/v1/completions",
                           json={"prompt": "hello", "max_tokens": 6, "stream": True, "temperature": 0}) as stream:
            assert stream.status_code == 200
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 3
        status = client.get("/router/status")  # still the same connection: the router process serves it
        pids.add(status.json()["pid"])
        health = client.get("/health")  # a probe on a kept connection: the router process answers
        assert health.status_code == 200 and health.json()["ready"] is True
    assert len(pids) == 1
    # A request larger than what the acceptor reads of it (16 KiB) arrives whole, on a new connection.
    answer = httpx.post(f"{base}/v1/completions", json={"prompt": "hello", "max_tokens": 2, "user": "u" * 40000},
                        timeout=60)
    assert answer.status_code == 200, answer.text


def read_answer(sock: socket.socket) -> tuple[bytes, bytes]:
    """One response with a content-length on a kept connection: (head, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return head, body


def test_a_kept_probe_connection_goes_on_to_a_router_process(router: tuple[Proc, str]) -> None:
    proc, base = router
    wait_until("the acceptor answering from a snapshot", lambda: "router_processes" in probe(base)[1], 10, [proc])
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        for _ in range(2):  # answered by the acceptor, the connection kept
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            head, body = read_answer(sock)
            assert head.startswith(b"HTTP/1.1 200") and "router_processes" in json.loads(body)
        body_bytes = json.dumps({"prompt": "hello", "max_tokens": 3}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body_bytes), body_bytes))
        answer = b""
        while chunk := sock.recv(65536):  # then handed over with those bytes: a router process answers
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert b'"object":"text_completion"' in answer


def test_health_answers_while_the_router_process_is_stopped(router: tuple[Proc, str]) -> None:
    proc, base = router
    assert probe(base)[1]["ready"] is True
    wait_until("the acceptor answering from a snapshot", lambda: "router_processes" in probe(base)[1], 10, [proc])
    pid = router_pid(base)
    os.kill(pid, signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        status, body, seconds = probe(base)
        assert status == 200 and body["ready"] is True and seconds < 0.5, (status, body, seconds)
        # Then the snapshot goes stale: not ready, said fast, by the acceptor alone.
        status, body, _ = wait_until("/health not ready once the snapshot is stale", lambda: stale(base),
                                     STALE_S + 5, [proc], interval=0.1)  # type: ignore[misc]
        assert body["ready"] is False and "reported" in body["reason"], body
        assert time.monotonic() - stopped_at >= STALE_S - 0.3
        status, body, seconds = probe(base, b"HEAD /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        assert status == 503 and body == {} and seconds < 0.5
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until("ready again after SIGCONT", lambda: probe(base)[0] == 200, 10, [proc])
    assert proc.alive()


def test_silent_and_slow_clients_do_not_delay_probes(router: tuple[Proc, str]) -> None:
    _, base = router
    host, port = base.removeprefix("http://").split(":")
    probe(base)
    idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(30)]
    slow = [socket.create_connection((host, int(port)), timeout=5) for _ in range(10)]
    try:
        for sock in slow:
            sock.sendall(b"GET /hea")  # a head that never ends
        times = [probe(base)[2] for _ in range(20)]
        assert max(times) < 0.5, times
        time.sleep(1.5)  # past the acceptor's head wait: the silent ones went to the router process
        times = [probe(base)[2] for _ in range(10)]
        assert max(times) < 0.5, times
        answer = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert answer.status_code == 200
    finally:
        for sock in idle + slow:
            sock.close()


def test_a_killed_router_process_is_replaced(router: tuple[Proc, str]) -> None:
    proc, base = router
    probe(base)
    old = router_pid(base)
    os.kill(old, signal.SIGKILL)
    seen = []

    def replaced() -> bool:
        status, body, _ = probe(base)
        seen.append(status)
        return status == 200 and router_pid(base) != old

    wait_until("gunicorn's new router process serving", replaced, 60, [proc])
    assert proc.alive()
    assert set(seen) <= {200, 503}


def test_two_router_processes_share_connections_and_die_with_a_killed_acceptor(
    workers: tuple[str, str], log_dir: Path,
) -> None:
    proc, base = start_router([workers[0]], [workers[1]], log_dir, extra=["--workers", "2"])
    try:
        wait_until("both router processes reporting", lambda: probe(base)[1].get("router_processes") == 2, 60,
                   [proc])
        pids = {router_pid(base) for _ in range(8)}
        assert len(pids) == 2, pids
        tree = descendants(proc.popen.pid)
        assert len(tree) == 3  # gunicorn's arbiter and its two router processes
        if os.geteuid() == 0:  # allowed to raise its priority: 5 levels ahead of the router processes
            assert {p.nice() for p in tree} == {psutil.Process(proc.popen.pid).nice() + 5}
        os.kill(proc.popen.pid, signal.SIGKILL)  # the acceptor only
        proc.popen.wait(timeout=10)
        host, port = base.removeprefix("http://").split(":")
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((host, int(port)), timeout=2).close()  # nothing listens any more
        _, alive = psutil.wait_procs(tree, timeout=40)
        assert not alive, [p.info for p in alive]
    finally:
        proc.stop()


def test_a_router_of_250_endpoints_is_answered_for_and_served(log_dir: Path) -> None:
    """/health lists every endpoint: at ~200 the snapshot outgrew one 16 KB record, the acceptor read it
    cut short, never trusted the router process, answered 503 and handed it no connection."""
    from bench.sim.config import SimConfig
    from bench.sim.launch import sim_platform

    with sim_platform(1, 249, log_dir, SimConfig(decode_tokens_per_s=400.0)) as plat:
        def answered() -> tuple[int, dict[str, object], float] | None:
            answer = probe(plat.router_url)
            return answer if "router_processes" in answer[1] else None

        answer = wait_until("the acceptor answering from a snapshot", answered, 30, [plat.router])
        assert isinstance(answer, tuple)
        status, body, _ = answer
        decode = body["decode"]
        assert status == 200 and isinstance(decode, list) and len(decode) == 249 and body["ready"] is True
        served = httpx.post(f"{plat.router_url}/generate", timeout=30,
                            json={"input_ids": [5, 6, 7, 8], "max_tokens": 3, "ignore_eos": True})
        assert served.status_code == 200 and len(served.json()["tokens"]) == 3, served.text
