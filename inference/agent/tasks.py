"""Celery tasks run by a node's agent, on its own queue `node.<name>` (never on "control").

They keep the names they were registered under when the agent lived in the `nodes` app
(`nodes.tasks.start_worker`, ...): messages already queued and agents of the previous release name them
so. config/celery.py registers this module (it is not an app's `tasks` module).

The control side sends them through `inference.worker_actions` (request_start/request_stop/restart_worker), which
names the node's queue; `route_node_task` (CELERY_TASK_ROUTES) routes them there too when someone calls
`.delay()` directly. The tasks only hand the request to this process's supervisor, which does the work
in its own thread (inference.agent.supervisor), so they return at once.
"""
from __future__ import annotations

import logging
from typing import Any

from celery import shared_task

from inference.agent.runtime import get_supervisor
from inference.models import Worker

logger = logging.getLogger(__name__)


@shared_task(name="nodes.tasks.start_worker", ignore_result=True)
def start_worker(*, worker_id: int) -> str:
    """Launch the worker's process on this node (no-op if it runs already or is no longer live)."""
    outcome = get_supervisor().request_start(worker_id)
    logger.info("start_worker #%s: %s", worker_id, outcome)
    return outcome


@shared_task(name="nodes.tasks.stop_worker", ignore_result=True)
def stop_worker(*, worker_id: int, drain: bool) -> str:
    """Stop the worker's process; with `drain`, once it has nothing in flight (bounded by the drain timeout)."""
    outcome = get_supervisor().request_stop(worker_id, drain=drain)
    logger.info("stop_worker #%s (drain=%s): %s", worker_id, drain, outcome)
    return outcome


@shared_task(name="nodes.tasks.restart_worker", ignore_result=True)
def restart_worker(*, worker_id: int) -> str:
    """Restart the worker's process (SIGTERM, then launch again; counts one restart)."""
    outcome = get_supervisor().request_restart(worker_id)
    logger.info("restart_worker #%s: %s", worker_id, outcome)
    return outcome


def route_node_task(
    name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **kw: Any
) -> dict[str, str] | None:
    """Celery router: send nodes.tasks.* to the queue of the worker's node, whatever the caller passed."""
    if not name.startswith("nodes.tasks.") or not isinstance(kwargs, dict) or "worker_id" not in kwargs:
        return None
    queue = options.get("queue")
    if str(getattr(queue, "name", queue) or "").startswith("node."):
        return None  # inference.worker_actions named the queue already
    node_name = Worker.objects.filter(pk=kwargs["worker_id"]).values_list("node__name", flat=True).first()
    return {"queue": f"node.{node_name}"} if node_name else None
