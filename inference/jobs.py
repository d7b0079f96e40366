"""The one way the control plane enqueues Celery work: by task name, on commit, with one failure policy.

Actions and views never import a task module: they name the task (the constants below) and `jobs`
publishes it through the project's Celery app (`send_task`), so tasks import actions and never the
reverse. CELERY_TASK_ROUTES still applies (agent tasks go to their node's queue `node.<name>`).

- `enqueue(name, ...)`: publish once the current transaction commits (at once outside one), so the
  task reads what the caller wrote. A broker outage is logged, not raised: the change is committed
  and the periodic safety nets carry it out later (the controller's `reconcile_all`, each agent's
  comparison of its processes with the database).
- `send(name, ...)`: publish now and return the task id, raising `JobNotQueued` when the broker does
  not take the message; for callers whose message *is* the change (the queued scale), which must
  answer 503 and roll back their transaction instead.
With CELERY_TASK_ALWAYS_EAGER the task runs in this process instead, as `.delay()` would.
"""
from __future__ import annotations

import logging
from typing import Any

from django.db import transaction

from config.celery import app

logger = logging.getLogger(__name__)

# Controller tasks (inference.tasks, queue "control").
RECONCILE_DEPLOYMENT = "inference.tasks.reconcile_deployment"
SCALE_DEPLOYMENT = "inference.tasks.scale_deployment_task"

# Agent tasks (inference.agent.tasks, queue "node.<name>"); the agent also accepts their previous names
# (`nodes.tasks.*`, see inference.agent.tasks.LEGACY_NAMES) for one release.
START_WORKER = "inference.agent.tasks.start_worker"
STOP_WORKER = "inference.agent.tasks.stop_worker"
RESTART_WORKER = "inference.agent.tasks.restart_worker"

TASK_NAMES = (RECONCILE_DEPLOYMENT, SCALE_DEPLOYMENT, START_WORKER, STOP_WORKER, RESTART_WORKER)


class JobNotQueued(RuntimeError):
    """The broker did not take a task's message (down, unreachable, refusing)."""


def send(name: str, *, queue: str | None = None, **kwargs: Any) -> str:
    """Publish task `name` with keyword arguments `kwargs` now; returns the task id.

    `queue` None lets CELERY_TASK_ROUTES and the default queue decide. Raises JobNotQueued when
    the broker does not take it (kombu and redis raise many types: all of them end up here).
    """
    if name not in TASK_NAMES:
        raise ValueError(f"unknown task {name!r}: jobs sends only {', '.join(TASK_NAMES)}")
    try:
        if app.conf.task_always_eager:
            app.loader.import_default_modules()  # the task modules, as a Celery worker imports them
            return str(app.tasks[name].apply(kwargs=kwargs).id)
        # No one reads a task's result: without ignore_result the sender subscribes to its result channel,
        # and Celery's Redis result consumer gives up for good after a broker restart (every later send
        # fails with "The Celery application must be restarted").
        return str(app.send_task(name, kwargs=kwargs, queue=queue, ignore_result=True).id)
    except Exception as exc:  # any broker failure is the same refusal to the caller
        raise JobNotQueued(f"could not queue {name}: {exc}") from exc


def enqueue(name: str, *, queue: str | None = None, **kwargs: Any) -> None:
    """Publish task `name` once the current transaction commits; a broker failure is logged only.

    The caller's change is committed by then; the periodic reconcile and agent sync carry it out
    when the broker is back, so a broker outage never turns a saved change into an error.
    """

    def publish() -> None:
        try:
            send(name, queue=queue, **kwargs)
        except JobNotQueued:
            logger.exception("%s not enqueued (%s); the periodic reconcile and agent sync catch up", name, kwargs)

    transaction.on_commit(publish)


def reconcile_on_commit(*deployment_ids: int) -> None:
    """Ask the controller to reconcile each deployment once the current transaction commits."""
    for deployment_id in sorted(set(deployment_ids)):
        enqueue(RECONCILE_DEPLOYMENT, deployment_id=deployment_id)
