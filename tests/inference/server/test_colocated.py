"""`--service-type both` with real processes: a one-host deployment without the prefill hop.

A `both` worker prefills every prompt itself (offered or not: its descriptor says local); a router
with decode endpoints only (no prefill pool) serves text, chat and streamed requests through it,
counting every prompt as prefilled locally; a plain decode worker behind such a router is offered
every prompt and gives the same greedy tokens; and a prefill+decode deployment gives them too.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.processes import Proc, post_json, start_parallel, start_router, start_workers

pytestmark = pytest.mark.django_db(transaction=False, databases=[])

COMMON = ["--block-size", "8", "--context-length", "512"]
HTTP_TIMEOUT = httpx.Timeout(60.0, connect=10.0)
ENV = {"ROUTER_REQUEST_TIMEOUT_S": "60", "ROUTER_HEALTH_INTERVAL_S": "0.5"}
GREEDY = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, log_dir: Path) -> Iterator[dict[str, str]]:
    """A `both` worker, a prefill and a decode worker; routers: both only, decode only, prefill + decode."""
    started = start_workers({"both": "both", "prefill": "prefill", "decode": "decode"}, tiny_model_dir, log_dir,
                            extra=COMMON, prefix="colo")
    procs: list[Proc] = [p for p, _ in started.values()]
    try:
        urls = {name: url for name, (_p, url) in started.items()}
        routers = {"both": ([], [urls["both"]]), "decode_only": ([], [urls["decode"]]),
                   "disagg": ([urls["prefill"]], [urls["decode"]])}
        # Side by side, as the workers: each router process takes seconds to start.
        starters = {name: partial(start_router, prefill, decode, log_dir, env=ENV)
                    for name, (prefill, decode) in routers.items()}
        for name, (proc, url) in start_parallel(starters).items():
            procs.append(proc)
            urls[f"router_{name}"] = url
        yield urls
    finally:
        for proc in reversed(procs):
            proc.stop()


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    return post_json(url + path, body, HTTP_TIMEOUT)


def _where(router: str) -> dict[str, float]:
    counts = {"local": 0.0, "remote": 0.0}
    for line in httpx.get(router + "/metrics", timeout=HTTP_TIMEOUT).text.splitlines():
        if line.startswith("router_prefill_where_total{"):
            counts[line.split('where="')[1].split('"')[0]] = float(line.split()[-1])
    return counts


def test_a_both_worker_prefills_every_prompt_itself(cluster: dict[str, str]) -> None:
    health = httpx.get(cluster["both"] + "/health", timeout=HTTP_TIMEOUT).json()
    assert health["role"] == "both"
    # No local prefill offered: a decode worker would reserve blocks for a prefill worker; `both` runs it.
    body = {"request_id": "colo-direct", "prompt": "Hello! How are you?", "sampling": {"max_tokens": 3}}
    with httpx.stream("POST", cluster["both"] + "/internal/decode", json=body, timeout=HTTP_TIMEOUT) as response:
        assert response.status_code == 200
        lines = [json.loads(line) for line in response.iter_lines() if line]
    assert lines[0]["descriptor"] == {"local": True}, lines[0]
    assert lines[-1]["type"] == "done", lines[-1]


def test_routers_without_prefill_workers_serve_everything_locally(cluster: dict[str, str]) -> None:
    prompt = "Hello! How are you? I am fine, thank you. What is your name?"
    tokens = {}
    for name in ("router_both", "router_decode_only", "router_disagg"):
        answer = _post(cluster[name], "/generate", {"prompt": prompt, **GREEDY})
        tokens[name] = answer["tokens"]
        assert (answer["prefill"] is None or answer["prefill"] == "") == (name != "router_disagg"), answer
    assert tokens["router_both"] == tokens["router_decode_only"] == tokens["router_disagg"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    chat = _post(cluster["router_both"], "/v1/chat/completions", {"messages": messages, **GREEDY})
    assert chat["usage"]["completion_tokens"] == 10
    with httpx.stream("POST", cluster["router_both"] + "/v1/completions",
                      json={"prompt": prompt, "stream": True, **GREEDY}, timeout=HTTP_TIMEOUT) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 2
    for name in ("router_both", "router_decode_only"):
        where = _where(cluster[name])
        assert where["remote"] == 0 and where["local"] >= 1, (name, where)
    assert _where(cluster["router_disagg"])["remote"] >= 1
    status = httpx.get(cluster["router_both"] + "/router/status", timeout=HTTP_TIMEOUT).json()
    assert status["ready"] is True and status["prefill"] == []
