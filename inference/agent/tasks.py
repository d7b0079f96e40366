"""Celery tasks run by a node's agent, on its own queue `node.<name>` (never on "control").

They are registered as `inference.agent.tasks.<name>` (inference.jobs names them so). Until the next
release they are also registered under the names they had when the agent lived in the `nodes` app
(`nodes.tasks.start_worker`, ...; LEGACY_NAMES): those run the same code, so messages queued before an
upgrade and controllers of the previous release keep working. config/celery.py registers this module
(it is not an app's `tasks` module).

The control side sends them through `inference.actions.workers` (request_start/request_stop/restart_worker),
which names the node's queue; `route_node_task` (CELERY_TASK_ROUTES) routes them, under either name, there
too when someone sends one without a queue. The tasks only hand the request to this process's supervisor,
which does the work in its own thread (inference.agent.supervisor), so they return at once.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery import shared_task

from inference.agent.runtime import get_supervisor
from inference.models import Worker

logger = logging.getLogger(__name__)

PREFIX = "inference.agent.tasks."
# Accepted (not sent) for one release: the agent tasks' names before they moved out of the `nodes` app.
LEGACY_PREFIX = "nodes.tasks."


def start_worker(*, worker_id: int) -> str:
    """Launch the worker's process on this node (no-op if it runs already or is no longer live)."""
    outcome = get_supervisor().request_start(worker_id)
    logger.info("start_worker #%s: %s", worker_id, outcome)
    return outcome


def stop_worker(*, worker_id: int, drain: bool) -> str:
    """Stop the worker's process; with `drain`, once it has nothing in flight (bounded by the drain timeout)."""
    outcome = get_supervisor().request_stop(worker_id, drain=drain)
    logger.info("stop_worker #%s (drain=%s): %s", worker_id, drain, outcome)
    return outcome


def restart_worker(*, worker_id: int) -> str:
    """Restart the worker's process (SIGTERM, then launch again; counts one restart)."""
    outcome = get_supervisor().request_restart(worker_id)
    logger.info("restart_worker #%s: %s", worker_id, outcome)
    return outcome


def _register(run: Callable[..., str]) -> tuple[Any, Any]:
    """The task under its name, and its alias under the legacy name (the same function)."""
    current = shared_task(name=PREFIX + run.__name__, ignore_result=True)(run)
    legacy = shared_task(name=LEGACY_PREFIX + run.__name__, ignore_result=True)(run)
    return current, legacy


start_worker_task, legacy_start_worker = _register(start_worker)
stop_worker_task, legacy_stop_worker = _register(stop_worker)
restart_worker_task, legacy_restart_worker = _register(restart_worker)
LEGACY_NAMES = tuple(task.name for task in (legacy_start_worker, legacy_stop_worker, legacy_restart_worker))
def route_node_task(
    name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **kw: Any
) -> dict[str, str] | None:
    """Celery router: send agent tasks (either name) to the queue of the worker's node, whatever the caller passed."""
    if not name.startswith((PREFIX, LEGACY_PREFIX)) or not isinstance(kwargs, dict) or "worker_id" not in kwargs:
        return None
    queue = options.get("queue")
    if str(getattr(queue, "name", queue) or "").startswith("node."):
        return None  # inference.actions.workers named the queue already
    node_name = Worker.objects.filter(pk=kwargs["worker_id"]).values_list("node__name", flat=True).first()
    return {"queue": f"node.{node_name}"} if node_name else None
