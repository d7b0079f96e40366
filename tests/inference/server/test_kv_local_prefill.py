"""Per-request disaggregation with real processes: a prefill worker, a decode worker, and two routers
over them, one offering local prefill (ROUTER_LOCAL_PREFILL_TOKENS) and one not.

A prompt with few tokens left to compute on the decode worker is prefilled there (no prefill call:
the done event names no prefill worker, `router_prefill_where{where="local"}` counts it) and its
greedy tokens equal the remote path's; a long uncached prompt still goes to the prefill worker; a
follow-up whose history the decode worker holds is prefilled locally. Over the threshold, the decode
worker prefills a prompt itself when the prefill pool's queue the router tells it is deeper than its own.
"""
from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.processes import Proc, post_json, start_router, start_worker

pytestmark = pytest.mark.django_db(transaction=False, databases=[])

COMMON = ["--block-size", "8", "--context-length", "512"]
HTTP_TIMEOUT = httpx.Timeout(60.0, connect=10.0)
LIMIT = 48


@pytest.fixture(scope="module")
def routers(tiny_model_dir: Path, log_dir: Path) -> Iterator[dict[str, str]]:
    """URLs of the prefill worker and of the two routers (`local`, `remote`)."""
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start_worker, role, tiny_model_dir, log_dir, extra=COMMON, name=f"local-{role}")
                   for role in ("prefill", "decode")]
    started = [f.result() for f in futures if f.exception() is None]
    procs: list[Proc] = [p for p, _ in started]
    try:
        for f in futures:
            f.result()
        (_, prefill), (_, decode) = started
        env = {"ROUTER_REQUEST_TIMEOUT_S": "60", "ROUTER_HEALTH_INTERVAL_S": "0.5"}
        local, local_url = start_router([prefill], [decode], log_dir,
                                        env={**env, "ROUTER_LOCAL_PREFILL_TOKENS": str(LIMIT)})
        procs.append(local)
        remote, remote_url = start_router([prefill], [decode], log_dir, env=env)
        procs.append(remote)
        yield {"prefill": prefill, "decode": decode, "local": local_url, "remote": remote_url}
    finally:
        for proc in reversed(procs):
            proc.stop()


def _generate(router: str, ids: list[int]) -> dict[str, Any]:
    return post_json(router + "/generate", {"input_ids": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
                     timeout=HTTP_TIMEOUT)


def _where(router: str) -> dict[str, float]:
    counts = {}
    for line in httpx.get(router + "/metrics", timeout=HTTP_TIMEOUT).text.splitlines():
        if line.startswith("router_prefill_where_total{"):
            counts[line.split('"')[1]] = float(line.split()[-1])
    return counts


def test_short_prompt_prefilled_locally_with_the_remote_paths_greedy_tokens(routers: dict[str, str]) -> None:
    rng = random.Random(11)
    prompt = [rng.randrange(3, 200) for _ in range(LIMIT - 8)]
    remote = _generate(routers["remote"], prompt)
    assert remote["prefill"] == routers["prefill"]
    local = _generate(routers["local"], prompt)
    assert local["prefill"] == "", local  # no prefill worker took part
    assert local["tokens"] == remote["tokens"]
    assert local["usage"]["prompt_tokens"] == len(prompt)
    other = [rng.randrange(3, 200) for _ in range(LIMIT - 8)]  # a cold prompt under the limit: local too
    cold_local = _generate(routers["local"], other)
    assert cold_local["prefill"] == "" and cold_local["tokens"] == _generate(routers["remote"], other)["tokens"]
    assert _where(routers["local"]).get("local", 0) >= 2


def test_long_prompt_goes_remote_and_its_follow_up_stays_local(routers: dict[str, str]) -> None:
    rng = random.Random(12)
    history = [rng.randrange(3, 200) for _ in range(200)]
    first = _generate(routers["local"], history)
    assert first["prefill"] == routers["prefill"], first  # 200 uncached tokens > the limit
    follow_up = history + first["tokens"] + [rng.randrange(3, 200) for _ in range(8)]
    second = _generate(routers["local"], follow_up)
    assert second["prefill"] == "", second  # the decode worker holds the history
    assert second["tokens"] == _generate(routers["remote"], follow_up)["tokens"]
    assert _where(routers["local"]).get("remote", 0) >= 1


def _descriptor(decode: str, request_id: str, ids: list[int], queue_tokens: int) -> dict[str, Any]:
    """POST /internal/decode offering local prefill under 8 tokens, with the prefill pool's queue; the
    descriptor line (a local stream is read to its end; a remote one is aborted: no KV will come)."""
    import orjson

    body = {"request_id": request_id, "input_ids": ids, "sampling": {"max_tokens": 2, "temperature": 0},
            "local_prefill_max_tokens": 8, "remote_prefill": {"queue_tokens": queue_tokens, "tokens_per_s": None}}
    with httpx.stream("POST", decode + "/internal/decode", json=body, timeout=HTTP_TIMEOUT) as response:
        assert response.status_code == 200, response.read()
        lines = response.iter_lines()
        first: dict[str, Any] = orjson.loads(next(lines))
        if first["descriptor"].get("local") is True:
            assert [orjson.loads(line)["type"] for line in lines][-1] == "done"
        else:
            httpx.post(decode + "/internal/abort", json={"request_id": request_id}, timeout=HTTP_TIMEOUT)
    return first


def test_prompt_over_the_threshold_goes_local_when_the_prefill_queue_is_deeper(routers: dict[str, str]) -> None:
    decode = routers["decode"]
    rng = random.Random(23)
    prompt = [rng.randrange(3, 200) for _ in range(150)]  # uncached: 150 tokens, over the 8 offered
    # An empty prefill pool: remote (ties stay remote, and this worker's own prompt costs as much here).
    assert _descriptor(decode, "q-remote", prompt, 0)["descriptor"].get("local") is not True
    # 2,000 tokens queued on the soonest prefill worker, none here: sooner here.
    assert _descriptor(decode, "q-local", prompt, 2000)["descriptor"] == {"local": True}
    metrics = httpx.get(decode + "/metrics", timeout=HTTP_TIMEOUT).text
    prefilled = [line for line in metrics.splitlines() if line.startswith("worker_prefilled_prompt_tokens_total{")]
    assert prefilled and float(prefilled[0].split()[-1]) >= 150, prefilled
