"""The deployment page's scale controls in a real browser: scale a role from the page, read what will
happen, see the scale event (and a refused placement marked refused), override a schedule rule from the
page, and the pages involved fit 1,400 px.

As in test_admin_console.py: pytest-django's live server on the test database, Debian's headless
Chromium through playwright-python, Celery messages recorded; the scale task runs in this process as
the controller would (its reconcile is only recorded).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from inference import jobs
from inference.models import Deployment, ScaleEvent, ScaleOverride, ScalingRule
from inference.selectors import schedules
from tests.browser.conftest import CHROMIUM, SKIP_REASON, BrowserSession
from tests.browser.test_admin_console import OVERFLOW_JS
from tests.support.celery_capture import capture
from tests.support.control_plane import make_deployment, make_model

pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason=SKIP_REASON),
    pytest.mark.timeout(180),
]

USERNAME = "root"
PASSWORD = "browser-test-password"


def log_in(browser: BrowserSession, base: str) -> None:
    page = browser.page
    page.goto(f"{base}/admin/")
    page.fill("#id_username", USERNAME)
    page.fill("#id_password", PASSWORD)
    page.click("#login-form [type=submit]")
    page.wait_for_url(f"{base}/admin/")


def assert_fits(browser: BrowserSession, base: str, path: str) -> None:
    browser.page.goto(f"{base}{path}")
    overflow = browser.page.evaluate(OVERFLOW_JS)
    assert not overflow, f"{path} does not fit 1,400 px: {overflow}"


@pytest.fixture
def chat(settings: Any) -> Deployment:
    """A superuser (fast hasher) and a deployment with 1 prefill [1–3] and 1 decode [1–4], and a
    schedule rule holding decode at 1 for the hour around now."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    get_user_model().objects.create_superuser(USERNAME, "root@example.com", PASSWORD)
    deployment = make_deployment(name="chat", model=make_model(name="smollm2-135m"), prefill_max=3)
    now = timezone.now()
    ScalingRule.objects.create(
        deployment=deployment, name="night: decode = 1", kind="schedule", role="decode",
        start_time=schedules.local_time(now - timedelta(hours=1)),
        end_time=schedules.local_time(now + timedelta(hours=1)), target_replicas=1,
    )  # fmt: skip
    return deployment


def test_scale_from_the_deployment_page_and_see_the_event(
    browser: BrowserSession, live_server: Any, chat: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = browser.page
    base = live_server.url
    change_url = f"{base}/admin/inference/deployment/{chat.pk}/change/"
    controller = capture(monkeypatch, run_only=(jobs.SCALE_DEPLOYMENT,))

    with browser.step("scale-controls"):
        log_in(browser, base)
        page.goto(change_url)
        prefill = page.locator("#scale-prefill")
        assert " ".join(prefill.locator(".scale-state").inner_text().split()) == (
            "desired 1 · bounds [1–3] · 0 running")
        assert prefill.locator(".scale-override").count() == 0  # nothing holds prefill
        decode = page.locator("#scale-decode")
        assert "Schedule rule “night: decode = 1”" in decode.locator(".scale-held").inner_text()
        assert decode.locator(".scale-override").count() == 1

    with browser.step("scaled-prefill"):
        prefill.locator("input.scale-replicas").fill("2")
        prefill.locator("input.scale-reason").fill("launch day")
        with page.expect_navigation():
            prefill.locator("input.scale-submit").click()
        assert page.url.endswith(f"/{chat.pk}/change/#scale")
        message = page.locator(".messagelist").inner_text()
        assert "Chat: queued: prefill 1 → 2;" in message
        # The controller's task ran: the page shows the new count and the event in its recent events.
        assert "desired 2" in page.locator("#scale-prefill .scale-state").inner_text()
        events = page.locator("#scale_events-group tbody tr")
        newest = events.first.inner_text()
        assert "prefill" in newest and "applied" in newest and "Admin" in newest and "launch day" in newest
    assert [kw["replicas"] for kw, _ in controller.named("scale_deployment_task")] == [2]

    with browser.step("refused-placement"):
        # The controller could not place the second prefill worker: the event says so, in the inline and list.
        ScaleEvent.objects.create(
            deployment=chat, role="prefill", from_replicas=1, to_replicas=2, source="manual", refused=True,
            reason="placement refused: 1 prefill worker(s) not placed (1 of 2 running or starting); "
                   "nodes considered: local: no free CPUs (needs 1 contiguous, 0 of 2 free)",
        )  # fmt: skip
        page.goto(f"{base}/admin/inference/scaleevent/")
        rows = page.locator("#result_list tbody tr")
        assert rows.count() == 2
        assert rows.first.locator("td.field-outcome .event-refused").inner_text() == "refused"
        assert rows.nth(1).locator("td.field-outcome").inner_text() == "applied"
        # Times to the second: "2026-12-04 11:53:07".
        assert len(rows.first.locator("th.field-created_at, td.field-created_at").inner_text()) == 19

    with browser.step("decode-refused-by-the-rule"):
        page.goto(change_url)
        page.locator("#scale-decode input.scale-replicas").fill("3")
        with page.expect_navigation():
            page.locator("#scale-decode input.scale-submit").click()
        error = page.locator(".messagelist .error").inner_text()
        assert "schedule rule 'night: decode = 1'" in error and "a scale to 3 would be reverted" in error
        assert "give an override" in error

    with browser.step("decode-overridden"):
        decode = page.locator("#scale-decode")
        decode.locator("input.scale-replicas").fill("3")
        decode.locator("input.scale-reason").fill("launch")
        decode.locator("input.scale-minutes").fill("30")
        with page.expect_navigation():
            decode.locator("input.scale-submit").click()
        message = page.locator(".messagelist").inner_text()
        assert "queued: decode 1 → 3" in message and "Held against the scaling rules until" in message
        override = ScaleOverride.objects.get(deployment=chat)
        assert f"Override #{override.pk} holds decode at 3" in page.locator("#scale-decode .scale-held").inner_text()
    chat.refresh_from_db()
    assert (chat.prefill_replicas, chat.decode_replicas) == (2, 3)

    with browser.step("history"):
        page.goto(f"{base}/admin/inference/deployment/{chat.pk}/history/")
        history = page.locator("#change-history").inner_text()
        assert "queued: prefill 1 → 2" in history and "queued: decode 1 → 3" in history

    with browser.step("pages-fit"):
        for path in (f"/admin/inference/deployment/{chat.pk}/change/", "/admin/inference/scaleevent/",
                     f"/admin/inference/deployment/{chat.pk}/history/", "/admin/inference/scaleoverride/"):
            assert_fits(browser, base, path)
