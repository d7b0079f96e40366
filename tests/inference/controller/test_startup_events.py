"""Scale events of the start-up order: `make up` starts the controller before the agent registers its
node, which is no refused placement; an agent that never comes, and real refusals, still are."""
from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.test import override_settings
from django.utils import timezone

from inference.controller import placement, reconciler
from inference.models import Deployment, ScaleEvent
from nodes.models import NodeStatus
from tests.support.celery_capture import SentTasks, sent_tasks  # noqa: F401  (fixture)
from tests.support.control_plane import make_node

pytestmark = pytest.mark.django_db


@pytest.fixture
def demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Deployment:
    """The quick start's demo deployment, as `make up` creates it before starting the controller."""
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv("PLATFORM_ADMIN_PASSWORD", "demo-password")
    with open("/dev/null", "w") as quiet:
        call_command("bootstrap_demo", "--model-path", str(tmp_path), stdout=quiet)
    return Deployment.objects.get(name="demo")


def events(dep: Deployment) -> list[tuple[str, str, bool, int, int]]:
    return [
        (e.role, e.source, e.refused, e.from_replicas, e.to_replicas)
        for e in ScaleEvent.objects.filter(deployment=dep).order_by("created_at", "pk")
    ]


def controller_started(monkeypatch: pytest.MonkeyPatch, seconds_ago: float) -> None:
    monkeypatch.setattr(placement, "CONTROLLER_STARTED_AT", timezone.now() - timedelta(seconds=seconds_ago))


def test_a_fresh_start_records_the_bootstrap_and_no_recovery_event(
    demo: Deployment, monkeypatch: pytest.MonkeyPatch, sent_tasks: SentTasks  # noqa: F811
) -> None:
    controller_started(monkeypatch, 1)
    assert events(demo) == [("prefill", "bootstrap", False, 0, 1), ("decode", "bootstrap", False, 0, 1)]
    early = reconciler.reconcile(demo)  # the controller's first round: no agent registered yet
    assert early.unplaced == {"prefill": 1, "decode": 1} and early.refused_events == []
    make_node(name="local", last_heartbeat=timezone.now(), port_range_start=30000, port_range_end=30999)
    placed = reconciler.reconcile(demo)
    assert len(placed.started) == 2 and not placed.unplaced
    assert events(demo) == [("prefill", "bootstrap", False, 0, 1), ("decode", "bootstrap", False, 0, 1)]
    assert not ScaleEvent.objects.filter(source="recovery").exists()
    # Each bootstrap event is carried out by its worker.
    assert sorted(ScaleEvent.objects.values_list("placed_workers", flat=True)) == sorted(placed.started)


def test_a_restart_waits_for_the_agent_of_a_node_left_offline(
    demo: Deployment, monkeypatch: pytest.MonkeyPatch, sent_tasks: SentTasks  # noqa: F811
) -> None:
    """`make down` marks the node OFFLINE; the next `make up`'s controller finds it so until the agent is back."""
    controller_started(monkeypatch, 5)
    node = make_node(name="local", status=NodeStatus.OFFLINE, last_heartbeat=timezone.now() - timedelta(hours=3))
    assert reconciler.reconcile(demo).refused_events == []
    node.status, node.last_heartbeat = NodeStatus.ONLINE, timezone.now()
    node.save()
    assert len(reconciler.reconcile(demo).started) == 2
    assert not ScaleEvent.objects.filter(refused=True).exists()


def test_an_agent_that_never_comes_is_a_refusal_labelled_with_the_scale_it_blocks(
    demo: Deployment, monkeypatch: pytest.MonkeyPatch, sent_tasks: SentTasks  # noqa: F811
) -> None:
    controller_started(monkeypatch, 61)  # past the default grace of 60 s
    result = reconciler.reconcile(demo)
    assert len(result.refused_events) == 2
    refused = ScaleEvent.objects.filter(refused=True).order_by("role")
    assert [(e.role, e.source, e.from_replicas, e.to_replicas) for e in refused] == [
        ("decode", "bootstrap", 0, 1), ("prefill", "bootstrap", 0, 1)]
    assert all(e.reason.endswith("nodes considered: no nodes registered") for e in refused)
    assert str(refused[0]).endswith("0->1 (refused)")


@override_settings(CONTROLLER_STARTUP_GRACE_S=600)
def test_a_node_short_of_cpus_is_refused_even_while_the_controller_starts(
    demo: Deployment, monkeypatch: pytest.MonkeyPatch, sent_tasks: SentTasks  # noqa: F811
) -> None:
    controller_started(monkeypatch, 1)
    make_node(name="tiny", cpu_count=1, last_heartbeat=timezone.now(), port_range_start=30000, port_range_end=30999)
    result: Any = reconciler.reconcile(demo)
    assert len(result.started) == 1 and result.unplaced == {"decode": 1}
    [event] = ScaleEvent.objects.filter(refused=True)
    assert event.source == "bootstrap" and "tiny: no free CPUs" in event.reason
