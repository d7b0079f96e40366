"""The load every router process shares, with real processes: workers report their load on their KV
event streams, so a router weighs requests another router sent.

Router A (decode d0 only, its prefill worker delays each KV send by a few seconds) holds two requests
on d0, waiting for their KV. Router B (decode d0 and d1, a prompt that neither holds) has nothing in
flight itself, so by its own counts d0 and d1 tie; with d0's reported load it must send every request
to d1, and its /router/status must show what d0 reported.
"""
from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.processes import Proc, post_json, start_router, start_worker, start_workers, wait_until

pytestmark = pytest.mark.django_db(transaction=False, databases=[])

COMMON = ["--block-size", "8", "--context-length", "512"]
HTTP_TIMEOUT = httpx.Timeout(60.0, connect=10.0)
ROUTER_ENV = {"ROUTER_REQUEST_TIMEOUT_S": "60", "ROUTER_HEALTH_INTERVAL_S": "0.5"}
HELD_S = 8  # how long router A's requests wait for their KV on d0


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, log_dir: Path) -> Iterator[dict[str, Any]]:
    """d0, d1, a prefill worker that sends its KV late (A's) and one that does not (B's), two routers."""
    procs: list[Proc] = []
    try:
        started = start_workers({"d0": "decode", "d1": "decode", "fast": "prefill"}, tiny_model_dir, log_dir,
                                extra=COMMON, prefix="shared")
        procs += [proc for proc, _url in started.values()]
        slow, slow_url = start_worker("prefill", tiny_model_dir, log_dir, extra=COMMON, name="shared-slow",
                                      env={"PLATFORM_FAULT_PREFILL_DELAY_S": str(HELD_S)})
        procs.append(slow)
        urls = {name: url for name, (_proc, url) in started.items()}
        router_a, url_a = start_router([slow_url], [urls["d0"]], log_dir, policy="kv-aware", env=ROUTER_ENV)
        procs.append(router_a)
        router_b, url_b = start_router([urls["fast"]], [urls["d0"], urls["d1"]], log_dir, policy="kv-aware",
                                       env=ROUTER_ENV)
        procs.append(router_b)
        yield {"urls": urls, "a": url_a, "b": url_b, "procs": procs}
    finally:
        for proc in reversed(procs):
            proc.stop()


def _generate(router: str, ids: list[int]) -> dict[str, Any]:
    return post_json(router + "/generate", {"input_ids": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
                     timeout=HTTP_TIMEOUT)


def _reported(router: str, url: str) -> dict[str, Any] | None:
    status = httpx.get(router + "/router/status", timeout=HTTP_TIMEOUT).json()
    for endpoint in status["decode"]:
        if endpoint["url"] == url:
            report: dict[str, Any] | None = endpoint["reported_load"]
            return report
    raise AssertionError(f"{url} not in {status['decode']}")


def test_a_router_weighs_the_requests_another_router_sent(cluster: dict[str, Any]) -> None:
    urls = cluster["urls"]
    d0, d1 = urls["d0"], urls["d1"]
    wait_until("router B subscribed to both decode workers' streams",
               lambda: _reported(cluster["b"], d0) is not None and _reported(cluster["b"], d1) is not None,
               30, cluster["procs"])
    rng = random.Random(19)
    held: list[dict[str, Any]] = []
    errors: list[BaseException] = []

    def hold() -> None:
        try:
            held.append(_generate(cluster["a"], [rng.randrange(3, 200) for _ in range(40)]))
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=hold) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        wait_until("d0's report of router A's two requests reached router B",
                   lambda: (_reported(cluster["b"], d0) or {}).get("waiting", 0)
                   + (_reported(cluster["b"], d0) or {}).get("running", 0) >= 2,
                   HELD_S - 2, cluster["procs"])
        # Router B has nothing in flight anywhere: by its own counts d0 and d1 tie (random), by the
        # workers' reports d0 has two requests and d1 none.
        chosen = [_generate(cluster["b"], [rng.randrange(3, 200) for _ in range(40)])["decode"] for _ in range(4)]
        assert chosen == [d1] * 4, chosen
    finally:
        for thread in threads:
            thread.join(HELD_S + 60)
    assert not errors, errors
    assert [answer["decode"] for answer in held] == [d0, d0]
    # Once A's requests ended, d0 reports an idle worker again.
    wait_until("d0 idle again in router B's view",
               lambda: (_reported(cluster["b"], d0) or {}).get("waiting", 1) == 0, 30, cluster["procs"])
