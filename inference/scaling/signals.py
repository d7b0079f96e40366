"""The numbers scaling rules compare: a role's load and its p90 latencies, from the workers' /health.

Every reading uses the RUNNING workers of the deployment and role whose last health report
(`Worker.last_health`, written by their agent every few seconds and by `collect_metrics`) is younger
than SCALING_HEALTH_MAX_AGE_S; None (no reading) when there is none.

Decode load (per worker): `(running + queue_depth) / batch_size`: the share of the continuous batch in
demand (1.0: every slot taken; requests queued beyond a full batch also read 1.0, LOAD_CAP, so one
worker with a long queue cannot outweigh the others). Decode sequences live for the whole generation,
so this instantaneous number is steady under load.

Prefill load (per worker): prompts spend tens of milliseconds in the engine, so the batch fill is 0 in
nearly every 5 s sample even under overload. The prefill worker therefore reports windowed readings
(inference.server.load), and its load is the largest of
- the batch fill, as for decode;
- `busy_ratio`: the share of the worker's last 10 s its engine had a prompt in flight (its utilisation);
- the queueing wait `prompt_tokens_pending / prefill_tokens_per_s` (prompt tokens queued and being
  prefilled, against the tokens/s the worker sustains while busy) over SCALING_PREFILL_WAIT_TARGET_S:
  the time to first token a new prompt would spend waiting for this worker;
capped at LOAD_CAP. A role's load is the mean over its workers.

Latency p90 (`role_latency_p90`): TTFT and ITL as the decode workers measure them (a decode worker's
TTFT runs from receipt to the first token streamed, so it covers prefill queueing and compute and the
KV transfer, which is what the client waits for beyond the router): the workers' p90 over their last
30 s, averaged weighted by how many requests (TTFT) or tokens (ITL) each observed.
"""
from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from inference.models import Deployment, Worker, WorkerStatus

LOAD_CAP = 1.0


def _number(health: Mapping[str, Any], key: str) -> float | None:
    """health[key] as a float; None when absent, null or not a number."""
    value = health.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def worker_load(health: Mapping[str, Any], batch_size: int, role: str = "decode") -> float | None:
    """One worker's load from its /health answer (module docstring); None when it reports no numbers."""
    try:
        demand = float(health.get("running", 0) or 0) + float(health.get("queue_depth", 0) or 0)
    except (TypeError, ValueError):
        return None
    size = int(_number(health, "batch_size") or batch_size)
    terms = [demand / max(1, size)]
    if role == "prefill":
        busy = _number(health, "busy_ratio")
        if busy is not None:
            terms.append(busy)
        pending, rate = _number(health, "prompt_tokens_pending"), _number(health, "prefill_tokens_per_s")
        if pending and rate and rate > 0:
            target = max(1e-3, float(settings.SCALING_PREFILL_WAIT_TARGET_S))
            terms.append(pending / rate / target)
    return min(LOAD_CAP, max(0.0, max(terms)))


def fresh_healths(deployment: Deployment, role: str, now: datetime) -> list[dict[str, Any]]:
    """Last health answers of the role's RUNNING workers seen within SCALING_HEALTH_MAX_AGE_S."""
    fresh_after = now - timedelta(seconds=float(settings.SCALING_HEALTH_MAX_AGE_S))
    healths = Worker.objects.filter(
        deployment=deployment, role=role, status=WorkerStatus.RUNNING, last_seen__gte=fresh_after
    ).values_list("last_health", flat=True)
    return [h for h in healths if isinstance(h, dict)]


def role_load(deployment: Deployment, role: str, *, now: datetime | None = None) -> float | None:
    """Mean load of the role's RUNNING workers with a recent health report; None when there is none."""
    now = now or timezone.now()
    loads = [
        x for x in (worker_load(h, deployment.batch_size, role) for h in fresh_healths(deployment, role, now))
        if x is not None
    ]
    if not loads:
        return None
    return sum(loads) / len(loads)


def role_latency_p90(deployment: Deployment, kind: str, *, now: datetime | None = None) -> float | None:
    """p90 of "ttft" or "itl" in seconds over the decode workers' recent requests; None without samples."""
    now = now or timezone.now()
    total = weight = 0.0
    for health in fresh_healths(deployment, "decode", now):
        p90, samples = _number(health, f"{kind}_p90_s"), _number(health, f"{kind}_samples")
        if p90 is None or not samples:
            continue
        total += p90 * samples
        weight += samples
    return total / weight if weight else None
