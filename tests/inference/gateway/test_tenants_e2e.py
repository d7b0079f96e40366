"""API keys end to end: two real router processes (gunicorn + uvicorn) over the stand-in workers, one
Redis (db 3 of the test machine's, or REDIS_URL) and the test database.

- a requests-per-minute limit holds across both routers: exactly the limit admitted, the rest 429 with
  Retry-After and a message naming the limit; a limit large enough to be leased in blocks admits
  within 2 % of it and never more;
- a key known to be over its limit is refused before its request is routed or read (a body that is not
  JSON gets the 429, not the consumer's 400), on a keep-alive connection that serves the next request;
- what a router that is killed held (a concurrency slot, unused permits) comes back after its lease;
- a revoked key is refused by both routers within 5 s;
- usage (requests, tokens, the OpenAI `user`) reaches the database;
- ws/generate generations count against the key's limits too.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
import redis
from django.contrib.auth import get_user_model
from django.db import connection
from websockets.sync.client import connect as ws_connect

from inference.actions import api_keys as key_actions
from inference.models import ApiKeyUsage
from tests.inference.router.stand_ins import Cluster
from tests.support.processes import Proc, start_router, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

REDIS_URL = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/3"


def _database_url() -> str:
    db = connection.settings_dict
    password = f":{db['PASSWORD']}" if db.get("PASSWORD") else ""
    return f"postgres://{db['USER']}{password}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


@pytest.fixture(scope="module")
def routers(cluster: Cluster, log_dir: Path, django_db_setup: None, django_db_blocker: object) -> Iterator[list[str]]:
    """Two router processes with auth on, sharing Redis and the test database."""
    with django_db_blocker.unblock():  # type: ignore[attr-defined]
        database_url = _database_url()
    client = redis.Redis.from_url(REDIS_URL)
    stale = list(client.scan_iter("quota:*", count=1000))
    if stale:  # counters of an earlier run whose key ids this database reuses
        client.delete(*stale)
    env = {
        "DATABASE_URL": database_url, "REDIS_URL": REDIS_URL, "ROUTER_REQUIRE_AUTH": "1",
        "ROUTER_HEALTH_INTERVAL_S": "0.3", "ROUTER_KEY_REFRESH_S": "1", "ROUTER_KEY_MAX_STALE_S": "2",
        "ROUTER_USAGE_FLUSH_S": "1", "PLATFORM_LOG_LEVEL": "WARNING",
    }
    procs: list[Proc] = []
    urls: list[str] = []
    try:
        for _ in range(2):
            proc, url = start_router(cluster.prefill_urls, cluster.decode_urls, log_dir, env=env)
            procs.append(proc)
            urls.append(url)
        yield urls
    finally:
        for proc in procs:
            proc.stop()


def _owner() -> object:
    return get_user_model().objects.create_user(f"tenant-{time.monotonic_ns()}", password=None)


def _generate(url: str, secret: str, user: str | None = None) -> httpx.Response:
    """One OpenAI completion (the field `user` is OpenAI's; the seed's /generate refuses it)."""
    body: dict[str, object] = {"prompt": "hello", "max_tokens": 4}
    if user:
        body["user"] = user
    return httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {secret}"},
                      timeout=30)


def _start_of_a_minute_with_room(seconds_needed: float) -> None:
    """Wait (at most a minute) until the current one-minute window has `seconds_needed` left, so the
    burst is counted in one window."""
    left = 60 - time.time() % 60
    if left < seconds_needed:
        time.sleep(left + 0.05)


def test_requests_per_minute_hold_across_two_routers(routers: list[str], stand_ins: Cluster) -> None:
    limit = 20
    created = key_actions.create_key(name="shared", owner=_owner(), requests_per_minute=limit)
    _start_of_a_minute_with_room(15)
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(lambda i: _generate(routers[i % 2], created.secret), range(3 * limit)))
    statuses = [a.status_code for a in answers]
    assert statuses.count(200) == limit, statuses
    assert statuses.count(429) == 2 * limit, statuses
    refused = next(a for a in answers if a.status_code == 429)
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    error = refused.json()["error"]
    assert "requests_per_minute" in error["message"] and error["code"] == "requests_per_minute"
    assert created.key.prefix in error["message"]
    # Prometheus: per key class, never per key.
    metrics = httpx.get(f"{routers[0]}/metrics", timeout=10).text
    assert 'router_key_class_limited_total{key_class="interactive",limit="requests_per_minute"}' in metrics
    assert 'router_key_class_requests_total{key_class="interactive",outcome="ok"}' in metrics
    assert created.key.prefix not in metrics


def test_a_leased_limit_admits_within_2_percent_across_two_routers(routers: list[str], stand_ins: Cluster) -> None:
    limit = 200  # permits leased 2 at a time by each router
    created = key_actions.create_key(name="leased", owner=_owner(), requests_per_minute=limit)
    _start_of_a_minute_with_room(40)
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        answers = list(pool.map(lambda i: _generate(routers[i % 2], created.secret), range(limit * 3 // 2)))
    statuses = [a.status_code for a in answers]
    admitted = statuses.count(200)
    assert 0.98 * limit <= admitted <= limit, admitted
    assert statuses.count(429) == len(statuses) - admitted, statuses


def test_a_killed_routers_slot_and_permits_come_back_after_its_lease(
        routers: list[str], stand_ins: Cluster, log_dir: Path) -> None:
    created = key_actions.create_key(name="orphaned", owner=_owner(), requests_per_minute=1000, max_concurrent=1)
    key_id = created.key.pk
    client = redis.Redis.from_url(REDIS_URL)
    env = {"DATABASE_URL": _database_url(), "REDIS_URL": REDIS_URL, "ROUTER_REQUIRE_AUTH": "1",
           "ROUTER_QUOTA_LEASE_S": "3", "PLATFORM_LOG_LEVEL": "WARNING"}
    doomed, doomed_url = start_router(stand_ins.prefill_urls, stand_ins.decode_urls, log_dir, env=env)
    _start_of_a_minute_with_room(20)
    window = int(time.time() // 60)
    for decode in stand_ins.decode:
        decode.token_delay_s = 1.0  # the doomed router's request holds the key's only slot for seconds
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(_generate, doomed_url, created.secret)
            wait_until("the slot taken", lambda: client.get(f"quota:{key_id}:c") == b"1", timeout=10, watch=[doomed])
            assert int(client.get(f"quota:{key_id}:r:{window}") or 0) == 10  # a block of 1 % of 1000
            doomed.kill()  # SIGKILL: nothing is given back
            killed_at = time.monotonic()
            with pytest.raises(Exception):  # noqa: B017  the connection dies with the router
                pending.result(timeout=30)
        for decode in stand_ins.decode:
            decode.token_delay_s = 0.0
        refused = _generate(routers[0], created.secret)
        assert refused.status_code == 429 and "max_concurrent" in refused.json()["error"]["message"]
        wait_until("the dead router's slot back", lambda: _generate(routers[0], created.secret).status_code == 200,
                   timeout=10, watch=[], interval=0.2)
        assert time.monotonic() - killed_at < 3.0 + 5.0  # its lease plus the polling and a loaded machine
        # The 9 permits it never used came back with the slot: 1 used there, 10 leased by routers[0], and
        # the refused request used none.
        assert int(client.get(f"quota:{key_id}:r:{window}") or 0) == 1 + 10
    finally:
        doomed.stop()


def test_a_spent_key_is_refused_before_its_body_is_read(routers: list[str], stand_ins: Cluster) -> None:
    spent = key_actions.create_key(name="spent", owner=_owner(), requests_per_minute=1)
    other = key_actions.create_key(name="other", owner=_owner())
    _start_of_a_minute_with_room(10)
    url = routers[0]
    assert _generate(url, spent.secret).status_code == 200
    assert _generate(url, spent.secret).status_code == 429  # the budget spent: now known in the process
    metrics_before = httpx.get(f"{url}/metrics", timeout=10).text
    with httpx.Client(timeout=10) as client:  # one keep-alive connection for all of them
        for _ in range(3):
            refused = client.post(f"{url}/v1/completions", content=b"{not json",
                                  headers={"Authorization": f"Bearer {spent.secret}",
                                           "content-type": "application/json"})
            assert refused.status_code == 429, refused.text  # the consumer would have answered 400
            assert 1 <= int(refused.headers["retry-after"]) <= 60
            assert refused.json()["error"]["code"] == "requests_per_minute"
        served = client.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                             headers={"Authorization": f"Bearer {other.secret}"})
        assert served.status_code == 200 and served.json()["choices"]
    assert _refusals_since(metrics_before, url) == 3


def _refusals_since(metrics_before: str, url: str) -> float:
    """How many refusals the router's refusal-time histogram gained since `metrics_before`."""
    def total(text: str) -> float:
        return next((float(line.split()[-1]) for line in text.splitlines()
                     if line.startswith("router_key_limit_refusal_seconds_count")), 0.0)

    return total(httpx.get(f"{url}/metrics", timeout=10).text) - total(metrics_before)


def test_a_revoked_key_is_refused_by_every_router_within_5s(routers: list[str], stand_ins: Cluster) -> None:
    created = key_actions.create_key(name="short-lived", owner=_owner())
    for url in routers:
        def accepted(url: str = url) -> bool:
            return _generate(url, created.secret).status_code == 200

        wait_until("the new key accepted", accepted, timeout=10, watch=[])
    key_actions.revoke_key(created.key)
    revoked_at = time.monotonic()
    pending = set(routers)
    while pending and time.monotonic() - revoked_at < 10:  # bounded: measured against the 5 s target below
        pending = {url for url in pending if _generate(url, created.secret).status_code != 401}
        time.sleep(0.05)
    elapsed = time.monotonic() - revoked_at
    assert not pending, f"still accepted by {pending} after {elapsed:.1f}s"
    assert elapsed < 5.0


def test_usage_reaches_the_database(routers: list[str], stand_ins: Cluster) -> None:
    created = key_actions.create_key(name="metered", owner=_owner())
    for i in range(4):
        assert _generate(routers[i % 2], created.secret, user="alice").status_code == 200

    def recorded() -> int:
        rows = ApiKeyUsage.objects.filter(api_key=created.key)
        return sum(row.requests for row in rows) if rows else 0

    wait_until("usage rows", lambda: recorded() == 4, timeout=15, watch=[])
    rows = list(ApiKeyUsage.objects.filter(api_key=created.key))
    assert sum(r.completion_tokens for r in rows) > 0 and sum(r.prompt_tokens for r in rows) > 0
    assert all(r.users == ["alice"] for r in rows)
    assert all(r.minute <= datetime.now(tz=UTC) for r in rows)


def test_websocket_generations_count_against_the_key(routers: list[str], stand_ins: Cluster) -> None:
    created = key_actions.create_key(name="socket", owner=_owner(), requests_per_minute=1)
    _start_of_a_minute_with_room(10)
    ws_url = routers[1].replace("http://", "ws://") + "/ws/generate"
    headers = {"Authorization": f"Bearer {created.secret}"}
    with ws_connect(ws_url, open_timeout=10, close_timeout=2, additional_headers=headers) as ws:
        ws.send(json.dumps({"prompt": "hi", "max_tokens": 2}))
        last = json.loads(ws.recv(timeout=10))
        while last["type"] == "token":  # bounded by the recv timeout and max_tokens
            last = json.loads(ws.recv(timeout=10))
        assert last["type"] == "done"
        ws.send(json.dumps({"prompt": "again", "max_tokens": 2}))
        refused = json.loads(ws.recv(timeout=10))
        assert refused["type"] == "error" and refused["status"] == 429
        assert "requests_per_minute" in refused["message"]
