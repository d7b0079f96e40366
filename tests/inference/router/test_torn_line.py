"""A decode worker that dies in the middle of a line (issue 26), with real processes.

A real prefill worker, two real decode workers, the router, and `torn_proxy` in front of one decode
worker: once armed, it relays part of a token line (cut inside a UTF-8 character where the line has
one) and dies. The torn line must count as the worker's death: the stream moves to the other
decode worker (migrations 1), every event the client gets parses as strict UTF-8 JSON, and the
greedy tokens equal an unbroken run's. Both ways a line can be torn are checked: the connection
drops inside a chunk, and the response ends cleanly on a partial line.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.processes import ROOT, Proc, free_port, start_router, start_worker

pytestmark = pytest.mark.django_db(transaction=False, databases=[])

PROMPT = "Disaggregated inference separates prefill from decode so that"
COMMON = ["--block-size", "8", "--context-length", "256"]
HTTP_TIMEOUT = httpx.Timeout(60.0, connect=10.0)
PAYLOAD = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def workers(tiny_model_dir: Path, log_dir: Path) -> Iterator[dict[str, str]]:
    """One prefill and two decode workers, shared by the tests (none of them is harmed)."""
    roles = {"prefill": "prefill", "victim": "decode", "survivor": "decode"}
    with ThreadPoolExecutor(len(roles)) as pool:  # in parallel: each takes seconds to load the model
        futures = {name: pool.submit(start_worker, role, tiny_model_dir, log_dir, extra=COMMON, name=f"torn-{name}")
                   for name, role in roles.items()}
    started = {name: future.result() for name, future in futures.items() if future.exception() is None}
    try:
        for future in futures.values():
            future.result()  # the first start that failed, after the others are recorded for stopping
        yield {name: url for name, (_proc, url) in started.items()}
    finally:
        for proc, _url in started.values():
            proc.stop()


def _start_proxy(upstream: str, arm_file: Path, mode: str, log_dir: Path) -> tuple[Proc, str]:
    port = free_port()
    args = [sys.executable, "-m", "tests.inference.router.torn_proxy", "--port", str(port),
            "--upstream", upstream.removeprefix("http://"), "--after-tokens", "5",
            "--arm-file", str(arm_file), "--mode", mode]
    proc = Proc(f"torn-proxy-{mode}-{port}", args, log_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(url + "/health", timeout=30)
    except BaseException:
        proc.stop()
        raise
    return proc, url


def _events(router: str) -> list[Any]:
    """One streamed /generate: every `data:` payload, each required to be strict UTF-8 JSON."""
    events: list[Any] = []
    with httpx.stream("POST", router + "/generate", json={**PAYLOAD, "stream": True}, timeout=HTTP_TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        buffered = b""
        for chunk in r.iter_raw():
            buffered += chunk
        for raw in buffered.split(b"\n"):
            if not raw.startswith(b"data: "):
                assert raw.strip() == b"", f"not an SSE line: {raw!r}"
                continue
            data = raw[len(b"data: "):].decode("utf-8")  # strict: a broken sequence fails here
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.mark.parametrize("mode", ["drop", "end"])
def test_torn_line_moves_the_stream(workers: dict[str, str], log_dir: Path, tmp_path: Path, mode: str) -> None:
    arm = tmp_path / "armed"
    proxy, proxy_url = _start_proxy(workers["victim"], arm, mode, log_dir)
    router, router_url = start_router([workers["prefill"]], [proxy_url, workers["survivor"]], log_dir,
                                      env={"ROUTER_REQUEST_TIMEOUT_S": "60", "ROUTER_HEALTH_INTERVAL_S": "0.5"})
    try:
        reference = httpx.post(router_url + "/generate", json=PAYLOAD, timeout=HTTP_TIMEOUT).json()["tokens"]
        assert len(reference) == PAYLOAD["max_tokens"]
        arm.touch()
        done: dict[str, Any] = {}
        tokens: list[int] = []
        for _ in range(4):  # round robin: a stream reaches the proxy within two tries
            events = _events(router_url)
            assert events[-1] == "[DONE]", events[-3:]
            done = events[-2]
            assert "error" not in done, done
            tokens = [t for e in events[:-2] for t in e["token_ids"]]
            if done["migrations"]:
                break
        else:
            pytest.fail(f"no stream was torn by the proxy:\n{proxy.log()}")
        time.sleep(0.2)
        assert "cut" in proxy.log() and not proxy.alive()
        assert done["migrations"] == 1 and done["decode"] == workers["survivor"], done
        assert done["finish_reason"] == "length"
        assert tokens == reference, "the moved stream differs from an unbroken greedy run"
    finally:
        router.stop()
        proxy.stop()


def test_proxy_cuts_inside_a_multibyte_character() -> None:
    from tests.inference.router.torn_proxy import cut_point

    line = '{"type":"token","text":"caf\u00e9"}'.encode()
    cut = cut_point(line)
    with pytest.raises(UnicodeDecodeError):
        line[:cut].decode("utf-8")
    assert cut_point(b'{"type":"token"}') == 8
    subprocess.run([sys.executable, "-m", "tests.inference.router.torn_proxy", "--help"], cwd=ROOT, check=True,
                   capture_output=True)
