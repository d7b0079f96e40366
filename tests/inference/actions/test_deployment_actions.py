"""inference.actions: scaling with clamping and events, deployment/rule saves, metric samples and pruning
(the metric series read back: tests/inference/selectors/test_metric_series.py)."""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
from datetime import timedelta
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.db import connection
from django.utils import timezone

from config.celery import app
from inference import jobs
from inference.actions import deployments as deployment_actions
from inference.actions import rules as rule_actions
from inference.actions import samples as sample_actions
from inference.actions import scale as scale_actions
from inference.models import Deployment, MetricSample, ScaleEvent, ScaleOverride, ScalingRule
from tests.support.celery_capture import SentTasks, capture, sent_tasks, tasks_run_inline  # noqa: F401  (fixtures)
from tests.support.control_plane import make_deployment, make_node, make_worker

pytestmark = pytest.mark.django_db


def reconciles(sent: SentTasks) -> list[dict[str, Any]]:
    """The reconcile_deployment messages recorded."""
    return [kwargs for kwargs, _ in sent.named("reconcile_deployment")]


# --------------------------------------------------------------------------- scale_deployment


def test_scale_within_bounds_saves_and_records_event() -> None:
    deployment = make_deployment(prefill_replicas=1, prefill_min=1, prefill_max=4)
    event = scale_actions.scale_deployment(deployment, "prefill", 3, source="manual", reason="more prompts")
    assert event is not None
    assert (event.role, event.from_replicas, event.to_replicas, event.source) == ("prefill", 1, 3, "manual")
    assert event.reason == "more prompts"
    assert event.rule is None
    assert deployment.prefill_replicas == 3  # the caller's instance follows
    assert Deployment.objects.get(pk=deployment.pk).prefill_replicas == 3
    assert ScaleEvent.objects.filter(deployment=deployment).count() == 1


def test_scale_above_max_is_clamped_and_says_so() -> None:
    deployment = make_deployment(decode_replicas=1, decode_min=1, decode_max=3)
    event = scale_actions.scale_deployment(deployment, "decode", 10, source="api", reason="burst")
    assert event is not None
    assert event.to_replicas == 3
    assert "clamped" in event.reason and "requested 10" in event.reason and "[1, 3]" in event.reason
    assert event.reason.startswith("burst")


def test_scale_below_min_is_clamped() -> None:
    deployment = make_deployment(prefill_replicas=3, prefill_min=2, prefill_max=4)
    event = scale_actions.scale_deployment(deployment, "prefill", 0, source="schedule", reason="night")
    assert event is not None
    assert (event.from_replicas, event.to_replicas) == (3, 2)
    assert "clamped to 2" in event.reason


def test_unchanged_count_records_nothing() -> None:
    deployment = make_deployment(decode_replicas=4, decode_max=4)
    assert scale_actions.scale_deployment(deployment, "decode", 4, source="manual", reason="same") is None
    # Clamped onto the current count: also no change.
    assert scale_actions.scale_deployment(deployment, "decode", 9, source="manual", reason="more") is None
    assert not ScaleEvent.objects.exists()


def test_scale_links_the_rule() -> None:
    deployment = make_deployment()
    rule = ScalingRule.objects.create(
        deployment=deployment, name="hot", kind="threshold", role="prefill", threshold=0.8
    )
    event = scale_actions.scale_deployment(deployment, "prefill", 2, source="threshold", reason="load 0.9", rule=rule)
    assert event is not None and event.rule == rule


@pytest.mark.parametrize(("role", "source"), [("embed", "manual"), ("prefill", "cron")])
def test_scale_rejects_unknown_role_or_source(role: str, source: str) -> None:
    deployment = make_deployment()
    with pytest.raises(ValueError):
        scale_actions.scale_deployment(deployment, role, 2, source=source, reason="x")
    assert not ScaleEvent.objects.exists()


def test_scale_by_reads_the_current_count_under_the_lock() -> None:
    deployment = make_deployment(decode_replicas=1)
    stale = Deployment.objects.get(pk=deployment.pk)
    scale_actions.scale_deployment(deployment, "decode", 2, source="manual", reason="first")
    event = scale_actions.scale_deployment_by(stale, "decode", +1, source="manual", reason="second")
    assert event is not None and (event.from_replicas, event.to_replicas) == (2, 3)


def test_reconcile_is_enqueued_on_commit(sent_tasks: SentTasks, django_capture_on_commit_callbacks: Any) -> None:  # noqa: F811
    deployment = make_deployment()
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        scale_actions.scale_deployment(deployment, "prefill", 2, source="manual", reason="x")
    assert reconciles(sent_tasks) == []  # not before the commit
    for callback in callbacks:
        callback()
    assert reconciles(sent_tasks) == [{"deployment_id": deployment.pk}]


def test_no_reconcile_when_nothing_changed(
    sent_tasks: SentTasks, django_capture_on_commit_callbacks: Any  # noqa: F811
) -> None:
    deployment = make_deployment(prefill_replicas=1)
    with django_capture_on_commit_callbacks(execute=True):
        scale_actions.scale_deployment(deployment, "prefill", 1, source="manual", reason="x")
    assert reconciles(sent_tasks) == []


def test_broker_outage_does_not_undo_the_scale(
    monkeypatch: pytest.MonkeyPatch, django_capture_on_commit_callbacks: Any, caplog: pytest.LogCaptureFixture
) -> None:
    def broker_down(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("broker down")

    monkeypatch.setattr(app, "send_task", broker_down)
    deployment = make_deployment()
    with django_capture_on_commit_callbacks(execute=True):
        event = scale_actions.scale_deployment(deployment, "prefill", 2, source="manual", reason="x")
    assert event is not None and Deployment.objects.get(pk=deployment.pk).prefill_replicas == 2
    assert "inference.tasks.reconcile_deployment not enqueued" in caplog.text and "broker down" in caplog.text


def test_actions_never_import_the_task_modules() -> None:
    """Tasks import actions, never the reverse: the actions enqueue by task name (inference.jobs)."""
    code = (
        "import sys, django; django.setup()\n"
        "import inference.actions.scale, inference.actions.deployments, inference.actions.workers\n"
        "import inference.actions.nodes, inference.actions.rules, inference.actions.samples\n"
        "loaded = [m for m in ('inference.tasks', 'inference.agent.tasks', 'inference.controller.reconciler') "
        "if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings"})  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_jobs_refuse_a_task_name_they_do_not_know() -> None:
    with pytest.raises(ValueError, match="unknown task 'inference.tasks.nope'"):
        jobs.send("inference.tasks.nope", deployment_id=1)


def test_reconcile_reaches_the_real_task(
    sent_tasks: SentTasks, django_capture_on_commit_callbacks: Any, settings: Any, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """The message is really sent (Redis), or recorded with the embedded broker."""
    deployment = make_deployment()
    if not settings.REDIS_URL:
        with django_capture_on_commit_callbacks(execute=True):
            scale_actions.scale_deployment(deployment, "decode", 2, source="manual", reason="x")
        assert reconciles(sent_tasks) == [{"deployment_id": deployment.pk}]
        return
    monkeypatch.undo()  # the real send_task
    import redis

    client = redis.Redis.from_url(settings.REDIS_URL)
    before = client.llen("control")
    with django_capture_on_commit_callbacks(execute=True):
        scale_actions.scale_deployment(deployment, "decode", 2, source="manual", reason="x")
    found: str | None = None
    for raw in client.lrange("control", 0, -1):
        message = json.loads(raw)
        if message["headers"]["task"] != "inference.tasks.reconcile_deployment":
            continue
        _, kwargs, _ = json.loads(base64.b64decode(message["body"]))
        if kwargs.get("deployment_id") == deployment.pk:
            found = raw.decode() if isinstance(raw, bytes) else str(raw)
    assert found is not None, f"no reconcile_deployment message in Redis list 'control' (had {before})"
    client.lrem("control", 1, found)


@pytest.mark.django_db(transaction=True)
def test_concurrent_scalers_both_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two admins pressing "+1" at once: the row lock makes it +2 with two events (PostgreSQL)."""
    if connection.vendor != "postgresql":
        pytest.skip("row locks (select_for_update) need PostgreSQL")
    # These transactions really commit: record the reconciles instead of sending them to the broker.
    sent = capture(monkeypatch, run_controller_tasks=False)
    from django.db import connections

    deployment = make_deployment(decode_replicas=1, decode_max=8)
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def bump() -> None:
        try:
            barrier.wait()
            scale_actions.scale_deployment_by(
                Deployment.objects.get(pk=deployment.pk), "decode", 1, source="manual", reason="race"
            )
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            connections.close_all()  # this thread's connections, else the test database cannot be dropped

    threads = [threading.Thread(target=bump) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert Deployment.objects.get(pk=deployment.pk).decode_replicas == 3
    assert sorted(ScaleEvent.objects.values_list("to_replicas", flat=True)) == [2, 3]
    assert reconciles(sent) == [{"deployment_id": deployment.pk}] * 2  # one per committed change


# --------------------------------------------------------------------------- deployments and rules


def test_save_deployment_records_creation_events(sent_tasks: SentTasks) -> None:  # noqa: F811
    from tests.support.control_plane import make_model

    deployment = Deployment(name="new", model=make_model(), prefill_replicas=2, decode_replicas=1)
    events = deployment_actions.save_deployment(deployment, source="api", reason="created by test")
    assert {(e.role, e.from_replicas, e.to_replicas) for e in events} == {("prefill", 0, 2), ("decode", 0, 1)}
    assert all(e.source == "api" and e.reason == "created by test" for e in events)


def test_save_deployment_keeps_a_concurrent_scale(sent_tasks: SentTasks) -> None:  # noqa: F811
    deployment = make_deployment(decode_replicas=1)
    form_copy = Deployment.objects.get(pk=deployment.pk)  # an admin page opened now
    scale_actions.scale_deployment(deployment, "decode", 3, source="threshold", reason="load")
    form_copy.batch_size = 64  # the admin only edits the batch size
    events = deployment_actions.save_deployment(form_copy, changed_fields=["batch_size"], reason="edit")
    fresh = Deployment.objects.get(pk=deployment.pk)
    assert (fresh.batch_size, fresh.decode_replicas) == (64, 3)
    assert events == []


def test_save_deployment_clamps_into_new_bounds(sent_tasks: SentTasks) -> None:  # noqa: F811
    deployment = make_deployment(prefill_replicas=4, prefill_max=4)
    deployment.prefill_max = 2
    events = deployment_actions.save_deployment(deployment, changed_fields=["prefill_max"], reason="smaller")
    assert len(events) == 1
    assert (events[0].from_replicas, events[0].to_replicas) == (4, 2)
    assert "clamped" in events[0].reason
    assert Deployment.objects.get(pk=deployment.pk).prefill_replicas == 2


def test_create_deployment_validates() -> None:
    from tests.support.control_plane import make_model

    with pytest.raises(ValidationError) as info:
        deployment_actions.create_deployment(name="bad", model=make_model(), decode_min=3, decode_max=2)
    assert "decode_min" in info.value.message_dict


def test_delete_deployment_refuses_live_workers() -> None:
    deployment = make_deployment()
    worker = make_worker(deployment, make_node())
    with pytest.raises(deployment_actions.DeploymentInUse):
        deployment_actions.delete_deployment(deployment)
    worker.status = "stopped"
    worker.save()
    deployment_actions.delete_deployment(deployment)
    assert not Deployment.objects.filter(pk=deployment.pk).exists()


def test_rule_condition_change_restarts_the_breach_timer() -> None:
    deployment = make_deployment()
    rule = ScalingRule.objects.create(
        deployment=deployment, name="hot", kind="threshold", role="decode", threshold=0.7,
        breach_started_at=timezone.now(),
    )  # fmt: skip
    rule_actions.update_rule(rule, {"cooldown_s": 10})
    rule.refresh_from_db()
    assert rule.breach_started_at is not None  # cooldown is not part of the condition
    rule_actions.update_rule(rule, {"threshold": 0.9})
    rule.refresh_from_db()
    assert rule.breach_started_at is None and rule.threshold == 0.9


def test_update_rule_runs_model_clean() -> None:
    deployment = make_deployment()
    rule = ScalingRule.objects.create(deployment=deployment, name="night", kind="threshold", role="decode", threshold=1)
    with pytest.raises(ValidationError) as info:
        rule_actions.update_rule(rule, {"kind": "schedule"})
    assert set(info.value.message_dict) == {"start_time", "end_time", "target_replicas"}


# --------------------------------------------------------------------------- metrics


def test_prune_metric_samples(settings: Any) -> None:
    deployment = make_deployment()
    now = timezone.now()
    sample_actions.record_metric_sample(deployment, "prefill", at=now - timedelta(hours=100))
    sample_actions.record_metric_sample(deployment, "prefill", at=now - timedelta(hours=10))
    sample_actions.record_metric_sample(deployment, "decode", at=now)
    assert sample_actions.prune_metric_samples(timedelta(hours=50)) == 1
    assert MetricSample.objects.count() == 2
    settings.METRICS_RETENTION_HOURS = 5
    assert sample_actions.prune_metric_samples() == 1
    assert MetricSample.objects.count() == 1


def test_record_metric_sample_validates_role() -> None:
    deployment = make_deployment()
    with pytest.raises(ValueError):
        sample_actions.record_metric_sample(deployment, "neither")
    sample = sample_actions.record_metric_sample(deployment.pk, "decode", load=0.5)
    assert sample.deployment_id == deployment.pk and sample.at is not None


# --------------------------------------------------------------------------- manual scales vs schedule rules


def _schedule(deployment: Deployment, *, target: int = 1, name: str = "night") -> ScalingRule:
    """A decode schedule rule whose window is the hour around now (platform time zone)."""
    from inference.selectors.schedules import local_time

    now = timezone.now()
    return ScalingRule.objects.create(
        deployment=deployment, name=name, kind="schedule", role="decode", target_replicas=target,
        start_time=local_time(now - timedelta(hours=1)), end_time=local_time(now + timedelta(hours=1)),
    )  # fmt: skip


def test_manual_scale_is_refused_inside_a_schedule_window(tasks_run_inline: SentTasks) -> None:  # noqa: F811
    deployment = make_deployment(decode_replicas=1, decode_max=4)
    _schedule(deployment)
    with pytest.raises(scale_actions.ScheduleConflict) as refused:
        scale_actions.request_manual_scale(deployment, "decode", delta=+1, source="manual", actor="ops", reason="more")
    assert refused.value.rule.name == "night" and (refused.value.requested, refused.value.held) == (2, 1)
    assert "'night'" in str(refused.value) and "override" in str(refused.value)
    assert Deployment.objects.get(pk=deployment.pk).decode_replicas == 1
    assert not ScaleEvent.objects.exists() and tasks_run_inline.calls == []  # refused: nothing queued
    # A disabled rule holds nothing; the prefill role was never held.
    ScalingRule.objects.update(enabled=False)
    queued = scale_actions.request_manual_scale(
        deployment, "decode", delta=+1, source="manual", actor="ops", reason="more"
    )
    assert (queued.current, queued.target, queued.changes) == (1, 2, True)
    assert Deployment.objects.get(pk=deployment.pk).decode_replicas == 2  # the controller's task applied it


def test_a_count_the_bounds_clamp_to_the_rules_target_is_no_conflict() -> None:
    deployment = make_deployment(decode_replicas=2, decode_min=2, decode_max=4)
    _schedule(deployment, target=1)  # clamped to 2 by decode_min: the rule holds 2
    assert scale_actions.plan_manual_scale(deployment, "decode", 0, source="api", actor="ops") is None  # clamps to 2
    with pytest.raises(scale_actions.ScheduleConflict):
        scale_actions.plan_manual_scale(deployment, "decode", 3, source="api", actor="ops")


def test_manual_scale_with_an_override_records_it_in_the_event(tasks_run_inline: SentTasks) -> None:  # noqa: F811
    deployment = make_deployment(decode_replicas=1, decode_max=4)
    rule = _schedule(deployment)
    until = timezone.now() + timedelta(minutes=20)
    scale_actions.request_manual_scale(deployment, "decode", delta=+2, source="manual", actor="ops", reason="launch",
                                       override_until=until)  # fmt: skip
    event = ScaleEvent.objects.get()
    assert (event.from_replicas, event.to_replicas) == (1, 3)
    override = ScaleOverride.objects.get()
    assert (override.replicas, override.rule, override.created_by, override.ends_at) == (3, rule, "ops", until)
    assert f"override #{override.pk} of schedule rule 'night'" in event.reason
    with pytest.raises(ValueError, match="future"):
        scale_actions.plan_manual_scale(deployment, "decode", 2, source="api", actor="ops",
                                  override_until=timezone.now() - timedelta(seconds=1))  # fmt: skip


def test_the_admin_scale_action_shows_the_rule_that_refuses_it() -> None:
    from django.contrib.auth import get_user_model
    from django.test import Client
    from django.urls import reverse

    client = Client()
    client.force_login(get_user_model().objects.create_superuser("root", "root@example.com", None))
    deployment = make_deployment(decode_replicas=1, decode_max=4)
    _schedule(deployment)
    response = client.post(
        reverse("admin:inference_deployment_changelist"),
        {"action": "scale_decode_up", "_selected_action": [deployment.pk]},
        follow=True,
    )
    page = response.content.decode()
    assert response.status_code == 200 and "schedule rule &#x27;night&#x27;" in page and "override_until" in page
    assert Deployment.objects.get(pk=deployment.pk).decode_replicas == 1
    assert not ScaleEvent.objects.exists()
