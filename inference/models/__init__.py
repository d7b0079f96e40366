"""The inference app's models, one module per concept; every model is re-exported here.

Django loads an app's models from `<app>.models`, and callers import them from this one place:
- deployments: the models served (`Model`), their `Deployment`s and the `RouterEndpoint`s serving them;
- workers: `Worker` (a prefill or decode process on a node), its role and status;
- scaling: `ScalingRule`, `ScaleEvent` (every replica change, with its source), `ScaleOverride`;
- samples: `MetricSample` (per role), `WorkerSample`, `RouterSample`;
- api_key: generation `ApiKey`s (limits, `PriorityClass`) and their per-minute `ApiKeyUsage`.
Tables and migrations are those of the single module this package replaced (app label `inference`).
"""
from __future__ import annotations

from inference.models.api_key import ApiKey, ApiKeyUsage, PriorityClass
from inference.models.deployments import (
    Deployment,
    DeploymentStatus,
    KVTransport,
    Model,
    ModelSource,
    RouterEndpoint,
    RouterPolicy,
)
from inference.models.samples import MetricSample, RouterSample, WorkerSample
from inference.models.scaling import (
    SLO_ROLES,
    Comparison,
    RuleKind,
    ScaleEvent,
    ScaleOverride,
    ScaleSource,
    ScalingRule,
)
from inference.models.workers import (
    ACTIVE_WORKER_STATUSES,
    ROLES,
    FailureCause,
    Worker,
    WorkerRole,
    WorkerStatus,
    validate_role,
)

__all__ = [
    "ACTIVE_WORKER_STATUSES",
    "ROLES",
    "ApiKey",
    "ApiKeyUsage",
    "SLO_ROLES",
    "Comparison",
    "Deployment",
    "DeploymentStatus",
    "KVTransport",
    "FailureCause",
    "MetricSample",
    "Model",
    "ModelSource",
    "PriorityClass",
    "RouterEndpoint",
    "RouterPolicy",
    "RouterSample",
    "RuleKind",
    "ScaleEvent",
    "ScaleOverride",
    "ScaleSource",
    "ScalingRule",
    "Worker",
    "WorkerRole",
    "WorkerSample",
    "WorkerStatus",
    "validate_role",
]
