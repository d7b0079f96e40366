"""Real processes: a decode worker started with `--batch-size 4` runs at most 4 sequences at once,
however many arrive with their KV from the prefill worker; the rest wait in its queue (`/health`
`queue_depth`), every request completes, and the KV pools are empty afterwards.

The workers are driven through their internal API (decode → descriptor → prefill → stream), as the
router does, so that this test depends on the workers only."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.processes import start_parallel, start_worker

pytestmark = pytest.mark.django_db(transaction=False, databases=[])

BATCH = 4
REQUESTS = 12
# Long enough that the 12 prefills all land while the first 4 decode, even on a fast idle CPU (with 400
# tokens a Zen 5 core finished sequences before the later KV arrived, and the queue never reached 4).
MAX_TOKENS = 1500


@pytest.fixture(scope="module")
def capped_cluster(tiny_model_dir: Path, log_dir: Path):
    """Prefill + decode with --batch-size 4."""
    procs = []
    try:
        common = ["--context-length", "1600", "--block-size", "8", "--batch-size", str(BATCH)]
        started = start_parallel({
            "prefill": partial(start_worker, "prefill", tiny_model_dir, log_dir, extra=common, name="cap-prefill"),
            "decode": partial(start_worker, "decode", tiny_model_dir, log_dir, extra=common, name="cap-decode"),
        })
        (prefill, prefill_url), (decode, decode_url) = started["prefill"], started["decode"]
        procs += [prefill, decode]
        yield {"prefill": prefill_url, "decode": decode_url}
    finally:
        for p in reversed(procs):
            p.stop()


def generate(cluster: dict[str, str], request_id: str, prompt: str) -> dict[str, Any]:
    """One disaggregated request as the router runs it; returns the decode stream's last line."""
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    body = {"request_id": request_id, "prompt": prompt, "sampling": sampling}
    with httpx.Client(timeout=300) as client, client.stream(
        "POST", cluster["decode"] + "/internal/decode", json=body
    ) as stream:
        assert stream.status_code == 200, stream.read()
        lines = stream.iter_lines()
        first = json.loads(next(lines))
        assert first["type"] == "descriptor"
        prefill = client.post(cluster["prefill"] + "/internal/prefill", json={
            "request_id": request_id, "prompt_token_ids": first["prompt_token_ids"],
            "sampling": sampling, "descriptor": first["descriptor"],
        })
        assert prefill.status_code == 200, prefill.text
        last: dict[str, Any] = {}
        for line in lines:
            if line:
                last = json.loads(line)
        return last


def _poll(url: str, stop: threading.Event, samples: list[dict[str, Any]]) -> None:
    """Record /health answers until `stop` is set."""
    with httpx.Client(timeout=5) as client:
        while not stop.is_set():
            try:
                samples.append(client.get(url + "/health").json())
            except httpx.HTTPError:
                pass
            time.sleep(0.01)


def test_decode_runs_at_most_batch_size_and_queues_the_rest(capped_cluster) -> None:
    info = httpx.get(capped_cluster["decode"] + "/info").json()
    assert info["batch_size"] == BATCH and info["max_queue"] >= REQUESTS

    def call(i: int) -> dict[str, Any]:
        return generate(capped_cluster, f"req-{i}", f"request {i}: the quick brown fox jumps over the lazy dog")

    samples: list[dict[str, Any]] = []
    stop = threading.Event()
    poller = threading.Thread(target=_poll, args=(capped_cluster["decode"], stop, samples), daemon=True)
    poller.start()
    try:
        with ThreadPoolExecutor(REQUESTS) as pool:
            results = list(pool.map(call, range(REQUESTS)))
    finally:
        stop.set()
        poller.join(10)

    assert all(r["type"] == "done" for r in results), results
    short = [r for r in results if r["usage"]["completion_tokens"] != MAX_TOKENS]
    assert not short, short
    assert all(r["finish_reason"] == "length" for r in results)
    assert samples, "no /health answer during the run"
    assert all({"queue_depth", "running", "reserved", "batch_size"} <= s.keys() for s in samples)
    assert max(s["running"] for s in samples) == BATCH
    assert all(s["running"] <= BATCH for s in samples)
    # While the batch was full, the others were visible as queued (KV arrived) or reserved.
    # (Polling on a busy machine is coarse and the prefills trickle in, hence the slack.)
    full = [s for s in samples if s["running"] == BATCH]
    assert max(s["queue_depth"] for s in full) >= BATCH
    assert max(s["queue_depth"] + s["reserved"] for s in full) >= REQUESTS - BATCH - 2
    assert all(s["running"] + s["queue_depth"] + s["reserved"] <= REQUESTS for s in samples)

    deadline = time.monotonic() + 10
    while True:
        health = {role: httpx.get(capped_cluster[role] + "/health").json() for role in ("prefill", "decode")}
        if all(h["kv_usage"] == 0 for h in health.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert health["decode"]["kv_usage"] == 0 and health["prefill"]["kv_usage"] == 0
    assert health["decode"]["running"] == 0 and health["decode"]["queue_depth"] == 0
    assert health["decode"]["reserved"] == 0
    metrics = httpx.get(capped_cluster["decode"] + "/metrics").text
    assert "worker_queue_depth" in metrics and "worker_reserved_requests" in metrics
    assert "worker_prefix_cache_hit_ratio" in httpx.get(capped_cluster["prefill"] + "/metrics").text
