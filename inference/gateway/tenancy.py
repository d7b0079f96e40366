"""One generation's tenant on the router: scope, limits, priority, token counting, usage and metrics.

`TenantRequest.admit` runs before the request is queued: 403 when the key may not use this router's
deployment, 429 when a limit refuses it (at once, never queued); it sets the request's priority class
and fairness label for the admission queue. `tokens` counts completion tokens as they stream (sent
to the shared counters every FLUSH_TOKENS tokens), `finish` the prompt tokens, the outcome, the usage row
and the Prometheus series per key class (not per key: the cardinality stays bounded).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter

from inference.gateway.api_keys import Tenant
from inference.gateway.quotas import Quotas, Refusal, quotas
from inference.metrics.usage import UsageRecorder, usage_recorder
from inference.router import RouterError
from inference.router.events import DoneEvent, Event, GenerateRequest, TokenEvent
from inference.router.metrics import LoopHistogram

if TYPE_CHECKING:
    from inference.gateway.service import RouterService

__all__ = ["ClassMetrics", "Tenant", "TenantRequest", "class_metrics", "key_class"]

# Completion tokens are sent to the shared token counters in batches of this many (and at the end).
FLUSH_TOKENS = 32
PRIORITY_RANK = {"interactive": 0, "batch": 1}
# The router's time to refuse a request past a per-key limit (target: under 10 ms).
_REFUSAL_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)


class ClassMetrics:
    """Prometheus series per key class (`interactive`, `batch`, and `env`/`token`/`open` callers)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("router_key_class_requests", "Generation requests by key class and outcome",
                                ["key_class", "outcome"], registry=registry)
        self.tokens = Counter("router_key_class_tokens", "Prompt and completion tokens by key class",
                              ["key_class", "kind"], registry=registry)
        self.limited = Counter("router_key_class_limited", "Requests refused by a per-key limit (429)",
                               ["key_class", "limit"], registry=registry)
        self.refusal = LoopHistogram("router_key_limit_refusal_seconds",
                                     "Router time from a request's arrival to its refusal by a per-key limit",
                                     _REFUSAL_BUCKETS, registry)


_metrics: dict[int, ClassMetrics] = {}


def class_metrics(registry: CollectorRegistry) -> ClassMetrics:
    """The series of `registry` (one router's), registered on first use."""
    found = _metrics.get(id(registry))
    if found is None:
        found = _metrics[id(registry)] = ClassMetrics(registry)
    return found


def key_class(tenant: Tenant) -> str:
    """The metric label of a tenant: its priority class for database keys, else what kind of caller."""
    return tenant.priority if tenant.key_id is not None else tenant.label


class TenantRequest:
    """The tenant side of one generation."""

    def __init__(self, tenant: Tenant, *, deployment: str | None, quotas: Quotas, usage: UsageRecorder,
                 metrics: ClassMetrics, arrived: float | None = None) -> None:
        self.tenant = tenant
        self.arrived = time.monotonic() if arrived is None else arrived
        self.deployment = deployment or ""
        self.quotas = quotas
        self.usage_recorder = usage
        self.metrics = metrics
        self.user: str | None = None
        self.label = key_class(tenant)
        self.admitted = False
        self._unsent_tokens = 0
        self.completion_tokens = 0
        # Set by the consumer as the request ends: how (ok, client_error, rejected, failed, aborted) and
        # the done event's usage.
        self.outcome = "client_error"
        self.usage: dict[str, Any] | None = None

    @classmethod
    def for_service(cls, tenant: Tenant, service: RouterService, arrived: float | None = None) -> TenantRequest:
        """The tenant side of a request to `service` (this process's quotas, usage and series) that
        arrived at monotonic time `arrived`."""
        return cls(tenant, deployment=service.deployment, quotas=quotas(), usage=usage_recorder(),
                   metrics=class_metrics(service.metrics.registry), arrived=arrived)

    async def admit(self, request: GenerateRequest, body: Any = None) -> None:
        """Check scope and limits (RouterError 403/429) and give `request` its class and fairness key;
        the OpenAI `user` of `body` is recorded with the usage."""
        tenant = self.tenant
        user = body.get("user") if isinstance(body, dict) else None
        self.user = user if isinstance(user, str) and user else None
        if not tenant.may_use(self.deployment or None):
            raise RouterError(403, f"API key {tenant.label}… may not use deployment "
                                   f"{self.deployment or '(static router)'}", error_type="permission_error")
        refusal = await self.quotas.admit(tenant)
        if refusal is not None:
            raise self.refuse(refusal)
        self.admitted = True
        request.tenant = tenant.label
        request.priority = PRIORITY_RANK.get(tenant.priority, 0)

    def refuse(self, refusal: Refusal) -> RouterError:
        """Count a refusal by a per-key limit (series, refusal time, usage); the 429 that answers it."""
        self.outcome = "rejected"
        self.metrics.limited.labels(self.label, refusal.limit).inc()
        self.metrics.refusal.observe(time.monotonic() - self.arrived)
        self.record(rejected=1)
        error = RouterError(429, refusal.message(self.tenant), code=refusal.limit)
        error.retry_after_s = refusal.retry_after_s  # type: ignore[attr-defined]
        return error

    async def watch(self, event: Event) -> None:
        """An event on its way to the client: tokens are counted, the done event's usage kept."""
        if isinstance(event, TokenEvent):
            await self.tokens(len(event.token_ids))
        elif isinstance(event, DoneEvent):
            self.usage = event.usage

    async def tokens(self, count: int) -> None:
        """`count` completion tokens were streamed to the client."""
        self.completion_tokens += count
        self._unsent_tokens += count
        if self._unsent_tokens >= FLUSH_TOKENS:
            sent, self._unsent_tokens = self._unsent_tokens, 0
            await self.quotas.add_tokens(self.tenant, sent)

    async def finish(self) -> None:
        """The request ended (`outcome`, `usage`): count its tokens, free its concurrency, record it."""
        outcome, usage = self.outcome, self.usage
        prompt = int((usage or {}).get("prompt_tokens", 0) or 0)
        completion = int((usage or {}).get("completion_tokens", self.completion_tokens) or 0)
        self.metrics.requests.labels(self.label, outcome).inc()
        if prompt:
            self.metrics.tokens.labels(self.label, "prompt").inc(prompt)
        if completion:
            self.metrics.tokens.labels(self.label, "completion").inc(completion)
        if not self.admitted:
            return
        unsent = prompt + max(0, completion - self.completion_tokens) + self._unsent_tokens
        self._unsent_tokens = 0
        await self.quotas.finish(self.tenant, unsent)  # one round trip: last tokens, concurrency freed
        self.record(requests=1, prompt_tokens=prompt, completion_tokens=completion,
                    errors=int(outcome == "failed"), rejected=int(outcome == "rejected"))

    def record(self, **counts: int) -> None:
        """Add to the key's usage row of this minute (database keys only)."""
        if self.tenant.key_id is not None:
            self.usage_recorder.add(self.tenant.key_id, self.deployment, time.time(), user=self.user, **counts)
