"""The router of this process: one WorkerPool, Admission queue, metrics and client, from settings.

Built lazily on first use, so importing the consumers never touches the network; the health-check
thread starts on first use inside the running event loop (a gunicorn/uvicorn worker has one loop;
when a new loop shows up, as in tests, the pool moves its HTTP session to it). Settings are read
once, here.

Readiness: until the pool has a health answer from a prefill and a decode worker, the router knows
neither the models nor the slots it serves, so a generation request waits for those answers, at
most as long as the first health round can take (`ready_wait_s`), and then gets 503 with
Retry-After: never a completion under a model name nobody serves.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from inference.gateway.follow import follow, load_now
from inference.router import Admission, DisaggregatedClient, RouterError, RouterMetrics, WorkerPool

# How often a request waiting for the first health answers looks again (only before the router is ready).
_READY_POLL_S = 0.02


@dataclass
class RouterService:
    """The process-wide router state."""

    pool: WorkerPool
    client: DisaggregatedClient
    metrics: RouterMetrics
    started_at: float = field(default_factory=time.time)
    model_aliases: dict[str, str] = field(default_factory=dict)
    deployment: str | None = None
    follow_task: asyncio.Task[None] | None = None

    def start_following(self, interval_s: float) -> None:
        """In managed mode, start (or move to the running loop) the task following the deployment."""
        if self.deployment is None:
            return
        loop = asyncio.get_running_loop()
        task = self.follow_task
        if task is not None and not task.done() and task.get_loop() is loop:
            return
        if task is not None and not task.done():
            task.get_loop().call_soon_threadsafe(task.cancel)
        self.follow_task = loop.create_task(follow(self.pool, self.deployment, interval_s), name="router-follow")

    def count(self, endpoint: str, outcome: str) -> None:
        """Count one finished request of `endpoint` (generate, completion, chat) by outcome."""
        self.metrics.requests.labels(endpoint, outcome).inc()

    def served_models(self) -> set[str]:
        """Model names the workers reported in their last health answers (no network)."""
        names = set()
        for endpoint in self.pool.all_endpoints():
            model = (endpoint.last_health or {}).get("model")
            if isinstance(model, str) and model:
                names.add(model)
        return names

    def ready_wait_s(self) -> float:
        """How long a generation request waits for the first health answers: one health check's
        longest time (connect + answer), the most the first round can take."""
        return max(1.0, self.pool.connect_timeout_s + self.pool.health_timeout_s)

    async def ready_for_generation(self) -> None:
        """Return once a prefill and a decode worker have answered a health check (models and slots
        known), waiting at most `ready_wait_s`; RouterError 503 when they have not by then.

        Bounded: the health-check thread's first round ends within the same time. Without that thread
        (health checks off) this request checks the workers itself, once.
        """
        pool = self.pool
        if not pool.unknown_roles():
            return
        deadline = time.monotonic() + self.ready_wait_s()
        if not pool.health_checks_running:
            await asyncio.wait_for(pool.check_all(), timeout=self.ready_wait_s())
        while unknown := pool.unknown_roles():  # bounded by the deadline
            if time.monotonic() >= deadline:
                raise RouterError(
                    503,
                    f"router not ready: no {' or '.join(unknown)} worker has answered a health check yet "
                    f"(waited {self.ready_wait_s():g}s; {self._unanswered(unknown)}); retry later",
                )
            await asyncio.sleep(_READY_POLL_S)

    def _unanswered(self, roles: list[str]) -> str:
        """Each endpoint of `roles` with its last error, so the operator sees which workers are missing."""
        return "; ".join(
            f"{role} {e.url}: {e.last_error or 'no answer yet'}" for role in roles for e in self.pool.endpoints(role)
        )

    def check_model(self, requested: str | None) -> None:
        """RouterError 404 (OpenAI's `model_not_found`) unless `requested` is served or an alias of it.

        No name, or workers that answered but report no model (older versions): accepted (nothing to
        check against). Call after `ready_for_generation`, which waits for the answers.
        """
        if not requested:
            return
        served = self.served_models()
        if not served or self.model_aliases.get(requested, requested) in served:
            return
        known = sorted(served | {a for a, s in self.model_aliases.items() if s in served})
        raise RouterError(404, f"The model `{requested}` does not exist; this router serves {', '.join(known)}",
                          error_type="invalid_request_error", code="model_not_found", param="model")

    def model_hint(self) -> str | None:
        """A model name from the workers' last health answers (no network), if any reported one."""
        for endpoint in self.pool.endpoints("decode") + self.pool.endpoints("prefill"):
            model = (endpoint.last_health or {}).get("model")
            if isinstance(model, str) and model:
                return model
        return None

    def status(self) -> dict[str, Any]:
        """The pool's status plus this process's settings, for /router/status."""
        client = self.client
        return {
            **self.pool.status(),
            "deployment": self.deployment,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started_at, 3),
            "inflight": client.inflight,
            "max_inflight": client.max_inflight,
            "max_migrations": client.max_migrations,
            "admission": {
                "decode_slots": client.admission.capacity(),
                "queued": client.admission.queued,
                "max_queue": client.admission.max_queue,
                "queue_timeout_s": client.admission.queue_timeout_s,
                "rejected": client.admission.rejected,
            },
            "timeouts_s": {
                "request": client.request_timeout_s,
                "connect": client.connect_timeout_s,
                "descriptor": client.descriptor_timeout_s,
                "stall": client.stall_timeout_s,
                "abort": client.abort_timeout_s,
            },
        }


_lock = threading.Lock()
_service: RouterService | None = None


def build_service() -> RouterService:
    """A new RouterService from the ROUTER_* settings; ValueError on a bad endpoint or policy."""
    secret = getattr(settings, "PLATFORM_SHARED_SECRET", "") or ""
    connect_timeout = float(settings.ROUTER_CONNECT_TIMEOUT_S)
    pool = WorkerPool(
        settings.ROUTER_PREFILL_ENDPOINTS,
        settings.ROUTER_DECODE_ENDPOINTS,
        settings.ROUTER_POLICY,
        health_interval_s=float(settings.ROUTER_HEALTH_INTERVAL_S),
        health_timeout_s=max(1.0, connect_timeout),
        connect_timeout_s=connect_timeout,
        # The workers' internal endpoints (inference/server/app.py) check this header.
        headers={"X-Platform-Secret": secret} if secret else None,
        kv_token_weight=float(settings.ROUTER_KV_TOKEN_WEIGHT),
        kv_load_weight=float(settings.ROUTER_KV_LOAD_WEIGHT),
        kv_remote_decode_share=float(settings.ROUTER_KV_REMOTE_DECODE_SHARE),
    )
    admission = Admission(
        pool,
        queue_timeout_s=float(settings.ROUTER_QUEUE_TIMEOUT_S),
        max_queue=int(settings.ROUTER_MAX_QUEUE),
    )
    metrics = RouterMetrics()
    max_inflight = int(settings.ROUTER_MAX_INFLIGHT)
    client = DisaggregatedClient(
        pool,
        admission=admission,
        metrics=metrics,
        request_timeout_s=float(settings.ROUTER_REQUEST_TIMEOUT_S),
        connect_timeout_s=connect_timeout,
        max_inflight=max_inflight or None,  # 0: bounded by the deployment's slots and the queue only
        max_migrations=int(settings.ROUTER_MAX_MIGRATIONS),
        stream_credit=int(settings.ROUTER_STREAM_CREDIT),
        local_prefill_tokens=int(settings.ROUTER_LOCAL_PREFILL_TOKENS),
    )
    deployment = getattr(settings, "ROUTER_DEPLOYMENT", None)
    if deployment:
        load_now(pool, deployment)
    return RouterService(pool=pool, client=client, metrics=metrics, deployment=deployment or None,
                         model_aliases=dict(getattr(settings, "ROUTER_MODEL_ALIASES", {})))


def get_router() -> RouterService:
    """This process's router, built on first call; starts its health checks in the running loop.

    Raises RouterError(503) when the settings name a bad endpoint URL or policy, so that every
    request says why instead of failing with a traceback.
    """
    global _service
    with _lock:
        if _service is None:
            try:
                _service = build_service()
            except ValueError as exc:
                raise RouterError(503, f"router misconfigured: {exc}") from exc
        service = _service
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return service  # called from sync code: health checks start with the first async use
    service.pool.start_health_checks()
    service.start_following(float(getattr(settings, "ROUTER_FOLLOW_INTERVAL_S", 2.0)))
    return service


def built_router() -> RouterService | None:
    """This process's router if it was built already, else None; builds nothing, starts nothing (for
    threads that only report on it, such as the acceptor's snapshots)."""
    return _service


def set_router(service: RouterService | None) -> None:
    """Replace (or with None, forget) this process's router; for tests and a future control plane."""
    global _service
    with _lock:
        _service = service
