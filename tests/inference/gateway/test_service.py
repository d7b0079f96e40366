"""The process-wide router built from Django settings."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from inference.gateway.service import build_service, get_router, set_router
from inference.router import RouterError


@pytest.fixture(autouse=True)
def forget_router() -> Iterator[None]:
    set_router(None)
    yield None
    set_router(None)


def test_built_from_settings(settings: Any) -> None:
    settings.ROUTER_PREFILL_ENDPOINTS = ["http://p1:30000"]
    settings.ROUTER_DECODE_ENDPOINTS = ["http://d1:30001/", "http://d2:30001"]
    settings.ROUTER_POLICY = "power-of-two"
    settings.ROUTER_REQUEST_TIMEOUT_S = 42.0
    settings.PLATFORM_SHARED_SECRET = "s3cret"
    service = build_service()
    assert [e.url for e in service.pool.endpoints("decode")] == ["http://d1:30001", "http://d2:30001"]
    assert service.pool.policy_name == "power-of-two"
    assert service.pool.headers == {"X-Platform-Secret": "s3cret"}
    assert service.client.request_timeout_s == 42.0
    assert get_router() is get_router()  # one per process


def test_bad_settings_answer_503(settings: Any) -> None:
    settings.ROUTER_DECODE_ENDPOINTS = ["decode-node:30001"]
    with pytest.raises(RouterError) as info:
        get_router()
    assert info.value.status == 503 and "decode-node:30001" in info.value.message
