"""nodes.actions (registration, heartbeats), inference.actions.workers and inference.actions.nodes
(offline/drain, restart requests and the agents' conditional reports), and the agent tasks' names."""
from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from config.celery import app
from inference import jobs
from inference.actions import nodes as node_workers
from inference.actions import workers as worker_actions
from inference.agent import tasks as agent_tasks
from inference.agent.runtime import NoSupervisor
from inference.agent.tasks import route_node_task
from inference.management.commands.setup_schedules import SCHEDULES
from inference.models import Worker, WorkerStatus
from nodes import actions as node_actions
from nodes.models import Node, NodeStatus
from nodes.resources import NodeResources
from tests.support.celery_capture import SentTasks, sent_tasks  # noqa: F401  (fixture)
from tests.support.control_plane import make_deployment, make_node, make_worker

pytestmark = pytest.mark.django_db

RES = NodeResources(hostname="h1", cpu_count=16, memory_bytes=64 * 2**30,
                    gpus=[{"index": 0, "name": "H100", "memory_bytes": 80 * 2**30}], rdma_devices=[],
                    rdma_note="no verbs")


def test_register_creates_then_updates_and_keeps_a_drain() -> None:
    node = node_actions.register_node(name="n1", address="10.0.0.1", resources=RES, port_range=(31000, 31099),
                                 labels={"roles": ["prefill"]})
    assert (node.status, node.cpu_count, node.port_range_start, node.port_range_end) == ("online", 16, 31000, 31099)
    assert node.gpus[0]["name"] == "H100" and node.rdma_note == "no verbs" and node.labels == {"roles": ["prefill"]}
    assert node.last_heartbeat is not None and node.queue_name == "node.n1"
    Node.objects.filter(pk=node.pk).update(status=NodeStatus.DRAINING)
    again = node_actions.register_node(name="n1", address="10.0.0.2", resources=RES)
    assert again.pk == node.pk and again.address == "10.0.0.2"
    assert again.status == NodeStatus.DRAINING  # an agent restart does not undo an operator's drain
    assert again.labels == {"roles": ["prefill"]}  # labels=None keeps them
    Node.objects.filter(pk=node.pk).update(status=NodeStatus.OFFLINE)
    assert node_actions.register_node(name="n1", address="10.0.0.2", resources=RES).status == NodeStatus.ONLINE
    with pytest.raises(ValueError):
        node_actions.register_node(name="n2", address="x", resources=RES, port_range=(10, 5))


def test_heartbeat_stamps_and_brings_an_offline_node_back() -> None:
    node = make_node(status=NodeStatus.OFFLINE, last_heartbeat=timezone.now() - timedelta(hours=1))
    assert node_actions.heartbeat(node.pk, metrics={"cpu_utilization": 0.5}) is node_actions.Beat.BACK
    node.refresh_from_db()
    assert node.status == NodeStatus.ONLINE
    assert node.last_metrics == {"cpu_utilization": 0.5}
    assert timezone.now() - node.last_heartbeat < timedelta(seconds=5)
    assert node_actions.heartbeat(10**9) is node_actions.Beat.GONE  # deleted node
    assert node_actions.heartbeat(node.pk) is node_actions.Beat.ALIVE  # ONLINE already
    unreachable = make_node(status=NodeStatus.UNREACHABLE, last_heartbeat=timezone.now() - timedelta(hours=1))
    assert node_actions.heartbeat(unreachable.pk) is node_actions.Beat.BACK
    unreachable.refresh_from_db()
    assert unreachable.status == NodeStatus.ONLINE  # its agent is back (and adopts the workers)
    draining = make_node(status=NodeStatus.DRAINING)
    assert node_workers.mark_node_unreachable(draining, reason="silent") == []
    assert Node.objects.get(pk=draining.pk).status == NodeStatus.DRAINING  # an operator's drain is kept


def test_mark_offline_stops_live_workers_and_reconciles(
    sent_tasks: SentTasks, django_capture_on_commit_callbacks  # noqa: F811
) -> None:
    node = make_node()
    dep = make_deployment()
    running = make_worker(dep, node, status="running")
    pending = make_worker(dep, node, status="pending", role="decode")
    old = make_worker(dep, node, status="failed")
    with django_capture_on_commit_callbacks(execute=True):
        given_up = node_workers.mark_node_offline(node, reason="silent")
    assert {w.pk for w in given_up} == {running.pk, pending.pk}
    node.refresh_from_db()
    assert node.status == NodeStatus.OFFLINE
    for worker in (running, pending):
        worker.refresh_from_db()
        assert worker.status == WorkerStatus.STOPPED
        assert "offline" in worker.last_error
        assert worker.pid is not None or worker.pk == pending.pk  # kept for the agent to clean up
    old.refresh_from_db()
    assert old.status == WorkerStatus.FAILED
    assert sent_tasks.named("reconcile_deployment") == [({"deployment_id": dep.pk}, None)]


def test_drain_node(sent_tasks: SentTasks, django_capture_on_commit_callbacks) -> None:  # noqa: F811
    node = make_node(name=f"drain-{uuid.uuid4().hex[:6]}")
    dep = make_deployment()
    running = make_worker(dep, node, status="running")
    starting = make_worker(dep, node, status="starting")
    with django_capture_on_commit_callbacks(execute=True):
        node_workers.drain_node(node)
    node.refresh_from_db()
    assert node.status == NodeStatus.DRAINING
    running.refresh_from_db()
    starting.refresh_from_db()
    assert running.status == WorkerStatus.DRAINING
    assert starting.status == WorkerStatus.STOPPING
    stops = sorted(sent_tasks.named("stop_worker"), key=lambda c: c[0]["worker_id"])
    assert stops == [
        ({"worker_id": running.pk, "drain": True}, node.queue_name),
        ({"worker_id": starting.pk, "drain": False}, node.queue_name),
    ]
    assert sent_tasks.named("reconcile_deployment") == [({"deployment_id": dep.pk}, None)]
    assert node_actions.activate_node(node).status == NodeStatus.ONLINE


def test_restart_worker_goes_to_the_node_queue(sent_tasks: SentTasks, django_capture_on_commit_callbacks) -> None:  # noqa: F811
    node = make_node()
    worker = make_worker(make_deployment(), node)
    with django_capture_on_commit_callbacks(execute=True):
        worker_actions.restart_worker(worker)
    assert sent_tasks.named("restart_worker") == [({"worker_id": worker.pk}, node.queue_name)]
    Worker.objects.filter(pk=worker.pk).update(status=WorkerStatus.STOPPED)
    with pytest.raises(ValueError, match="stopped"):
        worker_actions.restart_worker(worker)
    live = make_worker(worker.deployment, make_node(status=NodeStatus.OFFLINE))
    with pytest.raises(ValueError, match="offline"):
        worker_actions.restart_worker(live)


def test_reports_are_conditional() -> None:
    node = make_node()
    worker = make_worker(make_deployment(), node, status="pending", pid=None, role="decode")
    assert worker_actions.report_launched(worker.pk, pid=111, restart=False)
    worker.refresh_from_db()
    assert (worker.status, worker.pid, worker.restarts) == ("starting", 111, 0)
    health = {"status": "healthy", "running": 0, "queue_depth": 0}
    assert worker_actions.report_healthy(worker.pk, health=health, kv_port=31234)
    worker.refresh_from_db()
    assert (worker.status, worker.kv_port, worker.last_health) == ("running", 31234, health)
    assert worker.last_seen is not None
    assert worker_actions.report_unhealthy(worker.pk, error="no answer")
    assert worker_actions.report_healthy(worker.pk, health=health)  # UNHEALTHY → RUNNING again
    assert worker_actions.report_crashed(worker.pk, error="exit -9")
    worker.refresh_from_db()
    assert (worker.status, worker.pid) == ("unhealthy", None)
    assert worker_actions.report_launched(worker.pk, pid=222, restart=True)
    worker.refresh_from_db()
    assert (worker.pid, worker.restarts) == (222, 1)

    # The controller started draining it: health answers do not make it RUNNING again.
    Worker.objects.filter(pk=worker.pk).update(status=WorkerStatus.DRAINING)
    assert worker_actions.report_healthy(worker.pk, health=health) is False
    assert Worker.objects.get(pk=worker.pk).status == WorkerStatus.DRAINING
    # Given up on (node offline): a late launch report does not revive it.
    Worker.objects.filter(pk=worker.pk).update(status=WorkerStatus.STOPPED)
    assert worker_actions.report_launched(worker.pk, pid=333, restart=True) is False
    assert worker_actions.report_crashed(worker.pk, error="x") is False
    assert Worker.objects.get(pk=worker.pk).status == WorkerStatus.STOPPED
    assert worker_actions.report_stopped(worker.pk)
    assert Worker.objects.get(pk=worker.pk).pid is None


def test_report_failed_reconciles(sent_tasks: SentTasks, django_capture_on_commit_callbacks) -> None:  # noqa: F811
    worker = make_worker(make_deployment(), make_node(), status="unhealthy")
    with django_capture_on_commit_callbacks(execute=True):
        assert worker_actions.report_failed(worker.pk, error="gave up after 6 crashes")
    worker.refresh_from_db()
    assert (worker.status, worker.pid) == ("failed", None)
    assert "gave up" in worker.last_error
    assert sent_tasks.named("reconcile_deployment") == [({"deployment_id": worker.deployment_id}, None)]
    # FAILED stays FAILED when the agent later reports the process gone.
    worker_actions.report_stopped(worker.pk)
    assert Worker.objects.get(pk=worker.pk).status == WorkerStatus.FAILED


@pytest.mark.parametrize("name", ["inference.agent.tasks.start_worker", "nodes.tasks.start_worker"])
def test_node_tasks_are_routed_to_the_node_queue(name: str) -> None:
    """Under its name and under its legacy name (messages of the previous release), an agent task
    goes to the queue of the worker's node."""
    node = make_node(name="router-test")
    worker = make_worker(make_deployment(), node)
    assert route_node_task(name, (), {"worker_id": worker.pk}, {}) == {"queue": "node.router-test"}
    assert route_node_task("inference.tasks.reconcile_all", (), {}, {}) is None
    assert route_node_task(name, (), {"worker_id": 10**9}, {}) is None
    assert route_node_task(name, (), {"worker_id": worker.pk}, {"queue": "node.elsewhere"}) is None  # named already


def test_agent_tasks_answer_to_both_names() -> None:
    """The agent tasks are registered as inference.agent.tasks.* and, for one release, under their old
    names nodes.tasks.* (queued messages, agents and controllers of the previous release): the same code."""
    app.loader.import_default_modules()  # what a Celery worker does at start: autodiscovery
    for short in ("start_worker", "stop_worker", "restart_worker"):
        current, legacy = app.tasks[f"inference.agent.tasks.{short}"], app.tasks[f"nodes.tasks.{short}"]
        assert current.__module__ == legacy.__module__ == "inference.agent.tasks"
        assert current.run is legacy.run is getattr(agent_tasks, short)
        assert f"nodes.tasks.{short}" in agent_tasks.LEGACY_NAMES
    assert {jobs.START_WORKER, jobs.STOP_WORKER, jobs.RESTART_WORKER} <= set(app.tasks)
    # Outside an agent both names fail the same way: the request reached the task's code.
    for name in ("inference.agent.tasks.start_worker", "nodes.tasks.start_worker"):
        with pytest.raises(NoSupervisor):
            app.tasks[name].run(worker_id=1)


def test_every_task_jobs_sends_is_registered_and_beat_names_survive() -> None:
    """inference.jobs sends tasks by name: each name is a task of the app; beat schedules inference.tasks.*."""
    app.loader.import_default_modules()
    for name in jobs.TASK_NAMES:
        assert name in app.tasks, name
    for _, task_name, _, _ in SCHEDULES:
        assert app.tasks[task_name].__module__ == "inference.tasks"


@pytest.mark.django_db(transaction=True)
def test_start_request_reaches_the_node_queue_on_the_real_broker() -> None:
    """Through the configured broker (Redis with REDIS_URL, else the filesystem one): queue node.<name>."""
    name = f"q-{uuid.uuid4().hex[:8]}"
    node = make_node(name=name)
    worker = make_worker(make_deployment(), node, status="pending")
    worker_actions.request_start(worker)  # autocommit: sent at once
    with app.connection_for_read() as conn:
        queue = conn.SimpleQueue(node.queue_name)
        try:
            message = queue.get(block=True, timeout=10)
            assert message.headers["task"] == "inference.agent.tasks.start_worker"
            body = message.decode()
            assert body[1] == {"worker_id": worker.pk}  # protocol 2: (args, kwargs, embed)
            message.ack()
        finally:
            queue.close()


@pytest.mark.django_db(transaction=True)
def test_a_message_under_the_legacy_name_reaches_the_node_queue_on_the_real_broker() -> None:
    """A controller of the previous release sends nodes.tasks.* without naming the queue: the route finds
    the worker's node queue, where this release's agent runs it (the alias above)."""
    node = make_node(name=f"q-{uuid.uuid4().hex[:8]}")
    worker = make_worker(make_deployment(), node, status="running")
    app.send_task("nodes.tasks.stop_worker", kwargs={"worker_id": worker.pk, "drain": False})
    with app.connection_for_read() as conn:
        queue = conn.SimpleQueue(node.queue_name)
        try:
            message = queue.get(block=True, timeout=10)
            assert message.headers["task"] == "nodes.tasks.stop_worker"
            assert message.decode()[1] == {"worker_id": worker.pk, "drain": False}
            message.ack()
        finally:
            queue.close()
