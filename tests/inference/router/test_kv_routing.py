"""KV-aware routing with real processes: two prefill workers and a decode worker of the tiny model, a
router with the `kv-aware` policy subscribed to their KV event streams.

Each conversation's second turn (its first turn's prompt, the reply, a new user message, as token
ids) must go to the prefill worker that holds its first turn's prefix, and that prefill
worker must report prefix-cache hits; a second router must start exact from the workers' snapshots;
a killed worker's entries must leave the index, and the stale-free index must still serve requests.
"""
from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.processes import Proc, start_router, start_worker, wait_until

pytestmark = pytest.mark.django_db(transaction=False, databases=[])

COMMON = ["--block-size", "8", "--context-length", "512"]
HTTP_TIMEOUT = httpx.Timeout(60.0, connect=10.0)
ROUTER_ENV = {"ROUTER_REQUEST_TIMEOUT_S": "60", "ROUTER_HEALTH_INTERVAL_S": "0.5"}
CONVERSATIONS = 4


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, log_dir: Path) -> Iterator[dict[str, Any]]:
    """Two prefill workers, a decode worker and a kv-aware router, shared by the tests in order."""
    roles = {"p0": "prefill", "p1": "prefill", "d0": "decode"}
    with ThreadPoolExecutor(len(roles)) as pool:  # in parallel: each takes seconds to load the model
        futures = {name: pool.submit(start_worker, role, tiny_model_dir, log_dir, extra=COMMON, name=f"kv-{name}")
                   for name, role in roles.items()}
    started = {name: future.result() for name, future in futures.items() if future.exception() is None}
    procs: list[Proc] = [proc for proc, _url in started.values()]
    try:
        for future in futures.values():
            future.result()
        urls = {name: url for name, (_proc, url) in started.items()}
        router, router_url = start_router([urls["p0"], urls["p1"]], [urls["d0"]], log_dir,
                                          policy="kv-aware", env=ROUTER_ENV)
        procs.append(router)
        yield {"urls": urls, "procs": {name: proc for name, (proc, _url) in started.items()},
               "router": router_url, "router_proc": router, "log_dir": log_dir}
    finally:
        for proc in reversed(procs):
            proc.stop()


def _wait(what: str, check: Callable[[], bool], cluster: dict[str, Any], watch: list[str] | None = None) -> None:
    procs = cluster["procs"]
    wait_until(what, check, 30, [procs[name] for name in (watch or list(procs))] + [cluster["router_proc"]])


def _generate(router: str, ids: list[int]) -> dict[str, Any]:
    body = {"input_ids": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    response = httpx.post(router + "/generate", json=body, timeout=HTTP_TIMEOUT)
    assert response.status_code == 200, response.text
    return response.json()


def _kv(router: str) -> dict[str, Any]:
    status = httpx.get(router + "/router/status", timeout=HTTP_TIMEOUT).json()
    kv = status.get("kv")
    assert kv is not None, status
    return kv


def _blocks(router: str) -> dict[str, int]:
    return {url: w["blocks"] for url, w in _kv(router)["index"]["workers"].items()}


def _holds(router: str, url: str, blocks: int) -> bool:
    return _blocks(router).get(url, 0) >= blocks


def _hit_ratio(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=HTTP_TIMEOUT).text.splitlines():
        if line.startswith("worker_prefix_cache_hit_ratio"):
            return float(line.split()[-1])
    raise AssertionError("no worker_prefix_cache_hit_ratio on " + url)


def test_second_turn_goes_to_the_worker_holding_the_prefix(cluster: dict[str, Any]) -> None:
    router, urls = cluster["router"], cluster["urls"]
    _wait("the router's snapshots of 3 workers", lambda: len(_blocks(router)) == 3, cluster)
    rng = random.Random(7)
    for _ in range(CONVERSATIONS):
        system = [rng.randrange(3, 200) for _ in range(96)]  # 12 blocks, its own per conversation
        prompt = system + [rng.randrange(3, 200) for _ in range(10)]
        first = _generate(router, prompt)
        holder = first["prefill"]
        # The first turn's blocks reach the index (a stored event) before the second turn is routed.
        _wait("the first turn's blocks", functools.partial(_holds, router, holder, 12), cluster)
        second = _generate(router, prompt + first["tokens"] + [rng.randrange(3, 200) for _ in range(5)])
        assert second["prefill"] == holder, (first, second, _kv(router))
        # The client sees what the prefill worker did not compute (OpenAI's usage field): none of the
        # first turn's own system prompt, at least its 12 blocks on the second.
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}, first["usage"]
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96, second["usage"]
    predicted = _kv(router)["predicted"]
    assert predicted["prefill"]["predicted_cached_tokens"] >= CONVERSATIONS * 96, predicted
    # Beside the prediction, what the workers then reported: the prefill workers reused the first turns'
    # blocks, the decode worker held them (it received them for the first turn) and took only the rest.
    assert predicted["prefill"]["reported_cached_tokens"] >= CONVERSATIONS * 96, predicted
    assert predicted["decode"]["reported_cached_tokens"] >= CONVERSATIONS * 96, predicted
    assert max(_hit_ratio(urls["p0"]), _hit_ratio(urls["p1"])) > 0.3
    metrics = httpx.get(router + "/metrics", timeout=HTTP_TIMEOUT).text
    cached = float(predicted["prefill"]["predicted_cached_tokens"])
    assert f'router_kv_predicted_cached_tokens{{role="prefill"}} {cached}' in metrics
    reported = float(_kv(router)["predicted"]["prefill"]["reported_cached_tokens"])
    assert f'router_kv_reported_cached_tokens{{role="prefill"}} {reported}' in metrics


def test_a_new_router_is_exact_from_the_snapshots(cluster: dict[str, Any]) -> None:
    urls = cluster["urls"]
    first = _blocks(cluster["router"])
    proc, second_url = start_router([urls["p0"], urls["p1"]], [urls["d0"]], cluster["log_dir"],
                                    policy="kv-aware", env=ROUTER_ENV)
    try:
        _wait("the new router's snapshots", lambda: len(_blocks(second_url)) == 3, cluster)
        assert _blocks(second_url) == first
    finally:
        proc.stop()


def test_a_killed_worker_leaves_the_index_and_requests_go_on(cluster: dict[str, Any]) -> None:
    router, urls = cluster["router"], cluster["urls"]
    assert urls["p0"] in _blocks(router)
    cluster["procs"]["p0"].kill()
    _wait("p0 leaving the index", lambda: urls["p0"] not in _blocks(router), cluster, watch=["p1"])
    assert _kv(router)["stream_errors"].get(urls["p0"])
    for _ in range(3):  # whatever the index said about p0, every request is served (by p1)
        assert _generate(router, [5] * 40)["prefill"] == urls["p1"]
