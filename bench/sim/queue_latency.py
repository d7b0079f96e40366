"""The controller's Celery queue latency, idle and under the periodic load of a fleet (issue 25 item 2).

`measure(deployment, seconds)` sends probes to the control queue every PROBE_INTERVAL_S: a scale task
that asks for the deployment's current decode count (a no-op: it reads the deployment under its lock
and records nothing), whose outcome the task stores in the result backend with its `date_done`. The
latency of a probe is `date_done` minus the moment it was sent: the broker, the wait in the queue
behind other tasks, and the no-op itself (a few ms). Two phases of `seconds` each, in one run:
- idle: the probes alone;
- loaded: the periodic tasks Celery beat sends a controller (inference/management/commands/
  setup_schedules.py: collect_metrics and check_node_heartbeats every 5 s, evaluate_scaling_rules every
  10 s, reconcile_all every 30 s), sent here on the same intervals, beside the probes: at 1,000
  workers a collector round keeps one of the controller's processes busy for seconds.
"""
from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from bench.common import percentile
from inference import jobs
from inference.models import Deployment

PROBE_INTERVAL_S = 0.5
# (task, every seconds): what setup_schedules makes beat send.
PERIODIC: tuple[tuple[str, float], ...] = (
    ("inference.tasks.collect_metrics", 5.0),
    ("inference.tasks.check_node_heartbeats", 5.0),
    ("inference.tasks.evaluate_scaling_rules", 10.0),
    ("inference.tasks.reconcile_all", 30.0),
)
RESULT_WAIT_S = 60.0


def _probe(deployment: Deployment) -> tuple[str, datetime]:
    replicas = Deployment.objects.get(pk=deployment.pk).decode_replicas
    sent = datetime.now(UTC)
    task_id = jobs.send("inference.tasks.scale_deployment_task", deployment_id=deployment.pk, role="decode",
                        source="manual", reason="queue latency probe", replicas=replicas)  # fmt: skip
    return task_id, sent


def _phase(deployment: Deployment, seconds: float, periodic: bool) -> dict[str, Any]:
    probes: list[tuple[str, datetime]] = []
    sent_periodic: dict[str, int] = {name: 0 for name, _ in PERIODIC} if periodic else {}
    due = {name: 0.0 for name, _ in PERIODIC}
    start = time.monotonic()
    while (elapsed := time.monotonic() - start) < seconds:
        for name, every in PERIODIC if periodic else ():
            if elapsed >= due[name]:
                # As beat sends them (jobs.send publishes only the tasks the platform's code sends).
                jobs.app.send_task(name, ignore_result=True)
                sent_periodic[name] += 1
                due[name] += every
        probes.append(_probe(deployment))
        time.sleep(PROBE_INTERVAL_S)
    latencies: list[float] = []
    lost = 0
    deadline = time.monotonic() + RESULT_WAIT_S
    for task_id, sent in probes:
        result = jobs.app.AsyncResult(task_id)
        while result.date_done is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if result.date_done is None:
            lost += 1
            continue
        done = result.date_done if result.date_done.tzinfo else result.date_done.replace(tzinfo=UTC)
        latencies.append((done - sent).total_seconds())
    return {"probes": len(probes), "not_done": lost, "periodic_sent": sent_periodic,
            "p50_s": percentile(latencies, 50), "p95_s": percentile(latencies, 95),
            "max_s": max(latencies, default=None)}  # fmt: skip


def measure(deployment: Deployment, *, seconds: float) -> dict[str, Any]:
    """Probe latencies idle, then under the periodic load (module doc)."""
    return {"probe_interval_s": PROBE_INTERVAL_S, "idle": _phase(deployment, seconds, periodic=False),
            "loaded": _phase(deployment, seconds, periodic=True)}  # fmt: skip
