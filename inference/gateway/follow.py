"""Managed router mode: keep the router's pool equal to a deployment's RUNNING workers.

`python -m inference.launch_router --deployment NAME` sets ROUTER_DEPLOYMENT; the router then reads
the deployment's healthy workers, policy, kv-aware weights and local prefill threshold from the
control-plane database every ROUTER_FOLLOW_INTERVAL_S seconds and applies changes without a restart
(scale-ups join, drained and dead workers leave). `both` workers join the decode endpoints: they
prefill their own prompts.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from asgiref.sync import sync_to_async
from django.db import close_old_connections

from inference.models import Deployment, Worker, WorkerStatus
from inference.router import WorkerPool

logger = logging.getLogger(__name__)

# A `both` worker is a decode endpoint that prefills every prompt itself.
BOTH_JOINS = {"both": "decode"}


@dataclass(frozen=True)
class DeploymentView:
    """What the router needs of a deployment: its policy and the URLs of its RUNNING workers."""

    exists: bool
    policy: str
    prefill: list[str]
    decode: list[str]
    # The deployment's router settings; None (no deployment): the process's own ROUTER_* settings.
    kv_token_weight: float | None = None
    kv_load_weight: float | None = None
    local_prefill_tokens: int | None = None
    # Whether the deployment has a prefill role (replicas or a floor): its decode workers then never
    # prefill every prompt merely because no prefill worker is RUNNING yet.
    prefill_expected: bool | None = None


def read_deployment(name: str) -> DeploymentView:
    """The deployment's routing view from the database (sync ORM; call from a thread in async code)."""
    # No request cycle closes this thread's connection: drop it here once it is broken (a database restart)
    # or past CONN_MAX_AGE, or every later round fails with "the connection is closed".
    close_old_connections()
    deployment = Deployment.objects.filter(name=name).first()
    if deployment is None:
        # No deployment (yet): no endpoints, and the policy a new deployment would get.
        return DeploymentView(False, str(Deployment._meta.get_field("router_policy").get_default()), [], [])
    workers = Worker.objects.filter(deployment=deployment, status=WorkerStatus.RUNNING).select_related("node")
    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    for worker in workers:
        urls.setdefault(BOTH_JOINS.get(worker.role, worker.role), []).append(worker.url)
    return DeploymentView(True, deployment.router_policy, sorted(urls["prefill"]), sorted(urls["decode"]),
                          kv_token_weight=deployment.kv_token_weight, kv_load_weight=deployment.kv_load_weight,
                          local_prefill_tokens=deployment.local_prefill_tokens,
                          prefill_expected="prefill" in deployment.roles_in_use())


def apply_view(pool: WorkerPool, view: DeploymentView) -> None:
    """Make the pool route to exactly the view's workers with its policy."""
    pool.set_policy(view.policy)
    if view.kv_token_weight is not None and view.kv_load_weight is not None:
        pool.set_kv_weights(view.kv_token_weight, view.kv_load_weight)
    pool.local_prefill_tokens = view.local_prefill_tokens
    pool.prefill_expected = view.prefill_expected
    pool.set_endpoints("prefill", view.prefill)
    pool.set_endpoints("decode", view.decode)


def load_now(pool: WorkerPool, name: str, timeout_s: float = 10.0) -> DeploymentView:
    """Synchronously load the deployment into the pool (in a helper thread: safe from async code)."""
    with ThreadPoolExecutor(max_workers=1) as executor:
        view = executor.submit(read_deployment, name).result(timeout=timeout_s)
    if not view.exists:
        logger.warning("router follows deployment %r, which does not exist (yet)", name)
    apply_view(pool, view)
    return view


async def follow(pool: WorkerPool, name: str, interval_s: float) -> None:
    """Refresh the pool from the database forever; a failed round is logged and retried."""
    last: DeploymentView | None = None
    while True:  # for the life of the router process; each round is bounded by the DB timeout
        try:
            view = await sync_to_async(read_deployment, thread_sensitive=False)(name)
            if view != last:
                apply_view(pool, view)
                logger.info(
                    "deployment %s: prefill %s, decode %s, policy %s", name, view.prefill, view.decode, view.policy
                )
                last = view
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001  a database hiccup must not stop the router
            logger.exception("reading deployment %s failed; keeping the current workers", name)
        await asyncio.sleep(interval_s)
