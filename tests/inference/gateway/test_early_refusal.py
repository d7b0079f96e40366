"""The early refusal in process: which requests it answers (a spent key in the snapshot), what it counts,
and that everything else reaches the routes untouched. End to end: test_tenants_e2e.py."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from django.contrib.auth import get_user_model

from inference.actions import api_keys as key_actions
from inference.gateway import api_keys
from inference.gateway.api_keys import KeyCache
from inference.gateway.early_refusal import EarlyRefusal, early_answer
from inference.gateway.quotas import LocalCounters, Quotas, set_quotas
from inference.gateway.service import build_service, set_router
from inference.gateway.tenancy import class_metrics
from inference.metrics import usage

pytestmark = pytest.mark.django_db(transaction=True)  # the key snapshot's reload closes old connections


@pytest.fixture
def spent(settings: Any) -> Iterator[dict[str, Any]]:
    """A router built from settings (not started), a fresh key snapshot and in-process quotas, and two
    keys: one whose minute is spent in this process, one with budget left."""
    settings.ROUTER_PREFILL_ENDPOINTS = ["http://127.0.0.1:9"]
    settings.ROUTER_DECODE_ENDPOINTS = ["http://127.0.0.1:9"]
    settings.ROUTER_API_KEYS = ["env-key-for-scripts"]
    service = build_service()
    set_router(service)
    cache = KeyCache(refresh_s=60, max_stale_s=60)
    api_keys._cache = cache
    quotas = Quotas(LocalCounters())
    set_quotas(quotas)
    usage._recorder = usage.UsageRecorder(flush_s=3600)  # this test's counts stay in memory
    owner = get_user_model().objects.create_user(f"early-{time.monotonic_ns()}", password=None)
    over = key_actions.create_key(name="over", owner=owner, requests_per_minute=1)
    fresh = key_actions.create_key(name="fresh", owner=owner, requests_per_minute=1000)
    cache._reload()

    async def spend() -> None:
        tenant = await cache.lookup(over.secret)
        assert tenant is not None
        while await quotas.admit(tenant) is None:  # bounded: the limit is 1
            pass

    if time.time() % 60 > 58:  # the spent minute must last through the test
        time.sleep(2.1)
    asyncio.run(spend())
    try:
        yield {"service": service, "over": over, "fresh": fresh}
    finally:
        set_router(None)
        set_quotas(None)
        api_keys._cache = None
        usage._recorder = None


def _headers(secret: str) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json"), (b"authorization", f"Bearer {secret}".encode())]


def test_a_spent_key_gets_its_429_counted_like_the_consumers(spent: dict[str, Any]) -> None:
    metrics = class_metrics(spent["service"].metrics.registry)
    before = metrics.limited.labels("interactive", "requests_per_minute")._value.get()
    recorder = usage.usage_recorder()
    answer = early_answer("POST", "/v1/chat/completions", _headers(spent["over"].secret), time.monotonic())
    assert answer is not None
    status, headers, body = answer
    assert status == 429 and 1 <= int(dict(headers)[b"retry-after"]) <= 60
    error = orjson.loads(body)["error"]
    assert error["code"] == "requests_per_minute" and spent["over"].key.prefix in error["message"]
    assert metrics.limited.labels("interactive", "requests_per_minute")._value.get() == before + 1
    assert metrics.requests.labels("interactive", "rejected")._value.get() >= 1
    rows = [counts for (key_id, _, _), counts in recorder._pending.items() if key_id == spent["over"].key.pk]
    assert sum(row.rejected for row in rows) == 1


def test_anything_the_memory_cannot_say_goes_the_usual_way(spent: dict[str, Any]) -> None:
    over = _headers(spent["over"].secret)
    assert early_answer("GET", "/v1/completions", over) is None  # a 405 is the consumer's
    assert early_answer("POST", "/v1/models", over) is None
    assert early_answer("POST", "/generate", _headers(spent["fresh"].secret)) is None  # budget left
    assert early_answer("POST", "/generate", _headers("env-key-for-scripts")) is None
    assert early_answer("POST", "/generate", _headers("dpk-notakeyofours0000000000")) is None
    assert early_answer("POST", "/generate", [(b"content-type", b"application/json")]) is None


def test_the_middleware_answers_without_reading_the_body_and_passes_the_rest(spent: dict[str, Any]) -> None:
    reached: list[str] = []
    sent: list[dict[str, Any]] = []

    async def routes(scope: dict[str, Any], receive: Any, send: Any) -> None:
        reached.append(scope["path"])

    async def receive() -> dict[str, Any]:
        raise AssertionError("the body of a refused request is not read")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    app = EarlyRefusal(routes)
    scope = {"type": "http", "method": "POST", "path": "/generate", "headers": _headers(spent["over"].secret)}
    asyncio.run(app(scope, receive, send))
    assert reached == [] and sent[0]["status"] == 429 and "more_body" not in sent[1]
    asyncio.run(app({**scope, "headers": _headers(spent["fresh"].secret)}, receive, send))
    asyncio.run(app({"type": "websocket", "path": "/ws/generate"}, receive, send))
    assert reached == ["/generate", "/ws/generate"]
