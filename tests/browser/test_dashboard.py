"""The admin home as the operator's dashboard, in a real browser: the demo deployment with its replicas per
role, health, current load and SLO state, the recent events (a refused placement marked refused), "View site"
leading back to it, the charts link opening the metrics page, and the home fitting 1,400 px.

As in test_admin_console.py: pytest-django's live server on the test database, Debian's headless Chromium
through playwright-python.
"""
from __future__ import annotations

import time
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from inference.actions import samples as sample_actions
from inference.models import Deployment, ScaleEvent, ScalingRule
from tests.browser.conftest import CHROMIUM, SKIP_REASON, BrowserSession
from tests.browser.test_scale_controls import PASSWORD, USERNAME, assert_fits, log_in
from tests.support.control_plane import make_deployment, make_model, make_node, make_worker

pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason=SKIP_REASON),
    pytest.mark.timeout(180),
]


@pytest.fixture
def demo(settings: Any) -> Deployment:
    """A superuser (fast hasher); the demo deployment with its prefill running and one of two decode workers
    running, an ITL SLO rule breaching, fresh samples and a refused placement."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    get_user_model().objects.create_superuser(USERNAME, "root@example.com", PASSWORD)
    deployment = make_deployment(name="demo", model=make_model(name="smollm2-135m"), decode_replicas=2)
    node = make_node(name="local", last_heartbeat=timezone.now())
    make_worker(deployment, node, role="prefill", status="running", port=1)
    make_worker(deployment, node, role="decode", status="running", port=2)
    ScalingRule.objects.create(deployment=deployment, name="itl-slo", kind="itl_slo", role="decode", threshold=50,
                               observations=[[time.time(), 72.5]])
    sample_actions.record_metric_sample(deployment, "prefill", load=0.42, queue_depth=3, ttft_s=0.35)
    sample_actions.record_metric_sample(deployment, "decode", load=0.81, queue_depth=1, itl_s=0.0725)
    ScaleEvent.objects.create(
        deployment=deployment, role="decode", from_replicas=1, to_replicas=2, source="manual", refused=True,
        reason="placement refused: 1 decode worker(s) not placed; nodes considered: local: no free CPUs",
    )  # fmt: skip
    return deployment


def test_admin_home_is_the_dashboard(browser: BrowserSession, live_server: Any, demo: Deployment) -> None:
    page = browser.page
    base = live_server.url

    with browser.step("dashboard"):
        log_in(browser, base)
        row = page.locator("#dashboard-deployments tr.deployment-row[data-deployment=demo]")
        assert row.count() == 1
        assert row.locator(".dash-health").inner_text() == "degraded"  # 1 of 2 decode workers runs
        assert " ".join(row.locator(".dash-prefill").inner_text().split()) == "1 [1–4] · 1 running"
        assert " ".join(row.locator(".dash-decode").inner_text().split()) == "2 [1–4] · 1 running"
        load = " ".join(row.locator(".dash-load").inner_text().split())
        assert "prefill: load 0.42 · queue 3 · TTFT 350 ms" in load
        assert "decode: load 0.81 · queue 1 · ITL 72 ms" in load
        assert " ".join(row.locator(".dash-slo").inner_text().split()) == "ITL p90: 72 ms / 50 ms breaching"
        events = page.locator("#dashboard-events tbody tr")
        assert events.count() == 1 and "refused" in events.first.inner_text()
        online = page.locator("#dashboard-nodes").get_by_role("row", name="online")
        assert online.inner_text().split() == ["online", "1"]
        page.get_by_text("Refreshing in").first.wait_for()  # autorefresh.js loaded and running

    with browser.step("view-site"):
        page.locator("#user-tools").get_by_role("link", name="View site").click()
        page.wait_for_url(f"{base}/admin/")

    with browser.step("charts-link"):
        with page.expect_response(lambda r: "/metrics/data/" in r.url) as data:
            row.get_by_role("link", name="charts").click()
        assert data.value.ok
        page.wait_for_url(f"{base}/admin/inference/deployment/{demo.pk}/metrics/")

    with browser.step("dashboard-fits"):
        assert_fits(browser, base, "/admin/")
