"""inference.controller (placement, reconcile, heartbeats), the metrics collector and the controller's tasks."""
from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.utils import timezone

from inference import collector, controller
from inference.models import Deployment, MetricSample, ScaleEvent
from nodes.models import Node, NodeStatus, Worker, WorkerStatus
from tests.support.celery_capture import SentTasks, sent_tasks  # noqa: F401  (fixture)
from tests.support.control_plane import make_deployment, make_node, make_worker

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
    prefill = controller.place_worker(dep, "prefill")
    decode = controller.place_worker(dep, "decode")
    assert prefill is not None and decode is not None
    assert (prefill.node_id, prefill.port, prefill.kv_port, prefill.status) == (node.pk, 31000, None, "pending")
    assert (decode.port, decode.kv_port) == (31001, 31002)  # decode also gets its KV port from the range
    assert prefill.cpu_ids == [0, 1] and decode.cpu_ids == [2, 3]  # the roles do not share cores
    assert prefill.gpu_ids == [] and decode.gpu_ids == []
    third = controller.place_worker(dep, "decode")
    assert third is not None and third.port == 31003 and third.kv_port == 31004
    assert third.cpu_ids == [2, 3]  # oversubscribed: shares with its own role, not with prefill


def test_choose_cpus_spreads_roles() -> None:
    assert controller.choose_cpus(8, 1, "prefill", []) == [0]
    assert controller.choose_cpus(8, 1, "decode", []) == [7]
    assert controller.choose_cpus(2, 4, "decode", []) == [0, 1]  # clipped to the host


def test_nodes_that_do_not_fit_are_skipped() -> None:
    dep = make_deployment()
    now = timezone.now()
    online_node(name="stale", last_heartbeat=now - timedelta(minutes=5))
    online_node(name="offline", status=NodeStatus.OFFLINE)
    online_node(name="draining", status=NodeStatus.DRAINING)
    online_node(name="prefill-only", labels={"roles": ["prefill"]})
    full = online_node(name="full", port_range_start=32000, port_range_end=32000)
    make_worker(dep, full, port=32000)
    assert controller.place_worker(dep, "decode") is None
    # One free port is enough for prefill but not for decode (HTTP + KV).
    spare = online_node(name="one-port", port_range_start=33000, port_range_end=33000)
    assert controller.place_worker(dep, "decode") is None
    worker = controller.place_worker(dep, "prefill")
    assert worker is not None and worker.node_id in {spare.pk, Node.objects.get(name="prefill-only").pk}


def test_role_labels_and_gpus_steer_placement() -> None:
    dep = make_deployment()
    gpu_host = online_node(name="gpu", gpus=[{"index": 0, "name": "H100", "memory_bytes": 1}, {"index": 1}])
    cpu_host = online_node(name="cpu")
    first = controller.place_worker(dep, "prefill")
    second = controller.place_worker(dep, "prefill")
    third = controller.place_worker(dep, "prefill")
    assert first is not None and second is not None and third is not None
    assert (first.node_id, first.gpu_ids) == (gpu_host.pk, [0])
    assert (second.node_id, second.gpu_ids) == (gpu_host.pk, [1])
    assert (third.node_id, third.gpu_ids) == (cpu_host.pk, [])  # GPUs used up: a CPU host next
    decode = controller.place_worker(dep, "decode")
    assert decode is not None and decode.node_id == cpu_host.pk  # decode keeps off GPU hosts
    labelled = online_node(name="decode-box", labels={"roles": "decode"})
    decode2 = controller.place_worker(dep, "decode")
    assert decode2 is not None and decode2.node_id == labelled.pk  # a node labelled for the role first


def test_a_node_that_just_failed_a_replica_is_avoided() -> None:
    dep = make_deployment()
    bad = online_node(name="a-bad")
    good = online_node(name="b-good")
    make_worker(dep, bad, role="decode", status="failed")
    worker = controller.place_worker(dep, "decode")
    assert worker is not None and worker.node_id == good.pk
    Node.objects.filter(pk=good.pk).update(status=NodeStatus.OFFLINE)
    assert controller.place_worker(dep, "decode") is None  # only the failing node left: wait for the cooldown
    Worker.objects.filter(status="failed").update(updated_at=timezone.now() - timedelta(hours=1))
    later = controller.place_worker(dep, "decode")
    assert later is not None and later.node_id == bad.pk


# ------------------------------------------------------------------------------------------ reconcile
def test_reconcile_up_places_and_sends_start_to_the_node_queue(
    sent_tasks: SentTasks, django_capture_on_commit_callbacks  # noqa: F811
) -> None:
    node = online_node(name="host-a")
    dep = make_deployment(prefill_replicas=1, decode_replicas=2)
    with django_capture_on_commit_callbacks(execute=True):
        result = controller.reconcile(dep)
    assert len(result.started) == 3 and not result.unplaced
    assert len(live(dep, "prefill")) == 1 and len(live(dep, "decode")) == 2
    starts = sent_tasks.named("start_worker")
    assert sorted(kw["worker_id"] for kw, _ in starts) == sorted(result.started)
    assert {queue for _, queue in starts} == {"node.host-a"}
    sent_tasks.clear()
    with django_capture_on_commit_callbacks(execute=True):
        again = controller.reconcile(dep)  # nothing to do the second time
    assert again.started == [] and sent_tasks.calls == []
    assert node.workers.count() == 3


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
        result = controller.reconcile(dep)
    assert result.stopped == [sick.pk] and result.draining == []
    Deployment.objects.filter(pk=dep.pk).update(decode_replicas=1)
    with django_capture_on_commit_callbacks(execute=True):
        result = controller.reconcile(dep)
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
        results = controller.reconcile_all()
    assert [r.deployment_id for r in results] == [dep.pk]
    assert Worker.objects.get(pk=running.pk).status == WorkerStatus.DRAINING
    assert Worker.objects.get(pk=pending.pk).status == WorkerStatus.STOPPING


def test_offline_node_workers_are_replaced_elsewhere(
    sent_tasks: SentTasks, django_capture_on_commit_callbacks  # noqa: F811
) -> None:
    dep = make_deployment(decode_replicas=1, prefill_replicas=0, prefill_min=0)
    silent = online_node(name="silent", last_heartbeat=timezone.now() - timedelta(seconds=60))
    alive = online_node(name="alive")
    lost = make_worker(dep, silent, role="decode")
    with django_capture_on_commit_callbacks(execute=True):
        gone = controller.check_node_heartbeats()
    assert [n.name for n in gone] == ["silent"]
    assert Node.objects.get(pk=silent.pk).status == NodeStatus.OFFLINE
    assert Worker.objects.get(pk=lost.pk).status == WorkerStatus.STOPPED
    assert sent_tasks.named("reconcile_deployment") == [({"deployment_id": dep.pk}, None)]
    with django_capture_on_commit_callbacks(execute=True):
        result = controller.reconcile(dep)
    [replacement] = live(dep, "decode")
    assert replacement.node_id == alive.pk and result.started == [replacement.pk]
    assert controller.check_node_heartbeats() == []  # an OFFLINE node is not reported twice


def test_workers_left_on_a_node_set_offline_by_hand_are_replaced() -> None:
    dep = make_deployment(decode_replicas=1, prefill_replicas=0, prefill_min=0)
    dead = online_node(name="dead", status=NodeStatus.OFFLINE)
    fine = online_node(name="fine")
    lost = make_worker(dep, dead, role="decode")
    result = controller.reconcile(dep)
    assert result.stopped == [lost.pk]
    assert [w.node_id for w in live(dep, "decode")] == [fine.pk]


def test_pending_start_requests_are_sent_again(
    sent_tasks: SentTasks, django_capture_on_commit_callbacks  # noqa: F811
) -> None:
    node = online_node()
    dep = make_deployment(decode_replicas=1, prefill_replicas=0, prefill_min=0)
    stuck = make_worker(dep, node, role="decode", status="pending")
    Worker.objects.filter(pk=stuck.pk).update(updated_at=timezone.now() - timedelta(minutes=5))
    with django_capture_on_commit_callbacks(execute=True):
        result = controller.reconcile(dep)
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
    assert len(tasks) == 5
    every = {name: (t.interval.every, t.interval.period) for name, t in tasks.items()}
    assert every == {
        "inference.tasks.collect_metrics": (5, "seconds"),
        "inference.tasks.evaluate_scaling_rules": (10, "seconds"),
        "inference.tasks.check_node_heartbeats": (5, "seconds"),
        "inference.tasks.reconcile_all": (30, "seconds"),
        "inference.tasks.prune_metrics": (1, "hours"),
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

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/metrics":
                body, kind = state.metrics().encode(), "text/plain"
            else:
                body, kind = json.dumps(state.health).encode(), "application/json"
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1]), state
    finally:
        server.shutdown()
        server.server_close()


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
