"""Scaling rule forms in a real browser: from the deployment page, add one rule of each kind with the form of
its kind (only its fields, units in the labels, the time zone beside schedule times), see them in words on the
deployment page ("active now" on the schedule rule), read a rule's window of readings as a table, and the rule
pages fit 1,400 px.

As in test_admin_console.py: pytest-django's live server on the test database, Debian's headless Chromium
through playwright-python.
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from inference.models import Deployment, ScalingRule
from inference.selectors import schedules
from tests.browser.conftest import CHROMIUM, SKIP_REASON, BrowserSession
from tests.browser.test_scale_controls import PASSWORD, USERNAME, assert_fits, log_in
from tests.support.control_plane import make_deployment, make_model

pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason=SKIP_REASON),
    pytest.mark.timeout(180),
]

# The inputs a rule form may have; each kind shows only its own (visible inputs, by name).
ALL_FIELDS = {"name", "role", "kind", "enabled", "comparison", "threshold", "target_ms", "duration_s", "cooldown_s",
              "step", "start_time", "end_time", "target_replicas", "observations", "breach_started_at"}  # fmt: skip
KIND_FIELDS = {
    "threshold": {"name", "role", "enabled", "comparison", "threshold", "duration_s", "cooldown_s", "step"},
    "slo": {"name", "kind", "enabled", "target_ms", "duration_s", "cooldown_s", "step"},
    "schedule": {"name", "role", "enabled", "start_time", "end_time", "target_replicas"},
}
VISIBLE_INPUTS_JS = """(names) => names.filter((n) => {
  const el = document.querySelector(`#scalingrule_form [name="${n}"]`);
  return el && el.type !== 'hidden' && el.offsetParent !== null;
})"""


@pytest.fixture
def chat(settings: Any) -> Deployment:
    """A superuser (fast hasher) and a deployment without rules."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    get_user_model().objects.create_superuser(USERNAME, "root@example.com", PASSWORD)
    return make_deployment(name="chat", model=make_model(name="smollm2-135m"))


def test_each_rule_kind_has_its_own_form(browser: BrowserSession, live_server: Any, chat: Deployment) -> None:
    page = browser.page
    base = live_server.url
    change_url = f"{base}/admin/inference/deployment/{chat.pk}/change/"
    now = timezone.now()
    start, end = schedules.local_time(now - timedelta(hours=1)), schedules.local_time(now + timedelta(hours=1))
    filled = {
        "threshold": {"name": "decode-hot", "threshold": "0.8"},
        "slo": {"name": "ttft-2s", "target_ms": "2000"},
        "schedule": {"name": "now", "start_time": f"{start:%H:%M}", "end_time": f"{end:%H:%M}", "target_replicas": "1"},
    }

    log_in(browser, base)
    for kind, values in filled.items():
        with browser.step(f"add-{kind}"):
            page.goto(change_url)
            page.locator(f".rule-add a[href$='kind={kind}']").click()
            page.wait_for_selector("#scalingrule_form")
            assert set(page.evaluate(VISIBLE_INPUTS_JS, sorted(ALL_FIELDS))) == KIND_FIELDS[kind]
            assert page.input_value("select[name=deployment]") == str(chat.pk)  # from the deployment page's link
            labels = page.locator("#scalingrule_form").inner_text()
            if kind == "slo":
                assert "P90 target (ms)" in labels
                page.select_option("select[name=kind]", "ttft_slo")
            if kind == "schedule":
                assert "Start (UTC)" in labels and "End (UTC)" in labels
            if kind != "slo":  # an SLO rule's role follows from its latency
                page.select_option("select[name=role]", "decode")
            for name, value in values.items():
                page.fill(f"[name={name}]", value)
            page.click("input[name=_save]")
            page.wait_for_url(f"{base}/admin/inference/scalingrule/")
            assert "was added successfully" in page.locator(".messagelist").inner_text()

    ttft = ScalingRule.objects.get(name="ttft-2s")
    assert (ttft.kind, ttft.role, ttft.threshold) == ("ttft_slo", "prefill", 2.0)  # stored in s, entered in ms

    with browser.step("rules-in-words"):
        page.goto(change_url)
        rows = {r.name: page.locator("#rules-group tbody tr", has_text=r.name).inner_text()
                for r in ScalingRule.objects.filter(deployment=chat)}  # fmt: skip
        assert "decode load above 0.80 for 1 min" in rows["decode-hot"]
        assert "TTFT p90 (decode workers) ≤ 2000 ms, else +1 prefill" in rows["ttft-2s"]
        assert "(UTC): decode = 1 · active now" in rows["now"]

    with browser.step("rule-window"):
        hot = ScalingRule.objects.get(name="decode-hot")
        at = time.time()
        ScalingRule.objects.filter(pk=hot.pk).update(observations=[[at - 10, 0.5], [at - 5, None], [at, 0.92]])
        page.goto(f"{base}/admin/inference/scalingrule/{hot.pk}/change/")
        table = page.locator("table.rule-window")
        assert table.locator("tr.breaching").count() == 1
        assert "0.92" in table.locator("tr").nth(1).inner_text()  # newest first
        assert "no worker reported" in table.inner_text()
        assert page.locator("[name=observations]").count() == 0  # internal state is not a form field

    with browser.step("rule-pages-fit"):
        for rule in ScalingRule.objects.filter(deployment=chat):
            assert_fits(browser, base, f"/admin/inference/scalingrule/{rule.pk}/change/")
        assert_fits(browser, base, "/admin/inference/scalingrule/")
        assert_fits(browser, base, f"/admin/inference/deployment/{chat.pk}/change/")
