"""inference.scaling: load, threshold rules (duration, cooldown, min/max), schedule rules (midnight wrap)."""
from __future__ import annotations

from datetime import datetime, time, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.test import override_settings
from django.utils import timezone

from inference.actions import scale as scale_actions
from inference.models import Deployment, ScaleEvent, ScalingRule, Worker
from inference.scaling import rules as scaling_rules
from inference.scaling import signals as scaling_signals
from inference.selectors import schedules
from tests.support.celery_capture import SentTasks, sent_tasks  # noqa: F401  (fixture)
from tests.support.control_plane import make_deployment, make_node, make_worker

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 3, 10, 12, 0, 0, tzinfo=ZoneInfo("UTC"))


def set_load(deployment: Deployment, role: str, per_worker: list[tuple[int, int]], at: datetime) -> None:
    """Replace the role's RUNNING workers by ones reporting (running, queue_depth), seen at `at`."""
    Worker.objects.filter(deployment=deployment, role=role).delete()
    node = make_node()
    for running, queued in per_worker:
        make_worker(deployment, node, role=role, status="running", last_seen=at,
                    last_health={"status": "healthy", "running": running, "queue_depth": queued})


def threshold_rule(deployment: Deployment, **fields: object) -> ScalingRule:
    defaults: dict[str, object] = {"name": "busy prefill", "kind": "threshold", "role": "prefill",
                                   "threshold": 0.8, "comparison": "above", "duration_s": 30,
                                   "cooldown_s": 120, "step": 1}
    defaults.update(fields)
    return ScalingRule.objects.create(deployment=deployment, **defaults)


def events(deployment: Deployment) -> list[ScaleEvent]:
    return list(ScaleEvent.objects.filter(deployment=deployment).order_by("created_at", "pk"))


def test_load_is_the_mean_capped_batch_fill_of_recent_running_workers() -> None:
    dep = make_deployment(batch_size=4)
    set_load(dep, "decode", [(2, 0), (4, 8)], T0)  # 0.5 and 3.0 → capped at 1.0
    assert scaling_signals.role_load(dep, "decode", now=T0) == pytest.approx(0.75)
    assert scaling_signals.role_load(dep, "decode", now=T0 + timedelta(minutes=5)) is None  # stale reports ignored
    assert scaling_signals.role_load(dep, "prefill", now=T0) is None  # no running worker
    Worker.objects.filter(deployment=dep).update(status="unhealthy")
    assert scaling_signals.role_load(dep, "decode", now=T0) is None
    assert scaling_signals.worker_load({"running": 1, "queue_depth": 1}, 8) == 0.25
    assert scaling_signals.worker_load({"running": "?"}, 8) is None


def test_prefill_load_reads_busy_time_and_the_queued_prompt_tokens() -> None:
    """A prefill worker whose batch is empty at the sample can still be loaded: busy or with a queue."""
    idle = {"running": 0, "queue_depth": 0, "batch_size": 8}
    assert scaling_signals.worker_load(idle, 8, "prefill") == 0.0
    assert scaling_signals.worker_load({**idle, "busy_ratio": 0.9}, 8, "prefill") == pytest.approx(0.9)
    # 1200 prompt tokens queued at 2000 tokens/s: a new prompt waits 0.6 s of the 1 s target.
    queued = {**idle, "busy_ratio": 0.1, "prompt_tokens_pending": 1200, "prefill_tokens_per_s": 2000.0}
    assert scaling_signals.worker_load(queued, 8, "prefill") == pytest.approx(0.6)
    with override_settings(SCALING_PREFILL_WAIT_TARGET_S=0.3):
        assert scaling_signals.worker_load(queued, 8, "prefill") == 1.0  # capped
    # Decode ignores the prefill readings; the worker's own batch size wins over the deployment's.
    assert scaling_signals.worker_load({**queued, "running": 2}, 16, "decode") == pytest.approx(0.25)


def readings_every_10s(dep: Deployment, role: str, loads: list[tuple[int, int] | None],
                       start: datetime = T0) -> list[list[ScaleEvent]]:
    """Evaluate the rules every 10 s with the role's single worker reporting (running, queue_depth) each
    time (None: no fresh report); returns the events of each evaluation."""
    fired = []
    for i, load in enumerate(loads):
        at = start + timedelta(seconds=10 * i)
        if load is None:
            Worker.objects.filter(deployment=dep, role=role).update(last_seen=at - timedelta(minutes=5))
        else:
            set_load(dep, role, [load], at)
        fired.append(scaling_rules.evaluate_all(now=at))
    return fired


def test_threshold_needs_a_full_window_then_cools_down(sent_tasks: SentTasks) -> None:  # noqa: F811
    dep = make_deployment(prefill_replicas=1, prefill_min=1, prefill_max=3, batch_size=4)
    rule = threshold_rule(dep)  # 0.8 for 30 s, cooldown 120 s
    fired = readings_every_10s(dep, "prefill", [(4, 0)] * 4)  # load 1.0 at 0, 10, 20, 30 s
    assert fired[:3] == [[], [], []]
    rule.refresh_from_db()
    assert rule.last_triggered_at == T0 + timedelta(seconds=30) and rule.breach_started_at is None
    [event] = fired[3]
    assert (event.role, event.from_replicas, event.to_replicas, event.source) == ("prefill", 1, 2, "threshold")
    assert event.rule_id == rule.pk
    assert "busy prefill" in event.reason and "load 1.00 above 0.8 over 30s" in event.reason
    assert "4 of 4 readings" in event.reason

    # Still busy: a fresh 30 s window after the change, and the 120 s cooldown, before the next step.
    later = readings_every_10s(dep, "prefill", [(4, 0)] * 12, start=T0 + timedelta(seconds=40))
    assert [len(e) for e in later] == [0] * 11 + [1]  # at 150 s: cooldown over, window full
    assert (later[-1][0].from_replicas, later[-1][0].to_replicas) == (2, 3)

    # At the maximum nothing changes and no event is recorded.
    assert readings_every_10s(dep, "prefill", [(4, 0)] * 30, start=T0 + timedelta(seconds=160)) == [[]] * 30
    dep.refresh_from_db()
    assert dep.prefill_replicas == 3 and len(events(dep)) == 2
    assert [kw for kw, _ in sent_tasks.named("reconcile_deployment")] == []  # on commit only: not in this txn


def test_a_zero_and_a_missing_reading_do_not_reset_a_sustained_breach() -> None:
    """The issue's overload: decode load read 0.00 in the middle of the burst (and a report came late).
    Both are tolerated within the share; a breach timer would have restarted at each."""
    dep = make_deployment(decode_replicas=1, batch_size=10)
    rule = threshold_rule(dep, name="busy decode", role="decode", threshold=0.7, duration_s=90)
    loads: list[tuple[int, int] | None] = [(9, 0), (10, 3), (9, 1), (0, 0), (10, 0), None, (9, 2), (10, 0),
                                           (9, 0), (10, 5)]  # 0..90 s: 8 of 10 readings above 0.7
    fired = readings_every_10s(dep, "decode", loads)
    assert [len(e) for e in fired] == [0] * 9 + [1]
    assert "8 of 10 readings" in fired[-1][0].reason
    rule.refresh_from_db()
    assert rule.last_triggered_at == T0 + timedelta(seconds=90)


def test_a_real_dip_prevents_firing_and_a_short_window_waits() -> None:
    dep = make_deployment(decode_replicas=1, batch_size=10)
    rule = threshold_rule(dep, name="busy decode", role="decode", threshold=0.7, duration_s=30)
    fired = readings_every_10s(dep, "decode", [(9, 0), (5, 0), (5, 0), (9, 0)])  # half the window under
    assert fired == [[], [], [], []]
    rule.refresh_from_db()
    assert rule.breach_started_at is None and len(rule.observations) == 4
    # A window missing its first readings (evaluations stopped) is not full yet.
    ScalingRule.objects.filter(pk=rule.pk).update(observations=[])
    late = readings_every_10s(dep, "decode", [(9, 0), (9, 0)], start=T0 + timedelta(seconds=100))
    assert late == [[], []]
    rule.refresh_from_db()
    assert rule.breach_started_at == T0 + timedelta(seconds=100)  # breaching, window not yet covered


def test_scale_in_rules_judge_the_window_the_same_way() -> None:
    """A busy moment inside an idle window is tolerated as one dissent, but a scale-in rule does not
    fire while the load is still on (the issue's scale-in rule started its breach during the load)."""
    dep = make_deployment(decode_replicas=2, decode_min=1, decode_max=4, batch_size=10)
    threshold_rule(dep, name="idle decode", role="decode", threshold=0.2, comparison="below", step=-1,
                   duration_s=40, cooldown_s=0)
    busy_then_idle: list[tuple[int, int] | None] = [(9, 0), (8, 0), (0, 0), (9, 0), (9, 0), (9, 0)]
    assert [len(e) for e in readings_every_10s(dep, "decode", busy_then_idle)] == [0] * 6
    idle: list[tuple[int, int] | None] = [(1, 0), (0, 0), (10, 0), (0, 0), (1, 0)]  # 1 busy reading of 5
    fired = readings_every_10s(dep, "decode", idle, start=T0 + timedelta(seconds=60))
    assert [len(e) for e in fired] == [0, 0, 0, 0, 1]
    event = fired[-1][0]
    assert (event.from_replicas, event.to_replicas) == (2, 1) and "below 0.2" in event.reason
    # At the minimum nothing more changes.
    assert readings_every_10s(dep, "decode", [(0, 0)] * 6, start=T0 + timedelta(seconds=110)) == [[]] * 6
    dep.refresh_from_db()
    assert dep.decode_replicas == 1


def test_a_change_by_another_scaler_restarts_the_window(sent_tasks: SentTasks) -> None:  # noqa: F811

    dep = make_deployment(decode_replicas=1, decode_max=4, batch_size=10)
    threshold_rule(dep, name="busy decode", role="decode", threshold=0.7, duration_s=30)
    start = timezone.now() - timedelta(seconds=40)
    assert readings_every_10s(dep, "decode", [(9, 0)] * 3, start=start) == [[], [], []]
    scale_actions.scale_deployment(dep, "decode", 2, source="api", reason="operator")  # created_at: now
    fired = readings_every_10s(dep, "decode", [(9, 0)] * 5, start=timezone.now() + timedelta(seconds=1))
    assert [len(e) for e in fired] == [0, 0, 0, 1, 0]  # a fresh 30 s window after the API scale


@pytest.mark.parametrize(
    ("start", "end", "at", "inside"),
    [
        (time(22), time(7), time(23, 30), True),
        (time(22), time(7), time(0, 0), True),
        (time(22), time(7), time(6, 59, 59), True),
        (time(22), time(7), time(7, 0), False),  # end is exclusive
        (time(22), time(7), time(21, 59), False),
        (time(22), time(7), time(22, 0), True),
        (time(7), time(22), time(12), True),
        (time(7), time(22), time(23), False),
        (time(8), time(8), time(8), False),  # empty window
    ],
)
def test_window(start: time, end: time, at: time, inside: bool) -> None:
    assert schedules.in_window(start, end, at) is inside


def night_and_day(dep: Deployment) -> tuple[ScalingRule, ScalingRule]:
    night = ScalingRule.objects.create(deployment=dep, name="night", kind="schedule", role="decode",
                                       start_time=time(22), end_time=time(7), target_replicas=1)
    day = ScalingRule.objects.create(deployment=dep, name="day", kind="schedule", role="decode",
                                     start_time=time(7), end_time=time(22), target_replicas=3)
    return night, day


@override_settings(TIME_ZONE="Asia/Shanghai")
def test_schedule_wraps_midnight_in_the_platform_time_zone() -> None:
    dep = make_deployment(decode_replicas=3, decode_min=1, decode_max=4)
    night = ScalingRule.objects.create(deployment=dep, name="night", kind="schedule", role="decode",
                                       start_time=time(22), end_time=time(7), target_replicas=1)
    shanghai = ZoneInfo("Asia/Shanghai")
    # 21:30 local: not yet.
    assert scaling_rules.evaluate_all(now=datetime(2026, 3, 10, 21, 30, tzinfo=shanghai)) == []
    # 23:00 local = 15:00 UTC: the night window holds decode at 1.
    [event] = scaling_rules.evaluate_all(now=datetime(2026, 3, 10, 15, 0, tzinfo=ZoneInfo("UTC")))
    assert (event.role, event.from_replicas, event.to_replicas, event.source) == ("decode", 3, 1, "schedule")
    assert event.rule_id == night.pk and "night" in event.reason and "22:00–07:00" in event.reason
    # 02:00 next day, still inside: nothing to do, no event.
    assert scaling_rules.evaluate_all(now=datetime(2026, 3, 11, 2, 0, tzinfo=shanghai)) == []
    # Someone scales up by hand during the night: the schedule holds its value.
    Deployment.objects.filter(pk=dep.pk).update(decode_replicas=2)
    [held] = scaling_rules.evaluate_all(now=datetime(2026, 3, 11, 3, 0, tzinfo=shanghai))
    assert (held.from_replicas, held.to_replicas) == (2, 1)
    # 07:00: the window ended and nothing is restored without a day rule.
    assert scaling_rules.evaluate_all(now=datetime(2026, 3, 11, 7, 0, tzinfo=shanghai)) == []
    dep.refresh_from_db()
    assert dep.decode_replicas == 1


def test_a_day_rule_sets_the_day_value_back() -> None:
    dep = make_deployment(decode_replicas=3, decode_min=1, decode_max=4)
    night, day = night_and_day(dep)
    utc = ZoneInfo("UTC")
    [down] = scaling_rules.evaluate_all(now=datetime(2026, 3, 10, 22, 0, tzinfo=utc))
    [up] = scaling_rules.evaluate_all(now=datetime(2026, 3, 11, 7, 0, tzinfo=utc))
    assert (down.to_replicas, down.rule_id) == (1, night.pk)
    assert (up.from_replicas, up.to_replicas, up.rule_id) == (1, 3, day.pk)
    assert [e.source for e in events(dep)] == ["schedule", "schedule"]
    assert all(e.reason for e in events(dep))


def test_schedule_target_is_clamped_and_pauses_threshold_rules() -> None:
    dep = make_deployment(decode_replicas=3, decode_min=2, decode_max=4, batch_size=4)
    ScalingRule.objects.create(deployment=dep, name="night", kind="schedule", role="decode",
                               start_time=time(22), end_time=time(7), target_replicas=1)
    busy = threshold_rule(dep, name="busy decode", role="decode", threshold=0.7, duration_s=0, cooldown_s=0)
    night = datetime(2026, 3, 10, 23, 0, tzinfo=ZoneInfo("UTC"))
    set_load(dep, "decode", [(4, 4)], night)
    [event] = scaling_rules.evaluate_all(now=night)
    assert (event.from_replicas, event.to_replicas) == (3, 2)  # min 2 wins over the target 1
    assert "clamped" in event.reason
    # Busy at night: the threshold rule is paused while the schedule holds decode.
    assert scaling_rules.evaluate_all(now=night + timedelta(seconds=10)) == []
    busy.refresh_from_db()
    assert busy.breach_started_at is None
    # In the day the threshold rule works again.
    day = datetime(2026, 3, 11, 12, 0, tzinfo=ZoneInfo("UTC"))
    set_load(dep, "decode", [(4, 4)], day)
    [up] = scaling_rules.evaluate_all(now=day)
    assert (up.source, up.from_replicas, up.to_replicas) == ("threshold", 2, 3)


def test_disabled_rules_and_stopped_deployments_are_skipped() -> None:
    dep = make_deployment(decode_replicas=3)
    night, _ = night_and_day(dep)
    ScalingRule.objects.filter(pk=night.pk).update(enabled=False)
    assert scaling_rules.evaluate_all(now=datetime(2026, 3, 10, 23, 0, tzinfo=ZoneInfo("UTC"))) == []
    ScalingRule.objects.filter(pk=night.pk).update(enabled=True)
    Deployment.objects.filter(pk=dep.pk).update(status="stopped")
    assert scaling_rules.evaluate_all(now=datetime(2026, 3, 10, 23, 0, tzinfo=ZoneInfo("UTC"))) == []


def test_an_override_holds_its_count_and_pauses_the_roles_rules() -> None:
    """While an override lasts, neither the schedule nor a breached threshold rule moves the role;
    a count moved by something else is set back to the override's, with the override in the reason."""
    from inference.models import ScaleOverride

    dep = make_deployment(decode_replicas=3, decode_max=5, batch_size=4)
    night = ScalingRule.objects.create(deployment=dep, name="night", kind="schedule", role="decode",
                                       start_time=time(11, 0), end_time=time(13, 0), target_replicas=1)
    busy = threshold_rule(dep, name="busy decode", role="decode", duration_s=0, cooldown_s=0)
    set_load(dep, "decode", [(4, 0)], T0)
    override = ScaleOverride.objects.create(deployment=dep, role="decode", replicas=3, rule=night,
                                            ends_at=T0 + timedelta(minutes=10), source="api", created_by="ops")
    with override_settings(TIME_ZONE="UTC"):
        assert scaling_rules.evaluate_all(now=T0) == []
        busy.refresh_from_db()
        assert busy.breach_started_at is None  # paused, not counting
        Deployment.objects.filter(pk=dep.pk).update(decode_replicas=2)  # e.g. an edit in the admin form
        [held] = scaling_rules.evaluate_all(now=T0 + timedelta(minutes=1))
        assert (held.from_replicas, held.to_replicas, held.source) == (2, 3, "api")
        assert f"override #{override.pk} by ops" in held.reason and "'night'" in held.reason
        [after] = scaling_rules.evaluate_all(now=T0 + timedelta(minutes=10))  # ended: the schedule is back
        assert (after.to_replicas, after.rule_id) == (1, night.pk)


def set_latency(dep: Deployment, at: datetime, *, ttft_p90_s: float | None, itl_p90_s: float | None) -> None:
    """Replace the decode workers by one reporting these p90s over 50 requests / 500 tokens, seen at `at`."""
    Worker.objects.filter(deployment=dep, role="decode").delete()
    make_worker(dep, make_node(), role="decode", status="running", last_seen=at, last_health={
        "status": "healthy", "running": 1, "queue_depth": 0, "ttft_p90_s": ttft_p90_s, "ttft_samples": 50,
        "itl_p90_s": itl_p90_s, "itl_samples": 500})


def test_slo_rules_add_workers_of_the_role_that_limits_the_latency() -> None:
    dep = make_deployment(prefill_replicas=1, prefill_max=3, decode_replicas=1, decode_max=3, batch_size=8)
    ttft = ScalingRule.objects.create(deployment=dep, name="ttft p90 <= 1s", kind="ttft_slo", role="prefill",
                                      threshold=1.0, duration_s=20, cooldown_s=60, step=1)
    itl = ScalingRule.objects.create(deployment=dep, name="itl p90 <= 50ms", kind="itl_slo", role="decode",
                                     threshold=50.0, duration_s=20, cooldown_s=60, step=1)
    # TTFT 2.5 s (the clients) with a fine ITL of 30 ms: prefill grows, decode does not.
    fired = []
    for i, p90 in enumerate([2.5, 2.4, 2.6]):
        set_latency(dep, T0 + timedelta(seconds=10 * i), ttft_p90_s=p90, itl_p90_s=0.030)
        fired.append(scaling_rules.evaluate_all(now=T0 + timedelta(seconds=10 * i)))
    assert [len(e) for e in fired] == [0, 0, 1]
    event = fired[-1][0]
    assert (event.role, event.from_replicas, event.to_replicas, event.source, event.rule_id) == (
        "prefill", 1, 2, "slo", ttft.pk)
    assert "TTFT p90 2.60s above the 1s target over 20s (3 of 3 readings" in event.reason
    itl.refresh_from_db()
    assert [value for _, value in itl.observations] == pytest.approx([30.0, 30.0, 30.0])  # in milliseconds
    # Slow tokens: decode grows; no latency reported at all (no requests): nothing fires.
    for i in range(3):
        set_latency(dep, T0 + timedelta(seconds=40 + 10 * i), ttft_p90_s=0.2, itl_p90_s=0.120)
        fired.append(scaling_rules.evaluate_all(now=T0 + timedelta(seconds=40 + 10 * i)))
    [slow] = fired[-1]
    assert (slow.role, slow.to_replicas, slow.source) == ("decode", 2, "slo") and "ITL p90 120.00ms" in slow.reason
    for i in range(4):
        set_latency(dep, T0 + timedelta(seconds=200 + 10 * i), ttft_p90_s=None, itl_p90_s=None)
        assert scaling_rules.evaluate_all(now=T0 + timedelta(seconds=200 + 10 * i)) == []


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"kind": "ttft_slo", "role": "decode", "threshold": 1.0}, "role", "role must be prefill"),
        ({"kind": "itl_slo", "role": "prefill", "threshold": 50.0}, "role", "role must be decode"),
        ({"kind": "ttft_slo", "role": "prefill"}, "threshold", "p90 target in seconds"),
        ({"kind": "itl_slo", "role": "decode", "threshold": -5.0}, "threshold", "p90 target in milliseconds"),
        ({"kind": "ttft_slo", "role": "prefill", "threshold": 1.0, "step": -1}, "step", "only adds workers"),
        ({"kind": "itl_slo", "role": "decode", "threshold": 50.0, "comparison": "below"}, "comparison",
         "must be above"),
    ],
)
def test_slo_rules_are_validated_in_the_model_and_the_rest_serializer(
    fields: dict[str, object], field: str, message: str
) -> None:
    from django.core.exceptions import ValidationError

    from inference.api.serializers import ScalingRuleSerializer

    dep = make_deployment()
    rule = ScalingRule(deployment=dep, name="slo", **fields)  # type: ignore[misc]
    with pytest.raises(ValidationError) as refused:
        rule.clean()
    assert message in str(refused.value.message_dict[field])
    serializer = ScalingRuleSerializer(data={"deployment": dep.pk, "name": "slo", **fields})
    assert not serializer.is_valid()
    assert message in str(serializer.errors[field])
    ok = ScalingRuleSerializer(data={"deployment": dep.pk, "name": "ok", "kind": "ttft_slo", "role": "prefill",
                                     "threshold": 1.5})
    assert ok.is_valid(), ok.errors


def test_the_demo_ships_a_scale_in_rule(tmp_path: object) -> None:
    from pathlib import Path

    from django.core.management import call_command

    model_dir = Path(str(tmp_path))
    (model_dir / "config.json").write_text("{}")
    with override_settings(VAR_DIR=model_dir / "var"):
        call_command("bootstrap_demo", "--model-path", str(model_dir), stdout=open("/dev/null", "w"))  # noqa: SIM115
    rule = ScalingRule.objects.get(deployment__name="demo", name="decode load < 0.2")
    assert (rule.kind, rule.comparison, rule.step, rule.duration_s) == ("threshold", "below", -1, 300)
    rule.full_clean()
