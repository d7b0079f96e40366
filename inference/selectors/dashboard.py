"""The admin home's reads: every deployment with its replicas per role, health, current load and SLO state,
the nodes at a glance and the most recent scale events.

Current load is the newest role-level MetricSample (written by the metrics collector every few seconds) when it
is younger than FRESH_FOR; an older one is shown as stale rather than as the present. SLO state is each SLO
rule's own latest reading (inference.selectors.rules.state), the number the rule fires on.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.utils import timezone

from inference.models import (
    SLO_ROLES,
    Deployment,
    DeploymentStatus,
    MetricSample,
    ScaleEvent,
    ScalingRule,
    Worker,
    WorkerStatus,
)
from inference.selectors import rules as rule_selectors
from inference.selectors import schedules
from nodes.models import Node, NodeStatus

# A role sample older than this is not "current load" any more (the collector samples every few seconds).
FRESH_FOR = timedelta(minutes=2)
RECENT_EVENTS = 10


@dataclass
class RoleState:
    """One role of a deployment: desired count and bounds, its workers by state, and its newest sample."""

    role: str
    desired: int
    low: int
    high: int
    running: int = 0
    starting: int = 0  # pending or starting
    unhealthy: int = 0
    held_by: str = ""  # the override or schedule rule holding the count now, in words
    sample: MetricSample | None = None
    sample_stale: bool = False

    @property
    def health(self) -> str:
        """"ok" (every desired worker runs), "degraded" (some run) or "down" (none run)."""
        if self.running >= self.desired and not self.unhealthy:
            return "ok"
        return "degraded" if self.running else "down"


@dataclass
class SloState:
    """An SLO rule against its latest reading."""

    rule: ScalingRule
    signal: str  # "TTFT p90", "ITL p90"
    target: str
    latest: str
    state: str


@dataclass
class DeploymentState:
    """What the admin home shows of one deployment."""

    deployment: Deployment
    roles: list[RoleState]
    slos: list[SloState] = field(default_factory=list)

    @property
    def health(self) -> str:
        """"stopped", else the worst of its roles' health."""
        if self.deployment.status == DeploymentStatus.STOPPED:
            return "stopped"
        healths = {role.health for role in self.roles}
        for worst in ("down", "degraded"):
            if worst in healths:
                return worst
        return "ok"


def _role_states(deployment: Deployment, workers: list[Worker], now: datetime) -> list[RoleState]:
    states = []
    for role in deployment.roles_in_use():
        low, high = deployment.bounds(role)
        state = RoleState(role=role, desired=deployment.replicas(role), low=low, high=high)
        counts = Counter(w.status for w in workers if w.role == role)
        state.running = counts[WorkerStatus.RUNNING]
        state.starting = counts[WorkerStatus.PENDING] + counts[WorkerStatus.STARTING]
        state.unhealthy = counts[WorkerStatus.UNHEALTHY]
        override = schedules.active_override(deployment, role, now)
        if override is not None:
            state.held_by = f"override until {timezone.localtime(override.ends_at):%Y-%m-%d %H:%M:%S}"
        else:
            rule = schedules.schedule_rule_holding(deployment, role, now)
            if rule is not None:
                state.held_by = f"schedule “{rule.name}” {schedules.window_text(rule)}"
        state.sample = MetricSample.objects.filter(deployment=deployment, role=role).order_by("-at").first()
        state.sample_stale = state.sample is not None and now - state.sample.at > FRESH_FOR
        states.append(state)
    return states


def _slo_states(rules: list[ScalingRule], now: datetime) -> list[SloState]:
    states = []
    for rule in rules:
        if rule.kind not in SLO_ROLES:
            continue
        window = rule_selectors.readings(rule)
        latest = window[-1] if window else None
        states.append(SloState(
            rule=rule, signal=rule_selectors.SIGNALS[rule.kind], target=rule_selectors.shown(rule.kind, rule.threshold),
            latest=latest.text if latest is not None else "–", state=rule_selectors.state(rule, now),
        ))
    return states


def deployment_states(now: datetime | None = None) -> list[DeploymentState]:
    """Every deployment (by name) with its roles' state and its SLO rules' state."""
    now = now or timezone.now()
    deployments = list(Deployment.objects.select_related("model").order_by("name"))
    workers: dict[int, list[Worker]] = {}
    for worker in Worker.objects.exclude(status=WorkerStatus.STOPPED).only("deployment_id", "role", "status"):
        workers.setdefault(worker.deployment_id, []).append(worker)
    rules: dict[int, list[ScalingRule]] = {}
    for rule in ScalingRule.objects.filter(kind__in=list(SLO_ROLES)).order_by("name"):
        rules.setdefault(rule.deployment_id, []).append(rule)
    return [
        DeploymentState(
            deployment=deployment,
            roles=_role_states(deployment, workers.get(deployment.pk, []), now),
            slos=_slo_states(rules.get(deployment.pk, []), now),
        )
        for deployment in deployments
    ]


def node_counts() -> dict[str, int]:
    """How many nodes are in each status (online, draining, unreachable, offline), all statuses present."""
    counts = Counter(Node.objects.values_list("status", flat=True))
    return {status: counts.get(status, 0) for status in NodeStatus.values}


def recent_events(limit: int = RECENT_EVENTS) -> list[ScaleEvent]:
    """The newest scale events of every deployment."""
    return list(ScaleEvent.objects.select_related("deployment", "rule").order_by("-created_at", "-id")[:limit])
