"""Authentication in-process: the generation API's keys and DRF tokens, the management REST API,
the admin behind its login, the ASGI guards, and production settings that refuse to start open.

The same controls against real processes are in test_router_security.py and test_worker_secret.py.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.test.utils import override_settings
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from inference.gateway.auth import WS_CLOSE_UNAUTHORIZED, WebSocketAuthMiddleware, bearer_key, token_cache
from inference.gateway.limits import BodySizeLimitMiddleware
from tests.support.asgi import asgi_request, header
from tests.support.control_plane import make_deployment
from tests.support.processes import ROOT

KEY = "sk-unit-test-key"


@pytest.fixture(autouse=True)
def _fresh_token_cache() -> Iterator[None]:
    """Each test sees its own token lookups, not the previous test's cached answers."""
    token_cache.clear()
    yield
    token_cache.clear()


def call(authorization: str | None = None, path: str = "/router/status") -> dict[str, Any]:
    """GET a key-guarded router path through the real ASGI application with an Authorization header."""
    headers = {"authorization": authorization} if authorization is not None else {}
    return asgi_request("GET", path, headers=headers)


def status(authorization: str | None = None) -> int:
    return int(call(authorization)["status"])


def assert_401(response: dict[str, Any]) -> None:
    assert response["status"] == 401
    assert header(response, "content-type") == "application/json"
    assert (header(response, "www-authenticate") or "").startswith("Bearer")
    body = json.loads(response["body"])
    assert body["error"]["type"] == "authentication_error"
    assert body["error"]["message"]


def make_token(active: bool = True) -> str:
    user = get_user_model().objects.create_user(f"user-{Token.objects.count()}", password=None, is_active=active)
    return str(Token.objects.create(user=user).key)


# --------------------------------------------------------------------------- generation API keys


def test_bearer_key_parsing() -> None:
    assert bearer_key("Bearer abc") == "abc"
    assert bearer_key("bearer   abc ") == "abc"
    assert bearer_key("Token abc") == "abc"
    assert bearer_key("Basic YWJjOmRlZg==") is None
    assert bearer_key("Bearer") is None
    assert bearer_key("") is None
    assert bearer_key(None) is None


@override_settings(ROUTER_API_KEYS=[], ROUTER_REQUIRE_AUTH=False)
def test_open_when_nothing_is_configured() -> None:
    assert status() == 200


@override_settings(ROUTER_API_KEYS=[KEY, "another"], ROUTER_REQUIRE_AUTH=False)
def test_configured_keys() -> None:
    assert status(f"Bearer {KEY}") == 200
    assert status("Bearer another") == 200
    assert status(f"Token {KEY}") == 200
    assert_401(call())
    assert_401(call("Bearer nope"))
    assert_401(call(f"Bearer {KEY}x"))
    assert_401(call(f"Basic {KEY}"))
    # A latin-1 header value compares as bytes: refused, not a TypeError from hmac.compare_digest.
    assert_401(call("Bearer sk-\xe9\xff"))


@pytest.mark.django_db
@override_settings(ROUTER_API_KEYS=[], ROUTER_REQUIRE_AUTH=True)
def test_drf_tokens_of_active_users() -> None:
    assert status(f"Bearer {make_token()}") == 200
    assert status(f"Token {make_token()}") == 200
    assert_401(call(f"Bearer {make_token(active=False)}"))
    assert_401(call("Bearer " + "0" * 40))  # the shape of a token, but none
    assert_401(call())


@pytest.mark.django_db
@override_settings(ROUTER_API_KEYS=[KEY], ROUTER_REQUIRE_AUTH=False, ROUTER_AUTH_CACHE_S=0.0)
def test_tokens_also_work_next_to_keys_and_revocation_applies() -> None:
    token = make_token()
    assert status(f"Bearer {token}") == 200
    Token.objects.filter(key=token).delete()
    assert_401(call(f"Bearer {token}"))  # no cache (ROUTER_AUTH_CACHE_S=0): refused at once


@pytest.mark.django_db
@override_settings(ROUTER_API_KEYS=[], ROUTER_REQUIRE_AUTH=True, ROUTER_AUTH_CACHE_S=60.0)
def test_token_lookups_are_cached() -> None:
    token = make_token()
    assert status(f"Bearer {token}") == 200
    Token.objects.filter(key=token).delete()
    # Within ROUTER_AUTH_CACHE_S the answer comes from the cache: no query per request.
    assert status(f"Bearer {token}") == 200


@override_settings(ROUTER_API_KEYS=[KEY])
@pytest.mark.parametrize(
    "url", ["/generate", "/api/generate", "/v1/completions", "/v1/chat/completions", "/v1/models", "/router/status"]
)
def test_every_generation_route_is_guarded(url: str) -> None:
    method = "POST" if "generate" in url or "completions" in url else "GET"
    assert_401(asgi_request(method, url, b"{}"))


@override_settings(ROUTER_API_KEYS=[KEY])
@pytest.mark.parametrize("url", ["/health", "/metrics"])
def test_health_and_metrics_stay_open(url: str) -> None:
    # Load balancers and Prometheus probe these without credentials (the real router answers
    # /health without a key in test_router_security.py too).
    assert asgi_request("GET", url)["status"] == 200


# --------------------------------------------------------------------------- management REST API


@pytest.mark.django_db
@pytest.mark.parametrize("url", ["/api/deployments/", "/api/nodes/", "/api/workers/", "/api/rules/"])
def test_rest_api_requires_a_token(url: str) -> None:
    assert APIClient().get(url).status_code == 401
    bad = APIClient()
    bad.credentials(HTTP_AUTHORIZATION="Token " + "0" * 40)
    assert bad.get(url).status_code in (401, 403)
    inactive = APIClient()
    inactive.credentials(HTTP_AUTHORIZATION=f"Token {make_token(active=False)}")
    assert inactive.get(url).status_code in (401, 403)
    good = APIClient()
    good.credentials(HTTP_AUTHORIZATION=f"Token {make_token()}")
    assert good.get(url).status_code == 200
    # Writes are refused the same way.
    assert APIClient().post("/api/models/", {"name": "x"}, format="json").status_code == 401


# --------------------------------------------------------------------------- admin behind login


@pytest.mark.django_db
def test_admin_and_its_metrics_json_need_a_staff_login() -> None:
    deployment = make_deployment()
    urls = [
        "/admin/",
        "/admin/inference/deployment/",
        f"/admin/inference/deployment/{deployment.pk}/metrics/",
        f"/admin/inference/deployment/{deployment.pk}/metrics/data/",
    ]
    anonymous = Client()
    for url in urls:
        response = anonymous.get(url)
        assert response.status_code == 302, url
        assert response["Location"].startswith("/admin/login/"), url
    # A logged-in user who is not staff is sent to the login page too.
    user = get_user_model().objects.create_user("plain", password="pw-123456789")
    plain = Client()
    plain.force_login(user)
    for url in urls:
        assert plain.get(url).status_code == 302, url
    staff = Client()
    staff.force_login(get_user_model().objects.create_superuser("root", password="pw-123456789"))
    data = staff.get(urls[-1])
    assert data.status_code == 200
    assert data["Content-Type"].startswith("application/json")


# --------------------------------------------------------------------------- ASGI guards


def run_asgi(app: Any, scope: dict[str, Any], incoming: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drive an ASGI app with the given incoming messages; return what it sent."""
    sent: list[dict[str, Any]] = []
    queue = list(incoming)

    async def receive() -> dict[str, Any]:
        if queue:
            return queue.pop(0)
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(asyncio.wait_for(app(scope, receive, send), timeout=10))
    return sent


@override_settings(ROUTER_API_KEYS=[KEY])
def test_websocket_without_a_key_is_closed_with_4401() -> None:
    async def inner(scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise AssertionError("the consumer must not run")

    for headers in ([], [(b"authorization", b"Bearer wrong")]):
        scope = {"type": "websocket", "path": "/ws/generate", "headers": headers}
        sent = run_asgi(WebSocketAuthMiddleware(inner), scope, [{"type": "websocket.connect"}])
        assert [m["type"] for m in sent] == ["websocket.accept", "websocket.send", "websocket.close"]
        assert json.loads(sent[1]["text"])["error_type"] == "authentication_error"
        assert sent[2]["code"] == WS_CLOSE_UNAUTHORIZED


@override_settings(ROUTER_API_KEYS=[KEY])
def test_websocket_with_a_key_reaches_the_consumer() -> None:
    reached: list[bool] = []

    async def inner(scope: dict[str, Any], receive: Any, send: Any) -> None:
        reached.append(True)

    scope = {"type": "websocket", "path": "/ws/generate", "headers": [(b"authorization", f"Bearer {KEY}".encode())]}
    run_asgi(WebSocketAuthMiddleware(inner), scope, [])
    assert reached == [True]


@override_settings(ROUTER_MAX_BODY_BYTES=2048)
def test_body_limit_middleware() -> None:
    seen: list[bytes] = []

    async def inner(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    app = BodySizeLimitMiddleware(inner)
    declared = {"type": "http", "path": "/generate", "headers": [(b"content-length", b"4096")]}
    sent = run_asgi(app, declared, [])
    assert sent[0]["status"] == 413 and json.loads(sent[1]["body"])["error"]["message"]
    chunk = {"type": "http.request", "body": b"x" * 1000, "more_body": True}
    chunked = {"type": "http", "path": "/generate", "headers": []}
    sent = run_asgi(app, chunked, [chunk, chunk, chunk])
    assert sent[0]["status"] == 413
    # Under the limit, a chunked body reaches the app whole.
    sent = run_asgi(app, chunked, [chunk, {"type": "http.request", "body": b"y", "more_body": False}])
    assert sent[0]["status"] == 200 and seen == [b"x" * 1000 + b"y"]


# --------------------------------------------------------------------------- production settings


def _settings_import(extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROUTER_", "PLATFORM_", "DJANGO_"))}
    env.update({"DJANGO_SETTINGS_MODULE": "config.settings", "PLATFORM_PRODUCTION": "1",
                "DJANGO_SECRET_KEY": "x" * 50, **extra})
    return subprocess.run([sys.executable, "-c", "import django; django.setup()"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_production_settings_refuse_an_open_api_or_no_shared_secret() -> None:
    open_api = _settings_import({"PLATFORM_SHARED_SECRET": "s"})
    assert open_api.returncode != 0
    assert "ImproperlyConfigured" in open_api.stderr and "ROUTER_API_KEYS" in open_api.stderr
    no_secret = _settings_import({"ROUTER_API_KEYS": "k"})
    assert no_secret.returncode != 0 and "PLATFORM_SHARED_SECRET" in no_secret.stderr
    assert _settings_import({"ROUTER_API_KEYS": "k", "PLATFORM_SHARED_SECRET": "s"}).returncode == 0, "keys + secret"
    assert _settings_import({"ROUTER_REQUIRE_AUTH": "1", "PLATFORM_SHARED_SECRET": "s"}).returncode == 0
