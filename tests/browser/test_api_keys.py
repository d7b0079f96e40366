"""API keys in a real browser: create a key, see its secret once, set a limit, send real traffic with it
through a router process, and see that traffic on the key's usage chart.

As in test_scale_controls.py: pytest-django's live server on the test database and Debian's headless
Chromium through playwright-python. The router is a real process (gunicorn + uvicorn, auth on) over
the stand-in workers, reading keys from the same test database and writing usage to it.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.db import connection

from inference.models import ApiKey, ApiKeyUsage
from tests.browser.conftest import CHROMIUM, SKIP_REASON, BrowserSession
from tests.browser.test_scale_controls import PASSWORD, USERNAME, assert_fits, log_in
from tests.inference.router.stand_ins import Cluster
from tests.support.processes import Proc, start_router, wait_until

pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason=SKIP_REASON),
    pytest.mark.timeout(180),
]


@pytest.fixture
def router(log_dir: Path, transactional_db: None) -> Iterator[str]:
    """Stand-in workers and a router with auth on over this test's database."""
    db = connection.settings_dict
    password = f":{db['PASSWORD']}" if db.get("PASSWORD") else ""
    database_url = f"postgres://{db['USER']}{password}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
    cluster = Cluster()
    proc: Proc | None = None
    try:
        env = {"DATABASE_URL": database_url, "ROUTER_REQUIRE_AUTH": "1", "ROUTER_USAGE_FLUSH_S": "1",
               "ROUTER_KEY_REFRESH_S": "1", "ROUTER_KEY_MAX_STALE_S": "2", "REDIS_URL": ""}
        proc, url = start_router(cluster.prefill_urls, cluster.decode_urls, log_dir, env=env)
        yield url
    finally:
        if proc is not None:
            proc.stop()
        cluster.stop()


def test_create_a_key_see_its_secret_once_and_its_usage(
    browser: BrowserSession, live_server: Any, router: str, settings: Any
) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    get_user_model().objects.create_superuser(USERNAME, "root@example.com", PASSWORD)
    page = browser.page
    base = live_server.url

    with browser.step("api-key-add"):
        log_in(browser, base)
        page.goto(f"{base}/admin/inference/apikey/add/")
        page.fill("#id_name", "web-app")
        page.fill("#id_requests_per_minute", "100")
        with page.expect_navigation():
            page.click("input[name=_save]")

    with browser.step("api-key-secret-shown-once"):
        secret = page.locator("#api-key-secret").inner_text().strip()
        assert re.fullmatch(r"dpk-[A-Za-z0-9_-]{40,}", secret), secret
        assert "shown only once" in page.content()
        key = ApiKey.objects.get(name="web-app")
        assert secret.startswith(key.prefix) and key.requests_per_minute == 100
        page.goto(f"{base}/admin/inference/apikey/")
        assert key.prefix in page.content() and secret not in page.content()

    with browser.step("api-key-limit-set"):
        page.goto(f"{base}/admin/inference/apikey/{key.pk}/change/")
        assert secret not in page.content()
        page.fill("#id_tokens_per_minute", "50000")
        with page.expect_navigation():
            page.click("input[name=_save]")
        key.refresh_from_db()
        assert key.tokens_per_minute == 50000

    for i in range(3):  # real traffic through the router, with the secret the page showed
        answer = httpx.post(f"{router}/v1/completions", json={"prompt": f"hi {i}", "max_tokens": 4, "user": "ana"},
                            headers={"Authorization": f"Bearer {secret}"}, timeout=30)
        assert answer.status_code == 200, answer.text
    wait_until("usage written", lambda: sum(r.requests for r in ApiKeyUsage.objects.filter(api_key=key)) == 3,
               timeout=20, watch=[])

    with browser.step("api-key-usage-chart"):
        page.goto(f"{base}/admin/inference/apikey/{key.pk}/usage/")
        assert page.locator("#usage-totals td").first.inner_text() == "3"
        assert page.locator("figure.usage-chart svg rect").count() >= 2  # requests and tokens bars
        csv = page.request.get(f"{base}/admin/inference/apikey/{key.pk}/usage.csv")
        assert csv.ok and csv.text().splitlines()[1].endswith(",ana")  # the OpenAI `user` recorded
    assert_fits(browser, base, f"/admin/inference/apikey/{key.pk}/usage/")
    assert_fits(browser, base, "/admin/inference/apikey/")
