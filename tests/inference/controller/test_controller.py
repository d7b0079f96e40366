"""inference.controller (placement, reconcile, heartbeats), the metrics collector and the controller's tasks."""
from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.test import override_settings
from django.utils import timezone

from inference.actions import nodes as node_workers
from inference.actions import scale as scale_actions
from inference.actions import workers as worker_actions
from inference.controller import heartbeats, placement, reconciler
from inference.metrics import collector
from inference.models import Deployment, MetricSample, ScaleEvent, Worker, WorkerStatus
from nodes.models import Node, NodeStatus
from tests.support.celery_capture import SentTasks, sent_tasks  # noqa: F401  (fixture)
from tests.support.control_plane import make_deployment, make_node, make_worker
from tests.support.http_stub import QuietHandler, serving

pytestmark = pytest.mark.django_db


def online_node(**fields: Any) -> Node:
    defaults: dict[str, Any] = {"last_heartbeat": timezone.now(), "port_range_start": 30000,
                                "port_range_end": 30999, "cpu_count": 8}
    defaults.update(fields)
    return make_node(**defaults)


def live(deployment: Deployment, role: str) -> list[Worker]:
    return list(Worker.objects.filter(deployment=deployment, role=role,
                                      status__in=["pending", "starting", "running", "unhealthy"]))


# ------------------------------------------------------------------------------------------ placement
def test_ports_and_cpus_of_a_shared_host() -> None:
    node = online_node(cpu_count=4, port_range_start=31000, port_range_end=31010)
    dep = make_deployment(threads_per_worker=2)
    prefill = placement.place_worker(dep, "prefill")
    decode = placement.place_worker(dep, "decode")
    assert prefill is not None and decode is not None
    assert (prefill.node_id, prefill.port, prefill.kv_port, prefill.status) == (node.pk, 31000, None, "pending")
    assert (decode.port, decode.kv_port) == (31001, 31002)  # decode also gets its KV port from the range
    assert prefill.cpu_ids == [0, 1] and decode.cpu_ids == [2, 3]  # the roles do not share cores
    assert prefill.gpu_ids == [] and decode.gpu_ids == []
    assert placement.place_worker(dep, "decode") is None  # all four CPUs taken: no third worker
    Node.objects.filter(pk=node.pk).update(allow_cpu_oversubscription=True)
    third = placement.place_worker(dep, "decode")
    assert third is not None and third.port == 31003 and third.kv_port == 31004
    assert third.cpu_ids == [2, 3]  # oversubscribed: shares with its own role, not with prefill


def test_choose_cpus_spreads_roles() -> None:
    assert placement.choose_cpus(8, 1, "prefill", []) == [0]
    assert placement.choose_cpus(8, 1, "decode", []) == [7]
    assert placement.choose_cpus(2, 4, "decode", []) == [0, 1]  # clipped to the host


def test_nodes_that_do_not_fit_are_skipped() -> None:
    dep = make_deployment()
    now = timezone.now()
    online_node(name="stale", last_heartbeat=now - timedelta(minutes=5))
    online_node(name="offline", status=NodeStatus.OFFLINE)
    online_node(name="draining", status=NodeStatus.DRAINING)
    online_node(name="prefill-only", labels={"roles": ["prefill"]})
    full = online_node(name="full", port_range_start=32000, port_range_end=32000)
    make_worker(dep, full, port=32000)
    assert placement.place_worker(dep, "decode") is None
    # One free port is enough for prefill but not for decode (HTTP + KV).
    spare = online_node(name="one-port", port_range_start=33000, port_range_end=33000)
    assert placement.place_worker(dep, "decode") is None
    worker = placement.place_worker(dep, "prefill")
    assert worker is not None and worker.node_id in {spare.pk, Node.objects.get(name="prefill-only").pk}


def test_role_labels_and_gpus_steer_placement() -> None:
    dep = make_deployment()
    gpu_host = online_node(name="gpu", gpus=[{"index": 0, "name": "H100", "memory_bytes": 1}, {"index": 1}])
    cpu_host = online_node(name="cpu")
    first = placement.place_worker(dep, "prefill")
    second = placement.place_worker(dep, "prefill")
    third = placement.place_worker(dep, "prefill")
    assert first is not None and second is not None and third is not None
    assert (first.node_id, first.gpu_ids) == (gpu_host.pk, [0])
    assert (second.node_id, second.gpu_ids) == (gpu_host.pk, [1])
    assert (third.node_id, third.gpu_ids) == (cpu_host.pk, [])  # GPUs used up: a CPU host next
    decode = placement.place_worker(dep, "decode")
    assert decode is not None and decode.node_id == cpu_host.pk  # decode keeps off GPU hosts
    labelled = online_node(name="decode-box", labels={"roles": "decode"})
    decode2 = placement.place_worker(dep, "decode")
    assert decode2 is not None and decode2.node_id == labelled.pk  # a node labelled for the role first


def test_a_node_that_just_failed_a_replica_is_avoided() -> None:
    dep = make_deployment()
    bad = online_node(name="a-bad")
    good = online_node(name="b-good")
    make_worker(dep, bad, role="decode", status="failed")
    worker = placement.place_worker(dep, "decode")
    assert worker is not None and worker.node_id == good.pk
    Node.objects.filter(pk=good.pk).update(status=NodeStatus.OFFLINE)
    assert placement.place_worker(dep, "decode") is None  # only the failing node left: wait for the cooldown
    Worker.objects.filter(status="failed").update(updated_at=timezone.now() - timedelta(hours=1))
    later = placement.place_worker(dep, "decode")
    assert later is not None and later.node_id == bad.pk


def test_cpu_ranges_never_overlap_without_oversubscription() -> None:
    node = online_node(cpu_count=8)
    dep = make_deployment(threads_per_worker=2)
    other = make_deployment()
    make_worker(other, node, role="decode", status="draining", cpu_ids=[4, 5])  # still running: still busy
    make_worker(other, node, role="decode", status="stopped", cpu_ids=[2, 3])  # gone: its CPUs are free
    placed = []
    for role in ["prefill", "decode", "prefill", "decode"]:
        worker = placement.place_worker(dep, role)
        if worker is not None:
            placed.append((role, worker.cpu_ids))
    assert placed == [("prefill", [0, 1]), ("decode", [6, 7]), ("prefill", [2, 3])]  # CPUs 0-7 all taken
    plan = placement.plan_placement_explained(dep, "prefill")
    assert plan.placement is None
    assert plan.refusals == [
        (node.name, "no free CPUs (needs 2 contiguous, 0 of 8 free; oversubscription not allowed)")
    ]


def test_contiguous_free_cpus_are_needed() -> None:
    node = online_node(cpu_count=4)
    other = make_deployment()
    make_worker(other, node, role="prefill", cpu_ids=[0])
    make_worker(other, node, role="prefill", cpu_ids=[2])
    dep = make_deployment(threads_per_worker=2)
    # CPUs 1 and 3 are free, but not next to each other: --base-cpu-id takes a contiguous range.
    assert placement.place_worker(dep, "decode") is None
    single = make_deployment(threads_per_worker=1)
    worker = placement.place_worker(single, "decode")
    assert worker is not None and worker.cpu_ids == [3]


def test_oversubscription_is_allowed_per_node_and_used_last() -> None:
    other = make_deployment()
    dep = make_deployment()
    strict = online_node(name="a-strict", cpu_count=2)
    lenient = online_node(name="b-lenient", cpu_count=2, allow_cpu_oversubscription=True,
                          labels={"roles": "decode"})
    for node in (strict, lenient):
        make_worker(other, node, role="prefill", cpu_ids=[0])
        make_worker(other, node, role="decode", cpu_ids=[1])
    worker = placement.place_worker(dep, "decode")
    assert worker is not None and worker.node_id == lenient.pk  # only the node that allows it
    assert worker.cpu_ids == [1]  # shares with its own role rather than with prefill
    roomy = online_node(name="c-roomy", cpu_count=2)
    worker = placement.place_worker(dep, "decode")
    # Free CPUs beat the labelled node that would oversubscribe.
    assert worker is not None and (worker.node_id, worker.cpu_ids) == (roomy.pk, [1])


def test_refusals_name_every_node_and_its_reason(settings: Any) -> None:
    settings.NODE_HEARTBEAT_TIMEOUT_S = 30.0
    settings.CONTROLLER_FAILURE_COOLDOWN_S = 300.0
    dep = make_deployment(kv_transport="tcp")
    now = timezone.now()
    online_node(name="a-stale", last_heartbeat=now - timedelta(minutes=5))
    online_node(name="b-never", last_heartbeat=None)
    online_node(name="c-offline", status=NodeStatus.OFFLINE)
    online_node(name="d-draining", status=NodeStatus.DRAINING)
    online_node(name="e-prefill", labels={"roles": ["prefill"]})
    online_node(name="f-one-port", port_range_start=33000, port_range_end=33000)
    failing = online_node(name="g-failing")
    make_worker(dep, failing, role="decode", status="failed")
    plan = placement.plan_placement_explained(dep, "decode", now=now)
    assert plan.placement is None
    assert dict(plan.refusals) == {
        "a-stale": "heartbeat stale (none within 30s)",
        "b-never": "heartbeat stale (never sent one)",
        "c-offline": "offline",
        "d-draining": "draining",
        "e-prefill": "role not accepted (takes prefill)",
        "f-one-port": "no free port (needs 2 in 33000-33000)",
        "g-failing": "a decode worker of this deployment failed here within 300s",
    }
    assert [name for name, _ in plan.refusals] == sorted(dict(plan.refusals))
    Node.objects.all().delete()
    assert placement.plan_placement_explained(dep, "decode").explain() == "no nodes registered"


@pytest.mark.django_db(transaction=True)
def test_concurrent_reconciles_do_not_share_a_cpu(
    monkeypatch: pytest.MonkeyPatch, sent_tasks: SentTasks  # noqa: F811
) -> None:
    """Two deployments placed at once while a worker stops: each gets its own CPU (PostgreSQL)."""
    from django.db import connection, connections

    if connection.vendor != "postgresql":
        pytest.skip("the placement lock is a PostgreSQL advisory lock")
    node = online_node(name="duo", cpu_count=2)
    leaving = make_worker(make_deployment(), node, role="decode", port=30000, kv_port=30001, cpu_ids=[1])
    dep_a = make_deployment(prefill_replicas=0, prefill_min=0, decode_replicas=1)
    dep_b = make_deployment(prefill_replicas=1, decode_replicas=0, decode_min=0)
    # A (decode) reads the node while `leaving` still holds CPU 1 and port 30000: CPU 0, port 30002.
    # Then `leaving` stops and B (prefill) reads: without the placement lock it sees CPU 0 free too
    # and takes it with port 30000 (no port conflict to stop it); with the lock it waits for A's commit.
    a_read, b_read = threading.Event(), threading.Event()
    real_choose_cpus = placement.choose_cpus

    def choose_cpus_in_order(cpu_count: int, threads: int, role: str, live_workers: Any) -> list[int]:
        cpus = real_choose_cpus(cpu_count, threads, role, live_workers)
        if role == "decode":
            a_read.set()
            b_read.wait(timeout=1.5)  # only reached without the lock; with it B is waiting for this commit
        else:
            b_read.set()
        return cpus

    monkeypatch.setattr(placement, "choose_cpus", choose_cpus_in_order)
    errors: list[BaseException] = []

    def run(dep: Deployment) -> None:
        try:
            reconciler.reconcile(dep.pk)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            connections.close_all()  # this thread's connection, else the test database cannot be dropped

    thread_a = threading.Thread(target=run, args=(dep_a,))
    thread_a.start()
    assert a_read.wait(timeout=10)
    Worker.objects.filter(pk=leaving.pk).update(status=WorkerStatus.STOPPED)
    thread_b = threading.Thread(target=run, args=(dep_b,))
    thread_b.start()
    thread_a.join()
    thread_b.join()
    assert not errors
    [a] = Worker.objects.filter(deployment=dep_a)
    [b] = Worker.objects.filter(deployment=dep_b)
    assert (a.cpu_ids, b.cpu_ids) == ([0], [1])


# ------------------------------------------------------------------------------------------ reconcile
def test_reconcile_up_places_and_sends_start_to_the_node_queue(
    sent_tasks: SentTasks, django_capture_on_commit_callbacks  # noqa: F811
) -> None:
    node = online_node(name="host-a")
    dep = make_deployment(prefill_replicas=1, decode_replicas=2)
    with django_capture_on_commit_callbacks(execute=True):
        result = reconciler.reconcile(dep)
    assert len(result.started) == 3 and not result.unplaced
    assert len(live(dep, "prefill")) == 1 and len(live(dep, "decode")) == 2
    starts = sent_tasks.named("start_worker")
    assert sorted(kw["worker_id"] for kw, _ in starts) == sorted(result.started)
    assert {queue for _, queue in starts} == {"node.host-a"}
    sent_tasks.clear()
    with django_capture_on_commit_callbacks(execute=True):
        again = reconciler.reconcile(dep)  # nothing to do the second time
    assert again.started == [] and sent_tasks.calls == []
    assert node.workers.count() == 3


def refusals(dep: Deployment, role: str = "decode") -> list[ScaleEvent]:
    return list(ScaleEvent.objects.filter(deployment=dep, role=role, source="recovery").order_by("created_at", "pk"))


def test_an_unplaceable_scale_out_is_recorded_once_with_its_reasons(
    sent_tasks: SentTasks, django_capture_on_commit_callbacks  # noqa: F811
) -> None:
    local = online_node(name="local", cpu_count=2)
    tiny = online_node(name="one-port", port_range_start=33000, port_range_end=33000)
    online_node(name="prefill-box", labels={"roles": ["prefill"]}, cpu_count=1)
    dep = make_deployment(prefill_replicas=1, decode_replicas=1, decode_max=4)
    with django_capture_on_commit_callbacks(execute=True):
        first = reconciler.reconcile(dep)
    assert len(first.started) == 2 and not first.unplaced and not refusals(dep)
    Deployment.objects.filter(pk=dep.pk).update(decode_replicas=3)
    with django_capture_on_commit_callbacks(execute=True):
        result = reconciler.reconcile(dep)
    assert len(result.started) == 1 and result.unplaced == {"decode": 1}  # local's second CPU, then nothing
    [event] = refusals(dep)
    assert result.refused_events == [event.pk]
    assert (event.from_replicas, event.to_replicas) == (2, 3)
    assert event.reason == (
        "placement refused: 1 decode worker(s) not placed (2 of 3 running or starting); nodes considered: "
        "local: no free CPUs (needs 1 contiguous, 0 of 2 free; oversubscription not allowed); "
        "one-port: no free port (needs 2 in 33000-33000); prefill-box: role not accepted (takes prefill)"
    )
    assert sorted(w.cpu_ids for w in live(dep, "decode")) == [[0], [1]]  # the prefill is on prefill-box
    sent_tasks.clear()
    for _ in range(3):  # the reconcile loop: no new event while nothing changed
        with django_capture_on_commit_callbacks(execute=True):
            again = reconciler.reconcile(dep)
        assert again.unplaced == {"decode": 1} and again.refused_events == [] and again.started == []
    assert len(refusals(dep)) == 1 and sent_tasks.calls == []
    # Another reason (the one-port node stops heartbeating): recorded again, once.
    Node.objects.filter(pk=tiny.pk).update(last_heartbeat=timezone.now() - timedelta(hours=1))
    reconciler.reconcile(dep)
    reconciler.reconcile(dep)
    assert len(refusals(dep)) == 2 and "one-port: heartbeat stale" in refusals(dep)[-1].reason
    # The operator allows oversubscription on the host: the missing worker is placed, nothing is refused.
    Node.objects.filter(pk=local.pk).update(allow_cpu_oversubscription=True)
    with django_capture_on_commit_callbacks(execute=True):
        placed = reconciler.reconcile(dep)
    assert len(placed.started) == 1 and not placed.unplaced and len(refusals(dep)) == 2
    assert Worker.objects.get(pk=placed.started[0]).cpu_ids in ([0], [1])


def test_a_refusal_is_recorded_again_after_a_placement_or_a_scale_change(
    sent_tasks: SentTasks, django_capture_on_commit_callbacks  # noqa: F811
) -> None:
    online_node(name="solo", cpu_count=1)
    dep = make_deployment(prefill_replicas=0, prefill_min=0, decode_replicas=2, decode_max=4)
    result = reconciler.reconcile(dep)
    assert len(result.started) == 1 and result.unplaced == {"decode": 1} and len(refusals(dep)) == 1
    reconciler.reconcile(dep)
    assert len(refusals(dep)) == 1
    # The worker goes away and a new one is placed in its CPU: the same refusal is news again.
    Worker.objects.filter(pk=result.started[0]).update(status=WorkerStatus.STOPPED)
    replaced = reconciler.reconcile(dep)
    assert len(replaced.started) == 1 and len(replaced.refused_events) == 1
    first, second = [e for e in refusals(dep) if e.reason.startswith("placement refused")]
    assert (first.reason, first.from_replicas, first.to_replicas) == (
        second.reason, second.from_replicas, second.to_replicas)
    # A scale change in between (here a threshold-like step) makes the next refusal news too.
    with django_capture_on_commit_callbacks(execute=True):
        scale_actions.scale_deployment(dep, "decode", 3, source="api", reason="more decode")
    reconciler.reconcile(dep)
    reconciler.reconcile(dep)
    events = list(ScaleEvent.objects.filter(deployment=dep, role="decode").order_by("created_at", "pk"))
    assert [(e.source, e.refused, e.from_replicas, e.to_replicas) for e in events] == [
        ("recovery", True, 1, 2), ("recovery", False, 0, 2), ("recovery", True, 1, 2), ("api", False, 2, 3),
        ("api", True, 1, 3),
    ]  # the second: the stopped worker's re-placement; the last: the API's scale-out, refused
    assert events[1].reason.startswith("re-placement") and events[1].placed_workers.count() == 1
    assert "2 decode worker(s) not placed" in events[-1].reason


def test_the_demo_starts_on_two_cpus_and_its_scale_out_is_refused(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, sent_tasks: SentTasks,  # noqa: F811
    django_capture_on_commit_callbacks: Any,
) -> None:
    """`make up` on a 2-CPU host: bootstrap_demo's 1 prefill + 1 decode fit, a rule's third worker does not."""
    from django.core.management import call_command

    from inference.models import ScalingRule

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv("PLATFORM_ADMIN_PASSWORD", "demo-password")
    call_command("bootstrap_demo", "--model-path", str(tmp_path), stdout=open("/dev/null", "w"))  # noqa: SIM115
    online_node(name="local", cpu_count=2)  # what `agent --name local` registers here (sched_getaffinity)
    dep = Deployment.objects.get(name="demo")
    with django_capture_on_commit_callbacks(execute=True):
        started = reconciler.reconcile(dep)
    assert len(started.started) == 2 and not started.unplaced
    assert {(w.role, tuple(w.cpu_ids)) for w in live(dep, "prefill") + live(dep, "decode")} == {
        ("prefill", (0,)), ("decode", (1,))}
    rule = ScalingRule.objects.get(deployment=dep, name="decode load > 0.7")
    with django_capture_on_commit_callbacks(execute=True):
        scale_actions.scale_deployment_by(
            dep, "decode", rule.step, source="threshold", reason="load 0.9 > 0.7", rule=rule
        )
    with django_capture_on_commit_callbacks(execute=True):
        refused = reconciler.reconcile(dep)
    assert refused.started == [] and refused.unplaced == {"decode": 1}
    [event] = ScaleEvent.objects.filter(deployment=dep, refused=True)
    assert "local: no free CPUs (needs 1 contiguous, 0 of 2 free" in event.reason
    assert (event.source, event.from_replicas, event.to_replicas) == ("threshold", 1, 2)  # the rule's scale-out
    assert not refusals(dep)  # nothing labelled recovery: the deployment was created by the bootstrap
    assert set(ScaleEvent.objects.filter(deployment=dep, refused=False).values_list("source", flat=True)) == {
        "bootstrap", "threshold"}
    assert len(live(dep, "decode")) == 1


def test_reconcile_down_drains_preferring_unhealthy_and_idle(
    sent_tasks: SentTasks, django_capture_on_commit_callbacks  # noqa: F811
) -> None:
    node = online_node()
    dep = make_deployment(decode_replicas=1, decode_min=1)
    busy = make_worker(dep, node, role="decode", last_health={"running": 5, "queue_depth": 2})
    idle = make_worker(dep, node, role="decode", last_health={"running": 0, "queue_depth": 0})
    sick = make_worker(dep, node, role="decode", status="unhealthy")
    make_worker(dep, node, role="prefill")
    Deployment.objects.filter(pk=dep.pk).update(decode_replicas=2)
    with django_capture_on_commit_callbacks(execute=True):
        result = reconciler.reconcile(dep)
    assert result.stopped == [sick.pk] and result.draining == []
    Deployment.objects.filter(pk=dep.pk).update(decode_replicas=1)
    with django_capture_on_commit_callbacks(execute=True):
        result = reconciler.reconcile(dep)
    assert result.draining == [idle.pk]
    assert {w.pk: w.status for w in Worker.objects.filter(role="decode")} == {
        busy.pk: "running", idle.pk: "draining", sick.pk: "stopping",
    }
    stops = {kw["worker_id"]: (kw["drain"], queue) for kw, queue in sent_tasks.named("stop_worker")}
    assert stops == {sick.pk: (False, node.queue_name), idle.pk: (True, node.queue_name)}
    assert "scale-down" in Worker.objects.get(pk=idle.pk).last_error


def test_a_stopped_deployment_drains_everything(
    sent_tasks: SentTasks, django_capture_on_commit_callbacks  # noqa: F811
) -> None:
    node = online_node()
    dep = make_deployment(status="stopped")
    running = make_worker(dep, node, role="decode")
    pending = make_worker(dep, node, role="prefill", status="pending")
    with django_capture_on_commit_callbacks(execute=True):
        results = reconciler.reconcile_all()
    assert [r.deployment_id for r in results] == [dep.pk]
    assert Worker.objects.get(pk=running.pk).status == WorkerStatus.DRAINING
    assert Worker.objects.get(pk=pending.pk).status == WorkerStatus.STOPPING


def test_silent_node_is_unreachable_and_its_healthy_workers_stay_in_rotation(
    sent_tasks: SentTasks, django_capture_on_commit_callbacks, fake_worker: tuple[int, FakeWorkerState]  # noqa: F811
) -> None:
    """An agent that went silent: its node turns UNREACHABLE, its worker answering /health stays RUNNING."""
    port, _state = fake_worker
    dep = make_deployment(decode_replicas=1, prefill_replicas=0, prefill_min=0)
    silent = online_node(name="silent", address="127.0.0.1", last_heartbeat=timezone.now() - timedelta(seconds=60))
    online_node(name="alive")
    serving = make_worker(dep, silent, role="decode", port=port, status="running", last_seen=timezone.now())
    with django_capture_on_commit_callbacks(execute=True):
        gone = heartbeats.check_node_heartbeats()
    assert [n.name for n in gone] == ["silent"]
    assert Node.objects.get(pk=silent.pk).status == NodeStatus.UNREACHABLE
    kept = Worker.objects.get(pk=serving.pk)
    assert kept.status == WorkerStatus.RUNNING and kept.last_health["status"] == "healthy"
    [event] = ScaleEvent.objects.filter(deployment=dep)
    assert event.source == "recovery" and (event.from_replicas, event.to_replicas) == (1, 1)
    assert "unreachable" in event.reason and f"#{serving.pk}" in event.reason
    assert sent_tasks.named("reconcile_deployment") == []
    result = reconciler.reconcile(dep)
    assert result.started == [] and [w.pk for w in live(dep, "decode")] == [serving.pk]  # no replacement
    assert heartbeats.check_node_heartbeats() == []  # reported once; its worker is still probed
    assert ScaleEvent.objects.filter(deployment=dep).count() == 1
    # The placement of anything new avoids the node: its agent could not start it.
    plan = placement.plan_placement_explained(dep, "decode")
    assert ("silent", "unreachable") in plan.refusals


def test_worker_of_an_unreachable_node_is_failed_over_once_it_stops_answering(
    sent_tasks: SentTasks, django_capture_on_commit_callbacks  # noqa: F811
) -> None:
    """No /health answer: out of rotation at once (UNHEALTHY); replaced after NODE_HEARTBEAT_TIMEOUT_S."""
    dep = make_deployment(decode_replicas=1, prefill_replicas=0, prefill_min=0)
    now = timezone.now()
    silent = online_node(name="silent", address="127.0.0.1", last_heartbeat=now - timedelta(seconds=60))
    alive = online_node(name="alive")
    dead = make_worker(dep, silent, role="decode", port=1, status="running", pid=4242, last_seen=now)
    with django_capture_on_commit_callbacks(execute=True):
        heartbeats.check_node_heartbeats(now=now)
    out = Worker.objects.get(pk=dead.pk)
    assert out.status == WorkerStatus.UNHEALTHY and "/health probe failed" in out.last_error
    assert sent_tasks.named("reconcile_deployment") == []  # not yet: it may be a blip
    later = now + timedelta(seconds=16)  # NODE_HEARTBEAT_TIMEOUT_S (15 s) without an answer
    Node.objects.filter(pk=alive.pk).update(last_heartbeat=later)  # the other agent kept beating
    with django_capture_on_commit_callbacks(execute=True):
        assert heartbeats.check_node_heartbeats(now=later) == []
    failed = Worker.objects.get(pk=dead.pk)
    assert failed.status == WorkerStatus.STOPPED and failed.pid == 4242  # kept: a returning agent reaps it
    assert "failed over" in failed.last_error
    event = ScaleEvent.objects.filter(deployment=dep, reason__startswith="failover").get()
    assert (event.source, event.from_replicas, event.to_replicas) == ("recovery", 1, 0)
    assert f"#{dead.pk}" in event.reason and "silent" in event.reason
    assert sent_tasks.named("reconcile_deployment") == [({"deployment_id": dep.pk}, None)]
    with django_capture_on_commit_callbacks(execute=True):
        result = reconciler.reconcile(dep)
    [replacement] = live(dep, "decode")
    assert replacement.node_id == alive.pk and result.started == [replacement.pk]


def test_an_answer_after_a_failed_probe_puts_the_worker_back_and_a_pending_one_is_replaced(
    fake_worker: tuple[int, FakeWorkerState]
) -> None:
    port, state = fake_worker
    dep = make_deployment(decode_replicas=2, prefill_replicas=0, prefill_min=0)
    now = timezone.now()
    silent = online_node(name="silent", address="127.0.0.1", status=NodeStatus.UNREACHABLE,
                         last_heartbeat=now - timedelta(seconds=60))
    flaky = make_worker(dep, silent, role="decode", port=port, status="running", last_seen=now)
    never = make_worker(dep, silent, role="decode", status="pending", pid=None)
    state.health = {"status": "loading"}
    outcome = heartbeats.probe_workers_of_silent_nodes([silent], now=now)
    assert outcome == {flaky.pk: "unhealthy", never.pk: "failed_over"}
    assert Worker.objects.get(pk=never.pk).status == WorkerStatus.STOPPED
    state.health = {"status": "healthy", "running": 0}
    assert heartbeats.probe_workers_of_silent_nodes([silent], now=now) == {flaky.pk: "healthy"}
    assert Worker.objects.get(pk=flaky.pk).status == WorkerStatus.RUNNING


def test_manual_offline_replaces_the_workers_with_a_recorded_failover(
    django_capture_on_commit_callbacks  # noqa: F811
) -> None:

    dep = make_deployment(decode_replicas=1, prefill_replicas=0, prefill_min=0)
    gone = online_node(name="gone")
    fine = online_node(name="fine")
    lost = make_worker(dep, gone, role="decode", status="running")
    node_workers.mark_node_offline(gone, reason="host retired")
    assert Worker.objects.get(pk=lost.pk).status == WorkerStatus.STOPPED
    event = ScaleEvent.objects.get(deployment=dep)
    assert event.reason.startswith("failover: node gone offline (host retired)") and event.to_replicas == 0
    reconciler.reconcile(dep)
    assert [w.node_id for w in live(dep, "decode")] == [fine.pk]


def test_workers_left_on_a_node_set_offline_by_hand_are_replaced() -> None:
    dep = make_deployment(decode_replicas=1, prefill_replicas=0, prefill_min=0)
    dead = online_node(name="dead", status=NodeStatus.OFFLINE)
    fine = online_node(name="fine")
    lost = make_worker(dep, dead, role="decode")
    result = reconciler.reconcile(dep)
    assert result.stopped == [lost.pk]
    assert [w.node_id for w in live(dep, "decode")] == [fine.pk]


def test_a_worker_left_on_a_node_set_offline_by_hand_is_a_recorded_failover_with_its_time_to_run() -> None:

    dep = make_deployment(decode_replicas=1, prefill_replicas=0, prefill_min=0)
    dead = online_node(name="dead", status=NodeStatus.OFFLINE)
    online_node(name="fine")
    lost = make_worker(dep, dead, role="decode", status="running")
    [new] = reconciler.reconcile(dep).started
    [event] = refusals(dep)
    assert event.reason.startswith("failover: node dead offline") and f"#{lost.pk}" in event.reason
    assert (event.from_replicas, event.to_replicas) == (1, 0)
    assert list(event.placed_workers.values_list("pk", flat=True)) == [new]
    assert event.time_to_run_s is None
    worker_actions.report_launched(new, pid=4242, restart=False)
    assert worker_actions.report_healthy(new, health={"status": "healthy"})
    event.refresh_from_db()
    assert event.time_to_run_s is not None and 0 <= event.time_to_run_s < 60


def test_a_scale_out_records_how_long_its_workers_took_to_run() -> None:

    online_node()
    dep = make_deployment(decode_replicas=1, decode_max=4, prefill_replicas=0, prefill_min=0)
    reconciler.reconcile(dep)
    Worker.objects.filter(deployment=dep).update(created_at=timezone.now() - timedelta(seconds=60))
    event = scale_actions.scale_deployment(dep, "decode", 3, source="api", reason="traffic")
    assert event is not None
    ScaleEvent.objects.filter(pk=event.pk).update(created_at=timezone.now() - timedelta(seconds=42))
    started = reconciler.reconcile(dep).started
    assert sorted(event.placed_workers.values_list("pk", flat=True)) == sorted(started) and len(started) == 2
    worker_actions.report_healthy(started[0], health={"status": "healthy"})
    event.refresh_from_db()
    assert event.time_to_run_s is None  # one of its two workers still starts
    worker_actions.report_healthy(started[1], health={"status": "healthy"})
    event.refresh_from_db()
    assert event.time_to_run_s == pytest.approx(42, abs=5)
    # A health answer later (already RUNNING) changes nothing.
    worker_actions.report_healthy(started[1], health={"status": "healthy"})
    assert ScaleEvent.objects.get(pk=event.pk).time_to_run_s == event.time_to_run_s


def test_failed_and_drained_workers_are_recorded_as_recovery_and_re_placed() -> None:

    first = online_node(name="first")
    online_node(name="second")
    dep = make_deployment(decode_replicas=1, prefill_replicas=0, prefill_min=0)
    [crashing] = reconciler.reconcile(dep).started
    worker_actions.report_failed(crashing, error="Traceback ...\nRuntimeError: boom")
    [failed] = refusals(dep)
    assert failed.reason.startswith(f"failover: decode worker #{crashing} failed after repeated crashes")
    assert (failed.from_replicas, failed.to_replicas) == (1, 0)
    [replacement] = reconciler.reconcile(dep).started
    assert list(failed.placed_workers.values_list("pk", flat=True)) == [replacement]
    assert Worker.objects.get(pk=replacement).node.name == "second"  # the failed node is avoided

    Worker.objects.filter(pk=replacement).update(status="running")
    node_workers.drain_node(Node.objects.get(name="second"))
    drained = refusals(dep)[-1]
    assert drained.reason.startswith("re-placement: node second drained") and f"#{replacement}" in drained.reason
    with override_settings(CONTROLLER_FAILURE_COOLDOWN_S=0):
        [again] = reconciler.reconcile(dep).started
    assert list(drained.placed_workers.values_list("pk", flat=True)) == [again]
    assert Worker.objects.get(pk=again).node_id == first.pk


def test_a_worker_stopped_by_hand_is_re_placed_with_a_recovery_event_but_a_first_start_is_not() -> None:
    online_node()
    dep = make_deployment(decode_replicas=1, prefill_replicas=0, prefill_min=0)
    ScaleEvent.objects.filter(deployment=dep).delete()  # no creation event: the first start records none
    reconciler.reconcile(dep)
    assert refusals(dep) == []
    Deployment.objects.filter(pk=dep.pk).update(decode_replicas=2)  # raised without an event: no recovery
    [extra] = reconciler.reconcile(dep).started
    assert refusals(dep) == []
    Worker.objects.filter(pk=extra).update(status="stopped", updated_at=timezone.now())  # stopped by hand
    [second] = reconciler.reconcile(dep).started
    [event] = refusals(dep)
    assert event.reason.startswith("re-placement: decode worker(s) placed") and event.to_replicas == 2
    assert list(event.placed_workers.values_list("pk", flat=True)) == [second]


def test_pending_start_requests_are_sent_again(
    sent_tasks: SentTasks, django_capture_on_commit_callbacks  # noqa: F811
) -> None:
    node = online_node()
    dep = make_deployment(decode_replicas=1, prefill_replicas=0, prefill_min=0)
    stuck = make_worker(dep, node, role="decode", status="pending")
    Worker.objects.filter(pk=stuck.pk).update(updated_at=timezone.now() - timedelta(minutes=5))
    with django_capture_on_commit_callbacks(execute=True):
        result = reconciler.reconcile(dep)
    assert result.resent == [stuck.pk] and result.started == []
    assert sent_tasks.named("start_worker") == [({"worker_id": stuck.pk}, node.queue_name)]


# ------------------------------------------------------------------------------------------ tasks
def test_scale_task_records_an_event_and_reconciles(
    sent_tasks: SentTasks, django_capture_on_commit_callbacks  # noqa: F811
) -> None:
    from inference.tasks import scale_deployment_task

    dep = make_deployment(decode_replicas=1, decode_max=3)
    with django_capture_on_commit_callbacks(execute=True):
        event_id = scale_deployment_task(deployment_id=dep.pk, role="decode", replicas=9, source="api",
                                         reason="traffic")
    event = ScaleEvent.objects.get(pk=event_id)
    assert (event.source, event.from_replicas, event.to_replicas) == ("api", 1, 3)
    assert sent_tasks.named("reconcile_deployment") == [({"deployment_id": dep.pk}, None)]
    assert scale_deployment_task(deployment_id=10**9, role="decode", replicas=1, source="api", reason="") is None


def test_setup_schedules_is_idempotent() -> None:
    from django.core.management import call_command
    from django_celery_beat.models import PeriodicTask

    call_command("setup_schedules", stdout=open("/dev/null", "w"))  # noqa: SIM115
    call_command("setup_schedules", stdout=open("/dev/null", "w"))  # noqa: SIM115
    tasks = {t.task: t for t in PeriodicTask.objects.filter(name__startswith="platform: ")}
    assert len(tasks) == 6
    every = {name: (t.interval.every, t.interval.period) for name, t in tasks.items()}
    assert every == {
        "inference.tasks.collect_metrics": (5, "seconds"),
        "inference.tasks.evaluate_scaling_rules": (10, "seconds"),
        "inference.tasks.check_node_heartbeats": (5, "seconds"),
        "inference.tasks.reconcile_all": (30, "seconds"),
        "inference.tasks.prune_metrics": (1, "hours"),
        "inference.tasks.prune_workers": (1, "hours"),
    }
    assert all(t.enabled for t in tasks.values())


# ------------------------------------------------------------------------------------------ metrics
class FakeWorkerState:
    """Counters a fake worker reports; the test advances them between scrapes."""

    def __init__(self) -> None:
        self.ttft = (0.0, 0)
        self.itl = (0.0, 0)
        self.tokens = 0.0
        self.health = {"status": "healthy", "cpu_utilization": 0.5, "role": "decode", "queue_depth": 1,
                       "running": 2, "kv_usage": 0.25}

    def metrics(self) -> str:
        lines = []
        for name, (total, count) in (("worker_time_to_first_token_seconds", self.ttft),
                                     ("worker_inter_token_latency_seconds", self.itl)):
            lines += [f"# TYPE {name} histogram",
                      f'{name}_bucket{{le="+Inf",model="m",role="decode"}} {count}',
                      f'{name}_count{{model="m",role="decode"}} {count}',
                      f'{name}_sum{{model="m",role="decode"}} {total}']
        lines += ["# TYPE worker_generation_tokens counter",
                  f'worker_generation_tokens_total{{model="m",role="decode"}} {self.tokens}',
                  "# TYPE worker_queue_depth gauge", 'worker_queue_depth{model="m",role="decode"} 1.0',
                  "# TYPE worker_running_requests gauge", 'worker_running_requests{model="m",role="decode"} 2.0',
                  "# TYPE worker_kv_cache_usage_ratio gauge",
                  'worker_kv_cache_usage_ratio{model="m",role="decode"} 0.25',
                  "# TYPE worker_cpu_utilization_ratio gauge",
                  'worker_cpu_utilization_ratio{model="m",role="decode"} 0.5']
        return "\n".join(lines) + "\n"


@pytest.fixture
def fake_worker() -> Iterator[tuple[int, FakeWorkerState]]:
    state = FakeWorkerState()

    class Handler(QuietHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/metrics":
                self.reply(200, state.metrics().encode(), "text/plain")
            else:
                self.reply(200, json.dumps(state.health).encode())

    with serving(Handler) as port:
        yield port, state


def test_collect_metrics_turns_counter_deltas_into_samples(fake_worker: tuple[int, FakeWorkerState]) -> None:
    port, state = fake_worker
    node = online_node(address="127.0.0.1")
    dep = make_deployment(batch_size=4)
    worker = make_worker(dep, node, role="decode", port=port, status="running", last_health={}, pid=77)
    state.ttft, state.itl, state.tokens = (2.0, 10), (1.0, 100), 1000.0
    now = timezone.now()
    assert collector.collect(now=now) == 2  # both roles of the active deployment
    first = MetricSample.objects.get(deployment=dep, role="decode")
    assert first.ttft_s is None and first.throughput_tps == 0.0  # no previous scrape to subtract
    assert (first.workers, first.queue_depth, first.running, first.kv_usage) == (1, 1.0, 2.0, 0.25)
    assert first.load == pytest.approx(0.75) and first.cpu_utilization == 0.5
    stored = Worker.objects.get(pk=worker.pk)
    assert stored.last_health["running"] == 2 and stored.last_metrics["counters"]["generation_tokens"] == 1000.0

    # Ten requests with 0.5 s TTFT each and 400 tokens since: means from the deltas.
    previous = dict(stored.last_metrics)
    previous["at"] -= 400.0  # pretend the first scrape was 400 s ago (the real gap is negligible)
    Worker.objects.filter(pk=worker.pk).update(last_metrics=previous)
    state.ttft, state.itl, state.tokens = (7.0, 20), (3.0, 300), 1400.0
    collector.collect(now=now + timedelta(seconds=5))
    second = MetricSample.objects.filter(deployment=dep, role="decode").order_by("-at").first()
    assert second is not None
    assert second.ttft_s == pytest.approx(0.5)
    assert second.itl_s == pytest.approx(0.01)
    assert second.throughput_tps == pytest.approx(1.0, rel=0.02)  # 400 tokens in 400 s
    empty = MetricSample.objects.filter(deployment=dep, role="prefill").first()
    assert empty is not None and empty.workers == 0 and empty.ttft_s is None

    # A restarted worker (new pid, counters from zero) counts from zero, never negative.
    Worker.objects.filter(pk=worker.pk).update(pid=78)
    state.ttft, state.itl, state.tokens = (0.3, 1), (0.0, 0), 10.0
    collector.collect(now=now + timedelta(seconds=10))
    third = MetricSample.objects.filter(deployment=dep, role="decode").order_by("-at").first()
    assert third is not None and third.ttft_s == pytest.approx(0.3) and third.throughput_tps >= 0


def test_unreachable_workers_are_skipped() -> None:
    node = online_node(address="127.0.0.1")
    dep = make_deployment()
    make_worker(dep, node, role="prefill", port=1, status="running")  # nothing listens on port 1
    assert collector.collect() == 2
    sample = MetricSample.objects.get(deployment=dep, role="prefill")
    assert sample.workers == 1 and sample.running == 0.0
