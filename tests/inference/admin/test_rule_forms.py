"""Scaling rules in the admin: one form per kind with only its fields, help text and units (latencies in ms),
the rule in words naming its signal, "active now" on schedule rules, and the internal state read-only."""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from inference.models import Deployment, ScalingRule
from inference.selectors import rules as rule_selectors
from inference.selectors import schedules
from tests.support.control_plane import make_deployment

pytestmark = pytest.mark.django_db

ADD = "admin:inference_scalingrule_add"
# Input names each kind's form has, and those it must not have.
FIELDS = {
    "threshold": ({"name", "role", "comparison", "threshold", "duration_s", "cooldown_s", "step"},
                  {"kind", "target_ms", "start_time", "end_time", "target_replicas", "observations"}),
    "slo": ({"name", "kind", "target_ms", "duration_s", "cooldown_s", "step"},
            {"role", "comparison", "threshold", "start_time", "end_time", "target_replicas", "observations"}),
    "schedule": ({"name", "role", "start_time", "end_time", "target_replicas"},
                 {"kind", "comparison", "threshold", "duration_s", "cooldown_s", "step", "target_ms", "observations"}),
}  # fmt: skip


@pytest.fixture
def chat() -> Deployment:
    return make_deployment(name="chat")


def _inputs(html: str, names: set[str]) -> set[str]:
    return {name for name in names if f'name="{name}"' in html}


def test_adding_starts_with_the_kind(client_root: Client, chat: Deployment) -> None:
    page = client_root.get(reverse(ADD), {"deployment": chat.pk}).content.decode()
    for kind in ("threshold", "slo", "schedule"):
        assert f"?deployment={chat.pk}&amp;kind={kind}" in page
    assert 'name="threshold"' not in page


@pytest.mark.parametrize("kind", list(FIELDS))
def test_each_kind_shows_only_its_fields(client_root: Client, chat: Deployment, kind: str) -> None:
    page = client_root.get(reverse(ADD), {"deployment": chat.pk, "kind": kind}).content.decode()
    wanted, unwanted = FIELDS[kind]
    assert _inputs(page, wanted) == wanted
    assert _inputs(page, unwanted) == set()
    assert "Window (s)" in page or kind == "schedule"


def test_units_and_time_zone_in_the_labels(client_root: Client, chat: Deployment, settings: object) -> None:
    slo = client_root.get(reverse(ADD), {"kind": "slo"}).content.decode()
    assert "P90 target (ms)" in slo and "TTFT p90 (time to first token): adds prefill workers" in slo
    schedule = client_root.get(reverse(ADD), {"kind": "schedule"}).content.decode()
    assert "Start (UTC)" in schedule and "End (UTC)" in schedule
    threshold = client_root.get(reverse(ADD), {"kind": "threshold"}).content.decode()
    assert "Load threshold (ratio 0–1)" in threshold and "batch size" in threshold  # the signal explained


@pytest.mark.parametrize(("kind", "target_ms", "stored", "role"), [("ttft_slo", 2000, 2.0, "prefill"),
                                                                   ("itl_slo", 50, 50.0, "decode")])
def test_slo_target_in_ms_for_both_latencies(
    client_root: Client, chat: Deployment, kind: str, target_ms: float, stored: float, role: str
) -> None:
    response = client_root.post(
        reverse(ADD) + "?kind=slo",
        {"deployment": chat.pk, "name": kind, "kind": kind, "target_ms": target_ms, "enabled": "on",
         "duration_s": 60, "cooldown_s": 300, "step": 1},
    )  # fmt: skip
    assert response.status_code == 302, response.content.decode()[:2000]
    rule = ScalingRule.objects.get(name=kind)
    assert (rule.kind, rule.role, rule.comparison, rule.threshold) == (kind, role, "above", stored)
    page = client_root.get(reverse("admin:inference_scalingrule_change", args=[rule.pk])).content.decode()
    assert f'name="target_ms" value="{target_ms:g}' in page or f'value="{float(target_ms)}"' in page
    assert f"≤ {target_ms} ms" in rule_selectors.describe(rule)


def test_slo_step_must_add(client_root: Client, chat: Deployment) -> None:
    response = client_root.post(
        reverse(ADD) + "?kind=slo",
        {"deployment": chat.pk, "name": "x", "kind": "itl_slo", "target_ms": 50, "duration_s": 60,
         "cooldown_s": 300, "step": -1},
    )  # fmt: skip
    assert response.status_code == 200 and "greater than or equal to 1" in response.content.decode()


def test_schedule_needs_its_window(client_root: Client, chat: Deployment) -> None:
    data = {"deployment": chat.pk, "name": "night", "role": "decode", "enabled": "on", "start_time": "22:00",
            "target_replicas": 1}
    missing = client_root.post(reverse(ADD) + "?kind=schedule", data)
    assert missing.status_code == 200 and "This field is required" in missing.content.decode()
    saved = client_root.post(reverse(ADD) + "?kind=schedule", {**data, "end_time": "07:00"})
    assert saved.status_code == 302
    rule = ScalingRule.objects.get(name="night")
    assert (rule.kind, str(rule.start_time), str(rule.end_time), rule.step) == ("schedule", "22:00:00", "07:00:00", 1)


def test_threshold_edit_restarts_the_window_and_state_is_read_only(client_root: Client, chat: Deployment) -> None:
    now = time.time()
    rule = ScalingRule.objects.create(
        deployment=chat, name="hot", kind="threshold", role="decode", threshold=0.7, breach_started_at=timezone.now(),
        observations=[[now - 20, 0.75], [now - 10, None], [now, 0.9]],
    )  # fmt: skip
    url = reverse("admin:inference_scalingrule_change", args=[rule.pk])
    page = client_root.get(url).content.decode()
    assert 'name="observations"' not in page and 'name="breach_started_at"' not in page
    assert "rule-window" in page and "0.90" in page and "no worker reported" in page and "breaches" in page
    assert "decode load above 0.70 for 1 min → +1 decode (cooldown 5 min)" in page
    assert "breaching" in page
    saved = client_root.post(url, {"deployment": chat.pk, "name": "hot", "role": "decode", "enabled": "on",
                                   "comparison": "above", "threshold": "0.85", "duration_s": 60, "cooldown_s": 300,
                                   "step": 1})  # fmt: skip
    assert saved.status_code == 302
    rule.refresh_from_db()
    assert rule.threshold == 0.85 and rule.breach_started_at is None and rule.observations == []
    zero = client_root.post(url, {"deployment": chat.pk, "name": "hot", "role": "decode", "comparison": "above",
                                  "threshold": "0.85", "duration_s": 60, "cooldown_s": 300, "step": 0})
    assert zero.status_code == 200 and "step must not be 0" in zero.content.decode()


def test_schedule_rule_says_active_now_with_its_time_zone(client_root: Client, chat: Deployment) -> None:
    now = timezone.now()
    rule = ScalingRule.objects.create(
        deployment=chat, name="now", kind="schedule", role="decode", target_replicas=1,
        start_time=schedules.local_time(now - timedelta(hours=1)),
        end_time=schedules.local_time(now + timedelta(hours=1)),
    )  # fmt: skip
    assert rule_selectors.describe(rule).endswith("(UTC): decode = 1 · active now")
    listing = client_root.get(reverse("admin:inference_scalingrule_changelist")).content.decode()
    assert "active now" in listing
    deployment_page = client_root.get(reverse("admin:inference_deployment_change", args=[chat.pk])).content.decode()
    assert "active now" in deployment_page and 'name="rules-0-start_time"' not in deployment_page
    assert f"?deployment={chat.pk}&amp;kind=schedule" in deployment_page  # the add links under the rules
